"""patch_pipeline / unpatch_pipeline on tiny diffusers pipelines (CPU, float32): same images as stock, text encoder
untouched, and the surgeon's interplay with pipe.to, accelerate offload hooks, LoRA (peft), torch.compile and the
txt2img example."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from accelerate import cpu_offload, cpu_offload_with_hook
from accelerate.hooks import remove_hook_from_module
from diffusers import (ControlNetModel, DDIMScheduler, StableDiffusionControlNetPipeline, StableDiffusionPipeline,
                       UNet2DConditionModel)
from diffusers.models.controlnets.multicontrolnet import MultiControlNetModel
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict
from torch import nn
from transformers import CLIPTextConfig, CLIPTextModel, PretrainedConfig, PreTrainedModel

import gn_patch
from gn_patch import configs, rules, surgeon
from gn_patch.pipeline import patch_pipeline, unpatch_pipeline
from gn_patch.surgeon import patch_model, unpatch_model

from .tiny_models import (OpCounter, assert_same_outputs, make_model, module_types, randn, rel_l2, sd15_unet_inputs,
                          tiny_controlnet, tiny_sd15_unet, tiny_vae)
from .scripts import load_script

TEXT_WIDTH = configs.TINY_SD15_UNET["cross_attention_dim"]
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "conv1", "conv2", "proj_in", "proj_out"]


def tiny_text_encoder() -> CLIPTextModel:
    torch.manual_seed(0)
    config = CLIPTextConfig(hidden_size=TEXT_WIDTH, intermediate_size=37, num_attention_heads=4, num_hidden_layers=2,
                            vocab_size=1000, max_position_embeddings=77, projection_dim=TEXT_WIDTH)
    return CLIPTextModel(config).eval()


def tiny_sd_pipeline() -> StableDiffusionPipeline:
    """No tokenizer (it would need a download): call it with prompt_embeds."""
    return StableDiffusionPipeline(vae=tiny_vae(), text_encoder=tiny_text_encoder(), tokenizer=None,
                                   unet=tiny_sd15_unet(), scheduler=DDIMScheduler(**configs.SCHEDULER),
                                   safety_checker=None, feature_extractor=None, requires_safety_checker=False)


def prompt_kwargs(batch: int = 2) -> dict:
    return dict(prompt_embeds=randn(batch, 7, TEXT_WIDTH, seed=10),
                negative_prompt_embeds=randn(batch, 7, TEXT_WIDTH, seed=11))


def generate(pipe, **kwargs) -> np.ndarray:
    """Two denoising steps; (batch, 32, 32, 3) float images in [0, 1] (tiny VAE, latents 16 x 16)."""
    return pipe(**prompt_kwargs(), **kwargs, num_inference_steps=2, guidance_scale=5.0, height=32, width=32,
                generator=torch.Generator().manual_seed(0), output_type="np").images


def assert_same_images(actual: np.ndarray, expected: np.ndarray, atol: float = 1e-4) -> None:
    assert actual.shape == expected.shape and 0.05 < expected.std()  # informative images, not saturated
    assert np.abs(actual - expected).max() <= atol


@pytest.fixture(scope="module")
def stock_images() -> np.ndarray:
    return generate(tiny_sd_pipeline())


# ------------------------------------------------------------------------------------------------
# Pipelines
# ------------------------------------------------------------------------------------------------
def test_sd_pipeline_same_images_text_encoder_untouched(stock_images):
    pipe = tiny_sd_pipeline()
    encoder_types = module_types(pipe.text_encoder)
    encoder_state = {k: v.clone() for k, v in pipe.text_encoder.state_dict().items()}
    report = patch_pipeline(pipe)
    assert_same_images(generate(pipe), stock_images)
    components = {name.split(".")[0] for name, _ in report.patched}
    assert components == {"unet", "vae"} and report.skipped == []
    assert module_types(pipe.text_encoder) == encoder_types
    assert all(torch.equal(v, encoder_state[k]) and v.is_contiguous()
               for k, v in pipe.text_encoder.state_dict().items())
    assert unpatch_pipeline(pipe) == len(report.patched)
    assert module_types(pipe.unet) == module_types(tiny_sd15_unet())
    assert np.array_equal(generate(pipe), stock_images)


@pytest.mark.parametrize("order", ["patch_then_to", "to_then_patch"])
def test_pipe_to_before_or_after(order):
    stock = tiny_sd_pipeline().to(torch.float64)
    pipe = tiny_sd_pipeline()
    if order == "patch_then_to":
        patch_pipeline(pipe)
        pipe.to(torch.float64)
    else:
        pipe.to(torch.float64)
        patch_pipeline(pipe)
    assert pipe.unet.conv_in.weight.dtype == torch.float64
    assert pipe.unet.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    inputs = {k: v.double() if v.is_floating_point() else v for k, v in sd15_unet_inputs().items()}
    with torch.no_grad():
        assert_same_outputs(pipe.unet(**inputs), stock.unet(**inputs), tol=1e-12)


def test_controlnet_pipeline_with_multi_controlnet():
    def make_pipe():
        controlnet = MultiControlNetModel([tiny_controlnet(), make_model(ControlNetModel, configs.TINY_CONTROLNET,
                                                                         seed=1)])
        return StableDiffusionControlNetPipeline(
            vae=tiny_vae(), text_encoder=tiny_text_encoder(), tokenizer=None, unet=tiny_sd15_unet(),
            controlnet=controlnet, scheduler=DDIMScheduler(**configs.SCHEDULER), safety_checker=None,
            feature_extractor=None, requires_safety_checker=False)

    images = [torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    controls = dict(image=images, controlnet_conditioning_scale=[0.6, 0.9])
    expected = generate(make_pipe(), **controls)
    pipe = make_pipe()
    report = patch_pipeline(pipe)
    assert {name.split(".")[0] for name, _ in report.patched} == {"unet", "vae", "controlnet"}
    assert any(name.startswith("controlnet.nets.1.") for name, _ in report.patched)
    assert_same_images(generate(pipe, **controls), expected)


class TinyGroupNormEncoder(PreTrainedModel):
    """A transformers model holding a GroupNorm + SiLU pair, which patch_pipeline must leave alone."""

    config_class = PretrainedConfig

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        self.layers = nn.Sequential(nn.GroupNorm(2, 8), nn.SiLU())


def test_transformers_components_are_left_alone():
    pipe = tiny_sd_pipeline()
    pipe.register_modules(image_encoder=TinyGroupNormEncoder(PretrainedConfig()))
    report = patch_pipeline(pipe)
    assert type(pipe.image_encoder.layers[0]) is nn.GroupNorm and type(pipe.image_encoder.layers[1]) is nn.SiLU
    assert report.skipped == [("image_encoder", "TinyGroupNormEncoder is a transformers model: left alone")]


# ------------------------------------------------------------------------------------------------
# accelerate hooks
# ------------------------------------------------------------------------------------------------
def test_model_offload_hook_stays_attached():
    """enable_model_cpu_offload's hook (one per component, on its root) survives patching. It needs an
    accelerator; cpu_offload_with_hook with a CPU execution device attaches the same CpuOffload hook."""
    stock = tiny_sd15_unet()
    unet = copy.deepcopy(stock)
    _, hook = cpu_offload_with_hook(unet, execution_device="cpu")
    hf_hook = unet._hf_hook
    report = patch_model(unet)
    assert unet._hf_hook is hf_hook and report.counts and report.skipped == []
    with torch.no_grad():
        assert_same_outputs(unet(**sd15_unet_inputs()), stock(**sd15_unet_inputs()))
    hook.remove()


@pytest.mark.parametrize("order", ["offload_then_patch", "patch_then_offload"])
def test_sequential_cpu_offload(order):
    """accelerate.cpu_offload puts a weight-loading hook on every module with parameters, GroupNorms included:
    they are fused anyway, and the hooks keep loading their weights."""
    stock = tiny_sd15_unet()
    inputs = sd15_unet_inputs()
    with torch.no_grad():
        expected = stock(**inputs)
    unet = copy.deepcopy(stock)
    if order == "offload_then_patch":
        cpu_offload(unet, execution_device="cpu")
        report = patch_model(unet)
    else:
        report = patch_model(unet)
        cpu_offload(unet, execution_device="cpu")
    norm = unet.down_blocks[0].resnets[0].norm1
    assert isinstance(norm, rules.base.FusedGroupNorm) and hasattr(norm, "_hf_hook")
    assert norm.weight.device.type == "meta"  # offloaded: the hook loads it for each call
    assert report.skipped == [] and report.counts
    with torch.no_grad():
        assert_same_outputs(unet(**inputs), expected)
    # remove_hook_from_module leaves the forward the hook wrapped on each instance: the fused one, in both orders
    remove_hook_from_module(unet, recurse=True)
    assert norm.forward.__func__ is rules.base.FusedGroupNorm.forward
    with torch.no_grad():
        assert_same_outputs(unet(**inputs), expected)
    surgeon.unpatch_model(unet)
    assert type(norm) is nn.GroupNorm and norm.forward.__func__ is nn.GroupNorm.forward
    with torch.no_grad():
        assert torch.equal(unet(**inputs).sample, expected.sample)


# ------------------------------------------------------------------------------------------------
# LoRA
# ------------------------------------------------------------------------------------------------
def add_lora(unet: UNet2DConditionModel, seed: int = 0) -> None:
    torch.manual_seed(seed)  # init_lora_weights=False: random A and B, so the adapter changes the output
    unet.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights=False))


@pytest.mark.parametrize("order", ["patch_then_lora", "lora_then_patch"])
def test_peft_lora_adapter(order):
    stock = tiny_sd15_unet()
    patched = copy.deepcopy(stock)
    inputs = sd15_unet_inputs()
    with torch.no_grad():
        without_lora = stock(**inputs).sample
    add_lora(stock)
    if order == "patch_then_lora":
        patch_model(patched)
        add_lora(patched)
    else:
        add_lora(patched)
        report = patch_model(patched)
        assert report.skipped == [] and report.counts == patch_model(tiny_sd15_unet()).counts
    assert patched.state_dict().keys() == stock.state_dict().keys()
    with torch.no_grad():
        expected = stock(**inputs).sample
        assert rel_l2(expected, without_lora) > 1e-2  # the adapter matters
        assert_same_outputs(patched(**inputs).sample, expected)
        patched.disable_adapters()
        assert_same_outputs(patched(**inputs).sample, without_lora)


def test_lora_added_before_patching_saves_with_safetensors(tmp_path):
    """The training-script order (add the adapter, then patch): the adapter's own convs keep peft's contiguous
    layout, so its weights save with save_lora_weights (safetensors refuses non-contiguous tensors)."""
    unet = tiny_sd15_unet()
    add_lora(unet)
    patch_model(unet)
    assert unet.down_blocks[0].resnets[0].conv1.base_layer.weight.is_contiguous(memory_format=torch.channels_last)
    lora_state = get_peft_model_state_dict(unet)
    assert lora_state and all(tensor.is_contiguous() for tensor in lora_state.values())
    StableDiffusionPipeline.save_lora_weights(tmp_path, unet_lora_layers=lora_state)
    assert (tmp_path / "pytorch_lora_weights.safetensors").exists()


def test_unpatch_pipeline_is_all_or_nothing():
    """A hook added after patching on one component makes unpatch_pipeline refuse before it unpatches any other
    (the VAE comes before the UNet in ``components``), naming the module with its component."""
    from diffusers.hooks import HookRegistry, ModelHook

    pipe = tiny_sd_pipeline()
    patch_pipeline(pipe)
    registry = HookRegistry.check_if_exists_or_initialize(pipe.unet.mid_block.resnets[0])
    registry.register_hook(ModelHook(), "noop")
    with pytest.raises(ValueError, match=r"unet\.mid_block\.resnets\.0: the forward is wrapped"):
        unpatch_pipeline(pipe)
    assert any(type(m) is rules.fusion._FusedResnetBlock2D for m in pipe.vae.modules())
    registry.remove_hook("noop")
    assert unpatch_pipeline(pipe) > 0
    assert not any(type(m) is rules.fusion._FusedResnetBlock2D for m in pipe.vae.modules())


def test_unpatch_after_lora_restores_wrapped_convs(tmp_path):
    """patch, then add LoRA (peft moves each wrapped conv to ``<conv>.base_layer``), then unpatch: every conv weight
    patch_model made channels_last is contiguous again, so the whole state_dict saves with safetensors."""
    from safetensors.torch import save_file

    unet = tiny_sd15_unet()
    patch_model(unet)
    add_lora(unet)
    unpatch_model(unet)
    assert all(tensor.is_contiguous() for tensor in unet.state_dict().values())
    save_file(unet.state_dict(), tmp_path / "unet.safetensors")


def test_unpatch_after_unloading_a_lora_present_at_patching(tmp_path):
    """add a LoRA on the resnets' convs, patch (the wrapped convs are named ``<conv>.base_layer`` then), unload the
    LoRA, unpatch: every conv weight patch_model made channels_last is contiguous again."""
    from safetensors.torch import save_file

    unet = tiny_sd15_unet()
    unet.add_adapter(LoraConfig(r=4, target_modules=["conv1", "conv2"]))
    patch_model(unet)
    assert unet.down_blocks[0].resnets[0].conv1.base_layer.weight.is_contiguous(memory_format=torch.channels_last)
    unet.unload_lora()
    unpatch_model(unet)
    assert all(tensor.is_contiguous() for tensor in unet.state_dict().values())
    save_file(unet.state_dict(), tmp_path / "unet.safetensors")


def test_pipeline_load_fuse_unfuse_lora(tmp_path, stock_images):
    source = tiny_sd15_unet()
    add_lora(source)
    StableDiffusionPipeline.save_lora_weights(tmp_path, unet_lora_layers=get_peft_model_state_dict(source))
    stock, patched = tiny_sd_pipeline(), tiny_sd_pipeline()
    patch_pipeline(patched)
    for pipe in (stock, patched):
        pipe.load_lora_weights(tmp_path, adapter_name="tiny")
    with_lora = generate(stock)
    assert np.abs(with_lora - stock_images).max() > 1e-2
    assert_same_images(generate(patched), with_lora)
    for pipe in (stock, patched):
        pipe.fuse_lora(components=["unet"])
    fused = generate(stock)
    assert_same_images(generate(patched), fused)
    assert_same_images(fused, with_lora, atol=1e-3)
    for pipe in (stock, patched):
        pipe.unfuse_lora(components=["unet"])
        pipe.unload_lora_weights()
    assert_same_images(generate(patched), stock_images)


# ------------------------------------------------------------------------------------------------
# torch.compile
# ------------------------------------------------------------------------------------------------
def test_torch_compile_fullgraph():
    """No graph break in a patched UNet (fullgraph=True raises on one), same output."""
    stock = tiny_sd15_unet()
    unet = copy.deepcopy(stock)
    patch_model(unet)
    torch._dynamo.reset()
    compiled = torch.compile(unet, backend="eager", fullgraph=True)
    inputs = sd15_unet_inputs()
    with torch.no_grad():
        assert_same_outputs(compiled(**inputs), stock(**inputs))
    torch._dynamo.reset()


@pytest.mark.gpu
def test_torch_compile_inductor_cuda():
    """The default backend on CUDA: the fused op inside an Inductor graph, no graph break, same output."""
    unet = tiny_sd15_unet().to("cuda", torch.float16)
    patch_model(unet)
    inputs = {k: v.to("cuda", torch.float16) if v.is_floating_point() else v.cuda()
              for k, v in sd15_unet_inputs().items()}
    torch._dynamo.reset()
    compiled = torch.compile(unet, fullgraph=True)
    with torch.no_grad():
        expected = unet(**inputs).sample
        with OpCounter() as counter:
            unet(**inputs)
        assert counter.kernel_calls > 0  # the kernels run in eager mode
        assert rel_l2(compiled(**inputs).sample, expected) < 2e-3
    torch._dynamo.reset()


@pytest.mark.gpu
def test_enable_model_cpu_offload_cuda():
    """Patched after enable_model_cpu_offload: hooks stay, components move to the GPU and back, kernels run."""
    def make_pipe():
        pipe = tiny_sd_pipeline().to(torch.float16)
        pipe.enable_model_cpu_offload()
        return pipe

    def run(pipe):
        return pipe(**{k: v.half() for k, v in prompt_kwargs().items()}, num_inference_steps=2, guidance_scale=5.0,
                    height=32, width=32, generator=torch.Generator().manual_seed(0), output_type="np").images

    expected = run(make_pipe())
    pipe = make_pipe()
    hooks = {name: pipe.components[name]._hf_hook for name in ("unet", "vae")}
    report = patch_pipeline(pipe)
    assert report.patched and report.skipped == []
    assert all(pipe.components[name]._hf_hook is hook for name, hook in hooks.items())
    with OpCounter() as counter:
        images = run(pipe)
    assert counter.kernel_calls > 0
    assert pipe.unet.device.type == "cpu"  # offloaded again after the call
    mse = float(np.mean((images.astype(np.float64) - expected) ** 2))
    assert mse < 1e-5  # PSNR above 50 dB against stock float16


# ------------------------------------------------------------------------------------------------
# examples/txt2img.py
# ------------------------------------------------------------------------------------------------
def load_example():
    return load_script(Path(__file__).resolve().parents[1] / "examples" / "txt2img.py")


def test_txt2img_example_without_a_gpu_needs_device_cpu(monkeypatch, capsys):
    """Without a GPU the example stops at once unless --device cpu asks for the CPU (a full-size run there takes
    many minutes); the message names the smoke run."""
    example = load_example()
    monkeypatch.setattr(example.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as stopped:
        example.parse_args(["--check-fp32"])
    assert stopped.value.code == 2 and "--device cpu --steps 2" in capsys.readouterr().err
    assert example.parse_args(["--device", "cpu"]).device == torch.device("cpu")


@pytest.mark.parametrize("arch", ["sd15", "sdxl"])
def test_txt2img_example(tmp_path, arch):
    example = load_example()
    results = tmp_path / "results.json"
    argv = ["--tiny", "--arch", arch, "--device", "cpu", "--steps", "2", "--height", "32", "--width", "32",
            "--batch-size", "2", "--check-fp32", "--output-dir", str(tmp_path), "--json", str(results)]
    result = example.main(argv)
    example.main(argv)  # appends a second run
    runs = json.loads(results.read_text())
    assert len(runs) == 2 and runs[0]["psnr_stock_vs_fp32_db"] is None  # identical images: inf, stored as null
    assert {k: v for k, v in runs[0].items() if k != "psnr_stock_vs_fp32_db"} == {
        k: v for k, v in result.items() if k != "psnr_stock_vs_fp32_db"}
    assert {"arch", "height", "width", "steps", "stock_s", "patched_s", "psnr_patched_vs_stock_db",
            "psnr_patched_vs_fp32_db", "psnr_stock_vs_fp32_db", "commit"} <= set(result)
    assert (result["arch"], result["height"], result["width"], result["steps"]) == (arch, 32, 32, 2)
    assert result["stock_s"] > 0 and result["patched_s"] > 0
    # float32 on CPU: stock is the float32 reference; patched differs only by conv summation order
    assert result["psnr_stock_vs_fp32_db"] == math.inf
    assert result["psnr_patched_vs_stock_db"] > 80 and result["psnr_patched_vs_fp32_db"] > 80
    assert sorted(p.name for p in tmp_path.glob("*.png")) == [f"{v}_{i}.png" for v in ("fp32", "patched", "stock")
                                                              for i in (0, 1)]


def test_txt2img_psnr():
    example = load_example()
    reference = np.zeros((1, 4, 4, 3), dtype=np.float32)
    assert example.psnr(reference, reference) == math.inf
    assert example.psnr(reference + 0.1, reference) == pytest.approx(20.0)


@pytest.mark.parametrize("max_graphs, error", [(0, ValueError), (-1, ValueError), (2.5, TypeError)])
def test_patch_pipeline_checks_max_graphs_before_patching(max_graphs, error):
    pipe = tiny_sd_pipeline()
    with pytest.raises(error, match="max_graphs"):
        patch_pipeline(pipe, cuda_graph=True, max_graphs=max_graphs)
    assert not any(isinstance(m, gn_patch.GroupNormAct) for m in pipe.unet.modules())
    assert all(p.is_contiguous() for p in pipe.unet.parameters())
