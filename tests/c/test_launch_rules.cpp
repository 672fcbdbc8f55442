// The C API's per-algorithm buffer rules and default grid (csrc/host/launch_rules.h), checked
// without a GPU. The grid must match the Python launcher (ubnext/comm/__init__.py, _geometry) so that a
// job gets the same geometry whichever front end launches it; py_grid below transcribes it.
#include <algorithm>
#include <cstdio>
#include <string_view>

#include "launch_rules.h"

static int g_failures = 0;

#define CHECK(cond)                                                                 \
  do {                                                                              \
    if (!(cond)) {                                                                  \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++g_failures;                                                                 \
    }                                                                               \
  } while (0)

namespace {

using ubnext::default_grid;
using ubnext::kAlgos;

// ubnext/comm/_executor.py launch_geometry with gpu_max_blocks on a GPU (block 256, sm_count =
// min(128, SM count), nvls_ctas 16 below sm_100 and 32 from it), grid only.
long long py_grid(const char* algo, long long n, long long elem, long long tokens, bool fused, long long world,
                  long long sms, int cc_major = 9) {
  const long long block = 256;
  auto ceil_div = [](long long a, long long b) { return (a + b - 1) / b; };
  auto clamp = [](long long x, long long hi) { return x < 1 ? 1 : (x > hi ? hi : x); };
  const std::string_view a(algo);
  long long max_blocks = sms < 128 ? sms : 128;
  max_blocks = max_blocks / 2 > 1 ? max_blocks / 2 : 1;  // every algorithm here waits on its peers
  if (a == "nvls_twoshot" && !fused) {
    const long long nvls = ceil_div(cc_major >= 10 ? 32 : 16, world);
    if (nvls < max_blocks) max_blocks = nvls;
  }
  if (fused) {  // Lamport: launch_geometry's row_split (not per-token FP8, which this file does not try)
    long long split = 1;
    if (a == "lamport" && tokens > 0) {
      const long long row_vectors = n / tokens * elem / 16, groups = ceil_div(row_vectors, 32);
      split = std::min({max_blocks / tokens, row_vectors / 128, 8LL});
      if (split < 2 || ceil_div(groups, split) * 32 > 2048) split = 1;
    }
    return clamp(tokens * split, max_blocks);
  }
  long long vectors = ceil_div(n * elem, 16);
  if (a == "nvls_twoshot" || a == "twoshot" || a == "nvls_lamport") vectors = ceil_div(vectors, world);
  return clamp(ceil_div(vectors, block), max_blocks);
}

// The grid default_grid gives algorithm `a` through the C API's launch (collectives.cpp launch_kernel).
unsigned c_grid(int a, long long bytes, long long tokens, long long world, long long sms, int cc_major,
                int coresident = 1 << 20, size_t row_vectors = 0) {
  const unsigned nvls = a == UBNEXT_ALGO_NVLS_TWOSHOT && tokens == 0
                            ? ubnext::nvls_twoshot_grid_cap(static_cast<size_t>(world), cc_major)
                            : 0u;
  return default_grid(kAlgos[a].per_rank_share, static_cast<size_t>(bytes), static_cast<size_t>(tokens),
                      static_cast<size_t>(world), 256, static_cast<int>(sms), coresident, true, nvls, row_vectors);
}

const char* const kNames[ubnext::kNumAlgos] = {"lamport", "nvls_oneshot", "nvls_twoshot", "nvls_lamport", "twoshot"};

void test_traits() {
  // Per-rank share: the two-shot family, nvls_lamport included.
  CHECK(!kAlgos[UBNEXT_ALGO_LAMPORT].per_rank_share);
  CHECK(!kAlgos[UBNEXT_ALGO_NVLS_ONESHOT].per_rank_share);
  CHECK(kAlgos[UBNEXT_ALGO_NVLS_TWOSHOT].per_rank_share);
  CHECK(kAlgos[UBNEXT_ALGO_NVLS_LAMPORT].per_rank_share);
  CHECK(kAlgos[UBNEXT_ALGO_TWOSHOT].per_rank_share);
  // in in the arena: everything but lamport.
  CHECK(!kAlgos[UBNEXT_ALGO_LAMPORT].in_in_arena);
  for (int a = 1; a < ubnext::kNumAlgos; ++a) CHECK(kAlgos[a].in_in_arena);
  // out == in: where in is overwritten (two-shot) or never read by peers (lamport).
  CHECK(kAlgos[UBNEXT_ALGO_LAMPORT].out_may_be_in);
  CHECK(!kAlgos[UBNEXT_ALGO_NVLS_ONESHOT].out_may_be_in);
  CHECK(kAlgos[UBNEXT_ALGO_NVLS_TWOSHOT].out_may_be_in);
  CHECK(!kAlgos[UBNEXT_ALGO_NVLS_LAMPORT].out_may_be_in);
  CHECK(kAlgos[UBNEXT_ALGO_TWOSHOT].out_may_be_in);
  // Fusable: all but nvls_oneshot. Multicast: the nvls_* kernels. Lamport slot: the *lamport.
  for (int a = 0; a < ubnext::kNumAlgos; ++a) {
    CHECK(kAlgos[a].can_fuse == (a != UBNEXT_ALGO_NVLS_ONESHOT));
    CHECK(kAlgos[a].needs_multicast == (std::string_view(kNames[a]).substr(0, 5) == "nvls_"));
    CHECK(kAlgos[a].uses_lamport == (a == UBNEXT_ALGO_LAMPORT || a == UBNEXT_ALGO_NVLS_LAMPORT));
    CHECK(std::string_view(ubnext_algo_string(static_cast<ubnext_algo_t>(a))) == kNames[a]);
  }
}

void test_grid_matches_python() {
  const long long counts[] = {1, 5, 7, 8, 255, 2048, 4096, 65536, 1 << 20, 3 << 20, 1 << 24};
  const long long elems[] = {2, 4};
  const long long worlds[] = {1, 2, 4, 8};
  const long long smss[] = {8, 78, 114, 132, 148};  // H100 PCIe / SXM, B200
  const int ccs[] = {9, 10};
  int checked = 0;
  for (int a = 0; a < ubnext::kNumAlgos; ++a)
    for (long long n : counts)
      for (long long e : elems)
        for (long long w : worlds)
          for (long long sms : smss)
            for (int cc : ccs) {
              const unsigned got = c_grid(a, n * e, 0, w, sms, cc);
              const long long want = py_grid(kNames[a], n, e, 0, false, w, sms, cc);
              if (got != want) {
                std::fprintf(stderr, "%s n=%lld elem=%lld world=%lld sms=%lld cc=%d: grid %u, python %lld\n", kNames[a],
                             n, e, w, sms, cc, got, want);
                ++g_failures;
              }
              ++checked;
            }
  // Fused: one block per token row, min(tokens, SMs / 2), whatever the algorithm; Lamport at few
  // tokens several (the row split).
  const long long tokens[] = {1, 3, 8, 77, 128, 4096};
  for (int a = 0; a < ubnext::kNumAlgos; ++a)
    for (long long t : tokens)
      for (long long sms : smss) {
        CHECK(c_grid(a, t * 4096 * 2, t, 8, sms, 9, 1 << 20, a == UBNEXT_ALGO_LAMPORT ? 4096 * 2 / 16 : 0) ==
              py_grid(kNames[a], t * 4096, 2, t, true, 8, sms));
        ++checked;
      }
  std::printf("default grid: %d cases match ubnext/comm/_executor.py launch_geometry\n", checked);
}

void test_grid_caps() {
  // nvls_lamport sizes its grid by the per-rank share: 1 MiB on 8 ranks = 8192 vectors per rank.
  CHECK(c_grid(UBNEXT_ALGO_NVLS_LAMPORT, 1 << 20, 0, 8, 132, 9) == 32);
  // Odd byte counts round up to whole vectors; never 0 blocks.
  CHECK(default_grid(false, 2, 0, 8, 256, 132, 1 << 20) == 1);
  CHECK(default_grid(true, 2, 0, 8, 256, 132, 1 << 20) == 1);
  CHECK(default_grid(false, 256 * 16 + 2, 0, 1, 256, 132, 1 << 20) == 2);
  // Caps: UBNEXT_MAX_BLOCKS (an SM count above it, B200's 148) for a kernel that waits on nobody
  // (quantize), and the co-resident limit.
  CHECK(default_grid(false, 1 << 28, 0, 8, 256, 148, 1 << 20, false) == UBNEXT_MAX_BLOCKS);
  CHECK(default_grid(false, 1 << 28, 0, 8, 256, 148, 40) == 40);
  CHECK(default_grid(false, 0, 500, 8, 256, 148, 1 << 20, false) == UBNEXT_MAX_BLOCKS);
}

// No deadlock between communicators (launch_rules.h, pair_grid_cap): every kernel that waits on its
// peers' blocks, flat or fused, at any size, takes at most half the SMs, so two of them (two
// communicators) always fit the device together at one CTA per SM.
void test_two_kernels_fit() {
  const long long smss[] = {1, 2, 8, 78, 114, 132, 148, 160};
  const long long worlds[] = {2, 3, 4, 8, 16};
  for (long long sms : smss)
    for (long long w : worlds)
      for (int a = 0; a < ubnext::kNumAlgos; ++a)
        for (int cc : {9, 10}) {
          const unsigned flat = c_grid(a, 1ll << 30, 0, w, sms, cc);
          const unsigned fused = c_grid(a, 4096ll * 8192 * 2, 4096, w, sms, cc);
          const long long room = sms < 2 ? 1 : sms;  // one SM holds one grid of one block
          CHECK(sms < 2 || static_cast<long long>(flat) * 2 <= room);
          CHECK(sms < 2 || static_cast<long long>(fused) * 2 <= room);
          CHECK(flat >= 1 && fused >= 1);
        }
  CHECK(ubnext::pair_grid_cap(132) == 64);  // min(132, 128) / 2: H100
  CHECK(ubnext::pair_grid_cap(148) == 64);  // B200
  CHECK(ubnext::pair_grid_cap(78) == 39);
  CHECK(ubnext::pair_grid_cap(1) == 1);
  // A kernel that waits on nobody keeps the whole device (default_grid without waits_on_peers).
  CHECK(default_grid(false, 1 << 28, 0, 1, 256, 132, 1 << 20, false) == 128);
}

// The NVLS two-shot's flat grid as NCCL sizes its multicast kernels: ceil(16 / nranks) on sm_90,
// ceil(32 / nranks) from sm_100; its fused grid stays one block per row.
void test_nvls_twoshot_grid() {
  CHECK(c_grid(UBNEXT_ALGO_NVLS_TWOSHOT, 1 << 28, 0, 8, 132, 9) == 2);
  CHECK(c_grid(UBNEXT_ALGO_NVLS_TWOSHOT, 1 << 28, 0, 4, 132, 9) == 4);
  CHECK(c_grid(UBNEXT_ALGO_NVLS_TWOSHOT, 1 << 28, 0, 2, 132, 9) == 8);
  CHECK(c_grid(UBNEXT_ALGO_NVLS_TWOSHOT, 1 << 28, 0, 8, 148, 10) == 4);
  CHECK(c_grid(UBNEXT_ALGO_NVLS_TWOSHOT, 1 << 28, 0, 3, 132, 9) == 6);
  CHECK(c_grid(UBNEXT_ALGO_NVLS_TWOSHOT, 2048, 0, 8, 132, 9) == 1);  // one vector per thread suffices
  CHECK(c_grid(UBNEXT_ALGO_NVLS_TWOSHOT, 4096ll * 16384, 4096, 8, 132, 9) == 64);
  CHECK(c_grid(UBNEXT_ALGO_TWOSHOT, 1 << 28, 0, 8, 132, 9) == 64);  // the unicast two-shot is not NVLS
}

// ubnext_quantize_fp8's grid: the work alone, no residency cap (the kernel is local). The same numbers
// are pinned for ubnext/comm/_quantize.py quantize_geometry in tests/unit/test_plan.py.
void test_quantize_grid() {
  using ubnext::quantize_grid;
  CHECK(quantize_grid(false, 64u << 20, 0, 256) == 4096);       // 64 MB static: 4 vectors per thread
  CHECK(quantize_grid(true, 64u << 20, 8192 * 2, 256) == 4096);  // rows of 1024 vectors: 256 threads each
  CHECK(quantize_grid(true, 1000 * 128 * 2, 128 * 2, 256) == 16);  // rows of 16 vectors: 4 threads, 64 a block
  CHECK(quantize_grid(true, 16, 16, 256) == 1);
  CHECK(ubnext::quantize_row_group(16, 256) == 4 && ubnext::quantize_row_group(4096, 256) == 256);
  CHECK(ubnext::quantize_row_group(3, 256) == 1 && ubnext::quantize_row_group(24, 256) == 4);
  CHECK(ubnext::quantize_row_group(4096, 96) == 32);  // groups divide the block
}

}  // namespace

// The row split as a cluster launch (launch_rules.h row_split, row_cluster, pair_clusters_fit): at most 8
// CTAs per row (a portable cluster), one cluster per row, and the cluster rule's arithmetic at its site: a
// grid within pair_grid_cap leaves room for its clusters beside any other such kernel on H100 and B200.
void test_row_split_clusters() {
  CHECK(ubnext::row_split(1, 1024, 64) == 8);   // 1 x 8192 bf16: 8 CTAs of 128 vectors
  CHECK(ubnext::row_split(1, 2048, 64) == 8);   // fp32's 2048 vectors: still 8, not 16
  CHECK(ubnext::row_split(16, 1024, 64) == 4);  // 16 tokens: 64 CTAs, clusters of 4
  CHECK(ubnext::row_split(32, 1024, 128) == 4);  // no sync-region partials bound any more
  CHECK(ubnext::row_split(64, 1024, 64) == 1);
  CHECK(ubnext::row_cluster(1, 8) == 8 && ubnext::row_cluster(16, 64) == 4);
  CHECK(ubnext::row_cluster(8, 8) == 1 && ubnext::row_cluster(0, 8) == 1);
  CHECK(ubnext::pair_clusters_fit(8, 16) && !ubnext::pair_clusters_fit(9, 17) && !ubnext::pair_clusters_fit(1, 0));
  for (long long sms : {132ll, 148ll})
    for (long long gpcs : {8ll}) {
      const long long g = ubnext::pair_grid_cap(static_cast<int>(sms));
      for (long long s = 2; s <= static_cast<long long>(ubnext::kRowSplitMax); ++s) {
        // worst case beside another kernel of g CTAs, k = 2 CTAs per SM: k (sms - g) / s - G (s - 1) / s
        const double room = (2.0 * (sms - g) - static_cast<double>(gpcs * (s - 1))) / static_cast<double>(s);
        CHECK(room >= static_cast<double>(g / s));
      }
    }
}

int main() {
  test_row_split_clusters();
  test_quantize_grid();
  test_traits();
  test_grid_matches_python();
  test_grid_caps();
  test_two_kernels_fit();
  test_nvls_twoshot_grid();
  if (g_failures) {
    std::fprintf(stderr, "test_launch_rules: %d check(s) failed\n", g_failures);
    return 1;
  }
  std::printf("test_launch_rules: all checks passed\n");
  return 0;
}
