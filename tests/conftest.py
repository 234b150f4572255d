"""Shared test configuration: the `gpu` marker skips without CUDA; one tolerance table by dtype."""

import pytest
import torch

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
