// Invariants of the block geometries (csrc/geometry.cpp) over a sweep of shapes, dtypes, alignments, passes and
// cluster limits; prints the first violation and exits 1, else prints how many geometries it checked. Built and
// run by tests/test_geometry.py (host C++ only).
#include <algorithm>
#include <cstdio>
#include <initializer_list>

#include "group_norm_act.h"

namespace {

using gn_patch::Geometry;
using gn_patch::Pass;

int checked = 0;
constexpr long long kL2Bytes = 60LL << 20;

// An occupancy table of the H200's kind: blocks per SM from a 128-register budget (at most 3), and clusters packed
// with some loss (on the H200 30 clusters of 8 fit where SMs x blocks per SM / 8 is 33).
gn_patch::ClusterOccupancy h200_like_occupancy() {
  gn_patch::ClusterOccupancy o;
  for (int log2 = 1; log2 < gn_patch::ClusterOccupancy::kSizes; ++log2) {
    for (int warps = 1; warps <= gn_patch::ClusterOccupancy::kWarps; ++warps) {
      const int per_sm = warps * 32 * 128 * 3 <= 65536 ? 3 : 2;
      o.clusters[log2][warps - 1] = 132 * per_sm / (1 << log2) - 2;
    }
  }
  return o;
}
const gn_patch::ClusterOccupancy kOccupancy = h200_like_occupancy();

bool fail(const char* what, const Geometry& g, int elem, long long alignment, int max_cluster) {
  std::printf("violated: %s (N=%lld S=%lld C=%lld G=%lld elem=%d alignment=%lld max_cluster=%d: vec=%d "
              "groups_per_tile=%d tile_vecs=%d tiles=%lld block_rows=%d splits=%lld clustered=%d "
              "rows_per_block=%lld rows_per_thread=%lld resident=%d)\n",
              what, (long long)g.N, (long long)g.S, (long long)g.C, (long long)g.G, elem, alignment, max_cluster,
              g.vec, g.groups_per_tile, g.tile_vecs, (long long)g.tiles, g.block_rows, (long long)g.splits,
              (int)g.clustered, (long long)g.rows_per_block, (long long)g.rows_per_thread, (int)g.resident);
  return false;
}

// The divider's quotients at the edges of its range: around multiples of the divisor and up to 2^31 - 1.
bool divides_exactly(const gn_patch::FastDivider& f, long long d) {
  if (f.divisor != d) return false;
  const long long top = (1LL << 31) - 1;
  for (long long n : {0LL, 1LL, d - 1, d, d + 1, 2 * d - 1, 2 * d, 255LL, 256LL, 1000003LL, top - d, top - 1, top}) {
    if (n < 0 || n > top) continue;
    if (f.div((uint32_t)n) != (uint32_t)(n / d)) return false;
  }
  for (long long q = 1; q * d <= top; q = q * 3 + 1) {  // n = q d - 1, q d, q d + 1 over the range
    for (long long n : {q * d - 1, q * d, q * d + 1}) {
      if (n <= top && f.div((uint32_t)n) != (uint32_t)(n / d)) return false;
    }
  }
  return true;
}

bool check(Pass pass, const Geometry& g, int elem, long long alignment, int max_cluster,
           const gn_patch::ClusterOccupancy* occupancy) {
  ++checked;
  auto bad = [&](const char* what) { return fail(what, g, elem, alignment, max_cluster); };
  if (g.vec < 1 || (g.vec & (g.vec - 1)) || g.vec * elem > 16 || (!g.straddle && g.D % g.vec) ||
      alignment % (g.vec * elem))
    return bad("vector width: a power of two dividing D (unless straddling), within 16 bytes and the alignment");
  if (g.straddle && (g.vec * elem != 16 || elem != 2 || g.D < g.vec || g.D % g.vec == 0))
    return bad("straddling vectors: 16-byte vectors of 16-bit elements, within two groups");
  if (g.straddle ? g.vecs_per_group != 0 : g.vecs_per_group * g.vec != g.D) return bad("vectors per group");
  if ((long long)g.tile_vecs * g.vec != g.groups_per_tile * g.D) return bad("tiles of whole groups and vectors");
  if (g.tiles * g.groups_per_tile != g.G) return bad("tiles cover the groups exactly");
  if (g.tile_vecs * g.vec > gn_patch::kMaxTileChannels && g.groups_per_tile > 1) return bad("tile channels");
  if (g.tile_vecs * g.block_rows > gn_patch::kMaxThreads || g.threads() > gn_patch::kMaxThreads ||
      g.threads() % 32 != 0)
    return bad("threads per block");
  if (pass == Pass::kBackward && g.clustered && g.splits > 1 && g.tile_vecs <= gn_patch::kBackwardSplitThreads &&
      g.threads() > gn_patch::kBackwardSplitThreads)
    return bad("backward blocks split over a cluster fit three per SM");
  if (g.splits * g.rows_per_block < g.S) return bad("splits cover every row");
  if (g.clustered && g.splits > 1) {  // rows per thread of the same tile unsplit, in blocks of up to kMaxThreads
    const long long unsplit_rows = std::min<long long>(std::max(1, gn_patch::kMaxThreads / g.tile_vecs), g.S);
    if (g.rows_per_thread >= (g.S + unsplit_rows - 1) / unsplit_rows) return bad("a split lowers rows per thread");
  }
  if ((long long)g.block_rows * g.rows_per_thread < g.rows_per_block) return bad("threads cover the block's rows");
  if (g.blocks() >= (1LL << 31)) return bad("grid size");
  if (g.clustered) {
    if (g.cluster() > max_cluster || (g.cluster() & (g.cluster() - 1)))
      return bad("cluster: a power of two within the limit");
    if (g.images != 1 && (g.images != g.N || pass != Pass::kBackward))
      return bad("clusters span all the images of a tile, in the backward only");
    // An entry of 0 is unknown (a refused query): the geometry then counts SMs x blocks per SM instead.
    const int clusters = occupancy != nullptr && g.cluster() > 1 ? occupancy->at(g.cluster(), g.threads()) : 0;
    if (clusters > 0 && g.blocks() > (long long)clusters * g.cluster()) return bad("a grid of clusters runs in one wave");
  } else if (g.resident) {
    return bad("unclustered geometries stream their rows");
  }
  if (g.resident && g.rows_per_thread > gn_patch::resident_rows(pass, g.vec * elem, g.straddle))
    return bad("resident rows fit the registers");
  if (!g.clustered && g.images != 1) return bad("unclustered geometries keep images apart");
  if (g.reread_reversed != (g.N * g.S * g.C * elem > kL2Bytes)) return bad("rows re-read last first beyond L2");
  const gn_patch::FastDivider* dividers[] = {&g.div_splits,         &g.div_tiles,      &g.div_images, &g.div_tile_vecs,
                                             &g.div_vecs_per_group, &g.div_block_rows, &g.div_D};
  const long long divisors[] = {g.splits,   g.tiles, g.images, g.tile_vecs, g.straddle ? 1 : g.vecs_per_group,
                                g.block_rows, g.straddle ? g.D : 1};
  for (int i = 0; i < 7; ++i) {
    if (!divides_exactly(*dividers[i], divisors[i])) return bad("fast dividers equal integer division");
  }
  return true;
}

}  // namespace

int main() {
  const long long shapes[][2] = {{32, 32}, {64, 32}, {128, 32}, {256, 32}, {320, 32}, {512, 32}, {640, 32}, {960, 32},
                                 {1280, 32}, {1920, 32}, {2560, 32}, {24, 3}, {21, 7}, {262, 131}, {262, 2}, {16, 1},
                                 {16, 16}, {1024, 1}, {6, 2}, {40, 8}, {1, 1}, {96, 32}, {1048, 8}, {384, 32},
                                 {1152, 32}, {640, 16}};
  for (long long N : {1LL, 2LL, 4LL, 8LL, 32LL, 70000LL}) {
    for (long long S : {1LL, 7LL, 64LL, 255LL, 1000LL, 4096LL, 16384LL, 65536LL, 1LL << 20}) {
      for (const auto& cg : shapes) {
        for (int elem : {2, 4}) {
          for (long long alignment : {16LL, 8LL, 2LL}) {
            const long long D = cg[0] / cg[1];
            if (alignment < elem || !(D <= gn_patch::kMaxTileChannels)) continue;
            if (D / gn_patch::choose_vec(D, elem, alignment) > gn_patch::kMaxThreads) continue;  // copied first
            // Either pass may also take straddling vectors (ops.cpp: where the narrow vectors' rows stream).
            const int narrow = gn_patch::choose_vec(D, elem, alignment);
            const int wide = gn_patch::straddling_vec(D, cg[1], elem, alignment);
            for (Pass pass : {Pass::kForward, Pass::kBackward}) {
              for (int vec : {narrow, wide}) {
                if (vec == 0) continue;
                for (int max_cluster : {1, 8, 16}) {
                  for (const gn_patch::ClusterOccupancy* occupancy : {(const gn_patch::ClusterOccupancy*)nullptr,
                                                                      &kOccupancy}) {
                    const Geometry g = gn_patch::make_geometry(pass, N, S, cg[0], cg[1], elem, vec,
                                                               {132, max_cluster, kL2Bytes, occupancy});
                    if (!check(pass, g, elem, alignment, max_cluster, occupancy)) return 1;
                  }
                }
              }
            }
          }
        }
      }
    }
  }
  // Batches of many (image, group) pairs: forward tiles end on sector boundaries ((32, 640, 64, 64), fp16: 4 groups
  // of 40 bytes), unless that leaves a block fewer than 4 rows of threads ((32, 960, 64, 64): whole sectors would
  // take 8 groups of 60 bytes, 120 vectors).
  const Geometry wide = gn_patch::make_geometry(Pass::kForward, 32, 4096, 640, 32, 2, 4, {132, 16, kL2Bytes});
  if (wide.groups_per_tile * wide.D * 2 % 32 != 0) return fail("sector-aligned tiles", wide, 2, 16, 16) ? 0 : 1;
  const Geometry narrow = gn_patch::make_geometry(Pass::kForward, 32, 4096, 960, 32, 2, 2, {132, 16, kL2Bytes});
  if (narrow.block_rows < 4) return fail("rows of threads in sector-aligned tiles", narrow, 2, 16, 16) ? 0 : 1;
  // C = 320 and 960 with G = 32 in 16-bit types: the vectors may straddle groups (16 bytes, not 4).
  for (long long C : {320LL, 960LL}) {
    if (gn_patch::straddling_vec(C / 32, 32, 2, 16) != 8 || gn_patch::choose_vec(C / 32, 2, 16) != 2) {
      std::printf("violated: straddling vectors for C=%lld\n", C);
      return 1;
    }
  }
  std::printf("ok: %d geometries\n", checked);
  return 0;
}
