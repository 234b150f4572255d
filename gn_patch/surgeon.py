"""Model surgeon: fuse the GroupNorm + activation pairs of diffusers models into :class:`GroupNormAct`, in place.

``patch_model(model)`` walks any torch.nn.Module and rewrites the patterns whose code it knows:

* ``ResnetBlock2D``: norm1 -> nonlinearity and norm2 -> nonlinearity become fused GroupNormAct calls (norm2 stays
  plain under ``time_embedding_norm="scale_shift"``, where the timestep scale/shift sits between the two);
  ``TemporalResnetBlock`` (the 5-D blocks of Stable Video Diffusion) likewise.
* ``conv_norm_out`` + ``conv_act`` of UNet2DConditionModel, UNet2DModel, UNetSpatioTemporalConditionModel and the
  AutoencoderKL Encoder/Decoder.
* ``Attention.group_norm`` and the input ``norm`` of Transformer2DModel / TransformerTemporalModel /
  TransformerSpatioTemporalModel: a GroupNormAct with the identity activation.
* ``nn.Sequential(..., GroupNorm, SiLU | GELU | ReLU, ...)`` pairs anywhere.

Everything is done in place and is undone by :func:`unpatch_model`: a GroupNorm becomes a GroupNormAct by switching
the instance's class (the module object, its Parameters, hooks and state_dict keys stay the same), a block gets a
subclass whose forward is the original one with the fused calls, and a bypassed activation module is swapped for an
identity placeholder that keeps the original. What the surgeon does not know, or cannot do exactly, stays as it is
and is listed in the :class:`PatchReport` with the reason.

The fused forwards mirror diffusers 0.42.1 line by line. Each rule that relies on a diffusers forward checks, at
patch time, that the installed diffusers has that exact code (see ``_VERIFIED_SOURCES``); with other code the rule
skips and says so, rather than change results silently.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import types
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import diffusers
import torch
from accelerate.hooks import AlignDevicesHook, SequentialHook
from diffusers.models.attention_processor import Attention, SpatialNorm
from diffusers.models.autoencoders.vae import Decoder, Encoder
from diffusers.models.normalization import AdaGroupNorm
from diffusers.models.resnet import ResnetBlock2D, ResnetBlockCondNorm2D, TemporalResnetBlock
from diffusers.models.transformers.transformer_2d import Transformer2DModel
from diffusers.models.transformers.transformer_temporal import TransformerSpatioTemporalModel, TransformerTemporalModel
from diffusers.models.unets.unet_2d import UNet2DModel
from diffusers.models.unets.unet_2d_condition import UNet2DConditionModel
from diffusers.models.unets.unet_spatio_temporal_condition import UNetSpatioTemporalConditionModel
from diffusers.utils import deprecate
from torch import nn

from .modules import GroupNormAct
from .ops import canonical_activation

__all__ = ["PatchReport", "patch_model", "unpatch_model"]


# ------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------
@dataclass
class PatchReport:
    """What :func:`patch_model` (or ``patch_pipeline``) did.

    Module names are qualified from the patched model (``down_blocks.0.resnets.1.norm2``); reports merged with a
    prefix (one per pipeline component) start with the component's name (``unet.down_blocks...``).

    Attributes:
        patched: (module name, kind) of every GroupNorm this call fused, e.g. ``("mid_block.resnets.0.norm1",
            "ResnetBlock2D.norm1+act")``.
        already_patched: (module name, kind) of the GroupNorms an earlier call had fused.
        skipped: (module name, reason) of every GroupNorm-like module left as it is (from patch_pipeline, also of
            each transformers component holding a GroupNorm, which it leaves alone).
        channels_last: number of 4-D conv weights this call converted to channels_last.
    """

    patched: list[tuple[str, str]] = field(default_factory=list)
    already_patched: list[tuple[str, str]] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    channels_last: int = 0

    @property
    def counts(self) -> dict[str, int]:
        """Number of GroupNorms fused by this call, per kind."""
        return dict(Counter(kind for _, kind in self.patched))

    def merge(self, other: "PatchReport", prefix: str = "") -> "PatchReport":
        """A new report holding this one's entries and ``other``'s, the latter's names prefixed by ``prefix.``."""
        def named(entries):
            return [(_join(prefix, name), what) for name, what in entries]

        return PatchReport(
            patched=self.patched + named(other.patched),
            already_patched=self.already_patched + named(other.already_patched),
            skipped=self.skipped + named(other.skipped),
            channels_last=self.channels_last + other.channels_last,
        )

    def __str__(self) -> str:
        lines = [f"gn_patch: fused {len(self.patched)} GroupNorm(s), {len(self.already_patched)} already fused, "
                 f"{len(self.skipped)} left as they are; {self.channels_last} conv weight(s) made channels_last"]
        for title, entries in (("fused", self.patched), ("already fused", self.already_patched)):
            if entries:
                lines.append(f"  {title}:")
                counts = Counter(kind for _, kind in entries)
                lines += [f"    {count:5d}  {kind}" for kind, count in sorted(counts.items())]
        if self.skipped:
            lines.append("  left as they are:")
            lines += [f"    {name or '<root>'}: {reason}" for name, reason in self.skipped]
        return "\n".join(lines)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


# ------------------------------------------------------------------------------------------------
# The code the fused forwards were written against
# ------------------------------------------------------------------------------------------------
def _source_digest(function: Callable) -> str | None:
    """Digest of a function's source, blank and comment-only lines dropped; None when the source is unavailable."""
    try:
        lines = inspect.getsource(function).splitlines()
    except (OSError, TypeError):
        return None
    kept = [line.rstrip() for line in lines if line.strip() and not line.strip().startswith("#")]
    return hashlib.sha256("\n".join(kept).encode()).hexdigest()[:16]


# forward of each class whose code a rule relies on -> digests of the versions read and mirrored (diffusers 0.42.1).
# A rule whose class has another digest skips: add a digest here only after checking the new code.
_VERIFIED_SOURCES = {
    ResnetBlock2D: {"eda498bf0236feb0"},
    TemporalResnetBlock: {"7c1ebea7613ebc9f"},
    UNet2DConditionModel: {"55ffdaac232f9154"},
    UNet2DModel: {"ebfc8e9db1c6b9a1"},
    UNetSpatioTemporalConditionModel: {"4786ee948fcc6aca"},
    Encoder: {"f58ee1b44a5e3da4"},
    Decoder: {"9f0ef7b3671ff01b"},
}
# Transformer2DModel._get_output_for_continuous_inputs, mirrored by _ChannelsLastTransformer2DModel.
_VERIFIED_TRANSFORMER_OUTPUT = {"080aa7e5536f6b0c"}


_VERSION_SKIP = "is not the code the surgeon was checked against (diffusers 0.42.1)"


@functools.cache
def _unverified(cls: type) -> str | None:
    """Why ``cls.forward`` cannot be relied on (not the code the surgeon was checked against), None when it can."""
    if _source_digest(cls.forward) in _VERIFIED_SOURCES[cls]:
        return None
    return f"{cls.__name__}.forward of the installed diffusers {diffusers.__version__} {_VERSION_SKIP}"


# ------------------------------------------------------------------------------------------------
# Patched classes
# ------------------------------------------------------------------------------------------------
_SCALE_DEPRECATION = (
    "The `scale` argument is deprecated and will be ignored. Please remove it, as passing it will raise an error in "
    "the future. `scale` should directly be passed while calling the underlying pipeline component i.e., via "
    "`cross_attention_kwargs`."
)


class _FusedGroupNorm(GroupNormAct):
    """An nn.GroupNorm turned into a GroupNormAct in place by patch_model (unpatch_model turns it back)."""


class _FusedActivation(nn.Identity):
    """Stands in for an activation module whose work the preceding GroupNormAct now does.

    Keeps the original (outside the module tree: activations hold no parameters or buffers) for unpatch_model.
    """

    def __init__(self, original: nn.Module) -> None:
        super().__init__()
        self.__dict__["original"] = original  # a plain attribute, not a submodule: module names stay the same

    def extra_repr(self) -> str:
        return f"fused into the preceding GroupNormAct: {self.original}"


class _FusedResnetBlock2D(ResnetBlock2D):
    """ResnetBlock2D whose norm1, and norm2 unless ``time_embedding_norm == "scale_shift"``, are GroupNormActs
    applying the block's nonlinearity. ``self.nonlinearity`` still acts on temb and, under scale_shift, after the
    modulation. Installed by patch_model by switching a ResnetBlock2D instance's class.
    """

    def forward(self, input_tensor: torch.Tensor, temb: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        # diffusers 0.42.1 ResnetBlock2D.forward with norm + nonlinearity calls merged (lines marked "fused").
        if len(args) > 0 or kwargs.get("scale", None) is not None:
            deprecate("scale", "1.0.0", _SCALE_DEPRECATION)

        hidden_states = self.norm1(input_tensor)  # fused: norm1 + nonlinearity

        if self.upsample is not None:
            # upsample_nearest_nhwc fails with large batch sizes: https://github.com/huggingface/diffusers/issues/984
            if hidden_states.shape[0] >= 64:
                input_tensor = input_tensor.contiguous()
                hidden_states = hidden_states.contiguous()
            input_tensor = self.upsample(input_tensor)
            hidden_states = self.upsample(hidden_states)
        elif self.downsample is not None:
            input_tensor = self.downsample(input_tensor)
            hidden_states = self.downsample(hidden_states)

        hidden_states = self.conv1(hidden_states)

        if self.time_emb_proj is not None:
            if not self.skip_time_act:
                temb = self.nonlinearity(temb)
            temb = self.time_emb_proj(temb)[:, :, None, None]

        if self.time_embedding_norm == "default":
            if temb is not None:
                hidden_states = hidden_states + temb
            hidden_states = self.norm2(hidden_states)  # fused: norm2 + nonlinearity
        elif self.time_embedding_norm == "scale_shift":
            if temb is None:
                raise ValueError(
                    f" `temb` should not be None when `time_embedding_norm` is {self.time_embedding_norm}"
                )
            time_scale, time_shift = torch.chunk(temb, 2, dim=1)
            hidden_states = self.norm2(hidden_states)  # plain GroupNorm
            hidden_states = hidden_states * (1 + time_scale) + time_shift
            hidden_states = self.nonlinearity(hidden_states)
        else:
            hidden_states = self.norm2(hidden_states)  # fused: norm2 + nonlinearity

        hidden_states = self.dropout(hidden_states)
        hidden_states = self.conv2(hidden_states)

        if self.conv_shortcut is not None:
            # diffusers: contiguous() only in training, against a DDP gradient stride mismatch warning.
            if self.training:
                input_tensor = input_tensor.contiguous()
            input_tensor = self.conv_shortcut(input_tensor)

        output_tensor = (input_tensor + hidden_states) / self.output_scale_factor

        return output_tensor


class _ChannelsLastTransformer2DModel(Transformer2DModel):
    """Transformer2DModel whose output (continuous inputs) stays channels_last. Installed by
    patch_model(channels_last=True) by switching an instance's class.

    diffusers 0.42.1 ends with ``.reshape(B, H, W, C).permute(0, 3, 1, 2).contiguous()``, a copy to NCHW: the next
    GroupNorm then gets an input the kernels do not read (it takes PyTorch's path) and every layer after it converts
    back. The permuted view already is channels_last, so asking for that layout copies nothing; values are unchanged.
    """

    def _get_output_for_continuous_inputs(self, hidden_states, residual, batch_size, height, width, inner_dim):
        if not self.use_linear_projection:
            hidden_states = hidden_states.reshape(batch_size, height, width, inner_dim).permute(0, 3, 1, 2)
            hidden_states = self.proj_out(hidden_states.contiguous(memory_format=torch.channels_last))
        else:
            hidden_states = self.proj_out(hidden_states)
            hidden_states = hidden_states.reshape(batch_size, height, width, inner_dim).permute(0, 3, 1, 2)
            hidden_states = hidden_states.contiguous(memory_format=torch.channels_last)
        return hidden_states + residual


class _FusedTemporalResnetBlock(TemporalResnetBlock):
    """TemporalResnetBlock whose norm1 and norm2 are GroupNormActs applying the block's nonlinearity."""

    def forward(self, input_tensor: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        # diffusers 0.42.1 TemporalResnetBlock.forward with norm + nonlinearity calls merged (lines marked "fused").
        hidden_states = self.norm1(input_tensor)  # fused: norm1 + nonlinearity
        hidden_states = self.conv1(hidden_states)

        if self.time_emb_proj is not None:
            temb = self.nonlinearity(temb)
            temb = self.time_emb_proj(temb)[:, :, :, None, None]
            temb = temb.permute(0, 2, 1, 3, 4)
            hidden_states = hidden_states + temb

        hidden_states = self.norm2(hidden_states)  # fused: norm2 + nonlinearity
        hidden_states = self.dropout(hidden_states)
        hidden_states = self.conv2(hidden_states)

        if self.conv_shortcut is not None:
            input_tensor = self.conv_shortcut(input_tensor)

        output_tensor = input_tensor + hidden_states

        return output_tensor


# Code that picks modules by class name (accelerate's no_split_module_classes with diffusers' _no_split_modules,
# regional compilation's _repeated_blocks) must see a patched block as the original class. Pickling goes by
# __qualname__, which stays the subclass's own.
_FusedGroupNorm.__name__ = GroupNormAct.__name__
_FusedResnetBlock2D.__name__ = ResnetBlock2D.__name__
_FusedTemporalResnetBlock.__name__ = TemporalResnetBlock.__name__
_ChannelsLastTransformer2DModel.__name__ = Transformer2DModel.__name__

# patched class -> original class, for unpatch_model.
_ORIGINAL_CLASS = {
    _FusedGroupNorm: nn.GroupNorm,
    _FusedResnetBlock2D: ResnetBlock2D,
    _FusedTemporalResnetBlock: TemporalResnetBlock,
    _ChannelsLastTransformer2DModel: Transformer2DModel,
}


# ------------------------------------------------------------------------------------------------
# In-place class switches, hook-aware
# ------------------------------------------------------------------------------------------------
def _is_bound_class_forward(function, module: nn.Module) -> bool:
    return (isinstance(function, types.MethodType) and function.__self__ is module
            and function.__func__ is type(module).forward)


def _forward_override_problem(module: nn.Module) -> str | None:
    """Why an instance-level forward keeps ``module`` from switching class; None when it can switch.

    Allowed: none; accelerate's hook wrapper (it calls ``module._old_forward``, the class forward bound to the
    module, which the switch rebinds); the bound class forward that accelerate's remove_hook_from_module leaves.
    """
    own = module.__dict__.get("forward")
    if own is None or _is_bound_class_forward(own, module):
        return None
    if "_hf_hook" in module.__dict__ and _is_bound_class_forward(module.__dict__.get("_old_forward"), module):
        return None
    return "its forward is replaced on the instance by a wrapper the surgeon does not know (hooks?)"


def _set_class(module: nn.Module, cls: type) -> None:
    """Switch ``module``'s class in place; instance-level bound class forwards (see above) follow the switch."""
    bound = [name for name in ("forward", "_old_forward") if _is_bound_class_forward(module.__dict__.get(name), module)]
    module.__class__ = cls
    for name in bound:
        setattr(module, name, types.MethodType(cls.forward, module))


def _fuse_norm(norm: nn.GroupNorm, activation: str) -> None:
    """Make ``norm`` a GroupNormAct in place. GroupNormAct's only state beyond nn.GroupNorm's is ``activation``."""
    _set_class(norm, _FusedGroupNorm)
    norm.activation = canonical_activation(activation)


def _unfuse_norm(norm: _FusedGroupNorm) -> None:
    _set_class(norm, nn.GroupNorm)
    del norm.activation


# ------------------------------------------------------------------------------------------------
# Fusion preconditions
# ------------------------------------------------------------------------------------------------
def _activation_name(module) -> str | None:
    """gn_patch's name for an activation module computed exactly by GroupNormAct; None for any other module."""
    kind = type(module)
    if kind is nn.SiLU:
        return "silu"
    if kind is nn.ReLU:
        return "relu"
    if kind is nn.GELU:
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(module.approximate)
    return None


def _has_output_hooks(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._backward_hooks or module._backward_pre_hooks)


def _only_moves_tensors(hook) -> bool:
    """accelerate hooks that move weights and tensors between devices without changing values."""
    if isinstance(hook, SequentialHook):
        return all(_only_moves_tensors(h) for h in hook.hooks)
    return isinstance(hook, AlignDevicesHook)


class _Surgery:
    """One patch_model walk: the model's module-use counts and the report being written."""

    def __init__(self, model: nn.Module, channels_last: bool) -> None:
        self.channels_last = channels_last
        self.uses = Counter(id(m) for _, m in model.named_modules(remove_duplicate=False))
        self.report = PatchReport()
        self.seen: set[int] = set()  # ids of GroupNorms some rule has reported on

    def note(self, entries: list, name: str, norm: nn.Module, what: str) -> None:
        entries.append((name, what))
        self.seen.add(id(norm))

    def norm_problem(self, norm: nn.Module) -> str | None:
        """Why ``norm`` cannot become a GroupNormAct in place; None when it can."""
        if type(norm) is not nn.GroupNorm:
            return f"{type(norm).__name__} is not a plain torch.nn.GroupNorm"
        if self.uses[id(norm)] > 1:
            return "the GroupNorm is registered in several places, not all followed by the activation"
        if _has_output_hooks(norm):
            return "forward/backward hooks on the GroupNorm would see the activated output"
        if "_hf_hook" in norm.__dict__ and not _only_moves_tensors(norm._hf_hook):
            return f"accelerate hook {type(norm._hf_hook).__name__} on the GroupNorm may change its output"
        return _forward_override_problem(norm)

    def activation_problem(self, activation) -> str | None:
        """Why the GroupNormAct cannot take over ``activation``'s work; None when it can."""
        kind = type(activation).__name__
        if _activation_name(activation) is None:
            return f"the next op, {kind}, is not an activation with a fused kernel (SiLU, GELU, ReLU)"
        if (_has_output_hooks(activation) or activation._forward_pre_hooks or "_hf_hook" in activation.__dict__
                or "forward" in activation.__dict__):
            return f"hooks on the activation {kind} would no longer run"
        return None


# ------------------------------------------------------------------------------------------------
# Rules: one per module class, called with the module's qualified name
# ------------------------------------------------------------------------------------------------
def _patch_resnet(s: _Surgery, name: str, block: nn.Module, fused_cls: type, fused_norms: tuple[str, ...]) -> None:
    """Fuse ``fused_norms`` of ``block`` with its nonlinearity and switch it to ``fused_cls``, all or nothing."""
    base = type(block).__name__
    if type(block) is fused_cls:
        for attr in fused_norms:
            s.note(s.report.already_patched, _join(name, attr), getattr(block, attr), f"{base}.{attr}+act")
        return
    problem = (_unverified(type(block)) or s.activation_problem(block.nonlinearity)
               or _forward_override_problem(block))
    for attr in fused_norms:
        problem = problem or s.norm_problem(getattr(block, attr))
    if problem is not None:
        for attr in fused_norms:
            s.note(s.report.skipped, _join(name, attr), getattr(block, attr), f"{base}: {problem}")
        return
    activation = _activation_name(block.nonlinearity)
    for attr in fused_norms:
        _fuse_norm(getattr(block, attr), activation)
        s.note(s.report.patched, _join(name, attr), getattr(block, attr), f"{base}.{attr}+act")
    _set_class(block, fused_cls)


def _resnet_block_2d(s: _Surgery, name: str, block: ResnetBlock2D) -> None:
    """ResnetBlock2D, or the _FusedResnetBlock2D an earlier call made of it."""
    if block.time_embedding_norm == "scale_shift":
        s.note(s.report.skipped, _join(name, "norm2"), block.norm2,
               "ResnetBlock2D with time_embedding_norm='scale_shift': the timestep scale/shift sits between norm2 "
               "and the activation")
        _patch_resnet(s, name, block, _FusedResnetBlock2D, ("norm1",))
    else:
        _patch_resnet(s, name, block, _FusedResnetBlock2D, ("norm1", "norm2"))


def _temporal_resnet_block(s: _Surgery, name: str, block: TemporalResnetBlock) -> None:
    """TemporalResnetBlock, or the _FusedTemporalResnetBlock an earlier call made of it."""
    _patch_resnet(s, name, block, _FusedTemporalResnetBlock, ("norm1", "norm2"))


def _fuse_with_next(s: _Surgery, norm_name: str, norm, activation, kind: str,
                    replace_activation: Callable[[nn.Module], None]) -> None:
    """Fuse ``norm`` with the ``activation`` module that follows it; ``replace_activation`` installs the stand-in."""
    if isinstance(norm, _FusedGroupNorm) and isinstance(activation, _FusedActivation):
        s.note(s.report.already_patched, norm_name, norm, kind)
        return
    problem = s.norm_problem(norm) or s.activation_problem(activation)
    if problem is not None:
        s.note(s.report.skipped, norm_name, norm, problem)
        return
    _fuse_norm(norm, _activation_name(activation))
    replace_activation(_FusedActivation(activation))
    s.note(s.report.patched, norm_name, norm, kind)


def _post_process(s: _Surgery, name: str, model: nn.Module) -> None:
    """conv_norm_out + conv_act, run back to back at the end of the forward of the classes in _RULES."""
    norm = model.conv_norm_out
    if not isinstance(norm, nn.GroupNorm):  # None (UNet2DConditionModel(norm_num_groups=None)) or SpatialNorm
        return
    problem = _unverified(type(model))
    if problem is not None:
        s.note(s.report.skipped, _join(name, "conv_norm_out"), norm, problem)
        return
    _fuse_with_next(s, _join(name, "conv_norm_out"), norm, model.conv_act, "conv_norm_out+conv_act",
                    functools.partial(setattr, model, "conv_act"))


def _identity_norm(attr: str, kind: str) -> Callable[[_Surgery, str, nn.Module], None]:
    """Rule for a GroupNorm used on its own: GroupNormAct with the identity activation is exactly GroupNorm,
    whatever comes next, and runs the NHWC kernel on channels-last CUDA input."""

    def rule(s: _Surgery, name: str, owner: nn.Module) -> None:
        norm = getattr(owner, attr)
        if isinstance(norm, _FusedGroupNorm):
            s.note(s.report.already_patched, _join(name, attr), norm, kind)
        elif isinstance(norm, nn.GroupNorm):
            problem = s.norm_problem(norm)
            if problem is None:
                _fuse_norm(norm, "identity")
                s.note(s.report.patched, _join(name, attr), norm, kind)
            else:
                s.note(s.report.skipped, _join(name, attr), norm, problem)

    return rule


_transformer_norm = _identity_norm("norm", "Transformer2DModel.norm")


def _transformer_2d(s: _Surgery, name: str, model: Transformer2DModel) -> None:
    """The input norm (identity activation) and, with channels_last, an output that stays channels_last."""
    _transformer_norm(s, name, model)
    if (s.channels_last and type(model) is Transformer2DModel and model.is_input_continuous
            and _source_digest(Transformer2DModel._get_output_for_continuous_inputs) in _VERIFIED_TRANSFORMER_OUTPUT
            and _forward_override_problem(model) is None):
        _set_class(model, _ChannelsLastTransformer2DModel)


def _sequential(s: _Surgery, name: str, seq: nn.Sequential) -> None:
    """Adjacent (GroupNorm, activation) items of an nn.Sequential, whose forward calls its items in order."""
    items = list(seq._modules.items())
    for (key, norm), (next_key, following) in zip(items, items[1:]):
        if isinstance(norm, nn.GroupNorm) and type(norm) is not GroupNormAct:
            _fuse_with_next(s, _join(name, key), norm, following, "Sequential(GroupNorm, act)",
                            functools.partial(setattr, seq, next_key))


# Recognized modules the surgeon cannot fuse exactly; their subtrees are listed once, with the reason.
_UNFUSABLE = {
    SpatialNorm: "SpatialNorm: the GroupNorm output is modulated by the latent (norm * conv_y(zq) + conv_b(zq)) "
                 "before any activation",
    AdaGroupNorm: "AdaGroupNorm: F.group_norm then a timestep scale/shift, no GroupNorm module to fuse",
    ResnetBlockCondNorm2D: "ResnetBlockCondNorm2D: its conditional norms (AdaGroupNorm/SpatialNorm) modulate between "
                           "the normalization and the activation",
}

_RULES: dict[type, Callable[[_Surgery, str, nn.Module], None]] = {
    ResnetBlock2D: _resnet_block_2d,
    _FusedResnetBlock2D: _resnet_block_2d,
    TemporalResnetBlock: _temporal_resnet_block,
    _FusedTemporalResnetBlock: _temporal_resnet_block,
    # classes whose forward ends with `sample = self.conv_norm_out(sample); sample = self.conv_act(sample)` and
    # uses conv_act nowhere else (diffusers 0.42.1, checked by _VERIFIED_SOURCES).
    UNet2DConditionModel: _post_process,
    UNet2DModel: _post_process,
    UNetSpatioTemporalConditionModel: _post_process,
    Encoder: _post_process,
    Decoder: _post_process,
    Attention: _identity_norm("group_norm", "attention.group_norm"),
    Transformer2DModel: _transformer_2d,
    _ChannelsLastTransformer2DModel: _transformer_2d,
    TransformerTemporalModel: _identity_norm("norm", "TransformerTemporalModel.norm"),
    TransformerSpatioTemporalModel: _identity_norm("norm", "TransformerSpatioTemporalModel.norm"),
    nn.Sequential: _sequential,
}


def _unknown_use(model: nn.Module, name: str) -> str:
    """Skip reason of a GroupNorm no rule covers."""
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


def _conv2d_weights(model: nn.Module):
    """(qualified name, weight) of the 4-D Conv2d/ConvTranspose2d weights of ``model`` outside peft adapters."""
    adapters = _adapter_convs(model)
    for name, module in model.named_modules():
        if not isinstance(module, (nn.Conv2d, nn.ConvTranspose2d)) or id(module) in adapters:
            continue
        weight = getattr(module, "weight", None)
        # Parameters only (not parametrized weights); plain tensors (not quantized or other tensor subclasses).
        if isinstance(weight, nn.Parameter) and type(weight.data) is torch.Tensor:
            yield f"{name}.weight" if name else "weight", weight


def _make_conv_weights_channels_last(model: nn.Module) -> list[str]:
    """Give the 4-D conv weights the channels_last memory format in place; returns the names of those changed.

    Unlike ``model.to(memory_format=...)``, leaves Conv3d weights (5-D) and all other tensors alone.
    """
    changed = []
    for name, weight in _conv2d_weights(model):
        if not weight.is_contiguous(memory_format=torch.channels_last):
            weight.data = weight.data.contiguous(memory_format=torch.channels_last)
            changed.append(name)
    return changed


def _without_peft_wrappers(name: str) -> str:
    """A weight's name as patch_model saw it: peft's LoRA layers move the wrapped conv to ``<name>.base_layer``."""
    return name.replace(".base_layer.", ".")


def _restore_conv_weights(model: nn.Module, names) -> None:
    """Make the named conv weights of ``model`` contiguous again (names no longer present are passed over; a
    LoRA adapter added after patching does not hide a conv it wrapped)."""
    weights = {_without_peft_wrappers(name): weight for name, weight in _conv2d_weights(model)}
    for name in names:
        weight = weights.get(name)
        if weight is not None and not weight.is_contiguous():
            weight.data = weight.data.contiguous()


# ------------------------------------------------------------------------------------------------
# Public API
# ------------------------------------------------------------------------------------------------
def patch_model(model: nn.Module, *, channels_last: bool = True) -> PatchReport:
    """Fuse the GroupNorm + activation pairs of ``model`` in place (see the module docstring for the patterns).

    State_dict keys, shapes and Parameter objects do not change: checkpoints load both ways (strict) and
    ``save_pretrained`` writes what stock diffusers reads. Outputs equal the stock model's up to rounding: on CPU,
    or for inputs the kernels do not take, GroupNormAct computes exactly F.group_norm then the activation.
    Calling it again fuses only what is new (report.already_patched lists the rest). accelerate hooks
    (enable_model_cpu_offload, cpu_offload, dispatch_model) may be attached before or after; forward hooks on a
    GroupNorm or on the activation it would absorb keep that pair unfused. A patched block relies on its fused
    norms: replace submodules of a patched model only after unpatch_model. A fused nn.Sequential pair assumes its
    items run in order (calling the Sequential, or iterating over it); calling the GroupNorm item alone then
    applies the activation too.

    Args:
        model: any torch.nn.Module, e.g. a diffusers UNet2DConditionModel or AutoencoderKL.
        channels_last: also give the 4-D Conv2d/ConvTranspose2d weights the channels_last memory format, so
            activations flow NHWC through the network (what the CUDA kernels read). Other tensors (Conv3d
            weights included) keep their layout. unpatch_model converts the weights back.

    Returns:
        PatchReport: fused, already fused and skipped GroupNorms (qualified names), conv weights converted.
    """
    surgery = _Surgery(model, channels_last)
    unfusable_prefix = None  # the qualified name of the _UNFUSABLE module whose subtree is being walked
    for name, module in model.named_modules():
        if unfusable_prefix is not None and name.startswith(unfusable_prefix + "."):
            continue
        unfusable_prefix = None
        kind = type(module)
        if kind in _UNFUSABLE:
            surgery.report.skipped.append((name, _UNFUSABLE[kind]))
            unfusable_prefix = name
        elif kind in _RULES:
            _RULES[kind](surgery, name, module)
        elif (isinstance(module, nn.GroupNorm) and not isinstance(module, GroupNormAct)
              and id(module) not in surgery.seen):
            surgery.note(surgery.report.skipped, name, module, _unknown_use(model, name))
    version_skips = [reason for _, reason in surgery.report.skipped if _VERSION_SKIP in reason]
    if version_skips:
        warnings.warn(f"gn_patch: {len(version_skips)} GroupNorm(s) left unfused: {version_skips[0]}",
                      RuntimeWarning, stacklevel=2)
    if channels_last:
        converted = _make_conv_weights_channels_last(model)
        surgery.report.channels_last = len(converted)
        if converted:
            setattr(model, _LAYOUT_FLAG, tuple(model.__dict__.get(_LAYOUT_FLAG, ())) + tuple(converted))
    return surgery.report


def _check_unpatchable(model: nn.Module, prefix: str = "") -> None:
    """Raise the ValueError :func:`unpatch_model` would raise for ``model``, changing nothing (module names in the
    message prefixed by ``prefix``, e.g. a pipeline component's name)."""
    if isinstance(model, _FusedGroupNorm) and model.activation != "identity":
        raise ValueError("unpatch_model: this GroupNorm was fused with the activation its parent module applies after "
                         "it; unpatch the parent (or the whole model) so that the activation comes back too")
    # A wrapper that captured a patched forward (diffusers' HookRegistry, group offloading, ...) would keep calling
    # it after the class switch back: refuse before changing anything.
    wrapped = [".".join(filter(None, (prefix, name))) or "<root>" for name, module in model.named_modules()
               if type(module) in _ORIGINAL_CLASS and _forward_override_problem(module)]
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
        original = _ORIGINAL_CLASS.get(type(module))
        if original is nn.GroupNorm:
            _unfuse_norm(module)
            restored += 1
        elif original is not None:
            _set_class(module, original)
        for key, child in list(module._modules.items()):
            if isinstance(child, _FusedActivation):
                child.original.train(child.training)
                setattr(module, key, child.original)
        if _LAYOUT_FLAG in module.__dict__:
            _restore_conv_weights(module, module.__dict__[_LAYOUT_FLAG])
            delattr(module, _LAYOUT_FLAG)
    return restored
