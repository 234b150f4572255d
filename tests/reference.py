"""The float64 reference every kernel is checked against, and helpers to compare with it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gn_patch.ops import ACTIVATIONS


def _modulated(u, scale, shift):
    view = lambda t: t.reshape(*t.shape[:2], *([1] * (u.dim() - 2)))
    if scale is not None:
        u = u * (1 + view(scale))
    if shift is not None:
        u = u + view(shift)
    return u


def reference(x, num_groups, weight, bias, eps, activation, scale=None, shift=None):
    """act(F.group_norm(...) * (1 + scale) + shift) computed in float64 on upcast copies of the inputs."""
    up = lambda t: None if t is None else t.detach().double().contiguous()
    u = F.group_norm(up(x), num_groups, up(weight), up(bias), eps)
    return ACTIVATIONS[activation](_modulated(u, up(scale), up(shift)))


def reference_grads(x, num_groups, weight, bias, eps, activation, grad_out, scale=None, shift=None):
    """(dx, dweight, dbias[, dscale, dshift]) of the float64 reference for the upstream gradient grad_out."""
    leaves = [t.detach().double().contiguous().requires_grad_(True) if t is not None else None
              for t in (x, weight, bias, scale, shift)]
    u = F.group_norm(leaves[0], num_groups, leaves[1], leaves[2], eps)
    ACTIVATIONS[activation](_modulated(u, leaves[3], leaves[4])).backward(grad_out.double())
    grads = tuple(t.grad if t is not None else None for t in leaves)
    return grads if scale is not None or shift is not None else grads[:3]


def assert_close(actual, expected, atol, rtol, what=""):
    """Every element within atol + rtol*|expected| (NaN never passes); the message names the worst element."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a = actual.detach().double()
    e = expected.detach().double()
    bad = ~((a - e).abs() <= atol + rtol * e.abs())  # NaN compares False: counted as bad
    if bad.any():
        err = torch.where(torch.isnan(a), torch.full_like(a, float("inf")), (a - e).abs())
        worst = int(err.flatten().argmax())
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), a.shape))
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {a.numel()} elements off (atol={atol}, rtol={rtol}); worst at {index}: "
            f"got {a[index].item():.6g}, expected {e[index].item():.6g}")


def random_input(shape, dtype, device, layout="channels_last", offset=0.0, scale=3.0, seed=0):
    """scale * randn + 1 + offset in the given layout: 'channels_last' (any rank), 'nchw', or 'unaligned'
    (channels-last data starting one element past a 16-byte boundary)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    logical = (torch.randn(shape, generator=gen, dtype=torch.float64) * scale + 1.0 + offset).to(dtype)
    if layout == "nchw":
        return logical.contiguous().to(device)
    channels_last_shape = (shape[0], *shape[2:], shape[1])
    data = logical.movedim(1, -1).contiguous()
    if layout == "unaligned":
        storage = torch.empty(data.numel() + 1, dtype=dtype, device=device)
        storage[1:].copy_(data.flatten())
        data = storage[1:].view(channels_last_shape)
    else:
        data = data.to(device)
    return data.movedim(-1, 1)


def assert_same_nonfinite(actual, expected, atol, rtol, what=""):
    """NaN exactly where expected has NaN, the same infinities, and the finite elements within tolerance."""
    a, e = actual.detach().double(), expected.detach().double()
    assert torch.equal(torch.isnan(a), torch.isnan(e)), (
        f"{what}: NaN at {int(torch.isnan(a).sum())} elements, expected at {int(torch.isnan(e).sum())}")
    inf = torch.isinf(e)
    assert torch.equal(torch.isinf(a), inf) and torch.equal(a[inf], e[inf]), f"{what}: infinities differ"
    finite = torch.isfinite(e)
    assert_close(a[finite], e[finite], atol, rtol, what)
