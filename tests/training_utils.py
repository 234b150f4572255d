"""Helpers shared by the training-path tests: UNet configs, inputs, gradients and their comparison."""

from __future__ import annotations

import copy

import torch
from diffusers import UNet2DConditionModel

# SD1.5's block structure (cross-attention down blocks then a plain one, mirrored on the way up, a
# cross-attention mid block) at a size that runs forward and backward on a CPU in well under a second.
TINY_UNET_CONFIG = dict(
    sample_size=16,
    in_channels=4,
    out_channels=4,
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    block_out_channels=(32, 64),
    layers_per_block=1,
    norm_num_groups=8,
    cross_attention_dim=32,
    attention_head_dim=8,
)

# The published unet/config.json of Stable Diffusion 1.5 (diffusers defaults fill in the other fields).
SD15_UNET_CONFIG = dict(
    sample_size=64,
    in_channels=4,
    out_channels=4,
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    block_out_channels=(320, 640, 1280, 1280),
    layers_per_block=2,
    norm_num_groups=32,
    norm_eps=1e-5,
    cross_attention_dim=768,
    attention_head_dim=8,
    act_fn="silu",
    flip_sin_to_cos=True,
    freq_shift=0,
    downsample_padding=1,
    mid_block_scale_factor=1,
    center_input_sample=False,
)


def build_unet(config: dict, seed: int = 0, device: str | torch.device = "cpu") -> UNet2DConditionModel:
    """A randomly initialised UNet2DConditionModel in train mode, the same weights for the same seed."""
    torch.manual_seed(seed)
    with torch.device(device):
        unet = UNet2DConditionModel(**config)
    return unet.train()


def patched_copy(model: torch.nn.Module) -> torch.nn.Module:
    """An independent copy of ``model`` run through gn_patch.patch_model (the original stays stock)."""
    from gn_patch import patch_model  # the surgeon is imported where used: tests collect without it

    patched = copy.deepcopy(model)
    patch_model(patched)
    return patched


def unet_inputs(config: dict, batch: int, seed: int = 0, device="cpu", tokens: int = 8) -> dict:
    """Latents, timesteps and text embeddings for one UNet call, drawn from a seeded CPU generator."""
    gen = torch.Generator().manual_seed(seed)
    size = config["sample_size"]
    inputs = dict(
        sample=torch.randn(batch, config["in_channels"], size, size, generator=gen),
        timestep=torch.randint(0, 1000, (batch,), generator=gen),
        encoder_hidden_states=torch.randn(batch, tokens, config["cross_attention_dim"], generator=gen),
    )
    return {k: v.to(device) for k, v in inputs.items()}


def output_probe(config: dict, batch: int, seed: int = 1, device="cpu") -> torch.Tensor:
    """A fixed random cotangent for the UNet output.

    The loss ``(output * probe).sum()`` gives every output element an O(1) gradient, like a loss-scaled
    MSE in real training, so fp16 backward passes neither underflow nor overflow.
    """
    gen = torch.Generator().manual_seed(seed)
    size = config["sample_size"]
    return torch.randn(batch, config["out_channels"], size, size, generator=gen).to(device)


def parameter_grads(model: torch.nn.Module, inputs: dict, probe: torch.Tensor,
                    autocast_dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Gradients of ``(model(**inputs) * probe).sum()`` for every parameter that requires grad.

    Gradients are cleared first and returned as float32 copies keyed by parameter name; a trainable
    parameter that receives no gradient is an error, so a disconnected graph cannot pass a comparison.
    ``autocast_dtype`` runs the forward under torch.autocast on the inputs' device.
    """
    model.zero_grad(set_to_none=True)
    device_type = probe.device.type
    with torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        output = model(**inputs).sample
    (output.float() * probe).sum().backward()
    grads = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            assert param.grad is not None, f"{name} received no gradient"
            grads[name] = param.grad.detach().float().clone()
    return grads


def relative_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64 (the absolute distance where expected is all zero)."""
    diff = (actual.double() - expected.double()).norm().item()
    scale = expected.double().norm().item()
    return diff / scale if scale > 0 else diff


def relative_errors(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> dict[str, float]:
    """relative_l2 per parameter; both sides must name the same parameters with the same shapes."""
    assert actual.keys() == expected.keys(), f"parameter names differ: {sorted(actual.keys() ^ expected.keys())[:10]}"
    errors = {}
    for name, grad in expected.items():
        assert actual[name].shape == grad.shape, f"{name}: shape {tuple(actual[name].shape)} != {tuple(grad.shape)}"
        errors[name] = relative_l2(actual[name], grad)
    return errors


def assert_grads_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], rtol: float) -> None:
    """Every parameter's gradient within ``rtol`` relative L2 distance; the message lists the worst ones."""
    errors = relative_errors(actual, expected)
    bad = {name: err for name, err in errors.items() if not err <= rtol}  # NaN fails too
    worst = sorted(bad.items(), key=lambda kv: -kv[1] if kv[1] == kv[1] else float("-inf"))[:5]
    assert not bad, f"{len(bad)} of {len(errors)} gradients off by more than {rtol} relative L2, worst: {worst}"
