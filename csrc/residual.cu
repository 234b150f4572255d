// gn_patch::bias_residual_add on CUDA: out = residual + (x + bias[c]), each add rounded to the tensors' dtype as
// PyTorch's adds round. diffusers' resnet blocks end with `input_tensor + conv2(h)`; PyTorch runs a cuDNN
// convolution without its bias and adds the bias in a pass of its own (at::_convolution's `output.add_(bias)`), so
// stock reads and writes conv2's output once for the bias and reads it again for the residual sum. Here conv2 runs
// without its bias and one pass computes both adds: stock's values bit for bit, two of the five tensor-sized memory
// passes saved. Schema, CPU and fake implementations: gn_patch/ops.py.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "common.cuh"
#include "op_checks.h"

namespace gn_patch {
namespace {

constexpr int kResidualThreads = 256;
constexpr int kResidualUnroll = 4;  // vectors per thread, their loads issued together

// Channels-last data: element e has channel e % C. `vectors` = numel / V, `row` = C / V vectors per row, divided by
// `div_row` where every vector index is below 2^31 (FastDivider's range), else by 64-bit division.
template <typename T, int V>
__global__ void __launch_bounds__(kResidualThreads) bias_residual_add_kernel(const T* residual, const T* x,
                                                                            const T* bias, T* out, int64_t vectors,
                                                                            int64_t row, FastDivider div_row) {
  const int64_t first = (int64_t)blockIdx.x * kResidualThreads * kResidualUnroll + threadIdx.x;
  Pack<T, V> r[kResidualUnroll], v[kResidualUnroll], b[kResidualUnroll];
#pragma unroll
  for (int k = 0; k < kResidualUnroll; ++k) {
    const int64_t i = min(first + k * kResidualThreads, vectors - 1);  // clamped: the loads stay in bounds
    const int64_t c = (vectors < (int64_t{1} << 31) ? i - (int64_t)div_row.div((uint32_t)i) * row : i % row) * V;
    r[k] = load_pack<T, V>(residual + i * V);
    v[k] = load_pack<T, V>(x + i * V);
    b[k] = load_pack<T, V>(bias + c);
  }
#pragma unroll
  for (int k = 0; k < kResidualUnroll; ++k) {
    const int64_t i = first + k * kResidualThreads;
    if (i < vectors) *reinterpret_cast<Pack<T, V>*>(out + i * V) = add_packs(r[k], add_packs(v[k], b[k]));
  }
}

template <typename T, int V>
void launch_bias_residual_add(const at::Tensor& residual, const at::Tensor& x, const at::Tensor& bias,
                              at::Tensor& out) {
  const int64_t vectors = x.numel() / V, row = x.size(1) / V;
  const int64_t per_block = (int64_t)kResidualThreads * kResidualUnroll;
  const int64_t blocks = (vectors + per_block - 1) / per_block;
  TORCH_CHECK(blocks < (int64_t{1} << 31), "gn_patch.bias_residual_add: the tensor needs " + std::to_string(blocks) +
                                               " blocks, more than a CUDA grid holds");
  bias_residual_add_kernel<T, V><<<(unsigned)blocks, kResidualThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      static_cast<const T*>(residual.const_data_ptr()), static_cast<const T*>(x.const_data_ptr()),
      static_cast<const T*>(bias.const_data_ptr()), static_cast<T*>(out.data_ptr()), vectors, row,
      FastDivider::of((uint32_t)std::min<int64_t>(row, INT32_MAX)));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void dispatch_vec(int vec, const at::Tensor& residual, const at::Tensor& x, const at::Tensor& bias, at::Tensor& out) {
  constexpr int kFull = 16 / sizeof(T);
  if (vec == kFull) return launch_bias_residual_add<T, kFull>(residual, x, bias, out);
  if (vec == kFull / 2) return launch_bias_residual_add<T, kFull / 2>(residual, x, bias, out);
  if constexpr (kFull == 8) {
    if (vec == 2) return launch_bias_residual_add<T, 2>(residual, x, bias, out);
  }
  launch_bias_residual_add<T, 1>(residual, x, bias, out);
}

// Where the kernel computes the sum: x and residual of one kernel dtype, device and shape, channels-last dense
// with the same strides and not also NCHW-contiguous (where both layouts coincide, PyTorch's add may give the output
// other strides), and a (C,) bias of their dtype on their device.
bool kernel_takes(const at::Tensor& residual, const at::Tensor& x, const at::Tensor& bias) {
  return x.is_cuda() && kernel_dtype(x.scalar_type()) && x.dim() >= 3 && x.dim() <= 5 &&
         residual.scalar_type() == x.scalar_type() && bias.scalar_type() == x.scalar_type() &&
         residual.device() == x.device() && bias.device() == x.device() && residual.sizes() == x.sizes() &&
         residual.strides() == x.strides() && bias.dim() == 1 && bias.size(0) == x.size(1) && bias.stride(0) == 1 &&
         is_channels_last_dense(x) && !x.is_contiguous();
}

// gn_patch/ops.py's bias_residual_add: the two adds, bias viewed as (1, C, 1, ...) (as (1, C) for x of rank < 2).
at::Tensor pytorch_bias_residual_add(const at::Tensor& residual, const at::Tensor& x, const at::Tensor& bias) {
  std::vector<int64_t> shape(std::max<int64_t>(2, x.dim()), 1);
  shape[1] = -1;
  return at::add(residual, at::add(x, bias.reshape(shape)));
}

at::Tensor bias_residual_add_cuda(const at::Tensor& residual, const at::Tensor& x, const at::Tensor& bias) {
  if (!kernel_takes(residual, x, bias) || x.numel() == 0) return pytorch_bias_residual_add(residual, x, bias);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty_like(x);
  // The widest vector dividing C (a row's channels) that every pointer's alignment allows.
  const int vec = choose_vec(x.size(1), (int)x.element_size(),
                             common_alignment({residual.const_data_ptr(), x.const_data_ptr(), bias.const_data_ptr(),
                                               out.const_data_ptr()}));
  switch (scalar_kind(x)) {
    case ScalarKind::kHalf: dispatch_vec<__half>(vec, residual, x, bias, out); break;
    case ScalarKind::kBFloat16: dispatch_vec<__nv_bfloat16>(vec, residual, x, bias, out); break;
    case ScalarKind::kFloat: dispatch_vec<float>(vec, residual, x, bias, out); break;
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(gn_patch, CUDA, m) { m.impl("bias_residual_add", &bias_residual_add_cuda); }

}  // namespace gn_patch
