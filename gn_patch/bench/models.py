"""The models the benchmark measures (random weights from the published configs), their calls, and the
GroupNorm shapes those calls make (collected by forward pre-hooks on the real modules)."""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .. import configs

# torch.compile with static shapes for the top-traffic shape of these sources only (each shape is a compile).
STATIC_COMPILE_SOURCES = ("sd15_unet_512_b2", "vae_decode_512")
MODELS = {
    "sd15_unet": ("UNet2DConditionModel", configs.SD15_UNET),
    "sdxl_unet": ("UNet2DConditionModel", configs.SDXL_UNET),
    "sd_vae": ("AutoencoderKL", configs.SD_VAE),
    "cogvideox_vae": ("AutoencoderKLCogVideoX", configs.COGVIDEOX_VAE),
    "hunyuanvideo_vae": ("AutoencoderKLHunyuanVideo", configs.HUNYUANVIDEO_VAE),
    "animatediff_unet": ("UNetMotionModel", configs.ANIMATEDIFF_UNET),
    "kandinsky22_unet": ("UNet2DConditionModel", configs.KANDINSKY22_UNET),
}


def build_model(name: str, device: str, dtype: torch.dtype, seed: int = 0) -> nn.Module:
    """The model of MODELS[name] with seeded random weights, created directly on ``device``, in eval mode."""
    import diffusers

    class_name, config = MODELS[name]
    torch.manual_seed(seed)
    with torch.device(device):
        model = getattr(diffusers, class_name)(**config)
    # diffusers warns on every .to(dtype) about float32-only modules, even for models that have none
    verbosity = diffusers.logging.get_verbosity()
    diffusers.logging.set_verbosity_error()
    try:
        return model.to(dtype=dtype).eval()
    finally:
        diffusers.logging.set_verbosity(verbosity)


class ModelCache:
    """Float16 CUDA models built once per run: the kernel section hooks them, the e2e section then takes them."""

    def __init__(self):
        self._models: dict[str, nn.Module] = {}

    def get(self, name: str) -> nn.Module:
        """The float16 CUDA model MODELS[name], built on first use."""
        if name not in self._models:
            self._models[name] = build_model(name, "cuda", torch.float16)
        return self._models[name]

    def take(self, name: str) -> nn.Module:
        """The model, now owned by the caller (who may convert or patch it in place)."""
        model = self.get(name)
        del self._models[name]
        return model


def unet_inputs(config, batch: int, latent: int, dtype: torch.dtype, device: str) -> tuple[tuple, dict]:
    """(args, kwargs) of one UNet call, in the form StableDiffusionPipeline uses (so that a compiled UNet serves
    both this call and the pipeline without recompiling). SDXL-style configs get their text/time conditioning."""
    sample = torch.randn(batch, config.in_channels, latent, latent, dtype=dtype, device=device)
    timestep = torch.tensor(999, device=device)
    context = torch.randn(batch, 77, config.cross_attention_dim, dtype=dtype, device=device)
    added = None
    if config.addition_embed_type == "text_time":
        pooled = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim
        pixels = latent * 8
        added = {"text_embeds": torch.randn(batch, pooled, dtype=dtype, device=device),
                 "time_ids": torch.tensor([[pixels, pixels, 0, 0, pixels, pixels]] * batch, dtype=dtype, device=device)}
    kwargs = dict(encoder_hidden_states=context, timestep_cond=None, cross_attention_kwargs=None,
                  added_cond_kwargs=added, return_dict=False)
    return (sample, timestep), kwargs


def unet_call(unet: nn.Module, batch: int, latent: int, dtype: torch.dtype, device: str) -> Callable[[], Any]:
    """A call of ``unet`` on random latents of shape (batch, in_channels, latent, latent) (see unet_inputs),
    returning the predicted noise of the same shape."""
    args, kwargs = unet_inputs(unet.config, batch, latent, dtype, device)
    return lambda: unet(*args, **kwargs)[0]


def vae_decode_call(vae: nn.Module, latent: int, dtype: torch.dtype, device: str, batch: int = 1) -> Callable[[], Any]:
    """A decode by ``vae`` of random latents of shape (batch, latent_channels, latent, latent), returning the image
    of shape (batch, 3, 8 * latent, 8 * latent) for the SD VAE."""
    z = torch.randn(batch, vae.config.latent_channels, latent, latent, dtype=dtype, device=device)
    return lambda: vae.decode(z, return_dict=False)[0]


def _seeded(shape: tuple[int, ...], like: nn.Module, seed: int) -> torch.Tensor:
    """Seeded normal values made in float32 on ``like``'s device, then cast to its dtype: the float32 model and
    its half-precision copy see the same inputs up to that rounding."""
    parameter = next(like.parameters())
    generator = torch.Generator(parameter.device).manual_seed(seed)
    return torch.randn(shape, generator=generator, device=parameter.device).to(parameter.dtype)


def video_vae_decode_call(vae: nn.Module, latents: tuple[int, ...]) -> Callable[[], Any]:
    """A decode by a video VAE of seeded latents (batch, channels, frames, height, width) in the VAE's dtype,
    returning the video (batch, 3, frames', 8 * height, 8 * width)."""
    z = _seeded(latents, vae, 0)
    return lambda: vae.decode(z, return_dict=False)[0]


def animatediff_call(unet: nn.Module, batch: int, frames: int, latent: int) -> Callable[[], Any]:
    """A UNetMotionModel call on seeded latents (batch, 4, frames, latent, latent), the text context repeated per
    frame as AnimateDiffPipeline passes it; returns the predicted noise."""
    sample = _seeded((batch, unet.config.in_channels, frames, latent, latent), unet, 0)
    context = _seeded((batch, 77, unet.config.cross_attention_dim), unet, 1).repeat_interleave(frames, dim=0)
    timestep = torch.tensor(999, device=sample.device)
    return lambda: unet(sample, timestep, encoder_hidden_states=context, return_dict=False)[0]


def image_unet_call(unet: nn.Module, batch: int, latent: int) -> Callable[[], Any]:
    """A call of an image-conditioned UNet (Kandinsky 2.2's decoder: addition_embed_type="image") on seeded
    latents (batch, in_channels, latent, latent) and image embeddings; returns its output."""
    sample = _seeded((batch, unet.config.in_channels, latent, latent), unet, 0)
    image_embeds = _seeded((batch, unet.config.encoder_hid_dim), unet, 1)
    timestep = torch.tensor(999, device=sample.device)
    return lambda: unet(sample, timestep, encoder_hidden_states=None, added_cond_kwargs={"image_embeds": image_embeds},
                        return_dict=False)[0]


def build_txt2img_pipeline(unet: nn.Module, vae: nn.Module):
    """StableDiffusionPipeline from the given models, a DDIM scheduler with SD1.5's noise schedule, no text encoder,
    tokenizer or safety checker: the prompt comes as embeddings."""
    from diffusers import DDIMScheduler, StableDiffusionPipeline

    pipe = StableDiffusionPipeline(vae=vae, text_encoder=None, tokenizer=None, unet=unet,
                                   scheduler=DDIMScheduler(**configs.SCHEDULER), safety_checker=None,
                                   feature_extractor=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def txt2img_call(pipe, size: int, steps: int, device: str, dtype: torch.dtype) -> Callable[[], Any]:
    """One text-to-image generation (CFG 7.5, so the UNet runs at batch 2), decoded to a tensor image."""
    width = pipe.unet.config.cross_attention_dim
    prompt = torch.randn(1, 77, width, dtype=dtype, device=device)
    negative = torch.randn(1, 77, width, dtype=dtype, device=device)

    def call():
        generator = torch.Generator(device).manual_seed(0)
        return pipe(prompt_embeds=prompt, negative_prompt_embeds=negative, height=size, width=size,
                    num_inference_steps=steps, guidance_scale=7.5, output_type="pt", generator=generator).images

    return call


@dataclass(frozen=True)
class GroupNormCall:
    """One nn.GroupNorm call seen by the hook: input shape, groups, eps, and the module name with indices as *."""

    shape: tuple[int, ...]
    num_groups: int
    eps: float
    site: str


@dataclass(frozen=True)
class ShapeSource:
    """A model call whose GroupNorm inputs give rows of the kernel table."""

    name: str
    model: str     # key of MODELS
    device: str    # where the hooked call runs: "cuda" (random weights), or "meta" (shapes only, no memory)
    batch: int
    latent: int    # latent height = width (image size / 8)


SHAPE_SOURCES = (
    ShapeSource("sd15_unet_512_b1", "sd15_unet", "cuda", 1, 64),
    ShapeSource("sd15_unet_512_b2", "sd15_unet", "cuda", 2, 64),
    ShapeSource("sdxl_unet_1024_b2", "sdxl_unet", "meta", 2, 128),
    ShapeSource("vae_decode_512", "sd_vae", "cuda", 1, 64),
    ShapeSource("vae_decode_1024", "sd_vae", "cuda", 1, 128),
)


def collect_group_norm_calls(model: nn.Module, run: Callable[[], Any]) -> list[GroupNormCall]:
    """Every nn.GroupNorm call that ``run()`` makes inside ``model``, in call order, from forward pre-hooks."""
    calls: list[GroupNormCall] = []

    def hook_for(name: str):
        site = re.sub(r"\.\d+(?=\.|$)", ".*", name)

        def record(module: nn.GroupNorm, args: tuple) -> None:
            calls.append(GroupNormCall(tuple(args[0].shape), module.num_groups, module.eps, site))

        return record

    handles = [module.register_forward_pre_hook(hook_for(name))
               for name, module in model.named_modules() if isinstance(module, nn.GroupNorm)]
    try:
        with torch.no_grad():
            run()
    finally:
        for handle in handles:
            handle.remove()
    return calls


def source_calls(source: ShapeSource, cache: ModelCache) -> list[GroupNormCall]:
    """The GroupNorm calls of one source's model call (float16; the dtype changes no shape)."""
    if source.device == "meta":
        model = build_model(source.model, "meta", torch.float16)
    else:
        model = cache.get(source.model)
    if source.model.endswith("vae"):
        run = vae_decode_call(model, source.latent, torch.float16, source.device, source.batch)
    else:
        run = unet_call(model, source.batch, source.latent, torch.float16, source.device)
    return collect_group_norm_calls(model, run)


@dataclass(frozen=True)
class KernelShape:
    """A distinct (input shape, num_groups) of the models, with who calls it and how often per forward.

    Calls that differ only in eps share a row (eps changes no work); ``eps`` is the first seen, the one timed.
    """

    shape: tuple[int, ...]
    num_groups: int
    eps: float
    eps_seen: tuple[float, ...]
    calls: dict[str, int] = field(hash=False)   # source name -> calls in one model call
    sites: tuple[str, ...] = ()

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def distinct_shapes(calls_by_source: dict[str, list[GroupNormCall]]) -> list[KernelShape]:
    """Dedupe the calls of all sources by (shape, num_groups), in order of first appearance."""
    merged: dict[tuple, dict] = {}
    for source, calls in calls_by_source.items():
        for call in calls:
            entry = merged.setdefault((call.shape, call.num_groups),
                                      {"eps": [], "calls": Counter(), "sites": []})
            entry["calls"][source] += 1
            for key, value in (("eps", call.eps), ("sites", call.site)):
                if value not in entry[key]:
                    entry[key].append(value)
    return [KernelShape(shape, groups, e["eps"][0], tuple(sorted(e["eps"])), dict(e["calls"]), tuple(e["sites"]))
            for (shape, groups), e in merged.items()]


def static_compile_shapes(shapes: list[KernelShape]) -> set[tuple]:
    """(shape, num_groups) of the shape moving the most bytes per model call in each STATIC_COMPILE_SOURCES source."""
    keys = set()
    for source in STATIC_COMPILE_SOURCES:
        users = [s for s in shapes if source in s.calls]
        if users:
            top = max(users, key=lambda s: s.calls[source] * s.numel)
            keys.add((top.shape, top.num_groups))
    return keys

