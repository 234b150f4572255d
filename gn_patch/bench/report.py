"""summary.md from the result files: one section per file, each table rendered from its rows alone, so that
``--report-only`` redraws a committed summary exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .e2e import VARIANTS
from .kernels import KERNEL_METHODS
from .markdown import fmt, markdown_table, shape_label, speedup
from .peers_table import headlines, render_peers
from .results import load_result, ratio
from .settings import DTYPES, PASSES, RESULT_FILES

def provenance(meta: dict) -> str:
    """Where a section's numbers come from (sections of one summary may come from separate --only runs)."""
    keys = ("commit", "date", "quick", "section_s")
    return "_" + ", ".join(f"{k} {meta[k]}" for k in keys if meta.get(k) is not None) + "_"


def render_kernels(doc: dict) -> str:
    """The kernel table section of summary.md from kernels.json's document: one table per (dtype, pass), the
    cells not measured, then the per-model totals."""
    rows, notes = doc["rows"], doc["metadata"].get("notes", {})
    parts = ["## Kernel table: GroupNorm + SiLU", "", provenance(doc["metadata"]), "",
             *(f"- **{k}**: {v}" for k, v in notes.items()), ""]
    headers = ["shape", "G", "sources", "copy µs", "gn_patch µs", "NCHW µs", "CL µs", "compile µs",
               "compile static µs", "GB/s", "time/copy", "vs NCHW", "vs CL", "vs compile",
               "wall µs gn_patch / NCHW / CL / compile"]
    for dtype in DTYPES:
        for pass_ in PASSES:
            selected = [r for r in rows if r["dtype"] == dtype and r["pass"] == pass_]
            if not selected:
                continue
            table = [[shape_label(r["shape"]), r["num_groups"], r["source"], r["copy_us"], r["gn_patch_us"],
                      r["torch_nchw_us"], r["torch_cl_us"], r["compile_cl_us"], r["compile_static_cl_us"],
                      r["gbps"], r["ratio_to_copy"] and f"{r['ratio_to_copy']:.2f}",
                      speedup(r["speedup_vs_torch_nchw"]), speedup(r["speedup_vs_torch_cl"]),
                      speedup(r["speedup_vs_compile_cl"]),
                      " / ".join(fmt(r[f"{m}_wall_us"]) for m in ("gn_patch", "torch_nchw", "torch_cl", "compile_cl"))
                      if r["fits_l2"] else "GPU-bound"]
                     for r in selected]
            parts += [f"### {dtype}, {pass_}", "", markdown_table(headers, table), ""]
    errors = [(r, m, e) for r in rows for m, e in r.get("errors", {}).items()]
    if errors:
        parts += ["### Cells not measured", ""]
        parts += [f"- {shape_label(r['shape'])} {r['dtype']} {r['pass']} {m}: {e}" for r, m, e in errors]
        parts.append("")
    return "\n".join(parts + [render_model_totals(rows)])


def model_totals(rows: list[dict]) -> list[dict]:
    """Per source, dtype and pass: the GroupNorm+SiLU time of one model call (sum of calls x µs per method);
    None for a method where any of the source's shapes lacks a time."""
    totals = []
    sources = list(dict.fromkeys(s for r in rows for s in r["calls"]))
    for source in sources:
        for dtype in DTYPES:
            for pass_ in PASSES:
                selected = [r for r in rows if source in r["calls"] and r["dtype"] == dtype and r["pass"] == pass_]
                if not selected:
                    continue
                entry = {"source": source, "dtype": dtype, "pass": pass_,
                         "calls": sum(r["calls"][source] for r in selected)}
                for method in ("copy", *KERNEL_METHODS[:4]):
                    values = [r[f"{method}_us"] for r in selected]
                    entry[method] = (None if any(v is None for v in values)
                                     else sum(r["calls"][source] * v for r, v in zip(selected, values)) / 1e3)
                totals.append(entry)
    return totals


def render_model_totals(rows: list[dict]) -> str:
    """The table of model_totals (ms per model call), with gn_patch's speedup over torch on channels_last."""
    table = [[t["source"], t["dtype"], t["pass"], t["calls"], t["copy"], t["gn_patch"], t["torch_nchw"], t["torch_cl"],
              t["compile_cl"], speedup(ratio(t["torch_cl"], t["gn_patch"]))] for t in model_totals(rows)]
    headers = ["source", "dtype", "pass", "GN calls", "copy ms", "gn_patch ms", "NCHW ms", "CL ms", "compile ms",
               "vs CL"]
    return "\n".join(["### GroupNorm+SiLU time per model call (sum over its GroupNorm calls of GPU time)", "",
                      markdown_table(headers, [[fmt(v, 3) if isinstance(v, float) else v for v in r] for r in table]),
                      ""])


def _e2e_cell_text(row: dict | None) -> str:
    if row is None:
        return "–"
    if row.get("not_run"):
        return "not run"
    if row.get("error"):
        return "error"
    graph = f" / {row['graph_ms']:.1f}" if row.get("graph_ms") is not None else ""
    return f"{row['wall_ms']:.1f} / {row['gpu_ms']:.1f}{graph} ms, {row['peak_mb']:.0f} MB"


def e2e_table(doc: dict) -> str:
    """Configs x variants, each cell wall / GPU ms and peak MB, with the speedups of patching."""
    rows = {(r["config"], r["variant"]): r for r in doc["rows"]}

    def gain(config: str, stock: str, patched: str) -> str:
        before, after = rows.get((config, stock)) or {}, rows.get((config, patched)) or {}
        return speedup(ratio(before.get("wall_ms"), after.get("wall_ms")))

    table = [[config, *(_e2e_cell_text(rows.get((config, v))) for v in VARIANTS),
              gain(config, "stock_cl", "patched"), gain(config, "stock_cl+compile", "patched+compile")]
             for config in dict.fromkeys(r["config"] for r in doc["rows"])]
    return markdown_table(["config", *VARIANTS, "patched vs stock_cl", "patched vs stock, compiled"], table)


def accuracy_table(doc: dict) -> str:
    """The configs whose rows hold an error against float32 stock: GPU time of stock NCHW and patched, the
    speedup, and each one's error (relative L2)."""
    rows = {(r["config"], r["variant"]): r for r in doc["rows"]}
    configs = [c for c in dict.fromkeys(r["config"] for r in doc["rows"])
               if any(rows.get((c, v), {}).get("rel_l2_vs_fp32") is not None for v in VARIANTS)]
    table = []
    for config in configs:
        stock, patched = rows.get((config, "stock_nchw")) or {}, rows.get((config, "patched")) or {}
        table.append([config, fmt(stock.get("gpu_ms"), 1), fmt(patched.get("gpu_ms"), 1),
                      speedup(ratio(stock.get("gpu_ms"), patched.get("gpu_ms"))),
                      fmt(stock.get("rel_l2_vs_fp32"), 5), fmt(patched.get("rel_l2_vs_fp32"), 5)])
    return markdown_table(["config", "stock_nchw GPU ms", "patched GPU ms", "patched vs stock_nchw (GPU)",
                           "stock error vs fp32", "patched error vs fp32"], table) if table else ""


def render_e2e(doc: dict) -> str:
    """The end-to-end section of summary.md from e2e.json's document: notes, the table, the cells not run."""
    meta = doc["metadata"]
    parts = ["## End to end", "", provenance(meta), "",
             "Cells: wall / CUDA-event GPU [/ CUDA-graph replay] ms (medians), peak memory allocated; speedups "
             "of wall time.", ""]
    parts += [f"- **{k}**: {v}" for k, v in meta.get("variants", {}).items()]
    parts += [f"- **{k}**: {v}" for k, v in meta.get("configs", {}).items()]
    parts += [f"- {k}: {v}" for k, v in meta.get("notes", {}).items()]
    parts += [f"- surgeon on {k}: {v}" for k, v in meta.get("patch_reports", {}).items()]
    parts += ["", e2e_table(doc), ""]
    accuracy = accuracy_table(doc)
    if accuracy:
        parts += ["Zoo configs: GPU time against stock NCHW, and the output's relative L2 error against the float32 "
                  "stock model.", "", accuracy, ""]
    remarks = [f"- {r['config']} / {r['variant']}: {r.get('not_run') or r.get('error')}"
               for r in doc["rows"] if r.get("not_run") or r.get("error")]
    if remarks:
        parts += ["Not run or failed:", "", *remarks, ""]
    return "\n".join(parts)


def cpu_table(doc: dict) -> str:
    """cpu_overhead.json's rows as a table of µs per call."""
    table = [[r["method"], r["us_per_call"], r["us_per_call_min"], r.get("error", "")] for r in doc["rows"]]
    return markdown_table(["method", "µs/call (median)", "µs/call (min)", "error"], table)


def render_cpu(doc: dict) -> str:
    """The CPU-cost section of summary.md from cpu_overhead.json's document."""
    meta = doc["metadata"]
    return "\n".join([f"## CPU cost of one call: {shape_label(meta['shape'])} {meta['dtype']}, {meta['grad_mode']}",
                      "", provenance(meta), "", meta["notes"], "", cpu_table(doc), ""])


def render_summary(kernels: dict | None, e2e: dict | None, cpu: dict | None, peers: list[dict] | None = None
                   ) -> str:
    """summary.md from whichever result documents exist (kernels.json, e2e.json, cpu_overhead.json as documents,
    peers.json as its list of rows); the header's provenance is the first document's (or peers' first row)."""
    docs = [d["metadata"] for d in (kernels, e2e, cpu) if d] + (peers or [])[:1]
    meta = docs[0] if docs else {}
    # peers.json's rows name torch's version torch_version (the row format); a peers-only run records no
    # diffusers, quick or command, so those are left out rather than printed as None.
    provenance_of = {**meta, "torch": meta.get("torch", meta.get("torch_version"))}
    header = ["# gn_patch benchmark" + (f": {meta['gpu']}" if meta.get("gpu") else ""), "",
              ", ".join(f"{k} {provenance_of[k]}" for k in ("commit", "torch", "cuda", "diffusers", "triton", "date",
                                                          "quick") if provenance_of.get(k) is not None), ""]
    header += [f"`{meta['command']}`", ""] if meta.get("command") else []
    sections = [render(doc) for render, doc in ((render_kernels, kernels), (render_e2e, e2e), (render_cpu, cpu),
                                                (render_peers, peers)) if doc]
    return "\n".join(header + sections)


def load_results(out: Path) -> dict[str, Any]:
    """section -> its result document in ``out`` (None where the file does not exist)."""
    return {section: load_result(out / name) for section, name in RESULT_FILES.items()}


def console_summary(out: Path) -> str:
    """The headline tables, for the end of the run's output (per-model totals, end to end, CPU cost, peers)."""
    results = load_results(out)
    parts = [render_model_totals(results["kernels"]["rows"])] if results["kernels"] else []
    parts += [e2e_table(results["e2e"])] if results["e2e"] else []
    parts += [cpu_table(results["cpu"])] if results["cpu"] else []
    parts += [headlines(results["peers"])] if results["peers"] else []
    return "\n\n".join(parts)
