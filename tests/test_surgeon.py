"""patch_model / unpatch_model: patched outputs equal stock ones, checkpoints are unchanged, patching is idempotent
and reversible, the report says what was and was not fused. CPU tests in float32; ``gpu`` tests check float16 and
bfloat16 accuracy of the full-size models on CUDA against a float32 reference."""

from __future__ import annotations

import copy
import pickle
from collections import Counter, OrderedDict
from types import SimpleNamespace

import pytest
import torch

from diffusers import AutoencoderKL, ControlNetModel, UNet2DConditionModel, UNet2DModel
from diffusers.models.attention_processor import Attention, SpatialNorm
from diffusers.models.autoencoders.vae import Decoder
from diffusers.models.controlnets.multicontrolnet import MultiControlNetModel
from diffusers.models.normalization import AdaGroupNorm
from diffusers.models.resnet import ResnetBlock2D, ResnetBlockCondNorm2D, TemporalResnetBlock
from diffusers.models.transformers.transformer_2d import Transformer2DModel
from diffusers.models.transformers.transformer_temporal import TransformerTemporalModel
from diffusers.models.unets.unet_2d_blocks import UNetMidBlock2D
from diffusers.models.unets.unet_motion_model import AnimateDiffTransformer3D
from diffusers.models.upsampling import Upsample2D
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from gn_patch import GroupNormAct, configs, extension, rules, surgeon
from gn_patch.rules.sampling import nearest_upsample_2x
from gn_patch.surgeon import PatchReport, patch_model, unpatch_model
from .tiny_models import (KERNEL_OPS, OpCounter, assert_same_outputs, controlnet_inputs, is_channels_last, make_model,
                          module_types, outputs, perturb_, randn, rel_l2, sd15_unet_inputs, sdxl_unet_inputs,
                          svd_unet_inputs, tiny_controlnet, tiny_sd15_unet, tiny_sdxl_unet, tiny_svd_unet, tiny_vae)


@torch.no_grad()
def patched_matches(model: nn.Module, run, tol: float = 1e-5, **patch_kwargs):
    """Patch a copy of ``model``; assert ``run(copy)`` matches ``run(model)``. Returns (copy, report)."""
    expected = run(model)
    patched = copy.deepcopy(model)
    report = patch_model(patched, **patch_kwargs)
    assert_same_outputs(run(patched), expected, tol)
    return patched, report


def kinds(entries) -> Counter:
    return Counter(kind for _, kind in entries)


# ------------------------------------------------------------------------------------------------
# Blocks
# ------------------------------------------------------------------------------------------------
RESNET_CASES = {
    "default": dict(),
    "scale_shift": dict(time_embedding_norm="scale_shift"),
    "up_conv_shortcut": dict(out_channels=16, up=True),
    "up_fir": dict(up=True, kernel="fir"),
    "down": dict(down=True, use_in_shortcut=True),
    "down_sde_vp": dict(down=True, kernel="sde_vp"),
    "skip_time_act_scale_groups_out": dict(out_channels=48, groups_out=4, skip_time_act=True, output_scale_factor=2.0),
    "no_temb": dict(temb_channels=None),
    "gelu": dict(non_linearity="gelu"),
    "relu": dict(non_linearity="relu"),
}


def make_resnet(seed: int = 0, **kwargs) -> ResnetBlock2D:
    return make_model(ResnetBlock2D, dict(dict(in_channels=32, temb_channels=16, groups=8), **kwargs), seed)


def run_resnet(block: ResnetBlock2D, batch: int = 2):
    temb = randn(batch, 16, seed=1) if block.time_emb_proj is not None else None
    return lambda m: m(randn(batch, 32, 8, 8), temb)


@pytest.mark.parametrize("case", RESNET_CASES)
def test_resnet_block_2d(case):
    block = make_resnet(**RESNET_CASES[case])
    patched, report = patched_matches(block, run_resnet(block))
    assert type(patched) is rules.fusion._FusedResnetBlock2D and isinstance(patched, ResnetBlock2D)
    assert isinstance(patched.norm1, GroupNormAct) and patched.norm1.activation == rules.base.activation_name(
        block.nonlinearity)
    norm2 = "ResnetBlock2D.norm2+scale_shift+act" if case == "scale_shift" else "ResnetBlock2D.norm2+act"
    assert kinds(report.patched) == {"ResnetBlock2D.norm1+act": 1, norm2: 1}
    assert patched.norm2.activation == patched.norm1.activation
    assert report.skipped == [] and report.alone == []


@pytest.mark.parametrize("temb", [0.5, 2, torch.tensor(0.25)])
def test_resnet_block_2d_number_temb(temb, host_path):
    """A block without time_emb_proj adds temb as it is given, a Python number or a 0-dim tensor too
    (`hidden_states + temb`): patched, norm2 takes it as its input offset, with stock's values."""
    block = make_resnet(temb_channels=None)
    patched_matches(block, lambda m: m(randn(2, 32, 8, 8), temb))


@pytest.mark.parametrize("when", ["before_patching", "after_patching", "global"])
def test_resnet_block_norm2_pre_hooks_see_the_timestep_sum(when, host_path):
    """norm2's forward pre-hooks (its own, registered before or after patching, or global ones) see
    hidden_states + temb, as in stock, and what they return is normalised: the block keeps the add for them."""
    block = make_resnet()
    patched = copy.deepcopy(block)
    seen = {"stock": [], "patched": []}

    def hook(key):
        def record(module, args):
            if isinstance(module, nn.GroupNorm):
                seen[key].append(args[0].clone())
                return (args[0] * 2,)
            return None
        return record

    x, temb = randn(2, 32, 8, 8), randn(2, 16, seed=1)
    if when == "global":
        patch_model(patched)
        handles = []
        try:
            for key, model in (("stock", block), ("patched", patched)):
                handles.append(torch.nn.modules.module.register_module_forward_pre_hook(hook(key)))
                with torch.no_grad():
                    outputs = model(x, temb)
                handles.pop().remove()
                seen[key + "_out"] = outputs
        finally:
            for handle in handles:
                handle.remove()
        assert_same_outputs(seen["patched_out"], seen["stock_out"], 1e-5)
    else:
        block.norm2.register_forward_pre_hook(hook("stock"))
        if when == "before_patching":
            patched.norm2.register_forward_pre_hook(hook("patched"))
        patch_model(patched)
        if when == "after_patching":
            patched.norm2.register_forward_pre_hook(hook("patched"))
        with torch.no_grad():
            assert_same_outputs(patched(x, temb), block(x, temb), 1e-5)
    assert len(seen["patched"]) == len(seen["stock"]) > 0
    for got, want in zip(seen["patched"], seen["stock"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_resnet_block_2d_upsample_large_batch():
    """Batches of 64+ take diffusers' contiguous() detour before upsampling."""
    block = make_resnet(up=True)
    patched, _ = patched_matches(block, run_resnet(block, batch=64))
    assert patched.norm1.activation == "silu"


@pytest.mark.parametrize("case", ["default", "scale_shift"])
def test_patched_forward_uses_the_fused_activation(case):
    """The output depends on norm1's (and norm2's) activation: the patched forward does not apply the block's
    nonlinearity after a fused norm. Guards the equality tests against a forward that ignores the fusion."""
    block = make_resnet(**RESNET_CASES[case])
    run = run_resnet(block)
    patched = copy.deepcopy(block)
    patch_model(patched)
    fused = [patched.norm1] + ([patched.norm2] if case == "default" else [])
    with torch.no_grad():
        expected = run(block)
        for norm in fused:
            norm.activation = "identity"
            assert rel_l2(run(patched), expected) > 1e-3
            norm.activation = "silu"
            assert rel_l2(run(patched), expected) < 1e-6


@pytest.mark.parametrize("case", ["default", "skip_time_act_scale_groups_out"])
def test_resnet_block_divides_by_output_scale_factor_only_when_not_one(case):
    """The patched block skips the residual sum's division by an output_scale_factor of 1.0 (x / 1.0 is x), and
    divides by any other factor as stock does; the outputs match stock in both cases (test_resnet_block_2d)."""
    block = make_resnet(**RESNET_CASES[case])
    run = run_resnet(block)
    patched = copy.deepcopy(block)
    patch_model(patched)
    divisions = []
    for model in (block, patched):
        with torch.no_grad(), OpCounter() as ops:
            run(model)
        divisions.append(sum(n for name, n in ops.calls.items() if name.startswith("aten::div")))
    assert divisions[0] - divisions[1] == (1 if block.output_scale_factor == 1.0 else 0)


class _OpArguments(TorchDispatchMode):
    """Records the arguments of every call of the named ops."""

    def __init__(self, *names: str) -> None:
        super().__init__()
        self.names, self.calls = names, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in self.names:
            self.calls.append((func._schema.name, args))
        return func(*args, **(kwargs or {}))


def _run_resnet_recording(conv1_wrapped: str | None, device: str, dtype: torch.dtype, block_kwargs=None,
                          grad: bool = False):
    """Patch a ResnetBlock2D (make_resnet(**block_kwargs); conv1 wrapped as named after patching), call it on
    channels-last input; return (output, stock output, whether conv1's wrapper ran, the biases its convolutions were
    called with (conv1, conv2), the input offsets and input biases of norm1's and norm2's kernels' op calls)."""
    block = make_resnet(**(block_kwargs or {})).to(device, dtype)
    if conv1_wrapped == "bias_none":
        block.conv1.bias = None
    patched = copy.deepcopy(block)
    patch_model(patched)
    fired = []
    if conv1_wrapped == "hook":
        patched.conv1.register_forward_hook(lambda *_: fired.append(True))
    elif conv1_wrapped == "instance_forward":
        plain = patched.conv1.forward
        patched.conv1.forward = lambda x: fired.append(True) or plain(x)
    elif conv1_wrapped == "norm2_pre_hook":
        patched.norm2.register_forward_pre_hook(lambda *_: fired.append(True))
    x = randn(2, 32, 8, 8).to(device, dtype, memory_format=torch.channels_last)
    temb = randn(2, block.time_emb_proj.in_features, seed=1).to(device, dtype) if block.time_emb_proj else None
    with torch.set_grad_enabled(grad), _OpArguments(*KERNEL_OPS, "aten::convolution") as recorded:
        y = patched(x.requires_grad_(grad), temb)
    with torch.no_grad():
        expected = block(x, temb)
    biases = [args[2] for name, args in recorded.calls if name == "aten::convolution"]
    terms = [tuple(args[i] if len(args) > i else None for i in (8, 9))
             for name, args in recorded.calls if name in KERNEL_OPS]
    return y, expected, bool(fired), biases, terms


WRAPPED = [None, "hook", "instance_forward", "bias_none", "norm2_pre_hook"]


@pytest.mark.parametrize("conv1_wrapped", WRAPPED)
def test_resnet_block_timestep_joins_norm2(conv1_wrapped, kernel_path_on_cpu):
    """The timestep embedding of a time_embedding_norm="default" block reaches norm2's kernels as their (N, C) input
    offset (unless norm2 has pre-hooks); on the CPU conv1 keeps its bias (oneDNN adds it inside the convolution)."""
    y, expected, fired, biases, terms = _run_resnet_recording(conv1_wrapped, "cpu", torch.float32)
    assert_same_outputs(y, expected, 1e-5)
    assert fired == (conv1_wrapped in ("hook", "instance_forward", "norm2_pre_hook"))
    assert [b is None for b in biases] == [conv1_wrapped == "bias_none", False]  # conv1, conv2
    offset, bias = terms[1]  # norm2's
    assert terms[0] == (None, None) and bias is None
    assert (offset is None) == (conv1_wrapped == "norm2_pre_hook")
    assert offset is None or offset.shape == (2, 32)


def _fold_case(case: str):
    """A patched default ResnetBlock2D set up as ``case`` names, and a stand-in for a CUDA input (the predicate reads
    its is_cuda and requires_grad only); returns (block, input, undo)."""
    from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module
    block = make_resnet()
    patch_model(block)
    undo = lambda: None
    if case == "bias_none":
        block.conv1.bias = None
    elif case == "groups":
        block.conv1.groups = 2
    elif case == "bias_dtype":
        block.conv1.bias.data = block.conv1.bias.data.double()
    elif case == "conv1_hook":
        block.conv1.register_forward_hook(lambda *_: None)
    elif case == "norm2_forward_hook":
        block.norm2.register_forward_hook(lambda *_: None)
    elif case == "norm2_instance_forward":
        block.norm2.forward = lambda *args, **kwargs: None
    elif case == "accelerate_hook":
        add_hook_to_module(block.conv1, ModelHook())
    elif case == "accelerate_hook_removed":
        remove_hook_from_module(add_hook_to_module(block.conv1, ModelHook()))
    elif case == "class_forward":  # as LoRA loaders patch it
        original = nn.Conv2d.forward
        nn.Conv2d.forward = lambda self, x: original(self, x)
        undo = lambda: setattr(nn.Conv2d, "forward", original)
    elif case == "instance_conv_forward":
        block.conv1._conv_forward = lambda x, w, b: None
    elif case == "global_hook":
        undo = torch.nn.modules.module.register_module_forward_hook(lambda *_: None).remove
    return block, SimpleNamespace(is_cuda=True, requires_grad=case == "grad"), undo


FOLDS = {"plain": True, "accelerate_hook_removed": True, "bias_none": False, "groups": False, "bias_dtype": False,
         "conv1_hook": False, "norm2_forward_hook": False, "norm2_instance_forward": False, "accelerate_hook": False,
         "class_forward": False, "instance_conv_forward": False, "global_hook": False, "grad": False, "cpu": False}


@pytest.mark.parametrize("case", FOLDS)
def test_conv1_bias_folds_only_where_stock_values_follow(case):
    """conv1's bias joins norm2 only where the convolution without it plus the kernels' add give stock's values and
    nothing else would see the difference: a plain nn.Conv2d with PyTorch's forward, no hooks or instance forwards on
    conv1 or norm2 (accelerate's removed hook leaves the bound class forward: still folds), a bias of the weight's
    dtype, no gradient recorded, a CUDA input."""
    block, x, undo = _fold_case(case)
    if case == "cpu":
        x = randn(2, 32, 8, 8)
    try:
        with torch.set_grad_enabled(case == "grad"):
            assert rules.resnet.conv1_bias_folds(block, x) == FOLDS[case]
        with torch.backends.cudnn.flags(enabled=False):
            assert not rules.resnet.conv1_bias_folds(block, x)
    finally:
        undo()


def test_resnet_block_norm2_forward_hooks_see_stocks_input(host_path):
    """A forward hook on norm2 sees the input stock's norm2 gets, hidden_states + temb: the block keeps the add."""
    block = make_resnet()
    patched = copy.deepcopy(block)
    patch_model(patched)
    seen = []
    for model in (block, patched):
        model.norm2.register_forward_hook(lambda module, args, output: seen.append(args[0].clone()))
    x, temb = randn(2, 32, 8, 8), randn(2, 16, seed=1)
    with torch.no_grad():
        assert_same_outputs(patched(x, temb), block(x, temb), 1e-5)
    torch.testing.assert_close(seen[1], seen[0], rtol=1e-5, atol=1e-6)


# time_embedding_norm of the blocks: "default" with a timestep (UNets) or without (VAE encoders, the VAE decoders' mid
# blocks), "group" (the VAE decoders' up blocks), "scale_shift" (Kandinsky 2.2, DeepFloyd IF).
BLOCK_MODES = {"default": {}, "default_no_temb": dict(temb_channels=None),
               "group": dict(temb_channels=None, time_embedding_norm="group"),
               "scale_shift": dict(time_embedding_norm="scale_shift")}


@pytest.mark.gpu
@pytest.mark.parametrize("mode", BLOCK_MODES)
@pytest.mark.parametrize("conv1_wrapped", WRAPPED)
def test_resnet_block_conv1_bias_joins_norm2_cuda(conv1_wrapped, mode):
    """On CUDA, conv1 runs without its bias, which norm2's kernels add (before the timestep offset where there is
    one); where a call of conv1 would do more than its forward (a hook, a forward set on the instance as accelerate's
    offloading sets it), norm2 has pre-hooks or conv1 has no bias, conv1 is called as it is. The output is the same
    bit for bit either way (the kernels round each add as PyTorch's), and within fp16 rounding of stock's."""
    kwargs = BLOCK_MODES[mode]
    y, expected, fired, biases, terms = _run_resnet_recording(conv1_wrapped, "cuda", torch.float16, kwargs)
    assert_same_outputs(y, expected, 4e-3)
    assert fired == (conv1_wrapped in ("hook", "instance_forward", "norm2_pre_hook"))
    folded = conv1_wrapped is None
    # conv1's bias folded into norm2, conv2's into the residual sum (test_resnet_block_conv2_bias_joins_residual_sum)
    assert [b is None for b in biases] == [folded or conv1_wrapped == "bias_none", True]  # conv1, conv2
    offset, bias = terms[1]
    assert (bias is not None) == folded and (bias is None or bias.shape == (32,))
    assert (offset is not None) == (mode == "default" and conv1_wrapped != "norm2_pre_hook")
    if conv1_wrapped in ("hook", "instance_forward"):  # not folded: the same output as the folded block's
        assert torch.equal(y, _run_resnet_recording(None, "cuda", torch.float16, kwargs)[0])


CONV2_FOLDS = {"plain": True, "shortcut": True, "factor_2": False, "factor_tensor": False, "conv2_hook": False,
               "bias_none": False, "grad": False}


def _conv2_case(case: str, device: str):
    """A patched default ResnetBlock2D (fp16 on CUDA) set up as ``case`` names and its channels-last input."""
    block = make_resnet(out_channels=48 if case == "shortcut" else None)
    if case == "bias_none":
        block.conv2.bias = None
    block = block.to(device, torch.float16 if device == "cuda" else torch.float32)
    patch_model(block)
    if case == "factor_2":
        block.output_scale_factor = 2.0
    elif case == "factor_tensor":
        block.output_scale_factor = torch.tensor(1.0, device=device)
    elif case == "conv2_hook":
        block.conv2.register_forward_hook(lambda *_: None)
    x = randn(2, 32, 8, 8).to(device, block.conv1.weight.dtype, memory_format=torch.channels_last)
    return block, x.requires_grad_(case == "grad")


@pytest.mark.parametrize("case", CONV2_FOLDS)
def test_conv2_bias_folds_only_where_stock_values_follow(case, monkeypatch):
    """conv2's bias joins the residual sum only where conv1's would join norm2 (conv_bias_folds: same conditions on
    conv2 and the input), output_scale_factor is the number 1.0 and the kernels are loaded."""
    monkeypatch.setattr(extension, "kernels_available", lambda: True)
    block, x = _conv2_case(case, "cpu")
    cuda_like = SimpleNamespace(is_cuda=True, requires_grad=x.requires_grad)
    with torch.set_grad_enabled(case == "grad"):
        assert rules.resnet.conv2_bias_folds(block, cuda_like) == CONV2_FOLDS[case]
        assert not rules.resnet.conv2_bias_folds(block, x)  # a CPU input
    monkeypatch.setattr(extension, "kernels_available", lambda: False)
    assert not rules.resnet.conv2_bias_folds(block, cuda_like)


def test_compiled_modules_do_not_run_forward_only():
    conv = nn.Conv2d(4, 4, 1)
    assert rules.base.runs_forward_only(conv)
    conv.compile()
    assert not rules.base.runs_forward_only(conv)


@pytest.mark.parametrize("residual_grad", [False, True], ids=["no_grad", "trainable_shortcut"])
def test_resnet_block_conv2_bias_folded_gives_stocks_values(residual_grad, monkeypatch):
    """With the fold forced on the CPU (the op is then its two PyTorch adds), a patched block computes stock's output;
    where only the residual records a gradient (a trainable conv_shortcut beside a frozen block), residual_sum_with_bias
    takes PyTorch's adds and the shortcut's gradients are stock's."""
    monkeypatch.setattr(rules.resnet, "conv2_bias_folds", lambda block, hidden_states: True)
    block = make_resnet(out_channels=48)
    for p in block.parameters():
        p.requires_grad_(False)
    block.conv_shortcut.weight.requires_grad_(residual_grad)
    patched = copy.deepcopy(block)
    patch_model(patched)
    x, temb = randn(2, 32, 8, 8), randn(2, 16, seed=1)
    outputs, grads = [], []
    for model in (block, patched):
        with torch.set_grad_enabled(residual_grad), \
                _OpArguments("gn_patch::bias_residual_add", "aten::convolution") as recorded:
            out = model(x, temb)
        outputs.append(out)
        if residual_grad:
            (out * randn(*out.shape, seed=2)).sum().backward()
            grads.append(model.conv_shortcut.weight.grad)
        if model is patched:
            assert sum(name == "gn_patch::bias_residual_add" for name, _ in recorded.calls) == (not residual_grad)
            assert [args[2] for name, args in recorded.calls if name == "aten::convolution"][1] is None  # conv2's
    assert_same_outputs(outputs[1], outputs[0], 1e-5)
    if residual_grad:
        assert rel_l2(grads[1], grads[0]) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("case", CONV2_FOLDS)
def test_resnet_block_conv2_bias_joins_residual_sum_cuda(case):
    """On CUDA, conv2 runs without its bias and gn_patch::bias_residual_add adds it with the residual in one pass,
    where conv2_bias_folds holds: the block's output is bit for bit the one it gives with conv2 run as it is (a
    forward hook on conv2 turns the fold off), since the op rounds both adds as PyTorch's."""
    block, x = _conv2_case(case, "cuda")
    unfolded = copy.deepcopy(block)
    unfolded.conv2.register_forward_hook(lambda *_: None)
    temb = randn(2, 16, seed=1).to("cuda", torch.float16)
    with torch.set_grad_enabled(case == "grad"), \
            _OpArguments("gn_patch::bias_residual_add", "aten::convolution") as recorded:
        y = block(x, temb)
    with torch.set_grad_enabled(case == "grad"):
        expected = unfolded(x, temb)
    folded = CONV2_FOLDS[case]
    assert sum(name == "gn_patch::bias_residual_add" for name, _ in recorded.calls) == folded
    conv2_bias = [args[2] for name, args in recorded.calls if name == "aten::convolution"][1]
    assert (conv2_bias is None) == (folded or case == "bias_none")
    assert torch.equal(y, expected) and y.stride() == expected.stride()


@pytest.mark.gpu
def test_resnet_block_conv1_keeps_its_bias_under_autograd_cuda():
    """A call that records gradients (fine-tuning) runs conv1 as it is: the adds would be PyTorch's anyway."""
    y, expected, _, biases, terms = _run_resnet_recording(None, "cuda", torch.float16, grad=True)
    assert [b is None for b in biases] == [False, False] and terms[1][1] is None
    assert_same_outputs(y.detach(), expected, 4e-3)


@pytest.mark.gpu
def test_resnet_block_without_channels_last_is_bit_identical_cuda():
    """patch_model(channels_last=False) on CUDA: conv1's output is NCHW and the norms take PyTorch's path, which
    adds conv1's bias and temb as stock adds them: stock's output bit for bit."""
    block = make_resnet().to("cuda", torch.float16)
    patched = copy.deepcopy(block)
    patch_model(patched, channels_last=False)
    x, temb = randn(2, 32, 8, 8).to("cuda", torch.float16), randn(2, 16, seed=1).to("cuda", torch.float16)
    with torch.no_grad():
        assert torch.equal(patched(x, temb), block(x, temb))


def test_resnet_block_divides_by_a_tensor_output_scale_factor():
    """A tensor output_scale_factor (set by hand, here a Parameter of 1.0) divides as stock does: the patched
    block's output and the factor's gradient match stock's."""
    block = make_resnet(**RESNET_CASES["default"])
    block.output_scale_factor = torch.nn.Parameter(torch.tensor(1.0, dtype=torch.float64))
    run = run_resnet(block)
    patched = copy.deepcopy(block)
    patch_model(patched)
    outputs = []
    for model in (block, patched):
        out = run(model)
        out.sum().backward()
        outputs.append((out, model.output_scale_factor.grad))
    assert outputs[1][0].dtype == outputs[0][0].dtype
    assert rel_l2(outputs[1][0], outputs[0][0]) < 1e-6
    assert outputs[1][1] is not None and torch.allclose(outputs[1][1], outputs[0][1], rtol=1e-4)


@pytest.mark.parametrize("statement", ["y = x + 1", "y = x / self.output_scale_factor / self.output_scale_factor"])
def test_unscaled_rewrite_needs_exactly_one_division(statement):
    with pytest.raises(rules.fusion.RuleError, match=r"divisions by self\.output_scale_factor"):
        rules.fusion.unscaled(statement)


def test_deprecated_scale_argument_warns_like_stock():
    block = make_resnet()
    patched = copy.deepcopy(block)
    patch_model(patched)
    messages = []
    for model in (block, patched):
        with pytest.warns(FutureWarning) as record, torch.no_grad():
            model(randn(1, 32, 4, 4), randn(1, 16), scale=0.5)
        messages.append([str(w.message) for w in record])
    assert messages[0] == messages[1]


def test_resnet_block_2d_training_gradients():
    """In training mode (diffusers' contiguous() before conv_shortcut) forward and gradients match."""
    block = make_resnet(out_channels=48).train()
    patched = copy.deepcopy(block)
    patch_model(patched)
    grads = []
    for model in (block, patched):
        x = randn(2, 32, 8, 8).requires_grad_()
        out = model(x, randn(2, 16, seed=1))
        (out * randn(*out.shape, seed=2)).sum().backward()
        grads.append([x.grad] + [p.grad for p in model.parameters()])
    for actual, expected in zip(grads[1], grads[0]):
        assert rel_l2(actual, expected) < 1e-5


def test_unsupported_nonlinearity_runs_the_norms_alone():
    block = make_resnet()
    block.nonlinearity = nn.Tanh()
    patched, report = patched_matches(block, run_resnet(block))
    assert type(patched) is ResnetBlock2D
    assert report.patched == [] and report.skipped == [] and [name for name, _ in report.alone] == ["norm1", "norm2"]
    assert all("Tanh" in reason for _, reason in report.alone)
    assert type(patched.norm1) is rules.base.StockLayoutGroupNorm and patched.norm1.activation == "identity"
    # Named GroupNormAct, it takes GroupNormAct's arguments: frames_last gives a 5-D input's (N, H, W, F, C) order.
    x = randn(2, block.norm1.num_channels, 3, 4, 4)
    y = patched.norm1(x, frames_last=True)
    assert y.permute(0, 3, 4, 2, 1).is_contiguous() and torch.equal(y, patched.norm1(x))


def test_temporal_resnet_block_5d():
    block = make_model(TemporalResnetBlock, dict(in_channels=64, out_channels=64, temb_channels=16))
    patched, report = patched_matches(block, lambda m: m(randn(2, 64, 3, 4, 4), randn(2, 3, 16, seed=1)))
    assert kinds(report.patched) == {"TemporalResnetBlock.norm1+act": 1, "TemporalResnetBlock.norm2+act": 1}
    assert type(patched) is rules.fusion._FusedTemporalResnetBlock


def test_unet_mid_block_2d():
    block = make_model(UNetMidBlock2D, dict(in_channels=32, temb_channels=16, resnet_groups=8, attention_head_dim=8))
    _, report = patched_matches(block, lambda m: m(randn(2, 32, 8, 8), randn(2, 16, seed=1)))
    assert kinds(report.patched) == {"ResnetBlock2D.norm1+act": 2, "ResnetBlock2D.norm2+act": 2,
                                     "attention.group_norm": 1}
    assert report.skipped == []


def test_attention_group_norm():
    attention = make_model(Attention, dict(query_dim=32, heads=2, dim_head=16, norm_num_groups=8, bias=True,
                                           residual_connection=True, upcast_softmax=True,
                                           _from_deprecated_attn_block=True))
    patched, report = patched_matches(attention, lambda m: m(randn(2, 32, 4, 4)))
    assert report.patched == [("group_norm", "attention.group_norm")]
    assert patched.group_norm.activation == "identity"


def test_transformer_2d_norm():
    transformer = make_model(Transformer2DModel, dict(num_attention_heads=2, attention_head_dim=8, in_channels=16,
                                                      norm_num_groups=4, cross_attention_dim=16))
    _, report = patched_matches(transformer, lambda m: m(randn(2, 16, 4, 4), encoder_hidden_states=randn(2, 5, 16)))
    assert report.patched == [("norm", "Transformer2DModel.norm")]


def test_sequential_pairs():
    seq = perturb_(nn.Sequential(
        nn.GroupNorm(4, 16), nn.SiLU(), nn.Conv2d(16, 16, 3, padding=1),
        nn.GroupNorm(4, 16), nn.GELU(approximate="tanh"),
        nn.GroupNorm(4, 16), nn.GELU(),
        nn.GroupNorm(4, 16), nn.ReLU(inplace=True),
        nn.GroupNorm(4, 16), nn.Mish(),
        nn.GroupNorm(4, 16), nn.Conv2d(16, 16, 1),
        nn.GroupNorm(4, 16),
    ))
    patched, report = patched_matches(seq, lambda m: m(randn(2, 16, 6, 6)))
    assert report.patched == [(str(i), "Sequential(GroupNorm, act)") for i in (0, 3, 5, 7, 9)]
    assert [patched[i].activation for i in (0, 3, 5, 7, 9)] == ["silu", "gelu_tanh", "gelu", "relu", "mish"]
    assert [name for name, _ in report.alone] == ["11", "13"] and report.skipped == []
    assert "Conv2d" in report.alone[0][1] and "does not know what follows" in report.alone[1][1]


def test_sequential_with_named_items():
    seq = perturb_(nn.Sequential(OrderedDict(norm=nn.GroupNorm(2, 8), act=nn.SiLU(), conv=nn.Conv2d(8, 4, 1))))
    patched, report = patched_matches(seq, lambda m: m(randn(2, 8, 4, 4)))
    assert report.patched == [("norm", "Sequential(GroupNorm, act)")]
    assert list(dict(patched.named_children())) == ["norm", "act", "conv"]


# ------------------------------------------------------------------------------------------------
# Whole models
# ------------------------------------------------------------------------------------------------
def test_sd15_unet():
    unet = tiny_sd15_unet()
    patched, report = patched_matches(unet, lambda m: m(**sd15_unet_inputs()))
    assert kinds(report.patched) == {"ResnetBlock2D.norm1+act": 8, "ResnetBlock2D.norm2+act": 8,
                                     "Transformer2DModel.norm": 4, "conv_norm_out+conv_act": 1}
    assert report.skipped == [] and report.already_patched == []
    assert report.channels_last == sum(1 for m in unet.modules() if isinstance(m, nn.Conv2d))
    assert isinstance(patched.conv_act, nn.Identity)
    assert patched.conv_in.weight.is_contiguous(memory_format=torch.channels_last)


def test_conv_weights_get_the_strides_model_to_channels_last_gives():
    # 1x1 weights included: contiguous, they pass is_contiguous(memory_format=channels_last), but cuDNN and the CPU
    # convolutions choose their output layout from the strides.
    unet = tiny_sd15_unet()
    reference = copy.deepcopy(unet).to(memory_format=torch.channels_last)
    patch_model(unet)
    for (name, weight), (_, expected) in zip(unet.named_parameters(), reference.named_parameters()):
        assert weight.stride() == expected.stride(), name
    unpatch_model(unet)
    for name, weight in unet.named_parameters():
        assert weight.stride() == torch.empty_like(weight, memory_format=torch.contiguous_format).stride(), name


# ------------------------------------------------------------------------------------------------
# Upsample2D: nearest upsampling of channels-last activations by a broadcast copy
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_nearest_upsample_2x_is_interpolate_bitwise(dtype):
    x = randn(2, 8, 5, 7).to(dtype).contiguous(memory_format=torch.channels_last)
    x[0, 3, 1, 2], x[1, 0, 4, 6] = float("nan"), float("-inf")
    expected = torch.nn.functional.interpolate(x, scale_factor=2.0, mode="nearest")
    got = nearest_upsample_2x(x)
    assert got.stride() == expected.stride() and torch.equal(got.nan_to_num(), expected.nan_to_num())
    assert torch.equal(got.isnan(), expected.isnan())


def test_upsample_2d_switches_class_and_back():
    upsample = make_model(Upsample2D, dict(channels=8, use_conv=True))
    x = randn(2, 8, 5, 7).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        expected, sized = upsample(x), upsample(x, output_size=(10, 15))
        patch_model(upsample, channels_last=False)
        assert type(upsample) is not Upsample2D and type(upsample).__name__ == "Upsample2D"
        assert torch.equal(upsample(x), expected) and torch.equal(upsample(x, output_size=(10, 15)), sized)
    unpatch_model(upsample)
    assert type(upsample) is Upsample2D


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_upsample_2d_copies_channels_last_cuda(dtype):
    """On channels-last CUDA input without a gradient, the patched Upsample2D copies in place of PyTorch's
    channels-last kernel: bitwise its values and layout. NCHW input, or one that needs a gradient, takes stock's."""
    upsample = make_model(Upsample2D, dict(channels=16)).cuda()
    x = randn(2, 16, 9, 11).cuda().to(dtype)
    patch_model(upsample, channels_last=False)
    for layout, grad, copies in ((torch.channels_last, False, True), (torch.contiguous_format, False, False),
                                 (torch.channels_last, True, False)):
        inp = x.contiguous(memory_format=layout).requires_grad_(grad)
        expected = torch.nn.functional.interpolate(inp, scale_factor=2.0, mode="nearest")
        with OpCounter() as counter:
            got = upsample(inp)
        assert (counter.calls["aten::upsample_nearest2d"] == 0) == copies, counter.calls
        assert torch.equal(got, expected) and got.stride() == expected.stride()


def test_accelerate_offloaded_conv_weights_are_reported_not_converted():
    # cpu_offload (enable_sequential_cpu_offload) keeps each weight in its hook and loads that copy on every call: a
    # layout given to the module's placeholder would be lost, so patch_model says so instead of counting it.
    from accelerate import cpu_offload
    unet = tiny_sd15_unet()
    with torch.no_grad():
        expected = unet(**sd15_unet_inputs())
    cpu_offload(unet, execution_device=torch.device("cpu"))
    report = patch_model(unet)
    convs = sum(1 for m in unet.modules() if isinstance(m, nn.Conv2d))
    assert report.channels_last == 0 and len(report.layout_kept) == convs
    assert all("offloaded by accelerate" in reason for _, reason in report.layout_kept)
    with torch.no_grad():
        assert_same_outputs(unet(**sd15_unet_inputs()), expected, 1e-5)


def test_training_mode_keeps_every_norm_input_channels_last():
    # diffusers' resnets call conv_shortcut(input_tensor.contiguous()) in training mode: with NCHW-strided 1x1
    # weights that conv returned NCHW and the blocks after it ran NCHW (6 of the tiny UNet's 21 norms).
    unet = tiny_sd15_unet()
    patch_model(unet)
    layouts = []
    for module in unet.modules():
        if isinstance(module, GroupNormAct):
            module.register_forward_pre_hook(
                lambda m, args: layouts.append(args[0].is_contiguous(memory_format=torch.channels_last)))
    unet.train()(**sd15_unet_inputs())[0].sum().backward()
    assert len(layouts) == 21 and all(layouts), layouts


def test_sdxl_unet_text_time():
    unet = tiny_sdxl_unet()
    _, report = patched_matches(unet, lambda m: m(**sdxl_unet_inputs()))
    assert report.counts["Transformer2DModel.norm"] == 4 and report.counts["conv_norm_out+conv_act"] == 1
    assert report.skipped == []


@pytest.mark.parametrize("time_scale_shift", ["default", "scale_shift"])
def test_unet_2d_model(time_scale_shift):
    unet = make_model(UNet2DModel, dict(sample_size=16, block_out_channels=(32, 64), layers_per_block=1,
                                        norm_num_groups=8, attention_head_dim=8,
                                        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                                        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
                                        resnet_time_scale_shift=time_scale_shift))
    run = lambda m: m(randn(2, 3, 16, 16), torch.tensor([3, 900]))
    patched, report = patched_matches(unet, run)
    again = patch_model(patched)
    assert again.patched == [] and again.already_patched == report.patched
    assert report.skipped == report.alone == again.skipped == again.alone == []
    resnets = sum(isinstance(m, ResnetBlock2D) for m in unet.modules())
    assert report.counts["ResnetBlock2D.norm1+act"] == resnets
    assert report.counts["conv_norm_out+conv_act"] == 1
    norm2 = "ResnetBlock2D.norm2+act" if time_scale_shift == "default" else "ResnetBlock2D.norm2+scale_shift+act"
    assert report.counts[norm2] == resnets


def test_autoencoder_kl_encode_decode():
    vae = tiny_vae()
    _, report = patched_matches(vae, lambda m: m.encode(randn(2, 3, 32, 32)).latent_dist)
    assert report.counts["conv_norm_out+conv_act"] == 2  # encoder and decoder
    assert report.counts["attention.group_norm"] == 2  # their mid blocks
    assert report.skipped == []
    patched_matches(vae, lambda m: m.decode(randn(2, 4, 16, 16)).sample)


def test_controlnet():
    controlnet = tiny_controlnet()
    _, report = patched_matches(controlnet, lambda m: m(**controlnet_inputs()))
    resnets = sum(isinstance(m, ResnetBlock2D) for m in controlnet.modules())
    assert report.counts["ResnetBlock2D.norm2+act"] == resnets and report.skipped == []


def test_multi_controlnet():
    multi = MultiControlNetModel([tiny_controlnet(), make_model(ControlNetModel, configs.TINY_CONTROLNET, seed=1)])
    inputs = controlnet_inputs()
    cond = inputs.pop("controlnet_cond")
    del inputs["conditioning_scale"]
    # return_dict=False as pipelines call it: with True, MultiControlNetModel (0.42.1) unpacks each net's output
    # dict into its key names.
    _, report = patched_matches(multi, lambda m: m(**inputs, controlnet_cond=[cond, cond.flip(0)],
                                                   conditioning_scale=[0.5, 1.0], return_dict=False))
    per_net = Counter(name.split(".")[1] for name, _ in report.patched)
    assert per_net == {"0": per_net["0"], "1": per_net["0"]} and per_net["0"] > 0


@pytest.mark.parametrize("channels_last_3d", [True, False])
def test_spatio_temporal_unet_conv3d_weights(channels_last_3d):
    """Conv3d weights become channels_last_3d unless asked not to; unpatch_model makes them contiguous again."""
    unet = tiny_svd_unet()
    assert any(isinstance(m, nn.Conv3d) for m in unet.modules())
    patched, report = patched_matches(unet, lambda m: m(**svd_unet_inputs()), channels_last_3d=channels_last_3d)
    assert report.counts["TemporalResnetBlock.norm1+act"] >= 1 and report.counts["conv_norm_out+conv_act"] == 1
    conv3d = [m.weight for m in patched.modules() if isinstance(m, nn.Conv3d)]
    assert all(w.is_contiguous(memory_format=torch.channels_last_3d) == channels_last_3d for w in conv3d)
    unpatch_model(patched)
    assert all(w.is_contiguous() for w in conv3d)


def test_channels_last_false_converts_no_weight():
    """channels_last=False leaves every conv weight as it is, the Conv3d ones too (channels_last_3d applies with
    channels_last True only)."""
    unet = tiny_svd_unet()
    report = patch_model(unet, channels_last=False)
    assert report.channels_last == 0
    convs = [m for m in unet.modules() if isinstance(m, (nn.Conv2d, nn.Conv3d))]
    assert any(isinstance(m, nn.Conv3d) for m in convs) and all(m.weight.is_contiguous() for m in convs)


# ------------------------------------------------------------------------------------------------
# Checkpoints, idempotence, reversibility
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [tiny_sd15_unet, tiny_vae])
def test_state_dict_unchanged_and_loads_both_ways(make):
    stock = make()
    patched = copy.deepcopy(stock)
    patch_model(patched)
    stock_sd, patched_sd = stock.state_dict(), patched.state_dict()
    assert list(stock_sd) == list(patched_sd)
    assert all(stock_sd[k].shape == patched_sd[k].shape and torch.equal(stock_sd[k], patched_sd[k])
               for k in stock_sd)
    other = make_model(type(stock), dict(stock.config), seed=5)
    patch_model(other)
    other.load_state_dict(stock_sd, strict=True)
    assert all(torch.equal(v, stock_sd[k]) for k, v in other.state_dict().items())
    fresh = make_model(type(stock), dict(stock.config), seed=6)
    fresh.load_state_dict(patched_sd, strict=True)
    assert all(torch.equal(v, stock_sd[k]) for k, v in fresh.state_dict().items())


def test_save_pretrained_loads_into_stock_diffusers(tmp_path):
    stock = tiny_sd15_unet()
    patched = copy.deepcopy(stock)
    patch_model(patched)
    patched.save_pretrained(tmp_path)
    loaded = UNet2DConditionModel.from_pretrained(tmp_path).eval()
    assert module_types(loaded) == module_types(stock)
    with torch.no_grad():
        assert torch.equal(loaded(**sd15_unet_inputs()).sample, stock(**sd15_unet_inputs()).sample)


def test_patching_twice_changes_nothing_more():
    unet = tiny_sd15_unet()
    patched, first = patched_matches(unet, lambda m: m(**sd15_unet_inputs()))
    types_after_first = module_types(patched)
    second = patch_model(patched)
    assert second.patched == [] and second.channels_last == 0 and second.skipped == first.skipped
    assert second.already_patched == first.patched
    assert module_types(patched) == types_after_first
    patched_matches(unet, lambda m: m(**sd15_unet_inputs()))


@pytest.mark.parametrize("make,run", [(tiny_sd15_unet, lambda m: m(**sd15_unet_inputs()).sample),
                                      (tiny_vae, lambda m: m(randn(1, 3, 32, 32)).sample),
                                      (tiny_svd_unet, lambda m: m(**svd_unet_inputs()).sample)])
def test_unpatch_restores_stock(make, run):
    stock = make()
    patched = copy.deepcopy(stock)
    patch_model(patched)
    assert unpatch_model(patched) > 0
    assert module_types(patched) == module_types(stock)
    assert not any("forward" in vars(m) for m in patched.modules())
    assert all(m.weight.is_contiguous() for m in patched.modules() if isinstance(m, nn.Conv2d))
    assert not hasattr(patched, surgeon._LAYOUT_FLAG)
    with torch.no_grad():
        assert torch.equal(run(patched), run(stock))  # the very same computation again
    assert unpatch_model(patched) == 0


def test_layout_of_a_channels_last_model_is_kept():
    unet = tiny_sd15_unet().to(memory_format=torch.channels_last)
    report = patch_model(unet)
    assert report.channels_last == 0
    unpatch_model(unet)
    assert unet.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    assert not unet.conv_in.weight.is_contiguous()


def test_unpatch_keeps_weights_the_user_made_channels_last():
    unet = tiny_sd15_unet()
    unet.conv_out.to(memory_format=torch.channels_last)
    patch_model(unet)
    unpatch_model(unet)
    assert unet.conv_out.weight.is_contiguous(memory_format=torch.channels_last)
    assert not unet.conv_out.weight.is_contiguous()
    assert unet.conv_in.weight.is_contiguous()  # converted by patch_model, so converted back


def test_unpatch_refuses_hooks_added_after_patching():
    """A diffusers hook registered on a patched block keeps the fused forward it wrapped: unpatching under it would
    leave that block computing GroupNorm without its activation. unpatch_model refuses and changes nothing."""
    from diffusers.hooks import HookRegistry, ModelHook

    stock = tiny_sd15_unet()
    patched = copy.deepcopy(stock)
    patch_model(patched)
    registry = HookRegistry.check_if_exists_or_initialize(patched.mid_block.resnets[0])
    registry.register_hook(ModelHook(), "noop")
    with pytest.raises(ValueError, match=r"mid_block\.resnets\.0: the forward is wrapped"):
        unpatch_model(patched)
    assert type(patched.mid_block.resnets[0]) is rules.fusion._FusedResnetBlock2D
    inputs = sd15_unet_inputs()
    with torch.no_grad():
        assert_same_outputs(patched(**inputs).sample, stock(**inputs).sample)
    registry.remove_hook("noop")
    assert unpatch_model(patched) > 0


@pytest.mark.parametrize("attr,replacement", [("nonlinearity", lambda: nn.ReLU()),
                                              ("norm1", lambda: nn.GroupNorm(8, 32)),
                                              ("norm2", lambda: nn.GroupNorm(8, 32))])
def test_replacing_a_fused_module_of_a_patched_block_raises(attr, replacement):
    """The fused forward applies norm1's and norm2's activation in place of its dropped nonlinearity calls: a module
    replaced there after patching would be skipped (a new activation after the norms) or left unactivated (a new
    norm), wrong values without an error. The assignment raises and changes nothing; other attributes, and the same
    module set again, are set as stock sets them; after unpatch_model the replacement takes, and a new patch_model
    fuses it with stock's values."""
    block = make_resnet()
    run = run_resnet(block)
    patched = copy.deepcopy(block)
    patch_model(patched)
    before = getattr(patched, attr)
    with pytest.raises(RuntimeError, match=rf"ResnetBlock2D\.{attr} is fused .*unpatch_model"):
        setattr(patched, attr, replacement())
    assert getattr(patched, attr) is before
    setattr(patched, attr, before)
    patched.output_scale_factor = 1.0
    with torch.no_grad():
        assert_same_outputs(run(patched), run(block))
    unpatch_model(patched)
    new = replacement()
    new.load_state_dict(before.state_dict())
    setattr(patched, attr, new)
    setattr(block, attr, copy.deepcopy(new))
    patch_model(patched)
    assert type(patched) is rules.fusion._FusedResnetBlock2D
    with torch.no_grad():
        assert_same_outputs(run(patched), run(block))


def test_peft_modules_to_save_wraps_and_unloads_a_fused_norm():
    """peft's ``modules_to_save`` wraps a patched block's fused norm (ModulesToSaveWrapper: the norm and a trained
    deep copy of it) and ``merge_and_unload`` puts the trained copy in its place: both replace a fused norm by one
    fusing the same activation, which the block's replacement guard lets through, with stock's values."""
    from peft import LoraConfig, get_peft_model

    class Holder(nn.Module):  # peft wraps a model around the block
        def __init__(self, block: nn.Module) -> None:
            super().__init__()
            self.block = block

        def forward(self, x, temb):
            return self.block(x, temb)

    stock = Holder(make_resnet())
    run = run_resnet(stock.block)
    patched = copy.deepcopy(stock)
    patch_model(patched)
    wrapped = get_peft_model(patched, LoraConfig(target_modules=["conv1"], modules_to_save=["norm1"], r=4))
    with torch.no_grad():
        wrapped.base_model.model.block.norm1.modules_to_save["default"].weight.add_(0.5)
        stock.block.norm1.weight.add_(0.5)
        assert_same_outputs(run(wrapped), run(stock))
        unloaded = wrapped.merge_and_unload()
        assert type(unloaded.block.norm1) is rules.base.FusedGroupNorm
        assert_same_outputs(run(unloaded), run(stock))


class Double(nn.Module):
    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return 2 * weight


def test_unpatch_keeps_a_parametrization_added_after_patching():
    """parametrize gives the fused norm a subclass Parametrized<GroupNormAct>: unpatch_model must leave the
    Parametrized<GroupNorm> that parametrizing the stock norm gives (not a GroupNormAct still applying SiLU)."""
    from torch.nn.utils import parametrize

    stock = tiny_sd15_unet()
    patched = copy.deepcopy(stock)
    patch_model(patched)
    for model in (stock, patched):
        parametrize.register_parametrization(model.down_blocks[0].resnets[0].norm1, "weight", Double())
    inputs = sd15_unet_inputs()
    assert unpatch_model(patched) == 21
    norm = patched.down_blocks[0].resnets[0].norm1
    assert type(norm).__bases__ == (nn.GroupNorm,) and type(norm).__name__ == "ParametrizedGroupNorm"
    assert parametrize.is_parametrized(norm, "weight") and "activation" not in vars(norm)
    with torch.no_grad():
        assert_same_outputs(patched(**inputs).sample, stock(**inputs).sample, tol=1e-6)
    parametrize.remove_parametrizations(norm, "weight")
    assert type(norm) is nn.GroupNorm


def snapshot(model: nn.Module) -> tuple[dict, dict, torch.Tensor]:
    """What must not change when unpatch_model refuses: state_dict, module classes, output."""
    with torch.no_grad():
        output = model(**sd15_unet_inputs()).sample
    return copy.deepcopy(model.state_dict()), module_types(model), output


def assert_unchanged(model: nn.Module, before: tuple[dict, dict, torch.Tensor]) -> None:
    state, types, output = snapshot(model)
    assert types == before[1]
    assert state.keys() == before[0].keys()
    assert all(torch.equal(v, before[0][k]) and v.stride() == before[0][k].stride() for k, v in state.items())
    assert torch.equal(output, before[2])


def test_unpatch_refuses_a_wrapper_class_it_does_not_know():
    """A dynamic subclass of a fused block (some other wrapper's) cannot be switched back exactly: unpatch_model
    refuses before changing anything, naming the module."""
    unet = tiny_sd15_unet()
    patch_model(unet)
    block = unet.up_blocks[1].resnets[1]
    block.__class__ = type("Traced" + type(block).__name__, (type(block),), {})
    before = snapshot(unet)
    with pytest.raises(ValueError, match=r"nothing was changed: up_blocks\.1\.resnets\.1: its class .* subclasses"):
        unpatch_model(unet)
    assert_unchanged(unet, before)


def test_unpatch_refuses_hooks_on_a_fused_activation_stand_in():
    """The stand-in is swapped back for the original activation: hooks added on it would silently vanish."""
    unet = tiny_sd15_unet()
    patch_model(unet)
    unet.conv_act.register_forward_hook(lambda module, args, output: None)
    before = snapshot(unet)
    with pytest.raises(ValueError, match=r"conv_act: the stand-in for the fused activation has hooks"):
        unpatch_model(unet)
    assert_unchanged(unet, before)


def test_channels_last_off():
    unet = tiny_sd15_unet()
    report = patch_model(unet, channels_last=False)
    assert report.channels_last == 0 and report.counts
    assert all(m.weight.is_contiguous() for m in unet.modules() if isinstance(m, nn.Conv2d))


def test_channels_last_activations_mode_outputs_match_stock_and_flow_nhwc():
    """channels_last="activations" (for FSDP2): every parameter keeps its layout, the inputs become channels_last
    at the root, so activations flow NHWC; unpatch removes the hook."""
    stock = tiny_sd15_unet()
    inputs = sd15_unet_inputs()
    patched, report = patched_matches(stock, lambda m: m(**inputs).sample, channels_last="activations")
    assert report.channels_last == 0 and report.channels_last_inputs == ["", "conv_in"] and "<root>" in str(report)
    assert all(p.is_contiguous() for p in patched.parameters())
    with torch.no_grad():
        expected = stock(**inputs).sample
        assert is_channels_last(patched(**inputs).sample) and not is_channels_last(expected)
    assert patch_model(patched, channels_last="activations").channels_last_inputs == []  # one hook, not two
    for clone in (copy.deepcopy(patched), pickle.loads(pickle.dumps(patched))):  # the hook travels with the model
        with torch.no_grad():
            assert torch.equal(clone(**inputs).sample, patched(**inputs).sample)
        assert is_channels_last(clone(**inputs).sample)
    assert unpatch_model(patched) == 21
    assert not any(m._forward_pre_hooks or m._forward_pre_hooks_with_kwargs for m in patched.modules())
    with torch.no_grad():
        assert torch.equal(patched(**inputs).sample, expected)


def test_channels_last_activations_mode_reaches_the_autoencoder_decode():
    """Pipelines call vae.decode(), which calls vae.decoder without vae.forward: the decoder gets the hook too."""
    stock = tiny_vae()
    latents = randn(1, 4, 8, 8)
    patched, report = patched_matches(stock, lambda m: m.decode(latents).sample, channels_last="activations")
    assert report.channels_last_inputs == ["", "encoder", "decoder"]
    seen = []
    patched.decoder.conv_in.register_forward_pre_hook(lambda module, args: seen.append(is_channels_last(args[0])))
    with torch.no_grad():
        patched.decode(latents)
    assert seen == [True]


@pytest.mark.parametrize("value", ["weights", "True", 1, None])
def test_channels_last_must_be_a_known_mode(value):
    unet = tiny_sd15_unet()
    state = copy.deepcopy(unet.state_dict())
    with pytest.raises(ValueError, match="channels_last must be True"):
        patch_model(unet, channels_last=value)
    assert all(type(m) is not GroupNormAct for m in unet.modules())
    assert all(torch.equal(v, state[k]) and v.is_contiguous() for k, v in unet.state_dict().items())


@pytest.mark.parametrize("function", ["patch_model", "unpatch_model", "patch_pipeline", "unpatch_pipeline"])
@pytest.mark.parametrize("value", [None, [nn.Conv2d(4, 4, 1)]], ids=["None", "list"])
def test_the_surgeon_refuses_what_is_not_a_module(function, value):
    import gn_patch
    argument = "pipe" if "pipeline" in function else "model"
    with pytest.raises(TypeError, match=rf"{function}: {argument} must be"):
        getattr(gn_patch, function)(value)


def test_deepcopy_and_pickle_of_a_patched_model():
    unet = tiny_sd15_unet()
    patched, _ = patched_matches(unet, lambda m: m(**sd15_unet_inputs()))
    for clone in (copy.deepcopy(patched), pickle.loads(pickle.dumps(patched))):
        assert module_types(clone) == module_types(patched)
        with torch.no_grad():
            assert torch.equal(clone(**sd15_unet_inputs()).sample, patched(**sd15_unet_inputs()).sample)


def test_fused_group_norm_has_the_state_of_a_group_norm_act():
    """The in-place conversion gives exactly the attributes GroupNormAct's constructor gives."""
    seq = nn.Sequential(nn.GroupNorm(2, 8), nn.SiLU())
    patch_model(seq)
    reference = GroupNormAct.from_group_norm(nn.GroupNorm(2, 8), "silu")
    assert set(vars(seq[0])) == set(vars(reference))
    assert seq[0].extra_repr() == reference.extra_repr()


# ------------------------------------------------------------------------------------------------
# What stays unfused, and the report
# ------------------------------------------------------------------------------------------------
class Mixed(nn.Module):
    """Conditional norms next to a plain block, and a GroupNorm whose use the surgeon cannot see."""

    def __init__(self) -> None:
        super().__init__()
        self.cond_block = ResnetBlockCondNorm2D(in_channels=32, temb_channels=8, groups=8,
                                                time_embedding_norm="ada_group")
        self.ada_norm = AdaGroupNorm(8, 32, num_groups=8, act_fn="silu")
        self.spatial_norm = SpatialNorm(32, 4)
        self.block = ResnetBlock2D(in_channels=32, temb_channels=8, groups=8)
        self.loose_norm = nn.GroupNorm(8, 32)

    def forward(self, x, emb, zq):
        x = self.cond_block(x, emb)
        x = self.ada_norm(x, emb)
        x = self.spatial_norm(x, zq)
        x = self.block(x, emb)
        return torch.tanh(self.loose_norm(x))


def test_conditional_norms_and_an_unknown_use():
    model = make_model(Mixed, {})
    patched, report = patched_matches(model, lambda m: m(randn(2, 32, 8, 8), randn(2, 8, seed=1),
                                                         randn(2, 4, 4, 4)))
    assert report.patched == [("cond_block.norm1", "ResnetBlockCondNorm2D.norm1+act"),
                              ("cond_block.norm2", "ResnetBlockCondNorm2D.norm2+act"),
                              ("ada_norm", "AdaGroupNorm+scale_shift"),
                              ("spatial_norm.norm_layer", "SpatialNorm.norm_layer"),
                              ("block.norm1", "ResnetBlock2D.norm1+act"), ("block.norm2", "ResnetBlock2D.norm2+act")]
    assert patched.cond_block.norm1.activation == "silu" and patched.ada_norm.activation == "identity"
    assert report.alone == [("loose_norm", "the surgeon does not know what follows this GroupNorm in Mixed")]
    assert report.skipped == []
    text = str(report)
    assert "patched 6 GroupNorm(s), 1 run alone" in text and "the surgeon does not know" in text
    assert unpatch_model(patched) == 7 and module_types(patched) == module_types(model)


@pytest.mark.parametrize("shape", [(2, 2, 2, 3, 3), (2, 2, 3)], ids=["5d", "3d"])
def test_ada_group_norm_of_other_ranks_is_stocks(shape):
    """AdaGroupNorm's (N, C, 1, 1) scale and shift broadcast against a 3-D or 5-D input's trailing dims (N = C = 2
    here lines them up with (C, frames) or makes the output 4-D), not per (image, channel): patched, those inputs
    get stock's values, with the activation fused into the norm applied after; shapes stock cannot broadcast
    raise as in stock."""
    norm = AdaGroupNorm(6, 2, num_groups=1)
    x, emb = randn(*shape), randn(2, 6, seed=1)
    want = norm(x, emb)
    patch_model(norm)
    torch.testing.assert_close(norm(x, emb), want, rtol=0, atol=0)
    norm.activation = "silu"  # as the surgeon sets it where a block's activation follows
    torch.testing.assert_close(norm(x, emb), F.silu(want), rtol=0, atol=0)
    with pytest.raises(RuntimeError):
        norm(randn(2, 2, 4, 3, 3), emb)  # (N, C, 1, 1) against (C, 4, 3, 3): stock raises too


def test_conditional_norms_take_one_embedding_for_the_batch(host_path):
    """A batch-1 embedding for a batch of images: stock broadcasts it (`x * (1 + scale) + shift`, `h + temb`);
    patched, the fused scale and shift (and norm2's input offset) serve every image, with stock's values."""
    model = make_model(Mixed, {})
    patched_matches(model, lambda m: m(randn(2, 32, 8, 8), randn(1, 8, seed=1), randn(2, 4, 4, 4)))


@pytest.mark.parametrize("case", ["default", "scale_shift"])
def test_resnet_block_2d_takes_one_timestep_embedding_for_the_batch(case, host_path):
    block = make_resnet(**RESNET_CASES[case])
    patched_matches(block, lambda m: m(randn(2, 32, 8, 8), randn(1, 16, seed=1)))


def test_spatial_norm_mid_block_and_decoder():
    block = make_model(UNetMidBlock2D, dict(in_channels=32, temb_channels=4, resnet_groups=8, attention_head_dim=8,
                                            resnet_time_scale_shift="spatial"))
    _, report = patched_matches(block, lambda m: m(randn(2, 32, 8, 8), randn(2, 4, 4, 4, seed=1)))
    assert kinds(report.patched) == {"SpatialNorm.norm_layer": 5}  # the attention's and two per resnet
    assert report.skipped == report.alone == []

    decoder = make_model(Decoder, dict(in_channels=4, out_channels=3, up_block_types=("UpDecoderBlock2D",) * 2,
                                       block_out_channels=(32, 32), layers_per_block=1, norm_num_groups=8,
                                       norm_type="spatial"))
    _, report = patched_matches(decoder, lambda m: m(randn(1, 4, 8, 8), randn(1, 4, 8, 8, seed=1)))
    assert ("conv_norm_out.norm_layer", "SpatialNorm.norm_layer") in report.patched
    assert report.skipped == report.alone == []


def test_group_norm_with_hooks_is_not_fused():
    block = make_resnet()
    seen = []
    block.norm1.register_forward_hook(lambda module, args, output: seen.append(output))
    patched, report = patched_matches(block, run_resnet(block))
    assert report.patched == [] and type(patched) is ResnetBlock2D
    assert [name for name, _ in report.alone] == ["norm1", "norm2"] and seen
    assert all("hooks" in reason for _, reason in report.alone)


def test_a_siblings_hook_is_named_in_the_reason():
    """A block's forward is edited as one, so a hook on norm1 keeps norm2 unfused too: its reason names norm1."""
    block = make_resnet()
    block.norm1.register_forward_hook(lambda module, args, output: None)
    report = patch_model(block)
    assert dict(report.alone)["norm2"].startswith("ResnetBlock2D: norm1: forward/backward hooks")


def test_a_second_call_fuses_what_a_removed_hook_kept_apart():
    block = make_resnet()
    handle = block.norm1.register_forward_hook(lambda module, args, output: None)
    patched = copy.deepcopy(block)
    first = patch_model(patched)
    assert first.patched == [] and len(first.alone) == 2
    for module in (block.norm1, patched.norm1):
        module._forward_hooks.clear()
    handle.remove()
    second = patch_model(patched)
    assert [name for name, _ in second.patched] == ["norm1", "norm2"] and second.already_patched == []
    assert type(patched) is rules.fusion._FusedResnetBlock2D
    with torch.no_grad():
        assert_same_outputs(run_resnet(block)(patched), run_resnet(block)(block), 1e-5)
    third = patch_model(patched)
    assert third.patched == [] and third.already_patched == second.patched


def test_a_lone_norm_stays_already_patched_on_a_second_call():
    norm = nn.GroupNorm(4, 16)
    model = nn.ModuleDict(dict(seq=nn.Sequential(norm, nn.SiLU()), other=norm))
    patch_model(model)
    again = patch_model(model)
    assert again.patched == again.alone == []
    assert again.already_patched == [("seq.0", "GroupNorm alone: the GroupNorm is registered in several places, "
                                               "not all followed by the activation")]
    assert type(norm) is rules.base.StockLayoutGroupNorm


def test_global_module_hooks_keep_pairs_unfused():
    """A hook registered for every module sees each norm's output: fused, it would see the activation's."""
    block = make_resnet()
    seen = []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda module, args, output: seen.append(output) if isinstance(module, nn.GroupNorm) else None)
    try:
        patched, report = patched_matches(block, run_resnet(block))
        with torch.no_grad():
            seen.clear()
            run_resnet(block)(block)
            stock_outputs, seen[:] = list(seen), []
            run_resnet(block)(patched)
    finally:
        handle.remove()
    assert report.patched == [] and all("global" in reason for _, reason in report.alone)
    assert len(seen) == len(stock_outputs) == 2
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(seen, stock_outputs))


def test_unpatch_gives_the_activations_back_in_the_models_mode():
    model = nn.Sequential(nn.Conv2d(8, 8, 1), nn.GroupNorm(2, 8), nn.SiLU()).eval()
    assert patch_model(model).patched
    assert not any(module.training for module in model.modules())
    unpatch_model(model)
    assert type(model[2]) is nn.SiLU and not any(module.training for module in model.modules())


class WeightStandardizedConv2d(nn.Conv2d):
    """A conv subclass of a user's whose forward needs a contiguous weight (``.view``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = self.weight.view(self.out_channels, -1)
        weight = ((flat - flat.mean(1, keepdim=True)) / (flat.std(1, keepdim=True) + 1e-5)).view_as(self.weight)
        return self._conv_forward(x, weight, self.bias)


class ConfiguredConv2d(nn.Conv2d):
    """A conv subclass of a user's that changes only how it is built: the stock forward."""

    def __init__(self, channels: int) -> None:
        super().__init__(channels, channels, 3, padding=1)


class Halve(nn.Module):
    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return t / 2


@pytest.mark.parametrize("parametrized", [False, True], ids=["plain", "parametrized_bias"])
def test_conv_subclasses_of_unread_code_keep_their_layout(parametrized):
    """A user's conv subclass with its own forward keeps a contiguous weight, also under parametrize's wrapper class
    (defined in torch); one with the stock forward is converted."""
    torch.manual_seed(0)
    model = nn.Sequential(WeightStandardizedConv2d(8, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.SiLU(),
                          ConfiguredConv2d(16))
    if parametrized:
        torch.nn.utils.parametrize.register_parametrization(model[0], "bias", Halve())
    patched, report = patched_matches(model, lambda m: m(randn(2, 8, 8, 8)))
    assert report.channels_last == 1 and patched[3].weight.is_contiguous(memory_format=torch.channels_last)
    [(name, reason)] = report.layout_kept
    assert name == "0.weight" and "WeightStandardizedConv2d" in reason and patched[0].weight.is_contiguous()


def test_lazy_convs_not_yet_initialised_keep_their_layout():
    model = nn.Sequential(nn.LazyConv2d(16, 3, padding=1), nn.GroupNorm(4, 16), nn.SiLU(), nn.Conv2d(16, 8, 1))
    report = patch_model(model)
    assert report.layout_kept == [("0.weight", "not initialised yet (a lazy conv before its first call): patch after "
                                               "that call")]
    assert report.channels_last == 1 and [kind for _, kind in report.patched] == ["Sequential(GroupNorm, act)"]
    with torch.no_grad():
        assert model(randn(2, 8, 8, 8)).shape == (2, 8, 8, 8)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
def test_an_optimizer_created_before_patching_keeps_training_right(fused):
    """Patching mid-training restrides the conv weights in place; the optimizer's state made before (Adam's moments)
    follows them at its next step, so a fused AdamW (which pairs a weight's elements with its state's by memory
    offset) trains as without the patch. Its gradient follows the weight too."""
    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.SiLU(),
                             nn.Conv2d(16, 8, 3, padding=1))

    x = randn(2, 8, 8, 8)
    stock, patched = make(), make()
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=fused, foreach=not fused)
                  for m in (stock, patched)]
    for step in range(4):
        if step == 2:
            patched(x).square().mean().backward()  # a gradient at hand when patching
            patch_model(patched)
            weight = patched[0].weight
            assert weight.is_contiguous(memory_format=torch.channels_last) and weight.grad.stride() == weight.stride()
            patched.zero_grad()
        for model, optimizer in zip((stock, patched), optimizers):
            optimizer.zero_grad()
            model(x).square().mean().backward()
            optimizer.step()
    for a, b in zip(stock.parameters(), patched.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert optimizers[1].state[patched[0].weight]["exp_avg"].stride() == patched[0].weight.stride()
    unpatch_model(patched)
    optimizers[1].step()
    assert optimizers[1].state[patched[0].weight]["exp_avg"].is_contiguous()


@pytest.mark.parametrize("value", ["no", 1, None])
def test_channels_last_3d_must_be_a_bool(value):
    with pytest.raises(ValueError, match="channels_last_3d must be True or False"):
        patch_model(make_resnet(), channels_last_3d=value)


def test_hooks_on_the_block_keep_working():
    block = make_resnet()
    patched = copy.deepcopy(block)
    seen = []
    patched.register_forward_hook(lambda module, args, output: seen.append(output))
    patch_model(patched)
    with torch.no_grad():
        out = run_resnet(block)(patched)
    assert len(seen) == 1 and seen[0] is out and type(patched) is rules.fusion._FusedResnetBlock2D


def test_shared_group_norm_runs_alone():
    norm = nn.GroupNorm(4, 16)
    model = nn.ModuleDict(dict(seq=nn.Sequential(norm, nn.SiLU()), other=norm))
    report = patch_model(model)
    assert report.patched == [] and len(report.alone) == 1 and "several places" in report.alone[0][1]
    assert type(norm) is rules.base.StockLayoutGroupNorm and norm.activation == "identity"


def test_lone_group_norm_runs_alone():
    norm = nn.GroupNorm(2, 4)
    report = patch_model(norm)
    assert report.alone == [("", "the surgeon does not know what follows this GroupNorm")]
    assert "1  the surgeon does not know what follows this GroupNorm" in str(report)
    assert patch_model(norm).already_patched == [("", "GroupNorm alone: the surgeon does not know what follows this "
                                                      "GroupNorm")]
    assert unpatch_model(norm) == 1 and type(norm) is nn.GroupNorm


def test_subclassed_block_is_not_fused():
    class MyBlock(ResnetBlock2D):
        pass

    block = MyBlock(in_channels=32, temb_channels=16, groups=8)
    report = patch_model(block)
    assert report.patched == [] and type(block) is MyBlock
    assert [name for name, _ in report.alone] == ["norm1", "norm2"]
    assert "does not know what follows this GroupNorm in MyBlock" in report.alone[0][1]


@pytest.fixture
def fresh_source_check():
    rules.base.unverified.cache_clear()
    yield
    rules.base.unverified.cache_clear()


def test_installed_diffusers_has_the_verified_code(fresh_source_check):
    assert {f.__qualname__: rules.base.unverified(f) for f in rules.VERIFIED_SOURCES} == {
        f.__qualname__: None for f in rules.VERIFIED_SOURCES}


def test_every_declared_fusion_generates_its_forward():
    """Each rule's edits apply to its verified source exactly as declared (else RuleError), also for the rules no
    test model reaches; the generated class stands in for the original."""
    for cls, spec in rules.fusion.FUSIONS.items():
        if spec.edits:
            fused = rules.fusion.fused_class(spec)
            assert issubclass(fused, cls) and fused.__name__ == cls.__name__ and rules.ORIGINAL_CLASS[fused] is cls
            assert getattr(rules.fusion, fused.__qualname__) is fused  # what unpickling looks up


def test_other_diffusers_code_is_not_fused(fresh_source_check, monkeypatch):
    monkeypatch.setitem(rules.VERIFIED_SOURCES, ResnetBlock2D.forward, set())
    monkeypatch.setitem(rules.VERIFIED_SOURCES, UNet2DConditionModel.forward, set())
    unet = tiny_sd15_unet()
    with pytest.warns(RuntimeWarning, match="17 GroupNorm\\(s\\) not fused.*checked against"):
        _, report = patched_matches(unet, lambda m: m(**sd15_unet_inputs()))
    assert set(report.counts) == {"Transformer2DModel.norm"} and report.skipped == []
    assert all("is not the code the surgeon was checked against" in reason for _, reason in report.alone)
    assert len(report.alone) == 17  # 8 blocks x 2 norms, conv_norm_out: each runs alone


def test_report_merge():
    a = PatchReport(patched=[("conv_norm_out", "conv_norm_out+conv_act")], channels_last=3)
    b = PatchReport(patched=[("mid.norm1", "ResnetBlock2D.norm1+act")], already_patched=[("n", "k")],
                    skipped=[("x", "why"), ("", "root")], channels_last=2)
    merged = a.merge(b, prefix="vae")
    assert merged.patched == [("conv_norm_out", "conv_norm_out+conv_act"), ("vae.mid.norm1", "ResnetBlock2D.norm1+act")]
    assert merged.already_patched == [("vae.n", "k")]
    assert merged.skipped == [("vae.x", "why"), ("vae", "root")]
    assert merged.channels_last == 5
    c = PatchReport(layout_kept=[("conv_in.weight", "a DTensor")], channels_last_inputs=["", "decoder"])
    assert a.merge(c, prefix="vae").layout_kept == [("vae.conv_in.weight", "a DTensor")]
    assert a.merge(c, prefix="vae").channels_last_inputs == ["vae", "vae.decoder"]
    assert merged.counts == {"conv_norm_out+conv_act": 1, "ResnetBlock2D.norm1+act": 1}
    assert a.patched == [("conv_norm_out", "conv_norm_out+conv_act")]  # merge returns a new report


# ------------------------------------------------------------------------------------------------
# CUDA: half-precision accuracy of the full-size models (the fused kernels must run)
# ------------------------------------------------------------------------------------------------
def _gpu_randn(*shape, seed=0):
    return randn(*shape, seed=seed).cuda()


def _unet_inputs(cross_dim: int, batch: int = 2, size: int = 64, sdxl: bool = False) -> dict:
    inputs = dict(sample=_gpu_randn(batch, 4, size, size), timestep=torch.tensor(500, device="cuda"),
                  encoder_hidden_states=_gpu_randn(batch, 77, cross_dim, seed=1))
    if sdxl:
        time_ids = torch.tensor([[1024.0, 1024.0, 0.0, 0.0, 1024.0, 1024.0]], device="cuda").repeat(batch, 1)
        inputs["added_cond_kwargs"] = dict(text_embeds=_gpu_randn(batch, 1280, seed=2), time_ids=time_ids)
    return inputs


# name -> (model class, config, output of a model given a function casting its inputs, prefix of the modules it runs)
GPU_CASES = {
    "sd15_unet": (UNet2DConditionModel, configs.SD15_UNET,
                  lambda m, cast: m(**cast(_unet_inputs(768))).sample, ""),
    "sdxl_unet": (UNet2DConditionModel, configs.SDXL_UNET,
                  lambda m, cast: m(**cast(_unet_inputs(2048, sdxl=True))).sample, ""),
    "sd_vae_decode": (AutoencoderKL, configs.SD_VAE,
                      lambda m, cast: m.decode(cast(_gpu_randn(1, 4, 64, 64))).sample, "decoder."),
    "sd_vae_encode": (AutoencoderKL, configs.SD_VAE,
                      lambda m, cast: m.encode(cast(_gpu_randn(1, 3, 256, 256))).latent_dist.parameters, "encoder."),
    "controlnet": (ControlNetModel, configs.CONTROLNET,
                   lambda m, cast: m(**cast(dict(_unet_inputs(768), controlnet_cond=_gpu_randn(2, 3, 512, 512,
                                                                                                seed=3)))), ""),
}


def _caster(dtype):
    def cast(value):
        if isinstance(value, dict):
            return {k: cast(v) for k, v in value.items()}
        return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value
    return cast


@pytest.fixture
def exact_fp32_reference():
    """cuDNN convolutions in true float32 (not TF32) for the reference run."""
    previous = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32 = previous


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", GPU_CASES)
def test_half_precision_accuracy_cuda(case, dtype, exact_fp32_reference):
    """Patched fp16/bf16 output is as close to the float32 stock output as stock fp16/bf16 is (1.5x + slack)."""
    cls, config, run, prefix = GPU_CASES[case]
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = perturb_(cls(**config))
    with torch.no_grad():
        reference = [t.float() for t in outputs(run(model, _caster(torch.float32)))]
        model.to(dtype)
        stock = outputs(run(model, _caster(dtype)))
        report = patch_model(model)
        with OpCounter() as counter:
            patched = outputs(run(model, _caster(dtype)))
    assert report.patched and report.skipped == []
    # every fused GroupNorm the forward runs (once each) took the kernel: activations flow channels-last
    assert counter.kernel_calls == sum(name.startswith(prefix) for name, _ in report.patched)
    for p, s, r in zip(patched, stock, reference):
        stock_error, patched_error = rel_l2(s, r), rel_l2(p, r)
        assert torch.isfinite(p).all() and torch.isfinite(s).all()
        assert patched_error <= 1.5 * stock_error + 1e-3, (patched_error, stock_error)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["sd15_unet", "sd_vae_decode"])
def test_channels_last_activations_mode_runs_the_kernels_cuda(case):
    """channels_last="activations" (FSDP2) keeps every weight contiguous: the channels_last inputs alone must make
    cuDNN return NHWC (vae.decode through the decoder's hook), so every fused norm the forward runs takes the
    kernel, and outputs match the default mode's."""
    cls, config, run, prefix = GPU_CASES[case]
    torch.manual_seed(0)
    with torch.device("cuda"):
        weights_mode = perturb_(cls(**config)).half()
    activations_mode = copy.deepcopy(weights_mode)
    cast = _caster(torch.float16)
    patch_model(weights_mode)
    report = patch_model(activations_mode, channels_last="activations")
    assert report.patched and all(p.is_contiguous() for p in activations_mode.parameters())
    with torch.no_grad():
        expected = outputs(run(weights_mode, cast))
        with OpCounter() as counter:
            actual = outputs(run(activations_mode, cast))
    assert counter.kernel_calls == sum(name.startswith(prefix) for name, _ in report.patched)
    for a, e in zip(actual, expected):
        assert torch.isfinite(a).all() and rel_l2(a, e) <= 1e-3, rel_l2(a, e)


# ------------------------------------------------------------------------------------------------
# Layout flow: with channels_last, every fused GroupNorm must receive an input the kernels read
# ------------------------------------------------------------------------------------------------
LAYOUT_CASES = {
    "sd15_unet": (tiny_sd15_unet, lambda m: m(**sd15_unet_inputs())),
    "sdxl_unet": (tiny_sdxl_unet, lambda m: m(**sdxl_unet_inputs())),
    "vae": (tiny_vae, lambda m: m(randn(1, 3, 32, 32))),
    "controlnet": (tiny_controlnet, lambda m: m(**controlnet_inputs())),
}


@pytest.mark.parametrize("channels_last", [True, "activations"])
@pytest.mark.parametrize("case", LAYOUT_CASES)
def test_every_fused_group_norm_sees_channels_last_input(case, channels_last):
    """An NCHW input would send a GroupNormAct to PyTorch's path on CUDA (exact, but no kernel and two layout
    conversions). Transformer2DModel's NCHW .contiguous() output was such a leak. With channels_last="activations"
    the weights stay contiguous: the channels_last inputs alone must carry the layout through."""
    build, run = LAYOUT_CASES[case]
    model = build()
    patch_model(model, channels_last=channels_last)
    seen = {}

    def record(module, args):
        seen[module] = is_channels_last(args[0]) and not args[0].is_contiguous()

    handles = [m.register_forward_pre_hook(record) for m in model.modules() if isinstance(m, GroupNormAct)]
    with torch.no_grad():
        run(model)
    for handle in handles:
        handle.remove()
    names = {m: n for n, m in model.named_modules()}
    assert seen and all(seen.values()), [names[m] for m, ok in seen.items() if not ok]


def test_transformer_output_layout_patch_is_undone():
    model = tiny_sd15_unet()
    before = module_types(model)
    patch_model(model)
    assert any(type(m).__qualname__ == "_ChannelsLastTransformer2DModel" for m in model.modules())
    unpatch_model(model)
    assert module_types(model) == before


_TEMPORAL = dict(num_attention_heads=2, attention_head_dim=16, in_channels=32, norm_num_groups=8)
TEMPORAL_TRANSFORMERS = {
    "AnimateDiffTransformer3D": lambda: make_model(
        AnimateDiffTransformer3D, dict(_TEMPORAL, positional_embeddings="sinusoidal", num_positional_embeddings=8)),
    "TransformerTemporalModel": lambda: make_model(TransformerTemporalModel, _TEMPORAL),
}


def _copies(ops: OpCounter) -> int:
    return ops.calls["aten::clone"] + ops.calls["aten::copy_"]


def _temporal_call(name, x, frames=3):
    return lambda m: m(x, num_frames=frames) if name == "AnimateDiffTransformer3D" else m(x, num_frames=frames).sample


def _stock_and_patched_temporal(model, run):
    """(stock output, patched output, stock's op counts, patched's op counts) of one no-grad ``run(model)``."""
    patched = copy.deepcopy(model)
    patch_model(patched)
    with torch.no_grad():
        with OpCounter() as stock_ops:
            expected = run(model)
        with OpCounter() as patched_ops:
            actual = run(patched)
    return expected, actual, stock_ops, patched_ops


# (batch, frames, height, width, dtype): frames_last where stock's reshape copies (B, F, H·W > 1); elsewhere stock's
# proj_in reads a strided view (PyTorch's linear then adds the bias in a second rounding) and the norm keeps x's layout.
TEMPORAL_SHAPES = {"rows_copied": (2, 3, 4, 5, torch.float32), "batch_1": (1, 3, 4, 5, torch.float32),
                   "batch_1_bf16": (1, 8, 8, 8, torch.bfloat16), "one_frame": (1, 1, 3, 3, torch.float32),
                   "one_frame_batch_2": (2, 1, 4, 5, torch.float32), "one_position": (2, 3, 1, 1, torch.float32)}


@pytest.mark.parametrize("shape", TEMPORAL_SHAPES)
@pytest.mark.parametrize("channels_last", [True, False], ids=["channels_last", "nchw"])
@pytest.mark.parametrize("name", TEMPORAL_TRANSFORMERS)
def test_temporal_transformer_reads_and_writes_rows_in_place(name, channels_last, shape):
    """The norm returns its output frames_last where stock's reshape copies the rows (proj_in's (B·H·W, F, C) rows
    are then a view of it: on the CPU the op copies instead of the reshape) and, from channels-last input, the
    residual is added to proj_out's rows in place of stock's `.contiguous()` copy and second pass: stock's values
    bit for bit (the norm takes PyTorch's path on the CPU) at every shape, the residual's layout, one copy fewer;
    from NCHW input stock's output statements run."""
    batch, frames, height, width, dtype = TEMPORAL_SHAPES[shape]
    model = TEMPORAL_TRANSFORMERS[name]().to(dtype)
    x = randn(batch * frames, 32, height, width).to(dtype)
    x = x.to(memory_format=torch.channels_last) if channels_last else x
    expected, actual, stock_ops, patched_ops = _stock_and_patched_temporal(model, _temporal_call(name, x, frames))
    assert torch.equal(actual, expected)
    assert is_channels_last(actual) or not channels_last
    copies = _copies(stock_ops) - _copies(patched_ops)  # stock's `.contiguous()` copies nothing at H = W = 1
    assert copies == (1 if channels_last and height * width > 1 else 0), (stock_ops.calls, patched_ops.calls)


@pytest.mark.gpu
@pytest.mark.parametrize("name", TEMPORAL_TRANSFORMERS)
def test_temporal_transformer_copies_nothing_cuda(name):
    """On CUDA, channels-last float16: the kernels write the norm's output in proj_in's row order, and the residual
    joins proj_out's rows: the patched block copies nothing (stock: the reshape before proj_in, the `.contiguous()`
    after proj_out, and its GroupNorm's copy of the channels-last input), its output within half-precision rounding
    of stock's."""
    model = TEMPORAL_TRANSFORMERS[name]().cuda().half()
    x = randn(2 * 3, 32, 8, 8).cuda().half().to(memory_format=torch.channels_last)
    expected, actual, stock_ops, patched_ops = _stock_and_patched_temporal(model, _temporal_call(name, x))
    assert _copies(patched_ops) == 0 and _copies(stock_ops) >= 2, (stock_ops.calls, patched_ops.calls)
    assert patched_ops.kernel_calls == 1
    assert is_channels_last(actual)
    assert rel_l2(actual, expected) < 2e-3


def _flat_view_hook(module, args, output):
    output.view(output.shape[0], output.shape[1], -1)  # raises unless the output has stock's layout (NCDHW)


@pytest.mark.parametrize("case", ["hook_after_patching", "hook_at_patching", "norm_unpatched", "norm_patched_first",
                                  "parametrized_norm"])
@pytest.mark.parametrize("name", TEMPORAL_TRANSFORMERS)
def test_temporal_transformer_norm_others_see_stocks_call(name, case):
    """The norm is called with frames_last only while it is the surgeon's GroupNormAct and runs as it is: hooks
    (added after patching, or at patching and removed before patching again) see stock's layout, and a norm unpatched
    alone, patched on its own first, or parametrized gets stock's call."""
    model = TEMPORAL_TRANSFORMERS[name]()
    x = randn(2 * 3, 32, 4, 5)  # NCHW: stock's norm output is a view of NCDHW memory
    run = _temporal_call(name, x)
    if case == "parametrized_norm":
        torch.nn.utils.parametrize.register_parametrization(model.norm, "weight", nn.Identity())
    with torch.no_grad():
        expected = run(model)
    patched = copy.deepcopy(model)
    if case == "hook_at_patching":
        handle = patched.norm.register_forward_hook(lambda *args: None)
        patch_model(patched)
        handle.remove()
    if case == "norm_patched_first":
        patch_model(patched.norm)
    patch_model(patched)
    if case == "hook_after_patching":
        patched.norm.register_forward_hook(_flat_view_hook)
        model.norm.register_forward_hook(_flat_view_hook)
    if case == "norm_unpatched":
        unpatch_model(patched.norm)
    with torch.no_grad():
        torch.testing.assert_close(run(patched), expected, rtol=0, atol=0)


def test_unpatching_a_lone_fused_norm_is_refused():
    """Its activation lives in the parent: unpatching only the norm would silently drop it."""
    block = tiny_sd15_unet().down_blocks[1].resnets[0]
    patch_model(block)
    with pytest.raises(ValueError, match="unpatch the parent"):
        unpatch_model(block.norm1)
    assert unpatch_model(block) == 2


def test_patch_pipeline_needs_a_pipeline():
    from gn_patch.pipeline import patch_pipeline
    with pytest.raises(TypeError, match=r"use gn_patch\.patch_model"):
        patch_pipeline(tiny_sd15_unet())


@pytest.mark.parametrize("eps", [-1e-9, True])
def test_group_norm_with_settings_groupnormact_rejects_stays_stock(eps):
    """nn.GroupNorm takes a negative or bool eps; GroupNormAct does not (it would raise at its next call): the
    surgeon leaves such a norm as it is, fused with its activation or alone, and says why in the report."""
    fused = nn.Sequential(nn.GroupNorm(2, 8, eps=eps), nn.SiLU())
    alone = nn.Sequential(nn.GroupNorm(2, 8, eps=eps))
    for model in (fused, alone):
        x = torch.randn(2, 8, 4, 4)
        expected = model(x)
        report = patch_model(model)
        assert type(model[0]) is nn.GroupNorm and model[0].eps is eps
        assert [name for name, _ in report.skipped] == ["0"]
        assert "GroupNormAct does not take its settings" in report.skipped[0][1]
        torch.testing.assert_close(model(x), expected, rtol=0, atol=0)


def _eps_buffer(norm):
    del norm.eps
    norm.register_buffer("eps", torch.tensor(1e-5))
    return lambda: "eps" in norm._buffers


def _activation_submodule(norm):
    norm.activation = nn.Tanh()
    return lambda: isinstance(norm.activation, nn.Tanh)


def _activation_attribute(norm):
    norm.activation = "the user's"
    return lambda: norm.activation == "the user's"


@pytest.mark.parametrize("change", [_eps_buffer, _activation_submodule, _activation_attribute],
                         ids=["eps_buffer", "activation_submodule", "activation_attribute"])
def test_group_norm_whose_state_groupnormact_would_overwrite_stays_stock(change):
    """An eps registered as a buffer (which takes no float) or a submodule or attribute named activation (which
    GroupNormAct's own state would overwrite, and unpatch_model delete): the surgeon leaves the norm as it is, in
    working order, fused or alone, and says why; before, the class was switched and the patch failed halfway."""
    for model in (nn.Sequential(nn.GroupNorm(2, 8), nn.SiLU()), nn.Sequential(nn.GroupNorm(2, 8))):
        kept = change(model[0])
        x = torch.randn(2, 8, 4, 4)
        expected = model(x)
        report = patch_model(model)
        assert type(model[0]) is nn.GroupNorm and [name for name, _ in report.skipped] == ["0"]
        assert "GroupNormAct cannot take this GroupNorm" in report.skipped[0][1]
        torch.testing.assert_close(model(x), expected, rtol=0, atol=0)
        unpatch_model(model)
        assert kept()


def test_tensor_eps_becomes_a_float_when_patched():
    """An eps that nn.GroupNorm keeps as a one-element tensor (F.group_norm takes it) becomes the Python float
    GroupNormAct's calls take; the values stay the same."""
    model = nn.Sequential(nn.GroupNorm(2, 8, eps=torch.tensor(1e-3)), nn.SiLU())
    x = torch.randn(2, 8, 4, 4)
    expected = model(x)
    patch_model(model)
    assert isinstance(model[0], GroupNormAct) and type(model[0].eps) is float
    torch.testing.assert_close(model(x), expected)
