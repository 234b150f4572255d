"""Merges two runs of harness_times.py (a base build and the working tree's, same machine, same call) into one
A/B table with the commits, the GPU and torch: the format of results/h200/ab_barriers.json.

    python benchmarks/tools/ab_merge.py BASE.json NEW.json OUT.json   (GN_PATCH_COMMIT and BASE_COMMIT set)
"""
import json
import os
import sys

import torch
from harness_times import print_table, write_json


def merge(base_rows: list[dict], new_rows: list[dict]) -> list[dict]:
    """One row per (dtype, shape) of new_rows, with the base build's forward and forward+backward µs beside."""
    base = {(r["dtype"], tuple(r["shape"])): r for r in base_rows}
    rows = []
    for r in new_rows:
        b = base[(r["dtype"], tuple(r["shape"]))]
        rows.append({"shape": r["shape"], "dtype": r["dtype"], "mb": r["mb"], "copy_us": round(r["copy_us"], 2),
                     "base_fwd_us": round(b["gn_patch_fwd_us"], 2), "fwd_us": round(r["gn_patch_fwd_us"], 2),
                     "base_fwd_bwd_us": round(b["gn_patch_fwd_bwd_us"], 2),
                     "fwd_bwd_us": round(r["gn_patch_fwd_bwd_us"], 2)})
    return rows


def main(base_path: str, new_path: str, out_path: str) -> None:
    with open(base_path) as f_base, open(new_path) as f_new:
        rows = merge(json.load(f_base), json.load(f_new))
    out = {"tool": "benchmarks/tools/harness_times.py (TIMING=graph, median of 5 replays of 20 calls, HARNESS_TORCH=0)",
           "commit": os.environ["GN_PATCH_COMMIT"], "base_commit": os.environ["BASE_COMMIT"],
           "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    write_json(out_path, out)
    print_table(rows, {"dtype": "dtype", "shape": "shape", "copy": "copy_us", "fwd base": "base_fwd_us",
                       "fwd": "fwd_us", "fwd+bwd base": "base_fwd_bwd_us", "fwd+bwd": "fwd_bwd_us"})

if __name__ == "__main__":
    main(*sys.argv[1:4])
