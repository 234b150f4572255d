// Block-level reductions over the rows a block holds in flight, shared by forward and backward.
#pragma once

#include "common.cuh"

namespace gn_patch {

// Threads per block never exceed this (Geometry keeps tile_vecs * block_rows <= kMaxThreads).
constexpr int kMaxThreads = 256;

// Resident blocks per SM asked of the compiler through __launch_bounds__, which caps the registers per thread
// (65536 / (kMaxThreads * blocks)). Without the cap the batched, predicated loads let ptxas grow the forward
// passes from ~64 to 100-160 registers, halving the warps in flight that hide DRAM latency and splitting
// mid-size grids into two waves.
constexpr int kNormalizeBlocksPerSm = 4;  // normalize: <= 64 registers
constexpr int kStatsBlocksPerSm = 3;      // stats_partial: <= 85 registers
constexpr int kGradBlocksPerSm = 2;       // grad_partial, dx, fused_backward: <= 128 registers
// fused_forward (<= 128 registers): holds its rows, or the affine parameters through the statistics. Its
// grids are mostly under one wave (few, small images), where occupancy does not limit it.
constexpr int kFusedBlocksPerSm = 2;

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

// Channels of a tile of whole groups -> groups: warp w reduces groups w, w + warps, ... of the tile;
// value(i) gives channel i of the tile; emit(group_in_tile, total) runs on lane 0. Fixed order.
template <typename Acc, typename Value, typename Combine, typename WarpReduce, typename Emit>
__device__ __forceinline__ void reduce_tile_groups(int64_t tile_groups, int64_t D, Value value, Combine combine,
                                                   WarpReduce warp_reduce, Emit emit) {
  const int lane = threadIdx.x % 32;
  for (int64_t gl = threadIdx.x / 32; gl < tile_groups; gl += blockDim.x / 32) {
    Acc acc{};
    for (int64_t i = lane; i < D; i += 32) acc = combine(acc, value(gl * D + i));
    acc = warp_reduce(acc);
    if (lane == 0) emit(gl, acc);
  }
}

// Whole-block reduction in fixed order; the result is valid in thread 0. blockDim.x a multiple of 32.
template <typename Acc, typename Combine, typename WarpReduce>
__device__ __forceinline__ Acc block_reduce(Acc acc, Combine combine, WarpReduce warp_reduce) {
  __shared__ Acc warp_totals[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  acc = warp_reduce(acc);
  if (lane == 0) warp_totals[warp] = acc;
  __syncthreads();
  if (warp == 0) {
    acc = lane < (int)(blockDim.x / 32) ? warp_totals[lane] : Acc{};
    acc = warp_reduce(acc);
  }
  return acc;
}

// Channels of tile `tile` (the last tile of a row can be partial).
__device__ __forceinline__ int64_t tile_first_channel(const Geometry& g, int64_t tile) {
  return tile * g.tile_vecs * g.vec;
}
__device__ __forceinline__ int64_t tile_channel_count(const Geometry& g, int64_t tile) {
  return min((int64_t)g.tile_vecs * g.vec, g.C - tile_first_channel(g, tile));
}

// Blocks of the finalize kernels: one per (n, g).
constexpr int kFinalizeThreads = 256;

}  // namespace gn_patch
