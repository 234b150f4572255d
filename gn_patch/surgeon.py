"""Model surgeon: every GroupNorm of a model runs gn_patch's fused op, fused with what follows it where the
surgeon knows the code, in place.

``patch_model(model)`` walks any torch.nn.Module through the rule registry (:mod:`gn_patch.rules`: a handler per
module class, for the 39 diffusers model classes holding a GroupNorm and their blocks): a block's GroupNorms
become GroupNormActs that apply the activation after them, and the per-sample scale/shift before it where the
block has one; the block gets a subclass whose forward is its own diffusers code with those calls merged (or, at
the top level of a model, the activation module a stand-in). Every GroupNorm no rule fuses becomes the identity
GroupNormAct with PyTorch's output layout: always exact. Conv weights become channels-last.

Everything is done in place and is undone by :func:`unpatch_model`: a GroupNorm becomes a GroupNormAct by switching
the instance's class (the module object, its Parameters, hooks and state_dict keys stay the same), a bypassed
activation module is swapped for an identity placeholder that keeps the original. The :class:`PatchReport` lists
what was fused, what runs alone and why, and what stays as it is and why.

Each rule that relies on diffusers code checks, at patch time, that the installed diffusers has that exact code
(``gn_patch.rules.VERIFIED_SOURCES``, diffusers 0.42.1); with other code its GroupNorms run alone and the report
and a warning say so, rather than change results silently.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from .modules import GroupNormAct
from .report import PatchReport
from .rules import ORIGINAL_CLASS, RULES
from .rules.base import (ADDED_STATE, VERSION_SKIP, FusedActivation, StockLayoutGroupNorm, Surgery,
                         forward_override_problem, fuse_norm, restore)

__all__ = ["PatchReport", "patch_model", "unpatch_model"]


# ------------------------------------------------------------------------------------------------
# The walk
# ------------------------------------------------------------------------------------------------
def _walk(surgery: Surgery, model: nn.Module) -> None:
    """Apply the registered rules to every module of ``model``, in module order (a block before its norms), then
    run every GroupNorm no rule fused on its own."""
    for name, module in model.named_modules():
        rule = RULES.get(type(module))
        if rule is not None:
            rule(surgery, name, module)
    _run_the_rest_alone(surgery, model)


def _run_the_rest_alone(surgery: Surgery, model: nn.Module) -> None:
    """The always exact GroupNorm swap: every nn.GroupNorm no rule fused becomes the identity GroupNormAct whose
    output has the layout PyTorch's GroupNorm gives (report.alone, with why it is not fused)."""
    for name, module in model.named_modules():
        if id(module) in surgery.decided:
            continue
        if not isinstance(module, nn.GroupNorm):
            if id(module) in surgery.declined:  # a norm of another class (AdaGroupNorm, ...) a rule could not fuse
                surgery.skip(name, module, surgery.declined[id(module)])
            continue
        if type(module) is StockLayoutGroupNorm:
            surgery.already(name, module, "GroupNorm alone")
        elif isinstance(module, GroupNormAct):  # the user's own GroupNormAct
            continue
        elif type(module) is not nn.GroupNorm:
            surgery.skip(name, module, f"{type(module).__name__} is not a plain torch.nn.GroupNorm (its own forward)")
        elif forward_override_problem(module) is not None:
            surgery.skip(name, module, forward_override_problem(module))
        else:
            fuse_norm(module, "identity", StockLayoutGroupNorm)
            surgery.report.alone.append((name, surgery.declined.get(id(module)) or _unknown_use(model, name)))
            surgery.decided.add(id(module))


def _unknown_use(model: nn.Module, name: str) -> str:
    """Why a GroupNorm no rule covers is not fused."""
    if not name:
        return "the surgeon does not know what follows this GroupNorm"
    parent = model.get_submodule(name.rpartition(".")[0])
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
    """(qualified name, weight, memory format) of the weights of ``model``'s convs of the classes in ``formats``
    (subclasses included), outside peft adapters."""
    adapters = _adapter_convs(model)
    for name, module in model.named_modules():
        memory_format = next((f for cls, f in formats.items() if isinstance(module, cls)), None)
        if memory_format is None or id(module) in adapters:
            continue
        weight = getattr(module, "weight", None)
        # Parameters only (not parametrized weights); plain tensors (not quantized or other tensor subclasses).
        if isinstance(weight, nn.Parameter) and type(weight.data) is torch.Tensor:
            yield f"{name}.weight" if name else "weight", weight, memory_format


def _make_conv_weights_channels_last(model: nn.Module, formats: dict[type, torch.memory_format]) -> list[str]:
    """Give the conv weights of the classes in ``formats`` that memory format in place; returns the names of
    those changed. Unlike ``model.to(memory_format=...)``, leaves all other tensors alone."""
    changed = []
    for name, weight, memory_format in _conv_weights(model, formats):
        if not weight.is_contiguous(memory_format=memory_format):
            weight.data = weight.data.contiguous(memory_format=memory_format)
            changed.append(name)
    return changed


def _without_peft_wrappers(name: str) -> str:
    """A weight's name as patch_model saw it: peft's LoRA layers move the wrapped conv to ``<name>.base_layer``."""
    return name.replace(".base_layer.", ".")


def _restore_conv_weights(model: nn.Module, names) -> None:
    """Make the named conv weights of ``model`` contiguous again (names no longer present are passed over; a
    LoRA adapter added after patching does not hide a conv it wrapped)."""
    weights = {_without_peft_wrappers(name): weight
               for name, weight, _ in _conv_weights(model, _CHANNELS_LAST | _CHANNELS_LAST_3D)}
    for name in names:
        weight = weights.get(name)
        if weight is not None and not weight.is_contiguous():
            weight.data = weight.data.contiguous()


# ------------------------------------------------------------------------------------------------
# Public API
# ------------------------------------------------------------------------------------------------
def patch_model(model: nn.Module, *, channels_last: bool = True, channels_last_3d: bool = True) -> PatchReport:
    """Make the GroupNorms of ``model`` run gn_patch's fused op, in place, fused with what follows where the
    surgeon knows the code (see the module docstring).

    Every plain torch.nn.GroupNorm becomes a GroupNormAct (switching the instance's class): fused with the
    activation and/or per-sample scale/shift that follows it where a rule knows the code, on its own otherwise
    (``report.alone``). State_dict keys, shapes and Parameter objects do not change: checkpoints load both ways
    (strict) and ``save_pretrained`` writes what stock diffusers reads. Outputs equal the stock model's up to
    rounding: on CPU, or for inputs the kernels do not take, GroupNormAct computes exactly PyTorch's GroupNorm,
    modulation and activation. Calling it again fuses only what is new (report.already_patched lists the rest).
    accelerate hooks (enable_model_cpu_offload, cpu_offload, dispatch_model) may be attached before or after;
    forward hooks on a GroupNorm or on the activation it would absorb keep that pair unfused. A patched block relies
    on its fused norms: replace submodules of a patched model only after unpatch_model. A fused nn.Sequential pair
    assumes its items run in order (calling the Sequential, or iterating over it); calling the GroupNorm item alone
    then applies the activation too.

    Args:
        model: any torch.nn.Module, e.g. a diffusers UNet2DConditionModel, AutoencoderKL or
            AutoencoderKLCogVideoX.
        channels_last: also give the Conv2d/ConvTranspose2d weights (4-D) the channels_last memory format, so
            4-D activations flow NHWC through the network (what the CUDA kernels read).
        channels_last_3d: also give the Conv3d/ConvTranspose3d weights (5-D) the channels_last_3d memory format,
            so video activations flow NDHWC (cuDNN then runs its NDHWC convolutions; measure them with
            benchmarks/tools/conv3d_layout.py). Other tensors keep their layout; unpatch_model converts the
            weights back.

    Returns:
        PatchReport: fused, run alone, already fused and skipped GroupNorms (qualified names), conv weights
        converted.
    """
    surgery = Surgery(model, channels_last)
    _walk(surgery, model)
    version_skips = [reason for _, reason in surgery.report.skipped + surgery.report.alone if VERSION_SKIP in reason]
    if version_skips:
        warnings.warn(f"gn_patch: {len(version_skips)} GroupNorm(s) not fused: {version_skips[0]}",
                      RuntimeWarning, stacklevel=2)
    formats = (_CHANNELS_LAST if channels_last else {}) | (_CHANNELS_LAST_3D if channels_last_3d else {})
    converted = _make_conv_weights_channels_last(model, formats)
    surgery.report.channels_last = len(converted)
    if converted:
        setattr(model, _LAYOUT_FLAG, tuple(model.__dict__.get(_LAYOUT_FLAG, ())) + tuple(converted))
    return surgery.report


def _check_unpatchable(model: nn.Module, prefix: str = "") -> None:
    """Raise the ValueError :func:`unpatch_model` would raise for ``model``, changing nothing (module names in the
    message prefixed by ``prefix``, e.g. a pipeline component's name)."""
    if "activation" in ADDED_STATE.get(type(model), ()) and model.activation != "identity":
        raise ValueError("unpatch_model: this GroupNorm was fused with the activation its parent module applies after "
                         "it; unpatch the parent (or the whole model) so that the activation comes back too")
    # A wrapper that captured a patched forward (diffusers' HookRegistry, group offloading, ...) would keep calling
    # it after the class switch back: refuse before changing anything.
    wrapped = [".".join(filter(None, (prefix, name))) or "<root>" for name, module in model.named_modules()
               if type(module) in ORIGINAL_CLASS and forward_override_problem(module)]
    if wrapped:
        raise ValueError(f"unpatch_model: {', '.join(wrapped[:5])}{' ...' if len(wrapped) > 5 else ''}: the forward "
                         "is wrapped on the instance by hooks added after patch_model (e.g. diffusers' group "
                         "offloading or HookRegistry hooks); remove them before unpatching")


def unpatch_model(model: nn.Module) -> int:
    """Undo :func:`patch_model` in place: module classes, forwards and activation modules become stock again.

    Conv weights that patch_model made channels_last become contiguous again (also when it patched a submodule
    or a pipeline component of ``model``); weights that were channels_last before keep that layout. GroupNormAct
    modules not created by patch_model are left alone.

    Returns:
        The number of GroupNorms turned back from GroupNormAct.

    Raises:
        ValueError: ``model`` is a single GroupNorm fused with its parent's activation (unpatch the parent), or a
            patched module's forward is wrapped by hooks added after patching (remove them first); nothing is
            changed then.
    """
    _check_unpatchable(model)
    return _unpatch(model)


def _unpatch(model: nn.Module) -> int:
    """unpatch_model's work, once _check_unpatchable has passed."""
    restored = 0
    for module in list(model.modules()):
        if type(module) in ORIGINAL_CLASS:
            restored += "activation" in ADDED_STATE[type(module)]
            restore(module)
        for key, child in list(module._modules.items()):
            if isinstance(child, FusedActivation):
                child.original.train(child.training)
                setattr(module, key, child.original)
        if _LAYOUT_FLAG in module.__dict__:
            _restore_conv_weights(module, module.__dict__[_LAYOUT_FLAG])
            delattr(module, _LAYOUT_FLAG)
    return restored
