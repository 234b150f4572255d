// Forward: y = act(((x - mean[n,g]) * rstd[n,g] * weight[c] + bias[c]) * (1 + scale[n,c]) + shift[n,c]) on
// channels-last (N, S, C) data.
//
// Clustered (one kernel; grid N * tiles * splits, see Geometry): each block reduces its rows of its tile's groups
// to per-group sums; the `splits` blocks of one (n, tile), a thread-block cluster, combine theirs
// through distributed shared memory in rank order; every block then normalises its rows, from registers when
// resident, else read again, last first (from L2: the block read them moments before). A block without a cluster
// (splits = 1) needs no block-wide total: after the barrier that publishes the warps' parts, each thread combines
// its own group's (one barrier in all with one group per tile: the small kernels' time is in their barriers).
// Unclustered (large images, wide tiles, more splits than a cluster holds):
//   1. stats_kernel     the blocks' per-group statistics -> scratch
//   2. finalize_kernel  one warp per (n, g) combines the splits' -> mean, rstd
//   3. normalize_kernel grid as 1, walked in reverse to start on the rows still in L2.
//
// Statistics: in the clustered kernel, sums of deviations from one reference per group (its first element, which
// every thread and block of the group loads), added up as plain floats through the warps, the block and the
// cluster, and taken a second time about the mean where the reference lies far from it (group_reference,
// reference_within_spread). In the unclustered kernels, whose partials stream from many blocks, Welford statistics:
// within a thread, sums of deviations from the batch's first element; across threads and blocks, Chan combinations
// with a reference value per partial (common.cuh).
// Straddling geometries (Geometry::straddle: 16-byte vectors over groups of more than 8 16-bit channels, not a
// multiple of 8) run the same kernels instantiated with Straddle: each thread keeps both groups' statistics apart.
// With an input bias or offset (ForwardArgs::input_bias, input_offset: diffusers' `conv1(x) + temb` before a resnet
// block's norm2, the convolution run without its bias) the kernels instantiated with Offset add them to every row
// they load: the sums are never written to memory.
//
// Compiled once per activation: forward_<activation>.cu instantiates ForwardPass<A> (passes.h), defined at the end.
#pragma once

#include "launch.cuh"
#include "passes.h"
#include "reduce.cuh"

namespace gn_patch {
namespace {

// Welford statistics of `count` elements from the sums of their deviations from `ref`: mean = ref + s1 / count,
// m2 = s2 - s1^2 / count.
__device__ __forceinline__ Welford sums_to_welford(float ref, float s1, float s2, float count) {
  const float mean = __fdividef(s1, count);  // count <= 128: the approximate quotient is within 2 ulp
  const float m2 = s2 - s1 * mean;
  return Welford{ref, mean, m2 < 0.f ? 0.f : m2, count};  // a select, not fmaxf: NaN propagates
}

// ForwardArgs::input_bias[c0 .. c0 + V), then ForwardArgs::input_offset[n, c0 .. c0 + V), each where given, added to
// the rows a thread loads (Enabled), or nothing. Two rounded adds in this order: stock's `(conv(x) + conv.bias) +
// temb`, each add rounded to T as PyTorch's. A thread's channels are the same in every row it visits; the terms are
// loaded again for each batch of rows (from L1) rather than held: two packs more per thread spilled the resident
// rows of the 16-byte kernels (52-56 bytes).
template <typename T, int V, bool Enabled>
struct RowOffset {
  const ForwardArgs& a;
  const BlockCoord& b;

  __device__ __forceinline__ RowOffset(const ForwardArgs& args, const BlockCoord& coord) : a(args), b(coord) {}

  template <int U>
  __device__ __forceinline__ void add_to(Pack<T, V> (&packs)[U]) const {
    if constexpr (Enabled) {
      if (!b.active) return;  // its channels may lie past C
      if (a.input_bias != nullptr) add_each(packs, load_pack<T, V>(static_cast<const T*>(a.input_bias) + b.c0));
      if (a.input_offset != nullptr) {
        add_each(packs, load_pack<T, V>(static_cast<const T*>(a.input_offset) + b.n * a.geo.C + b.c0));
      }
    }
  }

 private:
  template <int U>
  __device__ __forceinline__ static void add_each(Pack<T, V> (&packs)[U], const Pack<T, V>& term) {
#pragma unroll
    for (int u = 0; u < U; ++u) packs[u] = add_packs(packs[u], term);
  }
};

// Sums of the deviations of the first `rows` of U packs from k, (sum (v - k), sum (v - k)^2), in one pass over the
// registers.
template <typename T, int V, int U>
__device__ __forceinline__ float2 rows_sums(const Pack<T, V> (&packs)[U], int rows, float k) {
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
  return make_float2(s1, s2);
}

// rows_sums of packs whose lanes straddle two groups (Geometry::straddle): lanes j < lanes_lo belong to the thread's
// group (lo, deviations from k.lo), the others to the next (hi, from k.hi). Per lane sums, then each group's over its
// lanes, taken with selects so that a NaN or inf in one group's lanes stays out of the other's sums.
template <typename T, int V, int U>
__device__ __forceinline__ GroupPair<float2> rows_sums_straddle(const Pack<T, V> (&packs)[U], int rows, int lanes_lo,
                                                                const GroupPair<float>& k) {
  float ref[V], s1[V], s2[V];
#pragma unroll
  for (int j = 0; j < V; ++j) {
    ref[j] = j < lanes_lo ? k.lo : k.hi;
    s1[j] = 0.f;
    s2[j] = 0.f;
  }
  auto add_row = [&](const Pack<T, V>& pack) {
    float v[V];
    unpack<T, V>(pack, v);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float d = v[j] - ref[j];
      s1[j] += d;
      s2[j] = fmaf(d, d, s2[j]);
    }
  };
  if (rows == U) {
#pragma unroll
    for (int u = 0; u < U; ++u) add_row(packs[u]);
  } else {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (u < rows) add_row(packs[u]);
    }
  }
  GroupPair<float2> sums{};
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const bool in_lo = j < lanes_lo;
    sums.lo = add2(sums.lo, in_lo ? make_float2(s1[j], s2[j]) : make_float2(0.f, 0.f));
    sums.hi = add2(sums.hi, in_lo ? make_float2(0.f, 0.f) : make_float2(s1[j], s2[j]));
  }
  return sums;
}

// Welford statistics of the first `rows` of U packs: sums of the deviations from the batch's first element k (the
// reference), mean = k + s1 / n, m2 = s2 - s1^2 / n. The deviations stay within the batch's own spread, so neither
// a large common offset nor an outlier cancels: the rounding error of m2 is a few ulp of n times the squared
// distance of k from the batch mean, itself part of m2.
template <typename T, int V, int U>
__device__ __forceinline__ Welford rows_stats(const Pack<T, V> (&packs)[U], int rows) {
  if (rows == 0) return Welford{};
  const float k = bits_to_float<T>(pack_element(packs[0], 0));
  const float2 s = rows_sums<T, V, U>(packs, rows, k);
  return sums_to_welford(k, s.x, s.y, (float)(rows * V));
}

// rows_stats for straddling vectors: each group's first element in the batch as its reference.
template <typename T, int V, int U>
__device__ __forceinline__ void rows_stats_straddle(const Pack<T, V> (&packs)[U], int rows, int lanes_lo, Welford& lo,
                                                    Welford& hi) {
  lo = Welford{};
  hi = Welford{};
  if (rows == 0) return;
  const GroupPair<float> k{bits_to_float<T>(pack_element(packs[0], 0)),
                           bits_to_float<T>(pack_element(packs[0], V - 1))};
  const GroupPair<float2> s = rows_sums_straddle<T, V, U>(packs, rows, lanes_lo, k);
  const int lanes = min(lanes_lo, V);
  lo = sums_to_welford(k.lo, s.lo.x, s.lo.y, (float)(rows * lanes));
  if (lanes < V) hi = sums_to_welford(k.hi, s.hi.x, s.hi.y, (float)(rows * (V - lanes)));
}

// Statistics of the rows this thread streams (not resident), a batch of U rows in flight at a time.
template <typename T, int V, int U, typename Offset>
__device__ __forceinline__ Welford streamed_stats(const T* base, const Geometry& g, const BlockCoord& b, int64_t rows,
                                                  const Offset& offset) {
  Welford w{};
  for (int64_t u0 = 0; u0 < rows; u0 += U) {
    Pack<T, V> batch[U];  // a fresh array per batch: one carried across iterations went to local memory
    load_rows<T, V, U>(batch, base, g, b, u0, rows);
    offset.add_to(batch);
    w = welford_combine(w, rows_stats<T, V, U>(batch, (int)min((int64_t)U, rows - u0)));
  }
  return w;
}

// streamed_stats for straddling vectors: the statistics of the thread's group (lo) and of the next (hi).
template <typename T, int V, int U, typename Offset>
__device__ __forceinline__ void streamed_stats_straddle(const T* base, const Geometry& g, const BlockCoord& b,
                                                        int64_t rows, const Offset& offset, Welford& lo, Welford& hi) {
  lo = Welford{};
  hi = Welford{};
  for (int64_t u0 = 0; u0 < rows; u0 += U) {
    Pack<T, V> batch[U];
    load_rows<T, V, U>(batch, base, g, b, u0, rows);
    offset.add_to(batch);
    Welford l, h;
    rows_stats_straddle<T, V, U>(batch, (int)min((int64_t)U, rows - u0), b.lanes_lo, l, h);
    lo = welford_combine(lo, l);
    hi = welford_combine(hi, h);
  }
}

// The one reference of a straddling vector's lanes, from its two groups' (ref, mean offset, rstd). The lanes of
// the other group compute (x - ref) * scale + shift as two terms of the size of the groups' distance in units of
// their own standard deviation, which round to 2^-24 of that: taking the reference of the group with the larger
// rstd leaves the rounding to the wider group, whose unit is the larger one. (A constant group, rstd =
// 1/sqrt(eps) = 316, beside a group of values around 1000: with the wide group's reference its lanes carried the
// rounding of a shift near 995 * 316, up to 0.016.) A reference that is NaN or infinite is not taken while the
// other is finite, nor kept when its group's rstd is NaN (its group's outputs are NaN then anyway): a NaN in one
// group never reaches the other's lanes.
__device__ __forceinline__ float straddle_reference(float4 lo, float4 hi) {
  return isfinite(hi.x) && (!isfinite(lo.x) || isnan(lo.z) || hi.z > lo.z) ? hi.x : lo.x;
}

// y = act((x - ref) * scale + shift) per lane, folding rstd and the mean offset into the channels' affine maps;
// `stats` = (ref, mean offset, rstd) of the thread's group, affine[j] = channel_affine of its vector's channel j.
// With straddling vectors (Straddle) the lanes j >= lanes_lo take the next group's statistics `hi`, every lane's
// mean expressed as an offset from one reference (straddle_reference).
template <int V, bool Straddle = false>
struct LaneAffine {
  float ref, scale[V], shift[V];

  __device__ __forceinline__ LaneAffine(float4 stats, const float2* affine, float4 hi = {}, int lanes_lo = V)
      : ref(Straddle ? straddle_reference(stats, hi) : stats.x) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float4 s = Straddle && j >= lanes_lo ? hi : stats;
      const float offset = Straddle ? (s.x - ref) + s.y : s.y;
      const float2 p = affine[j];
      scale[j] = s.z * p.x;
      shift[j] = fmaf(-offset, scale[j], p.y);
    }
  }
};

template <typename T, int V, Act A, bool Straddle>
__device__ __forceinline__ void normalize_pack(const Pack<T, V>& pack, T* y, const LaneAffine<V, Straddle>& l) {
  float v[V];
  unpack<T, V>(pack, v);
#pragma unroll
  for (int j = 0; j < V; ++j) v[j] = Activation<A>::f(fmaf(v[j] - l.ref, l.scale[j], l.shift[j]));
  store_vec<T, V>(y, v);
}

// Streams the thread's rows, last batch first where the tensor outgrows L2 (Geometry::reread_reversed): the
// statistics pass read them first to last, so the rows still in L2 come first (on the H200, up to 6% off the
// batch-32 shapes whose blocks' rows outgrow L2 together). Where the whole tensor stays in L2 there is nothing to
// gain: one peers run measured the reversed order 2-9% slower at three such shapes (benchmarks/NOTES.md).
template <typename T, int V, Act A, bool Straddle, typename Offset>
__device__ __forceinline__ void normalize_streamed(const T* x, T* y, const Geometry& g, const BlockCoord& b,
                                                   int64_t rows, const LaneAffine<V, Straddle>& l,
                                                   const Offset& offset) {
  const int64_t batches = (rows + kStreamUnroll - 1) / kStreamUnroll;
  for (int64_t i = 0; i < batches; ++i) {
    const int64_t u0 = (g.reread_reversed ? batches - 1 - i : i) * kStreamUnroll;
    Pack<T, V> batch[kStreamUnroll];
    load_rows<T, V, kStreamUnroll>(batch, x, g, b, u0, rows);
    offset.add_to(batch);
#pragma unroll
    for (int u = 0; u < kStreamUnroll; ++u) {
      if (u0 + u < rows) normalize_pack<T, V, A>(batch[u], y + output_row(g, thread_row(g, b, u0 + u)) * g.C, l);
    }
  }
}

// A group's first and second moments about a reference value: (reference, mean - reference, variance). The
// variance of sums about the reference (moments_of) may fall below zero by rounding.
struct GroupMoments {
  float ref, mean, var;
};

// (reference, mean offset, rstd) of group ng's moments; the writer stores its mean and rstd where the call has them
// (an inference call has none).
__device__ __forceinline__ float4 group_stats_of(const GroupMoments& m, const ForwardArgs& a, bool writer, int64_t ng) {
  const float r = rsqrtf((m.var < 0.f ? 0.f : m.var) + a.eps);  // a select, not fmaxf: NaN propagates
  if (writer && a.mean != nullptr) {
    a.mean[ng] = m.ref + m.mean;
    a.rstd[ng] = r;
  }
  return make_float4(m.ref, m.mean, r, 0.f);
}

__device__ __forceinline__ float4 group_stats_of(const Welford& t, const ForwardArgs& a, bool writer, int64_t ng) {
  return group_stats_of(GroupMoments{t.ref, t.mean, t.m2 / t.count}, a, writer, ng);
}

// The clustered kernel's statistics are sums of deviations from one reference k per group, loaded by every thread
// and block of the group: k is the group's first element (the first channel of the image's first row), with the
// input terms the kernel adds to its rows, rounded as RowOffset rounds them (so that the kernel's sums, and its
// outputs, are bitwise those of the same call on the summed input). Sums about a common k add up as two plain floats
// through the warps, the block and the cluster (a butterfly level is 2 shuffles and 2 adds, where a Welford
// combination of per-thread references is 4 shuffles and ~20 instructions with a division).
template <typename T, bool Offset>
__device__ __forceinline__ float group_reference(const ForwardArgs& a, int64_t n, int64_t group) {
  const int64_t c = group * a.geo.D;
  float k = to_float(static_cast<const T*>(a.x)[n * a.geo.S * a.geo.C + c]);
  if constexpr (Offset) {  // each add rounded to T, as add_packs
    if (a.input_bias != nullptr) k = to_float(from_float<T>(k + to_float(static_cast<const T*>(a.input_bias)[c])));
    if (a.input_offset != nullptr) {
      k = to_float(from_float<T>(k + to_float(static_cast<const T*>(a.input_offset)[n * a.geo.C + c])));
    }
  }
  return k;
}

// The moments about k of a group's sums (sum (x - k), sum (x - k)^2) over its elements (inv_count: 1 / (S * D)).
__device__ __forceinline__ GroupMoments moments_of(float k, float2 sums, float inv_count) {
  const float mean = sums.x * inv_count;
  return GroupMoments{k, mean, fmaf(-mean, mean, sums.y * inv_count)};
}

// The variance from sums about k is var = E[(x - k)^2] - (mean - k)^2: its error is the sums' own relative
// rounding times E[(x - k)^2] = var * (1 + t^2), t the distance of k from the mean in standard deviations. Where k
// lies within kMaxReferenceSpread of them (t <= 4: at most 17 times that rounding), it is kept; otherwise (k an
// outlier of its group, or NaN or inf among its elements, which make var NaN) the kernel takes the sums a second
// time, about k + mean, a reference within float32 rounding of the mean. For normally distributed data the first
// element lies beyond 4 standard deviations of its group's mean once in 16,000 groups. (Finite data spread beyond
// ~1e19 overflows the squares to a var of inf, which passes: rstd 0, as the Welford statistics before overflowed.)
constexpr float kMaxReferenceSpread = 4.f;

__device__ __forceinline__ bool reference_within_spread(const GroupMoments& m) {
  return m.mean * m.mean <= kMaxReferenceSpread * kMaxReferenceSpread * m.var;  // false for NaN
}

// A thread's sums about its groups' references: of its group (lo) and, for straddling vectors, of the next (hi).
using ThreadSums = GroupPair<float2>;

template <typename T, int V, bool Straddle, int U>
__device__ __forceinline__ ThreadSums packs_sums(const Pack<T, V> (&packs)[U], int rows, const BlockCoord& b,
                                                 const GroupPair<float>& k) {
  if constexpr (Straddle) {
    return rows_sums_straddle<T, V, U>(packs, rows, b.lanes_lo, k);
  } else {
    return ThreadSums{rows_sums<T, V, U>(packs, rows, k.lo), make_float2(0.f, 0.f)};
  }
}

// The thread's sums about k over the rows it streams (not resident), U rows in flight at a time.
template <typename T, int V, bool Straddle, int U, typename Offset>
__device__ __forceinline__ ThreadSums streamed_sums(const T* x, const Geometry& g, const BlockCoord& b, int64_t rows,
                                                    const Offset& offset, const GroupPair<float>& k) {
  ThreadSums t{};
  for (int64_t u0 = 0; u0 < rows; u0 += U) {
    Pack<T, V> batch[U];
    load_rows<T, V, U>(batch, x, g, b, u0, rows);
    offset.add_to(batch);
    const ThreadSums s = packs_sums<T, V, Straddle, U>(batch, (int)min((int64_t)U, rows - u0), b, k);
    t.lo = add2(t.lo, s.lo);
    t.hi = add2(t.hi, s.hi);
  }
  return t;
}

// A thread's Welford statistics (the unclustered kernels'): of its group (lo) and, straddling, of the next (hi).
using ThreadStats = GroupPair<Welford>;

template <typename T, int V, bool Straddle, int U, typename Offset>
__device__ __forceinline__ ThreadStats streamed_thread_stats(const T* x, const Geometry& g, const BlockCoord& b,
                                                             int64_t rows, const Offset& offset) {
  ThreadStats t{};
  if constexpr (Straddle) {
    streamed_stats_straddle<T, V, U>(x, g, b, rows, offset, t.lo, t.hi);
  } else {
    t.lo = streamed_stats<T, V, U>(x, g, b, rows, offset);
  }
  return t;
}

// The per-warp parts of the block's group totals of the threads' sums or statistics -> partial
// (block_group_partials; items_hi: the straddling reduction's second array). Ends with a block barrier.
template <bool Straddle, typename Acc, typename Combine>
__device__ __forceinline__ void block_partials_of(const GroupPair<Acc>& t, Acc* items, Acc* items_hi, Acc* partial,
                                                  const Geometry& g, Combine combine) {
  if constexpr (Straddle) {
    block_group_partials_straddle(t.lo, t.hi, items, items_hi, partial, g, combine);
  } else {
    block_group_partials(t.lo, items, partial, g, combine);
  }
}

// The moments of the thread's groups about k from the block's parts of their sums (block_partials_of's partial),
// without a cluster: a one-group tile's total as a tree in every thread (block_total shuffles: every thread calls
// it), else each active thread combines its own groups' parts (the same bits in every thread of a group), inactive
// threads none.
template <bool Straddle>
__device__ __forceinline__ GroupPair<GroupMoments> block_moments(const float2* partial, const Geometry& g,
                                                                 const BlockCoord& b, const GroupPair<float>& k,
                                                                 float inv_count, bool one_group) {
  ThreadSums totals{};
  if (one_group) {
    totals.lo = block_total(partial, add2);
  } else if (b.active) {
    totals = own_groups<Straddle>(g, b, [&](int i) { return group_total(partial, b.group_local + i, g, add2); });
  }
  GroupPair<GroupMoments> m;
  m.lo = moments_of(k.lo, totals.lo, inv_count);
  m.hi = Straddle ? moments_of(k.hi, totals.hi, inv_count) : m.lo;
  return m;
}

// Whether the thread's vector holds the first channel of its group (lo) or of the next group (hi), in the block's
// first row: that thread writes the group's statistics.
struct GroupWriter {
  bool lo, hi;
};

template <bool Straddle>
__device__ __forceinline__ GroupWriter group_writer(const Geometry& g, const BlockCoord& b) {
  if (b.rowlane != 0) return GroupWriter{false, false};
  if constexpr (Straddle) return GroupWriter{b.lanes_lo == g.D, b.lanes_lo < g.vec};
  return GroupWriter{b.col == b.group_local * g.vecs_per_group, false};
}

// The thread's LaneAffine from its groups' (reference, mean offset, rstd) (own_groups: hi is lo where the vector
// lies in one group).
template <int V, bool Straddle>
__device__ __forceinline__ LaneAffine<V, Straddle> lane_affine(const GroupPair<float4>& stats, const float2* affine,
                                                               const BlockCoord& b) {
  return LaneAffine<V, Straddle>(stats.lo, affine, stats.hi, b.lanes_lo);
}

// Clustered forwards of 16-byte vectors, the widths that stream in practice (narrower vectors stream only where
// the straddling ones cannot be used), have a kernel apart for rows that are not resident: a kernel holding both
// ways is compiled for the resident rows' registers, and batches of streamed rows larger than those spilled under
// the register cap and slowed the resident shapes. On the H200 (fp16, one build with both in one kernel), batches
// of stats_kernel's size took (2, 960, 64, 64) 25.4 -> 23.0 us, (2, 640, 64, 64) 18.8 -> 17.7, (8, 320, 64, 64)
// 31.2 -> 29.4, and the resident (2, 1280, 16, 16) 5.2 -> 5.5, (1, 512, 64, 64) 8.8 -> 9.6 (benchmarks/NOTES.md
// session 19).
template <typename T, int V>
constexpr bool kStreamedApart = V * sizeof(T) == 16;

// Rows of one batch of the statistics pass where rows stream: as many as fill 32 registers (24 with straddling
// vectors, whose per-lane sums take registers too; 32 spilled 8 bytes), as a DRAM-bound pass wants in flight (one
// H200 run with batches of resident_rows had the (1, 256, 1024, 1024) forward 10% slower).
template <typename T, int V, bool Straddle>
constexpr int kStatsBatch = rows_in_registers(Straddle ? 24 : 32, V * sizeof(T), 16);

// Whether a clustered forward kernel instance holds its rows in registers: never where it is the instance for
// streamed rows (Streamed), always where that instance exists apart (this one is launched for resident rows only),
// else as the geometry says. A constant in all but the last case: the compiler drops the other way.
template <typename T, int V, bool Streamed>
__device__ __forceinline__ bool rows_resident(const Geometry& g) {
  if constexpr (Streamed) {
    return false;
  } else if constexpr (kStreamedApart<T, V>) {
    return true;
  } else {
    return g.resident;
  }
}

// The second pass (some group of the block or cluster has its reference outside its spread: rare) reads the rows
// again (from L2: the block has just read them), and the kernel then loads its resident rows again too: the registers
// holding them are free in its branch. Taking the sums from those registers kept them live across it, and ptxas
// spilled the common path's rows to make room for its reductions (8-96 bytes in 68 instances).

// The thread's rows, with the input terms where the kernel adds them.
template <typename T, int V, int U, typename Offset>
__device__ __forceinline__ void load_resident_rows(Pack<T, V> (&packs)[U], const T* x, const Geometry& g,
                                                   const BlockCoord& b, int64_t rows, const Offset& offset) {
  load_rows<T, V, U>(packs, x, g, b, 0, rows);
  offset.add_to(packs);
}

// The thread's sums about k2 over its rows, read again from x.
template <typename T, int V, bool Straddle, bool Offset>
__device__ __forceinline__ ThreadSums sums_read_again(const ForwardArgs& a, const BlockCoord& b,
                                                      const GroupPair<float>& k2) {
  const Geometry& g = a.geo;
  return streamed_sums<T, V, Straddle, kStreamUnroll>(static_cast<const T*>(a.x) + b.n * g.S * g.C + b.c0, g, b,
                                                      thread_rows(g, b), RowOffset<T, V, Offset>(a, b), k2);
}

// Without a cluster: the moments of the thread's groups about k2 (block_moments of a second block reduction).
template <typename T, int V, bool Straddle, bool Offset>
__device__ __forceinline__ GroupPair<GroupMoments> block_moments_again(const ForwardArgs& a, const BlockCoord& b,
                                                                       const GroupPair<float>& k2, float inv_count,
                                                                       bool one_group, float2* items, float2* items_hi,
                                                                       float2* partial) {
  __syncthreads();  // every thread has read partial
  block_partials_of<Straddle>(sums_read_again<T, V, Straddle, Offset>(a, b, k2), items, items_hi, partial, a.geo,
                              add2);
  return block_moments<Straddle>(partial, a.geo, b, k2, inv_count, one_group);
}

// In a cluster: every tile group's statistics again, about k2 = its first pass's reference + mean offset in
// group_stats, the cluster's blocks in step (each calls this: their decision is made from the same bits). Called
// after cluster_arrive; ends with another, as the first pass.
template <typename T, int V, bool Straddle, bool Offset>
__device__ __forceinline__ void cluster_stats_again(const ForwardArgs& a, const BlockCoord& b, float inv_count,
                                                    float2* items, float2* items_hi, float2* partial,
                                                    float2* block_sums, float4* group_stats) {
  const Geometry& g = a.geo;
  const int gl = threadIdx.x;
  const bool finalises = gl < g.groups_per_tile;
  const GroupPair<float> k2 = own_groups<Straddle>(g, b, [&](int i) {
    const float4 s = group_stats[b.group_local + i];
    return s.x + s.y;
  });
  const float k2_tile = finalises ? group_stats[gl].x + group_stats[gl].y : 0.f;
  cluster_wait(g.cluster());  // the cluster's blocks have read this block's block_sums
  block_partials_of<Straddle>(sums_read_again<T, V, Straddle, Offset>(a, b, k2), items, items_hi, partial, g, add2);
  if (finalises) block_sums[gl] = group_total(partial, gl, g, add2);
  cluster_sync(g.cluster());
  if (finalises) {
    const GroupMoments m = moments_of(k2_tile, cluster_reduce(&block_sums[gl], g.cluster(), add2), inv_count);
    group_stats[gl] = group_stats_of(m, a, b.rank == 0, b.n * g.G + b.tile * g.groups_per_tile + gl);
  }
  cluster_arrive(g.cluster());
  __syncthreads();
}

template <typename T, int V, Act A, bool Straddle, bool Offset, bool Streamed>
__global__ void __launch_bounds__(kMaxThreads, kForwardBlocksPerSm) forward_kernel(const ForwardArgs a) {
  constexpr int kRows = resident_rows(Pass::kForward, V * sizeof(T), Straddle);
  constexpr int kBatch = Streamed ? kStatsBatch<T, V, Straddle> : kRows;
  const bool resident = rows_resident<T, V, Streamed>(a.geo);
  __shared__ float2 items[kMaxThreads];
  __shared__ float2 items_hi[Straddle ? kMaxThreads : 1];
  __shared__ float2 partial[kMaxThreads];
  __shared__ float2 block_sums[kMaxThreads];   // per tile group: read by the cluster's blocks
  __shared__ float4 group_stats[kMaxThreads];  // per tile group, in a cluster: (reference, mean offset, rstd)
  __shared__ float2 tile_affine[kMaxTileChannels];
  __shared__ bool second_pass;  // in a cluster: some group's reference lies outside its spread
  const Geometry& g = a.geo;
  const BlockCoord b = block_coord<Straddle>(g);
  const T* x = static_cast<const T*>(a.x) + b.n * g.S * g.C + b.c0;
  const int64_t rows = thread_rows(g, b);
  const RowOffset<T, V, Offset> offset(a, b);
  const bool clustered = g.cluster() > 1;

  Pack<T, V> packs[kRows];  // resident rows
  if (resident) load_resident_rows(packs, x, g, b, rows, offset);
  // The references of the thread's groups, in every thread (a padding thread's column is a valid one: without a
  // cluster, every thread of a one-group tile takes the decision below); in a cluster, thread gl's of tile group gl,
  // which it finalises. In flight with the rows, as the tile's affine maps (read after the barriers below).
  const GroupPair<float> k =
      own_groups<Straddle>(g, b, [&](int i) { return group_reference<T, Offset>(a, b.n, b.group + i); });
  const int gl = threadIdx.x;
  const bool finalises = clustered && gl < g.groups_per_tile;
  const float k_tile = finalises ? group_reference<T, Offset>(a, b.n, b.tile * g.groups_per_tile + gl) : 0.f;
  load_tile_affine<T>(a, b.n, b.tile, tile_affine);
  // S * D < 2^24 (clustered): the count is exact as a float; its reciprocal within 2 ulp, the same in every thread.
  const float inv_count = __fdividef(1.f, (float)(g.S * g.D));
  if (threadIdx.x == 0) second_pass = false;  // published by block_partials_of's barrier
  block_partials_of<Straddle>(resident ? packs_sums<T, V, Straddle, kRows>(packs, (int)rows, b, k)
                                       : streamed_sums<T, V, Straddle, kBatch>(x, g, b, rows, offset, k),
                              items, items_hi, partial, g, add2);
  // (reference, mean offset, rstd) of the thread's group (lo) and, straddling, of the next (hi). The first block of
  // a group's rows writes its mean and rstd.
  GroupPair<float4> stats{};
  if (clustered) {
    // The blocks' group sums go to block_sums; thread gl adds up the cluster's of group gl and finalises them for
    // the block. (Every thread reading its own group's through distributed shared memory, without the barrier
    // after it, made the clustered shapes up to 75% slower on the H200, and every thread finalising its group's
    // statistics itself 2-3% slower where rows stream: benchmarks/NOTES.md, sessions 17 and 18.)
    const int64_t group = b.n * g.G + b.tile * g.groups_per_tile + gl;
    if (finalises) block_sums[gl] = group_total(partial, gl, g, add2);
    cluster_sync(g.cluster());
    if (finalises) {
      const GroupMoments m = moments_of(k_tile, cluster_reduce(&block_sums[gl], g.cluster(), add2), inv_count);
      const bool exact = reference_within_spread(m);
      if (!exact) second_pass = true;
      group_stats[gl] = group_stats_of(m, a, b.rank == 0 && exact, group);
    }
    cluster_arrive(g.cluster());
    __syncthreads();
    if (second_pass) {  // in every block of the cluster alike: their sums are the same bits
      cluster_stats_again<T, V, Straddle, Offset>(a, b, inv_count, items, items_hi, partial, block_sums, group_stats);
      if (resident) load_resident_rows(packs, x, g, b, rows, offset);
    }
    if (b.active) stats = own_groups<Straddle>(g, b, [&](int i) { return group_stats[b.group_local + i]; });
  } else {
    // Each thread finalises its own groups' statistics: no barrier after; the thread holding the group's first
    // channel in the block's first row writes them. A tile of one group combines them as a tree (block_total): on
    // an H100 (fp16, two runs each) (2, 2560, 8, 8) 4.58-4.61 -> 4.26-4.31 us, (2, 1280, 16, 16) 4.99-5.14 ->
    // 4.85-4.88, (2, 1280, 8, 8) 3.92-4.12 -> 3.90-3.96 (benchmarks/NOTES.md, session 26).
    const bool one_group = !Straddle && g.groups_per_tile == 1;
    GroupPair<GroupMoments> m = block_moments<Straddle>(partial, g, b, k, inv_count, one_group);
    // The second pass is the block's decision: a one-group tile's moments are the same bits in every thread, other
    // tiles' threads vote.
    const bool exact = reference_within_spread(m.lo) && reference_within_spread(m.hi);
    if (one_group ? !exact : __syncthreads_or(!exact)) {
      m = block_moments_again<T, V, Straddle, Offset>(a, b, {m.lo.ref + m.lo.mean, m.hi.ref + m.hi.mean}, inv_count,
                                                      one_group, items, items_hi, partial);
      if (resident) load_resident_rows(packs, x, g, b, rows, offset);
    }
    if (b.active) {
      const GroupWriter writes = group_writer<Straddle>(g, b);
      const int64_t group = b.n * g.G + b.group;
      stats.lo = group_stats_of(m.lo, a, writes.lo, group);
      stats.hi = Straddle ? group_stats_of(m.hi, a, writes.hi, group + 1) : stats.lo;
    }
  }

  if (b.active) {
    const auto l = lane_affine<V, Straddle>(stats, &tile_affine[b.col * V], b);
    T* y = static_cast<T*>(a.y) + b.n * g.S * g.C + b.c0;
    if (resident) {
#pragma unroll
      for (int u = 0; u < kRows; ++u) {
        if (u < rows) normalize_pack<T, V, A>(packs[u], y + output_row(g, thread_row(g, b, u)) * g.C, l);
      }
    } else {
      normalize_streamed<T, V, A>(x, y, g, b, rows, l, offset);
    }
  }
  cluster_wait(g.cluster());
}

// Unclustered, 1: the block's per-group statistics -> partials[(n * splits + split) * G + group].
template <typename T, int V, bool Straddle, bool Offset>
__global__ void __launch_bounds__(kMaxThreads, kForwardBlocksPerSm) stats_kernel(const ForwardArgs a) {
  __shared__ Welford items[kMaxThreads];
  __shared__ Welford items_hi[Straddle ? kMaxThreads : 1];
  __shared__ Welford partial[kMaxThreads];
  const Geometry& g = a.geo;
  const BlockCoord b = block_coord<Straddle>(g);
  const T* x = static_cast<const T*>(a.x) + b.n * g.S * g.C + b.c0;
  const RowOffset<T, V, Offset> offset(a, b);
  block_partials_of<Straddle>(
      streamed_thread_stats<T, V, Straddle, kStatsBatch<T, V, Straddle>>(x, g, b, thread_rows(g, b), offset), items,
      items_hi, partial, g, welford_combine);
  if (threadIdx.x < g.groups_per_tile) {
    const int64_t group = b.tile * g.groups_per_tile + threadIdx.x;
    reinterpret_cast<Welford*>(a.partials)[(b.n * g.splits + b.rank) * g.G + group] =
        group_total(partial, threadIdx.x, g, welford_combine);
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
  if (lane == 0) reinterpret_cast<float4*>(a.group_stats)[ng] = group_stats_of(w, a, true, ng);
}

// Unclustered, 3: normalise the block's rows with its groups' statistics.
template <typename T, int V, Act A, bool Straddle, bool Offset>
__global__ void __launch_bounds__(kMaxThreads, kForwardBlocksPerSm) normalize_kernel(const ForwardArgs a) {
  const Geometry& g = a.geo;
  const BlockCoord b = block_coord<Straddle>(g, /*reverse=*/true);
  if (!b.active) return;  // no barriers in this kernel
  const int64_t first = b.n * g.S * g.C + b.c0;  // the thread's first element
  float2 affine[V];
  thread_affine<T>(a, b.n, b.c0, affine);
  const float4* stats = reinterpret_cast<const float4*>(a.group_stats) + b.n * g.G + b.group;
  const auto l = lane_affine<V, Straddle>(own_groups<Straddle>(g, b, [&](int i) { return stats[i]; }), affine, b);
  normalize_streamed<T, V, A>(static_cast<const T*>(a.x) + first, static_cast<T*>(a.y) + first, g, b,
                              thread_rows(g, b), l, RowOffset<T, V, Offset>(a, b));
}

template <typename T, int V, Act A, bool Straddle, bool Offset>
void launch_forward_kernels(const ForwardArgs& a, cudaStream_t stream) {
  const Geometry& g = a.geo;
  if (g.clustered) {
    if constexpr (kStreamedApart<T, V>) {
      if (!g.resident) return launch_kernel(forward_kernel<T, V, A, Straddle, Offset, true>, g, stream, a);
    }
    return launch_kernel(forward_kernel<T, V, A, Straddle, Offset, false>, g, stream, a);
  }
  launch_kernel(stats_kernel<T, V, Straddle, Offset>, g, stream, a);
  const unsigned finalize_blocks = (unsigned)((g.N * g.G + kFinalizeThreads / 32 - 1) / (kFinalizeThreads / 32));
  finalize_kernel<<<finalize_blocks, kFinalizeThreads, 0, stream>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  launch_kernel(normalize_kernel<T, V, A, Straddle, Offset>, g, stream, a);
}

template <typename T, int V, Act A, bool Offset>
void launch_forward_layout(const ForwardArgs& a, cudaStream_t stream) {
  if constexpr (kStraddles<T, V>) {
    if (a.geo.straddle) return launch_forward_kernels<T, V, A, true, Offset>(a, stream);
  }
  launch_forward_kernels<T, V, A, false, Offset>(a, stream);
}

template <typename T, int V, Act A>
struct ForwardKernels {
  static void fn(const ForwardArgs& a, cudaStream_t stream) {
    if constexpr (fuses_input_offset(A)) {
      if (a.input_offset != nullptr || a.input_bias != nullptr) return launch_forward_layout<T, V, A, true>(a, stream);
    }
    launch_forward_layout<T, V, A, false>(a, stream);
  }
};

// The clustered kernel's cluster limit, opting it in to large clusters.
template <typename T, int V, Act A, bool Straddle, bool Offset, bool Streamed>
int forward_kernel_max_cluster() {
  static std::array<std::atomic<int>, kMaxDevices> cache{};
  return query_max_cluster(forward_kernel<T, V, A, Straddle, Offset, Streamed>, cache);
}

// The smaller limit of the clustered kernel for resident rows and, where it exists apart, that for streamed rows.
template <typename T, int V, Act A, bool Straddle, bool Offset>
int forward_kernels_max_cluster() {
  const int limit = forward_kernel_max_cluster<T, V, A, Straddle, Offset, false>();
  if constexpr (kStreamedApart<T, V>) {
    return std::min(limit, forward_kernel_max_cluster<T, V, A, Straddle, Offset, true>());
  }
  return limit;
}

// Every clustered kernel of a vector width (straddling or not, with an input offset or not, for resident or
// streamed rows) is opted in to large clusters; the geometry takes the smallest limit.
template <typename T, int V, Act A>
struct ForwardMaxCluster {
  static int fn() {
    int limit = forward_kernels_max_cluster<T, V, A, false, false>();
    if constexpr (kStraddles<T, V>) limit = std::min(limit, forward_kernels_max_cluster<T, V, A, true, false>());
    if constexpr (fuses_input_offset(A)) {
      limit = std::min(limit, forward_kernels_max_cluster<T, V, A, false, true>());
      if constexpr (kStraddles<T, V>) limit = std::min(limit, forward_kernels_max_cluster<T, V, A, true, true>());
    }
    return limit;
  }
};

// The clustered kernels' occupancy for (T, V, A, Straddle): the fewest clusters of those for resident rows and,
// where apart, for streamed rows, with and without input terms. Their registers differ (on the H200, 64 and 80 for
// the 16-bit straddling SiLU kernels), and the geometry is chosen before it is known which of them runs it: one
// table for the kernel for resident rows alone split (16, 640, 32, 32) into clusters of 2 whose grid took two waves
// of the kernel for streamed rows (23.2 -> 27.3 us).
template <typename T, int V, Act A, bool Straddle>
const ClusterOccupancy* forward_occupancy(int max_cluster) {
  static OccupancyCache cache;
  constexpr bool kOffset = fuses_input_offset(A), kApart = kStreamedApart<T, V>;
  const std::array<void (*)(ForwardArgs), 4> kernels = {
      forward_kernel<T, V, A, Straddle, false, false>, forward_kernel<T, V, A, Straddle, kOffset, false>,
      forward_kernel<T, V, A, Straddle, false, kApart>, forward_kernel<T, V, A, Straddle, kOffset, kApart>};
  return query_cluster_occupancy(kernels, max_cluster, cache);
}

template <typename T, int V, Act A>
struct ForwardClusterOccupancy {
  static const ClusterOccupancy* fn(bool straddle, int max_cluster) {
    if constexpr (kStraddles<T, V>) {
      if (straddle) return forward_occupancy<T, V, A, true>(max_cluster);
    }
    return forward_occupancy<T, V, A, false>(max_cluster);
  }
};

}  // namespace

template <Act A>
void ForwardPass<A>::launch(const ForwardArgs& a, cudaStream_t stream) {
  dispatch_type<ForwardKernels, A>(a.dtype, a.geo.vec, a, stream);
}

template <Act A>
int ForwardPass<A>::max_cluster(ScalarKind dtype, int vec) {
  return dispatch_type<ForwardMaxCluster, A>(dtype, vec);
}

template <Act A>
const ClusterOccupancy* ForwardPass<A>::cluster_occupancy(ScalarKind dtype, int vec, bool straddle, int max_cluster) {
  return dispatch_type<ForwardClusterOccupancy, A>(dtype, vec, straddle, max_cluster);
}

}  // namespace gn_patch
