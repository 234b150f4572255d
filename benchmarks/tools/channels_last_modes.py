"""patch_model's two channels-last modes on the GPU, for the README's FSDP2 section (exploratory numbers).

``patch_model(unet)`` gives the conv weights the channels_last layout; ``patch_model(unet,
channels_last="activations")`` (what FSDP2's fully_shard needs) keeps them contiguous and makes the inputs
channels_last, and PyTorch's cuDNN convolution then copies each weight to channels_last on every call. This
measures what that copy costs: SD1.5's UNet (random weights, gn_patch.configs) at 512² (64² latents), an fp16
inference forward and a bf16-autocast training step (forward and backward, float32 weights), stock NCHW and
patched in both modes, median GPU ms between CUDA events. Needs a CUDA GPU and the kernels.

    python benchmarks/tools/channels_last_modes.py
    python benchmarks/tools/channels_last_modes.py --inference-batch 2 --train-batch 8 --json modes.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from diffusers import UNet2DConditionModel

from gn_patch import configs, extension
from gn_patch.bench.timing import median_event_ms
from gn_patch.surgeon import patch_model

# variant -> patch_model's channels_last (None: stock, not patched)
VARIANTS = {"stock_nchw": None, "patched_channels_last_weights": True,
            "patched_channels_last_activations": "activations"}
TARGET_MS = 2000.0  # GPU time per measurement


def unet_inputs(batch: int, dtype: torch.dtype) -> dict:
    generator = torch.Generator(device="cuda").manual_seed(0)
    return dict(sample=torch.randn(batch, 4, 64, 64, device="cuda", dtype=dtype, generator=generator),
                timestep=torch.tensor(500, device="cuda"),
                encoder_hidden_states=torch.randn(batch, 77, 768, device="cuda", dtype=dtype, generator=generator))


def build(channels_last, dtype: torch.dtype, train: bool) -> UNet2DConditionModel:
    """SD1.5's UNet with seeded random weights on the GPU in ``dtype``, patched as the variant says."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        unet = UNet2DConditionModel(**configs.SD15_UNET).to(dtype).train(train)
    if channels_last is not None:
        patch_model(unet, channels_last=channels_last)
    return unet


def inference_ms(channels_last, batch: int) -> float:
    unet = build(channels_last, torch.float16, train=False)
    inputs = unet_inputs(batch, torch.float16)

    def run():
        with torch.no_grad():
            unet(**inputs)

    run()
    return median_event_ms(run, TARGET_MS)


def training_ms(channels_last, batch: int) -> float:
    unet = build(channels_last, torch.float32, train=True)
    inputs = unet_inputs(batch, torch.float32)

    def run():
        unet.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            output = unet(**inputs).sample
        output.float().square().mean().backward()

    run()
    return median_event_ms(run, TARGET_MS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inference-batch", type=int, default=2, help="(default: %(default)s)")
    parser.add_argument("--train-batch", type=int, default=8, help="(default: %(default)s)")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("channels_last_modes: needs a CUDA GPU", file=sys.stderr)
        return 2
    if not extension.kernels_available():
        print("channels_last_modes: the gn_patch kernels did not load; the patched rows would time PyTorch's "
              "GroupNorm", file=sys.stderr)
        return 2
    results = {}
    for variant, channels_last in VARIANTS.items():
        results[variant] = {"inference_ms": round(inference_ms(channels_last, args.inference_batch), 3),
                            "training_step_ms": round(training_ms(channels_last, args.train_batch), 3)}
        torch.cuda.empty_cache()
        print(f"{variant:36s} inference {results[variant]['inference_ms']:8.2f} ms (fp16, batch "
              f"{args.inference_batch})   training step {results[variant]['training_step_ms']:8.2f} ms (bf16 "
              f"autocast, batch {args.train_batch})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "inference_batch": args.inference_batch, "train_batch": args.train_batch,
                       "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
