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
    "ANIMATEDIFF_UNET", "COGVIDEOX_VAE", "CONTROLNET", "HUNYUANVIDEO_VAE", "KANDINSKY22_UNET", "SCHEDULER",
    "SD15_UNET", "SDXL_UNET", "SDXL_VAE", "SD_VAE", "TINY_CONTROLNET", "TINY_SD15_UNET", "TINY_SDXL_UNET",
    "TINY_VAE",
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

# THUDM/CogVideoX-2b, vae/config.json (AutoencoderKLCogVideoX): 8x spatial, 4x temporal compression to 16 channels.
COGVIDEOX_VAE = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("CogVideoXDownBlock3D",) * 4,
    up_block_types=("CogVideoXUpBlock3D",) * 4,
    block_out_channels=(128, 256, 256, 512),
    latent_channels=16,
    layers_per_block=3,
    act_fn="silu",
    norm_eps=1e-6,
    norm_num_groups=32,
    temporal_compression_ratio=4,
    sample_height=480,
    sample_width=720,
    scaling_factor=1.15258426,
)

# hunyuanvideo-community/HunyuanVideo, vae/config.json (AutoencoderKLHunyuanVideo): 8x spatial, 4x temporal.
HUNYUANVIDEO_VAE = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=16,
    down_block_types=("HunyuanVideoDownBlock3D",) * 4,
    up_block_types=("HunyuanVideoUpBlock3D",) * 4,
    block_out_channels=(128, 256, 512, 512),
    layers_per_block=2,
    act_fn="silu",
    norm_num_groups=32,
    scaling_factor=0.476986,
    spatial_compression_ratio=8,
    temporal_compression_ratio=4,
    mid_block_add_attention=True,
)

# AnimateDiff: UNetMotionModel.from_unet2d(the SD 1.5 UNet, guoyww/animatediff-motion-adapter-v1-5-2), as a config
# (the adapter's motion modules: 2 per block, 8 heads, 32 groups, up to 32 frames, a mid-block motion module).
ANIMATEDIFF_UNET = dict(
    in_channels=4,
    out_channels=4,
    down_block_types=("CrossAttnDownBlockMotion",) * 3 + ("DownBlockMotion",),
    up_block_types=("UpBlockMotion",) + ("CrossAttnUpBlockMotion",) * 3,
    block_out_channels=(320, 640, 1280, 1280),
    layers_per_block=2,
    num_attention_heads=8,
    cross_attention_dim=768,
    norm_num_groups=32,
    norm_eps=1e-5,
    act_fn="silu",
    downsample_padding=1,
    mid_block_scale_factor=1,
    motion_max_seq_length=32,
    motion_num_attention_heads=8,
    use_motion_mid_block=True,
)

# kandinsky-community/kandinsky-2-2-decoder, unet/config.json: a UNet2DConditionModel whose resnets take the
# timestep as a per-sample scale and shift (resnet_time_scale_shift="scale_shift"), conditioned on an image
# embedding (image_embeds of 1280 values in added_cond_kwargs).
KANDINSKY22_UNET = dict(
    in_channels=4,
    out_channels=8,
    down_block_types=("ResnetDownsampleBlock2D",) + ("SimpleCrossAttnDownBlock2D",) * 3,
    mid_block_type="UNetMidBlock2DSimpleCrossAttn",
    up_block_types=("SimpleCrossAttnUpBlock2D",) * 3 + ("ResnetUpsampleBlock2D",),
    block_out_channels=(384, 768, 1152, 1536),
    layers_per_block=3,
    attention_head_dim=64,
    cross_attention_dim=768,
    encoder_hid_dim=1280,
    encoder_hid_dim_type="image_proj",
    addition_embed_type="image",
    addition_embed_type_num_heads=64,
    resnet_time_scale_shift="scale_shift",
    norm_num_groups=32,
    norm_eps=1e-5,
    act_fn="silu",
    flip_sin_to_cos=True,
    freq_shift=0,
    sample_size=64,
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
