"""A/B of conv2's bias added by the residual sum (gn_patch::bias_residual_add), in one process, for
benchmarks/NOTES.md (exploratory; CUDA).

Two variants of the same patched model: "folded" as patch_model leaves it (conv2 runs without its bias, which the
residual sum's pass adds) and "unfolded" (conv2 keeps its bias: PyTorch's bias pass, then the residual add).
Alternating rounds of eager calls (CUDA events) and CUDA-graph replays; prints the medians and writes them as JSON::

    python benchmarks/tools/ab_conv2_bias.py --json ab_conv2_bias.json
"""

from __future__ import annotations

import json
import sys

import diffusers
import torch
from ab_input_offset import ab_arguments, measure, measure_sd

from gn_patch import rules
from gn_patch.bench.results import run_metadata

FUSED_BLOCK = rules.fusion.fused_class(rules.fusion.FUSIONS[diffusers.models.resnet.ResnetBlock2D])
VARIANTS = {"folded": FUSED_BLOCK.conv2_without_bias,
            "unfolded": lambda block, hidden_states: (block.conv2(hidden_states), None)}


def use(variant: str) -> None:
    FUSED_BLOCK.conv2_without_bias = VARIANTS[variant]


def main() -> None:
    args = ab_arguments(__doc__)
    torch.manual_seed(0)
    out = measure_sd(lambda name, call: measure(name, call, args.rounds, args.repeats, VARIANTS, use), (64, 128))
    if args.json:
        metadata = {**run_metadata(False, []), "command": " ".join(["python", *sys.argv])}
        with open(args.json, "w") as f:
            json.dump({"metadata": metadata, "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
