// Device helpers shared by the forward and backward kernels: activations, vector access, Welford
// combination and the mapping of a block onto its (image, split, tile).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

#include "group_norm_act.h"

namespace gn_patch {

// ---------------------------------------------------------------------------------------------
// Activations: value and derivative, in float. Formulas as in PyTorch's CUDA activation kernels.
// ---------------------------------------------------------------------------------------------
template <Act A>
struct Activation;

template <>
struct Activation<Act::kIdentity> {
  static __device__ __forceinline__ float f(float u) { return u; }
  static __device__ __forceinline__ float df(float) { return 1.f; }
};

template <>
struct Activation<Act::kRelu> {
  static __device__ __forceinline__ float f(float u) { return u > 0.f ? u : 0.f; }
  // PyTorch's relu backward masks by the output (y > 0), i.e. zero gradient at u == 0.
  static __device__ __forceinline__ float df(float u) { return u > 0.f ? 1.f : 0.f; }
};

template <>
struct Activation<Act::kSilu> {
  // sigmoid(u) = 1 / (1 + exp(-u)) with the fast exp and divide (two MUFU operations, ~2 ulp each): the
  // forward is memory-bound only while the arithmetic per element stays this small. For u < -88 exp
  // overflows to inf and the quotient is 0, the correct limit.
  static __device__ __forceinline__ float sigmoid(float u) { return __fdividef(1.f, 1.f + __expf(-u)); }
  static __device__ __forceinline__ float f(float u) { return u * sigmoid(u); }
  static __device__ __forceinline__ float df(float u) {
    const float s = sigmoid(u);
    return s * (1.f + u * (1.f - s));
  }
};

template <>
struct Activation<Act::kGelu> {
  // gelu(u) = u * Phi(u), Phi the standard normal CDF (Hendrycks & Gimpel 2016, erf form).
  static __device__ __forceinline__ float f(float u) { return 0.5f * u * (1.f + erff(u * 0.70710678118654752f)); }
  static __device__ __forceinline__ float df(float u) {
    const float cdf = 0.5f * (1.f + erff(u * 0.70710678118654752f));
    const float pdf = __expf(-0.5f * u * u) * 0.39894228040143268f;  // 1/sqrt(2*pi)
    return cdf + u * pdf;
  }
};

template <>
struct Activation<Act::kGeluTanh> {
  // gelu_tanh(u) = 0.5 u (1 + tanh(sqrt(2/pi) (u + 0.044715 u^3))), PyTorch's approximate="tanh".
  static constexpr float kBeta = 0.79788456080286536f;  // sqrt(2/pi)
  static constexpr float kKappa = 0.044715f;
  static __device__ __forceinline__ float f(float u) {
    return 0.5f * u * (1.f + tanhf(kBeta * (u + kKappa * u * u * u)));
  }
  static __device__ __forceinline__ float df(float u) {
    const float t = tanhf(kBeta * (u + kKappa * u * u * u));
    return 0.5f * (1.f + t) + 0.5f * u * (1.f - t * t) * kBeta * (1.f + 3.f * kKappa * u * u);
  }
};

// ---------------------------------------------------------------------------------------------
// Element types and vector access
// ---------------------------------------------------------------------------------------------
template <ScalarKind K>
struct ScalarOf;
template <>
struct ScalarOf<ScalarKind::kFloat> { using type = float; };
template <>
struct ScalarOf<ScalarKind::kHalf> { using type = __half; };
template <>
struct ScalarOf<ScalarKind::kBFloat16> { using type = __nv_bfloat16; };

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// V elements read or written as one access (16 bytes when V * sizeof(T) == 16).
template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

template <typename T, int V>
__device__ __forceinline__ Pack<T, V> load_pack(const T* p) {
  return *reinterpret_cast<const Pack<T, V>*>(p);
}

template <typename T, int V>
__device__ __forceinline__ void unpack(const Pack<T, V>& pack, float (&out)[V]) {
#pragma unroll
  for (int j = 0; j < V; ++j) out[j] = to_float(pack.v[j]);
}

template <typename T, int V>
__device__ __forceinline__ void store_vec(T* p, const float (&in)[V]) {
  Pack<T, V> pack;
#pragma unroll
  for (int j = 0; j < V; ++j) pack.v[j] = from_float<T>(in[j]);
  *reinterpret_cast<Pack<T, V>*>(p) = pack;
}

// weight or bias element c, stored as T or as float32 (fp32 master weights under autocast).
template <typename T>
__device__ __forceinline__ float load_param(const void* p, bool fp32, int64_t c, float absent) {
  if (p == nullptr) return absent;
  return fp32 ? static_cast<const float*>(p)[c] : to_float(static_cast<const T*>(p)[c]);
}

// ---------------------------------------------------------------------------------------------
// Welford / Chan statistics. Combination formula: Chan, Golub & LeVeque (1979),
// "Updating formulae and a pairwise algorithm for computing sample variances".
// ---------------------------------------------------------------------------------------------
// Plain aggregate (no constructor) so that it can live in __shared__ memory; zero-initialise with {}.
struct Welford {
  float mean;
  float m2;  // sum of squared deviations from mean
  float count;
};

__device__ __forceinline__ Welford welford_combine(const Welford& a, const Welford& b) {
  const float n = a.count + b.count;
  if (n == 0.f) return a;
  const float wb = b.count / n;
  const float delta = b.mean - a.mean;
  Welford r{};
  r.mean = a.mean + delta * wb;
  r.m2 = a.m2 + b.m2 + delta * delta * a.count * wb;
  r.count = n;
  return r;
}

__device__ __forceinline__ Welford warp_welford(Welford w) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    Welford o;
    o.mean = __shfl_xor_sync(0xffffffffu, w.mean, offset);
    o.m2 = __shfl_xor_sync(0xffffffffu, w.m2, offset);
    o.count = __shfl_xor_sync(0xffffffffu, w.count, offset);
    w = welford_combine(w, o);
  }
  return w;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ float2 add2(float2 a, float2 b) { return make_float2(a.x + b.x, a.y + b.y); }

__device__ __forceinline__ float2 warp_sum2(float2 v) { return make_float2(warp_sum(v.x), warp_sum(v.y)); }

// ---------------------------------------------------------------------------------------------
// Block coordinates. Grid is 1-D over N * splits * tiles blocks (64-bit safe, no gridDim.y limit);
// `reverse` walks blocks last-to-first so that a second pass starts on the rows the first pass left in L2.
// ---------------------------------------------------------------------------------------------
struct BlockCoord {
  int64_t n;
  int64_t split;
  int64_t tile;
  int col;       // vector index inside the tile (this thread's channels)
  int rowlane;   // row offset inside the block
  int64_t c0;    // first channel of this thread's vector
  bool active;   // this thread's vector exists (the last tile of a row can be partial; threads past
                 // tile_vecs * block_rows only pad the block to whole warps)
  int64_t row_begin;
  int64_t row_end;
};

__device__ __forceinline__ BlockCoord block_coord_at(const Geometry& g, int64_t n, int64_t split, int64_t tile) {
  BlockCoord b;
  b.n = n;
  b.split = split;
  b.tile = tile;
  b.col = threadIdx.x % g.tile_vecs;
  b.rowlane = threadIdx.x / g.tile_vecs;
  const int64_t vec_index = b.tile * g.tile_vecs + b.col;
  b.c0 = vec_index * g.vec;
  b.active = b.c0 < g.C && b.rowlane < g.block_rows;
  b.row_begin = b.split * g.rows_per_split;
  b.row_end = min(b.row_begin + g.rows_per_split, g.S);
  return b;
}

// Blocks ordered (n, split, tile), tile fastest.
__device__ __forceinline__ BlockCoord block_coord(const Geometry& g, bool reverse) {
  const int64_t bid = reverse ? (int64_t)gridDim.x - 1 - blockIdx.x : (int64_t)blockIdx.x;
  return block_coord_at(g, bid / g.tiles / g.splits, bid / g.tiles % g.splits, bid % g.tiles);
}

// Rows processed per batch by each thread in passes that store (normalize, dx).
constexpr int kUnroll = 4;
// Reduction passes (no stores to overlap with) keep more rows in flight, as raw 16-byte packs: 128 bytes
// per thread in 32 registers.
constexpr int kReduceUnroll = 8;

// Visits rows r = first, first + step, ... < end in batches of U: `load(r)` for every row of a batch is
// issued before `use(r, loaded, valid)` runs on any of them. A partial last batch loads the last row again in
// place of the missing ones (an L1 hit) and passes valid = false for them, rather than falling back to a
// tail loop: a thread with few rows (small images, many splits) then waits for one memory round trip per
// batch instead of one per row, and on small tensors this latency, not bandwidth, is the cost.
// `use` must be branch-free in `valid` up to its stores (select, don't skip): ptxas then allocates registers
// as for a plain unrolled loop, where skipped or predicated uses cost 15-60 registers more per thread.
// The last rows go in batches of UTail <= U (U full rows, then UTail clamped ones, fit the same registers).
template <int U, int UTail, typename Load, typename Use>
__device__ __forceinline__ void for_rows(int64_t first, int64_t end, int64_t step, Load load, Use use) {
  int64_t r = first;
  for (; r + (U - 1) * step < end; r += U * step) {
    decltype(load(r)) loaded[U];
#pragma unroll
    for (int u = 0; u < U; ++u) loaded[u] = load(r + u * step);
#pragma unroll
    for (int u = 0; u < U; ++u) use(r + u * step, loaded[u], true);
  }
  for (; r < end; r += UTail * step) {
    decltype(load(r)) loaded[UTail];
#pragma unroll
    for (int u = 0; u < UTail; ++u) loaded[u] = load(min(r + u * step, end - 1));
#pragma unroll
    for (int u = 0; u < UTail; ++u) use(r + u * step, loaded[u], r + u * step < end);
  }
}

}  // namespace gn_patch
