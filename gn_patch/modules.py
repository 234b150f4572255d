"""``GroupNormAct``: torch.nn.GroupNorm fused with the activation that follows it."""

from __future__ import annotations

import torch
from torch import nn

from .ops import _group_norm_act, canonical_activation

__all__ = ["GroupNormAct"]


class GroupNormAct(nn.GroupNorm):
    """``act(GroupNorm(x))`` in one op: gn_patch's NHWC kernels on channels-last CUDA input, PyTorch otherwise.

    A torch.nn.GroupNorm subclass with the same parameters (``weight``, ``bias``, shape (num_channels,))
    and buffers, so state_dicts load into either class.

    Args:
        num_groups: groups to separate the channels into; num_channels must be divisible by it.
        num_channels: C of the expected (N, C, *spatial) input.
        eps: added to the variance for numerical stability.
        affine: learnable per-channel weight (init 1) and bias (init 0).
        activation: ``silu`` (alias ``swish``), ``gelu``, ``gelu_tanh``, ``relu`` or ``identity``.

    Raises:
        ValueError: num_channels not divisible by num_groups (from nn.GroupNorm), unknown activation.
    """

    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5, affine: bool = True,
                 activation: str | None = "silu", device=None, dtype=None) -> None:
        super().__init__(num_groups, num_channels, eps=eps, affine=affine, device=device, dtype=dtype)
        self.activation = canonical_activation(activation)

    @classmethod
    def from_group_norm(cls, group_norm: nn.GroupNorm, activation: str | None = "silu") -> "GroupNormAct":
        """A GroupNormAct sharing ``group_norm``'s parameters (the same Parameter objects, no copy)."""
        module = cls(group_norm.num_groups, group_norm.num_channels, group_norm.eps, group_norm.affine,
                     activation, device="meta")
        if group_norm.affine:
            module.weight = group_norm.weight
            module.bias = group_norm.bias
        module.train(group_norm.training)
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _group_norm_act(x, self.num_groups, self.weight, self.bias, self.eps, self.activation)

    def __prepare_scriptable__(self):
        raise RuntimeError("GroupNormAct does not support TorchScript (its forward chooses between the CUDA kernels "
                           "and PyTorch's path in Python): use torch.compile, torch.export or torch.jit.trace")

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, activation={self.activation}"
