"""GPU kernels of one zoo call grouped by kernel name (ms per call, launches per call), stock NCHW then patched,
for benchmarks/NOTES.md (exploratory, not committed results): where the GPU time of a call goes kernel by kernel,
which torch.profiler's operator tables (profile_video.py) spread over the ops that launch them.

    python benchmarks/tools/kernel_table.py [--models animatediff,cogvideox,hunyuanvideo] [--rows 45]
"""
import argparse

import torch

from gn_patch import patch_model
from gn_patch.bench.e2e import inference
from gn_patch.bench.models import build_model

from kernel_durations import kernel_totals
from profile_video import CALLS


def kernel_table(call, calls: int, rows: int) -> None:
    """Prints the kernels of ``calls`` calls (after three warm-up calls), largest total time first."""
    totals = kernel_totals(call, calls)
    launches = sum(n for n, _ in totals.values()) / calls
    print(f"kernel time {sum(t for _, t in totals.values()) / calls / 1e3:.2f} ms per call, {launches:.0f} kernels")
    for name, (n, t) in sorted(totals.items(), key=lambda item: -item[1][1])[:rows]:
        print(f"{t / calls / 1e3:8.3f} ms {n / calls:6.0f}x  {name[:110]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="animatediff")
    parser.add_argument("--rows", type=int, default=45)
    args = parser.parse_args()
    for name in args.models.split(","):
        model_name, dtype, make_call = CALLS[name]
        model = build_model(model_name, "cuda", dtype)
        call = inference(make_call(model))
        print(f"== {name} stock")
        kernel_table(call, 2, args.rows)
        print(patch_model(model))
        print(f"== {name} patched")
        kernel_table(call, 2, args.rows)
        del model, call
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
