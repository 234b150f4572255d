"""CPU tests of the extension build (gn_patch/extension.py, gn_patch/build.py): a failed build warns once and
falls back, a missing nvcc is one clear error, and (in CI) the kernels compile."""

import os
import warnings

import pytest

from gn_patch import extension


def test_failed_build_warns_once_and_falls_back(monkeypatch):
    def broken(*args, **kwargs):
        raise extension.BuildError("nvcc not found (test)")

    monkeypatch.setattr(extension, "build", broken)
    monkeypatch.setattr(extension, "_loaded", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert extension.kernels_available() is False
        assert extension.kernels_available() is False
    messages = [str(w.message) for w in caught if "gn_patch" in str(w.message)]
    assert len(messages) == 1 and "nvcc not found (test)" in messages[0]


def test_missing_nvcc_is_one_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(extension.Path, "exists", lambda self: False)
    with pytest.raises(extension.BuildError, match="nvcc not found"):
        extension._cuda_home()


@pytest.mark.skipif(not os.environ.get("GN_PATCH_REQUIRE_BUILD"),
                    reason="set GN_PATCH_REQUIRE_BUILD=1 (CI does; without a GPU also "
                           "TORCH_CUDA_ARCH_LIST=9.0) to require the CUDA extension to compile here")
def test_extension_compiles_and_loads():
    """CI has nvcc but no GPU: the kernels must still compile and the library load."""
    path = extension.build()
    assert path.exists()
