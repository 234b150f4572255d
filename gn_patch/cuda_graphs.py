"""CUDA graphs for a pipeline's denoiser and VAE decoder: ``patch_pipeline(pipe, cuda_graph=True)``.

An eager SD1.5 UNet call spends more host time launching its ~1,500 kernels than the GPU spends running them. A
CUDA graph records the kernels of one call and launches them all again with one host call. A
:class:`GraphedForward` takes the place of a module's ``forward`` (as an instance attribute, like accelerate's
hooks):

* Each call signature (the containers of the arguments; shape, dtype, device and strides of every tensor; the value
  of every other argument) is captured on first use: one eager warm-up call on a side stream (its output is that
  call's result), then the capture, into one memory pool shared by every graph of the pipeline. Later calls with
  that signature copy their tensors into the graph's static input buffers, replay it and return copies of its
  static outputs: the caller owns them (the pipeline keeps latents across steps, and the next replay of any graph
  may overwrite the pool). At most ``max_graphs`` signatures per module are kept, the least recently used dropped.
* A replay is correct while the module computes what it computed at capture. A graph holds the addresses of the
  weights and the kernels the Python forward chose from the module's state then: in-place weight updates
  (``load_state_dict``, ``copy_``, ``.data.mul_``) keep the addresses and are seen by replays; anything else is
  not. So before each call a fingerprint of that state (see :class:`_Inventory`) is compared with the one the
  graphs were captured under; on a difference the graphs are dropped and recaptured on use, or the module runs
  eagerly, with a warning and a report entry, while its state makes graphs wrong (hooks on submodules,
  offloading hooks, weights off the GPU).
* Always eager: grad mode (training), autocast, torch.compile and jit tracing, an enclosing graph capture.

The graph primitives sit behind a small backend interface (:class:`CUDAGraphBackend`), so the signature,
invalidation and fallback logic runs on the CPU with a stand-in backend in the tests.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import time
import warnings
import weakref
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from itertools import chain, repeat
from operator import attrgetter, getitem
from typing import Any, NamedTuple

import torch
from diffusers.models.attention import BasicTransformerBlock
from diffusers.models.attention_processor import Attention
from torch import nn
from torch.nn.modules import module as _torch_module
from torch.utils._pytree import tree_flatten, tree_unflatten

from .rules.base import is_bound_class_forward

try:
    from peft.tuners.tuners_utils import BaseTunerLayer
except ImportError:  # peft is optional; without it no module is a peft adapter layer
    BaseTunerLayer = ()

__all__ = ["CUDAGraphBackend", "CUDAGraphs", "CaptureError", "GraphedForward", "graph_pipeline", "graph_targets",
           "pipeline_graphs", "release_graphs"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_GRAPHS = 8
MAX_EVENTS = 100
# Where graph_pipeline keeps a pipeline's CUDAGraphs (in the instance __dict__: DiffusionPipeline.__setattr__ would
# try to register a component).
_PIPELINE_ATTRIBUTE = "_gn_patch_cuda_graphs"


# ------------------------------------------------------------------------------------------------
# Backend: the graph primitives
# ------------------------------------------------------------------------------------------------
class CaptureError(RuntimeError):
    """The forward ran eagerly but could not be captured (e.g. it synchronizes with the host)."""


class CUDAGraphBackend:
    """torch.cuda.CUDAGraph capture and replay, the graphs of one device sharing one memory pool.

    The interface a stand-in implements (the CPU tests use one): ``supports(device)``, ``capturing(device)``,
    ``capture(run, device) -> (graph, static output, warm-up output)``, ``replay(graph)``, ``memory_bytes()``.
    """

    def __init__(self) -> None:
        self._pools: dict[torch.device, tuple] = {}
        self._pool_graphs: dict[torch.device, weakref.WeakSet] = {}  # the live graphs of each device's pool
        self._pool_ids: set[tuple] = set()  # every pool this backend captured into (memory_bytes)
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def supports(self, device: torch.device) -> bool:
        return device.type == "cuda"

    def capturing(self, device: torch.device) -> bool:
        """Whether the current stream is being captured (by the caller's own graph or torch.compile)."""
        return torch.cuda.is_current_stream_capturing()

    def capture(self, run: Callable[[], Any], device: torch.device) -> tuple[_PooledGraph, Any, Any]:
        """One eager warm-up call of ``run`` on a side stream (lazy initialisation, kernel builds and autotuning
        stay out of the graph), then its capture into the device's pool. Returns the graph, the output of the
        captured call (the graph's static outputs, whose values are those of the next replay) and the output of
        the warm-up call (the result of this call: no replay needed).

        Raises:
            CaptureError: the capture failed (the warm-up call's own errors propagate unchanged).
        """
        with torch.cuda.device(device):
            current = torch.cuda.current_stream()
            if device not in self._streams:
                self._streams[device] = torch.cuda.Stream()
            stream, pool = self._streams[device], self._pool(device)
            stream.wait_stream(current)  # the static inputs were written on the current stream
            with torch.cuda.stream(stream):
                result = run()
                graph = torch.cuda.CUDAGraph()
                # thread_local: CUDA calls of other threads (data loaders, ...) do not invalidate the capture
                graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                failure = None
                try:
                    output = run()
                except Exception as error:  # noqa: BLE001 - reported as a CaptureError below
                    failure = error
                try:
                    graph.capture_end()
                except RuntimeError as error:
                    failure = failure or error
            current.wait_stream(stream)
            for leaf in tree_flatten(result)[0]:  # the warm-up's output, made on the side stream, is used on this one
                if isinstance(leaf, torch.Tensor):
                    leaf.record_stream(current)
            torch.cuda.synchronize(device)  # the warm-up's GPU time counts in the capture time the report gives
        if failure is not None:
            raise CaptureError(f"{type(failure).__name__}: {failure}") from failure
        pooled = _PooledGraph(graph)
        self._pool_graphs[device].add(pooled)
        return pooled, output, result

    def _pool(self, device: torch.device) -> tuple:
        """The memory pool of the device's next capture. Once every graph of a pool is gone, PyTorch's caching
        allocator releases the pool lazily (when its memory is freed), and a capture that names it before then fails
        an internal assert (``use_count > 0``, seen with torch 2.11 after a recapture) and leaves the CUDA generator
        in capture mode: such a pool is replaced by a new one."""
        graphs = self._pool_graphs.setdefault(device, weakref.WeakSet())
        if device not in self._pools or not graphs:
            self._pools[device] = torch.cuda.graph_pool_handle()
            self._pool_ids.add(tuple(self._pools[device]))
        return self._pools[device]

    def replay(self, graph: _PooledGraph) -> None:
        graph.graph.replay()

    def memory_bytes(self) -> int:
        """Bytes of device memory reserved by the pools of this backend's graphs (a pool whose graphs are gone
        counts until PyTorch frees its memory)."""
        if not self._pool_ids:
            return 0
        return sum(segment["total_size"] for segment in torch.cuda.memory_snapshot()
                   if tuple(segment.get("segment_pool_id", ())) in self._pool_ids)


class _PooledGraph:
    """A captured torch.cuda.CUDAGraph, as the backend hands it out: its only owner, and weakly referenceable (the
    pybind class is not), so that the backend knows when no graph of a pool is left."""

    __slots__ = ("__weakref__", "graph")

    def __init__(self, graph: torch.cuda.CUDAGraph) -> None:
        self.graph = graph


def check_max_graphs(max_graphs) -> None:
    """Raises TypeError unless ``max_graphs`` is an int, ValueError unless it is at least 1."""
    if isinstance(max_graphs, bool) or not isinstance(max_graphs, int):
        raise TypeError(f"max_graphs must be an int, got {type(max_graphs).__name__}")
    if max_graphs < 1:
        raise ValueError(f"max_graphs must be at least 1, got {max_graphs}")


# ------------------------------------------------------------------------------------------------
# Call signatures
# ------------------------------------------------------------------------------------------------
def _signature(value: Any, tensors: list[torch.Tensor]) -> Hashable:
    """Hashable key of ``value`` (the arguments of a call); appends its tensors to ``tensors`` in a fixed order.

    Tensors are keyed by shape, dtype, device and strides; tuples, lists and dicts by their items; anything else by
    its type and value (a Python number is baked into the graph: a new value is a new signature).

    Raises:
        TypeError: a value that is not hashable.
    """
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return value.shape, value.dtype, value.device, value.stride()
    kind = type(value)
    if kind is tuple or kind is list:
        return kind, tuple([_signature(item, tensors) for item in value])
    if kind is dict:
        return kind, tuple([(name, _signature(item, tensors)) for name, item in value.items()])
    hash(value)
    return kind, value  # the type too: 1, 1.0 and True are equal as dict keys


def _rebuild(value: Any, tensors: Iterator[torch.Tensor]) -> Any:
    """``value`` with its tensors replaced, in :func:`_signature`'s order, by the next ones of ``tensors``."""
    if isinstance(value, torch.Tensor):
        return next(tensors)
    kind = type(value)
    if kind is tuple or kind is list:
        return kind([_rebuild(item, tensors) for item in value])
    if kind is dict:
        return {name: _rebuild(item, tensors) for name, item in value.items()}
    return value


def _without_aliases(output: Any, buffers: list[torch.Tensor]) -> Any:
    """``output`` with copies in place of the tensors that share memory with ``buffers`` (a forward that returns an
    input, or a view of one, returns a static input buffer, which the next replay overwrites)."""
    storages = {buffer.untyped_storage().data_ptr() for buffer in buffers}
    leaves, spec = tree_flatten(output)
    return tree_unflatten([leaf.clone() if isinstance(leaf, torch.Tensor)
                           and leaf.untyped_storage().data_ptr() in storages else leaf for leaf in leaves], spec)


def _describe(value: Any) -> str:
    """Short text of an argument for the report: tensors as shape and dtype."""
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if type(value) in (tuple, list):
        return f"[{len(value)} items]" if len(value) > 3 else f"[{', '.join(map(_describe, value))}]"
    if type(value) is dict:
        return "{" + ", ".join(f"{name}: {_describe(item)}" for name, item in value.items()) + "}"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _describe_call(forward: Callable, args: tuple, kwargs: dict) -> str:
    """``name=value`` for each argument that is not None, positional ones named from the forward's signature where
    it binds."""
    try:
        named = inspect.signature(forward).bind(*args, **kwargs).arguments
    except (TypeError, ValueError):
        named = {**{f"arg{i}": value for i, value in enumerate(args)}, **kwargs}
    return ", ".join(f"{name}={_describe(value)}" for name, value in named.items() if value is not None)


# ------------------------------------------------------------------------------------------------
# Module state: what a graph depends on beyond its arguments
# ------------------------------------------------------------------------------------------------
def _adapter_state(layer: nn.Module) -> Hashable:
    """A peft adapter layer (LoRA, ...): which adapters run, merged into the base weights or not, at what scale
    (set_adapters, fuse_lora/unfuse_lora, enable/disable). Scales are rounded: the UNet's forward multiplies them by
    a ``cross_attention_kwargs`` LoRA scale and divides them back, which can leave the last bit changed."""
    scaling = getattr(layer, "scaling", None) or {}
    return (tuple(layer.active_adapters), tuple(layer.merged_adapters), layer.disable_adapters,
            tuple((name, round(value, 9) if isinstance(value, float) else value) for name, value in scaling.items()))


def _processor_state(attention: Attention) -> Hashable:
    """An attention's processor: its class (set_attn_processor, fuse_qkv_projections, slicing, xformers) and its
    settings (a slice size; an IP-Adapter scale, which set_ip_adapter_scale changes on the processor)."""
    processor = attention.processor
    if isinstance(processor, nn.Module):  # IP-Adapter processors: weights in submodules, the scale an attribute
        scale = getattr(processor, "scale", None)
        return type(processor), tuple(scale) if isinstance(scale, list) else scale
    return type(processor), tuple(getattr(processor, "__dict__", {}).items())


def _chunking_state(block: BasicTransformerBlock) -> Hashable:
    """Feed-forward chunking (enable_forward_chunking)."""
    return block._chunk_size, block._chunk_dim


def _freeu_state(block: nn.Module) -> Hashable:
    """FreeU factors that enable_freeu/disable_freeu set on the UNet's up blocks."""
    return tuple(getattr(block, name, None) for name in ("s1", "s2", "b1", "b2"))


# class -> state of its instances that decides what their forward computes and is not in tensors or submodules
_STATE_RULES: tuple[tuple[type, Callable[[nn.Module], Hashable]], ...] = (
    (BaseTunerLayer, _adapter_state),
    (Attention, _processor_state),
    (BasicTransformerBlock, _chunking_state),
)

_DATA_PTR = torch.Tensor.data_ptr
_DTYPE = attrgetter("dtype")


def _root_hooks(instance_dict: dict) -> tuple[bool, bool]:
    """(accelerate hook, non-empty diffusers HookRegistry) on the module with this ``__dict__``."""
    registry = instance_dict.get("_diffusers_hook")
    return "_hf_hook" in instance_dict, bool(registry is not None and registry.hooks)


class _State(NamedTuple):
    """One fingerprint of a graphed module; each field names what changed when it differs."""

    structure: int  # bumped when the inventory is rebuilt: modules added, replaced or removed
    pointers: tuple | None  # data pointers of every weight and buffer; None: one has no storage
    dtypes: tuple
    classes: tuple
    hooks: bool
    forwards: tuple  # instance-level forwards of submodules (None where the class forward runs)
    global_hooks: bool
    wrappers: tuple  # accelerate/diffusers hooks on the module and on the pipeline component holding it
    training: bool
    settings: list  # _STATE_RULES and FreeU values


_CHANGES = {
    "structure": "modules added, replaced or removed (e.g. a LoRA adapter loaded or unloaded)",
    "pointers": "weights or buffers moved, replaced or reallocated (.to(), load_state_dict(assign=True), offloading)",
    "dtypes": "weight dtypes changed",
    "classes": "module classes switched (patch_model/unpatch_model)",
    "hooks": "forward hooks added or removed on submodules",
    "forwards": "forwards of submodules wrapped or unwrapped (hooks)",
    "global_hooks": "global module hooks added or removed",
    "wrappers": "accelerate or diffusers hooks added or removed",
    "training": "train/eval mode changed",
    "settings": "adapter, attention processor or FreeU settings changed (set_adapters, fuse_lora, "
                "set_attn_processor, enable_freeu, ...)",
}


def _what_changed(old: _State, new: _State) -> str:
    return "; ".join(_CHANGES[field] for field, a, b in zip(_State._fields, old, new) if a != b)


class _Inventory:
    """Flat lists of a module tree's containers, built once, from which a fingerprint is read per call.

    The fingerprint covers what a graph bakes in besides its arguments:

    * the tree: the identity of every submodule (peft adapters, fused QKV projections and IP-Adapter processors
      replace or add submodules), and every module's class (the surgeon switches classes);
    * every weight and buffer, read from the ``_parameters``/``_buffers`` dicts (so a Parameter replaced in
      place is seen): its data pointer (``.to()``, ``.data =``, offloading and assign-loading move it; in-place
      updates keep it, and replays see them) and its dtype (a cast may land a tensor of another dtype on the
      freed address);
    * hooks: forward (pre-)hooks and instance-level forwards of submodules, global module hooks (none of them would
      run on replay), accelerate/diffusers hooks on the module or the pipeline component holding it;
    * Python settings the forward reads: ``_STATE_RULES``, the FreeU factors of ``up_blocks``, ``training``.

    Anything else a forward reads from Python state is not seen: call :meth:`GraphedForward.reset` after changing it.
    """

    def __init__(self, root: nn.Module, owner: nn.Module) -> None:
        named = list(root.named_modules())
        self.root, self.owner = root, owner
        self.names = {id(module): name for name, module in named}
        modules = [module for _, module in named]
        self.child_dicts = [module._modules for module in modules]
        self.children = list(chain.from_iterable(map(dict.values, self.child_dicts)))
        entries = [(tensors, key) for module in modules for tensors in (module._parameters, module._buffers)
                   for key, value in tensors.items() if value is not None]
        self.tensor_dicts = [tensors for tensors, _ in entries]
        self.tensor_keys = [key for _, key in entries]
        self.submodules = modules[1:]
        self.hook_dicts = [hooks for module in self.submodules for hooks in (module._forward_hooks,
                                                                             module._forward_pre_hooks)]
        self.instance_dicts = [module.__dict__ for module in self.submodules]
        self.settings = [(rule, module) for module in modules for cls, rule in _STATE_RULES
                         if isinstance(module, cls)]
        up_blocks = getattr(root, "up_blocks", None)
        if isinstance(up_blocks, nn.ModuleList):
            self.settings += [(_freeu_state, block) for block in up_blocks]

    def fingerprint(self, structure: int) -> _State | None:
        """The module's state now; None when the tree or the set of weights changed (rebuild the inventory)."""
        children = list(chain.from_iterable(map(dict.values, self.child_dicts)))
        if children != self.children:  # by identity: modules do not define __eq__
            return None
        try:
            tensors = list(map(getitem, self.tensor_dicts, self.tensor_keys))
        except KeyError:
            return None
        try:
            pointers = tuple(map(_DATA_PTR, tensors))
        except TypeError:  # a weight set to None
            return None
        except RuntimeError:  # tensor subclasses without storage
            pointers = None
        return _State(
            structure, pointers, tuple(map(_DTYPE, tensors)), (type(self.root), *map(type, children)),
            any(self.hook_dicts), tuple(map(dict.get, self.instance_dicts, repeat("forward"))),
            bool(_torch_module._global_forward_hooks or _torch_module._global_forward_pre_hooks),
            _root_hooks(self.root.__dict__) + _root_hooks(self.owner.__dict__), self.root.training,
            [rule(module) for rule, module in self.settings])

    def diagnose(self, state: _State, backend) -> tuple[torch.device | None, str | None]:
        """(device of the weights, why the module must run eagerly, or None)."""
        if state.pointers is None:
            return None, "some weights have no storage (tensor subclasses): they cannot be captured"
        for instance_dict in (self.owner.__dict__, self.root.__dict__):
            accelerate, diffusers_hooks = _root_hooks(instance_dict)
            if accelerate:
                return None, ("accelerate hooks (enable_model_cpu_offload, enable_sequential_cpu_offload, "
                              "dispatch_model) move its weights between calls")
            if diffusers_hooks:
                return None, "diffusers hooks (group offloading, caches) run Python code on every call"
        hooked = [module for module in self.submodules if module._forward_hooks or module._forward_pre_hooks]
        wrapped = [module for module in self.submodules
                   if "forward" in module.__dict__ and not is_bound_class_forward(module.forward, module)]
        for modules, what in ((hooked, "forward hooks on"), (wrapped, "wrapped forwards (hooks) of")):
            if modules:
                names = ", ".join(self.names[id(m)] for m in modules[:3]) + (" ..." if len(modules) > 3 else "")
                return None, f"{what} {names} would not run on replay"
        if state.global_hooks:
            return None, "global module forward hooks would not run on replay"
        devices = {tensor.device for tensor in map(getitem, self.tensor_dicts, self.tensor_keys)}
        if len(devices) != 1:
            return None, f"weights on {', '.join(sorted(map(str, devices)))}" if devices else "no weights"
        device = devices.pop()
        if not backend.supports(device):
            return device, f"weights on {device}"
        return device, None


# ------------------------------------------------------------------------------------------------
# One module's graphs
# ------------------------------------------------------------------------------------------------
@dataclass
class _Graph:
    """A captured call: static input buffers, the graph, its static outputs and how to rebuild the output."""

    handle: Any
    inputs: list[torch.Tensor]
    outputs: list[Any]  # the output's leaves: static output tensors, and any constants
    spec: Any
    description: str
    seconds: float

    def replay(self, tensors: list[torch.Tensor], backend) -> Any:
        if tensors:
            torch._foreach_copy_(self.inputs, tensors)
        backend.replay(self.handle)
        return tree_unflatten([leaf.clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in self.outputs],
                              self.spec)


# Reasons to run eagerly that need no warning: expected, or outside gn_patch's hands.
_GRAD_MODE = "grad mode (training runs eagerly)"
_TRACING = "torch.compile or jit tracing"
_INSIDE_CAPTURE = "an enclosing CUDA graph capture"
_RELEASED = "graphs released (unpatch_pipeline)"
_SILENT = {_GRAD_MODE, _TRACING, _INSIDE_CAPTURE, _RELEASED}


class GraphedForward:
    """Stands in for ``module.forward``: replays a CUDA graph per call signature, captured on first use.

    Installed and released by :func:`graph_pipeline` / :func:`release_graphs`. Calls run the module's own forward
    (the class's, looked up per call, or the instance-level forward it replaced) where they cannot be replayed.

    Attributes (read-only):
        name: the module's name in the pipeline ("unet", "controlnet", "vae.decoder").
        captures, replays: counts since installation.
        eager_calls: Counter of eager calls by reason.
        eager_reason: why the module runs eagerly in its current state, or None.
    """

    __slots__ = ("__weakref__", "_backend", "_device", "_events", "_graphs", "_inventory", "_max_graphs", "_owner",
                 "_previous", "_state", "_structure", "_warned", "captures", "eager_calls", "eager_reason", "module",
                 "name", "released", "replays")

    def __init__(self, module: nn.Module, name: str, backend, max_graphs: int, events: deque,
                 owner: nn.Module | None = None) -> None:
        check_max_graphs(max_graphs)
        previous = module.__dict__.get("forward")
        self.module, self.name = module, name
        self.captures = self.replays = 0
        self.eager_calls: Counter = Counter()
        self.eager_reason: str | None = None
        self.released = False
        self._owner = owner if owner is not None else module
        self._backend, self._max_graphs, self._events = backend, max_graphs, events
        self._previous = None if previous is None or is_bound_class_forward(previous, module) else previous
        self._graphs: OrderedDict[Hashable, _Graph | str] = OrderedDict()  # signature -> graph, or eager reason
        self._inventory: _Inventory | None = None  # built on the first call
        self._structure = 0
        self._state: _State | None = None
        self._device: torch.device | None = None
        self._warned: set[str] = set()

    # -- the call ----------------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        reason = self._context_reason()
        if reason is None:
            inventory = self._inventory
            state = inventory.fingerprint(self._structure) if inventory is not None else None
            if state is None or state != self._state:
                self._state_changed(state)
            reason = self.eager_reason or self._call_reason()
        if reason is None:
            tensors: list[torch.Tensor] = []
            try:
                key = _signature(args, tensors), _signature(kwargs, tensors), torch.is_inference_mode_enabled()
            except TypeError as error:
                reason = f"an argument is not hashable ({error})"
            else:
                graph = self._graphs.get(key)
                if graph is None:
                    reason, output = self._capture(key, args, kwargs, tensors)
                    if reason is None:
                        return output
                else:
                    self._graphs.move_to_end(key)
                    if isinstance(graph, _Graph):
                        self.replays += 1
                        return graph.replay(tensors, self._backend)
                    reason = graph
        self.eager_calls[reason] += 1
        if reason not in _SILENT:
            self._warn_once(reason)
        return self.eager(*args, **kwargs)

    def eager(self, *args, **kwargs):
        """The module's own forward, without graphs."""
        if self._previous is not None:
            return self._previous(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def _context_reason(self) -> str | None:
        """Why this call runs eagerly whatever the module's state (cheap checks first)."""
        if self.released:
            return _RELEASED
        if torch.is_grad_enabled():
            return _GRAD_MODE
        if torch.compiler.is_compiling() or torch.jit.is_tracing():
            return _TRACING
        return None

    def _call_reason(self) -> str | None:
        device_type = self._device.type
        if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
            return "autocast is enabled (graphs would keep autocast's cached weight casts)"
        if self._backend.capturing(self._device):
            return _INSIDE_CAPTURE
        return None

    # -- state changes -----------------------------------------------------------------------------
    def _state_changed(self, state: _State | None) -> None:
        """Drop the graphs captured under the previous state; decide whether the new one allows graphs."""
        if state is None:
            self._structure += 1
            self._inventory = _Inventory(self.module, self._owner)
            state = self._inventory.fingerprint(self._structure)
        what = _what_changed(self._state, state) if self._state is not None else "state re-read"
        if self._graphs:
            self._event(f"{len(self._graphs)} graph(s) dropped, recaptured on next use: {what}")
            self._graphs.clear()
        self._state = state
        previous_reason = self.eager_reason
        self._device, self.eager_reason = self._inventory.diagnose(state, self._backend)
        if previous_reason is not None and self.eager_reason is None:
            self._event(f"graphs again: {what}")

    def reset(self) -> None:
        """Drop this module's graphs and re-read its state: for changes the fingerprint does not cover."""
        self._graphs.clear()
        self._state = self._inventory = None

    # -- capture -----------------------------------------------------------------------------------
    def _capture(self, key: Hashable, args: tuple, kwargs: dict,
                 tensors: list[torch.Tensor]) -> tuple[str | None, Any]:
        """Capture this call's signature. Returns (None, this call's output: the warm-up call's), or (why the
        signature runs eagerly, None)."""
        description = _describe_call(functools.partial(type(self.module).forward, self.module), args, kwargs)
        misplaced = sorted({str(t.device) for t in tensors if t.device != self._device})
        if misplaced:
            return self._remember(key, f"tensor arguments on {', '.join(misplaced)}, weights on {self._device}",
                                  description), None
        static = [torch.empty_like(tensor) for tensor in tensors]  # same strides for dense tensors
        if tensors:
            torch._foreach_copy_(static, tensors)
        static_tensors = iter(static)
        run = functools.partial(self.eager, *_rebuild(args, static_tensors), **_rebuild(kwargs, static_tensors))
        start = time.perf_counter()
        try:
            handle, static_output, output = self._backend.capture(run, self._device)
        except CaptureError as error:
            return self._remember(key, f"capture failed: {error}", description), None
        seconds = time.perf_counter() - start
        self.captures += 1
        outputs, spec = tree_flatten(static_output)
        self._event(f"captured {description} in {seconds:.2f} s")
        self._remember(key, _Graph(handle, static, outputs, spec, description, seconds), description)
        return None, _without_aliases(output, static)

    def _remember(self, key: Hashable, entry: _Graph | str, description: str) -> _Graph | str:
        """Keep ``entry`` (a graph, or why the signature runs eagerly) for ``key``, dropping the least recently used
        beyond max_graphs; returns it."""
        self._graphs[key] = entry
        if isinstance(entry, str):
            self._event(f"eager for {description}: {entry}")
        if len(self._graphs) > self._max_graphs:
            _, dropped = self._graphs.popitem(last=False)
            if isinstance(dropped, _Graph):
                self._event(f"graph dropped (least recently used of {self._max_graphs}): {dropped.description}")
                self._warn_once(f"more call signatures than max_graphs={self._max_graphs}, the least recently used "
                                "graphs are dropped and recaptured (a Python number that changes between calls, e.g. "
                                "a timestep, is part of the signature: pass a tensor)", eager=False)
        return entry

    # -- report ------------------------------------------------------------------------------------
    @property
    def graphs(self) -> list[str]:
        """Descriptions of the captured signatures, least recently used first."""
        return [graph.description for graph in self._graphs.values() if isinstance(graph, _Graph)]

    @property
    def capture_seconds(self) -> float:
        """Time spent capturing the graphs held now (warm-up calls included)."""
        return sum(graph.seconds for graph in self._graphs.values() if isinstance(graph, _Graph))

    def _event(self, message: str) -> None:
        self._events.append(f"{self.name}: {message}")
        logger.info("gn_patch: %s: %s", self.name, message)

    def _warn_once(self, reason: str, eager: bool = True) -> None:
        if reason in self._warned:
            return
        self._warned.add(reason)
        if eager:
            self._event(f"eager: {reason}")
        prefix = "runs without CUDA graphs: " if eager else ""
        warnings.warn(f"gn_patch: {self.name} {prefix}{reason}", RuntimeWarning, stacklevel=2)

    def release(self) -> None:
        """Drop the graphs and give the module its forward back (where nothing has wrapped this one since)."""
        self._graphs.clear()
        self.released = True
        if self.module.__dict__.get("forward") is self:
            if self._previous is None:
                del self.module.forward
            else:
                self.module.forward = self._previous
        self._event("released")

    def __deepcopy__(self, memo: dict) -> GraphedForward:
        """A copy of a graphed module is graphed too (no graphs yet, in no report)."""
        module = memo.get(id(self.module)) or copy.deepcopy(self.module, memo)
        owner = memo.get(id(self._owner), module)
        return GraphedForward(module, self.name, self._backend, self._max_graphs, deque(maxlen=MAX_EVENTS), owner)

    def __repr__(self) -> str:
        return f"GraphedForward({self.name}: {len(self.graphs)} graph(s), {self.replays} replays)"


# ------------------------------------------------------------------------------------------------
# A pipeline's graphs
# ------------------------------------------------------------------------------------------------
class CUDAGraphs:
    """The CUDA graphs of a pipeline, live (``patch_pipeline(pipe, cuda_graph=True).cuda_graphs``): what is
    captured, replayed and run eagerly, and the memory the graphs hold, as of now.

    Attributes:
        modules: name ("unet", "controlnet", "vae.decoder") -> its :class:`GraphedForward`, held weakly: a module
            replaced in the pipeline and dropped takes its graphs with it.
        events: the latest captures, drops, evictions, eager fallbacks and releases, oldest first (at most
            ``MAX_EVENTS``), e.g. ``"unet: captured sample=(2, 4, 64, 64) float16, ... in 0.41 s"``.
        released: whether :meth:`release` (unpatch_pipeline) ran.
    """

    def __init__(self, modules: dict[str, GraphedForward], backend, events: deque) -> None:
        self.modules: weakref.WeakValueDictionary[str, GraphedForward] = weakref.WeakValueDictionary(modules)
        self.events = events
        self.released = False
        self._backend = backend

    @property
    def memory_bytes(self) -> int:
        """Device memory reserved by the graphs' pool (0 for the CPU backend); after release, until
        torch.cuda.empty_cache() returns it."""
        return self._backend.memory_bytes()

    @property
    def capture_seconds(self) -> float:
        return sum(module.capture_seconds for module in self.modules.values())

    def reset(self) -> None:
        """Drop every graph and re-read the modules' state (see :meth:`GraphedForward.reset`)."""
        for module in list(self.modules.values()):
            module.reset()

    def release(self) -> None:
        for module in list(self.modules.values()):
            module.release()
        self.released = True

    def __str__(self) -> str:
        if self.released:
            return "CUDA graphs: released"
        modules = dict(self.modules)
        lines = [f"CUDA graphs: {sum(len(m.graphs) for m in modules.values())} captured, "
                 f"{self.memory_bytes / 2**20:.1f} MiB in their memory pool, "
                 f"{sum(m.replays for m in modules.values())} replays"]
        for name, module in modules.items():
            graphs = module.graphs
            lines.append(f"  {name}: {len(graphs)} graph(s) ({module.capture_seconds:.2f} s to capture), "
                         f"{module.replays} replays, {sum(module.eager_calls.values())} eager calls"
                         + (f"; eager now: {module.eager_reason}" if module.eager_reason else ""))
            lines += [f"    {description}" for description in graphs]
        if self.events:
            lines.append("  latest events:")
            lines += [f"    {event}" for event in list(self.events)[-10:]]
        return "\n".join(lines)


def graph_targets(pipe) -> dict[str, tuple[nn.Module, nn.Module]]:
    """The modules ``graph_pipeline`` graphs: name -> (module, the pipeline component holding it). The UNet and
    ControlNet components (their forward) and the VAE's decoder (what ``vae.decode`` runs, tile by tile or slice by
    slice when enabled).

    Raises:
        ValueError: a component is offloaded by accelerate hooks (enable_model_cpu_offload,
            enable_sequential_cpu_offload): offloading moves the weights between calls, which graphs cannot follow.
    """
    components = pipe.components
    targets = {name: (components[name], components[name]) for name in ("unet", "controlnet")
               if isinstance(components.get(name), nn.Module)}
    vae = components.get("vae")
    if isinstance(getattr(vae, "decoder", None), nn.Module):
        targets["vae.decoder"] = (vae.decoder, vae)
    for name, (_, component) in targets.items():
        offloaded = [module for module in component.modules() if "_hf_hook" in module.__dict__]
        if offloaded:
            raise ValueError(f"cuda_graph=True: the pipeline's {name.partition('.')[0]} has accelerate hooks "
                             "(enable_model_cpu_offload, enable_sequential_cpu_offload, dispatch_model), which move "
                             "weights between calls: CUDA graphs need them in place. Remove the offloading "
                             "(pipe.remove_all_hooks()) and move the pipeline to the GPU, or patch without cuda_graph")
    return targets


def graph_pipeline(pipe, *, max_graphs: int = DEFAULT_MAX_GRAPHS, backend=None) -> CUDAGraphs:
    """Install :class:`GraphedForward` on the modules of :func:`graph_targets` (replacing graphs an earlier call
    installed). Works before or after ``pipe.to("cuda")``: graphs are captured on the first call on the GPU.

    Args:
        pipe: a diffusers DiffusionPipeline.
        max_graphs: call signatures kept per module; the least recently used graph is dropped beyond.
        backend: the graph primitives (default: a new :class:`CUDAGraphBackend`, one memory pool per device).

    Returns:
        The pipeline's :class:`CUDAGraphs`, live.
    """
    targets = graph_targets(pipe)
    release_graphs(pipe)
    backend = backend if backend is not None else CUDAGraphBackend()
    events: deque = deque(maxlen=MAX_EVENTS)
    modules = {}
    for name, (module, owner) in targets.items():
        existing = module.__dict__.get("forward")
        if isinstance(existing, GraphedForward):  # graphed by another pipeline sharing this component
            existing.release()
        modules[name] = GraphedForward(module, name, backend, max_graphs, events, owner)
        module.forward = modules[name]
    graphs = CUDAGraphs(modules, backend, events)
    pipe.__dict__[_PIPELINE_ATTRIBUTE] = graphs
    return graphs


def pipeline_graphs(pipe) -> CUDAGraphs | None:
    """The pipeline's live :class:`CUDAGraphs`, or None if it has none installed."""
    return pipe.__dict__.get(_PIPELINE_ATTRIBUTE)


def release_graphs(pipe) -> bool:
    """Drop the pipeline's graphs and give its modules their forward back. Returns whether there were any."""
    graphs = pipe.__dict__.pop(_PIPELINE_ATTRIBUTE, None)
    if graphs is None:
        return False
    graphs.release()
    return True
