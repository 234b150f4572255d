// CUDA implementations of the gn_patch::group_norm_act ops. The schemas, the fake (meta) functions and
// the autograd formula are registered in Python (gn_patch/ops.py); this file checks the inputs,
// allocates outputs and scratch from PyTorch's caching allocator and launches the kernels on the
// current stream of the input's device. No host synchronisation: the ops can be captured in CUDA graphs.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <array>
#include <string>
#include <string_view>
#include <tuple>

#include "group_norm_act.h"

namespace gn_patch {
namespace {

// Messages are assembled as one std::string (std::to_string, no iostreams): formatting numbers through the
// inline iostream templates that TORCH_CHECK's variadic form instantiates crashed an extension built with the
// H200 image's toolchain (segfault inside std::ostream::_M_insert<long>).
std::string shape_str(at::IntArrayRef sizes) {
  std::string s = "[";
  for (size_t i = 0; i < sizes.size(); ++i) s += (i ? ", " : "") + std::to_string(sizes[i]);
  return s + "]";
}

std::string dtype_str(at::ScalarType t) { return c10::toString(t); }

Act parse_activation(std::string_view name) {
  if (name == "identity") return Act::kIdentity;
  if (name == "silu") return Act::kSilu;
  if (name == "gelu") return Act::kGelu;
  if (name == "gelu_tanh") return Act::kGeluTanh;
  if (name == "relu") return Act::kRelu;
  TORCH_CHECK(false, "gn_patch: unknown activation '" + std::string(name) +
                         "' (expected identity, silu, gelu, gelu_tanh or relu)");
}

ScalarKind scalar_kind(const at::Tensor& x) {
  switch (x.scalar_type()) {
    case at::kFloat: return ScalarKind::kFloat;
    case at::kHalf: return ScalarKind::kHalf;
    case at::kBFloat16: return ScalarKind::kBFloat16;
    default:
      TORCH_CHECK(false, "gn_patch CUDA kernel: expected a float32, float16 or bfloat16 input, got " +
                             dtype_str(x.scalar_type()) +
                             " (gn_patch.group_norm_act takes the PyTorch path for other floating dtypes)");
  }
}

// Dense with the channel dimension innermost: (N, C, *spatial) stored as (N, *spatial, C). Size-1
// dimensions may carry any stride, as in PyTorch's own contiguity checks.
bool is_channels_last_dense(const at::Tensor& x) {
  int64_t expected = 1;
  auto check = [&](int64_t d) {
    if (x.size(d) != 1 && x.stride(d) != expected) return false;
    expected *= x.size(d);
    return true;
  };
  if (!check(1)) return false;
  for (int64_t d = x.dim() - 1; d >= 2; --d) {
    if (!check(d)) return false;
  }
  return check(0);
}

int64_t spatial_size(const at::Tensor& x) {
  int64_t s = 1;
  for (int64_t d = 2; d < x.dim(); ++d) s *= x.size(d);
  return s;
}

int num_sms(int device) {
  static std::array<int, 64> cache{};  // 0: not read yet
  TORCH_CHECK(device >= 0 && device < (int)cache.size(), "gn_patch: device index " + std::to_string(device) +
                                                             " out of range");
  if (cache[device] == 0) {
    int sms = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    cache[device] = sms;
  }
  return cache[device];
}

// Thread-block clusters (the forward's cluster geometry) need compute capability 9.0.
bool cluster_capable(int device) {
  static std::array<int, 64> cache{};  // 0: not read yet, else major + 1
  if (cache[device] == 0) {
    int major = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    cache[device] = major + 1;
  }
  return cache[device] - 1 >= 9;
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Checks shared by forward and backward, with torch.nn.GroupNorm's messages where it has one.
void check_inputs(const at::Tensor& x, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                  int64_t num_groups) {
  TORCH_CHECK(x.is_cuda(), "gn_patch CUDA kernel: expected a CUDA input, got device " + x.device().str());
  TORCH_CHECK(x.dim() >= 2 && x.dim() <= 5,
              "gn_patch: expected a 2-D to 5-D input (N, C, *spatial), got shape " + shape_str(x.sizes()));
  scalar_kind(x);
  const int64_t C = x.size(1);
  TORCH_CHECK(num_groups > 0, "gn_patch: num_groups must be positive, got " + std::to_string(num_groups));
  TORCH_CHECK(C % num_groups == 0,
              "Expected number of channels in input to be divisible by num_groups, but got input of shape " +
                  shape_str(x.sizes()) + " and num_groups=" + std::to_string(num_groups));
  TORCH_CHECK(is_channels_last_dense(x), "gn_patch CUDA kernel: expected a dense channels-last input (channel stride 1), got shape " +
                                             shape_str(x.sizes()) + " with strides " + shape_str(x.strides()));
  TORCH_CHECK(x.numel() > 0 || x.size(0) == 0,
              "gn_patch CUDA kernel: empty spatial size in input of shape " + shape_str(x.sizes()));
  for (const auto* p : {&weight, &bias}) {
    if (!p->has_value()) continue;
    const at::Tensor& t = **p;
    const std::string name = p == &weight ? "weight" : "bias";
    TORCH_CHECK(t.dim() == 1 && t.numel() == C, "Expected " + name +
                                                    " to be a vector of size equal to the number of channels in input, but got " +
                                                    name + " of shape " + shape_str(t.sizes()) + " and input of shape " +
                                                    shape_str(x.sizes()));
    TORCH_CHECK(t.device() == x.device(), "Expected all tensors to be on the same device, but found input on " +
                                              x.device().str() + " and " + name + " on " + t.device().str());
    TORCH_CHECK(t.scalar_type() == x.scalar_type() || t.scalar_type() == at::kFloat,
                "gn_patch: " + name + " must have the input's dtype (" + dtype_str(x.scalar_type()) +
                    ") or float32, got " + dtype_str(t.scalar_type()));
  }
  if (weight.has_value() && bias.has_value()) {
    TORCH_CHECK(weight->scalar_type() == bias->scalar_type(), "gn_patch: weight (" + dtype_str(weight->scalar_type()) +
                                                                  ") and bias (" + dtype_str(bias->scalar_type()) +
                                                                  ") must have the same dtype");
  }
}

bool params_are_fp32(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                     const std::optional<at::Tensor>& bias) {
  const auto& p = weight.has_value() ? weight : bias;
  return p.has_value() && p->scalar_type() == at::kFloat && x.scalar_type() != at::kFloat;
}

// weight/bias as the kernels index them (stride 1); the caller keeps the result alive during the launch.
std::optional<at::Tensor> contiguous_param(const std::optional<at::Tensor>& t) {
  return t.has_value() ? std::optional<at::Tensor>(t->contiguous()) : std::nullopt;
}

const void* data_or_null(const std::optional<at::Tensor>& t) { return t.has_value() ? t->const_data_ptr() : nullptr; }

std::tuple<at::Tensor, at::Tensor, at::Tensor> group_norm_act_cuda(const at::Tensor& x,
                                                                  const std::optional<at::Tensor>& weight,
                                                                  const std::optional<at::Tensor>& bias,
                                                                  int64_t num_groups, double eps,
                                                                  c10::string_view activation) {
  check_inputs(x, weight, bias, num_groups);
  const Act act = parse_activation(std::string_view(activation.data(), activation.size()));
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t N = x.size(0), C = x.size(1), S = spatial_size(x);

  at::Tensor y = at::empty_like(x);
  const auto stat_opts = x.options().dtype(at::kFloat);
  at::Tensor mean = at::empty({N, num_groups}, stat_opts);
  at::Tensor rstd = at::empty({N, num_groups}, stat_opts);
  if (N == 0) return {y, mean, rstd};

  ForwardArgs a;
  const int device = x.get_device();
  const int sms = num_sms(device);  // checks the device index for cluster_capable too
  a.geo = make_forward_geometry(N, S, C, num_groups, (int)x.element_size(),
                                aligned16(x.const_data_ptr()) && aligned16(y.data_ptr()), sms, cluster_capable(device));
  a.dtype = scalar_kind(x);
  a.act = act;
  a.x = x.const_data_ptr();
  const auto weight_c = contiguous_param(weight), bias_c = contiguous_param(bias);
  a.weight = data_or_null(weight_c);
  a.bias = data_or_null(bias_c);
  a.params_fp32 = params_are_fp32(x, weight, bias);
  a.eps = (float)eps;
  a.y = y.data_ptr();
  a.mean = mean.data_ptr<float>();
  a.rstd = rstd.data_ptr<float>();
  at::Tensor scratch;  // [partials | mean offsets], split geometry only
  a.partials = a.mean_offsets = nullptr;
  if (!a.geo.fused && a.geo.cluster == 0) {
    const int64_t n_partials = N * a.geo.splits * C * 2;
    scratch = at::empty({n_partials + N * num_groups}, stat_opts);
    a.partials = scratch.data_ptr<float>();
    a.mean_offsets = a.partials + n_partials;
  }
  launch_forward(a, c10::cuda::getCurrentCUDAStream());
  return {y, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> group_norm_act_backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& x, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor& mean, const at::Tensor& rstd, int64_t num_groups,
    c10::string_view activation, std::array<bool, 3> output_mask) {
  check_inputs(x, weight, bias, num_groups);
  const Act act = parse_activation(std::string_view(activation.data(), activation.size()));
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t N = x.size(0), C = x.size(1), S = spatial_size(x);
  TORCH_CHECK(grad_out.sizes() == x.sizes() && grad_out.scalar_type() == x.scalar_type() &&
                  grad_out.device() == x.device(),
              "gn_patch: grad_out must match the input's shape, dtype and device");
  TORCH_CHECK(mean.scalar_type() == at::kFloat && rstd.scalar_type() == at::kFloat && mean.numel() == N * num_groups &&
                  rstd.numel() == N * num_groups,
              "gn_patch: mean and rstd must be float32 of shape (N, num_groups)");
  // The kernels read grad_out with x's strides; gradients from NCHW consumers arrive in another layout.
  const at::Tensor dy = grad_out.strides() == x.strides() ? grad_out : at::empty_like(x).copy_(grad_out);
  const at::Tensor mean_c = mean.contiguous(), rstd_c = rstd.contiguous();

  const bool need_dw = output_mask[1] && weight.has_value();
  const bool need_db = output_mask[2] && bias.has_value();
  at::Tensor dx = output_mask[0] ? at::empty_like(x) : at::empty({0}, x.options());
  at::Tensor dweight = need_dw ? at::empty({C}, weight->options()) : at::empty({0}, x.options());
  at::Tensor dbias = need_db ? at::empty({C}, bias->options()) : at::empty({0}, x.options());
  if (N == 0) {
    if (need_dw) dweight.zero_();
    if (need_db) dbias.zero_();
    return {dx, dweight, dbias};
  }

  BackwardArgs a;
  const bool aligned = aligned16(x.const_data_ptr()) && aligned16(dy.const_data_ptr()) &&
                       (!output_mask[0] || aligned16(dx.data_ptr()));
  a.geo = make_geometry(N, S, C, num_groups, (int)x.element_size(), aligned, num_sms(x.get_device()));
  a.dtype = scalar_kind(x);
  a.act = act;
  a.dy = dy.const_data_ptr();
  a.x = x.const_data_ptr();
  const auto weight_c = contiguous_param(weight), bias_c = contiguous_param(bias);
  a.weight = data_or_null(weight_c);
  a.bias = data_or_null(bias_c);
  a.params_fp32 = params_are_fp32(x, weight, bias);
  a.mean = mean_c.const_data_ptr<float>();
  a.rstd = rstd_c.const_data_ptr<float>();
  a.dx = output_mask[0] ? dx.data_ptr() : nullptr;
  a.dweight = need_dw ? dweight.data_ptr() : nullptr;
  a.dbias = need_db ? dbias.data_ptr() : nullptr;

  // One scratch allocation: [channel sums | group sums | coefficients], each only where used.
  const auto f32 = x.options().dtype(at::kFloat);
  const bool split = !a.geo.fused;
  const int64_t rows = N * (split ? a.geo.splits : 1);
  const int64_t n_channel = (split || need_dw || need_db) ? rows * C * 2 : 0;
  const int64_t n_group = (split && a.geo.group_tiles) ? rows * num_groups * 2 : 0;
  const int64_t n_coeffs = split ? N * num_groups * 2 : 0;
  at::Tensor scratch = at::empty({n_channel + n_group + n_coeffs}, f32);
  float* base = scratch.data_ptr<float>();
  a.channel_sums = n_channel ? base : nullptr;
  a.group_sums = n_group ? base + n_channel : nullptr;
  a.coeffs = n_coeffs ? base + n_channel + n_group : nullptr;
  launch_backward(a, c10::cuda::getCurrentCUDAStream());
  return {dx, dweight, dbias};
}

}  // namespace

TORCH_LIBRARY_IMPL(gn_patch, CUDA, m) {
  m.impl("group_norm_act", &group_norm_act_cuda);
  m.impl("group_norm_act_backward", &group_norm_act_backward_cuda);
}

}  // namespace gn_patch
