"""Host time that gn_patch's CUDA-graph wrapper adds to one replayed call, measured on the CPU (exploratory).

A replayed call checks the module's state (gn_patch.cuda_graphs._Inventory.fingerprint), keys its arguments
(_signature), copies them into the static inputs, launches the graph and copies the outputs out. This times the
Python part of that path on a full-size model built on the meta device (no memory, no kernels: the copies, the
launch and the clone cost nothing here), with a backend whose replay does nothing, so the numbers are what the
wrapper costs on top of one cudaGraphLaunch and three to fifteen small copy kernels::

    python benchmarks/tools/graph_host_cost.py                  # SD1.5 UNet, batch 2 (CFG), with and without LoRA
    python benchmarks/tools/graph_host_cost.py --model sdxl --calls 2000
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import deque
from pathlib import Path

import torch
from diffusers import ControlNetModel, UNet2DConditionModel
from peft import LoraConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from gn_patch import configs, cuda_graphs
from gn_patch.surgeon import patch_model

LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
MODELS = {  # name -> (config, latent size, text width, extra UNet kwargs)
    "sd15": (configs.SD15_UNET, 64, 768, {}),
    "sdxl": (configs.SDXL_UNET, 128, 2048, {"added_cond_kwargs": ("text_embeds", "time_ids")}),
}


class NullBackend:
    """Captures by running the forward once; replays nothing."""

    def supports(self, device: torch.device) -> bool:
        return True

    def capturing(self, device: torch.device) -> bool:
        return False

    def capture(self, run, device):
        output = run()
        return None, output, output

    def replay(self, graph) -> None:
        pass

    def memory_bytes(self) -> int:
        return 0


def unet_kwargs(name: str, batch: int) -> dict:
    _, latent, width, extra = MODELS[name]
    kwargs = dict(sample=torch.empty(batch, 4, latent, latent, device="meta"),
                  timestep=torch.empty((), dtype=torch.int64, device="meta"),
                  encoder_hidden_states=torch.empty(batch, 77, width, device="meta"), return_dict=False)
    if extra:
        kwargs["added_cond_kwargs"] = dict(text_embeds=torch.empty(batch, 1280, device="meta"),
                                           time_ids=torch.empty(batch, 6, device="meta"))
    return kwargs


def per_call_us(function, calls: int) -> float:
    """The least, over 20 rounds, of the mean CPU time of this process per call, µs (CPU time and the least round:
    other processes on a shared machine inflate wall time and most rounds)."""
    rounds = []
    for _ in range(20):
        start = time.process_time()
        for _ in range(calls):
            function()
        rounds.append((time.process_time() - start) / calls * 1e6)
    return min(rounds)


def measure(name: str, lora: bool, controlnet_residuals: bool, calls: int) -> dict:
    config = MODELS[name][0]
    with torch.device("meta"):
        unet = UNet2DConditionModel(**config).eval()
        if lora:
            unet.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=LORA_TARGETS, init_lora_weights=False))
    patch_model(unet)
    graphed = cuda_graphs.GraphedForward(unet, "unet", NullBackend(), 8, deque())
    kwargs = unet_kwargs(name, 2)
    if controlnet_residuals:
        with torch.device("meta"):
            controlnet = ControlNetModel.from_unet(unet) if not lora else None
        if controlnet is not None:
            down, mid = controlnet(**kwargs, controlnet_cond=torch.empty(2, 3, 8 * MODELS[name][1],
                                                                         8 * MODELS[name][1], device="meta"))
            kwargs.update(down_block_additional_residuals=down, mid_block_additional_residual=mid)
    with torch.no_grad():
        graphed(**kwargs)  # first call: inventory diagnosis and the (null) capture
        inventory = graphed._inventory
        tensors: list = []
        result = dict(
            model=name, lora=lora, controlnet_residuals=controlnet_residuals,
            modules=len(inventory.children) + 1, tensors=len(inventory.tensor_keys),
            stateful_modules=len(inventory.settings),
            fingerprint_us=per_call_us(lambda: inventory.fingerprint(0), calls),
            signature_us=per_call_us(lambda: (tensors.clear(), cuda_graphs._signature(((), kwargs), tensors)), calls),
            replayed_call_us=per_call_us(lambda: graphed(**kwargs), calls),
            modules_walk_us=per_call_us(lambda: list(unet.modules()), calls),  # for scale: a walk of the tree
        )
    assert graphed.captures == 1 and graphed.replays > calls, "the timed calls were not replays"
    return result


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="sd15")
    parser.add_argument("--calls", type=int, default=100, help="calls per timing round (default: %(default)s)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    results = [measure(args.model, lora, residuals, args.calls)
               for lora, residuals in ((False, False), (False, True), (True, False))]
    for r in results:
        print(f"{r['model']} UNet, LoRA {'on ' if r['lora'] else 'off'}, ControlNet residuals "
              f"{'on ' if r['controlnet_residuals'] else 'off'}: {r['modules']} modules, {r['tensors']} tensors, "
              f"{r['stateful_modules']} with settings | fingerprint {r['fingerprint_us']:.0f} µs, signature "
              f"{r['signature_us']:.0f} µs, whole replayed call {r['replayed_call_us']:.0f} µs (list(unet.modules()): "
              f"{r['modules_walk_us']:.0f} µs)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
