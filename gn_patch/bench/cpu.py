"""Host cost of one call (cpu_overhead.json) at a launch-bound shape, where the GPU work per call is shorter than
its launch: what Python, the dispatcher and the launches cost, for gn_patch's entry points and PyTorch's, in
inference (forward under no_grad) and in training (forward and backward through autograd)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ..modules import GroupNormAct
from ..ops import group_norm_act
from .kernels import torch_gn_silu
from .results import ResultFile, attempt, progress_bar
from .settings import Settings
from .timing import host_loop_us

CPU_SHAPE = (2, 1280, 8, 8)
WARM_UP_CALLS = 100


def forward_backward(forward: Callable[[], torch.Tensor], grad_out: torch.Tensor,
                     leaves: tuple[torch.Tensor, ...]) -> Callable[[], None]:
    """One training call of ``forward``: its leaves' .grad set to None (as the kernel table's fwd+bwd does: no
    accumulation kernels), the forward under grad mode, then backward of ``grad_out``."""
    def call() -> None:
        for leaf in leaves:
            leaf.grad = None
        with torch.enable_grad():
            forward().backward(grad_out)
    return call


def cpu_candidates(kernels_ok: bool) -> dict[str, tuple[Callable[[], Any], str | None]]:
    """name -> (one call at CPU_SHAPE, float16, CUDA; the reason it is not run, or None). Names ending in
    "fwd+bwd" are training calls (forward_backward); the others are forward calls, run under torch.no_grad()."""
    groups, eps = 32, 1e-5
    x_nchw = torch.randn(CPU_SHAPE, dtype=torch.float16, device="cuda")
    x_cl = x_nchw.contiguous(memory_format=torch.channels_last)
    module = GroupNormAct(groups, CPU_SHAPE[1], eps=eps).to("cuda", torch.float16)
    weight, bias = module.weight.detach(), module.bias.detach()
    skip = None if kernels_ok else "gn_patch CUDA kernels unavailable"
    # Training calls: x and the affine parameters require gradients, as in a fine-tuning step.
    x_nchw_grad, x_cl_grad = x_nchw.clone().requires_grad_(True), x_cl.clone().requires_grad_(True)
    dy_nchw, dy_cl = torch.randn_like(x_nchw), torch.randn_like(x_cl)
    params = (module.weight, module.bias)
    return {
        "gn_patch.group_norm_act (channels_last)": (lambda: group_norm_act(x_cl, groups, weight, bias, eps), skip),
        "GroupNormAct module (channels_last)": (lambda: module(x_cl), skip),
        "torch.ops.gn_patch.group_norm_act raw op (channels_last)":
            (lambda: torch.ops.gn_patch.group_norm_act(x_cl, weight, bias, None, None, groups, eps, "silu"), skip),
        "torch F.group_norm + F.silu (NCHW)": (lambda: torch_gn_silu(x_nchw, weight, bias, groups, eps), None),
        "torch F.group_norm + F.silu (channels_last)": (lambda: torch_gn_silu(x_cl, weight, bias, groups, eps), None),
        "GroupNormAct module (channels_last) fwd+bwd":
            (forward_backward(lambda: module(x_cl_grad), dy_cl, (x_cl_grad, *params)), skip),
        "torch F.group_norm + F.silu (NCHW) fwd+bwd":
            (forward_backward(lambda: torch_gn_silu(x_nchw_grad, *params, groups, eps), dy_nchw,
                              (x_nchw_grad, *params)), None),
        "torch F.group_norm + F.silu (channels_last) fwd+bwd":
            (forward_backward(lambda: torch_gn_silu(x_cl_grad, *params, groups, eps), dy_cl, (x_cl_grad, *params)),
             None),
    }


def host_us_per_call(call: Callable[[], Any], calls: int, rounds: int) -> list[float]:
    """Host µs per call of a tight loop of ``calls`` calls (no synchronize inside), one value per round, after
    WARM_UP_CALLS untimed calls."""
    def step(_: int) -> None:  # host_loop_us passes an index, which this call does not take
        call()

    host_loop_us(step, 1, min(calls, WARM_UP_CALLS), 1, wait=True)
    return host_loop_us(step, 1, calls, rounds, wait=False)


def run_cpu(settings: Settings, out: Path, metadata: dict, kernels_ok: bool) -> None:
    """Time every cpu_candidates call into ``out``/cpu_overhead.json (µs per call, median and min over rounds)."""
    writer = ResultFile(out / "cpu_overhead.json", {
        **metadata, "shape": list(CPU_SHAPE), "dtype": "float16",
        "grad_mode": "torch.no_grad(); fwd+bwd rows: grad mode, x, weight and bias requiring grad, their .grad set "
                     "to None before each call",
        "notes": "us_per_call: median over rounds of (host time of a loop of `calls` calls / calls), no synchronize "
                 "inside the loop; at this shape the GPU work per call is shorter than its launch, so this is the "
                 "host cost of the call (Python, dispatcher, launches); fwd+bwd rows: the forward and y.backward(dy), "
                 "autograd's engine included",
    })
    start = time.perf_counter()
    with torch.no_grad(), progress_bar(cpu_candidates(kernels_ok).items(), desc="cpu", unit="method") as progress:
        for name, (call, skip) in progress:
            row = {"method": name, "us_per_call": None, "us_per_call_min": None,
                   "calls": settings.cpu_calls, "rounds": settings.cpu_rounds}
            if skip:
                row["error"] = skip
            else:
                per_round, error = attempt(partial(host_us_per_call, call, settings.cpu_calls, settings.cpu_rounds))
                if error is None:
                    row.update(us_per_call=round(statistics.median(per_round), 2),
                               us_per_call_min=round(min(per_round), 2))
                else:
                    row["error"] = error
            writer.add(row)
    writer.update_metadata(section_s=round(time.perf_counter() - start, 1))
