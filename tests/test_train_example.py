"""examples/train_text_to_image.py and examples/compare_training.py end to end on the CPU with tiny models.

Stock and patched runs see the same data and noise and give the same losses; checkpoints load into stock
diffusers; LoRA adapters, an image folder with captions or prompt embeddings, precomputed latents, gradient
accumulation and checkpointing, and real components loaded with --model all run.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel
from diffusers.models.resnet import ResnetBlock2D
from PIL import Image
from safetensors.torch import load_file

from gn_patch import configs

from .scripts import load_script

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
RESULT_KEYS = {"config", "stock_samples_per_s", "patched_samples_per_s", "max_loss_diff_first_10_steps", "commit"}


def run(script: str, *args: str | Path) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, str(EXAMPLES / script), *map(str, args)], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory) -> Path:
    """Four random RGB images of different sizes and aspect ratios, metadata.jsonl with captions, and
    prompt_embeds.pt (file name -> (77, 32) embedding, the tiny UNet's cross-attention width)."""
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    rows = []
    for index, (height, width) in enumerate([(40, 56), (64, 32), (33, 33), (90, 70)]):
        name = f"image_{index}.png"
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(root / name)
        rows.append({"file_name": name, "text": f"a random picture number {index}"})
    (root / "metadata.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    gen = torch.Generator().manual_seed(0)
    torch.save({row["file_name"]: torch.randn(77, 32, generator=gen) for row in rows}, root / "prompt_embeds.pt")
    return root


def test_compare_training_stock_and_patched_agree(tmp_path):
    output, runs = tmp_path / "training.json", tmp_path / "runs"
    printed = run("compare_training.py", "--tiny", "--resolution", 32, "--train-batch-size", 2, "--max-train-steps", 3,
                  "--mixed-precision", "no", "--output", output, "--work-dir", runs).stdout
    result = json.loads(output.read_text())
    # On the CPU the two runs' ratio measures the host, not the patch: neither printed nor recorded.
    assert ("no speedup to report" in printed) == (result["config"]["device"] == "cpu") == (result["speedup"] is None)
    assert RESULT_KEYS <= result.keys()
    assert len(result["stock_losses"]) == len(result["patched_losses"]) == 3
    # float32 on the CPU: the same weights, data and noise give the same losses up to summation order.
    assert result["max_loss_diff_first_10_steps"] <= 1e-5 * max(result["stock_losses"])
    assert result["stock_samples_per_s"] > 0 and result["patched_samples_per_s"] > 0
    assert sum(result["config"]["gn_patch"]["fused"].values()) > 0
    assert result["config"]["fsdp2"] is False and result["config"]["gn_patch"]["channels_last_conv_weights"] > 0

    # The patched run's checkpoint is a stock diffusers UNet: same classes, same keys, every tensor written.
    patched = UNet2DConditionModel.from_pretrained(runs / "patched" / "unet")
    assert type(patched.mid_block.resnets[0]) is ResnetBlock2D
    state = patched.state_dict()
    assert state.keys() == UNet2DConditionModel(**configs.TINY_SD15_UNET).state_dict().keys()
    saved = load_file(runs / "patched" / "unet" / "diffusion_pytorch_model.safetensors")
    assert saved.keys() == state.keys()
    # Both runs start from the same seeded weights, and three AdamW steps of lr 1e-5 move a weight by ~3e-5 at
    # most: the checkpoints agree far below the weights' own size (~1e-2) unless one of them is garbled.
    stock = load_file(runs / "stock" / "unet" / "diffusion_pytorch_model.safetensors")
    assert max((saved[name] - stock[name]).abs().max().item() for name in stock) < 1e-4


def test_lora_on_an_image_folder(tmp_path, image_folder):
    out = tmp_path / "lora"
    run("train_text_to_image.py", "--tiny", "--lora-rank", 4, "--train-data-dir", image_folder,
        "--prompt-embeds", image_folder / "prompt_embeds.pt", "--precompute-latents", "--gradient-checkpointing",
        "--gradient-accumulation-steps", 2, "--train-batch-size", 2, "--max-train-steps", 2,
        "--mixed-precision", "no", "--output-dir", out, "--log-json", out / "log.json")
    log = json.loads((out / "log.json").read_text())
    assert len(log["losses"]) == 2 and all(math.isfinite(loss) for loss in log["losses"])

    state, _ = StableDiffusionPipeline.lora_state_dict(out)  # diffusers' format: lora.down (A), lora.up (B)
    assert state and all(key.startswith("unet.") and ".lora." in key for key in state)
    # B starts at zero: non-zero values are the training steps.
    assert any(value.abs().max() > 0 for key, value in state.items() if ".lora.up." in key)
    unet = UNet2DConditionModel(**configs.TINY_SD15_UNET)
    unet.load_lora_adapter(state, prefix="unet", adapter_name="trained")
    loaded = {name: param for name, param in unet.named_parameters() if "lora_" in name}
    assert len(loaded) == len(state)


def write_tiny_model(root: Path) -> None:
    """A Stable Diffusion model folder of tiny random components, with a character-level CLIP tokenizer."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    UNet2DConditionModel(**configs.TINY_SD15_UNET).save_pretrained(root / "unet")
    AutoencoderKL(**configs.TINY_VAE).save_pretrained(root / "vae")
    DDPMScheduler.from_config(configs.SCHEDULER).save_pretrained(root / "scheduler")
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for char in "abcdefghijklmnopqrstuvwxyz0123456789":
        vocab[char], vocab[char + "</w>"] = len(vocab), len(vocab) + 1
    (root / "vocab.json").write_text(json.dumps(vocab))
    (root / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = CLIPTokenizer(vocab_file=str(root / "vocab.json"), merges_file=str(root / "merges.txt"),
                              model_max_length=77)
    tokenizer.save_pretrained(root / "tokenizer")
    text_config = CLIPTextConfig(vocab_size=len(vocab), hidden_size=configs.TINY_SD15_UNET["cross_attention_dim"],
                                 intermediate_size=37, num_attention_heads=4, num_hidden_layers=2,
                                 max_position_embeddings=77, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    CLIPTextModel(text_config).save_pretrained(root / "text_encoder")


def test_model_folder_with_captions(tmp_path, image_folder):
    model, out = tmp_path / "model", tmp_path / "out"
    write_tiny_model(model)
    run("train_text_to_image.py", "--model", model, "--train-data-dir", image_folder, "--resolution", 32,
        "--train-batch-size", 2, "--max-train-steps", 2, "--mixed-precision", "no", "--output-dir", out,
        "--log-json", out / "log.json")
    log = json.loads((out / "log.json").read_text())
    assert log["patched"] and all(math.isfinite(loss) for loss in log["losses"])
    assert (out / "unet" / "diffusion_pytorch_model.safetensors").exists()


def test_help():
    assert "--lora-rank" in run("train_text_to_image.py", "--help").stdout
    assert "--num-processes" in run("compare_training.py", "--help").stdout


def load_example(script: str):
    """examples/<script> imported as a module (its main not run)."""
    return load_script(EXAMPLES / script)


def test_launchers():
    """One process runs plainly, several under accelerate; --fsdp2 needs a distributed launch even for one."""
    launcher = load_example("compare_training.py").launcher
    assert launcher(1, fsdp2=False) == [sys.executable]
    assert launcher(1, fsdp2=True)[1:] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
    for fsdp2 in (False, True):
        assert launcher(2, fsdp2)[1:] == ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]


def test_default_work_dirs_are_new_folders():
    compare_training = load_example("compare_training.py")
    assert compare_training.parse_args([])[0].work_dir is None
    first, second = compare_training.new_work_dir(), compare_training.new_work_dir()
    assert first != second and first.is_dir() and second.is_dir() and not any(first.iterdir())
    first.rmdir()
    second.rmdir()


def test_scaling_against_one_gpu_result():
    compare_training = load_example("compare_training.py")
    config = {"resolution": 512, "train_batch_size": 8, "mixed_precision": "bf16", "gn_patch": {"fused": {}}}
    one_gpu = {"config": dict(config, num_processes=1, global_batch_size=8), "stock_samples_per_s": 20.0,
               "patched_samples_per_s": 25.0, "commit": "c1"}
    result = {"config": dict(config, num_processes=2, global_batch_size=16), "stock_samples_per_s": 38.0,
              "patched_samples_per_s": 45.0}
    compare_training.add_scaling(result, one_gpu)
    assert result["stock_scaling"] == pytest.approx(1.9) and result["patched_scaling"] == pytest.approx(1.8)
    assert result["one_gpu"] == {"stock_samples_per_s": 20.0, "patched_samples_per_s": 25.0, "commit": "c1"}
    other = dict(one_gpu, config=dict(one_gpu["config"], resolution=256))
    with pytest.raises(SystemExit, match="resolution"):
        compare_training.add_scaling(result, other)
    # A one-GPU result from before --fsdp2 existed ran without it: it scales a run without FSDP2 only.
    compare_training.add_scaling(dict(result, config=dict(result["config"], fsdp2=False)), one_gpu)
    with pytest.raises(SystemExit, match="fsdp2"):
        compare_training.add_scaling(dict(result, config=dict(result["config"], fsdp2=True)), one_gpu)


@pytest.mark.gpu
def test_compare_training_under_fsdp2(tmp_path):
    """--fsdp2 goes to both runs (one process, under torchrun); accelerate shards each UNet with FSDP2 in bf16,
    the patched one patched with channels_last="activations", and the patched checkpoint is a stock UNet."""
    output, runs = tmp_path / "training.json", tmp_path / "runs"
    run("compare_training.py", "--tiny", "--fsdp2", "--train-batch-size", 2, "--max-train-steps", 3,
        "--mixed-precision", "bf16", "--output", output, "--work-dir", runs)
    result = json.loads(output.read_text())
    config = result["config"]
    assert config["fsdp2"] is True and config["num_processes"] == 1 and config["mixed_precision"] == "bf16"
    assert config["gn_patch"]["cuda_kernels"] is True
    losses = result["stock_losses"] + result["patched_losses"]
    assert len(losses) == 6 and all(math.isfinite(loss) for loss in losses)
    # The same weights, data and noise in bf16: the losses differ by bf16 rounding of the activations (~1%).
    assert result["max_loss_diff_first_10_steps"] <= 0.05 * max(losses)

    patched = UNet2DConditionModel.from_pretrained(runs / "patched" / "unet")
    assert type(patched.mid_block.resnets[0]) is ResnetBlock2D
    saved = load_file(runs / "patched" / "unet" / "diffusion_pytorch_model.safetensors")
    assert all(value.dtype == torch.float32 for value in saved.values())  # FSDP2's float32 master weights
    stock = load_file(runs / "stock" / "unet" / "diffusion_pytorch_model.safetensors")
    assert saved.keys() == stock.keys() == patched.state_dict().keys()
    # Three AdamW steps of lr 1e-5 from the same seeded weights (see test_compare_training_stock_and_patched_agree).
    assert max((saved[name] - stock[name]).abs().max().item() for name in stock) < 1e-4


def test_training_without_a_gpu_asks_for_the_smoke_run(monkeypatch, capsys):
    """Full-size SD1.5 training from random weights (the default model) refuses a machine without a GPU at once,
    naming --tiny and --model: under `accelerate launch --multi_gpu` on such a machine it used to start both
    processes on the CPU."""
    train = load_example("train_text_to_image.py")
    monkeypatch.setattr(train.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        train.parse_args(["--mixed-precision", "bf16"])
    assert "no CUDA GPU here" in capsys.readouterr().err
    assert train.parse_args(["--tiny"]).tiny and train.parse_args(["--model", "some/model"]).model == "some/model"


def test_compare_training_without_a_gpu_asks_for_the_smoke_run(tmp_path, monkeypatch):
    """The full-size comparison (SD1.5 at 512², batch 8) refuses a machine without a GPU before it starts, naming
    --tiny; with --tiny it runs there (test_compare_training_stock_and_patched_agree)."""
    compare = load_example("compare_training.py")
    monkeypatch.setattr(compare.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match=r"no CUDA GPU here.*--tiny"):
        compare.main(["--output", str(tmp_path / "training.json"), "--work-dir", str(tmp_path)])
    assert not (tmp_path / "stock").exists()
