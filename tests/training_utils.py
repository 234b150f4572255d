"""Helpers shared by the training-path tests: models, inputs, gradients and their comparison."""

from __future__ import annotations

import copy
import math

import torch
from diffusers import UNet2DConditionModel

from gn_patch import GroupNormAct
from gn_patch.surgeon import patch_model

from .tiny_models import perturb_


def build_unet(config: dict, seed: int = 0, device: str | torch.device = "cpu") -> UNet2DConditionModel:
    """A random UNet2DConditionModel in train mode, the same for the same seed.

    GroupNorm affines are moved away from (1, 0) (tiny_models.perturb_): with the identity affine a fused
    op that dropped the weight or bias from the backward pass would go unnoticed.
    """
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(**config)
    return perturb_(unet, seed).to(device).train()


def patched_copy(model: torch.nn.Module) -> torch.nn.Module:
    """An independent copy of ``model`` run through patch_model (the original stays stock)."""
    patched = copy.deepcopy(model)
    report = patch_model(patched)
    assert report.patched, "patch_model fused nothing: the comparison would be stock against stock"
    assert any(isinstance(m, GroupNormAct) for m in patched.modules())
    return patched


def unet_inputs(config: dict, batch: int, tokens: int, seed: int = 0, device="cpu") -> dict:
    """Latents, timesteps and text embeddings for one UNet call, drawn from a seeded CPU generator."""
    gen = torch.Generator().manual_seed(seed)
    size = config["sample_size"]
    inputs = dict(
        sample=torch.randn(batch, config["in_channels"], size, size, generator=gen),
        timestep=torch.randint(0, 1000, (batch,), generator=gen),
        encoder_hidden_states=torch.randn(batch, tokens, config["cross_attention_dim"], generator=gen),
    )
    return {key: value.to(device) for key, value in inputs.items()}


def output_probe(config: dict, batch: int, seed: int = 1, device="cpu") -> torch.Tensor:
    """A fixed random cotangent for the UNet output (see probe_loss)."""
    gen = torch.Generator().manual_seed(seed)
    size = config["sample_size"]
    return torch.randn(batch, config["out_channels"], size, size, generator=gen).to(device)


def probe_loss(output: torch.Tensor, probe: torch.Tensor) -> torch.Tensor:
    """``(output * probe).sum()`` averaged over the batch.

    Every output element gets an O(1) gradient, as with a loss-scaled MSE in real training, so fp16 backward
    passes neither underflow nor overflow. Averaging over the batch makes DDP's gradient averaging over equal
    shards equal the full-batch gradient.
    """
    return (output.float() * probe).sum() / probe.shape[0]


def collect_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """float32 copies of the gradients of every parameter that requires grad, keyed by parameter name.

    A trainable parameter without a gradient is an error, so a disconnected graph cannot pass a comparison.
    """
    grads = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            assert param.grad is not None, f"{name} received no gradient"
            grads[name] = param.grad.detach().float().clone()
    return grads


def parameter_grads(model: torch.nn.Module, inputs: dict, probe: torch.Tensor,
                    autocast_dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """collect_grads after one backward pass of probe_loss from cleared gradients.

    ``autocast_dtype`` runs the forward under torch.autocast on the probe's device.
    """
    model.zero_grad(set_to_none=True)
    with torch.autocast(probe.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        output = model(**inputs).sample
    probe_loss(output, probe).backward()
    return collect_grads(model)


def _squared_error_and_scale(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """(||actual - expected||^2, ||expected||^2) in float64."""
    expected = expected.double()
    return (actual.double() - expected).square().sum().item(), expected.square().sum().item()


def _relative(squared_error: float, squared_scale: float) -> float:
    assert squared_scale > 0, "reference gradient is all zeros: the comparison would prove nothing"
    return (squared_error / squared_scale) ** 0.5


def relative_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64; expected must not be all zeros."""
    return _relative(*_squared_error_and_scale(actual, expected))


def joint_relative_l2(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], names) -> float:
    """relative_l2 of the named gradients taken together as one vector.

    Summed one parameter at a time: a float64 copy of a whole UNet's gradients (6.4 GiB for SD1.5) put the GPU suite's
    parallel workers out of memory.
    """
    sums = [_squared_error_and_scale(actual[name], expected[name]) for name in names]
    return _relative(sum(error for error, _ in sums), sum(scale for _, scale in sums))


def relative_errors(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> dict[str, float]:
    """relative_l2 per parameter; both sides must name the same parameters with the same shapes."""
    assert actual.keys() == expected.keys(), f"parameter names differ: {sorted(actual.keys() ^ expected.keys())[:10]}"
    errors = {}
    for name, grad in expected.items():
        assert actual[name].shape == grad.shape, f"{name}: shape {tuple(actual[name].shape)} != {tuple(grad.shape)}"
        errors[name] = relative_l2(actual[name], grad)
    return errors


def worst(errors: dict[str, float], count: int = 5) -> list[tuple[str, float]]:
    """The ``count`` largest errors, NaN first."""
    return sorted(errors.items(), key=lambda kv: math.inf if math.isnan(kv[1]) else kv[1], reverse=True)[:count]


def assert_grads_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], rtol: float) -> None:
    """Every parameter's gradient within ``rtol`` relative L2 distance of the reference."""
    errors = relative_errors(actual, expected)
    bad = {name: err for name, err in errors.items() if not err <= rtol}  # NaN fails too
    assert not bad, f"{len(bad)} of {len(errors)} gradients off by more than {rtol} relative L2: {worst(bad)}"


def assert_grads_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Bitwise equality of every parameter's gradient."""
    assert actual.keys() == expected.keys()
    differing = [name for name in expected if not torch.equal(actual[name], expected[name])]
    assert not differing, f"{len(differing)} of {len(expected)} gradients differ bitwise, e.g. {differing[:5]}"
