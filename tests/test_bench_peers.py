"""Tests of the benchmark's peers section (gn_patch/bench/peers.py, peers_table.py): row assembly, the choice of the
best peer, a peer whose output is wrong, missing peers, loading a peer from a folder, the report; on the CPU with
the timers replaced, and on a GPU a one-shape run with no peer present."""

import json
import sys

import pytest
import torch

from gn_patch.bench import cli, peers, peers_table, report
from gn_patch.bench.peers_table import PeerMeasurement

PROVENANCE = {"commit": "abc123", "gpu": "NVIDIA H200", "date": "2026-12-01T00:00:00+00:00"}


def measured(**us) -> PeerMeasurement:
    """us: method_pass=µs, e.g. gn_patch_fwd=10.0, apex_fwd_bwd=20.0."""
    result = PeerMeasurement()
    for key, value in us.items():
        method, pass_ = key.rsplit("_fwd", 1)
        result.us[(method, "fwd" + pass_)] = value
    return result


def test_best_peer_is_the_fastest_correct_candidate_torch_included():
    m = measured(gn_patch_fwd=10.0, gn_patch_fwd_bwd=30.0, torch_fwd=25.0, torch_fwd_bwd=50.0, apex_fwd=4.0,
                 apex_fwd_bwd=60.0, gnnhwc_fwd=12.0, gnnhwc_fwd_bwd=40.0, sfast_fwd=2.0)
    m.wrong.add("sfast")
    m.max_err.update(gn_patch=0.002, torch=0.001, apex=0.003, gnnhwc=0.002, sfast=1.35)
    row = peers_table.peer_row((2, 1280, 8, 8), "float16", "graph", m, PROVENANCE)
    assert row["shape"] == [2, 1280, 8, 8] and row["dtype"] == "float16" and row["timing"] == "graph"
    assert row["mb"] == 0.33 and row["commit"] == "abc123"
    assert (row["best_peer_fwd"], row["best_peer_fwd_us"]) == ("apex", 4.0)      # sfast is faster but wrong
    assert (row["best_peer_fwd_bwd"], row["best_peer_fwd_bwd_us"]) == ("gnnhwc", 40.0)
    assert row["ratio_fwd"] == 0.4 and row["ratio_fwd_bwd"] == pytest.approx(1.333)  # best peer / gn_patch
    assert row["torch_ratio_fwd_bwd"] == pytest.approx(1.667)
    assert row["sfast_fwd_bwd_us"] is None and row["sfast_max_err"] == 1.35 and row["wrong"] == ["sfast"]
    required = {"shape", "dtype", "timing", "mb", "gn_patch_fwd_us", "gn_patch_fwd_bwd_us", "torch_fwd_us",
                "torch_fwd_bwd_us", "best_peer_fwd_us", "best_peer_fwd_bwd_us", "best_peer_fwd", "best_peer_fwd_bwd",
                "commit"}
    assert required <= row.keys()
    json.dumps(row, allow_nan=False)


def test_a_peers_only_summary_names_torch_and_prints_no_none():
    m = measured(gn_patch_fwd=10.0, gn_patch_fwd_bwd=30.0, torch_fwd=25.0, torch_fwd_bwd=50.0)
    row = peers_table.peer_row((2, 1280, 8, 8), "float16", "graph", m,
                               {**PROVENANCE, "torch_version": "2.11.0+cu130", "triton": "3.6.0"})
    header = report.render_summary(None, None, None, [row]).split("## ")[0]
    assert "commit abc123, torch 2.11.0+cu130, triton 3.6.0" in header
    assert "None" not in header and "``" not in header


def test_no_candidate_leaves_best_peer_empty():
    row = peers_table.peer_row((1, 64, 4, 4), "bfloat16", "do_bench", measured(gn_patch_fwd=3.0), PROVENANCE)
    assert row["best_peer_fwd"] is None and row["best_peer_fwd_us"] is None and row["ratio_fwd"] is None


def test_output_error_against_the_tolerance():
    ref = torch.linspace(-3, 3, 1000)
    assert peers.output_error(ref.half(), ref, "float16") == (pytest.approx(1e-3, abs=5e-4), True)  # rounding
    largest, within = peers.output_error((ref + 0.5).half(), ref, "float16")
    assert largest == pytest.approx(0.5, abs=1e-3) and not within
    assert peers.output_error((ref + 0.05).bfloat16(), ref, "bfloat16")[1]  # 0.05 is within bf16's 6e-2
    poisoned = ref.clone()
    poisoned[3] = float("nan")
    assert peers.output_error(poisoned, ref, "float16") == (None, False)


def test_missing_peers_are_reported_and_nothing_is_built(tmp_path, monkeypatch):
    monkeypatch.setattr(peers.subprocess, "Popen", lambda *a, **k: pytest.fail("no build without a peer"))
    entries = peers.load_peers(tmp_path / "nowhere", tmp_path / "build")
    assert set(entries) == {"gnnhwc", "apex", "sfast"}
    assert all(isinstance(e, str) and e.startswith("FileNotFoundError: no ") for e in entries.values())


def test_a_failed_build_is_reported_once_not_retried(tmp_path, monkeypatch):
    """gnnhwc compiles on import: its build runs in a subprocess, and its failure is the peer's error."""
    (tmp_path / "gnnhwc").mkdir()
    (tmp_path / "gnnhwc" / "__init__.py").write_text("raise RuntimeError('nvcc fatal: unsupported gpu')\n")
    loaded = []
    monkeypatch.setattr(peers, "load_peer", lambda name, *args: loaded.append(name))
    entries = peers.load_peers(tmp_path, tmp_path / "build")
    assert entries["gnnhwc"].startswith("build failed (exit 1; ") and "nvcc fatal: unsupported gpu" in entries["gnnhwc"]
    assert (tmp_path / "build" / "gnnhwc.log").exists()
    assert loaded == ["apex", "sfast"]  # the failed build is not tried again in this process
    assert "FileNotFoundError" not in entries["gnnhwc"]


@pytest.fixture
def fake_sfast(tmp_path, monkeypatch):
    """DIR/sfast holding a group_norm_silu_forward that adds 1 to PyTorch's result (a wrong peer)."""
    ops = tmp_path / "sfast" / "triton" / "ops"
    ops.mkdir(parents=True)
    for package in (tmp_path / "sfast", tmp_path / "sfast" / "triton", ops):
        (package / "__init__.py").write_text("")
    (ops / "group_norm.py").write_text(
        "import torch.nn.functional as F\n"
        "def group_norm_silu_forward(x, groups, weight, bias, eps):\n"
        "    y = F.silu(F.group_norm(x.float(), groups, weight.float(), bias.float(), eps)) + 1\n"
        "    return y.to(x.dtype), None, None\n")
    yield tmp_path
    for name in [n for n in sys.modules if n == "sfast" or n.startswith("sfast.")]:
        monkeypatch.delitem(sys.modules, name)


def test_a_peer_loads_from_the_folder_given(fake_sfast):
    path = list(sys.path)
    forward = peers.load_peer("sfast", fake_sfast, fake_sfast / "build")
    assert forward.__module__ == "sfast.triton.ops.group_norm" and sys.path == path


def cpu_timers(monkeypatch):
    """Run the measuring on the CPU: timers that call once and return a fixed µs per method."""
    monkeypatch.setattr(peers, "DEVICE", "cpu")
    counter = iter(range(1, 10_000))
    monkeypatch.setattr(peers, "TIMERS", {timing: lambda call: call() is not None and float(next(counter))
                                          for timing in peer_timings()})


def peer_timings():
    return peers_table.TIMINGS


def test_measure_cell_times_every_method_and_flags_the_wrong_one(fake_sfast, monkeypatch):
    cpu_timers(monkeypatch)
    entries = {"gn_patch": None, "torch": None, "sfast": peers.load_peer("sfast", fake_sfast, fake_sfast / "b"),
               "apex": "FileNotFoundError: no apex_gn", "gnnhwc": "FileNotFoundError: no gnnhwc"}
    results = peers.measure_cell((1, 64, 4, 4), "bfloat16", entries, ("graph", "do_bench"))
    for measured_cell in results.values():
        assert set(measured_cell.us) == {("gn_patch", "fwd"), ("gn_patch", "fwd_bwd"), ("torch", "fwd"),
                                         ("torch", "fwd_bwd"), ("sfast", "fwd")}
        assert measured_cell.wrong == {"sfast"} and measured_cell.max_err["sfast"] == pytest.approx(1.0, abs=0.05)
        assert measured_cell.max_err["gn_patch"] < 0.05
        assert measured_cell.errors == {"apex": "FileNotFoundError: no apex_gn",
                                        "gnnhwc": "FileNotFoundError: no gnnhwc"}


def test_a_failing_peer_is_recorded_and_skipped(monkeypatch):
    cpu_timers(monkeypatch)

    def broken(x, groups, weight, bias, eps):
        raise RuntimeError("unsupported channels")

    results = peers.measure_cell((1, 64, 4, 4), "float16", {"torch": None, "sfast": broken}, ("graph",))
    assert results["graph"].errors == {"sfast": "RuntimeError: unsupported channels"}
    assert ("torch", "fwd") in results["graph"].us


def test_run_peers_writes_rows_and_the_report_redraws_them(fake_sfast, monkeypatch, tmp_path):
    cpu_timers(monkeypatch)
    monkeypatch.setattr(peers, "load_peers", lambda directory, build_dir: {
        "gnnhwc": "FileNotFoundError: no gnnhwc", "apex": "FileNotFoundError: no apex_gn",
        "sfast": peers.load_peer("sfast", directory, build_dir)})
    out = tmp_path / "out"
    metadata = {"commit": "abc123", "gpu": None, "date": "2026-12-01"}
    peers.run_peers(out, metadata, True, fake_sfast, tmp_path / "build", shapes=((1, 64, 4, 4), (2, 32, 8, 8)))
    rows = json.loads((out / "peers.json").read_text())
    assert isinstance(rows, list) and len(rows) == 2 * 2 * 2
    assert [(r["shape"], r["dtype"], r["timing"]) for r in rows[:4]] == [
        ([1, 64, 4, 4], "float16", "graph"), ([1, 64, 4, 4], "float16", "do_bench"),
        ([1, 64, 4, 4], "bfloat16", "graph"), ([1, 64, 4, 4], "bfloat16", "do_bench")]
    assert all(r["best_peer_fwd"] == "torch" and r["commit"] == "abc123" for r in rows)
    assert cli.main(["--report-only", "--out", str(out)]) == 0
    text = (out / "summary.md").read_text()
    assert text.startswith("# gn_patch benchmark\n") and "## gn_patch against the peer kernels" in text
    assert "### graph, float16" in text and "### do_bench, bfloat16" in text
    assert "- sfast float16 1x64x4x4: output outside tolerance, max error 1.0" in text
    assert "- apex not measured (every cell): FileNotFoundError: no apex_gn" in text


def test_peers_tables():
    m = measured(gn_patch_fwd=10.0, gn_patch_fwd_bwd=30.0, torch_fwd=25.0, torch_fwd_bwd=50.0, apex_fwd=4.0)
    m.errors["gnnhwc"] = "FileNotFoundError: no gnnhwc"
    rows = [peers_table.peer_row((2, 320, 64, 64), "float16", t, m, PROVENANCE) for t in peers_table.TIMINGS]
    text = peers_table.render_peers(rows)
    assert "_commit abc123, gpu NVIDIA H200, date 2026-12-01T00:00:00+00:00_" in text
    assert ("| 2x320x64x64 | 5.24 | 10.0 | 4.0 apex | 0.40x | 30.0 | 50.0 torch | 1.67x | 50.0 | 1.67x |"
            in text)
    assert "| shape | gn_patch fwd | torch fwd | apex fwd | gn_patch fwd+bwd | torch fwd+bwd |" in text
    assert "- gnnhwc not measured (every cell): FileNotFoundError: no gnnhwc" in text
    assert "peers, do_bench, float16" in peers_table.headlines(rows)


@pytest.mark.gpu
def test_peers_section_without_peers_times_gn_patch_and_torch(tmp_path):
    """One shape, both dtypes and timings, from a folder without peers: each peer is reported missing."""
    status = cli.main(["--only", "peers", "--peers", str(tmp_path / "none"), "--max-shapes", "1",
                       "--out", str(tmp_path / "out")])
    assert status == 0
    rows = json.loads((tmp_path / "out" / "peers.json").read_text())
    assert len(rows) == 4
    for row in rows:
        for key in ("gn_patch_fwd_us", "gn_patch_fwd_bwd_us", "torch_fwd_us", "torch_fwd_bwd_us"):
            assert row[key] > 0, (key, row)
        # one rounding of outputs up to ~20 (3 randn + 1, normalized, times randn weights): bf16's half-ulp is 0.06
        assert row["wrong"] == [] and row["gn_patch_max_err"] < {"float16": 0.02, "bfloat16": 0.13}[row["dtype"]]
        assert row["best_peer_fwd"] == "torch" and set(row["errors"]) == {"gnnhwc", "apex", "sfast"}
