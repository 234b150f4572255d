"""CPU tests of the op layer (gn_patch/ops.py and the extension's C++ host path, csrc/autograd.cpp): public API,
PyTorch's path (in Python before the extension loads, in C++ after), errors, op registration (schema, fake, the
C++ autograd), the reference forward and backward formulas the kernels implement, transforms and tracing."""

import gc
import warnings
from typing import ClassVar

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import gn_patch
from gn_patch import extension
from gn_patch.ops import ACTIVATIONS
from torch.utils._python_dispatch import TorchDispatchMode

from . import tiny_models
from .conftest import TOLERANCES
from .reference import assert_close, random_input, reference

ACTS = sorted(ACTIVATIONS)
SHAPES = {
    "rank2": (4, 16),
    "rank3_transposed": (2, 16, 7),
    "rank4": (2, 16, 5, 3),
    "rank5": (2, 16, 3, 2, 3),
    "hw_1": (3, 12, 1, 1),
}
OP = torch.ops.gn_patch.group_norm_act.default
INFERENCE_OP = torch.ops.gn_patch.group_norm_act_inference.default
DISPATCH = torch.ops.gn_patch.group_norm_act_dispatch.default
OP_BWD = torch.ops.gn_patch.group_norm_act_backward.default
ALL_GRADS = [True] * 5


def affine(channels, dtype=torch.float32, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return ((torch.randn(channels, generator=gen) * 0.5 + 1).to(dtype),
            (torch.randn(channels, generator=gen) * 0.5).to(dtype))


def modulation(n, channels, dtype=torch.float32, seed=2):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, channels, generator=gen) * 0.5).to(dtype), torch.randn(n, channels, generator=gen).to(dtype)


# ------------------------------------------------------------------------------------------------
# Public function: PyTorch's path
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("case", list(SHAPES))
def test_pytorch_path_matches_group_norm_then_activation(case, activation, host_path):
    shape = SHAPES[case]
    x = random_input(shape, torch.float32, "cpu")
    w, b = affine(shape[1])
    y = gn_patch.group_norm_act(x, 4, w, b, 1e-5, activation)
    expected = ACTIVATIONS[activation](F.group_norm(x, 4, w, b, 1e-5))
    torch.testing.assert_close(y, expected, rtol=0, atol=0)
    assert y.stride() == expected.stride()
    assert_close(y, reference(x, 4, w, b, 1e-5, activation), **TOLERANCES[torch.float32], what=case)


@pytest.mark.parametrize("shape,permutation", [((2, 8, 4, 4), (0, 3, 1, 2)), ((1, 32, 16, 16), (0, 2, 3, 1)),
                                               ((2, 8, 2, 3, 3), (0, 4, 1, 2, 3))])
def test_pytorch_path_returns_pytorchs_layout(shape, permutation, host_path):
    """Whatever the strides (channels_last, permuted views with size-1 batch), the layout is PyTorch's own."""
    x = torch.randn([shape[i] for i in permutation]).permute([permutation.index(i) for i in range(len(shape))])
    y = gn_patch.group_norm_act(x, 4)
    expected = F.silu(F.group_norm(x, 4))
    assert y.stride() == expected.stride()
    torch.testing.assert_close(y, expected, rtol=0, atol=0)


@pytest.mark.parametrize("modulation_shape", ["n_c", "n_c_1_1"])
@pytest.mark.parametrize("activation", ["silu", "mish", "identity"])
def test_pytorch_path_per_sample_scale_shift(modulation_shape, activation, host_path):
    """scale/shift as diffusers' scale_shift ResnetBlock2D and AdaGroupNorm apply them: exactly stock's result."""
    x = random_input((2, 8, 3, 5), torch.float32, "cpu")
    w, b = affine(8)
    scale, shift = modulation(2, 8)
    if modulation_shape == "n_c_1_1":
        scale, shift = scale[:, :, None, None], shift[:, :, None, None]
    y = gn_patch.group_norm_act(x, 4, w, b, 1e-5, activation, scale=scale, shift=shift)
    expected = ACTIVATIONS[activation](F.group_norm(x, 4, w, b, 1e-5) * (1 + scale.view(2, 8, 1, 1))
                                       + shift.view(2, 8, 1, 1))
    torch.testing.assert_close(y, expected, rtol=0, atol=0)
    only_shift = gn_patch.group_norm_act(x, 4, w, b, 1e-5, activation, shift=shift)
    torch.testing.assert_close(only_shift, ACTIVATIONS[activation](F.group_norm(x, 4, w, b) + shift.view(2, 8, 1, 1)),
                               rtol=0, atol=0)


@pytest.mark.parametrize("path", ["python", "extension", "kernel_path"])
def test_batch_one_scale_shift_serves_every_sample(path, monkeypatch, request):
    """scale and shift of x's rank with batch size 1, (1, C, 1, 1), broadcast over the batch as diffusers'
    ``h * (1 + scale) + shift`` does (a block called with one timestep embedding for a batch): stock's values, and
    their gradients summed over the batch, on PyTorch's path and through the op (its kernel path emulated on the
    CPU)."""
    if path == "python":
        monkeypatch.setattr(extension, "loaded", False)
    else:
        request.getfixturevalue("kernel_path_on_cpu" if path == "kernel_path" else "ext")
    x = random_input((3, 8, 3, 5), torch.float64, "cpu").float().contiguous(memory_format=torch.channels_last)
    scale, shift = (t[:1, :, None, None].clone().requires_grad_(True) for t in modulation(2, 8))
    y = gn_patch.group_norm_act(x, 4, scale=scale, shift=shift)
    y.square().sum().backward()
    leaves = [t.detach().double().requires_grad_(True) for t in (scale, shift)]
    expected = F.silu(F.group_norm(x.double(), 4) * (1 + leaves[0]) + leaves[1])
    expected.square().sum().backward()
    assert y.shape == x.shape
    assert_close(y, expected, **TOLERANCES[torch.float32], what="y")
    for got, leaf in zip((scale.grad, shift.grad), leaves):
        assert got.shape == (1, 8, 1, 1)
        assert_close(got, leaf.grad, atol=1e-4, rtol=1e-4, what="grad")


@pytest.mark.parametrize("shift_batch", [3, 1])
@pytest.mark.parametrize("path", ["python", "extension", "kernel_path"])
def test_batch_one_x_takes_the_modulation_batch(path, shift_batch, monkeypatch, request):
    """x of batch 1 with a scale of x's rank for a batch of 3 and a shift of batch 3 or 1 (a block called with one
    image and three timestep embeddings): stock's ``h * (1 + scale) + shift`` broadcasts h (and a batch-1 shift)
    over them, y has batch 3; the gradients of x and of a batch-1 shift (summed over the batch) as stock's."""
    if path == "python":
        monkeypatch.setattr(extension, "loaded", False)
    else:
        request.getfixturevalue("kernel_path_on_cpu" if path == "kernel_path" else "ext")
    x = random_input((1, 8, 3, 5), torch.float64, "cpu").float().contiguous(memory_format=torch.channels_last)
    x.requires_grad_(True)
    scale, shift = (t[:, :, None, None].clone().requires_grad_(True) for t in modulation(3, 8))
    shift = shift[:shift_batch].detach().clone().requires_grad_(True)
    y = gn_patch.group_norm_act(x, 4, scale=scale, shift=shift)
    y.square().sum().backward()
    leaves = [t.detach().double().requires_grad_(True) for t in (x, scale, shift)]
    expected = F.silu(F.group_norm(leaves[0], 4) * (1 + leaves[1]) + leaves[2])
    expected.square().sum().backward()
    assert y.shape == (3, 8, 3, 5)
    assert_close(y, expected, **TOLERANCES[torch.float32], what="y")
    for got, leaf in zip((x.grad, scale.grad, shift.grad), leaves):
        assert got.shape == leaf.shape
        assert_close(got, leaf.grad, atol=1e-4, rtol=1e-4, what="grad")
    # Stock's own ops on the one image, broadcast afterwards: the same bits and layout.
    stock = F.silu(F.group_norm(x.detach(), 4) * (1 + scale.detach()) + shift.detach())
    assert torch.equal(y.detach(), stock) and y.stride() == stock.stride()


@pytest.mark.parametrize("path", ["python", "extension", "kernel_path"])
def test_modulation_shape_errors(path, monkeypatch, request):
    """A 1-D x given a scale gets F.group_norm's rank error (not one from the scale's check); a scale of another
    batch gets the modulation's message, which names the shapes as given; with an x of batch 1, a 2-D scale of
    another batch and a scale and shift of unequal batches are ValueErrors, a (1, C) shift beside a scale of x's
    rank and batch 3 broadcasts, and a group of one value per image is F.group_norm's error (x as given, not
    broadcast): the same on every route."""
    if path == "python":
        monkeypatch.setattr(extension, "loaded", False)
    else:
        request.getfixturevalue("kernel_path_on_cpu" if path == "kernel_path" else "ext")
    with pytest.raises(RuntimeError, match="Expected at least 2 dimensions"):
        gn_patch.group_norm_act(torch.randn(8), 4, scale=torch.randn(1, 8))
    with pytest.raises(ValueError, match=r"scale must have shape \(N, C\) or \(N, C, 1, ...\) with N x's batch, "
                                         r"for input of shape \[3, 8, 2, 2\]; got \[2, 8, 1, 1\] \(with x's rank, "
                                         r"a batch of 1 on either side broadcasts"):
        gn_patch.group_norm_act(torch.randn(3, 8, 2, 2), 4, scale=torch.randn(2, 8, 1, 1))
    x1 = torch.randn(1, 8, 2, 2).contiguous(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match=r"scale must have shape .*input of shape \[1, 8, 2, 2\]; got \[3, 8\]"):
        gn_patch.group_norm_act(x1, 4, scale=torch.randn(3, 8), shift=torch.randn(3, 8, 1, 1))
    with pytest.raises(ValueError, match=r"scale and shift of batches \[2, 8, 1, 1\] and \[3, 8, 1, 1\] do not "
                                         r"broadcast together"):
        gn_patch.group_norm_act(x1, 4, scale=torch.randn(2, 8, 1, 1), shift=torch.randn(3, 8, 1, 1))
    scale, shift = torch.randn(3, 8, 1, 1), torch.randn(1, 8)
    y = gn_patch.group_norm_act(x1, 4, scale=scale, shift=shift)
    assert torch.equal(y, F.silu(F.group_norm(x1, 4) * (1 + scale) + shift[:, :, None, None]))
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        gn_patch.group_norm_act(torch.randn(1, 8, 1, 1), 8, scale=torch.randn(2, 8, 1, 1))


@pytest.mark.parametrize("path", ["python", "extension"])
def test_module_argument_types(path, monkeypatch, request):
    """GroupNormAct's forward names a scale, shift or input_bias that is no tensor in a TypeError, as
    gn_patch.group_norm_act does, on either host path (the C++ entry declines such a call)."""
    if path == "python":
        monkeypatch.setattr(extension, "loaded", False)
    else:
        request.getfixturevalue("ext")
    module, x = gn_patch.GroupNormAct(4, 8), torch.randn(2, 8, 3, 3)
    for name, value in (("scale", 0.5), ("shift", [1.0] * 8), ("input_bias", 1.0)):
        with pytest.raises(TypeError, match=f"{name} must be a tensor or None, got"):
            module(x, **{name: value})


@pytest.mark.parametrize("path", ["python", "extension"])
def test_num_groups_outside_int64(path, monkeypatch, request):
    """num_groups beyond int64 gets PyTorch's own ValueError on both host paths (F.group_norm's)."""
    if path == "python":
        monkeypatch.setattr(extension, "loaded", False)
    else:
        request.getfixturevalue("ext")
    with pytest.raises(ValueError, match="Overflow when unpacking long long"):
        gn_patch.group_norm_act(torch.randn(2, 8, 3), 2**63)


def test_activation_aliases():
    x = torch.randn(2, 8, 3, 3)
    torch.testing.assert_close(gn_patch.group_norm_act(x, 2, activation="swish"), F.silu(F.group_norm(x, 2)))
    torch.testing.assert_close(gn_patch.group_norm_act(x, 2, activation=None), F.group_norm(x, 2))
    assert gn_patch.canonical_activation("swish") == "silu"


@pytest.mark.parametrize("name,canonical", [("SiLU", "silu"), ("GELU", "gelu"), ("Mish", "mish"), ("Swish", "silu"),
                                            ("None", "identity"), ("ReLU", "relu")])
def test_activation_names_are_case_insensitive(name, canonical):
    assert gn_patch.canonical_activation(name) == canonical


class TestErrors:
    def test_channels_not_divisible(self, host_path):
        with pytest.raises(RuntimeError, match=r"divisible by num_groups.*\[2, 6, 3, 3\].*num_groups=4"):
            gn_patch.group_norm_act(torch.randn(2, 6, 3, 3), 4)

    def test_weight_shape(self, host_path):
        with pytest.raises(RuntimeError, match="weight to be a vector of size equal to the number of channels"):
            gn_patch.group_norm_act(torch.randn(2, 8, 3, 3), 4, torch.ones(6))

    @pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
    def test_integer_input(self, dtype, host_path):
        with pytest.raises(TypeError, match="floating-point"):
            gn_patch.group_norm_act(torch.ones(2, 8, 3, 3, dtype=dtype), 4)

    def test_unknown_activation(self):
        with pytest.raises(ValueError, match="unknown activation 'tanh'"):
            gn_patch.group_norm_act(torch.randn(2, 8, 3, 3), 4, activation="tanh")

    def test_activation_must_be_a_name(self):
        with pytest.raises(ValueError, match="unknown activation"):
            gn_patch.canonical_activation(["silu"])

    def test_input_must_be_a_tensor(self, host_path):
        with pytest.raises(TypeError, match="x must be a tensor, got list"):
            gn_patch.group_norm_act([[1.0, 2.0]], 1)

    @pytest.mark.parametrize("bad", [torch.ones(2, 4), torch.ones(1, 8), torch.ones(2, 8, 2, 1), torch.ones(16)])
    def test_scale_shape(self, bad, host_path):
        with pytest.raises(ValueError, match=r"scale must have shape \(N, C\)"):
            gn_patch.group_norm_act(torch.randn(2, 8, 3, 3), 4, scale=bad)

    def test_one_value_per_channel(self, host_path):
        with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
            gn_patch.group_norm_act(torch.randn(1, 4), 4)

    @pytest.mark.parametrize("num_groups", [2.0, True, "4", None, torch.tensor(4.0), torch.tensor(True)])
    def test_num_groups_not_an_int(self, num_groups, host_path):
        with pytest.raises(TypeError, match=f"num_groups must be an int, got {type(num_groups).__name__}"):
            gn_patch.group_norm_act(torch.randn(2, 8, 3, 3), num_groups)

    @pytest.mark.parametrize("num_groups", [0, -2])
    def test_num_groups_not_positive(self, num_groups, host_path):
        with pytest.raises(ValueError, match=f"num_groups must be positive, got {num_groups}"):
            gn_patch.group_norm_act(torch.randn(2, 8, 3, 3), num_groups)

    @pytest.mark.parametrize("eps", [-1e-5, float("nan"), float("inf")])
    def test_eps_out_of_range(self, eps, host_path):
        with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
            gn_patch.group_norm_act(torch.randn(2, 8, 3, 3), 4, eps=eps)

    @pytest.mark.parametrize("eps", ["1e-5", None, True, 1j, torch.tensor([1e-5, 1e-5]), torch.tensor(True)])
    def test_eps_not_a_number(self, eps, host_path):
        with pytest.raises(TypeError, match="eps must be a float"):
            gn_patch.group_norm_act(torch.randn(2, 8, 3, 3), 4, eps=eps)

    @pytest.mark.parametrize("num_groups,eps", [(np.int64(4), np.float32(1e-3)), (torch.tensor(4), torch.tensor(1e-3)),
                                                (np.int32(4), np.float64(1e-3))], ids=["numpy32", "tensors", "numpy64"])
    def test_numpy_and_tensor_scalars_as_f_group_norm(self, num_groups, eps, host_path):
        """num_groups and eps as F.group_norm takes them besides Python numbers: the same values."""
        x = torch.randn(2, 8, 3, 3)
        expected = F.silu(F.group_norm(x, num_groups, eps=eps))
        assert torch.equal(gn_patch.group_norm_act(x, num_groups, eps=eps), expected)
        module = gn_patch.GroupNormAct(num_groups, 8, eps=eps, affine=False)
        assert type(module.num_groups) is int and type(module.eps) is float
        assert torch.equal(module(x), expected)

    @pytest.mark.parametrize("name", ["weight", "bias", "scale", "shift"])
    def test_parameter_not_a_tensor(self, name, host_path):
        with pytest.raises(TypeError, match=f"{name} must be a tensor or None, got list"):
            gn_patch.group_norm_act(torch.randn(2, 8, 3, 3), 4, **{name: [1.0] * 8})


class TestPythonEntry:
    """gn_patch_C.group_norm_act_dispatch (csrc/python_entry.cpp): the dispatching op called from C++ for eager calls,
    with the OpOverload's results, errors and autograd; what __torch_function__ must see goes through the OpOverload."""

    @staticmethod
    def _args(x, num_groups=4, weight=None, bias=None, eps=1e-5, activation="silu", offset=None, frames_last=False):
        return (x, num_groups, weight, bias, eps, activation, None, None, offset, None, frames_last)

    def test_entry_computes_what_the_op_overload_computes(self, ext):
        assert extension.entry is not None
        x = random_input((2, 8, 3, 3), torch.float32, "cpu").requires_grad_(True)
        w, b = (t.requires_grad_(True) for t in affine(8))
        offset = torch.randn(2, 8, 1, 1)
        y = extension.entry(*self._args(x, 4, w, b, offset=offset))
        expected = DISPATCH(*self._args(x, 4, w, b, offset=offset))
        torch.testing.assert_close(y, expected, rtol=0, atol=0)
        grads = torch.autograd.grad(y.sum(), (x, w, b))
        for got, want in zip(grads, torch.autograd.grad(expected.sum(), (x, w, b))):
            torch.testing.assert_close(got, want, rtol=0, atol=0)

    def test_entry_raises_the_op_overloads_errors(self, ext):
        for args, error in [(self._args(torch.randn(2, 6, 3, 3)), RuntimeError),
                            (self._args(torch.randn(2, 8, 3, 3), activation="tanh"), ValueError),
                            (self._args(torch.ones(2, 8, 3, 3, dtype=torch.int64)), TypeError)]:
            with pytest.raises(error) as raw:
                DISPATCH(*args)
            with pytest.raises(error) as entry:
                extension.entry(*args)
            assert str(entry.value) == str(raw.value)
        with pytest.raises(TypeError, match="takes 11 positional arguments, got 2"):
            extension.entry(torch.randn(2, 8, 3, 3), 4)

    def test_warning_raised_as_an_error_leaves_no_tensor_behind(self, ext):
        """The op's C++ warnings reach Python's warnings (functorch's fallback warns under vmap); where a filter
        raises one, the call raises it and its output is not left alive."""
        x = random_input((2, 8, 3, 3), torch.float32, "cpu")
        batch = torch.stack([x, x])
        call = torch.func.vmap(lambda v: extension.entry(*self._args(v)))

        def live_tensors():
            gc.collect()
            return sum(isinstance(o, torch.Tensor) for o in gc.get_objects())

        before = live_tensors()
        for _ in range(3):
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                with pytest.raises(UserWarning, match="batching rule"):
                    call(batch)
        assert live_tensors() == before

    def test_entry_declines_what_the_op_overload_must_take(self, ext):
        class Subclass(torch.Tensor):
            pass

        x = torch.randn(2, 8, 3, 3)
        declined = [self._args(x.as_subclass(Subclass)), self._args(x, eps=0), self._args(x, num_groups=True),
                    self._args(x, weight=[1.0] * 8), self._args(x, offset=1.5),
                    (*self._args(x)[:-1], 0)]
        declined.append(self._args(x, activation="silu\ud800"))  # not UTF-8 encodable: the OpOverload's error
        for args in declined:
            assert extension.entry(*args) is None
        with _FunctionRecorder():
            assert extension.entry(*self._args(x)) is None

    def test_torch_function_sees_the_calls_the_entry_declines(self, ext):
        """A __torch_function__ mode, or a tensor subclass overriding it, sees the dispatching op's OpOverload, as
        before the entry; the result is the same."""
        x = random_input((2, 8, 3, 3), torch.float32, "cpu")
        expected = gn_patch.group_norm_act(x, 4)
        with _FunctionRecorder() as recorder:
            y = gn_patch.group_norm_act(x, 4)
        assert DISPATCH in recorder.funcs
        torch.testing.assert_close(y, expected, rtol=0, atol=0)

        class Recording(torch.Tensor):
            funcs: ClassVar[list] = []

            @classmethod
            def __torch_function__(cls, func, types, args=(), kwargs=None):
                cls.funcs.append(func)
                return super().__torch_function__(func, types, args, kwargs or {})

        y = gn_patch.group_norm_act(x.as_subclass(Recording), 4)
        assert DISPATCH in Recording.funcs
        torch.testing.assert_close(y.as_subclass(torch.Tensor), expected, rtol=0, atol=0)


class _FunctionRecorder(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.funcs = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.funcs.append(func)
        return func(*args, **(kwargs or {}))


class _DispatchRecorder(TorchDispatchMode):
    """The ops that reach the Python dispatch key, in order."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


class TestRawOpArguments:
    """The ops under torch.ops.gn_patch check what the public function checks, with the same messages."""

    def _dispatch(self, x, num_groups=4, eps=1e-5, activation="silu"):
        return torch.ops.gn_patch.group_norm_act_dispatch(x, num_groups, None, None, eps, activation, None, None)

    def test_unknown_activation_same_error_as_the_function(self, ext):
        x = torch.randn(2, 8, 3, 3)
        with pytest.raises(ValueError) as public:
            gn_patch.group_norm_act(x, 4, activation="tanh")
        for call in (lambda: self._dispatch(x, activation="tanh"),
                     lambda: OP(x, None, None, None, None, 4, 1e-5, "tanh"),
                     lambda: OP_BWD(x, x, None, None, None, None, torch.zeros(2, 4), torch.ones(2, 4), 4, "tanh",
                                    ALL_GRADS)):
            with pytest.raises(ValueError) as raw:
                call()
            assert str(raw.value).splitlines()[0] == str(public.value)

    @pytest.mark.parametrize("name", ["SiLU", "Swish", "GELU_tanh", "NONE"])
    def test_activation_is_case_insensitive(self, name, ext):
        x = torch.randn(2, 8, 3, 3, dtype=torch.float64)
        canonical = gn_patch.canonical_activation(name)
        want = OP(x, None, None, None, None, 4, 1e-5, canonical)
        torch.testing.assert_close(OP(x, None, None, None, None, 4, 1e-5, name), want, rtol=0, atol=0)
        torch.testing.assert_close(self._dispatch(x, activation=name), want[0])
        torch.testing.assert_close(OP_BWD(x, x, None, None, None, None, *want[1:], 4, name, ALL_GRADS)[0],
                                   OP_BWD(x, x, None, None, None, None, *want[1:], 4, canonical, ALL_GRADS)[0])

    def test_dispatch_checks_num_groups_eps_and_dtype(self, ext):
        x = torch.randn(2, 8, 3, 3)
        with pytest.raises(ValueError, match="num_groups must be positive, got 0"):
            self._dispatch(x, num_groups=0)
        with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
            self._dispatch(x, eps=-1.0)
        with pytest.raises(TypeError, match="x must be a floating-point tensor"):
            self._dispatch(x.long())


# ------------------------------------------------------------------------------------------------
# The op itself: CPU reference implementation, fake, C++ autograd
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("modulated", [False, True])
def test_reference_forward_and_stats(activation, modulated):
    x = random_input((2, 12, 4, 5), torch.float64, "cpu")
    w, b = affine(12, torch.float64)
    scale, shift = modulation(2, 12, torch.float64) if modulated else (None, None)
    y, mean, rstd = OP(x, w, b, scale, shift, 3, 1e-5, activation)
    u = F.group_norm(x, 3, w, b, 1e-5)
    if modulated:
        u = u * (1 + scale[:, :, None, None]) + shift[:, :, None, None]
    assert_close(y, ACTIVATIONS[activation](u), **TOLERANCES[torch.float64], what="y")
    xg = x.reshape(2, 3, -1)
    assert_close(mean, xg.mean(-1), **TOLERANCES[torch.float64], what="mean")
    assert_close(rstd, torch.rsqrt(xg.var(-1, unbiased=False) + 1e-5), **TOLERANCES[torch.float64], what="rstd")
    assert y.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("params", ["affine", "none", "modulated", "modulated_no_affine"])
def test_reference_backward_formula(activation, params):
    """The closed-form backward (the one the CUDA kernels implement) equals autograd of PyTorch's ops."""
    x = random_input((2, 12, 3, 5), torch.float64, "cpu")
    w, b = affine(12, torch.float64) if params in ("affine", "modulated") else (None, None)
    scale, shift = modulation(2, 12, torch.float64) if params.startswith("modulated") else (None, None)
    dy = random_input((2, 12, 3, 5), torch.float64, "cpu", scale=1.0, seed=7)
    _, mean, rstd = OP(x, w, b, scale, shift, 4, 1e-5, activation)
    grads = OP_BWD(dy, x, w, b, scale, shift, mean, rstd, 4, activation, ALL_GRADS)
    leaves = [t.clone().requires_grad_(True) if t is not None else None for t in (x, w, b, scale, shift)]
    u = F.group_norm(leaves[0], 4, leaves[1], leaves[2], 1e-5)
    if scale is not None:
        u = u * (1 + leaves[3][:, :, None, None]) + leaves[4][:, :, None, None]
    ACTIVATIONS[activation](u).backward(dy)
    for name, got, leaf in zip(("dx", "dweight", "dbias", "dscale", "dshift"), grads, leaves):
        if leaf is None:
            assert got.numel() == 0, name
        else:
            assert_close(got, leaf.grad, atol=1e-9, rtol=1e-9, what=name)


def test_gradcheck_through_op(ext):
    x = random_input((2, 6, 3, 2), torch.float64, "cpu").requires_grad_(True)
    w, b = (t.requires_grad_(True) for t in affine(6, torch.float64))
    scale, shift = (t.requires_grad_(True) for t in modulation(2, 6, torch.float64))
    fn = lambda *args: OP(*args, 3, 1e-5, "gelu_tanh")[0]
    assert torch.autograd.gradcheck(fn, (x, w, b, scale, shift))
    assert torch.autograd.gradcheck(lambda x: OP(x, None, None, None, None, 3, 1e-5, "mish")[0], (x,))


def test_double_backward_through_op(ext):
    """create_graph=True (gradient penalties, Hessian-vector products) differentiates the gradients too."""
    x = random_input((2, 6, 3, 2), torch.float64, "cpu").requires_grad_(True)
    w, b = (t.requires_grad_(True) for t in affine(6, torch.float64))
    scale, _ = modulation(2, 6, torch.float64)
    fn = lambda x, w, b, s: OP(x, w, b, s, None, 3, 1e-5, "silu")[0]
    assert torch.autograd.gradgradcheck(fn, (x, w, b, scale.requires_grad_(True)))


def test_opcheck(ext):
    x = random_input((2, 8, 3, 3), torch.float32, "cpu").requires_grad_(True)
    w, b = (t.requires_grad_(True) for t in affine(8))
    scale, shift = (t.requires_grad_(True) for t in modulation(2, 8))
    torch.library.opcheck(OP, (x, w, b, None, None, 4, 1e-5, "silu"))
    torch.library.opcheck(OP, (x, None, None, scale, shift, 2, 1e-6, "mish"))
    torch.library.opcheck(OP, (x, w, b, scale, None, 2, 1e-6, "identity"))


def test_opcheck_inference(ext):
    """The inference op's schema, fake function and CPU implementation agree (inputs needing no gradient: it has
    none), and its y is group_norm_act's, bit for bit."""
    x = random_input((2, 8, 3, 3), torch.float32, "cpu")
    w, b = affine(8)
    scale, shift = modulation(2, 8)
    offset = random_input((2, 8), torch.float32, "cpu", seed=3)
    for args in [(x, w, b, None, None, 4, 1e-5, "silu"), (x, None, None, scale, shift, 2, 1e-6, "mish"),
                 (x, w, b, scale, None, 2, 1e-6, "identity", offset)]:
        torch.library.opcheck(INFERENCE_OP, args)
        torch.testing.assert_close(INFERENCE_OP(*args), OP(*args)[0], rtol=0, atol=0)


def test_inference_op_records_gradients_as_group_norm_act(ext):
    """Where autograd records the call (a graph traced without gradients, then run with them), the inference op's
    y has group_norm_act's history: the same values and gradients; forward-mode AD is refused as there."""
    x = random_input((2, 8, 3, 3), torch.float32, "cpu").requires_grad_(True)
    w, b = (t.requires_grad_(True) for t in affine(8))
    offset = random_input((2, 8), torch.float32, "cpu", seed=3)
    y = INFERENCE_OP(x, w, b, None, None, 4, 1e-5, "gelu", offset)
    expected = OP(x, w, b, None, None, 4, 1e-5, "gelu", offset)[0]
    torch.testing.assert_close(y, expected, rtol=0, atol=0)
    dy = torch.randn_like(y)
    for got, want in zip(torch.autograd.grad(y, (x, w, b), dy), torch.autograd.grad(expected, (x, w, b), dy)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level():
        dual = fwAD.make_dual(x.detach(), torch.ones_like(x))
        with pytest.raises(RuntimeError) as full:
            OP(dual, w.detach(), b.detach(), None, None, 4, 1e-5, "silu")
        with pytest.raises(RuntimeError) as inference:
            INFERENCE_OP(dual, w.detach(), b.detach(), None, None, 4, 1e-5, "silu")
    assert str(inference.value) == str(full.value)


def test_graph_traced_without_gradients_runs_with_them(kernel_path_on_cpu):
    """make_fx of a call with nothing requiring a gradient records the inference op; run on inputs that require
    one, the graph gives the eager call's output and gradients (break-it pass, session 24)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    x = random_input((2, 8, 4, 4), torch.float32, "cpu")
    w, b = affine(8)
    graph = make_fx(lambda x, w, b: gn_patch.group_norm_act(x, 4, w, b))(x, w, b)
    assert "gn_patch.group_norm_act_inference.default" in {str(n.target) for n in graph.graph.nodes}
    leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
    eager_leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
    y, expected = graph(*leaves), gn_patch.group_norm_act(eager_leaves[0], 4, *eager_leaves[1:])
    torch.testing.assert_close(y, expected, rtol=0, atol=0)
    for got, want in zip(torch.autograd.grad(y.sum(), leaves), torch.autograd.grad(expected.sum(), eager_leaves)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("output_mask", [[True, False, False, False, False], [False, True, True, False, False],
                                         [True, True, True, True, True], [False] * 5])
def test_opcheck_backward(ext, output_mask):
    """The backward op's schema, fake function and CPU implementation agree, outputs not asked for included (each
    its own empty tensor: outputs of a custom op may not alias each other)."""
    x = random_input((2, 8, 3, 3), torch.float32, "cpu")
    w, b = affine(8)
    scale, shift = modulation(2, 8)
    _, mean, rstd = OP(x, w, b, scale, shift, 4, 1e-5, "silu")
    dy = random_input((2, 8, 3, 3), torch.float32, "cpu", seed=5)
    torch.library.opcheck(torch.ops.gn_patch.group_norm_act_backward.default,
                          (dy, x, w, b, scale, shift, mean, rstd, 4, "silu", output_mask))


@pytest.mark.parametrize("shape,fmt", [((2, 8, 4, 4), torch.channels_last), ((2, 8, 2, 4, 4), torch.channels_last_3d),
                                       ((2, 8, 4, 4), torch.contiguous_format)])
def test_fake_keeps_the_layout(shape, fmt):
    x = torch.empty(shape, device="meta").to(memory_format=fmt)
    y, mean, rstd = OP(x, None, None, None, None, 4, 1e-5, "silu")
    assert y.stride() == x.stride() and y.dtype == x.dtype
    assert mean.shape == rstd.shape == (2, 4) and mean.dtype == torch.float32
    x16 = torch.empty((2, 16, 7), device="meta", dtype=torch.float16).transpose(1, 2).contiguous().transpose(1, 2)
    assert OP(x16, None, None, None, None, 4, 1e-5, "silu")[0].stride() == x16.stride()


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph_forward_backward(dynamic, ext):
    def fn(x, w, b, s):
        return OP(x, w, b, s, None, 4, 1e-5, "silu")[0].sum()

    compiled = torch.compile(fn, fullgraph=True, dynamic=dynamic, backend="aot_eager")
    for shape in [(2, 8, 4, 4), (3, 8, 6, 5)]:
        x = random_input(shape, torch.float32, "cpu").requires_grad_(True)
        w, b = (t.requires_grad_(True) for t in affine(8))
        s = modulation(shape[0], 8)[0].requires_grad_(True)
        compiled(x, w, b, s).backward()
        expected = [t.grad.clone() for t in (x, w, b, s)]
        for t in (x, w, b, s):
            t.grad = None
        fn(x, w, b, s).backward()
        for got, want in zip(expected, (x.grad, w.grad, b.grad, s.grad)):
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize("call,error,match", [
    (lambda: OP(torch.randn(1, 6, 1, 2), None, None, None, None, 4, 1e-5, "identity"), RuntimeError,
     "divisible by num_groups"),
    (lambda: OP(torch.randn(2, 8, 3), torch.ones(2, 4), None, None, None, 4, 1e-5, "silu"), RuntimeError,
     "weight to be a vector"),
    (lambda: OP(torch.randn(2, 8, 3), None, torch.ones(1), None, None, 4, 1e-5, "silu"), RuntimeError,
     "bias to be a vector"),
    (lambda: OP(torch.arange(48).reshape(2, 8, 3), None, None, None, None, 4, 1e-5, "silu"), TypeError,
     "floating-point"),
    (lambda: OP(torch.randn(2, 8, 3), None, None, None, None, 0, 1e-5, "silu"), ValueError,
     "num_groups must be positive"),
    (lambda: OP(torch.randn(2, 8, 3), None, None, None, None, 4, -1e-5, "silu"), ValueError,
     "eps must be a finite number >= 0"),
    (lambda: OP(torch.randn(2, 8, 3), None, None, None, None, 4, float("nan"), "silu"), ValueError,
     "eps must be a finite number >= 0"),
    (lambda: OP(torch.randn(2, 8, 3), None, None, None, None, 4, 1e-5, "tanh"), ValueError,
     "unknown activation 'tanh'"),
    (lambda: OP(torch.randn(8), None, None, None, None, 4, 1e-5, "silu"), ValueError, "x must be a 2-D to 5-D input"),
    (lambda: OP(torch.randn(2, 8, 0, 3), None, None, None, None, 4, 1e-5, "silu"), RuntimeError,
     "Expected HxW to be greater than 0"),
    (lambda: OP(torch.randn(2, 8, 3, dtype=torch.bfloat16), torch.ones(8, dtype=torch.bfloat16), torch.zeros(8), None,
                None, 4, 1e-5, "silu"), TypeError, "must have the same dtype"),
    (lambda: OP(torch.randn(2, 8, 3), None, None, torch.ones(2, 4), None, 4, 1e-5, "silu"), ValueError,
     r"scale must have shape \(N, C\)"),
    (lambda: OP(torch.randn(2, 8, 3), None, None, None, torch.ones(2, 8, dtype=torch.int32), 4, 1e-5, "silu"),
     TypeError, "shift must have the input's dtype"),
    (lambda: OP(torch.empty(2, 8, 0, device="meta"), None, None, None, None, 4, 1e-5, "silu"), RuntimeError,
     "Expected HxW to be greater than 0"),
    (lambda: OP(torch.empty(0, 8, 0, 3), None, None, None, None, 4, 1e-5, "silu"), RuntimeError,
     "Expected HxW to be greater than 0"),
    (lambda: OP(torch.empty(2, 0, 3), None, None, None, None, 4, 1e-5, "silu"), RuntimeError,
     "number of channels to be greater than 0"),
    (lambda: OP(torch.empty(2, 8, 3, device="meta"), torch.ones(3, device="meta"), None, None, None, 4, 1e-5, "silu"),
     RuntimeError, "weight to be a vector"),
    (lambda: OP_BWD(torch.randn(2, 8, 3), torch.randn(2, 8, 3), None, None, None, None, torch.zeros(1, 4),
                    torch.ones(1, 4), 4, "silu", ALL_GRADS), ValueError, "mean and rstd"),
])
def test_op_rejects_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_op_empty_batch(ext):
    x = torch.empty(0, 8, 3, 3).requires_grad_(True)
    w, b = (t.requires_grad_(True) for t in affine(8))
    y, mean, rstd = OP(x, w, b, None, None, 4, 1e-5, "silu")
    assert y.shape == x.shape and mean.shape == rstd.shape == (0, 4)
    y.sum().backward()
    assert torch.equal(w.grad, torch.zeros(8)) and torch.equal(b.grad, torch.zeros(8))
    torch.library.opcheck(OP, (x, w, b, None, None, 4, 1e-5, "silu"))


def test_public_function_compiles_with_symbolic_eps(host_path):
    """gn_patch.group_norm_act under torch.compile(fullgraph=True, dynamic=True), where eps is a symbolic float:
    the argument checks must not be traced (math.isfinite of a SymFloat is a graph break)."""
    fn = lambda x, eps: gn_patch.group_norm_act(x, 2, eps=eps)
    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend="aot_eager")
    x = random_input((2, 8, 3, 3), torch.float32, "cpu")
    for eps in (1e-3, 1e-4):
        torch.testing.assert_close(compiled(x, eps), fn(x, eps), rtol=0, atol=0)


@pytest.mark.parametrize("num_groups,eps,message", [(2, float("nan"), "eps must be a finite number >= 0"),
                                                     (2, -1.0, "eps must be a finite number >= 0"),
                                                     (0, 1e-5, "num_groups must be positive")],
                         ids=["nan_eps", "negative_eps", "zero_groups"])
def test_compiled_function_checks_constant_arguments(num_groups, eps, message, host_path):
    """Under torch.compile(fullgraph=True) a constant eps or num_groups out of range stops the trace with eager's
    error, after valid values compiled: without the check a CPU-only install's PyTorch path gave NaN outputs."""
    fn = lambda x, num_groups, eps: gn_patch.group_norm_act(x, num_groups, eps=eps)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    x = random_input((2, 8, 3, 3), torch.float32, "cpu")
    for valid_eps in (1e-3, 1e-4, 1e-5):  # the third call makes eps symbolic (automatic dynamic)
        compiled(x, 2, valid_eps)
    with pytest.raises(Exception, match=message):
        compiled(x, num_groups, eps)


def test_compiled_backward_uses_the_backward_op(ext):
    """Under torch.compile the backward graph keeps the fused backward op (not a recomputation)."""
    from torch._dynamo.backends.common import aot_autograd

    backward_ops = set()

    def record_backward(gm, _inputs):
        backward_ops.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    backend = aot_autograd(fw_compiler=lambda gm, _: gm, bw_compiler=record_backward)
    compiled = torch.compile(lambda x, w, b: OP(x, w, b, None, None, 4, 1e-5, "silu")[0].sum(), backend=backend,
                             fullgraph=True)
    x = random_input((2, 8, 3, 3), torch.float32, "cpu").requires_grad_(True)
    w, b = (t.requires_grad_(True) for t in affine(8))
    compiled(x, w, b).backward()
    assert "gn_patch.group_norm_act_backward.default" in backward_ops


# ------------------------------------------------------------------------------------------------
# The kernel path's dispatch, emulated on the CPU
# ------------------------------------------------------------------------------------------------
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


def _records_op_calls():
    """A TorchDispatchMode-free probe: counts calls of the kernels' op through a profiler."""
    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])


def _op_called(prof) -> bool:
    return any(e.name in tiny_models.KERNEL_OPS for e in prof.events())


def test_kernel_path_takes_the_op_and_matches_stock(kernel_path_on_cpu):
    fused, stock, x = _stock_and_fused()
    with _records_op_calls() as prof:
        y = fused(x.requires_grad_(True))
    assert _op_called(prof)
    assert y.is_contiguous(memory_format=torch.channels_last)
    assert_close(y, stock(x), **TOLERANCES[torch.float32], what="y")
    y.square().sum().backward()
    got = [t.grad.clone() for t in (x, fused.weight, fused.bias)]
    x.grad = None
    stock(x).square().sum().backward()
    for g, want in zip(got, (x.grad, stock[0].weight.grad, stock[0].bias.grad)):
        assert_close(g, want, atol=1e-4, rtol=1e-4, what="grad")


def test_kernel_path_scale_shift_gradients(kernel_path_on_cpu):
    x = random_input((2, 8, 3, 4), torch.float64, "cpu")
    x32 = x.float().contiguous(memory_format=torch.channels_last).requires_grad_(True)
    scale, shift = (t.requires_grad_(True) for t in modulation(2, 8))
    with _records_op_calls() as prof:
        y = gn_patch.group_norm_act(x32, 4, scale=scale[:, :, None, None], shift=shift[:, :, None, None])
    assert _op_called(prof)
    y.sum().backward()
    leaves = [t.detach().double().requires_grad_(True) for t in (x32, scale, shift)]
    u = F.group_norm(leaves[0], 4) * (1 + leaves[1][:, :, None, None]) + leaves[2][:, :, None, None]
    F.silu(u).sum().backward()
    for got, leaf in zip((x32.grad, scale.grad, shift.grad), leaves):
        assert_close(got, leaf.grad, atol=1e-4, rtol=1e-4, what="grad")


def test_backward_makes_no_zero_gradients_for_the_statistics(kernel_path_on_cpu):
    """mean and rstd are outputs without a gradient: the backward fills no zeros tensors for them (on CUDA each
    would be an allocation and a kernel per call)."""
    fused, _, x = _stock_and_fused()
    y = fused(x.requires_grad_(True))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        y.backward(torch.randn_like(y))
    names = {e.name for e in prof.events()}
    assert "gn_patch::group_norm_act_backward" in names, names
    assert "aten::zeros" not in names  # autograd materialises an absent output gradient with at::zeros


def _backward_ops_under_compiled_autograd(fn, backend):
    """Runs torch.compile(fn, backend=backend)() with compiled autograd on (a fresh Dynamo cache); the names of the
    ops it called."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(compiled_autograd=True), _records_op_calls() as prof:
        torch.compile(fn, backend=backend)()
    return {e.name for e in prof.events()}


def test_compiled_autograd_backward_of_an_eager_forward(kernel_path_on_cpu):
    """torch.compile'd backward with compiled autograd over an eager forward: the kernel path's autograd node is
    compiled with the rest, and its gradients are stock's."""
    fused, stock, x = _stock_and_fused()
    x_stock, x_fused = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    stock(x_stock).square().sum().backward()
    loss = fused(x_fused).square().sum()
    assert "gn_patch::group_norm_act_backward" in _backward_ops_under_compiled_autograd(loss.backward, "eager")
    assert_close(x_fused.grad, x_stock.grad, atol=1e-4, rtol=1e-4, what="grad")
    assert_close(fused.weight.grad, stock[0].weight.grad, atol=1e-4, rtol=1e-4, what="grad")


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_autograd_with_modulation_input_terms_and_frozen_inputs(kernel_path_on_cpu, backend):
    """Compiled autograd over a compiled step whose norm has a per-sample scale and shift and an input offset and
    bias, without affine parameters, where only some inputs need a gradient; then the same compiled step again on
    new values (no stale graph): the gradients are PyTorch's."""
    fused = gn_patch.GroupNormAct(4, 8, affine=False)
    gen = torch.Generator().manual_seed(3)
    frozen_scale = torch.randn(2, 8, generator=gen)

    def inputs():
        x = torch.randn(2, 8, 3, 3, generator=gen).to(memory_format=torch.channels_last).requires_grad_(True)
        shift, offset, bias = (torch.randn(*shape, generator=gen).requires_grad_(True)
                               for shape in ((2, 8), (2, 8, 1, 1), (8,)))
        return x, shift, offset, bias

    def step(x, shift, offset, bias):
        fused(x, frozen_scale, shift, input_offset=offset, input_bias=bias).square().sum().backward()

    torch._dynamo.reset()
    compiled = torch.compile(step, backend=backend)
    for _ in range(2):
        got = inputs()
        want = [t.detach().clone().requires_grad_(True) for t in got]
        with torch._dynamo.config.patch(compiled_autograd=True):
            compiled(*got)
        x, shift, offset, bias = want
        u = F.group_norm((x + bias.view(1, 8, 1, 1)) + offset, 4) * (1 + frozen_scale[:, :, None, None])
        F.silu(u + shift[:, :, None, None]).square().sum().backward()
        for g, w in zip(got, want):
            assert_close(g.grad, w.grad, atol=1e-4, rtol=1e-4, what="grad")


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh", "relu", "mish", "identity"])
def test_compiled_autograd_over_a_compiled_training_step(kernel_path_on_cpu, activation):
    """A training step compiled whole (forward and backward in one torch.compile'd function) with compiled autograd:
    the kernel path's backward runs below the autograd key there, and its gradients are stock's for every
    activation."""
    fused, _, x = _stock_and_fused()
    fused.activation = activation
    stock = torch.nn.GroupNorm(fused.num_groups, fused.num_channels)
    stock.load_state_dict(fused.state_dict())
    act = gn_patch.ops.ACTIVATIONS[activation]
    x_stock, x_fused = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    act(stock(x_stock)).square().sum().backward()

    def step():
        fused(x_fused).square().sum().backward()

    assert "gn_patch::group_norm_act_backward" in _backward_ops_under_compiled_autograd(step, "aot_eager")
    assert_close(x_fused.grad, x_stock.grad, atol=1e-4, rtol=1e-4, what="grad")
    assert_close(fused.weight.grad, stock.weight.grad, atol=1e-4, rtol=1e-4, what="grad")
    assert_close(fused.bias.grad, stock.bias.grad, atol=1e-4, rtol=1e-4, what="grad")


def test_nchw_input_takes_pytorch_path_even_when_emulating(kernel_path_on_cpu):
    fused, stock, x = _stock_and_fused()
    x = x.contiguous()
    with _records_op_calls() as prof:
        y = fused(x)
    assert not _op_called(prof)
    torch.testing.assert_close(y, stock(x), rtol=0, atol=0)


def test_func_grad_over_parameters(kernel_path_on_cpu):
    """torch.func.grad / jacrev over the parameters (functional_call) give nn.GroupNorm's gradients."""
    fused, stock, x = _stock_and_fused()

    def loss(module, params, prefix=""):
        params = {prefix + name: value for name, value in params.items()}
        return torch.func.functional_call(module, params, (x,)).square().sum()

    params = dict(fused.named_parameters())
    got = torch.func.grad(lambda p: loss(fused, p))(params)
    want = torch.func.grad(lambda p: loss(stock, p, prefix="0."))(params)
    for name in ("weight", "bias"):
        torch.testing.assert_close(got[name], want[name], atol=1e-4, rtol=1e-4)
    jacobian = torch.func.jacrev(lambda w: torch.func.functional_call(fused, {"weight": w}, (x,)))(fused.weight)
    torch.testing.assert_close(
        jacobian, torch.func.jacrev(lambda w: torch.func.functional_call(stock, {"0.weight": w}, (x,)))(fused.weight),
        atol=1e-4, rtol=1e-4)


def test_vmap_and_forward_ad(kernel_path_on_cpu):
    """vmap over a batch of 4-D inputs, per-sample gradients and forward-mode AD give stock's results."""
    import torch.autograd.forward_ad as fwAD

    fused, stock, x = _stock_and_fused()
    batch = torch.stack([x, x * 2 + 1])
    torch.testing.assert_close(torch.func.vmap(fused)(batch), torch.stack([stock(x), stock(x * 2 + 1)]),
                               atol=1e-5, rtol=1e-5)
    per_sample = torch.func.vmap(torch.func.grad(lambda t: fused(t[None]).sum()))(x)
    torch.testing.assert_close(per_sample, torch.func.vmap(torch.func.grad(lambda t: stock(t[None]).sum()))(x),
                               atol=1e-4, rtol=1e-4)
    x = x.contiguous()  # PyTorch's own forward AD of group_norm refuses channels-last CPU input (torch 2.11-2.13)
    tangent = torch.randn_like(x)
    with fwAD.dual_level():
        got = fwAD.unpack_dual(fused(fwAD.make_dual(x, tangent))).tangent
        want = fwAD.unpack_dual(stock(fwAD.make_dual(x, tangent))).tangent
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    _, jvp = torch.func.jvp(fused, (x,), (tangent,))
    torch.testing.assert_close(jvp, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_module_keeps_the_op(dynamic, kernel_path_on_cpu):
    """torch.compile(fullgraph=True) traces the C++ dispatch (symbolic shapes too) down to the kernels' op."""
    from torch._dynamo.backends.common import aot_autograd

    ops = set()

    def record(gm, _inputs):
        ops.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    fused, stock, _ = _stock_and_fused()
    compiled = torch.compile(fused, fullgraph=True, dynamic=dynamic,
                             backend=aot_autograd(fw_compiler=record, bw_compiler=record))
    for shape in [(2, 8, 3, 3), (3, 8, 5, 4)]:
        x = torch.randn(shape).to(memory_format=torch.channels_last)
        assert_close(compiled(x), stock(x), **TOLERANCES[torch.float32], what="compiled")
    assert "gn_patch.group_norm_act.default" in ops
    torch.testing.assert_close(compiled(x.contiguous()), stock(x.contiguous()), rtol=0, atol=0)


def test_export_keeps_the_op(kernel_path_on_cpu):
    """torch.export keeps gn_patch's dispatching op (it decides at run time); decomposed, the kernels' op."""
    fused, stock, x = _stock_and_fused()
    with torch.no_grad():
        exported = torch.export.export(fused, (x,))
    targets = lambda program: {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert "gn_patch.group_norm_act_dispatch.default" in targets(exported), targets(exported)
    with _records_op_calls() as prof:
        assert_close(exported.module()(x), stock(x), **TOLERANCES[torch.float32], what="exported")
    assert _op_called(prof)
    assert targets(exported.run_decompositions()) & set(tiny_models.KERNEL_TARGETS)


def test_no_grad_runs_the_op_without_recording(kernel_path_on_cpu):
    """Under no_grad (diffusers' pipelines) the kernels' op runs below autograd: same values, no graph; with a
    gradient needed the autograd node is recorded and its gradients are those of the same op."""
    x = random_input((2, 8, 4, 4), torch.float32, "cpu").requires_grad_(True)
    w, b = (t.requires_grad_(True) for t in affine(8))
    with torch.no_grad():
        y = gn_patch.group_norm_act(x, 4, w, b)
    assert y.grad_fn is None and not y.requires_grad
    recorded = gn_patch.group_norm_act(x, 4, w, b)
    assert recorded.grad_fn is not None
    torch.testing.assert_close(y, recorded.detach(), rtol=0, atol=0)
    frozen = gn_patch.group_norm_act(x.detach(), 4, w.detach(), b.detach())
    assert frozen.grad_fn is None
    torch.testing.assert_close(frozen, y, rtol=0, atol=0)


def test_calls_recording_nothing_take_the_inference_op(kernel_path_on_cpu):
    """Where autograd records nothing (no_grad, or no input requiring a gradient) the dispatching op calls the
    inference op (y alone: no mean or rstd allocated); where it records, the kernels' op with its statistics."""
    x = random_input((2, 8, 4, 4), torch.float32, "cpu")
    w, b = affine(8)
    def ops_called(*args):
        with _records_op_calls() as prof:
            y = gn_patch.group_norm_act(*args)
        return y, {e.name for e in prof.events()} & set(tiny_models.KERNEL_OPS)

    with torch.no_grad():
        y, called = ops_called(x, 4, w.requires_grad_(True), b)
    assert called == {"gn_patch::group_norm_act_inference"}
    frozen, called = ops_called(x, 4, w.detach(), b)
    assert called == {"gn_patch::group_norm_act_inference"}
    recorded, called = ops_called(x, 4, w, b)
    assert called == {"gn_patch::group_norm_act"} and recorded.grad_fn is not None
    torch.testing.assert_close(y, recorded.detach(), rtol=0, atol=0)
    torch.testing.assert_close(frozen, y, rtol=0, atol=0)


def test_dispatch_modes_see_the_views_of_a_per_sample_modulation(kernel_path_on_cpu):
    """The (N, C, 1, 1) scale, shift and input offset become (N, C) views above autograd, where reshape decomposes:
    a dispatch mode (or a tensor subclass whose table has view, not reshape) sees the same ops under no_grad as
    with gradients, and the inference op last."""
    x = random_input((2, 8, 3, 5), torch.float32, "cpu")
    modulation = torch.randn(2, 8, 1, 1)
    with torch.no_grad(), _DispatchRecorder() as seen:
        gn_patch.group_norm_act(x, 4, scale=modulation, shift=modulation, input_offset=modulation)
    assert torch.ops.aten.reshape.default not in seen.ops
    assert seen.ops[-4:] == [torch.ops.aten.view.default] * 3 + [INFERENCE_OP]


# ------------------------------------------------------------------------------------------------
# input_offset: x + offset before the normalisation (diffusers' `hidden_states + temb` before norm2)
# ------------------------------------------------------------------------------------------------
def _stock_with_offset(x, offset, w, b, activation="silu"):
    return ACTIVATIONS[activation](F.group_norm(x + offset, 4, w, b))


@pytest.mark.parametrize("offset_shape", [(2, 8, 1, 1), (1, 8, 1, 1), (8, 1, 1), (2, 8, 3, 4), (4,)])
def test_pytorch_path_input_offset(offset_shape, host_path):
    """On PyTorch's path the offset is `x + offset`, whatever its shape (broadcasting as PyTorch's add): exactly
    stock's values."""
    x = random_input((2, 8, 3, 4), torch.float32, "cpu", layout="nchw")
    w, b = affine(8)
    offset = torch.randn(offset_shape)
    y = gn_patch.group_norm_act(x, 4, w, b, input_offset=offset)
    torch.testing.assert_close(y, _stock_with_offset(x, offset, w, b), rtol=0, atol=0)


def test_pytorch_path_input_offset_promotes_and_raises_as_add(host_path):
    x = random_input((2, 8, 3, 4), torch.float32, "cpu", layout="nchw")
    offset = torch.randn(2, 8, 1, 1, dtype=torch.float64)
    y = gn_patch.group_norm_act(x, 4, input_offset=offset)
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, _stock_with_offset(x, offset, None, None), rtol=0, atol=0)
    for bad in (torch.randn(2, 5, 1, 1), torch.randn(2, 8)):  # (N, C) broadcasts against the last dims, as in add
        with pytest.raises(RuntimeError, match="must match the size"):
            gn_patch.group_norm_act(x, 4, input_offset=bad)
    torch.testing.assert_close(gn_patch.group_norm_act(x, 4, input_offset=1.5),
                               _stock_with_offset(x, 1.5, None, None), rtol=0, atol=0)  # a number, as x + 1.5
    with pytest.raises(TypeError):
        gn_patch.group_norm_act(x, 4, input_offset="1")


def test_pytorch_path_input_bias(host_path):
    """input_bias (C,) is added per channel before input_offset, as `(x + bias.view(1, C, 1, 1)) + offset`: stock's
    values, PyTorch's type promotion; any other shape is a ValueError, anything but a tensor a TypeError."""
    x = random_input((2, 8, 3, 4), torch.float32, "cpu", layout="nchw")
    w, b = affine(8)
    bias, offset = torch.randn(8), torch.randn(2, 8, 1, 1)
    torch.testing.assert_close(gn_patch.group_norm_act(x, 4, w, b, input_offset=offset, input_bias=bias),
                               _stock_with_offset(x + bias.view(1, 8, 1, 1), offset, w, b), rtol=0, atol=0)
    torch.testing.assert_close(gn_patch.group_norm_act(x, 4, input_offset=1.5, input_bias=bias),
                               _stock_with_offset(x + bias.view(1, 8, 1, 1), 1.5, None, None), rtol=0, atol=0)
    y = gn_patch.group_norm_act(x, 4, input_bias=bias.double())
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, _stock_with_offset(x, bias.double().view(1, 8, 1, 1), None, None), rtol=0, atol=0)
    for bad in (torch.randn(4), torch.randn(1, 8), torch.randn(8, 1, 1)):
        with pytest.raises(ValueError, match="input_bias must have shape"):
            gn_patch.group_norm_act(x, 4, input_bias=bad)
    with pytest.raises(TypeError, match="input_bias"):
        gn_patch.group_norm_act(x, 4, input_bias=1.0)
    with pytest.raises(RuntimeError, match="Expected at least 2 dimensions for input tensor but received 1"):
        gn_patch.group_norm_act(torch.randn(8), 4, input_bias=bias)  # as F.group_norm(torch.randn(8), 4)


@pytest.mark.parametrize("requires_grad", [False, True])
def test_kernel_path_input_offset(requires_grad, kernel_path_on_cpu):
    """A per-sample offset and a per-channel bias of x's dtype reach the kernels' op (no_grad: as its input_offset and
    input_bias); with gradients they are PyTorch's adds, and x, the terms and the parameters get stock's gradients."""
    x = random_input((2, 8, 3, 4), torch.float64, "cpu")
    x32 = x.float().contiguous(memory_format=torch.channels_last).requires_grad_(requires_grad)
    offset = torch.randn(2, 8, 1, 1).requires_grad_(requires_grad)
    bias = torch.randn(8).requires_grad_(requires_grad)
    w, b = (t.requires_grad_(requires_grad) for t in affine(8))
    with _records_op_calls() as prof:
        y = gn_patch.group_norm_act(x32, 4, w, b, input_offset=offset, input_bias=bias)
    assert _op_called(prof)
    assert y.is_contiguous(memory_format=torch.channels_last)
    leaves = [t.detach().double().requires_grad_(True) for t in (x32, offset, bias, w, b)]
    want = _stock_with_offset(leaves[0] + leaves[2].view(1, 8, 1, 1), leaves[1], *leaves[3:])
    assert_close(y, want, **TOLERANCES[torch.float32], what="y")
    if requires_grad:
        y.square().sum().backward()
        want.square().sum().backward()
        for got, leaf in zip((x32.grad, offset.grad, bias.grad, w.grad, b.grad), leaves):
            assert_close(got, leaf.grad, atol=1e-4, rtol=1e-4, what="grad")


def test_kernel_path_input_terms_round_in_order(kernel_path_on_cpu):
    """float16: the op sums (x + bias) + offset, each add rounded, as stock's `(conv(x) + conv.bias) + temb`."""
    x = random_input((2, 8, 6, 6), torch.float16, "cpu")
    bias, offset = torch.randn(8).half(), torch.randn(2, 8, 1, 1).half()
    two_adds = (x + bias.view(1, 8, 1, 1)) + offset
    assert not torch.equal(two_adds, x + (bias.view(1, 8, 1, 1) + offset))  # the data tells the orders apart
    with torch.no_grad():
        y = gn_patch.group_norm_act(x, 4, input_offset=offset, input_bias=bias)
        torch.testing.assert_close(y, gn_patch.group_norm_act(two_adds, 4), rtol=0, atol=0)


def test_op_input_offset_checks_and_fake(ext):
    """The kernels' op takes an (N, C) offset and a (C,) bias of x's dtype and device; its fake function checks the
    same."""
    x = random_input((2, 8, 3, 4), torch.float32, "cpu")
    offset, bias = torch.randn(2, 8), torch.randn(8)
    torch.testing.assert_close(OP(x, None, None, None, None, 4, 1e-5, "silu", offset, bias)[0],
                               OP((x + bias[:, None, None]) + offset[:, :, None, None], None, None, None, None, 4, 1e-5,
                                  "silu")[0], rtol=0, atol=0)
    for bad, error in ((offset[:, :, None, None], ValueError), (torch.randn(2, 5), ValueError),
                       (offset.double(), TypeError)):
        for inputs in ((x, bad), (x.to("meta"), bad.to("meta"))):
            with pytest.raises(error, match="input_offset"):
                OP(inputs[0], None, None, None, None, 4, 1e-5, "silu", inputs[1])
    for bad, error in ((bias[None], ValueError), (torch.randn(5), ValueError), (bias.double(), TypeError)):
        for inputs in ((x, bad), (x.to("meta"), bad.to("meta"))):
            with pytest.raises(error, match="input_bias"):
                OP(inputs[0], None, None, None, None, 4, 1e-5, "silu", None, inputs[1])


def test_opcheck_input_offset(ext):
    x = random_input((2, 8, 3, 3), torch.float32, "cpu").requires_grad_(True)
    w, b = (t.requires_grad_(True) for t in affine(8))
    offset = torch.randn(2, 8).requires_grad_(True)
    bias = torch.randn(8).requires_grad_(True)
    torch.library.opcheck(OP, (x, w, b, None, None, 4, 1e-5, "silu", offset))
    torch.library.opcheck(OP, (x, w, b, None, None, 4, 1e-5, "silu", offset, bias))
    torch.library.opcheck(OP, (x.detach(), None, None, None, None, 4, 1e-5, "gelu", None, bias.detach()))


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph_input_offset(dynamic, kernel_path_on_cpu):
    """torch.compile(fullgraph=True) traces the offset and the bias (here w again) through the dispatch, forward and
    backward."""
    fn = lambda x, o, w: gn_patch.group_norm_act(x, 4, w, None, input_offset=o, input_bias=w).square().sum()
    compiled = torch.compile(fn, fullgraph=True, dynamic=dynamic, backend="aot_eager")
    for shape in [(2, 8, 4, 4), (3, 8, 6, 5)]:
        x = random_input(shape, torch.float32, "cpu").requires_grad_(True)
        o = torch.randn(shape[0], 8, 1, 1).requires_grad_(True)
        w = affine(8)[0].requires_grad_(True)
        compiled(x, o, w).backward()
        got = [t.grad.clone() for t in (x, o, w)]
        for t in (x, o, w):
            t.grad = None
        fn(x, o, w).backward()
        for g, t in zip(got, (x, o, w)):
            assert_close(g, t.grad, atol=1e-5, rtol=1e-5, what="grad")
    with torch.no_grad():
        assert_close(torch.compile(fn, fullgraph=True, dynamic=dynamic, backend="aot_eager")(x, o, w), fn(x, o, w),
                     atol=1e-4, rtol=1e-5, what="no_grad")


def _frames_last_strides(shape):
    _, c, f, h, w = shape
    return (h * w * f * c, 1, c, w * f * c, f * c)


@pytest.mark.parametrize("path", ["python", "cpp", "kernel_path"])
@pytest.mark.parametrize("layout", ["channels_last", "nchw"])
def test_frames_last_returns_the_same_values_frames_innermost(path, layout, request, monkeypatch):
    """frames_last=True: the output of a 5-D (N, C, F, H, W) input has its memory in (N, H, W, F, C) order on every
    path, its values and gradients those of the call without it."""
    if path == "python":
        monkeypatch.setattr(extension, "loaded", False)
    else:
        request.getfixturevalue("kernel_path_on_cpu" if path == "kernel_path" else "ext")
    shape = (2, 8, 3, 4, 5)
    x = random_input(shape, torch.float32, "cpu", layout=layout).requires_grad_(True)
    w, b = (t.requires_grad_(True) for t in affine(8))
    offset, bias = torch.randn(2, 8, 1, 1, 1), torch.randn(8)
    results = []
    for frames_last in (False, True):
        y = gn_patch.group_norm_act(x, 4, w, b, activation="gelu", input_offset=offset, input_bias=bias,
                                    frames_last=frames_last)
        y.backward(torch.linspace(-1, 1, y.numel()).view(shape))
        results.append((y.detach(), *(t.grad.clone() for t in (x, w, b))))
        for t in (x, w, b):
            t.grad = None
    assert results[1][0].stride() == _frames_last_strides(shape)
    for plain, frames in zip(*results):
        torch.testing.assert_close(frames, plain, rtol=0, atol=0)
    with torch.no_grad():
        module = gn_patch.GroupNormAct(4, 8, activation=None)
        assert module(x, frames_last=True).stride() == _frames_last_strides(shape)


def test_frames_last_op_fake_and_opcheck(ext):
    """The kernels' op and its fake function return the frames_last strides; opcheck compares them."""
    x = random_input((2, 8, 3, 4, 5), torch.float32, "cpu").requires_grad_(True)
    w, b = (t.requires_grad_(True) for t in affine(8))
    for inputs in ((x, w, b), tuple(t.detach().to("meta") for t in (x, w, b))):
        y = OP(*inputs, None, None, 4, 1e-5, "silu", None, None, True)[0]
        assert y.shape == x.shape and y.stride() == _frames_last_strides(x.shape)
    torch.library.opcheck(OP, (x, w, b, None, None, 4, 1e-5, "silu", None, None, True))
    torch.library.opcheck(OP, (x, w, b, None, None, 4, 1e-5, "identity", torch.randn(2, 8), torch.randn(8), True))


@pytest.mark.parametrize("shape", [(2, 8, 3, 4), (2, 8, 12)])
def test_frames_last_needs_5d_input(shape, host_path):
    x = random_input(shape, torch.float32, "cpu")
    with pytest.raises(ValueError, match="frames_last needs a 5-D input"):
        gn_patch.group_norm_act(x, 4, frames_last=True)
    if host_path == "cpp":
        for t in (x, x.to("meta")):
            with pytest.raises(ValueError, match="frames_last needs a 5-D input"):
                OP(t, None, None, None, None, 4, 1e-5, "silu", None, None, True)


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph_frames_last(dynamic, kernel_path_on_cpu):
    """torch.compile(fullgraph=True) traces the frames_last layout through the dispatch, forward and backward."""
    fn = lambda x, w: gn_patch.group_norm_act(x, 4, w, None, frames_last=True).permute(0, 3, 4, 2, 1)
    compiled = torch.compile(fn, fullgraph=True, dynamic=dynamic, backend="aot_eager")
    for shape in [(2, 8, 3, 4, 4), (3, 8, 2, 5, 6)]:
        x = random_input(shape, torch.float32, "cpu").requires_grad_(True)
        w = affine(8)[0].requires_grad_(True)
        y = compiled(x, w)
        assert y.is_contiguous()
        y.square().sum().backward()
        got = [t.grad.clone() for t in (x, w)]
        for t in (x, w):
            t.grad = None
        fn(x, w).square().sum().backward()
        for g, t in zip(got, (x, w)):
            assert_close(g, t.grad, atol=1e-5, rtol=1e-5, what="grad")


def test_frames_last_under_torch_func(host_path):
    """torch.func transforms take PyTorch's path, whose frames_last copy they batch: vmap over per-sample gradients
    gives the gradients of the call without frames_last."""
    x = random_input((3, 2, 8, 3, 4, 5), torch.float32, "cpu")
    loss = lambda frames_last: lambda t: gn_patch.group_norm_act(t, 4, frames_last=frames_last).square().sum()
    per_sample = [torch.func.vmap(torch.func.grad(loss(frames_last)))(x) for frames_last in (True, False)]
    torch.testing.assert_close(*per_sample, rtol=0, atol=0)
