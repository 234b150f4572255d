"""Rules for diffusers.models.upsampling: Upsample2D's nearest upsampling of channels-last activations.

PyTorch's CUDA kernel for ``F.interpolate(mode="nearest")`` on channels-last input is about 2.6x slower than on NCHW
input. On the H200 (float16, the SD VAE decoder's three upsamplings to 1024²) it took 2.58 ms against 0.96 ms for
NCHW, and a broadcast copy of the NHWC rows took 1.23 ms for the same values (``benchmarks/NOTES.md``, session 15).
The patched class takes that copy where stock would run the channels-last kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.models.upsampling import Upsample2D
from torch import nn

from .fusion import fusion


def nearest_upsample_2x(x: torch.Tensor) -> torch.Tensor:
    """``F.interpolate(x, scale_factor=2.0, mode="nearest")`` for a channels-last (N, C, H, W) ``x``: each NHWC row
    copied twice and each of its pixels twice, by one broadcasting copy into a new channels-last tensor. The same
    values bit for bit (nearest upsampling by 2 only copies), the same layout as PyTorch's kernel returns.

    Args:
        x: (N, C, H, W), channels-last dense, any dtype and device.
    Returns:
        (N, C, 2H, 2W), channels_last.
    """
    n, c, h, w = x.shape
    out = torch.empty((n, c, 2 * h, 2 * w), dtype=x.dtype, device=x.device, memory_format=torch.channels_last)
    out.permute(0, 2, 3, 1).view(n, h, 2, w, 2, c).copy_(x.permute(0, 2, 3, 1)[:, :, None, :, None, :])
    return out


def _copies_instead(x: torch.Tensor) -> bool:
    """Whether Upsample2D's ``F.interpolate(x, scale_factor=2.0, mode="nearest")`` is computed by
    nearest_upsample_2x: a CUDA input channels-last and not also contiguous (where it is both, PyTorch returns NCHW),
    no gradient recorded (autograd's copy backward would stand in for interpolate's), not while torch.compile or
    torch.export traces (Inductor writes its own kernel)."""
    return (not torch.compiler.is_compiling() and x.is_cuda and x.dim() == 4
            and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
            and not (torch.is_grad_enabled() and x.requires_grad))


def upsample_nearest_2x(upsample: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """Upsample2D's ``F.interpolate(hidden_states, scale_factor=2.0, mode="nearest")``, by nearest_upsample_2x where
    _copies_instead holds."""
    if _copies_instead(hidden_states):
        return nearest_upsample_2x(hidden_states)
    return F.interpolate(hidden_states, scale_factor=2.0, mode="nearest")


# Upsample2D's forward with its nearest upsampling by 2 (no output_size) through upsample_nearest_2x; no norms.
_NEAREST = 'hidden_states = F.interpolate(hidden_states, scale_factor=2.0, mode="nearest")'
fusion(Upsample2D, "a42c758233dcf892", rewrites={_NEAREST: "hidden_states = self.upsample_nearest_2x(hidden_states)"},
       helpers={"upsample_nearest_2x": upsample_nearest_2x})
