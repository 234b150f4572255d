"""Rules for diffusers.models.resnet and diffusers.models.normalization: the resnet blocks, AdaGroupNorm."""

from __future__ import annotations

import torch
from diffusers.models.normalization import AdaGroupNorm
from diffusers.models.resnet import Conv1dBlock, ResnetBlock2D, ResnetBlockCondNorm2D, TemporalResnetBlock

from ..ops import _group_norm_act
from .base import Surgery, rule, stands_in_for, verified
from .fusion import ACTIVATION_NORMS, fused_norm_alone, fusion, pairs, unscaled

# The residual sum's division by output_scale_factor, skipped where that is 1.0.
RESIDUAL_SUM = unscaled("output_tensor = (input_tensor + hidden_states) / self.output_scale_factor")
# The timestep embedding (N, C, 1, 1) added to hidden_states before norm2 becomes norm2's input_offset: the kernels
# add it as they load hidden_states, which saves a pass over the block's tensor (a read and a write) and a launch.
# Where norm2 has forward pre-hooks (its own or global ones, registered before or after patching) they see the
# sum, as in stock: the add stays.
TEMB_OFFSET = {
    "if temb is not None:\n    hidden_states = hidden_states + temb\nhidden_states = self.norm2(hidden_states)":
        "if temb is not None and (self.norm2._forward_pre_hooks or "
        "torch.nn.modules.module._global_forward_pre_hooks):\n"
        "    hidden_states = hidden_states + temb\n"
        "    hidden_states = self.norm2(hidden_states)\n"
        "else:\n"
        "    hidden_states = self.norm2(hidden_states, input_offset=temb)",
}
# norm1 -> nonlinearity; norm2 (with the timestep shift as its input offset, or with the timestep scale/shift of
# time_embedding_norm="scale_shift" merged into the call) -> nonlinearity. self.nonlinearity also acts on temb.
fusion(ResnetBlock2D, "eda498bf0236feb0",
       activations={"norm1": "self.nonlinearity", "norm2": "self.nonlinearity"}, modulated={"norm2"},
       modulated_if=lambda block: block.time_embedding_norm == "scale_shift", rewrites={**RESIDUAL_SUM, **TEMB_OFFSET})
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

