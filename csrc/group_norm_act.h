// Host-side interface between the op binding (ops.cpp) and the CUDA kernels (forward.cuh and backward.cuh, compiled
// per activation: passes.h).
// Plain C++ only: no torch headers, so the .cu files compile without PyTorch's heavy includes.
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

// Functions of the interface's structs that kernels call too.
#ifdef __CUDACC__
#define GN_PATCH_HOST_DEVICE __host__ __device__
#else
#define GN_PATCH_HOST_DEVICE
#endif

namespace gn_patch {

enum class ScalarKind : int { kFloat = 0, kHalf = 1, kBFloat16 = 2 };

// The activation applied after the normalisation; a compile-time template parameter of every kernel.
enum class Act : int { kIdentity = 0, kSilu = 1, kGelu = 2, kGeluTanh = 3, kRelu = 4, kMish = 5 };

// Activations whose forward kernels take ForwardArgs::input_bias and input_offset themselves: SiLU, what diffusers'
// resnet blocks apply after `conv1(x) + temb` and norm2. For the others the op adds them with PyTorch first (the
// kernels are instantiated per activation; one more set for each would add a sixth of the forward's build time
// each, for no block that uses them).
constexpr bool fuses_input_offset(Act act) { return act == Act::kSilu; }

// Threads per block never exceed this.
constexpr int kMaxThreads = 256;
// The most blocks one (image, tile) is spread over: a thread-block cluster of 16 is the largest sm_90 schedules
// (more than 8 is "non-portable" and needs an opt-in per kernel).
constexpr int kMaxCluster = 16;

// Blocks per SM each pass's kernels are compiled for (__launch_bounds__; register caps of 85 and 128 per thread).
constexpr int kForwardBlocksPerSm = 3;
constexpr int kBackwardBlocksPerSm = 2;
// Threads of a backward block whose rows a cluster splits, at most: blocks of 160 threads fit three per SM under the
// backward's register cap (65536 / (3 * 128) = 170), 256 fit two, and a cluster's blocks wait for each other at its
// barrier, so more of them in flight per SM is what hides the memory latency. On the H200 (fp16, backward, inputs in
// L2): (2, 320, 64, 64) 21.1 -> 18.7 us, (2, 640, 32, 32) 15.1 -> 12.1, (2, 2560, 32, 32) 32.4 -> 26.7,
// (1, 512, 128, 128) 55.9 -> 49.8. Unsplit blocks (a grid full of (image, tile) pairs) and the unclustered kernels
// keep kMaxThreads: capped, (16, 640, 32, 32) went 44.2 -> 49.4 and (1, 512, 256, 256) 157 -> 185
// (benchmarks/results/h200/ab_thread_caps.json, benchmarks/NOTES.md session 19).
constexpr int kBackwardSplitThreads = kMaxThreads * kBackwardBlocksPerSm / (kBackwardBlocksPerSm + 1) / 32 * 32;
// Channels of one tile, at most (the backward keeps per-channel sums of a tile in shared memory).
constexpr int kMaxTileChannels = 1024;

// Thread-block clusters of one kernel resident on a device at once (cudaOccupancyMaxActiveClusters): a cluster's
// blocks run in one GPC, so fewer fit than SMs x blocks per SM / cluster size (on the H200, 128-register blocks of
// 224 threads: 30 clusters of 8, not 33; 14 of 16, not 16).
struct ClusterOccupancy {
  static constexpr int kSizes = 5;  // clusters of 1 (unused), 2, 4, 8, 16 blocks
  static constexpr int kWarps = kMaxThreads / 32;
  // clusters[log2 size][warps per block - 1]; 0: not known
  int clusters[kSizes][kWarps] = {};

  // Clusters of `size` blocks (a power of two) of `threads` threads (a multiple of 32) resident at once; 0: unknown.
  int at(int64_t size, int threads) const {
    int log2 = 0;
    while ((int64_t{1} << log2) < size) ++log2;
    return log2 < kSizes && threads >= 32 && threads <= kMaxThreads ? clusters[log2][threads / 32 - 1] : 0;
  }
};

// What the device offers the geometry (read once per device by the op binding).
struct DeviceLimits {
  int num_sms = 1;
  int max_cluster = 1;  // 1: no thread-block clusters (before sm_90)
  int64_t l2_bytes = 0;  // L2 cache size
  // The pass's clustered kernel's, where known (else the geometry counts SMs x blocks per SM).
  const ClusterOccupancy* occupancy = nullptr;
};

// Division of an unsigned n < 2^31 by a fixed divisor d (1 <= d < 2^31) as a multiply-high, an add and a shift
// (Granlund & Montgomery 1994, "Division by invariant integers using multiplication", the round-up method): with
// l = ceil(log2 d) and m = floor(2^32 (2^l - d) / d) + 1, n / d = (mulhi(n, m) + n) >> l. The kernels' block and
// thread coordinates divide by geometry values known only at run time, where the GPU's integer division is a
// sequence of ~15 instructions on the critical path of the small kernels.
struct FastDivider {
  uint32_t divisor = 1;
  uint32_t magic = 1;
  uint32_t shift = 0;

  static FastDivider of(uint32_t d) {
    FastDivider f;
    f.divisor = d;
    while (f.shift < 32 && (uint64_t{1} << f.shift) < d) ++f.shift;
    f.magic = (uint32_t)(((uint64_t{1} << 32) * ((uint64_t{1} << f.shift) - d)) / d + 1);
    return f;
  }
  GN_PATCH_HOST_DEVICE uint32_t div(uint32_t n) const {
#ifdef __CUDA_ARCH__
    const uint32_t high = __umulhi(n, magic);
#else
    const uint32_t high = (uint32_t)(((uint64_t)n * magic) >> 32);
#endif
    return (high + n) >> shift;
  }
};

// Which pass a geometry is for: the two hold different data per thread in registers.
enum class Pass : int { kForward = 0, kBackward = 1 };

// How one (N, S, C) channels-last tensor is cut into thread blocks.
//   - A row is one spatial position: C contiguous channels, read as vectors of `vec` elements. vec divides the
//     group size D, so every vector (every thread) lies in one group; except in `straddle` geometries, whose
//     16-byte vectors may span two groups (D > vec, not a multiple of it: e.g. C = 320, 640, 960 or 1920 with G = 32),
//     each thread then keeping both groups' statistics (forward) or moments and dx coefficients (backward).
//   - A tile is `groups_per_tile` consecutive groups: tile_vecs = groups_per_tile * vecs_per_group vectors of a
//     row. Block threads are (rowlane, col) with col < tile_vecs fastest; a block walks its rows block_rows at a
//     time.
//   - The rows of one (image n, tile) are split over `splits` blocks (rows_per_block each). Clustered: the splits
//     form one thread-block cluster that combines its group statistics (forward) or channel sums (backward)
//     through distributed shared memory, and each pass is one kernel (the backward's cluster may hold the splits of
//     all N images of the tile: `images`). Otherwise (more splits than a cluster holds, for large images with wide
//     tiles) partial results go through global scratch: three kernels per pass.
//   - resident: every thread has at most resident_rows(pass) rows, kept in registers between the reduction and
//     the output (x read once); otherwise the output pass reads the block's rows again.
struct Geometry {
  int64_t N = 0;  // batch
  int64_t S = 0;  // spatial positions per image (H*W, D*H*W or L)
  int64_t C = 0;  // channels
  int64_t G = 0;  // groups
  int64_t D = 0;  // channels per group, C / G
  int vec = 1;
  bool straddle = false;
  int vecs_per_group = 1;  // D / vec; 0 when straddle (groups are not whole vectors)
  int groups_per_tile = 1;
  int tile_vecs = 1;
  int64_t tiles = 1;
  int block_rows = 1;
  int64_t splits = 1;
  bool clustered = true;
  int64_t rows_per_block = 0;
  int64_t rows_per_thread = 0;  // the most rows one thread visits
  bool resident = false;
  // Images per cluster, 1 or N (backward only): the blocks of all N images of a tile form one cluster, which sums
  // the weight and bias gradients over the images itself (else a second kernel does). Blocks are then ordered
  // (tile, n, split) instead of (n, tile, split).
  int64_t images = 1;
  // The forward's normalising pass reads streamed rows again last first: set where the tensor outgrows L2, whose
  // most recently read rows are then the only ones still there.
  bool reread_reversed = false;
  // Forward only: where frames > 1 (the op's frames_last), an image's rows, x's (F, H, W) positions in order, are
  // written to y transposed as a (frames, S / frames) matrix: row f * (S / frames) + p (frame f, position p of the
  // H * W) goes to y's row p * frames + f, y's memory then being (N, H, W, F, C). div_frame_rows divides by S / frames.
  int64_t frames = 1;
  FastDivider div_frame_rows;
  // Dividers by splits, tiles, images, tile_vecs, vecs_per_group (1 when straddle), block_rows and, when straddle,
  // D (else 1) (geometry.cpp's with_dividers).
  FastDivider div_splits, div_tiles, div_images, div_tile_vecs, div_vecs_per_group, div_block_rows, div_D;

  int threads() const { return (tile_vecs * block_rows + 31) / 32 * 32; }
  int64_t blocks() const { return N * tiles * splits; }
  // Blocks per thread-block cluster (1: no cluster).
  GN_PATCH_HOST_DEVICE int cluster() const { return clustered ? (int)(splits * images) : 1; }
};

// Rows a thread keeps in registers: up to 24 registers of data and 16 rows in the forward, up to 16 registers
// and 8 rows each of x and dy in the backward (row addresses and lane constants take registers too). With 32
// registers of 16-byte rows the forward spilled rows to local memory under its 80-register cap (ptxas -v: 56-84
// bytes; 4 bytes remain in some half/bfloat16 instantiations).
constexpr int pack_registers(int vec_bytes) { return vec_bytes < 4 ? 1 : vec_bytes / 4; }
// Rows of vec_bytes that fit `registers` registers, at most `cap`.
constexpr int rows_in_registers(int registers, int vec_bytes, int cap) {
  return registers / pack_registers(vec_bytes) < cap ? registers / pack_registers(vec_bytes) : cap;
}
// Straddling vectors keep per-lane sums and references (forward) or two groups' moments and dx coefficients
// (backward) besides: 12 registers of rows (24 spilled ~100 bytes under the forward's cap, 16 ~40 bytes; 16 each of
// x and dy spilled 16-52 bytes under the backward's; ptxas -v).
constexpr int resident_rows(Pass pass, int vec_bytes, bool straddle = false) {
  if (pass == Pass::kBackward) return rows_in_registers(straddle ? 12 : 16, vec_bytes, 8);
  return rows_in_registers(straddle ? 12 : 24, vec_bytes, 16);
}

// The widest vector (elements) that divides D, fits 16 bytes and keeps every accessed pointer aligned.
// `alignment`: the largest power of two dividing every data pointer's address (bytes).
int choose_vec(int64_t D, int elem_size, int64_t alignment);

// Vectors of 16 bytes whose lanes may straddle two groups, for a pass where choose_vec's are narrower: their
// width if the elements are 16-bit, D is larger than a vector (not a multiple of it), tiles of whole vectors
// exist and the pointers are 16-byte aligned; else 0.
int straddling_vec(int64_t D, int64_t G, int elem_size, int64_t alignment);

// The geometry of `pass` for vector width `vec` (from choose_vec, or straddling_vec for the forward).
Geometry make_geometry(Pass pass, int64_t N, int64_t S, int64_t C, int64_t G, int elem_size, int vec,
                       const DeviceLimits& limits);


struct ForwardArgs {
  Geometry geo;
  ScalarKind dtype;
  Act act;
  const void* x;
  const void* weight;  // (C,) or nullptr: all ones
  const void* bias;    // (C,) or nullptr: all zeros
  const void* scale;   // (N, C) or nullptr: y = act(GN(x) * (1 + scale) + shift)
  const void* shift;   // (N, C) or nullptr
  // (C,) and (N, C) in x's dtype, or nullptr: (x + input_bias) + input_offset, each add rounded to x's dtype as
  // PyTorch's, is what is normalised; only for activations with fuses_input_offset.
  const void* input_bias;
  const void* input_offset;
  bool params_fp32;    // weight/bias are float32 (else the input's dtype)
  bool modulation_fp32;  // scale/shift are float32 (else the input's dtype)
  float eps;
  void* y;
  float* mean;  // (N, G), or null: an inference call (gn_patch::group_norm_act_inference) returns y alone
  float* rstd;  // (N, G), or null with mean
  // Unclustered splits only (else nullptr): (N, splits, G) partial statistics, then (N, G) group statistics,
  // 4 floats each (struct Welford; then reference, mean offset, rstd).
  float* partials;
  float* group_stats;
};

struct BackwardArgs {
  Geometry geo;
  ScalarKind dtype;
  Act act;
  const void* dy;
  const void* x;
  const void* weight;
  const void* bias;
  const void* scale;
  const void* shift;
  bool params_fp32;
  bool modulation_fp32;
  const float* mean;
  const float* rstd;
  void* dx;            // nullptr: not required
  void* dweight;       // nullptr: not required; else weight's dtype, (C,)
  void* dbias;         // nullptr: not required; else bias's dtype, (C,)
  void* dscale;        // nullptr: not required; else scale's dtype, (N, C)
  void* dshift;        // nullptr: not required; else shift's dtype, (N, C)
  float* param_sums;   // (N, C) pairs (sum du * m, sum du * m * xhat) for dweight/dbias when N > 1 and the
                       // images are not in one cluster (Geometry::images), else nullptr
  // Unclustered splits only (else nullptr): (N, splits, C) pairs of channel sums (sum du, sum du * xhat), then
  // (N, G) pairs of dx coefficients.
  float* channel_partials;
  float* coefficients;
  // Whether a kernel of ours, launched as a dependent, follows the one launched with these arguments: it then lets
  // it launch early (let_dependents_launch). Set per launch by launch_backward_kernels, which orders them.
  bool dependent_follows = false;
};

void launch_forward(const ForwardArgs& args, cudaStream_t stream);
void launch_backward(const BackwardArgs& args, cudaStream_t stream);

// The largest cluster (power of two <= kMaxCluster) the pass's kernel for (dtype, vec, act) launches with on the
// current device: 1 without thread-block clusters (before sm_90). Cached per device; opts the kernel in to
// clusters larger than 8 where the device schedules them.
int forward_max_cluster(ScalarKind dtype, int vec, Act act);
int backward_max_cluster(ScalarKind dtype, int vec, Act act);

// The pass's clustered kernel's occupancy for (dtype, vec, act, straddle) on the current device, for clusters of up
// to max_cluster blocks (the pass's *_max_cluster), queried once per device; nullptr where unknown (no clusters, or
// first asked inside a CUDA-graph capture).
const ClusterOccupancy* forward_cluster_occupancy(ScalarKind dtype, int vec, Act act, bool straddle, int max_cluster);
const ClusterOccupancy* backward_cluster_occupancy(ScalarKind dtype, int vec, Act act, bool straddle,
                                                   int max_cluster);

}  // namespace gn_patch
