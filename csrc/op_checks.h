// Argument checks, layout queries and name parsing shared by the CUDA ops (ops.cpp, residual.cu) and the dispatching
// op (autograd.cpp). Messages match torch.nn.GroupNorm's where it has one, and gn_patch/ops.py's fake functions.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>

#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "group_norm_act.h"

namespace gn_patch {

// Messages are assembled as one std::string (std::to_string, no iostreams): formatting numbers through the
// inline iostream templates that TORCH_CHECK's variadic form instantiates crashed an extension built with the
// H200 image's toolchain (segfault inside std::ostream::_M_insert<long>).
inline std::string shape_str(at::IntArrayRef sizes) {
  std::string s = "[";
  for (size_t i = 0; i < sizes.size(); ++i) s += (i ? ", " : "") + std::to_string(sizes[i]);
  return s + "]";
}

// Dtypes as Python spells them (torch.float32), as gn_patch/ops.py's messages do.
inline std::string dtype_str(at::ScalarType t) { return "torch." + std::string(c10::getDtypeNames(t).first); }

// Symbolic sizes (torch.compile with dynamic shapes) print as "s?".
inline std::string shape_str(c10::SymIntArrayRef sizes) {
  std::string s = "[";
  for (size_t i = 0; i < sizes.size(); ++i) {
    const auto value = sizes[i].maybe_as_int();
    s += (i ? ", " : "") + (value ? std::to_string(*value) : std::string("s?"));
  }
  return s + "]";
}

// A double with the fewest significant digits that read back as it (as Python's repr: -1e-09, -0.1234567, not
// std::to_string's -0.000000), through snprintf for the reason above.
inline std::string number_str(double value) {
  char text[32];
  for (int digits = 1; digits <= 17; ++digits) {
    std::snprintf(text, sizeof(text), "%.*g", digits, value);
    if (std::strtod(text, nullptr) == value) break;
  }
  return text;
}

// Activation names as gn_patch.canonical_activation takes them: case-insensitive, with the aliases swish (silu) and
// none (identity); the message is the Python function's.
inline Act parse_activation(std::string_view given) {
  std::string name(given);
  for (char& c : name) c = (char)std::tolower((unsigned char)c);
  if (name == "identity" || name == "none") return Act::kIdentity;
  if (name == "silu" || name == "swish") return Act::kSilu;
  if (name == "gelu") return Act::kGelu;
  if (name == "gelu_tanh") return Act::kGeluTanh;
  if (name == "relu") return Act::kRelu;
  if (name == "mish") return Act::kMish;
  TORCH_CHECK_VALUE(false, "activation: unknown activation '" + std::string(given) +
                               "'; expected one of gelu, gelu_tanh, identity, mish, relu, silu, swish or None "
                               "(case-insensitive)");
}

// num_groups and eps as torch.nn.GroupNorm needs them (it has no message of its own for these).
inline void check_num_groups(int64_t num_groups) {
  TORCH_CHECK_VALUE(num_groups > 0, "gn_patch: num_groups must be positive, got " + std::to_string(num_groups));
}

inline void check_eps(double eps) {
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps >= 0,
                    "gn_patch: eps must be a finite number >= 0, got " + number_str(eps));
}

// Largest power of two (<= 16) dividing every pointer's address: the widest vector access all of them allow.
inline int64_t common_alignment(std::initializer_list<const void*> pointers) {
  int64_t alignment = 16;
  for (const void* p : pointers) {
    while (alignment > 1 && reinterpret_cast<uintptr_t>(p) % alignment != 0) alignment /= 2;
  }
  return alignment;
}

inline bool kernel_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kHalf || t == at::kBFloat16; }

inline ScalarKind scalar_kind(const at::Tensor& x) {
  switch (x.scalar_type()) {
    case at::kFloat: return ScalarKind::kFloat;
    case at::kHalf: return ScalarKind::kHalf;
    case at::kBFloat16: return ScalarKind::kBFloat16;
    default:
      TORCH_CHECK_TYPE(false, "gn_patch CUDA kernel: expected a float32, float16 or bfloat16 input, got " +
                                  dtype_str(x.scalar_type()) +
                                  " (gn_patch.group_norm_act takes the PyTorch path for other floating dtypes)");
  }
}

// Dense with the channel dimension innermost: (N, C, *spatial) stored as (N, *spatial, C). Size-1
// dimensions may carry any stride, as in PyTorch's own contiguity checks.
inline bool is_channels_last_dense(const at::Tensor& x) {
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

// A fresh channels-last dense copy of x (any rank >= 2), 16-byte aligned by the caching allocator.
inline at::Tensor channels_last_copy(const at::Tensor& x) {
  std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end());
  sizes.push_back(sizes[1]);
  sizes.erase(sizes.begin() + 1);
  return at::empty(sizes, x.options()).movedim(-1, 1).copy_(x);
}

inline int64_t spatial_size(const at::Tensor& x) {
  int64_t s = 1;
  for (int64_t d = 2; d < x.dim(); ++d) s *= x.size(d);
  return s;
}

// Groups the kernels take: at most kMaxThreads vectors (of the widest width D allows) and kMaxTileChannels
// channels; the CUDA ops compute wider ones with ATen (aten_path.h).
inline bool kernel_supports_group_size(int64_t D, int elem_size) {
  return D <= kMaxTileChannels && D / choose_vec(D, elem_size, 16) <= kMaxThreads;
}

// Checks of the CUDA ops' inputs, shared by forward and backward, with torch.nn.GroupNorm's messages where it has
// one.
inline void check_inputs(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                         const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& scale,
                         const std::optional<at::Tensor>& shift, int64_t num_groups) {
  TORCH_CHECK(x.is_cuda(), "gn_patch CUDA kernel: expected a CUDA input, got device " + x.device().str());
  TORCH_CHECK_TYPE(x.is_floating_point(),
                   "gn_patch: x must be a floating-point tensor, got " + dtype_str(x.scalar_type()));
  TORCH_CHECK_VALUE(x.dim() >= 2 && x.dim() <= 5,
                    "gn_patch: x must be a 2-D to 5-D input (N, C, *spatial), got shape " + shape_str(x.sizes()));
  scalar_kind(x);
  const int64_t N = x.size(0), C = x.size(1);
  check_num_groups(num_groups);
  TORCH_CHECK(C > 0, "Expected number of channels to be greater than 0, got 0");  // torch.group_norm's
  TORCH_CHECK(C % num_groups == 0,
              "Expected number of channels in input to be divisible by num_groups, but got input of shape " +
                  shape_str(x.sizes()) + " and num_groups=" + std::to_string(num_groups));
  int64_t spatial_size = 1;  // an empty batch is computed, an empty image is not: torch.group_norm's error
  for (int64_t d = 2; d < x.dim(); ++d) spatial_size *= x.size(d);
  TORCH_CHECK(spatial_size > 0, "Expected HxW to be greater than 0, got 0");
  for (const auto* p : {&weight, &bias}) {
    if (!p->has_value()) continue;
    const at::Tensor& t = **p;
    const std::string name = p == &weight ? "weight" : "bias";
    TORCH_CHECK(t.dim() == 1 && t.numel() == C, "Expected " + name +
                                                    " to be a vector of size equal to the number of channels in input, "
                                                    "but got " + name + " of shape " + shape_str(t.sizes()) +
                                                    " and input of shape " + shape_str(x.sizes()));
  }
  for (const auto* p : {&scale, &shift}) {
    if (!p->has_value()) continue;
    const at::Tensor& t = **p;
    const std::string name = p == &scale ? "scale" : "shift";
    TORCH_CHECK_VALUE(t.dim() == 2 && t.size(0) == N && t.size(1) == C,
                      "gn_patch: " + name + " must have shape (N, C) = (" + std::to_string(N) + ", " +
                          std::to_string(C) + "), got " + shape_str(t.sizes()));
  }
  for (const auto* p : {&weight, &bias, &scale, &shift}) {
    if (!p->has_value()) continue;
    const at::Tensor& t = **p;
    const std::string name = p == &weight ? "weight" : p == &bias ? "bias" : p == &scale ? "scale" : "shift";
    TORCH_CHECK(t.device() == x.device(), "Expected all tensors to be on the same device, but found input on " +
                                              x.device().str() + " and " + name + " on " + t.device().str());
    TORCH_CHECK_TYPE(t.scalar_type() == x.scalar_type() || t.scalar_type() == at::kFloat,
                     "gn_patch: " + name + " must have the input's dtype (" + dtype_str(x.scalar_type()) +
                         ") or float32, got " + dtype_str(t.scalar_type()));
  }
  for (const auto& [a, b, names] : {std::tuple{&weight, &bias, "weight and bias"}, std::tuple{&scale, &shift,
                                                                                             "scale and shift"}}) {
    if (a->has_value() && b->has_value()) {
      TORCH_CHECK_TYPE((*a)->scalar_type() == (*b)->scalar_type(),
                       std::string("gn_patch: ") + names + " must have the same dtype, got " +
                           dtype_str((*a)->scalar_type()) + " and " + dtype_str((*b)->scalar_type()));
    }
  }
}

// Sizes may be symbolic here (the autograd kernel runs on fake tensors under torch.compile): a comparison guards
// on the value it needs.
inline bool sym_equal(const c10::SymInt& a, const c10::SymInt& b) { return a.sym_eq(b).guard_bool(__FILE__, __LINE__); }

// The forward op's input terms, added to x before the normalisation: input_offset (N, C) and input_bias (C,), x's
// dtype and device (the dispatching op adds any other with PyTorch's add first).
inline void check_input_terms(const at::Tensor& x, const std::optional<at::Tensor>& input_offset,
                              const std::optional<at::Tensor>& input_bias) {
  for (const auto* p : {&input_offset, &input_bias}) {
    if (!p->has_value()) continue;
    const at::Tensor& t = **p;
    const bool offset = p == &input_offset;
    const std::string name = offset ? "input_offset" : "input_bias";
    const bool shape_ok = offset ? t.dim() == 2 && sym_equal(t.sym_size(0), x.sym_size(0)) &&
                                       sym_equal(t.sym_size(1), x.sym_size(1))
                                 : t.dim() == 1 && sym_equal(t.sym_size(0), x.sym_size(1));
    TORCH_CHECK_VALUE(shape_ok, "gn_patch: " + name + " must have shape " +
                                    (offset ? "(N, C) = " + shape_str(x.sym_sizes().slice(0, 2))
                                            : "(C,) = " + shape_str(x.sym_sizes().slice(1, 1))) +
                                    ", got " + shape_str(t.sym_sizes()));
    TORCH_CHECK(t.device() == x.device(), "Expected all tensors to be on the same device, but found input on " +
                                              x.device().str() + " and " + name + " on " + t.device().str());
    TORCH_CHECK_TYPE(t.scalar_type() == x.scalar_type(), "gn_patch: " + name + " must have the input's dtype (" +
                                                             dtype_str(x.scalar_type()) + "), got " +
                                                             dtype_str(t.scalar_type()));
  }
}

// t viewed to broadcast against x (x's rank): per channel, (C,) -> (1, C, 1, ...), or per sample, (N, C) ->
// (N, C, 1, ...). Sizes are symbolic (the dispatching op runs on fake tensors under torch.compile).
inline at::Tensor channel_view(const at::Tensor& t, const at::Tensor& x) {
  std::vector<c10::SymInt> shape(x.dim(), 1);
  shape[1] = x.sym_size(1);
  return t.reshape_symint(shape);
}

inline at::Tensor sample_view(const at::Tensor& t, const at::Tensor& x) {
  std::vector<c10::SymInt> shape(x.dim(), 1);
  shape[0] = x.sym_size(0);
  shape[1] = x.sym_size(1);
  return t.reshape_symint(shape);
}

// (x + input_bias) + input_offset with PyTorch's adds, each rounded to x's dtype: what the kernels normalise when
// they add the terms themselves (check_input_terms' shapes, viewed to broadcast against x).
inline at::Tensor with_input_terms(const at::Tensor& x, const std::optional<at::Tensor>& input_offset,
                                   const std::optional<at::Tensor>& input_bias) {
  const at::Tensor sum = input_bias.has_value() ? at::add(x, channel_view(*input_bias, x)) : x;
  return input_offset.has_value() ? at::add(sum, sample_view(*input_offset, x)) : sum;
}

// frames_last: the output of a 5-D input (N, C, F, H, W) returned with its memory in (N, H, W, F, C) order.
inline void check_frames_last(const at::Tensor& x, bool frames_last) {
  TORCH_CHECK_VALUE(!frames_last || x.dim() == 5, "gn_patch: frames_last needs a 5-D input (N, C, F, H, W), got shape " +
                                                      shape_str(x.sym_sizes()));
}

// An uninitialised tensor of 5-D x's shape, dtype and device whose memory is in (N, H, W, F, C) order: what a
// frames_last call returns (gn_patch/ops.py's _empty_frames_last).
inline at::Tensor empty_frames_last(const at::Tensor& x) {
  const c10::SymIntArrayRef s = x.sym_sizes();
  return at::empty_symint({s[0], s[3], s[4], s[2], s[1]}, x.options()).permute({0, 4, 3, 1, 2});
}

inline void check_backward_inputs(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& mean,
                                  const at::Tensor& rstd, int64_t num_groups) {
  TORCH_CHECK_VALUE(grad_out.sizes() == x.sizes() && grad_out.scalar_type() == x.scalar_type() &&
                        grad_out.device() == x.device(),
                    "gn_patch: grad_out must match the input's shape, dtype and device");
  const int64_t N = x.size(0);
  TORCH_CHECK_VALUE(mean.scalar_type() == at::kFloat && rstd.scalar_type() == at::kFloat && mean.dim() == 2 &&
                        rstd.dim() == 2 && mean.size(0) == N && mean.size(1) == num_groups && rstd.size(0) == N &&
                        rstd.size(1) == num_groups,
                    "gn_patch: mean and rstd must be float32 of shape (N, num_groups)");
}

}  // namespace gn_patch
