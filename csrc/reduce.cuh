// Block- and cluster-level reductions shared by the forward and backward kernels. Every reduction has a fixed
// order, so results are bitwise deterministic.
#pragma once

#include <cooperative_groups.h>

#include "common.cuh"

namespace gn_patch {

// Warps per tile group in the block reductions below: the block's warps are shared out over the tile's groups.
__device__ __forceinline__ int warps_per_group(const Geometry& g) {
  return max(1, (int)(blockDim.x / 32) / g.groups_per_tile);
}

// Per-warp parts of a block's group totals. Thread t contributes `w` (its group's statistics or sums over its
// rows); afterwards (the function ends with a block barrier, which also publishes the caller's earlier
// shared-memory writes) partial[gl * warps_per_group(g) + p], p < warps_per_group, hold the parts of tile group
// gl's total, which group_total combines.
// items and partial: kMaxThreads entries of shared memory. With one group per tile every thread is in it, and each
// warp combines its own lanes (one barrier); otherwise the warps assigned to a group read its
// vecs_per_group * block_rows items and combine them by butterflies (two).
template <typename Acc, typename Combine>
__device__ __forceinline__ void block_group_partials(const Acc& w, Acc* items, Acc* partial, const Geometry& g,
                                                     Combine combine) {
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (g.groups_per_tile == 1) {  // no barrier before the butterflies: partial[warp] is warp `warp`'s total
    const Acc acc = lanes_reduce(w, 32, combine);
    if (lane == 0) partial[warp] = acc;
    __syncthreads();
    return;
  }
  items[threadIdx.x] = w;
  __syncthreads();
  const int groups = g.groups_per_tile;
  const int per_warp = warps_per_group(g);
  const int concurrent = warps / per_warp;
  const int per_group = g.vecs_per_group * g.block_rows;
  for (int g0 = 0; g0 < groups; g0 += concurrent) {  // uniform across the block
    const int gl = g0 + warp / per_warp, part = warp % per_warp;
    const bool on = warp < concurrent * per_warp && gl < groups;
    Acc acc{};
    if (on) {
      for (int i = part * 32 + lane; i < per_group; i += per_warp * 32) {
        const int rowlane = (int)g.div_vecs_per_group.div(i);
        const int k = i - rowlane * g.vecs_per_group;
        acc = combine(acc, items[rowlane * g.tile_vecs + gl * g.vecs_per_group + k]);
      }
    }
    acc = lanes_reduce(acc, 32, combine);
    if (on && lane == 0) partial[gl * per_warp + part] = acc;
  }
  __syncthreads();
}

// block_group_partials for straddling vectors (Geometry::straddle): thread t contributes lo to the group of its
// vector's first channel and hi to the next group (empty when its vector lies in one group). A tile group's
// contributors in each row are the vectors from the one holding its first channel to the one holding its last:
// the first of them through hi when it starts in the previous group.
// items, items_hi and partial: kMaxThreads entries of shared memory.
template <typename Acc, typename Combine>
__device__ __forceinline__ void block_group_partials_straddle(const Acc& lo, const Acc& hi, Acc* items, Acc* items_hi,
                                                              Acc* partial, const Geometry& g, Combine combine) {
  items[threadIdx.x] = lo;
  items_hi[threadIdx.x] = hi;
  __syncthreads();
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int groups = g.groups_per_tile, D = (int)g.D;
  const int per_warp = warps_per_group(g);
  const int concurrent = warps / per_warp;
  for (int g0 = 0; g0 < groups; g0 += concurrent) {  // uniform across the block
    const int gl = g0 + warp / per_warp, part = warp % per_warp;
    const bool on = warp < concurrent * per_warp && gl < groups;
    Acc acc{};
    if (on) {
      const int first = gl * D / g.vec, cols = ((gl + 1) * D - 1) / g.vec - first + 1;
      for (int i = part * 32 + lane; i < cols * g.block_rows; i += per_warp * 32) {
        const int rowlane = i / cols, col = first + i - rowlane * cols;
        const Acc* from = col * g.vec < gl * D ? items_hi : items;
        acc = combine(acc, from[rowlane * g.tile_vecs + col]);
      }
    }
    acc = lanes_reduce(acc, 32, combine);
    if (on && lane == 0) partial[gl * per_warp + part] = acc;
  }
  __syncthreads();
}

// Tile group gl's total in the block, from block_group_partials' `partial`, in a fixed order: every thread that
// asks gets the same bits, so each thread can take its own group's total without a further barrier.
template <typename Acc, typename Combine>
__device__ __forceinline__ Acc group_total(const Acc* partial, int gl, const Geometry& g, Combine combine) {
  const int per_warp = warps_per_group(g);
  Acc acc = partial[gl * per_warp];
  for (int p = 1; p < per_warp; ++p) acc = combine(acc, partial[gl * per_warp + p]);
  return acc;
}

// The total of a one-group tile (groups_per_tile == 1: block_group_partials leaves one part per warp) in every
// thread of the block, with the same bits in each: every warp combines the parts as a butterfly over its lanes and
// takes lane 0's: log2(warps) combining steps where group_total takes warps - 1 in sequence. Every thread of the
// block calls it: it shuffles over whole warps.
template <typename Acc, typename Combine>
__device__ __forceinline__ Acc block_total(const Acc* partial, Combine combine) {
  const int warps = blockDim.x / 32, lane = threadIdx.x % 32;
  int width = 1;
  while (width < warps) width *= 2;
  return shfl(lanes_reduce(lane < warps ? partial[lane] : Acc{}, width, combine), 0);
}

// A value of the thread's group (lo) and, for straddling vectors (Geometry::straddle), of the next group (hi: the
// lanes from lanes_lo on).
template <typename V>
struct GroupPair {
  V lo, hi;
};

// f(0), the value of the thread's group, and f(1), of the next group where its vector straddles (else hi = lo).
// f takes the offset from the thread's group: add it to b.group_local for tile-local arrays, to n * G + b.group for
// global ones.
template <bool Straddle, typename F>
__device__ __forceinline__ auto own_groups(const Geometry& g, const BlockCoord& b, F&& f) -> GroupPair<decltype(f(0))> {
  const auto lo = f(0);
  return {lo, Straddle && b.lanes_lo < g.vec ? f(1) : lo};
}

// Per-channel totals of a block, in two steps around a block barrier (the caller's: block_group_partials ends with
// one). 1. Thread t stores acc[j], its sum for channel (col * V + j) of the tile, to items (kMaxThreads * V entries
// of shared memory). 2. channel_totals calls emit(ch, total) once for each tile channel ch < tile_vecs * V, from
// one thread: `per` lanes (a power of two) sum the rowlanes of one channel.
template <int V>
__device__ __forceinline__ void store_lane_sums(const float2 (&acc)[V], float2* items) {
#pragma unroll
  for (int j = 0; j < V; ++j) items[threadIdx.x * V + j] = acc[j];
}

template <int V, typename Emit>
__device__ __forceinline__ void channel_totals(const float2* items, const Geometry& g, Emit&& emit) {
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
    if (ch < channels && p == 0) emit(ch, s);
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

// Programmatic dependent launch (launch.cuh's `dependent`): the next kernel of the pass may be launched once every
// block of this grid has executed this; its blocks then become resident and wait in wait_for_prerequisite. Called
// first thing: by the time every block of the grid has called it, the last of them has been scheduled, so the
// waiting blocks never hold an SM this grid still needs. Called only where one of ours follows: another library's
// kernel launched as a dependent after ours would otherwise be let in early (correct, if it waits as it must, but
// holding SMs from the start).
__device__ __forceinline__ void let_dependents_launch() {
#if GN_PATCH_CLUSTERS
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// A kernel launched as a dependent waits here, before it reads what the kernel before it wrote, until that kernel
// has completed and its writes are visible (which holds for the kernels before it too: each waited for its own).
// What kernels before the pass's first kernel wrote (x, dy, the parameters) may be read before it. Returns at once
// in a kernel not launched as a dependent.
__device__ __forceinline__ void wait_for_prerequisite() {
#if GN_PATCH_CLUSTERS
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

}  // namespace gn_patch
