"""A/B of conv2's bias added by the residual sum (gn_patch::bias_residual_add), in one process, for
benchmarks/NOTES.md (exploratory; CUDA).

Two variants of the same patched model: "folded" as patch_model leaves it (conv2 runs without its bias, which the
residual sum's pass adds) and "unfolded" (conv2 keeps its bias: PyTorch's bias pass, then the residual add).
Alternating rounds of eager calls (CUDA events) and CUDA-graph replays; prints the medians and writes them as JSON::

    python benchmarks/tools/ab_conv2_bias.py --json ab_conv2_bias.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import diffusers
import torch
from ab_input_offset import graph_of, timed

from gn_patch import configs, patch_model, rules
from gn_patch.bench.models import unet_call, vae_decode_call
from gn_patch.bench.results import run_metadata

FUSED_BLOCK = rules.fusion.fused_class(rules.fusion.FUSIONS[diffusers.models.resnet.ResnetBlock2D])
VARIANTS = {"folded": FUSED_BLOCK.conv2_without_bias,
            "unfolded": lambda block, hidden_states: (block.conv2(hidden_states), None)}


def use(variant: str) -> None:
    FUSED_BLOCK.conv2_without_bias = VARIANTS[variant]


def measure(name: str, call, rounds: int, repeats: int) -> dict:
    graphs, rows = {}, {variant: {"eager_ms": [], "graph_ms": []} for variant in VARIANTS}
    with torch.no_grad():
        for variant in VARIANTS:
            use(variant)
            graphs[variant] = graph_of(call)
        for _ in range(rounds):
            for variant in VARIANTS:
                use(variant)
                rows[variant]["eager_ms"].append(timed(call, repeats))
                rows[variant]["graph_ms"].append(timed(graphs[variant].replay, repeats))
    use("folded")
    summary = {variant: {key: statistics.median(values) for key, values in row.items()}
               for variant, row in rows.items()}
    print(name, json.dumps(summary))
    return {"model": name, **summary, "rounds": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.manual_seed(0)
    out = []
    with torch.device("cuda"):
        unet = diffusers.UNet2DConditionModel(**configs.SD15_UNET).to(torch.float16).eval()
    patch_model(unet, channels_last=True)
    out.append(measure("sd15_unet b2 64x64", unet_call(unet, 2, 64, torch.float16, "cuda"), args.rounds, args.repeats))
    del unet
    with torch.device("cuda"):
        vae = diffusers.AutoencoderKL(**configs.SD_VAE).to(torch.float16).eval()
    patch_model(vae, channels_last=True)
    for latent in (64, 128):
        out.append(measure(f"sd_vae decode {8 * latent}", vae_decode_call(vae, latent, torch.float16, "cuda"),
                           args.rounds, args.repeats))
    if args.json:
        metadata = {**run_metadata(False, []), "command": " ".join(["python", *sys.argv])}
        with open(args.json, "w") as f:
            json.dump({"metadata": metadata, "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
