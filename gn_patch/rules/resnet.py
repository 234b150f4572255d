"""Rules for diffusers.models.resnet and diffusers.models.normalization: the resnet blocks, AdaGroupNorm."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules import module as torch_module
from diffusers.models.normalization import AdaGroupNorm
from diffusers.models.resnet import Conv1dBlock, ResnetBlock2D, ResnetBlockCondNorm2D, TemporalResnetBlock

from ..ops import _group_norm_act
from .base import Surgery, rule, stands_in_for, verified
from .fusion import ACTIVATION_NORMS, fused_norm_alone, fusion, pairs, unscaled

# The residual sum's division by output_scale_factor, skipped where that is 1.0.
RESIDUAL_SUM = unscaled("output_tensor = (input_tensor + hidden_states) / self.output_scale_factor")


_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _runs_forward_only(module: nn.Module) -> bool:
    """Calling ``module`` would run its class's forward and nothing else: no hooks of its own or global ones
    (FSDP2's, a user's), no forward set on the instance (accelerate's offload hooks), as in
    torch.nn.Module._call_impl's fast path."""
    return not (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or "forward" in module.__dict__
                or torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks
                or torch_module._global_backward_hooks or torch_module._global_backward_pre_hooks)


def conv_and_bias(conv: nn.Module, x: torch.Tensor, fold: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(conv(x) without its bias, the bias (C,) in the output's dtype)`` when ``fold``, x is a CUDA tensor,
    ``conv`` is a plain nn.Conv2d with a bias that a call would run as is and its output is channels-last in a dtype
    the kernels take; else ``(conv(x), None)`` (a LoRA layer, hooks, offloading: the module's own call; CPU and
    other layouts: PyTorch's own values, bit for bit). On CUDA, PyTorch adds a convolution's bias in a kernel of
    its own after cuDNN's (at::_convolution's ``output.add_(bias)``); left out here, it joins the timestep offset
    that norm2's kernels add as they load the convolution's output."""
    if not (fold and x.is_cuda and type(conv) is nn.Conv2d and conv.bias is not None and _runs_forward_only(conv)):
        return conv(x), None
    y = conv._conv_forward(x, conv.weight, None)
    bias = conv.bias.to(y.dtype)  # autocast casts the bias of its convolutions likewise
    if y.dtype in _KERNEL_DTYPES and y.is_contiguous(memory_format=torch.channels_last):
        return y, bias
    return y.add_(bias.view(1, -1, 1, 1)), None  # as at::_convolution adds it after cuDNN


def timestep_offset(temb: torch.Tensor | None, conv_bias: torch.Tensor | None) -> torch.Tensor | None:
    """What norm2 adds to conv1's output: ``temb`` (N, C, 1, 1), plus conv1's bias where conv_and_bias left it out
    (summed first: one rounding of the small (N, C) sum instead of a pass over the activations)."""
    if conv_bias is None:
        return temb
    bias = conv_bias.view(1, -1, 1, 1)
    return bias if temb is None else temb + bias


# conv1's bias and the timestep embedding, both added to conv1's output before norm2, become norm2's input_offset
# in time_embedding_norm="default" blocks: the kernels add it as they load conv1's output, which saves two passes
# over the block's tensor (a read and a write each) and two launches.
TEMB_OFFSET = {
    "hidden_states = self.conv1(hidden_states)":
        "hidden_states, conv1_bias = self.conv_and_bias(self.conv1, hidden_states, "
        "self.time_embedding_norm == 'default')",
    "if temb is not None:\n    hidden_states = hidden_states + temb\nhidden_states = self.norm2(hidden_states)":
        "hidden_states = self.norm2(hidden_states, input_offset=self.timestep_offset(temb, conv1_bias))",
}
# norm1 -> nonlinearity; norm2 (with conv1's bias and the timestep shift as its input offset, or with the timestep
# scale/shift of time_embedding_norm="scale_shift" merged into the call) -> nonlinearity. self.nonlinearity also acts
# on temb.
fusion(ResnetBlock2D, "eda498bf0236feb0",
       activations={"norm1": "self.nonlinearity", "norm2": "self.nonlinearity"}, modulated={"norm2"},
       modulated_if=lambda block: block.time_embedding_norm == "scale_shift", rewrites={**RESIDUAL_SUM, **TEMB_OFFSET},
       helpers={"conv_and_bias": conv_and_bias, "timestep_offset": timestep_offset})
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

