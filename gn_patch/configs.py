"""Architecture configs of the diffusers models gn_patch is tested and benchmarked on, as constructor kwargs.

The full-size dicts reproduce the published ``config.json`` of each model (the keys that differ from the diffusers
defaults, plus the defining ones), so ``UNet2DConditionModel(**SD15_UNET)`` builds the Stable Diffusion 1.5 UNet
architecture with random weights, without network access. The ``TINY_*`` dicts are the same architectures shrunk
to a few hundred thousand parameters for CPU tests; they fit together (TINY_SD15_UNET with TINY_VAE and
TINY_CONTROLNET; TINY_SDXL_UNET with TINY_VAE).

Sequences are tuples so that the shared dicts cannot be changed through a model's config; copy a dict
(``dict(SD15_UNET, sample_size=96)``) to vary it.
"""

from __future__ import annotations

__all__ = [
    "CONTROLNET", "SCHEDULER", "SD15_UNET", "SD_VAE", "SDXL_UNET", "SDXL_VAE",
    "TINY_CONTROLNET", "TINY_SD15_UNET", "TINY_SDXL_UNET", "TINY_VAE",
]

# runwayml/stable-diffusion-v1-5, unet/config.json
SD15_UNET = dict(
    sample_size=64,
    in_channels=4,
    out_channels=4,
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    block_out_channels=(320, 640, 1280, 1280),
    layers_per_block=2,
    attention_head_dim=8,
    cross_attention_dim=768,
    norm_num_groups=32,
    norm_eps=1e-5,
    act_fn="silu",
    center_input_sample=False,
    flip_sin_to_cos=True,
    freq_shift=0,
    downsample_padding=1,
    mid_block_scale_factor=1,
)

# stabilityai/stable-diffusion-xl-base-1.0, unet/config.json
SDXL_UNET = dict(
    sample_size=128,
    in_channels=4,
    out_channels=4,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    mid_block_type="UNetMidBlock2DCrossAttn",
    block_out_channels=(320, 640, 1280),
    layers_per_block=2,
    transformer_layers_per_block=(1, 2, 10),
    attention_head_dim=(5, 10, 20),
    cross_attention_dim=2048,
    use_linear_projection=True,
    addition_embed_type="text_time",
    addition_embed_type_num_heads=64,
    addition_time_embed_dim=256,
    projection_class_embeddings_input_dim=2816,
    norm_num_groups=32,
    norm_eps=1e-5,
    act_fn="silu",
    center_input_sample=False,
    flip_sin_to_cos=True,
    freq_shift=0,
    downsample_padding=1,
    mid_block_scale_factor=1,
    resnet_time_scale_shift="default",
    time_embedding_type="positional",
)

# runwayml/stable-diffusion-v1-5, vae/config.json
SD_VAE = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    block_out_channels=(128, 256, 512, 512),
    layers_per_block=2,
    latent_channels=4,
    norm_num_groups=32,
    act_fn="silu",
    sample_size=512,
)

# stabilityai/stable-diffusion-xl-base-1.0, vae/config.json: SD_VAE's architecture, another scaling factor, and
# decoding upcast to float32 by the pipeline (the original SDXL VAE overflows in float16).
SDXL_VAE = dict(SD_VAE, sample_size=1024, scaling_factor=0.13025, force_upcast=True)

# lllyasviel/control_v11p_sd15_canny, config.json: the SD 1.5 UNet's encoder half plus the conditioning embedding.
CONTROLNET = dict(
    in_channels=4,
    conditioning_channels=3,
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    block_out_channels=(320, 640, 1280, 1280),
    conditioning_embedding_out_channels=(16, 32, 96, 256),
    layers_per_block=2,
    attention_head_dim=8,
    cross_attention_dim=768,
    norm_num_groups=32,
    norm_eps=1e-5,
    act_fn="silu",
    flip_sin_to_cos=True,
    freq_shift=0,
    downsample_padding=1,
    mid_block_scale_factor=1,
    controlnet_conditioning_channel_order="rgb",
)

# The SD 1.5 / SDXL training noise schedule, as DDIMScheduler kwargs.
SCHEDULER = dict(
    num_train_timesteps=1000,
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    clip_sample=False,
    set_alpha_to_one=False,
    steps_offset=1,
    timestep_spacing="leading",
)

# ---- tiny variants: 8 groups of 4+ channels, so that a wrong grouping changes results --------------------------
TINY_SD15_UNET = dict(
    SD15_UNET,
    sample_size=16,
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    block_out_channels=(32, 64),
    layers_per_block=1,
    cross_attention_dim=32,
    norm_num_groups=8,
)

# pooled text embedding of 32 + 6 time ids x 8 = 80 inputs to the additional embedding
TINY_SDXL_UNET = dict(
    SDXL_UNET,
    sample_size=16,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
    block_out_channels=(32, 64),
    layers_per_block=1,
    transformer_layers_per_block=(1, 2),
    attention_head_dim=(2, 4),
    cross_attention_dim=64,
    addition_time_embed_dim=8,
    projection_class_embeddings_input_dim=80,
    norm_num_groups=8,
)

# latents at half the image size (one downsampling stage)
TINY_VAE = dict(
    SD_VAE,
    down_block_types=("DownEncoderBlock2D",) * 2,
    up_block_types=("UpDecoderBlock2D",) * 2,
    block_out_channels=(16, 32),
    layers_per_block=1,
    norm_num_groups=8,
    sample_size=32,
)

# conditioning image at twice the latent size, like TINY_VAE's images
TINY_CONTROLNET = dict(
    CONTROLNET,
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
    block_out_channels=(32, 64),
    conditioning_embedding_out_channels=(8, 16),
    layers_per_block=1,
    cross_attention_dim=32,
    norm_num_groups=8,
)
