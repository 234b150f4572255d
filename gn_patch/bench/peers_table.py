"""The peers table (peers.json): its rows, the choice of the best peer, and its section of summary.md.

Pure Python over measured numbers, so it runs without a GPU; peers.py measures. A row is one (shape, dtype,
timing) with µs per call of every method (``<method>_fwd_us``, ``<method>_fwd_bwd_us``; None where not measured),
each method's largest absolute error against a float32 reference (``<method>_max_err``), and the best peer.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from .markdown import fmt, markdown_table, shape_label, speedup
from .results import ratio, rounded

PEER_NAMES = ("gnnhwc", "apex", "sfast")
# What the best peer is chosen from, as side_by_side.py counts: PyTorch's own GroupNorm+SiLU and every peer.
CANDIDATES = ("torch", *PEER_NAMES)
METHODS = ("gn_patch", *CANDIDATES)
PEER_PASSES = ("fwd", "fwd_bwd")
TIMINGS = ("graph", "do_bench")
# (atol, rtol): an output is correct where |y - y_float32| <= atol + rtol * |y_float32| everywhere. About 20 ulps
# (float16) and 8 ulps (bfloat16) of outputs of order 1: fast-math activations and other summation orders pass,
# wrong statistics (errors of 0.5 and more) do not.
TOLERANCES = {"float16": (1e-2, 1e-2), "bfloat16": (6e-2, 3e-2)}
NOTES = {
    "graph": "20 calls captured in one CUDA graph and replayed (median replay / 20): GPU time alone; the inputs "
             "are reused, so tensors below L2 size stay in L2.",
    "do_bench": "triton.testing.do_bench median, L2 flushed between repetitions: the time a caller sees, host cost "
                "included where it exceeds the GPU work.",
    "methods": "gn_patch.group_norm_act and F.group_norm + F.silu (torch, NCHW input): fwd+bwd through autograd "
               "(torch.autograd.grad of x, weight, bias). gnnhwc: its GN_NHWC module, fwd+bwd through its "
               "autograd.Function. apex: forward and backward of the NHWC extension called directly (no autograd; "
               "one pass where H*W <= 1024, else two). sfast: forward only. x = 3 randn + 1, channels_last; weight, "
               "bias randn in the input dtype; G = 32, eps 1e-5, SiLU.",
    "best": "best peer: the fastest of torch and the peers whose forward output is within tolerance of the float32 "
            "reference (|err| <= atol + rtol |ref|; float16 1e-2, 1e-2; bfloat16 6e-2, 3e-2). ratio = best peer / "
            "gn_patch (> 1: gn_patch faster); vs torch = torch / gn_patch.",
}


@dataclass
class PeerMeasurement:
    """What one (shape, dtype, timing) cell measured.

    us: µs per call by (method, pass), pass "fwd" or "fwd_bwd"; max_err: largest absolute error of the forward
    output against float32, by method; wrong: methods whose output is outside TOLERANCES; errors: why a method
    has no time (not loaded, failed to run), by method.
    """

    us: dict[tuple[str, str], float] = field(default_factory=dict)
    max_err: dict[str, float] = field(default_factory=dict)
    wrong: set[str] = field(default_factory=set)
    errors: dict[str, str] = field(default_factory=dict)


def best_peer(row: dict, pass_: str) -> tuple[str | None, float | None]:
    """(name, µs) of the fastest candidate of ``row`` for ``pass_`` ("fwd" or "fwd_bwd") among those with a time
    and a correct output; (None, None) when there is none."""
    timed = [(row[f"{name}_{pass_}_us"], name) for name in CANDIDATES
             if row.get(f"{name}_{pass_}_us") is not None and name not in row["wrong"]]
    if not timed:
        return None, None
    us, name = min(timed)
    return name, us


def peer_row(shape: tuple[int, ...], dtype: str, timing: str, measured: PeerMeasurement, provenance: dict) -> dict:
    """One peers.json row: identity (shape, dtype, timing, mb = MB of x), every method's µs and error, the best
    peer per pass with the ratios, then ``provenance`` (commit, gpu, versions, date)."""
    numel = 1
    for size in shape:
        numel *= size
    row = {"shape": list(shape), "dtype": dtype, "timing": timing, "mb": round(numel * 2 / 1e6, 2)}
    for method in METHODS:
        for pass_ in PEER_PASSES:
            row[f"{method}_{pass_}_us"] = rounded(measured.us.get((method, pass_)), 2)
    for method in METHODS:
        row[f"{method}_max_err"] = rounded(measured.max_err.get(method), 5)
    row["wrong"] = sorted(measured.wrong)
    row["errors"] = dict(measured.errors)
    for pass_ in PEER_PASSES:
        name, us = best_peer(row, pass_)
        row[f"best_peer_{pass_}"], row[f"best_peer_{pass_}_us"] = name, us
        row[f"ratio_{pass_}"] = ratio(us, row[f"gn_patch_{pass_}_us"])
        row[f"torch_ratio_{pass_}"] = ratio(row[f"torch_{pass_}_us"], row[f"gn_patch_{pass_}_us"])
    return {**row, **provenance}


def _best_cell(row: dict, pass_: str) -> str:
    name = row[f"best_peer_{pass_}"]
    return "–" if name is None else f"{row[f'best_peer_{pass_}_us']:.1f} {name}"


def headline_table(rows: list[dict]) -> str:
    """gn_patch against the best peer and torch, one line per shape."""
    headers = ["shape", "MB", "gn_patch fwd µs", "best peer fwd µs", "ratio", "gn_patch fwd+bwd µs",
               "best peer fwd+bwd µs", "ratio", "torch fwd+bwd µs", "vs torch fwd+bwd"]
    table = [[shape_label(r["shape"]), f"{r['mb']:.2f}", r["gn_patch_fwd_us"], _best_cell(r, "fwd"),
              speedup(r["ratio_fwd"]), r["gn_patch_fwd_bwd_us"], _best_cell(r, "fwd_bwd"), speedup(r["ratio_fwd_bwd"]),
              r["torch_fwd_bwd_us"], speedup(r["torch_ratio_fwd_bwd"])] for r in rows]
    return markdown_table(headers, table)


def methods_table(rows: list[dict]) -> str:
    """Every method's µs, forward then forward+backward, for the methods timed in any row."""
    columns = [(m, p) for p in PEER_PASSES for m in METHODS if any(r[f"{m}_{p}_us"] is not None for r in rows)]
    headers = ["shape", *(f"{m} {'fwd' if p == 'fwd' else 'fwd+bwd'}" for m, p in columns)]
    table = [[shape_label(r["shape"]), *(r[f"{m}_{p}_us"] for m, p in columns)] for r in rows]
    return markdown_table(headers, table)


def problems(rows: list[dict]) -> list[str]:
    """Lines for the outputs outside tolerance (per row) and the methods not measured (one line per error)."""
    wrong = {(name, r["dtype"], shape_label(r["shape"])): r[f"{name}_max_err"] for r in rows for name in r["wrong"]}
    lines = [f"- {name} {dtype} {shape}: output outside tolerance, max error {fmt(err, 3)}"
             for (name, dtype, shape), err in wrong.items()]
    where = defaultdict(list)
    for r in rows:
        for name, error in r["errors"].items():
            where[(name, error)].append(f"{shape_label(r['shape'])} {r['dtype']} {r['timing']}")
    for (name, error), cells in where.items():
        place = "every cell" if len(cells) == len(rows) else ", ".join(cells[:6]) + (" ..." if len(cells) > 6 else "")
        lines.append(f"- {name} not measured ({place}): {error}")
    return lines


def headlines(rows: list[dict]) -> str:
    """The headline tables alone, per (timing, dtype): for the end of a run's output."""
    parts = []
    for timing in TIMINGS:
        for dtype in dict.fromkeys(r["dtype"] for r in rows):
            selected = [r for r in rows if r["timing"] == timing and r["dtype"] == dtype]
            if selected:
                parts += [f"peers, {timing}, {dtype}", headline_table(selected), ""]
    return "\n".join(parts)


def render_peers(rows: list[dict]) -> str:
    """The peers section of summary.md from peers.json's rows: per (timing, dtype) the headline table and every
    method's times, then the outputs outside tolerance and the methods not measured."""
    first = rows[0] if rows else {}
    provenance = ", ".join(f"{k} {first[k]}" for k in ("commit", "gpu", "date") if first.get(k) is not None)
    parts = ["## gn_patch against the peer kernels: GroupNorm + SiLU, G = 32", "", f"_{provenance}_", ""]
    parts += [f"- **{k}**: {v}" for k, v in NOTES.items()] + [""]
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    for timing in TIMINGS:
        for dtype in dtypes:
            selected = [r for r in rows if r["timing"] == timing and r["dtype"] == dtype]
            if selected:
                parts += [f"### {timing}, {dtype}", "", headline_table(selected), "", methods_table(selected), ""]
    issues = problems(rows)
    if issues:
        parts += ["### Outputs outside tolerance, methods not measured", "", *issues, ""]
    return "\n".join(parts)
