"""The package as pip installs it: every subpackage and kernel source is in the wheel, and the installed package
finds its own sources (outside any checkout). Builds a wheel with the running environment's setuptools."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
tomllib = pytest.importorskip("tomllib")


def test_pyproject_lists_every_subpackage():
    packages = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "gn_patch").rglob("__init__.py")}
    assert found | {"gn_patch.csrc"} == packages


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(ROOT)], check=True, capture_output=True)
    return next(out.glob("gn_patch-*.whl"))


def test_wheel_leaves_out_sources_an_earlier_build_copied(tmp_path):
    """setuptools keeps what an earlier build copied to build/lib/ (pip builds in the source tree): a kernel source
    removed or renamed since must not ship, since every source in gn_patch/csrc/ is compiled (setup.py's BuildPy)."""
    project = tmp_path / "project"
    shutil.copytree(ROOT / "gn_patch", project / "gn_patch", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copytree(ROOT / "csrc", project / "csrc")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, project / name)
    earlier = project / "build" / "lib" / "gn_patch" / "csrc" / "removed_since.cu"
    earlier.parent.mkdir(parents=True)
    earlier.write_text("")
    out = tmp_path / "wheel"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(project)], check=True, capture_output=True)
    names = zipfile.ZipFile(next(out.glob("gn_patch-*.whl"))).namelist()
    assert "gn_patch/csrc/ops.cpp" in names
    assert "gn_patch/csrc/removed_since.cu" not in names


def test_wheel_holds_the_kernel_sources(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {f"gn_patch/csrc/{p.name}" for p in (ROOT / "csrc").iterdir() if p.is_file()}
    assert sources and sources <= names, f"not in the wheel (pyproject.toml's package-data): {sources - names}"
    assert "gn_patch/bench/__main__.py" in names


def test_installed_package_finds_its_own_sources(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    script = ("from gn_patch import extension; d = extension.source_directory(); "
              "print(d); print(' '.join(p.name for p in extension.source_files(d)))")
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env={"PYTHONPATH": str(site), "PATH": ""},
                            capture_output=True, text=True, check=True)
    directory, files = result.stdout.splitlines()
    assert Path(directory) == site / "gn_patch" / "csrc"
    csrc = ROOT / "csrc"
    assert files.split() == [p.name for p in sorted(csrc.glob("*.cpp")) + sorted(csrc.glob("*.cu"))]
