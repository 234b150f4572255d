// The backward pass's kernels for Act::kIdentity (passes.h: one translation unit per pass and activation).
#include "backward.cuh"

template struct gn_patch::BackwardPass<gn_patch::Act::kIdentity>;
