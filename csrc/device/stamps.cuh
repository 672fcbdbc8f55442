// Per-phase stamps of the Lamport one-shot: the test-only build UBNEXT_STAMPS (the one-GPU check,
// tests/gpu_check/stamps.py, decodes them; the emulator builds it as "stamps"). Without the define nothing
// here is compiled and UBX_STAMP is empty: the normal build's code is the same.
//
// What: %globaltimer (ns) at the moments thread 0 of CTA 0 of a rank
//   entry         enters the kernel (read before griddepcontrol.wait: under PDL a kernel that starts
//                 early shows it; stored after the wait, since the kernel before may write the record too),
//   wait          leaves griddepcontrol.wait,
//   push          has stored its vectors into every rank's slot (the call header is block 0's last thread's),
//   row_exchange  has seen every CTA of its row arrive (the fused row split only, norm.cuh),
//   exit          leaves (after the rotation's finish, before triggering the dependents),
//   slot p        sees its first vector's 16 bytes of rank p's slot arrive, p = 0..N-1, own slot included
//                 (lamport_poll.cuh; a slot already there when checked is stamped at the check).
// Where: this rank's sync region, UBNEXT_SYNC_STAMPS (desc.cuh), UBNEXT_STAMP_COUNT u64 in the order above.
// The stamping thread clears the record after the wait, so a phase the call does not reach reads 0.
//
// Why one thread of CTA 0, not one record per CTA: the sync region's free words hold a few records, not
// UBNEXT_MAX_BLOCKS of them; and thread 0 of CTA 0 goes through every phase in every mode (the call header
// left it on 2026-11-28 for block 0's last thread: its slot stamps no longer include a header wait, so
// stamp runs before and after that date differ there), its first vector is vector 0 of the message (plain mode, one CTA per row, and part
// 0 of row 0 under the row split), and CTA 0 takes part in row 0's exchange. The stamps time one
// representative path through the kernel, not the slowest CTA. One writer, plain 64-bit stores: the host
// reads the record after the kernel has ended.
#pragma once

#include "platform.cuh"
#include "desc.cuh"
#include "entry.cuh"
#include "ptx.cuh"

#if defined(UBNEXT_STAMPS)

namespace ubx {

enum StampPhase : int { kStampEntry = 0, kStampWait, kStampPush, kStampRowExchange, kStampExit, kStampSlot0 };
static_assert(kStampSlot0 + UBNEXT_MAX_RANKS == UBNEXT_STAMP_COUNT, "desc.cuh's count names these phases");
static_assert(2 * UBNEXT_STAMP_COUNT <= UBNEXT_SYNC_STAMPS_END - UBNEXT_SYNC_STAMPS, "the record fits its range");
static_assert(UBNEXT_SYNC_STAMPS % 2 == 0, "u64 stamps: 8-byte aligned");

UBX_DEV bool is_stamp_thread() { return blockIdx.x == 0 && threadIdx.x == 0; }

UBX_DEV uint64_t* stamp_record(const ubnext_comm_desc* d) {
  return reinterpret_cast<uint64_t*>(static_cast<uint64_t>(d->peer_base[d->rank]) + d->sync_off +
                                     4ull * UBNEXT_SYNC_STAMPS);
}

UBX_DEV void stamp(const ubnext_comm_desc* d, int phase) {
  if (is_stamp_thread()) stamp_record(d)[phase] = globaltimer_ns();
}

// kernel_begin (entry.cuh) with the entry and wait stamps, and the record cleared for this call.
UBX_DEV void stamped_kernel_begin(const ubnext_comm_desc* d) {
  const uint64_t entry = globaltimer_ns();
  kernel_begin();
  if (!is_stamp_thread()) return;
  uint64_t* record = stamp_record(d);
  for (int i = 0; i < UBNEXT_STAMP_COUNT; ++i) record[i] = 0ull;
  record[kStampEntry] = entry;
  record[kStampWait] = globaltimer_ns();
}

}  // namespace ubx

#define UBX_STAMP(d, phase) ::ubx::stamp(d, ::ubx::phase)
#define UBX_STAMPED_KERNEL_BEGIN(d) ::ubx::stamped_kernel_begin(d)

#else

#define UBX_STAMP(d, phase) ((void)0)
#define UBX_STAMPED_KERNEL_BEGIN(d) ::ubx::kernel_begin()

#endif
