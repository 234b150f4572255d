"""gn_patch's GPU time per call at the peer harness's shapes (../shared/peers/side_by_side.py, TIMING=graph): 20
calls captured in one CUDA graph and replayed, inputs reused (in L2 below ~50 MB), median of 5 replays, µs.

Exploratory numbers for benchmarks/NOTES.md, comparable with the harness's tables in the same machine type; the
committed comparison with the peers is `python -m gn_patch.bench --peers DIR`.

    [HARNESS_SHAPES="2,1280,8,8 2,320,64,64"] python benchmarks/tools/harness_times.py OUT.json [float16|bfloat16 ...]
"""
import json
import os
import statistics
import sys

import torch

import gn_patch
from gn_patch import extension


def shapes_from(text: str | None, default: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The shapes of ``text``, "N,C,H,W N,C,H,W ..." (HARNESS_SHAPES here, ``ncu_shapes.py --shapes``), else
    ``default``."""
    if not text:
        return default
    return [tuple(int(v) for v in item.split(",")) for item in text.split()]


# The peer harness's shapes; HARNESS_SHAPES narrows an A/B to the shapes a change is for (ab_builds.sh runs the base
# tree's harness for both builds).
HARNESS_SHAPES = [(2, 320, 64, 64), (2, 640, 32, 32), (2, 1280, 16, 16), (2, 1280, 8, 8), (2, 2560, 8, 8),
                  (2, 960, 64, 64), (1, 512, 64, 64), (1, 512, 128, 128), (1, 512, 256, 256), (1, 256, 512, 512),
                  (1, 128, 512, 512), (2, 320, 128, 128), (2, 640, 64, 64), (2, 1280, 32, 32), (2, 2560, 32, 32),
                  (1, 512, 512, 512), (1, 256, 1024, 1024), (1, 128, 1024, 1024), (8, 320, 64, 64), (16, 640, 32, 32)]
SHAPES = shapes_from(os.environ.get("HARNESS_SHAPES"), HARNESS_SHAPES)
CALLS = 20
TORCH = os.environ.get("HARNESS_TORCH", "1") == "1"  # HARNESS_TORCH=0: gn_patch's columns only (A/B runs)


def graph_us(fn, calls: int = CALLS, replays: int = 5) -> float:
    """Median µs per call of ``replays`` replays of a CUDA graph holding ``calls`` calls of ``fn`` (warmed up on a
    side stream, as torch.cuda.graphs asks)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def time_shape(shape: tuple[int, ...], dtype: torch.dtype) -> dict:
    F = torch.nn.functional
    x = (torch.randn(shape, device="cuda", dtype=dtype) * 3 + 1).to(memory_format=torch.channels_last)
    w, b = torch.randn(shape[1], device="cuda", dtype=dtype), torch.randn(shape[1], device="cuda", dtype=dtype)
    dy = torch.randn_like(x)
    xg, wg, bg = (t.clone().requires_grad_(True) for t in (x, w, b))
    xn, xng, dyn = x.contiguous(), x.contiguous().requires_grad_(True), dy.contiguous()
    copy = torch.empty_like(x)
    row = {"shape": list(shape), "dtype": str(dtype)[6:], "mb": round(x.numel() * x.element_size() / 1e6, 2)}
    row["copy_us"] = graph_us(lambda: copy.copy_(x))
    row["gn_patch_fwd_us"] = graph_us(lambda: gn_patch.group_norm_act(x, 32, w, b))
    row["gn_patch_fwd_bwd_us"] = graph_us(
        lambda: torch.autograd.grad(gn_patch.group_norm_act(xg, 32, wg, bg), (xg, wg, bg), dy))
    if TORCH:
        row["torch_fwd_us"] = graph_us(lambda: F.silu(F.group_norm(xn, 32, w, b)))
        row["torch_fwd_bwd_us"] = graph_us(
            lambda: torch.autograd.grad(F.silu(F.group_norm(xng, 32, wg, bg)), (xng, wg, bg), dyn))
    return row


def main(out_path: str, dtypes: list[str]) -> None:
    assert extension.kernels_available(), "the gn_patch extension did not build or load"
    rows = []
    for dtype in [getattr(torch, d) for d in dtypes]:
        for shape in SHAPES:
            rows.append(time_shape(shape, dtype))
            print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in rows[-1].items()}), flush=True)
            torch.cuda.empty_cache()
    write_json(out_path, rows)
    print()
    print_table(rows, {"dtype": "dtype", "shape": "shape", "MB": "mb", "copy": "copy_us",
                       "gn_patch fwd": "gn_patch_fwd_us", "fwd+bwd": "gn_patch_fwd_bwd_us",
                       "torch fwd": "torch_fwd_us", "torch fwd+bwd": "torch_fwd_bwd_us"})


def write_json(path: str, data) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def print_table(rows: list[dict], columns: dict[str, str]) -> None:
    """A markdown table of ``rows``: ``columns`` maps each header to its key (floats to 0.1, missing keys empty)."""
    def cell(value) -> str:
        return f"{value:.1f}" if isinstance(value, float) else str(tuple(value) if isinstance(value, list) else value)
    print("| " + " | ".join(columns) + " |")
    for r in rows:
        print("| " + " | ".join(cell(r[k]) if k in r else "" for k in columns.values()) + " |")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or ["float16"])
