// Host-side interface between the op binding (ops.cpp) and the CUDA kernels (forward.cu, backward.cu).
// Plain C++ only: no torch headers, so the .cu files compile without PyTorch's heavy includes.
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

namespace gn_patch {

enum class ScalarKind : int { kFloat = 0, kHalf = 1, kBFloat16 = 2 };

// The activation fused after the normalisation; a compile-time template parameter of every kernel.
enum class Act : int { kIdentity = 0, kSilu = 1, kGelu = 2, kGeluTanh = 3, kRelu = 4 };

// How one (N, S, C) channels-last tensor is cut into thread blocks. Both passes of an op use the same cut.
//   - A row is one spatial position: C contiguous channels, read as C / vec vectors of `vec` elements.
//   - A tile is `tile_vecs` consecutive vectors of a row; a block owns one (image n, split, tile) and walks
//     rows [split * rows_per_split, +rows_per_split) with `block_rows` rows in flight, one vector per thread.
//   - fused: one split per image and tiles made of whole groups, so a single block sees every element of
//     its groups and the statistics, normalisation (or gradient) run in one kernel.
//   - split: partial results per (n, split) are written to scratch and combined by a finalize kernel; per
//     group when tiles hold whole groups, else per channel (a group wider than any tile, e.g. G = 1).
struct Geometry {
  int64_t N = 0;             // batch
  int64_t S = 0;             // spatial positions per image (H*W, D*H*W or L)
  int64_t C = 0;             // channels
  int64_t G = 0;             // groups
  int64_t D = 0;             // channels per group, C / G
  int vec = 1;               // elements per vector access (16 bytes, or 1 when C or a pointer does not allow it)
  int tile_vecs = 1;         // vectors per tile (threads per block row)
  int64_t tiles = 1;         // tiles per row
  int block_rows = 1;        // rows a block processes at once; threads = tile_vecs * block_rows
  int64_t splits = 1;        // row ranges per image
  int64_t rows_per_split = 0;
  bool group_tiles = false;  // every tile holds whole groups (so blocks can reduce per group)
  bool fused = false;
  // Forward only, sm_90+: > 0 when the `cluster` splits of one (n, tile) run as one thread-block cluster that
  // exchanges per-group partial statistics through distributed shared memory, each thread holding its rows in
  // registers (x read once, one kernel). splits == cluster then.
  int cluster = 0;

  // Whole warps: the warp-level group reductions use full-mask shuffles.
  int threads() const { return (tile_vecs * block_rows + 31) / 32 * 32; }
  int64_t blocks() const { return N * splits * tiles; }
  // Every thread of a fused block visits at most `rows` rows (so they can stay in registers).
  bool resident(int rows) const { return fused && S <= (int64_t)rows * block_rows; }
};

// `aligned16`: every data pointer the kernels will touch is 16-byte aligned.
Geometry make_geometry(int64_t N, int64_t S, int64_t C, int64_t G, int elem_size, bool aligned16, int num_sms);

// Rows each thread of a cluster-geometry block holds in registers, and the most groups one tile may hold there.
constexpr int kClusterRows = 6;
constexpr int kMaxClusterTileGroups = 16;

// The forward's geometry: make_geometry's, or the cluster geometry where it replaces the split one
// (`cluster_capable`: the device has compute capability 9.0 or newer).
Geometry make_forward_geometry(int64_t N, int64_t S, int64_t C, int64_t G, int elem_size, bool aligned16, int num_sms,
                               bool cluster_capable);

struct ForwardArgs {
  Geometry geo;
  ScalarKind dtype;
  Act act;
  const void* x;
  const void* weight;  // nullptr: all ones
  const void* bias;    // nullptr: all zeros
  bool params_fp32;    // weight/bias are float32 (else the input's dtype)
  float eps;
  void* y;
  float* mean;         // (N, G)
  float* rstd;         // (N, G)
  float* partials;     // (N, splits, G or C) pairs of (mean offset, m2), per group when geo.group_tiles;
                       // unused when geo.fused
  float* mean_offsets; // (N, G) mean minus the group reference value; unused when geo.fused
};

struct BackwardArgs {
  Geometry geo;
  ScalarKind dtype;
  Act act;
  const void* dy;
  const void* x;
  const void* weight;
  const void* bias;
  bool params_fp32;
  const float* mean;
  const float* rstd;
  void* dx;             // nullptr: dx not required
  void* dweight;        // nullptr: not required; else weight's dtype, (C,)
  void* dbias;          // nullptr: not required; else bias's dtype, (C,)
  float* channel_sums;  // (N, splits, C) pairs of (sum du, sum du*xhat); splits = 1 when geo.fused
  float* group_sums;    // (N, splits, G) pairs of (sum w*du, sum w*du*xhat); split geometry with group tiles
  float* coeffs;        // (N, G) pairs of the dx coefficients (mean of w*du, mean of w*du*xhat)
};

void launch_forward(const ForwardArgs& args, cudaStream_t stream);
void launch_backward(const BackwardArgs& args, cudaStream_t stream);

}  // namespace gn_patch
