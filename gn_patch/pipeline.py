"""Patch every GroupNorm-holding component of a diffusers pipeline (unet, vae, controlnet, ...) in place."""

from __future__ import annotations

from diffusers.models.normalization import AdaGroupNorm
from torch import nn

from . import cuda_graphs
from .surgeon import PatchReport, _check_unpatchable, _unpatch, patch_model

try:
    from transformers import PreTrainedModel
except ImportError:  # transformers is optional; without it no component is a transformers model
    PreTrainedModel = ()

__all__ = ["patch_pipeline", "unpatch_pipeline"]


def _holds_group_norm(module: nn.Module) -> bool:
    return any(isinstance(m, (nn.GroupNorm, AdaGroupNorm)) for m in module.modules())


def _check_pipeline(pipe, function: str) -> None:
    if not isinstance(getattr(pipe, "components", None), dict):
        raise TypeError(f"{function}: pipe must be a diffusers DiffusionPipeline (with a `components` dict), got "
                        f"{type(pipe).__name__}; use gn_patch.{function.replace('pipeline', 'model')} for a single "
                        "model")


def patch_pipeline(pipe, *, cuda_graph: bool = False, max_graphs: int = cuda_graphs.DEFAULT_MAX_GRAPHS,
                   **kwargs) -> PatchReport:
    """:func:`~gn_patch.surgeon.patch_model` applied to each torch.nn.Module in ``pipe.components`` that holds a
    GroupNorm: unet, vae, controlnet (MultiControlNetModel and ControlNetUnionModel included), ...

    transformers models (text and image encoders) are left alone; one holding a GroupNorm is listed as skipped.
    Components are patched in place, so this works before or after ``pipe.to(...)``, with accelerate offload hooks
    (``enable_model_cpu_offload``) already attached or attached later (not with ``cuda_graph``), and before
    ``torch.compile(pipe.unet)``. Call it again after replacing a component.

    Args:
        pipe: a diffusers DiffusionPipeline (anything with a ``components`` dict).
        cuda_graph: also run the UNet, the ControlNet and the VAE decoder as CUDA graphs, captured on first use
            per call signature and replayed after (:mod:`gn_patch.cuda_graphs`); replaces the graphs of an
            earlier call. False leaves graphs an earlier call installed as they are.
        max_graphs: with cuda_graph, call signatures kept per module (least recently used dropped beyond).
        **kwargs: passed to patch_model (``channels_last``: ``"activations"`` for FSDP2, ``channels_last_3d``).

    Returns:
        PatchReport of all components, module names prefixed by the component's name (``unet.conv_norm_out``);
        its ``cuda_graphs`` is the pipeline's live :class:`~gn_patch.cuda_graphs.CUDAGraphs` where it has graphs.

    Raises:
        TypeError: ``pipe`` has no ``components`` dict (a single model: use patch_model), or ``max_graphs`` is
            not an int.
        ValueError: cuda_graph with a component offloaded by accelerate hooks, ``max_graphs`` < 1, or a bad
            ``channels_last``; nothing is changed then.
    """
    _check_pipeline(pipe, "patch_pipeline")
    cuda_graphs.check_max_graphs(max_graphs)
    if cuda_graph:
        cuda_graphs.graph_targets(pipe)  # refuses an offloaded pipeline before anything is patched
    report = PatchReport()
    for name, component in pipe.components.items():
        if not isinstance(component, nn.Module) or not _holds_group_norm(component):
            continue
        if isinstance(component, PreTrainedModel):
            report.skipped.append((name, f"{type(component).__name__} is a transformers model: left alone"))
        else:
            report = report.merge(patch_model(component, **kwargs), prefix=name)
    report.cuda_graphs = (cuda_graphs.graph_pipeline(pipe, max_graphs=max_graphs) if cuda_graph
                          else cuda_graphs.pipeline_graphs(pipe))
    return report


def unpatch_pipeline(pipe) -> int:
    """:func:`~gn_patch.surgeon.unpatch_model` applied to every torch.nn.Module in ``pipe.components``, all checked
    before any is changed; the pipeline's CUDA graphs are released first.

    Returns:
        The number of GroupNorms turned back from GroupNormAct.

    Raises:
        TypeError: ``pipe`` has no ``components`` dict (a single model: use unpatch_model).
        ValueError: a component cannot be unpatched (unpatch_model's reasons, the module named with its
            component's prefix, ``unet.mid_block.resnets.0``); no component is changed then.
    """
    _check_pipeline(pipe, "unpatch_pipeline")
    modules = {name: c for name, c in pipe.components.items() if isinstance(c, nn.Module)}
    for name, component in modules.items():
        _check_unpatchable(component, prefix=name)
    cuda_graphs.release_graphs(pipe)
    return sum(_unpatch(component) for component in modules.values())
