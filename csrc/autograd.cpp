// The host path of a call, in C++: the autograd kernel of gn_patch::group_norm_act, and the op
// gn_patch::group_norm_act_dispatch that gn_patch.group_norm_act and GroupNormAct.forward call once per call. It
// sends what the kernels take to gn_patch::group_norm_act and everything else to PyTorch's own ops, computing
// exactly what F.group_norm, diffusers' `* (1 + scale) + shift` and the activation compute.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/add.h>
#include <ATen/ops/group_norm.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/ones_like.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>

#include "aten_path.h"
#include "op_checks.h"

namespace gn_patch {
namespace {

using OptTensor = std::optional<at::Tensor>;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

const auto& forward_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("gn_patch::group_norm_act", "")
          .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const OptTensor&, const OptTensor&,
                                                                const OptTensor&, const OptTensor&, int64_t, double,
                                                                c10::string_view, const OptTensor&,
                                                                const OptTensor&, bool)>();
  return op;
}

// gn_patch::group_norm_act's y alone, for calls that record no gradient: no mean or rstd allocated.
const auto& inference_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("gn_patch::group_norm_act_inference", "")
          .typed<at::Tensor(const at::Tensor&, const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&,
                            int64_t, double, c10::string_view, const OptTensor&, const OptTensor&, bool)>();
  return op;
}

const auto& backward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("gn_patch::group_norm_act_backward", "")
                             .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
                                 const at::Tensor&, const at::Tensor&, const OptTensor&, const OptTensor&,
                                 const OptTensor&, const OptTensor&, const at::Tensor&, const at::Tensor&, int64_t,
                                 c10::string_view, std::array<bool, 5>)>();
  return op;
}

// Sizes are SymInts throughout this file: under torch.compile with dynamic shapes the dispatching op runs on
// fake tensors with symbolic sizes, and a decision that needs a value guards on it.
bool holds(const c10::SymBool& b) { return b.guard_bool(__FILE__, __LINE__); }

// scale or shift as a view that broadcasts against x: (N, C) or (N, C, 1, ...) -> (N, C, 1, ..., 1) with x's rank.
// Of x's rank, a batch of 1 on either side broadcasts as stock's `h * (1 + scale) + shift` does: a batch-1 scale or
// shift is expanded over x's batch (one timestep embedding for every image; a view, autograd sums its gradient),
// and one of batch M beside an x of batch 1 is returned as it is (one image for M embeddings: y has batch M, which
// PyTorch's ops compute, kernel_covers declining it). An x of fewer than 2 dims is left to the group norm's check.
OptTensor broadcastable(const OptTensor& t, const at::Tensor& x, const char* name) {
  if (!t.has_value() || x.dim() < 2) return t;
  const c10::SymInt& N = x.sym_size(0);
  const bool of_x_rank = t->dim() == x.dim();
  bool ok = t->dim() >= 2 && t->dim() <= x.dim() && holds(t->sym_size(1).sym_eq(x.sym_size(1)));
  for (int64_t d = 2; ok && d < t->dim(); ++d) ok = holds(t->sym_size(d).sym_eq(1));
  const bool one_for_all = ok && of_x_rank && holds(t->sym_size(0).sym_eq(1));
  const bool per_sample = ok && !one_for_all && holds(t->sym_size(0).sym_eq(N));
  const bool over_x = ok && of_x_rank && !one_for_all && !per_sample && holds(N.sym_eq(1));
  TORCH_CHECK_VALUE(one_for_all || per_sample || over_x,
                    std::string("gn_patch.group_norm_act: ") + name + " must have shape (N, C) or (N, C, 1, ...) "
                        "with N x's batch, for input of shape " + shape_str(x.sym_sizes()) + "; got " +
                        shape_str(t->sym_sizes()) + " (with x's rank, a batch of 1 on either side broadcasts, as in "
                        "h * (1 + scale) + shift)");
  if (over_x) return t;
  if (per_sample) return sample_view(*t, x);
  std::vector<c10::SymInt> over_the_batch = t->sym_sizes().vec();
  over_the_batch[0] = N;
  return t->expand_symint(over_the_batch);
}

// With an x of batch 1, a scale and a shift of x's rank broadcast against each other too: their batches must be
// equal or 1 (a ValueError as for any other modulation shape, where PyTorch's broadcast would raise a RuntimeError).
void check_modulation_batches(const OptTensor& scale, const OptTensor& shift, const at::Tensor& x) {
  if (!scale.has_value() || !shift.has_value() || x.dim() < 2) return;
  const c10::SymInt &a = scale->sym_size(0), &b = shift->sym_size(0);
  TORCH_CHECK_VALUE(holds(a.sym_eq(b)) || holds(a.sym_eq(1)) || holds(b.sym_eq(1)),
                    "gn_patch.group_norm_act: scale and shift of batches " + shape_str(scale->sym_sizes()) + " and " +
                        shape_str(shift->sym_sizes()) + " do not broadcast together for input of shape " +
                        shape_str(x.sym_sizes()));
}

OptTensor per_sample(const OptTensor& t) {
  return t.has_value() ? OptTensor(t->reshape_symint({t->sym_size(0), t->sym_size(1)})) : t;
}

// F.group_norm's _verify_batch_size: a group of one value per image is an error, whichever path computes it.
void check_values_per_group(const at::Tensor& x, int64_t num_groups) {
  if (x.dim() < 2 || num_groups == 0) return;  // the op's or torch.group_norm's own checks report these
  c10::SymInt values = x.sym_size(0) * x.sym_size(1) / num_groups;
  for (int64_t d = 2; d < x.dim(); ++d) values = values * x.sym_size(d);
  TORCH_CHECK_VALUE(!holds(values.sym_eq(1)),
                    "Expected more than 1 value per channel when training, got input size " + shape_str(x.sym_sizes()));
}

bool needs_grad(const OptTensor& t) { return t.has_value() && t->requires_grad(); }

// A torch.func transform (vmap, grad, jvp, ...) wraps t: functorch cannot be asked for its per-sample layout, nor copy
// it to channels-last ("NYI: ... inside vmap").
bool functorch_wrapped(const at::Tensor& t) {
  static const c10::DispatchKeySet functorch({c10::DispatchKey::FuncTorchBatched, c10::DispatchKey::FuncTorchGradWrapper,
                                              c10::DispatchKey::BatchedNestedTensor});
  return t.key_set().has_any(functorch);
}

// at::group_norm, steered around two faults of PyTorch's GroupNorm backward: a SIGSEGV of the CPU kernel (torch
// 2.13) for channels-last input when the input needs no gradient but the weight or bias does (norm-only
// fine-tuning of a channels-last model: the first norm's input comes from a frozen conv), and "tensor does not have
// a device" for a bias without a weight (CPU on torch 2.13, CUDA on torch 2.11). The first runs from an
// NCHW-contiguous copy (NCHW kernel's values, PyTorch's layout), the second with a weight of ones (the same
// values: x̂ * 1 is exact). Outside these cases: PyTorch's own call.
at::Tensor safe_group_norm(const at::Tensor& x, int64_t num_groups, const OptTensor& weight, const OptTensor& bias,
                           double eps) {
  const bool training = at::GradMode::is_enabled(), cpu_training = x.is_cpu() && training;
  const OptTensor w = training && !weight.has_value() && needs_grad(bias) ? OptTensor(at::ones_like(*bias)) : weight;
  const bool crashing_backward = cpu_training && !x.requires_grad() && (needs_grad(weight) || needs_grad(bias)) &&
                                 !functorch_wrapped(x) && x.suggest_memory_format() != at::MemoryFormat::Contiguous;
  const bool cudnn = at::globalContext().userEnabledCuDNN();
  if (crashing_backward) return at::group_norm(x.contiguous(), num_groups, w, bias, eps, cudnn);
  return at::group_norm(x, num_groups, w, bias, eps, cudnn);
}

// act(F.group_norm(x) * (1 + scale) + shift) with PyTorch's ops, as diffusers writes it (scale and shift already
// broadcastable). On the CPU, y has the layout PyTorch's CPU kernel gives it (x's suggested memory format), stated
// here because the fake (meta) group_norm of torch 2.14 returns NCHW for channels-last input: torch.compile and
// torch.export then trace the layout the real call returns.
at::Tensor pytorch_path(const at::Tensor& x, int64_t num_groups, const OptTensor& weight, const OptTensor& bias,
                        double eps, Act act, const OptTensor& scale, const OptTensor& shift) {
  TORCH_CHECK(x.dim() >= 2, "Expected at least 2 dimensions for input tensor but received " + std::to_string(x.dim()));
  at::Tensor y = safe_group_norm(x, num_groups, weight, bias, eps);
  if (x.is_cpu() && !functorch_wrapped(y)) y = y.contiguous(x.suggest_memory_format());  // x's wrapping wraps y
  if (scale.has_value()) y = at::mul(y, at::add(*scale, 1));
  if (shift.has_value()) y = at::add(y, *shift);
  return apply_activation(y, act);
}

// The Function's one output is y. mean and rstd, which have no gradient, are handed out through `statistics` beside
// it: as outputs of the Function they would have to be marked non-differentiable, which compiled autograd
// (torch._dynamo's, for torch.compile'd training) refuses in a C++ Function; as the op's outputs they are plain
// tensors that require no gradient, as they were.
using Statistics = std::array<at::Tensor, 2>;

class GroupNormActFunction : public torch::autograd::Function<GroupNormActFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const OptTensor& weight,
                               const OptTensor& bias, const OptTensor& scale, const OptTensor& shift,
                               int64_t num_groups, double eps, c10::string_view activation, bool frames_last,
                               Statistics* statistics) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    // With frames_last, y's layout differs from x's: the backward op takes the gradient in x's layout (a copy).
    auto [y, mean, rstd] = forward_op().call(x, weight, bias, scale, shift, num_groups, eps, activation, std::nullopt,
                                             std::nullopt, frames_last);
    *statistics = {mean, rstd};
    // Only the tensors given are saved (undefined entries did not survive AOT tracing's saved-tensor handling);
    // the mask records which.
    variable_list saved = {x, mean, rstd};
    int64_t present = 0;
    for (const auto* p : {&weight, &bias, &scale, &shift}) {
      present = present << 1 | (int64_t)p->has_value();
      if (p->has_value()) saved.push_back(**p);
    }
    ctx->save_for_backward(saved);
    ctx->saved_data["present"] = present;
    ctx->saved_data["num_groups"] = num_groups;
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["activation"] = std::string(activation);
    // An undefined gradient of y (possible since autograd may skip it) is handled in backward, not made zeros.
    ctx->set_materialize_grads(false);
    return {y};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &mean = saved[1], &rstd = saved[2];
    const int64_t present = ctx->saved_data["present"].toInt();
    std::array<OptTensor, 4> params;  // weight, bias, scale, shift
    for (size_t i = 0, next = 3; i < 4; ++i) {
      if (present >> (3 - i) & 1) params[i] = saved[next++];
    }
    const auto& [weight, bias, scale, shift] = params;
    const int64_t num_groups = ctx->saved_data["num_groups"].toInt();
    const std::string activation = ctx->saved_data["activation"].toStringRef();
    // needs_input_grad counts the tensor arguments given: x, then each of weight, bias, scale, shift present.
    std::array<bool, 5> mask = {ctx->needs_input_grad(0), false, false, false, false};
    for (size_t i = 0, edge = 1; i < 4; ++i) {
      if (params[i]) mask[i + 1] = ctx->needs_input_grad(edge++);
    }
    const at::Tensor& grad_y = grads[0];
    variable_list result(10);  // one per argument of forward
    if (!grad_y.defined()) return result;
    if (at::GradMode::is_enabled()) {
      // create_graph=True (double backward, gradient penalties): the gradients must themselves be differentiable.
      // Recompute through PyTorch's ops in float32 (float64 stays float64); the fused backward has no derivative.
      const auto acc = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
      auto up = [&](const OptTensor& t) { return t ? OptTensor(t->to(acc)) : std::nullopt; };
      const at::Tensor y = pytorch_path(x.to(acc), num_groups, up(weight), up(bias), ctx->saved_data["eps"].toDouble(),
                                        parse_activation(activation), broadcastable(up(scale), x, "scale"),
                                        broadcastable(up(shift), x, "shift"));
      const std::array<OptTensor, 5> inputs = {x, weight, bias, scale, shift};
      variable_list leaves;
      for (size_t i = 0; i < 5; ++i) {
        if (mask[i]) leaves.push_back(*inputs[i]);
      }
      const variable_list g = torch::autograd::grad({y}, leaves, {grad_y.to(acc)}, /*retain_graph=*/true,
                                                    /*create_graph=*/true, /*allow_unused=*/true);
      for (size_t i = 0, k = 0; i < 5; ++i) {
        if (mask[i]) result[i] = g[k++];
      }
      return result;
    }
    auto grads_out =
        backward_op().call(grad_y, x, weight, bias, scale, shift, mean, rstd, num_groups, activation, mask);
    const std::array<at::Tensor, 5> outputs = {std::get<0>(grads_out), std::get<1>(grads_out),
                                               std::get<2>(grads_out), std::get<3>(grads_out),
                                               std::get<4>(grads_out)};
    for (size_t i = 0; i < 5; ++i) {
      if (mask[i]) result[i] = outputs[i];
    }
    return result;
  }
};

using Inputs = std::initializer_list<const OptTensor*>;

// Grad mode is on and x or one of the optional inputs requires a gradient: autograd must record the call.
bool records_gradient(const at::Tensor& x, Inputs inputs) {
  return at::GradMode::is_enabled() && (x.requires_grad() || std::any_of(inputs.begin(), inputs.end(), [](auto* p) {
                                          return p->has_value() && (*p)->requires_grad();
                                        }));
}

bool has_forward_grad(const at::Tensor& x, Inputs inputs) {
  return x._fw_grad(/*level=*/0).defined() || std::any_of(inputs.begin(), inputs.end(), [](auto* p) {
           return p->has_value() && (*p)->_fw_grad(/*level=*/0).defined();
         });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> group_norm_act_autograd(const at::Tensor& x, const OptTensor& weight,
                                                                       const OptTensor& bias, const OptTensor& scale,
                                                                       const OptTensor& shift, int64_t num_groups,
                                                                       double eps, c10::string_view activation,
                                                                       const OptTensor& input_offset,
                                                                       const OptTensor& input_bias, bool frames_last) {
  // Nothing to record (no_grad, as diffusers' pipelines run, or no input needing a gradient): the op runs below
  // autograd without the Function's node and saved state. Forward-mode AD keeps the Function, which refuses it.
  const bool needs_grad = records_gradient(x, {&weight, &bias, &scale, &shift, &input_offset, &input_bias});
  // Forward-mode AD is looked for only where the fast path would otherwise be taken: a training call pays nothing.
  const bool forward_ad =
      !needs_grad && has_forward_grad(x, {&weight, &bias, &scale, &shift, &input_offset, &input_bias});
  if (!needs_grad && !forward_ad) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return forward_op().call(x, weight, bias, scale, shift, num_groups, eps, activation, input_offset, input_bias,
                             frames_last);
  }
  if (input_offset.has_value() || input_bias.has_value()) {
    // Recorded as PyTorch's adds, whose backward sums the gradient over the positions each term broadcasts over: the
    // fused backward then sees the sum as its input. A training step pays the adds' passes as stock does; inference
    // does not.
    check_input_terms(x, input_offset, input_bias);
    return group_norm_act_autograd(with_input_terms(x, input_offset, input_bias), weight, bias, scale, shift,
                                   num_groups, eps, activation, std::nullopt, std::nullopt, frames_last);
  }
  Statistics statistics;
  const variable_list out = GroupNormActFunction::apply(x, weight, bias, scale, shift, num_groups, eps, activation,
                                                        frames_last, &statistics);
  return {out[0], statistics[0], statistics[1]};
}

// The dispatching op calls the inference op only where autograd records nothing; a graph traced there (make_fx,
// torch.export's run_decompositions) holds it and may run with gradients: y then comes from group_norm_act and its
// Function, as the dispatching op would have chosen.
at::Tensor group_norm_act_inference_autograd(const at::Tensor& x, const OptTensor& weight, const OptTensor& bias,
                                             const OptTensor& scale, const OptTensor& shift, int64_t num_groups,
                                             double eps, c10::string_view activation, const OptTensor& input_offset,
                                             const OptTensor& input_bias, bool frames_last) {
  const Inputs inputs = {&weight, &bias, &scale, &shift, &input_offset, &input_bias};
  if (records_gradient(x, inputs) || has_forward_grad(x, inputs)) {
    return std::get<0>(group_norm_act_autograd(x, weight, bias, scale, shift, num_groups, eps, activation,
                                               input_offset, input_bias, frames_last));
  }
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return inference_op().call(x, weight, bias, scale, shift, num_groups, eps, activation, input_offset, input_bias,
                             frames_last);
}

// Tests route channels-last CPU inputs to the op's CPU implementation as if it were the CUDA kernels, so that the
// kernel path's dispatch, autograd and tracing run on machines without a GPU.
std::atomic<bool> cpu_emulates_kernels{false};

bool set_cpu_emulates_kernels(bool enabled) { return cpu_emulates_kernels.exchange(enabled); }

// A torch.func transform (vmap, grad, jvp, ...) or forward-mode AD sees this tensor: the kernel op has no batching
// rule or forward derivative, PyTorch's ops do.
bool transformed(const OptTensor& t) {
  return t.has_value() && (functorch_wrapped(*t) || t->_fw_grad(/*level=*/0).defined());
}

// Dense with the channel dimension innermost (see is_channels_last_dense), on symbolic sizes and strides.
bool channels_last_dense(const at::Tensor& x) {
  c10::SymInt expected = 1;
  auto check = [&](int64_t d) {
    const c10::SymInt& size = x.sym_size(d);
    if (TORCH_GUARD_SIZE_OBLIVIOUS(size.sym_ne(1)) && !holds(x.sym_stride(d).sym_eq(expected))) return false;
    expected = expected * size;
    return true;
  };
  if (!check(1)) return false;
  for (int64_t d = x.dim() - 1; d >= 2; --d) {
    if (!check(d)) return false;
  }
  return check(0);
}

bool kernel_covers(const at::Tensor& x, int64_t num_groups, const OptTensor& weight, const OptTensor& bias,
                   const OptTensor& scale, const OptTensor& shift) {
  if (!(x.is_cuda() || (x.is_cpu() && cpu_emulates_kernels.load(std::memory_order_relaxed)))) return false;
  if (!kernel_dtype(x.scalar_type()) || x.dim() < 2 || x.dim() > 5) return false;
  for (const auto& [a, b] : {std::pair{&weight, &bias}, std::pair{&scale, &shift}}) {
    const OptTensor& p = a->has_value() ? *a : *b;
    if (!p.has_value()) continue;
    const auto dtype = p->scalar_type();
    if ((dtype != x.scalar_type() && dtype != at::kFloat) || (a->has_value() && b->has_value() &&
                                                              (*a)->scalar_type() != (*b)->scalar_type())) {
      return false;
    }
  }
  if (transformed(x) || transformed(weight) || transformed(bias) || transformed(scale) || transformed(shift)) {
    return false;
  }
  // A modulation of batch M beside an x of batch 1 (broadcastable leaves it so) makes y of batch M.
  for (const OptTensor* t : {&scale, &shift}) {
    if (t->has_value() && !holds((*t)->sym_size(0).sym_eq(x.sym_size(0)))) return false;
  }
  // Channels are static in practice: guarding on them costs no recompilation.
  const int64_t C = x.sym_size(1).guard_int(__FILE__, __LINE__);
  if (C % num_groups != 0) return false;
  if (TORCH_GUARD_SIZE_OBLIVIOUS(x.sym_numel().sym_eq(0)) && !TORCH_GUARD_SIZE_OBLIVIOUS(x.sym_size(0).sym_eq(0))) {
    return false;
  }
  return channels_last_dense(x);
}

// input_offset as the kernels add it, (N, C, 1, ...) of x's rank (a per-sample channel vector that `x + input_offset`
// broadcasts over the spatial positions), or input_bias, (C,): x's dtype and device, seen by no torch.func transform.
bool term_fusable(const at::Tensor& t, const at::Tensor& x, bool per_sample) {
  if (x.dim() < 2) return false;  // the checks after the adds report it
  if (t.scalar_type() != x.scalar_type() || t.device() != x.device() || transformed(t)) return false;
  if (!per_sample) return t.dim() == 1 && holds(t.sym_size(0).sym_eq(x.sym_size(1)));
  if (t.dim() != x.dim()) return false;
  bool ok = holds(t.sym_size(0).sym_eq(x.sym_size(0))) && holds(t.sym_size(1).sym_eq(x.sym_size(1)));
  for (int64_t d = 2; ok && d < t.dim(); ++d) ok = holds(t.sym_size(d).sym_eq(1));
  return ok;
}

at::Tensor group_norm_act_dispatch(const at::Tensor& x, int64_t num_groups, const OptTensor& weight,
                                   const OptTensor& bias, double eps, c10::string_view activation,
                                   const OptTensor& scale, const OptTensor& shift, const OptTensor& input_offset,
                                   const OptTensor& input_bias, bool frames_last) {
  // Terms the kernels do not add (another dtype or device, an offset of another shape: broadcasting and type
  // promotion) are added as `(x + input_bias) + input_offset` is in PyTorch, errors included; both, to keep the order.
  if ((input_offset.has_value() && !term_fusable(*input_offset, x, /*per_sample=*/true)) ||
      (input_bias.has_value() && !term_fusable(*input_bias, x, /*per_sample=*/false))) {
    at::Tensor sum = x;
    if (input_bias.has_value()) {
      // F.group_norm's message first: x is what is wrong (a 1-D x would broadcast against the bias).
      TORCH_CHECK(x.dim() >= 2, "Expected at least 2 dimensions for input tensor but received " +
                                    std::to_string(x.dim()));
      TORCH_CHECK_VALUE(input_bias->dim() == 1 && holds(input_bias->sym_size(0).sym_eq(x.sym_size(1))),
                        "gn_patch.group_norm_act: input_bias must have shape (C,) for input of shape " +
                            shape_str(x.sym_sizes()) + "; got " + shape_str(input_bias->sym_sizes()));
      sum = with_input_terms(x, std::nullopt, input_bias);
    }
    if (input_offset.has_value()) sum = at::add(sum, *input_offset);
    return group_norm_act_dispatch(sum, num_groups, weight, bias, eps, activation, scale, shift, std::nullopt,
                                   std::nullopt, frames_last);
  }
  const Act act = parse_activation(activation);
  check_num_groups(num_groups);
  check_eps(eps);
  TORCH_CHECK_TYPE(x.is_floating_point() || x.is_complex(),
                   "gn_patch.group_norm_act: x must be a floating-point tensor, got " + dtype_str(x.scalar_type()));
  const OptTensor scale_b = broadcastable(scale, x, "scale"), shift_b = broadcastable(shift, x, "shift");
  check_modulation_batches(scale_b, shift_b, x);
  check_values_per_group(x, num_groups);
  check_frames_last(x, frames_last);
  if (kernel_covers(x, num_groups, weight, bias, scale_b, shift_b)) {
    // Reshaped above autograd, where reshape decomposes into the views that modes and subclasses see.
    const OptTensor scale_n = per_sample(scale_b), shift_n = per_sample(shift_b), offset_n = per_sample(input_offset);
    // kernel_covers and term_fusable leave out forward-mode AD: only a gradient to record decides.
    if (!records_gradient(x, {&weight, &bias, &scale_b, &shift_b, &input_offset, &input_bias})) {
      // Below autograd: the inference op's Autograd kernel would ask again what was just asked (one dispatcher
      // round trip less per inference call). Modes, tracers and autocast still see the call.
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      return inference_op().call(x, weight, bias, scale_n, shift_n, num_groups, eps, activation, offset_n, input_bias,
                                 frames_last);
    }
    return std::get<0>(forward_op().call(x, weight, bias, scale_n, shift_n, num_groups, eps, activation, offset_n,
                                         input_bias, frames_last));
  }
  const at::Tensor y = pytorch_path(with_input_terms(x, per_sample(input_offset), input_bias), num_groups, weight,
                                    bias, eps, act, scale_b, shift_b);
  // frames_last's layout through PyTorch's own ops, which torch.func transforms batch (an empty tensor and copy_ into
  // it would be unbatched).
  return frames_last ? y.permute({0, 3, 4, 2, 1}).contiguous().permute({0, 4, 3, 1, 2}) : y;
}

}  // namespace

TORCH_LIBRARY_IMPL(gn_patch, Autograd, m) {
  m.impl("group_norm_act", &group_norm_act_autograd);
  m.impl("group_norm_act_inference", &group_norm_act_inference_autograd);
}

TORCH_LIBRARY_IMPL(gn_patch, CompositeImplicitAutograd, m) {
  m.impl("group_norm_act_dispatch", &group_norm_act_dispatch);
}

TORCH_LIBRARY_FRAGMENT(gn_patch, m) {
  m.def("_set_cpu_emulates_kernels(bool enabled) -> bool", &set_cpu_emulates_kernels);
}

}  // namespace gn_patch
