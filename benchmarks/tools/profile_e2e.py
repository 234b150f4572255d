"""torch.profiler tables of the SD1.5 UNet call (batch 2, fp16), the SD VAE decode to 1024² (fp16) and the training
step (batch 8, bf16 autocast): stock (the UNet call channels_last, the others NCHW as diffusers builds them) then
patched, for benchmarks/NOTES.md (exploratory, not committed results):

    python benchmarks/tools/profile_e2e.py profile.txt
"""
import sys
import time
from types import SimpleNamespace

import torch
from torch.profiler import ProfilerActivity, profile

from gn_patch import patch_model
from gn_patch.bench.e2e import inference, train_step_call
from gn_patch.bench.models import build_model, unet_call, vae_decode_call


def profile_calls(name, fn, n, out):
    """Wall ms per call of n calls after 3 warm-up calls, then the profiler's top CPU and CUDA ops of n more."""
    def log(*text):
        print(*text, flush=True)
        print(*text, file=out, flush=True)

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    log(f"## {name}: {(time.perf_counter() - start) / n * 1e3:.2f} ms/call wall")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    averages = p.key_averages()
    log(averages.table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=60))
    log(averages.table(sort_by="self_cuda_time_total", row_limit=22, max_name_column_width=60))


def main(path):
    with open(path, "w") as out:
        unet = build_model("sd15_unet", "cuda", torch.float16)
        call = inference(unet_call(unet, 2, 64, torch.float16, "cuda"))
        unet.to(memory_format=torch.channels_last)
        profile_calls("sd15 unet b2 stock_cl", call, 5, out)
        patch_model(unet, channels_last=True)
        profile_calls("sd15 unet b2 patched", call, 5, out)
        del unet, call
        vae = build_model("sd_vae", "cuda", torch.float16)
        call = inference(vae_decode_call(vae, 128, torch.float16, "cuda"))
        profile_calls("vae decode 1024 stock_nchw", call, 3, out)
        patch_model(vae, channels_last=True)
        profile_calls("vae decode 1024 patched", call, 3, out)
        del vae, call
        models = SimpleNamespace(unet=build_model("sd15_unet", "cuda", torch.float32).train())
        profile_calls("train b8 stock_nchw", train_step_call(models), 2, out)
        patch_model(models.unet, channels_last=True)
        profile_calls("train b8 patched", train_step_call(models), 2, out)


if __name__ == "__main__":
    main(sys.argv[1])
