"""Training-path correctness: every parameter gradient of a patched UNet equals the stock UNet's.

CPU tests (run in CI) use a tiny UNet of SD1.5's structure in float32. There GroupNormAct computes with PyTorch's
GroupNorm, so they check the surgery under autograd: shared parameters, no activation dropped or applied twice,
channels-last weights, under gradient checkpointing (reentrant and not), LoRA adapters, torch.compile and repeated
backward passes. The ``gpu`` tests run the full SD1.5 architecture on CUDA, where the fused kernels do the work.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from diffusers.models.resnet import ResnetBlock2D
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from gn_patch import GroupNormAct, configs, extension

from .tiny_models import OpCounter
from .training_utils import (
    assert_grads_close,
    assert_grads_equal,
    build_unet,
    collect_grads,
    joint_relative_l2,
    output_probe,
    parameter_grads,
    patched_copy,
    unet_inputs,
)

LORA_TARGET_MODULES = ["to_q", "to_k", "to_v", "to_out.0"]
CPU_RTOL = 1e-5  # float32 on CPU: stock and patched differ only by the summation order of channels-last convs
CUDA_RTOL = 1e-4  # float32 on CUDA (TF32 off): another reduction order in the fused kernels and convs
AUTOCAST_RATIO, AUTOCAST_SLACK = 1.5, 1e-3


class Case:
    """A stock UNet, one batch of inputs, the output probe and the stock gradients (the reference)."""

    def __init__(self, config: dict, batch: int, tokens: int, device: str = "cpu"):
        self.stock = build_unet(config, device=device)
        self.inputs = unet_inputs(config, batch, tokens, device=device)
        self.probe = output_probe(config, batch, device=device)
        self.grads = parameter_grads(self.stock, self.inputs, self.probe)

    def grads_of(self, model: torch.nn.Module, **kwargs) -> dict[str, torch.Tensor]:
        return parameter_grads(model, self.inputs, self.probe, **kwargs)


def checkpoint_recorder(use_reentrant: bool):
    """A gradient_checkpointing_func for diffusers that checkpoints with torch.utils.checkpoint and records
    which modules it was called for (so a test can see that checkpointing covered the fused blocks)."""
    calls: list[torch.nn.Module] = []

    def checkpointed(module, *args):
        calls.append(module)
        return checkpoint(module, *args, use_reentrant=use_reentrant)

    return checkpointed, calls


def holds_fused_norm(module: torch.nn.Module) -> bool:
    return any(isinstance(m, GroupNormAct) for m in module.modules())


def fused_norm_parameters(model: torch.nn.Module) -> list[str]:
    """Names of the affine parameters of the model's GroupNormAct modules."""
    return [f"{name}.{attr}" for name, module in model.named_modules() if isinstance(module, GroupNormAct)
            for attr in ("weight", "bias") if getattr(module, attr) is not None]


# ------------------------------------------------------------------------------------------------
# CPU, float32
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    return Case(configs.TINY_SD15_UNET, batch=2, tokens=8)


def test_patched_gradients_match_stock(tiny):
    patched = patched_copy(tiny.stock)
    assert_grads_close(tiny.grads_of(patched), tiny.grads, CPU_RTOL)


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_gradient_checkpointing_matches_stock(tiny, use_reentrant):
    patched = patched_copy(tiny.stock)
    checkpointed, calls = checkpoint_recorder(use_reentrant)
    patched.enable_gradient_checkpointing(checkpointed)
    grads = tiny.grads_of(patched)
    assert any(isinstance(m, ResnetBlock2D) and holds_fused_norm(m) for m in calls), "no fused block was checkpointed"
    assert_grads_close(grads, tiny.grads, CPU_RTOL)


def test_lora_gradients_match_stock():
    from peft import LoraConfig

    stock = build_unet(configs.TINY_SD15_UNET)
    patched = patched_copy(stock)  # the training script's order: patch, then add the adapters
    for model in (stock, patched):
        model.requires_grad_(False)
        model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=LORA_TARGET_MODULES))
    # lora_B starts at zero, which would make every lora_A gradient zero: give it values, the same in both.
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in stock.named_parameters():
            if "lora_B" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
    patched.load_state_dict(stock.state_dict())

    inputs = unet_inputs(configs.TINY_SD15_UNET, batch=2, tokens=8)
    probe = output_probe(configs.TINY_SD15_UNET, batch=2)
    expected = parameter_grads(stock, inputs, probe)
    grads = parameter_grads(patched, inputs, probe)
    assert expected and all("lora_" in name for name in expected), sorted(expected)[:5]
    assert all(param.grad is None for param in patched.parameters() if not param.requires_grad)
    assert_grads_close(grads, expected, CPU_RTOL)


def test_compiled_patched_unet_has_no_graph_break_and_matches_stock(tiny):
    patched = patched_copy(tiny.stock)
    torch._dynamo.reset()
    try:
        # fullgraph=True makes any graph break an error; aot_eager traces forward and backward through AOTAutograd.
        compiled = torch.compile(patched, backend="aot_eager", fullgraph=True)
        grads = tiny.grads_of(compiled)
    finally:
        torch._dynamo.reset()
    assert_grads_close({name.removeprefix("_orig_mod."): g for name, g in grads.items()}, tiny.grads, CPU_RTOL)


def test_patched_backward_is_deterministic(tiny):
    patched = patched_copy(tiny.stock)
    assert_grads_equal(tiny.grads_of(patched), tiny.grads_of(patched))


# ------------------------------------------------------------------------------------------------
# CUDA: the full SD1.5 architecture at 64x64 latents (512x512 images), batch 2
# ------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def cuda_numerics(deterministic: bool = False):
    """float32 convolutions and matmuls in full precision (no TF32, whose 10-bit mantissa would swamp the
    comparison), no cuDNN autotuning; ``deterministic``: deterministic algorithms and the math SDPA backend
    (the fused attention kernels' backward passes accumulate with atomics)."""
    matmul_precision = torch.get_float32_matmul_precision()
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.set_float32_matmul_precision("highest")
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.backends.cudnn.flags(enabled=True, benchmark=False,
                                                           deterministic=deterministic, allow_tf32=False))
            if deterministic:
                # warn_only: a stock op without a deterministic kernel warns; the bitwise comparison decides.
                torch.use_deterministic_algorithms(True, warn_only=True)
                stack.enter_context(sdpa_kernel(SDPBackend.MATH))
            yield
    finally:
        torch.use_deterministic_algorithms(was_deterministic, warn_only=was_warn_only)
        torch.set_float32_matmul_precision(matmul_precision)


@pytest.fixture(scope="module")
def sd15():
    # Without the kernels GroupNormAct falls back to PyTorch's GroupNorm and these tests would prove little.
    assert extension.kernels_available(), "gn_patch's CUDA kernels are not available (see python -m gn_patch.build)"
    with cuda_numerics():
        case = Case(configs.SD15_UNET, batch=2, tokens=77, device="cuda")
        case.patched = patched_copy(case.stock)
    yield case
    del case
    torch.cuda.empty_cache()


@pytest.mark.gpu
def test_cuda_fp32_gradients_match_stock(sd15):
    with cuda_numerics(), OpCounter() as ops:
        grads = sd15.grads_of(sd15.patched)
    # The fused kernels did the work, forward and backward.
    assert ops.calls["gn_patch::group_norm_act"] > 0 and ops.calls["gn_patch::group_norm_act_backward"] > 0
    assert_grads_close(grads, sd15.grads, CUDA_RTOL)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cuda_autocast_gradients_as_close_to_fp32_as_stock(sd15, dtype):
    """Under autocast with float32 weights, the patched gradients may be no further from the float32 stock
    gradients than the stock autocast gradients are (x1.5, plus a small slack).

    Distances are taken over gradients jointly: all parameters, and apart the GroupNorm parameters (whose
    gradients the fused backward computes itself, and which are too few to show in the total). Per parameter,
    two equally accurate half-precision runs scatter too much to compare: on the tiny UNet, where the patched
    model computes with PyTorch's own GroupNorm, patched/stock ratios of per-parameter errors reach 1.9.
    """
    with cuda_numerics():
        stock = sd15.grads_of(sd15.stock, autocast_dtype=dtype)
        patched = sd15.grads_of(sd15.patched, autocast_dtype=dtype)
    groups = {"all parameters": sorted(sd15.grads), "GroupNorm parameters": fused_norm_parameters(sd15.patched)}
    for group, names in groups.items():
        stock_error = joint_relative_l2(stock, sd15.grads, names)
        patched_error = joint_relative_l2(patched, sd15.grads, names)
        assert stock_error < 0.5, f"{group}: stock autocast gradients are unusable (relative error {stock_error})"
        assert patched_error <= AUTOCAST_RATIO * stock_error + AUTOCAST_SLACK, (
            f"{group}: patched gradients {patched_error:.4g} from float32, stock's {stock_error:.4g}")


@pytest.mark.gpu
def test_cuda_backward_is_deterministic(sd15):
    with cuda_numerics(deterministic=True):
        stock_first, stock_second = sd15.grads_of(sd15.stock), sd15.grads_of(sd15.stock)
        first, second = sd15.grads_of(sd15.patched), sd15.grads_of(sd15.patched)
    # Precondition: with stock nondeterministic under these settings, the patched check would prove nothing.
    assert_grads_equal(stock_second, stock_first)
    assert_grads_equal(second, first)


@pytest.mark.gpu
@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_cuda_gradient_checkpointing_matches_stock(sd15, use_reentrant):
    checkpointed, calls = checkpoint_recorder(use_reentrant)
    sd15.patched.enable_gradient_checkpointing(checkpointed)
    try:
        with cuda_numerics():
            grads = sd15.grads_of(sd15.patched)
    finally:
        sd15.patched.disable_gradient_checkpointing()
    assert any(isinstance(m, ResnetBlock2D) and holds_fused_norm(m) for m in calls), "no fused block was checkpointed"
    assert_grads_close(grads, sd15.grads, CUDA_RTOL)


@pytest.mark.gpu
def test_cuda_compiled_patched_resnet_block_matches_stock(sd15):
    """The fused op inside a compiled graph (on CPU the kernels are not in play): one ResnetBlock2D of the
    first stage, compiled whole (fullgraph) through AOTAutograd, against the stock block in eager mode."""
    path = "down_blocks.0.resnets.0"
    stock, patched = sd15.stock.get_submodule(path), sd15.patched.get_submodule(path)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 320, 64, 64, generator=gen).cuda().to(memory_format=torch.channels_last)
    temb = torch.randn(2, 1280, generator=gen).cuda()
    probe = torch.randn(2, 320, 64, 64, generator=gen).cuda()

    def grads(block):
        block.zero_grad(set_to_none=True)
        leaves = [x.detach().requires_grad_(True), temb.detach().requires_grad_(True)]
        (block(*leaves) * probe).sum().backward()
        return dict(collect_grads(block), x=leaves[0].grad, temb=leaves[1].grad)

    torch._dynamo.reset()
    try:
        with cuda_numerics():
            expected = grads(stock)
            actual = grads(torch.compile(patched, backend="aot_eager", fullgraph=True))
    finally:
        torch._dynamo.reset()
    assert_grads_close({name.removeprefix("_orig_mod."): g for name, g in actual.items()}, expected, CUDA_RTOL)

