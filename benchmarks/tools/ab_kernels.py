"""A/B timing of the gn_patch kernels for benchmarks/NOTES.md (exploratory numbers, not committed results).

GPU time per call from CUDA-graph replay, forward and forward+backward, float16 and bfloat16, inputs rotating over
>= 120 MB. Run once per build to compare (GN_PATCH_BUILD_DIR and PYTHONPATH select the tree):

    python benchmarks/tools/ab_kernels.py ab.json
"""
import json, sys, statistics, torch, gn_patch.ops, gn_patch.extension
assert gn_patch.extension.kernels_available()
SHAPES = [(2,320,64,64),(2,320,32,32),(2,640,32,32),(2,1280,16,16),(2,1280,8,8),(2,1920,32,32),(2,960,64,64),
          (1,512,64,64),(1,512,128,128),(1,256,256,256),(1,512,256,256),(1,256,512,512),(1,128,512,512),
          (1,256,1024,1024),(8,320,64,64),(8,640,32,32),(8,1280,16,16),(8,960,64,64)]
def time_graph(fn, calls):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2): fn()
    torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g): fn()
    ts = []
    for _ in range(7):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record(); g.replay(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b) * 1000 / calls)
    return statistics.median(ts[2:])
out = {}
for dtype in (torch.float16, torch.bfloat16):
    for shape in SHAPES:
        n = shape[0]*shape[1]*shape[2]*shape[3]*2
        k = max(1, min(16, (120 << 20) // n + 1))
        xs = [torch.randn(shape, device="cuda", dtype=dtype).to(memory_format=torch.channels_last) for _ in range(k)]
        w = torch.randn(shape[1], device="cuda", dtype=dtype); b = torch.randn_like(w)
        fwd = time_graph(lambda: [torch.ops.gn_patch.group_norm_act(x, w, b, 32, 1e-5, "silu") for x in xs], k)
        dys = [torch.randn_like(x) for x in xs]
        def fb():
            for x, dy in zip(xs, dys):
                y, m, r = torch.ops.gn_patch.group_norm_act(x, w, b, 32, 1e-5, "silu")
                torch.ops.gn_patch.group_norm_act_backward(dy, x, w, b, m, r, 32, "silu", [True, True, True])
        bwd = time_graph(fb, k)
        src = torch.empty(n // 2, dtype=torch.uint8, device="cuda"); dst = torch.empty_like(src)
        cp = time_graph(lambda: dst.copy_(src), 1) if n > 100e6 else None
        out[f"{str(dtype)[6:]} {shape}"] = (round(fwd, 1), round(bwd, 1))
        print(f"{str(dtype)[6:]:9s} {str(shape):22s} fwd {fwd:8.1f}  fwd+bwd {bwd:8.1f}", flush=True)
        del xs, dys
json.dump(out, open(sys.argv[1], "w"), indent=1)
