// Block-level reductions over the rows a block holds in flight, shared by forward and backward.
#pragma once

#include "common.cuh"

namespace gn_patch {

// Threads per block never exceed this (Geometry keeps tile_vecs * block_rows <= kMaxThreads).
constexpr int kMaxThreads = 256;

__device__ __forceinline__ int next_pow2(int v) {
  int p = 1;
  while (p < v) p <<= 1;
  return p;
}

// Tree-combines each thread's V accumulators with those of the threads holding the same channels in the
// other rows of the block (fixed order: bitwise deterministic). Afterwards smem[col * V + j] holds the
// block total of channel (tile start + col * V + j) and rowlane 0's `acc` equals it.
// smem must hold threads * V entries. Ends with a barrier.
template <typename Acc, int V, typename Combine>
__device__ __forceinline__ void reduce_rowlanes(Acc (&acc)[V], Acc* smem, const Geometry& g, int rowlane,
                                                Combine combine) {
#pragma unroll
  for (int j = 0; j < V; ++j) smem[threadIdx.x * V + j] = acc[j];
  for (int stride = next_pow2(g.block_rows) / 2; stride > 0; stride >>= 1) {
    __syncthreads();
    if (rowlane < stride && rowlane + stride < g.block_rows) {
      const int partner = (threadIdx.x + stride * g.tile_vecs) * V;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        acc[j] = combine(acc[j], smem[partner + j]);
        smem[threadIdx.x * V + j] = acc[j];
      }
    }
  }
  __syncthreads();
}

}  // namespace gn_patch
