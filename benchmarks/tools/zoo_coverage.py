"""The README's zoo coverage table: for one tiny config of each diffusers model class holding a GroupNorm
(tests/zoo.py), how many of its GroupNorms patch_model fuses, runs alone or leaves as they are.

    python benchmarks/tools/zoo_coverage.py            # markdown table on stdout
    python benchmarks/tools/zoo_coverage.py --json coverage.json

Runs on the CPU in a few seconds (the models are built, patched, not run). The totals line gives the share of the
zoo's GroupNorms that run gn_patch's op (fused or alone).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: tests.zoo

from gn_patch.surgeon import patch_model
from tests.zoo import ZOO, count_group_norms


def coverage() -> list[dict]:
    """One row per primary zoo case: class, GroupNorms, fused, run alone, left as they are."""
    rows = []
    for name, case in ZOO.items():
        if not case.primary:
            continue
        model = case.build()
        total = count_group_norms(model)
        report = patch_model(model)
        rows.append({"class": name, "group_norms": total, "fused": len(report.patched), "alone": len(report.alone),
                     "stock": total - len(report.patched) - len(report.alone)})
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| class | GroupNorms | fused | run alone | left stock |", "|---|---|---|---|---|"]
    lines += [f"| {r['class']} | {r['group_norms']} | {r['fused']} | {r['alone']} | {r['stock']} |" for r in rows]
    total = sum(r["group_norms"] for r in rows)
    fused, alone = sum(r["fused"] for r in rows), sum(r["alone"] for r in rows)
    lines.append(f"| **{len(rows)} classes** | **{total}** | **{fused}** | **{alone}** | **{total - fused - alone}** |")
    lines.append("")
    lines.append(f"{fused + alone} of {total} GroupNorms ({(fused + alone) / total:.1%}) run gn_patch's op; "
                 f"{fused} ({fused / total:.1%}) fused by a rule.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    rows = coverage()
    print(markdown(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
