"""Rules for diffusers.models.resnet and diffusers.models.normalization: the resnet blocks, AdaGroupNorm."""

from __future__ import annotations

import torch
from torch import nn
from diffusers.models.normalization import AdaGroupNorm
from diffusers.models.resnet import Conv1dBlock, ResnetBlock2D, ResnetBlockCondNorm2D, TemporalResnetBlock

from .. import extension
from ..ops import ACTIVATIONS, _group_norm_act
from .base import Surgery, rule, runs_forward_only, stands_in_for, verified
from .fusion import ACTIVATION_NORMS, fused_norm_alone, fusion, pairs, unscaled

# The residual sum's division by output_scale_factor, skipped where that is 1.0.
RESIDUAL_SUM = unscaled("output_tensor = (input_tensor + hidden_states) / self.output_scale_factor")


def conv1_without_bias(block: ResnetBlock2D, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(block.conv1(hidden_states), None)``; or, where norm2 can add conv1's bias itself with stock's values
    (conv1_bias_folds), ``(conv1(hidden_states) without its bias, the bias (C,) in the output's dtype)``, for
    norm2's input_bias."""
    return _without_bias(block.conv1, hidden_states, conv1_bias_folds(block, hidden_states))


def conv2_without_bias(block: ResnetBlock2D, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(block.conv2(hidden_states), None)``; or, where the residual sum can add conv2's bias itself
    (conv2_bias_folds), ``(conv2(hidden_states) without its bias, the bias (C,) in the output's dtype)``, for
    residual_sum_with_bias."""
    return _without_bias(block.conv2, hidden_states, conv2_bias_folds(block, hidden_states))


def _without_bias(conv: nn.Conv2d, hidden_states: torch.Tensor, folds: bool):
    if not folds:
        return conv(hidden_states), None
    output = conv._conv_forward(hidden_states, conv.weight, None)
    return output, conv.bias.to(output.dtype)  # autocast casts a convolution's bias likewise


def conv1_bias_folds(block: ResnetBlock2D, hidden_states: torch.Tensor) -> bool:
    """Whether norm2's kernels can add conv1's bias with stock's values (conv_bias_folds), and norm2 runs as it is
    (no hooks of its own or global ones, no forward set on the instance: its hooks would see its input without the
    bias)."""
    return conv_bias_folds(block.conv1, hidden_states) and runs_forward_only(block.norm2)


def conv2_bias_folds(block: ResnetBlock2D, hidden_states: torch.Tensor) -> bool:
    """Whether the residual sum can add conv2's bias in its pass (gn_patch::bias_residual_add) with stock's values
    (conv_bias_folds): also an output_scale_factor of 1.0 (a Python number: the division is skipped, as RESIDUAL_SUM
    skips it) and gn_patch's CUDA kernels loaded."""
    factor = block.output_scale_factor
    return (isinstance(factor, (int, float)) and factor == 1.0 and conv_bias_folds(block.conv2, hidden_states)
            and extension.kernels_available())


def conv_bias_folds(conv: nn.Module, hidden_states: torch.Tensor) -> bool:
    """Whether the kernel after ``conv`` can add its bias with stock's values, and it saves work.

    On CUDA, PyTorch adds a cuDNN convolution's bias in a pass of its own over the output (at::_convolution's
    ``output.add_(bias)``); gn_patch's kernels add it as they load the output, rounded as that add rounds, so what
    they compute from it is what stock computes. Folded only where that holds: a CUDA input with cuDNN enabled;
    ``conv`` a plain nn.Conv2d (groups 1: no depthwise kernel, which adds the bias itself) whose forward and
    _conv_forward are PyTorch's (LoRA loaders replace them on the class), with a bias of the weight's dtype (else
    stock's call raises); ``conv`` runs as it is (no hooks of its own or global ones, no forward set on the instance:
    accelerate's and diffusers' offloading, FSDP); no gradient recorded (a training step gains nothing: the adds are
    PyTorch's there); not while torch.compile or torch.export traces (their graphs place the bias themselves).
    """
    return (hidden_states.is_cuda and type(conv) is nn.Conv2d and conv.bias is not None and conv.groups == 1
            and conv.bias.dtype == conv.weight.dtype and _pytorch_conv2d(conv) and not torch.compiler.is_compiling()
            and torch.backends.cudnn.enabled and runs_forward_only(conv)
            and not (torch.is_grad_enabled()
                     and (hidden_states.requires_grad or conv.weight.requires_grad or conv.bias.requires_grad)))


def residual_sum_with_bias(block: ResnetBlock2D, input_tensor: torch.Tensor, hidden_states: torch.Tensor,
                           conv2_bias: torch.Tensor) -> torch.Tensor:
    """Stock's ``input_tensor + conv2(h)`` from conv2's output without its bias (conv2_without_bias folded it,
    output_scale_factor being 1.0): both adds in one pass (gn_patch::bias_residual_add, which takes the two adds
    itself where the layouts differ); PyTorch's adds where the residual records a gradient (the op is not
    differentiable; conv2's input records none, or the bias would not have been folded, but the residual may: a
    trainable conv_shortcut)."""
    if torch.is_grad_enabled() and input_tensor.requires_grad:
        return input_tensor + (hidden_states + conv2_bias.view(1, -1, 1, 1))
    return torch.ops.gn_patch.bias_residual_add(input_tensor, hidden_states, conv2_bias)


def _pytorch_conv2d(conv: nn.Conv2d) -> bool:
    """nn.Conv2d's forward and _conv_forward are PyTorch's own, and ``conv`` replaces neither."""
    return ("_conv_forward" not in conv.__dict__
            and getattr(nn.Conv2d.forward, "__module__", None) == "torch.nn.modules.conv"
            and getattr(nn.Conv2d._conv_forward, "__module__", None) == "torch.nn.modules.conv")


def norm2_hooked(block: ResnetBlock2D) -> bool:
    """norm2's call would do more than its forward (hooks, an instance forward): it must see stock's input."""
    return not runs_forward_only(block.norm2)


# conv1's bias (conv1_without_bias) and, in time_embedding_norm="default" blocks, the timestep embedding (N, C, 1, 1),
# added to conv1's output before norm2, become norm2's input_bias and input_offset: the kernels add them as they load
# the output, which saves a pass over the block's tensor (a read and a write) and a launch each. Where norm2 has
# hooks (its own or global ones, registered before or after patching) or a forward set on the instance, it gets the
# sums, as in stock: the adds stay (a folded bias means conv1_bias_folds found norm2 without them: not asked again).
# The other branches ("scale_shift", whose modulation joins the call too, and
# "group", the VAE decoders') normalise conv1's output directly.
TEMB_OFFSET = {
    "hidden_states = self.conv1(hidden_states)": "hidden_states, conv1_bias = self.conv1_without_bias(hidden_states)",
    "if temb is not None:\n    hidden_states = hidden_states + temb\nhidden_states = self.norm2(hidden_states)":
        "if temb is not None and conv1_bias is None and self.norm2_hooked():\n"
        "    hidden_states = hidden_states + temb\n"
        "    hidden_states = self.norm2(hidden_states)\n"
        "else:\n"
        "    hidden_states = self.norm2(hidden_states, input_offset=temb, input_bias=conv1_bias)",
    'if self.time_embedding_norm == "scale_shift":\n'
    "    if temb is None:\n"
    '        raise ValueError(f" `temb` should not be None when `time_embedding_norm` is {self.time_embedding_norm}")\n'
    "    time_scale, time_shift = torch.chunk(temb, 2, dim=1)\n"
    "    hidden_states = self.norm2(hidden_states)\n"
    "    hidden_states = hidden_states * (1 + time_scale) + time_shift\n"
    "else:\n"
    "    hidden_states = self.norm2(hidden_states)":
        'if self.time_embedding_norm == "scale_shift":\n'
        "    if temb is None:\n"
        '        raise ValueError(f" `temb` should not be None when `time_embedding_norm` is '
        '{self.time_embedding_norm}")\n'
        "    time_scale, time_shift = torch.chunk(temb, 2, dim=1)\n"
        "    hidden_states = self.norm2(hidden_states, input_bias=conv1_bias)\n"
        "    hidden_states = hidden_states * (1 + time_scale) + time_shift\n"
        "else:\n"
        "    hidden_states = self.norm2(hidden_states, input_bias=conv1_bias)",
}
# conv2's bias (conv2_without_bias), added by the residual sum's pass (residual_sum_with_bias) instead of a pass of
# its own; elsewhere the residual sum as RESIDUAL_SUM writes it.
_RESIDUAL = "output_tensor = (input_tensor + hidden_states) / self.output_scale_factor"
CONV2_BIAS = {
    "hidden_states = self.conv2(hidden_states)": "hidden_states, conv2_bias = self.conv2_without_bias(hidden_states)",
    _RESIDUAL: "if conv2_bias is None:\n"
               f"    {RESIDUAL_SUM[_RESIDUAL]}\n"
               "else:\n"
               "    output_tensor = self.residual_sum_with_bias(input_tensor, hidden_states, conv2_bias)",
}
# norm1 -> nonlinearity; norm2 (with conv1's bias and the timestep shift as its input terms, or conv1's bias and the
# timestep scale/shift of time_embedding_norm="scale_shift" merged into the call) -> nonlinearity.
# self.nonlinearity also acts on temb.
fusion(ResnetBlock2D, "eda498bf0236feb0",
       activations={"norm1": "self.nonlinearity", "norm2": "self.nonlinearity"}, modulated={"norm2"},
       modulated_if=lambda block: block.time_embedding_norm == "scale_shift", rewrites={**CONV2_BIAS, **TEMB_OFFSET},
       helpers={"conv1_without_bias": conv1_without_bias, "norm2_hooked": norm2_hooked,
                "conv2_without_bias": conv2_without_bias, "residual_sum_with_bias": residual_sum_with_bias})
# The 5-D blocks of Stable Video Diffusion.
fusion(TemporalResnetBlock, "7c1ebea7613ebc9f",
       activations={"norm1": "self.nonlinearity", "norm2": "self.nonlinearity"})
# norm1/norm2 are AdaGroupNorm (fused below) or SpatialNorm (its own rule: the modulation by the latent comes
# between the normalization and the activation).
fusion(ResnetBlockCondNorm2D, "b82e6799b20e46d8",
       activations={"norm1": "self.nonlinearity", "norm2": "self.nonlinearity"}, rewrites=RESIDUAL_SUM)
# UNet1D reinforcement-learning blocks: Conv1d -> GroupNorm (on the (B, C, 1, L) view) -> Mish.
pairs(Conv1dBlock, "5dd5cd3294134f5e", {"group_norm": "mish"})

verified(AdaGroupNorm.forward, "08a3993270b2378a")


@stands_in_for(AdaGroupNorm, added_state=("activation",))
class _FusedAdaGroupNorm(AdaGroupNorm):
    """AdaGroupNorm whose GroupNorm, timestep scale/shift and (with ``activation`` set by the surgeon) following
    activation run as one gn_patch op."""

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4:
            # Stock's (N, C, 1, 1) scale and shift broadcast against other ranks' trailing dims, not per (image,
            # channel) as the op applies them: those inputs take stock's arithmetic (or its error), then the
            # activation fused into this norm.
            return ACTIVATIONS[self.activation](super().forward(x, emb))
        # diffusers 0.42.1 AdaGroupNorm.forward; F.group_norm and `x * (1 + scale) + shift` become one call.
        if self.act:
            emb = self.act(emb)
        emb = self.linear(emb)
        emb = emb[:, :, None, None]
        scale, shift = emb.chunk(2, dim=1)
        # The op layer, as GroupNormAct.forward: the arguments were checked and the activation made canonical once.
        return _group_norm_act(x, self.num_groups, None, None, self.eps, self.activation, scale, shift)


ACTIVATION_NORMS[AdaGroupNorm] = _FusedAdaGroupNorm


@rule(AdaGroupNorm, _FusedAdaGroupNorm)
def ada_group_norm(s: Surgery, name: str, norm: AdaGroupNorm) -> None:
    """An AdaGroupNorm no block fused an activation into: its scale/shift still joins the normalization."""
    fused_norm_alone(s, name, norm, "AdaGroupNorm+scale_shift")

