"""The surgeon's machinery: the rule registry, source verification, in-place class switches and the fusion
preconditions. Rule modules (``gn_patch.rules.*``) build on it; ``gn_patch.surgeon`` walks a model with it.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import sys
import types
from collections import Counter
from collections.abc import Callable

import diffusers
import torch
from accelerate.hooks import AlignDevicesHook, SequentialHook
from torch import nn
from torch.nn.modules import module as torch_module

from ..modules import GroupNormAct
from ..ops import canonical_activation, check_eps, check_num_groups
from ..report import PatchReport, join_name


# ------------------------------------------------------------------------------------------------
# Registry: module class -> handler
# ------------------------------------------------------------------------------------------------
# handler(surgery, qualified name, module): fuses what it can of the module, notes every GroupNorm it decides on.
Rule = Callable[["Surgery", str, nn.Module], None]

RULES: dict[type, Rule] = {}


def rule(*classes: type) -> Callable[[Rule], Rule]:
    """Register the decorated handler for modules of exactly these classes (a subclass may have another forward,
    so it is not matched)."""

    def register(handler: Rule) -> Rule:
        for cls in classes:
            RULES[cls] = handler
        return handler

    return register


# ------------------------------------------------------------------------------------------------
# The code the fused forwards were written against
# ------------------------------------------------------------------------------------------------
def source_digest(function: Callable) -> str | None:
    """Digest of a function's source, blank and comment-only lines dropped; None when the source is unavailable."""
    try:
        lines = inspect.getsource(function).splitlines()
    except (OSError, TypeError):
        return None
    kept = [line.rstrip() for line in lines if line.strip() and not line.strip().startswith("#")]
    return hashlib.sha256("\n".join(kept).encode()).hexdigest()[:16]


# diffusers function a rule relies on -> digests of the versions read and mirrored (diffusers 0.42.1).
# A rule whose function has another digest skips: add a digest only after checking the new code.
VERIFIED_SOURCES: dict[Callable, set[str]] = {}

VERSION_SKIP = "is not the code the surgeon was checked against (diffusers 0.42.1)"


def verified(function: Callable, *digests: str) -> None:
    """Record that a rule mirrors ``function`` as it reads with one of ``digests``."""
    VERIFIED_SOURCES.setdefault(function, set()).update(digests)


@functools.cache
def unverified(function: Callable) -> str | None:
    """Why ``function`` cannot be relied on (not the code the surgeon was checked against), None when it can."""
    if source_digest(function) in VERIFIED_SOURCES[function]:
        return None
    return f"{function.__qualname__} of the installed diffusers {diffusers.__version__} {VERSION_SKIP}"


# ------------------------------------------------------------------------------------------------
# In-place class switches, hook-aware
# ------------------------------------------------------------------------------------------------
# patched class -> original class, for unpatch_model.
ORIGINAL_CLASS: dict[type, type] = {}
# patched class -> instance attributes the patch added (unpatch_model deletes them).
ADDED_STATE: dict[type, tuple[str, ...]] = {}


def stands_in_for(original: type, added_state: tuple[str, ...] = ()) -> Callable[[type], type]:
    """Register the decorated class as the patched form of ``original``, which unpatch_model switches back to
    (deleting the instance attributes named in ``added_state``).

    Code that picks modules by class name (accelerate's no_split_module_classes with diffusers' _no_split_modules,
    regional compilation's _repeated_blocks) must see a patched module as the original class, so the patched class
    takes the original's ``__name__``. Pickling goes by ``__qualname__``, which stays the patched class's own.
    """

    def register(cls: type) -> type:
        cls.__name__ = original.__name__
        ORIGINAL_CLASS[cls] = original
        ADDED_STATE[cls] = added_state
        return cls

    return register


# ------------------------------------------------------------------------------------------------
# PyTorch's wrapper classes: dynamic subclasses a wrapper gives a module in place, after patch_model
# ------------------------------------------------------------------------------------------------
# (module, mixin class, cache attribute) of the wrappers that make one subclass per class and keep it in a cache
# (wrapped class -> wrapper class): FSDP2's fully_shard (``FSDP<Class>``, bases (FSDPModule, Class)) and replicate.
_CACHED_WRAPPERS = (("torch.distributed.fsdp._fully_shard._fully_shard", "FSDPModule", "cls_to_fsdp_cls"),
                    ("torch.distributed._composable.replicate_with_fsdp", "ReplicateModule", "cls_to_replicate_cls"))


def _wrapper_caches() -> dict[type, dict[type, type]]:
    """Mixin class -> cache of the _CACHED_WRAPPERS loaded (a wrapper not imported has wrapped nothing). A torch
    that renamed them leaves its wrapper classes unknown: unpatch_model then refuses them rather than guess."""
    caches = {}
    for module_name, mixin, cache in _CACHED_WRAPPERS:
        module = sys.modules.get(module_name)
        if module is not None and isinstance(getattr(module, cache, None), dict) and hasattr(module, mixin):
            caches[getattr(module, mixin)] = getattr(module, cache)
    return caches


def _is_parametrized_class(cls: type) -> bool:
    """``cls`` is the ``Parametrized<Class>`` subclass torch.nn.utils.parametrize gives a module (one per module;
    removing the last parametrization switches back to its only base)."""
    getstate = vars(cls).get("__getstate__")
    return (len(cls.__bases__) == 1 and cls.__name__ == f"Parametrized{cls.__bases__[0].__name__}"
            and getattr(getstate, "__module__", None) == "torch.nn.utils.parametrize")


def wrapped_class(cls: type) -> type | None:
    """The class that ``cls``, a wrapper class of FSDP2 (fully_shard, replicate) or of parametrize, wraps (its
    last base); None when ``cls`` is no such wrapper class."""
    *mixins, inner = cls.__bases__
    if len(mixins) == 1 and _wrapper_caches().get(mixins[0], {}).get(inner) is cls:
        return inner
    return inner if _is_parametrized_class(cls) else None


def patched_class(cls: type) -> type | None:
    """The patched class (see stands_in_for) ``cls`` is, or wraps through the wrapper classes of
    :func:`wrapped_class`; None when it is neither."""
    while cls not in ORIGINAL_CLASS:
        cls = wrapped_class(cls)
        if cls is None:
            return None
    return cls


def rewrapped(cls: type, core: type) -> type:
    """``cls``, a patched class or a wrapper class of one (:func:`patched_class` is not None), with that patched
    class replaced by ``core``: the class the same wrappers give a ``core`` instance (FSDP2's own class for ``core``
    where it has one)."""
    if cls in ORIGINAL_CLASS:
        return core
    inner = wrapped_class(cls)
    new_inner = rewrapped(inner, core)
    cache = _wrapper_caches().get(cls.__bases__[0]) if len(cls.__bases__) == 2 else None
    if cache is not None and new_inner in cache:
        return cache[new_inner]
    namespace = {key: value for key, value in vars(cls).items() if key not in ("__dict__", "__weakref__")}
    name = cls.__name__.removesuffix(inner.__name__) + new_inner.__name__
    new = type(name, (*cls.__bases__[:-1], new_inner), namespace)
    if cache is not None:
        cache[new_inner] = new
    return new


def restore(module: nn.Module) -> None:
    """Switch a patched module back to its original class (see stands_in_for), under the wrapper classes FSDP2
    or parametrize gave it after patching (they then wrap the original class, as they would have without gn_patch)."""
    patched = patched_class(type(module))
    set_class(module, rewrapped(type(module), ORIGINAL_CLASS[patched]))
    for attr in ADDED_STATE[patched]:
        module.__dict__.pop(attr, None)


def is_bound_class_forward(function, module: nn.Module) -> bool:
    return (isinstance(function, types.MethodType) and function.__self__ is module
            and function.__func__ is type(module).forward)


def forward_override_problem(module: nn.Module) -> str | None:
    """Why an instance-level forward keeps ``module`` from switching class; None when it can switch.

    Allowed: none; accelerate's hook wrapper (it calls ``module._old_forward``, the class forward bound to the
    module, which the switch rebinds); the bound class forward that accelerate's remove_hook_from_module leaves.
    """
    own = module.__dict__.get("forward")
    if own is None or is_bound_class_forward(own, module):
        return None
    if "_hf_hook" in module.__dict__ and is_bound_class_forward(module.__dict__.get("_old_forward"), module):
        return None
    return "its forward is replaced on the instance by a wrapper the surgeon does not know (hooks?)"


def set_class(module: nn.Module, cls: type) -> None:
    """Switch ``module``'s class in place; instance-level bound class forwards (see above) follow the switch."""
    bound = [name for name in ("forward", "_old_forward") if is_bound_class_forward(module.__dict__.get(name), module)]
    module.__class__ = cls
    for name in bound:
        setattr(module, name, types.MethodType(cls.forward, module))


class FusedGroupNorm(GroupNormAct):
    """An nn.GroupNorm turned into a GroupNormAct in place by patch_model (unpatch_model turns it back)."""


FusedGroupNorm.__name__ = GroupNormAct.__name__  # to the user it is a GroupNormAct
ORIGINAL_CLASS[FusedGroupNorm] = nn.GroupNorm
ADDED_STATE[FusedGroupNorm] = ("activation",)


class StockLayoutGroupNorm(FusedGroupNorm):
    """The GroupNorm swap for a GroupNorm whose consumer the surgeon does not know: the identity GroupNormAct, its
    CUDA output given the layout PyTorch's CUDA GroupNorm returns (contiguous), so that whatever reads it (a
    ``.view`` included) sees what it saw before. Elsewhere (CPU, ...) GroupNormAct already returns PyTorch's result.
    ``frames_last=True``, a layout asked for, is GroupNormAct's.
    """

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None, shift: torch.Tensor | None = None,
                input_offset: torch.Tensor | None = None, input_bias: torch.Tensor | None = None,
                frames_last: bool = False) -> torch.Tensor:
        y = super().forward(x, scale, shift, input_offset, input_bias, frames_last)
        return y.contiguous() if y.is_cuda and not frames_last else y


StockLayoutGroupNorm.__name__ = GroupNormAct.__name__
ORIGINAL_CLASS[StockLayoutGroupNorm] = nn.GroupNorm
ADDED_STATE[StockLayoutGroupNorm] = ("activation",)


class FusedActivation(nn.Identity):
    """Stands in for an activation module whose work the preceding GroupNormAct now does.

    Keeps the original (outside the module tree: activations hold no parameters or buffers) for unpatch_model.
    """

    def __init__(self, original: nn.Module) -> None:
        super().__init__()
        self.__dict__["original"] = original  # a plain attribute, not a submodule: module names stay the same
        self.train(original.training)  # the model's mode, which unpatch_model gives the original back

    def extra_repr(self) -> str:
        return f"fused into the preceding GroupNormAct: {self.original}"


def fuse_norm(norm: nn.GroupNorm, activation: str, cls: type = FusedGroupNorm) -> None:
    """Make ``norm`` a GroupNormAct (``cls``) in place. GroupNormAct's only state beyond nn.GroupNorm's is
    ``activation``; eps becomes the Python float its calls take (a tensor eps, as nn.GroupNorm keeps it), through
    GroupNormAct's checking ``__setattr__`` (settings_problem has vetted it)."""
    set_class(norm, cls)
    norm.eps = norm.eps
    norm.activation = canonical_activation(activation)


def settings_problem(norm: nn.GroupNorm) -> str | None:
    """Why ``norm``'s num_groups or eps are not what GroupNormAct takes (nn.GroupNorm accepts a negative eps, or a
    bool; the switched class would raise at its next call), or why GroupNormAct's own state cannot be set on it (an
    eps registered as a buffer or parameter, which takes no float; a submodule, tensor or attribute named
    ``activation``, which fuse_norm would overwrite and unpatch_model delete): the GroupNorm then stays as it is.
    None when they are."""
    for name in ("eps", "activation"):
        for registry in ("_parameters", "_buffers", "_modules"):
            if name in norm.__dict__.get(registry, {}):
                return f"GroupNormAct cannot take this GroupNorm's {name}: it is one of its {registry[1:]}"
    if "activation" in norm.__dict__:
        return "GroupNormAct cannot take this GroupNorm: it has an attribute named activation, which is GroupNormAct's"
    try:
        check_num_groups(norm.num_groups)
        check_eps(norm.eps)
    except (TypeError, ValueError) as error:
        return f"GroupNormAct does not take its settings: {error}"
    return None


# ------------------------------------------------------------------------------------------------
# Fusion preconditions
# ------------------------------------------------------------------------------------------------
_ACTIVATION_MODULES = {nn.SiLU: "silu", nn.ReLU: "relu", nn.Mish: "mish"}


def activation_name(module) -> str | None:
    """gn_patch's name for an activation module computed exactly by GroupNormAct; None for any other module."""
    kind = type(module)
    if kind is nn.GELU:
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(module.approximate)
    return _ACTIVATION_MODULES.get(kind)


def global_output_hooks() -> bool:
    """Hooks registered for every module (torch.nn.modules.module.register_module_forward_hook, ..._full_backward_hook
    and ..._full_backward_pre_hook) that see each module's output or its gradient."""
    return bool(torch_module._global_forward_hooks or torch_module._global_backward_hooks
                or torch_module._global_backward_pre_hooks)


def global_hooks() -> bool:
    """Hooks registered for every module, on its output or its input (global_output_hooks, and the forward pre-hooks
    of register_module_forward_pre_hook)."""
    return global_output_hooks() or bool(torch_module._global_forward_pre_hooks)


def has_output_hooks(module: nn.Module) -> bool:
    """Hooks of the module's own that see its output or its gradient."""
    return bool(module._forward_hooks or module._backward_hooks or module._backward_pre_hooks)


def output_seen(module: nn.Module) -> bool:
    """Hooks, the module's own or global ones, see ``module``'s output or its gradient: fusing what follows into it
    would show them another output."""
    return has_output_hooks(module) or global_output_hooks()


def has_hooks(module: nn.Module) -> bool:
    """Hooks of the module's own, on its output or its input."""
    return has_output_hooks(module) or bool(module._forward_pre_hooks)


def runs_forward_only(module: nn.Module) -> bool:
    """Calling ``module`` would run its class's forward and nothing else (torch.nn.Module._call_impl's fast path):
    no hooks of its own or global ones, no forward set on the instance but the bound class forward that
    accelerate's remove_hook_from_module leaves, not compiled by ``module.compile()``."""
    own = module.__dict__.get("forward")
    return not (has_hooks(module) or (own is not None and not is_bound_class_forward(own, module))
                or module._compiled_call_impl is not None or global_hooks())


def accelerate_hooks(module: nn.Module) -> tuple:
    """The accelerate hooks attached to ``module`` (its ``_hf_hook``, a SequentialHook's parts), none if it has
    none."""
    def parts(hook) -> tuple:
        return tuple(p for h in hook.hooks for p in parts(h)) if isinstance(hook, SequentialHook) else (hook,)

    hook = module.__dict__.get("_hf_hook")
    return () if hook is None else parts(hook)


def only_moves_tensors(module: nn.Module) -> bool:
    """``module``'s accelerate hooks (if any) move weights and tensors between devices without changing values."""
    return all(isinstance(hook, AlignDevicesHook) for hook in accelerate_hooks(module))


class Surgery:
    """One patch_model walk: the model's module-use counts, the decisions taken so far and the report.

    Rules decide on each GroupNorm they know once: ``fused`` (it now runs GroupNormAct, fused with what follows
    or on its own where that is all it does), ``already`` (an earlier call did it), or ``decline`` (it cannot be
    fused exactly, with the reason). The walker then runs every GroupNorm no rule fused on its own.
    """

    def __init__(self, model: nn.Module, channels_last: bool) -> None:
        self.channels_last = channels_last
        self.uses = Counter(id(m) for _, m in model.named_modules(remove_duplicate=False))
        self.report = PatchReport()
        self.decided: set[int] = set()  # ids of the GroupNorms fused, already fused or skipped
        self.declined: dict[int, str] = {}  # id of a GroupNorm a rule could not fuse -> why

    def fused(self, name: str, norm: nn.Module, kind: str) -> None:
        self.report.patched.append((name, kind))
        self.decided.add(id(norm))

    def already(self, name: str, norm: nn.Module, kind: str) -> None:
        self.report.already_patched.append((name, kind))
        self.decided.add(id(norm))

    def skip(self, name: str, module: nn.Module, reason: str) -> None:
        self.report.skipped.append((name, reason))
        self.decided.add(id(module))

    def decline(self, name: str, norm: nn.Module, reason: str) -> None:
        self.declined.setdefault(id(norm), reason)

    def norm_problem(self, norm: nn.Module) -> str | None:
        """Why ``norm`` cannot become a GroupNormAct fused with what follows it; None when it can."""
        if type(norm) is not nn.GroupNorm:
            return f"{type(norm).__name__} is not a plain torch.nn.GroupNorm"
        if self.uses[id(norm)] > 1:
            return "the GroupNorm is registered in several places, not all followed by the activation"
        if output_seen(norm):
            return ("forward/backward hooks on the GroupNorm (its own, or global ones: register_module_forward_hook) "
                    "would see the activated output")
        if not only_moves_tensors(norm):
            return f"accelerate hook {type(norm._hf_hook).__name__} on the GroupNorm may change its output"
        return forward_override_problem(norm) or settings_problem(norm)

    def activation_problem(self, activation) -> str | None:
        """Why the GroupNormAct cannot take over ``activation``'s work; None when it can."""
        kind = type(activation).__name__
        if activation_name(activation) is None:
            return f"the next op, {kind}, is not an activation with a fused kernel (SiLU, GELU, ReLU, Mish)"
        if (has_hooks(activation) or global_hooks() or "_hf_hook" in activation.__dict__
                or "forward" in activation.__dict__):
            return f"hooks on the activation {kind} (its own, or global ones) would no longer run"
        return None


# ------------------------------------------------------------------------------------------------
# Building blocks of rules
# ------------------------------------------------------------------------------------------------
def fuse_with_next(s: Surgery, norm_name: str, norm, activation, kind: str,
                   replace_activation: Callable[[nn.Module], None]) -> None:
    """Fuse ``norm`` with the ``activation`` module that follows it; ``replace_activation`` installs the stand-in."""
    if isinstance(norm, FusedGroupNorm) and isinstance(activation, FusedActivation):
        s.already(norm_name, norm, kind)
        return
    problem = s.norm_problem(norm) or s.activation_problem(activation)
    if problem is not None:
        s.decline(norm_name, norm, problem)
        return
    fuse_norm(norm, activation_name(activation))
    replace_activation(FusedActivation(activation))
    s.fused(norm_name, norm, kind)


def run_alone(s: Surgery, name: str, norm: nn.Module, kind: str) -> None:
    """A GroupNorm whose output feeds ops that take any layout: the identity GroupNormAct, which computes exactly
    GroupNorm and runs the NHWC kernel on channels-last CUDA input (its output then stays channels-last)."""
    if id(norm) in s.decided:
        return
    if type(norm) is FusedGroupNorm:
        s.already(name, norm, kind)
    elif s.uses[id(norm)] > 1:
        s.decline(name, norm, "the GroupNorm is registered in several places, not all known to take any layout")
    elif type(norm) is nn.GroupNorm and forward_override_problem(norm) is None:
        problem = settings_problem(norm)
        if problem is not None:
            s.decline(name, norm, problem)
            return
        fuse_norm(norm, "identity")
        s.fused(name, norm, kind)


def alone(attr: str, kind: str, mirrors: Callable | None = None) -> Rule:
    """Rule for a GroupNorm ``owner.<attr>`` used on its own (see run_alone). ``mirrors``: the owner's function
    whose code was read to see that the output may have any layout; the rule skips when it is not that code."""

    def handler(s: Surgery, name: str, owner: nn.Module) -> None:
        norm = getattr(owner, attr)
        if not isinstance(norm, nn.GroupNorm):
            return
        problem = mirrors is not None and unverified(mirrors)
        if problem:
            s.decline(join_name(name, attr), norm, problem)
        else:
            run_alone(s, join_name(name, attr), norm, kind)

    return handler
