// Lamport one-shot allreduce (DESIGN.md section 3), optionally fused with residual add + RMSNorm and
// FP8 e4m3 output. One launch, no barrier: the data words themselves say whether they have arrived.
//
// Kernels: ubnext_lamport_{bf16,fp16,fp32}, with the one ABI parameter list (docs/ARCHITECTURE.md).
//
// Call k (k = sync[LAMPORT_CALL], local) uses buffer b = k % 3 of every rank:
//   1. push: each thread loads 16-byte vectors of `in`, sanitises -0 -> +0 and stores them into slot
//      [rank] of buffer b on every rank (relaxed .sys stores; or once through the multicast address),
//      after the slot's first vector, which holds the call header (below).
//   2. re-poison buffer (k + 2) % 3 of THIS rank, the previous call's; then advance the rotation: thread 0
//      of block 0, once every block has counted itself at its start, records this call's byte count and
//      advances the counter, before its own polls (a one-block launch: at its end).
//   3. poll: volatile 16-byte loads of our own buffer b, every slot, until no word is the sentinel
//      (bounded by desc->timeout_ns); sum in fp32 in rank order 0..N-1 (bitwise identical on every
//      rank); write `out`, or run the fused row math (csrc/device/norm.cuh), one block per token row, or
//      at few tokens a cluster of `split` blocks per row (norm.cuh's row split: the grid is rows x split;
//      each block pushes and polls its part of the row, with the row's residual and weight loaded before the
//      poll, and the cluster folds the row's sum of squares in distributed shared memory).
// Step 2 (the 3-buffer rotation: why that buffer is safe to re-poison, the counters, their
// ordering and the test-only broken builds) lives in csrc/device/lamport_rotation.cuh, shared with
// nvls_lamport.
//
// Dependencies between blocks: each thread polls exactly the vectors it pushed itself (same index
// mapping on every rank, since every rank launches the same grid), so a block's polls depend only on the
// same block of the peers, which pushes before it waits. Without the row split that keeps the kernel
// deadlock-free for any grid. With it, the blocks sharing a row, one thread-block cluster, also wait for
// each other at the cluster barrier (after their polls), and block 0's cluster for thread 0's bounded wait
// for every block to start (the rotation's early advance): norm.cuh argues why that cannot deadlock; the
// cluster launch runs them together.
//
// Call header: the last thread of block 0 (lamport_poll.cuh: is_lamport_header_thread) pushes this rank's call header (op, dtype, flags, n, hidden and a fused
// call's eps: lamport_poll.cuh's lamport_call_header) into vector 0 of its slot beside its first data,
// then loads every peer's at once and compares them before its own data. A peer whose header differs
// is reported as UBNEXT_ERR_MISMATCH, which aborts the communicator: every
// rank compares every peer, so each rank raises the mismatch, and a thread waiting for data its peer
// will never send (another count) leaves at the abort instead of at the timeout. One writer per header
// word, as for data words, so the rotation's argument (lamport_rotation.cuh: a word seen is a store
// landed) holds for it too; other blocks neither write nor wait for it. No NVLink hop is added: the
// header travels beside the data and is polled while the data is in flight; one 16-byte store per peer
// (or one multicast store) more per call, and for the header thread one serialised wait before its data,
// if it has any (every peer's header polled together, lamport_poll.cuh poll_slots).
//
// Ordering of the data path: no fence and no release. Every 32-bit word is self-validating (sentinel vs
// sanitised data), so a reader needs no flag; a vector is consumed only when all four words have arrived.
// (The rotation's ordering: lamport_rotation.cuh.)
#include "../device/platform.cuh"
#include "../device/desc.cuh"
#include "../device/entry.cuh"
#include "../device/ptx.cuh"
#include "../device/barrier.cuh"
#include "../device/vec.cuh"
#include "../device/reduce.cuh"
#include "../device/norm.cuh"
#include "../device/lamport_rotation.cuh"
#include "../device/lamport_poll.cuh"
#include "../device/stamps.cuh"

namespace ubx {

template <typename T>
UBX_DEV void lamport_allreduce(const ubnext_comm_desc* d, const void* in, void* out, const void* residual,
                               void* residual_out, const void* weight, const float* scale, float* scale_inv, int n,
                               int hidden, float eps, int flags) {
  constexpr int V = DType<T>::kElems;
  __shared__ uint4 s_cache[UBX_ROW_CACHE_VECS];
  __shared__ float s_red[UBX_RED_SCRATCH];

  const bool rows = uses_rows(flags);
  // Host contract (ubnext checks before launching). All ranks see the same arguments, so returning here
  // leaves every rank's state untouched and nobody waiting.
  if (n < 0 || !row_shape_ok<T>(n, hidden, flags)) return;

  const uint32_t rank = static_cast<uint32_t>(d->rank);
  const uint32_t nranks = static_cast<uint32_t>(d->nranks);
  const uint64_t slot = d->lamport_slot_bytes;

  const LamportRot rot = lamport_rot_begin(d);  // before this block's done increment (step 2)
  const uint64_t buf_off = lamport_buffer_off(d, rot.b);  // buffer b, slot 0
  const uint64_t my_off = buf_off + static_cast<uint64_t>(rank) * slot;  // our slot: header
  const uint64_t my_data_off = my_off + UBNEXT_LAMPORT_HEADER_BYTES;  // then the data
  const uint64_t mc = (flags & UBNEXT_F_MULTICAST) ? static_cast<uint64_t>(d->mc_base) : 0ull;
  const int64_t nvec = (static_cast<int64_t>(n) + V - 1) / V;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int nv_row = rows ? hidden / V : 0;
  const int64_t nrows = rows ? n / hidden : 0;

  // An aborted communicator (barrier.cuh): push nothing, consume nothing, report why. The flag is
  // read first but tested only after the first load of `in`, so that the two loads overlap.
  const uint32_t aborted = abort_flag(d);

  // ---- 1. push (peers first, own slot last: the local store is the one nobody waits long for)
  auto store_everywhere = [&](uint64_t off, const uint4& v) {
    if (mc != 0ull) {
      multimem_st_v4(reinterpret_cast<void*>(mc + off), v);
    } else {
      uint32_t p = rank;
      for (uint32_t i = 0; i < nranks; ++i) {
        p = (p + 1u == nranks) ? 0u : p + 1u;
        st_relaxed_sys_v4(reinterpret_cast<void*>(static_cast<uint64_t>(d->peer_base[p]) + off), v);
      }
    }
  };
  auto push = [&](int64_t gi) {
    const uint4 v = sanitize<T>(load_vec<T>(in, gi, n));  // tail: zero padding, a valid value
    if (aborted != 0u) return;
    store_everywhere(my_data_off + static_cast<uint64_t>(gi) * 16u, v);
  };
  const uint4 header = lamport_call_header(UBNEXT_OP_LAMPORT, DType<T>::kCode, n, hidden, flags, eps);
  const bool header_thread = is_lamport_header_thread();  // its one writer and reader (above)
  if (header_thread && aborted == 0u) store_everywhere(my_off, header);
  // Row mode: one CTA per row, or a row shared by `split` CTAs (norm.cuh, the row split).
  const int split = rows ? row_split_of(nrows, nv_row, flags) : 1;
  const RowPart part = row_part_of(nrows, nv_row, split);
  if (split > 1) row_split_open();  // norm.cuh: the siblings' shared memory exists before the first push into it
  if (!rows) {
    for (int64_t gi = tid; gi < nvec; gi += stride) push(gi);
  } else if (split > 1) {
    // Same mapping as norm_row_part: this thread pushes exactly what it will poll.
    if (part.active)
      for (int i = part.lo + static_cast<int>(threadIdx.x); i < part.hi; i += blockDim.x) push(part.row * nv_row + i);
  } else {
    // Same mapping as the row loop below: this thread pushes exactly what it will poll.
    for (int64_t row = blockIdx.x; row < nrows; row += gridDim.x)
      for (int i = threadIdx.x; i < nv_row; i += blockDim.x) push(row * nv_row + i);
  }
  UBX_STAMP(d, kStampPush);  // test-only build UBNEXT_STAMPS (stamps.cuh), as the other UBX_STAMPs
  const RowParams rp{residual, weight, scale, hidden, eps, flags};
  RowPrefetch<T> pre;  // residual and weight, in flight while the peers' data is (split rows)
  if (split > 1) pre.load(rp, part);
  // No fence.proxy.alias between the multicast push and the unicast poll of our own slot (issue 24 A),
  // although this thread reads through unicast bytes it just wrote through multicast. Without the
  // fence the PTX model leaves the load unordered with the store: it may return the bytes from before
  // the store, and nothing else. Those bytes are the sentinel: call k - 2 re-poisoned this buffer
  // through unicast (our own stores, ordered before this kernel by the kernel boundary), after call
  // k - 3's poll had seen every word of that call land (lamport_rotation.cuh). A stale read is thus
  // "not arrived yet" and the poll (volatile .sys loads: L2, never a stale L1 line) reads again until
  // the store shows, which the hardware guarantees eventually. The value it accepts is the store itself
  // (no other writer of these bytes in this call), so the sum is unchanged; the poll validates itself.
  // The next re-poison of this buffer (call k + 1, unicast) cannot be overtaken by this store either:
  // this call's poll has seen it land in our memory (L2, where both aliases meet) before the kernel
  // ended. NCCL's LL multicast allreduce reads its own slot the same way, with no fence (nccl_device
  // ll_a2a: bcast through the multicast pointer, recv with ld.relaxed.sys of the local buffer). The
  // emulator's chaos mode returns the old bytes for the first loads after such a store (memory.cpp).
#if defined(UBNEXT_BREAK_EXTRA_FENCE)
  fence_acq_rel_sys();  // test-only: a fence nothing needs, which the critical-path count must show
#endif
  if (aborted != 0u) adopt_abort(d, aborted);

  // ---- 2. re-poison the previous call's buffer (our copy only), while the peers' data is in flight, and
  // advance the rotation before the polls (lamport_rotation.cuh lamport_rot_advance_early: its wait then
  // overlaps the peers' data in flight instead of following the block's last poll; one block: at the end)
  lamport_repoison(d, rot);
  const uint64_t bytes_per_slot = UBNEXT_LAMPORT_HEADER_BYTES + static_cast<uint64_t>(nvec) * 16u;
  const bool advanced = lamport_rot_advance_early(d, rot, bytes_per_slot, UBNEXT_OP_LAMPORT);

  // ---- 3. poll, reduce, write
  LamportSrc<T> src{rot.own + buf_off + UBNEXT_LAMPORT_HEADER_BYTES, slot, nranks, d, timeout_ns(d), aborted != 0u};
#if defined(UBNEXT_STAMPS)
  if (is_stamp_thread()) src.slot_stamps = stamp_record(d) + kStampSlot0;
#endif
  if (header_thread && !src.failed && !lamport_headers_match(src, header, rank)) src.failed = true;
  if (!rows) {
    for (int64_t gi = tid; gi < nvec; gi += stride) {
      float x[V];
      if (!src(gi, x)) break;  // timed out (reported): stop consuming (a one-block launch still finishes below)
      store_vec<T>(out, gi, n, pack<T>(x));
    }
  } else {
    row_outputs_begin(flags, scale, scale_inv, nrows, hidden);
    const GlobalSink<T> sink{residual_out, out, scale_inv, static_cast<int64_t>(n)};
    if (split > 1) {
      // every CTA of the row's cluster, with a part or not: the cluster barrier's phases count them all
      (void)norm_row_part<T>(rp, part, pre, src, sink, s_cache, s_red, d, UBNEXT_OP_LAMPORT);
    } else {
      for (int64_t row = blockIdx.x; row < nrows; row += gridDim.x)
        if (!norm_row<T>(rp, row, src, sink, s_cache, UBX_ROW_CACHE_VECS, s_red)) break;  // block-uniform
    }
  }
  if (!advanced) lamport_rot_finish(d, rot, bytes_per_slot, UBNEXT_OP_LAMPORT);  // a one-block launch
  UBX_STAMP(d, kStampExit);
  griddep_launch_dependents();  // after its last wait on a peer (launch_rules.h, pair_grid_cap: a parked dependent then waits only for a grid that waits on nobody)
}

}  // namespace ubx

#define UBX_LAMPORT_ENTRY(NAME, T)                                                                                \
  UBX_KERNEL(NAME) {                                                                                              \
    UBX_STAMPED_KERNEL_BEGIN(&desc); /* kernel_begin, and the entry stamps of the test-only build */              \
    ::ubx::lamport_allreduce<T>(&desc, in, out, residual, residual_out, weight, scale, scale_inv, n, hidden, eps, \
                                flags);                                                                           \
  }

UBX_LAMPORT_ENTRY(ubnext_lamport_bf16, __nv_bfloat16)
UBX_LAMPORT_ENTRY(ubnext_lamport_fp16, __half)
UBX_LAMPORT_ENTRY(ubnext_lamport_fp32, float)
