"""The surgeon's rules, as a registry: module class -> handler (see :mod:`gn_patch.rules.base`).

Each module here covers one part of diffusers and declares, class by class, what its diffusers 0.42.1 code does
after its GroupNorms (``fusion``, ``pairs`` in :mod:`gn_patch.rules.fusion`), pinned to the code read by a source
digest (``verified``). Adding a model family is adding such declarations, not editing the walker in
:mod:`gn_patch.surgeon`.
"""

from . import attention, containers, resnet, sampling, unets, vaes  # noqa: F401  (registers the handlers)
from .base import ORIGINAL_CLASS, RULES, VERIFIED_SOURCES

__all__ = ["ORIGINAL_CLASS", "RULES", "VERIFIED_SOURCES"]
