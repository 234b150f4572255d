"""End to end (e2e.json): UNet calls, VAE decodes (video VAEs included), the txt2img pipeline and a training step,
each as stock NCHW, stock channels_last and patched, eager and compiled; for the zoo's configs, the output's error
against the float32 stock model besides."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from .models import (ModelCache, animatediff_call, build_model, build_txt2img_pipeline, image_unet_call,
                     txt2img_call, unet_call, unet_inputs, vae_decode_call, video_vae_decode_call)
from .results import ResultFile, attempt, free_memory, load_result, progress_bar
from .settings import Settings
from .timing import time_calls

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
    is an error); "none" = no compiled variants. graphable: a stateless call, also replayed from a CUDA graph
    (graph_ms). variants: the variants measured (the others get a not_run row). The calls of the groups in
    REFERENCE_DTYPES return their output, which is compared with the float32 stock model's.
    """

    name: str
    group: str
    description: str
    make_call: Callable[[SimpleNamespace], Callable[[], Any]]
    compile: str
    graphable: bool
    variants: tuple[str, ...] = VARIANTS


def inference(call: Callable[[], Any]) -> Callable[[], Any]:
    """``call`` under torch.no_grad()."""
    def run():
        with torch.no_grad():
            return call()
    return run


def train_step_call(models: SimpleNamespace, batch: int = 8, latent: int = 64) -> Callable[[], Any]:
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
              lambda m: inference(unet_call(m.unet, 2, 64, torch.float16, "cuda")), "compile", True),
    E2EConfig("vae_decode_512", "sd15", "SD VAE decode, latents 1x4x64x64 to 512², fp16, no_grad",
              lambda m: inference(vae_decode_call(m.vae, 64, torch.float16, "cuda")), "compile", True),
    E2EConfig("sd15_txt2img_512_30steps", "sd15",
              "StableDiffusionPipeline from components (text_encoder=None, tokenizer=None, prompt_embeds given), "
              "512², 30 DDIM steps, CFG 7.5 (UNet batch 2), VAE decode included, output_type='pt', fp16",
              lambda m: txt2img_call(build_txt2img_pipeline(m.unet, m.vae), 512, 30, "cuda", torch.float16),
              "reuse", False),
    # After the pipeline, which reuses the decoder compiled at 512²: this call compiles it again, for 1024².
    E2EConfig("vae_decode_1024", "sd15", "SD VAE decode, latents 1x4x128x128 to 1024², fp16, no_grad",
              lambda m: inference(vae_decode_call(m.vae, 128, torch.float16, "cuda")), "compile", True),
    E2EConfig("sdxl_unet_1024_b2", "sdxl", "SDXL UNet call, latents 2x4x128x128 (1024²), fp16, no_grad",
              lambda m: inference(unet_call(m.unet, 2, 128, torch.float16, "cuda")), "compile", True),
    E2EConfig("sd15_train_512_b8", "train",
              "SD1.5 UNet training step, batch 8 at 512²: fp32 weights, bf16 autocast forward, MSE loss, backward, "
              "WITH a fused AdamW step (lr 1e-6)", train_step_call, "compile", False),
    # The zoo (issue 14): models whose GroupNorms only the rule-based surgeon fuses; eager only.
    E2EConfig("cogvideox_vae_decode", "cogvideox",
              "CogVideoX VAE (THUDM/CogVideoX-2b) decode, latents 1x16x4x60x90 to 13 frames of 480x720, bf16, no_grad",
              lambda m: inference(video_vae_decode_call(m.vae, (1, 16, 4, 60, 90))), "none", True,
              ("stock_nchw", "patched")),
    E2EConfig("hunyuanvideo_vae_decode", "hunyuanvideo",
              "HunyuanVideo VAE decode, latents 1x16x3x40x64 to 9 frames of 320x512, fp16, no_grad",
              lambda m: inference(video_vae_decode_call(m.vae, (1, 16, 3, 40, 64))), "none", True,
              ("stock_nchw", "patched")),
    E2EConfig("animatediff_unet", "animatediff",
              "AnimateDiff UNetMotionModel (SD1.5 + motion adapter v1-5-2) call, latents 2x4x16x64x64 (16 frames of "
              "512², batch 2), fp16, no_grad", lambda m: inference(animatediff_call(m.unet, 2, 16, 64)), "none", True,
              ("stock_nchw", "stock_cl", "patched")),
    E2EConfig("scale_shift_unet", "scale_shift",
              "Kandinsky 2.2 decoder UNet (resnet_time_scale_shift='scale_shift') call, latents 2x4x96x96 (768², "
              "batch 2), image embeddings, fp16, no_grad", lambda m: inference(image_unet_call(m.unet, 2, 96)),
              "none", True, ("stock_nchw", "stock_cl", "patched")),
)
E2E_GROUPS = tuple(dict.fromkeys(c.group for c in E2E_CONFIGS))
# Modules (dotted paths from the group's models) that the "+compile" variants replace by torch.compile of them.
COMPILE_TARGETS = {"sd15": ("unet", "vae.decoder"), "sdxl": ("unet",), "train": ("unet",), "cogvideox": (),
                   "hunyuanvideo": (), "animatediff": (), "scale_shift": ()}
# Groups whose models are built in float32, run once for reference outputs, then cast to this dtype: each cell
# compares its output with the reference (error_vs_fp32 in the rows).
REFERENCE_DTYPES = {"cogvideox": torch.bfloat16, "hunyuanvideo": torch.float16, "animatediff": torch.float16,
                    "scale_shift": torch.float16}
# group -> {attribute of the group's namespace: benchmark.models.MODELS key}, for the zoo groups.
_ZOO_GROUP_MODELS = {"cogvideox": {"vae": "cogvideox_vae"}, "hunyuanvideo": {"vae": "hunyuanvideo_vae"},
                     "animatediff": {"unet": "animatediff_unet"}, "scale_shift": {"unet": "kandinsky22_unet"}}


def group_models(group: str, cache: ModelCache) -> SimpleNamespace:
    """The models of an E2E group, now owned by the caller: sd15 -> unet and vae (float16, from the cache), sdxl ->
    unet (float16), train -> a float32 SD1.5 unet in train mode."""
    if group == "sd15":
        return SimpleNamespace(unet=cache.take("sd15_unet"), vae=cache.take("sd_vae"))
    if group == "sdxl":
        return SimpleNamespace(unet=cache.take("sdxl_unet"))
    if group in _ZOO_GROUP_MODELS:
        return SimpleNamespace(**{attribute: build_model(name, "cuda", torch.float32)
                                  for attribute, name in _ZOO_GROUP_MODELS[group].items()})
    return SimpleNamespace(unet=build_model("sd15_unet", "cuda", torch.float32).train())


def not_run_reason(config: E2EConfig, variant: str, settings: Settings) -> str | None:
    """Why ``variant`` of ``config`` is not measured under ``settings`` (--quick compiles nothing), or None."""
    if variant not in config.variants:
        return f"not measured for this config (variants: {', '.join(config.variants)})"
    if variant.endswith("+compile") and not settings.e2e_compile:
        return "--quick skips torch.compile"
    return None


def error_vs_reference(output: torch.Tensor, reference: torch.Tensor) -> dict:
    """How far ``output`` is from the float32 reference: relative L2 error, and the largest absolute error over
    the reference's largest magnitude."""
    output, reference = output.float(), reference.float()
    difference = output - reference
    return {"rel_l2_vs_fp32": round((difference.norm() / reference.norm()).item(), 6),
            "max_err_vs_fp32": round((difference.abs().max() / reference.abs().max()).item(), 6)}


def reference_outputs(group: str, models: SimpleNamespace) -> dict[str, torch.Tensor]:
    """The float32 outputs of the group's calls (models as built, float32, NCHW; cuDNN without TF32: a true
    float32 reference), then the models cast in place to the group's benchmark dtype."""
    with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=False, allow_tf32=False):
        references = {c.name: c.make_call(models)().float() for c in E2E_CONFIGS if c.group == group}
    for model in vars(models).values():
        model.to(REFERENCE_DTYPES[group])
    return references


def enter_variant(variant: str, models: SimpleNamespace, kernels_ok: bool) -> dict:
    """Convert the models in place for an eager variant; returns what the surgeon did (patched only)."""
    if variant == "stock_cl":
        for model in vars(models).values():
            model.to(memory_format=torch.channels_last)
    elif variant == "patched":
        if not kernels_ok:
            raise RuntimeError("gn_patch CUDA kernels unavailable: the patched model would run PyTorch's GroupNorm")
        from ..surgeon import patch_model

        reports = {name: patch_model(model, channels_last=True) for name, model in vars(models).items()}
        return {name: {"fused": len(r.patched), "alone": len(r.alone), "skipped": [n for n, _ in r.skipped]}
                for name, r in reports.items()}
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


def e2e_row(config: E2EConfig, variant: str, **values: Any) -> dict:
    """One e2e.json row: config and variant names, wall_ms / gpu_ms / peak_mb (None unless in ``values``), then
    ``values`` (time_calls' keys, or not_run / error)."""
    return {"config": config.name, "variant": variant, "wall_ms": None, "gpu_ms": None, "peak_mb": None, **values}


def _e2e_cell(config: E2EConfig, variant: str, models: SimpleNamespace, settings: Settings,
              broken: str | None, compiled_ok: bool, reference: torch.Tensor | None) -> dict:
    reason = not_run_reason(config, variant, settings)
    if reason:
        return e2e_row(config, variant, not_run=reason)
    if broken:
        return e2e_row(config, variant, error=broken)
    reuse = variant.endswith("+compile") and config.compile == "reuse"
    if reuse and not compiled_ok:
        return e2e_row(config, variant, error="not run: a compile cell it would reuse failed")
    guard = torch._dynamo.config.patch(error_on_recompile=True) if reuse else contextlib.nullcontext()

    def measure() -> dict:
        call = config.make_call(models)
        with guard:
            times = time_calls(call, *settings.e2e_runs[config.name], config.graphable)
        return times if reference is None else {**times, **error_vs_reference(call(), reference)}

    times, error = attempt(measure)  # the call's pipeline / optimizer went with measure's frame: release them
    for model in vars(models).values():
        model.zero_grad(set_to_none=True)
    free_memory()
    return e2e_row(config, variant, error=error) if error else e2e_row(config, variant, **times)


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
                             "sd15_unet_512_b2 and vae_decode_512 cells (a recompile would be an error)",
                  "rel_l2_vs_fp32": "zoo configs (cogvideox, hunyuanvideo, animatediff, scale_shift groups): the "
                                    "output's relative L2 error against the float32 stock model's output on the same "
                                    "inputs (cuDNN without TF32); max_err_vs_fp32: largest absolute error over the "
                                    "reference's largest magnitude"},
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
    models, broken = attempt(partial(group_models, group, cache))
    if models is None:
        models = SimpleNamespace()
    references = {}
    if group in REFERENCE_DTYPES and broken is None:
        references, broken = attempt(partial(reference_outputs, group, models))
        free_memory()
    for variant in VARIANT_ORDER:
        compiling = variant.endswith("+compile")
        # A variant no config of the group measures converts nothing (a video VAE's 5-D weights cannot take
        # channels_last); its cells say why they were not run.
        measured = any(variant in c.variants for c in group_configs)
        if not compiling and broken is None and measured:
            report, broken = attempt(partial(enter_variant, variant, models, kernels_ok))
            if report:
                writer.update_metadata(patch_reports={**writer.doc["metadata"]["patch_reports"], group: report})
        targets = COMPILE_TARGETS.get(group, ()) if compiling and broken is None and settings.e2e_compile else ()
        with compiled_modules(models, targets):
            compiled_ok = True
            for config in group_configs:
                progress.set_postfix_str(f"{config.name} {variant}")
                row = _e2e_cell(config, variant, models, settings, broken, compiled_ok,
                                (references or {}).get(config.name))
                if compiling and config.compile == "compile" and row["wall_ms"] is None:
                    compiled_ok = False
                writer.add(row)
                progress.update()
    del models
    free_memory()

