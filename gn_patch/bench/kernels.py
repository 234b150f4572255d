"""The kernel table (kernels.json): GroupNorm+SiLU on every distinct GroupNorm input of the measured models,
float16 and bfloat16, forward and forward+backward, timed for gn_patch, PyTorch eager on NCHW and channels_last
input, torch.compile, and a device copy of the same bytes."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from functools import partial
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..ops import group_norm_act
from .models import SHAPE_SOURCES, STATIC_COMPILE_SOURCES, KernelShape, ModelCache, distinct_shapes, source_calls
from .models import static_compile_shapes
from .results import ResultFile, attempt, progress_bar, ratio, rounded
from .settings import DTYPES, PASSES, Settings
from .timing import WALL_MAX_CALLS, WALL_MIN_CALLS, gpu_time_us, sync, wall_time_us

# Timed implementations of the kernel table, in column order; each has a "<name>_us" key in kernels.json.
KERNEL_METHODS = ("gn_patch", "torch_nchw", "torch_cl", "compile_cl", "compile_static_cl")
# Inputs rotate over at least this many L2 sizes of distinct tensors, so no call finds its input in L2.
ROTATION_L2_MULTIPLE = 2


def bytes_moved(numel: int, element_size: int, pass_: str) -> int:
    """Bytes the op must move at least. fwd: read x, write y (2|x|). fwd+bwd adds read x, read dy, write dx (5|x|).

    Weight, bias, their gradients and the N x G statistics are O(C + N*G) and not counted.
    """
    tensors = {"fwd": 2, "fwd+bwd": 5}[pass_]
    return tensors * numel * element_size


def rotation_sets(bytes_per_set: int, l2_bytes: int) -> int:
    """Distinct input sets to cycle through so that together they exceed ROTATION_L2_MULTIPLE x L2."""
    return max(1, math.ceil(ROTATION_L2_MULTIPLE * l2_bytes / bytes_per_set))


def channels_last_randn(shape: tuple[int, ...], n: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """n random tensors of ``shape`` with the channel dim innermost (channels_last for 4-D, (B, L, C)-major for 3-D)."""
    physical = torch.randn((n, shape[0], *shape[2:], shape[1]), dtype=dtype, device="cuda")
    return [t.movedim(-1, 1) for t in physical.unbind(0)]


class RotationPool:
    """The distinct inputs of one kernel-table cell: n_sets x tensors per layout, weight and bias, and for fwd+bwd
    n_sets dy tensors per output layout (each method gets dy in the layout of its own y, as autograd would)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, n_sets: int, backward: bool):
        self.shape, self.dtype, self.n_sets, self.backward = shape, dtype, n_sets, backward
        self._xs: dict[str, list[torch.Tensor]] = {}
        self._dys: dict[tuple, list[torch.Tensor]] = {}
        channels = shape[1]
        self.weight = (1 + 0.1 * torch.randn(channels, device="cuda")).to(dtype).requires_grad_(backward)
        self.bias = (0.1 * torch.randn(channels, device="cuda")).to(dtype).requires_grad_(backward)

    def xs(self, layout: str) -> list[torch.Tensor]:
        """The n_sets inputs in ``layout`` ("cl": channel stride 1, "nchw": contiguous), made on first use."""
        if layout not in self._xs:
            if layout == "cl":
                tensors = channels_last_randn(self.shape, self.n_sets, self.dtype)
            else:
                tensors = list(torch.randn((self.n_sets, *self.shape), dtype=self.dtype, device="cuda").unbind(0))
            # detach(): separate leaves, so that each x gets its own .grad (a view of a pool would not)
            self._xs[layout] = [t.detach().requires_grad_(self.backward) for t in tensors]
        return self._xs[layout]

    def inputs(self, layout: str, alias: bool = False, mark_dynamic: bool = False
               ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """(xs, weight, bias). ``alias``: new tensor objects over the same memory, so that the dynamic-dim marks
        and compile guards of one method never touch another's tensors; ``mark_dynamic``: every dim of them
        marked dynamic for torch.compile."""
        tensors = (*self.xs(layout), self.weight, self.bias)
        if alias:
            tensors = tuple(t.detach().requires_grad_(self.backward) for t in tensors)
        if mark_dynamic:
            for tensor in tensors:
                for dim in range(tensor.dim()):
                    torch._dynamo.maybe_mark_dynamic(tensor, dim)
        return list(tensors[:-2]), tensors[-2], tensors[-1]

    def dys_like(self, y: torch.Tensor) -> list[torch.Tensor]:
        """n_sets upstream gradients with y's shape, dtype and strides (made once per layout of y)."""
        key = y.stride()
        if key not in self._dys:
            self._dys[key] = [torch.randn_like(y, requires_grad=False) for _ in range(self.n_sets)]
        return self._dys[key]




def make_step(op: Callable, xs: list[torch.Tensor], weight: torch.Tensor, bias: torch.Tensor,
              dys: list[torch.Tensor] | None) -> Callable[[int], Any]:
    """Call i of a loop over the pool: y = op(x_i, w, b), and with dys, y.backward(dy_i) with fresh gradients
    (set to None first, so that no accumulation kernel is timed)."""
    if dys is None:
        return lambda i: op(xs[i], weight, bias)

    def step(i: int) -> None:
        x = xs[i]
        x.grad = weight.grad = bias.grad = None
        op(x, weight, bias).backward(dys[i])

    return step




def torch_gn_silu(x, weight, bias, num_groups: int, eps: float):
    """What the stock model computes: F.group_norm, then F.silu."""
    return F.silu(F.group_norm(x, num_groups, weight, bias, eps))


def torch_gn_silu_static(x, weight, bias, num_groups: int, eps: float):
    """torch_gn_silu under another code object, for the static-shape compile."""
    # A code object of its own: dynamo keeps compiled graphs per code object, and the static compiles must neither
    # reuse nor count against the dynamic-shape compilations of torch_gn_silu.
    return torch_gn_silu(x, weight, bias, num_groups, eps)


@dataclass
class CellTimes:
    """What one kernel-table cell measured, by method name ("copy" and KERNEL_METHODS)."""

    gpu_us: dict[str, float] = field(default_factory=dict)
    wall_us: dict[str, float] = field(default_factory=dict)
    timing: dict[str, str] = field(default_factory=dict)
    first_call_s: dict[str, float] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


def kernel_row(ks: KernelShape, dtype: str, pass_: str, element_size: int, n_sets: int, fits_l2: bool,
               times: CellTimes) -> dict:
    """One kernels.json row: the cell's identity, its times, and what follows from them."""
    moved = bytes_moved(ks.numel, element_size, pass_)
    gn = times.gpu_us.get("gn_patch")
    row = {
        "shape": list(ks.shape), "num_groups": ks.num_groups, "eps": ks.eps, "eps_seen": list(ks.eps_seen),
        "dtype": dtype, "pass": pass_, "source": ",".join(ks.calls), "calls": ks.calls, "sites": list(ks.sites),
        "bytes": moved, "rotation_sets": n_sets, "fits_l2": fits_l2,
        "copy_us": rounded(times.gpu_us.get("copy")),
    }
    for method in KERNEL_METHODS:
        row[f"{method}_us"] = rounded(times.gpu_us.get(method))
    for method in KERNEL_METHODS:
        row[f"{method}_wall_us"] = rounded(times.wall_us.get(method))
    row["gbps"] = None if not gn else round(moved / gn / 1e3, 1)
    row["copy_gbps"] = None if not times.gpu_us.get("copy") else round(moved / times.gpu_us["copy"] / 1e3, 1)
    row["ratio_to_copy"] = ratio(gn, times.gpu_us.get("copy"))
    for method in KERNEL_METHODS[1:]:
        row[f"speedup_vs_{method}"] = ratio(times.gpu_us.get(method), gn)
    row["timing"] = times.timing
    row["compile_first_call_s"] = {k: round(v, 2) for k, v in times.first_call_s.items()}
    row["errors"] = times.errors
    return row


class KernelBench:
    """Times every method of the kernel table on one (shape, dtype, pass) cell."""

    def __init__(self, settings: Settings, l2_bytes: int, kernels_ok: bool, static_keys: set[tuple]):
        self.settings, self.l2_bytes, self.kernels_ok, self.static_keys = settings, l2_bytes, kernels_ok, static_keys
        compiling = bool(settings.compile_dtypes)
        self.compiled = torch.compile(torch_gn_silu) if compiling else None
        self.compiled_static = torch.compile(torch_gn_silu_static, dynamic=False) if compiling else None

    def methods(self, ks: KernelShape, dtype: str) -> list[tuple[str, str, Callable, str | None]]:
        """(name, input layout, op(x, w, b), reason it is not run) for each method of this cell."""
        groups, eps = ks.num_groups, ks.eps
        no_kernels = None if self.kernels_ok else "gn_patch CUDA kernels unavailable: not timing PyTorch's fallback"
        methods = [
            ("gn_patch", "cl", lambda x, w, b: group_norm_act(x, groups, w, b, eps, "silu"), no_kernels),
            ("torch_nchw", "nchw", lambda x, w, b: torch_gn_silu(x, w, b, groups, eps), None),
            ("torch_cl", "cl", lambda x, w, b: torch_gn_silu(x, w, b, groups, eps), None),
        ]
        if dtype in self.settings.compile_dtypes:
            methods.append(("compile_cl", "cl", lambda x, w, b: self.compiled(x, w, b, groups, eps), None))
            if (ks.shape, groups) in self.static_keys:
                methods.append(("compile_static_cl", "cl",
                                lambda x, w, b: self.compiled_static(x, w, b, groups, eps), None))
        return methods

    def run(self, ks: KernelShape, dtype_name: str, pass_: str) -> dict:
        """The kernels.json row of one cell (shape, "float16"/"bfloat16", "fwd"/"fwd+bwd"): every method timed;
        what fails is recorded in the row's errors, never raised."""
        dtype, backward = DTYPES[dtype_name], pass_ == "fwd+bwd"
        element_size = torch.empty((), dtype=dtype).element_size()
        x_bytes = ks.numel * element_size
        n_sets = rotation_sets(x_bytes * (2 if backward else 1), self.l2_bytes)
        fits_l2 = x_bytes <= self.l2_bytes
        times = CellTimes()
        self._time("copy", times, partial(self._copy_floor, bytes_moved(ks.numel, element_size, pass_), dtype))
        pool, error = attempt(partial(RotationPool, ks.shape, dtype, n_sets, backward))
        if error is not None:  # no inputs, no method: the row says why
            times.errors["cell"] = error
            return kernel_row(ks, dtype_name, pass_, element_size, n_sets, fits_l2, times)
        for name, layout, op, skip_reason in self.methods(ks, dtype_name):
            if skip_reason:
                times.errors[name] = skip_reason
            else:
                self._time(name, times, partial(self._method, pool, name, layout, op, fits_l2))
        return kernel_row(ks, dtype_name, pass_, element_size, n_sets, fits_l2, times)

    @staticmethod
    def _time(name: str, times: CellTimes, measure: Callable[[], dict]) -> None:
        """Run one measurement into ``times``; a failure becomes that method's error, not the run's."""
        result, error = attempt(measure)
        if error is not None:
            times.errors[name] = error
            sync()
            torch.cuda.empty_cache()  # after an out-of-memory error, give the next measurement a clean slate
            return
        times.gpu_us[name], times.timing[name] = result["gpu_us"], result["timing"]
        for key, store in (("wall_us", times.wall_us), ("first_call_s", times.first_call_s)):
            if result.get(key) is not None:
                store[name] = result[key]

    def _copy_floor(self, moved: int, dtype: torch.dtype) -> dict:
        """Copies of flat tensors holding moved/2 bytes (the same total bytes read plus written as the op): the
        faster of dst.copy_(src) (cudaMemcpyAsync) and torch.neg(src, out=dst) (an elementwise kernel), since
        neither is the faster at every size."""
        element_size = torch.empty((), dtype=dtype).element_size()
        numel = math.ceil(moved / (2 * element_size))
        n_sets = rotation_sets(numel * element_size, self.l2_bytes)
        srcs = torch.randn((n_sets, numel), dtype=dtype, device="cuda").unbind(0)
        dst = torch.empty(numel, dtype=dtype, device="cuda")
        memcpy_us, how = gpu_time_us(lambda i: dst.copy_(srcs[i]), n_sets, self.settings.graph_ms)
        kernel_us, _ = gpu_time_us(lambda i: torch.neg(srcs[i], out=dst), n_sets, self.settings.graph_ms)
        return {"gpu_us": min(memcpy_us, kernel_us), "timing": how}

    def _method(self, pool: RotationPool, name: str, layout: str, op: Callable, fits_l2: bool) -> dict:
        compiled = name.startswith("compile")
        xs, weight, bias = pool.inputs(layout, alias=compiled, mark_dynamic=name == "compile_cl")
        with torch.set_grad_enabled(pool.backward):
            # First call apart: it compiles (torch.compile) and tells the layout of y, which dy must share.
            sync()
            start = time.perf_counter()
            y = op(xs[0], weight, bias)
            dys = pool.dys_like(y) if pool.backward else None
            if dys is not None:
                y.backward(dys[0])
            sync()
            first_call_s = time.perf_counter() - start
            del y
            step = make_step(op, xs, weight, bias, dys)
            gpu_us, how = gpu_time_us(step, pool.n_sets, self.settings.graph_ms)
            wall_us = wall_time_us(step, pool.n_sets, self.settings.wall_rounds) if fits_l2 else None
        for tensor in (*xs, weight, bias):
            tensor.grad = None
        return {"gpu_us": gpu_us, "timing": how, "wall_us": wall_us, "first_call_s": first_call_s if compiled else None}


def kernel_notes(settings: Settings, l2_bytes: int) -> dict:
    """How kernels.json was measured, stored in its metadata and repeated in summary.md."""
    compile_note = ("compile_cl: torch.compile(F.group_norm + F.silu), default mode, every dim of x, weight and bias "
                    "marked dynamic (torch._dynamo.maybe_mark_dynamic): one compiled function serves all shapes, "
                    "recompiled only for dtype, grad mode, eps, rank and dynamo's specialisation of size-1 dims "
                    "(batch 1). compile_static_cl: torch.compile(dynamic=False), one compile per shape, for the "
                    f"top-traffic shape of {', '.join(STATIC_COMPILE_SOURCES)}: what shape specialisation buys. "
                    f"Compile budget: compile columns for {', '.join(settings.compile_dtypes)} rows only.")
    return {
        "rows": "one per distinct (shape, num_groups) of the GroupNorm calls the source models make (forward "
                "pre-hooks on every nn.GroupNorm); calls differing only in eps share a row (eps_seen) and are "
                "timed with the first eps; calls = calls per model call",
        "methods": "gn_patch: gn_patch.group_norm_act(x, activation='silu') on channels_last x. torch_nchw: "
                   "F.silu(F.group_norm(x)) on contiguous NCHW x. torch_cl: the same on channels_last x (PyTorch's "
                   "CUDA GroupNorm makes x contiguous and returns NCHW; converting y back, which the next "
                   "channels_last conv pays, is not counted; in fwd+bwd autograd copies dx back to x's layout, which "
                   "is). 3-D (N, C, L) inputs: channels_last = channel stride 1. "
                   + (compile_note if settings.compile_dtypes else "compile columns: not run (--quick)."),
        "gpu_time": "*_us: GPU time per call. The calls of one pass over the rotation pool are captured in a CUDA "
                    f"graph and replayed >= 5 times (about {settings.graph_ms:g} ms of GPU time): median replay time "
                    "(CUDA events) / calls per graph. Warm-up calls excluded. timing says 'graph', or 'events' where "
                    "capture failed and CUDA events timed the eager loop.",
        "wall_time": "*_wall_us, only where x fits in L2 (the sizes where launches can dominate): host clock around "
                     f"{WALL_MIN_CALLS}-{WALL_MAX_CALLS} eager calls plus torch.cuda.synchronize(), per call, median "
                     f"of {settings.wall_rounds} rounds: what an eager caller pays.",
        "rotation": f"x (and dy for fwd+bwd) rotate over rotation_sets distinct tensors holding >= "
                    f"{ROTATION_L2_MULTIPLE} x L2 ({l2_bytes / 2**20:.0f} MiB) in total, so no call finds its "
                    "input in L2.",
        "byte_model": "bytes: fwd = read x + write y = 2|x|; fwd+bwd = fwd + read x + read dy + write dx = 5|x|; "
                      "weight, bias, their gradients and the N x G statistics are left out. gbps = bytes / "
                      "gn_patch_us; ratio_to_copy = gn_patch_us / copy_us; speedup_vs_M = M_us / gn_patch_us.",
        "copy_floor": "copy_us: the faster of dst.copy_(src) and torch.neg(src, out=dst) over flat tensors of "
                      "bytes/2 bytes (the same total bytes read plus "
                      "written), rotated the same way, timed the same way.",
        "backward": "fwd+bwd: x, weight and bias (input dtype) require grad; each call sets their .grad to None, "
                    "y = op(x, w, b), y.backward(dy), dy in y's own layout. fwd runs under torch.no_grad().",
    }


def compile_limits():
    """Room for the kernel table's recompiles (dtype, grad mode, eps, rank, batch 1), and an error rather than
    dynamo's silent fall back to eager once the limit is hit. Keys this torch lacks are left out."""
    wanted = {"recompile_limit": 64, "fail_on_recompile_limit_hit": True}
    return torch._dynamo.config.patch(**{k: v for k, v in wanted.items() if hasattr(torch._dynamo.config, k)})


def run_kernels(settings: Settings, cache: ModelCache, out: Path, metadata: dict, max_shapes: int | None,
                kernels_ok: bool) -> None:
    """Collect the models' GroupNorm shapes, then time every (shape, dtype, pass) cell into kernels.json."""
    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    calls_by_source, collection_errors = {}, {}
    for source in SHAPE_SOURCES:
        if source.name in settings.kernel_sources:
            calls, error = attempt(partial(source_calls, source, cache))  # the other sources still give rows
            if error is None:
                calls_by_source[source.name] = calls
            else:
                collection_errors[source.name] = error
    shapes = distinct_shapes(calls_by_source)[:max_shapes]
    static_keys = static_compile_shapes(shapes) if settings.compile_dtypes else set()
    writer = ResultFile(out / "kernels.json", {
        **metadata, "notes": kernel_notes(settings, l2_bytes),
        "sources": {s.name: {"model": s.model, "batch": s.batch, "image": s.latent * 8, "hooked_on": s.device,
                             "group_norm_calls": len(calls_by_source[s.name])}
                    for s in SHAPE_SOURCES if s.name in calls_by_source},
        "collection_errors": collection_errors,
        "static_compile_shapes": sorted(list(shape) for shape, _ in static_keys),
    })
    bench = KernelBench(settings, l2_bytes, kernels_ok, static_keys)
    cells = [(ks, dtype, pass_) for ks in shapes for dtype in DTYPES for pass_ in PASSES]
    start = time.perf_counter()
    with compile_limits(), progress_bar(cells, desc="kernels", unit="cell") as progress:
        for ks, dtype, pass_ in progress:
            progress.set_postfix_str(f"{'x'.join(map(str, ks.shape))} {dtype} {pass_}")
            writer.add(bench.run(ks, dtype, pass_))
    writer.update_metadata(section_s=round(time.perf_counter() - start, 1))

