// The forward and backward passes' entry points for one activation. Each activation's kernels are compiled in a
// translation unit of their own, forward_<activation>.cu and backward_<activation>.cu, which instantiate
// ForwardPass<A> and BackwardPass<A> from forward.cuh and backward.cuh: twelve files a build compiles in parallel,
// where one forward.cu held every activation's kernels (150 s of one core; benchmarks/NOTES.md, session 39).
// passes.cpp selects the instance for the runtime activation.
#pragma once

#include "group_norm_act.h"

namespace gn_patch {

template <Act A>
struct ForwardPass {
  static void launch(const ForwardArgs& args, cudaStream_t stream);
  static int max_cluster(ScalarKind dtype, int vec);
  static const ClusterOccupancy* cluster_occupancy(ScalarKind dtype, int vec, bool straddle, int max_cluster);
};

template <Act A>
struct BackwardPass {
  static void launch(const BackwardArgs& args, cudaStream_t stream);
  static int max_cluster(ScalarKind dtype, int vec);
  static const ClusterOccupancy* cluster_occupancy(ScalarKind dtype, int vec, bool straddle, int max_cluster);
};

}  // namespace gn_patch
