// See aten_path.h.
#include "aten_path.h"

#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/gelu_backward.h>
#include <ATen/ops/mish.h>
#include <ATen/ops/mish_backward.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/native_group_norm.h>
#include <ATen/ops/native_group_norm_backward.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/silu_backward.h>
#include <ATen/ops/sub.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/threshold_backward.h>

#include <vector>

#include "op_checks.h"

namespace gn_patch {

at::Tensor apply_activation(const at::Tensor& u, Act act) {
  switch (act) {
    case Act::kSilu: return at::silu(u);
    case Act::kGelu: return at::gelu(u, "none");
    case Act::kGeluTanh: return at::gelu(u, "tanh");
    case Act::kRelu: return at::relu(u);
    case Act::kMish: return at::mish(u);
    case Act::kIdentity: break;
  }
  return u;
}

at::Tensor activation_backward(const at::Tensor& grad_out, const at::Tensor& u, Act act) {
  switch (act) {
    case Act::kSilu: return at::silu_backward(grad_out, u);
    case Act::kGelu: return at::gelu_backward(grad_out, u, "none");
    case Act::kGeluTanh: return at::gelu_backward(grad_out, u, "tanh");
    case Act::kRelu: return at::threshold_backward(grad_out, at::relu(u), 0);
    case Act::kMish: return at::mish_backward(grad_out, u);
    case Act::kIdentity: break;
  }
  return grad_out;
}

namespace {

using OptTensor = std::optional<at::Tensor>;

// Wide groups are rare: computed in float64, so that their statistics survive any offset or outlier.
constexpr auto kAcc = at::kDouble;

OptTensor upcast(const OptTensor& t) { return t ? OptTensor(t->to(kAcc)) : std::nullopt; }

int64_t spatial(const at::Tensor& x) { return x.numel() / (x.size(0) * x.size(1)); }

std::vector<int64_t> spatial_dims(const at::Tensor& x) {
  std::vector<int64_t> dims;
  for (int64_t d = 2; d < x.dim(); ++d) dims.push_back(d);
  return dims;
}

at::Tensor modulate(at::Tensor v, const OptTensor& scale, const OptTensor& shift, const at::Tensor& x) {
  if (scale) v = at::mul(v, at::add(sample_view(*scale, x), 1));
  if (shift) v = at::add(v, sample_view(*shift, x));
  return v;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> aten_forward(const at::Tensor& input, const OptTensor& weight,
                                                            const OptTensor& bias, const OptTensor& scale,
                                                            const OptTensor& shift, int64_t num_groups, double eps,
                                                            Act act) {
  const at::Tensor x = input.to(kAcc).contiguous();
  auto [v, mean, rstd] = at::native_group_norm(x, upcast(weight), upcast(bias), x.size(0), x.size(1), spatial(x),
                                               num_groups, eps);
  const at::Tensor y = apply_activation(modulate(v, upcast(scale), upcast(shift), x), act);
  return {at::empty_like(input).copy_(y), mean.to(at::kFloat), rstd.to(at::kFloat)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> aten_backward(
    const at::Tensor& grad_out, const at::Tensor& input, const OptTensor& weight, const OptTensor& bias,
    const OptTensor& scale, const OptTensor& shift, const at::Tensor& mean, const at::Tensor& rstd,
    int64_t num_groups, Act act, std::array<bool, 5> mask) {
  const at::Tensor x = input.to(kAcc).contiguous();
  const int64_t N = x.size(0), C = x.size(1);
  const OptTensor w = upcast(weight), b = upcast(bias), s = upcast(scale), t = upcast(shift);
  const at::Tensor mean64 = mean.to(kAcc), rstd64 = rstd.to(kAcc);
  const std::vector<int64_t> group_shape = {N, num_groups, -1};
  const at::Tensor xhat =
      at::mul(at::sub(x.reshape(group_shape), mean64.unsqueeze(-1)), rstd64.unsqueeze(-1)).reshape(x.sizes());
  at::Tensor v = xhat;
  if (w) v = at::mul(v, channel_view(*w, x));
  if (b) v = at::add(v, channel_view(*b, x));
  // Every operand NCHW-contiguous: native_group_norm_backward reads dv with x's layout.
  const at::Tensor du = activation_backward(grad_out.to(kAcc).contiguous(), modulate(v, s, t, x), act);
  const at::Tensor dv = s ? at::mul(du, at::add(sample_view(*s, x), 1)) : du;
  // native_group_norm_backward allocates the bias gradient like the weight ("tensor does not have a device"
  // without one, torch 2.11): a weight of ones gives the same dx.
  const OptTensor gamma = !w && b && mask[2] ? OptTensor(at::ones_like(*b)) : w;
  auto [dx, dweight, dbias] = at::native_group_norm_backward(
      dv.contiguous(), x, mean64, rstd64, gamma, N, C, spatial(x), num_groups, {mask[0], mask[1] && w.has_value(), mask[2] && b.has_value()});
  const auto none = input.options();
  auto like = [&](bool needed, const at::Tensor& value, const at::Tensor& target) {
    return needed ? at::empty_like(target).copy_(value) : at::empty({0}, none);
  };
  const std::vector<int64_t> dims = spatial_dims(x);
  auto per_sample_sum = [&](const at::Tensor& value) { return dims.empty() ? value : at::sum(value, dims); };
  return {like(mask[0], dx, input),
          like(mask[1] && weight.has_value(), dweight, weight ? *weight : input),
          like(mask[2] && bias.has_value(), dbias, bias ? *bias : input),
          like(mask[3] && scale.has_value(), mask[3] && scale ? per_sample_sum(at::mul(du, v)) : du, scale ? *scale : input),
          like(mask[4] && shift.has_value(), mask[4] && shift ? per_sample_sum(du) : du, shift ? *shift : input)};
}

}  // namespace gn_patch
