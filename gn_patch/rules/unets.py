"""Rules for the UNets (2D, 3D, motion, 1D, Kandinsky 3, ...) and for the output layers of the AutoencoderKL
Encoder/Decoder."""

from __future__ import annotations

import torch
from diffusers.models.autoencoders.vae import Decoder, Encoder
from diffusers.models.controlnets.controlnet_xs import UNetControlNetXSModel
from diffusers.models.unets.unet_1d_blocks import OutConv1DBlock, ResConvBlock, SelfAttention1d
from diffusers.models.unets.unet_2d import UNet2DModel
from diffusers.models.unets.unet_2d_blocks import AttnSkipUpBlock2D, SkipUpBlock2D
from diffusers.models.unets.unet_2d_condition import UNet2DConditionModel
from diffusers.models.unets.unet_3d_condition import UNet3DConditionModel
from diffusers.models.unets.unet_dreamlite import DreamLiteUNetModel, ResnetBlock2DDreamLite
from diffusers.models.unets.unet_i2vgen_xl import I2VGenXLUNet
from diffusers.models.unets.unet_kandinsky3 import Kandinsky3Block, Kandinsky3ConditionalGroupNorm, Kandinsky3UNet
from diffusers.models.unets.unet_motion_model import AnimateDiffTransformer3D, UNetMotionModel
from diffusers.models.unets.unet_spatio_temporal_condition import UNetSpatioTemporalConditionModel
from diffusers.models.transformers.transformer_temporal import TransformerTemporalModel
from diffusers.pipelines.audioldm2.modeling_audioldm2 import AudioLDM2UNet2DConditionModel
from diffusers.pipelines.deprecated.versatile_diffusion.modeling_text_unet import (ResnetBlockFlat,
                                                                                   UNetFlatConditionModel)

from .base import FusedGroupNorm, runs_forward_only
from .fusion import fusion, pairs
from .resnet import RESIDUAL_SUM

# Forwards that end with `sample = self.conv_norm_out(sample); sample = self.conv_act(sample)` and use conv_act
# nowhere else (conv_norm_out is None in UNet2DConditionModel(norm_num_groups=None), a SpatialNorm in MoVQ's
# Decoder: the rule passes over those).
_CONV_OUT = {"conv_norm_out": "conv_act"}
pairs(UNet2DConditionModel, "55ffdaac232f9154", _CONV_OUT)
pairs(UNet2DModel, "ebfc8e9db1c6b9a1", _CONV_OUT)
pairs(UNetSpatioTemporalConditionModel, "4786ee948fcc6aca", _CONV_OUT)
pairs(Encoder, "f58ee1b44a5e3da4", _CONV_OUT)
pairs(Decoder, "9f0ef7b3671ff01b", _CONV_OUT)

# The other UNets: conv_norm_out -> conv_act at the end, conv_act nowhere else.
pairs(UNet3DConditionModel, "7bf71b5685b3bde2", _CONV_OUT)
pairs(I2VGenXLUNet, "1a40a2f0afbec67f", _CONV_OUT)
pairs(UNetMotionModel, "badbf37375de2ae3", _CONV_OUT)
pairs(AudioLDM2UNet2DConditionModel, "ab2f2ad9e75d7d73", _CONV_OUT)
pairs(UNetFlatConditionModel, "44d98a4d5fd095e5", _CONV_OUT)
pairs(DreamLiteUNetModel, "55ffdaac232f9154", _CONV_OUT)  # UNet2DConditionModel.forward
pairs(Kandinsky3UNet, "a017fa1d464add57", {"conv_norm_out": "conv_act_out"})
pairs(UNetControlNetXSModel, "cbd79dcd015baca9", {"base_conv_norm_out": "base_conv_act"})

# NCSN++ (score SDE) up blocks: the skip branch's norm -> act -> conv, act used there only.
pairs(AttnSkipUpBlock2D, "7232330bf83cc478", {"skip_norm": "act"})
pairs(SkipUpBlock2D, "e54d2ef6d71706a0", {"skip_norm": "act"})

# Versatile Diffusion's text UNet: the 2D resnet block on (B, C·k, 1, 1) views.
fusion(ResnetBlockFlat, "14558da9f7039103", activations={"norm1": "self.nonlinearity", "norm2": "self.nonlinearity"})
# DreamLite: ResnetBlock2D's code with a `scale_shift` branch of its own.
fusion(ResnetBlock2DDreamLite, "638519721cbc8643",
       activations={"norm1": "self.nonlinearity", "norm2": "self.nonlinearity"}, modulated={"norm2"},
       modulated_if=lambda block: block.time_embedding_norm == "scale_shift",
       rewrites=RESIDUAL_SUM)

def norm_in_row_order(block, hidden_states: torch.Tensor) -> torch.Tensor:
    """``block.norm(hidden_states)`` on (B, C, F, H, W), called with ``frames_last=True`` (its output's memory in
    the (B·H·W, F, C) row order proj_in reads) where that changes only where the values lie: the norm is the
    GroupNormAct the surgeon made of it and runs as it is (hooks would see another layout; a norm unpatched,
    parametrized or left stock takes no frames_last), and B, F and H·W are above 1, where stock's reshape copies the
    rows into that order (elsewhere it is a view, whose strides send PyTorch's linear down another path: a matmul,
    then the bias added in a second rounding)."""
    norm = block.norm
    batch, _, frames, height, width = hidden_states.shape
    if type(norm) is FusedGroupNorm and runs_forward_only(norm) and batch > 1 and frames > 1 and height * width > 1:
        return norm(hidden_states, frames_last=True)
    return norm(hidden_states)


# The temporal transformers (AnimateDiff's motion modules, UNet3D's and I2VGen-XL's temp_attentions): norm ->
# permute/reshape -> proj_in (a Linear), which reads the norm's output as (B·H·W, F, C) rows: a copy, unless the
# norm writes it in that order (norm_in_row_order: the kernels do, at no cost; elsewhere the op copies instead of
# the reshape). Stock writes their output (B, F, C, H, W) (`.contiguous()`, an NCHW copy that the next layers convert
# back), then adds the residual in a second pass. From channels-last input the residual is added to the
# (B, F, C, H, W) view of proj_out's (B·H·W, F, C) rows directly: one pass, its output in the residual's layout
# (channels_last). The same values: the norm's are only placed elsewhere, and float addition is commutative.
_TEMPORAL_LAYOUT = {
    "hidden_states = self.norm(hidden_states)": "hidden_states = self.norm_in_row_order(hidden_states)",
    "hidden_states = hidden_states[None, None, :].reshape(batch_size, height, width, num_frames, channel)"
    ".permute(0, 3, 4, 1, 2).contiguous()\n"
    "hidden_states = hidden_states.reshape(batch_frames, channel, height, width)\n"
    "output = hidden_states + residual":
        "hidden_states = hidden_states[None, None, :].reshape(batch_size, height, width, num_frames, channel)"
        ".permute(0, 3, 4, 1, 2)\n"
        "if residual.stride(1) == 1:\n"
        "    output = (residual.unflatten(0, (batch_size, num_frames)) + hidden_states).flatten(0, 1)\n"
        "else:\n"
        "    output = hidden_states.contiguous().reshape(batch_frames, channel, height, width) + residual"}
fusion(AnimateDiffTransformer3D, "27dba616eaaa900e", alone={"norm"}, rewrites=_TEMPORAL_LAYOUT,
       helpers={"norm_in_row_order": norm_in_row_order})
fusion(TransformerTemporalModel, "90569d703bf1d299", alone={"norm"}, rewrites=_TEMPORAL_LAYOUT,
       helpers={"norm_in_row_order": norm_in_row_order})

# Kandinsky 3: `self.norm(x) * (scale + 1.0) + shift` with a per-sample scale/shift from the timestep; its blocks
# apply SiLU after it (Kandinsky3Block), or use it alone (Kandinsky3AttentionBlock: reshape, attention / a conv).
fusion(Kandinsky3ConditionalGroupNorm, "25c421f57f5bb3d8", modulated={"norm"}, output="norm")
fusion(Kandinsky3Block, "396ba875f3cec136", activations={"group_norm": "self.activation"})

# UNet1D (Dance Diffusion, reinforcement-learning configs): GELU on (B, C, L); SelfAttention1d: norm -> transpose ->
# Linear layers.
pairs(ResConvBlock, "692d29b876c5288e", {"group_norm_1": "gelu_1", "group_norm_2": "gelu_2"})
pairs(OutConv1DBlock, "bcdf212d3478b9db", {"final_conv1d_gn": "final_conv1d_act"})
fusion(SelfAttention1d, "abdd88a389cb9a87", alone={"group_norm"})
