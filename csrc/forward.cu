// Forward: y = act((x - mean[n,g]) * rstd[n,g] * weight[c] + bias[c]) on channels-last (N, S, C) data.
//
// Fused geometry (small images or many of them): one kernel, grid (N * tiles): each block gathers the
// statistics of whole groups, then normalises the same rows, kept in registers when each thread has at most
// kReduceUnroll of them, else read a second time (from L2).
// Split geometry (few images, many rows: e.g. a batch-1 VAE decode has N*G = 32 groups for 132 SMs):
//   1. stats_partial  grid (N * splits * tiles): (mean, m2) of one row range per group (or channel) -> scratch
//   2. stats_finalize one block per (n, g): Chan-combines the splits' partials -> mean, rstd (+ mean offset)
//   3. normalize      grid as 1, walked in reverse so it starts on the rows still in L2.
// Cluster geometry (sm_90+, in place of the split one when each thread can hold its rows in registers): the
// splits of one (n, tile) form a thread-block cluster that exchanges per-group partials through distributed
// shared memory; one kernel, x read once.
#include <c10/cuda/CUDAException.h>
#include <cooperative_groups.h>

#include "dispatch.cuh"
#include "reduce.cuh"

namespace gn_patch {
namespace {

// The reference value of each (n, g): x[n, first spatial position, first channel of g]. All statistics of a
// group are accumulated as offsets from it, so large offsets (x = 1000 + 0.001 * noise) neither cancel in
// the sums nor lose precision when partial means are combined or subtracted in float32.
template <typename T>
__device__ __forceinline__ float group_reference(const T* x, const Geometry& g, int64_t n, int64_t group) {
  return to_float(x[n * g.S * g.C + group * g.D]);
}

// Per lane j (channel c0 + j): its group's reference value and the affine parameters. Loaded before the data
// rows, so that these dependent-free loads overlap the data's instead of following the reductions.
template <int V>
struct LaneAffine {
  float ref[V], weight[V], bias[V];
};

template <typename T, int V>
__device__ __forceinline__ void lane_reference(const T* x, const Geometry& g, const BlockCoord& b, float (&ref)[V]) {
#pragma unroll
  for (int j = 0; j < V; ++j) ref[j] = b.active ? group_reference(x, g, b.n, (b.c0 + j) / g.D) : 0.f;
}

template <typename T, int V>
__device__ __forceinline__ LaneAffine<V> load_lane_affine(const ForwardArgs& a, const BlockCoord& b) {
  LaneAffine<V> p;
  lane_reference<T, V>(static_cast<const T*>(a.x), a.geo, b, p.ref);
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int64_t c = b.active ? b.c0 + j : 0;
    p.weight[j] = load_param<T>(a.weight, a.params_fp32, c, 1.f);
    p.bias[j] = load_param<T>(a.bias, a.params_fp32, c, 0.f);
  }
  return p;
}

// Per-channel sums of d = x - ref over the rows one thread visits. Few rows per thread, so the plain sums lose
// little to cancellation; the block then combines the threads' results as Welford triples.
template <int V>
struct ShiftedSums {
  float s1[V] = {}, s2[V] = {};
  float count = 0.f;

  // Adds one row when `valid` (else adds zeros: branch-free, see for_rows).
  template <typename T>
  __device__ __forceinline__ void add(const Pack<T, V>& raw, const float (&ref)[V], bool valid) {
    float v[V];
    unpack<T, V>(raw, v);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float d = valid ? v[j] - ref[j] : 0.f;
      s1[j] += d;
      s2[j] = fmaf(d, d, s2[j]);
    }
    count += valid ? 1.f : 0.f;
  }

  __device__ __forceinline__ void to_welford(Welford (&w)[V]) const {
    const float inv = count > 0.f ? 1.f / count : 0.f;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      w[j].mean = s1[j] * inv;
      w[j].m2 = fmaxf(s2[j] - s1[j] * s1[j] * inv, 0.f);
      w[j].count = count;
    }
  }
};

// Per-thread statistics of its V channels over the rows it visits, as Welford triples whose means are
// offsets from the channel's group reference.
template <typename T, int V>
__device__ __forceinline__ void thread_stats(const T* x, const Geometry& g, const BlockCoord& b, const float (&ref)[V],
                                             Welford (&w)[V]) {
  ShiftedSums<V> sums;
  if (b.active) {
    const T* base = x + b.n * g.S * g.C + b.c0;
    for_rows<kReduceUnroll, kUnroll>(
        b.row_begin + b.rowlane, b.row_end, g.block_rows, [&](int64_t r) { return load_pack<T, V>(base + r * g.C); },
        [&](int64_t, const Pack<T, V>& raw, bool valid) { sums.add(raw, ref, valid); });
  }
  sums.to_welford(w);
}

// y = act((x - ref) * scale + shift) of one row; ref is the group reference (x - ref is exact for x near it),
// scale and shift fold weight, bias, the mean offset and rstd.
template <typename T, int V, Act A>
__device__ __forceinline__ void normalize_row(const Pack<T, V>& raw, T* y, const float (&ref)[V],
                                              const float (&scale)[V], const float (&shift)[V], bool valid) {
  float v[V];
  unpack<T, V>(raw, v);
#pragma unroll
  for (int j = 0; j < V; ++j) v[j] = Activation<A>::f(fmaf(v[j] - ref[j], scale[j], shift[j]));
  if (valid) store_vec<T, V>(y, v);
}

template <typename T, int V, Act A>
__device__ __forceinline__ void normalize_rows(const T* x, T* y, const Geometry& g, const BlockCoord& b,
                                               const float (&ref)[V], const float (&scale)[V],
                                               const float (&shift)[V]) {
  if (!b.active) return;
  const int64_t offset = b.n * g.S * g.C + b.c0;
  for_rows<kUnroll, kUnroll / 2>(
      b.row_begin + b.rowlane, b.row_end, g.block_rows,
      [&](int64_t r) { return load_pack<T, V>(x + offset + r * g.C); },
      [&](int64_t r, const Pack<T, V>& raw, bool valid) {
        normalize_row<T, V, A>(raw, y + offset + r * g.C, ref, scale, shift, valid);
      });
}

// Per lane: scale = rstd * weight and shift = bias - mean_offset * scale, with the group's mean offset and rstd
// read at index (group - group_base).
template <int V>
__device__ __forceinline__ void fold_affine(const LaneAffine<V>& p, const Geometry& g, const BlockCoord& b,
                                            const float* mean_offset, const float* rstd, int64_t group_base,
                                            float (&scale)[V], float (&shift)[V]) {
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int64_t group = b.active ? (b.c0 + j) / g.D - group_base : 0;
    scale[j] = b.active ? rstd[group] * p.weight[j] : 0.f;
    shift[j] = b.active ? p.bias[j] - mean_offset[group] * scale[j] : 0.f;
  }
}

template <typename T, int V>
__global__ void __launch_bounds__(kMaxThreads, kStatsBlocksPerSm) stats_partial_kernel(const ForwardArgs a) {
  __shared__ Welford smem[kMaxThreads * V];
  const Geometry& g = a.geo;
  const BlockCoord b = block_coord(g, /*reverse=*/false);
  float ref[V];
  lane_reference<T, V>(static_cast<const T*>(a.x), g, b, ref);
  Welford w[V];
  thread_stats<T, V>(static_cast<const T*>(a.x), g, b, ref, w);
  reduce_rowlanes<Welford, V>(w, smem, g, b.rowlane, welford_combine);
  float2* out = reinterpret_cast<float2*>(a.partials) + (b.n * g.splits + b.split) * (g.group_tiles ? g.G : g.C);
  if (g.group_tiles) {
    const int64_t c0 = tile_first_channel(g, b.tile);
    reduce_tile_groups<Welford>(
        tile_channel_count(g, b.tile) / g.D, g.D, [&](int64_t i) { return smem[i]; }, welford_combine, warp_welford,
        [&](int64_t gl, const Welford& t) { out[c0 / g.D + gl] = make_float2(t.mean, t.m2); });
  } else if (b.rowlane == 0 && b.active) {
#pragma unroll
    for (int j = 0; j < V; ++j) out[b.c0 + j] = make_float2(w[j].mean, w[j].m2);
  }
}

// One block per (n, g): Chan-combines the group's partials of every split (per group, or per channel when
// tiles split groups), then writes mean, rstd and the mean offset from the group reference.
template <typename T>
__global__ void stats_finalize_kernel(const ForwardArgs a) {
  const Geometry& g = a.geo;
  const int64_t ng = blockIdx.x, n = ng / g.G, grp = ng % g.G;
  const int64_t per_split = g.group_tiles ? 1 : g.D;  // entries of this group in one split
  const float2* part = reinterpret_cast<const float2*>(a.partials);
  Welford acc{};
  for (int64_t i = threadIdx.x; i < g.splits * per_split; i += blockDim.x) {
    const int64_t s = i / per_split;
    const float2 p = part[((n * g.splits + s) * g.G + grp) * per_split + i % per_split];
    const float rows = (float)min(g.rows_per_split, g.S - s * g.rows_per_split);
    acc = welford_combine(acc, Welford{p.x, p.y, rows * (float)(g.D / per_split)});
  }
  acc = block_reduce(acc, welford_combine, warp_welford);
  if (threadIdx.x == 0) {
    a.mean[ng] = group_reference(static_cast<const T*>(a.x), g, n, grp) + acc.mean;
    a.rstd[ng] = rsqrtf(acc.m2 / acc.count + a.eps);
    a.mean_offsets[ng] = acc.mean;
  }
}

template <typename T, int V, Act A>
__global__ void __launch_bounds__(kMaxThreads, kNormalizeBlocksPerSm) normalize_kernel(const ForwardArgs a) {
  const BlockCoord b = block_coord(a.geo, /*reverse=*/true);
  const LaneAffine<V> p = load_lane_affine<T, V>(a, b);
  float scale[V], shift[V];
  const int64_t stats = b.n * a.geo.G;
  fold_affine<V>(p, a.geo, b, a.mean_offsets + stats, a.rstd + stats, 0, scale, shift);
  normalize_rows<T, V, A>(static_cast<const T*>(a.x), static_cast<T*>(a.y), a.geo, b, p.ref, scale, shift);
}

// Fused geometry: the block's tile is whole groups and it sees every row of its image. kResident: every thread
// has at most kReduceUnroll rows (Geometry::resident()), which are read once, kept in registers for the
// normalisation, and so cost one memory round trip; otherwise the normalisation reads them again (from L2).
template <typename T, int V, Act A, bool kResident>
__global__ void __launch_bounds__(kMaxThreads, kFusedBlocksPerSm) fused_forward_kernel(const ForwardArgs a) {
  __shared__ Welford smem[kMaxThreads * V];
  __shared__ float group_offset[kMaxThreads * V];
  __shared__ float group_rstd[kMaxThreads * V];
  const Geometry& g = a.geo;
  const BlockCoord b = block_coord(g, /*reverse=*/false);
  const T* x = static_cast<const T*>(a.x);
  const LaneAffine<V> p = load_lane_affine<T, V>(a, b);
  const int64_t first = b.rowlane, step = g.block_rows, offset = b.n * g.S * g.C + b.c0;
  auto resident_row = [&](int u) { return b.active && first + u * step < g.S; };
  Pack<T, V> rows[kResident ? kReduceUnroll : 1];
  {
    Welford w[V];
    if constexpr (kResident) {
      ShiftedSums<V> sums;
#pragma unroll
      for (int u = 0; u < kReduceUnroll; ++u) {
        if (b.active) rows[u] = load_pack<T, V>(x + offset + min(first + u * step, g.S - 1) * g.C);
      }
#pragma unroll
      for (int u = 0; u < kReduceUnroll; ++u) sums.add(rows[u], p.ref, resident_row(u));
      sums.to_welford(w);
    } else {
      thread_stats<T, V>(x, g, b, p.ref, w);
    }
    reduce_rowlanes<Welford, V>(w, smem, g, b.rowlane, welford_combine);
  }
  // smem[i] now holds channel (tile start + i); warps take the tile's groups in turn.
  const int64_t group_base = tile_first_channel(g, b.tile) / g.D;
  reduce_tile_groups<Welford>(
      tile_channel_count(g, b.tile) / g.D, g.D, [&](int64_t i) { return smem[i]; }, welford_combine, warp_welford,
      [&](int64_t gl, const Welford& t) {
        const float rstd = rsqrtf(t.m2 / t.count + a.eps);
        group_offset[gl] = t.mean;
        group_rstd[gl] = rstd;
        a.mean[b.n * g.G + group_base + gl] = group_reference(x, g, b.n, group_base + gl) + t.mean;
        a.rstd[b.n * g.G + group_base + gl] = rstd;
      });
  __syncthreads();
  float scale[V], shift[V];
  fold_affine<V>(p, g, b, group_offset, group_rstd, group_base, scale, shift);
  T* y = static_cast<T*>(a.y);
  if constexpr (kResident) {
#pragma unroll
    for (int u = 0; u < kReduceUnroll; ++u) {
      normalize_row<T, V, A>(rows[u], y + offset + (first + u * step) * g.C, p.ref, scale, shift, resident_row(u));
    }
  } else {
    normalize_rows<T, V, A>(x, y, g, b, p.ref, scale, shift);
  }
}

// Cluster geometry: block `rank` of the cluster for (n, tile) holds rows [rank * rows_per_split, +rows_per_split),
// at most kClusterRows per thread, in registers. Each block writes its per-group Welford partials to its shared
// memory; after a cluster barrier every block combines the cluster's partials in rank order (the same result in
// every block, bitwise deterministic), normalises its rows and stores them.
template <typename T, int V, Act A>
__global__ void __launch_bounds__(kMaxThreads, kFusedBlocksPerSm) cluster_forward_kernel(const ForwardArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  __shared__ Welford smem[kMaxThreads * V];
  __shared__ Welford block_partial[kMaxClusterTileGroups];
  __shared__ float group_offset[kMaxClusterTileGroups];
  __shared__ float group_rstd[kMaxClusterTileGroups];
  const cg::cluster_group cluster = cg::this_cluster();
  const Geometry& g = a.geo;
  const int64_t cluster_index = blockIdx.x / g.cluster;
  const BlockCoord b = block_coord_at(g, cluster_index / g.tiles, cluster.block_rank(), cluster_index % g.tiles);
  const T* x = static_cast<const T*>(a.x);
  const LaneAffine<V> p = load_lane_affine<T, V>(a, b);
  const int64_t first = b.row_begin + b.rowlane, step = g.block_rows, offset = b.n * g.S * g.C + b.c0;
  auto holds = [&](int u) { return b.active && first + u * step < b.row_end; };
  Pack<T, V> rows[kClusterRows];
  {
    ShiftedSums<V> sums;
#pragma unroll
    for (int u = 0; u < kClusterRows; ++u) {
      // Rows past the split's end load its last row again (never out of bounds) and are masked below.
      if (b.active) rows[u] = load_pack<T, V>(x + offset + max(min(first + u * step, b.row_end - 1), 0l) * g.C);
    }
#pragma unroll
    for (int u = 0; u < kClusterRows; ++u) sums.add(rows[u], p.ref, holds(u));
    Welford w[V];
    sums.to_welford(w);
    reduce_rowlanes<Welford, V>(w, smem, g, b.rowlane, welford_combine);
  }
  const int64_t tile_groups = tile_channel_count(g, b.tile) / g.D;
  const int64_t group_base = tile_first_channel(g, b.tile) / g.D;
  reduce_tile_groups<Welford>(
      tile_groups, g.D, [&](int64_t i) { return smem[i]; }, welford_combine, warp_welford,
      [&](int64_t gl, const Welford& t) { block_partial[gl] = t; });
  cluster.sync();  // every block's partials are written and visible cluster-wide
  if (threadIdx.x < tile_groups) {
    Welford acc{};
    for (int r = 0; r < g.cluster; ++r) {
      acc = welford_combine(acc, *cluster.map_shared_rank(&block_partial[threadIdx.x], r));
    }
    const float rstd = rsqrtf(acc.m2 / acc.count + a.eps);
    group_offset[threadIdx.x] = acc.mean;
    group_rstd[threadIdx.x] = rstd;
    if (b.split == 0) {
      const int64_t group = group_base + threadIdx.x;
      a.mean[b.n * g.G + group] = group_reference(x, g, b.n, group) + acc.mean;
      a.rstd[b.n * g.G + group] = rstd;
    }
  }
  // The peers have read this block's partials (so its shared memory may be released when it exits), and the
  // group statistics are visible to the whole block.
  cluster.sync();
  float scale[V], shift[V];
  fold_affine<V>(p, g, b, group_offset, group_rstd, group_base, scale, shift);
  T* y = static_cast<T*>(a.y);
#pragma unroll
  for (int u = 0; u < kClusterRows; ++u) {
    normalize_row<T, V, A>(rows[u], y + offset + (first + u * step) * g.C, p.ref, scale, shift, holds(u));
  }
#endif
}

template <typename T, int V, Act A>
void launch_cluster(const ForwardArgs& a, cudaStream_t stream) {
  cudaLaunchAttribute cluster_dims;
  cluster_dims.id = cudaLaunchAttributeClusterDimension;
  cluster_dims.val.clusterDim.x = (unsigned)a.geo.cluster;
  cluster_dims.val.clusterDim.y = 1;
  cluster_dims.val.clusterDim.z = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3((unsigned)a.geo.blocks());
  config.blockDim = dim3((unsigned)a.geo.threads());
  config.stream = stream;
  config.attrs = &cluster_dims;
  config.numAttrs = 1;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, cluster_forward_kernel<T, V, A>, a));
}

template <typename T, int V, Act A>
struct Launch {
  static void run(const ForwardArgs& a, cudaStream_t stream) {
    const Geometry& g = a.geo;
    const unsigned threads = g.threads();
    const unsigned blocks = (unsigned)g.blocks();
    if (g.cluster > 0) return launch_cluster<T, V, A>(a, stream);
    if (g.fused) {
      if (g.resident(kReduceUnroll)) {
        fused_forward_kernel<T, V, A, true><<<blocks, threads, 0, stream>>>(a);
      } else {
        fused_forward_kernel<T, V, A, false><<<blocks, threads, 0, stream>>>(a);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      return;
    }
    stats_partial_kernel<T, V><<<blocks, threads, 0, stream>>>(a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    stats_finalize_kernel<T><<<(unsigned)(g.N * g.G), kFinalizeThreads, 0, stream>>>(a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    normalize_kernel<T, V, A><<<blocks, threads, 0, stream>>>(a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

}  // namespace

void launch_forward(const ForwardArgs& a, cudaStream_t stream) { dispatch<Launch>(a, stream); }

}  // namespace gn_patch
