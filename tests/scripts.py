"""The project's scripts (examples/, benchmarks/), files rather than package modules, imported by the tests."""

import importlib.util
from pathlib import Path


def load_script(path: Path):
    """The script at ``path`` imported as a module named after its file (its ``__main__`` block not run)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
