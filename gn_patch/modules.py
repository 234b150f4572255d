"""``GroupNormAct``: torch.nn.GroupNorm fused with the activation that follows it."""

from __future__ import annotations

import torch
from torch import nn

from .ops import _group_norm_act, canonical_activation, check_eps, check_num_groups

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
        activation: ``silu`` (alias ``swish``), ``gelu``, ``gelu_tanh``, ``relu``, ``mish`` or ``identity``
            (case-insensitive; also None). Assigning ``module.activation`` later takes the same names.
        bias: keyword-only, as torch.nn.GroupNorm's: False leaves the affine map without its bias (None).

    num_groups may also be a numpy integer or a one-element integer tensor, eps a numpy float or a one-element real
    tensor, as torch.nn.GroupNorm takes them: they are stored as a Python int and float.

    ``forward(x, scale=None, shift=None, input_offset=None, input_bias=None)``: x is (N, C, *spatial); the optional
    per-sample scale and shift of shape (N, C) or (N, C, 1, ...) give ``act(GroupNorm(x) * (1 + scale) + shift)``
    (with x's rank, a batch of 1 on either side broadcasts, as that expression does: one embedding for every image,
    or one image for M embeddings, y then of batch M);
    ``input_offset`` (a timestep embedding of shape (N, C, 1, 1), say) and ``input_bias`` (the (C,) bias of the
    convolution that produced x, left out of it) give
    ``act(GroupNorm((x + input_bias.view(1, C, 1, ...)) + input_offset))``, the sums formed as the kernels load x;
    ``frames_last=True`` returns the output of a 5-D (N, C, F, H, W) input with its memory in (N, H, W, F, C) order.
    See gn_patch.group_norm_act.

    Raises:
        TypeError: num_groups not an int, eps not a number.
        ValueError: num_groups <= 0; num_channels not divisible by num_groups (nn.GroupNorm's message); eps
            negative, infinite or NaN; unknown activation.
    """

    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5, affine: bool = True,
                 activation: str | None = "silu", device=None, dtype=None, *, bias: bool = True) -> None:
        num_groups = check_num_groups(num_groups)  # before nn.GroupNorm's own check, which divides by it
        # bias=False only where given: torch.nn.GroupNorm takes it in torch 2.13 and 2.14; a torch without it raises
        # TypeError for bias=False, as its nn.GroupNorm does.
        super().__init__(num_groups, num_channels, eps=eps, affine=affine, device=device, dtype=dtype,
                         **({} if bias else {"bias": False}))
        self.activation = activation

    @classmethod
    def from_group_norm(cls, group_norm: nn.GroupNorm, activation: str | None = "silu") -> GroupNormAct:
        """A GroupNormAct sharing ``group_norm``'s parameters (the same Parameter objects, no copy).

        Raises:
            TypeError: ``group_norm`` is not a torch.nn.GroupNorm.
            ValueError: unknown activation.
        """
        if not isinstance(group_norm, nn.GroupNorm):
            raise TypeError(f"GroupNormAct.from_group_norm: group_norm must be a torch.nn.GroupNorm, got "
                            f"{type(group_norm).__name__}")
        module = cls(group_norm.num_groups, group_norm.num_channels, group_norm.eps, group_norm.affine,
                     activation, device="meta")
        if group_norm.affine:
            module.weight = group_norm.weight
            module.bias = group_norm.bias
        module.train(group_norm.training)
        return module

    def __setattr__(self, name: str, value) -> None:
        # `activation` is kept canonical whenever it is set (the constructor, the surgeon, a user switching it), so
        # that forward passes it on without a per-call lookup. Raises ValueError for an unknown name. num_groups
        # and eps assigned later are checked as the constructor checks them: the error comes from the assignment,
        # the same whether the C++ or the Python path would have run the next call.
        if name == "activation":
            value = canonical_activation(value)
        elif name == "num_groups":
            value = check_num_groups(value)
            # nn.GroupNorm's constructor sets num_groups before num_channels: a later assignment is checked too.
            if "num_channels" in self.__dict__ and self.num_channels % value != 0:
                raise ValueError("num_channels must be divisible by num_groups")
        elif name == "eps":
            value = check_eps(value)
        super().__setattr__(name, value)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None, shift: torch.Tensor | None = None,
                input_offset: torch.Tensor | None = None, input_bias: torch.Tensor | None = None,
                frames_last: bool = False) -> torch.Tensor:
        # weight and bias from _parameters: nn.Module.__getattr__, a Python call per attribute, cost about a third of
        # the module's own Python per call. A parametrization (torch.nn.utils.parametrize) or weight_norm takes the
        # name out of _parameters: the attribute then serves, as for nn.GroupNorm.
        params = self._parameters
        weight = params["weight"] if "weight" in params else self.weight
        bias = params["bias"] if "bias" in params else self.bias
        return _group_norm_act(x, self.num_groups, weight, bias, self.eps, self.activation, scale, shift, input_offset,
                               input_bias, bool(frames_last))

    def __prepare_scriptable__(self):
        raise RuntimeError("GroupNormAct does not support TorchScript: torch.jit.script cannot compile its forward, "
                           "a Python function that calls gn_patch's custom op (PyTorch's ops until the CUDA extension "
                           "is loaded). Use torch.compile or torch.export (torch.jit.trace once the extension is "
                           "loaded)")

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, activation={self.activation}"
