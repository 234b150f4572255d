"""GPU tests of the CUDA kernels against the float64 reference: forward, every gradient, all dtypes and
activations, the shape families the kernels must cover, and composability (compile, CUDA graphs).

Outputs are NaN-poisoned before every call (see `poisoned`), inputs are random (3 * randn + 1)."""

import math

import pytest
import torch
import torch.nn.functional as F

import gn_patch
import gn_patch.extension
from gn_patch.ops import ACTIVATIONS

from .conftest import TOLERANCES
from .reference import assert_close, reference, reference_grads, random_input

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def kernels():
    """Build/load the extension once; direct torch.ops calls need its CUDA kernels registered."""
    assert gn_patch.extension.kernels_available(), "the CUDA extension failed to build or load"
OP = torch.ops.gn_patch.group_norm_act.default
ACTS = sorted(ACTIVATIONS)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# (shape, num_groups): each names the case it covers.
CASES = {
    "sd_resnet": ((2, 320, 16, 16), 32),
    "split_rows": ((1, 256, 96, 96), 32),                 # few images, many rows: split geometry
    "split_many_channels": ((1, 1280, 40, 40), 32),      # several tiles per row
    "group_size_1": ((2, 64, 6, 6), 64),                  # G == C
    "single_group": ((2, 64, 9, 9), 1),                   # G == 1
    "single_group_wide": ((1, 4096, 20, 20), 1),          # group wider than a block: unaligned tiles
    "group_size_3": ((2, 96, 7, 9), 32),
    "group_size_5": ((2, 160, 5, 5), 32),
    "group_size_7": ((2, 56, 11, 3), 8),
    "prime_group_size_131": ((1, 1048, 9, 9), 8),         # lcm(131, 8) channels per aligned tile
    "odd_channels_scalar_path": ((2, 262, 9, 9), 2),      # C not a multiple of the vector width
    "hw_1": ((4, 320, 1, 1), 32),
    "hw_not_multiple_of_8": ((2, 64, 7, 7), 32),
    "rank2": ((8, 64), 16),
    "rank3_transposed": ((2, 512, 77), 32),               # diffusers attention's (B, C, HW) view
    "rank5": ((1, 64, 3, 8, 8), 32),
    "many_images": ((513, 32, 3, 3), 8),
    # Forward cluster geometry on sm_90 (clusters of 4 or 8 blocks sharing statistics through DSMEM):
    "cluster_sd_resnet": ((2, 320, 32, 32), 32),
    "cluster_vae": ((1, 512, 64, 64), 32),
    "cluster_rows_not_multiple": ((3, 96, 30, 50), 32),   # last split's rows partial
    "cluster_group_size_5": ((1, 40, 40, 50), 8),        # a tile of 5 vectors, 8 blocks per cluster
    "cluster_scalar_path": ((2, 30, 30, 40), 3),          # C not a multiple of the vector width
}


def poisoned(like: torch.Tensor):
    """Leave a NaN-filled block of like's size in the caching allocator, so the op's next allocation of that
    size (its output) starts as NaN and an unwritten element fails the comparison."""
    t = torch.empty_like(like)
    t.fill_(float("nan"))
    del t


def affine(channels, dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(channels, generator=gen) * 0.5 + 1).to(dtype).cuda()
    b = (torch.randn(channels, generator=gen) * 0.5).to(dtype).cuda()
    return w, b


def check_forward(shape, groups, dtype, activation, layout="channels_last", param_dtype=None, offset=0.0, scale=3.0):
    x = random_input(shape, dtype, "cuda", layout=layout, offset=offset, scale=scale)
    w, b = affine(shape[1], param_dtype or dtype)
    poisoned(x)
    y, mean, rstd = OP(x, w, b, groups, 1e-5, activation)
    assert y.stride() == x.stride() and y.dtype == dtype
    tol = TOLERANCES[dtype]
    assert_close(y, reference(x, groups, w, b, 1e-5, activation), **tol, what=f"y {tuple(shape)} {dtype}")
    xg = x.double().reshape(shape[0], groups, -1)
    assert_close(mean, xg.mean(-1), atol=1e-5 * scale, rtol=1e-5, what="mean")
    assert_close(rstd, torch.rsqrt(xg.var(-1, unbiased=False) + 1e-5), atol=0, rtol=1e-4, what="rstd")


def check_backward(shape, groups, dtype, activation, param_dtype=None, layout="channels_last", affine_params=True):
    x = random_input(shape, dtype, "cuda", layout=layout).requires_grad_(True)
    w, b = affine(shape[1], param_dtype or dtype) if affine_params else (None, None)
    if affine_params:
        w.requires_grad_(True)
        b.requires_grad_(True)
    dy = random_input(shape, dtype, "cuda", scale=1.0, seed=5)
    y = OP(x, w, b, groups, 1e-5, activation)[0]
    poisoned(x)
    y.backward(dy)
    rdx, rdw, rdb = reference_grads(x, groups, w, b, 1e-5, activation, dy)
    # dx goes through the float32 statistics and one rounding to dtype; scale the tolerance to its magnitude.
    tol = TOLERANCES[dtype]
    scale = rdx.abs().max().item()
    assert_close(x.grad, rdx, atol=tol["atol"] * scale, rtol=tol["rtol"], what=f"dx {tuple(shape)} {dtype}")
    if affine_params:
        ptol = TOLERANCES[w.dtype]
        # dweight/dbias sum M = N*S elements per channel in float32: allow sqrt(M) roundings of the inputs.
        m = x.numel() // shape[1]
        for got, want, name in ((w.grad, rdw, "dweight"), (b.grad, rdb, "dbias")):
            atol = ptol["atol"] * want.abs().max().item() + 4e-6 * math.sqrt(m) * scale
            assert_close(got, want, atol=atol, rtol=ptol["rtol"], what=f"{name} {tuple(shape)} {dtype}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_forward_shapes(case, dtype):
    check_forward(*CASES[case], dtype, "silu")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_backward_shapes(case, dtype):
    check_backward(*CASES[case], dtype, "silu")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("case", ["sd_resnet", "split_rows", "group_size_3"])
def test_activations(case, activation, dtype):
    check_forward(*CASES[case], dtype, activation)
    check_backward(*CASES[case], dtype, activation)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", ["sd_resnet", "split_rows", "odd_channels_scalar_path"])
def test_float32_params_with_half_input(case, dtype):
    """fp32 master weights (autocast, mixed precision training) with fp16/bf16 activations."""
    check_forward(*CASES[case], dtype, "silu", param_dtype=torch.float32)
    check_backward(*CASES[case], dtype, "silu", param_dtype=torch.float32)


@pytest.mark.parametrize("case", ["sd_resnet", "split_rows"])
def test_no_affine(case):
    check_backward(*CASES[case], torch.float16, "gelu", affine_params=False)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ["sd_resnet", "split_rows", "odd_channels_scalar_path", "rank3_transposed"])
def test_unaligned_pointer(case, dtype):
    """Data starting one element past a 16-byte boundary: narrower loads, no fault."""
    check_forward(*CASES[case], dtype, "silu", layout="unaligned")
    check_backward(*CASES[case], dtype, "silu", layout="unaligned")


@pytest.mark.parametrize("case", ["sd_resnet", "split_rows", "single_group_wide"])
def test_large_offset_small_variance(case):
    """x = 1000 + 0.001 * randn: the variance must not cancel catastrophically in float32."""
    shape, groups = CASES[case]
    x = random_input(shape, torch.float32, "cuda", offset=999.0, scale=1e-3)
    poisoned(x)
    y, mean, rstd = OP(x, None, None, groups, 1e-12, "identity")
    xg = x.double().reshape(shape[0], groups, -1)
    var = xg.var(-1, unbiased=False)
    assert_close(rstd, torch.rsqrt(var + 1e-12), atol=0, rtol=2e-3, what="rstd")
    assert_close(y, reference(x, groups, None, None, 1e-12, "identity"), atol=5e-3, rtol=5e-3, what="y")


def test_empty_batch():
    x = random_input((0, 64, 4, 4), torch.float16, "cuda")
    w, b = affine(64, torch.float16)
    w.requires_grad_(True)
    b.requires_grad_(True)
    x.requires_grad_(True)
    y = gn_patch.group_norm_act(x, 32, w, b)
    assert y.shape == x.shape and y.stride() == x.stride()
    y.sum().backward()
    assert torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(b.grad, torch.zeros_like(b))


def test_deterministic_backward():
    shape, groups = CASES["split_rows"]
    grads = []
    for _ in range(2):
        x = random_input(shape, torch.float16, "cuda").requires_grad_(True)
        w, b = (t.requires_grad_(True) for t in affine(shape[1], torch.float32))
        gn_patch.group_norm_act(x, groups, w, b).backward(random_input(shape, torch.float16, "cuda", seed=9))
        grads.append((x.grad, w.grad, b.grad))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_gradcheck_float32():
    x = random_input((2, 8, 3, 3), torch.float32, "cuda", scale=1.0).requires_grad_(True)
    w, b = (t.requires_grad_(True) for t in affine(8, torch.float32))
    fn = lambda x, w, b: OP(x, w, b, 4, 1e-5, "silu")[0]
    assert torch.autograd.gradcheck(fn, (x, w, b), eps=1e-2, atol=1e-2, rtol=1e-2, nondet_tol=0.0)


def test_nchw_cuda_input_takes_exact_pytorch_path():
    x = random_input((2, 64, 8, 8), torch.float16, "cuda", layout="nchw")
    w, b = affine(64, torch.float16)
    y = gn_patch.group_norm_act(x, 32, w, b)
    assert torch.equal(y, F.silu(F.group_norm(x, 32, w, b)))


def test_float64_cuda_takes_pytorch_path():
    x = random_input((2, 64, 8, 8), torch.float64, "cuda")
    y = gn_patch.group_norm_act(x, 32)
    assert torch.equal(y, F.silu(F.group_norm(x, 32)))
    assert y.is_contiguous(memory_format=torch.channels_last)


class TestCudaErrors:
    def test_channels_not_divisible(self):
        x = random_input((2, 48, 4, 4), torch.float16, "cuda")
        with pytest.raises(RuntimeError, match=r"divisible by num_groups.*\[2, 48, 4, 4\].*num_groups=32"):
            gn_patch.group_norm_act(x, 32)

    def test_weight_shape(self):
        x = random_input((2, 64, 4, 4), torch.float16, "cuda")
        with pytest.raises(RuntimeError, match="weight to be a vector of size equal to the number of channels"):
            gn_patch.group_norm_act(x, 32, torch.ones(32, device="cuda", dtype=torch.float16))

    def test_weight_on_cpu(self):
        x = random_input((2, 64, 4, 4), torch.float16, "cuda")
        with pytest.raises(RuntimeError, match="same device.*cuda:0 and weight on cpu"):
            gn_patch.group_norm_act(x, 32, torch.ones(64, dtype=torch.float16))

    def test_integer_input(self):
        with pytest.raises(TypeError, match="floating-point"):
            gn_patch.group_norm_act(torch.ones(2, 64, 4, 4, device="cuda", dtype=torch.int32), 32)


def test_module_and_autocast():
    module = gn_patch.GroupNormAct(32, 64).cuda()
    conv = torch.nn.Conv2d(64, 64, 3, padding=1).cuda().to(memory_format=torch.channels_last)
    x = random_input((2, 64, 16, 16), torch.float32, "cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        h = conv(x)
        y = module(h)
    assert y.dtype == torch.float16 and y.is_contiguous(memory_format=torch.channels_last)
    assert_close(y, reference(h, 32, module.weight, module.bias, 1e-5, "silu"), **TOLERANCES[torch.float16], what="y")
    y.float().sum().backward()
    assert module.weight.grad.dtype == torch.float32


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph_inductor(dynamic):
    module = gn_patch.GroupNormAct(32, 128).cuda()
    compiled = torch.compile(module, fullgraph=True, dynamic=dynamic)
    for shape in [(2, 128, 16, 16), (1, 128, 24, 20)]:
        x = random_input(shape, torch.float16, "cuda").requires_grad_(True)
        y = compiled(x)
        assert y.is_contiguous(memory_format=torch.channels_last)
        y.float().square().sum().backward()
        gx = x.grad.clone()
        x.grad = None
        module(x).float().square().sum().backward()
        torch.testing.assert_close(gx, x.grad)


def test_cuda_graph_capture():
    shape, groups = CASES["split_rows"]
    module = gn_patch.GroupNormAct(groups, shape[1]).cuda().half()
    static_x = random_input(shape, torch.float16, "cuda")
    module(static_x)  # build and warm up outside capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        module(static_x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = module(static_x)
    static_x.copy_(random_input(shape, torch.float16, "cuda", seed=3))
    graph.replay()
    torch.cuda.synchronize()
    assert_close(static_y, reference(static_x, groups, module.weight, module.bias, 1e-5, "silu"),
                 **TOLERANCES[torch.float16], what="replayed y")


# ------------------------------------------------------------------------------------------------
# Sizes that broke earlier NHWC kernels: grid-dimension overflow and 32-bit indexing.
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape,groups", [((1, 256, 1024, 1024), 32), ((1, 128, 2048, 2048), 32),
                                          ((70000, 32, 2, 2), 8)], ids=["vae_1024", "c128_2048", "n_70000"])
def test_large_grids(shape, groups):
    # float32 parameters: their gradients sum millions of terms and would overflow float16.
    check_forward(shape, groups, torch.float16, "silu", param_dtype=torch.float32)
    check_backward(shape, groups, torch.float16, "silu", param_dtype=torch.float32)


def test_more_than_2_31_elements():
    """(1, 40, 8192, 8192) fp16 = 2.7e9 elements: statistics of every group and the last rows of y."""
    shape, groups = (1, 40, 8192, 8192), 8
    data = torch.empty((1, 8192, 8192, 40), dtype=torch.float16, device="cuda").normal_(1.0, 3.0)
    x = data.permute(0, 3, 1, 2)
    assert x.numel() > 2**31 and x.is_contiguous(memory_format=torch.channels_last)
    w, b = affine(40, torch.float16)
    y, mean, rstd = OP(x, w, b, groups, 1e-5, "silu")
    rows = data.view(8192 * 8192, 40)  # (S, C) view of the channels-last data
    s1 = torch.zeros(groups, dtype=torch.float64, device="cuda")
    s2 = torch.zeros_like(s1)
    for chunk in rows.split(1 << 24):
        c = chunk.double().view(-1, groups, 5)
        s1 += c.sum((0, 2))
        s2 += c.square().sum((0, 2))
    count = 8192 * 8192 * 5
    ref_mean = s1 / count
    ref_var = s2 / count - ref_mean**2
    assert_close(mean[0], ref_mean, atol=1e-4, rtol=1e-4, what="mean")
    assert_close(rstd[0], torch.rsqrt(ref_var + 1e-5), atol=0, rtol=1e-4, what="rstd")
    tail = slice(8192 * 8192 - 70000, None)  # elements past 2^31 from the start of the tensor
    xt = rows[tail].double().view(-1, groups, 5)
    expected = F.silu(((xt - ref_mean[:, None]) * torch.rsqrt(ref_var + 1e-5)[:, None]).view(-1, 40) * w.double() + b.double())
    assert_close(y.permute(0, 2, 3, 1).reshape(-1, 40)[tail], expected, **TOLERANCES[torch.float16], what="y tail")


def test_func_transforms_take_pytorch_path():
    """torch.func.grad / jvp need derivative rules the kernel op lacks: the public function must not use it."""
    x = random_input((2, 64, 8, 8), torch.float32, "cuda")
    v = random_input((2, 64, 8, 8), torch.float32, "cuda", seed=4)
    fused = lambda t: gn_patch.group_norm_act(t, 32).square().sum()
    stock = lambda t: F.silu(F.group_norm(t, 32)).square().sum()
    torch.testing.assert_close(torch.func.grad(fused)(x), torch.func.grad(stock)(x))
    torch.testing.assert_close(torch.func.jvp(fused, (x,), (v,))[1], torch.func.jvp(stock, (x,), (v,))[1])


def test_double_backward_cuda():
    x = random_input((2, 16, 4, 4), torch.float64, "cuda").to(torch.float32).requires_grad_(True)
    w, b = (t.requires_grad_(True) for t in affine(16, torch.float32))
    y = OP(x, w, b, 4, 1e-5, "silu")[0]
    (gx,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    gx.square().sum().backward()
    x64, w64, b64 = (t.detach().double().requires_grad_(True) for t in (x, w, b))
    y64 = F.silu(F.group_norm(x64, 4, w64, b64, 1e-5))
    (g64,) = torch.autograd.grad(y64.square().sum(), x64, create_graph=True)
    g64.square().sum().backward()
    assert_close(w.grad, w64.grad, atol=1e-3 * w64.grad.abs().max().item(), rtol=1e-3, what="d(|dx|^2)/dweight")
