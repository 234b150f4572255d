"""CPU tests of PyTorch's path (gn_patch/ops.py's _pytorch_path before the extension loads, csrc/autograd.cpp's
pytorch_path after) where a plain call of PyTorch's GroupNorm falls short: PyTorch's exact result and layout for
odd strides, a traced layout (fake tensors, torch.compile) that agrees with the real one, CPU training around
PyTorch's crashing GroupNorm backward, and torch.export of a patched model keeping gn_patch's op."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch._prims_common import suggest_memory_format
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import gn_patch
from gn_patch.ops import ACTIVATIONS

from . import tiny_models

ROOT = Path(__file__).resolve().parent.parent
GROUPS = 8


def _randn(*shape, dtype=torch.float32, seed=0, device="cpu"):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


# (N, C, *spatial) inputs of 16 or 32 channels whose strides PyTorch treats in different ways: the shape of a
# contiguous tensor and the view of it.
CHANNELS_LAST = lambda t: t.to(memory_format=torch.channels_last)
LAYOUTS = {
    "issue_permuted": ((16, 16, 32), lambda t: t.permute(2, 0, 1).unsqueeze(0)),  # strides (32, 1, 512, 32)
    "channels_last": ((2, 16, 5, 4), CHANNELS_LAST),
    "channels_last_3d": ((2, 16, 3, 4, 2), lambda t: t.to(memory_format=torch.channels_last_3d)),
    "channels_last_channel_slice": ((2, 32, 4, 4), lambda t: CHANNELS_LAST(t)[:, 8:24]),
    "non_dense": ((2, 16, 10, 6), lambda t: t[:, :, ::2, 1:]),
    "expanded": ((1, 16, 1, 5), lambda t: t.expand(3, 16, 4, 5)),
    "rank3_transposed": ((2, 7, 16), lambda t: t.transpose(1, 2)),
    "rank5_permuted": ((2, 3, 4, 5, 16), lambda t: t.permute(0, 4, 2, 1, 3)),
}


def make_input(layout, dtype, device="cpu"):
    shape, view = LAYOUTS[layout]
    return view(_randn(*shape, dtype=dtype, device=device))


DTYPES = [torch.float32, torch.float64, torch.bfloat16]
AFFINE = ["none", "weight_bias", "weight", "bias"]


def _params(channels, dtype, affine):
    weight, bias = 1 + 0.5 * _randn(channels, seed=1), 0.5 * _randn(channels, seed=2)
    return (weight.to(dtype) if "weight" in affine else None), (bias.to(dtype) if "bias" in affine else None)


def _stock(x, weight, bias, activation="silu", eps=1e-5):
    return ACTIVATIONS[activation](F.group_norm(x, GROUPS, weight, bias, eps))


def _trainable_reference(params):
    """Detached copies of (weight, bias) that require grad, a missing weight as ones (stock PyTorch 2.13 cannot
    backpropagate to a bias without a weight on the CPU)."""
    weight, bias = (p.detach().clone().requires_grad_(True) if p is not None else None for p in params)
    return (torch.ones_like(bias) if weight is None else weight), bias


def _assert_pytorchs(y, expected, what=""):
    assert y.stride() == expected.stride(), f"{what}: strides {y.stride()}, PyTorch's {expected.stride()}"
    assert torch.equal(y, expected), f"{what}: largest difference {(y.double() - expected.double()).abs().max()}"


# ------------------------------------------------------------------------------------------------
# PyTorch's exact result and layout
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("affine", AFFINE)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_function_returns_pytorchs_result_and_layout(layout, dtype, affine, host_path):
    x = make_input(layout, dtype)
    weight, bias = _params(x.shape[1], dtype, affine)
    _assert_pytorchs(gn_patch.group_norm_act(x, GROUPS, weight, bias), _stock(x, weight, bias), layout)


@pytest.mark.parametrize("activation", ["gelu", "mish", "identity"])
@pytest.mark.parametrize("layout", ["issue_permuted", "channels_last", "non_dense"])
def test_modulated_result_and_layout(layout, activation, host_path):
    x = make_input(layout, torch.float32)
    n, c = x.shape[:2]
    scale, shift = 0.5 * _randn(n, c, seed=3), _randn(n, c, seed=4)
    y = gn_patch.group_norm_act(x, GROUPS, activation=activation, scale=scale, shift=shift)
    u = F.group_norm(x, GROUPS) * (1 + scale[:, :, None, None]) + shift[:, :, None, None]
    _assert_pytorchs(y, ACTIVATIONS[activation](u), layout)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_module_returns_pytorchs_result_and_layout(layout, host_path):
    x = make_input(layout, torch.float32)
    stock = torch.nn.GroupNorm(GROUPS, x.shape[1])
    with torch.no_grad():
        stock.weight.copy_(_params(x.shape[1], torch.float32, "weight")[0])
    fused = gn_patch.GroupNormAct.from_group_norm(stock, "SiLU")
    with torch.no_grad():
        _assert_pytorchs(fused(x), F.silu(stock(x)), layout)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_traced_layout_is_the_real_one(layout, host_path):
    """Fake tensors (what torch.compile and torch.export trace with) get the layout the real call returns; PyTorch's
    own fake group_norm returns NCHW for channels-last CPU input (torch 2.14), where the CPU kernel keeps it."""
    x = make_input(layout, torch.float32)
    real = gn_patch.group_norm_act(x, GROUPS)
    with FakeTensorMode() as mode:
        fake = gn_patch.group_norm_act(mode.from_tensor(x), GROUPS)
    assert fake.stride() == real.stride(), f"fake strides {fake.stride()}, real {real.stride()}"


@pytest.mark.parametrize("layout", ["channels_last", "channels_last_3d", "issue_permuted"])
def test_compiled_result_and_layout(layout, host_path):
    x = make_input(layout, torch.float32)
    weight, bias = _params(x.shape[1], torch.float32, "weight_bias")
    compiled = torch.compile(lambda t: gn_patch.group_norm_act(t, GROUPS, weight, bias), backend="aot_eager",
                             fullgraph=True)
    _assert_pytorchs(compiled(x), _stock(x, weight, bias), layout)


def test_unet_patched_without_channels_last_is_bit_identical(host_path):
    """patch_model(channels_last=False): every norm takes PyTorch's path, so outputs equal stock's bit for bit."""
    stock, patched = tiny_models.tiny_sd15_unet(), tiny_models.tiny_sd15_unet()
    gn_patch.patch_model(patched, channels_last=False)
    inputs = tiny_models.sd15_unet_inputs()
    with torch.no_grad():
        assert torch.equal(patched(**inputs).sample, stock(**inputs).sample)


# ------------------------------------------------------------------------------------------------
# CPU training: never PyTorch's crashing GroupNorm backward
# ------------------------------------------------------------------------------------------------
class FaultyBackwardCalls(TorchDispatchMode):
    """Records the calls of PyTorch's CPU GroupNorm backward that torch 2.13 cannot run: channels-last input without
    its gradient (SIGSEGV), a bias gradient without a weight ("tensor does not have a device")."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.native_group_norm_backward.default:
            x, weight, mask = args[1], args[4], args[9]
            channels_last = suggest_memory_format(x) != torch.contiguous_format
            if x.is_cpu and ((channels_last and not mask[0]) or (weight is None and mask[2])):
                self.calls.append((tuple(x.stride()), weight is None, list(mask)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("affine", ["weight_bias", "weight", "bias"])
@pytest.mark.parametrize("layout", ["channels_last", "channels_last_3d"])
def test_norm_only_training_on_channels_last_input(layout, affine, host_path):
    """The input needs no gradient, the parameters do (the first norm of a model fine-tuned norms-only): computed
    as from an NCHW copy (PyTorch's NCHW values and gradients) in PyTorch's channels-last layout."""
    x = make_input(layout, torch.float32)
    params = [p.requires_grad_(True) if p is not None else None for p in _params(x.shape[1], torch.float32, affine)]
    with FaultyBackwardCalls() as faulty:
        y = gn_patch.group_norm_act(x, GROUPS, *params)
        y.square().sum().backward()
    assert not faulty.calls, f"PyTorch's faulty GroupNorm backward was called: {faulty.calls}"
    stock_params = _trainable_reference(params)
    expected = _stock(x.contiguous(), *stock_params)
    expected.square().sum().backward()
    assert y.stride() == _stock(x, *params).stride()
    assert torch.equal(y, expected)
    for p, q in zip(params, stock_params):
        if p is not None and p.requires_grad:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("x_needs_grad", [False, True])
@pytest.mark.parametrize("layout", ["channels_last", "non_dense"])
def test_bias_without_weight_trains(layout, x_needs_grad, host_path):
    x = make_input(layout, torch.float32).detach().requires_grad_(x_needs_grad)
    bias = _params(x.shape[1], torch.float32, "bias")[1].requires_grad_(True)
    with FaultyBackwardCalls() as faulty:
        gn_patch.group_norm_act(x, GROUPS, None, bias).square().sum().backward()
    assert not faulty.calls, f"PyTorch's faulty GroupNorm backward was called: {faulty.calls}"
    x_ref = x.detach().contiguous().requires_grad_(x_needs_grad)
    ones, bias_ref = _trainable_reference((None, bias))
    _stock(x_ref, ones, bias_ref).square().sum().backward()
    torch.testing.assert_close(bias.grad, bias_ref.grad)
    if x_needs_grad:
        torch.testing.assert_close(x.grad, x_ref.grad)


NORM_ONLY_FINE_TUNING = """
import sys

import torch
from torch import nn

import gn_patch
from tests import tiny_models

if sys.argv[1] == "cpp":
    assert gn_patch.extension.kernels_available()


def norm_gradients(patch):
    model = tiny_models.tiny_sd15_unet().train()
    if patch:
        gn_patch.patch_model(model)
    for module in model.modules():
        for param in module.parameters(recurse=False):
            param.requires_grad_(isinstance(module, nn.GroupNorm))
    model(**tiny_models.sd15_unet_inputs()).sample.square().mean().backward()
    return {name: p.grad for name, p in model.named_parameters() if p.requires_grad}


stock, patched = norm_gradients(False), norm_gradients(True)
assert stock and stock.keys() == patched.keys()
for name, grad in stock.items():
    error = tiny_models.rel_l2(patched[name], grad)
    assert error < 1e-4, f"{name}: relative L2 difference {error:.3g}"
print(len(stock), "norm parameters")
"""


def test_norm_only_fine_tuning_of_a_patched_unet(host_path):
    """Freeze all but the GroupNorms, train on the CPU (fp32): the patched model runs forward and backward (in a
    subprocess: a crash in PyTorch fails the test instead of killing pytest) and its gradients are stock's."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, "-c", NORM_ONLY_FINE_TUNING, host_path], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"exit status {run.returncode}\n{run.stdout}\n{run.stderr[-3000:]}"


# ------------------------------------------------------------------------------------------------
# torch.export of a patched model
# ------------------------------------------------------------------------------------------------
def _call_targets(program) -> list[str]:
    return [str(n.target) for n in program.graph.nodes if n.op == "call_function"]


def test_export_of_a_patched_unet_keeps_the_op(kernel_path_on_cpu):
    """Each fused norm of a patched tiny UNet (channels-last input, kernel path emulated) is one gn_patch op in the
    exported program (the kernels' op once decomposed), and the program computes stock's outputs."""
    stock, patched = tiny_models.tiny_sd15_unet(), tiny_models.tiny_sd15_unet()
    gn_patch.patch_model(patched)
    norms = sum(isinstance(m, gn_patch.GroupNormAct) for m in patched.modules())
    inputs = tiny_models.sd15_unet_inputs()
    inputs["sample"] = inputs["sample"].contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        exported = torch.export.export(patched, (), inputs)
        targets = _call_targets(exported)
        assert targets.count("gn_patch.group_norm_act_dispatch.default") == norms > 0, sorted(set(targets))
        assert not [t for t in targets if "aten.group_norm" in t or "native_group_norm" in t]
        decomposed = _call_targets(exported.run_decompositions())
        assert sum(map(decomposed.count, tiny_models.KERNEL_TARGETS)) == norms, sorted(set(decomposed))
        tiny_models.assert_same_outputs(exported.module()(**inputs), stock(**inputs))


def test_func_transforms_over_channels_last_input(host_path):
    """torch.func over channels-last CPU input, where functorch cannot be asked for a per-sample layout: vmap over
    per-sample channels-last input, over a batched input_offset or input_bias, the hessian over the weight; PyTorch's
    results."""
    x = CHANNELS_LAST(_randn(2, 16, 4, 4))
    per_sample = torch.stack([x, 2 * x + 1])  # each sample channels-last
    assert not per_sample.is_contiguous()
    try:
        want = torch.func.vmap(lambda t: _stock(t, None, None))(per_sample)
    except RuntimeError as error:
        pytest.skip(f"this torch's own group_norm takes no channels-last sample under vmap (torch 2.13): {error}")
    torch.testing.assert_close(torch.func.vmap(lambda t: gn_patch.group_norm_act(t, GROUPS))(per_sample), want)
    offsets, biases = _randn(3, 2, 16, 1, 1, seed=3), _randn(3, 16, seed=4)
    torch.testing.assert_close(torch.func.vmap(lambda o: gn_patch.group_norm_act(x, GROUPS, input_offset=o))(offsets),
                               torch.func.vmap(lambda o: _stock(x + o, None, None))(offsets))
    torch.testing.assert_close(torch.func.vmap(lambda b: gn_patch.group_norm_act(x, GROUPS, input_bias=b))(biases),
                               torch.func.vmap(lambda b: _stock(x + b.view(1, 16, 1, 1), None, None))(biases))
    weight = 1 + 0.5 * _randn(16, seed=1)
    torch.testing.assert_close(torch.func.hessian(lambda w: gn_patch.group_norm_act(x, GROUPS, w).sum())(weight),
                               torch.func.hessian(lambda w: _stock(x, w, None).sum())(weight), atol=1e-5, rtol=1e-4)
