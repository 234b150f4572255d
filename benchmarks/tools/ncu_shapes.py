"""The forward and backward kernels at a few UNet shapes, twice each, for Nsight Compute (exploratory, for
benchmarks/NOTES.md). The second launch of each finds its input in L2, as the peer harness's replays do.

    ncu --clock-control none --cache-control none -k regex:"forward_kernel|backward_kernel" \\
        --section LaunchStats --section SpeedOfLight --section WarpStateStats --section SchedulerStats \\
        --section InstructionStats python3 benchmarks/tools/ncu_shapes.py [float16|bfloat16]

Executed instructions per warp (InstructionStats / warps of the grid) and cycles per issued instruction
(WarpStateStats) say how long a small kernel's latency chain is; the SASS to read beside it comes from
`cuobjdump -sass -fun NAME` on the build's forward.cuda.o (triton ships a cuobjdump).
"""
import sys

import torch

from gn_patch import extension

SHAPES = [(2, 1280, 8, 8), (2, 1280, 16, 16), (2, 1280, 32, 32), (2, 320, 64, 64), (1, 512, 128, 128),
          (16, 640, 32, 32)]


def main(dtype: torch.dtype) -> None:
    assert extension.kernels_available(), "the gn_patch extension did not build or load"
    forward, backward = torch.ops.gn_patch.group_norm_act, torch.ops.gn_patch.group_norm_act_backward
    for shape in SHAPES:
        x = (torch.randn(shape, device="cuda", dtype=dtype) * 3 + 1).to(memory_format=torch.channels_last)
        w, b = torch.randn(shape[1], device="cuda", dtype=dtype), torch.randn(shape[1], device="cuda", dtype=dtype)
        dy = torch.randn_like(x)
        for _ in range(2):
            _, mean, rstd = forward(x, w, b, None, None, 32, 1e-5, "silu")
        for _ in range(2):
            backward(dy, x, w, b, None, None, mean, rstd, 32, "silu", [True, True, True, False, False])
        torch.cuda.synchronize()


if __name__ == "__main__":
    main(getattr(torch, sys.argv[1] if len(sys.argv) > 1 else "float16"))
