"""Rules for the autoencoders of diffusers.models.autoencoders (video VAEs above all) and LTX's latent upsamplers.

Each line declares what a forward of diffusers 0.42.1 does after its GroupNorms (see gn_patch.rules.fusion):
``activations`` the norm fuses, ``alone`` norms whose output feeds convolutions or elementwise ops (any layout),
``output`` the norm a wrapper returns. The digest pins the source that was read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.models.autoencoders import (autoencoder_kl_allegro as allegro, autoencoder_kl_cogvideox as cogvideox,
                                           autoencoder_kl_cosmos as cosmos,
                                           autoencoder_kl_hunyuan_video as hunyuan_video,
                                           autoencoder_kl_hunyuanimage as hunyuan_image, autoencoder_kl_kvae as kvae,
                                           autoencoder_kl_kvae_video as kvae_video,
                                           autoencoder_kl_ltx2_audio as ltx2_audio, autoencoder_kl_magvit as magvit,
                                           autoencoder_kl_minimax_h3 as minimax, autoencoder_kl_mochi as mochi,
                                           autoencoder_kl_temporal_decoder as temporal_decoder, vae)
from diffusers.pipelines.ltx import modeling_latent_upsampler as ltx_upsampler
from diffusers.pipelines.ltx2 import latent_upsampler as ltx2_upsampler

from ..ops import _group_norm_act
from .base import forward_override_problem, rule, set_class, stands_in_for, unverified, verified
from .fusion import (ACTIVATION_NORMS, ZQ_LIKE_F_2D, ZQ_LIKE_F_3D, activation_function, fused_norm_alone, fusion,
                     pairs, unscaled)

_NORMS = {"norm1": "self.nonlinearity", "norm2": "self.nonlinearity"}
_CONV_OUT = {"conv_norm_out": "conv_act"}

# CogVideoX: the encoder's blocks take GroupNorms; the decoder's take CogVideoXSpatialNorm3D (norm * conv_y(zq) +
# conv_b(zq), a modulation by a full tensor), whose GroupNorm runs alone.
fusion(cogvideox.CogVideoXResnetBlock3D, "024ca7182ddaa74e", activations=_NORMS)
fusion(cogvideox.CogVideoXSpatialNorm3D, "3e71f9b39e88e3a3", alone={"norm_layer"}, rewrites={
    "zq = torch.cat([z_first, z_rest], dim=2)": "zq = torch.cat([z_first, z_rest], dim=2)" + ZQ_LIKE_F_3D,
    "zq = F.interpolate(zq, size=f.shape[-3:])": "zq = F.interpolate(zq, size=f.shape[-3:])" + ZQ_LIKE_F_3D})
pairs(cogvideox.CogVideoXEncoder3D, "0ec8a01c953cea50", {"norm_out": "conv_act"})

# HunyuanVideo: each block starts with `hidden_states.contiguous()`, an NCDHW copy of channels_last_3d input.
fusion(hunyuan_video.HunyuanVideoResnetBlockCausal3D, "ac45584f70c52ac0", activations=_NORMS, rewrites={
    "hidden_states = hidden_states.contiguous()":
        "hidden_states = hidden_states.contiguous(memory_format=torch.channels_last_3d if hidden_states.stride(1) == 1 "
        "else torch.contiguous_format)"})
pairs(hunyuan_video.HunyuanVideoEncoder3D, "fe186d1d5223ce0f", _CONV_OUT)
pairs(hunyuan_video.HunyuanVideoDecoder3D, "d1095b37b2235596", _CONV_OUT)

# HunyuanVideo's causal convolutions pad with F.pad(mode="replicate"), whose CUDA kernel returns NCDHW from
# channels_last_3d input and reads that input across its channel stride: on the H200 the padding took 58 ms of the
# 146 ms decode, plus 29 ms for the convolution to convert its input back to NDHWC. The patched class pads a
# channels_last_3d input by copies that keep its layout (the same values).
verified(hunyuan_video.HunyuanVideoCausalConv3d.forward, "fc886fe0a66eb125")


def replicate_pad_channels_last_3d(x: torch.Tensor, pad: tuple[int, ...]) -> torch.Tensor:
    """``F.pad(x, pad, mode="replicate")`` for a 5-D ``x``, returned channels_last_3d: the input copied into the
    middle of a new tensor, then each border filled from its edge slice (last dim, then height, then depth, so the
    corners replicate as F.pad's do). Pure copies: bitwise the same values, gradients through autograd.

    Args:
        x: (N, C, D, H, W), any floating dtype and layout (channels_last_3d is the one it is for).
        pad: (left, right, top, bottom, front, back), each >= 0, in F.pad's order (last dim first).
    Returns:
        (N, C, D + front + back, H + top + bottom, W + left + right), channels_last_3d.
    """
    left, right, top, bottom, front, back = pad
    n, c, d, h, w = x.shape
    out = torch.empty((n, c, d + front + back, h + top + bottom, w + left + right), dtype=x.dtype, device=x.device,
                      memory_format=torch.channels_last_3d)
    frames, rows = slice(front, front + d), slice(top, top + h)
    out[:, :, frames, rows, left:left + w] = x
    out[:, :, frames, rows, :left] = x[..., :1]
    out[:, :, frames, rows, left + w:] = x[..., -1:]
    out[:, :, frames, :top] = out[:, :, frames, top:top + 1]
    out[:, :, frames, top + h:] = out[:, :, frames, top + h - 1:top + h]
    out[:, :, :front] = out[:, :, front:front + 1]
    out[:, :, front + d:] = out[:, :, front + d - 1:front + d]
    return out


@stands_in_for(hunyuan_video.HunyuanVideoCausalConv3d)
class _ChannelsLastHunyuanVideoCausalConv3d(hunyuan_video.HunyuanVideoCausalConv3d):
    """HunyuanVideoCausalConv3d whose replicate padding of a channels_last_3d input keeps that layout."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        pad = self.time_causal_padding
        if (self.pad_mode == "replicate" and hidden_states.dim() == 5 and hidden_states.stride(1) == 1
                and not hidden_states.is_contiguous() and hidden_states.numel() > 0 and min(pad) >= 0):
            hidden_states = replicate_pad_channels_last_3d(hidden_states, pad)
        else:
            hidden_states = F.pad(hidden_states, pad, mode=self.pad_mode)
        return self.conv(hidden_states)


@rule(hunyuan_video.HunyuanVideoCausalConv3d, _ChannelsLastHunyuanVideoCausalConv3d)
def hunyuan_causal_conv(s, name, conv) -> None:
    """Switch a stock HunyuanVideoCausalConv3d (its forward as read, no instance-level wrapper) to the class above."""
    if (type(conv) is hunyuan_video.HunyuanVideoCausalConv3d and unverified(type(conv).forward) is None
            and forward_override_problem(conv) is None):
        set_class(conv, _ChannelsLastHunyuanVideoCausalConv3d)

# Magvit (EasyAnimate): with spatial_group_norm the frames are folded into the batch around each norm.
fusion(magvit.EasyAnimateResidualBlock3D, "1a2e2ce1efe4be1b", activations=_NORMS,
       rewrites=unscaled("return (hidden_states + shortcut) / self.output_scale_factor"))
pairs(magvit.EasyAnimateEncoder, "d6b80dc9987477e1", _CONV_OUT)
pairs(magvit.EasyAnimateDecoder, "f08baa3c2d729571", _CONV_OUT)

# Mochi: per-frame GroupNorm over chunks of frames, concatenated (an elementwise activation commutes with that).
fusion(mochi.MochiChunkedGroupNorm3D, "e1f4cafa0eed97bb", output="norm_layer")
fusion(mochi.MochiResnetBlock3D, "aeb4d899ab9d8fca", activations=_NORMS)
fusion(mochi.MochiEncoder3D, "321540ed0af8a234", activations={"norm_out": "self.nonlinearity"})

# Cosmos: the causal GroupNorm folds the frames into the batch when num_groups == 1; F.silu after it.
fusion(cosmos.CosmosCausalGroupNorm, "32a5bbf864bd5e52", output="norm")
fusion(cosmos.CosmosResnetBlock3d, "0356c5c7c912fb8c", activations={"norm1": "F.silu", "norm2": "F.silu"})
fusion(cosmos.CosmosEncoder3d, "2cae85382760e4b8", activations={"norm_out": "F.silu"})
fusion(cosmos.CosmosDecoder3d, "35b6e2afd756ec30", activations={"norm_out": "F.silu"})
fusion(cosmos.CosmosCausalAttention, "e0d3e482769f3cd5", alone={"norm"})  # its processors: norm -> to_q/k/v convs

# KVAE (image): the decoder's blocks take spatial norms, like CogVideoX's.
fusion(kvae.KVAEResnetBlock2D, "e309708cff41f518", activations=_NORMS)
fusion(kvae.KVAEDecoderSpatialNorm2D, "488cd61acc1187db", alone={"norm_layer"}, rewrites={
    "zq = F.interpolate(zq, size=f_first_size, mode='nearest')":
        "zq = F.interpolate(zq, size=f_first_size, mode='nearest')" + ZQ_LIKE_F_2D})
pairs(kvae.KVAEEncoder2D, "ea7da2663494e056", {"norm_out": "nonlinearity"})

# KVAE (video): cached GroupNorm wrappers; `nonlinearity(x)` is F.silu(x).
activation_function(kvae_video.nonlinearity, "33c72ba8ff780276", "silu")
fusion(kvae_video.KVAECachedGroupNorm, "a9102c125c92e170", output="norm_layer")
fusion(kvae_video.KVAECachedSpatialNorm3D, "0eb2e46e495d255b", alone={"norm_layer"})
fusion(kvae_video.KVAECachedResnetBlock3D, "c53b38f2a5f9ba77", activations={"norm1": "F.silu", "norm2": "F.silu"})
fusion(kvae_video.KVAECachedEncoder3D, "dc3c0fd7cb01fdfc", activations={"norm_out": "nonlinearity"})

# HunyuanImage
fusion(hunyuan_image.HunyuanImageResnetBlock, "5ee9679698f88c06", activations=_NORMS)
fusion(hunyuan_image.HunyuanImageAttentionBlock, "3b35ffa410104162", alone={"norm"})
pairs(hunyuan_image.HunyuanImageEncoder2D, "a50500cdc5aa58fe", {"norm_out": "nonlinearity"})
pairs(hunyuan_image.HunyuanImageDecoder2D, "f07838490f127e73", {"norm_out": "nonlinearity"})

# LTX-2 audio VAE (norm_type="group")
fusion(ltx2_audio.LTX2AudioResnetBlock, "213111054f8ac616",
       activations={"norm1": "self.non_linearity", "norm2": "self.non_linearity"})
fusion(ltx2_audio.LTX2AudioAttnBlock, "d2e310f46e720177", alone={"norm"})
pairs(ltx2_audio.LTX2AudioEncoder, "765883679d8bc253", {"norm_out": "non_linearity"})
pairs(ltx2_audio.LTX2AudioDecoder, "89d0e06c373a19ec", {"norm_out": "non_linearity"})

# Allegro (its temporal convolutions are nn.Sequential(GroupNorm, SiLU, ...): the Sequential rule), SVD's
# temporal decoder, the asymmetric VAE's mask-conditioned decoder.
pairs(allegro.AllegroEncoder3D, "0e726f03dd40497e", _CONV_OUT)
pairs(allegro.AllegroDecoder3D, "eb6ea85e4a4d8789", _CONV_OUT)
pairs(temporal_decoder.TemporalDecoder, "4016e54965c0b561", _CONV_OUT)
pairs(vae.MaskConditionDecoder, "735780846caedc36", _CONV_OUT)

# LTX / LTX-2 latent upsamplers: in ResBlock, norm2's output is added to the residual before the activation.
fusion(ltx_upsampler.ResBlock, "d35484f431b11bde", activations={"norm1": "self.activation"}, alone={"norm2"})
fusion(ltx2_upsampler.ResBlock, "d35484f431b11bde", activations={"norm1": "self.activation"}, alone={"norm2"})
pairs(ltx_upsampler.LTXLatentUpsamplerModel, "75ecfde01f100546", {"initial_norm": "initial_activation"})
pairs(ltx2_upsampler.LTX2LatentUpsamplerModel, "75ecfde01f100546", {"initial_norm": "initial_activation"})

# MiniMax-H3: a GroupNorm subclass that normalizes each frame alone (frames folded into the batch).
verified(minimax.MiniMaxH3VideoGroupNorm.forward, "cb05055d2765c60f")


@stands_in_for(minimax.MiniMaxH3VideoGroupNorm, added_state=("activation",))
class _FusedMiniMaxH3VideoGroupNorm(minimax.MiniMaxH3VideoGroupNorm):
    """MiniMaxH3VideoGroupNorm computing its per-frame GroupNorm and (``activation``) the activation after it as
    one gn_patch op. The frames are folded into the batch by views, not copies, so a channels_last_3d input reaches
    the kernels as one; the output is the same values in that layout (the module's users take any)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch_size, num_channels, num_frames, height, width = hidden_states.shape
        hidden_states = hidden_states.permute(0, 2, 1, 3, 4).reshape(batch_size * num_frames, num_channels, 1,
                                                                     height, width)
        hidden_states = _group_norm_act(hidden_states, self.num_groups, self.weight, self.bias, self.eps,
                                        self.activation)
        return hidden_states.reshape(batch_size, num_frames, num_channels, height, width).permute(0, 2, 1, 3, 4)


ACTIVATION_NORMS[minimax.MiniMaxH3VideoGroupNorm] = _FusedMiniMaxH3VideoGroupNorm


@rule(minimax.MiniMaxH3VideoGroupNorm, _FusedMiniMaxH3VideoGroupNorm)
def minimax_group_norm(s, name, norm) -> None:
    """A MiniMaxH3VideoGroupNorm no block fused an activation into."""
    fused_norm_alone(s, name, norm, "MiniMaxH3VideoGroupNorm")


fusion(minimax.MiniMaxH3VideoResnetBlock3d, "3c35d48ab8f97045", activations={"norm1": "F.silu", "norm2": "F.silu"})
fusion(minimax.MiniMaxH3VideoEncoder3d, "5c6b24c5b4afc6e4", activations={"norm_out": "F.silu"})
