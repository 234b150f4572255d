"""Where the host time of one gn_patch call goes, at the cpu section's launch-bound shape (exploratory, for
benchmarks/NOTES.md): µs per call of the entry points and of PyTorch calls that each cost one piece of what the op
does (an allocation, one kernel launch, one dispatcher round trip), then a torch.profiler table of the module's
calls (CPU self time per op and per CUDA runtime call)::

    python benchmarks/tools/host_breakdown.py [--calls 2000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from gn_patch import GroupNormAct, extension, ops
from gn_patch.bench.cpu import CPU_SHAPE, cpu_candidates, host_us_per_call


def candidates():
    groups, eps = 32, 1e-5
    x = torch.randn(CPU_SHAPE, dtype=torch.float16, device="cuda").contiguous(memory_format=torch.channels_last)
    module = GroupNormAct(groups, CPU_SHAPE[1], eps=eps).to("cuda", torch.float16)
    w, b = module.weight.detach(), module.bias.detach()
    raw = torch.ops.gn_patch.group_norm_act.default
    inference = torch.ops.gn_patch.group_norm_act_inference.default
    dispatch = torch.ops.gn_patch.group_norm_act_dispatch.default
    entry = extension.entry
    x_empty = x[:0]
    return {
        "torch.empty((2, 32)) [one allocation]": lambda: torch.empty((2, 32), device="cuda"),
        "torch.empty_like(x) [one allocation]": lambda: torch.empty_like(x),
        "F.silu(x) [one op, one launch]": lambda: F.silu(x),
        "torch.add(x, 1) [one op, one launch]": lambda: torch.add(x, 1),
        "F.group_norm + F.silu (channels_last)": lambda: F.silu(F.group_norm(x, groups, w, b, eps)),
        "raw op gn_patch::group_norm_act": lambda: raw(x, w, b, None, None, groups, eps, "silu"),
        "inference op gn_patch::group_norm_act_inference [no mean, rstd]":
            lambda: inference(x, w, b, None, None, groups, eps, "silu"),
        "dispatch op gn_patch::group_norm_act_dispatch": lambda: dispatch(x, groups, w, b, eps, "silu", None, None),
        "dispatch op, all 11 arguments [GroupNormAct's call before the entry]":
            lambda: dispatch(x, groups, w, b, eps, "silu", None, None, None, None, False),
        "entry gn_patch_C.group_norm_act_dispatch [the same call from C++]":
            lambda: entry(x, groups, w, b, eps, "silu", None, None, None, None, False),
        "gn_patch.ops._group_norm_act": lambda: ops._group_norm_act(x, groups, w, b, eps, "silu"),
        "GroupNormAct module": lambda: module(x),
        "raw op, N = 0 [checks, three allocations, no launch]":
            lambda: raw(x_empty, w, b, None, None, groups, eps, "silu"),
    }, module, x


def training_candidates():
    """Calls with grad enabled: the module's forward alone (its autograd node and saved tensors), then the cpu
    section's forward + backward rows (gn_patch.bench.cpu), the module's and stock's."""
    x = torch.randn(CPU_SHAPE, dtype=torch.float16, device="cuda").contiguous(memory_format=torch.channels_last)
    x.requires_grad_(True)
    module = GroupNormAct(32, CPU_SHAPE[1]).to("cuda", torch.float16)
    rows = {name: call for name, (call, _) in cpu_candidates(kernels_ok=True).items() if name.endswith("fwd+bwd")}
    return {"GroupNormAct forward only, x requiring grad [autograd node, saved tensors]": lambda: module(x), **rows}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    if not extension.kernels_available():
        raise SystemExit("gn_patch's CUDA kernels did not build")
    with torch.no_grad():
        calls, module, x = candidates()
        for name, call in calls.items():
            per_round = host_us_per_call(call, args.calls, args.rounds)
            print(f"{statistics.median(per_round):8.2f} us  (min {min(per_round):6.2f})  {name}", flush=True)
        for name, call in training_candidates().items():
            with torch.enable_grad():
                per_round = host_us_per_call(call, args.calls, args.rounds)
            print(f"{statistics.median(per_round):8.2f} us  (min {min(per_round):6.2f})  {name}", flush=True)
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(200):
                module(x)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
