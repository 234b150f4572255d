// Choice of block geometry (see Geometry in group_norm_act.h). Host-only, no CUDA calls.
#include <algorithm>
#include <numeric>

#include "group_norm_act.h"

namespace gn_patch {
namespace {

// A tile's row segment is at least one 32-byte sector (narrower segments leave part of each sector to another
// block, and DRAM moves whole sectors); for large images, whose rows come from DRAM, several.
constexpr int64_t kSectorBytes = 32;
constexpr int64_t kMinSegmentBytes = kSectorBytes;
constexpr int64_t kWideSegmentBytes = 512;
// Images from this size on (bytes) take the unclustered geometry; each thread then streams at least this many rows.
constexpr int64_t kUnclusteredImageBytes = 32 << 20;
constexpr int64_t kMinStreamedRows = 8;
// The largest cluster the backward spans images with (larger clusters are scheduled on fewer SMs at a time).
constexpr int64_t kMaxImageCluster = 8;
// Sector-aligned forward tiles (see make_geometry): batches of at least this many (image, group) pairs per SM, and
// tiles leaving a block at least this many rows of threads.
constexpr int64_t kAlignedTilePairsPerSm = 4;
constexpr int64_t kAlignedTileMinBlockRows = 4;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

int choose_vec(int64_t D, int elem_size, int64_t alignment) {
  int vec = 16 / elem_size;
  while (vec > 1 && (D % vec != 0 || alignment % (vec * elem_size) != 0)) vec /= 2;
  return vec;
}

int straddling_vec(int64_t D, int64_t G, int elem_size, int64_t alignment) {
  const int full = 16 / elem_size;
  if (elem_size != 2 || alignment % 16 != 0 || D < full || D % full == 0 || D > kMaxTileChannels) return 0;
  // Tiles of whole vectors: a multiple of `groups` groups.
  const int64_t groups = full / std::gcd<int64_t>(D, full);
  return G % groups == 0 && groups * D <= kMaxTileChannels ? full : 0;
}

namespace {

// Vectors of a tile of k groups (0 if k groups are not whole vectors, as with straddling vectors).
int64_t vecs_of(const Geometry& g, int64_t k) { return (k * g.D) % g.vec == 0 ? k * g.D / g.vec : 0; }

// Groups per tile: the fewest (most tiles) whose row segment has at least `segment_bytes` and, for images of few
// rows, gives a block some threads; a divisor of G, so that tiles are whole and equal, and whole vectors.
int64_t groups_per_tile(const Geometry& g, int elem_size, int64_t segment_bytes) {
  int64_t groups = 0;
  for (int64_t k = 1; k <= g.G; ++k) {
    if (groups > 0 && (k * g.D > kMaxTileChannels || k * g.D > (int64_t)kMaxThreads * g.vec)) break;
    const int64_t vecs = vecs_of(g, k);
    if (g.G % k != 0 || vecs == 0) continue;
    groups = k;
    if (k * g.D * elem_size >= segment_bytes && vecs * std::min<int64_t>(g.S, 64) >= 64) break;
  }
  return groups;
}

// The fewest groups per tile whose row segment is a whole number of sectors, within kAlignedTileMinBlockRows rows
// of threads per block; 0 if there is none.
int64_t sector_aligned_groups(const Geometry& g, int elem_size) {
  for (int64_t k = 1; k <= g.G && k * g.D * kAlignedTileMinBlockRows <= (int64_t)kMaxThreads * g.vec; ++k) {
    if (g.G % k == 0 && (k * g.D * elem_size) % kSectorBytes == 0 && k * g.D <= kMaxTileChannels) return k;
  }
  return 0;
}

void set_tiles(Geometry& g, int64_t groups) {
  g.groups_per_tile = (int)groups;
  g.tile_vecs = (int)vecs_of(g, groups);
  g.tiles = g.G / groups;
}

// Rows of one (n, tile) over `splits` blocks, each block with the fewest threads that keep its rows per thread, at
// most max_threads (rows of tile_vecs threads, one row at least).
void set_splits(Geometry& g, int64_t splits, int max_threads = kMaxThreads) {
  const int64_t block_rows_max = std::max<int64_t>(1, max_threads / g.tile_vecs);
  g.splits = splits;
  g.rows_per_block = ceil_div(g.S, splits);
  g.rows_per_thread = ceil_div(g.rows_per_block, std::min(block_rows_max, g.rows_per_block));
  g.block_rows = (int)ceil_div(g.rows_per_block, g.rows_per_thread);
}

// The kernels divide block and thread indices (< 2^31) by these, each below 2^31: the grid has fewer than 2^31
// blocks (launch_kernel checks), so splits, tiles and images do; tile_vecs, vecs_per_group and block_rows are at
// most kMaxThreads.
Geometry with_dividers(Geometry g) {
  g.div_splits = FastDivider::of((uint32_t)g.splits);
  g.div_tiles = FastDivider::of((uint32_t)g.tiles);
  g.div_images = FastDivider::of((uint32_t)g.images);
  g.div_tile_vecs = FastDivider::of((uint32_t)g.tile_vecs);
  g.div_vecs_per_group = FastDivider::of(g.straddle ? 1u : (uint32_t)g.vecs_per_group);
  g.div_block_rows = FastDivider::of((uint32_t)g.block_rows);
  g.div_D = FastDivider::of(g.straddle ? (uint32_t)g.D : 1u);
  return g;
}

}  // namespace

Geometry make_geometry(Pass pass, int64_t N, int64_t S, int64_t C, int64_t G, int elem_size, int vec,
                       const DeviceLimits& limits) {
  Geometry g;
  g.N = N;
  g.S = S;
  g.C = C;
  g.G = G;
  g.D = C / G;
  g.vec = vec;
  g.straddle = g.D % vec != 0;
  g.vecs_per_group = g.straddle ? 0 : (int)(g.D / vec);
  g.reread_reversed = N * S * C * elem_size > limits.l2_bytes;
  const int rows_cap = resident_rows(pass, vec * elem_size, g.straddle);
  const int64_t per_sm = pass == Pass::kForward ? kForwardBlocksPerSm : kBackwardBlocksPerSm;
  auto capacity = [&](const Geometry& s) {  // blocks resident at once
    const int clusters = s.cluster() > 1 && limits.occupancy != nullptr
                             ? limits.occupancy->at(s.cluster(), s.threads())
                             : 0;
    if (clusters > 0) return (int64_t)clusters * s.cluster();
    return limits.num_sms * std::max<int64_t>(1, per_sm * kMaxThreads / s.threads());
  };

  // Large images whose rows do not fit on chip: wide tiles (long contiguous row segments, as DRAM prefers), rows
  // split over as many blocks as fill the GPU twice, partial results through scratch (three kernels per pass).
  if (S * C * elem_size >= kUnclusteredImageBytes) {
    g.clustered = false;
    set_tiles(g, groups_per_tile(g, elem_size, kWideSegmentBytes));
    set_splits(g, 1);
    const int64_t target = 2 * capacity(g);
    const int64_t max_splits = std::max<int64_t>(1, S / ((int64_t)g.block_rows * kMinStreamedRows));
    set_splits(g, std::clamp<int64_t>(ceil_div(target, N * g.tiles), 1, max_splits));
    g.resident = false;
    return with_dividers(g);
  }

  // Otherwise one kernel per pass: the rows of each (n, tile) over a cluster of `splits` blocks, split until they
  // are resident in registers, but never into a second wave: a cluster's blocks wait for each other, so a grid of
  // 1.1 waves takes two waves' time (on the H200, 256 blocks in clusters of 8 where 240 fit: the backward at
  // (2, 1280, 32, 32) ran 22.8 us with SMs idle half of it; ncu, benchmarks/NOTES.md session 18). Splitting further
  // only adds cluster-wide synchronisation: on the H200 a (2, 1280, 16, 16) forward took 8.2 us unsplit (6 rows per
  // thread) and 14.9 us over clusters of 8 (one row per thread).
  int64_t groups = groups_per_tile(g, elem_size, kMinSegmentBytes);
  // A segment that ends mid-sector shares its last sector with the next tile's block, which DRAM serves again when
  // that block runs at another time. Where the batch holds enough (image, group) pairs to fill the GPU with wider
  // tiles, the forward takes whole sectors. On the H200 (fp16, batch 32, the norms of an AnimateDiff call):
  // (32, 640, 64, 64) 374 -> 196 us, (32, 1920, 32, 32) 154 -> 147, (32, 640, 16, 16) 19 -> 14; with tiles of 120
  // vectors (two rows of threads, D = 30) (32, 960, 64, 64) went 371 -> 412, hence kAlignedTileMinBlockRows.
  if (pass == Pass::kForward && N * G >= kAlignedTilePairsPerSm * limits.num_sms) {
    groups = std::max(groups, sector_aligned_groups(g, elem_size));
  }
  set_tiles(g, groups);
  set_splits(g, 1);
  // A doubling that does not lower the rows per thread is passed over, not taken: with the backward's smaller split
  // blocks, a tile of 81-85 vectors has 3 rows of threads unsplit and 1 split in two.
  const int split_threads = pass == Pass::kBackward ? kBackwardSplitThreads : kMaxThreads;
  for (int64_t splits = 2; splits <= limits.max_cluster && g.rows_per_thread > rows_cap; splits *= 2) {
    Geometry next = g;
    set_splits(next, splits, split_threads);
    if (next.blocks() > capacity(next)) break;
    if (next.rows_per_thread < g.rows_per_thread) g = next;
  }
  g.resident = g.rows_per_thread <= rows_cap;
  // The backward's weight and bias gradients sum over the images: where the rows are split over a cluster anyway
  // and all N images' blocks of a tile fit one small cluster, it adds them up in place of a second kernel. On the
  // H200 (fp16) that took 1.9 us off (2, 320, 64, 64) and 6 us off (2, 960, 64, 64), but turning unclustered
  // launches into clusters of 2 cost (2, 1280, 8, 8) and (2, 1280, 16, 16) 0.5 us.
  // The larger clusters must still hold the grid in one wave.
  if (pass == Pass::kBackward && N > 1 && (N & (N - 1)) == 0 && g.splits > 1 &&
      N * g.splits <= std::min<int64_t>(limits.max_cluster, kMaxImageCluster)) {
    Geometry spanned = g;
    spanned.images = N;
    if (spanned.blocks() <= capacity(spanned)) g = spanned;
  }
  return with_dividers(g);
}

}  // namespace gn_patch
