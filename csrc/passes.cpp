// group_norm_act.h's entry points of the passes: each checks what holds for every activation, then calls the
// instance of ForwardPass or BackwardPass (passes.h) for the runtime activation.
#include "passes.h"

#include <c10/util/Exception.h>

namespace gn_patch {
namespace {

// Entry::call<Pass<A>>(args...) for the runtime activation A. An Entry names one entry point of a pass.
template <template <Act> class Pass, typename Entry, typename... Args>
auto dispatch_activation(Act act, const Args&... args) {
  switch (act) {
    case Act::kSilu: return Entry::template call<Pass<Act::kSilu>>(args...);
    case Act::kGelu: return Entry::template call<Pass<Act::kGelu>>(args...);
    case Act::kGeluTanh: return Entry::template call<Pass<Act::kGeluTanh>>(args...);
    case Act::kRelu: return Entry::template call<Pass<Act::kRelu>>(args...);
    case Act::kMish: return Entry::template call<Pass<Act::kMish>>(args...);
    case Act::kIdentity: break;
  }
  return Entry::template call<Pass<Act::kIdentity>>(args...);
}

struct Launch {
  template <typename Pass, typename... Args>
  static void call(const Args&... args) {
    Pass::launch(args...);
  }
};

struct MaxCluster {
  template <typename Pass, typename... Args>
  static int call(const Args&... args) {
    return Pass::max_cluster(args...);
  }
};

struct ClusterOccupancyOf {
  template <typename Pass, typename... Args>
  static const ClusterOccupancy* call(const Args&... args) {
    return Pass::cluster_occupancy(args...);
  }
};

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
  dispatch_activation<ForwardPass, Launch>(a.act, a, stream);
}

void launch_backward(const BackwardArgs& a, cudaStream_t stream) {
  if (a.geo.blocks() == 0) return;
  check_straddling_kernels(a.geo, a.dtype);
  dispatch_activation<BackwardPass, Launch>(a.act, a, stream);
}

int forward_max_cluster(ScalarKind dtype, int vec, Act act) {
  return dispatch_activation<ForwardPass, MaxCluster>(act, dtype, vec);
}

int backward_max_cluster(ScalarKind dtype, int vec, Act act) {
  return dispatch_activation<BackwardPass, MaxCluster>(act, dtype, vec);
}

const ClusterOccupancy* forward_cluster_occupancy(ScalarKind dtype, int vec, Act act, bool straddle,
                                                  int max_cluster) {
  return dispatch_activation<ForwardPass, ClusterOccupancyOf>(act, dtype, vec, straddle, max_cluster);
}

const ClusterOccupancy* backward_cluster_occupancy(ScalarKind dtype, int vec, Act act, bool straddle,
                                                   int max_cluster) {
  return dispatch_activation<BackwardPass, ClusterOccupancyOf>(act, dtype, vec, straddle, max_cluster);
}

}  // namespace gn_patch
