// Choice of block geometry (see Geometry in group_norm_act.h). Host-only, no CUDA calls.
#include <algorithm>
#include <numeric>

#include "group_norm_act.h"

namespace gn_patch {
namespace {

constexpr int kMaxThreads = 256;      // must match reduce.cuh
constexpr int64_t kWideTile = 64;     // vectors per tile row: 1 KiB of fp16 per row, fully coalesced
constexpr int64_t kBlocksPerSm = 8;   // 8 x 256 threads = the SM's 2048-thread limit
constexpr int64_t kFusedMaxRowsPerThread = 16;
constexpr int64_t kMinRowsPerThread = 4;
constexpr int64_t kMaxPortableCluster = 8;  // thread-block cluster size every sm_90 GPU schedules

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

Geometry make_geometry(int64_t N, int64_t S, int64_t C, int64_t G, int elem_size, bool aligned16, int num_sms) {
  Geometry g;
  g.N = N;
  g.S = S;
  g.C = C;
  g.G = G;
  g.D = C / G;
  const int full = 16 / elem_size;
  g.vec = (aligned16 && C % full == 0) ? full : 1;
  const int64_t row_vecs = C / g.vec;
  const int64_t target_blocks = kBlocksPerSm * num_sms;

  // The smallest tile made of whole groups and whole vectors: lcm(D, vec) channels.
  const int64_t unit = std::lcm(g.D, (int64_t)g.vec) / g.vec;
  const bool group_aligned = unit <= kMaxThreads;
  g.group_tiles = group_aligned;
  const int64_t wide = group_aligned ? std::min(row_vecs, unit * std::max<int64_t>(1, kWideTile / unit))
                                     : std::min(row_vecs, kWideTile);

  auto set_tile = [&](int64_t tile_vecs) {
    g.tile_vecs = (int)tile_vecs;
    g.tiles = ceil_div(row_vecs, tile_vecs);
    g.block_rows = (int)std::max<int64_t>(1, std::min<int64_t>(kMaxThreads / tile_vecs, S));
  };

  // Fused: enough (image, tile) blocks to fill the GPU, or so little work per block that one pass of
  // statistics and one of normalisation inside a block beat three kernels. Narrow tiles (at least two
  // vectors, one 32-byte sector) make more blocks for small batches.
  if (group_aligned) {
    set_tile(wide);
    if (N * g.tiles < target_blocks) set_tile(std::min(row_vecs, unit * ceil_div(2, unit)));
    const int64_t rows_per_thread = ceil_div(S, g.block_rows);
    if (N * g.tiles >= target_blocks || rows_per_thread <= kFusedMaxRowsPerThread) {
      g.fused = true;
      g.splits = 1;
      g.rows_per_split = S;
      return g;
    }
  }

  // Split rows so that N * splits * tiles blocks fill the GPU, each thread keeping a few rows in flight.
  set_tile(wide);
  const int64_t max_splits = std::max<int64_t>(1, S / ((int64_t)g.block_rows * kMinRowsPerThread));
  const int64_t want = ceil_div(target_blocks, std::max<int64_t>(1, N * g.tiles));
  g.rows_per_split = ceil_div(S, std::clamp<int64_t>(want, 1, max_splits));
  g.splits = ceil_div(S, g.rows_per_split);
  g.fused = group_aligned && g.splits == 1;
  return g;
}

Geometry make_forward_geometry(int64_t N, int64_t S, int64_t C, int64_t G, int elem_size, bool aligned16, int num_sms,
                               bool cluster_capable) {
  Geometry g = make_geometry(N, S, C, G, elem_size, aligned16, num_sms);
  if (g.fused || !cluster_capable) return g;
  // The narrowest tile of whole groups (most clusters), its rows spread over the fewest blocks of a portable
  // cluster (<= 8) that leave each thread at most kClusterRows rows.
  const int64_t row_vecs = C / g.vec;
  const int64_t unit = std::lcm(g.D, (int64_t)g.vec) / g.vec;
  if (unit > kMaxThreads) return g;
  const int64_t tile_vecs = std::min(row_vecs, unit * ceil_div(2, unit));
  if (tile_vecs * g.vec / g.D > kMaxClusterTileGroups) return g;
  const int64_t block_rows = std::max<int64_t>(1, std::min<int64_t>(kMaxThreads / tile_vecs, S));
  int64_t cluster = 2;
  while (cluster <= kMaxPortableCluster && S > cluster * block_rows * kClusterRows) cluster *= 2;
  if (cluster > kMaxPortableCluster) return g;
  g.tile_vecs = (int)tile_vecs;
  g.tiles = ceil_div(row_vecs, tile_vecs);
  g.block_rows = (int)block_rows;
  g.cluster = (int)cluster;
  g.splits = cluster;
  g.rows_per_split = ceil_div(S, cluster);
  g.group_tiles = true;
  g.fused = false;
  return g;
}

}  // namespace gn_patch
