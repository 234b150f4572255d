"""The zoo test: every diffusers model class that holds a GroupNorm (tests/zoo.py), patched on the CPU as users run
it (conv weights made channels-last). Its outputs match stock (float32, 1e-5 relative L2), every GroupNorm is fused
by a rule that knows the code (none merely run alone, none left stock), checkpoints keep their keys and
unpatch_model restores stock; and the fused norms of the models that run channels-last end to end all get
channels-last input (else on CUDA they take PyTorch's path)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from gn_patch import GroupNormAct
from gn_patch.surgeon import patch_model, unpatch_model
from . import tiny_models
from .tiny_models import (KERNEL_OPS, CudnnConv3dLayout, assert_same_outputs, is_channels_last, make_model,
                          module_types, outputs, rel_l2)
from .zoo import ZOO, count_group_norms, inputs_on

# Cases whose GroupNorms do not all get channels-last input, and why (the README lists them). Kernels then run
# where they do; the others take PyTorch's path (same values).
LAYOUT_GAPS = {
    "UNet1DModel": "Conv1d has no channels-last layout: its (B, C, L) activations have channel stride L",
    "UNet2DModel-ncsnpp": "8 of 25 norms, after its skip blocks' FIR resampling, get NCHW input (not traced)",
    "UNetFlatConditionModel": "the 4 attention norms get Versatile Diffusion's (B, C, 4, 1) inputs as NCHW",
    "DreamLiteUNetModel": "16 of 22 norms get NCHW input on the CPU (not traced; its depthwise convolutions?)",
    "AutoencoderKLCosmos": "10 of 26 norms get NCDHW input (not traced)",
    "AutoencoderKLMochi": "4 of 23 norms, in the decoder, get NCDHW input (not traced)",
    "AutoencoderKLKVAEVideo": "all 22 norms get NCDHW input (not traced)",
    "AutoencoderKLAllegro": "2 of 72 norms get NCDHW input (not traced)",
    "AutoencoderKLHunyuanImage": "2 of 24 norms get NCHW input (not traced)",
}
# Cases that run blocks on the test's own NCHW inputs (in a model they get a convolution's output), or whose
# norms are no GroupNormAct modules (MiniMax's per-frame norm applies the op inside its own forward).
NOT_LAYOUT_CASES = {"Transformer2DModel", "DreamLiteTransformer2DModel", "TransformerTemporalModel", "MotionAdapter",
                    "ControlNetXSAdapter", "AutoencoderKLMiniMaxH3"}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These tiny models run in milliseconds on one thread; more threads only contend (on a busy 2-core CI
    machine, 10x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name", ZOO)
def test_zoo_model_is_fused_and_matches_stock(name):
    case = ZOO[name]
    model = case.build()
    with torch.no_grad():
        expected = case.run(model)
    patched = copy.deepcopy(model)
    report = patch_model(patched)
    with torch.no_grad():
        actual = case.run(patched)
    assert_same_outputs(actual, expected, tol=1e-5)
    total = count_group_norms(model)
    assert len(report.patched) == total, (f"{len(report.patched)} of {total} GroupNorms fused; run alone: "
                                          f"{report.alone[:3]}; skipped: {report.skipped[:3]}")
    assert report.alone == [] and report.skipped == []
    assert list(patched.state_dict()) == list(model.state_dict())
    unpatch_model(patched)
    assert module_types(patched) == module_types(model)


def _layout_checked(name: str) -> bool:
    """Neither the case nor its class (``UNet1DModel`` for ``UNet1DModel-rl``) is exempt from the layout check."""
    return not {name, name.partition("-")[0]} & (NOT_LAYOUT_CASES | set(LAYOUT_GAPS))


# Models in which an op returns NCHW activations (resampling through reshapes or 5-D interpolation): with
# channels_last="activations" the norms after it get NCHW input (PyTorch's path on CUDA, exact); only channels_last
# conv weights bring the layout back after it.
ACTIVATIONS_LAYOUT_GAPS = {"AutoencoderKLCogVideoX", "AutoencoderKLHunyuanVideo", "AutoencoderKLMagvit",
                           "LTXLatentUpsamplerModel", "LTX2LatentUpsamplerModel"}


def _layout_cases():
    for name in filter(_layout_checked, ZOO):
        yield pytest.param(name, True, id=f"{name}-weights")
        gap = pytest.mark.xfail(strict=True, reason="NCHW after an op inside; see ACTIVATIONS_LAYOUT_GAPS")
        yield pytest.param(name, "activations", id=f"{name}-activations",
                           marks=gap if name in ACTIVATIONS_LAYOUT_GAPS else ())


@pytest.mark.parametrize("name,channels_last", list(_layout_cases()))
def test_zoo_model_runs_channels_last(name, channels_last):
    """With cuDNN's convolution layouts (CudnnConv3dLayout), every fused norm gets channels-last input: from the
    channels_last conv weights, or (channels_last="activations", for FSDP2) from the inputs alone."""
    case = ZOO[name]
    model = case.build()
    patch_model(model, channels_last=channels_last)
    names = {module: name for name, module in model.named_modules()}
    layouts = {}

    def record(module, args):
        layouts[names[module]] = layouts.get(names[module], True) and is_channels_last(args[0])

    handles = [m.register_forward_pre_hook(record) for m in model.modules() if isinstance(m, GroupNormAct)]
    with torch.no_grad(), CudnnConv3dLayout():
        case.run(model)
    for handle in handles:
        handle.remove()
    assert layouts and all(layouts.values()), [n for n, ok in layouts.items() if not ok]


# Models whose norms all get channels-last input but in which an elementwise op still adds a channels-last tensor
# to an NCHW one of the same shape (PyTorch then runs its slow strided kernel), and where.
MIXED_LAYOUT_GAPS = {
    "AutoencoderKLKVAE": "the pixel-shuffle shortcut of its resampling returns NCHW (conv_out + pxs_out)",
    "ConsistencyDecoderVAE": "its scheduler step mixes the UNet's channels-last output with the NCHW latent",
}


class MixedLayouts(TorchDispatchMode):
    """Records the elementwise ATen ops whose 4-D/5-D tensor operands of one shape come in both the standard and the
    channels-last layout (neither ambiguous): ``hits[(op, shape)] = count``."""

    OPS = frozenset({"add", "sub", "mul", "div", "addcmul", "addcdiv", "where", "add_", "sub_", "mul_", "div_",
                     "copy_"})

    def __init__(self) -> None:
        super().__init__()
        self.hits: dict[tuple[str, tuple[int, ...]], int] = {}

    @staticmethod
    def _layout(t: torch.Tensor) -> str:
        channels_last = t.is_contiguous(memory_format=torch.channels_last if t.dim() == 4 else torch.channels_last_3d)
        return {(True, False): "standard", (False, True): "channels_last"}.get((t.is_contiguous(), channels_last),
                                                                                "other")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.OPS:
            tensors = [a for a in args if isinstance(a, torch.Tensor) and a.dim() in (4, 5)]
            if len(tensors) > 1 and all(t.shape == tensors[0].shape for t in tensors):
                if {"standard", "channels_last"} <= {self._layout(t) for t in tensors}:
                    key = (func.overloadpacket.__name__, tuple(tensors[0].shape))
                    self.hits[key] = self.hits.get(key, 0) + 1
        return func(*args, **(kwargs or {}))


def _mixed_layout_cases():
    for name in filter(_layout_checked, ZOO):
        gap = pytest.mark.xfail(strict=True, reason=MIXED_LAYOUT_GAPS.get(name, ""))
        yield pytest.param(name, marks=gap if name in MIXED_LAYOUT_GAPS else ())


@pytest.mark.parametrize("name", list(_mixed_layout_cases()))
def test_zoo_model_elementwise_ops_keep_one_layout(name, kernel_path_on_cpu):
    """With cuDNN's convolution layouts, no elementwise op of a patched model mixes channels-last and NCHW operands
    of one shape: where one did, PyTorch ran it with its strided kernel (CogVideoX's spatial norms spent 220 ms per
    decode so on the H200 before their latent took f's layout)."""
    case = ZOO[name]
    model = case.build()
    patch_model(model)
    decoder = getattr(model, "decoder", None)
    if isinstance(decoder, torch.nn.Module):  # latents reach a VAE's decoder NCHW/NCDHW, as from a pipeline
        decoder.register_forward_pre_hook(lambda _, args: tuple(
            a.contiguous() if isinstance(a, torch.Tensor) else a for a in args))
    mixed = MixedLayouts()
    with torch.no_grad(), CudnnConv3dLayout(), mixed:
        case.run(model)
    assert mixed.hits == {}


# ------------------------------------------------------------------------------------------------
# CUDA: half precision, channels-last, the kernels (run on the H200)
# ------------------------------------------------------------------------------------------------
def _tensors(result) -> list[torch.Tensor]:
    return [t.double() for t in outputs(result)]


def _relative_errors(actual: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """The largest relative L2 error over the tensors."""
    return max(rel_l2(a, r) for a, r in zip(actual, reference))


class KernelCalls:
    """Counts, inside the ``with`` block, the calls of the kernels' ops (KERNEL_OPS, seen by the
    profiler, whatever dispatches it) and the GroupNormAct calls the kernels must take: channels-last CUDA input
    of a kernel dtype, weights of that dtype or float32."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.required = 0
        self.profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])

    def _record(self, module, args):
        x = args[0]
        kernel_dtypes = x.dtype in (torch.float16, torch.bfloat16, torch.float32) and (
            module.weight is None or module.weight.dtype in (x.dtype, torch.float32))
        self.required += x.is_cuda and kernel_dtypes and is_channels_last(x)

    def __enter__(self):
        self.handles = [m.register_forward_pre_hook(self._record)
                        for m in self.model.modules() if isinstance(m, GroupNormAct)]
        self.profile.__enter__()
        return self

    def __exit__(self, *exc):
        self.profile.__exit__(*exc)
        for handle in self.handles:
            handle.remove()

    @property
    def kernel_ops(self) -> int:
        return sum(event.name in KERNEL_OPS for event in self.profile.events())


@pytest.fixture
def no_tf32():
    """cuDNN convolutions without TF32 while the test runs."""
    with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=False, allow_tf32=False):
        yield


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ZOO)
def test_zoo_model_half_precision_cuda(name, dtype, no_tf32):
    """Patched fp16/bf16 outputs on CUDA are as close to the float64 stock outputs as stock fp16/bf16 are (1.5x and
    slack for one rounding), and every GroupNormAct call the kernels take does take them."""
    case = ZOO[name]
    model = case.build().cuda()
    with torch.no_grad():
        with inputs_on("cuda", torch.float64):
            reference = _tensors(case.run(model.double()))
        model.to(dtype)
        with inputs_on("cuda", dtype):
            stock = _tensors(case.run(model))
            report = patch_model(model)
            with KernelCalls(model) as calls:
                patched = _tensors(case.run(model))
    assert report.alone == [] and report.skipped == []
    assert all(torch.isfinite(t).all() for t in patched)
    stock_error, patched_error = _relative_errors(stock, reference), _relative_errors(patched, reference)
    assert patched_error <= 1.5 * stock_error + 2e-3, (patched_error, stock_error)
    assert calls.kernel_ops >= calls.required, (calls.kernel_ops, calls.required)


def _block_cases():
    """Blocks whose fused paths the zoo's models take, with channels-last CUDA inputs: (module, inputs, output)."""
    from diffusers.models.attention_processor import SpatialNorm
    from diffusers.models.autoencoders.autoencoder_kl_cogvideox import CogVideoXResnetBlock3D, CogVideoXSpatialNorm3D
    from diffusers.models.autoencoders.autoencoder_kl_cosmos import CosmosResnetBlock3d
    from diffusers.models.autoencoders.autoencoder_kl_hunyuan_video import HunyuanVideoResnetBlockCausal3D
    from diffusers.models.autoencoders.autoencoder_kl_mochi import MochiResnetBlock3D
    from diffusers.models.resnet import Conv1dBlock, ResnetBlock2D
    from diffusers.models.unets.unet_kandinsky3 import Kandinsky3Block

    def video(*shape):
        return (tiny_models.randn(*shape).to(memory_format=torch.channels_last_3d),)

    return {
        # 5-D: the causal convolutions pad the frames; norm1 -> SiLU, norm2 -> SiLU fused
        "cogvideox_resnet_5d": (CogVideoXResnetBlock3D, dict(in_channels=64, out_channels=64, temb_channels=0),
                                video(2, 64, 5, 16, 16), lambda out: out[0]),
        "hunyuanvideo_resnet_5d": (HunyuanVideoResnetBlockCausal3D, dict(in_channels=64, out_channels=128),
                                   video(1, 64, 5, 16, 16), lambda out: out),
        # spatial norms: norm_f * conv_y(zq) + conv_b(zq), the interpolated latent zq made channels-last like f
        # (CogVideoX: an odd frame count interpolates the first frame apart)
        "cogvideox_spatial_norm_5d": (CogVideoXSpatialNorm3D, dict(f_channels=64, zq_channels=16),
                                      (video(1, 64, 5, 16, 16)[0], tiny_models.randn(1, 16, 3, 4, 4, seed=1)),
                                      lambda out: out[0]),
        "movq_spatial_norm": (SpatialNorm, dict(f_channels=64, zq_channels=16),
                              (tiny_models.randn(2, 64, 16, 16).to(memory_format=torch.channels_last),
                               tiny_models.randn(2, 16, 4, 4, seed=1)), lambda out: out),
        # Mochi's chunked GroupNorm: 10 frames make two chunks of (up to) 8
        "mochi_resnet_chunked": (MochiResnetBlock3D, dict(in_channels=64), video(1, 64, 10, 8, 8),
                                 lambda out: out[0]),
        # Cosmos's causal GroupNorm folds the frames into the batch (num_groups=1)
        "cosmos_resnet_causal": (CosmosResnetBlock3d, dict(in_channels=64, out_channels=64, dropout=0.0,
                                                           num_groups=1), video(1, 64, 3, 16, 16), lambda out: out),
        # per-sample scale/shift: the timestep's, and Kandinsky 3's conditional GroupNorm
        "scale_shift_resnet": (ResnetBlock2D, dict(in_channels=64, temb_channels=32, time_embedding_norm="scale_shift"),
                               (tiny_models.randn(2, 64, 16, 16).to(memory_format=torch.channels_last),
                                tiny_models.randn(2, 32, seed=1)), lambda out: out),
        "kandinsky3_conditional": (Kandinsky3Block, dict(in_channels=64, out_channels=64, time_embed_dim=32),
                                   (tiny_models.randn(2, 64, 16, 16).to(memory_format=torch.channels_last),
                                    tiny_models.randn(2, 32, seed=1)), lambda out: out),
        # Mish on the (B, C, 1, L) view of a 1-D block
        "conv1d_mish": (Conv1dBlock, dict(inp_channels=32, out_channels=64, kernel_size=5),
                        (tiny_models.randn(2, 32, 64),), lambda out: out),
    }


BLOCK_CASES = ("cogvideox_resnet_5d", "hunyuanvideo_resnet_5d", "cogvideox_spatial_norm_5d", "movq_spatial_norm",
               "mochi_resnet_chunked", "cosmos_resnet_causal",
               "scale_shift_resnet", "kandinsky3_conditional", "conv1d_mish")


def _forward_backward(module, inputs, output_of, dtype, device):
    """The output and the gradients (inputs, then parameters) of sum(output * g) for a fixed random g, in float64.
    Inputs keep their layout."""
    inputs = [x.detach().to(device=device, dtype=dtype).requires_grad_(True) for x in inputs]
    module.zero_grad(set_to_none=True)
    out = output_of(module(*inputs))
    weight = tiny_models.randn(*out.shape, seed=7).to(device=device, dtype=out.dtype)
    (out * weight).sum().backward()
    return [out.double()] + [x.grad.double() for x in inputs] + [p.grad.double() for p in module.parameters()
                                                                 if p.grad is not None]


def test_fused_block_gradients_match_stock():
    """On the CPU (PyTorch's path), each block's output and gradients after patching equal stock's (float32)."""
    for case, (cls, config, inputs, output_of) in _block_cases().items():
        module = make_model(cls, config).train()
        expected = _forward_backward(module, [x.contiguous() for x in inputs], output_of, torch.float32, "cpu")
        patch_model(module)
        actual = _forward_backward(module, inputs, output_of, torch.float32, "cpu")
        for index, (a, e) in enumerate(zip(actual, expected)):
            assert rel_l2(a, e) <= 1e-5, (case, index, rel_l2(a, e))


def _conv_input(conv: torch.nn.Module, module: torch.nn.Module, *args) -> torch.Tensor:
    """The input ``conv`` receives while ``module(*args)`` runs."""
    seen = []
    handle = conv.register_forward_pre_hook(lambda _, inputs: seen.append(inputs[0]))
    try:
        module(*args)
    finally:
        handle.remove()
    return seen[0]


def test_video_vae_layout_edits_keep_channels_last():
    """What keeps the video VAEs NDHWC end to end: a spatial norm hands conv_y the interpolated latent in f's
    channels-last layout (its 1x1 convs follow their input's layout), and HunyuanVideo's causal convolution pads
    channels_last_3d input into that layout, bitwise F.pad(mode="replicate"); NCDHW input keeps stock's path."""
    from diffusers.models.attention_processor import SpatialNorm
    from diffusers.models.autoencoders.autoencoder_kl_cogvideox import CogVideoXSpatialNorm3D
    from diffusers.models.autoencoders.autoencoder_kl_hunyuan_video import HunyuanVideoCausalConv3d

    for cls, f, memory_format, conv_y in (
            (CogVideoXSpatialNorm3D, tiny_models.randn(1, 64, 4, 8, 8), torch.channels_last_3d,
             lambda m: m.conv_y.conv),
            (SpatialNorm, tiny_models.randn(1, 64, 8, 8), torch.channels_last, lambda m: m.conv_y)):
        norm = make_model(cls, dict(f_channels=64, zq_channels=16))
        zq = tiny_models.randn(*f.shape[:1], 16, *f.shape[2:-2], 4, 4, seed=1)
        patch_model(norm)
        for layout in (memory_format, torch.contiguous_format):
            latent = _conv_input(conv_y(norm), norm, f.contiguous(memory_format=layout), zq)
            assert latent.is_contiguous(memory_format=layout), (cls.__name__, layout)

    conv = make_model(HunyuanVideoCausalConv3d, dict(in_channels=8, out_channels=8, kernel_size=3))
    patch_model(conv)
    x = tiny_models.randn(1, 8, 3, 5, 6)
    for layout in (torch.channels_last_3d, torch.contiguous_format):
        padded = _conv_input(conv.conv, conv, x.contiguous(memory_format=layout))
        assert padded.is_contiguous(memory_format=layout)
        assert torch.equal(padded, F.pad(x, conv.time_causal_padding, mode="replicate"))
    unpatch_model(conv)
    assert type(conv) is HunyuanVideoCausalConv3d


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", BLOCK_CASES)
def test_fused_block_forward_backward_cuda(case, dtype, no_tf32):
    """Patched blocks in fp16/bf16 on channels-last CUDA input: output and gradients (input, weights) as close to
    float64 stock as stock fp16/bf16's, every GroupNormAct call the kernels take taking them."""
    cls, config, inputs, output_of = _block_cases()[case]
    module = make_model(cls, config).cuda().train()
    reference = _forward_backward(module.double(), inputs, output_of, torch.float64, "cuda")
    module.to(dtype)
    stock = _forward_backward(module, [x.contiguous() for x in inputs], output_of, dtype, "cuda")
    report = patch_model(module)
    assert report.patched and report.alone == [] and report.skipped == []
    with KernelCalls(module) as calls:
        patched = _forward_backward(module, inputs, output_of, dtype, "cuda")
    assert calls.kernel_ops >= calls.required, (calls.kernel_ops, calls.required)
    for index, (p, s, r) in enumerate(zip(patched, stock, reference)):
        assert torch.isfinite(p).all()
        stock_error, patched_error = rel_l2(s, r), rel_l2(p, r)
        assert patched_error <= 1.5 * stock_error + 2e-3, (index, patched_error, stock_error)
