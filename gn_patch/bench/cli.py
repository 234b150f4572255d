"""The command line of the benchmark: ``python -m gn_patch.bench`` (its --help has the sections)."""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from functools import partial
from pathlib import Path

import torch

from .. import extension
from . import __doc__ as PACKAGE_DOC
from .cpu import run_cpu
from .e2e import E2E_GROUPS, run_e2e
from .kernels import run_kernels
from .models import ModelCache
from .peers import SHAPES, run_peers
from .plots import plot_e2e, plot_kernel_speedup
from .report import console_summary, load_results, render_summary
from .results import attempt, run_metadata
from .settings import FULL, QUICK, RESULT_FILES, SECTIONS

DEFAULT_OUT = Path("benchmarks") / "results" / "h200"
DEFAULT_SECTIONS = tuple(s for s in SECTIONS if s != "peers")  # peers needs --peers DIR


def write_report(out: Path) -> list[Path]:
    """summary.md and the plots from the result files in ``out``; returns the files written. A plot that fails
    is reported on stderr and left out (it must not cost the measurements after it)."""
    results = load_results(out)
    written = [out / "summary.md"]
    written[0].write_text(render_summary(results["kernels"], results["e2e"], results["cpu"], results["peers"]))
    for doc, plot, name in ((results["kernels"], plot_kernel_speedup, "kernel_speedup.png"),
                            (results["e2e"], plot_e2e, "e2e.png")):
        if doc and doc["rows"]:
            _, error = attempt(partial(plot, doc, out / name))
            if error is None:
                written.append(out / name)
            else:
                print(f"gn_patch.bench: {name} not drawn ({error})", file=sys.stderr)
    return written


def _comma_list(text: str, choices: tuple[str, ...], what: str) -> tuple[str, ...]:
    """The comma-separated names of ``text``, each one of ``choices`` (argparse type functions below)."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in choices]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown {what}(s) {unknown or text!r}; choose from {', '.join(choices)}")
    return names


def parse_sections(text: str) -> tuple[str, ...]:
    """'kernels,cpu' -> ('kernels', 'cpu'). Raises argparse.ArgumentTypeError for a name not in SECTIONS."""
    return _comma_list(text, SECTIONS, "section")


def parse_e2e_groups(text: str) -> tuple[str, ...]:
    """'sd15,train' -> ('sd15', 'train'). Raises argparse.ArgumentTypeError for a name not in E2E_GROUPS."""
    return _comma_list(text, E2E_GROUPS, "group")


def positive_int(text: str) -> int:
    """An integer >= 1 (argparse type function). Raises argparse.ArgumentTypeError otherwise."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The options of ``argv``; exits with a usage message (argparse) on a bad one, and where --only names the
    peers section without --peers."""
    head, epilog = PACKAGE_DOC.split("\n\n", 1)
    parser = argparse.ArgumentParser(prog="python -m gn_patch.bench", description=head,
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=epilog)
    parser.add_argument("--quick", action="store_true",
                        help="SD1.5 UNet batch 2 and VAE 512² shapes only, fewer repeats, no torch.compile")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: %(default)s)")
    parser.add_argument("--only", type=parse_sections, default=None, metavar="SECTIONS",
                        help=f"comma-separated sections to run, from {','.join(SECTIONS)} (default: "
                             f"{','.join(DEFAULT_SECTIONS)}, and peers with --peers)")
    parser.add_argument("--e2e-groups", type=parse_e2e_groups, default=E2E_GROUPS, metavar="GROUPS",
                        help=f"end-to-end table: only these model groups, from {','.join(E2E_GROUPS)} (default: all); "
                             "rows of the others already in --out/e2e.json (same commit) are kept")
    parser.add_argument("--max-shapes", type=positive_int, default=None, metavar="N",
                        help="kernel and peers tables: only the first N distinct shapes (smoke tests)")
    parser.add_argument("--peers", type=Path, metavar="DIR",
                        help="folder of the peer kernels (gnnhwc/, apex_gn/, sfast/; a missing one is skipped)")
    parser.add_argument("--peers-build-dir", type=Path, default=None, metavar="DIR",
                        help="where the peers are compiled and cached (default: $GN_PATCH_BUILD_DIR/peers, else "
                             "~/.cache/gn_patch/peers)")
    parser.add_argument("--report-only", action="store_true",
                        help="measure nothing: write summary.md and the plots from the JSON files in --out")
    args = parser.parse_args(argv)
    if args.only is None:
        args.only = SECTIONS if args.peers else DEFAULT_SECTIONS
    if "peers" in args.only and args.peers is None and not args.report_only:
        parser.error("the peers section needs --peers DIR")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit status (2 without a CUDA GPU, except for --report-only)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.report_only:
        if not any((args.out / name).exists() for name in RESULT_FILES.values()):
            print(f"gn_patch.bench: no result files ({', '.join(RESULT_FILES.values())}) in {args.out}: nothing to "
                  "report", file=sys.stderr)
            return 1
        for path in write_report(args.out):
            print(path)
        return 0
    if not torch.cuda.is_available():
        print("gn_patch.bench: needs a CUDA GPU (only --report-only runs without one)", file=sys.stderr)
        return 2
    settings = QUICK if args.quick else FULL
    metadata = run_metadata(args.quick, argv)
    start = time.perf_counter()
    kernels_ok = extension.kernels_available()  # builds the extension now, outside every timed region
    metadata.update(gn_patch_kernels=kernels_ok, extension_load_s=round(time.perf_counter() - start, 1))
    cache = ModelCache()
    peers_build_dir = args.peers_build_dir or extension.cache_root() / "peers"
    runners = {
        "kernels": lambda: run_kernels(settings, cache, args.out, metadata, args.max_shapes, kernels_ok),
        "e2e": lambda: run_e2e(settings, cache, args.out, metadata, kernels_ok, args.e2e_groups),
        "cpu": lambda: run_cpu(settings, args.out, metadata, kernels_ok),
        "peers": lambda: run_peers(args.out, metadata, kernels_ok, args.peers, peers_build_dir,
                                   SHAPES[:args.max_shapes]),
    }
    for section in SECTIONS:
        if section in args.only:
            section_start = time.perf_counter()
            print(f"== {section}", flush=True)
            try:
                runners[section]()
            except Exception:  # noqa: BLE001 - the rows written so far stay; the other sections still run
                traceback.print_exc()
            write_report(args.out)  # after every section, so that a later timeout still leaves a summary
            print(f"== {section}: {time.perf_counter() - section_start:.0f} s", flush=True)
    print(console_summary(args.out))
    print(f"== total {time.perf_counter() - start:.0f} s; results in {args.out}")
    return 0
