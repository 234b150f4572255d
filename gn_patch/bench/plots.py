"""The benchmark's plots: kernel_speedup.png from kernels.json, e2e.png from e2e.json (matplotlib, Agg)."""

from __future__ import annotations

import math
from pathlib import Path

from .e2e import VARIANTS
from .kernels import KERNEL_METHODS
from .markdown import shape_label
from .settings import DTYPES, PASSES


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_kernel_speedup(doc: dict, path: Path) -> None:
    """Bars per shape of gn_patch's speedup over the other methods, one panel per (dtype, pass)."""
    plt = _pyplot()
    panels = [(d, p) for d in DTYPES for p in PASSES if any(r["dtype"] == d and r["pass"] == p for r in doc["rows"])]
    if not panels:
        return
    methods = [m for m in KERNEL_METHODS[1:4] if any(r[f"speedup_vs_{m}"] for r in doc["rows"])]
    n_shapes = max(sum(1 for r in doc["rows"] if (r["dtype"], r["pass"]) == panel) for panel in panels)
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(8.0, 0.3 * n_shapes + 2), 3.4 * len(panels)), squeeze=False)
    width = 0.8 / max(1, len(methods))
    for ax, (dtype, pass_) in zip(axes[:, 0], panels, strict=True):
        rows = [r for r in doc["rows"] if r["dtype"] == dtype and r["pass"] == pass_]
        for k, method in enumerate(methods):
            ax.bar([i + (k - (len(methods) - 1) / 2) * width for i in range(len(rows))],
                   [r[f"speedup_vs_{method}"] or 0 for r in rows], width, label=f"vs {method}")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(rows)), [shape_label(r["shape"]) for r in rows], rotation=90, fontsize=6)
        ax.set_ylabel("gn_patch speedup (x)")
        ax.set_title(f"{dtype}, {pass_} (GPU time; > 1: gn_patch faster)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_e2e(doc: dict, path: Path) -> None:
    """Per config, bars of each variant's wall time and, where measured, its CUDA-graph replay time (the GPU work
    alone); a missing bar is a cell not run or failed."""
    plt = _pyplot()
    config_names = list(dict.fromkeys(r["config"] for r in doc["rows"]))
    if not config_names:
        return
    rows = {(r["config"], r["variant"]): r for r in doc["rows"]}
    columns = min(3, len(config_names))
    lines = math.ceil(len(config_names) / columns)
    fig, axes = plt.subplots(lines, columns, figsize=(4.6 * columns, 3.6 * lines), squeeze=False)
    for ax, config in zip(axes.flat, config_names, strict=False):
        cells = [rows.get((config, v)) or {} for v in VARIANTS]
        for offset, key, label in ((-0.2, "wall_ms", "wall"), (0.2, "graph_ms", "GPU work (graph replay)")):
            values = [cell.get(key) for cell in cells]
            if not any(values):
                continue
            bars = ax.bar([i + offset for i in range(len(VARIANTS))], [v or 0 for v in values], 0.4, label=label)
            ax.bar_label(bars, ["n/a" if v is None else f"{v:.1f}" for v in values], fontsize=6)
        ax.set_xticks(range(len(VARIANTS)), VARIANTS, rotation=30, ha="right", fontsize=7)
        ax.set_title(config, fontsize=9)
        ax.set_ylabel("ms (median)")
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(config_names):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

