"""Rule for nn.Sequential: adjacent (GroupNorm, activation) items."""

from __future__ import annotations

import functools
import itertools

from torch import nn

from ..modules import GroupNormAct
from ..report import join_name
from .base import Surgery, fuse_with_next, rule


@rule(nn.Sequential)
def sequential(s: Surgery, name: str, seq: nn.Sequential) -> None:
    """Adjacent (GroupNorm, activation) items of an nn.Sequential, whose forward calls its items in order."""
    items = list(seq._modules.items())
    for (key, norm), (next_key, following) in itertools.pairwise(items):
        if isinstance(norm, nn.GroupNorm) and type(norm) is not GroupNormAct:
            fuse_with_next(s, join_name(name, key), norm, following, "Sequential(GroupNorm, act)",
                           functools.partial(setattr, seq, next_key))
