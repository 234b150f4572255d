"""Conv3d in NCDHW against NDHWC (channels_last_3d) on the GPU, for the convolutions of the video VAE decodes.

patch_model(..., channels_last_3d=True) gives Conv3d weights the channels_last_3d layout, so that video activations
flow NDHWC (what gn_patch's kernels read) and cuDNN runs its NDHWC convolutions. This script measures whether
cuDNN's NDHWC path is faster for the shapes that matter, to set that option's default:

1. every distinct nn.Conv3d call of the decode (recorded by forward pre-hooks on a stock NCDHW run), timed in both
   layouts (input and weight contiguous, or both channels_last_3d), weighted by how often the decode makes it;
2. the whole decode: stock NCDHW, patched with channels_last_3d=False (the GroupNorms then take PyTorch's path on
   NCDHW input), patched with channels_last_3d=True.

Random weights from the published configs (gn_patch.configs). Needs a CUDA GPU and, for step 2, the kernels.

    python benchmarks/tools/conv3d_layout.py                      # both VAEs, the e2e shapes
    python benchmarks/tools/conv3d_layout.py --models cogvideox --json conv3d.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gn_patch import configs
from gn_patch.bench.results import commit_id
from gn_patch.bench.timing import median_event_ms
from gn_patch.surgeon import patch_model, unpatch_model

# model -> (diffusers class, config, latents of the decode, dtype): the e2e rows' decodes.
MODELS = {
    "cogvideox": ("AutoencoderKLCogVideoX", configs.COGVIDEOX_VAE, (1, 16, 4, 60, 90), torch.bfloat16),
    "hunyuanvideo": ("AutoencoderKLHunyuanVideo", configs.HUNYUANVIDEO_VAE, (1, 16, 3, 40, 64), torch.float16),
}
FORMATS = {"ncdhw": torch.contiguous_format, "ndhwc": torch.channels_last_3d}


@dataclass(frozen=True)
class ConvCall:
    """One Conv3d call: input shape, weight shape, and the convolution's arguments."""

    input: tuple[int, ...]
    weight: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int


def build(name: str) -> tuple[nn.Module, torch.Tensor]:
    """The VAE with seeded random weights on the GPU in its dtype, and seeded latents."""
    import diffusers

    class_name, config, latents, dtype = MODELS[name]
    torch.manual_seed(0)
    with torch.device("cuda"):
        vae = getattr(diffusers, class_name)(**config).to(dtype).eval()
    return vae, torch.randn(latents, device="cuda", dtype=dtype)


def conv_calls(vae: nn.Module, latents: torch.Tensor) -> Counter:
    """How often the decode makes each distinct Conv3d call."""
    calls: Counter = Counter()

    def record(module: nn.Conv3d, args: tuple) -> None:
        padding = module.padding if isinstance(module.padding, tuple) else (0, 0, 0)  # "same"/"valid": not in VAEs
        calls[ConvCall(tuple(args[0].shape), tuple(module.weight.shape), module.stride, padding, module.dilation,
                       module.groups)] += 1

    handles = [m.register_forward_pre_hook(record) for m in vae.modules() if isinstance(m, nn.Conv3d)]
    with torch.no_grad():
        vae.decode(latents)
    for handle in handles:
        handle.remove()
    return calls


def conv_ms(call: ConvCall, dtype: torch.dtype, memory_format: torch.memory_format) -> float:
    """Median GPU ms of F.conv3d on random input and weight of ``call``'s shapes, both in ``memory_format``."""
    x = torch.randn(call.input, device="cuda", dtype=dtype).contiguous(memory_format=memory_format)
    w = torch.randn(call.weight, device="cuda", dtype=dtype).contiguous(memory_format=memory_format)
    run = lambda: F.conv3d(x, w, None, call.stride, call.padding, call.dilation, call.groups)
    run()
    return median_event_ms(run, target_ms=200.0)


def decode_ms(vae: nn.Module, latents: torch.Tensor, repeats: int) -> float:
    """Median GPU ms of one decode (CUDA events), after one warm-up decode."""
    def run():
        with torch.no_grad():
            vae.decode(latents)

    run()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(name: str, repeats: int, log: Callable[[str], None]) -> dict:
    """Both measurements for one model; returns the rows and totals."""
    vae, latents = build(name)
    dtype = latents.dtype
    calls = conv_calls(vae, latents)
    rows = []
    for call, count in sorted(calls.items(), key=lambda item: -item[1] * torch.Size(item[0].input).numel()):
        times = {fmt: conv_ms(call, dtype, memory_format) for fmt, memory_format in FORMATS.items()}
        rows.append({**asdict(call), "count": count, **{f"{fmt}_ms": round(ms, 4) for fmt, ms in times.items()}})
        log(f"  {call.input!s:26s} w{call.weight!s:22s} s{call.stride} x{count:3d}: "
            f"NCDHW {times['ncdhw']:8.3f} ms  NDHWC {times['ndhwc']:8.3f} ms  ({times['ncdhw'] / times['ndhwc']:.2f}x)")
    totals = {fmt: sum(r[f"{fmt}_ms"] * r["count"] for r in rows) for fmt in FORMATS}
    log(f"  all Conv3d calls of one decode: NCDHW {totals['ncdhw']:.1f} ms, NDHWC {totals['ndhwc']:.1f} ms "
        f"({totals['ncdhw'] / totals['ndhwc']:.2f}x)")
    decodes = {"stock_ncdhw": decode_ms(vae, latents, repeats)}
    for layout in (False, True):
        patch_model(vae, channels_last_3d=layout)
        decodes[f"patched_channels_last_3d={layout}"] = decode_ms(vae, latents, repeats)
        unpatch_model(vae)
    log("  decode: " + ", ".join(f"{variant} {ms:.1f} ms" for variant, ms in decodes.items()))
    return {"model": name, "latents": list(latents.shape), "dtype": str(dtype), "convs": rows,
            "conv_total_ms": {fmt: round(ms, 3) for fmt, ms in totals.items()},
            "decode_ms": {variant: round(ms, 3) for variant, ms in decodes.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated, from %(default)s")
    parser.add_argument("--repeats", type=int, default=5, help="timed decodes per variant (default: %(default)s)")
    parser.add_argument("--cudnn-benchmark", action="store_true",
                        help="let cuDNN autotune (torch.backends.cudnn.benchmark; off by default, as in diffusers)")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("conv3d_layout: needs a CUDA GPU", file=sys.stderr)
        return 2
    names = [name.strip() for name in args.models.split(",") if name.strip()]
    unknown = [name for name in names if name not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {', '.join(MODELS)}")
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    results = []
    for name in names:
        print(f"== {name}", flush=True)
        results.append(measure(name, args.repeats, lambda line: print(line, flush=True)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"commit": commit_id(), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "cudnn": torch.backends.cudnn.version(), "cudnn_benchmark": args.cudnn_benchmark,
                       "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
