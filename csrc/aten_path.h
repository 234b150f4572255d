// The ops computed with PyTorch's own ATen operators: the activations, and the CUDA ops for groups wider than
// the kernels take (more than 1024 channels, or more than kMaxThreads vectors), in float32 through
// native_group_norm and its backward.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <optional>
#include <tuple>

#include "group_norm_act.h"

namespace gn_patch {

at::Tensor apply_activation(const at::Tensor& u, Act act);

// grad_out * act'(u), as PyTorch's activation backward computes it.
at::Tensor activation_backward(const at::Tensor& grad_out, const at::Tensor& u, Act act);

// gn_patch::group_norm_act's forward and backward for any group size; scale and shift are (N, C).
std::tuple<at::Tensor, at::Tensor, at::Tensor> aten_forward(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                                                            const std::optional<at::Tensor>& bias,
                                                            const std::optional<at::Tensor>& scale,
                                                            const std::optional<at::Tensor>& shift, int64_t num_groups,
                                                            double eps, Act act);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> aten_backward(
    const at::Tensor& grad_out, const at::Tensor& x, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& scale,
    const std::optional<at::Tensor>& shift, const at::Tensor& mean, const at::Tensor& rstd, int64_t num_groups,
    Act act, std::array<bool, 5> output_mask);

}  // namespace gn_patch
