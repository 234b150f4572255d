// Device helpers shared by the forward and backward kernels: activations, vector access, Welford statistics and
// the mapping of a block onto its (image, tile, cluster rank).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "group_norm_act.h"

namespace gn_patch {

// ---------------------------------------------------------------------------------------------
// Activations: value, derivative and the gradient dy * act'(u) as PyTorch's backward computes it (a product,
// except relu's select), in float. Formulas as in PyTorch's CUDA activation kernels; NaN and inf
// propagate as there (comparisons are written so that a NaN takes the branch that returns it).
// ---------------------------------------------------------------------------------------------
template <Act A>
struct Activation;

template <Act A>
__device__ __forceinline__ float activation_grad(float dy, float u) {
  if constexpr (A == Act::kRelu) {
    return Activation<A>::grad(dy, u);
  } else {
    return dy * Activation<A>::df(u);
  }
}

template <>
struct Activation<Act::kIdentity> {
  static __device__ __forceinline__ float f(float u) { return u; }
  static __device__ __forceinline__ float df(float) { return 1.f; }
};

template <>
struct Activation<Act::kRelu> {
  static __device__ __forceinline__ float f(float u) { return u < 0.f ? 0.f : u; }
  static __device__ __forceinline__ float df(float u) { return u <= 0.f ? 0.f : 1.f; }
  // PyTorch's relu backward (threshold_backward) selects: zero where the output is <= 0 (even for a NaN or
  // infinite gradient), the gradient where the output is positive or NaN.
  static __device__ __forceinline__ float grad(float dy, float u) { return u <= 0.f ? 0.f : dy; }
};

// 2^x with the MUFU unit's approximation, subnormal arguments and results flushed to zero. __expf is the same
// instruction plus a range fix-up for subnormal results (a compare and two multiplies per element, ~20% of a
// SiLU forward's instructions in the kernels' SASS); in sigmoid below a subnormal exp(-u) only ever adds to 1.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

template <>
struct Activation<Act::kSilu> {
  // sigmoid(u) = 1 / (1 + exp(-u)) with the fast exp and divide (two MUFU operations, ~2 ulp each): the
  // forward is memory-bound only while the arithmetic per element stays this small. For u < -88 exp
  // overflows to inf and the quotient is 0, the correct limit.
  static constexpr float kLog2e = 1.44269504088896341f;
  static __device__ __forceinline__ float sigmoid(float u) { return __fdividef(1.f, 1.f + exp2_ftz(-u * kLog2e)); }
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

template <>
struct Activation<Act::kMish> {
  // mish(u) = u * tanh(softplus(u)), softplus(u) = log(1 + exp(u)) (Misra 2019), as PyTorch computes it.
  static __device__ __forceinline__ float tanh_softplus(float u) { return tanhf(log1pf(__expf(u))); }
  static __device__ __forceinline__ float f(float u) { return u * tanh_softplus(u); }
  static __device__ __forceinline__ float df(float u) {
    const float t = tanh_softplus(u);
    return t + u * Activation<Act::kSilu>::sigmoid(u) * (1.f - t * t);
  }
};

// ---------------------------------------------------------------------------------------------
// Element types and vector access
// ---------------------------------------------------------------------------------------------
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

// Raw storage of one element: packs hold bits, not T, so that they stay trivially copyable (the bfloat16 type's
// user-provided assignment put arrays of bf16 packs into local memory).
template <typename T>
struct Bits {
  using type = unsigned short;
};
template <>
struct Bits<float> {
  using type = unsigned int;
};

template <typename T>
__device__ __forceinline__ float bits_to_float(typename Bits<T>::type b);
template <>
__device__ __forceinline__ float bits_to_float<float>(unsigned int b) { return __uint_as_float(b); }
template <>
__device__ __forceinline__ float bits_to_float<__half>(unsigned short b) { return __half2float(__ushort_as_half(b)); }
template <>
__device__ __forceinline__ float bits_to_float<__nv_bfloat16>(unsigned short b) {
  return __uint_as_float((unsigned int)b << 16);
}

template <typename T>
__device__ __forceinline__ typename Bits<T>::type float_to_bits(float v);
template <>
__device__ __forceinline__ unsigned int float_to_bits<float>(float v) { return __float_as_uint(v); }
template <>
__device__ __forceinline__ unsigned short float_to_bits<__half>(float v) { return __half_as_ushort(__float2half_rn(v)); }
template <>
__device__ __forceinline__ unsigned short float_to_bits<__nv_bfloat16>(float v) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(v));
}

// V elements read or written as one access (16 bytes when V * sizeof(T) == 16), held as 32-bit words (two 16-bit
// elements per word) wherever the pack has 4 bytes or more: with one 16-bit member per element, a pack was split
// into a register per element and the resident rows spilled to local memory.
template <int Bytes>
struct PackWords {
  unsigned int w[Bytes / 4];
};
template <>
struct PackWords<2> {
  unsigned short w[1];
};

template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  static constexpr int kPerWord = sizeof(T) * V < 4 ? 1 : 4 / (int)sizeof(T);  // elements per word
  PackWords<sizeof(T) * V> bits;
};

// The bits of element j.
template <typename T, int V>
__device__ __forceinline__ typename Bits<T>::type pack_element(const Pack<T, V>& pack, int j) {
  constexpr int kPerWord = Pack<T, V>::kPerWord;
  if constexpr (kPerWord == 1) {
    return pack.bits.w[j];
  } else {
    return (typename Bits<T>::type)(pack.bits.w[j / kPerWord] >> (16 * (j % kPerWord)));
  }
}

template <typename T, int V>
__device__ __forceinline__ Pack<T, V> load_pack(const T* p) {
  return *reinterpret_cast<const Pack<T, V>*>(p);
}

template <typename T, int V>
__device__ __forceinline__ void unpack(const Pack<T, V>& pack, float (&out)[V]) {
#pragma unroll
  for (int j = 0; j < V; ++j) out[j] = bits_to_float<T>(pack_element(pack, j));
}

template <typename T, int V>
__device__ __forceinline__ void store_vec(T* p, const float (&in)[V]) {
  constexpr int kPerWord = Pack<T, V>::kPerWord;
  Pack<T, V> pack;
#pragma unroll
  for (int i = 0; i < V / kPerWord; ++i) {
    unsigned int word = 0;
#pragma unroll
    for (int k = 0; k < kPerWord; ++k) word |= (unsigned int)float_to_bits<T>(in[i * kPerWord + k]) << (16 * k);
    pack.bits.w[i] = word;
  }
  *reinterpret_cast<Pack<T, V>*>(p) = pack;
}

template <typename To, typename From>
__device__ __forceinline__ To bit_cast(const From& from) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast between types of different sizes");
  To to;
  memcpy(&to, &from, sizeof(To));
  return to;
}

// a + b per element, rounded to T: the value PyTorch's CUDA add gives (a float32 sum rounded to T; for 16-bit T
// that is the correctly rounded sum, which HADD2 computes, since float32 holds more than twice their precision).
template <typename T, int V>
__device__ __forceinline__ Pack<T, V> add_packs(const Pack<T, V>& a, const Pack<T, V>& b) {
  constexpr int kWords = sizeof(a.bits.w) / sizeof(a.bits.w[0]);
  Pack<T, V> sum;
#pragma unroll
  for (int i = 0; i < kWords; ++i) {
    if constexpr (std::is_same_v<T, float>) {
      sum.bits.w[i] = __float_as_uint(__uint_as_float(a.bits.w[i]) + __uint_as_float(b.bits.w[i]));
    } else if constexpr (Pack<T, V>::kPerWord == 1) {  // one 16-bit element
      sum.bits.w[i] = float_to_bits<T>(bits_to_float<T>(a.bits.w[i]) + bits_to_float<T>(b.bits.w[i]));
    } else {
      using T2 = std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;
      sum.bits.w[i] = bit_cast<unsigned int>(__hadd2(bit_cast<T2>(a.bits.w[i]), bit_cast<T2>(b.bits.w[i])));
    }
  }
  return sum;
}

// Element i of an optional parameter stored as T or as float32 (fp32 master weights under autocast).
template <typename T>
__device__ __forceinline__ float load_param(const void* p, bool fp32, int64_t i, float absent) {
  if (p == nullptr) return absent;
  return fp32 ? static_cast<const float*>(p)[i] : to_float(static_cast<const T*>(p)[i]);
}

// Per-lane affine parameters of channel c of image n: u = xhat * weight + bias, then the per-sample modulation
// u * (1 + scale[n, c]) + shift[n, c].
struct ChannelParams {
  float weight, bias, modulation, shift;  // modulation = 1 + scale
};

template <typename T, typename Args>
__device__ __forceinline__ ChannelParams load_channel_params(const Args& a, int64_t n, int64_t c) {
  ChannelParams p;
  p.weight = load_param<T>(a.weight, a.params_fp32, c, 1.f);
  p.bias = load_param<T>(a.bias, a.params_fp32, c, 0.f);
  p.modulation = 1.f + load_param<T>(a.scale, a.modulation_fp32, n * a.geo.C + c, 0.f);
  p.shift = load_param<T>(a.shift, a.modulation_fp32, n * a.geo.C + c, 0.f);
  return p;
}

// The affine map of channel c of image n folded into u = xhat * gamma + beta: gamma = weight * (1 + scale),
// beta = bias * (1 + scale) + shift. Both passes use it (.x = gamma, .y = beta).
template <typename T, typename Args>
__device__ __forceinline__ float2 channel_affine(const Args& a, int64_t n, int64_t c) {
  const ChannelParams p = load_channel_params<T>(a, n, c);
  return make_float2(p.weight * p.modulation, fmaf(p.bias, p.modulation, p.shift));
}

// channel_affine of this thread's V channels (c0, c0 + 1, ...): the per-thread loads of the unclustered kernels, whose
// blocks stream many rows per thread.
template <typename T, int V, typename Args>
__device__ __forceinline__ void thread_affine(const Args& a, int64_t n, int64_t c0, float2 (&out)[V]) {
#pragma unroll
  for (int j = 0; j < V; ++j) out[j] = channel_affine<T>(a, n, c0 + j);
}

// channel_affine of every channel of the block's tile -> out[tile channel], visible after the next barrier. The
// block loads them once (a few threads, one channel each) instead of every thread loading its vector's V channels
// (4 V dependent, branchy loads on the critical path of the small kernels).
template <typename T, typename Args>
__device__ __forceinline__ void load_tile_affine(const Args& a, int64_t n, int64_t tile, float2* out) {
  const int channels = a.geo.tile_vecs * a.geo.vec;
  const int64_t c0 = tile * a.geo.groups_per_tile * a.geo.D;
  for (int ch = threadIdx.x; ch < channels; ch += blockDim.x) out[ch] = channel_affine<T>(a, n, c0 + ch);
}

// ---------------------------------------------------------------------------------------------
// Welford / Chan statistics. Combination formula: Chan, Golub & LeVeque (1979), "Updating formulae and a
// pairwise algorithm for computing sample variances". Each partial keeps its mean as an offset from a reference
// value, one of its own elements: data far from zero (x = 1000 + 0.001 * noise) keeps its precision in float32,
// and a combination keeps the reference nearer the combined mean, so that an outlier's partial does not make
// every mean an offset from the outlier (its rounding would then be the group mean's).
// ---------------------------------------------------------------------------------------------
// Plain aggregate (no constructor) so that it can live in __shared__ memory; zero-initialise with {}.
struct Welford {
  float ref;    // reference value
  float mean;   // mean - ref
  float m2;     // sum of squared deviations from the mean
  float count;
};

// NaN in either operand propagates (no clamping); an empty operand leaves the other as it is.
__device__ __forceinline__ Welford welford_combine(const Welford& a, const Welford& b) {
  if (b.count == 0.f) return a;
  if (a.count == 0.f) return b;
  const float n = a.count + b.count;
  const float wb = __fdividef(b.count, n);
  const float refs = b.ref - a.ref;  // exact for nearby references (Sterbenz)
  const float delta = refs + (b.mean - a.mean);
  const float mean = fmaf(delta, wb, a.mean);  // from a.ref
  const float m2 = a.m2 + b.m2 + delta * delta * a.count * wb;
  const float mean_b = mean - refs;  // from b.ref
  return fabsf(mean_b) < fabsf(mean) ? Welford{b.ref, mean_b, m2, n} : Welford{a.ref, mean, m2, n};
}

__device__ __forceinline__ Welford shfl_xor(const Welford& w, int offset) {
  return Welford{__shfl_xor_sync(0xffffffffu, w.ref, offset), __shfl_xor_sync(0xffffffffu, w.mean, offset),
                 __shfl_xor_sync(0xffffffffu, w.m2, offset), __shfl_xor_sync(0xffffffffu, w.count, offset)};
}

// Lane `lane`'s w in every lane of the warp.
__device__ __forceinline__ Welford shfl(const Welford& w, int lane) {
  return Welford{__shfl_sync(0xffffffffu, w.ref, lane), __shfl_sync(0xffffffffu, w.mean, lane),
                 __shfl_sync(0xffffffffu, w.m2, lane), __shfl_sync(0xffffffffu, w.count, lane)};
}

__device__ __forceinline__ float2 shfl_xor(float2 v, int offset) {
  return make_float2(__shfl_xor_sync(0xffffffffu, v.x, offset), __shfl_xor_sync(0xffffffffu, v.y, offset));
}

// Lane `lane`'s v in every lane of the warp.
__device__ __forceinline__ float2 shfl(float2 v, int lane) {
  return make_float2(__shfl_sync(0xffffffffu, v.x, lane), __shfl_sync(0xffffffffu, v.y, lane));
}

__device__ __forceinline__ float2 add2(float2 a, float2 b) { return make_float2(a.x + b.x, a.y + b.y); }

// Combines the values of `width` aligned lanes (width a power of two <= 32) in a fixed butterfly order; every lane
// of the warp must call it.
template <typename Acc, typename Combine>
__device__ __forceinline__ Acc lanes_reduce(Acc v, int width, Combine combine) {
  for (int offset = width / 2; offset > 0; offset >>= 1) v = combine(v, shfl_xor(v, offset));
  return v;
}

// ---------------------------------------------------------------------------------------------
// Block coordinates: a 1-D grid of N * tiles * splits blocks (64-bit safe), split fastest so that the blocks of
// one (n, tile) are consecutive (and form one thread-block cluster when clustered; with Geometry::images > 1 the
// images of a tile are next fastest, and the cluster holds all of them). `reverse` walks the grid
// last-to-first, so that a second pass starts on the rows the first pass left in L2.
// ---------------------------------------------------------------------------------------------
struct BlockCoord {
  int64_t n;
  int64_t tile;
  int64_t rank;     // split of its (n, tile): rows [rank * rows_per_block, +rows_per_block); the cluster rank when
                    // the cluster holds one image (with Geometry::images > 1 that is n * splits + rank)
  int col;          // vector index inside the tile (this thread's channels)
  int rowlane;      // row offset inside the block
  int group_local;  // this thread's group inside the tile (of its vector's first channel)
  int64_t group;    // this thread's group
  int lanes_lo;     // straddling vectors: how many of the vector's channels are in group_local (the rest, if
                    // any, in the next group)
  int64_t c0;       // first channel of this thread's vector
  bool active;      // this thread holds a vector (threads past tile_vecs * block_rows only pad the block to warps)
  int64_t row_begin;
  int64_t row_end;
};

// `image_clusters`: the kernel takes geometries with Geometry::images > 1 (the clustered backward). `Straddle`: the
// kernel takes straddling geometries (Geometry::straddle).
template <bool Straddle = false>
__device__ __forceinline__ BlockCoord block_coord(const Geometry& g, bool reverse = false,
                                                  bool image_clusters = false) {
  BlockCoord b;
  const unsigned bid = reverse ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
  const unsigned split_major = g.div_splits.div(bid);  // n * tiles + tile, or tile * N + n (Geometry::images)
  b.rank = bid - split_major * (unsigned)g.splits;
  if (image_clusters && g.images > 1) {
    b.tile = g.div_images.div(split_major);
    b.n = split_major - (unsigned)b.tile * (unsigned)g.images;
  } else {
    b.n = g.div_tiles.div(split_major);
    b.tile = split_major - (unsigned)b.n * (unsigned)g.tiles;
  }
  b.rowlane = (int)g.div_tile_vecs.div(threadIdx.x);
  b.col = threadIdx.x - b.rowlane * g.tile_vecs;
  b.active = b.rowlane < g.block_rows;
  if constexpr (Straddle) {
    const int channel = b.col * g.vec;  // in the tile
    b.group_local = (int)g.div_D.div(channel);
    b.lanes_lo = (b.group_local + 1) * (int)g.D - channel;
    b.group = b.tile * g.groups_per_tile + b.group_local;
    b.c0 = b.tile * g.groups_per_tile * g.D + channel;
  } else {
    b.group_local = (int)g.div_vecs_per_group.div(b.col);
    b.lanes_lo = g.vec;  // every lane in the thread's group
    b.group = b.tile * g.groups_per_tile + b.group_local;
    b.c0 = b.group * g.D + (int64_t)(b.col - b.group_local * g.vecs_per_group) * g.vec;
  }
  b.row_begin = b.rank * g.rows_per_block;
  b.row_end = min(b.row_begin + g.rows_per_block, g.S);
  return b;
}

// Rows this thread visits: rowlane, rowlane + block_rows, ... of the block's range.
__device__ __forceinline__ int64_t thread_rows(const Geometry& g, const BlockCoord& b) {
  const int64_t first = b.row_begin + b.rowlane;
  if (!b.active || first >= b.row_end) return 0;
  const int64_t span = b.row_end - 1 - first;  // < rows_per_block
  return (span < (int64_t{1} << 31) ? (int64_t)g.div_block_rows.div((uint32_t)span) : span / g.block_rows) + 1;
}

// Row r of this thread's u-th visit (rows rowlane, rowlane + block_rows, ... of the block's range).
__device__ __forceinline__ int64_t thread_row(const Geometry& g, const BlockCoord& b, int64_t u) {
  return b.row_begin + b.rowlane + u * g.block_rows;
}

// The row of y that row r of x (of the same image) is written to: r, or r transposed as Geometry::frames says.
// r < S < 2^31 where frames > 1 (ops.cpp), as FastDivider needs.
__device__ __forceinline__ int64_t output_row(const Geometry& g, int64_t r) {
  if (g.frames == 1) return r;
  const uint32_t f = g.div_frame_rows.div((uint32_t)r);
  return (int64_t)((uint32_t)r - f * g.div_frame_rows.divisor) * g.frames + f;
}

// Loads this thread's rows u0, u0 + 1, ... (< rows) of its visit order into packs.
template <typename T, int V, int U>
__device__ __forceinline__ void load_rows(Pack<T, V> (&packs)[U], const T* base, const Geometry& g,
                                          const BlockCoord& b, int64_t u0, int64_t rows) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    // Rows past the end read as zeros: an array left partly unassigned went to local memory.
    packs[u] = u0 + u < rows ? load_pack<T, V>(base + thread_row(g, b, u0 + u) * g.C) : Pack<T, V>{};
  }
}

// Rows visited per batch by passes that stream (rows not resident): loads of a batch are issued together.
constexpr int kStreamUnroll = 4;

}  // namespace gn_patch
