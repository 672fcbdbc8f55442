// The 3-buffer Lamport rotation (DESIGN.md section 3, step 4), the one implementation: used by the
// Lamport one-shot (csrc/kernels/lamport.cu) and by nvls_lamport (csrc/kernels/nvls.cu). Both kinds of
// call advance the same sync[LAMPORT_CALL] counter and use the same buffers, so any sequence of
// lamport / nvls_lamport calls keeps a consistent rotation.
//
// Usage in a kernel (every thread):
//   LamportRot rot = lamport_rot_begin(d);          // before anything else touches the counters
//   ... push into buffer rot.b (every rank's copy) ...
//   lamport_repoison(d, rot);                       // our copy of buffer rot.bprev
//   early = lamport_rot_advance_early(d, rot, bytes_per_slot, op); // the Lamport one-shot, before its polls
//   ... poll our copy of buffer rot.b ...
//   if (!early) lamport_rot_finish(d, rot, bytes_per_slot, op); // at the end (collective over the block)
//
// Call k (k = sync[LAMPORT_CALL], local) uses buffer b = k % 3 of every rank and re-poisons buffer
// (k + 2) % 3 of THIS rank (local stores of the sentinel), for the byte count that call k - 1 recorded.
// Why that buffer, and why it is safe:
//   - it is the buffer of the PREVIOUS call (k - 1). This rank consumed every slot of it during call
//     k - 1 (it saw every word non-sentinel), so every peer's call k - 1 stores have landed and no peer
//     will store into it again before call k + 2 -- which needs our call k + 1 data, which we push only
//     after this kernel has ended (stream order).
//   - NOT (k + 1) % 3: a faster peer that has finished call k may already be pushing call k + 1 data into
//     it. It was re-poisoned by our call k - 1, before any such push could start (the peer needed our
//     call k data first).
//   - NOT b: this call's own data is arriving there.
// So the re-poisoning never races with this call's pushes or polls (different buffer).
//
// Advance: once every block has counted itself, thread 0 of block 0 records this call's byte count in
// sync[LAMPORT_BYTES + b], resets the done counter and advances sync[LAMPORT_CALL] (before its polls in a
// Lamport one-shot of several blocks, lamport_rot_advance_early; else at the end of block 0, lamport_rot_finish). The counter lives in
// device memory and is only touched by the kernel, so a captured CUDA graph replays correctly.
//
// Shared meaning of sync[LAMPORT_BYTES + b]: bytes from the start of EACH of the nranks slots of buffer b
// that call wrote (lamport: the 16-byte call header and the message; nvls_lamport: its per-rank slice,
// see slices.cuh; its push form: the header, the broadcast slice and the received slice, 16 + 32 cv,
// csrc/kernels/nvls.cu). Re-poisoning writes the sentinel over that many bytes of every slot.
//
// Ordering ("why" for each):
//   - Re-poison -> reuse two calls later: the poison stores target our OWN memory and have been performed
//     when this kernel ends, i.e. they sit in our L2 -- the point where peers' NVLink stores to our memory
//     are serialised -- before our next call pushes anything, and the peers' next stores into that
//     buffer are causally after our next call's pushes (kernel boundaries on both sides order the rest).
//   - Multicast pushes (our own included) cannot land after that re-poison: call k - 1's poll accepted
//     every word of them from our memory (L2, where the multicast and unicast aliases meet), so they
//     had landed before the kernel that re-poisons began. Hence no fence.proxy.alias between a multicast
//     push and the unicast poll and re-poison (lamport.cu gives the whole argument).
//   - Rotation: every thread reads sync[LAMPORT_CALL] and sync[LAMPORT_BYTES + (k+2)%3] at kernel start,
//     before its block's __syncthreads + done increment (release, lamport_rot_begin); block 0's wait for
//     the count (acquire) orders all of them before its advance, so no thread of this launch can see the
//     advance, and the next launch sees all three updates (kernel boundary). Nobody ever observes a
//     half-advanced state.
//   UBNEXT_BREAK_NO_RELEASE (test-only) makes the done count's increment relaxed (no test
//     can observe that on its own; the same build also drops the release of the barrier signal,
//     barrier.cuh, which the two-shot tests do catch).
//   UBNEXT_BREAK_SKIP_REPOISON (test-only) skips the re-poison: call k + 3 then sees stale data as ready.
#pragma once

#include "platform.cuh"
#include "desc.cuh"
#include "ptx.cuh"
#include "vec.cuh"
#include "barrier.cuh"

// The rotation counter wraps at a multiple of 3 so that k % 3 stays continuous (2^32 is not a multiple
// of 3: wrapping there would reuse a buffer that has not been re-poisoned).
#ifndef UBX_LAMPORT_CALL_WRAP
#define UBX_LAMPORT_CALL_WRAP 3221225472u /* 3 * 2^30 */
#endif
static_assert(UBX_LAMPORT_CALL_WRAP % 3u == 0u, "the Lamport call counter must wrap at a multiple of 3");

namespace ubx {

struct LamportRot {
  uint32_t* sync;  // this rank's sync region
  uint8_t* own;  // this rank's pool base
  uint32_t k;  // call index
  uint32_t b;  // buffer of this call
  uint32_t bprev;  // buffer of the previous call: re-poisoned by this call
  uint64_t prev_bytes;  // bytes per slot the previous call left in bprev
};

UBX_DEV uint32_t lamport_next_call(uint32_t k) { return (k + 1u >= UBX_LAMPORT_CALL_WRAP) ? 0u : k + 1u; }

// Byte offset (from the pool base) of buffer `buf`, slot 0.
UBX_DEV uint64_t lamport_buffer_off(const ubnext_comm_desc* d, uint32_t buf) {
  return d->lamport_off + static_cast<uint64_t>(buf) * d->nranks * d->lamport_slot_bytes;
}

// Reads the rotation counters, then counts this block as having read them (collective over the block: a
// __syncthreads, then thread 0's fire-and-forget increment of the done count). Why count here, at the
// start, and not at the end: the count says only "this block has read k and prev_bytes", which is all
// the advance must wait for (the next launch reads the rest after the kernel boundary). Released here,
// it has no stores before it to wait for; released at the end it would wait for the block's pushes to
// peers to land (a release orders every earlier store: one more NVLink hop at the tail of every block),
// and an atomic whose result a block waits for would cost every block a GPU-scope round trip there.
// A launch of one block counts nothing (its __syncthreads already orders its reads before thread 0's
// advance).
UBX_DEV LamportRot lamport_rot_begin(const ubnext_comm_desc* d) {
  LamportRot r;
  r.own = reinterpret_cast<uint8_t*>(static_cast<uint64_t>(d->peer_base[d->rank]));
  r.sync = reinterpret_cast<uint32_t*>(r.own + d->sync_off);
  r.k = ld_volatile_u32(r.sync + UBNEXT_SYNC_LAMPORT_CALL);
  r.b = r.k % 3u;
  r.bprev = (r.k + 2u) % 3u;
  r.prev_bytes = ld_volatile_u32(r.sync + UBNEXT_SYNC_LAMPORT_BYTES + r.bprev);
  if (r.prev_bytes > d->lamport_slot_bytes) r.prev_bytes = d->lamport_slot_bytes;  // never poison past a slot
  if (gridDim.x > 1u) {
    __syncthreads();  // why: every thread of this block has read k / prev_bytes before thread 0 counts it
    if (threadIdx.x == 0) {
#if !defined(UBNEXT_BREAK_NO_RELEASE)
      red_release_gpu_add_u32(r.sync + UBNEXT_SYNC_LAMPORT_BLOCKS_DONE, 1u);
#else
      red_relaxed_gpu_add_u32(r.sync + UBNEXT_SYNC_LAMPORT_BLOCKS_DONE, 1u);  // test-only: no release
#endif
    }
  }
  return r;
}

// Our copy of the previous call's buffer back to the sentinel, every slot (grid-stride). Call it after
// this call's pushes, so that it overlaps the peers' data in flight.
UBX_DEV void lamport_repoison(const ubnext_comm_desc* d, const LamportRot& r) {
#if !defined(UBNEXT_BREAK_SKIP_REPOISON)
  uint8_t* pbuf = r.own + lamport_buffer_off(d, r.bprev);
  const uint64_t slot = d->lamport_slot_bytes;
  const uint32_t nranks = static_cast<uint32_t>(d->nranks);
  const int64_t pv = static_cast<int64_t>(r.prev_bytes / 16u);
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const uint4 poison = sentinel_vec();
  for (uint32_t s = 0; s < nranks; ++s)
    for (int64_t i = tid; i < pv; i += stride) st_volatile_v4(pbuf + s * slot + i * 16, poison);
#else
  (void)d;
  (void)r;
#endif
}

// Block 0 waits until every block of the launch has counted itself (acquire: their reads of the counters,
// released by their increments, come before block 0's advance). Bounded like every wait: past the timeout
// it reports {TIMEOUT, op, rank, rank} (a block of this rank's own launch never started) and the rotation
// stays where it is. It does not leave at an abort: every block counts itself at its start, so the count
// completes once every block has started, whatever the peers do.
UBX_DEV bool lamport_blocks_done(const ubnext_comm_desc* d, const uint32_t* done, uint32_t blocks, uint32_t op) {
  UBX_COUNT_WAIT_BEGIN();
  const uint32_t rank = static_cast<uint32_t>(d->rank);
  SpinWait spin(d, timeout_ns(d));  // barrier.cuh: the clock every UBX_SPIN_CLOCK_EVERY spins
  bool arrived = false;
  for (;;) {
    if ((arrived = ld_acquire_sys_u32(done) >= blocks)) break;
    // An abort or a departure does not end this wait (above); only the limit does, checked on the
    // spins where the helper read the clock (it answers something other than kWaiting there after one).
    if (spin.step(rank) != kWaiting && globaltimer_ns() - spin.t0 > spin.limit) {
      report_timeout(d, op, rank);
      break;
    }
  }
  UBX_COUNT_WAIT_END_AT(done, blocks, arrived);
  return arrived;
}

// Records this call's bytes per slot and advances the call counter, once every block has counted itself
// (lamport_rot_begin), in the one thread that calls it. Its callers (below) say why the thread may.
UBX_DEV void lamport_rot_advance_now(const ubnext_comm_desc* d, const LamportRot& r, uint64_t bytes_per_slot,
                                     uint32_t op) {
  uint32_t* done = r.sync + UBNEXT_SYNC_LAMPORT_BLOCKS_DONE;
  if (gridDim.x > 1u) {
    // After a timeout the count stays above 0 (late blocks still add theirs) and the rotation stays put:
    // the timeout's report aborts the communicator (barrier.cuh report_error), whose later kernels push
    // and consume nothing, so a mis-timed advance there moves buffers nobody reads again.
    if (!lamport_blocks_done(d, done, gridDim.x, op)) return;
    st_relaxed_sys_u32(done, 0u);  // no block of this launch counts again; the next one starts from 0
  }
  st_relaxed_sys_u32(r.sync + UBNEXT_SYNC_LAMPORT_BYTES + r.b, static_cast<uint32_t>(bytes_per_slot));
  st_relaxed_sys_u32(r.sync + UBNEXT_SYNC_LAMPORT_CALL, lamport_next_call(r.k));
}

// The advance at the end of block 0 (nvls_lamport; a one-block Lamport one-shot): after its __syncthreads
// every thread of block 0 has read k / prev_bytes, which a one-block launch needs (it counts nothing).
// Collective over the block.
UBX_DEV void lamport_rot_finish(const ubnext_comm_desc* d, const LamportRot& r, uint64_t bytes_per_slot, uint32_t op) {
  if (blockIdx.x != 0u) return;
  __syncthreads();  // why: every thread of block 0 has read k / prev_bytes
  if (threadIdx.x == 0) lamport_rot_advance_now(d, r, bytes_per_slot, op);
}

// The advance before the polls (the Lamport one-shot), by thread 0 of block 0: its wait for the count then
// overlaps the peers' data in flight (the blocks' counts land long before the peers' pushes), where at the
// end of block 0 it was one more serialised wait on the critical path, after the block's last poll.
// Why it may come that early: every thread of this launch reads the counters only in lamport_rot_begin,
// before its block's count (block 0's too: its __syncthreads there orders all of block 0's reads before
// its count), so once the count is complete nobody of this launch reads them again; the next launch
// reads them after the kernel boundary. Why block 0 cannot wait forever for a block that never starts: the
// other blocks never wait for block 0's thread 0 (they wait for the same block of the peers, whose thread
// 0 pushed before this wait, and in a split row for their cluster, whose thread 0 reaches the cluster
// barrier after this bounded wait), so they run to their end and free their SMs.
// Every thread calls it, after its pushes and before its polls. It returns whether it took the advance on
// (block-uniform): a one-block launch counts nothing, so only a __syncthreads orders its threads' reads
// before the advance, and here that would split the block's loads in flight (the push's from the polls'):
// it keeps the advance at its end (lamport_rot_finish).
UBX_DEV bool lamport_rot_advance_early(const ubnext_comm_desc* d, const LamportRot& r, uint64_t bytes_per_slot,
                                       uint32_t op) {
  if (gridDim.x == 1u) return false;
  if (blockIdx.x == 0u && threadIdx.x == 0u) lamport_rot_advance_now(d, r, bytes_per_slot, op);
  return true;
}

}  // namespace ubx
