"""GPU time of whole patched model calls, replayed from a CUDA graph, for an A/B of two builds (exploratory).

The peer harness replays 20 calls of one op back to back; in a model each GroupNorm+SiLU sits between
convolutions. This times the patched SD1.5 UNet call (batch 2, latents 64², float16, no grad) and the SD VAE
decode to 512² (latents 64²), each captured once in a CUDA graph and replayed (harness_times.graph_us): the
median of 7 replays of ``--calls`` calls, ms per call. One build per process (the extension is loaded once): an
A/B runs it with each tree's PYTHONPATH and GN_PATCH_BUILD_DIR (benchmarks/NOTES.md session 34)::

    python benchmarks/tools/model_graph_times.py OUT.json [--models sd15_unet sd_vae] [--calls 5]
"""

from __future__ import annotations

import argparse
import json

import torch

from gn_patch import extension, patch_model
from gn_patch.bench.models import build_model, unet_call, vae_decode_call
from harness_times import graph_us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--models", nargs="+", default=["sd15_unet", "sd_vae"], choices=["sd15_unet", "sd_vae"])
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args()
    assert extension.kernels_available(), "the CUDA extension failed to build or load"
    rows = {}
    for name in args.models:
        model = build_model(name, "cuda", torch.float16)
        patch_model(model, channels_last=True)
        if name == "sd15_unet":
            call = unet_call(model, 2, 64, torch.float16, "cuda")
        else:
            call = vae_decode_call(model, 64, torch.float16, "cuda")
        with torch.no_grad():
            rows[name] = round(graph_us(call, calls=args.calls, replays=7) / 1e3, 4)
        print(name, rows[name], "ms", flush=True)
        del model, call
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "ms_per_call": rows}, f, indent=1)


if __name__ == "__main__":
    main()
