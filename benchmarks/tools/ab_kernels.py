"""A/B timing of the gn_patch kernels for benchmarks/NOTES.md (exploratory numbers, not committed results).

GPU time per call, forward and forward+backward, float16 and bfloat16, timed as gn_patch.bench times its kernel
table (CUDA-graph replay over inputs rotating out of L2). Run once per build to compare (GN_PATCH_BUILD_DIR and
PYTHONPATH select the tree):

    python benchmarks/tools/ab_kernels.py ab.json
"""
import json
import math
import sys

import torch

from gn_patch import extension
from gn_patch.bench.kernels import rotation_sets
from gn_patch.bench.timing import gpu_time_us

SHAPES = [(2, 320, 64, 64), (2, 320, 32, 32), (2, 640, 32, 32), (2, 1280, 16, 16), (2, 1280, 8, 8),
          (2, 1920, 32, 32), (2, 960, 64, 64), (1, 512, 64, 64), (1, 512, 128, 128), (1, 256, 256, 256),
          (1, 512, 256, 256), (1, 256, 512, 512), (1, 128, 512, 512), (1, 256, 1024, 1024), (8, 320, 64, 64),
          (8, 640, 32, 32), (8, 1280, 16, 16), (8, 960, 64, 64)]
GRAPH_MS = 10.0


def time_shape(shape: tuple[int, ...], dtype: torch.dtype, l2_bytes: int) -> tuple[float, float]:
    """(forward µs, forward+backward µs) of the raw ops at ``shape``, G = 32, SiLU."""
    op, op_backward = torch.ops.gn_patch.group_norm_act, torch.ops.gn_patch.group_norm_act_backward
    n_sets = rotation_sets(math.prod(shape) * 2, l2_bytes)
    xs = [torch.randn(shape, device="cuda", dtype=dtype).to(memory_format=torch.channels_last)
          for _ in range(n_sets)]
    dys = [torch.randn_like(x) for x in xs]
    w, b = torch.randn(shape[1], device="cuda", dtype=dtype), torch.randn(shape[1], device="cuda", dtype=dtype)

    def forward_backward(i):
        _, mean, rstd = op(xs[i], w, b, None, None, 32, 1e-5, "silu")
        op_backward(dys[i], xs[i], w, b, None, None, mean, rstd, 32, "silu", [True, True, True, False, False])

    fwd, _ = gpu_time_us(lambda i: op(xs[i], w, b, None, None, 32, 1e-5, "silu"), n_sets, GRAPH_MS)
    fwd_bwd, _ = gpu_time_us(forward_backward, n_sets, GRAPH_MS)
    return fwd, fwd_bwd


def main(out_path: str) -> None:
    assert extension.kernels_available(), "the gn_patch extension did not build or load"
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
    main(sys.argv[1])
