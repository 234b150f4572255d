"""Build and load gn_patch's CUDA kernels (the command line is gn_patch.build).

The kernel sources (every ``*.cpp`` and ``*.cu`` of ``csrc/``) ship inside the package: ``gn_patch/csrc/`` in a
wheel or a non-editable install, the checkout's top-level ``csrc/`` in an editable install or a source tree on
PYTHONPATH. On first use they are compiled with ninja through ``torch.utils.cpp_extension`` for the running GPU's
architecture only, and cached per (torch version, CUDA version, architecture). Ahead of time, also on a machine
with nvcc but no GPU::

    python -m gn_patch.build --arch 9.0      # or TORCH_CUDA_ARCH_LIST=9.0 python -m gn_patch.build

An install with ``GN_PATCH_CUDA_ARCH_LIST`` set (``GN_PATCH_CUDA_ARCH_LIST="8.0;9.0" pip install
--no-build-isolation .``, see setup.py) compiles the library into the package instead; it is loaded when it was
built for the running torch and GPU from the sources beside it, and the JIT build above serves otherwise.

Environment: ``GN_PATCH_BUILD_DIR`` overrides the cache folder (default ``~/.cache/gn_patch``);
``CUDA_HOME`` names the CUDA toolkit; ``MAX_JOBS`` caps ninja's parallel compiles.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import site
import shutil
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

PACKAGE_DIR = Path(__file__).resolve().parent
EXTENSION_NAME = "gn_patch_C"
# Written by setup.py beside the library it compiles at install time: {"library", "torch", "cuda", "arch", "sources"}.
PREBUILT_INFO = PACKAGE_DIR / f"{EXTENSION_NAME}.json"
# Compiler flags of both builds (the JIT one here, the install-time one of setup.py).
CXX_FLAGS = ["-O3"]
# -Xfatbin=-compress-all: by default fatbinary compressed one 47 MB cubin (csrc/forward.cu's, before the kernels were
# compiled per activation: csrc/passes.h) but left the per-activation units' ones (up to 10 MB) uncompressed, mostly
# -lineinfo's PTX text: a library of 75 MB instead of 19 (sm_90, nvcc 13.0).
NVCC_FLAGS = ["-O3", "-lineinfo", "-Xptxas=-warn-spills", "-Xfatbin=-compress-all"]


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


def source_directory() -> Path:
    """The folder of the kernel sources: ``csrc/`` inside the installed package, else the checkout's ``csrc/``
    (an editable install or a source tree on PYTHONPATH).

    Raises:
        BuildError: neither exists (a package installed without its sources).
    """
    candidates = (PACKAGE_DIR / "csrc", PACKAGE_DIR.parent / "csrc")
    for directory in candidates:
        if source_files(directory):
            return directory
    raise BuildError(f"the kernel sources are missing: no .cpp or .cu file in {' or '.join(map(str, candidates))}; "
                     "reinstall gn_patch from a wheel, an sdist or a checkout")


def _kernel_files(directory: Path, *patterns: str) -> list[Path]:
    """The regular files of ``directory`` matching ``patterns``, sorted by name; hidden ones (an editor's lock or
    backup files) left out, as the package data leaves them out."""
    paths = (p for pattern in patterns for p in directory.glob(pattern))
    return sorted(p for p in paths if p.is_file() and not p.name.startswith("."))


def source_files(directory: Path) -> list[Path]:
    """Every translation unit of ``directory``: its ``*.cpp`` then its ``*.cu`` files, each group sorted by name."""
    return _kernel_files(directory, "*.cpp") + _kernel_files(directory, "*.cu")


def sources_digest(directory: Path) -> str:
    """SHA-256 (hex) over the kernel sources of ``directory``, every ``*.cpp``, ``*.cu``, ``*.h`` and ``*.cuh`` by
    name and content: a library compiled at install time records it, so that one compiled from other sources (an
    editable install's, after a checkout) is not loaded.

    Raises:
        OSError: a source cannot be read.
    """
    digest = hashlib.sha256()
    for path in _kernel_files(directory, "*.cpp", "*.cu", "*.h", "*.cuh"):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _arch_set(arch_list: str) -> set[str]:
    """'8.0;9.0+PTX' (or space-separated) -> {'8.0', '9.0'}."""
    return {a.removesuffix("+PTX") for a in arch_list.replace(" ", ";").split(";") if a}


def _prebuilt_record() -> dict | None:
    """gn_patch_C.json as setup.py writes it ({"library", "torch", "cuda", "arch", "sources"}: torch.__version__ and
    torch.version.cuda as they were, strings otherwise), or None with a warning when it is not that."""
    try:
        info = json.loads(PREBUILT_INFO.read_text())
    except (OSError, ValueError) as exc:  # ValueError: not JSON, or not UTF-8
        problem = str(exc)
    else:
        if (isinstance(info, dict) and {"torch", "cuda"} <= info.keys()
                and all(isinstance(info.get(k), str) for k in ("library", "arch", "sources"))):
            return info
        problem = "not an object with the fields library, torch, cuda, arch and sources"
    warnings.warn(f"gn_patch: {PREBUILT_INFO} is not a readable record of the prebuilt kernels ({problem}): "
                  "compiling them instead", RuntimeWarning, stacklevel=4)
    return None


def prebuilt_library(arch: str) -> Path | None:
    """The library compiled at install time that gn_patch_C.json names, if it was built for this torch, this CUDA
    and ``arch`` from the kernel sources found beside it (source_directory; where there are none, the library is
    taken as it is).

    A prebuilt library for another torch or other architectures is not used (it would not load, or would have no
    kernel for the GPU), nor one compiled from other sources or whose sources cannot be read (it could lack ops or
    kernels of this version), nor one whose record cannot be read: the caller then builds one on first use, and
    this warns once to say why.
    """
    if not PREBUILT_INFO.exists():
        return None
    info = _prebuilt_record()
    if info is None:
        return None
    library = PACKAGE_DIR / info["library"]
    if Path(info["library"]).name != info["library"] or not library.is_file():
        return None
    here = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if {k: info[k] for k in here} != here or not _arch_set(arch) <= _arch_set(info["arch"]):
        warnings.warn(f"gn_patch: the prebuilt kernels ({library.name}: torch {info['torch']}, CUDA {info['cuda']}, "
                      f"arch {info['arch']}) do not fit torch {torch.__version__}, CUDA {torch.version.cuda}, arch "
                      f"{arch}: compiling them for this setup instead", RuntimeWarning, stacklevel=3)
        return None
    try:
        sources = source_directory()
    except BuildError:
        return library
    try:
        digest = sources_digest(sources)
    except OSError as exc:
        warnings.warn(f"gn_patch: the kernel sources in {sources} cannot be read ({exc}), so the prebuilt kernels "
                      f"({library.name}) cannot be matched to them: compiling them instead", RuntimeWarning,
                      stacklevel=3)
        return None
    if info["sources"] != digest:
        warnings.warn(f"gn_patch: the prebuilt kernels ({library.name}) were compiled from other sources than "
                      f"those in {sources}: compiling these instead", RuntimeWarning, stacklevel=3)
        return None
    return library


def library_include_paths() -> list[str]:
    """Header folders of the CUDA libraries PyTorch's CUDA headers include (cusparse.h, cublas_v2.h, ...): pip's
    nvidia-* wheels install them beside torch, where a toolkit in CUDA_HOME may have only the compiler and runtime."""
    roots = [Path(p) / "nvidia" for p in site.getsitepackages() + [site.getusersitepackages()]]
    return sorted(str(inc) for root in roots if root.is_dir() for inc in root.glob("*/include") if inc.is_dir())


def cache_root() -> Path:
    """$GN_PATCH_BUILD_DIR, else ~/.cache/gn_patch: where JIT builds are cached."""
    return Path(os.environ.get("GN_PATCH_BUILD_DIR", Path.home() / ".cache" / "gn_patch"))


def build_directory(arch: str) -> Path:
    """The cache folder of JIT builds for ``arch`` with this torch and CUDA, under cache_root()."""
    root = cache_root()
    tag = f"torch{torch.__version__}-cu{torch.version.cuda}-sm{arch.replace('.', '').replace(';', '_')}"
    return root / tag


def _say(message: str) -> None:
    print(f"gn_patch: {message}", file=sys.stderr, flush=True)


def _compiles(library: Path, sources: list[Path]) -> bool:
    """Whether loading ``library`` from ``sources`` compiles (for the messages around it): no library yet, its
    build.ninja names other sources (the build directory is shared by every checkout of one torch, CUDA and arch:
    another clone's build is compiled again), or a file of the sources' folder is newer than the library."""
    if not library.exists():
        return True
    try:
        ninja = (library.parent / "build.ninja").read_text()
        built = library.stat().st_mtime
        folder = sources[0].parent
        return (any(str(path) not in ninja for path in sources)
                or any(path.stat().st_mtime > built for path in folder.iterdir() if path.is_file()))
    except OSError:
        return True


@contextlib.contextmanager
def build_lock(directory: Path) -> Iterator[None]:
    """Hold an exclusive lock of gn_patch's own on the build folder ``directory`` while
    ``torch.utils.cpp_extension.load`` compiles or loads there, and clear a lock that a killed build of torch's left.

    torch 2.13 and older guard a build folder with a file, ``lock``, whose existence alone makes every later build
    wait (``torch.utils.file_baton.FileBaton``): a build killed by SIGKILL or SIGTERM (a notebook restarted in the
    minutes of the first compile, a job's time limit) leaves it, and every later import waits on it for ever without
    a word (pytorch/pytorch#189245; torch 2.14 takes an OS lock instead). This lock is an ``fcntl.flock`` on
    ``directory/gn_patch.lock``, which the operating system releases when its holder dies: any other process
    building here holds it, so a ``lock`` found while holding it is stale and is removed. Where ``fcntl`` does not
    exist (not POSIX) torch's lock alone guards the folder. Reentrant within a thread (not across the tasks of an
    event loop, nor for a process forked while it is held: the child waits for it); ``directory`` may be a str.

    Raises:
        OSError: the lock file cannot be opened or locked.
    """
    directory = Path(directory).resolve()
    held = _held_build_locks.folders
    try:
        import fcntl
    except ImportError:
        fcntl = None
    if fcntl is None or directory in held:  # not POSIX; or this thread holds it already (a second flock would wait)
        yield
        return
    from torch.utils import cpp_extension

    with open(directory / "gn_patch.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:  # the record inside: an interrupt just after the flock must not leave the folder recorded as held
            held.add(directory)
            if hasattr(cpp_extension, "FileBaton"):  # torch's existence lock, not an OS one: stale if present
                (directory / "lock").unlink(missing_ok=True)
            yield
        finally:
            held.discard(directory)
            fcntl.flock(handle, fcntl.LOCK_UN)


class _HeldBuildLocks(threading.local):
    """The build folders whose lock this thread holds (``__init__`` runs once in each thread that reads it)."""

    def __init__(self) -> None:
        self.folders: set[Path] = set()


_held_build_locks = _HeldBuildLocks()


# A process forked while its parent holds build locks holds none of them (its own open of a lock file waits for the
# parent's flock): the forking thread, the child's only one, starts with no record rather than enter as if reentrant.
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: _held_build_locks.folders.clear())


def build(arch: str | None = None, verbose: bool = False) -> Path:
    """Load the extension (its ops, and its Python function as ``entry``), compiling it first where needed; return
    the path of the shared library.

    Loads the library compiled at install time when it fits (see prebuilt_library), else compiles the sources
    (see source_directory) into build_directory(arch), which ninja skips when they are up to date. A compile
    prints a line to stderr before and after (it takes minutes on a small machine).

    Raises:
        BuildError: torch has no CUDA, no architecture is given and no GPU is visible, the sources are missing,
            nvcc is missing or does not match torch's CUDA, or compilation failed.
    """
    if torch.version.cuda is None:
        raise BuildError(f"torch {torch.__version__} is a CPU-only build; the kernels need a CUDA build of torch")
    arch = _arch(arch)
    prebuilt = prebuilt_library(arch)
    if prebuilt is not None:
        torch.ops.load_library(str(prebuilt))
        _load_entry(prebuilt)
        return prebuilt
    sources = source_files(source_directory())
    cuda_home = _cuda_home()
    os.environ.setdefault("CUDA_HOME", cuda_home)  # read by cpp_extension at import: no misleading guess there
    from torch.utils import cpp_extension

    cpp_extension.CUDA_HOME = cuda_home
    directory = build_directory(arch)
    directory.mkdir(parents=True, exist_ok=True)
    library = directory / f"{EXTENSION_NAME}.so"
    first_build = _compiles(library, sources)
    if first_build:
        _say(f"compiling the CUDA kernels ({len(sources)} files from {sources[0].parent}) for arch {arch} into "
             f"{directory}: a few minutes on a small machine, once")
    start = time.perf_counter()
    previous = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = arch
    try:
        with build_lock(directory):
            cpp_extension.load(
                name=EXTENSION_NAME,
                sources=[str(path) for path in sources],
                extra_cflags=CXX_FLAGS,
                extra_cuda_cflags=NVCC_FLAGS,
                extra_include_paths=library_include_paths(),
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
    if first_build:
        _say(f"CUDA kernels compiled in {time.perf_counter() - start:.0f} s")
    _load_entry(library)
    return library


_loaded: bool | None = None  # None: not tried yet
loaded = False  # the extension's ops (kernels, autograd, dispatch) are registered: gn_patch.ops calls them
# Once loaded: the library's Python function group_norm_act_dispatch (csrc/python_entry.cpp), which calls the
# dispatching op from C++ without the OpOverload's per-call argument parsing.
entry = None


def _load_entry(library: Path) -> None:
    """Set ``entry`` from the loaded library, imported as the Python module gn_patch.gn_patch_C (its ops are
    registered already: the import runs only its module init).

    Raises:
        BuildError: the library is no Python module (compiled from sources without csrc/python_entry.cpp).
    """
    global entry
    try:
        spec = importlib.util.spec_from_file_location(f"{__package__}.{EXTENSION_NAME}", library)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        entry = module.group_norm_act_dispatch
    except (ImportError, AttributeError) as exc:
        raise BuildError(f"{library} loaded, but not as gn_patch's Python module: {exc}") from exc


@torch.compiler.assume_constant_result
def kernels_available() -> bool:
    """True once the CUDA kernels are loaded; builds them on the first call.

    Never raises: when the build fails it warns once and returns False, and gn_patch then computes every
    call with PyTorch's GroupNorm. Constant for torch.compile (the build happens at trace time, not per call).
    """
    global _loaded, loaded
    if _loaded is None:
        try:
            build()
            _loaded = loaded = True
        except BuildError as exc:
            warnings.warn(f"gn_patch: CUDA kernels unavailable, using PyTorch's GroupNorm instead. Cause: {exc}",
                          RuntimeWarning, stacklevel=2)
            _loaded = False
    return _loaded
