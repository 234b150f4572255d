"""torch.profiler tables of the SD1.5 UNet call (batch 2, fp16) and training step (batch 8, bf16 autocast), stock
channels_last then patched, for benchmarks/NOTES.md (exploratory, not committed results):

    python benchmarks/tools/profile_e2e.py profile.txt
"""
import sys, time, torch
from torch.profiler import profile, ProfilerActivity
from gn_patch import bench, patch_model
out = open(sys.argv[1], "w")
def log(*a):
    print(*a, flush=True); print(*a, file=out, flush=True)
def prof(name, fn, n):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n): fn()
    torch.cuda.synchronize()
    log(f"## {name}: {(time.perf_counter() - t) / n * 1e3:.2f} ms/call wall")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for _ in range(n): fn()
        torch.cuda.synchronize()
    ka = p.key_averages()
    log(ka.table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=60))
    log(ka.table(sort_by="self_cuda_time_total", row_limit=22, max_name_column_width=60))
unet = bench.build_model("sd15_unet", "cuda", torch.float16)
call = bench._inference(bench.unet_call(unet, 2, 64, torch.float16, "cuda"))
unet.to(memory_format=torch.channels_last)
prof("sd15 unet b2 stock_cl", call, 5)
patch_model(unet, channels_last=True)
prof("sd15 unet b2 patched", call, 5)
del unet, call
from types import SimpleNamespace
m = SimpleNamespace(unet=bench.build_model("sd15_unet", "cuda", torch.float32).train())
m.unet.to(memory_format=torch.channels_last)
step = bench._train_step_call(m)
prof("train b8 stock_cl", step, 2)
patch_model(m.unet, channels_last=True)
step = bench._train_step_call(m)
prof("train b8 patched", step, 2)
