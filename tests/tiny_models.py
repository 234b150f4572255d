"""Tiny diffusers models with random, non-trivial weights, their inputs, and output comparison for the tests."""

from __future__ import annotations

from collections import Counter

import torch
from diffusers import AutoencoderKL, ControlNetModel, UNet2DConditionModel, UNetSpatioTemporalConditionModel
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
from diffusers.utils import BaseOutput
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from gn_patch import configs

# Tiny Stable Video Diffusion UNet: GroupNorms need channels divisible by 32 (hard-coded in diffusers).
TINY_SVD_UNET = dict(
    sample_size=8,
    in_channels=8,
    out_channels=4,
    down_block_types=("CrossAttnDownBlockSpatioTemporal", "DownBlockSpatioTemporal"),
    up_block_types=("UpBlockSpatioTemporal", "CrossAttnUpBlockSpatioTemporal"),
    block_out_channels=(32, 64),
    addition_time_embed_dim=8,
    projection_class_embeddings_input_dim=24,
    layers_per_block=1,
    cross_attention_dim=32,
    num_attention_heads=(2, 4),
    num_frames=3,
)


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64; expected must not be all zeros."""
    expected = expected.double()
    norm = expected.norm()
    assert norm > 0, "reference output is all zeros: the comparison would prove nothing"
    return ((actual.double() - expected).norm() / norm).item()


@torch.no_grad()
def perturb_(model: nn.Module, seed: int = 0) -> nn.Module:
    """Make every parameter informative: GroupNorm weights away from 1, biases away from 0, zero-initialised
    weights (ControlNet's zero convolutions, ...) random. Otherwise a test could not see, e.g., a lost affine."""
    generator = torch.Generator().manual_seed(seed)
    for param in model.parameters():
        noise = torch.randn(param.shape, generator=generator, dtype=param.dtype, device="cpu").to(param.device)
        if param.dim() <= 1:
            param.add_(0.2 * noise)
        elif not param.any():
            param.copy_(0.05 * noise)
    return model.eval()


def make_model(cls, config: dict, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return perturb_(cls(**config), seed)


def tiny_sd15_unet() -> UNet2DConditionModel:
    return make_model(UNet2DConditionModel, configs.TINY_SD15_UNET)


def tiny_sdxl_unet() -> UNet2DConditionModel:
    return make_model(UNet2DConditionModel, configs.TINY_SDXL_UNET)


def tiny_vae() -> AutoencoderKL:
    return make_model(AutoencoderKL, configs.TINY_VAE)


def tiny_controlnet() -> ControlNetModel:
    return make_model(ControlNetModel, configs.TINY_CONTROLNET)


def tiny_svd_unet() -> UNetSpatioTemporalConditionModel:
    return make_model(UNetSpatioTemporalConditionModel, TINY_SVD_UNET)


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), device="cpu")


def sd15_unet_inputs(batch: int = 2) -> dict:
    return dict(sample=randn(batch, 4, 16, 16), timestep=torch.tensor([10, 500][:batch]),
                encoder_hidden_states=randn(batch, 7, 32, seed=1))


def sdxl_unet_inputs(batch: int = 2) -> dict:
    return dict(sample=randn(batch, 4, 16, 16), timestep=torch.tensor(700),
                encoder_hidden_states=randn(batch, 7, 64, seed=1),
                added_cond_kwargs=dict(text_embeds=randn(batch, 32, seed=2), time_ids=randn(batch, 6, seed=3)))


def controlnet_inputs(batch: int = 2) -> dict:
    return dict(sd15_unet_inputs(batch), controlnet_cond=randn(batch, 3, 32, 32, seed=4), conditioning_scale=0.7)


def svd_unet_inputs(batch: int = 1, frames: int = 3) -> dict:
    return dict(sample=randn(batch, frames, 8, 8, 8), timestep=torch.tensor(0.5),
                encoder_hidden_states=randn(batch, 1, 32, seed=1), added_time_ids=randn(batch, 3, seed=2))


def module_types(model: nn.Module) -> dict[str, type]:
    return {name: type(module) for name, module in model.named_modules()}


def outputs(result) -> list[torch.Tensor]:
    """The tensors of a model output (a tensor, a diffusers BaseOutput, or nested tuples/lists of them)."""
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, DiagonalGaussianDistribution):  # AutoencoderKL.encode's latent_dist
        return [result.parameters]
    if isinstance(result, BaseOutput):
        result = result.to_tuple()
    return [t for item in result if item is not None for t in outputs(item)]


def assert_same_outputs(actual, expected, tol: float = 1e-5) -> None:
    """Each output tensor within ``tol`` relative L2 of the reference."""
    actual, expected = outputs(actual), outputs(expected)
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a.shape == e.shape
        assert rel_l2(a, e) <= tol, f"relative L2 difference {rel_l2(a, e):.3g} > {tol}"


# The kernels' ops, by schema name: group_norm_act where autograd records the call, group_norm_act_inference where it
# records nothing (no_grad, or no input requiring a gradient); and as the targets of traced graphs.
KERNEL_OPS = ("gn_patch::group_norm_act", "gn_patch::group_norm_act_inference")
KERNEL_TARGETS = tuple(name.replace("::", ".") + ".default" for name in KERNEL_OPS)


class OpCounter(TorchDispatchMode):
    """Counts the ATen and custom ops dispatched inside the ``with`` block, by schema name
    (KERNEL_OPS, summed by ``kernel_calls``: the fused CUDA kernels ran)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[func._schema.name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def kernel_calls(self) -> int:
        return sum(self.calls[name] for name in KERNEL_OPS)


def is_channels_last(x: torch.Tensor) -> bool:
    """Dense with the channel dimension innermost (what gn_patch's kernels read): channels_last (4-D),
    channels_last_3d (5-D), channel stride 1 (3-D)."""
    if x.dim() == 4:
        return x.is_contiguous(memory_format=torch.channels_last)
    if x.dim() == 5:
        return x.is_contiguous(memory_format=torch.channels_last_3d)
    return x.dim() == 3 and x.transpose(1, 2).is_contiguous()


class CudnnConv3dLayout(TorchFunctionMode):
    """On the CPU, 3-D convolutions return NCDHW whatever their input's and weight's layout; cuDNN returns
    channels_last_3d when either is. Inside this mode they return what cuDNN would (same values), so that a CPU
    test sees the layouts a CUDA run sees."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.conv3d, torch.nn.functional.conv3d, torch.nn.functional.conv_transpose3d) and any(
                isinstance(t, torch.Tensor) and t.dim() == 5 and not t.is_contiguous()
                and t.is_contiguous(memory_format=torch.channels_last_3d) for t in args[:2]):
            out = out.contiguous(memory_format=torch.channels_last_3d)
        return out
