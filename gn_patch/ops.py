"""GroupNorm fused with an activation, as the PyTorch custom ops ``gn_patch::group_norm_act`` and
``gn_patch::group_norm_act_backward``.

Schema, fake (meta) functions, autograd formula and the CPU reference implementation live here; the CUDA
implementation is csrc/ops.cpp, loaded by gn_patch.build on first use. The public entry point is
:func:`group_norm_act`, which sends channels-last CUDA inputs to the kernels and everything else to
PyTorch's own ``F.group_norm`` followed by the activation.
"""

from __future__ import annotations

import torch
import torch.autograd.forward_ad as _forward_ad
import torch.nn.functional as F

from . import extension

__all__ = ["ACTIVATIONS", "canonical_activation", "group_norm_act"]

# name -> elementwise function. Aliases resolve through _ALIASES.
ACTIVATIONS = {
    "identity": lambda t: t,
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "relu": F.relu,
}
_ALIASES = {"swish": "silu", "none": "identity", None: "identity"}
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MEMORY_FORMATS = {4: torch.channels_last, 5: torch.channels_last_3d}
_is_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor

_lib = torch.library.Library("gn_patch", "DEF")
_lib.define(
    "group_norm_act(Tensor x, Tensor? weight, Tensor? bias, int num_groups, float eps, str activation)"
    " -> (Tensor y, Tensor mean, Tensor rstd)"
)
_lib.define(
    "group_norm_act_backward(Tensor grad_out, Tensor x, Tensor? weight, Tensor? bias, Tensor mean, Tensor rstd,"
    " int num_groups, str activation, bool[3] output_mask) -> (Tensor grad_x, Tensor grad_weight, Tensor grad_bias)"
)


def canonical_activation(activation: str | None) -> str:
    """Canonical name of an activation: one of ``identity, silu, gelu, gelu_tanh, relu``.

    Accepts the aliases ``swish`` (= silu) and ``None``/``"none"`` (= identity).

    Raises:
        ValueError: unknown name.
    """
    name = _ALIASES.get(activation, activation) if isinstance(activation, (str, type(None))) else activation
    if not isinstance(name, str) or name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; expected one of {sorted(ACTIVATIONS)} or swish")
    return name


def _stats_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _param_view(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return p.view(1, -1, *([1] * (x.dim() - 2)))


# ------------------------------------------------------------------------------------------------
# Input checks of the ops outside CUDA (the CUDA kernels check in C++ with the same messages)
# ------------------------------------------------------------------------------------------------
def _check_inputs(x, weight, bias, num_groups, activation):
    """Raise RuntimeError on what the CUDA op rejects, with torch.nn.GroupNorm's messages where it has one."""
    torch._check(x.dtype.is_floating_point, lambda: f"gn_patch: expected a floating-point input, got {x.dtype}")
    torch._check(2 <= x.dim() <= 5, lambda: f"gn_patch: expected a 2-D to 5-D input (N, C, *spatial), got shape "
                                            f"{list(x.shape)}")
    torch._check(num_groups > 0, lambda: f"gn_patch: num_groups must be positive, got {num_groups}")
    torch._check(x.shape[1] % num_groups == 0,
                 lambda: "Expected number of channels in input to be divisible by num_groups, but got input of shape "
                         f"{list(x.shape)} and num_groups={num_groups}")
    torch._check(activation in ACTIVATIONS, lambda: f"gn_patch: unknown activation '{activation}' (expected identity, "
                                                    "silu, gelu, gelu_tanh or relu)")
    torch._check(x.numel() != 0 or x.shape[0] == 0,
                 lambda: f"gn_patch: empty spatial size in input of shape {list(x.shape)}")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is None:
            continue
        torch._check(p.dim() == 1 and p.shape[0] == x.shape[1],
                     lambda: f"Expected {name} to be a vector of size equal to the number of channels in input, but "
                             f"got {name} of shape {list(p.shape)} and input of shape {list(x.shape)}")
        torch._check(p.device == x.device, lambda: "Expected all tensors to be on the same device, but found input on "
                                                   f"{x.device} and {name} on {p.device}")
        torch._check(p.dtype in (x.dtype, torch.float32),
                     lambda: f"gn_patch: {name} must have the input's dtype ({x.dtype}) or float32, got {p.dtype}")
    if weight is not None and bias is not None:
        torch._check(weight.dtype == bias.dtype,
                     lambda: f"gn_patch: weight ({weight.dtype}) and bias ({bias.dtype}) must have the same dtype")


def _check_backward_inputs(grad_out, x, mean, rstd, num_groups, output_mask):
    torch._check(grad_out.shape == x.shape and grad_out.dtype == x.dtype,
                 lambda: "gn_patch: grad_out must match the input's shape, dtype and device")
    for t in (mean, rstd):
        torch._check(t.shape == (x.shape[0], num_groups) and t.dtype == _stats_dtype(x),
                     lambda: f"gn_patch: mean and rstd must be {_stats_dtype(x)} of shape (N, num_groups)")
    torch._check(len(output_mask) == 3, lambda: "gn_patch: output_mask must have 3 entries (x, weight, bias)")


# ------------------------------------------------------------------------------------------------
# Fake functions: shapes, dtypes and strides (y keeps x's memory format, channels_last in -> out).
# ------------------------------------------------------------------------------------------------
@torch.library.register_fake("gn_patch::group_norm_act")
def _group_norm_act_fake(x, weight, bias, num_groups, eps, activation):
    _check_inputs(x, weight, bias, num_groups, activation)
    stats = x.new_empty((x.shape[0], num_groups), dtype=_stats_dtype(x))
    return torch.empty_like(x), stats, torch.empty_like(stats)


@torch.library.register_fake("gn_patch::group_norm_act_backward")
def _group_norm_act_backward_fake(grad_out, x, weight, bias, mean, rstd, num_groups, activation, output_mask):
    _check_inputs(x, weight, bias, num_groups, activation)
    _check_backward_inputs(grad_out, x, mean, rstd, num_groups, output_mask)
    dx = torch.empty_like(x) if output_mask[0] else x.new_empty((0,))
    dw = torch.empty_like(weight) if output_mask[1] and weight is not None else x.new_empty((0,))
    db = torch.empty_like(bias) if output_mask[2] and bias is not None else x.new_empty((0,))
    return dx, dw, db


# ------------------------------------------------------------------------------------------------
# Autograd: the op's own backward (one fused op for dx, dweight, dbias).
# ------------------------------------------------------------------------------------------------
def _setup_context(ctx, inputs, output):
    x, weight, bias, num_groups, eps, activation = inputs
    _y, mean, rstd = output
    ctx.save_for_backward(x, weight, bias, mean, rstd)
    ctx.num_groups = num_groups
    ctx.eps = eps
    ctx.activation = activation
    ctx.mark_non_differentiable(mean, rstd)


def _differentiable_grads(ctx, x, weight, bias, grad_y, mask):
    """The gradients recomputed through PyTorch's own differentiable ops (float32 or wider), for backward passes
    that build a graph (create_graph=True: double backward, gradient penalties). The backward op has no
    derivative of its own."""
    acc = _stats_dtype(x)
    leaves = [t for t, needed in zip((x, weight, bias), mask) if needed]
    up = lambda t: None if t is None else t.to(acc)
    y = ACTIVATIONS[ctx.activation](F.group_norm(up(x), ctx.num_groups, up(weight), up(bias), ctx.eps))
    grads = iter(torch.autograd.grad(y, leaves, grad_y.to(acc), create_graph=True))
    return tuple(next(grads) if needed else None for needed in mask)


def _backward(ctx, grad_y, _grad_mean, _grad_rstd):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    mask = [ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[1],
            bias is not None and ctx.needs_input_grad[2]]
    if torch.is_grad_enabled():  # create_graph=True: the gradients must themselves be differentiable
        return (*_differentiable_grads(ctx, x, weight, bias, grad_y, mask), None, None, None)
    dx, dw, db = torch.ops.gn_patch.group_norm_act_backward.default(
        grad_y, x, weight, bias, mean, rstd, ctx.num_groups, ctx.activation, mask)
    return (dx if mask[0] else None, dw if mask[1] else None, db if mask[2] else None, None, None, None)


torch.library.register_autograd("gn_patch::group_norm_act", _backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------------------------
# Reference implementation (CPU kernel of the ops): the same formulas as the CUDA kernels, in float32
# (float64 for float64 inputs). Used by tests, torch.library.opcheck and CPU tracing.
# ------------------------------------------------------------------------------------------------
def _normalized(x, mean, rstd, num_groups):
    n = x.shape[0]
    xg = x.to(_stats_dtype(x)).reshape(n, num_groups, -1)
    return ((xg - mean[..., None]) * rstd[..., None]).reshape(x.shape)


def _preactivation(xhat, weight, bias):
    u = xhat
    if weight is not None:
        u = u * _param_view(weight, xhat).to(xhat.dtype)
    if bias is not None:
        u = u + _param_view(bias, xhat).to(xhat.dtype)
    return u


@torch.library.impl("gn_patch::group_norm_act", "CPU")
def _group_norm_act_reference(x, weight, bias, num_groups, eps, activation):
    _check_inputs(x, weight, bias, num_groups, activation)
    if x.numel() == 0:  # N = 0 (_check_inputs rejects an empty spatial size, as the CUDA op does)
        stats = x.new_empty((x.shape[0], num_groups), dtype=_stats_dtype(x))
        return torch.empty_like(x), stats, torch.empty_like(stats)
    acc = x.to(_stats_dtype(x)).reshape(x.shape[0], num_groups, -1)
    var, mean = torch.var_mean(acc, dim=-1, unbiased=False)
    rstd = torch.rsqrt(var + eps)
    u = _preactivation(_normalized(x, mean, rstd, num_groups), weight, bias)
    y = torch.empty_like(x)
    y.copy_(ACTIVATIONS[activation](u))
    return y, mean, rstd


@torch.library.impl("gn_patch::group_norm_act_backward", "CPU")
def _group_norm_act_backward_reference(grad_out, x, weight, bias, mean, rstd, num_groups, activation, output_mask):
    _check_inputs(x, weight, bias, num_groups, activation)
    _check_backward_inputs(grad_out, x, mean, rstd, num_groups, output_mask)
    if x.numel() == 0:
        empty = x.new_empty((0,))
        return (torch.empty_like(x) if output_mask[0] else empty,
                torch.zeros_like(weight) if output_mask[1] and weight is not None else empty,
                torch.zeros_like(bias) if output_mask[2] and bias is not None else empty)
    xhat = _normalized(x, mean, rstd, num_groups)
    with torch.enable_grad():  # du = dy * act'(u), through PyTorch's own activation backward
        u = _preactivation(xhat, weight, bias).detach().requires_grad_(True)
        (du,) = torch.autograd.grad(ACTIVATIONS[activation](u), u, grad_out.to(u.dtype))
    reduce_dims = [0] + list(range(2, x.dim()))
    empty = x.new_empty((0,))
    dw = (du * xhat).sum(reduce_dims).to(weight.dtype) if output_mask[1] and weight is not None else empty
    db = du.sum(reduce_dims).to(bias.dtype) if output_mask[2] and bias is not None else empty
    if not output_mask[0]:
        return empty, dw, db
    n = x.shape[0]
    wdu = (du * _param_view(weight, x).to(du.dtype) if weight is not None else du).reshape(n, num_groups, -1)
    xg = xhat.reshape(n, num_groups, -1)
    c1 = wdu.mean(-1, keepdim=True)
    c2 = (wdu * xg).mean(-1, keepdim=True)
    dx = torch.empty_like(x)
    dx.copy_((rstd[..., None] * (wdu - c1 - xg * c2)).reshape(x.shape))
    return dx, dw, db


# ------------------------------------------------------------------------------------------------
# Public function
# ------------------------------------------------------------------------------------------------
def _is_channels_last(x: torch.Tensor) -> bool:
    """Dense with the channel dimension innermost, the layout the kernels read."""
    dim = x.dim()
    if dim == 4:
        return x.is_contiguous(memory_format=torch.channels_last)
    if dim == 3:
        return x.transpose(1, 2).is_contiguous()
    if dim == 5:
        return x.is_contiguous(memory_format=torch.channels_last_3d)
    return dim == 2 and x.is_contiguous()


def _wrapped_by_transform(t: torch.Tensor | None) -> bool:
    """``t`` is a torch.func transform's wrapper (vmap, grad, ...). Never under torch.compile tracing: dynamo
    cannot trace the functorch query (it handles transforms itself)."""
    return t is not None and not torch.compiler.is_compiling() and _is_functorch_wrapped(t)


def _transform_active(x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> bool:
    """A torch.func transform over x, weight or bias (grad or vmap over the parameters too) or forward-mode AD is
    in effect: they need derivative and batching rules the kernel op lacks. Never under torch.compile tracing."""
    if torch.compiler.is_compiling():
        return False
    return (_forward_ad._current_level >= 0 or _is_functorch_wrapped(x)
            or (weight is not None and _is_functorch_wrapped(weight))
            or (bias is not None and _is_functorch_wrapped(bias)))


def _kernel_accepts(x, weight, bias) -> bool:
    """The kernels' conditions on dtype, layout and parameters, whatever the device."""
    # Transforms first: inside vmap, the memory-format query below raises.
    if x.dtype not in _KERNEL_DTYPES or _transform_active(x, weight, bias) or not _is_channels_last(x):
        return False
    if x.numel() == 0 and x.shape[0] != 0:
        return False
    pdtype = weight.dtype if weight is not None else (bias.dtype if bias is not None else x.dtype)
    return pdtype in (x.dtype, torch.float32) and (bias is None or bias.dtype == pdtype)


def _kernel_covers(x, weight, bias) -> bool:
    return x.is_cuda and _kernel_accepts(x, weight, bias) and extension.kernels_available()


def _pytorch_path(x, num_groups, weight, bias, eps, activation):
    """F.group_norm then the activation, the result in x's memory format."""
    if not (x.is_floating_point() or x.is_complex()):
        raise TypeError(f"gn_patch.group_norm_act: expected a floating-point input, got {x.dtype}")
    y = ACTIVATIONS[activation](F.group_norm(x, num_groups, weight, bias, eps))
    # PyTorch's CUDA GroupNorm returns NCHW for channels-last input; hand back the caller's layout.
    fmt = _MEMORY_FORMATS.get(x.dim())
    # Under vmap the layout query raises, and a per-sample layout means nothing: the result stays as it is.
    if fmt is None or _wrapped_by_transform(x):
        return y
    if not x.is_contiguous() and x.is_contiguous(memory_format=fmt):
        y = y.contiguous(memory_format=fmt)
    return y


def _group_norm_act(x, num_groups: int, weight, bias, eps: float, activation: str) -> torch.Tensor:
    # Hot path of GroupNormAct.forward: activation is already canonical.
    if _kernel_covers(x, weight, bias):
        return torch.ops.gn_patch.group_norm_act.default(x, weight, bias, num_groups, eps, activation)[0]
    return _pytorch_path(x, num_groups, weight, bias, eps, activation)


def group_norm_act(x: torch.Tensor, num_groups: int, weight: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None, eps: float = 1e-5, activation: str | None = "silu") -> torch.Tensor:
    """GroupNorm (Wu & He, 2018) followed by an activation: ``act(F.group_norm(x, num_groups, weight, bias, eps))``.

    Args:
        x: (N, C, *spatial) with 0 to 3 spatial dims, float16/bfloat16/float32 (any floating dtype on the
            PyTorch path).
        num_groups: G; C must be divisible by it. Statistics are per (sample, group) over C/G channels and
            all spatial positions; the variance is biased (divides by the element count), as in nn.GroupNorm.
        weight, bias: (C,) affine parameters, optional; the input's dtype or float32.
        eps: added to the variance before the reciprocal square root.
        activation: ``silu`` (alias ``swish``), ``gelu`` (erf form), ``gelu_tanh``, ``relu`` or
            ``identity``/``None``.

    Returns:
        y with x's shape and dtype (on PyTorch's path under torch.autocast: autocast's float32) and x's memory
        format for 4-D/5-D inputs (the (B, C, L) channel-stride-1 view comes back contiguous from PyTorch's path).

    CUDA inputs that are channels-last (channels_last, channels_last_3d, or a (B, C, L) tensor with channel
    stride 1) run gn_patch's fused NHWC kernels, with float32 statistics; every other input (CPU, MPS,
    float64, NCHW-contiguous, ...) takes exactly PyTorch's F.group_norm then the activation. Gradients flow
    to x, weight and bias on both paths; the kernels' backward is bitwise deterministic (fixed-order
    reductions, no atomics).

    Raises:
        RuntimeError: C not divisible by num_groups, weight/bias not of shape (C,) (messages as
            torch.nn.GroupNorm's), weight on another device than x.
        TypeError: integer or bool input.
        ValueError: unknown activation.
    """
    return _group_norm_act(x, num_groups, weight, bias, eps, canonical_activation(activation))
