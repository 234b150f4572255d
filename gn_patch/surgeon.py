"""Model surgeon: every GroupNorm of a model runs gn_patch's fused op, fused with what follows it where the
surgeon knows the code, in place.

``patch_model(model)`` walks any torch.nn.Module through the rule registry (:mod:`gn_patch.rules`: a handler per
module class, for the 39 diffusers model classes holding a GroupNorm and their blocks): a block's GroupNorms
become GroupNormActs that apply the activation after them, and the per-sample scale/shift before it where the
block has one; the block gets a subclass whose forward is its own diffusers code with those calls merged (or, at
the top level of a model, the activation module a stand-in). Every GroupNorm no rule fuses becomes the identity
GroupNormAct with PyTorch's output layout: always exact. Conv weights become channels-last, or (for FSDP2, which
refuses non-contiguous parameters) the model's inputs do, in a forward pre-hook at its root.

Everything is done in place and is undone by :func:`unpatch_model`: a GroupNorm becomes a GroupNormAct by switching
the instance's class (the module object, its Parameters, hooks and state_dict keys stay the same), a bypassed
activation module is swapped for an identity placeholder that keeps the original. Wrapper classes that FSDP2 or
parametrize give a patched module afterwards are rebuilt around the original class; anything unpatch_model cannot
restore exactly is refused before it changes anything. The :class:`PatchReport` lists what was fused, what runs
alone and why, and what stays as it is and why.

Each rule that relies on diffusers code checks, at patch time, that the installed diffusers has that exact code
(``gn_patch.rules.VERIFIED_SOURCES``, diffusers 0.42.1); with other code its GroupNorms run alone and the report
and a warning say so, rather than change results silently.
"""

from __future__ import annotations

import warnings
import weakref

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .modules import GroupNormAct
from .report import PatchReport, join_name
from .rules import ORIGINAL_CLASS, RULES
from .rules.base import (ADDED_STATE, VERSION_SKIP, FusedActivation, StockLayoutGroupNorm, Surgery, accelerate_hooks,
                         forward_override_problem, fuse_norm, has_hooks, patched_class, restore,
                         settings_problem, wrapped_class)

__all__ = ["PatchReport", "patch_model", "unpatch_model"]


# ------------------------------------------------------------------------------------------------
# The walk
# ------------------------------------------------------------------------------------------------
def _walk(surgery: Surgery, model: nn.Module) -> None:
    """Apply the registered rules to every module of ``model``, in module order (a block before its norms), then
    run every GroupNorm no rule fused on its own. GroupNorms an earlier call ran alone are decided again: what kept
    them from fusing then (a hook since removed) may be gone; those that run alone again count as already patched.
    """
    reopened = _reopen_alone(model)
    for name, module in model.named_modules():
        rule = RULES.get(type(module))
        if rule is not None:
            rule(surgery, name, module)
    _run_the_rest_alone(surgery, model, reopened)


def _reopen_alone(model: nn.Module) -> set[int]:
    """Switch the GroupNorms that an earlier patch_model ran alone (StockLayoutGroupNorm, nothing added but the
    identity activation) back to nn.GroupNorm for the rules; returns their ids. One whose forward was wrapped on
    the instance since stays as it is (as a GroupNorm it could not be switched again)."""
    reopened = set()
    for module in model.modules():
        if type(module) is StockLayoutGroupNorm and forward_override_problem(module) is None:
            restore(module)
            reopened.add(id(module))
    return reopened


def _run_the_rest_alone(surgery: Surgery, model: nn.Module, reopened: set[int]) -> None:
    """The always exact GroupNorm swap: every nn.GroupNorm no rule fused becomes the identity GroupNormAct whose
    output has the layout PyTorch's GroupNorm gives (report.alone, with why it is not fused; for one an earlier call
    ran alone, of ``reopened``, report.already_patched with kind "GroupNorm alone: <why>")."""
    for name, module in model.named_modules():
        if id(module) in surgery.decided:
            continue
        if not isinstance(module, nn.GroupNorm):
            if id(module) in surgery.declined:  # a norm of another class (AdaGroupNorm, ...) a rule could not fuse
                surgery.skip(name, module, surgery.declined[id(module)])
            continue
        if type(module) is StockLayoutGroupNorm:  # run alone by an earlier call, its forward wrapped since
            surgery.already(name, module, "GroupNorm alone")
        elif isinstance(module, GroupNormAct):  # the user's own GroupNormAct
            continue
        elif type(module) is not nn.GroupNorm:
            surgery.skip(name, module, f"{type(module).__name__} is not a plain torch.nn.GroupNorm (its own forward)")
        elif (problem := forward_override_problem(module) or settings_problem(module)) is not None:
            surgery.skip(name, module, problem)
        else:
            fuse_norm(module, "identity", StockLayoutGroupNorm)
            why = surgery.declined.get(id(module)) or _unknown_use(model, name)
            if id(module) in reopened:
                surgery.already(name, module, f"GroupNorm alone: {why}")
            else:
                surgery.report.alone.append((name, why))
                surgery.decided.add(id(module))


def _unknown_use(model: nn.Module, name: str) -> str:
    """Why a GroupNorm no rule covers is not fused."""
    if not name:
        return "the surgeon does not know what follows this GroupNorm"
    parent = model.get_submodule(name.rpartition(".")[0])
    if wrapped_class(type(parent)) is not None:
        return (f"{type(parent).__name__} is a wrapper class (FSDP2's fully_shard, parametrize) the rules do not "
                "match: patch_model before wrapping to fuse it")
    return f"the surgeon does not know what follows this GroupNorm in {type(parent).__name__}"


# ------------------------------------------------------------------------------------------------
# Channels-last weights
# ------------------------------------------------------------------------------------------------
# Set on a model whose conv weights patch_model converted: the qualified names of those weights, so that
# unpatch_model converts back only them (not weights the user had made channels_last).
_LAYOUT_FLAG = "_gn_patch_made_channels_last"
# Sub-layers of peft adapters (LoRA's down and up projections). Their weights stay as peft made them: they are
# small, and LoRA checkpoints are written with safetensors, which refuses non-contiguous tensors.
_ADAPTER_CONTAINERS = ("lora_A", "lora_B")


def _adapter_convs(model: nn.Module) -> set[int]:
    ids = set()
    for module in model.modules():
        for attribute in _ADAPTER_CONTAINERS:
            container = getattr(module, attribute, None)
            if isinstance(container, nn.ModuleDict):
                ids.update(id(m) for m in container.modules())
    return ids


# conv classes -> the memory format that puts their weight's input channels innermost
_CHANNELS_LAST = {nn.Conv2d: torch.channels_last, nn.ConvTranspose2d: torch.channels_last}
_CHANNELS_LAST_3D = {nn.Conv3d: torch.channels_last_3d, nn.ConvTranspose3d: torch.channels_last_3d}


def _conv_weights(model: nn.Module, formats: dict[type, torch.memory_format]):
    """(qualified name, conv, weight, memory format) of the Parameter weights of ``model``'s convs of the classes
    in ``formats`` (subclasses included), outside peft adapters; parametrized weights are not Parameters."""
    adapters = _adapter_convs(model)
    for name, module in model.named_modules():
        memory_format = next((f for cls, f in formats.items() if isinstance(module, cls)), None)
        if memory_format is None or id(module) in adapters:
            continue
        weight = getattr(module, "weight", None)
        if isinstance(weight, nn.Parameter):
            yield f"{name}.weight" if name else "weight", module, weight, memory_format


def _offloaded(module: nn.Module) -> bool:
    """An accelerate hook of ``module`` keeps the weights and loads them on every call (cpu_offload,
    enable_sequential_cpu_offload, disk offload: AlignDevicesHook with a weights_map)."""
    return any(getattr(hook, "offload", False) and getattr(hook, "weights_map", None) is not None
               for hook in accelerate_hooks(module))


# Where the conv classes whose code was read live: subclasses defined there (diffusers' causal and chunked Conv3d
# of the video VAEs, PyTorch's QAT convs) call the stock convolution on the weight as it is.
_KNOWN_CONV_PACKAGES = ("torch", "diffusers")


def _unread_conv_code(cls: type) -> type | None:
    """The first class of ``cls``'s MRO, before the torch conv class it derives from, that is defined outside torch
    and diffusers and defines its own forward or _conv_forward (through wrapper classes: parametrize's
    ``Parametrized<Class>`` is torch's, its class is not); None when there is none."""
    for base in cls.__mro__:
        if base in _CHANNELS_LAST or base in _CHANNELS_LAST_3D:
            return None
        own_forward = "forward" in vars(base) or "_conv_forward" in vars(base)
        if own_forward and base.__module__.partition(".")[0] not in _KNOWN_CONV_PACKAGES:
            return base
    return None


def _layout_kept(module: nn.Module, weight: nn.Parameter) -> str | None:
    """Why patch_model leaves the layout of ``module``'s ``weight`` as it is; None for a plain tensor the module
    owns, which it converts."""
    if nn.parameter.is_lazy(weight):
        return "not initialised yet (a lazy conv before its first call): patch after that call"
    unread = _unread_conv_code(type(module))
    if unread is not None:
        return (f"{unread.__qualname__} ({unread.__module__}) subclasses a torch conv with a forward gn_patch has not "
                "read, which may need a contiguous weight (a .view of it, as weight-standardised convs take)")
    if _offloaded(module):
        return ("offloaded by accelerate (cpu_offload, enable_sequential_cpu_offload): its hook loads its own copy "
                "of the weight on every call; patch before offloading")
    if type(weight.data) is torch.Tensor:
        return None
    if type(weight.data).__name__ == "DTensor":
        return ("a DTensor (sharded by FSDP2's fully_shard, which needs contiguous parameters): patch with "
                "channels_last='activations' for channels-last activations")
    return f"a {type(weight.data).__name__}, not a plain tensor"


def _make_conv_weights_channels_last(model: nn.Module, formats: dict[type, torch.memory_format],
                                     report: PatchReport) -> list[str]:
    """Give the conv weights of the classes in ``formats`` that memory format in place; returns the names of
    those changed, and lists in ``report.layout_kept`` those it cannot change (DTensors, quantized tensors...).
    Unlike ``model.to(memory_format=...)``, leaves all other tensors alone."""
    changed = []
    for name, module, weight, memory_format in _conv_weights(model, formats):
        reason = _layout_kept(module, weight)
        if reason is not None:
            report.layout_kept.append((name, reason))
        elif _restride(weight, memory_format):
            changed.append((name, weight))
    _note_restrided([weight for _, weight in changed])
    return [name for name, _ in changed]


# Optimizer state that follows the weights patch_model and unpatch_model restride. Fused optimizers (AdamW(fused=True)
# on CPU and CUDA, bitsandbytes') pair a parameter's elements with its state's by memory offset: state created
# before a restride (Adam's exp_avg, exp_avg_sq) would be updated against the wrong elements (PyTorch's CPU fused
# AdamW silently; CUDA's raises, pytorch/pytorch#110758). A global optimizer step pre-hook, registered at the first
# restride, gives such state the parameter's strides at each optimizer's first step after one: the values stay,
# every optimizer works whenever it was created. Checked once per optimizer and restride (a generation count), not
# per step.
_restrided: weakref.WeakValueDictionary[int, nn.Parameter] = weakref.WeakValueDictionary()
_restride_generation = 0
_aligned_generation: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> generation seen
_state_hook = None


def _note_restrided(weights: list[nn.Parameter]) -> None:
    """Record ``weights`` as restrided, for _align_optimizer_state."""
    global _restride_generation, _state_hook
    if not weights:
        return
    for weight in weights:
        _restrided[id(weight)] = weight
    _restride_generation += 1
    if _state_hook is None:
        _state_hook = register_optimizer_step_pre_hook(_align_optimizer_state)


def _align_optimizer_state(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """Optimizer step pre-hook: the state tensors of the parameter's shape of every restrided parameter of
    ``optimizer`` get the parameter's strides (same values)."""
    if _aligned_generation.get(optimizer) == _restride_generation:
        return
    _aligned_generation[optimizer] = _restride_generation
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param) if _restrided.get(id(param)) is param else None
            for key, value in (state or {}).items():
                if isinstance(value, torch.Tensor) and value.shape == param.shape and value.stride() != param.stride():
                    state[key] = torch.empty_strided(param.shape, param.stride(), dtype=value.dtype,
                                                     device=value.device).copy_(value)


def _restride(weight: nn.Parameter, memory_format: torch.memory_format) -> bool:
    """Give ``weight`` the strides ``.to(memory_format=...)`` gives it, as ``model.to(memory_format=...)`` does;
    True if they changed. A 1x1 kernel's contiguous weight already passes ``is_contiguous(memory_format=...)``, but
    cuDNN picks a convolution's layout from the strides (``suggest_memory_format``): with NCHW strides such a conv
    returns NCHW for NCHW input (diffusers' training-mode ``conv_shortcut(input_tensor.contiguous())``), and the
    blocks after it run NCHW."""
    restrided = weight.data.to(memory_format=memory_format)
    if restrided.stride() == weight.data.stride():
        return False
    weight.data = restrided
    if weight.grad is not None:  # accumulated into as it is: the gradient follows the weight's layout
        weight.grad = weight.grad.contiguous(memory_format=memory_format)
    return True


def _without_peft_wrappers(name: str) -> str:
    """A weight's name as patch_model saw it: peft's LoRA layers move the wrapped conv to ``<name>.base_layer``."""
    return name.replace(".base_layer.", ".")


def _restore_conv_weights(model: nn.Module, names) -> None:
    """Make the named conv weights of ``model`` contiguous again (names no longer present are passed over; a
    LoRA adapter added after patching does not hide a conv it wrapped)."""
    weights = {_without_peft_wrappers(name): weight
               for name, module, weight, _ in _conv_weights(model, _CHANNELS_LAST | _CHANNELS_LAST_3D)
               if _layout_kept(module, weight) is None}
    restored = []
    for name in names:
        weight = weights.get(name)
        if weight is not None and _restride(weight, torch.contiguous_format):
            restored.append(weight)
    _note_restrided(restored)


# ------------------------------------------------------------------------------------------------
# Channels-last activations (channels_last="activations"): parameters keep their layout
# ------------------------------------------------------------------------------------------------
_INPUT_FORMATS = {4: torch.channels_last, 5: torch.channels_last_3d}
# Children that get the input hook too: the first conv of models that reshape their input before it (video UNets
# fold the frames into the batch), the encoder and decoder that an autoencoder's encode()/decode() call directly
# (ConsistencyDecoderVAE's decoder is a UNet).
_ENTRY_CHILDREN = ("conv_in", "encoder", "decoder", "decoder_unet")


class ChannelsLastInputs:
    """Forward pre-hook of ``patch_model(model, channels_last="activations")``: makes the floating-point tensor
    arguments of the ``ndims`` ranks channels-last (4-D: channels_last, 5-D: channels_last_3d) once, at the model's
    root. cuDNN then picks its NHWC convolutions from the input's layout, and the fused norms keep it, so
    activations flow NHWC with contiguous weights (what FSDP2's fully_shard needs). One hook per call, not per conv.
    """

    def __init__(self, ndims: tuple[int, ...]) -> None:
        self.ndims = ndims

    def _convert(self, value):
        if isinstance(value, torch.Tensor) and value.dim() in self.ndims and value.is_floating_point():
            return value.contiguous(memory_format=_INPUT_FORMATS[value.dim()])
        return value

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return tuple(map(self._convert, args)), {key: self._convert(value) for key, value in kwargs.items()}


def _input_hook_ids(module: nn.Module) -> list[int]:
    return [key for key, hook in module._forward_pre_hooks.items() if isinstance(hook, ChannelsLastInputs)]


def _add_input_hooks(model: nn.Module, ndims: tuple[int, ...]) -> list[str]:
    """Install ChannelsLastInputs on ``model`` and its entry children (a module holding one already keeps it);
    returns the names of the modules that got one."""
    entries = {"": model} | {name: child for name, child in model.named_children() if name in _ENTRY_CHILDREN}
    added = []
    for name, module in entries.items():
        if not _input_hook_ids(module):
            module.register_forward_pre_hook(ChannelsLastInputs(ndims), with_kwargs=True)
            added.append(name)
    return added


def _remove_input_hooks(module: nn.Module) -> None:
    for key in _input_hook_ids(module):
        del module._forward_pre_hooks[key]
        module._forward_pre_hooks_with_kwargs.pop(key, None)


def _check_module(model, function: str) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{function}: model must be a torch.nn.Module, got {type(model).__name__}")


# ------------------------------------------------------------------------------------------------
# Public API
# ------------------------------------------------------------------------------------------------
def patch_model(model: nn.Module, *, channels_last: bool | str = True, channels_last_3d: bool = True) -> PatchReport:
    """Make the GroupNorms of ``model`` run gn_patch's fused op, in place, fused with what follows where the
    surgeon knows the code (see the module docstring).

    Every plain torch.nn.GroupNorm becomes a GroupNormAct (switching the instance's class): fused with the
    activation and/or per-sample scale/shift that follows it where a rule knows the code, on its own otherwise
    (``report.alone``). State_dict keys, shapes and Parameter objects do not change: checkpoints load both ways
    (strict) and ``save_pretrained`` writes what stock diffusers reads. Outputs equal the stock model's up to
    rounding: on CPU, or for inputs the kernels do not take, GroupNormAct computes exactly PyTorch's GroupNorm,
    modulation and activation. Calling it again fuses only what is new (report.already_patched lists the rest).
    accelerate hooks (enable_model_cpu_offload, cpu_offload, dispatch_model) may be attached before or after, but
    hooks that keep the weights themselves (cpu_offload, enable_sequential_cpu_offload) load their own copies on
    every call: patch before them (after them the conv weights keep their layout, report.layout_kept; and
    unpatch_model after them leaves their copies channels_last);
    forward hooks on a GroupNorm or on the activation it would absorb, or global module hooks
    (register_module_forward_hook), keep that pair unfused (a block whose forward is edited as one keeps all its
    pairs unfused; the report names the module the reason comes from), and a later call fuses what they kept apart
    once they are removed. Patching mid-training is safe: the conv weights change memory format in place, their
    gradients with them, and an optimizer's state made before (Adam's moments, which fused optimizers pair with the
    weight by memory offset) follows at the optimizer's next step (a global optimizer step pre-hook, registered at
    the first conversion). A patched block relies
    on its fused norms: replace submodules of a patched model only after unpatch_model. A fused nn.Sequential pair
    assumes its items run in order (calling the Sequential, or iterating over it); calling the GroupNorm item alone
    then applies the activation too.

    Args:
        model: any torch.nn.Module, e.g. a diffusers UNet2DConditionModel, AutoencoderKL or
            AutoencoderKLCogVideoX.
        channels_last: how 4-D activations come to flow NHWC through the network (what the CUDA kernels read).
            True: give the Conv2d/ConvTranspose2d weights the channels_last memory format (the fastest
            inference). ``"activations"``: leave every parameter as it is and make the model's 4-D tensor
            arguments channels_last once, in a forward pre-hook on ``model`` (and on its ``conv_in``, ``encoder``,
            ``decoder`` children: video UNets reshape their input before conv_in, autoencoders' encode()/decode()
            call their encoder/decoder directly); cuDNN picks its NHWC convolutions from the input's layout. An op
            inside the model that returns NCHW (some video VAEs' resampling) ends the NHWC flow there: only
            channels_last weights restore it. Needed for FSDP2's fully_shard, which refuses non-contiguous
            parameters. False: neither. Parameters that are DTensors (patch_model after fully_shard) or other
            tensor subclasses are never converted, nor the weights of conv subclasses defined outside torch and
            diffusers with a forward of their own, whose code may need a contiguous weight, nor those of lazy convs
            not yet called (``report.layout_kept``).
        channels_last_3d: the same for 5-D activations (NDHWC), with channels_last True: the
            Conv3d/ConvTranspose3d weights become channels_last_3d (cuDNN then runs its NDHWC convolutions;
            measure them with benchmarks/tools/conv3d_layout.py); with ``"activations"``: 5-D tensor arguments
            become channels_last_3d; with channels_last False, nothing. Other tensors keep their layout;
            unpatch_model converts the weights back and removes the hooks.

    Returns:
        PatchReport: patched, run alone, already patched and skipped GroupNorms (qualified names), conv weights
        converted and kept, modules whose inputs are made channels-last.

    Raises:
        TypeError: ``model`` is not a torch.nn.Module.
        ValueError: ``channels_last`` is not True, False or "activations"; ``channels_last_3d`` is not a bool.
    """
    _check_module(model, "patch_model")
    if not (isinstance(channels_last, bool) or channels_last == "activations"):
        raise ValueError(f"patch_model: channels_last must be True (channels_last conv weights), 'activations' "
                         f"(channels-last inputs, parameters as they are) or False, got {channels_last!r}")
    if not isinstance(channels_last_3d, bool):
        raise ValueError(f"patch_model: channels_last_3d must be True or False, got {channels_last_3d!r}")
    surgery = Surgery(model, bool(channels_last))
    _walk(surgery, model)
    version_skips = [reason for _, reason in surgery.report.skipped + surgery.report.alone if VERSION_SKIP in reason]
    if version_skips:
        warnings.warn(f"gn_patch: {len(version_skips)} GroupNorm(s) not fused: {version_skips[0]}",
                      RuntimeWarning, stacklevel=2)
    if channels_last == "activations":
        surgery.report.channels_last_inputs = _add_input_hooks(model, (4, 5) if channels_last_3d else (4,))
        return surgery.report
    formats = (_CHANNELS_LAST | (_CHANNELS_LAST_3D if channels_last_3d else {})) if channels_last else {}
    converted = _make_conv_weights_channels_last(model, formats, surgery.report)
    surgery.report.channels_last = len(converted)
    if converted:
        # Recorded without peft's wrappers: a LoRA present now may be unloaded before unpatch_model, and one added
        # after patching wraps the conv then.
        converted = tuple(_without_peft_wrappers(name) for name in converted)
        setattr(model, _LAYOUT_FLAG, tuple(model.__dict__.get(_LAYOUT_FLAG, ())) + converted)
    return surgery.report


def _unpatch_problems(model: nn.Module) -> list[tuple[str, str]]:
    """(module name, why unpatch_model cannot restore it exactly) for every module of ``model`` that it could not
    turn back into stock; empty when it can restore them all."""
    problems = []
    for name, module in model.named_modules():
        patched = next((cls for cls in type(module).__mro__ if cls in ORIGINAL_CLASS), None)
        if patched is not None and patched_class(type(module)) is None:
            problems.append((name, f"its class {type(module).__qualname__} subclasses the patched "
                                   f"{patched.__name__} (a wrapper class gn_patch cannot undo; it undoes FSDP2's "
                                   "fully_shard and replicate, and parametrizations)"))
        elif patched is not None and forward_override_problem(module):
            # A wrapper that captured a patched forward (diffusers' HookRegistry, group offloading, ...) would keep
            # calling it after the class switch back.
            problems.append((name, "the forward is wrapped on the instance by hooks added after patch_model (e.g. "
                                   "diffusers' group offloading or HookRegistry hooks); remove them"))
        for key, child in module._modules.items():
            if isinstance(child, FusedActivation) and (type(child) is not FusedActivation or has_hooks(child)
                                                       or "forward" in vars(child)):
                # unpatch puts the original activation module back: what was added to the stand-in would be lost.
                problems.append((join_name(name, key), "the stand-in for the fused activation has hooks or a "
                                                       "wrapper class added after patch_model; remove them"))
    return problems


def _check_unpatchable(model: nn.Module, prefix: str = "") -> None:
    """Raise the ValueError :func:`unpatch_model` would raise for ``model``, changing nothing (module names in the
    message prefixed by ``prefix``, e.g. a pipeline component's name)."""
    patched = patched_class(type(model))
    if patched is not None and "activation" in ADDED_STATE[patched] and model.activation != "identity":
        raise ValueError("unpatch_model: this GroupNorm was fused with the activation its parent module applies after "
                         "it; unpatch the parent (or the whole model) so that the activation comes back too")
    problems = _unpatch_problems(model)
    if problems:
        listed = "; ".join(f"{join_name(prefix, name) or '<root>'}: {why}" for name, why in problems[:3])
        raise ValueError(f"unpatch_model: cannot restore {len(problems)} module(s), nothing was changed: {listed}"
                         + (" ..." if len(problems) > 3 else ""))


def unpatch_model(model: nn.Module) -> int:
    """Undo :func:`patch_model` in place: module classes, forwards and activation modules become stock again.

    Conv weights that patch_model made channels_last become contiguous again (also when it patched a submodule
    or a pipeline component of ``model``); weights that were channels_last before keep that layout. The
    channels-last input hooks of ``channels_last="activations"`` are removed. GroupNormAct modules not created by
    patch_model are left alone. Wrapper classes that FSDP2's fully_shard (or replicate) and
    torch.nn.utils.parametrize gave patched modules after patching stay, around the stock class: the model is
    then what those wrappers would have made of the stock model. Every module is checked before any is changed.

    Returns:
        The number of GroupNorms turned back from GroupNormAct.

    Raises:
        TypeError: ``model`` is not a torch.nn.Module.
        ValueError: ``model`` is a single GroupNorm fused with its parent's activation (unpatch the parent); a
            patched module's forward is wrapped by hooks added after patching, or its class by a wrapper gn_patch
            does not know, or a fused activation's stand-in has hooks (remove them first); nothing is changed then.
    """
    _check_module(model, "unpatch_model")
    _check_unpatchable(model)
    return _unpatch(model)


def _unpatch(model: nn.Module) -> int:
    """unpatch_model's work, once _check_unpatchable has passed."""
    restored = 0
    for module in list(model.modules()):
        patched = patched_class(type(module))
        if patched is not None:
            restored += "activation" in ADDED_STATE[patched]
            restore(module)
        _remove_input_hooks(module)
        for key, child in list(module._modules.items()):
            if isinstance(child, FusedActivation):
                child.original.train(child.training)
                setattr(module, key, child.original)
        if _LAYOUT_FLAG in module.__dict__:
            _restore_conv_weights(module, module.__dict__[_LAYOUT_FLAG])
            delattr(module, _LAYOUT_FLAG)
    return restored
