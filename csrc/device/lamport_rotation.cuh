// The 3-buffer Lamport rotation, as reusable pieces: the same protocol, counters and test-only broken
// builds as csrc/kernels/lamport.cu (which documents WHY each step is safe; read it there). Factored out
// so that nvls_lamport (csrc/kernels/nvls.cu) shares the rotation with the Lamport one-shot: both kinds
// of call advance the same sync[LAMPORT_CALL] counter and use the same buffers, so any sequence of
// lamport / nvls_lamport calls keeps a consistent rotation.
//
// Shared meaning of sync[LAMPORT_BYTES + b]: bytes that call wrote into EACH of the nranks slots of
// buffer b (lamport: the message; nvls_lamport: its per-rank slice, see slices.cuh). Re-poisoning
// writes the sentinel over that many bytes of every slot.
//
// Usage in a kernel (every thread):
//   LamportRot rot = lamport_rot_begin(d);          // before anything else touches the counters
//   ... push into buffer rot.b ...
//   lamport_repoison(d, rot);                       // our copy of buffer rot.bprev
//   ... poll buffer rot.b ...
//   lamport_rot_finish(d, rot, bytes_per_slot);     // collective over the block (__syncthreads)
#pragma once

#include "platform.cuh"
#include "desc.cuh"
#include "ptx.cuh"
#include "vec.cuh"

// Wraps at a multiple of 3 so that k % 3 stays continuous (same value as lamport.cu).
#ifndef UBX_LAMPORT_CALL_WRAP
#define UBX_LAMPORT_CALL_WRAP 3221225472u /* 3 * 2^30 */
#endif

namespace ubx {

struct LamportRot {
  uint32_t* sync;       // this rank's sync region
  uint8_t* own;         // this rank's pool base
  uint32_t k;           // call index
  uint32_t b;           // buffer of this call
  uint32_t bprev;       // buffer of the previous call: re-poisoned by this call
  uint64_t prev_bytes;  // bytes per slot the previous call left in bprev
};

UBX_DEV uint64_t lamport_buffer_off(const ubnext_comm_desc* d, uint32_t buf) {
  return d->lamport_off + static_cast<uint64_t>(buf) * d->nranks * d->lamport_slot_bytes;
}

// Read before this block's done increment: the last block may advance these only once every thread of
// the grid has read them.
UBX_DEV LamportRot lamport_rot_begin(const ubnext_comm_desc* d) {
  LamportRot r;
  r.own = reinterpret_cast<uint8_t*>(static_cast<uint64_t>(d->peer_base[d->rank]));
  r.sync = reinterpret_cast<uint32_t*>(r.own + d->sync_off);
  r.k = ld_volatile_u32(r.sync + UBNEXT_SYNC_LAMPORT_CALL);
  r.b = r.k % 3u;
  r.bprev = (r.k + 2u) % 3u;
  r.prev_bytes = ld_volatile_u32(r.sync + UBNEXT_SYNC_LAMPORT_BYTES + r.bprev);
  if (r.prev_bytes > d->lamport_slot_bytes) r.prev_bytes = d->lamport_slot_bytes;  // never past a slot
  return r;
}

// Our copy of the previous call's buffer back to the sentinel, every slot (grid-stride).
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
// Collective over the block.
UBX_DEV void lamport_rot_finish(const LamportRot& r, uint64_t bytes_per_slot) {
  __syncthreads();  // every thread of this block has read k / prev_bytes and done all its stores
  if (threadIdx.x == 0) {
    uint32_t* done = r.sync + UBNEXT_SYNC_LAMPORT_BLOCKS_DONE;
#if defined(UBNEXT_BREAK_NO_RELEASE)
    uint32_t prev = ld_volatile_u32(done);
    for (;;) {
      const uint32_t seen = atom_cas_relaxed_sys_u32(done, prev, prev + 1u);
      if (seen == prev) break;
      prev = seen;
    }
#else
    // release: this block's counter reads and re-poison stores; acquire (last block): all blocks' of them.
    const uint32_t prev = atom_add_acq_rel_gpu_u32(done, 1u);
#endif
    if (prev == gridDim.x - 1u) {
      st_relaxed_sys_u32(done, 0u);
      st_relaxed_sys_u32(r.sync + UBNEXT_SYNC_LAMPORT_BYTES + r.b, static_cast<uint32_t>(bytes_per_slot));
      st_relaxed_sys_u32(r.sync + UBNEXT_SYNC_LAMPORT_CALL, (r.k + 1u >= UBX_LAMPORT_CALL_WRAP) ? 0u : r.k + 1u);
    }
  }
}

}  // namespace ubx
