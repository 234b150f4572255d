"""Result files (JSON rewritten after every row, with the run's metadata on top) and the helpers every section
shares: the commit under test, error capture, progress bars."""

from __future__ import annotations

import datetime
import gc
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from tqdm import tqdm

T = TypeVar("T")
REPO_ROOT = Path(__file__).resolve().parents[2]


def commit_id(directory: Path = REPO_ROOT) -> str:
    """The commit under test: $GN_PATCH_COMMIT (set where the tree is a copy without .git, as on the device
    machine), else git's HEAD of the repository holding ``directory``, else 'unknown'."""
    if os.environ.get("GN_PATCH_COMMIT"):
        return os.environ["GN_PATCH_COMMIT"]
    try:
        result = subprocess.run(["git", "rev-parse", "HEAD"], cwd=directory, capture_output=True, text=True,
                                timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return result.stdout.strip() if result.returncode == 0 else "unknown"


def package_version(name: str) -> str | None:
    """``name.__version__``, or None where the package is not installed."""
    try:
        return __import__(name).__version__
    except ImportError:
        return None


def run_metadata(quick: bool, argv: list[str]) -> dict:
    """The keys every JSON file starts with: what was measured (commit, command), where (GPU, SM count, L2 size
    in bytes, library versions) and when (UTC date)."""
    cuda = torch.cuda.is_available()
    props = torch.cuda.get_device_properties(0) if cuda else None
    return {
        "commit": commit_id(),
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "sms": props.multi_processor_count if props else None,
        "l2_bytes": getattr(props, "L2_cache_size", None),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "diffusers": package_version("diffusers"),
        "triton": package_version("triton"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "quick": quick,
        "command": " ".join(["python -m gn_patch.bench", *argv]),
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
    }


class ResultFile:
    """One JSON document ``{"metadata": {...}, "rows": [...]}`` at ``path``, rewritten atomically after every
    change, so that a run cut short leaves valid JSON with what it measured. ``rows`` are kept from an earlier run
    (see e2e.previous_e2e_rows)."""

    def __init__(self, path: Path, metadata: dict, rows: list[dict] | None = None):
        self.path = path
        self.doc = {"metadata": dict(metadata), "rows": list(rows or [])}
        path.parent.mkdir(parents=True, exist_ok=True)
        self._flush()

    def add(self, row: dict) -> None:
        """Append one row and rewrite the file."""
        self.doc["rows"].append(row)
        self._flush()

    def update_metadata(self, **entries: Any) -> None:
        """Add or replace metadata keys and rewrite the file."""
        self.doc["metadata"].update(entries)
        self._flush()

    def _flush(self) -> None:
        write_json(self.path, self.doc)


class RowsFile:
    """A JSON list of rows at ``path`` (peers.json's layout), rewritten atomically after every row."""

    def __init__(self, path: Path):
        self.path, self.rows = path, []
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, self.rows)

    def add(self, row: dict) -> None:
        """Append one row and rewrite the file."""
        self.rows.append(row)
        write_json(self.path, self.rows)


def write_json(path: Path, value: Any) -> None:
    """``value`` as JSON at ``path``, replacing the file at once (a reader never sees half of it). Raises
    ValueError for NaN or infinity, which JSON cannot hold."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1, allow_nan=False) + "\n")
    os.replace(tmp, path)


def load_result(path: Path) -> Any:
    """The content of a result file (a document, or peers.json's list), or None where it does not exist."""
    return json.loads(path.read_text()) if path.exists() else None


def rounded(value: float | None, digits: int = 3) -> float | None:
    """round(value, digits), None kept."""
    return None if value is None else round(value, digits)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator to 3 decimals; None where either is missing or zero."""
    return None if not numerator or not denominator else round(numerator / denominator, 3)


def describe_error(exc: BaseException) -> str:
    """One line for the JSON: the exception's type and the start of its message."""
    message = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {message[:400]}" if message else type(exc).__name__


def attempt(action: Callable[[], T]) -> tuple[T | None, str | None]:
    """``(action(), None)``, or ``(None, describe_error(exc))`` when it raises.

    The benchmark's one way to survive a failure: a cell, a model or a peer that fails is recorded with its
    error and the run goes on with the next one.
    """
    try:
        return action(), None
    except Exception as exc:  # noqa: BLE001 - whatever fails is recorded, never lost and never fatal
        return None, describe_error(exc)


def progress_bar(iterable=None, **kwargs) -> tqdm:
    """tqdm, updating rarely when stderr is not a terminal (a log then gets a few lines, not thousands)."""
    return tqdm(iterable, dynamic_ncols=True, mininterval=0.5 if sys.stderr.isatty() else 15.0, **kwargs)


def free_memory() -> None:
    """Collect garbage and return cached CUDA blocks: between measurements that must not share memory."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
