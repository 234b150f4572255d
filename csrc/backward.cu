// Backward of y = act(u), u = xhat * w[c] + b[c], xhat = (x - mean[n,g]) * rstd[n,g].
//   du     = dy * act'(u)
//   dbias  = sum_{n,s} du                 dweight = sum_{n,s} du * xhat
//   dx     = rstd * (w * du - mean_g(w * du) - xhat * mean_g(w * du * xhat))
// where mean_g averages over the M = S * D elements of the group (the standard normalisation backward,
// e.g. Ioffe & Szegedy 2015, eq. for dL/dx_i, applied per (n, g)).
//
// Kernels (no atomics: every reduction has a fixed order, so gradients are bitwise deterministic):
//   fused geometry: fused_backward (sums, group coefficients and dx in one block) + param_grad
//   split geometry: grad_partial -> grad_finalize (per (n, g)) -> param_grad -> dx
#include <c10/cuda/CUDAException.h>

#include "reduce.cuh"

namespace gn_patch {
namespace {

__device__ __forceinline__ float2 add2(float2 a, float2 b) { return make_float2(a.x + b.x, a.y + b.y); }

// Per-lane constants: the lane's group statistics and affine parameters.
template <typename T, int V>
struct LaneParams {
  float mean[V], rstd[V], w[V], bias[V];
  int64_t group[V];

  __device__ __forceinline__ LaneParams(const BackwardArgs& a, const BlockCoord& b) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int64_t c = b.active ? b.c0 + j : 0;
      group[j] = c / a.geo.D;
      mean[j] = a.mean[b.n * a.geo.G + group[j]];
      rstd[j] = a.rstd[b.n * a.geo.G + group[j]];
      w[j] = load_param<T>(a.weight, a.params_fp32, c, 1.f);
      bias[j] = load_param<T>(a.bias, a.params_fp32, c, 0.f);
    }
  }
};

// sum du and sum du * xhat of this thread's channels over its rows.
template <typename T, int V, Act A>
__device__ __forceinline__ void thread_grad_sums(const BackwardArgs& a, const BlockCoord& b,
                                                 const LaneParams<T, V>& p, float2 (&acc)[V]) {
#pragma unroll
  for (int j = 0; j < V; ++j) acc[j] = make_float2(0.f, 0.f);
  if (!b.active) return;
  const Geometry& g = a.geo;
  const T* x = static_cast<const T*>(a.x);
  const T* dy = static_cast<const T*>(a.dy);
  const int64_t offset = b.n * g.S * g.C + b.c0;
  const int64_t step = g.block_rows;
  int64_t r = b.row_begin + b.rowlane;
  for (; r + (kUnroll - 1) * step < b.row_end; r += kUnroll * step) {
    float xv[kUnroll][V], gv[kUnroll][V];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      load_vec<T, V>(x + offset + (r + u * step) * g.C, xv[u]);
      load_vec<T, V>(dy + offset + (r + u * step) * g.C, gv[u]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float z = (xv[u][j] - p.mean[j]) * p.rstd[j];
        const float du = gv[u][j] * Activation<A>::df(fmaf(z, p.w[j], p.bias[j]));
        acc[j].x += du;
        acc[j].y = fmaf(du, z, acc[j].y);
      }
    }
  }
  for (; r < b.row_end; r += step) {
    float xv[V], gv[V];
    load_vec<T, V>(x + offset + r * g.C, xv);
    load_vec<T, V>(dy + offset + r * g.C, gv);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float z = (xv[j] - p.mean[j]) * p.rstd[j];
      const float du = gv[j] * Activation<A>::df(fmaf(z, p.w[j], p.bias[j]));
      acc[j].x += du;
      acc[j].y = fmaf(du, z, acc[j].y);
    }
  }
}

// dx over this thread's rows; coef[j] = (mean_g(w*du), mean_g(w*du*xhat)) of lane j's group.
template <typename T, int V, Act A>
__device__ __forceinline__ void dx_rows(const BackwardArgs& a, const BlockCoord& b, const LaneParams<T, V>& p,
                                        const float2 (&coef)[V]) {
  if (!b.active) return;
  const Geometry& g = a.geo;
  const T* x = static_cast<const T*>(a.x);
  const T* dy = static_cast<const T*>(a.dy);
  T* dx = static_cast<T*>(a.dx);
  const int64_t offset = b.n * g.S * g.C + b.c0;
  const int64_t step = g.block_rows;
  int64_t r = b.row_begin + b.rowlane;
  auto grad = [&](float xj, float gj, int j) {
    const float z = (xj - p.mean[j]) * p.rstd[j];
    const float du = gj * Activation<A>::df(fmaf(z, p.w[j], p.bias[j]));
    return p.rstd[j] * (p.w[j] * du - coef[j].x - z * coef[j].y);
  };
  for (; r + (kUnroll - 1) * step < b.row_end; r += kUnroll * step) {
    float xv[kUnroll][V], gv[kUnroll][V];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      load_vec<T, V>(x + offset + (r + u * step) * g.C, xv[u]);
      load_vec<T, V>(dy + offset + (r + u * step) * g.C, gv[u]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int j = 0; j < V; ++j) xv[u][j] = grad(xv[u][j], gv[u][j], j);
      store_vec<T, V>(dx + offset + (r + u * step) * g.C, xv[u]);
    }
  }
  for (; r < b.row_end; r += step) {
    float xv[V], gv[V];
    load_vec<T, V>(x + offset + r * g.C, xv);
    load_vec<T, V>(dy + offset + r * g.C, gv);
#pragma unroll
    for (int j = 0; j < V; ++j) xv[j] = grad(xv[j], gv[j], j);
    store_vec<T, V>(dx + offset + r * g.C, xv);
  }
}

template <typename T, int V, Act A>
__global__ void grad_partial_kernel(const BackwardArgs a) {
  __shared__ float2 smem[kMaxThreads * V];
  const Geometry& g = a.geo;
  const BlockCoord b = block_coord(g, /*reverse=*/false);
  const LaneParams<T, V> p(a, b);
  float2 acc[V];
  thread_grad_sums<T, V, A>(a, b, p, acc);
  reduce_rowlanes<float2, V>(acc, smem, g, b.rowlane, add2);
  if (b.rowlane == 0 && b.active) {
    float2* out = reinterpret_cast<float2*>(a.partials) + (b.n * g.splits + b.split) * g.C + b.c0;
#pragma unroll
    for (int j = 0; j < V; ++j) out[j] = acc[j];
  }
}

// One warp per (n, g): per-channel sums over splits, and the group's dx coefficients.
template <typename T>
__global__ void grad_finalize_kernel(const BackwardArgs a) {
  const Geometry& g = a.geo;
  const int lane = threadIdx.x % 32;
  const int64_t ng = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  if (ng >= g.N * g.G) return;  // whole warps exit together: no barrier below
  const int64_t n = ng / g.G, grp = ng % g.G;
  const float2* part = reinterpret_cast<const float2*>(a.partials);
  float2 coef = make_float2(0.f, 0.f);
  for (int64_t i = lane; i < g.D; i += 32) {
    const int64_t c = grp * g.D + i;
    float2 s = make_float2(0.f, 0.f);
    for (int64_t k = 0; k < g.splits; ++k) s = add2(s, part[(n * g.splits + k) * g.C + c]);
    reinterpret_cast<float2*>(a.channel_sums)[n * g.C + c] = s;
    const float w = load_param<T>(a.weight, a.params_fp32, c, 1.f);
    coef.x = fmaf(w, s.x, coef.x);
    coef.y = fmaf(w, s.y, coef.y);
  }
  coef.x = warp_sum(coef.x);
  coef.y = warp_sum(coef.y);
  if (lane == 0) {
    const float inv_m = 1.f / ((float)g.S * (float)g.D);
    reinterpret_cast<float2*>(a.coeffs)[ng] = make_float2(coef.x * inv_m, coef.y * inv_m);
  }
}

template <typename T, int V, Act A>
__global__ void dx_kernel(const BackwardArgs a) {
  const BlockCoord b = block_coord(a.geo, /*reverse=*/true);
  const LaneParams<T, V> p(a, b);
  float2 coef[V];
#pragma unroll
  for (int j = 0; j < V; ++j) coef[j] = reinterpret_cast<const float2*>(a.coeffs)[b.n * a.geo.G + p.group[j]];
  dx_rows<T, V, A>(a, b, p, coef);
}

// Fused geometry: one block holds whole groups over all rows of its image.
template <typename T, int V, Act A>
__global__ void fused_backward_kernel(const BackwardArgs a) {
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
  // smem[i] holds channel (tile_c0 + i).
  const int64_t tile_c0 = b.tile * g.tile_vecs * g.vec;
  const int64_t tile_channels = min((int64_t)g.tile_vecs * g.vec, g.C - tile_c0);
  if (a.channel_sums != nullptr) {
    float2* out = reinterpret_cast<float2*>(a.channel_sums) + b.n * g.C + tile_c0;
    for (int64_t i = threadIdx.x; i < tile_channels; i += blockDim.x) out[i] = smem[i];
  }
  if (a.dx == nullptr) return;  // uniform across the block
  const int64_t group_base = tile_c0 / g.D;
  const int lane = threadIdx.x % 32;
  const float inv_m = 1.f / ((float)g.S * (float)g.D);
  for (int64_t gl = threadIdx.x / 32; gl < tile_channels / g.D; gl += blockDim.x / 32) {
    float2 coef = make_float2(0.f, 0.f);
    for (int64_t i = lane; i < g.D; i += 32) {
      const float w = load_param<T>(a.weight, a.params_fp32, tile_c0 + gl * g.D + i, 1.f);
      coef.x = fmaf(w, smem[gl * g.D + i].x, coef.x);
      coef.y = fmaf(w, smem[gl * g.D + i].y, coef.y);
    }
    coef.x = warp_sum(coef.x);
    coef.y = warp_sum(coef.y);
    if (lane == 0) group_coef[gl] = make_float2(coef.x * inv_m, coef.y * inv_m);
  }
  __syncthreads();
  float2 coef[V];
#pragma unroll
  for (int j = 0; j < V; ++j) coef[j] = b.active ? group_coef[p.group[j] - group_base] : make_float2(0.f, 0.f);
  dx_rows<T, V, A>(a, b, p, coef);
}

// dweight[c] = sum_n channel_sums[n, c].y, dbias[c] = sum_n channel_sums[n, c].x.
// Block: 32 channels x 8 batch lanes, fixed-order tree over the lanes.
template <typename P>
__global__ void param_grad_kernel(const BackwardArgs a) {
  __shared__ float2 smem[8][33];
  const Geometry& g = a.geo;
  const int64_t c = (int64_t)blockIdx.x * 32 + threadIdx.x % 32;
  const int lane_n = threadIdx.x / 32;
  float2 s = make_float2(0.f, 0.f);
  if (c < g.C) {
    const float2* sums = reinterpret_cast<const float2*>(a.channel_sums);
    for (int64_t n = lane_n; n < g.N; n += 8) s = add2(s, sums[n * g.C + c]);
  }
  smem[lane_n][threadIdx.x % 32] = s;
  __syncthreads();
  if (lane_n == 0 && c < g.C) {
    for (int k = 1; k < 8; ++k) s = add2(s, smem[k][threadIdx.x]);
    if (a.dweight != nullptr) static_cast<P*>(a.dweight)[c] = from_float<P>(s.y);
    if (a.dbias != nullptr) static_cast<P*>(a.dbias)[c] = from_float<P>(s.x);
  }
}

template <typename T, int V, Act A>
void launch_typed(const BackwardArgs& a, cudaStream_t stream) {
  const Geometry& g = a.geo;
  const unsigned threads = g.threads();
  const unsigned blocks = (unsigned)g.blocks();
  if (g.fused) {
    fused_backward_kernel<T, V, A><<<blocks, threads, 0, stream>>>(a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  } else {
    grad_partial_kernel<T, V, A><<<blocks, threads, 0, stream>>>(a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    constexpr int kWarps = 8;
    const unsigned finalize_blocks = (unsigned)((g.N * g.G + kWarps - 1) / kWarps);
    grad_finalize_kernel<T><<<finalize_blocks, kWarps * 32, 0, stream>>>(a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (a.dweight != nullptr || a.dbias != nullptr) {
    const unsigned param_blocks = (unsigned)((g.C + 31) / 32);
    if (a.params_fp32) {
      param_grad_kernel<float><<<param_blocks, 256, 0, stream>>>(a);
    } else {
      param_grad_kernel<T><<<param_blocks, 256, 0, stream>>>(a);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (!g.fused && a.dx != nullptr) {
    dx_kernel<T, V, A><<<blocks, threads, 0, stream>>>(a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

template <typename T, int V>
void dispatch_act(const BackwardArgs& a, cudaStream_t stream) {
  switch (a.act) {
    case Act::kIdentity: return launch_typed<T, V, Act::kIdentity>(a, stream);
    case Act::kSilu: return launch_typed<T, V, Act::kSilu>(a, stream);
    case Act::kGelu: return launch_typed<T, V, Act::kGelu>(a, stream);
    case Act::kGeluTanh: return launch_typed<T, V, Act::kGeluTanh>(a, stream);
    case Act::kRelu: return launch_typed<T, V, Act::kRelu>(a, stream);
  }
}

template <typename T>
void dispatch_vec(const BackwardArgs& a, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  if (a.geo.vec == kVec) return dispatch_act<T, kVec>(a, stream);
  return dispatch_act<T, 1>(a, stream);
}

}  // namespace

void launch_backward(const BackwardArgs& a, cudaStream_t stream) {
  if (a.geo.blocks() == 0) return;
  switch (a.dtype) {
    case ScalarKind::kFloat: return dispatch_vec<float>(a, stream);
    case ScalarKind::kHalf: return dispatch_vec<__half>(a, stream);
    case ScalarKind::kBFloat16: return dispatch_vec<__nv_bfloat16>(a, stream);
  }
}

}  // namespace gn_patch
