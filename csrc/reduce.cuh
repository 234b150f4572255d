// Block- and cluster-level reductions shared by the forward and backward kernels. Every reduction has a fixed
// order, so results are bitwise deterministic.
#pragma once

#include <cooperative_groups.h>

#include "common.cuh"

namespace gn_patch {

// Per-group totals of a block. Thread t contributes `w` (its group's statistics over its rows); afterwards, for
// gl < groups_per_tile, out[gl] holds the block's total of tile group gl (written by thread gl: valid for the
// other threads after a barrier).
// items and partial: kMaxThreads entries of shared memory. Warps share out the groups; a group's
// vecs_per_group * block_rows items are read by all the warps assigned to it and combined by butterflies.
__device__ __forceinline__ void block_group_stats(const Welford& w, Welford* items, Welford* partial, Welford* out,
                                                  const Geometry& g) {
  items[threadIdx.x] = w;
  __syncthreads();
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int groups = g.groups_per_tile;
  const int warps_per_group = max(1, warps / groups);
  const int concurrent = warps / warps_per_group;
  const int per_group = g.vecs_per_group * g.block_rows;
  for (int g0 = 0; g0 < groups; g0 += concurrent) {  // uniform across the block
    const int gl = g0 + warp / warps_per_group, part = warp % warps_per_group;
    const bool on = warp < concurrent * warps_per_group && gl < groups;
    Welford acc{};
    if (on) {
      for (int i = part * 32 + lane; i < per_group; i += warps_per_group * 32) {
        const int rowlane = (int)g.div_vecs_per_group.div(i);
        const int k = i - rowlane * g.vecs_per_group;
        acc = welford_combine(acc, items[rowlane * g.tile_vecs + gl * g.vecs_per_group + k]);
      }
    }
    acc = lanes_reduce(acc, 32, welford_combine);
    if (on && lane == 0) partial[gl * warps_per_group + part] = acc;
  }
  __syncthreads();
  if (threadIdx.x < groups) {
    Welford acc{};
    for (int p = 0; p < warps_per_group; ++p) acc = welford_combine(acc, partial[threadIdx.x * warps_per_group + p]);
    out[threadIdx.x] = acc;
  }
}

// block_group_stats for straddling vectors (Geometry::straddle): thread t contributes lo to the group of its
// vector's first channel and hi to the next group (empty when its vector lies in one group). A tile group's
// contributors in each row are the vectors from the one holding its first channel to the one holding its last:
// the first of them through hi when it starts in the previous group.
// items, items_hi and partial: kMaxThreads entries of shared memory.
__device__ __forceinline__ void block_group_stats_straddle(const Welford& lo, const Welford& hi, Welford* items,
                                                           Welford* items_hi, Welford* partial, Welford* out,
                                                           const Geometry& g) {
  items[threadIdx.x] = lo;
  items_hi[threadIdx.x] = hi;
  __syncthreads();
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int groups = g.groups_per_tile, D = (int)g.D;
  const int warps_per_group = max(1, warps / groups);
  const int concurrent = warps / warps_per_group;
  for (int g0 = 0; g0 < groups; g0 += concurrent) {  // uniform across the block
    const int gl = g0 + warp / warps_per_group, part = warp % warps_per_group;
    const bool on = warp < concurrent * warps_per_group && gl < groups;
    Welford acc{};
    if (on) {
      const int first = gl * D / g.vec, cols = ((gl + 1) * D - 1) / g.vec - first + 1;
      for (int i = part * 32 + lane; i < cols * g.block_rows; i += warps_per_group * 32) {
        const int rowlane = i / cols, col = first + i - rowlane * cols;
        const Welford* from = col * g.vec < gl * D ? items_hi : items;
        acc = welford_combine(acc, from[rowlane * g.tile_vecs + col]);
      }
    }
    acc = lanes_reduce(acc, 32, welford_combine);
    if (on && lane == 0) partial[gl * warps_per_group + part] = acc;
  }
  __syncthreads();
  if (threadIdx.x < groups) {
    Welford acc{};
    for (int p = 0; p < warps_per_group; ++p) acc = welford_combine(acc, partial[threadIdx.x * warps_per_group + p]);
    out[threadIdx.x] = acc;
  }
}

// Per-channel totals of a block. Thread t contributes acc[j] for channel (col * V + j) of the tile; afterwards
// out[ch] holds the block's total of tile channel ch < tile_vecs * V (valid after a barrier).
// items: kMaxThreads * V entries of shared memory. `per` lanes (a power of two) sum the rowlanes of one channel.
template <int V>
__device__ __forceinline__ void block_channel_sums(const float2 (&acc)[V], float2* items, float2* out,
                                                   const Geometry& g) {
#pragma unroll
  for (int j = 0; j < V; ++j) items[threadIdx.x * V + j] = acc[j];
  __syncthreads();
  const int channels = g.tile_vecs * V;
  int per = 1;
  while (per < 32 && per * 2 * channels <= (int)blockDim.x && per < g.block_rows) per *= 2;
  const int concurrent = blockDim.x / per;
  for (int ch0 = 0; ch0 < channels; ch0 += concurrent) {  // uniform across the block
    const int ch = ch0 + threadIdx.x / per, p = threadIdx.x % per;
    float2 s = make_float2(0.f, 0.f);
    if (ch < channels) {
      const int col = ch / V, j = ch - col * V;
      for (int rowlane = p; rowlane < g.block_rows; rowlane += per) {
        s = add2(s, items[(rowlane * g.tile_vecs + col) * V + j]);
      }
    }
    s = lanes_reduce(s, per, add2);
    if (ch < channels && p == 0) out[ch] = s;
  }
}

// ---------------------------------------------------------------------------------------------
// Thread-block clusters (sm_90+): the blocks of one (n, tile), or of all N images of a tile (Geometry::images),
// exchange their partial results through distributed shared memory. Every thread of every block must reach each
// barrier.
// ---------------------------------------------------------------------------------------------
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define GN_PATCH_CLUSTERS 1
#else
#define GN_PATCH_CLUSTERS 0
#endif

// All blocks' shared-memory writes before this point are visible to every block of the cluster after it (a full
// cluster barrier, release/acquire). Also a block-level barrier. Without clusters: __syncthreads().
__device__ __forceinline__ void cluster_sync(int cluster) {
#if GN_PATCH_CLUSTERS
  if (cluster > 1) {
    cooperative_groups::this_cluster().sync();
    return;
  }
#endif
  __syncthreads();
}

// Combines in rank order `*local` of the cluster's blocks first, first + 1, ..., first + count - 1 (the same
// result in every block that asks). The remote loads go out four at a time: one distributed-shared-memory round
// trip per four blocks. Without a cluster (cluster == 1): *local.
template <typename Acc, typename Combine>
__device__ __forceinline__ Acc cluster_reduce(Acc* local, int cluster, int first, int count, Combine combine) {
#if GN_PATCH_CLUSTERS
  if (cluster > 1) {
    constexpr int kBatch = 4;
    const cooperative_groups::cluster_group group = cooperative_groups::this_cluster();
    Acc acc{};
    for (int r0 = 0; r0 < count; r0 += kBatch) {
      Acc part[kBatch];
#pragma unroll
      for (int r = 0; r < kBatch; ++r) {
        if (r0 + r < count) part[r] = *group.map_shared_rank(local, first + r0 + r);
      }
#pragma unroll
      for (int r = 0; r < kBatch; ++r) {
        if (r0 + r < count) acc = r0 + r == 0 ? part[r] : combine(acc, part[r]);
      }
    }
    return acc;
  }
#endif
  return *local;
}

// Every block of the cluster.
template <typename Acc, typename Combine>
__device__ __forceinline__ Acc cluster_reduce(Acc* local, int cluster, Combine combine) {
  return cluster_reduce(local, cluster, 0, cluster, combine);
}

// The peers have finished reading this block's shared memory: arrive after the last remote read, wait before the
// block exits (its shared memory is released then). Block-local barriers between them are unaffected.
__device__ __forceinline__ void cluster_arrive(int cluster) {
#if GN_PATCH_CLUSTERS
  if (cluster > 1) cooperative_groups::this_cluster().barrier_arrive();
#endif
}

__device__ __forceinline__ void cluster_wait(int cluster) {
#if GN_PATCH_CLUSTERS
  if (cluster > 1) cooperative_groups::this_cluster().barrier_wait();
#endif
}

}  // namespace gn_patch
