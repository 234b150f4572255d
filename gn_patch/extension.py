"""Build and load gn_patch's CUDA kernels (the command line is gn_patch.build).

The extension is compiled on first use with ninja through ``torch.utils.cpp_extension`` for the running
GPU's architecture only, and cached per (torch version, CUDA version, architecture). Ahead of time, also on
a machine with nvcc but no GPU::

    python -m gn_patch.build --arch 9.0      # or TORCH_CUDA_ARCH_LIST=9.0 python -m gn_patch.build

Environment: ``GN_PATCH_BUILD_DIR`` overrides the cache folder (default ``~/.cache/gn_patch``);
``CUDA_HOME`` names the CUDA toolkit; ``MAX_JOBS`` caps ninja's parallel compiles.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

import torch

CSRC = Path(__file__).resolve().parent.parent / "csrc"
SOURCES = ("ops.cpp", "geometry.cpp", "forward.cu", "backward.cu")
EXTENSION_NAME = "gn_patch_C"


class BuildError(RuntimeError):
    """The CUDA extension cannot be built here (no nvcc, mismatched CUDA, no CUDA-enabled torch, ...)."""


def _cuda_home() -> str:
    """The CUDA toolkit folder: $CUDA_HOME/$CUDA_PATH, else the folder above `nvcc` that holds the headers."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parent.parent))
    candidates.append("/usr/local/cuda")
    for home in candidates:
        if home and (Path(home) / "bin" / "nvcc").exists() and (Path(home) / "include" / "cuda_runtime.h").exists():
            return home
    raise BuildError("nvcc not found: install the CUDA toolkit matching torch "
                     f"(CUDA {torch.version.cuda}) or set CUDA_HOME to it")


def _arch(arch: str | None) -> str:
    """Compute capability to build for, as 'major.minor'."""
    if arch:
        return arch
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return os.environ["TORCH_CUDA_ARCH_LIST"]
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"{major}.{minor}"
    raise BuildError("no GPU visible: name the architecture to build for with --arch 9.0 "
                     "or TORCH_CUDA_ARCH_LIST=9.0")


def build_directory(arch: str) -> Path:
    root = Path(os.environ.get("GN_PATCH_BUILD_DIR", Path.home() / ".cache" / "gn_patch"))
    tag = f"torch{torch.__version__}-cu{torch.version.cuda}-sm{arch.replace('.', '').replace(';', '_')}"
    return root / tag


def build(arch: str | None = None, verbose: bool = False) -> Path:
    """Compile (if needed) and load the extension; return the path of the shared library.

    Raises:
        BuildError: torch has no CUDA, nvcc is missing or does not match torch's CUDA, or compilation failed.
    """
    if torch.version.cuda is None:
        raise BuildError(f"torch {torch.__version__} is a CPU-only build; the kernels need a CUDA build of torch")
    arch = _arch(arch)
    cuda_home = _cuda_home()
    os.environ.setdefault("CUDA_HOME", cuda_home)  # read by cpp_extension at import: no misleading guess there
    from torch.utils import cpp_extension

    cpp_extension.CUDA_HOME = cuda_home
    directory = build_directory(arch)
    directory.mkdir(parents=True, exist_ok=True)
    previous = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = arch
    try:
        cpp_extension.load(
            name=EXTENSION_NAME,
            sources=[str(CSRC / s) for s in SOURCES],
            extra_cflags=["-O3"],
            extra_cuda_cflags=["-O3", "-lineinfo", "-Xptxas=-warn-spills"],
            build_directory=str(directory),
            is_python_module=False,
            verbose=verbose,
        )
    except (RuntimeError, OSError, ValueError) as exc:  # cpp_extension reports compiler and version errors so
        raise BuildError(str(exc)) from exc
    finally:
        if previous is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = previous
    return directory / f"{EXTENSION_NAME}.so"


_loaded: bool | None = None  # None: not tried yet


@torch.compiler.assume_constant_result
def kernels_available() -> bool:
    """True once the CUDA kernels are loaded; builds them on the first call.

    Never raises: when the build fails it warns once and returns False, and gn_patch then computes every
    call with PyTorch's GroupNorm. Constant for torch.compile (the build happens at trace time, not per call).
    """
    global _loaded
    if _loaded is None:
        try:
            build()
            _loaded = True
        except BuildError as exc:
            warnings.warn(f"gn_patch: CUDA kernels unavailable, using PyTorch's GroupNorm instead. Cause: {exc}",
                          RuntimeWarning, stacklevel=2)
            _loaded = False
    return _loaded
