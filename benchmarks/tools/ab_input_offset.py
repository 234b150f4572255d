"""A/B of the adds before ResnetBlock2D.norm2 fused into its kernels, in one process, for benchmarks/NOTES.md
(exploratory; CUDA).

Three variants of the same patched model: "bias_and_temb" as patch_model leaves it (conv1 runs without its bias,
which norm2's kernels add before the timestep embedding: input_bias and input_offset), "temb" (conv1 keeps its bias;
the kernels add temb only, the surgeon before conv1's bias was folded) and "neither" (GroupNormAct.forward adding
both with PyTorch first, the surgeon before input_offset). Alternating rounds of eager calls (CUDA events) and
CUDA-graph replays; prints the medians and writes them as JSON::

    python benchmarks/tools/ab_input_offset.py --json ab_input_offset.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import diffusers
import torch

from gn_patch import GroupNormAct, configs, patch_model, rules
from gn_patch.bench.models import animatediff_call, unet_call, vae_decode_call

FUSED_FORWARD = GroupNormAct.forward
FUSED_BLOCK = rules.fusion.fused_class(rules.fusion.FUSIONS[diffusers.models.resnet.ResnetBlock2D])
FOLDING_CONV1 = FUSED_BLOCK.conv1_without_bias


def add_first_forward(self, x, scale=None, shift=None, input_offset=None, input_bias=None):
    if input_bias is not None:
        x = x + input_bias.view(1, -1, *([1] * (x.dim() - 2)))
    if input_offset is not None:
        x = x + input_offset
    return FUSED_FORWARD(self, x, scale, shift)


def conv1_with_bias(block, hidden_states):
    return block.conv1(hidden_states), None


# variant -> (GroupNormAct.forward, the fused ResnetBlock2D's conv1_without_bias)
VARIANTS = {"bias_and_temb": (FUSED_FORWARD, FOLDING_CONV1), "temb": (FUSED_FORWARD, conv1_with_bias),
            "neither": (add_first_forward, conv1_with_bias)}


def use(variant: str) -> None:
    GroupNormAct.forward, FUSED_BLOCK.conv1_without_bias = VARIANTS[variant]


def timed(call, repeats: int) -> float:
    """Median ms of `repeats` calls between CUDA events."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_of(call):
    for _ in range(2):
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph


def measure(name: str, call, rounds: int, repeats: int, variants=VARIANTS, use=use) -> dict:
    """Alternating rounds of ``call`` under each of ``variants`` (switched by ``use``; the first is left on after),
    eager and graph-replayed; the medians, and every round."""
    graphs, rows = {}, {variant: {"eager_ms": [], "graph_ms": []} for variant in variants}
    with torch.no_grad():
        for variant in variants:
            use(variant)
            graphs[variant] = graph_of(call)
        for _ in range(rounds):
            for variant in variants:
                use(variant)
                rows[variant]["eager_ms"].append(timed(call, repeats))
                rows[variant]["graph_ms"].append(timed(graphs[variant].replay, repeats))
    use(next(iter(variants)))
    summary = {variant: {key: statistics.median(values) for key, values in row.items()}
               for variant, row in rows.items()}
    print(name, json.dumps(summary))
    return {"model": name, **summary, "rounds": rows}


def measure_sd(ab, vae_latents=(128,)) -> list[dict]:
    """``ab(name, call)`` on the SD1.5 UNet call at batch 2 and the SD VAE decodes from the given latent sizes
    (patched float16 models of random weights, built one after the other)."""
    out = []
    with torch.device("cuda"):
        unet = diffusers.UNet2DConditionModel(**configs.SD15_UNET).to(torch.float16).eval()
    patch_model(unet, channels_last=True)
    out.append(ab("sd15_unet b2 64x64", unet_call(unet, 2, 64, torch.float16, "cuda")))
    del unet
    with torch.device("cuda"):
        vae = diffusers.AutoencoderKL(**configs.SD_VAE).to(torch.float16).eval()
    patch_model(vae, channels_last=True)
    for latent in vae_latents:
        out.append(ab(f"sd_vae decode {8 * latent}", vae_decode_call(vae, latent, torch.float16, "cuda")))
    return out


def ab_arguments(doc: str) -> argparse.Namespace:
    """The command line of the A/B tools: --rounds, --repeats, --json."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json")
    return parser.parse_args()


def main() -> None:
    args = ab_arguments(__doc__)
    torch.manual_seed(0)
    with torch.device("cuda"):
        motion = diffusers.UNetMotionModel(**configs.ANIMATEDIFF_UNET).to(torch.float16).eval()
    patch_model(motion, channels_last=True)
    out = [measure("animatediff_unet b2 16x64x64", animatediff_call(motion, 2, 16, 64), args.rounds, args.repeats)]
    del motion
    out += measure_sd(lambda name, call: measure(name, call, args.rounds, args.repeats))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
