"""CUDA graphs of a patched pipeline (gn_patch.cuda_graphs): call signatures, the least-recently-used bound, every
change of a model's state that must drop its graphs, the eager fallbacks, the live report, release, and the
txt2img example's graph and compile runs.

On the CPU the graph primitives are played by FakeBackend, which records captures and replays and, before each
replay, checks an independent record of the models against the one taken at capture: a stale replay fails the
test. The GPU tests (marked `gpu`) capture and replay real CUDA graphs and compare them with eager calls."""

from __future__ import annotations

import copy
import gc
import math
import warnings
import weakref
from itertools import chain
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from accelerate import cpu_offload_with_hook
from diffusers import ControlNetModel, DDIMScheduler, StableDiffusionControlNetPipeline
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.models.attention import BasicTransformerBlock
from diffusers.models.attention_processor import Attention, AttnProcessor
from diffusers.models.controlnets.multicontrolnet import MultiControlNetModel
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils import get_peft_model_state_dict
from torch import nn
from torch.utils._pytree import tree_flatten

from gn_patch import configs, cuda_graphs, surgeon
from gn_patch.cuda_graphs import CaptureError
from gn_patch.pipeline import patch_pipeline, unpatch_pipeline

from .test_pipeline import add_lora, generate, load_example, prompt_kwargs, tiny_sd_pipeline, tiny_text_encoder
from .tiny_models import (make_model, randn, rel_l2, sd15_unet_inputs, sdxl_unet_inputs, tiny_controlnet,
                          tiny_sd15_unet, tiny_sdxl_unet, tiny_vae)


# ------------------------------------------------------------------------------------------------
# The stand-in backend
# ------------------------------------------------------------------------------------------------
def model_record(model: nn.Module) -> list:
    """What a graph of ``model`` depends on, read independently of the fingerprint: every module (name, class,
    identity, hooks, wrapped forward), every weight and buffer (data pointer, dtype, shape), adapter, processor,
    FreeU and chunking settings, and the root's train mode."""
    record = []
    for name, module in model.named_modules():
        record.append((name, type(module), id(module), tuple(module._forward_hooks),
                       tuple(module._forward_pre_hooks), module.__dict__.get("forward") if name else None,
                       module.training if not name else None,
                       tuple(getattr(module, k, None) for k in ("s1", "s2", "b1", "b2"))))
        for key, tensor in chain(module._parameters.items(), module._buffers.items()):
            record.append((name, key, None if tensor is None else (tensor.data_ptr(), tensor.dtype, tensor.shape)))
        if isinstance(module, BaseTunerLayer):
            record.append((name, tuple(module.active_adapters), tuple(module.merged_adapters),
                           module.disable_adapters, {k: round(v, 6) for k, v in module.scaling.items()}))
        if isinstance(module, Attention):
            record.append((name, type(module.processor)))
        if isinstance(module, BasicTransformerBlock):
            record.append((name, module._chunk_size))
    return record


class FakeGraph:
    def __init__(self, run, outputs: list) -> None:
        self.run, self.outputs = run, outputs
        self.module = run.func.__self__.module  # run: GraphedForward.eager with the static arguments
        self.record = model_record(self.module)


class FakeBackend:
    """CUDAGraphBackend's stand-in on any device. A capture runs the forward twice (warm-up, capture), keeps the
    second output as the static outputs and returns the first as the call's result; a replay checks that the module
    is as it was at capture, runs the captured call again and writes its result into the static outputs. ``log``
    records captures and replays."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.graphs = weakref.WeakSet()  # graphs still held by a GraphedForward
        self.force_eager = False  # capturing() says True: every call runs eagerly
        self.fail_captures = False

    def supports(self, device: torch.device) -> bool:
        return True

    def capturing(self, device: torch.device) -> bool:
        return self.force_eager

    def capture(self, run, device: torch.device):
        result = run()
        if self.fail_captures:
            raise CaptureError("CUDA error: operation not permitted when stream is capturing")
        output = run()
        graph = FakeGraph(run, tree_flatten(output)[0])
        self.graphs.add(graph)
        self.log.append("capture")
        return graph, output, result

    def replay(self, graph: FakeGraph) -> None:
        assert model_record(graph.module) == graph.record, "stale replay: the module changed since the capture"
        for static, fresh in zip(graph.outputs, tree_flatten(graph.run())[0]):
            if isinstance(static, torch.Tensor):
                static.copy_(fresh)
        self.log.append("replay")

    def memory_bytes(self) -> int:
        return sum(t.nbytes for graph in self.graphs for t in graph.outputs if isinstance(t, torch.Tensor))


def graph_model(model: nn.Module, max_graphs: int = 8) -> tuple[cuda_graphs.GraphedForward, FakeBackend]:
    """Graph ``model`` as a pipeline's UNet would be, with a FakeBackend."""
    backend = FakeBackend()
    graphs = cuda_graphs.graph_pipeline(SimpleNamespace(components={"unet": model}), max_graphs=max_graphs,
                                        backend=backend)
    return graphs.modules["unet"], backend


def graph_pipe(pipe, **kwargs) -> tuple[cuda_graphs.CUDAGraphs, FakeBackend]:
    backend = FakeBackend()
    return cuda_graphs.graph_pipeline(pipe, backend=backend, **kwargs), backend


def patched_unet() -> nn.Module:
    unet = tiny_sd15_unet()
    surgeon.patch_model(unet)
    return unet


class Toy(nn.Module):
    """A linear map whose forward takes a tensor, a Python number and any extra argument; returns a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, scale: float = 1.0, extra=None) -> dict:
        return {"y": self.linear(x) * scale, "extra": extra}


# ------------------------------------------------------------------------------------------------
# Call signatures
# ------------------------------------------------------------------------------------------------
def signature(*args, **kwargs):
    tensors: list = []
    return cuda_graphs._signature((args, kwargs), tensors), tensors


X = randn(2, 4, 8, 8)
SIGNATURE_CHANGES = {  # case -> (call, call that must get another graph)
    "batch": ((X,), (X[:1],)),
    "dtype": ((X,), (X.double(),)),
    "strides": ((X,), (X.contiguous(memory_format=torch.channels_last),)),
    "python_number": ((X, 0.5), (X, 0.6)),
    "int_float_bool": ((X, 1), (X, 1.0)),
    "bool_int": ((X, True), (X, 1)),
    "none_or_tensor": ((X, None), (X, X)),
    "nested_dict_value": ((X, {"scale": 0.5}), (X, {"scale": 1.0})),
    "tuple_length": ((X, (X, X)), (X, (X,))),
    "tuple_or_list": ((X, (X,)), (X, [X])),
}


@pytest.mark.parametrize("case", SIGNATURE_CHANGES)
def test_signature_tells_calls_apart(case):
    first, second = SIGNATURE_CHANGES[case]
    assert signature(*first)[0] != signature(*second)[0]


def test_signature_ignores_tensor_values_and_collects_tensors_in_order():
    a, b, c = randn(2, 3), randn(2, 3, seed=1), randn(5)
    key, tensors = signature(a, cond={"text": b, "ids": (c, None)}, flag=False)
    assert key == signature(b, cond={"text": a, "ids": (c + 1, None)}, flag=False)[0]
    assert [t is u for t, u in zip(tensors, (a, b, c))] == [True] * 3 and len(tensors) == 3
    value = ((a,), {"cond": {"text": b, "ids": (c, None)}, "flag": False})
    rebuilt = cuda_graphs._rebuild(value, iter([c, a, b]))
    assert rebuilt[0][0] is c and rebuilt[1]["cond"]["text"] is a and rebuilt[1]["cond"]["ids"] == (b, None)


def test_unhashable_argument_runs_eagerly():
    toy = Toy()
    graphed, backend = graph_model(toy)
    with torch.no_grad(), pytest.warns(RuntimeWarning, match=r"unet runs without CUDA graphs: an argument is not "
                                                              r"hashable"):
        out = toy(randn(2, 4), extra={1, 2})
    assert out["extra"] == {1, 2} and backend.log == []
    assert list(graphed.eager_calls.values()) == [1]


# ------------------------------------------------------------------------------------------------
# Capture and replay
# ------------------------------------------------------------------------------------------------
def test_replay_returns_outputs_the_caller_owns():
    toy = Toy()
    graphed, backend = graph_model(toy)
    x, y = randn(3, 4), randn(3, 4, seed=1)
    with torch.no_grad():
        first = toy(x, 2.0, extra="kept")
        second = toy(y, 2.0, extra="kept")
        assert torch.equal(first["y"], graphed.eager(x, 2.0)["y"])  # not overwritten by the second replay
        assert torch.equal(second["y"], graphed.eager(y, 2.0)["y"]) and second["extra"] == "kept"
    static = backend.graphs.pop().outputs[0]
    assert static.data_ptr() not in (first["y"].data_ptr(), second["y"].data_ptr())
    assert backend.log == ["capture", "replay"] and (graphed.captures, graphed.replays) == (1, 1)


class PassThrough(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("unused", torch.zeros(()))  # places the module on a device

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x[0]


def test_outputs_aliasing_an_input_are_copies():
    """A forward that returns its input (or a view) returns a static input buffer: the caller gets copies."""
    module = PassThrough()
    graph = graph_model(module)[0]
    x, y = randn(2, 4), randn(2, 4, seed=1)
    with torch.no_grad():
        first = module(x)
        second = module(y)
    assert torch.equal(first[0], x) and torch.equal(first[1], x[0]) and torch.equal(second[0], y)
    assert graph.captures == 1 and graph.replays == 1


def test_unet_signature_changes_capture_once_each():
    """CFG on (batch 2) and off (batch 1), a LoRA scale and return_dict: one graph per signature, replays after."""
    unet = patched_unet()
    graphed, backend = graph_model(unet)
    calls = [sd15_unet_inputs(2), sd15_unet_inputs(1), dict(sd15_unet_inputs(2), return_dict=False),
             dict(sd15_unet_inputs(2), cross_attention_kwargs={"scale": 0.5})]
    with torch.no_grad():
        for _ in range(2):
            for inputs in calls:
                out = unet(**inputs)
                expected = graphed.eager(**inputs)
                assert type(out) is type(expected)
                assert torch.equal(out[0], expected[0])
    assert (graphed.captures, graphed.replays) == (4, 4) and backend.log.count("capture") == 4
    assert len(graphed.graphs) == 4 and "sample=(1, 4, 16, 16) float32" in " ".join(graphed.graphs)


def test_least_recently_used_graph_is_dropped():
    toy = Toy()
    graphed, backend = graph_model(toy, max_graphs=2)
    with torch.no_grad():
        toy(randn(1, 4))
        toy(randn(2, 4))
        toy(randn(1, 4))  # batch 1 is now the most recently used
        memory = backend.memory_bytes()
        with pytest.warns(RuntimeWarning, match="more call signatures than max_graphs=2"):
            toy(randn(3, 4))  # drops batch 2
        assert backend.memory_bytes() == memory - 2 * 4 * 4 + 3 * 4 * 4  # batch 2's outputs freed, batch 3's held
        toy(randn(1, 4))
        toy(randn(2, 4))  # recaptured, drops batch 3
    assert graphed.captures == 4 and len(graphed.graphs) == 2
    assert any("graph dropped (least recently used of 2): x=(2, 4) float32" in e for e in graphed._events)


def test_a_pool_without_live_graphs_is_replaced(monkeypatch):
    """CUDAGraphBackend shares a pool between live graphs only: a pool whose graphs are all gone is never captured
    into again (torch 2.11's allocator asserts then, as the H200 suite found after a recapture)."""
    handles = iter((0, n) for n in range(1, 100))  # as torch.cuda.graph_pool_handle, which CPU builds lack
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: next(handles))
    backend, device = cuda_graphs.CUDAGraphBackend(), torch.device("cuda", 0)
    first = backend._pool(device)
    graph = cuda_graphs._PooledGraph(object())
    backend._pool_graphs[device].add(graph)
    assert backend._pool(device) == first
    del graph
    gc.collect()
    second = backend._pool(device)
    assert second != first and backend._pool_ids == {tuple(first), tuple(second)}


def test_capture_failure_runs_that_signature_eagerly():
    toy = Toy()
    graphed, backend = graph_model(toy)
    backend.fail_captures = True
    with torch.no_grad():
        with pytest.warns(RuntimeWarning, match="capture failed: CUDA error: operation not permitted"):
            out = toy(randn(2, 4))
        assert torch.equal(out["y"], graphed.eager(randn(2, 4))["y"])
        toy(randn(2, 4))  # not retried
        backend.fail_captures = False
        toy(randn(3, 4))  # another signature captures
    assert graphed.captures == 1 and sum(graphed.eager_calls.values()) == 2


# ------------------------------------------------------------------------------------------------
# State changes: graphs dropped and recaptured
# ------------------------------------------------------------------------------------------------
def perturbed_state(model: nn.Module) -> dict:
    return {k: v + 0.01 * torch.randn_like(v) if v.is_floating_point() else v for k, v in model.state_dict().items()}


def set_chunking(unet: nn.Module) -> None:
    for module in unet.modules():
        if isinstance(module, BasicTransformerBlock):
            module.set_chunk_feed_forward(2, 1)


STATE_CHANGES = {  # case -> (setup before the first call or None, the change, text of the drop event)
    "weights_reassigned": (None, lambda u: setattr(u.conv_in.weight, "data", u.conv_in.weight.data * 1.5),
                           "weights or buffers moved"),
    "state_dict_assigned": (None, lambda u: u.load_state_dict(perturbed_state(u), assign=True),
                            "weights or buffers moved"),
    "parameter_replaced_in_dict": (None, lambda u: u.conv_in._parameters.__setitem__(
        "bias", nn.Parameter(u.conv_in.bias + 1)), "weights or buffers moved"),
    "lora_added": (None, add_lora, "modules added, replaced or removed"),
    "lora_disabled": (add_lora, lambda u: u.disable_adapters(), "adapter"),
    "lora_weight": (add_lora, lambda u: u.set_adapters(["default"], weights=[0.5]), "adapter"),
    "lora_fused": (add_lora, lambda u: u.fuse_lora(), "adapter"),
    "unpatched": (None, surgeon.unpatch_model, "module classes switched"),
    "attention_processor": (None, lambda u: u.set_attn_processor(AttnProcessor()), "attention processor"),
    "freeu": (None, lambda u: u.enable_freeu(s1=0.9, s2=0.2, b1=1.2, b2=1.4), "FreeU"),
    "chunking": (None, set_chunking, "settings changed"),
    "train_mode": (None, lambda u: u.train(), "train/eval mode"),
    "submodule_replaced": (None, lambda u: setattr(u, "conv_out", copy.deepcopy(u.conv_out)),
                           "modules added, replaced or removed"),
}


@pytest.mark.parametrize("case", STATE_CHANGES)
def test_state_change_drops_graphs(case):
    setup, change, what = STATE_CHANGES[case]
    unet = patched_unet()
    if setup is not None:
        setup(unet)
    graphed, backend = graph_model(unet)
    inputs = sd15_unet_inputs()
    with torch.no_grad():
        unet(**inputs)
        memory = backend.memory_bytes()
        change(unet)
        out = unet(**inputs).sample
        unet(**inputs)
        assert torch.equal(out, graphed.eager(**inputs).sample)
    assert backend.log == ["capture", "capture", "replay"]
    dropped = [e for e in graphed._events if "graph(s) dropped" in e]
    assert len(dropped) == 1 and what in dropped[0], dropped
    assert backend.memory_bytes() == memory  # the first graph is gone, the second holds as much


def test_in_place_weight_updates_keep_the_graphs():
    """load_state_dict copies into the weights: same addresses, which a replay reads (the GPU test checks values)."""
    unet = patched_unet()
    graphed, backend = graph_model(unet)
    inputs = sd15_unet_inputs()
    with torch.no_grad():
        before = unet(**inputs).sample
        unet.load_state_dict(perturbed_state(unet))
        after = unet(**inputs).sample
        assert torch.equal(after, graphed.eager(**inputs).sample) and rel_l2(after, before) > 1e-3
    assert backend.log == ["capture", "replay"]


def test_dtype_change_drops_graphs():
    unet = patched_unet()
    graphed, _ = graph_model(unet)
    with torch.no_grad():
        unet(**sd15_unet_inputs())
        unet.to(torch.float64)
        inputs = {k: v.double() if v.is_floating_point() else v for k, v in sd15_unet_inputs().items()}
        assert torch.equal(unet(**inputs).sample, graphed.eager(**inputs).sample)
    assert any("weight dtypes changed" in e for e in graphed._events) and len(graphed.graphs) == 1


def test_reset_drops_graphs():
    toy = Toy()
    graphed, backend = graph_model(toy)
    with torch.no_grad():
        toy(randn(2, 4))
        graphed.reset()
        toy(randn(2, 4))
    assert backend.log == ["capture", "capture"]


# ------------------------------------------------------------------------------------------------
# Eager fallbacks
# ------------------------------------------------------------------------------------------------
def test_hook_on_submodule_runs_eagerly_until_removed():
    unet = patched_unet()
    graphed, backend = graph_model(unet)
    seen = []
    inputs = sd15_unet_inputs()
    with torch.no_grad():
        unet(**inputs)
        handle = unet.mid_block.register_forward_hook(lambda module, args, output: seen.append(output.shape))
        with pytest.warns(RuntimeWarning, match="unet runs without CUDA graphs: forward hooks on mid_block would not "
                                                "run on replay"):
            unet(**inputs)
        unet(**inputs)
        assert len(seen) == 2 and graphed.eager_reason.startswith("forward hooks on mid_block")
        handle.remove()
        unet(**inputs)
    assert backend.log == ["capture", "capture"] and graphed.eager_reason is None
    assert any("graphs again" in e for e in graphed._events)


def test_hook_on_the_module_itself_keeps_the_graphs():
    """Hooks on the graphed module run around its forward, outside the graph."""
    unet = patched_unet()
    backend = graph_model(unet)[1]
    seen = []
    unet.register_forward_pre_hook(lambda module, args: seen.append(1))
    with torch.no_grad():
        unet(**sd15_unet_inputs())
        unet(**sd15_unet_inputs())
    assert len(seen) == 2 and backend.log == ["capture", "replay"]


def test_diffusers_hook_on_submodule_runs_eagerly():
    unet = patched_unet()
    backend = graph_model(unet)[1]
    registry = HookRegistry.check_if_exists_or_initialize(unet.down_blocks[0].resnets[0])
    registry.register_hook(ModelHook(), "noop")
    wrapped = r"wrapped forwards \(hooks\) of down_blocks\.0\.resnets\.0"
    with torch.no_grad(), pytest.warns(RuntimeWarning, match=wrapped):
        unet(**sd15_unet_inputs())
    registry.remove_hook("noop")  # leaves the block's bound class forward on the instance: harmless
    with torch.no_grad():
        unet(**sd15_unet_inputs())
    assert backend.log == ["capture"]


@pytest.mark.parametrize("context", ["grad_mode", "torch_compile", "enclosing_capture"])
def test_runs_eagerly_without_warning(context):
    unet = patched_unet()
    graphed, backend = graph_model(unet)
    inputs = sd15_unet_inputs()
    with torch.no_grad():
        expected = graphed.eager(**inputs).sample
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if context == "grad_mode":
            out = unet(**inputs).sample
            out.mean().backward()  # training works
            assert unet.conv_in.weight.grad is not None
        elif context == "torch_compile":
            torch._dynamo.reset()
            with torch.no_grad():
                out = torch.compile(unet, backend="eager", fullgraph=True)(**inputs).sample
            torch._dynamo.reset()
        else:
            backend.force_eager = True
            with torch.no_grad():
                out = unet(**inputs).sample
    assert rel_l2(out, expected) < 1e-6 and backend.log == []


def test_autocast_runs_eagerly():
    toy = Toy()
    backend = graph_model(toy)[1]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.warns(RuntimeWarning, match="autocast is enabled"):
            assert toy(randn(2, 4))["y"].dtype == torch.bfloat16
    assert backend.log == []


def test_offloaded_pipeline_is_refused_and_later_offloading_runs_eagerly():
    pipe = tiny_sd_pipeline()
    _, hook = cpu_offload_with_hook(pipe.unet, execution_device="cpu")
    types = {name: type(m) for name, m in pipe.unet.named_modules()}
    with pytest.raises(ValueError, match="cuda_graph=True: the pipeline's unet has accelerate hooks"):
        patch_pipeline(pipe, cuda_graph=True)
    assert {name: type(m) for name, m in pipe.unet.named_modules()} == types  # nothing patched
    hook.remove()
    patch_pipeline(pipe)
    graphs = graph_pipe(pipe)[0]
    cpu_offload_with_hook(pipe.vae, execution_device="cpu")  # enable_model_cpu_offload's hook, after graphing
    with pytest.warns(RuntimeWarning, match="vae.decoder runs without CUDA graphs: accelerate hooks"):
        generate(pipe)
    assert graphs.modules["vae.decoder"].captures == 0 and graphs.modules["unet"].captures == 1


def test_cpu_pipeline_with_the_cuda_backend_runs_eagerly():
    """patch_pipeline(cuda_graph=True) before pipe.to("cuda"): on the CPU, eager, with a warning per module."""
    reference = tiny_sd_pipeline()
    patch_pipeline(reference)
    expected = generate(reference)
    pipe = tiny_sd_pipeline()
    report = patch_pipeline(pipe, cuda_graph=True)
    with pytest.warns(RuntimeWarning, match="runs without CUDA graphs: weights on cpu"):
        images = generate(pipe)
    assert np.abs(images - expected).max() <= 1e-4
    assert {name: m.eager_reason for name, m in report.cuda_graphs.modules.items()} == {
        "unet": "weights on cpu", "vae.decoder": "weights on cpu"}
    assert "eager now: weights on cpu" in str(report)


# ------------------------------------------------------------------------------------------------
# Pipelines
# ------------------------------------------------------------------------------------------------
def eager_images(pipe, backend: FakeBackend, run=generate, **kwargs) -> np.ndarray:
    backend.force_eager = True
    try:
        return run(pipe, **kwargs)
    finally:
        backend.force_eager = False


def generate_without_cfg(pipe) -> np.ndarray:
    return pipe(**prompt_kwargs(), num_inference_steps=2, guidance_scale=1.0, height=32, width=32,
                generator=torch.Generator().manual_seed(0), output_type="np").images


@pytest.mark.parametrize("run", [generate, generate_without_cfg], ids=["cfg", "no_cfg"])
def test_sd_pipeline(run):
    pipe = tiny_sd_pipeline()
    patch_pipeline(pipe)
    graphs, backend = graph_pipe(pipe)
    expected = eager_images(pipe, backend, run)
    for _ in range(2):
        assert np.array_equal(run(pipe), expected)
    assert {name: m.captures for name, m in graphs.modules.items()} == {"unet": 1, "vae.decoder": 1}
    assert {name: m.replays for name, m in graphs.modules.items()} == {"unet": 3, "vae.decoder": 1}


def test_report_is_live_and_unpatch_releases():
    pipe = tiny_sd_pipeline()
    stock = generate(pipe)
    patch_pipeline(pipe)
    graphs, backend = graph_pipe(pipe)
    report = patch_pipeline(pipe)  # a plain patch keeps the graphs and reports them
    assert report.cuda_graphs is graphs
    assert str(report).endswith("CUDA graphs: 0 captured, 0.0 MiB in their memory pool, 0 replays\n"
                                "  unet: 0 graph(s) (0.00 s to capture), 0 replays, 0 eager calls\n"
                                "  vae.decoder: 0 graph(s) (0.00 s to capture), 0 replays, 0 eager calls")
    generate(pipe)
    text = str(report)
    assert "CUDA graphs: 2 captured" in text and "sample=(4, 4, 16, 16) float32, timestep=() int64" in text
    assert graphs.memory_bytes > 0
    unpatch_pipeline(pipe)
    assert graphs.released and str(graphs) == "CUDA graphs: released" and backend.memory_bytes() == 0
    assert "forward" not in pipe.unet.__dict__ and "forward" not in pipe.vae.decoder.__dict__
    assert cuda_graphs.pipeline_graphs(pipe) is None
    assert np.abs(generate(pipe) - stock).max() <= 1e-4 and backend.log.count("capture") == 2


def test_replaced_component_takes_its_graphs_along():
    """A component replaced in the pipeline and dropped is collected with its graphs (the report holds it weakly);
    the new one runs without graphs until patch_pipeline(pipe, cuda_graph=True) is called again."""
    pipe = tiny_sd_pipeline()
    patch_pipeline(pipe)
    graphs, backend = graph_pipe(pipe)
    generate(pipe)
    memory = backend.memory_bytes()
    pipe.unet = tiny_sd15_unet()
    gc.collect()
    assert list(graphs.modules) == ["vae.decoder"] and 0 < backend.memory_bytes() < memory
    assert "forward" not in pipe.unet.__dict__


def test_pipeline_lora_load_weight_fuse_unfuse_unload(tmp_path):
    source = tiny_sd15_unet()
    add_lora(source)
    from diffusers import StableDiffusionPipeline

    StableDiffusionPipeline.save_lora_weights(tmp_path, unet_lora_layers=get_peft_model_state_dict(source))
    pipe = tiny_sd_pipeline()
    patch_pipeline(pipe)
    graphs, backend = graph_pipe(pipe)
    unet = graphs.modules["unet"]
    without_lora = generate(pipe)
    steps = [lambda: pipe.load_lora_weights(tmp_path, adapter_name="tiny"),
             lambda: pipe.set_adapters(["tiny"], adapter_weights=[0.5]),
             lambda: pipe.fuse_lora(components=["unet"]),
             lambda: pipe.unfuse_lora(components=["unet"]),
             lambda: pipe.unload_lora_weights()]
    for step in steps:
        captures = unet.captures
        step()
        images = generate(pipe)
        assert unet.captures == captures + 1
        assert np.array_equal(images, eager_images(pipe, backend))
    assert np.abs(images - without_lora).max() <= 1e-4
    assert np.abs(generate(pipe, cross_attention_kwargs={"scale": 0.5}) - without_lora).max() <= 1e-4


def test_controlnet_pipeline_with_multi_controlnet():
    controlnet = MultiControlNetModel([tiny_controlnet(), make_model(ControlNetModel, configs.TINY_CONTROLNET,
                                                                     seed=1)])
    pipe = StableDiffusionControlNetPipeline(
        vae=tiny_vae(), text_encoder=tiny_text_encoder(), tokenizer=None, unet=tiny_sd15_unet(),
        controlnet=controlnet, scheduler=DDIMScheduler(**configs.SCHEDULER), safety_checker=None,
        feature_extractor=None, requires_safety_checker=False)
    patch_pipeline(pipe)
    graphs, backend = graph_pipe(pipe)
    images = [torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    controls = dict(image=images, controlnet_conditioning_scale=[0.6, 0.9])
    assert np.array_equal(generate(pipe, **controls), eager_images(pipe, backend, **controls))
    assert {name: m.captures for name, m in graphs.modules.items()} == {"unet": 1, "controlnet": 1,
                                                                       "vae.decoder": 1}
    assert "down_block_additional_residuals=[4 items]" in graphs.modules["unet"].graphs[0]


def test_sdxl_pipeline():
    example = load_example()
    pipe = example.random_pipeline("sdxl", True, 0, torch.device("cpu"))
    kwargs = example.random_prompt_kwargs("sdxl", True, 1, 0)
    patch_pipeline(pipe)
    graphs, backend = graph_pipe(pipe)

    def run():
        return pipe(**kwargs, num_inference_steps=2, height=32, width=32, generator=torch.Generator().manual_seed(0),
                    output_type="np").images

    backend.force_eager = True
    expected = run()
    backend.force_eager = False
    assert np.array_equal(run(), expected)
    assert "added_cond_kwargs={text_embeds: (2, 32) float32, time_ids: (2, 6) float32}" in \
        graphs.modules["unet"].graphs[0]


def test_deepcopy_of_a_graphed_module():
    toy = Toy()
    graphed = graph_model(toy)[0]
    twin = copy.deepcopy(toy)
    assert isinstance(twin.forward, cuda_graphs.GraphedForward) and twin.forward.module is twin
    with torch.no_grad():
        twin.linear.weight.mul_(2)
        assert torch.equal(twin(randn(2, 4))["y"], twin.forward.eager(randn(2, 4))["y"])
        assert not torch.equal(toy(randn(2, 4))["y"], twin(randn(2, 4))["y"])
    assert twin.forward.captures == 1 and graphed.captures == 1


# ------------------------------------------------------------------------------------------------
# examples/txt2img.py
# ------------------------------------------------------------------------------------------------
def test_txt2img_example_cuda_graph_and_compile_anchor(tmp_path, monkeypatch):
    example = load_example()
    monkeypatch.setattr(example, "COMPILE_OPTIONS", dict(backend="eager"))  # Inductor on the CPU takes minutes
    results = tmp_path / "results.json"
    result = example.main(["--tiny", "--device", "cpu", "--steps", "2", "--height", "32", "--width", "32",
                           "--cuda-graph", "--compile-anchor", "--output-dir", str(tmp_path), "--json", str(results)])
    torch._dynamo.reset()
    assert result["patched_graph_s"] > 0 and result["graph_capture_s"] > 0 and result["graph_memory_bytes"] == 0
    assert result["compile_anchor_s"] > 0 and result["compile_anchor_compile_s"] > 0
    # on the CPU the graph run is eager (weights on cpu), and torch.compile's eager backend computes as stock
    assert result["psnr_graph_vs_patched_db"] == math.inf and result["psnr_compile_anchor_vs_stock_db"] == math.inf
    assert result["psnr_graph_vs_stock_db"] == result["psnr_patched_vs_stock_db"] > 80
    assert result["psnr_graph_vs_fp32_db"] is None
    assert {p.name for p in tmp_path.glob("*.png")} == {f"{v}_0.png" for v in ("stock", "compiled", "patched",
                                                                                "graph")}
    assert "psnr_graph_vs_patched_db" in results.read_text()


# ------------------------------------------------------------------------------------------------
# GPU: real capture and replay
# ------------------------------------------------------------------------------------------------
DEVICE, DTYPE = torch.device("cuda"), torch.float16  # of the GPU tests' models and inputs


def cuda(inputs: dict) -> dict:
    """``inputs`` on DEVICE, floating-point tensors in DTYPE (nested dicts too)."""
    return {k: (v.to(DEVICE, DTYPE) if v.is_floating_point() else v.to(DEVICE)) if torch.is_tensor(v)
            else cuda(v) if isinstance(v, dict) else v for k, v in inputs.items()}


def cuda_unet(unet: nn.Module) -> tuple[nn.Module, cuda_graphs.GraphedForward, cuda_graphs.CUDAGraphs]:
    unet.to(DEVICE, DTYPE)
    surgeon.patch_model(unet)
    graphs = cuda_graphs.graph_pipeline(SimpleNamespace(components={"unet": unet}))
    return unet, graphs.modules["unet"], graphs


def assert_replay_equals_eager(unet, graphed, inputs: dict) -> torch.Tensor:
    """Two calls: the first captures where the signature or the module's state is new (and returns the warm-up
    call's output), the second replays; the replay equals an eager call."""
    unet(**inputs)
    replays = graphed.replays
    out = unet(**inputs).sample
    assert graphed.replays == replays + 1
    expected = graphed.eager(**inputs).sample
    assert rel_l2(out, expected) < 1e-3, f"replay differs from eager: relative L2 {rel_l2(out, expected):.3g}"
    return out


@pytest.mark.gpu
def test_unet_replays_equal_eager_across_signatures_cuda():
    unet, graphed, graphs = cuda_unet(tiny_sd15_unet())
    with torch.no_grad():
        for timestep in (10, 500):  # replays take new input values
            for batch in (2, 1):  # CFG on, off
                inputs = cuda(dict(sd15_unet_inputs(batch), timestep=torch.tensor(timestep)))
                assert_replay_equals_eager(unet, graphed, inputs)
        sdxl, sdxl_graphed, _ = cuda_unet(tiny_sdxl_unet())
        for batch in (2, 1):
            assert_replay_equals_eager(sdxl, sdxl_graphed, cuda(sdxl_unet_inputs(batch)))
    assert (graphed.captures, graphed.replays) == (2, 6) and (sdxl_graphed.captures, sdxl_graphed.replays) == (2, 2)
    assert graphs.memory_bytes > 0 and graphed.capture_seconds > 0 and graphed.eager_reason is None


@pytest.mark.gpu
def test_unet_lora_and_weight_changes_between_calls_cuda():
    unet, graphed, _ = cuda_unet(tiny_sd15_unet())
    inputs = cuda(sd15_unet_inputs())
    with torch.no_grad():
        without = assert_replay_equals_eager(unet, graphed, inputs)
        unet.load_state_dict(perturbed_state(unet))  # in place: replayed, not recaptured
        reloaded = assert_replay_equals_eager(unet, graphed, inputs)
        assert graphed.captures == 1 and rel_l2(reloaded, without) > 1e-3
        add_lora(unet)
        unet.to(DEVICE, DTYPE)
        with_lora = assert_replay_equals_eager(unet, graphed, inputs)
        assert rel_l2(with_lora, reloaded) > 1e-2
        scaled = assert_replay_equals_eager(unet, graphed, dict(inputs, cross_attention_kwargs={"scale": 0.5}))
        assert rel_l2(scaled, with_lora) > 1e-3
        unet.set_adapters(["default"], weights=[0.5])
        assert rel_l2(assert_replay_equals_eager(unet, graphed, inputs), scaled) < 1e-3
        unet.disable_adapters()
        assert rel_l2(assert_replay_equals_eager(unet, graphed, inputs), reloaded) < 1e-3
        unet.enable_adapters()
        unet.fuse_lora()
        assert rel_l2(assert_replay_equals_eager(unet, graphed, inputs), scaled) < 1e-2
    assert graphed.eager_reason is None and graphed.replays == 8 and graphed.captures == 6


def cuda_pipeline(case: str):
    """(pipeline in DTYPE on DEVICE, patched, call kwargs) for a GPU pipeline case."""
    example = load_example()
    if case == "sdxl":
        pipe = example.random_pipeline("sdxl", True, 0, DEVICE)
        kwargs = cuda(example.random_prompt_kwargs("sdxl", True, 1, 0))
    elif case == "controlnet":
        pipe = StableDiffusionControlNetPipeline(
            vae=tiny_vae(), text_encoder=tiny_text_encoder(), tokenizer=None, unet=tiny_sd15_unet(),
            controlnet=tiny_controlnet(), scheduler=DDIMScheduler(**configs.SCHEDULER), safety_checker=None,
            feature_extractor=None, requires_safety_checker=False)
        kwargs = dict(image=torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(0)))
    else:
        pipe = tiny_sd_pipeline()
        kwargs = {}
    if case != "sdxl":
        kwargs.update(cuda(prompt_kwargs()))
    kwargs["guidance_scale"] = 1.0 if case == "sd_no_cfg" else 5.0
    pipe.to(DEVICE, DTYPE)
    patch_pipeline(pipe)
    return pipe, kwargs


def run_cuda(pipe, kwargs: dict) -> np.ndarray:
    return pipe(**kwargs, num_inference_steps=3, height=32, width=32, output_type="np",
                generator=torch.Generator(DEVICE).manual_seed(0)).images


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["sd_cfg", "sd_no_cfg", "controlnet", "sdxl"])
def test_pipeline_graphs_equal_patched_eager_cuda(case):
    pipe, kwargs = cuda_pipeline(case)
    expected = run_cuda(pipe, kwargs)
    report = patch_pipeline(pipe, cuda_graph=True)
    first = run_cuda(pipe, kwargs)
    captures = {name: m.captures for name, m in report.cuda_graphs.modules.items()}
    second = run_cuda(pipe, kwargs)
    for images in (first, second):
        assert expected.std() > 0.05 and np.abs(images - expected).max() <= 2e-3
    graphed = report.cuda_graphs.modules
    assert captures["unet"] == 1 and graphed["unet"].captures == 1 and graphed["unet"].replays == 5
    if case == "controlnet":
        assert graphed["controlnet"].captures == 1 and graphed["controlnet"].replays == 5
    # SDXL casts the VAE to float32 around each decode (force_upcast): its decoder's weights may move
    assert graphed["vae.decoder"].captures == 1 or case == "sdxl"
    assert all(m.eager_reason is None and not m.eager_calls for m in graphed.values())
    assert report.cuda_graphs.memory_bytes > 0


@pytest.mark.gpu
def test_pipeline_moved_to_cpu_and_back_then_released_cuda():
    pipe, kwargs = cuda_pipeline("sd_cfg")
    expected = run_cuda(pipe, kwargs)
    graphs = patch_pipeline(pipe, cuda_graph=True).cuda_graphs
    run_cuda(pipe, kwargs)
    pipe.to("cpu")
    cpu_kwargs = {k: v.cpu().float() if torch.is_tensor(v) else v for k, v in kwargs.items()}
    pipe.to(torch.float32)
    with pytest.warns(RuntimeWarning, match="weights on cpu"):
        pipe(**cpu_kwargs, num_inference_steps=1, height=32, width=32, output_type="np")
    pipe.to(DEVICE, DTYPE)
    assert np.abs(run_cuda(pipe, kwargs) - expected).max() <= 2e-3
    assert graphs.modules["unet"].captures == 2 and graphs.memory_bytes > 0
    unpatch_pipeline(pipe)
    torch.cuda.empty_cache()
    assert graphs.released and graphs.memory_bytes == 0


@pytest.mark.gpu
def test_txt2img_example_cuda_graph_cuda(tmp_path):
    example = load_example()
    result = example.main(["--tiny", "--device", "cuda", "--steps", "3", "--height", "32", "--width", "32",
                           "--cuda-graph", "--output-dir", str(tmp_path)])
    assert result["psnr_graph_vs_patched_db"] >= 70 and result["graph_memory_bytes"] > 0
    assert result["patched_graph_s"] > 0 and result["graph_capture_s"] < 30
