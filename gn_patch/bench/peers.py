"""gn_patch against the public NHWC GroupNorm kernels a diffusers user could pick instead (peers.json).

The peers are loaded at run time from a folder DIR laid out as follows; none of their code is part of gn_patch:

* ``DIR/gnnhwc/``: latentCall145/channels-last-groupnorm as the package ``gnnhwc`` (``GN_NHWC``); importing it
  compiles its extension (~1 min).
* ``DIR/apex_gn/``: NVIDIA apex's ``apex/contrib/csrc/group_norm`` (a copy or a symlink), compiled here with
  torch.utils.cpp_extension.load (~2 min with MAX_JOBS=16).
* ``DIR/sfast/``: stable-fast's ``sfast`` package, for ``sfast.triton.ops.group_norm.group_norm_silu_forward``
  (Triton, forward only).

A peer that is missing, fails to build or fails to run is recorded in the rows and skipped. The compiled peers
are built at once in subprocesses of their own and cached in a build folder (reused by later runs on the same
machine). What is timed matches the project's side-by-side harness (the 20 shapes, G = 32, SiLU, both timings),
so the numbers compare; peers_table has the rows and the report.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..extension import build_lock
from ..ops import group_norm_act
from .peers_table import TOLERANCES, PeerMeasurement, peer_row
from .results import RowsFile, attempt, free_memory, package_version, progress_bar
from .timing import do_bench_us, gpu_time_us

# The shapes of the side-by-side harness: SD1.5/SDXL UNet and SD VAE GroupNorm inputs, 0.3 MB to 270 MB (fp16).
SHAPES = ((2, 320, 64, 64), (2, 640, 32, 32), (2, 1280, 16, 16), (2, 1280, 8, 8), (2, 2560, 8, 8),
          (2, 960, 64, 64), (1, 512, 64, 64), (1, 512, 128, 128), (1, 512, 256, 256), (1, 256, 512, 512),
          (1, 128, 512, 512), (2, 320, 128, 128), (2, 640, 64, 64), (2, 1280, 32, 32), (2, 2560, 32, 32),
          (1, 512, 512, 512), (1, 256, 1024, 1024), (1, 128, 1024, 1024), (8, 320, 64, 64), (16, 640, 32, 32))
GROUPS, EPS = 32, 1e-5
GRAPH_CALLS = 20   # calls per captured graph, as the harness
GRAPH_MS = 10.0    # GPU time spent replaying it (at least 5 replays)
DEVICE = "cuda"


@dataclass(frozen=True)
class PeerSource:
    """A peer: its key in the rows, its folder under DIR, and whether loading it compiles C++/CUDA."""

    name: str
    folder: str
    compiles: bool


PEER_SOURCES = (PeerSource("gnnhwc", "gnnhwc", True), PeerSource("apex", "apex_gn", True),
                PeerSource("sfast", "sfast", False))


@contextlib.contextmanager
def _importable_from(directory: Path, build_dir: Path) -> Iterator[None]:
    """``directory`` first on sys.path, and torch extensions built on import cached under ``build_dir``."""
    previous = os.environ.get("TORCH_EXTENSIONS_DIR")
    os.environ["TORCH_EXTENSIONS_DIR"] = str(build_dir / "torch_extensions")
    sys.path.insert(0, str(directory))
    try:
        yield
    finally:
        sys.path.remove(str(directory))
        if previous is None:
            del os.environ["TORCH_EXTENSIONS_DIR"]
        else:
            os.environ["TORCH_EXTENSIONS_DIR"] = previous


def _load_apex(folder: Path, build_dir: Path):
    from torch.utils.cpp_extension import load

    directory = build_dir / "apex_gn"
    directory.mkdir(parents=True, exist_ok=True)
    sources = [folder / "group_norm_nhwc_op.cpp", *sorted(folder.glob("*.cu"))]
    # apex's own build flags for this extension; gn_patch's lock clears a killed build's stale one
    with build_lock(directory):
        return load(name="group_norm_cuda", sources=[str(s) for s in sources], extra_include_paths=[str(folder)],
                    extra_cflags=["-O3"], extra_cuda_cflags=["-O3", "--use_fast_math", "--ftz=false"],
                    build_directory=str(directory))


def load_peer(name: str, directory: Path, build_dir: Path) -> Any:
    """The entry point of peer ``name`` from ``directory``: gnnhwc -> its GN_NHWC module class, apex -> its
    extension module (forward, backward), sfast -> group_norm_silu_forward. Compiles the peer into ``build_dir``
    where it needs that (ninja skips what is up to date).

    Raises:
        FileNotFoundError: the peer's folder is not in ``directory``.
        Exception: whatever its build or import raises.
    """
    source = next(s for s in PEER_SOURCES if s.name == name)
    folder = directory / source.folder
    if not folder.is_dir():
        raise FileNotFoundError(f"no {folder}")
    build_dir.mkdir(parents=True, exist_ok=True)
    if name == "apex":
        return _load_apex(folder, build_dir)
    with _importable_from(directory, build_dir):
        if name == "gnnhwc":
            return importlib.import_module("gnnhwc").GN_NHWC
        return importlib.import_module("sfast.triton.ops.group_norm").group_norm_silu_forward


_BUILD_SCRIPT = ("import sys; from pathlib import Path; from gn_patch.bench.peers import load_peer; "
                 "load_peer(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))")


def build_in_parallel(names: list[str], directory: Path, build_dir: Path) -> dict[str, str]:
    """Compile the peers ``names`` all at once, each in a subprocess (their compilers share the cores), so that
    loading them here then finds them built. Prints a line per peer; each build's output goes to
    ``build_dir``/<name>.log. Returns name -> error for the builds that failed."""
    build_dir.mkdir(parents=True, exist_ok=True)
    started = {}
    for name in names:
        log = build_dir / f"{name}.log"
        with log.open("w") as stream:
            started[name] = (subprocess.Popen([sys.executable, "-c", _BUILD_SCRIPT, name, str(directory),
                                               str(build_dir)], stdout=stream, stderr=subprocess.STDOUT), log)
    print(f"peers: building {', '.join(names)} in parallel (cache {build_dir})", flush=True)
    start, failed = time.perf_counter(), {}
    for name, (process, log) in started.items():
        if process.wait() != 0:
            tail = " ".join(log.read_text(errors="replace").split()[-60:])
            failed[name] = f"build failed (exit {process.returncode}; {log}): ...{tail[-400:]}"
        print(f"peers: {name} {'failed' if name in failed else 'built'} after {time.perf_counter() - start:.0f} s",
              flush=True)
    return failed


def load_peers(directory: Path, build_dir: Path) -> dict[str, Any]:
    """name -> entry point (see load_peer) for every peer of PEER_SOURCES; a peer missing or failing to build or
    import maps to a str, the reason. The compiled peers are built first, in parallel."""
    present = [s for s in PEER_SOURCES if (directory / s.folder).is_dir()]
    failed = build_in_parallel([s.name for s in present if s.compiles], directory, build_dir) if present else {}
    entries: dict[str, Any] = {}
    for source in PEER_SOURCES:
        if source.name in failed:
            entries[source.name] = failed[source.name]
            continue
        entry, error = attempt(partial(load_peer, source.name, directory, build_dir))
        entries[source.name] = entry if error is None else error
        print(f"peers: {source.name} {'loaded' if error is None else 'skipped: ' + error[:200]}", flush=True)
    return entries


@dataclass
class Inputs:
    """One (shape, dtype) cell's tensors: x channels_last (3 randn + 1) and its NCHW copy, weight and bias in the
    input dtype, grad_y in both layouts, and leaves requiring grad for the fwd+bwd calls."""

    x: torch.Tensor
    x_nchw: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor
    grad_y: torch.Tensor
    grad_y_nchw: torch.Tensor
    x_leaf: torch.Tensor
    x_nchw_leaf: torch.Tensor
    weight_leaf: torch.Tensor
    bias_leaf: torch.Tensor


def make_inputs(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> Inputs:
    """The harness's inputs for one cell, on ``device``."""
    x = (torch.randn(shape, device=device, dtype=dtype) * 3 + 1).to(memory_format=torch.channels_last)
    weight = torch.randn(shape[1], device=device, dtype=dtype)
    bias = torch.randn(shape[1], device=device, dtype=dtype)
    grad_y = torch.randn_like(x)
    return Inputs(x, x.contiguous(), weight, bias, grad_y, grad_y.contiguous(), x.clone().requires_grad_(),
                  x.contiguous().requires_grad_(), weight.clone().requires_grad_(), bias.clone().requires_grad_())


def reference(t: Inputs) -> torch.Tensor:
    """SiLU(GroupNorm(x)) computed in float32."""
    return F.silu(F.group_norm(t.x.float(), GROUPS, t.weight.float(), t.bias.float(), EPS))


def output_error(y: torch.Tensor, ref: torch.Tensor, dtype: str) -> tuple[float | None, bool]:
    """(largest |y - ref|, None where it is not finite; whether every element is within TOLERANCES[dtype])."""
    atol, rtol = TOLERANCES[dtype]
    error = (y.float() - ref).abs()
    within = bool((error <= atol + rtol * ref.abs()).all())  # NaN compares False: never within
    largest = error.max().item()
    return (largest if math.isfinite(largest) else None), within


Calls = tuple[Callable[[], Any], Callable[[], Any] | None]  # (forward returning y, forward+backward or None)


def _gn_patch_calls(_, t: Inputs) -> Calls:
    def forward_backward():
        y = group_norm_act(t.x_leaf, GROUPS, t.weight_leaf, t.bias_leaf, EPS, "silu")
        return torch.autograd.grad(y, (t.x_leaf, t.weight_leaf, t.bias_leaf), t.grad_y)

    return (lambda: group_norm_act(t.x, GROUPS, t.weight, t.bias, EPS, "silu")), forward_backward


def _torch_calls(_, t: Inputs) -> Calls:
    def forward_backward():
        y = F.silu(F.group_norm(t.x_nchw_leaf, GROUPS, t.weight_leaf, t.bias_leaf, EPS))
        return torch.autograd.grad(y, (t.x_nchw_leaf, t.weight_leaf, t.bias_leaf), t.grad_y_nchw)

    return (lambda: F.silu(F.group_norm(t.x_nchw, GROUPS, t.weight, t.bias, EPS))), forward_backward


def _gnnhwc_calls(module_class, t: Inputs) -> Calls:
    module = module_class(GROUPS, t.x.shape[1], activation="silu").to(t.x.device, t.x.dtype)
    with torch.no_grad():
        module.weight.copy_(t.weight)
        module.bias.copy_(t.bias)

    def forward():
        with torch.no_grad():
            return module(t.x)

    def forward_backward():
        return torch.autograd.grad(module(t.x_leaf), (t.x_leaf, module.weight, module.bias), t.grad_y)

    return forward, forward_backward


def apex_passes(shape) -> int:
    """apex's kernel for an input of ``shape`` (N, C, *spatial), as the peer harness (../shared/peers) picks it: the
    two-pass one above 1024 spatial positions, else the one-pass one."""
    return 2 if math.prod(shape[2:]) > 1024 else 1


def _apex_calls(extension, t: Inputs) -> Calls:
    passes = apex_passes(t.x.shape)

    def forward_backward():
        _, sums = extension.forward(t.x, GROUPS, t.weight, t.bias, EPS, passes, True)
        return extension.backward(t.grad_y, sums, t.x, GROUPS, t.weight, t.bias, EPS, passes, True)

    return (lambda: extension.forward(t.x, GROUPS, t.weight, t.bias, EPS, passes, True)[0]), forward_backward


def _sfast_calls(forward, t: Inputs) -> Calls:
    return (lambda: forward(t.x, GROUPS, t.weight, t.bias, EPS)[0]), None


CALLS = {"gn_patch": _gn_patch_calls, "torch": _torch_calls, "gnnhwc": _gnnhwc_calls, "apex": _apex_calls,
         "sfast": _sfast_calls}


def _graph_us(call: Callable[[], Any]) -> float:
    return gpu_time_us(lambda _: call(), GRAPH_CALLS, GRAPH_MS, eager_fallback=False)[0]


TIMERS = {"graph": _graph_us, "do_bench": do_bench_us}


def measure_cell(shape: tuple[int, ...], dtype: str, entries: dict[str, Any], timings: tuple[str, ...]
                 ) -> dict[str, PeerMeasurement]:
    """timing -> what every method of ``entries`` (method -> entry point, or the str saying why it has none)
    measured at ``shape`` and ``dtype``: its forward output's error, then its µs per call under each timing."""
    t = make_inputs(shape, getattr(torch, dtype), DEVICE)
    ref = reference(t)
    results = {timing: PeerMeasurement() for timing in timings}

    def record_error(key: str, error: str) -> None:
        for measured in results.values():
            measured.errors[key] = error

    for method, entry in entries.items():
        if isinstance(entry, str):
            record_error(method, entry)
            continue
        calls, error = attempt(partial(CALLS[method], entry, t))
        y, error = (None, error) if error else attempt(calls[0])
        if error:
            record_error(method, error)
            continue
        largest, within = output_error(y, ref, dtype)
        del y
        for measured in results.values():
            measured.max_err[method] = largest
            if not within:
                measured.wrong.add(method)
        for timing, measured in results.items():
            for pass_, call in zip(("fwd", "fwd_bwd"), calls, strict=True):
                if call is not None:
                    us, error = attempt(partial(TIMERS[timing], call))
                    if error:
                        measured.errors[f"{method} {pass_}"] = error
                    else:
                        measured.us[(method, pass_)] = us
    del t, ref
    free_memory()
    return results


def peer_sources(directory: Path) -> dict[str, str | None]:
    """name -> the commit each peer's folder was taken from (its SOURCE_COMMIT file), None where unknown."""
    commits = {}
    for source in PEER_SOURCES:
        path = directory / source.folder / "SOURCE_COMMIT"
        commits[source.name] = path.read_text().strip() if path.is_file() else None
    return commits


def run_peers(out: Path, metadata: dict, kernels_ok: bool, directory: Path, build_dir: Path,
              shapes: tuple[tuple[int, ...], ...] = SHAPES, dtypes: tuple[str, ...] = ("float16", "bfloat16"),
              timings: tuple[str, ...] = ("graph", "do_bench")) -> None:
    """Load the peers from ``directory`` (building into ``build_dir``), then time gn_patch, torch and every peer
    at each shape and dtype under each timing into ``out``/peers.json, one row per (shape, dtype, timing)."""
    entries: dict[str, Any] = {"gn_patch": None if kernels_ok else "gn_patch CUDA kernels unavailable",
                               "torch": None, **load_peers(directory, build_dir)}
    provenance = {"commit": metadata["commit"], "gpu": metadata["gpu"], "torch_version": torch.__version__,
                  "cuda": torch.version.cuda, "triton": package_version("triton"), "date": metadata["date"],
                  "peer_sources": peer_sources(directory)}
    writer = RowsFile(out / "peers.json")
    cells = [(shape, dtype) for shape in shapes for dtype in dtypes]
    with progress_bar(cells, desc="peers", unit="cell") as progress:
        for shape, dtype in progress:
            progress.set_postfix_str(f"{'x'.join(map(str, shape))} {dtype}")
            for timing, measured in measure_cell(shape, dtype, entries, timings).items():
                writer.add(peer_row(shape, dtype, timing, measured, provenance))
