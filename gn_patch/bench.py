"""Benchmark gn_patch against PyTorch on the GroupNorm calls that real diffusers models make.

    python -m gn_patch.bench                    # full run: kernels, end to end (with torch.compile), CPU cost
    python -m gn_patch.bench --quick            # fewer shapes and repeats, no torch.compile
    python -m gn_patch.bench --only kernels,cpu --out benchmarks/results/h200
    python -m gn_patch.bench --report-only      # summary.md and plots again from the JSON files in --out

Sections, each writing its JSON file row by row (a run cut short leaves what it had measured):

* ``kernels`` -> kernels.json: GroupNorm+SiLU on every distinct GroupNorm input of the SD1.5 UNet (512², batch 1
  and 2), the SDXL UNet (1024², batch 2) and the SD VAE decoder (to 512² and 1024²), collected by forward pre-hooks
  on the real modules; float16 and bfloat16, forward and forward+backward; gn_patch, PyTorch eager on NCHW and on
  channels_last input, torch.compile, and a device copy of the same bytes.
* ``e2e`` -> e2e.json: UNet calls, VAE decodes, the txt2img pipeline and a training step; stock NCHW, stock
  channels_last, patched, each eager and (some) compiled.
* ``cpu`` -> cpu_overhead.json: host cost of one call at a launch-bound shape.

Then summary.md, kernel_speedup.png and e2e.png. Everything needs a CUDA GPU except --report-only.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from . import configs, extension
from .modules import GroupNormAct
from .ops import group_norm_act

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "h200"
SECTIONS = ("kernels", "e2e", "cpu")
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
PASSES = ("fwd", "fwd+bwd")

# Timed implementations of the kernel table, in column order; each has a "<name>_us" key in kernels.json.
KERNEL_METHODS = ("gn_patch", "torch_nchw", "torch_cl", "compile_cl", "compile_static_cl")
# Inputs rotate over at least this many L2 sizes of distinct tensors, so no call finds its input in L2.
ROTATION_L2_MULTIPLE = 2
# Wall-time loops: enough calls to average out the host clock, few enough to stay cheap (launch-bound shapes
# only, where the GPU keeps up with the host and L2 residency of the inputs cannot change the result).
WALL_MIN_CALLS, WALL_MAX_CALLS = 50, 200
# torch.compile with static shapes for the top-traffic shape of these sources only (each shape is a compile).
STATIC_COMPILE_SOURCES = ("sd15_unet_512_b2", "vae_decode_512")


# ------------------------------------------------------------------------------------------------
# Run settings
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Settings:
    """What a full or a --quick run measures, and how long it spends on each measurement."""

    quick: bool
    kernel_sources: tuple[str, ...]   # ShapeSource names whose GroupNorm shapes get a row
    compile_dtypes: tuple[str, ...]   # dtypes whose rows get the compile_cl / compile_static_cl columns
    graph_ms: float                   # GPU time spent replaying one captured graph, split into >= 5 replays
    wall_rounds: int                  # rounds of the wall-time loop (median taken)
    e2e_compile: bool
    e2e_runs: dict[str, tuple[int, int]] = field(hash=False)  # config -> (warm-up calls, timed calls)
    cpu_calls: int                    # calls per round of the CPU-cost loop
    cpu_rounds: int


FULL = Settings(
    quick=False,
    kernel_sources=("sd15_unet_512_b1", "sd15_unet_512_b2", "sdxl_unet_1024_b2", "vae_decode_512", "vae_decode_1024"),
    compile_dtypes=("float16",), graph_ms=10.0, wall_rounds=3, e2e_compile=True,
    e2e_runs={"sd15_unet_512_b2": (3, 10), "vae_decode_512": (2, 10), "vae_decode_1024": (2, 5),
              "sd15_txt2img_512_30steps": (1, 3), "sdxl_unet_1024_b2": (2, 5), "sd15_train_512_b8": (2, 5)},
    cpu_calls=2000, cpu_rounds=7,
)
QUICK = Settings(
    quick=True,
    kernel_sources=("sd15_unet_512_b2", "vae_decode_512"),
    compile_dtypes=(), graph_ms=6.0, wall_rounds=2, e2e_compile=False,
    e2e_runs={"sd15_unet_512_b2": (2, 5), "vae_decode_512": (1, 5), "vae_decode_1024": (1, 3),
              "sd15_txt2img_512_30steps": (1, 2), "sdxl_unet_1024_b2": (1, 3), "sd15_train_512_b8": (1, 3)},
    cpu_calls=1000, cpu_rounds=3,
)


# ------------------------------------------------------------------------------------------------
# Result files: JSON rewritten after every row, with the run's metadata on top
# ------------------------------------------------------------------------------------------------
def commit_id() -> str:
    """$GN_PATCH_COMMIT (the device machine's copy of the tree has no .git), else git's HEAD, else 'unknown'."""
    if os.environ.get("GN_PATCH_COMMIT"):
        return os.environ["GN_PATCH_COMMIT"]
    try:
        result = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                                timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return result.stdout.strip() if result.returncode == 0 else "unknown"


def _package_version(name: str) -> str | None:
    try:
        return __import__(name).__version__
    except ImportError:
        return None


def run_metadata(quick: bool, argv: list[str]) -> dict:
    """The keys every JSON file starts with: what was measured, where, and when."""
    cuda = torch.cuda.is_available()
    props = torch.cuda.get_device_properties(0) if cuda else None
    return {
        "commit": commit_id(),
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "sms": props.multi_processor_count if props else None,
        "l2_bytes": getattr(props, "L2_cache_size", None),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "diffusers": _package_version("diffusers"),
        "triton": _package_version("triton"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "quick": quick,
        "command": " ".join(["python -m gn_patch.bench", *argv]),
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
    }


class ResultFile:
    """One JSON document ``{"metadata": {...}, "rows": [...]}``, rewritten atomically after every change; ``rows``
    are kept from an earlier run (see previous_e2e_rows)."""

    def __init__(self, path: Path, metadata: dict, rows: list[dict] | None = None):
        self.path = path
        self.doc = {"metadata": dict(metadata), "rows": list(rows or [])}
        path.parent.mkdir(parents=True, exist_ok=True)
        self._flush()

    def add(self, row: dict) -> None:
        self.doc["rows"].append(row)
        self._flush()

    def update_metadata(self, **entries: Any) -> None:
        self.doc["metadata"].update(entries)
        self._flush()

    def _flush(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.doc, indent=1, allow_nan=False) + "\n")
        os.replace(tmp, self.path)


def load_result(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if not numerator or not denominator else round(numerator / denominator, 3)


def describe_error(exc: BaseException) -> str:
    """One line for the JSON: the exception's type and the start of its message."""
    message = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {message[:400]}" if message else type(exc).__name__


def progress_bar(iterable=None, **kwargs) -> tqdm:
    """tqdm, updating rarely when stderr is not a terminal (a log then gets a few lines, not thousands)."""
    return tqdm(iterable, dynamic_ncols=True, mininterval=0.5 if sys.stderr.isatty() else 15.0, **kwargs)


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------
# Models (random weights from the published configs) and their inputs
# ------------------------------------------------------------------------------------------------
MODELS = {
    "sd15_unet": ("UNet2DConditionModel", configs.SD15_UNET),
    "sdxl_unet": ("UNet2DConditionModel", configs.SDXL_UNET),
    "sd_vae": ("AutoencoderKL", configs.SD_VAE),
}


def build_model(name: str, device: str, dtype: torch.dtype, seed: int = 0) -> nn.Module:
    """The model of MODELS[name] with seeded random weights, created directly on ``device``, in eval mode."""
    import diffusers

    class_name, config = MODELS[name]
    torch.manual_seed(seed)
    with torch.device(device):
        model = getattr(diffusers, class_name)(**config)
    # diffusers warns on every .to(dtype) about float32-only modules, even for models that have none
    verbosity = diffusers.logging.get_verbosity()
    diffusers.logging.set_verbosity_error()
    try:
        return model.to(dtype=dtype).eval()
    finally:
        diffusers.logging.set_verbosity(verbosity)


class ModelCache:
    """Float16 CUDA models built once per run: the kernel section hooks them, the e2e section then takes them."""

    def __init__(self):
        self._models: dict[str, nn.Module] = {}

    def get(self, name: str) -> nn.Module:
        if name not in self._models:
            self._models[name] = build_model(name, "cuda", torch.float16)
        return self._models[name]

    def take(self, name: str) -> nn.Module:
        """The model, now owned by the caller (who may convert or patch it in place)."""
        model = self.get(name)
        del self._models[name]
        return model


def unet_inputs(config, batch: int, latent: int, dtype: torch.dtype, device: str) -> tuple[tuple, dict]:
    """(args, kwargs) of one UNet call, in the form StableDiffusionPipeline uses (so that a compiled UNet serves
    both this call and the pipeline without recompiling). SDXL-style configs get their text/time conditioning."""
    sample = torch.randn(batch, config.in_channels, latent, latent, dtype=dtype, device=device)
    timestep = torch.tensor(999, device=device)
    context = torch.randn(batch, 77, config.cross_attention_dim, dtype=dtype, device=device)
    added = None
    if config.addition_embed_type == "text_time":
        pooled = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim
        pixels = latent * 8
        added = {"text_embeds": torch.randn(batch, pooled, dtype=dtype, device=device),
                 "time_ids": torch.tensor([[pixels, pixels, 0, 0, pixels, pixels]] * batch, dtype=dtype, device=device)}
    kwargs = dict(encoder_hidden_states=context, timestep_cond=None, cross_attention_kwargs=None,
                  added_cond_kwargs=added, return_dict=False)
    return (sample, timestep), kwargs


def unet_call(unet: nn.Module, batch: int, latent: int, dtype: torch.dtype, device: str) -> Callable[[], Any]:
    args, kwargs = unet_inputs(unet.config, batch, latent, dtype, device)
    return lambda: unet(*args, **kwargs)[0]


def vae_decode_call(vae: nn.Module, latent: int, dtype: torch.dtype, device: str, batch: int = 1) -> Callable[[], Any]:
    z = torch.randn(batch, vae.config.latent_channels, latent, latent, dtype=dtype, device=device)
    return lambda: vae.decode(z, return_dict=False)[0]


def build_txt2img_pipeline(unet: nn.Module, vae: nn.Module):
    """StableDiffusionPipeline from the given models, a DDIM scheduler with SD1.5's noise schedule, no text encoder,
    tokenizer or safety checker: the prompt comes as embeddings."""
    from diffusers import DDIMScheduler, StableDiffusionPipeline

    pipe = StableDiffusionPipeline(vae=vae, text_encoder=None, tokenizer=None, unet=unet,
                                   scheduler=DDIMScheduler(**configs.SCHEDULER), safety_checker=None,
                                   feature_extractor=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def txt2img_call(pipe, size: int, steps: int, device: str, dtype: torch.dtype) -> Callable[[], Any]:
    """One text-to-image generation (CFG 7.5, so the UNet runs at batch 2), decoded to a tensor image."""
    width = pipe.unet.config.cross_attention_dim
    prompt = torch.randn(1, 77, width, dtype=dtype, device=device)
    negative = torch.randn(1, 77, width, dtype=dtype, device=device)

    def call():
        generator = torch.Generator(device).manual_seed(0)
        return pipe(prompt_embeds=prompt, negative_prompt_embeds=negative, height=size, width=size,
                    num_inference_steps=steps, guidance_scale=7.5, output_type="pt", generator=generator).images

    return call


# ------------------------------------------------------------------------------------------------
# GroupNorm shapes of the real models, from forward pre-hooks
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GroupNormCall:
    """One nn.GroupNorm call seen by the hook: input shape, groups, eps, and the module name with indices as *."""

    shape: tuple[int, ...]
    num_groups: int
    eps: float
    site: str


@dataclass(frozen=True)
class ShapeSource:
    """A model call whose GroupNorm inputs give rows of the kernel table."""

    name: str
    model: str     # key of MODELS
    device: str    # where the hooked call runs: "cuda" (random weights), or "meta" (shapes only, no memory)
    batch: int
    latent: int    # latent height = width (image size / 8)


SHAPE_SOURCES = (
    ShapeSource("sd15_unet_512_b1", "sd15_unet", "cuda", 1, 64),
    ShapeSource("sd15_unet_512_b2", "sd15_unet", "cuda", 2, 64),
    ShapeSource("sdxl_unet_1024_b2", "sdxl_unet", "meta", 2, 128),
    ShapeSource("vae_decode_512", "sd_vae", "cuda", 1, 64),
    ShapeSource("vae_decode_1024", "sd_vae", "cuda", 1, 128),
)


def collect_group_norm_calls(model: nn.Module, run: Callable[[], Any]) -> list[GroupNormCall]:
    """Every nn.GroupNorm call that ``run()`` makes inside ``model``, in call order, from forward pre-hooks."""
    calls: list[GroupNormCall] = []

    def hook_for(name: str):
        site = re.sub(r"\.\d+(?=\.|$)", ".*", name)

        def record(module: nn.GroupNorm, args: tuple) -> None:
            calls.append(GroupNormCall(tuple(args[0].shape), module.num_groups, module.eps, site))

        return record

    handles = [module.register_forward_pre_hook(hook_for(name))
               for name, module in model.named_modules() if isinstance(module, nn.GroupNorm)]
    try:
        with torch.no_grad():
            run()
    finally:
        for handle in handles:
            handle.remove()
    return calls


def source_calls(source: ShapeSource, cache: ModelCache) -> list[GroupNormCall]:
    """The GroupNorm calls of one source's model call (float16; the dtype changes no shape)."""
    if source.device == "meta":
        model = build_model(source.model, "meta", torch.float16)
    else:
        model = cache.get(source.model)
    if source.model.endswith("vae"):
        run = vae_decode_call(model, source.latent, torch.float16, source.device, source.batch)
    else:
        run = unet_call(model, source.batch, source.latent, torch.float16, source.device)
    return collect_group_norm_calls(model, run)


@dataclass(frozen=True)
class KernelShape:
    """A distinct (input shape, num_groups) of the models, with who calls it and how often per forward.

    Calls that differ only in eps share a row (eps changes no work); ``eps`` is the first seen, the one timed.
    """

    shape: tuple[int, ...]
    num_groups: int
    eps: float
    eps_seen: tuple[float, ...]
    calls: dict[str, int] = field(hash=False)   # source name -> calls in one model call
    sites: tuple[str, ...] = ()

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def distinct_shapes(calls_by_source: dict[str, list[GroupNormCall]]) -> list[KernelShape]:
    """Dedupe the calls of all sources by (shape, num_groups), in order of first appearance."""
    merged: dict[tuple, dict] = {}
    for source, calls in calls_by_source.items():
        for call in calls:
            entry = merged.setdefault((call.shape, call.num_groups),
                                      {"eps": [], "calls": Counter(), "sites": []})
            entry["calls"][source] += 1
            for key, value in (("eps", call.eps), ("sites", call.site)):
                if value not in entry[key]:
                    entry[key].append(value)
    return [KernelShape(shape, groups, e["eps"][0], tuple(sorted(e["eps"])), dict(e["calls"]), tuple(e["sites"]))
            for (shape, groups), e in merged.items()]


def static_compile_shapes(shapes: list[KernelShape]) -> set[tuple]:
    """(shape, num_groups) of the shape moving the most bytes per model call in each STATIC_COMPILE_SOURCES source."""
    keys = set()
    for source in STATIC_COMPILE_SOURCES:
        users = [s for s in shapes if source in s.calls]
        if users:
            top = max(users, key=lambda s: s.calls[source] * s.numel)
            keys.add((top.shape, top.num_groups))
    return keys


# ------------------------------------------------------------------------------------------------
# Byte model and input rotation
# ------------------------------------------------------------------------------------------------
def bytes_moved(numel: int, element_size: int, pass_: str) -> int:
    """Bytes the op must move at least. fwd: read x, write y (2|x|). fwd+bwd adds read x, read dy, write dx (5|x|).

    Weight, bias, their gradients and the N x G statistics are O(C + N*G) and not counted.
    """
    tensors = {"fwd": 2, "fwd+bwd": 5}[pass_]
    return tensors * numel * element_size


def rotation_sets(bytes_per_set: int, l2_bytes: int) -> int:
    """Distinct input sets to cycle through so that together they exceed ROTATION_L2_MULTIPLE x L2."""
    return max(1, math.ceil(ROTATION_L2_MULTIPLE * l2_bytes / bytes_per_set))


def _channels_last_randn(shape: tuple[int, ...], n: int, dtype: torch.dtype) -> list[torch.Tensor]:
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
        if layout not in self._xs:
            if layout == "cl":
                tensors = _channels_last_randn(self.shape, self.n_sets, self.dtype)
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
        key = y.stride()
        if key not in self._dys:
            self._dys[key] = [torch.randn_like(y, requires_grad=False) for _ in range(self.n_sets)]
        return self._dys[key]


# ------------------------------------------------------------------------------------------------
# Timing primitives
# ------------------------------------------------------------------------------------------------
def _sync() -> None:
    torch.cuda.synchronize()


def _warm_up(step: Callable[[int], Any], n_sets: int, calls: int = 3) -> None:
    """A few calls on a side stream before capture, as torch.cuda.graph asks (lazy init, autotuning, allocator)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(calls):
            step(i % n_sets)
    torch.cuda.current_stream().wait_stream(side)
    _sync()


def _median_event_ms(run: Callable[[], Any], target_ms: float, min_reps: int = 5, max_reps: int = 100) -> float:
    """Median GPU time of ``run()`` between two CUDA events, over as many repetitions as fill about target_ms."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    _sync()
    reps = int(min(max_reps, max(min_reps, target_ms / max(start.elapsed_time(end), 1e-3))))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        run()
        end.record()
    _sync()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def gpu_time_us(step: Callable[[int], Any], n_sets: int, target_ms: float) -> tuple[float, str]:
    """GPU time of one call, in µs, and how it was taken.

    The n_sets calls of one pass over the rotation pool are captured in a CUDA graph, which is replayed: the median
    replay time divided by n_sets is the GPU time without launch overhead. Calls that cannot be captured are timed
    with CUDA events around the eager loop instead ("events (<why>)").
    """
    _warm_up(step, n_sets)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for i in range(n_sets):
                step(i)
    except Exception as exc:  # noqa: BLE001 - whatever the op does that capture forbids, time it eagerly instead
        _sync()
        how = f"events ({type(exc).__name__})"
        return _median_event_ms(lambda: [step(i) for i in range(n_sets)], target_ms) * 1e3 / n_sets, how
    return _median_event_ms(graph.replay, target_ms) * 1e3 / n_sets, "graph"


def wall_time_us(step: Callable[[int], Any], n_sets: int, rounds: int) -> float:
    """Host time per call of an eager Python loop, synchronized at both ends: what an eager caller pays."""
    calls = min(max(n_sets, WALL_MIN_CALLS), WALL_MAX_CALLS)
    per_call = []
    for _ in range(rounds):
        _sync()
        start = time.perf_counter()
        for i in range(calls):
            step(i % n_sets)
        _sync()
        per_call.append((time.perf_counter() - start) / calls)
    return statistics.median(per_call) * 1e6


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


# ------------------------------------------------------------------------------------------------
# Kernel table
# ------------------------------------------------------------------------------------------------
def torch_gn_silu(x, weight, bias, num_groups: int, eps: float):
    """What the stock model computes: F.group_norm, then F.silu."""
    return F.silu(F.group_norm(x, num_groups, weight, bias, eps))


def torch_gn_silu_static(x, weight, bias, num_groups: int, eps: float):
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
        "copy_us": _round(times.gpu_us.get("copy")),
    }
    for method in KERNEL_METHODS:
        row[f"{method}_us"] = _round(times.gpu_us.get(method))
    for method in KERNEL_METHODS:
        row[f"{method}_wall_us"] = _round(times.wall_us.get(method))
    row["gbps"] = None if not gn else round(moved / gn / 1e3, 1)
    row["copy_gbps"] = None if not times.gpu_us.get("copy") else round(moved / times.gpu_us["copy"] / 1e3, 1)
    row["ratio_to_copy"] = _ratio(gn, times.gpu_us.get("copy"))
    for method in KERNEL_METHODS[1:]:
        row[f"speedup_vs_{method}"] = _ratio(times.gpu_us.get(method), gn)
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
        dtype, backward = DTYPES[dtype_name], pass_ == "fwd+bwd"
        element_size = torch.empty((), dtype=dtype).element_size()
        x_bytes = ks.numel * element_size
        n_sets = rotation_sets(x_bytes * (2 if backward else 1), self.l2_bytes)
        fits_l2 = x_bytes <= self.l2_bytes
        times = CellTimes()
        self._time("copy", times, lambda: self._copy_floor(bytes_moved(ks.numel, element_size, pass_), dtype))
        try:
            pool = RotationPool(ks.shape, dtype, n_sets, backward)
            for name, layout, op, skip_reason in self.methods(ks, dtype_name):
                if skip_reason:
                    times.errors[name] = skip_reason
                    continue
                self._time(name, times, lambda: self._method(pool, name, layout, op, fits_l2))
        except Exception as exc:  # noqa: BLE001 - a failure outside the methods (inputs): the row says so
            times.errors["cell"] = describe_error(exc)
        return kernel_row(ks, dtype_name, pass_, element_size, n_sets, fits_l2, times)

    @staticmethod
    def _time(name: str, times: CellTimes, measure: Callable[[], dict]) -> None:
        """Run one measurement into ``times``; a failure becomes that method's error, not the run's."""
        try:
            result = measure()
        except Exception as exc:  # noqa: BLE001 - one failing cell must not stop the table
            times.errors[name] = describe_error(exc)
            _sync()
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
            _sync()
            start = time.perf_counter()
            y = op(xs[0], weight, bias)
            dys = pool.dys_like(y) if pool.backward else None
            if dys is not None:
                y.backward(dys[0])
            _sync()
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


def _compile_limits():
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
            try:
                calls_by_source[source.name] = source_calls(source, cache)
            except Exception as exc:  # noqa: BLE001 - the other sources still give rows
                collection_errors[source.name] = describe_error(exc)
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
    with _compile_limits(), progress_bar(cells, desc="kernels", unit="cell") as progress:
        for ks, dtype, pass_ in progress:
            progress.set_postfix_str(f"{'x'.join(map(str, ks.shape))} {dtype} {pass_}")
            writer.add(bench.run(ks, dtype, pass_))
    writer.update_metadata(section_s=round(time.perf_counter() - start, 1))


# ------------------------------------------------------------------------------------------------
# End to end
# ------------------------------------------------------------------------------------------------
# Variants in table order, and in the order they run: each eager variant converts the models of the one before
# in place (NCHW -> channels_last -> patched), so only one copy of each model is ever resident.
VARIANTS = ("stock_nchw", "stock_cl", "patched", "stock_cl+compile", "patched+compile")
VARIANT_ORDER = ("stock_nchw", "stock_cl", "stock_cl+compile", "patched", "patched+compile")
VARIANT_NOTES = {
    "stock_nchw": "diffusers model as built (NCHW), eager",
    "stock_cl": "model.to(memory_format=torch.channels_last), eager",
    "patched": "gn_patch.patch_model(model, channels_last=True), eager",
    "stock_cl+compile": "torch.compile (default mode) of the channels_last UNet / VAE decoder",
    "patched+compile": "torch.compile (default mode) of the patched UNet / VAE decoder",
}


@dataclass(frozen=True)
class E2EConfig:
    """One end-to-end measurement: a call built from the group's models.

    compile: "compile" = compiled in the full run (recompiling what earlier configs of its group compiled where its
    shapes differ); "reuse" = run compiled only with what the earlier configs of its group compiled (recompiling
    is an error). graphable: a stateless call, also replayed from a CUDA graph (graph_ms).
    """

    name: str
    group: str
    description: str
    make_call: Callable[[SimpleNamespace], Callable[[], Any]]
    compile: str
    graphable: bool


def _inference(call: Callable[[], Any]) -> Callable[[], Any]:
    def run():
        with torch.no_grad():
            return call()
    return run


def _train_step_call(models: SimpleNamespace, batch: int = 8, latent: int = 64) -> Callable[[], Any]:
    """One training step of the float32 SD1.5 UNet: bf16 autocast forward, MSE loss, backward, fused AdamW step."""
    unet = models.unet
    (sample, _), kwargs = unet_inputs(unet.config, batch, latent, torch.float32, "cuda")
    timesteps = torch.randint(0, 1000, (batch,), device="cuda")
    target = torch.randn_like(sample)
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-6, fused=True)

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            prediction = unet(sample, timesteps, **kwargs)[0]
        F.mse_loss(prediction.float(), target).backward()
        optimizer.step()

    return step


E2E_CONFIGS = (
    E2EConfig("sd15_unet_512_b2", "sd15", "SD1.5 UNet call, latents 2x4x64x64 (512²), fp16, no_grad",
              lambda m: _inference(unet_call(m.unet, 2, 64, torch.float16, "cuda")), "compile", True),
    E2EConfig("vae_decode_512", "sd15", "SD VAE decode, latents 1x4x64x64 to 512², fp16, no_grad",
              lambda m: _inference(vae_decode_call(m.vae, 64, torch.float16, "cuda")), "compile", True),
    E2EConfig("sd15_txt2img_512_30steps", "sd15",
              "StableDiffusionPipeline from components (text_encoder=None, tokenizer=None, prompt_embeds given), "
              "512², 30 DDIM steps, CFG 7.5 (UNet batch 2), VAE decode included, output_type='pt', fp16",
              lambda m: txt2img_call(build_txt2img_pipeline(m.unet, m.vae), 512, 30, "cuda", torch.float16),
              "reuse", False),
    # After the pipeline, which reuses the decoder compiled at 512²: this call compiles it again, for 1024².
    E2EConfig("vae_decode_1024", "sd15", "SD VAE decode, latents 1x4x128x128 to 1024², fp16, no_grad",
              lambda m: _inference(vae_decode_call(m.vae, 128, torch.float16, "cuda")), "compile", True),
    E2EConfig("sdxl_unet_1024_b2", "sdxl", "SDXL UNet call, latents 2x4x128x128 (1024²), fp16, no_grad",
              lambda m: _inference(unet_call(m.unet, 2, 128, torch.float16, "cuda")), "compile", True),
    E2EConfig("sd15_train_512_b8", "train",
              "SD1.5 UNet training step, batch 8 at 512²: fp32 weights, bf16 autocast forward, MSE loss, backward, "
              "WITH a fused AdamW step (lr 1e-6)", _train_step_call, "compile", False),
)
E2E_GROUPS = tuple(dict.fromkeys(c.group for c in E2E_CONFIGS))
# Modules (dotted paths from the group's models) that the "+compile" variants replace by torch.compile of them.
COMPILE_TARGETS = {"sd15": ("unet", "vae.decoder"), "sdxl": ("unet",), "train": ("unet",)}


def group_models(group: str, cache: ModelCache) -> SimpleNamespace:
    if group == "sd15":
        return SimpleNamespace(unet=cache.take("sd15_unet"), vae=cache.take("sd_vae"))
    if group == "sdxl":
        return SimpleNamespace(unet=cache.take("sdxl_unet"))
    return SimpleNamespace(unet=build_model("sd15_unet", "cuda", torch.float32).train())


def not_run_reason(config: E2EConfig, variant: str, settings: Settings) -> str | None:
    if not variant.endswith("+compile"):
        return None
    if not settings.e2e_compile:
        return "--quick skips torch.compile"
    return None


def enter_variant(variant: str, models: SimpleNamespace, kernels_ok: bool) -> dict:
    """Convert the models in place for an eager variant; returns what the surgeon did (patched only)."""
    if variant == "stock_cl":
        for model in vars(models).values():
            model.to(memory_format=torch.channels_last)
    elif variant == "patched":
        if not kernels_ok:
            raise RuntimeError("gn_patch CUDA kernels unavailable: the patched model would run PyTorch's GroupNorm")
        from . import patch_model

        reports = {name: patch_model(model, channels_last=True) for name, model in vars(models).items()}
        return {name: {"fused": len(r.patched), "skipped": [n for n, _ in r.skipped]} for name, r in reports.items()}
    return {}


@contextlib.contextmanager
def compiled_modules(models: SimpleNamespace, paths: tuple[str, ...]):
    """Replace each module at a dotted path from ``models`` by torch.compile of it; put the originals back after,
    and reset dynamo so that the next variant starts from a clean cache."""
    swapped = []
    try:
        for path in paths:
            *parents, name = path.split(".")
            parent = models
            for attribute in parents:
                parent = getattr(parent, attribute)
            module = getattr(parent, name)
            setattr(parent, name, torch.compile(module))
            swapped.append((parent, name, module))
        yield
    finally:
        for parent, name, module in reversed(swapped):
            setattr(parent, name, module)
        if swapped:
            torch._dynamo.reset()


def graph_replay_ms(call: Callable[[], Any], target_ms: float = 50.0) -> float:
    """GPU time of one call replayed from a CUDA graph: its kernels without the host's launch gaps."""
    _warm_up(lambda _: call(), 1, calls=1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return _median_event_ms(graph.replay, target_ms)


def time_calls(call: Callable[[], Any], warmup: int, repeats: int, graph: bool = False) -> dict:
    """Wall time (host clock around call + synchronize) and GPU time (CUDA events around the call), medians of
    ``repeats`` calls after ``warmup`` (>= 1; the first call is timed apart: compile time for compiled variants),
    the peak memory allocated during the timed calls, what was allocated before them (weights, inputs), and with
    ``graph`` the CUDA-graph replay time of the call (or why it could not be captured)."""
    _sync()
    start = time.perf_counter()
    call()
    _sync()
    first_call_s = time.perf_counter() - start
    for _ in range(warmup - 1):
        call()
    _sync()
    torch.cuda.reset_peak_memory_stats()
    resident_mb = torch.cuda.memory_allocated() / 2**20
    walls, gpus = [], []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        _sync()
        start = time.perf_counter()
        begin.record()
        call()
        end.record()
        _sync()
        walls.append((time.perf_counter() - start) * 1e3)
        gpus.append(begin.elapsed_time(end))
    result = {"wall_ms": round(statistics.median(walls), 3), "gpu_ms": round(statistics.median(gpus), 3),
              "peak_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1), "resident_mb": round(resident_mb, 1),
              "first_call_s": round(first_call_s, 2), "warmup": warmup, "repeats": repeats}
    if graph:
        try:
            result["graph_ms"] = round(graph_replay_ms(call), 3)
        except Exception as exc:  # noqa: BLE001 - the eager times stand without it
            _sync()
            result["graph_error"] = describe_error(exc)
    return result


def e2e_row(config: E2EConfig, variant: str, **values: Any) -> dict:
    return {"config": config.name, "variant": variant, "wall_ms": None, "gpu_ms": None, "peak_mb": None, **values}


def _e2e_cell(config: E2EConfig, variant: str, models: SimpleNamespace, settings: Settings,
              broken: str | None, compiled_ok: bool) -> dict:
    reason = not_run_reason(config, variant, settings)
    if reason:
        return e2e_row(config, variant, not_run=reason)
    if broken:
        return e2e_row(config, variant, error=broken)
    reuse = variant.endswith("+compile") and config.compile == "reuse"
    if reuse and not compiled_ok:
        return e2e_row(config, variant, error="not run: a compile cell it would reuse failed")
    guard = torch._dynamo.config.patch(error_on_recompile=True) if reuse else contextlib.nullcontext()
    try:
        call = config.make_call(models)
        with guard:
            return e2e_row(config, variant, **time_calls(call, *settings.e2e_runs[config.name], config.graphable))
    except Exception as exc:  # noqa: BLE001 - one failing cell must not stop the table
        return e2e_row(config, variant, error=describe_error(exc))
    finally:
        call = None  # drop the call's pipeline / optimizer now, so that _free_memory can release them
        for model in vars(models).values():
            model.zero_grad(set_to_none=True)
        _free_memory()


def previous_e2e_rows(path: Path, commit: str, groups: tuple[str, ...]) -> tuple[list[dict], dict]:
    """The rows and patch reports of an earlier e2e.json in ``path`` for the groups this run leaves out, so that
    runs of some groups each (``--e2e-groups``, e.g. one device call per group) add up to one table. Raises
    ValueError when that file is from another commit."""
    previous = load_result(path)
    if previous is None:
        return [], {}
    if previous["metadata"].get("commit") != commit:
        raise ValueError(f"{path} holds results of commit {previous['metadata'].get('commit')}, not {commit}: "
                         "measure into another --out")
    group_of = {c.name: c.group for c in E2E_CONFIGS}
    rows = [r for r in previous["rows"] if group_of.get(r["config"]) not in groups]
    reports = {g: r for g, r in previous["metadata"].get("patch_reports", {}).items() if g not in groups}
    return rows, reports


def run_e2e(settings: Settings, cache: ModelCache, out: Path, metadata: dict, kernels_ok: bool,
            groups: tuple[str, ...] = E2E_GROUPS) -> None:
    """Every E2E config of ``groups`` under every variant, group by group (the models of one group live together).
    Rows of the other groups already in ``out``/e2e.json (same commit) are kept."""
    kept_rows, kept_reports = previous_e2e_rows(out / "e2e.json", metadata["commit"], groups)
    writer = ResultFile(out / "e2e.json", {
        **metadata, "configs": {c.name: c.description for c in E2E_CONFIGS}, "variants": VARIANT_NOTES,
        "notes": {"wall_ms": "median over timed calls of host clock around call + torch.cuda.synchronize()",
                  "gpu_ms": "median over timed calls of CUDA events recorded around the call on the current stream "
                            "(includes the GPU's idle gaps while the host launches: launch-bound calls show ~wall)",
                  "graph_ms": "stateless inference configs: the same call captured once in a CUDA graph, median "
                              "replay time (CUDA events): the GPU work alone, without launch gaps",
                  "peak_mb": "torch.cuda.max_memory_allocated() over the timed calls, reset after warm-up; "
                             "resident_mb: allocated before them. The sd15 group keeps its UNet and VAE resident "
                             "together (the pipeline needs both), so its UNet and VAE rows include both weights",
                  "first_call_s": "first call alone (compile time included for compiled variants)",
                  "inputs": "seeded random weights and inputs; NCHW-contiguous latents, as the pipeline makes them",
                  "compile": "the pipeline's compiled variants reuse the UNet and VAE decoder compiled by the "
                             "sd15_unet_512_b2 and vae_decode_512 cells (a recompile would be an error)"},
        "patch_reports": kept_reports, "groups_run": list(groups),
    }, kept_rows)
    start = time.perf_counter()
    cells = sum(c.group in groups for c in E2E_CONFIGS) * len(VARIANTS)
    with progress_bar(total=cells, desc="e2e", unit="cell") as progress:
        for group in groups:
            _run_group(group, settings, cache, writer, progress, kernels_ok)
    writer.update_metadata(section_s=round(time.perf_counter() - start, 1))


def _run_group(group: str, settings: Settings, cache: ModelCache, writer: ResultFile, progress: tqdm,
               kernels_ok: bool) -> None:
    group_configs = [c for c in E2E_CONFIGS if c.group == group]
    broken = None  # error of a failed model build or conversion: it holds for every later variant
    try:
        models = group_models(group, cache)
    except Exception as exc:  # noqa: BLE001
        models, broken = SimpleNamespace(), describe_error(exc)
    for variant in VARIANT_ORDER:
        compiling = variant.endswith("+compile")
        if not compiling and broken is None:
            try:
                report = enter_variant(variant, models, kernels_ok)
                if report:
                    writer.update_metadata(patch_reports={**writer.doc["metadata"]["patch_reports"], group: report})
            except Exception as exc:  # noqa: BLE001
                broken = describe_error(exc)
        runs = [c for c in group_configs if not_run_reason(c, variant, settings) is None]
        targets = COMPILE_TARGETS.get(group, ()) if compiling and broken is None and runs else ()
        with compiled_modules(models, targets):
            compiled_ok = True
            for config in group_configs:
                progress.set_postfix_str(f"{config.name} {variant}")
                row = _e2e_cell(config, variant, models, settings, broken, compiled_ok)
                if compiling and config.compile == "compile" and row["wall_ms"] is None:
                    compiled_ok = False
                writer.add(row)
                progress.update()
    del models
    _free_memory()


# ------------------------------------------------------------------------------------------------
# CPU cost of one call
# ------------------------------------------------------------------------------------------------
CPU_SHAPE = (2, 1280, 8, 8)


def cpu_candidates(kernels_ok: bool) -> dict[str, tuple[Callable[[], Any] | None, str | None]]:
    """name -> (one call, reason it is not run) at CPU_SHAPE, float16."""
    groups, eps = 32, 1e-5
    x_nchw = torch.randn(CPU_SHAPE, dtype=torch.float16, device="cuda")
    x_cl = x_nchw.contiguous(memory_format=torch.channels_last)
    module = GroupNormAct(groups, CPU_SHAPE[1], eps=eps).to("cuda", torch.float16)
    weight, bias = module.weight.detach(), module.bias.detach()
    skip = None if kernels_ok else "gn_patch CUDA kernels unavailable"
    return {
        "gn_patch.group_norm_act (channels_last)": (lambda: group_norm_act(x_cl, groups, weight, bias, eps), skip),
        "GroupNormAct module (channels_last)": (lambda: module(x_cl), skip),
        "torch.ops.gn_patch.group_norm_act raw op (channels_last)":
            (lambda: torch.ops.gn_patch.group_norm_act(x_cl, weight, bias, groups, eps, "silu"), skip),
        "torch F.group_norm + F.silu (NCHW)": (lambda: torch_gn_silu(x_nchw, weight, bias, groups, eps), None),
        "torch F.group_norm + F.silu (channels_last)": (lambda: torch_gn_silu(x_cl, weight, bias, groups, eps), None),
    }


def host_us_per_call(call: Callable[[], Any], calls: int, rounds: int) -> list[float]:
    """Mean host µs per call of a tight loop (no synchronize inside; the GPU drains between rounds, untimed)."""
    for _ in range(min(calls, 100)):
        call()
    _sync()
    results = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        results.append((time.perf_counter() - start) / calls * 1e6)
        _sync()
    return results


def run_cpu(settings: Settings, out: Path, metadata: dict, kernels_ok: bool) -> None:
    writer = ResultFile(out / "cpu_overhead.json", {
        **metadata, "shape": list(CPU_SHAPE), "dtype": "float16", "grad_mode": "torch.no_grad()",
        "notes": "us_per_call: median over rounds of (host time of a loop of `calls` calls / calls), no synchronize "
                 "inside the loop; at this shape the GPU work per call is shorter than its launch, so this is the "
                 "host cost of the call (Python, dispatcher, launches)",
    })
    start = time.perf_counter()
    with torch.no_grad(), progress_bar(cpu_candidates(kernels_ok).items(), desc="cpu", unit="method") as progress:
        for name, (call, skip) in progress:
            row = {"method": name, "us_per_call": None, "us_per_call_min": None,
                   "calls": settings.cpu_calls, "rounds": settings.cpu_rounds}
            try:
                if skip:
                    raise RuntimeError(skip)
                per_round = host_us_per_call(call, settings.cpu_calls, settings.cpu_rounds)
                row.update(us_per_call=round(statistics.median(per_round), 2), us_per_call_min=round(min(per_round), 2))
            except Exception as exc:  # noqa: BLE001
                row["error"] = describe_error(exc)
            writer.add(row)
    writer.update_metadata(section_s=round(time.perf_counter() - start, 1))


# ------------------------------------------------------------------------------------------------
# Report: summary.md and plots
# ------------------------------------------------------------------------------------------------
def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def markdown_table(headers: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(_fmt(v) if not isinstance(v, str) else v for v in row) + " |" for row in rows]
    return "\n".join(lines)


def shape_label(shape: list[int]) -> str:
    return "x".join(map(str, shape))


def _speedup(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}x"


def provenance(meta: dict) -> str:
    """Where a section's numbers come from (sections of one summary may come from separate --only runs)."""
    keys = ("commit", "date", "quick", "section_s")
    return "_" + ", ".join(f"{k} {meta[k]}" for k in keys if meta.get(k) is not None) + "_"


def render_kernels(doc: dict) -> str:
    rows, notes = doc["rows"], doc["metadata"].get("notes", {})
    parts = ["## Kernel table: GroupNorm + SiLU", "", provenance(doc["metadata"]), "",
             *(f"- **{k}**: {v}" for k, v in notes.items()), ""]
    headers = ["shape", "G", "sources", "copy µs", "gn_patch µs", "NCHW µs", "CL µs", "compile µs",
               "compile static µs", "GB/s", "time/copy", "vs NCHW", "vs CL", "vs compile",
               "wall µs gn_patch / NCHW / CL / compile"]
    for dtype in DTYPES:
        for pass_ in PASSES:
            selected = [r for r in rows if r["dtype"] == dtype and r["pass"] == pass_]
            if not selected:
                continue
            table = [[shape_label(r["shape"]), r["num_groups"], r["source"], r["copy_us"], r["gn_patch_us"],
                      r["torch_nchw_us"], r["torch_cl_us"], r["compile_cl_us"], r["compile_static_cl_us"],
                      r["gbps"], r["ratio_to_copy"] and f"{r['ratio_to_copy']:.2f}",
                      _speedup(r["speedup_vs_torch_nchw"]), _speedup(r["speedup_vs_torch_cl"]),
                      _speedup(r["speedup_vs_compile_cl"]),
                      " / ".join(_fmt(r[f"{m}_wall_us"]) for m in ("gn_patch", "torch_nchw", "torch_cl", "compile_cl"))
                      if r["fits_l2"] else "GPU-bound"]
                     for r in selected]
            parts += [f"### {dtype}, {pass_}", "", markdown_table(headers, table), ""]
    errors = [(r, m, e) for r in rows for m, e in r.get("errors", {}).items()]
    if errors:
        parts += ["### Cells not measured", ""]
        parts += [f"- {shape_label(r['shape'])} {r['dtype']} {r['pass']} {m}: {e}" for r, m, e in errors]
        parts.append("")
    return "\n".join(parts + [render_model_totals(rows)])


def model_totals(rows: list[dict]) -> list[dict]:
    """Per source, dtype and pass: the GroupNorm+SiLU time of one model call (sum of calls x µs per method);
    None for a method where any of the source's shapes lacks a time."""
    totals = []
    sources = list(dict.fromkeys(s for r in rows for s in r["calls"]))
    for source in sources:
        for dtype in DTYPES:
            for pass_ in PASSES:
                selected = [r for r in rows if source in r["calls"] and r["dtype"] == dtype and r["pass"] == pass_]
                if not selected:
                    continue
                entry = {"source": source, "dtype": dtype, "pass": pass_,
                         "calls": sum(r["calls"][source] for r in selected)}
                for method in ("copy", *KERNEL_METHODS[:4]):
                    values = [r[f"{method}_us"] for r in selected]
                    entry[method] = (None if any(v is None for v in values)
                                     else sum(r["calls"][source] * v for r, v in zip(selected, values)) / 1e3)
                totals.append(entry)
    return totals


def render_model_totals(rows: list[dict]) -> str:
    table = [[t["source"], t["dtype"], t["pass"], t["calls"], t["copy"], t["gn_patch"], t["torch_nchw"], t["torch_cl"],
              t["compile_cl"], _speedup(_ratio(t["torch_cl"], t["gn_patch"]))] for t in model_totals(rows)]
    headers = ["source", "dtype", "pass", "GN calls", "copy ms", "gn_patch ms", "NCHW ms", "CL ms", "compile ms",
               "vs CL"]
    return "\n".join(["### GroupNorm+SiLU time per model call (sum over its GroupNorm calls of GPU time)", "",
                      markdown_table(headers, [[_fmt(v, 3) if isinstance(v, float) else v for v in r] for r in table]),
                      ""])


def _e2e_cell_text(row: dict | None) -> str:
    if row is None:
        return "–"
    if row.get("not_run"):
        return "not run"
    if row.get("error"):
        return "error"
    graph = f" / {row['graph_ms']:.1f}" if row.get("graph_ms") is not None else ""
    return f"{row['wall_ms']:.1f} / {row['gpu_ms']:.1f}{graph} ms, {row['peak_mb']:.0f} MB"


def e2e_table(doc: dict) -> str:
    """Configs x variants, each cell wall / GPU ms and peak MB, with the speedups of patching."""
    rows = {(r["config"], r["variant"]): r for r in doc["rows"]}

    def gain(config: str, stock: str, patched: str) -> str:
        before, after = rows.get((config, stock)) or {}, rows.get((config, patched)) or {}
        return _speedup(_ratio(before.get("wall_ms"), after.get("wall_ms")))

    table = [[config, *(_e2e_cell_text(rows.get((config, v))) for v in VARIANTS),
              gain(config, "stock_cl", "patched"), gain(config, "stock_cl+compile", "patched+compile")]
             for config in dict.fromkeys(r["config"] for r in doc["rows"])]
    return markdown_table(["config", *VARIANTS, "patched vs stock_cl", "patched vs stock, compiled"], table)


def render_e2e(doc: dict) -> str:
    meta = doc["metadata"]
    parts = ["## End to end", "", provenance(meta), "",
             "Cells: wall / CUDA-event GPU [/ CUDA-graph replay] ms (medians), peak memory allocated; speedups "
             "of wall time.", ""]
    parts += [f"- **{k}**: {v}" for k, v in meta.get("variants", {}).items()]
    parts += [f"- **{k}**: {v}" for k, v in meta.get("configs", {}).items()]
    parts += [f"- {k}: {v}" for k, v in meta.get("notes", {}).items()]
    parts += [f"- surgeon on {k}: {v}" for k, v in meta.get("patch_reports", {}).items()]
    parts += ["", e2e_table(doc), ""]
    remarks = [f"- {r['config']} / {r['variant']}: {r.get('not_run') or r.get('error')}"
               for r in doc["rows"] if r.get("not_run") or r.get("error")]
    if remarks:
        parts += ["Not run or failed:", "", *remarks, ""]
    return "\n".join(parts)


def cpu_table(doc: dict) -> str:
    table = [[r["method"], r["us_per_call"], r["us_per_call_min"], r.get("error", "")] for r in doc["rows"]]
    return markdown_table(["method", "µs/call (median)", "µs/call (min)", "error"], table)


def render_cpu(doc: dict) -> str:
    meta = doc["metadata"]
    return "\n".join([f"## CPU cost of one call: {shape_label(meta['shape'])} {meta['dtype']}, {meta['grad_mode']}",
                      "", provenance(meta), "", meta["notes"], "", cpu_table(doc), ""])


def render_summary(kernels: dict | None, e2e: dict | None, cpu: dict | None) -> str:
    """summary.md from whichever of the three documents exist."""
    docs = [d for d in (kernels, e2e, cpu) if d]
    meta = docs[0]["metadata"] if docs else {}
    header = ["# gn_patch benchmark" + (f": {meta['gpu']}" if meta.get("gpu") else ""), "",
              ", ".join(f"{k} {meta.get(k)}" for k in ("commit", "torch", "cuda", "diffusers", "triton", "date",
                                                     "quick")), "", f"`{meta.get('command', '')}`", ""]
    sections = [render(doc) for render, doc in ((render_kernels, kernels), (render_e2e, e2e), (render_cpu, cpu))
                if doc]
    return "\n".join(header + sections)


def plot_kernel_speedup(doc: dict, path: Path) -> None:
    """Bars per shape of gn_patch's speedup over the other methods, one panel per (dtype, pass)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(d, p) for d in DTYPES for p in PASSES if any(r["dtype"] == d and r["pass"] == p for r in doc["rows"])]
    if not panels:
        return
    methods = [m for m in KERNEL_METHODS[1:4] if any(r[f"speedup_vs_{m}"] for r in doc["rows"])]
    n_shapes = max(sum(1 for r in doc["rows"] if (r["dtype"], r["pass"]) == panel) for panel in panels)
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(8.0, 0.3 * n_shapes + 2), 3.4 * len(panels)), squeeze=False)
    width = 0.8 / max(1, len(methods))
    for ax, (dtype, pass_) in zip(axes[:, 0], panels):
        rows = [r for r in doc["rows"] if r["dtype"] == dtype and r["pass"] == pass_]
        for k, method in enumerate(methods):
            ax.bar([i + (k - (len(methods) - 1) / 2) * width for i in range(len(rows))],
                   [r[f"speedup_vs_{method}"] or 0 for r in rows], width, label=f"vs {method}")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(rows)), [shape_label(r["shape"]) for r in rows], rotation=90, fontsize=6)
        ax.set_ylabel("gn_patch speedup (x)")
        ax.set_title(f"{dtype}, {pass_} (GPU time; > 1: gn_patch faster)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_e2e(doc: dict, path: Path) -> None:
    """Per config, bars of each variant's wall time and, where measured, its CUDA-graph replay time (the GPU work
    alone); a missing bar is a cell not run or failed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    config_names = list(dict.fromkeys(r["config"] for r in doc["rows"]))
    if not config_names:
        return
    rows = {(r["config"], r["variant"]): r for r in doc["rows"]}
    columns = min(3, len(config_names))
    lines = math.ceil(len(config_names) / columns)
    fig, axes = plt.subplots(lines, columns, figsize=(4.6 * columns, 3.6 * lines), squeeze=False)
    for ax, config in zip(axes.flat, config_names):
        cells = [rows.get((config, v)) or {} for v in VARIANTS]
        for offset, key, label in ((-0.2, "wall_ms", "wall"), (0.2, "graph_ms", "GPU work (graph replay)")):
            values = [cell.get(key) for cell in cells]
            if not any(values):
                continue
            bars = ax.bar([i + offset for i in range(len(VARIANTS))], [v or 0 for v in values], 0.4, label=label)
            ax.bar_label(bars, ["n/a" if v is None else f"{v:.1f}" for v in values], fontsize=6)
        ax.set_xticks(range(len(VARIANTS)), VARIANTS, rotation=30, ha="right", fontsize=7)
        ax.set_title(config, fontsize=9)
        ax.set_ylabel("ms (median)")
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(config_names):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def console_summary(out: Path) -> str:
    """The headline tables, for the end of the run's output (per-model totals, end to end, CPU cost)."""
    kernels, e2e, cpu = (load_result(out / name) for name in ("kernels.json", "e2e.json", "cpu_overhead.json"))
    parts = [render_model_totals(kernels["rows"])] if kernels else []
    parts += [e2e_table(e2e)] if e2e else []
    parts += [cpu_table(cpu)] if cpu else []
    return "\n\n".join(parts)


def write_report(out: Path) -> list[Path]:
    """summary.md and the plots from the JSON files in ``out``; returns the files written."""
    kernels, e2e, cpu = (load_result(out / name) for name in ("kernels.json", "e2e.json", "cpu_overhead.json"))
    written = [out / "summary.md"]
    written[0].write_text(render_summary(kernels, e2e, cpu))
    for doc, plot, name in ((kernels, plot_kernel_speedup, "kernel_speedup.png"), (e2e, plot_e2e, "e2e.png")):
        if doc and doc["rows"]:
            try:
                plot(doc, out / name)
                written.append(out / name)
            except Exception as exc:  # noqa: BLE001 - a plot must not cost the measurements after it
                print(f"gn_patch.bench: {name} not drawn ({describe_error(exc)})", file=sys.stderr)
    return written


# ------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------
def _comma_list(text: str, choices: tuple[str, ...], what: str) -> tuple[str, ...]:
    """The comma-separated names of ``text``, each one of ``choices`` (argparse type functions below)."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in choices]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown {what}(s) {unknown or text!r}; choose from {', '.join(choices)}")
    return names


def parse_sections(text: str) -> tuple[str, ...]:
    return _comma_list(text, SECTIONS, "section")


def parse_e2e_groups(text: str) -> tuple[str, ...]:
    return _comma_list(text, E2E_GROUPS, "group")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m gn_patch.bench", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--quick", action="store_true",
                        help="SD1.5 UNet batch 2 and VAE 512² shapes only, fewer repeats, no torch.compile")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: %(default)s)")
    parser.add_argument("--only", type=parse_sections, default=SECTIONS, metavar="SECTIONS",
                        help="comma-separated sections to run, from kernels,e2e,cpu (default: all)")
    parser.add_argument("--e2e-groups", type=parse_e2e_groups, default=E2E_GROUPS, metavar="GROUPS",
                        help=f"end-to-end table: only these model groups, from {','.join(E2E_GROUPS)} (default: all); "
                             "rows of the others already in --out/e2e.json (same commit) are kept")
    parser.add_argument("--max-shapes", type=int, default=None, metavar="N",
                        help="kernel table: only the first N distinct shapes (smoke tests)")
    parser.add_argument("--report-only", action="store_true",
                        help="measure nothing: write summary.md and the plots from the JSON files in --out")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.report_only:
        for path in write_report(args.out):
            print(path)
        return 0
    if not torch.cuda.is_available():
        print("gn_patch.bench: needs a CUDA GPU (only --report-only runs without one)", file=sys.stderr)
        return 2
    settings = QUICK if args.quick else FULL
    metadata = run_metadata(args.quick, argv)
    start = time.perf_counter()
    kernels_ok = extension.kernels_available()  # builds the extension now, outside every timed region
    metadata.update(gn_patch_kernels=kernels_ok, extension_load_s=round(time.perf_counter() - start, 1))
    cache = ModelCache()
    runners = {
        "kernels": lambda: run_kernels(settings, cache, args.out, metadata, args.max_shapes, kernels_ok),
        "e2e": lambda: run_e2e(settings, cache, args.out, metadata, kernels_ok, args.e2e_groups),
        "cpu": lambda: run_cpu(settings, args.out, metadata, kernels_ok),
    }
    for section in SECTIONS:
        if section in args.only:
            section_start = time.perf_counter()
            try:
                runners[section]()
            except Exception:  # noqa: BLE001 - the rows written so far stay; the other sections still run
                traceback.print_exc()
            write_report(args.out)  # after every section, so that a later timeout still leaves a summary
            print(f"== {section}: {time.perf_counter() - section_start:.0f} s", flush=True)
    print(console_summary(args.out))
    print(f"== total {time.perf_counter() - start:.0f} s; results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
