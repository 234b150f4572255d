"""GroupNorm fused with an activation (and an optional per-sample modulation), as PyTorch custom ops.

Ops (schemas, fake functions and CPU reference implementations here; CUDA kernels, autograd and dispatch in the
compiled extension, csrc/, loaded on first use by gn_patch.extension):

* ``gn_patch::group_norm_act(x, weight, bias, scale, shift, num_groups, eps, activation, input_offset=None,
  input_bias=None, frames_last=False) -> (y, mean, rstd)``: the kernels' op. CUDA: any layout (non-channels-last
  inputs through a channels-last copy); CPU: the reference implementation (same formulas, float32 statistics).
* ``gn_patch::group_norm_act_inference(...)``: the same arguments, y alone (no mean or rstd allocated), for calls
  that record no gradient; where autograd does record one (a graph traced under no_grad, run with gradients), y and
  its history are group_norm_act's.
* ``gn_patch::group_norm_act_backward(...)``: its fused backward (dx, dweight, dbias, dscale, dshift).
* ``gn_patch::group_norm_act_dispatch(x, num_groups, weight, bias, eps, activation, scale, shift,
  input_offset=None, input_bias=None, frames_last=False) -> y``: what :func:`group_norm_act` and
  ``GroupNormAct.forward`` call, once per call: it sends what the kernels take (channels-last CUDA inputs) to
  ``group_norm_act`` and computes everything else exactly as PyTorch's ``(x + input_bias) + input_offset``,
  ``F.group_norm``, ``* (1 + scale) + shift`` and the activation do, in C++.

Until the extension is loaded (it is built on the first CUDA input; CPU-only installs never build it), the public
function computes PyTorch's path in Python.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import operator

import torch
import torch.nn.functional as F
from torch._prims_common import suggest_memory_format

from . import extension

__all__ = ["ACTIVATIONS", "canonical_activation", "group_norm_act"]

# name -> elementwise function. Aliases resolve through _ALIASES.
ACTIVATIONS = {
    "identity": lambda t: t,
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "relu": F.relu,
    "mish": F.mish,
}
_ALIASES = {"swish": "silu", "none": "identity", None: "identity"}
_CANONICAL = {**{name: name for name in ACTIVATIONS}, **_ALIASES}

_lib = torch.library.Library("gn_patch", "DEF")
_lib.define(
    "group_norm_act(Tensor x, Tensor? weight, Tensor? bias, Tensor? scale, Tensor? shift, int num_groups, float eps,"
    " str activation, Tensor? input_offset=None, Tensor? input_bias=None, bool frames_last=False)"
    " -> (Tensor y, Tensor mean, Tensor rstd)"
)
_lib.define(
    "group_norm_act_inference(Tensor x, Tensor? weight, Tensor? bias, Tensor? scale, Tensor? shift, int num_groups,"
    " float eps, str activation, Tensor? input_offset=None, Tensor? input_bias=None, bool frames_last=False)"
    " -> Tensor y"
)
_lib.define(
    "group_norm_act_backward(Tensor grad_out, Tensor x, Tensor? weight, Tensor? bias, Tensor? scale, Tensor? shift,"
    " Tensor mean, Tensor rstd, int num_groups, str activation, bool[5] output_mask)"
    " -> (Tensor grad_x, Tensor grad_weight, Tensor grad_bias, Tensor grad_scale, Tensor grad_shift)"
)
_lib.define(
    "group_norm_act_dispatch(Tensor x, int num_groups, Tensor? weight, Tensor? bias, float eps, str activation,"
    " Tensor? scale, Tensor? shift, Tensor? input_offset=None, Tensor? input_bias=None, bool frames_last=False)"
    " -> Tensor"
)
_DISPATCH = torch.ops.gn_patch.group_norm_act_dispatch.default
_lib.define("bias_residual_add(Tensor residual, Tensor x, Tensor bias) -> Tensor")


def canonical_activation(activation: str | None) -> str:
    """Canonical name of an activation: one of ``identity, silu, gelu, gelu_tanh, relu, mish``.

    Names are case-insensitive (``"SiLU"``, as torch.nn spells the class); accepts the aliases ``swish`` (= silu)
    and ``None``/``"none"`` (= identity).

    Raises:
        ValueError: unknown name, or not a string or None.
    """
    name = _CANONICAL.get(activation) if isinstance(activation, (str, type(None))) else None
    if name is not None:  # a canonical name or alias as spelled here: the per-call case
        return name
    key = activation.lower() if isinstance(activation, str) else activation
    name = _ALIASES.get(key, key) if isinstance(key, (str, type(None))) else None
    if name not in ACTIVATIONS:  # the C++ ops' message (csrc/op_checks.h)
        given = f"'{activation}'" if isinstance(activation, str) else repr(activation)
        raise ValueError(f"activation: unknown activation {given}; expected one of {', '.join(sorted(ACTIVATIONS))}, "
                         "swish or None (case-insensitive)")
    return name


def check_num_groups(num_groups):
    """num_groups as a Python int: an int (not a bool), or what F.group_norm also takes, an integer that converts
    exactly (a numpy integer, a one-element integer tensor). Raises TypeError for anything else, ValueError unless
    it is positive. While torch.compile traces, a Python int is checked too (a failing check stops the trace with
    this error); anything else is returned as given (a symbolic int is no int to Dynamo), and the op's schema and
    C++ checks still apply."""
    if type(num_groups) is int and num_groups > 0:  # the per-call case, checked first: it costs a call nothing more
        return num_groups
    if isinstance(num_groups, torch.SymInt) or (torch.compiler.is_compiling() and type(num_groups) is not int):
        return num_groups
    bool_tensor = isinstance(num_groups, torch.Tensor) and num_groups.dtype == torch.bool
    if not isinstance(num_groups, (bool, int)) and not bool_tensor:
        with contextlib.suppress(TypeError):  # numpy integers, one-element integer tensors (not floats)
            num_groups = operator.index(num_groups)
    if isinstance(num_groups, bool) or not isinstance(num_groups, int):
        raise TypeError(f"gn_patch: num_groups must be an int, got {type(num_groups).__name__}")
    if num_groups <= 0:
        raise ValueError(f"gn_patch: num_groups must be positive, got {num_groups}")
    return num_groups


def check_eps(eps):
    """eps as a Python float: a real number (not a bool; numpy floating scalars included) or, as F.group_norm also
    takes, a one-element real tensor. Raises TypeError for anything else, ValueError unless it is finite and >= 0.
    While torch.compile traces, a Python float is checked too (Dynamo evaluates the comparisons, guarding on a
    float it made symbolic, and a failing check stops the trace with this error, where a CPU-only install's
    PyTorch path would give NaN outputs); anything else is returned as given (a SymFloat outside Dynamo, numpy and
    tensor scalars, which Dynamo cannot turn into a float), and the op's schema and C++ checks still apply."""
    if type(eps) is float and 0 <= eps < math.inf:  # the per-call case, checked first
        return eps
    if isinstance(eps, torch.SymFloat) or (torch.compiler.is_compiling() and type(eps) is not float):
        return eps
    real_tensor = (isinstance(eps, torch.Tensor) and eps.numel() == 1
                   and not (eps.dtype.is_complex or eps.dtype == torch.bool))
    if isinstance(eps, bool) or not (isinstance(eps, numbers.Real) or real_tensor):
        raise TypeError(f"gn_patch: eps must be a float, got {type(eps).__name__}")
    eps = float(eps)
    if not 0 <= eps < math.inf:  # NaN fails both comparisons
        raise ValueError(f"gn_patch: eps must be a finite number >= 0, got {eps}")
    return eps


def _stats_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _param_view(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return p.view(1, -1, *([1] * (x.dim() - 2)))


def _sample_view(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return p.view(p.shape[0], p.shape[1], *([1] * (x.dim() - 2)))


def _empty_frames_last(x: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor of 5-D x's shape, dtype and device whose memory is in (N, H, W, F, C) order: what a
    ``frames_last`` call returns (csrc/op_checks.h's empty_frames_last)."""
    n, c, f, h, w = x.shape
    return x.new_empty((n, h, w, f, c)).permute(0, 4, 3, 1, 2)


def _check_frames_last(x, frames_last):
    if frames_last and x.dim() != 5:  # a plain test: torch.compile traces the Python path through it
        raise ValueError(f"gn_patch: frames_last needs a 5-D input (N, C, F, H, W), got shape {list(x.shape)}")


# ------------------------------------------------------------------------------------------------
# Input checks of the ops outside CUDA (csrc/op_checks.h checks the same, with the same messages)
# ------------------------------------------------------------------------------------------------
def _check_inputs(x, weight, bias, scale, shift, num_groups, activation):
    """Raise what the CUDA op raises: torch.nn.GroupNorm's RuntimeErrors where it has one, TypeError for dtypes,
    ValueError for num_groups, the activation and the modulation's shape."""
    torch._check_type(x.dtype.is_floating_point, lambda: f"gn_patch: x must be a floating-point tensor, got {x.dtype}")
    torch._check_value(2 <= x.dim() <= 5, lambda: f"gn_patch: x must be a 2-D to 5-D input (N, C, *spatial), got "
                                                  f"shape {list(x.shape)}")
    check_num_groups(num_groups)
    torch._check(x.shape[1] > 0, lambda: "Expected number of channels to be greater than 0, got 0")  # group_norm's
    torch._check(x.shape[1] % num_groups == 0,
                 lambda: "Expected number of channels in input to be divisible by num_groups, but got input of shape "
                         f"{list(x.shape)} and num_groups={num_groups}")
    canonical_activation(activation)
    # An empty batch is computed, an empty image is not: torch.group_norm's error.
    torch._check(math.prod(x.shape[2:]) > 0, lambda: "Expected HxW to be greater than 0, got 0")
    for name, p in (("weight", weight), ("bias", bias), ("scale", scale), ("shift", shift)):
        if p is not None:
            _check_param(x, name, p)
    for names, a, b in (("weight and bias", weight, bias), ("scale and shift", scale, shift)):
        if a is not None and b is not None:
            torch._check_type(a.dtype == b.dtype,
                              lambda: f"gn_patch: {names} must have the same dtype, got {a.dtype} and {b.dtype}")  # noqa: B023  (called at once)


def _check_param(x, name, p):
    """One of weight, bias (shape (C,)) or scale, shift (shape (N, C)): shape, device and dtype."""
    if name in ("weight", "bias"):
        torch._check(p.dim() == 1 and p.shape[0] == x.shape[1],
                     lambda: f"Expected {name} to be a vector of size equal to the number of channels in input, "
                             f"but got {name} of shape {list(p.shape)} and input of shape {list(x.shape)}")
    else:
        torch._check_value(p.dim() == 2 and p.shape[0] == x.shape[0] and p.shape[1] == x.shape[1],
                           lambda: f"gn_patch: {name} must have shape (N, C) = ({x.shape[0]}, {x.shape[1]}), got "
                                   f"{list(p.shape)}")
    torch._check(p.device == x.device, lambda: "Expected all tensors to be on the same device, but found "
                                               f"input on {x.device} and {name} on {p.device}")
    torch._check_type(p.dtype in (x.dtype, torch.float32),
                      lambda: f"gn_patch: {name} must have the input's dtype ({x.dtype}) or float32, got {p.dtype}")


def _check_input_terms(x, input_offset, input_bias):
    """The forward op's input_offset (N, C) and input_bias (C,): shape, x's device and dtype (csrc/op_checks.h's
    check_input_terms, with its messages)."""
    if input_offset is not None:
        _check_input_term(x, "input_offset", input_offset, "(N, C)", list(x.shape[:2]))
    if input_bias is not None:
        _check_input_term(x, "input_bias", input_bias, "(C,)", list(x.shape[1:2]))


def _check_input_term(x, name, t, dims, expected):
    torch._check_value(list(t.shape) == expected,
                       lambda: f"gn_patch: {name} must have shape {dims} = {expected}, got {list(t.shape)}")
    torch._check(t.device == x.device,
                 lambda: f"Expected all tensors to be on the same device, but found input on {x.device} and {name} on "
                         f"{t.device}")
    torch._check_type(t.dtype == x.dtype, lambda: f"gn_patch: {name} must have the input's dtype ({x.dtype}), got "
                                                  f"{t.dtype}")


def _with_input_terms(x, input_offset, input_bias):
    """(x + input_bias) + input_offset, each add rounded to x's dtype: what the kernels normalise when they add the
    terms as they load x (csrc/op_checks.h's with_input_terms)."""
    if input_bias is not None:
        x = x + _param_view(input_bias, x)
    if input_offset is not None:
        x = x + _sample_view(input_offset, x)
    return x


def _check_backward_inputs(grad_out, x, mean, rstd, num_groups, output_mask):
    torch._check_value(grad_out.shape == x.shape and grad_out.dtype == x.dtype,
                       lambda: "gn_patch: grad_out must match the input's shape, dtype and device")
    for t in (mean, rstd):
        torch._check_value(t.shape == (x.shape[0], num_groups) and t.dtype == _stats_dtype(x),
                           lambda: f"gn_patch: mean and rstd must be {_stats_dtype(x)} of shape (N, num_groups)")
    torch._check_value(len(output_mask) == 5, lambda: "gn_patch: output_mask must have 5 entries (x, weight, bias, "
                                                      "scale, shift)")


# ------------------------------------------------------------------------------------------------
# Fake functions: shapes, dtypes and strides (y has x's layout, as empty_like gives it).
# ------------------------------------------------------------------------------------------------
@torch.library.register_fake("gn_patch::group_norm_act")
def _group_norm_act_fake(x, weight, bias, scale, shift, num_groups, eps, activation, input_offset=None,
                         input_bias=None, frames_last=False):
    _check_inputs(x, weight, bias, scale, shift, num_groups, activation)
    _check_input_terms(x, input_offset, input_bias)
    _check_frames_last(x, frames_last)
    check_eps(eps)
    stats = x.new_empty((x.shape[0], num_groups), dtype=_stats_dtype(x))
    return _empty_frames_last(x) if frames_last else torch.empty_like(x), stats, torch.empty_like(stats)


@torch.library.register_fake("gn_patch::group_norm_act_inference")
def _group_norm_act_inference_fake(*args, **kwargs):
    return _group_norm_act_fake(*args, **kwargs)[0]


def _grad_outputs(x, weight, bias, scale, shift, output_mask):
    """The backward op's outputs, empty: like their input where requested and present, else (0,), each its own
    tensor (outputs of a custom op may not alias each other)."""
    grads = [torch.empty_like(x) if output_mask[0] else x.new_empty((0,))]
    grads += [t.new_empty(t.shape) if needed and t is not None else x.new_empty((0,))  # dense, whatever t's strides
              for t, needed in zip((weight, bias, scale, shift), output_mask[1:])]
    return tuple(grads)


@torch.library.register_fake("gn_patch::group_norm_act_backward")
def _group_norm_act_backward_fake(grad_out, x, weight, bias, scale, shift, mean, rstd, num_groups, activation,
                                  output_mask):
    _check_inputs(x, weight, bias, scale, shift, num_groups, activation)
    _check_backward_inputs(grad_out, x, mean, rstd, num_groups, output_mask)
    return _grad_outputs(x, weight, bias, scale, shift, output_mask)


# ------------------------------------------------------------------------------------------------
# Reference implementation (CPU kernel of the ops): the formulas of the CUDA kernels, in float32 (float64 for
# float64 inputs). Used by tests, torch.library.opcheck and CPU tracing.
# ------------------------------------------------------------------------------------------------
def _normalized(x, mean, rstd, num_groups):
    n = x.shape[0]
    xg = x.to(_stats_dtype(x)).reshape(n, num_groups, -1)
    return ((xg - mean[..., None]) * rstd[..., None]).reshape(x.shape)


def _affine(xhat, weight, bias):
    v = xhat
    if weight is not None:
        v = v * _param_view(weight, xhat).to(xhat.dtype)
    if bias is not None:
        v = v + _param_view(bias, xhat).to(xhat.dtype)
    return v


def _modulation(x, scale):
    """(1 + scale) as a per-sample view in the statistics' dtype, or None."""
    return None if scale is None else 1 + _sample_view(scale, x).to(_stats_dtype(x))


def _modulated(v, m, shift):
    if m is not None:
        v = v * m
    if shift is not None:
        v = v + _sample_view(shift, v).to(v.dtype)
    return v


def _group_norm_act_reference(x, weight, bias, scale, shift, num_groups, eps, activation, input_offset=None,
                              input_bias=None, frames_last=False):
    _check_inputs(x, weight, bias, scale, shift, num_groups, activation)
    _check_input_terms(x, input_offset, input_bias)
    _check_frames_last(x, frames_last)
    check_eps(eps)
    y = _empty_frames_last(x) if frames_last else torch.empty_like(x)
    if x.numel() == 0:  # N = 0 (_check_inputs rejects an empty image, as the CUDA op does)
        stats = x.new_empty((x.shape[0], num_groups), dtype=_stats_dtype(x))
        return y, stats, torch.empty_like(stats)
    x = _with_input_terms(x, input_offset, input_bias)  # the sums in x's dtype, as the kernels form them
    acc = x.to(_stats_dtype(x)).reshape(x.shape[0], num_groups, -1)
    var, mean = torch.var_mean(acc, dim=-1, unbiased=False)
    rstd = torch.rsqrt(var + eps)
    u = _modulated(_affine(_normalized(x, mean, rstd, num_groups), weight, bias), _modulation(x, scale), shift)
    y.copy_(ACTIVATIONS[canonical_activation(activation)](u))
    return y, mean, rstd


def _group_norm_act_inference_reference(*args, **kwargs):
    return _group_norm_act_reference(*args, **kwargs)[0]


# Registered by call: the decorator form returns None, and the inference op's reference calls the full one.
torch.library.impl("gn_patch::group_norm_act", "CPU")(_group_norm_act_reference)
torch.library.impl("gn_patch::group_norm_act_inference", "CPU")(_group_norm_act_inference_reference)


# name -> (grad of the activation's output, its input u) -> grad of u: the backward ops PyTorch's autograd formulas
# call (tools/autograd/derivatives.yaml). Called directly rather than through torch.autograd.grad, which records
# nothing where this runs below the autograd key (compiled autograd runs the op's backward there).
_ACTIVATION_BACKWARDS = {
    "identity": lambda grad, u: grad,
    "silu": torch.ops.aten.silu_backward,
    "gelu": lambda grad, u: torch.ops.aten.gelu_backward(grad, u),
    "gelu_tanh": lambda grad, u: torch.ops.aten.gelu_backward(grad, u, approximate="tanh"),
    "relu": lambda grad, u: torch.ops.aten.threshold_backward(grad, F.relu(u), 0),
    "mish": torch.ops.aten.mish_backward,
}


@torch.library.impl("gn_patch::group_norm_act_backward", "CPU")
def _group_norm_act_backward_reference(grad_out, x, weight, bias, scale, shift, mean, rstd, num_groups, activation,
                                       output_mask):
    _check_inputs(x, weight, bias, scale, shift, num_groups, activation)
    _check_backward_inputs(grad_out, x, mean, rstd, num_groups, output_mask)
    outputs = list(_grad_outputs(x, weight, bias, scale, shift, output_mask))
    if x.numel() == 0:
        for i in (1, 2):
            outputs[i].zero_()
        return tuple(outputs)
    xhat = _normalized(x, mean, rstd, num_groups)
    m = _modulation(x, scale)
    v = _affine(xhat, weight, bias)
    u = _modulated(v, m, shift)
    du = _ACTIVATION_BACKWARDS[canonical_activation(activation)](grad_out.to(u.dtype), u)
    spatial = list(range(2, x.dim()))
    per_sample = lambda t: t.sum(spatial) if spatial else t
    dv = du if m is None else du * m
    values = {1: lambda: (dv * xhat).sum([0] + spatial), 2: lambda: dv.sum([0] + spatial),
              3: lambda: per_sample(du * v), 4: lambda: per_sample(du)}
    for i, value in values.items():
        if outputs[i].numel():
            outputs[i].copy_(value())
    if outputs[0].numel():
        n = x.shape[0]
        dxhat = dv if weight is None else dv * _param_view(weight, x).to(dv.dtype)
        dxhat, xg = dxhat.reshape(n, num_groups, -1), xhat.reshape(n, num_groups, -1)
        c1 = dxhat.mean(-1, keepdim=True)
        c2 = (dxhat * xg).mean(-1, keepdim=True)
        outputs[0].copy_((rstd[..., None] * (dxhat - c1 - xg * c2)).reshape(x.shape))
    return tuple(outputs)


# ------------------------------------------------------------------------------------------------
# Public function
# ------------------------------------------------------------------------------------------------
@torch.library.impl("gn_patch::bias_residual_add", "CPU")
@torch.library.register_fake("gn_patch::bias_residual_add")
def bias_residual_add(residual: torch.Tensor, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``residual + (x + bias.view(1, C, 1, ...))`` with PyTorch's adds, each rounded to the tensors' dtype: the end of
    a diffusers resnet block, ``input_tensor + conv2(h)``, with conv2 run without its bias (``x``). On CUDA the op
    ``gn_patch::bias_residual_add`` computes it in one pass (csrc/residual.cu, the same values bit for bit) where x
    and residual are channels-last with the same shape, strides and dtype (float16, bfloat16 or float32) and bias is
    (C,) of their dtype; elsewhere, and on the CPU and in tracing (this function), with the two adds. The op is not
    differentiable (no autograd kernel: autograd warns and records nothing): the surgeon calls it only where no
    gradient is recorded.

    Args:
        residual, x: (N, C, *spatial), 1 to 3 spatial dims.
        bias: (C,).
    Returns:
        The sum, in the layout PyTorch's adds give it (channels-last for channels-last inputs).
    Raises:
        RuntimeError: shapes that do not broadcast, as PyTorch's add raises.
    """
    return residual + (x + bias.reshape(1, -1, *(1,) * (x.dim() - 2)))


def _functorch_wrapped(t: torch.Tensor) -> bool:
    """Whether a torch.func transform (vmap, grad, jvp, ...) wraps t: functorch cannot be asked for its per-sample
    layout ("NYI: querying is_contiguous inside of vmap") nor copy it to channels-last. False while torch.compile
    traces: Dynamo cannot trace the query, and traces the transforms itself."""
    return not torch.compiler.is_compiling() and torch._C._functorch.is_functorch_wrapped_tensor(t)


def _safe_group_norm(x, num_groups, weight, bias, eps):
    """F.group_norm, steered around two faults of PyTorch's GroupNorm backward: a SIGSEGV of the CPU kernel (torch
    2.13) for channels-last input when the input needs no gradient but the weight or bias does (norm-only
    fine-tuning of a channels-last model: the first norm's input comes from a frozen conv), and "tensor does not have
    a device" for a bias without a weight (CPU on torch 2.13, CUDA on torch 2.11). The first runs from an
    NCHW-contiguous copy (the NCHW kernel's values), the second with a weight of ones (the same values). Outside
    these cases: PyTorch's own call. As autograd.cpp's safe_group_norm."""
    if torch.is_grad_enabled() and weight is None and bias is not None and bias.requires_grad:
        weight = torch.ones_like(bias)
    if x.is_cpu and torch.is_grad_enabled():
        params_need_grad = any(p is not None and p.requires_grad for p in (weight, bias))
        if (params_need_grad and not x.requires_grad and not _functorch_wrapped(x)
                and suggest_memory_format(x) != torch.contiguous_format):
            x = x.contiguous()
    return F.group_norm(x, num_groups, weight, bias, eps)


def _pytorch_path(x, num_groups, weight, bias, eps, activation, scale=None, shift=None, input_offset=None,
                  input_bias=None, frames_last=False):
    """Stock PyTorch: ``(x + input_bias) + input_offset``, F.group_norm, the per-sample modulation
    ``* (1 + scale) + shift`` as diffusers writes it, then the activation (copied to the frames_last layout where
    asked). What the dispatching op computes for the inputs the kernels do not take, before the extension is loaded.
    On the CPU, y has the layout PyTorch's CPU kernel gives it (x's suggested memory format), stated here because
    the fake (meta) group_norm of torch 2.14 returns NCHW for channels-last input: torch.compile then traces the
    layout the real call returns."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"gn_patch.group_norm_act: x must be a tensor, got {type(x).__name__}")
    _check_frames_last(x, frames_last)
    x = _add_input_bias(x, input_bias)
    if input_offset is not None:
        x = x + input_offset
    if not (x.is_floating_point() or x.is_complex()):
        raise TypeError(f"gn_patch.group_norm_act: x must be a floating-point tensor, got {x.dtype}")
    scale, shift = _broadcastable(scale, x, "scale"), _broadcastable(shift, x, "shift")
    if scale is not None and shift is not None and not (scale.shape[0] == shift.shape[0] or 1 in
                                                        (scale.shape[0], shift.shape[0])):
        # An x of batch 1 leaves them to broadcast against each other: a ValueError, as autograd.cpp's
        # check_modulation_batches, where PyTorch's broadcast would raise a RuntimeError.
        raise ValueError(f"gn_patch.group_norm_act: scale and shift of batches {list(scale.shape)} and "
                         f"{list(shift.shape)} do not broadcast together for input of shape {list(x.shape)}")
    y = _safe_group_norm(x, num_groups, weight, bias, eps)
    if x.is_cpu and not _functorch_wrapped(y):  # a wrapped x makes y wrapped too
        y = y.contiguous(memory_format=suggest_memory_format(x))
    if scale is not None:
        y = y * (1 + scale)
    if shift is not None:
        y = y + shift
    y = ACTIVATIONS[activation](y)
    return y.permute(0, 3, 4, 2, 1).contiguous().permute(0, 4, 3, 1, 2) if frames_last else y


def _add_input_bias(x: torch.Tensor, input_bias: torch.Tensor | None) -> torch.Tensor:
    """``x + input_bias`` with input_bias (C,) viewed per channel, PyTorch's add (broadcasting, type promotion)."""
    if input_bias is None:
        return x
    if not isinstance(input_bias, torch.Tensor):
        raise TypeError("gn_patch.group_norm_act: input_bias must be a tensor or None, got "
                        f"{type(input_bias).__name__}")
    if x.dim() < 2:  # F.group_norm's message: x is what is wrong (a 1-D x would broadcast against the bias)
        raise RuntimeError(f"Expected at least 2 dimensions for input tensor but received {x.dim()}")
    if input_bias.dim() != 1 or input_bias.shape[0] != x.shape[1]:
        raise ValueError("gn_patch.group_norm_act: input_bias must have shape (C,) for input of shape "
                         f"{list(x.shape)}; got {list(input_bias.shape)}")
    return _with_input_terms(x, None, input_bias)


def _broadcastable(t: torch.Tensor | None, x: torch.Tensor, name: str) -> torch.Tensor | None:
    """A per-sample scale or shift of shape (N, C) or (N, C, 1, ...), as a view that broadcasts against x. Of x's
    rank, a batch of 1 on either side broadcasts as ``h * (1 + scale) + shift`` does: one timestep embedding for
    every image (autograd.cpp's broadcastable expands it for the kernels), or one image for a batch of
    embeddings (y then has their batch: PyTorch's ops). An x of fewer than 2 dims is left to F.group_norm's check."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"gn_patch.group_norm_act: {name} must be a tensor or None, got {type(t).__name__}")
    if x.dim() < 2:
        return t
    n, c = x.shape[:2]
    broadcasts = t.dim() == x.dim() and (t.shape[0] == 1 or n == 1)
    if (t.dim() < 2 or t.shape[1] != c or not (broadcasts or t.shape[0] == n)
            or any(size != 1 for size in t.shape[2:]) or t.dim() > x.dim()):
        raise ValueError(f"gn_patch.group_norm_act: {name} must have shape (N, C) or (N, C, 1, ...) with N x's "
                         f"batch, for input of shape {list(x.shape)}; got {list(t.shape)} (with x's rank, a batch of "
                         "1 on either side broadcasts, as in h * (1 + scale) + shift)")
    return t if broadcasts else t.reshape(n, c, *([1] * (x.dim() - 2)))


def _check_tensor_arguments(weight, bias, scale, shift, input_bias) -> None:
    """TypeError naming the first of these that is neither a tensor nor None (the OpOverload's schema error would
    name the schema's type instead)."""
    tensor = torch.Tensor
    if not ((weight is None or isinstance(weight, tensor)) and (bias is None or isinstance(bias, tensor))
            and (scale is None or isinstance(scale, tensor)) and (shift is None or isinstance(shift, tensor))
            and (input_bias is None or isinstance(input_bias, tensor))):
        for name, t in (("weight", weight), ("bias", bias), ("scale", scale), ("shift", shift),
                        ("input_bias", input_bias)):
            if t is not None and not isinstance(t, tensor):
                raise TypeError(f"gn_patch.group_norm_act: {name} must be a tensor or None, got {type(t).__name__}")


def _group_norm_act(x, num_groups: int, weight, bias, eps: float, activation: str, scale=None, shift=None,
                    input_offset=None, input_bias=None, frames_last: bool = False) -> torch.Tensor:
    """One call of the op layer (GroupNormAct.forward's hot path): activation is already canonical. The tensor
    arguments' types are checked where the C++ entry does not take the call (it declines other types)."""
    if input_offset is not None and not isinstance(input_offset, torch.Tensor):
        # A Python number, as `hidden_states + temb` takes it (after the bias: the order of the adds).
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"gn_patch.group_norm_act: x must be a tensor, got {type(x).__name__}")
        x, input_offset, input_bias = _add_input_bias(x, input_bias) + input_offset, None, None
    if extension.loaded or (isinstance(x, torch.Tensor) and x.is_cuda and extension.kernels_available()):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"gn_patch.group_norm_act: x must be a tensor, got {type(x).__name__}")
        if extension.entry is not None and not torch.compiler.is_compiling():  # Dynamo traces the OpOverload
            y = extension.entry(x, num_groups, weight, bias, eps, activation, scale, shift, input_offset, input_bias,
                                frames_last)
            if y is not None:
                return y
        # The entry declined (an argument of another type, a subclass, a mode) or Dynamo traces: the OpOverload.
        _check_tensor_arguments(weight, bias, scale, shift, input_bias)
        return _DISPATCH(x, num_groups, weight, bias, eps, activation, scale, shift, input_offset, input_bias,
                         frames_last)
    _check_tensor_arguments(weight, bias, scale, shift, input_bias)
    return _pytorch_path(x, num_groups, weight, bias, eps, activation, scale, shift, input_offset, input_bias,
                         frames_last)


def group_norm_act(x: torch.Tensor, num_groups: int, weight: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None, eps: float = 1e-5, activation: str | None = "silu", *,
                   scale: torch.Tensor | None = None, shift: torch.Tensor | None = None,
                   input_offset: torch.Tensor | None = None, input_bias: torch.Tensor | None = None,
                   frames_last: bool = False) -> torch.Tensor:
    """GroupNorm (Wu & He, 2018), an optional per-sample modulation, then an activation:
    ``act(F.group_norm((x + input_bias.view(1, C, 1, ...)) + input_offset, num_groups, weight, bias, eps)
    * (1 + scale) + shift)``.

    Args:
        x: (N, C, *spatial) with 0 to 3 spatial dims, float16/bfloat16/float32 (any floating dtype on the
            PyTorch path).
        num_groups: G; C must be divisible by it. Statistics are per (sample, group) over C/G channels and
            all spatial positions; the variance is biased (divides by the element count), as in nn.GroupNorm.
        weight, bias: (C,) affine parameters, optional; the input's dtype or float32.
        eps: added to the variance before the reciprocal square root.
        activation: ``silu`` (alias ``swish``), ``gelu`` (erf form), ``gelu_tanh``, ``relu``, ``mish`` or
            ``identity``/``None``; case-insensitive.
        scale, shift: optional per-sample modulation of shape (N, C) or (N, C, 1, ...), e.g. the timestep
            embedding of diffusers' ``time_embedding_norm="scale_shift"`` blocks and ``AdaGroupNorm``; x's dtype or
            float32. Of x's rank, a batch of 1 on either side broadcasts as ``h * (1 + scale) + shift`` does: a
            (1, C, 1, ...) serves every sample, and an x of batch 1 with a modulation of batch M gives y of batch M
            (a block called with one image and M timestep embeddings: PyTorch's ops, the norm run once). A 2-D
            (N, C) modulation must match x's batch.
        input_offset: optional tensor (or number) added to x before the normalisation, as ``x + input_offset``
            (diffusers' resnet blocks add their timestep embedding, shape (N, C, 1, 1), before norm2). The kernels
            add a per-sample offset of shape (N, C, 1, ...) (x's rank) and x's dtype as they load x, rounded to x's
            dtype as PyTorch's add rounds, without writing the sum to memory (inference; under autograd, and with
            activations other than silu, the sum is PyTorch's add); any other shape, dtype or a number broadcasts
            and promotes as PyTorch's add does.
        input_bias: optional (C,) tensor added to each channel of x before input_offset, as
            ``x + input_bias.view(1, C, 1, ...)``: the bias of the convolution that produced x, left out of it
            (PyTorch adds a cuDNN convolution's bias in a pass of its own; diffusers' resnet blocks compute
            ``norm2(conv1(h) + temb)``). Added by the kernels as input_offset is, in x's dtype, a second rounded add
            before it; another dtype or device promotes as PyTorch's add does.
        frames_last: for a 5-D x (N, C, F, H, W), return y with its memory in (N, H, W, F, C) order (strides
            (H·W·F·C, 1, C, W·F·C, F·C)) instead of x's: the order diffusers' temporal transformers read it in
            (``y.permute(0, 3, 4, 2, 1).reshape(N·H·W, F, C)``, the input of their proj_in, is then a view). The
            values are the same; the kernels write the rows there themselves, every other path copies.

    Returns:
        y with x's shape and dtype (on PyTorch's path under torch.autocast: autocast's float32). The kernels return
        x's memory format (or frames_last's); PyTorch's path returns what PyTorch returns (or frames_last's).

    CUDA inputs that are channels-last (channels_last, channels_last_3d, or a (B, C, L) tensor with channel
    stride 1) run gn_patch's fused NHWC kernels, with float32 statistics; every other input (CPU, MPS,
    float64, NCHW-contiguous, ...) takes exactly PyTorch's F.group_norm, modulation and activation. Gradients flow
    to x, weight, bias, scale and shift on both paths; the kernels' backward is bitwise deterministic
    (fixed-order reductions, no atomics).

    Raises:
        RuntimeError: C not divisible by num_groups, weight/bias not of shape (C,) (messages as
            torch.nn.GroupNorm's), weight on another device than x; input_offset not broadcastable to x, or
            input_bias on another device (PyTorch's add's messages).
        TypeError: x not a tensor, or an integer or bool tensor; weight, bias, scale, shift or input_bias neither a
            tensor nor None; input_offset neither a tensor, a number nor None (PyTorch's add's message); num_groups
            not an int; eps not a number.
        ValueError: num_groups <= 0; eps negative, infinite or NaN; unknown activation; scale/shift of the wrong
            shape, or of batches that do not broadcast together; input_bias not of shape (C,); frames_last with
            an x that is not 5-D.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"gn_patch.group_norm_act: x must be a tensor, got {type(x).__name__}")
    num_groups, eps = check_num_groups(num_groups), check_eps(eps)
    return _group_norm_act(x, num_groups, weight, bias, eps, canonical_activation(activation), scale, shift,
                           input_offset, input_bias, bool(frames_last))
