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

// Instantiated by their own units alone: a unit that includes forward.cuh or backward.cuh does not instantiate
// another activation's pass, whose kernels (internal to each unit) would be a second, different copy.
extern template struct ForwardPass<Act::kIdentity>;
extern template struct ForwardPass<Act::kSilu>;
extern template struct ForwardPass<Act::kGelu>;
extern template struct ForwardPass<Act::kGeluTanh>;
extern template struct ForwardPass<Act::kRelu>;
extern template struct ForwardPass<Act::kMish>;
extern template struct BackwardPass<Act::kIdentity>;
extern template struct BackwardPass<Act::kSilu>;
extern template struct BackwardPass<Act::kGelu>;
extern template struct BackwardPass<Act::kGeluTanh>;
extern template struct BackwardPass<Act::kRelu>;
extern template struct BackwardPass<Act::kMish>;

}  // namespace gn_patch
