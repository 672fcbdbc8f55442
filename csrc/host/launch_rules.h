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

constexpr AlgoTraits kAlgos[kNumAlgos] = {
    /*                 op                      arena  out=in share  mcast  lamport fuse */
    /* LAMPORT      */ {UBNEXT_OP_LAMPORT,      false, true,  false, false, true,  true},
    /* NVLS_ONESHOT */ {UBNEXT_OP_NVLS_ONESHOT, true,  false, false, true,  false, false},
    /* NVLS_TWOSHOT */ {UBNEXT_OP_NVLS_TWOSHOT, true,  true,  true,  true,  false, true},
    /* NVLS_LAMPORT */ {UBNEXT_OP_NVLS_LAMPORT, true,  false, true,  true,  true,  true},
    /* TWOSHOT      */ {UBNEXT_OP_TWOSHOT,      true,  true,  true,  false, false, true},
};

// The same geometry as the Python launcher (ubnext/comm.py, _geometry), so that a job gets the
// same grid whichever front end launches: fused op (tokens > 0), one block per token row (Lamport at
// few tokens: tokens x row_split blocks);
// otherwise one 16-byte vector per thread of what this rank reduces (1/nranks of the message for
// the two-shot family: nvls_twoshot, twoshot, nvls_lamport; the whole message for lamport and
// nvls_oneshot). Capped at one block per SM and UBNEXT_MAX_BLOCKS (as Python's _sm_count), and
// at the kernel's co-resident limit (below both on any supported GPU); at least 1.
// Blocks per token row of the Lamport fused kernel at few tokens (csrc/device/norm.cuh, the row split;
// ubnext/_executor.py row_split): the blocks the rows leave free, each keeping >= 128 of the row's
// `row_vectors` 16-byte vectors, within the sync region's partials (one word per 32 vectors of every
// row, 896 words) and a row cache (2048 vectors) per block; 1 = no split.
inline size_t row_split(size_t tokens, size_t row_vectors, size_t max_blocks) {
  if (tokens == 0 || row_vectors == 0) return 1;
  const size_t groups = (row_vectors + 31) / 32;
  size_t split = max_blocks / tokens;
  if (row_vectors / 128 < split) split = row_vectors / 128;
  if (split < 2 || tokens * groups > UBNEXT_SYNC_ROW_PARTIALS_END - UBNEXT_SYNC_ROW_PARTIALS ||
      (groups + split - 1) / split * 32 > 2048)
    return 1;
  return split;
}

// row_vectors: the row's 16-byte vectors for a Lamport fused launch whose rows may split (not per-token
// FP8), else 0.
inline unsigned default_grid(bool per_rank_share, size_t bytes, size_t tokens, size_t nranks,
                             unsigned block, int sms, int coresident, size_t row_vectors = 0) {
  size_t want;
  if (tokens > 0) {
    size_t max_blocks = UBNEXT_MAX_BLOCKS;
    if (sms > 0 && static_cast<size_t>(sms) < max_blocks) max_blocks = static_cast<size_t>(sms);
    want = tokens * row_split(tokens, row_vectors, max_blocks);
  } else {
    size_t vectors = (bytes + 15) / 16;
    if (per_rank_share && nranks > 0) vectors = (vectors + nranks - 1) / nranks;
    want = (vectors + block - 1) / block;
  }
  size_t cap = UBNEXT_MAX_BLOCKS;
  if (sms > 0 && static_cast<size_t>(sms) < cap) cap = static_cast<size_t>(sms);
  if (coresident > 0 && static_cast<size_t>(coresident) < cap) cap = static_cast<size_t>(coresident);
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
