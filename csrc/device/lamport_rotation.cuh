// The 3-buffer Lamport rotation (DESIGN.md section 3, step 4), the one implementation: used by the
// Lamport one-shot (csrc/kernels/lamport.cu) and by nvls_lamport (csrc/kernels/nvls.cu). Both kinds of
// call advance the same sync[LAMPORT_CALL] counter and use the same buffers, so any sequence of
// lamport / nvls_lamport calls keeps a consistent rotation.
//
// Usage in a kernel (every thread):
//   LamportRot rot = lamport_rot_begin(d);          // before anything else touches the counters
//   ... push into buffer rot.b (every rank's copy) ...
//   lamport_repoison(d, rot);                       // our copy of buffer rot.bprev
//   ... poll our copy of buffer rot.b ...
//   lamport_rot_finish(rot, bytes_per_slot);        // collective over the block (__syncthreads)
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
// Finish: the last block to finish (done counter) records this call's byte count in
// sync[LAMPORT_BYTES + b], resets the done counter and advances sync[LAMPORT_CALL]. The counter lives in
// device memory and is only touched by the kernel, so a captured CUDA graph replays correctly.
//
// Shared meaning of sync[LAMPORT_BYTES + b]: bytes from the start of EACH of the nranks slots of buffer b
// that call wrote (lamport: the 16-byte call header and the message; nvls_lamport: its per-rank slice,
// see slices.cuh; its push form: the header, the broadcast slice and the received slice, 16 + 32 cv,
// csrc/kernels/nvls.cu). Re-poisoning writes the sentinel over that many bytes of every slot.
//
// Ordering ("why" for each):
//   - Re-poison -> reuse two calls later: the poison stores target our OWN memory and are published at
//     gpu scope by the release of the done counter (cumulative over the block via __syncthreads), i.e.
//     they sit in our L2 -- the point where peers' NVLink stores to our memory are serialised -- before
//     the call ends, and the peers' next stores into that buffer are causally after our next call's
//     pushes (kernel boundaries on both sides order the rest).
//   - Multicast pushes (our own included) cannot land after that re-poison: call k - 1's poll accepted
//     every word of them from our memory (L2, where the multicast and unicast aliases meet), so they
//     had landed before the kernel that re-poisons began. Hence no fence.proxy.alias between a multicast
//     push and the unicast poll and re-poison (lamport.cu gives the whole argument).
//   - Rotation: every thread reads sync[LAMPORT_CALL] and sync[LAMPORT_BYTES + (k+2)%3] at kernel start,
//     before its block's __syncthreads + done increment (release); the last block's increment acquires
//     all of them, so its advance cannot be seen by any thread of this launch, and the next launch sees
//     all three updates (kernel boundary). Nobody ever observes a half-advanced state.
//   UBNEXT_BREAK_NO_RELEASE (test-only) turns the done-counter acq_rel into a relaxed CAS loop (no test
//     can observe that on its own; the same build also drops the release of the barrier signal,
//     barrier.cuh, which the two-shot tests do catch).
//   UBNEXT_BREAK_SKIP_REPOISON (test-only) skips the re-poison: call k + 3 then sees stale data as ready.
#pragma once

#include "platform.cuh"
#include "desc.cuh"
#include "ptx.cuh"
#include "vec.cuh"

// The rotation counter wraps at a multiple of 3 so that k % 3 stays continuous (2^32 is not a multiple
// of 3: wrapping there would reuse a buffer that has not been re-poisoned).
#ifndef UBX_LAMPORT_CALL_WRAP
#define UBX_LAMPORT_CALL_WRAP 3221225472u /* 3 * 2^30 */
#endif
static_assert(UBX_LAMPORT_CALL_WRAP % 3u == 0u, "the Lamport call counter must wrap at a multiple of 3");

namespace ubx {

struct LamportRot {
  uint32_t* sync;       // this rank's sync region
  uint8_t* own;         // this rank's pool base
  uint32_t k;           // call index
  uint32_t b;           // buffer of this call
  uint32_t bprev;       // buffer of the previous call: re-poisoned by this call
  uint64_t prev_bytes;  // bytes per slot the previous call left in bprev
};

UBX_DEV uint32_t lamport_next_call(uint32_t k) { return (k + 1u >= UBX_LAMPORT_CALL_WRAP) ? 0u : k + 1u; }

// Byte offset (from the pool base) of buffer `buf`, slot 0.
UBX_DEV uint64_t lamport_buffer_off(const ubnext_comm_desc* d, uint32_t buf) {
  return d->lamport_off + static_cast<uint64_t>(buf) * d->nranks * d->lamport_slot_bytes;
}

// Read before this block's done increment (see "Rotation" above): the last block may advance these only
// once every thread of the grid has read them.
UBX_DEV LamportRot lamport_rot_begin(const ubnext_comm_desc* d) {
  LamportRot r;
  r.own = reinterpret_cast<uint8_t*>(static_cast<uint64_t>(d->peer_base[d->rank]));
  r.sync = reinterpret_cast<uint32_t*>(r.own + d->sync_off);
  r.k = ld_volatile_u32(r.sync + UBNEXT_SYNC_LAMPORT_CALL);
  r.b = r.k % 3u;
  r.bprev = (r.k + 2u) % 3u;
  r.prev_bytes = ld_volatile_u32(r.sync + UBNEXT_SYNC_LAMPORT_BYTES + r.bprev);
  if (r.prev_bytes > d->lamport_slot_bytes) r.prev_bytes = d->lamport_slot_bytes;  // never poison past a slot
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

// The last block to finish records this call's bytes per slot and advances the call counter.
// Collective over the block; every block must call it exactly once per launch, also after a timeout (a
// half-counted launch would leave the done counter off by some blocks forever).
UBX_DEV void lamport_rot_finish(const LamportRot& r, uint64_t bytes_per_slot) {
  __syncthreads();  // why: every thread of this block has read k / prev_bytes and done all its stores
  if (threadIdx.x == 0) {
    uint32_t* done = r.sync + UBNEXT_SYNC_LAMPORT_BLOCKS_DONE;
#if defined(UBNEXT_BREAK_NO_RELEASE)
    // Test-only broken build: relaxed increment, no release of this block's work, no acquire of others'.
    uint32_t prev = ld_volatile_u32(done);
    for (;;) {
      const uint32_t seen = atom_cas_relaxed_sys_u32(done, prev, prev + 1u);
      if (seen == prev) break;
      prev = seen;
    }
#else
    // why acq_rel: release publishes this block's reads of the counter and its re-poison stores (through
    // __syncthreads cumulativity) before it counts as done; acquire in the last block orders all of that
    // before the advance below.
    const uint32_t prev = atom_add_acq_rel_gpu_u32(done, 1u);
#endif
    if (prev == gridDim.x - 1u) {
      // Every block of this launch has finished reading the sync words: reset and advance. The next
      // launch (stream order) sees all three; CALL is written last anyway.
      st_relaxed_sys_u32(done, 0u);
      st_relaxed_sys_u32(r.sync + UBNEXT_SYNC_LAMPORT_BYTES + r.b, static_cast<uint32_t>(bytes_per_slot));
      st_relaxed_sys_u32(r.sync + UBNEXT_SYNC_LAMPORT_CALL, lamport_next_call(r.k));
    }
  }
}

}  // namespace ubx
