"""Rules for the GroupNorms used on their own in attention layers and spatial transformers."""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import Attention, SpatialNorm
from diffusers.models.transformers.transformer_2d import Transformer2DModel
from diffusers.models.transformers.transformer_2d_dreamlite import DreamLiteTransformer2DModel
from diffusers.models.transformers.transformer_temporal import TransformerSpatioTemporalModel

from .base import (Surgery, alone, forward_override_problem, rule, set_class, source_digest, stands_in_for,
                   verified)
from .fusion import ZQ_LIKE_F_2D, fusion

# Transformer2DModel._get_output_for_continuous_inputs, mirrored by _ChannelsLastTransformer2DModel.
_VERIFIED_TRANSFORMER_OUTPUT = {"080aa7e5536f6b0c"}


@stands_in_for(Transformer2DModel)
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


_transformer_norm = alone("norm", "Transformer2DModel.norm")


@rule(Transformer2DModel, _ChannelsLastTransformer2DModel)
def transformer_2d(s: Surgery, name: str, model: Transformer2DModel) -> None:
    """The input norm (identity activation) and, with channels_last, an output that stays channels_last."""
    _transformer_norm(s, name, model)
    if (s.channels_last and type(model) is Transformer2DModel and model.is_input_continuous
            and source_digest(Transformer2DModel._get_output_for_continuous_inputs) in _VERIFIED_TRANSFORMER_OUTPUT
            and forward_override_problem(model) is None):
        set_class(model, _ChannelsLastTransformer2DModel)


_attention_group_norm = alone("group_norm", "attention.group_norm")
_attention_norm_cross = alone("norm_cross", "attention.norm_cross")


@rule(Attention)
def attention(s: Surgery, name: str, attn: Attention) -> None:
    """Every attention processor transposes (B, L, C) to (B, C, L) for ``group_norm`` and back; ``norm_cross``
    (cross_attention_norm="group_norm") likewise, in Attention.norm_encoder_hidden_states. Any layout serves."""
    _attention_group_norm(s, name, attn)
    _attention_norm_cross(s, name, attn)


# Stable Video Diffusion's transformer ends like Transformer2DModel, with an NCHW copy of its output; from
# channels-last input it keeps that layout (the permuted view already is channels_last).
fusion(TransformerSpatioTemporalModel, "c09d8a8e8e6d3251", alone={"norm"}, rewrites={
    "hidden_states = hidden_states.reshape(batch_frames, height, width, inner_dim).permute(0, 3, 1, 2).contiguous()":
        "hidden_states = hidden_states.reshape(batch_frames, height, width, inner_dim).permute(0, 3, 1, 2)"
        ".contiguous(memory_format=torch.channels_last if residual.stride(1) == 1 else torch.contiguous_format)"})

# MoVQ's spatial norm: `norm_f = self.norm_layer(f); new_f = norm_f * self.conv_y(zq) + self.conv_b(zq)`, a
# modulation by a full tensor (not per sample): the GroupNorm runs alone. The interpolated latent takes f's layout,
# so that the 1x1 conv_y/conv_b (which follow their input's layout) and the elementwise ops stay NHWC (see
# ZQ_LIKE_F_2D).
fusion(SpatialNorm, "e90292c0c0feb29b", alone={"norm_layer"}, rewrites={
    "zq = F.interpolate(zq, size=f_size, mode='nearest')":
        "zq = F.interpolate(zq, size=f_size, mode='nearest')" + ZQ_LIKE_F_2D})

# DreamLite's spatial transformer: `_operate_on_continuous_inputs` runs the norm, then proj_in (a conv or, after a
# reshape, a Linear).
verified(DreamLiteTransformer2DModel._operate_on_continuous_inputs, "cbed491d6d761209")
rule(DreamLiteTransformer2DModel)(alone("norm", "DreamLiteTransformer2DModel.norm",
                                        mirrors=DreamLiteTransformer2DModel._operate_on_continuous_inputs))
