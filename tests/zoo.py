"""The diffusers model zoo: a tiny random-weight config, with seeded inputs, of every diffusers 0.42.1 model class
that holds a GroupNorm (39 classes), for the zoo test (tests/test_zoo.py) and the README's coverage table.

``ZOO`` has one case per class (``primary``) and a few more configurations of some (``UNet1DModel-rl``: the Mish
blocks of the reinforcement-learning configs). Configs are shrunk to a few hundred thousand parameters; many
diffusers blocks hard-code 32 groups, so channel counts are multiples of 32. Adapters (MotionAdapter,
ControlNetXSAdapter) only hold the blocks their host model copies weights from: their case runs those blocks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass

import diffusers
import torch
from diffusers.models.normalization import AdaGroupNorm
from diffusers.pipelines.audioldm2.modeling_audioldm2 import AudioLDM2UNet2DConditionModel
from diffusers.pipelines.deprecated.versatile_diffusion.modeling_text_unet import UNetFlatConditionModel
from diffusers.pipelines.ltx.modeling_latent_upsampler import LTXLatentUpsamplerModel
from diffusers.pipelines.ltx2.latent_upsampler import LTX2LatentUpsamplerModel
from torch import nn

from . import tiny_models
from .tiny_models import make_model

# Where and in which floating dtype the cases make their inputs (the CPU and float32 unless inputs_on says else).
_PLACE: ContextVar[tuple[str, torch.dtype]] = ContextVar("place", default=("cpu", torch.float32))


@contextlib.contextmanager
def inputs_on(device: str, dtype: torch.dtype):
    """The cases' inputs on ``device``, floating ones in ``dtype`` (the same seeded values, rounded)."""
    token = _PLACE.set((device, dtype))
    try:
        yield
    finally:
        _PLACE.reset(token)


def _on(tensor: torch.Tensor) -> torch.Tensor:
    device, dtype = _PLACE.get()
    return tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else tensor.dtype)


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return _on(tiny_models.randn(*shape, seed=seed))


@dataclass(frozen=True)
class ZooCase:
    """``cls(**config)`` with random weights (tiny_models.make_model), run by ``run(model)`` on seeded inputs."""

    cls: type
    config: dict
    run: Callable[[nn.Module], object]
    primary: bool = True  # the configuration of its class that the coverage counts

    def build(self) -> nn.Module:
        return make_model(self.cls, self.config)


def count_group_norms(model: nn.Module) -> int:
    """GroupNorm-like modules: nn.GroupNorm (subclasses included) and AdaGroupNorm (F.group_norm inside)."""
    return sum(isinstance(m, (nn.GroupNorm, AdaGroupNorm)) for m in model.modules())


def _steps(batch: int) -> torch.Tensor:
    return _on(torch.tensor([10, 500][:batch]))


def _vae(*shape: int) -> Callable:
    """encode (the posterior's parameters) then decode the posterior's mode: every encoder and decoder norm runs."""
    def run(model):
        posterior = model.encode(randn(*shape)).latent_dist
        return posterior.parameters, model.decode(posterior.mode()).sample
    return run


def _unet(*shape: int, context: tuple[int, ...] = (5, 32)) -> Callable:
    """A UNet call on latents ``shape`` (batch first), two timesteps, text context (batch, *context)."""
    def run(model):
        return model(randn(*shape), _steps(shape[0]), randn(shape[0], *context, seed=1)).sample
    return run


def _blocks(model: nn.Module) -> list[torch.Tensor]:
    """The blocks an adapter holds, each run on its own with inputs of its widths."""
    outputs = []
    for seed, module in enumerate(model.modules()):
        kind = type(module).__name__  # the original class name, patched or not
        if kind == "ResnetBlock2D":
            outputs.append(module(randn(2, module.in_channels, 8, 8, seed=seed),
                                  randn(2, module.time_emb_proj.in_features, seed=seed + 1)))
        elif kind == "Transformer2DModel":
            context = randn(2, 5, module.config.cross_attention_dim, seed=seed + 1)
            outputs.append(module(randn(2, module.in_channels, 8, 8, seed=seed), encoder_hidden_states=context).sample)
        elif kind == "AnimateDiffTransformer3D":
            outputs.append(module(randn(2 * 3, module.in_channels, 4, 4, seed=seed), num_frames=3))
    return outputs


def _asymmetric_vae(model):
    posterior = model.encode(randn(1, 3, 16, 16)).latent_dist
    mask = _on((tiny_models.randn(1, 1, 16, 16, seed=3) > 0).float())
    return posterior.parameters, model.decode(posterior.mode(), image=randn(1, 3, 16, 16, seed=2), mask=mask).sample


def _consistency_vae(model):
    posterior = model.encode(randn(1, 3, 16, 16)).latent_dist
    generator = torch.Generator(_PLACE.get()[0]).manual_seed(0)
    return posterior.parameters, model.decode(posterior.mode(), generator=generator, num_inference_steps=2).sample


def _allegro(model):
    # AutoencoderKLAllegro encodes and decodes through tiles of 24 frames and 120+ pixels only: its encoder and
    # decoder run directly here.
    moments = model.encoder(randn(1, 3, 8, 16, 16))
    return moments, model.decoder(moments[:, :4])


def _temporal_decoder(model):
    posterior = model.encode(randn(2, 3, 16, 16)).latent_dist
    return posterior.parameters, model.decode(posterior.mode(), num_frames=2).sample


_UNET = dict(block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=8, cross_attention_dim=32)
_CONTROLNET = dict(_UNET, attention_head_dim=8, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                   conditioning_embedding_out_channels=(16, 32))
_UNET_2D = dict(_UNET, sample_size=16, attention_head_dim=8, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))
_UNET_3D = dict(_UNET, attention_head_dim=8, down_block_types=("CrossAttnDownBlock3D", "DownBlock3D"),
                up_block_types=("UpBlock3D", "CrossAttnUpBlock3D"))
_UNET_MOTION = dict(_UNET, down_block_types=("CrossAttnDownBlockMotion", "DownBlockMotion"),
                    up_block_types=("UpBlockMotion", "CrossAttnUpBlockMotion"), motion_num_attention_heads=2,
                    motion_max_seq_length=8)
_VAE_2D = dict(block_out_channels=(32, 64), down_block_types=("DownEncoderBlock2D",) * 2,
               up_block_types=("UpDecoderBlock2D",) * 2, norm_num_groups=8, latent_channels=4)
_UNET_1D_RL = dict(sample_size=16, in_channels=6, out_channels=6, extra_in_channels=0, time_embedding_type="positional",
                   use_timestep_embedding=True, flip_sin_to_cos=False, freq_shift=1, act_fn="mish",
                   down_block_types=("DownResnetBlock1D", "DownResnetBlock1D"), block_out_channels=(32, 64),
                   norm_num_groups=8, layers_per_block=1)

ZOO: dict[str, ZooCase] = {
    # ---- image UNets and ControlNets ----
    "UNet2DConditionModel": ZooCase(diffusers.UNet2DConditionModel, _UNET_2D, _unet(2, 4, 16, 16)),
    "UNet2DModel": ZooCase(
        diffusers.UNet2DModel,
        dict(sample_size=16, block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=8, attention_head_dim=8,
             down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D")),
        lambda m: m(randn(2, 3, 16, 16), _steps(2)).sample),
    "UNet2DModel-ncsnpp": ZooCase(  # score SDE's NCSN++: skip blocks, Fourier time embedding
        diffusers.UNet2DModel,
        dict(sample_size=16, block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=8, attention_head_dim=8,
             down_block_types=("SkipDownBlock2D", "AttnSkipDownBlock2D"),
             up_block_types=("AttnSkipUpBlock2D", "SkipUpBlock2D"), time_embedding_type="fourier",
             mid_block_scale_factor=2 ** 0.5, flip_sin_to_cos=True),
        lambda m: m(randn(2, 3, 16, 16), _on(torch.tensor([0.1, 0.9]))).sample, primary=False),
    "AudioLDM2UNet2DConditionModel": ZooCase(
        AudioLDM2UNet2DConditionModel, dict(_UNET_2D, cross_attention_dim=(32, 32)),
        lambda m: m(randn(2, 4, 16, 16), _steps(2), randn(2, 5, 32, seed=1),
                    encoder_hidden_states_1=randn(2, 5, 32, seed=2)).sample),
    "UNetFlatConditionModel": ZooCase(  # Versatile Diffusion's text UNet: (B, C, 4, 1) "images"
        UNetFlatConditionModel,
        dict(_UNET_2D, down_block_types=("CrossAttnDownBlockFlat", "DownBlockFlat"),
             up_block_types=("UpBlockFlat", "CrossAttnUpBlockFlat")), _unet(2, 4, 4, 1)),
    "DreamLiteUNetModel": ZooCase(
        diffusers.DreamLiteUNetModel,
        dict(_UNET_2D, down_block_types=("DreamLiteCrossAttnNoSelfAttnDownBlock2D", "DreamLiteCrossAttnDownBlock2D"),
             up_block_types=("DreamLiteCrossAttnUpBlock2D", "DreamLiteUpBlock2D")), _unet(2, 4, 16, 16)),
    "Kandinsky3UNet": ZooCase(
        diffusers.Kandinsky3UNet,
        dict(in_channels=4, time_embedding_dim=32, groups=8, attention_head_dim=8, layers_per_block=2,
             block_out_channels=(32, 32, 64, 64), cross_attention_dim=32, encoder_hid_dim=16),
        lambda m: m(randn(2, 4, 16, 16), _steps(2), randn(2, 5, 16, seed=1),
                    encoder_attention_mask=_on(torch.ones(2, 5))).sample),
    "ControlNetModel": ZooCase(
        diffusers.ControlNetModel, _CONTROLNET,
        lambda m: m(randn(2, 4, 16, 16), _steps(2), randn(2, 5, 32, seed=1),
                    controlnet_cond=randn(2, 3, 32, 32, seed=2))),
    "ControlNetUnionModel": ZooCase(
        diffusers.ControlNetUnionModel,
        dict(_CONTROLNET, num_control_type=2, num_trans_channel=32,
             num_trans_head=2, num_proj_channel=32, addition_embed_type="text_time", addition_time_embed_dim=8,
             projection_class_embeddings_input_dim=32 + 6 * 8),
        lambda m: m(randn(2, 4, 16, 16), _steps(2), randn(2, 5, 32, seed=1),
                    controlnet_cond=[randn(2, 3, 32, 32, seed=2), randn(2, 3, 32, 32, seed=3)],
                    control_type=_on(torch.tensor([[1, 1], [1, 0]])), control_type_idx=[0, 1],
                    added_cond_kwargs=dict(text_embeds=randn(2, 32, seed=4), time_ids=randn(2, 6, seed=5)))),
    "ControlNetXSAdapter": ZooCase(
        diffusers.ControlNetXSAdapter,
        dict(block_out_channels=(4, 8), base_block_out_channels=(32, 64), cross_attention_dim=32, num_attention_heads=2,
             down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), conditioning_embedding_out_channels=(16, 32),
             max_norm_num_groups=8, sample_size=16), _blocks),
    "UNetControlNetXSModel": ZooCase(
        diffusers.UNetControlNetXSModel,
        dict(sample_size=16, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
             up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), block_out_channels=(32, 64), norm_num_groups=8,
             cross_attention_dim=32, num_attention_heads=2, ctrl_block_out_channels=(4, 8), ctrl_num_attention_heads=2,
             ctrl_conditioning_embedding_out_channels=(16, 32), ctrl_max_norm_num_groups=8),
        lambda m: m(randn(2, 4, 16, 16), _steps(2), randn(2, 5, 32, seed=1),
                    controlnet_cond=randn(2, 3, 32, 32, seed=2)).sample),
    "Transformer2DModel": ZooCase(
        diffusers.Transformer2DModel,
        dict(num_attention_heads=2, attention_head_dim=16, in_channels=32, norm_num_groups=8, cross_attention_dim=32),
        lambda m: m(randn(2, 32, 8, 8), encoder_hidden_states=randn(2, 5, 32, seed=1)).sample),
    "DreamLiteTransformer2DModel": ZooCase(
        diffusers.DreamLiteTransformer2DModel,
        dict(num_attention_heads=2, attention_head_dim=16, in_channels=32, norm_num_groups=8, cross_attention_dim=32),
        lambda m: m(randn(2, 32, 8, 8), encoder_hidden_states=randn(2, 5, 32, seed=1)).sample),
    # ---- video UNets ----
    "UNet3DConditionModel": ZooCase(diffusers.UNet3DConditionModel, _UNET_3D, _unet(2, 4, 3, 8, 8)),
    "I2VGenXLUNet": ZooCase(
        diffusers.I2VGenXLUNet, _UNET_3D,
        lambda m: m(randn(2, 4, 3, 8, 8), _steps(2), fps=_on(torch.tensor([8, 8])),
                    image_latents=randn(2, 4, 3, 8, 8, seed=2), image_embeddings=randn(2, 32, seed=3),
                    encoder_hidden_states=randn(2, 5, 32, seed=1)).sample),
    "UNetMotionModel": ZooCase(  # AnimateDiff; the text context comes repeated per frame, as the pipeline makes it
        diffusers.UNetMotionModel, _UNET_MOTION,
        lambda m: m(randn(2, 4, 3, 8, 8), _steps(2), randn(2 * 3, 5, 32, seed=1)).sample),
    "MotionAdapter": ZooCase(
        diffusers.MotionAdapter,
        dict(block_out_channels=(32, 64), motion_layers_per_block=1, motion_num_attention_heads=2,
             motion_norm_num_groups=8, motion_max_seq_length=8), _blocks),
    "SparseControlNetModel": ZooCase(
        diffusers.SparseControlNetModel,
        dict(_UNET, down_block_types=("CrossAttnDownBlockMotion", "DownBlockMotion"), attention_head_dim=8,
             motion_num_attention_heads=2, motion_max_seq_length=8, conditioning_embedding_out_channels=(16, 32)),
        lambda m: m(randn(2, 4, 3, 8, 8), _steps(2), randn(2 * 3, 5, 32, seed=1),
                    controlnet_cond=randn(2, 4, 3, 8, 8, seed=2), conditioning_mask=_on(torch.ones(2, 1, 3, 8, 8)))),
    "UNetSpatioTemporalConditionModel": ZooCase(
        diffusers.UNetSpatioTemporalConditionModel,
        dict(sample_size=8, in_channels=8, out_channels=4, block_out_channels=(32, 64), layers_per_block=1,
             down_block_types=("CrossAttnDownBlockSpatioTemporal", "DownBlockSpatioTemporal"),
             up_block_types=("UpBlockSpatioTemporal", "CrossAttnUpBlockSpatioTemporal"), addition_time_embed_dim=8,
             projection_class_embeddings_input_dim=24, cross_attention_dim=32, num_attention_heads=(2, 4),
             num_frames=3),
        lambda m: m(randn(1, 3, 8, 8, 8), _on(torch.tensor(0.5)), randn(1, 1, 32, seed=1),
                    added_time_ids=randn(1, 3, seed=2)).sample),
    "TransformerTemporalModel": ZooCase(
        diffusers.TransformerTemporalModel,
        dict(num_attention_heads=2, attention_head_dim=16, in_channels=32, norm_num_groups=8),
        lambda m: m(randn(2 * 3, 32, 8, 8), num_frames=3).sample),
    # ---- UNet1D ----
    "UNet1DModel": ZooCase(  # Dance Diffusion's blocks: GELU on (B, C, L)
        diffusers.UNet1DModel,
        dict(sample_size=32, block_out_channels=(32, 32, 64), extra_in_channels=16, time_embedding_dim=16),
        lambda m: m(randn(2, 2, 32), _steps(2)).sample),
    "UNet1DModel-rl": ZooCase(  # Diffuser's planning UNet: Conv1d -> GroupNorm -> Mish
        diffusers.UNet1DModel,
        dict(_UNET_1D_RL, up_block_types=("UpResnetBlock1D",), mid_block_type="MidResTemporalBlock1D",
             out_block_type="OutConv1DBlock", downsample_each_block=False),
        lambda m: m(randn(2, 6, 16), _steps(2)).sample, primary=False),
    "UNet1DModel-value": ZooCase(  # its value function
        diffusers.UNet1DModel,
        dict(_UNET_1D_RL, up_block_types=(), mid_block_type="ValueFunctionMidBlock1D", out_block_type="ValueFunction",
             downsample_each_block=True),
        lambda m: m(randn(2, 6, 16), _steps(2)).sample, primary=False),
    # ---- image autoencoders ----
    "AutoencoderKL": ZooCase(diffusers.AutoencoderKL, _VAE_2D, _vae(1, 3, 16, 16)),
    "AutoencoderKLFlux2": ZooCase(diffusers.AutoencoderKLFlux2, dict(_VAE_2D, layers_per_block=1), _vae(1, 3, 16, 16)),
    "AsymmetricAutoencoderKL": ZooCase(
        diffusers.AsymmetricAutoencoderKL,
        dict(down_block_out_channels=(32, 64), up_block_out_channels=(32, 64), norm_num_groups=8, latent_channels=4,
             down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2), _asymmetric_vae),
    "VQModel": ZooCase(  # MoVQ (Kandinsky): the decoder's norms are SpatialNorms
        diffusers.VQModel, dict(_VAE_2D, num_vq_embeddings=16, norm_type="spatial"),
        lambda m: m(randn(1, 3, 16, 16)).sample),
    "ConsistencyDecoderVAE": ZooCase(  # its decoder: a UNet2DModel with time_embedding_norm="scale_shift"
        diffusers.ConsistencyDecoderVAE,
        dict(encoder_block_out_channels=(32, 64), encoder_down_block_types=("DownEncoderBlock2D",) * 2,
             encoder_norm_num_groups=8, encoder_layers_per_block=1, decoder_block_out_channels=(32, 64),
             decoder_down_block_types=("ResnetDownsampleBlock2D",) * 2,
             decoder_up_block_types=("ResnetUpsampleBlock2D",) * 2, decoder_norm_num_groups=8,
             decoder_layers_per_block=1), _consistency_vae),
    "AutoencoderKLKVAE": ZooCase(
        diffusers.AutoencoderKLKVAE,
        dict(channels=32, num_enc_blocks=1, num_dec_blocks=1, z_channels=4, ch_mult=(1, 2)), _vae(1, 3, 16, 16)),
    "AutoencoderKLHunyuanImage": ZooCase(
        diffusers.AutoencoderKLHunyuanImage,
        dict(in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(32, 64), layers_per_block=1,
             spatial_compression_ratio=2, sample_size=16), _vae(1, 3, 16, 16)),
    "AutoencoderKLLTX2Audio": ZooCase(  # GroupNorms with norm_type="group" (its default is pixel norm)
        diffusers.AutoencoderKLLTX2Audio,
        dict(base_channels=32, ch_mult=(1, 2), num_res_blocks=1, latent_channels=4, norm_type="group",
             causality_axis="none", is_causal=False, mel_bins=16, resolution=16, attn_resolutions=(8,),
             mid_block_add_attention=True), _vae(1, 2, 16, 16)),
    # ---- video autoencoders (frames: 1 + a multiple of the temporal compression) ----
    "AutoencoderKLCogVideoX": ZooCase(
        diffusers.AutoencoderKLCogVideoX,
        dict(block_out_channels=(32, 64), down_block_types=("CogVideoXDownBlock3D",) * 2,
             up_block_types=("CogVideoXUpBlock3D",) * 2, layers_per_block=1, norm_num_groups=8, latent_channels=4,
             temporal_compression_ratio=2), _vae(1, 3, 3, 16, 16)),
    "AutoencoderKLHunyuanVideo": ZooCase(
        diffusers.AutoencoderKLHunyuanVideo,
        dict(block_out_channels=(32, 64), down_block_types=("HunyuanVideoDownBlock3D",) * 2,
             up_block_types=("HunyuanVideoUpBlock3D",) * 2, layers_per_block=1, norm_num_groups=8, latent_channels=4,
             spatial_compression_ratio=2, temporal_compression_ratio=4), _vae(1, 3, 5, 16, 16)),
    "AutoencoderKLMochi": ZooCase(
        diffusers.AutoencoderKLMochi,
        dict(encoder_block_out_channels=(32, 32, 64, 64), decoder_block_out_channels=(32, 32, 64, 64),
             layers_per_block=(1, 1, 1, 1, 1), latent_channels=4, add_attention_block=(False, True, False, False, True),
             latents_mean=(0.0,) * 4, latents_std=(1.0,) * 4), _vae(1, 3, 7, 16, 16)),
    "AutoencoderKLCosmos": ZooCase(
        diffusers.AutoencoderKLCosmos,
        dict(encoder_block_out_channels=(32, 64), decode_block_out_channels=(32, 64), latent_channels=4,
             attention_resolutions=(8,), resolution=16, num_layers=1, patch_size=2, spatial_compression_ratio=4,
             temporal_compression_ratio=4, latents_mean=None, latents_std=None), _vae(1, 3, 5, 16, 16)),
    "AutoencoderKLMagvit": ZooCase(
        diffusers.AutoencoderKLMagvit,
        dict(block_out_channels=(32, 64), down_block_types=("SpatialDownBlock3D", "SpatialTemporalDownBlock3D"),
             up_block_types=("SpatialUpBlock3D", "SpatialTemporalUpBlock3D"), layers_per_block=1, norm_num_groups=8,
             latent_channels=4), _vae(1, 3, 5, 16, 16)),
    "AutoencoderKLKVAEVideo": ZooCase(
        diffusers.AutoencoderKLKVAEVideo, dict(ch=32, ch_mult=(1, 2), num_res_blocks=1, z_channels=4,
                                               temporal_compress_times=2), _vae(1, 3, 5, 16, 16)),
    "AutoencoderKLMiniMaxH3": ZooCase(  # GroupNorms in the encoder only (the decoder is a transformer)
        diffusers.AutoencoderKLMiniMaxH3,
        dict(block_out_channels=(32, 64), layers_per_block=1, spatial_downsample_factors=(2, 1),
             temporal_downsample_factors=(2, 1), latent_channels=4, decoder_num_layers=1, decoder_num_attention_heads=2,
             decoder_attention_head_dim=16, decoder_num_register_tokens=1, clip_length=5, token_drop=0,
             latents_mean=(0.0,) * 4, latents_std=(1.0,) * 4), _vae(1, 3, 5, 16, 16)),
    "AutoencoderKLAllegro": ZooCase(
        diffusers.AutoencoderKLAllegro,
        dict(block_out_channels=(32, 64), down_block_types=("AllegroDownBlock3D",) * 2,
             up_block_types=("AllegroUpBlock3D",) * 2, temporal_downsample_blocks=(True, False),
             temporal_upsample_blocks=(False, True), layers_per_block=1, norm_num_groups=8, latent_channels=4,
             temporal_compression_ratio=2, sample_size=16), _allegro),
    "AutoencoderKLTemporalDecoder": ZooCase(
        diffusers.AutoencoderKLTemporalDecoder,
        dict(block_out_channels=(32, 64), down_block_types=("DownEncoderBlock2D",) * 2, layers_per_block=1,
             latent_channels=4), _temporal_decoder),
    "LTXLatentUpsamplerModel": ZooCase(
        LTXLatentUpsamplerModel, dict(in_channels=8, mid_channels=32, num_blocks_per_stage=1),
        lambda m: m(randn(1, 8, 3, 8, 8))),
    "LTX2LatentUpsamplerModel": ZooCase(
        LTX2LatentUpsamplerModel, dict(in_channels=8, mid_channels=32, num_blocks_per_stage=1),
        lambda m: m(randn(1, 8, 3, 8, 8))),
}
