// All-gather of bytes over the symmetric pool, one shot: every rank pushes its shard to every rank.
//
// Kernel: ubnext_allgather_u8, with the one ABI parameter list (docs/ARCHITECTURE.md); `n` is the shard's
// size in BYTES (the data is moved, never interpreted: FSDP2 gathers bf16 parameters, or FP8 data and its
// scale_inv packed as bytes, through the same kernel). residual, residual_out, weight, scale, scale_inv,
// hidden and eps are unused.
//
//   barrier 1 (every peer is done with its earlier use of `out`: we are about to write into it) ->
//   push: rank r stores its shard `in` to bytes [r*n, (r+1)*n) of `out` on every rank, by one
//   st.relaxed.sys per peer, or once through the multicast address (UBNEXT_F_MULTICAST) ->
//   barrier 2 (its release/acquire orders every rank's stores before anyone reads `out`).
//
// Contract:
//   out: world_size * n bytes in this rank's pool data arena, at the same offset on every rank (the call
//   header carries that offset, so ranks that disagree fail with a mismatch error instead of writing into
//   each other's unrelated tensors). in: n bytes anywhere, read locally; it may be this rank's own slice of
//   `out` (FSDP2 copies its shard there first), which is then not stored to again. Any n >= 1: where `in`
//   and its slice of `out` lie alike on the 16-byte grid (the host copies `in` when they do not; FSDP2's
//   in-place slice always does), the bytes before the slice's first 16-byte boundary and after its last
//   (fewer than 16 each) go one byte per peer, the vectors between them whole; where they do not, every
//   byte goes alone (correct, slow). multimem.st has no byte form: head and tail bytes go to each peer
//   by unicast, the vectors through multicast.
// UBNEXT_BREAK_ALLGATHER_SHORT_PUSH (test-only) leaves the last byte of a shard that does not end on a
// 16-byte boundary unpushed.
// Traffic per rank: (N-1)*n bytes of peer stores (unicast), or n bytes once through multicast.
#include "../device/platform.cuh"
#include "../device/desc.cuh"
#include "../device/entry.cuh"
#include "../device/ptx.cuh"
#include "../device/barrier.cuh"
#include "../device/vec.cuh"
#include "../device/slices.cuh"

namespace ubx {

UBX_DEV void allgather_push(const ubnext_comm_desc* d, const void* in, void* out, int n, int flags) {
  if (gridDim.x > UBNEXT_MAX_BLOCKS || n <= 0) return;  // the host checks: nobody waits
  RankBarrier br = barrier_open_checked(d, UBNEXT_OP_ALLGATHER, UBNEXT_HDR_DTYPE_BYTES, n, 0, flags, out);

  const uint32_t rank = static_cast<uint32_t>(d->rank);
  const uint32_t nranks = static_cast<uint32_t>(d->nranks);
  const uint64_t my_base = static_cast<uint64_t>(d->peer_base[rank]);
  // Byte offset of this rank's slice of `out` in every pool (layouts are identical on every rank).
  const uint64_t dst_off = reinterpret_cast<uint64_t>(out) - my_base + static_cast<uint64_t>(rank) * n;
  const bool in_place = reinterpret_cast<uint64_t>(in) == my_base + dst_off;
  const bool multicast = (flags & UBNEXT_F_MULTICAST) != 0 && d->mc_base != 0;
  const bool vectors = (reinterpret_cast<uint64_t>(in) - dst_off) % 16u == 0;  // peer bases are 16-aligned
  const int64_t to_grid = static_cast<int64_t>((16u - dst_off % 16u) % 16u);
  const int64_t head = !vectors ? n : (to_grid < n ? to_grid : n);
  const int64_t nvec = (n - head) / 16;
  const int64_t tail0 = head + nvec * 16;
#if !defined(UBNEXT_BREAK_ALLGATHER_SHORT_PUSH)
  const int64_t nbytes = head + (n - tail0);
#else
  const int64_t nbytes = head + (n - tail0) - (n > tail0 ? 1 : 0);  // test-only broken build: the last byte stays
#endif

  if (!barrier_sync(br)) return;

  // Every rank starts with the rank after itself, so they do not all hit the same peer first.
  auto for_each_peer = [&](auto&& put) {
    uint32_t p = rank;
    for (uint32_t i = 0; i < nranks; ++i) {
      p = (p + 1u == nranks) ? 0u : p + 1u;
      if (p == rank && in_place) continue;
      put(static_cast<uint64_t>(d->peer_base[p]) + dst_off);
    }
  };
  const int64_t t0 = global_tid(), step = global_threads();
  for (int64_t i = t0; i < nvec; i += step) {
    const uint64_t at = static_cast<uint64_t>(head + i * 16);
    const uint4 v = ld_plain_v4(static_cast<const char*>(in) + at);
    if (multicast) {
      multimem_st_v4(reinterpret_cast<void*>(static_cast<uint64_t>(d->mc_base) + dst_off + at), v);
      continue;
    }
    for_each_peer([&](uint64_t dst) { st_relaxed_sys_v4(reinterpret_cast<void*>(dst + at), v); });
  }
  for (int64_t k = t0; k < nbytes; k += step) {
    const int64_t at = k < head ? k : tail0 + (k - head);
    const uint8_t v = static_cast<const uint8_t*>(in)[at];
    for_each_peer([&](uint64_t dst) { st_relaxed_sys_u8(reinterpret_cast<uint8_t*>(dst + at), v); });
  }
  // No fence.proxy.alias after the multicast push (issue 24 A): no thread of this kernel reads `out`
  // after storing to it (the byte stores go to other bytes, by unicast); its readers are later kernels,
  // after barrier 2 (every rank's stores released before its signal) and the kernel boundary (a grid's
  // stores are complete before the next grid in stream order starts; no thread of it has a stale L1
  // line of `out`). NCCL's multicast
  // all-gather and all-reduce (symmetric AllGather_STMC, AllReduce_RSxLDMC_AGxSTMC) end the same way.
  // This rests on the hardware, not on the PTX model alone: the model orders a peer's multicast store
  // before a later kernel's unicast load of it only through an alias proxy fence on the path, and a
  // kernel boundary is not one; multimem stores complete in L2, which every later unicast load reads
  // (L1 starts each kernel invalid). nvls_twoshot keeps its fence where it reads back in-kernel.
  (void)barrier_sync(br);
  griddep_launch_dependents();  // after its last wait on a peer (launch_rules.h, pair_grid_cap: a parked dependent then waits only for a grid that waits on nobody)
}

}  // namespace ubx

UBX_KERNEL(ubnext_allgather_u8) {
  (void)residual, (void)residual_out, (void)weight, (void)scale, (void)scale_inv, (void)hidden, (void)eps;
  ::ubx::kernel_begin();
  ::ubx::allgather_push(&desc, in, out, n, flags);
}
