"""Host cost of the SD1.5 UNet call (fp16, batch 2, no_grad) and of the training step (batch 8, bf16 autocast, fp32
weights, fused AdamW; gn_patch.bench's e2e calls), stock NCHW against patched, in alternating rounds on one host, for
benchmarks/NOTES.md (exploratory, not committed results). Per call: wall time (synchronised), host time of the call
itself, CPU time of the process and of the main thread; a call whose process CPU time is its wall time is bound by
the host, whatever the GPU could do.

    python benchmarks/tools/host_e2e.py
"""
import statistics
import time
from types import SimpleNamespace

import torch

from gn_patch import patch_model
from gn_patch.bench.e2e import inference, train_step_call
from gn_patch.bench.models import build_model, unet_call

WARM_UP_CALLS = 3


def measure(fn, calls):
    """ms per call over `calls` synchronised calls."""
    torch.cuda.synchronize()
    wall, process, thread = time.perf_counter(), time.process_time(), time.thread_time()
    host = 0.0
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        host += time.perf_counter() - start
        torch.cuda.synchronize()
    per_call = 1e3 / calls
    return {"wall_ms": (time.perf_counter() - wall) * per_call, "host_ms": host * per_call,
            "process_cpu_ms": (time.process_time() - process) * per_call,
            "main_thread_cpu_ms": (time.thread_time() - thread) * per_call}


def report(name, variants, calls, rounds):
    """Medians over `rounds` alternating rounds of `calls` calls per variant, after the warm-up calls."""
    for fn in variants.values():
        for _ in range(WARM_UP_CALLS):
            fn()
    rows = {variant: [] for variant in variants}
    for _ in range(rounds):
        for variant, fn in variants.items():
            rows[variant].append(measure(fn, calls))
    for variant, measured in rows.items():
        medians = {key: round(statistics.median(row[key] for row in measured), 2) for key in measured[0]}
        per_round = [round(row["wall_ms"], 1) for row in measured]
        print(f"{name} {variant:8s} {medians} wall per round {per_round}", flush=True)


def main():
    stock = build_model("sd15_unet", "cuda", torch.float16).eval()
    patched = build_model("sd15_unet", "cuda", torch.float16).eval()
    patch_model(patched, channels_last=True)
    report("unet_b2_fp16", {"stock": inference(unet_call(stock, 2, 64, torch.float16, "cuda")),
                            "patched": inference(unet_call(patched, 2, 64, torch.float16, "cuda"))}, 10, 6)
    del stock, patched
    torch.cuda.empty_cache()
    stock = SimpleNamespace(unet=build_model("sd15_unet", "cuda", torch.float32).train())
    patched = SimpleNamespace(unet=build_model("sd15_unet", "cuda", torch.float32).train())
    patch_model(patched.unet, channels_last=True)
    report("train_b8_bf16", {"stock": train_step_call(stock), "patched": train_step_call(patched)}, 4, 5)


if __name__ == "__main__":
    main()
