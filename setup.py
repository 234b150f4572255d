"""Install-time build of the CUDA kernels, opt-in: the metadata lives in pyproject.toml.

By default the package installs as Python plus the kernel sources (``gn_patch/csrc/``), compiled on first use
(gn_patch/extension.py). With ``GN_PATCH_CUDA_ARCH_LIST`` set, the install compiles them into the package for the
named architectures, as apex and flash-attention do::

    GN_PATCH_CUDA_ARCH_LIST="8.0;9.0" MAX_JOBS=4 pip install --no-build-isolation .

``--no-build-isolation``: the library must be compiled against the torch that will load it, and pip's isolated
build environment has none. The library is used only with that torch and CUDA and on those architectures;
anything else falls back to the first-use build.
"""

import importlib.util
import json
import os
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
ARCH_LIST = os.environ.get("GN_PATCH_CUDA_ARCH_LIST", "").strip()


def _extension_module():
    """gn_patch/extension.py alone (it needs only torch), for its flags, source list and toolkit lookup."""
    spec = importlib.util.spec_from_file_location("_gn_patch_extension", ROOT / "gn_patch" / "extension.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build_options() -> dict:
    """setup() keywords that add the compiled library to the package."""
    try:
        extension = _extension_module()
    except ImportError as exc:
        raise SystemExit("GN_PATCH_CUDA_ARCH_LIST is set but torch cannot be imported where the package is built: "
                         "install torch first and pass --no-build-isolation to pip") from exc
    import torch

    if torch.version.cuda is None:
        raise SystemExit(f"GN_PATCH_CUDA_ARCH_LIST is set but torch {torch.__version__} is a CPU-only build")
    os.environ["CUDA_HOME"] = extension._cuda_home()  # read when cpp_extension is imported
    os.environ["TORCH_CUDA_ARCH_LIST"] = ARCH_LIST
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    class BuildWithInfo(BuildExtension):
        """BuildExtension, then gn_patch_C.json beside the library: its file name, the torch, CUDA and
        architectures it is for, and the digest of the sources it is compiled from (taken before the compile)."""

        def run(self):
            sources = extension.sources_digest(ROOT / "csrc")
            super().run()
            for ext in self.extensions:
                library = Path(self.get_ext_fullpath(ext.name))
                info = {"library": library.name, "torch": torch.__version__, "cuda": torch.version.cuda,
                        "arch": ARCH_LIST, "sources": sources}
                library.with_name(f"{extension.EXTENSION_NAME}.json").write_text(json.dumps(info) + "\n")

    sources = [str(path.relative_to(ROOT)) for path in extension.source_files(ROOT / "csrc")]
    module = CUDAExtension(f"gn_patch.{extension.EXTENSION_NAME}", sources,
                           include_dirs=extension.library_include_paths(),
                           extra_compile_args={"cxx": extension.CXX_FLAGS, "nvcc": extension.NVCC_FLAGS})
    return {"ext_modules": [module], "cmdclass": {"build_ext": BuildWithInfo}}


class BuildPy(build_py):
    """build_py that first empties the build folder's copy of the kernel sources. setuptools keeps what an earlier
    build copied there, and every source in gn_patch/csrc/ is compiled: a file renamed or removed since (a
    checkout's ``pip install .``, then ``git pull`` and the same again) would be compiled beside its successor."""

    def run(self):
        shutil.rmtree(Path(self.build_lib) / "gn_patch" / "csrc", ignore_errors=True)
        super().run()


options = _build_options() if ARCH_LIST else {}
options["cmdclass"] = {"build_py": BuildPy, **options.get("cmdclass", {})}
setup(**options)
