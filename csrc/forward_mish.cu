// The forward pass's kernels for Act::kMish (passes.h: one translation unit per pass and activation).
#include "forward.cuh"

template struct gn_patch::ForwardPass<gn_patch::Act::kMish>;
