"""gn_patch: channels-last (NHWC) GroupNorm + activation CUDA kernels for diffusers models.

The op layer (``group_norm_act``, ``GroupNormAct``) needs only torch; the model surgeon and the pipeline
entry points import diffusers, so they load on first access.
"""

from .modules import GroupNormAct
from .ops import canonical_activation, group_norm_act

__all__ = ["GroupNormAct", "PatchReport", "canonical_activation", "group_norm_act", "patch_model",
           "patch_pipeline", "unpatch_model", "unpatch_pipeline"]
__version__ = "0.1.0"

_LAZY = {"PatchReport": "report", "patch_model": "surgeon", "unpatch_model": "surgeon",
         "patch_pipeline": "pipeline", "unpatch_pipeline": "pipeline"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
