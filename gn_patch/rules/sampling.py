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
from diffusers.utils import deprecate
from diffusers.utils.import_utils import is_torch_version

from .base import forward_override_problem, rule, set_class, stands_in_for, unverified, verified

verified(Upsample2D.forward, "a42c758233dcf892")


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


@stands_in_for(Upsample2D)
class _ChannelsLastUpsample2D(Upsample2D):
    """Upsample2D whose nearest upsampling of a channels-last CUDA input is nearest_upsample_2x; otherwise stock's
    forward (diffusers 0.42.1), statement for statement."""

    def forward(self, hidden_states: torch.Tensor, output_size: int | None = None, *args, **kwargs) -> torch.Tensor:
        if len(args) > 0 or kwargs.get("scale", None) is not None:
            deprecation_message = "The `scale` argument is deprecated and will be ignored. Please remove it, as passing it will raise an error in the future. `scale` should directly be passed while calling the underlying pipeline component i.e., via `cross_attention_kwargs`."  # noqa: E501
            deprecate("scale", "1.0.0", deprecation_message)

        assert hidden_states.shape[1] == self.channels

        if self.norm is not None:
            hidden_states = self.norm(hidden_states.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)

        if self.use_conv_transpose:
            return self.conv(hidden_states)

        dtype = hidden_states.dtype
        if dtype == torch.bfloat16 and is_torch_version("<", "2.1"):
            hidden_states = hidden_states.to(torch.float32)

        if hidden_states.shape[0] >= 64:
            hidden_states = hidden_states.contiguous()

        if self.interpolate:
            scale_factor = (
                2 if output_size is None else max([f / s for f, s in zip(output_size, hidden_states.shape[-2:])])
            )
            if hidden_states.numel() * scale_factor > pow(2, 31):
                hidden_states = hidden_states.contiguous()

            if output_size is None:
                if _copies_instead(hidden_states):
                    hidden_states = nearest_upsample_2x(hidden_states)
                else:
                    hidden_states = F.interpolate(hidden_states, scale_factor=2.0, mode="nearest")
            else:
                hidden_states = F.interpolate(hidden_states, size=output_size, mode="nearest")

        if dtype == torch.bfloat16 and is_torch_version("<", "2.1"):
            hidden_states = hidden_states.to(dtype)

        if self.use_conv:
            if self.name == "conv":
                hidden_states = self.conv(hidden_states)
            else:
                hidden_states = self.Conv2d_0(hidden_states)

        return hidden_states


@rule(Upsample2D, _ChannelsLastUpsample2D)
def upsample_2d(s, name, upsample) -> None:
    """Switch a stock Upsample2D (its forward as read, no instance-level wrapper) to the class above."""
    if (type(upsample) is Upsample2D and unverified(type(upsample).forward) is None
            and forward_override_problem(upsample) is None):
        set_class(upsample, _ChannelsLastUpsample2D)
