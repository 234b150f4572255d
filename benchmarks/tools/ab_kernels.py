"""A/B timing of the gn_patch kernels for benchmarks/NOTES.md (exploratory numbers, not committed results).

GPU time per call, forward and forward+backward, float16 and bfloat16, timed as gn_patch.bench times its kernel
table (CUDA-graph replay over inputs rotating out of L2). Run once per build to compare (GN_PATCH_BUILD_DIR and
PYTHONPATH select the tree):

    python benchmarks/tools/ab_kernels.py ab.json [--animatediff]

``--animatediff``: the forward alone at the GroupNorm shapes of one AnimateDiff UNetMotionModel call (16 frames of
512², batch 2; the motion modules' norms are 5-D), beside a device copy of the same tensor and PyTorch's NCHW
GroupNorm + SiLU, with how many times each shape runs per call.
"""
import argparse
import json
import math

import torch
import torch.nn.functional as F

from gn_patch import extension
from gn_patch.bench.kernels import rotation_sets
from gn_patch.bench.timing import gpu_time_us

SHAPES = [(2, 320, 64, 64), (2, 320, 128, 128), (2, 320, 32, 32), (2, 640, 32, 32), (2, 1280, 16, 16), (2, 1280, 8, 8),
          (2, 1920, 32, 32), (2, 960, 64, 64), (1, 512, 64, 64), (1, 512, 128, 128), (1, 256, 256, 256),
          (1, 512, 256, 256), (1, 256, 512, 512), (1, 128, 512, 512), (1, 256, 1024, 1024), (8, 320, 64, 64),
          (8, 640, 32, 32), (8, 1280, 16, 16), (8, 960, 64, 64)]
# (shape, GroupNorms of that shape per UNetMotionModel call), from forward hooks on the model of
# gn_patch.bench.models' "animatediff_unet" config.
ANIMATEDIFF_SHAPES = [((32, 320, 64, 64), 13), ((32, 1280, 8, 8), 12), ((32, 640, 32, 32), 11),
                      ((32, 1280, 16, 16), 11), ((2, 1280, 16, 8, 8), 6), ((2, 320, 16, 64, 64), 5),
                      ((2, 640, 16, 32, 32), 5), ((2, 1280, 16, 16, 16), 5), ((32, 2560, 8, 8), 3),
                      ((32, 2560, 16, 16), 2), ((32, 640, 64, 64), 2), ((32, 320, 32, 32), 1), ((32, 640, 16, 16), 1),
                      ((32, 1920, 16, 16), 1), ((32, 1920, 32, 32), 1), ((32, 1280, 32, 32), 1),
                      ((32, 960, 32, 32), 1), ((32, 960, 64, 64), 1)]
GRAPH_MS = 10.0


def channels_last(t: torch.Tensor) -> torch.Tensor:
    return t.to(memory_format=torch.channels_last if t.dim() == 4 else torch.channels_last_3d)


def inputs(shape: tuple[int, ...], dtype: torch.dtype, l2_bytes: int):
    """(n_sets, channels-last inputs rotating out of L2, weight, bias) at ``shape``."""
    n_sets = rotation_sets(math.prod(shape) * 2, l2_bytes)
    xs = [channels_last(torch.randn(shape, device="cuda", dtype=dtype)) for _ in range(n_sets)]
    w, b = (torch.randn(shape[1], device="cuda", dtype=dtype) for _ in range(2))
    return n_sets, xs, w, b


def forward(x, w, b):
    """The raw forward op, G = 32, SiLU: (y, mean, rstd)."""
    return torch.ops.gn_patch.group_norm_act(x, w, b, None, None, 32, 1e-5, "silu")


def time_shape(shape: tuple[int, ...], dtype: torch.dtype, l2_bytes: int) -> tuple[float, float]:
    """(forward µs, forward+backward µs) of the raw ops at ``shape``, G = 32, SiLU."""
    n_sets, xs, w, b = inputs(shape, dtype, l2_bytes)
    dys = [torch.randn_like(x) for x in xs]

    def forward_backward(i):
        _, mean, rstd = forward(xs[i], w, b)
        torch.ops.gn_patch.group_norm_act_backward(dys[i], xs[i], w, b, None, None, mean, rstd, 32, "silu",
                                                   [True, True, True, False, False])

    fwd, _ = gpu_time_us(lambda i: forward(xs[i], w, b), n_sets, GRAPH_MS)
    fwd_bwd, _ = gpu_time_us(forward_backward, n_sets, GRAPH_MS)
    return fwd, fwd_bwd


def time_animatediff_shape(shape: tuple[int, ...], l2_bytes: int, gn_only: bool) -> tuple[float, float, float]:
    """(gn_patch forward, device copy, PyTorch NCHW GroupNorm + SiLU) µs at ``shape``, float16, G = 32; the last
    two NaN with ``gn_only``."""
    n_sets, xs, w, b = inputs(shape, torch.float16, l2_bytes)
    fwd, _ = gpu_time_us(lambda i: forward(xs[i], w, b), n_sets, GRAPH_MS)
    if gn_only:
        return fwd, math.nan, math.nan
    nchw = [x.contiguous() for x in xs]
    copy, _ = gpu_time_us(lambda i: xs[i].clone(), n_sets, GRAPH_MS)
    stock, _ = gpu_time_us(lambda i: F.silu(F.group_norm(nchw[i], 32, w, b, 1e-5)), n_sets, GRAPH_MS)
    return fwd, copy, stock


def animatediff(out_path: str, l2_bytes: int, gn_only: bool = False) -> None:
    out, totals = {}, [0.0, 0.0, 0.0]
    for shape, count in ANIMATEDIFF_SHAPES:
        times = time_animatediff_shape(shape, l2_bytes, gn_only)
        totals = [t + count * v for t, v in zip(totals, times)]
        out[str(shape)] = {"count": count, "fwd_us": round(times[0], 1), "copy_us": round(times[1], 1),
                           "torch_nchw_us": round(times[2], 1)}
        print(f"{count:3d} x {shape!s:24s} fwd {times[0]:8.1f}  copy {times[1]:8.1f}  "
              f"torch NCHW {times[2]:8.1f}", flush=True)
    out["per_call_us"] = dict(zip(("fwd_us", "copy_us", "torch_nchw_us"), (round(t, 1) for t in totals)))
    print("per call:", out["per_call_us"])
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)


def main(out_path: str) -> None:
    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    out = {}
    for dtype in (torch.float16, torch.bfloat16):
        for shape in SHAPES:
            fwd, fwd_bwd = time_shape(shape, dtype, l2_bytes)
            key = f"{str(dtype)[6:]} {shape}"
            out[key] = (round(fwd, 1), round(fwd_bwd, 1))
            print(f"{key:32s} fwd {fwd:8.1f}  fwd+bwd {fwd_bwd:8.1f}", flush=True)
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_path")
    parser.add_argument("--animatediff", action="store_true")
    parser.add_argument("--gn-only", action="store_true", help="with --animatediff: gn_patch's times alone")
    args = parser.parse_args()
    assert extension.kernels_available(), "the gn_patch extension did not build or load"
    if args.animatediff:
        animatediff(args.out_path, torch.cuda.get_device_properties(0).L2_cache_size, args.gn_only)
    else:
        main(args.out_path)
