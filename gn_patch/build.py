"""Compile gn_patch's CUDA extension ahead of time and print where it lives.

    python -m gn_patch.build [--arch 9.0] [--verbose]

Without --arch it builds for the visible GPU, or for TORCH_CUDA_ARCH_LIST on a machine without one.
Exit status 1 (with the cause on stderr) when nvcc is missing, does not match torch's CUDA, or the code
fails to compile.
"""

from __future__ import annotations

import argparse
import sys

from .extension import BuildError, build


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gn_patch.build", description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", help="compute capability, e.g. 9.0 (default: the visible GPU's)")
    parser.add_argument("--verbose", action="store_true", help="show the compiler's commands and output")
    args = parser.parse_args(argv)
    try:
        path = build(args.arch, verbose=args.verbose)
    except BuildError as exc:
        print(f"gn_patch build failed: {exc}", file=sys.stderr)
        return 1
    print(f"gn_patch CUDA extension ready (compiled now, or found up to date): {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
