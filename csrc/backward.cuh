// Backward of y = act(u), u = (xhat * w[c] + b[c]) * m[n,c] + shift[n,c], m = 1 + scale, xhat = (x - mean) * rstd:
//   du      = dy * act'(u),  A[n,c] = sum_s du,  B[n,c] = sum_s du * xhat
//   dshift  = A              dscale = w * B + b * A            (per image and channel)
//   dbias   = sum_n m * A    dweight = sum_n m * B
//   dx      = rstd * (gamma * du - mean_g(gamma * du) - xhat * mean_g(gamma * du * xhat)),  gamma = w * m
// where mean_g averages over the M = S * D elements of the group (the normalisation backward, e.g. Ioffe &
// Szegedy 2015, applied per (n, g)), i.e. mean_g(gamma * du) = sum_{c in g} gamma_c * A[n,c] / M.
//
// Clustered (one kernel, the forward's kind of geometry): each block sums A and B per channel over its rows, the
// blocks of each image in the cluster combine theirs in rank order through distributed shared memory, and every
// block computes dx for its rows (from registers when resident). A block without a cluster (splits = 1) reduces
// each thread's gamma-weighted sums per group alongside its channel sums, each thread combining its own group's
// parts after the one barrier, and writes the parameter gradients after dx.
// Unclustered: 1. sums_kernel (the blocks' channel sums -> scratch), 2. coefficients_kernel (one block per
// (n, g): channel totals over the splits, the parameter gradients, the dx coefficients), 3. dx_kernel.
// Straddling geometries (Geometry::straddle: 16-byte vectors over groups of more than 8 16-bit channels, not a
// multiple of 8, as in the forward) run the same kernels instantiated with Straddle: the channel sums are per lane
// whatever the group; a thread's lanes past lanes_lo take the next group's mean, rstd and dx coefficients.
// With N > 1 the per-image parameter sums go to scratch and param_grad_kernel sums them over the images in a
// fixed order, unless one cluster holds all the images of a tile (Geometry::images): its first block then sums
// them through distributed shared memory. No atomics: gradients are bitwise deterministic. The kernels after the
// first are launched as dependents of the one before (launch.cuh's programmatic_launch): launched early, they wait
// for it in wait_for_prerequisite.
//
// Compiled once per activation: backward_<activation>.cu instantiates BackwardPass<A> (passes.h), defined at the end.
#pragma once

#include "launch.cuh"
#include "passes.h"
#include "reduce.cuh"

namespace gn_patch {
namespace {

template <typename T>
__device__ __forceinline__ void store_param(void* p, bool fp32, int64_t i, float v) {
  if (fp32) {
    static_cast<float*>(p)[i] = v;
  } else {
    static_cast<T*>(p)[i] = from_float<T>(v);
  }
}

// (mean, rstd) of the thread's group (.lo) and, straddling, of the next group (.hi: the lanes from lanes_lo on).
using Moments = GroupPair<float2>;

// Per-lane constants: u = xhat * gamma + delta, xhat = (x - mean) * rstd with the lane's group's moments.
template <int V, bool Straddle = false>
struct LaneConstants {
  Moments moments;
  int lanes_lo;
  float gamma[V], delta[V];

  // The value of lane j's group, of the thread's (lo) or the next (hi): a select per lane where the vector straddles
  // (j is a compile-time lane index).
  __device__ __forceinline__ float2 lane_select(int j, float2 lo, float2 hi) const {
    return Straddle && j >= lanes_lo ? hi : lo;
  }
  __device__ __forceinline__ float2 lane_moments(int j) const { return lane_select(j, moments.lo, moments.hi); }
  __device__ __forceinline__ float xhat(int j, float x) const {
    const float2 m = lane_moments(j);
    return (x - m.x) * m.y;
  }
};

template <bool Straddle>
__device__ __forceinline__ Moments group_moments(const BackwardArgs& a, const BlockCoord& b) {
  if (!b.active) return Moments{};
  const int64_t ng = b.n * a.geo.G + b.group;
  return own_groups<Straddle>(a.geo, b, [&](int i) { return make_float2(a.mean[ng + i], a.rstd[ng + i]); });
}

// affine[j]: channel_affine of the thread's channel c0 + j.
template <int V, bool Straddle>
__device__ __forceinline__ LaneConstants<V, Straddle> lane_constants(const Moments& moments, const float2* affine,
                                                                     const BlockCoord& b) {
  LaneConstants<V, Straddle> k;
  k.moments = moments;
  k.lanes_lo = b.lanes_lo;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    k.gamma[j] = affine[j].x;
    k.delta[j] = affine[j].y;
  }
  return k;
}

template <typename T, int V, bool Straddle>
__device__ __forceinline__ LaneConstants<V, Straddle> lane_constants(const BackwardArgs& a, const BlockCoord& b) {
  float2 affine[V];
  thread_affine<T>(a, b.n, b.c0, affine);
  return lane_constants<V, Straddle>(group_moments<Straddle>(a, b), affine, b);
}

template <typename T, int V, Act A, bool Straddle, typename Visit>
__device__ __forceinline__ void visit_pair(const Pack<T, V>& xp, const Pack<T, V>& dp,
                                           const LaneConstants<V, Straddle>& k, Visit&& visit) {
  float xv[V], dv[V];
  unpack<T, V>(xp, xv);
  unpack<T, V>(dp, dv);
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const float xhat = k.xhat(j, xv[j]);
    visit(j, xhat, activation_grad<A>(dv[j], fmaf(xhat, k.gamma[j], k.delta[j])));
  }
}

template <int V>
struct LaneSums {
  float2 acc[V];

  __device__ __forceinline__ LaneSums() {
#pragma unroll
    for (int j = 0; j < V; ++j) acc[j] = make_float2(0.f, 0.f);
  }
  __device__ __forceinline__ void operator()(int j, float xhat, float du) {
    acc[j].x += du;
    acc[j].y = fmaf(du, xhat, acc[j].y);
  }
};

// (sum du, sum du * xhat) per lane over the rows this thread streams (not resident), U rows in flight.
template <typename T, int V, Act A, int U, bool Straddle>
__device__ __forceinline__ void streamed_sums(const T* x, const T* dy, const Geometry& g, const BlockCoord& b,
                                              int64_t rows, const LaneConstants<V, Straddle>& k, LaneSums<V>& sums) {
  for (int64_t u0 = 0; u0 < rows; u0 += U) {
    Pack<T, V> xb[U], db[U];  // per batch: arrays carried across iterations go to local memory
    load_rows<T, V, U>(xb, x, g, b, u0, rows);
    load_rows<T, V, U>(db, dy, g, b, u0, rows);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (u0 + u < rows) visit_pair<T, V, A, Straddle>(xb[u], db[u], k, sums);
    }
  }
}

// The dx coefficients (mean_g(gamma du), mean_g(gamma du xhat)) of the thread's group (.lo) and, straddling, of
// the next group (.hi).
using Coefficients = GroupPair<float2>;

template <typename T, int V, Act A, bool Straddle>
__device__ __forceinline__ void store_dx(const Pack<T, V>& xp, const Pack<T, V>& dp,
                                         const LaneConstants<V, Straddle>& k, const Coefficients& coef, T* out) {
  float r[V];
  visit_pair<T, V, A, Straddle>(xp, dp, k, [&](int j, float xhat, float du) {
    const float2 c = k.lane_select(j, coef.lo, coef.hi);
    r[j] = k.lane_moments(j).y * (k.gamma[j] * du - c.x - xhat * c.y);
  });
  store_vec<T, V>(out, r);
}

template <typename T, int V, Act A, bool Straddle>
__device__ __forceinline__ void dx_streamed(const T* x, const T* dy, T* dx, const Geometry& g, const BlockCoord& b,
                                            int64_t rows, const LaneConstants<V, Straddle>& k,
                                            const Coefficients& coef) {
  for (int64_t u0 = 0; u0 < rows; u0 += kStreamUnroll) {
    Pack<T, V> xb[kStreamUnroll], db[kStreamUnroll];
    load_rows<T, V, kStreamUnroll>(xb, x, g, b, u0, rows);
    load_rows<T, V, kStreamUnroll>(db, dy, g, b, u0, rows);
#pragma unroll
    for (int u = 0; u < kStreamUnroll; ++u) {
      if (u0 + u < rows) store_dx<T, V, A, Straddle>(xb[u], db[u], k, coef, dx + thread_row(g, b, u0 + u) * g.C);
    }
  }
}

// The parameter gradients of image n and channel c from its totals s = (A, B).
template <typename T>
__device__ __forceinline__ void store_param_grads(const BackwardArgs& a, int64_t n, int64_t c, float2 s) {
  const ChannelParams p = load_channel_params<T>(a, n, c);
  const int64_t nc = n * a.geo.C + c;
  if (a.dshift) store_param<T>(a.dshift, a.modulation_fp32, nc, s.x);
  if (a.dscale) store_param<T>(a.dscale, a.modulation_fp32, nc, fmaf(p.weight, s.y, p.bias * s.x));
  if (a.param_sums) {
    reinterpret_cast<float2*>(a.param_sums)[nc] = make_float2(p.modulation * s.x, p.modulation * s.y);
  } else if (a.geo.images == 1) {  // else store_summed_param_grads writes them
    if (a.dweight) store_param<T>(a.dweight, a.params_fp32, c, p.modulation * s.y);
    if (a.dbias) store_param<T>(a.dbias, a.params_fp32, c, p.modulation * s.x);
  }
}

// dweight[c] and dbias[c] over the images of a cluster that holds them all (Geometry::images == N), in image order:
// sum_n m[n, c] * (image n's channel totals, the sums of its splits' `local` entries). Before cluster_arrive.
template <typename T>
__device__ __forceinline__ void store_summed_param_grads(const BackwardArgs& a, int64_t c, float2* local,
                                                          const Geometry& g) {
  if (a.dweight == nullptr && a.dbias == nullptr) return;
  float2 total = make_float2(0.f, 0.f);
  for (int64_t n = 0; n < g.images; ++n) {
    const float2 s = cluster_reduce(local, g.cluster(), (int)(n * g.splits), (int)g.splits, add2);
    const float m = 1.f + load_param<T>(a.scale, a.modulation_fp32, n * g.C + c, 0.f);
    total = make_float2(fmaf(m, s.x, total.x), fmaf(m, s.y, total.y));
  }
  if (a.dweight) store_param<T>(a.dweight, a.params_fp32, c, total.y);
  if (a.dbias) store_param<T>(a.dbias, a.params_fp32, c, total.x);
}

// The thread's part of its group's sum_{c in g} gamma_c * (A[n,c], B[n,c]): sum_j gamma_j * (du, du * xhat) over its
// lanes in the group (lo) and, straddling, over those in the next group (hi; zero where the vector lies in one
// group). Selects, not branches, keep a NaN in one group's lanes out of the other's sums.
using WeightedSums = GroupPair<float2>;

template <int V, bool Straddle>
__device__ __forceinline__ WeightedSums weighted_sums(const LaneSums<V>& sums, const LaneConstants<V, Straddle>& k) {
  WeightedSums w{make_float2(0.f, 0.f), make_float2(0.f, 0.f)};
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const float2 t = make_float2(k.gamma[j] * sums.acc[j].x, k.gamma[j] * sums.acc[j].y);
    const bool hi = Straddle && j >= k.lanes_lo;
    w.lo = add2(w.lo, hi ? make_float2(0.f, 0.f) : t);
    if constexpr (Straddle) w.hi = add2(w.hi, hi ? t : make_float2(0.f, 0.f));
  }
  return w;
}

template <typename T, int V, Act A, bool Straddle>
__global__ void __launch_bounds__(kMaxThreads, kBackwardBlocksPerSm) backward_kernel(const BackwardArgs a) {
  constexpr int kRows = resident_rows(Pass::kBackward, V * sizeof(T), Straddle);
  __shared__ float2 items[kMaxThreads * V];  // the threads' lane sums; in a cluster then the tile's channel totals
  __shared__ float2 group_items[kMaxThreads];  // without a cluster: the threads' weighted sums (block_group_partials)
  __shared__ float2 group_items_hi[Straddle ? kMaxThreads : 1];
  __shared__ float2 group_parts[kMaxThreads];
  __shared__ float2 block_sums[kMaxTileChannels];  // in a cluster, per tile channel: read by the cluster's blocks
  __shared__ float2 group_coef[kMaxThreads];       // in a cluster, per tile group: the dx coefficients
  __shared__ float2 tile_affine[kMaxTileChannels];  // channel_affine per tile channel
  if (a.dependent_follows) let_dependents_launch();
  const Geometry& g = a.geo;
  const BlockCoord b = block_coord<Straddle>(g, /*reverse=*/false, /*image_clusters=*/true);
  const int64_t offset = b.n * g.S * g.C + b.c0;
  const T* x = static_cast<const T*>(a.x) + offset;
  const T* dy = static_cast<const T*>(a.dy) + offset;
  const int64_t rows = thread_rows(g, b);

  Pack<T, V> xs[kRows], dys[kRows];  // resident rows, kept for dx
  if (g.resident) {
    load_rows<T, V, kRows>(xs, x, g, b, 0, rows);
    load_rows<T, V, kRows>(dys, dy, g, b, 0, rows);
  }
  const Moments moments = group_moments<Straddle>(a, b);
  load_tile_affine<T>(a, b.n, b.tile, tile_affine);  // in flight with the rows
  __syncthreads();
  const auto k = lane_constants<V, Straddle>(moments, &tile_affine[b.col * V], b);
  LaneSums<V> sums;
  if (g.resident) {
#pragma unroll
    for (int u = 0; u < kRows; ++u) {
      if (u < rows) visit_pair<T, V, A, Straddle>(xs[u], dys[u], k, sums);
    }
  } else {
    streamed_sums<T, V, A, kRows, Straddle>(x, dy, g, b, rows, k, sums);
  }
  store_lane_sums<V>(sums.acc, items);
  const int64_t tile_c0 = b.tile * g.groups_per_tile * g.D;
  const int channels = g.tile_vecs * g.vec;
  const float inv_m = 1.f / ((float)g.S * (float)g.D);
  Coefficients coef{};
  if (g.cluster() > 1) {
    // The blocks' channel sums go to block_sums; every block combines its image's (cluster ranks image_rank0, ...,
    // + splits - 1; see Geometry::images) per channel, then per group the dx coefficients. (Reducing the groups'
    // weighted sums instead, as below, made the clustered shapes 1-8% slower on the H200: NOTES session 17.)
    __syncthreads();
    channel_totals<V>(items, g, [&](int ch, float2 s) { block_sums[ch] = s; });
    cluster_sync(g.cluster());
    const int image_rank0 = g.images > 1 ? (int)(b.n * g.splits) : 0;
    for (int ch = threadIdx.x; ch < channels; ch += blockDim.x) {
      items[ch] = cluster_reduce(&block_sums[ch], g.cluster(), image_rank0, (int)g.splits, add2);
    }
    if (g.images > 1 && b.n == 0 && b.rank == 0) {  // the cluster's first block: weight and bias over the images
      for (int ch = threadIdx.x; ch < channels; ch += blockDim.x) {
        store_summed_param_grads<T>(a, tile_c0 + ch, block_sums + ch, g);
      }
    }
    cluster_arrive(g.cluster());
    __syncthreads();
    if (b.rank == 0) {  // the parameter gradients of image n: one block of the image's splits writes them
      for (int ch = threadIdx.x; ch < channels; ch += blockDim.x) store_param_grads<T>(a, b.n, tile_c0 + ch, items[ch]);
    }
    if (a.dx != nullptr) {  // uniform across the grid
      const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
      for (int gl = warp; gl < g.groups_per_tile; gl += warps) {
        float2 s = make_float2(0.f, 0.f);
        for (int c = lane; c < g.D; c += 32) {
          const int ch = gl * (int)g.D + c;
          const float gamma = tile_affine[ch].x;
          s = add2(s, make_float2(gamma * items[ch].x, gamma * items[ch].y));
        }
        s = lanes_reduce(s, 32, add2);
        if (lane == 0) group_coef[gl] = make_float2(s.x * inv_m, s.y * inv_m);
      }
      __syncthreads();
      if (b.active) coef = own_groups<Straddle>(g, b, [&](int i) { return group_coef[b.group_local + i]; });
    }
  } else {
    // The block holds its image's rows of the tile. Each thread's weighted sums reduce per group alongside the
    // channel sums (one barrier with one group per tile), and each thread combines its own group's parts (the same
    // bits in every thread of the group): no barrier after. A thread without rows adds nothing (not 0 * gamma: an
    // infinite weight would make it NaN).
    const WeightedSums w = rows > 0 ? weighted_sums<V, Straddle>(sums, k) : WeightedSums{};
    if constexpr (Straddle) {
      block_group_partials_straddle(w.lo, w.hi, group_items, group_items_hi, group_parts, g, add2);
    } else {
      block_group_partials(w.lo, group_items, group_parts, g, add2);
    }
    if (b.active) {
      coef = own_groups<Straddle>(g, b, [&](int i) {
        const float2 s = group_total(group_parts, b.group_local + i, g, add2);
        return make_float2(s.x * inv_m, s.y * inv_m);
      });
    }
  }

  if (a.dx != nullptr && b.active) {
    T* dx = static_cast<T*>(a.dx) + offset;
    if (g.resident) {
#pragma unroll
      for (int u = 0; u < kRows; ++u) {
        if (u < rows) store_dx<T, V, A, Straddle>(xs[u], dys[u], k, coef, dx + thread_row(g, b, u) * g.C);
      }
    } else {
      dx_streamed<T, V, A, Straddle>(x, dy, dx, g, b, rows, k, coef);
    }
  }
  // Without a cluster the channel totals give the parameter gradients after dx, off its path.
  if (g.cluster() == 1) {
    channel_totals<V>(items, g, [&](int ch, float2 s) { store_param_grads<T>(a, b.n, tile_c0 + ch, s); });
  }
  cluster_wait(g.cluster());
}

// Unclustered, 1: the block's channel sums -> channel_partials[(n * splits + split) * C + c].
template <typename T, int V, Act A, bool Straddle>
__global__ void __launch_bounds__(kMaxThreads, kBackwardBlocksPerSm) sums_kernel(const BackwardArgs a) {
  constexpr int kRows = resident_rows(Pass::kBackward, V * sizeof(T), Straddle);
  __shared__ float2 items[kMaxThreads * V];
  if (a.dependent_follows) let_dependents_launch();
  const Geometry& g = a.geo;
  const BlockCoord b = block_coord<Straddle>(g);
  const int64_t offset = b.n * g.S * g.C + b.c0;
  LaneSums<V> sums;
  streamed_sums<T, V, A, kRows, Straddle>(static_cast<const T*>(a.x) + offset, static_cast<const T*>(a.dy) + offset,
                                          g, b, thread_rows(g, b), lane_constants<T, V, Straddle>(a, b), sums);
  store_lane_sums<V>(sums.acc, items);
  __syncthreads();
  float2* out = reinterpret_cast<float2*>(a.channel_partials) + (b.n * g.splits + b.rank) * g.C +
                b.tile * g.groups_per_tile * g.D;
  channel_totals<V>(items, g, [&](int ch, float2 s) { out[ch] = s; });
}

// Unclustered, 2: one block per (n, g): each channel's totals over the splits (in split order), the parameter
// gradients, and the group's dx coefficients.
constexpr int kCoefficientThreads = 256;

template <typename T>
__global__ void coefficients_kernel(const BackwardArgs a) {
  if (a.dependent_follows) let_dependents_launch();
  wait_for_prerequisite();
  const Geometry& g = a.geo;
  const int64_t ng = blockIdx.x, n = ng / g.G, group = ng % g.G;
  const float2* partials = reinterpret_cast<const float2*>(a.channel_partials);
  float2 weighted = make_float2(0.f, 0.f);
  for (int64_t c = group * g.D + threadIdx.x; c < (group + 1) * g.D; c += blockDim.x) {
    float2 s = make_float2(0.f, 0.f);
    for (int64_t split = 0; split < g.splits; ++split) s = add2(s, partials[(n * g.splits + split) * g.C + c]);
    store_param_grads<T>(a, n, c, s);
    const ChannelParams p = load_channel_params<T>(a, n, c);
    const float gamma = p.weight * p.modulation;
    weighted = add2(weighted, make_float2(gamma * s.x, gamma * s.y));
  }
  __shared__ float2 warp_totals[kCoefficientThreads / 32];
  weighted = lanes_reduce(weighted, 32, add2);
  if (threadIdx.x % 32 == 0) warp_totals[threadIdx.x / 32] = weighted;
  __syncthreads();
  if (threadIdx.x == 0) {
    float2 s = warp_totals[0];
    for (int w = 1; w < kCoefficientThreads / 32; ++w) s = add2(s, warp_totals[w]);
    const float inv_m = 1.f / ((float)g.S * (float)g.D);
    reinterpret_cast<float2*>(a.coefficients)[ng] = make_float2(s.x * inv_m, s.y * inv_m);
  }
}

// Unclustered, 3: dx of the block's rows.
template <typename T, int V, Act A, bool Straddle>
__global__ void __launch_bounds__(kMaxThreads, kBackwardBlocksPerSm) dx_kernel(const BackwardArgs a) {
  const Geometry& g = a.geo;
  const BlockCoord b = block_coord<Straddle>(g, /*reverse=*/true);
  if (a.dependent_follows) let_dependents_launch();
  if (!b.active) return;  // no barriers in this kernel
  wait_for_prerequisite();
  const int64_t offset = b.n * g.S * g.C + b.c0;
  const float2* coefficients = reinterpret_cast<const float2*>(a.coefficients) + b.n * g.G + b.group;
  const Coefficients coef = own_groups<Straddle>(g, b, [&](int i) { return coefficients[i]; });
  dx_streamed<T, V, A, Straddle>(static_cast<const T*>(a.x) + offset, static_cast<const T*>(a.dy) + offset,
                                 static_cast<T*>(a.dx) + offset, g, b, thread_rows(g, b),
                                 lane_constants<T, V, Straddle>(a, b), coef);
}

// dweight[c] = sum_n sums[n, c].y and dbias[c] = sum_n sums[n, c].x. Block: 32 channels x 8 row lanes, each
// lane with 4 independent accumulators (loads in flight), combined in a fixed order.
template <typename P>
__global__ void param_grad_kernel(const float2* sums, int64_t rows, int64_t C, P* dweight, P* dbias) {
  constexpr int kLanes = 8, kAcc = 4;
  __shared__ float2 smem[kLanes][33];
  wait_for_prerequisite();
  const int64_t c = (int64_t)blockIdx.x * 32 + threadIdx.x % 32;
  const int lane = threadIdx.x / 32;
  float2 acc[kAcc];
#pragma unroll
  for (int i = 0; i < kAcc; ++i) acc[i] = make_float2(0.f, 0.f);
  if (c < C) {
    int64_t r = lane;
    for (; r + (kAcc - 1) * kLanes < rows; r += kAcc * kLanes) {
#pragma unroll
      for (int i = 0; i < kAcc; ++i) acc[i] = add2(acc[i], sums[(r + i * kLanes) * C + c]);
    }
    for (; r < rows; r += kLanes) acc[0] = add2(acc[0], sums[r * C + c]);
  }
  smem[lane][threadIdx.x % 32] = add2(add2(acc[0], acc[1]), add2(acc[2], acc[3]));
  __syncthreads();
  if (lane == 0 && c < C) {
    float2 s = smem[0][threadIdx.x];
    for (int i = 1; i < kLanes; ++i) s = add2(s, smem[i][threadIdx.x]);
    if (dweight != nullptr) dweight[c] = from_float<P>(s.y);
    if (dbias != nullptr) dbias[c] = from_float<P>(s.x);
  }
}

template <typename P>
void launch_param_grad(const BackwardArgs& a, cudaStream_t stream) {
  launch(param_grad_kernel<P>, (a.geo.C + 31) / 32, 256, 1, /*dependent=*/true, stream,
         reinterpret_cast<const float2*>(a.param_sums), a.geo.N, a.geo.C, static_cast<P*>(a.dweight),
         static_cast<P*>(a.dbias));
}

// The pass's kernels in order, each after the first launched as a dependent of the one before; each kernel's
// arguments say whether one follows (BackwardArgs::dependent_follows).
template <typename T, int V, Act A, bool Straddle>
void launch_backward_kernels(const BackwardArgs& args, cudaStream_t stream) {
  const Geometry& g = args.geo;
  const bool param_grads = args.param_sums != nullptr;  // param_grad_kernel comes last
  BackwardArgs a = args;
  if (g.clustered) {
    a.dependent_follows = param_grads;
    launch_kernel(backward_kernel<T, V, A, Straddle>, g, stream, a);
  } else {
    a.dependent_follows = true;
    launch_kernel(sums_kernel<T, V, A, Straddle>, g, stream, a);
    a.dependent_follows = a.dx != nullptr || param_grads;
    launch(coefficients_kernel<T>, g.N * g.G, kCoefficientThreads, 1, /*dependent=*/true, stream, a);
    a.dependent_follows = param_grads;
    if (a.dx != nullptr) launch_kernel(dx_kernel<T, V, A, Straddle>, g, stream, a, /*dependent=*/true);
  }
  if (param_grads) {
    if (a.params_fp32) {
      launch_param_grad<float>(a, stream);
    } else {
      launch_param_grad<T>(a, stream);
    }
  }
}

template <typename T, int V, Act A>
struct BackwardKernels {
  static void fn(const BackwardArgs& a, cudaStream_t stream) {
    if constexpr (kStraddles<T, V>) {
      if (a.geo.straddle) return launch_backward_kernels<T, V, A, true>(a, stream);
    }
    launch_backward_kernels<T, V, A, false>(a, stream);
  }
};

// Both kernels of a 16-byte vector width (straddling or not) are opted in to large clusters.
template <typename T, int V, Act A>
struct BackwardMaxCluster {
  static int fn() {
    static std::array<std::atomic<int>, kMaxDevices> cache{};
    const int whole_groups = query_max_cluster(backward_kernel<T, V, A, false>, cache);
    if constexpr (kStraddles<T, V>) {
      static std::array<std::atomic<int>, kMaxDevices> straddle_cache{};
      return std::min(whole_groups, query_max_cluster(backward_kernel<T, V, A, true>, straddle_cache));
    }
    return whole_groups;
  }
};

template <typename T, int V, Act A>
struct BackwardClusterOccupancy {
  static const ClusterOccupancy* fn(bool straddle, int max_cluster) {
    if constexpr (kStraddles<T, V>) {
      static OccupancyCache straddle_cache;
      if (straddle) {
        return query_cluster_occupancy(std::array{backward_kernel<T, V, A, true>}, max_cluster, straddle_cache);
      }
    }
    static OccupancyCache cache;
    return query_cluster_occupancy(std::array{backward_kernel<T, V, A, false>}, max_cluster, cache);
  }
};

}  // namespace

template <Act A>
void BackwardPass<A>::launch(const BackwardArgs& a, cudaStream_t stream) {
  dispatch_type<BackwardKernels, A>(a.dtype, a.geo.vec, a, stream);
}

template <Act A>
int BackwardPass<A>::max_cluster(ScalarKind dtype, int vec) {
  return dispatch_type<BackwardMaxCluster, A>(dtype, vec);
}

template <Act A>
const ClusterOccupancy* BackwardPass<A>::cluster_occupancy(ScalarKind dtype, int vec, bool straddle,
                                                           int max_cluster) {
  return dispatch_type<BackwardClusterOccupancy, A>(dtype, vec, straddle, max_cluster);
}

}  // namespace gn_patch
