"""The forward and backward kernels at a few UNet shapes, twice each, for Nsight Compute (exploratory, for
benchmarks/NOTES.md), and with ``--peers DIR`` apex's one-pass kernels at the same shapes beside them (DIR laid out
as ../shared/peers; the peer is built into ``--peers-build-dir``). The second launch of each finds its input in L2,
as the peer harness's replays do.

    ncu --clock-control none --cache-control none -k regex:"forward_kernel|backward_kernel|group_norm_nhwc" \\
        --section LaunchStats --section SpeedOfLight --section WarpStateStats --section SchedulerStats \\
        --section InstructionStats --section SourceCounters python3 benchmarks/tools/ncu_shapes.py [--dtype float16] \\
        [--peers DIR] [--shapes "N,C,H,W ..."]

Executed instructions per warp (InstructionStats / warps of the grid) and cycles per issued instruction
(WarpStateStats) say how long a small kernel's latency chain is; the SASS to read beside it comes from
`cuobjdump -sass -fun NAME` on the build's forward_<activation>.cuda.o (triton ships a cuobjdump).
"""
import argparse
from pathlib import Path

import torch

from gn_patch import extension
from gn_patch.bench.peers import EPS, GROUPS, apex_passes, load_peer
from harness_times import shapes_from

SHAPES = [(2, 1280, 8, 8), (2, 2560, 8, 8), (2, 1280, 16, 16), (2, 1280, 32, 32), (2, 320, 64, 64),
          (1, 512, 128, 128), (16, 640, 32, 32)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--peers", type=Path, help="folder of the peer kernels (../shared/peers' layout)")
    parser.add_argument("--shapes", help='"N,C,H,W N,C,H,W ..." instead of SHAPES')
    parser.add_argument("--peers-build-dir", type=Path, help="default: the benchmark's, $GN_PATCH_BUILD_DIR/peers "
                        "or ~/.cache/gn_patch/peers")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    assert extension.kernels_available(), "the gn_patch extension did not build or load"
    build_dir = args.peers_build_dir or extension.cache_root() / "peers"
    apex = load_peer("apex", args.peers, build_dir) if args.peers else None
    forward, backward = torch.ops.gn_patch.group_norm_act, torch.ops.gn_patch.group_norm_act_backward
    for shape in shapes_from(args.shapes, SHAPES):
        x = (torch.randn(shape, device="cuda", dtype=dtype) * 3 + 1).to(memory_format=torch.channels_last)
        w, b = torch.randn(shape[1], device="cuda", dtype=dtype), torch.randn(shape[1], device="cuda", dtype=dtype)
        dy = torch.randn_like(x)
        for _ in range(2):
            _, mean, rstd = forward(x, w, b, None, None, GROUPS, EPS, "silu")
        for _ in range(2):
            backward(dy, x, w, b, None, None, mean, rstd, GROUPS, "silu", [True, True, True, False, False])
        if apex is not None:
            passes = apex_passes(shape)
            for _ in range(2):
                _, sums = apex.forward(x, GROUPS, w, b, EPS, passes, True)
            for _ in range(2):
                apex.backward(dy, sums, x, GROUPS, w, b, EPS, passes, True)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
