"""The float64 reference every kernel is checked against, and helpers to compare with it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gn_patch.ops import ACTIVATIONS


def reference(x, num_groups, weight, bias, eps, activation):
    """act(F.group_norm(...)) computed in float64 on upcast copies of the inputs."""
    up = lambda t: None if t is None else t.detach().double().contiguous()
    return ACTIVATIONS[activation](F.group_norm(up(x), num_groups, up(weight), up(bias), eps))


def reference_grads(x, num_groups, weight, bias, eps, activation, grad_out):
    """(dx, dweight, dbias) of the float64 reference for the upstream gradient grad_out."""
    leaves = [t.detach().double().contiguous().requires_grad_(True) if t is not None else None for t in (x, weight, bias)]
    y = ACTIVATIONS[activation](F.group_norm(leaves[0], num_groups, leaves[1], leaves[2], eps))
    y.backward(grad_out.double())
    return tuple(t.grad if t is not None else None for t in leaves)


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
