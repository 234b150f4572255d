// Invariants of the block geometries (csrc/geometry.cpp) over a sweep of shapes; prints the first violation and
// exits 1, else prints how many geometries it checked. Built and run by tests/test_geometry.py (host C++ only).
#include <cstdio>
#include <initializer_list>

#include "group_norm_act.h"

namespace {

int checked = 0;

bool fail(const char* what, const gn_patch::Geometry& g, int elem, bool aligned) {
  std::printf("violated: %s (N=%lld S=%lld C=%lld G=%lld elem=%d aligned=%d: vec=%d tile_vecs=%d tiles=%lld "
              "block_rows=%d splits=%lld rows_per_split=%lld fused=%d group_tiles=%d cluster=%d)\n",
              what, (long long)g.N, (long long)g.S, (long long)g.C, (long long)g.G, elem, (int)aligned, g.vec,
              g.tile_vecs, (long long)g.tiles, g.block_rows, (long long)g.splits, (long long)g.rows_per_split,
              (int)g.fused, (int)g.group_tiles, g.cluster);
  return false;
}

bool check(const gn_patch::Geometry& g, int elem, bool aligned) {
  ++checked;
  const int full = 16 / elem;
  if (g.vec != 1 && !(g.vec == full && aligned && g.C % full == 0)) return fail("vector width", g, elem, aligned);
  if (g.tile_vecs * g.block_rows > 256 || g.threads() > 256 || g.threads() % 32 != 0)
    return fail("threads per block", g, elem, aligned);
  const long long row_vecs = g.C / g.vec;
  if (g.tiles * g.tile_vecs < row_vecs || (g.tiles - 1) * g.tile_vecs >= row_vecs)
    return fail("tiles cover the row exactly", g, elem, aligned);
  if (g.splits * g.rows_per_split < g.S) return fail("splits cover every row", g, elem, aligned);
  if (g.cluster == 0 && (g.splits - 1) * g.rows_per_split >= g.S) return fail("no empty split", g, elem, aligned);
  if (g.group_tiles && (g.tile_vecs * g.vec) % g.D != 0) return fail("tiles of whole groups", g, elem, aligned);
  if (g.fused && (g.splits != 1 || !g.group_tiles)) return fail("fused: one split of whole groups", g, elem, aligned);
  if (g.cluster > 0) {
    if (g.cluster != 2 && g.cluster != 4 && g.cluster != 8) return fail("portable cluster size", g, elem, aligned);
    if (g.splits != g.cluster || g.fused || !g.group_tiles) return fail("cluster: splits of whole groups", g, elem, aligned);
    if (g.rows_per_split > (long long)g.block_rows * gn_patch::kClusterRows)
      return fail("cluster: rows fit the registers", g, elem, aligned);
    if (g.tile_vecs * g.vec / g.D > gn_patch::kMaxClusterTileGroups)
      return fail("cluster: groups per tile", g, elem, aligned);
  }
  return true;
}

}  // namespace

int main() {
  const long long shapes[][2] = {{32, 32}, {64, 32}, {128, 32}, {256, 32}, {320, 32}, {512, 32}, {640, 32}, {960, 32},
                                 {1280, 32}, {1920, 32}, {2560, 32}, {24, 3}, {21, 7}, {262, 131}, {16, 1}, {16, 16},
                                 {4096, 4096}, {6, 2}, {40, 8}, {1, 1}};
  for (long long N : {1LL, 2LL, 8LL, 70000LL}) {
    for (long long S : {1LL, 7LL, 64LL, 255LL, 1000LL, 4096LL, 16384LL, 65536LL, 1LL << 20}) {
      for (const auto& cg : shapes) {
        for (int elem : {2, 4}) {
          for (bool aligned : {true, false}) {
            const auto g = gn_patch::make_geometry(N, S, cg[0], cg[1], elem, aligned, 132);
            if (!check(g, elem, aligned)) return 1;
            for (bool capable : {false, true}) {
              const auto f = gn_patch::make_forward_geometry(N, S, cg[0], cg[1], elem, aligned, 132, capable);
              if (!check(f, elem, aligned)) return 1;
              if (!capable && f.cluster != 0) return fail("cluster only where capable", f, elem, aligned), 1;
            }
          }
        }
      }
    }
  }
  std::printf("ok: %d geometries\n", checked);
  return 0;
}
