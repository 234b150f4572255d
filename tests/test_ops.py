"""CPU tests of the op layer (gn_patch/ops.py): public API, PyTorch path, errors, op registration (schema, fake,
autograd), the reference backward formula the kernels implement, and torch.compile tracing."""

import pytest
import torch
import torch.nn.functional as F

import gn_patch
from gn_patch.ops import ACTIVATIONS

from .conftest import TOLERANCES
from .reference import assert_close, reference, reference_grads, random_input

ACTS = sorted(ACTIVATIONS)
SHAPES = {
    "rank2": (4, 16),
    "rank3_transposed": (2, 16, 7),
    "rank4": (2, 16, 5, 3),
    "rank5": (2, 16, 3, 2, 3),
    "hw_1": (3, 12, 1, 1),
}


def affine(channels, dtype=torch.float32, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(channels, generator=gen) * 0.5 + 1).to(dtype), (torch.randn(channels, generator=gen) * 0.5).to(dtype)


@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("case", list(SHAPES))
def test_pytorch_path_matches_group_norm_then_activation(case, activation):
    shape = SHAPES[case]
    x = random_input(shape, torch.float32, "cpu")
    w, b = affine(shape[1])
    y = gn_patch.group_norm_act(x, 4, w, b, 1e-5, activation)
    expected = ACTIVATIONS[activation](F.group_norm(x, 4, w, b, 1e-5))
    torch.testing.assert_close(y, expected, rtol=0, atol=0)
    assert_close(y, reference(x, 4, w, b, 1e-5, activation), **TOLERANCES[torch.float32], what=case)


@pytest.mark.parametrize("fmt,shape", [(torch.channels_last, (2, 8, 4, 4)), (torch.channels_last_3d, (2, 8, 2, 3, 3))])
def test_pytorch_path_keeps_memory_format(fmt, shape):
    x = torch.randn(shape).to(memory_format=fmt)
    y = gn_patch.group_norm_act(x, 4)
    assert y.is_contiguous(memory_format=fmt)


def test_activation_aliases():
    x = torch.randn(2, 8, 3, 3)
    torch.testing.assert_close(gn_patch.group_norm_act(x, 2, activation="swish"), F.silu(F.group_norm(x, 2)))
    torch.testing.assert_close(gn_patch.group_norm_act(x, 2, activation=None), F.group_norm(x, 2))
    assert gn_patch.canonical_activation("swish") == "silu"


class TestErrors:
    def test_channels_not_divisible(self):
        with pytest.raises(RuntimeError, match=r"divisible by num_groups.*\[2, 6, 3, 3\].*num_groups=4"):
            gn_patch.group_norm_act(torch.randn(2, 6, 3, 3), 4)

    def test_weight_shape(self):
        with pytest.raises(RuntimeError, match="weight to be a vector of size equal to the number of channels"):
            gn_patch.group_norm_act(torch.randn(2, 8, 3, 3), 4, torch.ones(6))

    @pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
    def test_integer_input(self, dtype):
        with pytest.raises(TypeError, match="floating-point"):
            gn_patch.group_norm_act(torch.ones(2, 8, 3, 3, dtype=dtype), 4)

    def test_unknown_activation(self):
        with pytest.raises(ValueError, match="unknown activation 'tanh'"):
            gn_patch.group_norm_act(torch.randn(2, 8, 3, 3), 4, activation="tanh")


# ------------------------------------------------------------------------------------------------
# The op itself (CPU reference implementation + registrations)
# ------------------------------------------------------------------------------------------------
OP = torch.ops.gn_patch.group_norm_act.default
OP_BWD = torch.ops.gn_patch.group_norm_act_backward.default


@pytest.mark.parametrize("activation", ACTS)
def test_reference_forward_and_stats(activation):
    x = random_input((2, 12, 4, 5), torch.float64, "cpu")
    w, b = affine(12, torch.float64)
    y, mean, rstd = OP(x, w, b, 3, 1e-5, activation)
    assert_close(y, reference(x, 3, w, b, 1e-5, activation), **TOLERANCES[torch.float64], what="y")
    xg = x.reshape(2, 3, -1)
    assert_close(mean, xg.mean(-1), **TOLERANCES[torch.float64], what="mean")
    assert_close(rstd, torch.rsqrt(xg.var(-1, unbiased=False) + 1e-5), **TOLERANCES[torch.float64], what="rstd")
    assert y.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("with_affine", [True, False])
def test_reference_backward_formula(activation, with_affine):
    """The closed-form backward (the one the CUDA kernels implement) equals autograd of the reference."""
    x = random_input((2, 12, 3, 5), torch.float64, "cpu")
    w, b = affine(12, torch.float64) if with_affine else (None, None)
    dy = random_input((2, 12, 3, 5), torch.float64, "cpu", scale=1.0, seed=7)
    _, mean, rstd = OP(x, w, b, 4, 1e-5, activation)
    dx, dw, db = OP_BWD(dy, x, w, b, mean, rstd, 4, activation, [True, True, True])
    rdx, rdw, rdb = reference_grads(x, 4, w, b, 1e-5, activation, dy)
    assert_close(dx, rdx, atol=1e-9, rtol=1e-9, what="dx")
    if with_affine:
        assert_close(dw, rdw, atol=1e-9, rtol=1e-9, what="dweight")
        assert_close(db, rdb, atol=1e-9, rtol=1e-9, what="dbias")
    else:
        assert dw.numel() == 0 and db.numel() == 0


def test_gradcheck_through_op():
    x = random_input((2, 6, 3, 2), torch.float64, "cpu").requires_grad_(True)
    w, b = (t.requires_grad_(True) for t in affine(6, torch.float64))
    fn = lambda x, w, b: OP(x, w, b, 3, 1e-5, "gelu_tanh")[0]
    assert torch.autograd.gradcheck(fn, (x, w, b))


def test_opcheck():
    x = random_input((2, 8, 3, 3), torch.float32, "cpu").requires_grad_(True)
    w, b = (t.requires_grad_(True) for t in affine(8))
    torch.library.opcheck(torch.ops.gn_patch.group_norm_act, (x, w, b, 4, 1e-5, "silu"))
    torch.library.opcheck(torch.ops.gn_patch.group_norm_act, (x, None, None, 2, 1e-6, "identity"))


@pytest.mark.parametrize("shape,fmt", [((2, 8, 4, 4), torch.channels_last), ((2, 8, 2, 4, 4), torch.channels_last_3d)])
def test_fake_keeps_channels_last(shape, fmt):
    x = torch.empty(shape, device="meta").to(memory_format=fmt)
    y, mean, rstd = OP(x, None, None, 4, 1e-5, "silu")
    assert y.stride() == x.stride() and y.dtype == x.dtype
    assert mean.shape == rstd.shape == (2, 4) and mean.dtype == torch.float32
    x16 = torch.empty((2, 16, 7), device="meta", dtype=torch.float16).transpose(1, 2).contiguous().transpose(1, 2)
    assert OP(x16, None, None, 4, 1e-5, "silu")[0].stride() == x16.stride()


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph_forward_backward(dynamic):
    def fn(x, w, b):
        return torch.ops.gn_patch.group_norm_act(x, w, b, 4, 1e-5, "silu")[0].sum()

    compiled = torch.compile(fn, fullgraph=True, dynamic=dynamic, backend="aot_eager")
    for shape in [(2, 8, 4, 4), (3, 8, 6, 5)]:
        x = random_input(shape, torch.float32, "cpu").requires_grad_(True)
        w, b = (t.requires_grad_(True) for t in affine(8))
        compiled(x, w, b).backward()
        expected = [t.grad.clone() for t in (x, w, b)]
        for t in (x, w, b):
            t.grad = None
        fn(x, w, b).backward()
        for got, want in zip(expected, (x.grad, w.grad, b.grad)):
            torch.testing.assert_close(got, want)


def test_double_backward_through_op():
    """create_graph=True (gradient penalties, Hessian-vector products) differentiates the gradients too."""
    x = random_input((2, 6, 3, 2), torch.float64, "cpu").requires_grad_(True)
    w, b = (t.requires_grad_(True) for t in affine(6, torch.float64))
    fn = lambda x, w, b: OP(x, w, b, 3, 1e-5, "silu")[0]
    assert torch.autograd.gradgradcheck(fn, (x, w, b))


@pytest.mark.parametrize("call,match", [
    (lambda: OP(torch.randn(1, 6, 1, 2), None, None, 4, 1e-5, "identity"), "divisible by num_groups"),
    (lambda: OP(torch.randn(2, 8, 3), torch.ones(2, 4), None, 4, 1e-5, "silu"), "weight to be a vector"),
    (lambda: OP(torch.randn(2, 8, 3), None, torch.ones(1), 4, 1e-5, "silu"), "bias to be a vector"),
    (lambda: OP(torch.arange(48).reshape(2, 8, 3), None, None, 4, 1e-5, "silu"), "floating-point"),
    (lambda: OP(torch.randn(2, 8, 3), None, None, 0, 1e-5, "silu"), "num_groups must be positive"),
    (lambda: OP(torch.randn(2, 8, 3), None, None, 4, 1e-5, "tanh"), "unknown activation 'tanh'"),
    (lambda: OP(torch.randn(8), None, None, 4, 1e-5, "silu"), "2-D to 5-D"),
    (lambda: OP(torch.randn(2, 8, 0, 3), None, None, 4, 1e-5, "silu"), "empty spatial size"),
    (lambda: OP(torch.randn(2, 8, 3, dtype=torch.bfloat16), torch.ones(8, dtype=torch.bfloat16), torch.zeros(8), 4,
                1e-5, "silu"), "must have the same dtype"),
    (lambda: OP(torch.empty(2, 8, 0, device="meta"), None, None, 4, 1e-5, "silu"), "empty spatial size"),
    (lambda: OP(torch.empty(2, 8, 3, device="meta"), torch.ones(3, device="meta"), None, 4, 1e-5, "silu"),
     "weight to be a vector"),
    (lambda: OP_BWD(torch.randn(2, 8, 3), torch.randn(2, 8, 3), None, None, torch.zeros(1, 4), torch.ones(1, 4), 4,
                    "silu", [True, False, False]), "mean and rstd"),
])
def test_op_rejects_bad_input(call, match):
    with pytest.raises(RuntimeError, match=match):
        call()


def test_op_empty_batch():
    x = torch.empty(0, 8, 3, 3).requires_grad_(True)
    w, b = (t.requires_grad_(True) for t in affine(8))
    y, mean, rstd = OP(x, w, b, 4, 1e-5, "silu")
    assert y.shape == x.shape and mean.shape == rstd.shape == (0, 4)
    y.sum().backward()
    assert torch.equal(w.grad, torch.zeros(8)) and torch.equal(b.grad, torch.zeros(8))
    torch.library.opcheck(torch.ops.gn_patch.group_norm_act, (x, w, b, 4, 1e-5, "silu"))


def test_activation_must_be_a_name():
    with pytest.raises(ValueError, match="unknown activation"):
        gn_patch.canonical_activation(["silu"])


def test_transform_detection_and_tracing():
    """torch.func and forward AD are detected (the kernel op has no rules for them), and the check itself
    traces under torch.compile(fullgraph=True)."""
    import torch.autograd.forward_ad as fwAD

    from gn_patch.ops import _transform_active

    x = torch.randn(2, 8, 3)
    assert not _transform_active(x)
    seen = []
    torch.func.grad(lambda t: (seen.append(_transform_active(t)), t.sum())[1])(x)
    with fwAD.dual_level():
        seen.append(_transform_active(fwAD.make_dual(x, torch.ones_like(x))))
    assert seen == [True, True]
    compiled = torch.compile(lambda t: t * 2 if not _transform_active(t) else t, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x), x * 2)


def test_compiled_backward_uses_the_backward_op():
    """Under torch.compile the backward graph keeps the fused backward op (not a recomputation)."""
    from torch._dynamo.backends.common import aot_autograd

    backward_ops = set()

    def record_backward(gm, _inputs):
        backward_ops.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    backend = aot_autograd(fw_compiler=lambda gm, _: gm, bw_compiler=record_backward)
    compiled = torch.compile(lambda x, w, b: OP(x, w, b, 4, 1e-5, "silu")[0].sum(), backend=backend, fullgraph=True)
    x = random_input((2, 8, 3, 3), torch.float32, "cpu").requires_grad_(True)
    w, b = (t.requires_grad_(True) for t in affine(8))
    compiled(x, w, b).backward()
    assert "gn_patch.group_norm_act_backward.default" in backward_ops


@pytest.fixture
def kernel_path_on_cpu(monkeypatch):
    """Route what the CUDA kernels would take to the op's CPU implementation: the dispatch logic of the kernel
    path (transform checks, layout checks, the op's autograd and compile behaviour) runs without a GPU."""
    from gn_patch import ops

    calls = []

    def covers(x, weight, bias):
        taken = ops._kernel_accepts(x, weight, bias)
        calls.append(taken)
        return taken

    monkeypatch.setattr(ops, "_kernel_covers", covers)
    return calls


def _stock_and_fused(shape=(2, 8, 3, 3), groups=4):
    torch.manual_seed(0)
    fused = gn_patch.GroupNormAct(groups, shape[1])
    with torch.no_grad():
        fused.weight.normal_()
        fused.bias.normal_()
    stock = torch.nn.Sequential(torch.nn.GroupNorm(groups, shape[1]), torch.nn.SiLU())
    stock[0].load_state_dict(fused.state_dict())
    x = torch.randn(shape).to(memory_format=torch.channels_last)  # float32: a dtype the kernels take
    return fused, stock, x


def test_func_grad_over_parameters_takes_pytorch_path(kernel_path_on_cpu):
    """torch.func.grad / jacrev over the parameters (functional_call) wrap weight and bias, not x: still the
    PyTorch path, with nn.GroupNorm's gradients."""
    fused, stock, x = _stock_and_fused()

    def loss(module, params, prefix=""):
        params = {prefix + name: value for name, value in params.items()}
        return torch.func.functional_call(module, params, (x,)).square().sum()

    params = dict(fused.named_parameters())
    got = torch.func.grad(lambda p: loss(fused, p))(params)
    want = torch.func.grad(lambda p: loss(stock, p, prefix="0."))(params)
    for name in ("weight", "bias"):
        torch.testing.assert_close(got[name], want[name])
    jacobian = torch.func.jacrev(lambda w: torch.func.functional_call(fused, {"weight": w}, (x,)))(fused.weight)
    torch.testing.assert_close(
        jacobian, torch.func.jacrev(lambda w: torch.func.functional_call(stock, {"0.weight": w}, (x,)))(fused.weight))
    assert kernel_path_on_cpu and not any(kernel_path_on_cpu)
    fused(x)
    assert kernel_path_on_cpu[-1]  # outside the transforms the same call takes the kernel path


def test_vmap_over_channels_last_input(kernel_path_on_cpu):
    """vmap over a batch of 4-D inputs: the layout query (which raises inside vmap) is never reached."""
    fused, stock, x = _stock_and_fused()
    batch = torch.stack([x, x * 2 + 1])
    got = torch.func.vmap(fused)(batch)
    want = torch.stack([stock(x), stock(x * 2 + 1)])
    torch.testing.assert_close(got, want)
    per_sample = torch.func.vmap(torch.func.grad(lambda t: fused(t[None]).sum()))(x)
    torch.testing.assert_close(per_sample, torch.func.vmap(torch.func.grad(lambda t: stock(t[None]).sum()))(x))

