// Backward of y = act(u), u = xhat * w[c] + b[c], xhat = (x - mean[n,g]) * rstd[n,g].
//   du     = dy * act'(u)
//   dbias  = sum_{n,s} du                 dweight = sum_{n,s} du * xhat
//   dx     = rstd * (w * du - mean_g(w * du) - xhat * mean_g(w * du * xhat))
// where mean_g averages over the M = S * D elements of the group (the standard normalisation backward,
// e.g. Ioffe & Szegedy 2015, eq. for dL/dx_i, applied per (n, g)).
//
// Kernels (no atomics: every reduction has a fixed order, so gradients are bitwise deterministic):
//   fused geometry: fused_backward (sums, group coefficients and dx in one block) + param_grad
//   split geometry: grad_partial (per-channel and per-group sums of a row range) -> grad_finalize (one block
//                   per (n, g): dx coefficients) -> param_grad (sums over n and splits) -> dx
#include <c10/cuda/CUDAException.h>

#include "dispatch.cuh"
#include "reduce.cuh"

namespace gn_patch {
namespace {

// Per-lane constants: the lane's group statistics and affine parameters.
template <typename T, int V>
struct LaneParams {
  float mean[V], rstd[V], w[V], bias[V];
  int group[V];  // < G <= C, fits 32 bits

  __device__ __forceinline__ LaneParams(const BackwardArgs& a, const BlockCoord& b) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int64_t c = b.active ? b.c0 + j : 0;
      group[j] = (int)(c / a.geo.D);
      mean[j] = a.mean[b.n * a.geo.G + group[j]];
      rstd[j] = a.rstd[b.n * a.geo.G + group[j]];
      w[j] = load_param<T>(a.weight, a.params_fp32, c, 1.f);
      bias[j] = load_param<T>(a.bias, a.params_fp32, c, 0.f);
    }
  }

  // (xhat, du) of lane j for input x and output gradient dy.
  template <Act A>
  __device__ __forceinline__ float2 xhat_du(float x, float dy, int j) const {
    const float z = (x - mean[j]) * rstd[j];
    return make_float2(z, dy * Activation<A>::df(fmaf(z, w[j], bias[j])));
  }
};

// The same spatial position of x and dy.
template <typename T, int V>
struct RowPair {
  Pack<T, V> x, dy;
};

template <typename T, int V>
__device__ __forceinline__ RowPair<T, V> load_row_pair(const BackwardArgs& a, int64_t index) {
  return {load_pack<T, V>(static_cast<const T*>(a.x) + index), load_pack<T, V>(static_cast<const T*>(a.dy) + index)};
}

// sum du and sum du * xhat of this thread's channels over its rows.
template <typename T, int V, Act A>
__device__ __forceinline__ void thread_grad_sums(const BackwardArgs& a, const BlockCoord& b,
                                                 const LaneParams<T, V>& p, float2 (&acc)[V]) {
#pragma unroll
  for (int j = 0; j < V; ++j) acc[j] = make_float2(0.f, 0.f);
  if (!b.active) return;
  const Geometry& g = a.geo;
  const int64_t offset = b.n * g.S * g.C + b.c0;
  for_rows<kUnroll, kUnroll>(
      b.row_begin + b.rowlane, b.row_end, g.block_rows,
      [&](int64_t r) { return load_row_pair<T, V>(a, offset + r * g.C); },
      [&](int64_t, const RowPair<T, V>& row, bool valid) {
        float xv[V], gv[V];
        unpack<T, V>(row.x, xv);
        unpack<T, V>(row.dy, gv);
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const float2 zd = p.template xhat_du<A>(xv[j], gv[j], j);
          const float du = valid ? zd.y : 0.f;
          acc[j].x += du;
          acc[j].y = fmaf(du, zd.x, acc[j].y);
        }
      });
}

// dx over this thread's rows; coef[j] = (mean_g(w*du), mean_g(w*du*xhat)) of lane j's group.
template <typename T, int V, Act A>
__device__ __forceinline__ void dx_rows(const BackwardArgs& a, const BlockCoord& b, const LaneParams<T, V>& p,
                                        const float2 (&coef)[V]) {
  if (!b.active) return;
  const Geometry& g = a.geo;
  T* dx = static_cast<T*>(a.dx);
  const int64_t offset = b.n * g.S * g.C + b.c0;
  for_rows<kUnroll, kUnroll>(
      b.row_begin + b.rowlane, b.row_end, g.block_rows,
      [&](int64_t r) { return load_row_pair<T, V>(a, offset + r * g.C); },
      [&](int64_t r, const RowPair<T, V>& row, bool valid) {
        float xv[V], gv[V];
        unpack<T, V>(row.x, xv);
        unpack<T, V>(row.dy, gv);
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const float2 zd = p.template xhat_du<A>(xv[j], gv[j], j);
          xv[j] = p.rstd[j] * (p.w[j] * zd.y - coef[j].x - zd.x * coef[j].y);
        }
        if (valid) store_vec<T, V>(dx + offset + r * g.C, xv);
      });
}

// w[c] * (sum du, sum du*xhat) of tile channel i, from the per-channel sums in shared memory.
template <typename T>
__device__ __forceinline__ float2 weighted(const BackwardArgs& a, const float2* sums, int64_t tile_c0, int64_t i) {
  const float w = load_param<T>(a.weight, a.params_fp32, tile_c0 + i, 1.f);
  return make_float2(w * sums[i].x, w * sums[i].y);
}

template <typename T, int V, Act A>
__global__ void __launch_bounds__(kMaxThreads, kGradBlocksPerSm) grad_partial_kernel(const BackwardArgs a) {
  __shared__ float2 smem[kMaxThreads * V];
  const Geometry& g = a.geo;
  const BlockCoord b = block_coord(g, /*reverse=*/false);
  const LaneParams<T, V> p(a, b);
  float2 acc[V];
  thread_grad_sums<T, V, A>(a, b, p, acc);
  reduce_rowlanes<float2, V>(acc, smem, g, b.rowlane, add2);
  const int64_t row = b.n * g.splits + b.split;
  if (b.rowlane == 0 && b.active) {
    float2* out = reinterpret_cast<float2*>(a.channel_sums) + row * g.C + b.c0;
#pragma unroll
    for (int j = 0; j < V; ++j) out[j] = acc[j];
  }
  if (g.group_tiles) {
    const int64_t c0 = tile_first_channel(g, b.tile);
    float2* out = reinterpret_cast<float2*>(a.group_sums) + row * g.G + c0 / g.D;
    reduce_tile_groups<float2>(
        tile_channel_count(g, b.tile) / g.D, g.D, [&](int64_t i) { return weighted<T>(a, smem, c0, i); }, add2,
        warp_sum2, [&](int64_t gl, float2 t) { out[gl] = t; });
  }
}

// One block per (n, g): sums the splits' weighted partials (per group, or per channel when tiles split
// groups) into the group's dx coefficients.
template <typename T>
__global__ void grad_finalize_kernel(const BackwardArgs a) {
  const Geometry& g = a.geo;
  const int64_t ng = blockIdx.x, n = ng / g.G, grp = ng % g.G;
  const float2* group_sums = reinterpret_cast<const float2*>(a.group_sums);
  const float2* channel_sums = reinterpret_cast<const float2*>(a.channel_sums);
  const int64_t per_split = g.group_tiles ? 1 : g.D;
  float2 acc = make_float2(0.f, 0.f);
  for (int64_t i = threadIdx.x; i < g.splits * per_split; i += blockDim.x) {
    const int64_t row = n * g.splits + i / per_split;
    if (g.group_tiles) {
      acc = add2(acc, group_sums[row * g.G + grp]);
    } else {
      const int64_t c = grp * g.D + i % per_split;
      const float w = load_param<T>(a.weight, a.params_fp32, c, 1.f);
      acc = add2(acc, make_float2(w * channel_sums[row * g.C + c].x, w * channel_sums[row * g.C + c].y));
    }
  }
  acc = block_reduce(acc, add2, warp_sum2);
  if (threadIdx.x == 0) {
    const float inv_m = 1.f / ((float)g.S * (float)g.D);
    reinterpret_cast<float2*>(a.coeffs)[ng] = make_float2(acc.x * inv_m, acc.y * inv_m);
  }
}

template <typename T, int V, Act A>
__global__ void __launch_bounds__(kMaxThreads, kGradBlocksPerSm) dx_kernel(const BackwardArgs a) {
  const BlockCoord b = block_coord(a.geo, /*reverse=*/true);
  const LaneParams<T, V> p(a, b);
  float2 coef[V];
#pragma unroll
  for (int j = 0; j < V; ++j) coef[j] = reinterpret_cast<const float2*>(a.coeffs)[b.n * a.geo.G + p.group[j]];
  dx_rows<T, V, A>(a, b, p, coef);
}

// Fused geometry: one block holds whole groups over all rows of its image.
template <typename T, int V, Act A>
__global__ void __launch_bounds__(kMaxThreads, kGradBlocksPerSm) fused_backward_kernel(const BackwardArgs a) {
  __shared__ float2 smem[kMaxThreads * V];
  __shared__ float2 group_coef[kMaxThreads * V];
  const Geometry& g = a.geo;
  const BlockCoord b = block_coord(g, /*reverse=*/false);
  const LaneParams<T, V> p(a, b);
  {
    float2 acc[V];
    thread_grad_sums<T, V, A>(a, b, p, acc);
    reduce_rowlanes<float2, V>(acc, smem, g, b.rowlane, add2);
  }
  // smem[i] holds channel (tile start + i).
  const int64_t c0 = tile_first_channel(g, b.tile);
  if (a.channel_sums != nullptr) {
    float2* out = reinterpret_cast<float2*>(a.channel_sums) + b.n * g.C + c0;
    for (int64_t i = threadIdx.x; i < tile_channel_count(g, b.tile); i += blockDim.x) out[i] = smem[i];
  }
  if (a.dx == nullptr) return;  // uniform across the block
  const float inv_m = 1.f / ((float)g.S * (float)g.D);
  reduce_tile_groups<float2>(
      tile_channel_count(g, b.tile) / g.D, g.D, [&](int64_t i) { return weighted<T>(a, smem, c0, i); }, add2,
      warp_sum2, [&](int64_t gl, float2 t) { group_coef[gl] = make_float2(t.x * inv_m, t.y * inv_m); });
  __syncthreads();
  const int64_t group_base = c0 / g.D;
  float2 coef[V];
#pragma unroll
  for (int j = 0; j < V; ++j) coef[j] = b.active ? group_coef[p.group[j] - group_base] : make_float2(0.f, 0.f);
  dx_rows<T, V, A>(a, b, p, coef);
}

// dweight[c] = sum of channel_sums[r, c].y and dbias[c] = sum of channel_sums[r, c].x over the N * splits
// rows r. Block: 32 channels x 8 row lanes, each lane with 4 independent accumulators (loads in flight),
// combined in a fixed order.
template <typename P>
__global__ void param_grad_kernel(const BackwardArgs a, int64_t rows) {
  constexpr int kLanes = 8, kAcc = 4;
  __shared__ float2 smem[kLanes][33];
  const Geometry& g = a.geo;
  const int64_t c = (int64_t)blockIdx.x * 32 + threadIdx.x % 32;
  const int lane = threadIdx.x / 32;
  float2 acc[kAcc];
#pragma unroll
  for (int k = 0; k < kAcc; ++k) acc[k] = make_float2(0.f, 0.f);
  if (c < g.C) {
    const float2* sums = reinterpret_cast<const float2*>(a.channel_sums);
    int64_t r = lane;
    for (; r + (kAcc - 1) * kLanes < rows; r += kAcc * kLanes) {
#pragma unroll
      for (int k = 0; k < kAcc; ++k) acc[k] = add2(acc[k], sums[(r + k * kLanes) * g.C + c]);
    }
    for (; r < rows; r += kLanes) acc[0] = add2(acc[0], sums[r * g.C + c]);
  }
  smem[lane][threadIdx.x % 32] = add2(add2(acc[0], acc[1]), add2(acc[2], acc[3]));
  __syncthreads();
  if (lane == 0 && c < g.C) {
    float2 s = smem[0][threadIdx.x];
    for (int k = 1; k < kLanes; ++k) s = add2(s, smem[k][threadIdx.x]);
    if (a.dweight != nullptr) static_cast<P*>(a.dweight)[c] = from_float<P>(s.y);
    if (a.dbias != nullptr) static_cast<P*>(a.dbias)[c] = from_float<P>(s.x);
  }
}

template <typename T, int V, Act A>
struct Launch {
  static void run(const BackwardArgs& a, cudaStream_t stream) {
    const Geometry& g = a.geo;
    const unsigned threads = g.threads();
    const unsigned blocks = (unsigned)g.blocks();
    if (g.fused) {
      fused_backward_kernel<T, V, A><<<blocks, threads, 0, stream>>>(a);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    } else {
      grad_partial_kernel<T, V, A><<<blocks, threads, 0, stream>>>(a);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      grad_finalize_kernel<T><<<(unsigned)(g.N * g.G), kFinalizeThreads, 0, stream>>>(a);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    if (a.dweight != nullptr || a.dbias != nullptr) {
      const unsigned param_blocks = (unsigned)((g.C + 31) / 32);
      const int64_t rows = g.N * (g.fused ? 1 : g.splits);
      if (a.params_fp32) {
        param_grad_kernel<float><<<param_blocks, 256, 0, stream>>>(a, rows);
      } else {
        param_grad_kernel<T><<<param_blocks, 256, 0, stream>>>(a, rows);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    if (!g.fused && a.dx != nullptr) {
      dx_kernel<T, V, A><<<blocks, threads, 0, stream>>>(a);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }
};

}  // namespace

void launch_backward(const BackwardArgs& a, cudaStream_t stream) { dispatch<Launch>(a, stream); }

}  // namespace gn_patch
