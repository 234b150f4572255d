"""Shared test configuration: the `gpu` marker skips without CUDA; one tolerance table by dtype; fixtures that load
the extension and choose the host path (Python or C++) or emulate the kernel path on the CPU."""

import os

import pytest
import torch

from gn_patch import extension

# Tolerances against a float64 reference, by the dtype of the tensors under test. The fp16/bf16 rows
# cover one rounding of the output (fp16: 2^-11 relative, bf16: 2^-8) on values of order 1 to 10.
TOLERANCES = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=4e-3, rtol=4e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=1.6e-2),
    torch.float64: dict(atol=1e-10, rtol=1e-10),
}


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def release_cached_gpu_memory(request):
    """After each GPU test, return the blocks PyTorch's caching allocator keeps to the driver. The H200 suite runs
    four workers on one GPU, and one worker's cache from its large tests (66 GB) made another's allocations fail
    (three out-of-memory failures at 495bfdf, which passed when run alone)."""
    yield
    if "gpu" in request.keywords and torch.cuda.is_available():
        torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def ext():
    """The compiled extension (C++ autograd and dispatch) loaded on this CPU machine; CI builds it."""
    if not extension.kernels_available():
        if os.environ.get("GN_PATCH_REQUIRE_BUILD"):
            pytest.fail("the extension failed to build or load")
        pytest.skip("the extension is not built here (needs nvcc, a CUDA build of torch, and a GPU or "
                    "TORCH_CUDA_ARCH_LIST; GN_PATCH_REQUIRE_BUILD=1 makes this a failure)")


@pytest.fixture(params=["python", "cpp"])
def host_path(request, monkeypatch):
    """Run a test once with PyTorch's path in Python (before the extension loads) and once in C++ (after)."""
    if request.param == "python":
        monkeypatch.setattr(extension, "loaded", False)
    else:
        request.getfixturevalue("ext")
    return request.param


@pytest.fixture
def kernel_path_on_cpu(ext):
    """The C++ dispatch sends channels-last CPU inputs to the op's CPU implementation as if it were the CUDA kernels:
    the kernel path's dispatch, autograd and tracing run without a GPU."""
    previous = torch.ops.gn_patch._set_cpu_emulates_kernels(True)
    yield
    torch.ops.gn_patch._set_cpu_emulates_kernels(previous)
