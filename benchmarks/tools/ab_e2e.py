"""Alternating A/B of eager UNet calls, each variant in a fresh process, for benchmarks/NOTES.md (exploratory).

Host-bound calls (an eager SD1.5 UNet call on an H200 spends 2-3x its GPU time launching) vary by 10-40% between
runs of one process after another; running the variants in fresh processes, in alternating order, `--rounds` times
separates that noise from what the variant changes. Prints and writes the median and spread of each variant's
per-call wall time::

    python benchmarks/tools/ab_e2e.py --out ab_e2e.json                      # SD1.5 UNet, 512², batch 2, fp16
    python benchmarks/tools/ab_e2e.py --model sdxl_unet --latent 128 --rounds 4
    python benchmarks/tools/ab_e2e.py --device cpu --model tiny_sd15_unet --latent 8 --dtype float32 --rounds 2
    python benchmarks/tools/ab_e2e.py --pipeline 30 --calls 3 --warmup 1   # the txt2img pipeline (SD VAE decode too)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

VARIANTS = ("stock_nchw", "stock_cl", "patched")


def measure(args: argparse.Namespace) -> float:
    """Median wall ms of one variant's calls (UNet calls or whole pipeline calls), in this process."""
    import diffusers
    import torch

    from gn_patch import configs, patch_model
    from gn_patch.bench.e2e import inference
    from gn_patch.bench.models import build_txt2img_pipeline, txt2img_call, unet_call

    dtype = getattr(torch, args.dtype)
    config = getattr(configs, args.model.upper())
    torch.manual_seed(0)
    models = {}
    with torch.device(args.device):
        models["unet"] = diffusers.UNet2DConditionModel(**config).to(dtype).eval()
        if args.pipeline:
            vae_config = configs.TINY_VAE if args.model.startswith("tiny") else configs.SD_VAE
            models["vae"] = diffusers.AutoencoderKL(**vae_config).to(dtype).eval()
    for model in models.values():
        if args.variant == "stock_cl":
            model.to(memory_format=torch.channels_last)
        elif args.variant == "patched":
            patch_model(model, channels_last=True)
    if args.pipeline:
        pipe = build_txt2img_pipeline(models["unet"], models["vae"])
        size = args.latent * pipe.vae_scale_factor
        call = txt2img_call(pipe, size, args.pipeline, args.device, dtype)
    else:
        call = inference(unet_call(models["unet"], args.batch, args.latent, dtype, args.device))
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    for _ in range(args.warmup):
        call()
    times = []
    for _ in range(args.calls):
        sync()
        start = time.perf_counter()
        call()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="sd15_unet", help="a UNet config of gn_patch.configs, lower case")
    parser.add_argument("--latent", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rounds", type=int, default=6, help="processes per variant, in alternating order")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--pipeline", type=int, metavar="STEPS",
                        help="time the txt2img pipeline with this many steps (CFG, batch 1) instead of UNet calls")
    parser.add_argument("--out", help="JSON file for the results")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # one measurement (child process)
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(measure(args)))
        return
    passthrough = [f"--{k}={v}" for k, v in vars(args).items()
                   if k not in ("rounds", "out", "variant") and v is not None]
    results: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
        for variant in order:
            out = subprocess.run([sys.executable, __file__, *passthrough, f"--variant={variant}"], check=True,
                                 capture_output=True, text=True).stdout
            results[variant].append(json.loads(out.strip().splitlines()[-1]))
    summary = {v: {"median_ms": statistics.median(t), "min_ms": min(t), "max_ms": max(t), "runs_ms": t}
               for v, t in results.items()}
    for v, s in summary.items():
        print(f"{v:11s} median {s['median_ms']:8.2f} ms  (min {s['min_ms']:.2f}, max {s['max_ms']:.2f}, "
              f"{len(s['runs_ms'])} processes)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "variant"}, "variants": summary}, f,
                      indent=1)


if __name__ == "__main__":
    main()
