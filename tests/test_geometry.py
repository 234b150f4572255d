"""The block geometries of csrc/geometry.cpp (host C++, no GPU needed): tests/csrc/geometry_check.cpp sweeps
shapes, dtypes, alignments, passes and cluster limits through make_geometry and checks its invariants (vector
widths, threads per block, tiles and splits covering the tensor exactly, cluster sizes, resident rows fitting the
registers)."""

import shutil
import subprocess
from pathlib import Path

import pytest

from gn_patch import extension

ROOT = Path(__file__).resolve().parents[1]


def test_geometry_invariants(tmp_path):
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    try:
        cuda_home = extension._cuda_home()  # group_norm_act.h includes cuda_runtime_api.h for cudaStream_t
    except extension.BuildError as exc:
        pytest.skip(str(exc))
    binary = tmp_path / "geometry_check"
    subprocess.run([compiler, "-std=c++17", "-O1", "-I", str(ROOT / "csrc"), "-I", f"{cuda_home}/include",
                    str(ROOT / "csrc" / "geometry.cpp"), str(ROOT / "tests" / "csrc" / "geometry_check.cpp"),
                    "-o", str(binary)], check=True)
    result = subprocess.run([str(binary)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("ok:")
