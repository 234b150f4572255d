// Host-side launch helpers shared by forward.cuh and backward.cuh: the dtype/vector dispatch to the kernels'
// template arguments, and cluster launches.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <climits>
#include <mutex>
#include <string>

#include "group_norm_act.h"

namespace gn_patch {

// Calls Kernels<T, V, A>::fn(args...) for the runtime dtype and vector width (16 bytes of T, or a smaller power of
// two: make_geometry's choice). Every combination is instantiated, so every kernel of activation A exists for every
// input the op accepts.
template <template <typename, int, Act> class Kernels, typename T, Act A, typename... Args>
auto dispatch_vector(int vec, Args&&... args) {
  constexpr int kFull = 16 / sizeof(T);
  if (vec == kFull) return Kernels<T, kFull, A>::fn(args...);
  if (vec == kFull / 2) return Kernels<T, kFull / 2, A>::fn(args...);
  if constexpr (kFull == 8) {
    if (vec == 2) return Kernels<T, 2, A>::fn(args...);
  }
  return Kernels<T, 1, A>::fn(args...);
}

template <template <typename, int, Act> class Kernels, Act A, typename... Args>
auto dispatch_type(ScalarKind dtype, int vec, Args&&... args) {
  switch (dtype) {
    case ScalarKind::kHalf: return dispatch_vector<Kernels, __half, A>(vec, args...);
    case ScalarKind::kBFloat16: return dispatch_vector<Kernels, __nv_bfloat16, A>(vec, args...);
    case ScalarKind::kFloat: break;
  }
  return dispatch_vector<Kernels, float, A>(vec, args...);
}

// The launch attribute of a 1-D thread-block cluster of `size` blocks.
inline cudaLaunchAttribute cluster_dimension(unsigned size) {
  cudaLaunchAttribute cluster;
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = size;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  return cluster;
}

// Devices the per-device caches below hold.
constexpr size_t kMaxDevices = 64;

// The current device, an index into this file's per-device caches (`entries` long).
inline int cached_device(size_t entries) {
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  TORCH_CHECK(device >= 0 && device < (int)entries, "gn_patch: device index out of range");
  return device;
}

// Whether the kernels run on the current device with what reduce.cuh compiles for sm_90 (GN_PATCH_CLUSTERS:
// distributed shared memory, griddepcontrol): the device has thread-block clusters and `kernel`, like every kernel of
// this library (one set of -gencode flags), runs code compiled for sm_90 or later. An older PTX compiled just in time
// for the device (a build for "8.0+PTX" on an H100) leaves them out: its clustered kernels would not combine their
// blocks' sums, its dependent kernels would not wait. Asked per device once (device and function attributes, which
// may be asked during a CUDA-graph capture).
inline bool sm90_features(int device, const void* kernel) {
  static std::array<std::atomic<int>, kMaxDevices> cache{};  // 0: not asked yet, 1: no, 2: yes
  int known = cache[device].load(std::memory_order_relaxed);
  if (known == 0) {
    int clusters = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&clusters, cudaDevAttrClusterLaunch, device));
    cudaFuncAttributes attributes = {};
    C10_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
    known = clusters && attributes.ptxVersion >= 90 ? 2 : 1;
    cache[device].store(known, std::memory_order_relaxed);
  }
  return known == 2;
}

// Programmatic dependent launch (sm_90 on; CUDA 12.3 on, which captures it in CUDA graphs): the backward's second
// and later kernels are launched as dependents of the kernel before them, so that they are launched while it still
// runs (let_dependents_launch and wait_for_prerequisite in reduce.cuh) and the launch latency overlaps it. On the
// H200 (fp16, forward+backward, inputs rotated out of L2): (2, 1280, 8, 8) 11.1 -> 10.6 us, (2, 640, 16, 16) 12.7
// -> 12.1, (2, 320, 64, 64) 32.4 -> 31.5 (param_grad_kernel after the backward kernel), (1, 512, 256, 256) 227 -> 224
// (the unclustered chain). The forward's unclustered chain was slower so: (1, 128, 512, 512) 83 -> 91 us
// (benchmarks/NOTES.md session 20).
// The toolkit that compiled the kernels may be newer than the CUDA runtime they run with (torch's) or the driver
// (kernels built with 12.4 against a 12.1 runtime, or run on a 12.2 driver): both are asked too, once.
inline bool programmatic_launch(int device, const void* kernel) {
#if CUDART_VERSION >= 12030
  static const bool runtime_and_driver = [] {
    int runtime = 0, driver = 0;
    return cudaRuntimeGetVersion(&runtime) == cudaSuccess && cudaDriverGetVersion(&driver) == cudaSuccess &&
           runtime >= 12030 && driver >= 12030;
  }();
  return runtime_and_driver && sm90_features(device, kernel);
#else
  (void)device;
  (void)kernel;
  return false;
#endif
}

// The launch attribute of a dependent launch.
inline cudaLaunchAttribute programmatic_serialization() {
  cudaLaunchAttribute dependent;
  dependent.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  dependent.val.programmaticStreamSerializationAllowed = 1;
  return dependent;
}

// Launches `kernel(args...)` on `grid` blocks of `threads`, as thread-block clusters of `cluster` blocks when > 1, and
// as a dependent of the stream's previous kernel when `dependent` (and the device supports it).
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), int64_t grid, int threads, int cluster, bool dependent, cudaStream_t stream,
            Args&&... args) {
  TORCH_CHECK(grid < (int64_t{1} << 31), "gn_patch: the tensor needs " + std::to_string(grid) +
                                             " blocks, more than a CUDA grid holds");
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3((unsigned)grid);
  config.blockDim = dim3((unsigned)threads);
  config.stream = stream;
  cudaLaunchAttribute attrs[2];
  if (cluster > 1) attrs[config.numAttrs++] = cluster_dimension((unsigned)cluster);
  if (dependent && programmatic_launch(cached_device(kMaxDevices), reinterpret_cast<const void*>(kernel))) {
    attrs[config.numAttrs++] = programmatic_serialization();
  }
  config.attrs = attrs;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

// Launches `kernel(args)` over the geometry's grid, as thread-block clusters of g.cluster() blocks when > 1.
template <typename Args>
void launch_kernel(void (*kernel)(Args), const Geometry& g, cudaStream_t stream, const Args& args,
                   bool dependent = false) {
  launch(kernel, g.blocks(), g.threads(), g.cluster(), dependent, stream, args);
}

// Straddling geometries exist for 16-byte vectors of 16-bit types only (straddling_vec): the kernels are
// instantiated with Straddle for those alone.
template <typename T, int V>
constexpr bool kStraddles = sizeof(T) == 2 && V == 8;

// Whether the current stream is capturing a CUDA graph: the kernels' opt-ins and occupancy queries are not made then.
inline bool capturing() {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(), &capture));
  return capture != cudaStreamCaptureStatusNone;
}

// The largest power-of-two cluster (<= kMaxCluster) `kernel` launches with on the current device, with blocks of
// kMaxThreads threads; 1 without cluster support. Opts the kernel in to non-portable sizes (> 8) where the
// device schedules them. `cache` holds one entry per device (0: not queried yet).
template <typename Args>
int query_max_cluster(void (*kernel)(Args), std::array<std::atomic<int>, kMaxDevices>& cache) {
  const int device = cached_device(cache.size());
  const int cached = cache[device].load(std::memory_order_relaxed);
  if (cached > 0) return cached;
  const bool supported = sm90_features(device, reinterpret_cast<const void*>(kernel));
  if (supported && capturing()) return 8;  // portable clusters until asked outside a capture
  int result = 1;
  if (supported) {
    result = 8;  // every sm_90 device schedules clusters of 8 ("portable")
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) == cudaSuccess) {
      cudaLaunchConfig_t config = {};
      config.gridDim = dim3(kMaxCluster);
      config.blockDim = dim3(kMaxThreads);
      cudaLaunchAttribute cluster = cluster_dimension(kMaxCluster);
      config.attrs = &cluster;
      config.numAttrs = 1;
      int clusters = 0;
      if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) == cudaSuccess && clusters > 0) {
        result = kMaxCluster;
      }
    }
    (void)cudaGetLastError();  // a refused opt-in or query is an answer, not an error to report later
  }
  cache[device].store(result, std::memory_order_relaxed);
  return result;
}

// One kernel's ClusterOccupancy per device, filled once.
struct OccupancyCache {
  std::mutex mutex;
  std::array<std::atomic<bool>, kMaxDevices> ready{};
  std::array<ClusterOccupancy, kMaxDevices> tables{};
};

// The ClusterOccupancy on the current device for clusters of up to max_cluster blocks of the kernels that one
// geometry may launch, entry by entry the fewest clusters any of them fits (query_max_cluster opts each in to the
// non-portable sizes), queried on first use. nullptr without clusters, or when first asked inside a CUDA-graph
// capture (the query is not made there, as in query_max_cluster).
template <typename Args, size_t K>
const ClusterOccupancy* query_cluster_occupancy(const std::array<void (*)(Args), K>& kernels, int max_cluster,
                                                OccupancyCache& cache) {
  if (max_cluster < 2) return nullptr;
  const int device = cached_device(cache.tables.size());
  if (cache.ready[device].load(std::memory_order_acquire)) return &cache.tables[device];
  if (capturing()) return nullptr;
  const std::lock_guard<std::mutex> lock(cache.mutex);
  if (!cache.ready[device].load(std::memory_order_relaxed)) {
    ClusterOccupancy& table = cache.tables[device];
    for (int log2 = 1; log2 < ClusterOccupancy::kSizes && (1 << log2) <= max_cluster; ++log2) {
      for (int warps = 1; warps <= ClusterOccupancy::kWarps; ++warps) {
        cudaLaunchConfig_t config = {};
        config.gridDim = dim3(1u << log2);
        config.blockDim = dim3(32u * warps);
        cudaLaunchAttribute cluster = cluster_dimension(1u << log2);
        config.attrs = &cluster;
        config.numAttrs = 1;
        int fewest = INT_MAX;
        for (const auto kernel : kernels) {
          int clusters = 0;
          if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) != cudaSuccess) clusters = 0;
          fewest = std::min(fewest, clusters);
        }
        table.clusters[log2][warps - 1] = fewest;
      }
    }
    (void)cudaGetLastError();  // a refused query leaves 0 (unknown), not an error to report later
    cache.ready[device].store(true, std::memory_order_release);
  }
  return &cache.tables[device];
}

}  // namespace gn_patch
