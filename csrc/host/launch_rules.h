// The kernels' buffer contracts as the C API enforces them, and the default launch geometry.
// Pure data and arithmetic (no CUDA), so that tests/c/test_launch_rules.cpp can check them
// without a GPU. Change together with the header comments of csrc/kernels/*.cu, the contracts
// in include/ubnext.h and ubnext/comm.py (_geometry).
#pragma once

#include <cstddef>

#include "device/desc.cuh"
#include "ubnext.h"

namespace ubnext {

constexpr int kNumAlgos = 5;
static_assert(UBNEXT_ALGO_TWOSHOT + 1 == kNumAlgos, "algo table out of date");

// Buffer contracts of the kernels (their header comments in csrc/kernels/*.cu say why):
//   lamport       in anywhere, not modified; out anywhere (out == in allowed).
//   nvls_oneshot  in in the arena, read by the peers through the multicast address until the
//                 trailing barrier, not modified: out anywhere but never over in. Not fusable.
//   nvls_twoshot  in in the arena and OVERWRITTEN with the result (peers store into it); out == in,
//   twoshot       or out anywhere else (copied from in after the exchange).
//   nvls_lamport  in in the arena, not modified; out anywhere but never over in.
// Every kernel takes any count >= 1 in flat mode (a partial last 16-byte vector is never stored
// past n); row mode (fused) needs hidden * elem % 16 == 0 and count % hidden == 0.
// Fused (every fusable algorithm): the row math runs on every rank after the exchange, so out,
// residual_out, residual, weight, scale and scale_inv are plain device memory anywhere.
struct AlgoTraits {
  int op;               // UBNEXT_OP_* written by the kernel into the error word
  bool in_in_arena;     // peers read (and two-shot: write) `in` at the same pool offset
  bool out_may_be_in;   // out == in is allowed (dtype output); otherwise out must not overlap in
  bool per_rank_share;  // each rank reduces 1/nranks of the message (default grid sizing)
  bool needs_multicast;
  bool uses_lamport;    // the message passes through one Lamport slot
  bool can_fuse;        // fused norm needs bitwise-identical sums on every rank
};

// clang-format off: a table, one column per trait
constexpr AlgoTraits kAlgos[kNumAlgos] = {
    /*                 op                      arena  out=in share  mcast  lamport fuse */
    /* LAMPORT      */ {UBNEXT_OP_LAMPORT,      false, true,  false, false, true,  true},
    /* NVLS_ONESHOT */ {UBNEXT_OP_NVLS_ONESHOT, true,  false, false, true,  false, false},
    /* NVLS_TWOSHOT */ {UBNEXT_OP_NVLS_TWOSHOT, true,  true,  true,  true,  false, true},
    /* NVLS_LAMPORT */ {UBNEXT_OP_NVLS_LAMPORT, true,  false, true,  true,  true,  true},
    /* TWOSHOT      */ {UBNEXT_OP_TWOSHOT,      true,  true,  true,  false, false, true},
};
// clang-format on

// No deadlock between communicators (issue 24 G). A kernel whose blocks wait on its peers' blocks
// (every kernel here but the local ones, quantize, the block quantisers and add_rmsnorm: the barrier kernels, and the Lamport kernels, whose block b polls
// what block b of each peer pushes) makes progress only once block b is resident on every rank. Two
// communicators with kernels in flight at once (a TP op on one stream, FSDP2's prefetched all-gather on
// another) can each hold SMs on one rank while waiting for blocks that the other holds back on a peer,
// if the ranks made their kernels resident in opposite orders. The rule: such a kernel's default grid
// is at most half the SMs, min(SMs, UBNEXT_MAX_BLOCKS) / 2. Why it holds: one CTA of any ubnext kernel
// fits an empty SM (coresident >= SMs, checked at launch: 256 threads at ptxas' limit of 255 registers,
// allocated as 256 a thread, = 65536 of 65536 registers, and 35 KB of static shared memory of 228 KB, is one
// CTA per SM on sm_90 and sm_100), so a kernel of g <= SMs / 2 CTAs touches at most SMs / 2 SMs, which leaves at least
// SMs / 2 empty SMs for the other kernel's g' <= SMs / 2 CTAs: both are resident at once on every rank,
// whatever order each rank's scheduler took them in, and each completes. Other work on the device
// (GEMMs) only delays this: its blocks never wait on ours. Programmatic dependent launch keeps it: a
// kernel triggers its dependent (griddepcontrol.launch_dependents) only after its last wait on a peer,
// so a dependent parked in griddepcontrol.wait on its SMs waits for a grid that waits on nobody. The guarantee covers two communicators in
// flight per device; a third needs an explicit grid (ubnext_launch_t.grid) of at most SMs / 3.
inline int pair_grid_cap(int sms) {
  const int base = sms > 0 && sms < UBNEXT_MAX_BLOCKS ? sms : UBNEXT_MAX_BLOCKS;
  return base / 2 > 0 ? base / 2 : 1;
}

// The same argument for cluster launches (the Lamport row split: c = grid / s clusters of s <= 8 CTAs of
// 128 threads, row_split and row_cluster below). The GPU places a cluster's CTAs at once on one GPC, so
// "g <= SMs / 2 CTAs" alone no longer makes two kernels resident together: the SMs the other kernel leaves
// free may be spread over the GPCs with fewer than a cluster's slots free in each. Per GPC j of n_j SMs,
// with k of our CTAs per empty SM, the empty device holds M = sum_j floor(k n_j / s) of our clusters
// (cuOccupancyMaxActiveClusters). The rule (pair_clusters_fit): 2c <= M, on top of g <= SMs / 2. Why it holds:
//   (a) against any other kernel of g' <= SMs / 2 CTAs (plain or clustered, each CTA holding a whole SM at
//       worst): it leaves >= SMs / 2 empty SMs, and GPC j with f_j of them holds floor(k f_j / s) >=
//       k f_j / s - (s - 1) / s of our clusters, so together >= k SMs / (2s) - G (s - 1) / s for G GPCs.
//       Our c = g / s <= SMs / (2s) clusters fit when G (s - 1) <= (k - 1) SMs / 2. A 128-thread CTA fits
//       an SM at least twice whatever its registers (2 x 128 x 256 = 65536: 255 rounds up to 256) and shared memory (35 KB of
//       228), so k >= 2 and it suffices that G (s - 1) <= SMs / 2: at s = 8, G <= 9 GPCs on H100's 132 SMs
//       (it has 8 or fewer), G <= 10 on 148 (B200). A device with more GPCs per SM than that, or s > 8,
//       needs this checked again: the driver reports no GPC count, so the launchers cannot check it;
//   (b) 2c <= M is what they can check: it refuses a device that holds too few clusters at all (an MPS
//       share or a green context with few SMs, where the previous global-memory exchange spun until its
//       timeout), and against another cluster launch of the same shape it is exact: a cluster takes s slots
//       of one GPC, lowering that GPC's floor(slots / s) by exactly one, so c + c' <= M fit together;
//   (c) PDL as above: a dependent parked in griddepcontrol.wait waits for a grid that waits on nobody.
// When the rule fails the launch drops the cluster attribute: the kernel then gives each row to one CTA
// (norm.cuh row_split_of), which waits for no sibling. The emulator runs every block of a launch at once.
inline bool pair_clusters_fit(size_t clusters, int max_active_clusters) {
  return max_active_clusters > 0 && 2 * clusters <= static_cast<size_t>(max_active_clusters);
}

// The NVLS two-shot's flat grid as NCCL sizes its multicast kernels (src/sym_kernels.cc, queryModel_lsa:
// nMaxBlocksNvls = ceil(16 / nranks) below sm_100, ceil(32 / nranks) from sm_100; 2 CTAs at 8 ranks on
// Hopper): the switch reduces and replicates, so a few SMs saturate NVLS bandwidth, and fewer CTAs
// mean fewer barrier slots to signal and poll.
inline unsigned nvls_twoshot_grid_cap(size_t nranks, int cc_major) {
  const size_t base = cc_major >= 10 ? 32 : 16;
  const size_t n = nranks > 0 ? nranks : 1;
  return static_cast<unsigned>((base + n - 1) / n);
}

// Blocks per token row of the Lamport fused kernel at few tokens (csrc/device/norm.cuh, the row split;
// ubnext/comm/_executor.py row_split), launched as one thread-block cluster per row: the blocks the rows
// leave free, each keeping >= 128 of the row's `row_vectors` 16-byte vectors, at most 8 (the portable
// cluster size), and a row cache (2048 vectors) per block; 1 = no split.
constexpr size_t kRowSplitMax = 8;
// Threads of a split row's CTAs (at 1 x 8192 bf16: one 16-byte vector per thread, FlashInfer's 8 x 128).
constexpr unsigned kRowSplitBlock = 128;
inline size_t row_split(size_t tokens, size_t row_vectors, size_t max_blocks) {
  if (tokens == 0 || row_vectors == 0) return 1;
  const size_t groups = (row_vectors + 31) / 32;
  size_t split = max_blocks / tokens;
  if (row_vectors / 128 < split) split = row_vectors / 128;
  if (kRowSplitMax < split) split = kRowSplitMax;
  if (split < 2 || (groups + split - 1) / split * 32 > 2048) return 1;
  return split;
}

// CTAs per thread-block cluster of a Lamport fused launch of `grid` CTAs over `tokens` rows: the row
// split's (grid = tokens x split, one cluster per row), else 1 (no cluster).
inline unsigned row_cluster(size_t tokens, unsigned grid) {
  return tokens > 0 && grid > tokens ? static_cast<unsigned>(grid / tokens) : 1u;
}

// The same geometry as the Python launcher (ubnext/_executor.py, launch_geometry and gpu_max_blocks),
// so that a job gets the same grid whichever front end launches: fused op (tokens > 0), one block per
// token row (Lamport at
// few tokens: tokens x row_split blocks, row_vectors the row's 16-byte vectors when its rows may split:
// not per-token FP8, else 0); otherwise one 16-byte vector per thread of what this rank reduces (1/nranks of the message
// for the two-shot family: nvls_twoshot, twoshot, nvls_lamport; the whole message for lamport and
// nvls_oneshot). Capped at one block per SM and UBNEXT_MAX_BLOCKS (as Python's _sm_count), halved for
// kernels that wait on peers (pair_grid_cap), at `algo_cap` when non-zero (nvls_twoshot_grid_cap), and
// at the kernel's co-resident limit (below all of them on any supported GPU); at least 1.
inline unsigned default_grid(bool per_rank_share, size_t bytes, size_t tokens, size_t nranks, unsigned block, int sms,
                             int coresident, bool waits_on_peers = true, unsigned algo_cap = 0,
                             size_t row_vectors = 0) {
  size_t cap = UBNEXT_MAX_BLOCKS;
  if (sms > 0 && static_cast<size_t>(sms) < cap) cap = static_cast<size_t>(sms);
  if (waits_on_peers) cap = static_cast<size_t>(pair_grid_cap(sms));
  if (algo_cap > 0 && algo_cap < cap) cap = algo_cap;
  if (coresident > 0 && static_cast<size_t>(coresident) < cap) cap = static_cast<size_t>(coresident);
  size_t want;
  if (tokens > 0) {
    want = tokens * row_split(tokens, row_vectors, cap);  // the split within the capped grid
  } else {
    size_t vectors = (bytes + 15) / 16;
    if (per_rank_share && nranks > 0) vectors = (vectors + nranks - 1) / nranks;
    want = (vectors + block - 1) / block;
  }
  if (want > cap) want = cap;
  return want ? static_cast<unsigned>(want) : 1u;
}

}  // namespace ubnext

namespace ubnext {

// The grid of ubnext_quantize_fp8, the same rule as ubnext/_quantize.py quantize_geometry. The kernel is
// local (no peer, no barrier between blocks), so residency does not bound it: blocks that do not fit
// wait for a free SM. static: one trip of kInFlight 16-byte vectors per thread; per row: a group of G
// threads per row (quantize.cu row_group_threads: the largest power of two with G * kInFlight <= the
// row's vectors that divides `block`), block / G rows per block. At least 1, at most gridDim.x's limit.
constexpr unsigned kQuantizeInFlight = 4;
constexpr size_t kMaxGridX = 2147483647u;

inline unsigned quantize_row_group(size_t row_vectors, unsigned block) {
  unsigned g = 1;
  while (2 * g * kQuantizeInFlight <= row_vectors && block % (2 * g) == 0) g *= 2;
  return g;
}

inline unsigned quantize_grid(bool per_row, size_t bytes, size_t row_bytes, unsigned block) {
  size_t want;
  if (per_row) {
    const size_t per_block = block / quantize_row_group(row_bytes / 16, block);
    want = (bytes / row_bytes + per_block - 1) / per_block;
  } else {
    const size_t per_block = static_cast<size_t>(block) * kQuantizeInFlight;
    want = (bytes / 16 + per_block - 1) / per_block;
  }
  if (want > kMaxGridX) want = kMaxGridX;
  return want ? static_cast<unsigned>(want) : 1u;
}

}  // namespace ubnext
