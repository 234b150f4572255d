"""A markdown table of where each profiled kernel's cycles go, from Nsight Compute's raw page (`benchmarks/h200.sh
stalls` writes it): per launch, the grid and block, its time, the instructions each warp executed and the cycles
per issued instruction, split by stall reason.

    ncu --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio,smsp__inst_executed.sum,\\
        smsp__warps_launched.sum,gpu__time_duration.sum" --page raw ... > RAW
    python benchmarks/tools/ncu_stalls.py RAW [--top 6]

Each smsp__average_warps_issue_stalled_<reason>_per_issue_active.ratio is the warps stalled for <reason> per issued
instruction, averaged over the SM sub-partitions, so the reasons sum to the cycles between a warp's instructions
("selected" is the issuing cycle itself; Nsight Compute's "Warp State Statistics" section documents each reason).
ncu_shapes.py launches every kernel twice, the second finding its input in L2: of each such pair the second is kept.
"""
import argparse
import re
from pathlib import Path

# "  void <name>(<parameter types>) (grid x, y, z)x(block x, y, z), Context 1, Stream 7, Device 0, CC 9.0"
LAUNCH = re.compile(r"^\s+void (?P<name>.+)\((?P<types>[^()]*)\) "
                    r"\((?P<grid>\d+), \d+, \d+\)x\((?P<block>\d+), \d+, \d+\), Context")
# "  <metric>   <unit>   <value>" (values with thousands separators; the unit column may be empty)
METRIC = re.compile(r"^\s+(?P<metric>[a-z0-9_]+__[a-z0-9_.]+)\s+(?:\S+\s+)?(?P<value>[\d,]+(?:\.\d+)?)$")
STALL = re.compile(r"smsp__average_warps_issue_stalled_(?P<reason>\w+)_per_issue_active\.ratio")


def launches(text: str) -> list[dict]:
    """Every profiled launch of the raw page, in order: {"kernel", "grid", "block", "metrics"}."""
    found = []
    for line in text.splitlines():
        match = LAUNCH.match(line)
        if match:
            found.append({"kernel": match["name"], "grid": int(match["grid"]), "block": int(match["block"]),
                          "metrics": {}})
            continue
        match = METRIC.match(line)
        if match and found:
            found[-1]["metrics"][match["metric"]] = float(match["value"].replace(",", ""))
    return found


def _same_launch(a: dict, b: dict) -> bool:
    return (a["kernel"], a["grid"], a["block"]) == (b["kernel"], b["grid"], b["block"])


def second_launches(found: list[dict]) -> list[dict]:
    """The second of each pair of consecutive launches of one kernel, grid and block (a launch without its twin is
    kept as it is). Pairs, not runs: two shapes may share a kernel, grid and block ((2,2560,8,8), (2,1280,16,16))."""
    kept, i = [], 0
    while i < len(found):
        twin = i + 1 < len(found) and _same_launch(found[i], found[i + 1])
        kept.append(found[i + 1] if twin else found[i])
        i += 2 if twin else 1
    return kept


def short_name(kernel: str) -> str:
    """The kernel's name without namespace or template arguments, and its template arguments apart."""
    name, _, arguments = kernel.partition("<")
    return f"{name.rsplit('::', 1)[-1]}<{arguments}" if arguments else name.rsplit("::", 1)[-1]


def row(launch: dict, top: int) -> str:
    metrics = launch["metrics"]
    stalls = {match["reason"]: v for m, v in metrics.items() if (match := STALL.fullmatch(m))}
    warps = metrics.get("smsp__warps_launched.sum", 0.0)
    per_warp = f"{metrics['smsp__inst_executed.sum'] / warps:,.0f}" if warps else "-"
    largest = ", ".join(f"{reason} {value:.2f}" for reason, value in
                        sorted(stalls.items(), key=lambda item: -item[1])[:top] if value > 0)
    return (f"| `{short_name(launch['kernel'])}` | {launch['grid']} x {launch['block']} | "
            f"{metrics.get('gpu__time_duration.sum', float('nan')):.2f} | {per_warp} | {sum(stalls.values()):.2f} | "
            f"{largest} |")


def table(text: str, top: int = 6) -> str:
    header = ("| kernel | grid x block | µs (ncu) | instructions per warp | cycles per issue | largest stalls "
              "(cycles per issue) |\n|---|---|---|---|---|---|\n")
    return header + "\n".join(row(launch, top) for launch in second_launches(launches(text))) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("raw", type=Path, help="ncu --page raw output with the metrics above")
    parser.add_argument("--top", type=int, default=6, help="stall reasons per row (default: %(default)s)")
    args = parser.parse_args()
    print(table(args.raw.read_text(), args.top), end="")


if __name__ == "__main__":
    main()
