"""Tests of gn_patch.bench: the CPU-testable parts (shape collection, byte model, result files, report rendering,
the txt2img pipeline wiring) and, on a GPU, a smoke run of the kernel table. The peers section: test_bench_peers.py."""

import argparse
import json
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from diffusers import AutoencoderKL, UNet2DConditionModel

from gn_patch import GroupNormAct, configs
from gn_patch.bench import cli, e2e, kernels, models, report, results, settings

from .scripts import load_script

E5, E6 = 1e-5, 1e-6
ROOT = Path(__file__).resolve().parents[1]


def tiny(cls, config):
    torch.manual_seed(0)
    return cls(**config).eval()


# ------------------------------------------------------------------------------------------------
# Shape collection
# ------------------------------------------------------------------------------------------------
def test_hooks_see_every_group_norm_of_a_tiny_unet():
    unet = tiny(UNet2DConditionModel, configs.TINY_SD15_UNET)
    calls = models.collect_group_norm_calls(unet, models.unet_call(unet, 2, 16, torch.float32, "cpu"))
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
        models.collect_group_norm_calls(unet, failing_call)
    assert all(not m._forward_pre_hooks for m in unet.modules())


def test_vae_decode_includes_the_3d_attention_norm():
    vae = tiny(AutoencoderKL, configs.TINY_VAE)
    calls = models.collect_group_norm_calls(vae, models.vae_decode_call(vae, 16, torch.float32, "cpu"))
    assert all(c.site.startswith("decoder.") for c in calls), "decode must not run the encoder"
    attention = [c for c in calls if c.site == "decoder.mid_block.attentions.*.group_norm"]
    assert [c.shape for c in attention] == [(1, 32, 16 * 16)]
    assert ((1, 16, 32, 32), 8, E6) in {(c.shape, c.num_groups, c.eps) for c in calls}  # conv_norm_out at 32²


def test_sdxl_shapes_come_from_a_meta_device_call():
    source = next(s for s in models.SHAPE_SOURCES if s.name == "sdxl_unet_1024_b2")
    assert source.device == "meta"
    calls = models.source_calls(source, cache=None)
    shapes = Counter(c.shape for c in calls)
    assert len(calls) == 46
    assert shapes[(2, 320, 128, 128)] == 8 and shapes[(2, 1280, 32, 32)] == 16


def test_sdxl_inputs_carry_text_and_time_conditioning():
    unet = models.build_model("sdxl_unet", "meta", torch.float16)
    (sample, timestep), kwargs = models.unet_inputs(unet.config, 2, 128, torch.float16, "meta")
    assert sample.shape == (2, 4, 128, 128) and timestep.dim() == 0
    assert kwargs["encoder_hidden_states"].shape == (2, 77, 2048)
    assert kwargs["added_cond_kwargs"]["text_embeds"].shape == (2, 1280)
    assert kwargs["added_cond_kwargs"]["time_ids"].shape == (2, 6)


def test_distinct_shapes_merge_sources_and_eps():
    call = models.GroupNormCall
    shapes = models.distinct_shapes({
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
    assert models.static_compile_shapes(shapes) == set()  # neither source is a static-compile source


def test_static_compile_picks_the_top_traffic_shape_per_source():
    shape = models.KernelShape
    shapes = [shape((2, 320, 64, 64), 32, E5, (E5,), {"sd15_unet_512_b2": 13}),
              shape((2, 1280, 8, 8), 32, E5, (E5,), {"sd15_unet_512_b2": 12}),
              shape((1, 128, 512, 512), 32, E6, (E6,), {"vae_decode_512": 6}),
              shape((1, 512, 64, 64), 32, E6, (E6,), {"vae_decode_512": 10})]
    assert models.static_compile_shapes(shapes) == {((2, 320, 64, 64), 32), ((1, 128, 512, 512), 32)}


# ------------------------------------------------------------------------------------------------
# Byte model, rotation
# ------------------------------------------------------------------------------------------------
def test_byte_model():
    numel = 2 * 320 * 64 * 64
    assert kernels.bytes_moved(numel, 2, "fwd") == 2 * numel * 2          # read x, write y
    assert kernels.bytes_moved(numel, 2, "fwd+bwd") == 5 * numel * 2      # + read x, read dy, write dx
    assert kernels.bytes_moved(numel, 4, "fwd") == 2 * kernels.bytes_moved(numel, 2, "fwd")
    with pytest.raises(KeyError):
        kernels.bytes_moved(numel, 2, "bwd")


def test_rotation_covers_twice_l2():
    l2 = 60 * 2**20
    assert kernels.rotation_sets(2**20, l2) == 120
    assert kernels.rotation_sets(7 * 2**20, l2) == 18          # 18 x 7 MiB = 126 MiB >= 120 MiB
    assert kernels.rotation_sets(120 * 2**20, l2) == 1
    assert kernels.rotation_sets(512 * 2**20, l2) == 1


# ------------------------------------------------------------------------------------------------
# Rows and result files
# ------------------------------------------------------------------------------------------------
KERNEL_KEYS = {"shape", "dtype", "pass", "copy_us", "gn_patch_us", "torch_nchw_us", "torch_cl_us", "compile_cl_us",
               "source", "gn_patch_wall_us", "gbps", "ratio_to_copy", "num_groups", "eps", "bytes", "errors"}


def kernel_row(**gpu_us):
    ks = models.KernelShape((2, 320, 64, 64), 32, E5, (E6, E5), {"sd15_unet_512_b2": 13, "sdxl_unet_1024_b2": 1})
    times = kernels.CellTimes(gpu_us=gpu_us, wall_us={"gn_patch": 9.0}, timing={k: "graph" for k in gpu_us},
                            errors={"compile_cl": "not run (--quick)"})
    return kernels.kernel_row(ks, "float16", "fwd", 2, 24, True, times)


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
    metadata = results.run_metadata(quick=True, argv=["--quick"])
    assert {"commit", "gpu", "torch", "diffusers", "date", "quick"} <= metadata.keys()
    assert metadata["commit"] == "abc123" and metadata["quick"] is True
    path = tmp_path / "sub" / "kernels.json"
    writer = results.ResultFile(path, metadata)
    assert json.loads(path.read_text()) == {"metadata": metadata, "rows": []}
    writer.add(kernel_row(copy=4.0, gn_patch=5.0))
    writer.add(kernel_row(copy=4.0, gn_patch=6.0))
    writer.update_metadata(section_s=1.5)
    doc = json.loads(path.read_text())
    assert [r["gn_patch_us"] for r in doc["rows"]] == [5.0, 6.0]
    assert doc["metadata"]["section_s"] == 1.5 and doc["metadata"]["commit"] == "abc123"
    assert not list(path.parent.glob("*.tmp"))


def test_describe_error_is_one_bounded_line():
    text = results.describe_error(RuntimeError("CUDA out of memory.\n" + "x" * 1000))
    assert text.startswith("RuntimeError: CUDA out of memory. x") and "\n" not in text and len(text) < 450


# ------------------------------------------------------------------------------------------------
# End-to-end bookkeeping and pipeline wiring
# ------------------------------------------------------------------------------------------------
def test_every_config_runs_its_variants_in_the_full_run():
    by_name = {c.name: c for c in e2e.E2E_CONFIGS}
    assert {n for n, c in by_name.items() if c.compile == "reuse"} == {"sd15_txt2img_512_30steps"}
    assert set(e2e.COMPILE_TARGETS) == set(e2e.E2E_GROUPS)
    for name, config in by_name.items():
        assert set(config.variants) <= set(e2e.VARIANTS) and {"stock_nchw", "patched"} <= set(config.variants)
        assert (config.compile == "none") == (not any(v.endswith("+compile") for v in config.variants)), name
        for variant in e2e.VARIANTS:
            assert (e2e.not_run_reason(config, variant, settings.FULL) is None) == (variant in config.variants), name
            quick = e2e.not_run_reason(config, variant, settings.QUICK)
            assert (quick is None) == (variant in config.variants and not variant.endswith("+compile")), name
    # The pipeline reuses the decoder compiled at 512², so the 1024² decode (a recompile) comes after it.
    names = list(by_name)
    assert names.index("sd15_txt2img_512_30steps") < names.index("vae_decode_1024")
    assert set(settings.FULL.e2e_runs) == set(by_name) == set(settings.QUICK.e2e_runs)
    assert not settings.QUICK.compile_dtypes and settings.FULL.compile_dtypes == ("float16",)
    assert {n for n, c in by_name.items() if not c.graphable} == {"sd15_txt2img_512_30steps", "sd15_train_512_b8"}
    assert set(e2e.VARIANTS) == set(e2e.VARIANT_ORDER)
    # the zoo's rows (issue 14), compared with float32 stock
    assert {c.name for c in e2e.E2E_CONFIGS if c.group in e2e.REFERENCE_DTYPES} == {
        "cogvideox_vae_decode", "hunyuanvideo_vae_decode", "animatediff_unet", "scale_shift_unet"}


def test_error_vs_reference():
    reference = torch.tensor([3.0, -4.0])
    assert e2e.error_vs_reference(reference.half(), reference) == {"rel_l2_vs_fp32": 0.0, "max_err_vs_fp32": 0.0}
    error = e2e.error_vs_reference(torch.tensor([3.0, -3.0]), reference)
    assert error == {"rel_l2_vs_fp32": pytest.approx(0.2), "max_err_vs_fp32": pytest.approx(0.25)}


def test_zoo_calls_on_tiny_models():
    """The zoo configs' calls, on tiny versions of their models: the same seeded inputs in float32 and in half
    precision (up to rounding), outputs of the expected shape."""
    from diffusers import AutoencoderKLCogVideoX, UNetMotionModel

    vae = tiny(AutoencoderKLCogVideoX, dict(configs.COGVIDEOX_VAE, block_out_channels=(32, 32, 32, 32),
                                            layers_per_block=1))
    assert models.video_vae_decode_call(vae, (1, 16, 2, 4, 4))().shape == (1, 3, 8, 32, 32)
    unet = tiny(UNetMotionModel, dict(configs.ANIMATEDIFF_UNET, block_out_channels=(32, 32, 32, 32),
                                      layers_per_block=1, cross_attention_dim=16, num_attention_heads=2,
                                      motion_num_attention_heads=2, norm_num_groups=8))
    assert models.animatediff_call(unet, 2, 3, 8)().shape == (2, 4, 3, 8, 8)
    kandinsky = tiny(UNet2DConditionModel, dict(configs.KANDINSKY22_UNET, block_out_channels=(32, 64, 64, 64),
                                                layers_per_block=1, attention_head_dim=8, cross_attention_dim=32,
                                                encoder_hid_dim=16, addition_embed_type_num_heads=2,
                                                norm_num_groups=8))
    call = models.image_unet_call(kandinsky, 2, 16)
    output = call()
    assert output.shape == (2, 8, 16, 16)
    kandinsky.half()
    half_inputs = models._seeded((2, 4, 16, 16), kandinsky, 0)
    assert half_inputs.dtype == torch.float16
    torch.testing.assert_close(half_inputs.float(), models._seeded((2, 4, 16, 16), vae, 0), rtol=1e-3, atol=1e-3)


def test_e2e_groups_add_up_to_one_table(tmp_path):
    path = tmp_path / "e2e.json"
    assert e2e.previous_e2e_rows(path, "abc", ("sd15",)) == ([], {})
    rows = [e2e.e2e_row(c, "patched", wall_ms=1.0) for c in e2e.E2E_CONFIGS]
    reports = {"sd15": {"unet": {"fused": 61}}, "sdxl": {"unet": {"fused": 46}}}
    results.ResultFile(path, {"commit": "abc", "patch_reports": reports}, rows)
    kept, kept_reports = e2e.previous_e2e_rows(path, "abc", tuple(g for g in e2e.E2E_GROUPS if g != "sd15"))
    assert {r["config"] for r in kept} == {c.name for c in e2e.E2E_CONFIGS if c.group == "sd15"}
    assert kept_reports == {"sd15": {"unet": {"fused": 61}}}
    with pytest.raises(ValueError, match="commit abc, not def"):
        e2e.previous_e2e_rows(path, "def", ("sdxl",))
    assert cli.parse_e2e_groups("sdxl, train") == ("sdxl", "train")
    with pytest.raises(argparse.ArgumentTypeError, match="unknown group"):
        cli.parse_e2e_groups("sd3")


def test_txt2img_pipeline_runs_from_prompt_embeddings_on_tiny_models():
    unet = tiny(UNet2DConditionModel, configs.TINY_SD15_UNET)
    vae = tiny(AutoencoderKL, configs.TINY_VAE)
    pipe = models.build_txt2img_pipeline(unet, vae)
    assert pipe.text_encoder is None and pipe.tokenizer is None
    images = models.txt2img_call(pipe, size=32, steps=2, device="cpu", dtype=torch.float32)()
    assert images.shape == (1, 3, 32, 32)


def test_variants_convert_the_models_in_place():
    vae = tiny(AutoencoderKL, configs.TINY_VAE)
    models = SimpleNamespace(vae=vae)
    assert e2e.enter_variant("stock_nchw", models, kernels_ok=True) == {}
    assert not vae.decoder.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    assert e2e.enter_variant("stock_cl", models, kernels_ok=True) == {}
    assert vae.decoder.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    with pytest.raises(RuntimeError, match="kernels unavailable"):
        e2e.enter_variant("patched", models, kernels_ok=False)
    report = e2e.enter_variant("patched", models, kernels_ok=True)
    assert models.vae is vae and report["vae"]["fused"] > 0
    assert any(isinstance(m, GroupNormAct) for m in vae.modules())


def test_compiled_modules_swaps_and_restores(monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda module: ("compiled", module))
    decoder, unet = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    models = SimpleNamespace(unet=unet, vae=SimpleNamespace(decoder=decoder))
    with e2e.compiled_modules(models, ("unet", "vae.decoder")):
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
    config = e2e.E2E_CONFIGS[0]
    e2e_doc = {"metadata": {**metadata, "variants": e2e.VARIANT_NOTES, "configs": {config.name: "UNet call"}},
           "rows": [e2e.e2e_row(config, "stock_nchw", wall_ms=30.0, gpu_ms=29.0, peak_mb=2000.0),
                    e2e.e2e_row(config, "stock_cl", wall_ms=24.0, gpu_ms=23.5, peak_mb=2000.0),
                    e2e.e2e_row(config, "patched", wall_ms=20.0, gpu_ms=19.5, peak_mb=1900.0, graph_ms=10.0),
                    e2e.e2e_row(config, "stock_cl+compile", not_run="--quick skips torch.compile"),
                    e2e.e2e_row(config, "patched+compile", error="RuntimeError: boom")]}
    cpu = {"metadata": {**metadata, "shape": [2, 1280, 8, 8], "dtype": "float16", "grad_mode": "torch.no_grad()",
                        "notes": "host cost"},
           "rows": [{"method": "gn_patch.group_norm_act", "us_per_call": 7.5, "us_per_call_min": 7.1},
                    {"method": "torch", "us_per_call": None, "us_per_call_min": None, "error": "RuntimeError: x"}]}
    return kernels, e2e_doc, cpu


def test_summary_markdown_has_every_table():
    kernels, e2e_doc, cpu = sample_docs()
    text = report.render_summary(kernels, e2e_doc, cpu)
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
    totals = {(t["source"], t["pass"]): t for t in report.model_totals(kernels["rows"])}
    total = totals[("sd15_unet_512_b2", "fwd")]
    assert total["calls"] == 13
    assert total["gn_patch"] == pytest.approx(13 * 5.0 / 1e3) and total["torch_cl"] == pytest.approx(13 * 25.0 / 1e3)
    assert total["compile_cl"] is None
    assert totals[("sdxl_unet_1024_b2", "fwd")]["calls"] == 1


def test_zoo_rows_get_an_accuracy_table():
    _, e2e_doc, _ = sample_docs()
    assert "error vs fp32" not in report.render_e2e(e2e_doc)
    config = next(c for c in e2e.E2E_CONFIGS if c.name == "cogvideox_vae_decode")
    e2e_doc["rows"] += [e2e.e2e_row(config, "stock_nchw", wall_ms=700.0, gpu_ms=692.0, peak_mb=9000.0,
                                    rel_l2_vs_fp32=0.0041),
                        e2e.e2e_row(config, "patched", wall_ms=400.0, gpu_ms=346.0, peak_mb=8000.0,
                                    rel_l2_vs_fp32=0.0039)]
    text = report.render_e2e(e2e_doc)
    assert "| cogvideox_vae_decode | 692.0 | 346.0 | 2.00x | 0.00410 | 0.00390 |" in text


def test_summary_renders_partial_results():
    kernels, _, _ = sample_docs()
    text = report.render_summary(kernels, None, None)
    assert "## Kernel table" in text and "## End to end" not in text
    assert report.render_summary(None, None, None).startswith("# gn_patch benchmark")


def test_report_only_writes_summary_and_plots(tmp_path, capsys):
    for name, doc in zip(("kernels.json", "e2e.json", "cpu_overhead.json"), sample_docs()):
        (tmp_path / name).write_text(json.dumps(doc))
    assert cli.main(["--report-only", "--out", str(tmp_path)]) == 0
    assert "## End to end" in (tmp_path / "summary.md").read_text()
    pytest.importorskip("matplotlib")
    for plot in ("kernel_speedup.png", "e2e.png"):
        assert (tmp_path / plot).read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_max_shapes_must_be_positive(value):
    with pytest.raises(SystemExit):
        cli.parse_args(["--max-shapes", value])


def test_report_only_refuses_a_folder_without_results(tmp_path, capsys):
    assert cli.main(["--report-only", "--out", str(tmp_path)]) == 1
    assert "no result files" in capsys.readouterr().err
    assert not (tmp_path / "summary.md").exists()


def test_only_rejects_unknown_sections():
    assert cli.parse_args(["--only", "cpu,kernels"]).only == ("cpu", "kernels")
    assert cli.parse_args([]).only == ("kernels", "e2e", "cpu")
    assert cli.parse_args(["--peers", "/p"]).only == settings.SECTIONS
    with pytest.raises(SystemExit):
        cli.parse_args(["--only", "peers"])  # the peers section needs --peers DIR
    with pytest.raises(SystemExit):
        cli.parse_args(["--only", "kernels,gpu"])


# ------------------------------------------------------------------------------------------------
# GPU smoke run
# ------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_quick_kernel_table_on_two_shapes(tmp_path):
    assert cli.main(["--quick", "--only", "kernels", "--max-shapes", "2", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "kernels.json").read_text())
    assert doc["metadata"]["quick"] is True and doc["metadata"]["gpu"]
    rows = doc["rows"]
    assert len(rows) == 2 * len(settings.DTYPES) * len(settings.PASSES)
    for row in rows:
        assert not row["errors"], row["errors"]
        assert row["compile_cl_us"] is None  # --quick compiles nothing
        for key in ("copy_us", "gn_patch_us", "torch_nchw_us", "torch_cl_us"):
            assert row[key] > 0, (key, row)
        assert row["gbps"] > 0 and row["ratio_to_copy"] > 0
    assert (tmp_path / "summary.md").exists()


@pytest.mark.gpu
def test_quick_cpu_section_times_inference_and_training_calls(tmp_path):
    assert cli.main(["--quick", "--only", "cpu", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "cpu_overhead.json").read_text())["rows"]
    for row in rows:
        assert "error" not in row, row
        assert 0 < row["us_per_call_min"] <= row["us_per_call"], row
    training = [row["method"] for row in rows if row["method"].endswith("fwd+bwd")]
    assert len(training) == 3 and any(name.startswith("GroupNormAct") for name in training)


# ------------------------------------------------------------------------------------------------
# The GPU suite's summary (benchmarks/gpu_tests_summary.py, run on the H200 by benchmarks/h200.sh)
# ------------------------------------------------------------------------------------------------
def test_gpu_tests_summary_counts_outcomes_and_keeps_the_run_date(tmp_path):
    module = load_script(ROOT / "benchmarks" / "gpu_tests_summary.py")
    report = tmp_path / "report.xml"
    report.write_text(
        '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="1" failures="1" '
        'skipped="1" tests="4" time="12.5" timestamp="2026-12-02T18:00:00.000001+00:00">'
        '<testcase classname="tests.test_a" name="test_ok" time="0.1"/>'
        '<testcase classname="tests.test_a" name="test_fails" time="0.1"><failure message="x"/></testcase>'
        '<testcase classname="tests.test_a" name="test_skipped" time="0"><skipped message="y"/></testcase>'
        '<testcase classname="tests.test_a" name="test_errs" time="0"><error message="z"/></testcase>'
        '<testcase time="0.001" />'  # a worker stopped mid-test by an interrupt: no test's outcome
        "</testsuite></testsuites>")
    result = module.summarize(str(report))
    assert (result["passed"], result["failed"], result["errors"], result["skipped"]) == (1, 1, 1, 1)
    assert result["unnamed"] == 1
    assert result["failures"] == ["tests.test_a::test_fails", "tests.test_a::test_errs"]
    assert result["date"] == "2026-12-02T18:00:00.000001+00:00"
    assert result["duration_s"] == 12.5
    alone = tmp_path / "alone.xml"  # h200.sh's run of the `alone` tests after the parallel one
    alone.write_text('<testsuites><testsuite name="pytest" time="2.5" timestamp="2026-12-02T18:05:00+00:00">'
                     '<testcase classname="tests.test_b" name="test_capture" time="1"><failure message="x"/>'
                     '</testcase><testcase classname="tests.test_b" name="test_other" time="1"/></testsuite>'
                     '</testsuites>')
    both = module.summarize(str(report), str(alone))
    assert (both["passed"], both["failed"], both["errors"], both["skipped"]) == (2, 2, 1, 1)
    assert both["failures"][-1] == "tests.test_b::test_capture"
    assert both["date"] == result["date"] and both["duration_s"] == 15.0


# ------------------------------------------------------------------------------------------------
# The A/B harness's shapes (benchmarks/tools/harness_times.py; HARNESS_SHAPES, ncu_shapes.py --shapes)
# ------------------------------------------------------------------------------------------------
def _harness_times(monkeypatch, shapes: str | None):
    if shapes is None:
        monkeypatch.delenv("HARNESS_SHAPES", raising=False)
    else:
        monkeypatch.setenv("HARNESS_SHAPES", shapes)
    return load_script(ROOT / "benchmarks" / "tools" / "harness_times.py")


def test_harness_shapes_narrowed_by_the_environment(monkeypatch):
    module = _harness_times(monkeypatch, "2,1280,8,8  16,640,32,32 ")
    assert module.SHAPES == [(2, 1280, 8, 8), (16, 640, 32, 32)]
    assert len(module.HARNESS_SHAPES) == 20


def test_harness_shapes_default_to_the_peer_harness(monkeypatch):
    module = _harness_times(monkeypatch, None)
    assert module.SHAPES == module.HARNESS_SHAPES
    assert (2, 1280, 8, 8) in module.SHAPES and (1, 256, 1024, 1024) in module.SHAPES


# ------------------------------------------------------------------------------------------------
# Nsight Compute's stall reasons as a table (benchmarks/tools/ncu_stalls.py, `benchmarks/h200.sh stalls`)
# ------------------------------------------------------------------------------------------------
def _ncu_launch(name: str, grid: int, block: int, instructions: int, warps: int, stalls: dict) -> str:
    lines = [f"  void {name}(ForwardArgs) ({grid}, 1, 1)x({block}, 1, 1), Context 1, Stream 7, Device 0, CC 9.0",
             "  Metric Name      Metric Unit     Metric Value",
             "  device__attribute_display_name                          NVIDIA H100 80GB",
             "  gpu__time_duration.sum                                  us               5.44"]
    lines += [f"  smsp__average_warps_issue_stalled_{reason}_per_issue_active.ratio   inst   {value}"
              for reason, value in stalls.items()]
    lines += [f"  smsp__inst_executed.sum       inst     {instructions:,}",
              f"  smsp__warps_launched.sum      warp     {warps}"]
    return "\n".join(lines)


def test_ncu_stalls_table_keeps_each_pairs_second_launch():
    module = load_script(ROOT / "benchmarks" / "tools" / "ncu_stalls.py")
    kernel = "(anonymous namespace)::forward_kernel<__half, 8, 1, 0, 0, 0>"
    # Two shapes launching the same kernel, grid and block (each twice): two rows, each its pair's second launch.
    raw = "\n".join(["==PROF== Connected to process 661",
                     _ncu_launch(kernel, 64, 224, 100_000, 100, {"wait": 9.0, "selected": 1.0}),
                     _ncu_launch(kernel, 64, 224, 110_400, 100, {"wait": 1.68, "selected": 1.0, "barrier": 0.0}),
                     _ncu_launch(kernel, 64, 224, 100_000, 100, {"wait": 9.0}),
                     _ncu_launch(kernel, 64, 224, 145_300, 100, {"wait": 1.46, "selected": 1.0, "imc_miss": 0.39})])
    rows = module.table(raw).splitlines()[2:]
    assert len(rows) == 2
    assert rows[0] == ("| `forward_kernel<__half, 8, 1, 0, 0, 0>` | 64 x 224 | 5.44 | 1,104 | 2.68 | "
                       "wait 1.68, selected 1.00 |")
    assert "| 1,453 | 2.85 | wait 1.46, selected 1.00, imc_miss 0.39 |" in rows[1]
