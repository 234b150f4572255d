"""Per-kernel GPU durations of gn_patch's forward and forward+backward (torch.profiler's CUDA activity, eager calls),
to tell kernel time from launch gaps in the graph-replay timings. Exploratory, for benchmarks/NOTES.md.

    python benchmarks/tools/kernel_durations.py [float16|bfloat16]
"""
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import gn_patch
from gn_patch import extension

SHAPES = [(2, 1280, 8, 8), (2, 1280, 16, 16), (2, 1280, 32, 32), (2, 320, 64, 64), (1, 512, 128, 128),
          (16, 640, 32, 32), (1, 256, 1024, 1024)]
CALLS = 10


def kernel_totals(fn, calls: int) -> dict[str, list]:
    """Kernel name -> [launches, µs] over ``calls`` calls of ``fn`` (after three warm-up calls)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    totals = defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name][0] += 1
            totals[event.name][1] += event.device_time
    return dict(totals)


def durations(fn) -> dict[str, float]:
    """µs per call by kernel (names shortened to their last 40 characters before template arguments)."""
    total = defaultdict(float)
    for name, (_, us) in kernel_totals(fn, CALLS).items():
        total[name.split("<")[0].split("(")[0][-40:]] += us / CALLS
    return dict(total)


def shape_durations(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[dict, dict]:
    x = (torch.randn(shape, device="cuda", dtype=dtype) * 3 + 1).to(memory_format=torch.channels_last)
    w, b = torch.randn(shape[1], device="cuda", dtype=dtype), torch.randn(shape[1], device="cuda", dtype=dtype)
    dy = torch.randn_like(x)
    xg, wg, bg = (t.clone().requires_grad_(True) for t in (x, w, b))
    fwd = durations(lambda: gn_patch.group_norm_act(x, 32, w, b))
    both = durations(lambda: torch.autograd.grad(gn_patch.group_norm_act(xg, 32, wg, bg), (xg, wg, bg), dy))
    return fwd, both


def main(dtype: torch.dtype) -> None:
    assert extension.kernels_available()
    for shape in SHAPES:
        fwd, both = shape_durations(shape, dtype)
        print(shape, "fwd", {k: round(v, 1) for k, v in fwd.items()}, "| fwd+bwd",
              {k: round(v, 1) for k, v in both.items()}, flush=True)


if __name__ == "__main__":
    main(getattr(torch, sys.argv[1]) if len(sys.argv) > 1 else torch.float16)
