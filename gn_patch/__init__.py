"""gn_patch: channels-last (NHWC) GroupNorm + activation CUDA kernels for diffusers models."""

from .modules import GroupNormAct
from .ops import canonical_activation, group_norm_act

__all__ = ["GroupNormAct", "canonical_activation", "group_norm_act"]
__version__ = "0.1.0"
