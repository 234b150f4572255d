// CUDA implementations of the ops gn_patch::group_norm_act and gn_patch::group_norm_act_backward (schemas, fake
// and CPU implementations in gn_patch/ops.py; autograd and the dispatching op in autograd.cpp). Checks the inputs,
// allocates outputs and scratch from PyTorch's caching allocator and launches the kernels on the current stream
// of the input's device. No host synchronisation: the ops can be captured in CUDA graphs.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <ATen/cuda/EmptyTensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <string>
#include <tuple>

#include "aten_path.h"
#include "op_checks.h"

namespace gn_patch {
namespace {

// GN_PATCH_MAX_CLUSTER (1 turns clusters off; other values round down to a power of two, the sizes the geometry
// doubles through) caps the cluster size the geometry may choose: a tuning and diagnosis knob, read once.
int cluster_cap() {
  static const int cap = [] {
    const char* value = std::getenv("GN_PATCH_MAX_CLUSTER");
    if (value == nullptr) return kMaxCluster;
    int size = 1;
    while (size * 2 <= std::min(std::atoi(value), kMaxCluster)) size *= 2;
    return size;
  }();
  return cap;
}

DeviceLimits device_limits(const at::Tensor& x, Pass pass, ScalarKind dtype, int vec, Act act, bool straddle) {
  DeviceLimits limits;
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(x.get_device());
  limits.num_sms = prop->multiProcessorCount;
  limits.l2_bytes = prop->l2CacheSize;
  const bool forward = pass == Pass::kForward;
  const int supported = forward ? forward_max_cluster(dtype, vec, act) : backward_max_cluster(dtype, vec, act);
  limits.max_cluster = std::min(supported, cluster_cap());
  limits.occupancy = forward ? forward_cluster_occupancy(dtype, vec, act, straddle, supported)
                             : backward_cluster_occupancy(dtype, vec, act, straddle, supported);
  return limits;
}

// The kernels' geometry for x, whose data (and that of the tensors read and written with it) is at `pointers`.
// A pass whose vectors are narrower than 16 bytes (groups of more than 8 16-bit channels, not a multiple of 8: 10,
// 12, 20, 30, 60, 90) and whose rows are not resident takes vectors straddling two groups: a row costs a quarter or
// half of the instructions, fewer rows fit the registers. On the H200 (fp16), forward: (32, 320, 64, 64) 139 -> 96,
// (2, 320, 128, 128) 48 -> 34, resident (2, 640, 32, 32) 8.1 -> 9.2; backward: (2, 320, 128, 128) 91 -> 60,
// (2, 960, 64, 64) 64 -> 46, resident (2, 640, 32, 32) 14.0 -> 15.2 (but (2, 320, 32, 32) 13.2 -> 10.4); hence
// only where rows stream (times in us).
Geometry geometry(Pass pass, const at::Tensor& x, int64_t num_groups, Act act,
                  std::initializer_list<const void*> pointers) {
  const int64_t N = x.size(0), C = x.size(1), D = C / num_groups, S = spatial_size(x);
  const int elem = (int)x.element_size();
  const ScalarKind dtype = scalar_kind(x);
  const int64_t alignment = common_alignment(pointers);
  const int vec = choose_vec(D, elem, alignment);
  const Geometry g =
      make_geometry(pass, N, S, C, num_groups, elem, vec, device_limits(x, pass, dtype, vec, act, false));
  const int wide = g.resident ? 0 : straddling_vec(D, num_groups, elem, alignment);
  if (wide == 0) return g;
  return make_geometry(pass, N, S, C, num_groups, elem, wide, device_limits(x, pass, dtype, wide, act, true));
}

// Outputs and scratch of a fixed layout, allocated from the CUDA caching allocator as at::empty's CUDA kernel does,
// without at::empty_like's and at::empty's dispatcher round trips: part of a launch-bound call's host time
// (benchmarks/NOTES.md, session 25). Unlike at::empty, never filled under torch.use_deterministic_algorithms'
// fill_uninitialized_memory: the kernels write every element of what is allocated here.
// x's sizes and strides, as at::empty_like(x) gives them for a non-overlapping and dense x.
at::Tensor empty_dense_like(const at::Tensor& x) {
  return at::detail::empty_strided_cuda(x.sizes(), x.strides(), x.scalar_type(), x.device());
}

// Contiguous float32 on x's device.
at::Tensor empty_float(at::IntArrayRef sizes, const at::Tensor& x) {
  return at::detail::empty_cuda(sizes, at::kFloat, x.device(), std::nullopt);
}

// Optional (N, C) or (C,) parameters as the kernels index them (dense); the caller keeps the result alive.
std::optional<at::Tensor> dense(const std::optional<at::Tensor>& t) {
  return t.has_value() ? std::optional<at::Tensor>(t->contiguous()) : std::nullopt;
}

const void* data_or_null(const std::optional<at::Tensor>& t) { return t.has_value() ? t->const_data_ptr() : nullptr; }

bool is_fp32_for(const at::Tensor& x, const std::optional<at::Tensor>& a, const std::optional<at::Tensor>& b) {
  const auto& p = a.has_value() ? a : b;
  return p.has_value() && p->scalar_type() == at::kFloat && x.scalar_type() != at::kFloat;
}

// x, or a channels-last copy of it whose data is 16-byte aligned (what the kernels read fastest) when x is not
// channels-last dense, or when its alignment would force vectors too narrow for its groups.
at::Tensor kernel_layout(const at::Tensor& x, int64_t num_groups) {
  const int64_t D = x.size(1) / num_groups;
  const int elem = (int)x.element_size();
  const bool narrow = D / choose_vec(D, elem, common_alignment({x.const_data_ptr()})) > kMaxThreads;
  return is_channels_last_dense(x) && !narrow ? x : channels_last_copy(x);
}

// An input bias or offset as the kernels read it: dense, from a 16-byte aligned start, at the vector width x's rows
// allow (a tensor sliced at an odd element would narrow every access of x to its alignment).
std::optional<at::Tensor> aligned(const std::optional<at::Tensor>& t) {
  if (t.has_value() && common_alignment({t->const_data_ptr()}) < 16) return t->clone(at::MemoryFormat::Contiguous);
  return dense(t);
}

// y, and mean and rstd where `statistics` is set (undefined otherwise: an inference call, which never reads them,
// allocates neither).
std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_cuda(
    const at::Tensor& input, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& scale, const std::optional<at::Tensor>& shift, int64_t num_groups, double eps,
    c10::string_view activation, const std::optional<at::Tensor>& input_offset,
    const std::optional<at::Tensor>& input_bias, bool frames_last, bool statistics) {
  check_inputs(input, weight, bias, scale, shift, num_groups);
  check_input_terms(input, input_offset, input_bias);
  check_frames_last(input, frames_last);
  check_eps(eps);
  const Act act = parse_activation(activation);
  const c10::cuda::CUDAGuard guard(input.device());
  const int64_t N = input.size(0);
  const bool supported = kernel_supports_group_size(input.size(1) / num_groups, (int)input.element_size());
  const bool adds = input_offset.has_value() || input_bias.has_value();
  const bool adds_itself = !adds || (supported && fuses_input_offset(act));
  if (frames_last && !(N > 0 && supported && adds_itself && spatial_size(input) <= INT32_MAX)) {
    // The kernels write frames_last rows where they compute y themselves (output_row's 32-bit rows); elsewhere y is
    // computed in x's layout and copied.
    auto [y, mean, rstd] = forward_cuda(input, weight, bias, scale, shift, num_groups, eps, activation, input_offset,
                                        input_bias, false, statistics);
    return {empty_frames_last(input).copy_(y), mean, rstd};
  }
  if (N > 0 && !adds_itself) {
    // Kernels that do not add them: (x + bias) + offset with PyTorch's adds (the kernels' rounding), y in x's layout
    // (as empty_like(input) would have it: input's strides where it is dense).
    auto [y, mean, rstd] = forward_cuda(with_input_terms(input, input_offset, input_bias), weight, bias, scale, shift,
                                        num_groups, eps, activation, std::nullopt, std::nullopt, false, statistics);
    const bool same_layout = input.is_non_overlapping_and_dense() && y.strides() == input.strides();
    return {same_layout ? y : at::empty_like(input).copy_(y), mean, rstd};
  }
  if (N > 0 && !supported) return aten_forward(input, weight, bias, scale, shift, num_groups, eps, act);
  at::Tensor mean = statistics ? empty_float({N, num_groups}, input) : at::Tensor();
  at::Tensor rstd = statistics ? empty_float({N, num_groups}, input) : at::Tensor();
  if (N == 0) return {at::empty_like(input), mean, rstd};

  const at::Tensor x = kernel_layout(input, num_groups);
  at::Tensor y = frames_last ? empty_frames_last(x) : empty_dense_like(x);  // x: channels-last dense
  const auto weight_d = dense(weight), bias_d = dense(bias), scale_d = dense(scale), shift_d = dense(shift);
  const auto offset_d = aligned(input_offset), input_bias_d = aligned(input_bias);
  ForwardArgs a;
  a.geo = geometry(Pass::kForward, x, num_groups, act,
                   {x.const_data_ptr(), y.const_data_ptr(), data_or_null(offset_d), data_or_null(input_bias_d)});
  if (frames_last && x.size(2) > 1) {
    a.geo.frames = x.size(2);
    a.geo.div_frame_rows = FastDivider::of((uint32_t)(x.size(3) * x.size(4)));
  }
  a.dtype = scalar_kind(x);
  a.act = act;
  a.x = x.const_data_ptr();
  a.weight = data_or_null(weight_d);
  a.bias = data_or_null(bias_d);
  a.scale = data_or_null(scale_d);
  a.shift = data_or_null(shift_d);
  a.input_offset = data_or_null(offset_d);
  a.input_bias = data_or_null(input_bias_d);
  a.params_fp32 = is_fp32_for(x, weight, bias);
  a.modulation_fp32 = is_fp32_for(x, scale, shift);
  a.eps = (float)eps;
  a.y = y.data_ptr();
  a.mean = statistics ? mean.data_ptr<float>() : nullptr;
  a.rstd = statistics ? rstd.data_ptr<float>() : nullptr;
  at::Tensor scratch;  // unclustered: [partials (N, splits, G) | group statistics (N, G)], 4 floats each
  a.partials = a.group_stats = nullptr;
  if (!a.geo.clustered) {
    const int64_t n_partials = N * a.geo.splits * num_groups * 4;
    scratch = empty_float({n_partials + N * num_groups * 4}, x);
    a.partials = scratch.data_ptr<float>();
    a.group_stats = a.partials + n_partials;
  }
  launch_forward(a, c10::cuda::getCurrentCUDAStream());
  if (!frames_last && !x.is_same(input)) y = at::empty_like(input).copy_(y);  // the layout the fake function promises
  return {y, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> group_norm_act_cuda(
    const at::Tensor& input, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& scale, const std::optional<at::Tensor>& shift, int64_t num_groups, double eps,
    c10::string_view activation, const std::optional<at::Tensor>& input_offset,
    const std::optional<at::Tensor>& input_bias, bool frames_last) {
  return forward_cuda(input, weight, bias, scale, shift, num_groups, eps, activation, input_offset, input_bias,
                      frames_last, /*statistics=*/true);
}

at::Tensor group_norm_act_inference_cuda(const at::Tensor& input, const std::optional<at::Tensor>& weight,
                                         const std::optional<at::Tensor>& bias,
                                         const std::optional<at::Tensor>& scale,
                                         const std::optional<at::Tensor>& shift, int64_t num_groups, double eps,
                                         c10::string_view activation, const std::optional<at::Tensor>& input_offset,
                                         const std::optional<at::Tensor>& input_bias, bool frames_last) {
  return std::get<0>(forward_cuda(input, weight, bias, scale, shift, num_groups, eps, activation, input_offset,
                                  input_bias, frames_last, /*statistics=*/false));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> group_norm_act_backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& input, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& scale,
    const std::optional<at::Tensor>& shift, const at::Tensor& mean, const at::Tensor& rstd, int64_t num_groups,
    c10::string_view activation, std::array<bool, 5> output_mask) {
  check_inputs(input, weight, bias, scale, shift, num_groups);
  check_backward_inputs(grad_out, input, mean, rstd, num_groups);
  const Act act = parse_activation(activation);
  const c10::cuda::CUDAGuard guard(input.device());
  const int64_t N = input.size(0), C = input.size(1);
  const bool need_dx = output_mask[0];
  const bool need_dw = output_mask[1] && weight.has_value(), need_db = output_mask[2] && bias.has_value();
  const bool need_dscale = output_mask[3] && scale.has_value(), need_dshift = output_mask[4] && shift.has_value();
  const auto none = input.options();
  // Dense outputs, whatever the parameters' strides (the kernels write them at flat indices).
  auto output = [&](bool needed, const std::optional<at::Tensor>& like) {
    return needed ? at::empty(like->sizes(), like->options()) : at::empty({0}, none);
  };
  at::Tensor dweight = output(need_dw, weight), dbias = output(need_db, bias);
  at::Tensor dscale = output(need_dscale, scale), dshift = output(need_dshift, shift);
  if (N == 0) {
    if (need_dw) dweight.zero_();
    if (need_db) dbias.zero_();
    return {need_dx ? at::empty_like(input) : at::empty({0}, none), dweight, dbias, dscale, dshift};
  }
  if (!kernel_supports_group_size(C / num_groups, (int)input.element_size())) {
    return aten_backward(grad_out, input, weight, bias, scale, shift, mean, rstd, num_groups, act, output_mask);
  }

  const at::Tensor x = kernel_layout(input, num_groups);
  // The kernels read grad_out with x's strides; gradients from NCHW consumers arrive in another layout.
  const at::Tensor dy = grad_out.strides() == x.strides() && common_alignment({grad_out.const_data_ptr()}) == 16
                            ? grad_out
                            : empty_dense_like(x).copy_(grad_out);
  at::Tensor dx = need_dx ? empty_dense_like(x) : at::Tensor();
  const auto weight_d = dense(weight), bias_d = dense(bias), scale_d = dense(scale), shift_d = dense(shift);
  const at::Tensor mean_d = mean.contiguous(), rstd_d = rstd.contiguous();

  BackwardArgs a;
  a.geo = geometry(Pass::kBackward, x, num_groups, act,
                   {x.const_data_ptr(), dy.const_data_ptr(), need_dx ? dx.const_data_ptr() : nullptr});
  a.dtype = scalar_kind(x);
  a.act = act;
  a.dy = dy.const_data_ptr();
  a.x = x.const_data_ptr();
  a.weight = data_or_null(weight_d);
  a.bias = data_or_null(bias_d);
  a.scale = data_or_null(scale_d);
  a.shift = data_or_null(shift_d);
  a.params_fp32 = is_fp32_for(x, weight, bias);
  a.modulation_fp32 = is_fp32_for(x, scale, shift);
  a.mean = mean_d.const_data_ptr<float>();
  a.rstd = rstd_d.const_data_ptr<float>();
  a.dx = need_dx ? dx.data_ptr() : nullptr;
  a.dweight = need_dw ? dweight.data_ptr() : nullptr;
  a.dbias = need_db ? dbias.data_ptr() : nullptr;
  a.dscale = need_dscale ? dscale.data_ptr() : nullptr;
  a.dshift = need_dshift ? dshift.data_ptr() : nullptr;
  // One scratch allocation: [param sums (N, C) pairs, summed over N by a second kernel, when N > 1 and the images
  // are not in one cluster |
  // unclustered: channel partials (N, splits, C) pairs | dx coefficients (N, G) pairs].
  const int64_t n_params = N > 1 && a.geo.images == 1 && (need_dw || need_db) ? N * C * 2 : 0;
  const int64_t n_partials = a.geo.clustered ? 0 : N * a.geo.splits * C * 2;
  const int64_t n_coeffs = a.geo.clustered ? 0 : N * num_groups * 2;
  at::Tensor scratch = empty_float({n_params + n_partials + n_coeffs}, x);
  float* base = scratch.data_ptr<float>();
  a.param_sums = n_params ? base : nullptr;
  a.channel_partials = n_partials ? base + n_params : nullptr;
  a.coefficients = n_coeffs ? base + n_params + n_partials : nullptr;
  launch_backward(a, c10::cuda::getCurrentCUDAStream());
  if (!need_dx) {
    dx = at::empty({0}, none);
  } else if (!x.is_same(input)) {
    dx = at::empty_like(input).copy_(dx);
  }
  return {dx, dweight, dbias, dscale, dshift};
}

}  // namespace

TORCH_LIBRARY_IMPL(gn_patch, CUDA, m) {
  m.impl("group_norm_act", &group_norm_act_cuda);
  m.impl("group_norm_act_inference", &group_norm_act_inference_cuda);
  m.impl("group_norm_act_backward", &group_norm_act_backward_cuda);
}

}  // namespace gn_patch
