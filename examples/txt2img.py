#!/usr/bin/env python
"""Text-to-image with Stable Diffusion 1.5 or SDXL, stock and gn_patch-patched at the same seed: time, speedup, PSNR.

    python examples/txt2img.py --arch sd15 --height 512 --width 512 --steps 30
    python examples/txt2img.py --arch sdxl --height 1024 --width 1024 --check-fp32 --json results.json
    python examples/txt2img.py --cuda-graph --compile-anchor --check-fp32   # + CUDA graphs, + stock torch.compile
    python examples/txt2img.py --model stabilityai/stable-diffusion-xl-base-1.0 --prompt "a red fox in snow"
    python examples/txt2img.py --device cpu --steps 2 --height 64 --width 64       # smoke run

Without ``--model`` the pipeline is built from the published architecture configs (gn_patch.configs) with random
weights, and the prompt is a random embedding of the text encoders' output shape (SD1.5: 77 x 768; SDXL: 77 x 2048
plus a pooled 1280), so it runs without network access, tokenizer or text encoder. The images are then noise-like;
what matters is how close the patched image is to the stock one. (Random weights with diffusers' default init keep
every activation far below the float16 range, e.g. at most ~15 in the SD VAE decoder, so float16 runs stay finite;
a non-finite image stops the script with an error rather than reporting a meaningless PSNR.)

One pipeline serves every variant: the optional float32 reference run first (``--check-fp32``), then stock in
``--dtype``, then (``--compile-anchor``) stock with its UNet and VAE decoder under
``torch.compile(mode="reduce-overhead")``, then the same pipeline patched in place by gn_patch.patch_pipeline, then
(``--cuda-graph``) patched with ``cuda_graph=True``. Each timed variant gets a short warm-up call first (JIT build
of the kernels, cuDNN autotuning and allocator growth stay out of the timing; CUDA-graph capture, and compilation
over two warm-up calls, which record torch.compile's CUDA graphs, are timed on their own), and CUDA is synchronized
around every timed call. PSNR is over the [0, 1] float images, peak 1.0; identical images give inf. The PNGs go to
``--output-dir``; ``--json PATH`` appends one object per run to the JSON list in PATH (created if missing).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from diffusers import (AutoencoderKL, DDIMScheduler, DiffusionPipeline, StableDiffusionPipeline,
                       StableDiffusionXLPipeline, UNet2DConditionModel)

# Run from a checkout without installing: the repository root holds the gn_patch package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gn_patch import configs, extension
from gn_patch.bench.results import commit_id
from gn_patch.pipeline import patch_pipeline

PROMPT_TOKENS = 77  # CLIP's context length
WARMUP_STEPS = 1  # enough to build the kernels, autotune cuDNN and grow the allocator
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
COMPILE_OPTIONS = dict(mode="reduce-overhead")  # --compile-anchor: torch.compile's CUDA-graph mode
# variant -> label; in the order they run
VARIANTS = {"stock": "stock", "compiled": "stock + torch.compile", "patched": "patched",
            "graph": "patched + CUDA graphs"}

# arch -> (UNet config, VAE config, prompt embedding width, pooled embedding width or None) for random weights
ARCHS = {
    "sd15": (configs.SD15_UNET, configs.SD_VAE, 768, None),
    "sdxl": (configs.SDXL_UNET, configs.SDXL_VAE, 2048, 1280),
}
TINY_ARCHS = {  # --tiny (CI): the same structures, a few hundred thousand parameters
    "sd15": (configs.TINY_SD15_UNET, configs.TINY_VAE, 32, None),
    "sdxl": (configs.TINY_SDXL_UNET, configs.TINY_VAE, 64, 32),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  python examples/txt2img.py --check-fp32                      # SD1.5, 512x512, CUDA\n"
               "  python examples/txt2img.py --arch sdxl --height 1024 --width 1024 --check-fp32\n"
               "  python examples/txt2img.py --device cpu --steps 2 --height 64 --width 64   # CPU smoke run")
    parser.add_argument("--model", help="diffusers SD1.x/SDXL folder or hub id (default: random weights of --arch)")
    parser.add_argument("--arch", choices=sorted(ARCHS), default="sd15",
                        help="architecture built without --model (default: %(default)s)")
    parser.add_argument("--prompt", default="a photograph of an astronaut riding a horse",
                        help="prompt, used with --model; random weights take random prompt embeddings")
    parser.add_argument("--steps", type=int, default=30,
                        help="denoising steps of the timed runs (default: %(default)s)")
    parser.add_argument("--height", type=int, help="image height (default: the model's native size)")
    parser.add_argument("--width", type=int, help="image width (default: the model's native size)")
    parser.add_argument("--batch-size", type=int, default=1, help="images per prompt (default: %(default)s)")
    parser.add_argument("--guidance-scale", type=float, default=7.5,
                        help="classifier-free guidance scale (default: %(default)s)")
    parser.add_argument("--dtype", choices=sorted(DTYPES),
                        help="dtype of the stock and patched runs (default: float16 on CUDA, float32 on CPU)")
    parser.add_argument("--device", help="torch device (default: cuda; a machine without a GPU needs --device cpu)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the random weights, embeddings and diffusion noise (default: %(default)s)")
    parser.add_argument("--check-fp32", action="store_true",
                        help="also run stock in float32 first and report each image's PSNR against it")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="also run patched with CUDA graphs (patch_pipeline(pipe, cuda_graph=True))")
    parser.add_argument("--compile-anchor", action="store_true",
                        help='also run stock with UNet and VAE decoder under torch.compile(mode="reduce-overhead"), '
                             "timing its compilation")
    parser.add_argument("--output-dir", type=Path, default=Path("txt2img_out"),
                        help="where the PNGs go (default: %(default)s)")
    parser.add_argument("--json", type=Path, help="append the result to the JSON list in this file")
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # tiny random models, for CI
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1:
        parser.error("--steps and --batch-size must be at least 1")
    if args.tiny and args.model:
        parser.error("--tiny builds random models: it takes no --model")
    if args.device is None and not torch.cuda.is_available():  # a full-size run on the CPU takes many minutes
        parser.error("no CUDA GPU here: pass --device cpu to run on the CPU (the smoke run: --device cpu --steps 2 "
                     "--height 64 --width 64)")
    args.device = torch.device(args.device or "cuda")
    args.dtype = DTYPES[args.dtype or ("float16" if args.device.type == "cuda" else "float32")]
    return args


# ------------------------------------------------------------------------------------------------
# Pipeline and its inputs
# ------------------------------------------------------------------------------------------------
def random_pipeline(arch: str, tiny: bool, seed: int, device: torch.device) -> DiffusionPipeline:
    """SD1.5 or SDXL architecture, float32 random weights (diffusers' default init, drawn on ``device``: fast on a
    GPU), no tokenizer or text encoder (prompts come as embeddings)."""
    unet_config, vae_config, _, _ = (TINY_ARCHS if tiny else ARCHS)[arch]
    torch.manual_seed(seed)
    with device:
        unet = UNet2DConditionModel(**unet_config).eval()
        vae = AutoencoderKL(**vae_config).eval()
    scheduler = DDIMScheduler(**configs.SCHEDULER)
    if arch == "sd15":
        return StableDiffusionPipeline(vae=vae, text_encoder=None, tokenizer=None, unet=unet, scheduler=scheduler,
                                       safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    return StableDiffusionXLPipeline(vae=vae, text_encoder=None, text_encoder_2=None, tokenizer=None,
                                     tokenizer_2=None, unet=unet, scheduler=scheduler, add_watermarker=False)


def random_prompt_kwargs(arch: str, tiny: bool, batch: int, seed: int) -> dict[str, torch.Tensor]:
    """Random float32 prompt (and negative prompt) embeddings, (batch, 77, width), plus SDXL's pooled ones."""
    _, _, width, pooled_width = (TINY_ARCHS if tiny else ARCHS)[arch]
    generator = torch.Generator().manual_seed(seed + 1)
    kwargs = {name: torch.randn(batch, PROMPT_TOKENS, width, generator=generator)
              for name in ("prompt_embeds", "negative_prompt_embeds")}
    if pooled_width is not None:
        kwargs.update({name: torch.randn(batch, pooled_width, generator=generator)
                       for name in ("pooled_prompt_embeds", "negative_pooled_prompt_embeds")})
    return kwargs


def load_pipeline(args: argparse.Namespace) -> tuple[DiffusionPipeline, dict]:
    """The pipeline on --device, float32 when a reference run follows, else --dtype; and its prompt kwargs."""
    if args.model:
        load_dtype = torch.float32 if args.check_fp32 else args.dtype
        pipe = DiffusionPipeline.from_pretrained(args.model, torch_dtype=load_dtype)
        if not isinstance(pipe, (StableDiffusionPipeline, StableDiffusionXLPipeline)):
            raise SystemExit(f"{args.model} is a {type(pipe).__name__}; this example runs SD1.x and SDXL pipelines")
        # Safety checker and watermark would alter images for reasons unrelated to the GroupNorm under test.
        if isinstance(pipe, StableDiffusionPipeline):
            pipe.safety_checker = None
        else:
            pipe.watermark = None
        prompt_kwargs = dict(prompt=args.prompt, negative_prompt="")
    else:
        pipe = random_pipeline(args.arch, args.tiny, args.seed, args.device)
        prompt_kwargs = random_prompt_kwargs(args.arch, args.tiny, args.batch_size, args.seed)
    pipe.set_progress_bar_config(disable=True)
    pipe.to(args.device)
    if not args.check_fp32:
        pipe.to(dtype=args.dtype)
    return pipe, prompt_kwargs


# ------------------------------------------------------------------------------------------------
# Runs and measurements
# ------------------------------------------------------------------------------------------------
def generate(pipe: DiffusionPipeline, prompt_kwargs: dict, args: argparse.Namespace, steps: int) -> np.ndarray:
    """Images as float32 (batch, height, width, 3) in [0, 1]; the diffusion noise is seeded by --seed."""
    dtype = pipe.unet.dtype
    kwargs = {k: v.to(args.device, dtype) if isinstance(v, torch.Tensor) else v for k, v in prompt_kwargs.items()}
    if "prompt" in kwargs:
        kwargs["num_images_per_prompt"] = args.batch_size
    generator = torch.Generator(args.device).manual_seed(args.seed)
    images = pipe(**kwargs, num_inference_steps=steps, guidance_scale=args.guidance_scale, height=args.height,
                  width=args.width, generator=generator, output_type="np").images
    if not np.isfinite(images).all():
        raise SystemExit(f"non-finite pixels in a {dtype} image: the comparison would be meaningless")
    return images.astype(np.float32)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Run(NamedTuple):
    images: np.ndarray
    seconds: float  # the timed call
    warmup_seconds: float  # the warm-up calls before it


def timed_generate(pipe: DiffusionPipeline, prompt_kwargs: dict, args: argparse.Namespace,
                   warmup_calls: int = 1) -> Run:
    """One-step warm-up calls, then the timed call with --steps."""
    synchronize(args.device)
    start = time.perf_counter()
    for _ in range(warmup_calls):
        generate(pipe, prompt_kwargs, args, WARMUP_STEPS)
    synchronize(args.device)
    warmup_seconds = time.perf_counter() - start
    start = time.perf_counter()
    images = generate(pipe, prompt_kwargs, args, args.steps)
    synchronize(args.device)
    return Run(images, time.perf_counter() - start, warmup_seconds)


def compile_anchor(pipe: DiffusionPipeline, prompt_kwargs: dict, args: argparse.Namespace) -> Run:
    """The pipeline with its UNet and VAE decoder under torch.compile(**COMPILE_OPTIONS), both restored after. Two
    warm-up calls: reduce-overhead compiles and warms up on a module's first call and records its CUDA graph on the
    second."""
    unet, decoder = pipe.unet, pipe.vae.decoder
    pipe.unet = torch.compile(unet, **COMPILE_OPTIONS)
    pipe.vae.decoder = torch.compile(decoder, **COMPILE_OPTIONS)
    try:
        return timed_generate(pipe, prompt_kwargs, args, warmup_calls=2)
    finally:
        pipe.unet, pipe.vae.decoder = unet, decoder
        torch._dynamo.reset()  # drops the compiled code and its CUDA graphs


def psnr(images: np.ndarray, reference: np.ndarray) -> float:
    """Peak signal-to-noise ratio in dB of [0, 1] images against a reference (peak 1.0); inf when identical."""
    mse = float(np.mean((images.astype(np.float64) - reference.astype(np.float64)) ** 2))
    return math.inf if mse == 0.0 else 10.0 * math.log10(1.0 / mse)


def save_pngs(images: np.ndarray, output_dir: Path, variant: str) -> None:
    output_dir.mkdir(parents=True, exist_ok=True)
    for index, image in enumerate(DiffusionPipeline.numpy_to_pil(images)):
        image.save(output_dir / f"{variant}_{index}.png")


def phase(text: str) -> None:
    """One line per step of the run, so that a slow one (building a full-size model on a CPU) is not silent."""
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def run_variants(pipe: DiffusionPipeline, prompt_kwargs: dict, args: argparse.Namespace) -> tuple[dict, object]:
    """Time each variant of VARIANTS that the flags ask for on ``pipe`` (left patched). Returns ({variant: Run},
    the last patch report)."""
    timing = f"{WARMUP_STEPS}-step warm-up, then {args.steps} steps timed"
    phase(f"stock run: {timing}")
    runs = {"stock": timed_generate(pipe, prompt_kwargs, args)}
    if args.compile_anchor:
        phase(f"stock run under torch.compile({COMPILE_OPTIONS}): two {WARMUP_STEPS}-step warm-ups (compilation), "
              f"then {args.steps} steps timed")
        runs["compiled"] = compile_anchor(pipe, prompt_kwargs, args)
    on_gpu = args.device.type == "cuda"
    phase("patching the pipeline" + (" (first use on a GPU compiles the kernels)" if on_gpu else ""))
    report = patch_pipeline(pipe)
    phase(f"patched run: {timing}")
    runs["patched"] = timed_generate(pipe, prompt_kwargs, args)
    if args.cuda_graph:
        phase(f"patched run with CUDA graphs: {timing} (the warm-up captures them)")
        report = patch_pipeline(pipe, cuda_graph=True)
        runs["graph"] = timed_generate(pipe, prompt_kwargs, args)
    return runs, report


def print_table(runs: dict, reference: np.ndarray | None) -> None:
    """Time, speedup over stock and PSNR against stock and float32 stock of each variant."""
    stock = runs["stock"]
    print(f"{'run':24s} {'time':>9s} {'speedup':>8s} {'PSNR vs stock':>14s} {'PSNR vs fp32':>13s}")
    for variant, run in runs.items():
        vs_stock = "-" if variant == "stock" else f"{psnr(run.images, stock.images):.2f} dB"
        vs_fp32 = "-" if reference is None else f"{psnr(run.images, reference):.2f} dB"
        note = {"compiled": f"   (compilation: {run.warmup_seconds:.1f} s)",
                "graph": f"   (capture and warm-up: {run.warmup_seconds:.2f} s)"}.get(variant, "")
        print(f"{VARIANTS[variant]:24s} {run.seconds:7.3f} s {stock.seconds / run.seconds:7.2f}x {vs_stock:>14s} "
              f"{vs_fp32:>13s}{note}")
    if "graph" in runs:
        print(f"PSNR patched + CUDA graphs vs patched: {psnr(runs['graph'].images, runs['patched'].images):.2f} dB")


def main(argv: list[str] | None = None) -> dict:
    """Run the comparison; returns the result dict also appended to --json."""
    args = parse_args(argv)
    phase(f"loading {args.model}" if args.model else
          f"building the {args.arch} pipeline with random weights on {args.device} (seconds to a minute on a CPU)")
    pipe, prompt_kwargs = load_pipeline(args)

    reference = None
    if args.check_fp32:
        phase(f"float32 reference run, {args.steps} steps")
        reference = generate(pipe, prompt_kwargs, args, args.steps)
        save_pngs(reference, args.output_dir, "fp32")
        pipe.to(dtype=args.dtype)

    runs, report = run_variants(pipe, prompt_kwargs, args)
    for variant, run in runs.items():
        save_pngs(run.images, args.output_dir, variant)

    def vs(variant: str, other: np.ndarray | None) -> float | None:
        return psnr(runs[variant].images, other) if variant in runs and other is not None else None

    def seconds(variant: str, attribute: str = "seconds") -> float | None:
        return getattr(runs[variant], attribute) if variant in runs else None

    stock, patched = runs["stock"], runs["patched"]
    height, width = stock.images.shape[1:3]
    result = dict(
        arch="sdxl" if isinstance(pipe, StableDiffusionXLPipeline) else "sd15", model=args.model,
        height=height, width=width, steps=args.steps, batch_size=args.batch_size, dtype=str(args.dtype),
        device=str(args.device),
        stock_s=stock.seconds, patched_s=patched.seconds,
        psnr_patched_vs_stock_db=psnr(patched.images, stock.images),
        psnr_patched_vs_fp32_db=vs("patched", reference),
        psnr_stock_vs_fp32_db=vs("stock", reference),
        patched_graph_s=seconds("graph"), graph_capture_s=seconds("graph", "warmup_seconds"),
        psnr_graph_vs_patched_db=vs("graph", patched.images), psnr_graph_vs_stock_db=vs("graph", stock.images),
        psnr_graph_vs_fp32_db=vs("graph", reference),
        graph_memory_bytes=report.cuda_graphs.memory_bytes if "graph" in runs else None,
        compile_anchor_s=seconds("compiled"), compile_anchor_compile_s=seconds("compiled", "warmup_seconds"),
        psnr_compile_anchor_vs_stock_db=vs("compiled", stock.images),
        psnr_compile_anchor_vs_fp32_db=vs("compiled", reference),
        cuda_kernels=args.device.type == "cuda" and extension.kernels_available(),
        commit=commit_id(Path(__file__).resolve().parent),
    )
    print(report)
    if not result["cuda_kernels"]:
        print(f"note: gn_patch's CUDA kernels are not in use on {args.device}: the patched run takes PyTorch's "
              "GroupNorm path, so its time says nothing about the kernels")
    print(f"{args.model or 'random ' + result['arch']}: {height}x{width}, {args.steps} steps, batch "
          f"{args.batch_size}, {args.dtype}, {args.device}")
    print_table(runs, reference)
    print(f"images in {args.output_dir}")
    if args.json:
        runs_json = json.loads(args.json.read_text()) if args.json.exists() else []
        runs_json.append({k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in result.items()})
        args.json.write_text(json.dumps(runs_json, indent=2) + "\n")  # identical images (psnr inf) record null
    return result


if __name__ == "__main__":
    main()
