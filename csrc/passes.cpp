// group_norm_act.h's entry points of the passes: each checks what holds for every activation, then calls the
// instance of ForwardPass or BackwardPass (passes.h) for the runtime activation.
#include "passes.h"

#include <c10/util/Exception.h>

namespace gn_patch {
namespace {

// f(Pass<A>{}) for the runtime activation A: f reads the pass's entry points from its argument's type.
template <template <Act> class Pass, typename F>
auto dispatch_activation(Act act, const F& f) {
  switch (act) {
    case Act::kSilu: return f(Pass<Act::kSilu>{});
    case Act::kGelu: return f(Pass<Act::kGelu>{});
    case Act::kGeluTanh: return f(Pass<Act::kGeluTanh>{});
    case Act::kRelu: return f(Pass<Act::kRelu>{});
    case Act::kMish: return f(Pass<Act::kMish>{});
    case Act::kIdentity: break;
  }
  return f(Pass<Act::kIdentity>{});
}

// Straddling kernels exist for 16-byte vectors of 16-bit types only (launch.cuh's kStraddles): a straddling
// geometry for any other vectors would run kernels that keep each thread in one group.
void check_straddling_kernels(const Geometry& g, ScalarKind dtype) {
  TORCH_CHECK(!g.straddle || (dtype != ScalarKind::kFloat && g.vec == 8),
              "gn_patch: straddling geometry for vectors without straddling kernels");
}

}  // namespace

void launch_forward(const ForwardArgs& a, cudaStream_t stream) {
  if (a.geo.blocks() == 0) return;
  check_straddling_kernels(a.geo, a.dtype);
  TORCH_CHECK((a.input_offset == nullptr && a.input_bias == nullptr) || fuses_input_offset(a.act),
              "gn_patch: an input offset or bias for an activation whose kernels do not add it");
  dispatch_activation<ForwardPass>(a.act, [&](auto pass) { decltype(pass)::launch(a, stream); });
}

void launch_backward(const BackwardArgs& a, cudaStream_t stream) {
  if (a.geo.blocks() == 0) return;
  check_straddling_kernels(a.geo, a.dtype);
  dispatch_activation<BackwardPass>(a.act, [&](auto pass) { decltype(pass)::launch(a, stream); });
}

int forward_max_cluster(ScalarKind dtype, int vec, Act act) {
  return dispatch_activation<ForwardPass>(act, [&](auto pass) { return decltype(pass)::max_cluster(dtype, vec); });
}

int backward_max_cluster(ScalarKind dtype, int vec, Act act) {
  return dispatch_activation<BackwardPass>(act, [&](auto pass) { return decltype(pass)::max_cluster(dtype, vec); });
}

const ClusterOccupancy* forward_cluster_occupancy(ScalarKind dtype, int vec, Act act, bool straddle,
                                                  int max_cluster) {
  return dispatch_activation<ForwardPass>(
      act, [&](auto pass) { return decltype(pass)::cluster_occupancy(dtype, vec, straddle, max_cluster); });
}

const ClusterOccupancy* backward_cluster_occupancy(ScalarKind dtype, int vec, Act act, bool straddle,
                                                   int max_cluster) {
  return dispatch_activation<BackwardPass>(
      act, [&](auto pass) { return decltype(pass)::cluster_occupancy(dtype, vec, straddle, max_cluster); });
}

}  // namespace gn_patch
