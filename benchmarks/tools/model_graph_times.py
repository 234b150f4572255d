"""GPU time of whole patched model calls, replayed from a CUDA graph, for an A/B of two builds (exploratory).

The peer harness replays 20 calls of one op back to back; in a model each GroupNorm+SiLU sits between
convolutions. This times the patched SD1.5 UNet call (batch 2, latents 64², float16, no grad) and the SD VAE
decode to 512² (latents 64²), each captured once in a CUDA graph and replayed: the median of 7 replays of
``--calls`` calls, ms per call. One build per process (the extension is loaded once): ab_builds.sh-style A/Bs run
it with each tree's PYTHONPATH and GN_PATCH_BUILD_DIR, alternating::

    python benchmarks/tools/model_graph_times.py OUT.json [--models sd15_unet sd_vae] [--calls 5]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from gn_patch import extension, patch_model
from gn_patch.bench.models import build_model, unet_call, vae_decode_call


def replay_ms(call, calls: int) -> float:
    """Median ms per call of 7 replays of a graph holding ``calls`` calls of ``call`` (warmed up on a side stream,
    as torch.cuda.graphs asks)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        for _ in range(calls):
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--models", nargs="+", default=["sd15_unet", "sd_vae"], choices=["sd15_unet", "sd_vae"])
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args()
    assert extension.kernels_available(), "the CUDA extension failed to build or load"
    rows = {}
    for name in args.models:
        model = build_model(name, "cuda", torch.float16)
        patch_model(model, channels_last=True)
        if name == "sd15_unet":
            call = unet_call(model, 2, 64, torch.float16, "cuda")
        else:
            call = vae_decode_call(model, 64, torch.float16, "cuda")
        rows[name] = round(replay_ms(call, args.calls), 4)
        print(name, rows[name], "ms", flush=True)
        del model, call
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "ms_per_call": rows}, f, indent=1)


if __name__ == "__main__":
    main()
