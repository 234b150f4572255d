"""Tests of gn_patch.bench: the CPU-testable parts (shape collection, byte model, result files, report rendering,
the txt2img pipeline wiring) and, on a GPU, a smoke run of the kernel table."""

import json
from collections import Counter

import pytest
import torch
from diffusers import AutoencoderKL, UNet2DConditionModel

from gn_patch import GroupNormAct, bench, configs

E5, E6 = 1e-5, 1e-6


def tiny(cls, config):
    torch.manual_seed(0)
    return cls(**config).eval()


# ------------------------------------------------------------------------------------------------
# Shape collection
# ------------------------------------------------------------------------------------------------
def test_hooks_see_every_group_norm_of_a_tiny_unet():
    unet = tiny(UNet2DConditionModel, configs.TINY_SD15_UNET)
    calls = bench.collect_group_norm_calls(unet, bench.unet_call(unet, 2, 16, torch.float32, "cpu"))
    # Worked out from the architecture: 32 channels at 16², 64 at 8²; the up blocks concatenate skips
    # (64+64, 64+32 at 8²; 64+32, 32+32 at 16²); Transformer2DModel norms use eps 1e-6.
    expected = Counter({
        ((2, 32, 16, 16), E5): 5,   # down 0 resnet norm1+norm2, up 1 resnet norm2 x2, conv_norm_out
        ((2, 32, 16, 16), E6): 3,   # down 0 attention, up 1 attentions x2
        ((2, 32, 8, 8), E5): 1,     # down 1 resnet norm1
        ((2, 64, 8, 8), E5): 7,     # down 1 norm2, mid resnets x2 (norm1+norm2), up 0 norm2 x2
        ((2, 64, 8, 8), E6): 1,     # mid attention
        ((2, 128, 8, 8), E5): 1,    # up 0 resnet 0 norm1
        ((2, 96, 8, 8), E5): 1,     # up 0 resnet 1 norm1
        ((2, 96, 16, 16), E5): 1,   # up 1 resnet 0 norm1
        ((2, 64, 16, 16), E5): 1,   # up 1 resnet 1 norm1
    })
    assert Counter((c.shape, c.eps) for c in calls) == expected
    assert {c.num_groups for c in calls} == {8}
    assert "up_blocks.*.resnets.*.norm1" in {c.site for c in calls} and "conv_norm_out" in {c.site for c in calls}
    assert all(not m._forward_pre_hooks for m in unet.modules()), "hooks must be removed after the call"


def test_hooks_are_removed_when_the_call_fails():
    unet = tiny(UNet2DConditionModel, configs.TINY_SD15_UNET)

    def failing_call():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        bench.collect_group_norm_calls(unet, failing_call)
    assert all(not m._forward_pre_hooks for m in unet.modules())


def test_vae_decode_includes_the_3d_attention_norm():
    vae = tiny(AutoencoderKL, configs.TINY_VAE)
    calls = bench.collect_group_norm_calls(vae, bench.vae_decode_call(vae, 16, torch.float32, "cpu"))
    assert all(c.site.startswith("decoder.") for c in calls), "decode must not run the encoder"
    attention = [c for c in calls if c.site == "decoder.mid_block.attentions.*.group_norm"]
    assert [c.shape for c in attention] == [(1, 32, 16 * 16)]
    assert ((1, 16, 32, 32), 8, E6) in {(c.shape, c.num_groups, c.eps) for c in calls}  # conv_norm_out at 32²


def test_sdxl_shapes_come_from_a_meta_device_call():
    source = next(s for s in bench.SHAPE_SOURCES if s.name == "sdxl_unet_1024_b2")
    assert source.device == "meta"
    calls = bench.source_calls(source, cache=None)
    shapes = Counter(c.shape for c in calls)
    assert len(calls) == 46
    assert shapes[(2, 320, 128, 128)] == 8 and shapes[(2, 1280, 32, 32)] == 16


def test_sdxl_inputs_carry_text_and_time_conditioning():
    unet = bench.build_model("sdxl_unet", "meta", torch.float16)
    (sample, timestep), kwargs = bench.unet_inputs(unet.config, 2, 128, torch.float16, "meta")
    assert sample.shape == (2, 4, 128, 128) and timestep.dim() == 0
    assert kwargs["encoder_hidden_states"].shape == (2, 77, 2048)
    assert kwargs["added_cond_kwargs"]["text_embeds"].shape == (2, 1280)
    assert kwargs["added_cond_kwargs"]["time_ids"].shape == (2, 6)


def test_distinct_shapes_merge_sources_and_eps():
    call = bench.GroupNormCall
    shapes = bench.distinct_shapes({
        "a": [call((2, 64, 8, 8), 32, E5, "x.norm1"), call((2, 64, 8, 8), 32, E6, "x.norm"),
              call((2, 64, 8, 8), 32, E5, "x.norm1"), call((1, 64, 4096), 32, E6, "attn")],
        "b": [call((2, 64, 8, 8), 32, E5, "y.norm2"), call((2, 64, 8, 8), 16, E5, "z")],
    })
    assert [(s.shape, s.num_groups) for s in shapes] == [((2, 64, 8, 8), 32), ((1, 64, 4096), 32),
                                                         ((2, 64, 8, 8), 16)]
    first = shapes[0]
    assert first.eps == E5 and first.eps_seen == (E6, E5)
    assert first.calls == {"a": 3, "b": 1}
    assert first.sites == ("x.norm1", "x.norm", "y.norm2")
    assert bench.static_compile_shapes(shapes) == set()  # neither source is a static-compile source


def test_static_compile_picks_the_top_traffic_shape_per_source():
    shape = bench.KernelShape
    shapes = [shape((2, 320, 64, 64), 32, E5, (E5,), {"sd15_unet_512_b2": 13}),
              shape((2, 1280, 8, 8), 32, E5, (E5,), {"sd15_unet_512_b2": 12}),
              shape((1, 128, 512, 512), 32, E6, (E6,), {"vae_decode_512": 6}),
              shape((1, 512, 64, 64), 32, E6, (E6,), {"vae_decode_512": 10})]
    assert bench.static_compile_shapes(shapes) == {((2, 320, 64, 64), 32), ((1, 128, 512, 512), 32)}


# ------------------------------------------------------------------------------------------------
# Byte model, rotation
# ------------------------------------------------------------------------------------------------
def test_byte_model():
    numel = 2 * 320 * 64 * 64
    assert bench.bytes_moved(numel, 2, "fwd") == 2 * numel * 2          # read x, write y
    assert bench.bytes_moved(numel, 2, "fwd+bwd") == 5 * numel * 2      # + read x, read dy, write dx
    assert bench.bytes_moved(numel, 4, "fwd") == 2 * bench.bytes_moved(numel, 2, "fwd")
    with pytest.raises(KeyError):
        bench.bytes_moved(numel, 2, "bwd")


def test_rotation_covers_twice_l2():
    l2 = 60 * 2**20
    assert bench.rotation_sets(2**20, l2) == 120
    assert bench.rotation_sets(7 * 2**20, l2) == 18          # 18 x 7 MiB = 126 MiB >= 120 MiB
    assert bench.rotation_sets(120 * 2**20, l2) == 1
    assert bench.rotation_sets(512 * 2**20, l2) == 1


# ------------------------------------------------------------------------------------------------
# Rows and result files
# ------------------------------------------------------------------------------------------------
KERNEL_KEYS = {"shape", "dtype", "pass", "copy_us", "gn_patch_us", "torch_nchw_us", "torch_cl_us", "compile_cl_us",
               "source", "gn_patch_wall_us", "gbps", "ratio_to_copy", "num_groups", "eps", "bytes", "errors"}


def kernel_row(**gpu_us):
    ks = bench.KernelShape((2, 320, 64, 64), 32, E5, (E6, E5), {"sd15_unet_512_b2": 13, "sdxl_unet_1024_b2": 1})
    times = bench.CellTimes(gpu_us=gpu_us, wall_us={"gn_patch": 9.0}, timing={k: "graph" for k in gpu_us},
                            errors={"compile_cl": "not run (--quick)"})
    return bench.kernel_row(ks, "float16", "fwd", 2, 24, True, times)


def test_kernel_row_schema_and_derived_values():
    row = kernel_row(copy=4.0, gn_patch=5.0, torch_nchw=20.0, torch_cl=25.0)
    assert KERNEL_KEYS <= row.keys()
    assert row["shape"] == [2, 320, 64, 64] and row["source"] == "sd15_unet_512_b2,sdxl_unet_1024_b2"
    assert row["bytes"] == 2 * 2 * 320 * 64 * 64 * 2
    assert row["gbps"] == pytest.approx(row["bytes"] / 5.0 / 1e3, rel=1e-3)   # bytes per µs -> GB/s
    assert row["ratio_to_copy"] == 1.25
    assert row["speedup_vs_torch_nchw"] == 4.0 and row["speedup_vs_torch_cl"] == 5.0
    assert row["compile_cl_us"] is None and row["speedup_vs_compile_cl"] is None
    assert row["errors"] == {"compile_cl": "not run (--quick)"}
    assert row["gn_patch_wall_us"] == 9.0 and row["torch_nchw_wall_us"] is None


def test_kernel_row_without_gn_patch_time_has_no_derived_values():
    row = kernel_row(copy=4.0, torch_nchw=20.0)
    assert row["gn_patch_us"] is None and row["gbps"] is None and row["ratio_to_copy"] is None
    assert row["speedup_vs_torch_nchw"] is None


def test_result_file_is_valid_json_after_every_row(tmp_path, monkeypatch):
    monkeypatch.setenv("GN_PATCH_COMMIT", "abc123")
    metadata = bench.run_metadata(quick=True, argv=["--quick"])
    assert {"commit", "gpu", "torch", "diffusers", "date", "quick"} <= metadata.keys()
    assert metadata["commit"] == "abc123" and metadata["quick"] is True
    path = tmp_path / "sub" / "kernels.json"
    writer = bench.ResultFile(path, metadata)
    assert json.loads(path.read_text()) == {"metadata": metadata, "rows": []}
    writer.add(kernel_row(copy=4.0, gn_patch=5.0))
    writer.add(kernel_row(copy=4.0, gn_patch=6.0))
    writer.update_metadata(section_s=1.5)
    doc = json.loads(path.read_text())
    assert [r["gn_patch_us"] for r in doc["rows"]] == [5.0, 6.0]
    assert doc["metadata"]["section_s"] == 1.5 and doc["metadata"]["commit"] == "abc123"
    assert not list(path.parent.glob("*.tmp"))


def test_describe_error_is_one_bounded_line():
    text = bench.describe_error(RuntimeError("CUDA out of memory.\n" + "x" * 1000))
    assert text.startswith("RuntimeError: CUDA out of memory. x") and "\n" not in text and len(text) < 450


# ------------------------------------------------------------------------------------------------
# End-to-end bookkeeping and pipeline wiring
# ------------------------------------------------------------------------------------------------
def test_every_config_compiles_in_the_full_run():
    by_name = {c.name: c for c in bench.E2E_CONFIGS}
    assert {n for n, c in by_name.items() if c.compile == "reuse"} == {"sd15_txt2img_512_30steps"}
    assert set(bench.COMPILE_TARGETS) == set(bench.E2E_GROUPS)
    for name, config in by_name.items():
        for variant in bench.VARIANTS:
            assert bench.not_run_reason(config, variant, bench.FULL) is None, name
            quick = bench.not_run_reason(config, variant, bench.QUICK)
            assert (quick is None) == (not variant.endswith("+compile")), name
    # The pipeline reuses the decoder compiled at 512², so the 1024² decode (a recompile) comes after it.
    names = list(by_name)
    assert names.index("sd15_txt2img_512_30steps") < names.index("vae_decode_1024")
    assert set(bench.FULL.e2e_runs) == set(by_name) == set(bench.QUICK.e2e_runs)
    assert not bench.QUICK.compile_dtypes and bench.FULL.compile_dtypes == ("float16",)
    assert {n for n, c in by_name.items() if not c.graphable} == {"sd15_txt2img_512_30steps", "sd15_train_512_b8"}
    assert set(bench.VARIANTS) == set(bench.VARIANT_ORDER)


def test_e2e_groups_add_up_to_one_table(tmp_path):
    path = tmp_path / "e2e.json"
    assert bench.previous_e2e_rows(path, "abc", ("sd15",)) == ([], {})
    rows = [bench.e2e_row(c, "patched", wall_ms=1.0) for c in bench.E2E_CONFIGS]
    reports = {"sd15": {"unet": {"fused": 61}}, "sdxl": {"unet": {"fused": 46}}}
    bench.ResultFile(path, {"commit": "abc", "patch_reports": reports}, rows)
    kept, kept_reports = bench.previous_e2e_rows(path, "abc", ("sdxl", "train"))
    assert {r["config"] for r in kept} == {c.name for c in bench.E2E_CONFIGS if c.group == "sd15"}
    assert kept_reports == {"sd15": {"unet": {"fused": 61}}}
    with pytest.raises(ValueError, match="commit abc, not def"):
        bench.previous_e2e_rows(path, "def", ("sdxl",))
    assert bench.parse_e2e_groups("sdxl, train") == ("sdxl", "train")
    with pytest.raises(bench.argparse.ArgumentTypeError, match="unknown group"):
        bench.parse_e2e_groups("sd3")


def test_txt2img_pipeline_runs_from_prompt_embeddings_on_tiny_models():
    unet = tiny(UNet2DConditionModel, configs.TINY_SD15_UNET)
    vae = tiny(AutoencoderKL, configs.TINY_VAE)
    pipe = bench.build_txt2img_pipeline(unet, vae)
    assert pipe.text_encoder is None and pipe.tokenizer is None
    images = bench.txt2img_call(pipe, size=32, steps=2, device="cpu", dtype=torch.float32)()
    assert images.shape == (1, 3, 32, 32)


def test_variants_convert_the_models_in_place():
    vae = tiny(AutoencoderKL, configs.TINY_VAE)
    models = bench.SimpleNamespace(vae=vae)
    assert bench.enter_variant("stock_nchw", models, kernels_ok=True) == {}
    assert not vae.decoder.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    assert bench.enter_variant("stock_cl", models, kernels_ok=True) == {}
    assert vae.decoder.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    with pytest.raises(RuntimeError, match="kernels unavailable"):
        bench.enter_variant("patched", models, kernels_ok=False)
    report = bench.enter_variant("patched", models, kernels_ok=True)
    assert models.vae is vae and report["vae"]["fused"] > 0
    assert any(isinstance(m, GroupNormAct) for m in vae.modules())


def test_compiled_modules_swaps_and_restores(monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda module: ("compiled", module))
    decoder, unet = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    models = bench.SimpleNamespace(unet=unet, vae=bench.SimpleNamespace(decoder=decoder))
    with bench.compiled_modules(models, ("unet", "vae.decoder")):
        assert models.unet == ("compiled", unet) and models.vae.decoder == ("compiled", decoder)
    assert models.unet is unet and models.vae.decoder is decoder


# ------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------
def sample_docs():
    metadata = {"commit": "abc123", "gpu": "NVIDIA H200", "torch": "2.11", "cuda": "12.8", "diffusers": "0.42.1",
                "triton": "3.5", "date": "2026-01-01T00:00:00+00:00", "quick": False, "command": "python -m x"}
    kernels = {"metadata": {**metadata, "notes": {"byte_model": "fwd 2|x|"}},
               "rows": [kernel_row(copy=4.0, gn_patch=5.0, torch_nchw=20.0, torch_cl=25.0),
                        {**kernel_row(copy=4.0, gn_patch=5.0, torch_nchw=20.0, torch_cl=25.0), "pass": "fwd+bwd"}]}
    config = bench.E2E_CONFIGS[0]
    e2e = {"metadata": {**metadata, "variants": bench.VARIANT_NOTES, "configs": {config.name: "UNet call"}},
           "rows": [bench.e2e_row(config, "stock_nchw", wall_ms=30.0, gpu_ms=29.0, peak_mb=2000.0),
                    bench.e2e_row(config, "stock_cl", wall_ms=24.0, gpu_ms=23.5, peak_mb=2000.0),
                    bench.e2e_row(config, "patched", wall_ms=20.0, gpu_ms=19.5, peak_mb=1900.0, graph_ms=10.0),
                    bench.e2e_row(config, "stock_cl+compile", not_run="--quick skips torch.compile"),
                    bench.e2e_row(config, "patched+compile", error="RuntimeError: boom")]}
    cpu = {"metadata": {**metadata, "shape": [2, 1280, 8, 8], "dtype": "float16", "grad_mode": "torch.no_grad()",
                        "notes": "host cost"},
           "rows": [{"method": "gn_patch.group_norm_act", "us_per_call": 7.5, "us_per_call_min": 7.1},
                    {"method": "torch", "us_per_call": None, "us_per_call_min": None, "error": "RuntimeError: x"}]}
    return kernels, e2e, cpu


def test_summary_markdown_has_every_table():
    kernels, e2e, cpu = sample_docs()
    text = bench.render_summary(kernels, e2e, cpu)
    assert text.startswith("# gn_patch benchmark: NVIDIA H200")
    assert "commit abc123" in text and "quick False" in text
    assert "### float16, fwd" in text and "### float16, fwd+bwd" in text and "bfloat16" not in text
    assert "| 2x320x64x64 | 32 | sd15_unet_512_b2,sdxl_unet_1024_b2 | 4.0 | 5.0 | 20.0 | 25.0 |" in text
    assert "4.00x" in text and "5.00x" in text and "1.25" in text
    assert "- 2x320x64x64 float16 fwd compile_cl: not run (--quick)" in text
    assert "| sd15_unet_512_b2 | 30.0 / 29.0 ms, 2000 MB | 24.0 / 23.5 ms, 2000 MB | 20.0 / 19.5 / 10.0 ms, 1900 MB " \
           "| not run | error | 1.20x | – |" in text
    assert "sd15_unet_512_b2 / patched+compile: RuntimeError: boom" in text
    assert "| gn_patch.group_norm_act | 7.5 | 7.1 |  |" in text
    assert text.count("|---|") >= 5


def test_model_totals_sum_calls_times_time():
    kernels, _, _ = sample_docs()
    totals = {(t["source"], t["pass"]): t for t in bench.model_totals(kernels["rows"])}
    total = totals[("sd15_unet_512_b2", "fwd")]
    assert total["calls"] == 13
    assert total["gn_patch"] == pytest.approx(13 * 5.0 / 1e3) and total["torch_cl"] == pytest.approx(13 * 25.0 / 1e3)
    assert total["compile_cl"] is None
    assert totals[("sdxl_unet_1024_b2", "fwd")]["calls"] == 1


def test_summary_renders_partial_results():
    kernels, _, _ = sample_docs()
    text = bench.render_summary(kernels, None, None)
    assert "## Kernel table" in text and "## End to end" not in text
    assert bench.render_summary(None, None, None).startswith("# gn_patch benchmark")


def test_report_only_writes_summary_and_plots(tmp_path, capsys):
    for name, doc in zip(("kernels.json", "e2e.json", "cpu_overhead.json"), sample_docs()):
        (tmp_path / name).write_text(json.dumps(doc))
    assert bench.main(["--report-only", "--out", str(tmp_path)]) == 0
    assert "## End to end" in (tmp_path / "summary.md").read_text()
    pytest.importorskip("matplotlib")
    for plot in ("kernel_speedup.png", "e2e.png"):
        assert (tmp_path / plot).read_bytes().startswith(b"\x89PNG")


def test_only_rejects_unknown_sections():
    assert bench.parse_args(["--only", "cpu,kernels"]).only == ("cpu", "kernels")
    assert bench.parse_args([]).only == bench.SECTIONS
    with pytest.raises(SystemExit):
        bench.parse_args(["--only", "kernels,gpu"])


# ------------------------------------------------------------------------------------------------
# GPU smoke run
# ------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_quick_kernel_table_on_two_shapes(tmp_path):
    assert bench.main(["--quick", "--only", "kernels", "--max-shapes", "2", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "kernels.json").read_text())
    assert doc["metadata"]["quick"] is True and doc["metadata"]["gpu"]
    rows = doc["rows"]
    assert len(rows) == 2 * len(bench.DTYPES) * len(bench.PASSES)
    for row in rows:
        assert not row["errors"], row["errors"]
        assert row["compile_cl_us"] is None  # --quick compiles nothing
        for key in ("copy_us", "gn_patch_us", "torch_nchw_us", "torch_cl_us"):
            assert row[key] > 0, (key, row)
        assert row["gbps"] > 0 and row["ratio_to_copy"] > 0
    assert (tmp_path / "summary.md").exists()
