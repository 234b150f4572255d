// Forward: y = act(((x - mean[n,g]) * rstd[n,g] * weight[c] + bias[c]) * (1 + scale[n,c]) + shift[n,c]) on
// channels-last (N, S, C) data.
//
// Clustered (one kernel; grid N * tiles * splits, see Geometry): each block reduces its rows of its tile's groups
// to per-group Welford statistics; the `splits` blocks of one (n, tile), a thread-block cluster, combine theirs
// through distributed shared memory in rank order; every block then normalises its rows, from registers when
// resident, else read again, last first (from L2: the block read them moments before).
// Unclustered (large images, wide tiles, more splits than a cluster holds):
//   1. stats_kernel     the blocks' per-group statistics -> scratch
//   2. finalize_kernel  one warp per (n, g) combines the splits' -> mean, rstd
//   3. normalize_kernel grid as 1, walked in reverse to start on the rows still in L2.
//
// Within a thread, statistics are sums of deviations from the batch's first element (one pass over the rows held
// in registers); across threads and blocks, Chan combinations with a reference value per partial (common.cuh).
#include "launch.cuh"
#include "reduce.cuh"

namespace gn_patch {
namespace {

// Statistics of the first `rows` of U packs in one pass over the registers: sums of the deviations from the
// batch's first element k (the reference), mean = k + s1 / n, m2 = s2 - s1^2 / n. The deviations stay within the
// batch's own spread, so neither a large common offset nor an outlier cancels: the rounding error of m2 is a few
// ulp of n times the squared distance of k from the batch mean, itself part of m2.
template <typename T, int V, int U>
__device__ __forceinline__ Welford rows_stats(const Pack<T, V> (&packs)[U], int rows) {
  if (rows == 0) return Welford{};
  const float k = bits_to_float<T>(pack_element(packs[0], 0));
  float s1 = 0.f, s2 = 0.f;
  auto add_row = [&](const Pack<T, V>& pack) {
    float v[V];
    unpack<T, V>(pack, v);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float d = v[j] - k;
      s1 += d;
      s2 = fmaf(d, d, s2);
    }
  };
  if (rows == U) {  // full batches of streamed rows: no branches
#pragma unroll
    for (int u = 0; u < U; ++u) add_row(packs[u]);
  } else {  // a branch per row, not a select per element: most threads hold fewer than U resident rows
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (u < rows) add_row(packs[u]);
    }
  }
  const float count = (float)(rows * V);
  const float mean = __fdividef(s1, count);  // count <= 128: the approximate quotient is within 2 ulp
  const float m2 = s2 - s1 * mean;
  return Welford{k, mean, m2 < 0.f ? 0.f : m2, count};  // a select, not fmaxf: NaN propagates
}

// Statistics of the rows this thread streams (not resident), a batch of U rows in flight at a time.
template <typename T, int V, int U>
__device__ __forceinline__ Welford streamed_stats(const T* base, const Geometry& g, const BlockCoord& b, int64_t rows) {
  Welford w{};
  for (int64_t u0 = 0; u0 < rows; u0 += U) {
    Pack<T, V> batch[U];  // a fresh array per batch: one carried across iterations went to local memory
    load_rows<T, V, U>(batch, base, g, b, u0, rows);
    w = welford_combine(w, rows_stats<T, V, U>(batch, (int)min((int64_t)U, rows - u0)));
  }
  return w;
}

// y = act((x - ref) * scale + shift) per lane, folding rstd and the mean offset into the channels' affine maps;
// `stats` = (ref, mean offset, rstd) of the thread's group, affine[j] = channel_affine of its vector's channel j.
template <int V>
struct LaneAffine {
  float ref, scale[V], shift[V];

  __device__ __forceinline__ LaneAffine(float4 stats, const float2* affine) : ref(stats.x) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float2 p = affine[j];
      scale[j] = stats.z * p.x;
      shift[j] = fmaf(-stats.y, scale[j], p.y);
    }
  }
};

template <typename T, int V, Act A>
__device__ __forceinline__ void normalize_pack(const Pack<T, V>& pack, T* y, const LaneAffine<V>& l) {
  float v[V];
  unpack<T, V>(pack, v);
#pragma unroll
  for (int j = 0; j < V; ++j) v[j] = Activation<A>::f(fmaf(v[j] - l.ref, l.scale[j], l.shift[j]));
  store_vec<T, V>(y, v);
}

// Streams the thread's rows last batch first: the statistics pass read them first to last, so the rows still in L2
// come first (on the H200, up to 6% off the batch-32 shapes whose blocks' rows outgrow L2 together).
template <typename T, int V, Act A>
__device__ __forceinline__ void normalize_streamed(const T* x, T* y, const Geometry& g, const BlockCoord& b,
                                                   int64_t rows, const LaneAffine<V>& l) {
  for (int64_t batch_index = (rows + kStreamUnroll - 1) / kStreamUnroll - 1; batch_index >= 0; --batch_index) {
    const int64_t u0 = batch_index * kStreamUnroll;
    Pack<T, V> batch[kStreamUnroll];
    load_rows<T, V, kStreamUnroll>(batch, x, g, b, u0, rows);
#pragma unroll
    for (int u = 0; u < kStreamUnroll; ++u) {
      if (u0 + u < rows) normalize_pack<T, V, A>(batch[u], y + thread_row(g, b, u0 + u) * g.C, l);
    }
  }
}

// (reference, mean offset, rstd) of a group's total statistics; writes mean and rstd when `out` is set.
__device__ __forceinline__ float4 group_stats_of(const Welford& t, float eps, float* mean, float* rstd) {
  const float r = rsqrtf(t.m2 / t.count + eps);
  if (mean != nullptr) {
    *mean = t.ref + t.mean;
    *rstd = r;
  }
  return make_float4(t.ref, t.mean, r, 0.f);
}

template <typename T, int V, Act A>
__global__ void __launch_bounds__(kMaxThreads, kForwardBlocksPerSm) forward_kernel(const ForwardArgs a) {
  constexpr int kRows = resident_rows(Pass::kForward, V * sizeof(T));
  __shared__ Welford items[kMaxThreads];
  __shared__ Welford partial[kMaxThreads];
  __shared__ Welford block_stats[kMaxThreads];  // per tile group: read by the cluster's blocks
  __shared__ float4 group_stats[kMaxThreads];   // per tile group: (reference, mean offset, rstd)
  __shared__ float2 tile_affine[kMaxTileChannels];
  const Geometry& g = a.geo;
  const BlockCoord b = block_coord(g);
  const T* x = static_cast<const T*>(a.x) + b.n * g.S * g.C + b.c0;
  const int64_t rows = thread_rows(g, b);

  Pack<T, V> packs[kRows];  // resident rows
  if (g.resident) load_rows<T, V, kRows>(packs, x, g, b, 0, rows);
  load_tile_affine<T>(a, b.n, b.tile, tile_affine);  // in flight with the rows; read after the barriers below
  const Welford w = g.resident ? rows_stats<T, V, kRows>(packs, (int)rows) : streamed_stats<T, V, kRows>(x, g, b, rows);
  block_group_stats(w, items, partial, block_stats, g);
  // The cluster's blocks read each other's block_stats; without a cluster each thread reads back its own.
  if (g.cluster() > 1) cluster_sync(g.cluster());
  if (threadIdx.x < g.groups_per_tile) {
    const int64_t group = b.n * g.G + b.tile * g.groups_per_tile + threadIdx.x;
    const Welford t = cluster_reduce(&block_stats[threadIdx.x], g.cluster(), welford_combine);
    group_stats[threadIdx.x] =
        group_stats_of(t, a.eps, b.rank == 0 ? a.mean + group : nullptr, a.rstd + group);
  }
  cluster_arrive(g.cluster());
  __syncthreads();

  if (b.active) {
    const LaneAffine<V> l(group_stats[b.group_local], &tile_affine[b.col * V]);
    T* y = static_cast<T*>(a.y) + b.n * g.S * g.C + b.c0;
    if (g.resident) {
#pragma unroll
      for (int u = 0; u < kRows; ++u) {
        if (u < rows) normalize_pack<T, V, A>(packs[u], y + thread_row(g, b, u) * g.C, l);
      }
    } else {
      normalize_streamed<T, V, A>(x, y, g, b, rows, l);
    }
  }
  cluster_wait(g.cluster());
}

// Unclustered, 1: the block's per-group statistics -> partials[(n * splits + split) * G + group].
template <typename T, int V>
__global__ void __launch_bounds__(kMaxThreads, kForwardBlocksPerSm) stats_kernel(const ForwardArgs a) {
  // Rows in flight per batch: 32 registers of loads, as before resident rows were capped at 24 (a DRAM-bound pass:
  // one H200 run with batches of resident_rows had the (1, 256, 1024, 1024) forward 10% slower).
  constexpr int kStatsBatch = rows_in_registers(32, V * sizeof(T), 16);
  __shared__ Welford items[kMaxThreads];
  __shared__ Welford partial[kMaxThreads];
  __shared__ Welford block_stats[kMaxThreads];
  const Geometry& g = a.geo;
  const BlockCoord b = block_coord(g);
  const T* x = static_cast<const T*>(a.x) + b.n * g.S * g.C + b.c0;
  block_group_stats(streamed_stats<T, V, kStatsBatch>(x, g, b, thread_rows(g, b)), items, partial, block_stats, g);
  __syncthreads();
  if (threadIdx.x < g.groups_per_tile) {
    const int64_t group = b.tile * g.groups_per_tile + threadIdx.x;
    reinterpret_cast<Welford*>(a.partials)[(b.n * g.splits + b.rank) * g.G + group] = block_stats[threadIdx.x];
  }
}

// Unclustered, 2: one warp per (n, g) combines the splits' partials (lane-strided, then a butterfly: a fixed
// order) -> group_stats, mean, rstd.
constexpr int kFinalizeThreads = 256;

__global__ void finalize_kernel(const ForwardArgs a) {
  const Geometry& g = a.geo;
  const int64_t ng = (int64_t)blockIdx.x * (kFinalizeThreads / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (ng >= g.N * g.G) return;  // whole warps: the butterfly below stays within full warps
  const Welford* partials = reinterpret_cast<const Welford*>(a.partials);
  const int64_t n = ng / g.G, group = ng % g.G;
  Welford w{};
  for (int64_t s = lane; s < g.splits; s += 32) w = welford_combine(w, partials[(n * g.splits + s) * g.G + group]);
  w = lanes_reduce(w, 32, welford_combine);
  if (lane == 0) reinterpret_cast<float4*>(a.group_stats)[ng] = group_stats_of(w, a.eps, a.mean + ng, a.rstd + ng);
}

// Unclustered, 3: normalise the block's rows with its groups' statistics.
template <typename T, int V, Act A>
__global__ void __launch_bounds__(kMaxThreads, kForwardBlocksPerSm) normalize_kernel(const ForwardArgs a) {
  const Geometry& g = a.geo;
  const BlockCoord b = block_coord(g, /*reverse=*/true);
  if (!b.active) return;  // no barriers in this kernel
  const int64_t offset = b.n * g.S * g.C + b.c0;
  float2 affine[V];
  thread_affine<T>(a, b.n, b.c0, affine);
  const LaneAffine<V> l(reinterpret_cast<const float4*>(a.group_stats)[b.n * g.G + b.group], affine);
  normalize_streamed<T, V, A>(static_cast<const T*>(a.x) + offset, static_cast<T*>(a.y) + offset, g, b,
                              thread_rows(g, b), l);
}

template <typename T, int V, Act A>
struct ForwardKernels {
  static void fn(const ForwardArgs& a, cudaStream_t stream) {
    const Geometry& g = a.geo;
    if (g.clustered) return launch_kernel(forward_kernel<T, V, A>, g, stream, a);
    launch_kernel(stats_kernel<T, V>, g, stream, a);
    const unsigned finalize_blocks = (unsigned)((g.N * g.G + kFinalizeThreads / 32 - 1) / (kFinalizeThreads / 32));
    finalize_kernel<<<finalize_blocks, kFinalizeThreads, 0, stream>>>(a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    launch_kernel(normalize_kernel<T, V, A>, g, stream, a);
  }
};

template <typename T, int V, Act A>
struct ForwardMaxCluster {
  static int fn() {
    static std::array<std::atomic<int>, 64> cache{};
    return query_max_cluster(forward_kernel<T, V, A>, cache);
  }
};

}  // namespace

void launch_forward(const ForwardArgs& a, cudaStream_t stream) {
  if (a.geo.blocks() == 0) return;
  dispatch<ForwardKernels>(a.dtype, a.geo.vec, a.act, a, stream);
}

int forward_max_cluster(ScalarKind dtype, int vec, Act act) { return dispatch<ForwardMaxCluster>(dtype, vec, act); }

}  // namespace gn_patch
