// Cross-rank, per-block barrier with monotonic epochs, and the bounded-wait / error-report helpers
// that every kernel waiting on a peer uses.
//
// Protocol (block b of every rank takes part; all ranks launch the same grid):
//   1. __syncthreads(): every thread's earlier stores of this block are ordered before the signal.
//   2. the block's epoch goes up by one: a register copy, loaded from the LOCAL word
//      sync[BARRIER_EPOCH + b] by barrier_open at kernel entry and written back at each barrier (never
//      reset, so a captured CUDA graph replays correctly and no reset race exists between calls).
//   3. signal: slot barrier_flag[b][my_rank] := epoch on EVERY rank, with release semantics at .sys
//      scope: one multimem.st.release through the multicast address when the pool has one, else one
//      st.release.sys per peer (lane p of warp 0 writes peer p, in parallel).
//   4. wait: lane p of warp 0 spins with ld.acquire.sys on its own copy of slot [b][p] until it holds
//      an epoch >= ours (wrap-safe signed compare), bounded by desc->timeout_ns.
//   5. __syncthreads(): the acquire of warp 0 is ordered before every thread's later accesses.
// A given slot is always written by the same thread of the same rank (lane 0 through multicast, or lane p
// to peer p), so successive epochs reach it in program order.
//
// Why one slot per (block, peer) instead of one counter per block bumped by multimem.red.add
// (the DESIGN.md suggestion): the counter only says HOW MANY ranks arrived, not WHICH one is missing.
// With per-peer slots the timeout names the peer that is behind, which is what the user needs to
// debug a hang (dead rank, mismatched call sequence). Cost: 16 x 4 bytes per block instead of 4,
// and nranks acquire loads (issued in parallel by one warp) instead of one.
//
// Epochs stay aligned across ranks because every rank runs the same sequence of collectives with
// the same grid, and each block of each kernel passes through the same number of barriers. A peer
// can be at most one barrier ahead of us (it cannot pass a barrier we have not arrived at), so the
// signed 32-bit difference is exact across wrap-around (2^32 barriers).
//
// Every kernel of a communicator signals the same way (multicast iff the pool has it), also the unicast
// two-shot: a slot must never receive epoch e through the multicast path and e+1 through a unicast store,
// since a regression of the slot to e (the two paths reordering) would hang the next barrier.
//
// UBNEXT_BREAK_NO_RELEASE (test-only) signals with relaxed stores (step 3 without release);
// UBNEXT_BREAK_SKIP_BARRIER (test-only) signals but never waits (no step 4).
// UBNEXT_BREAK_NO_HEADER_CHECK (test-only) publishes call headers but never compares them;
// UBNEXT_BREAK_SINGLE_HEADER_SLOT (test-only) uses one header slot set instead of two.
// UBNEXT_BREAK_NO_EPS_CHECK (test-only) publishes a fused call's eps but never compares it (here and in
// lamport_poll.cuh): ranks with different eps then each return their own norm.
//
// Call headers: a kernel that reads its peers' `in` at its own offset opens the barrier with its
// call header (call_header); the first sync writes it next to the signal, and after the wait each
// lane p compares peer p's header with ours. A difference is reported as UBNEXT_ERR_MISMATCH
// naming the field and both values, and the barrier fails on every rank.
//
// A fused call's eps (issue 40 W3): the rows' norm uses it, and ranks that pass different ones (the call
// is otherwise the same) would each return their own answer. It has no room in the header's four words:
// kind, count, hidden and the `in` offset each need their 32 bits (a fused call's `in` may lie anywhere
// in the arena for a C caller), and folding it into one of them by XOR would still catch a difference but
// could not name both values (the word's other half may differ too). So block 0 alone publishes it, one
// more word beside its header, in UBNEXT_SYNC_CALL_EPS[parity][rank] of every peer (desc.cuh: 32 words,
// where the region had room; one per block would take 16 KiB more), under the same release as its signal,
// and lane p of block 0 compares peer p's after the header. Block 0 suffices, as the Lamport one-shot's
// one header thread does: every rank compares every peer, so each rank's block 0 sees a difference and
// reports it, which aborts the communicator; the other blocks, whose headers matched, move only what a
// matching call moves (eps changes no address), and stop at their next wait or return, and every rank
// raises the mismatch. Cost (fused calls only): one 4-byte store per peer (or one multicast store) and one
// local load per peer in block 0, beside the header's: no hop, no byte counted as data.
//
// Sticky abort. A timeout or a header mismatch aborts the communicator on every rank: the rank that
// detects it writes its failure into record [rank] of every rank's sync region and then sets each rank's
// abort flag (release). Every wait (barrier, Lamport poll) reads the local flag on a time base
// (UBX_ABORT_POLL_NS, judged at the wait's clock reads, every UBX_SPIN_CLOCK_EVERY-th spin (SpinWait): a
// wait that ends sooner never reads it; the flag is device memory, never the host word), and every barrier
// kernel reads it once at entry, so that:
//   - the peers of a failed rank stop waiting at once instead of each timing out on its own;
//   - a late rank, arriving after its peers gave up, returns at once instead of matching a barrier its
//     peers have left and touching memory they have reused (without the flag it would pass the first
//     barrier on the signals its peers sent before timing out);
//   - every later kernel of the communicator returns at once, on every rank, and reports the cause.
// What the flag cannot close: a late rank that reads it at entry just before its peers' abort lands
// (their timeout fired a microsecond before its signal reached them) passes the first barrier on the
// signals they sent before giving up, as with NCCL's abort flag; it stops at its next barrier or poll,
// where the flag is read again, or times out there itself.
// A rank that stops because of the flag reports the recorded failure (error word `aborted` = 1). The
// epochs no longer agree after an abort: the communicator is unusable for good and a new one must be
// created (its sync region is zeroed at init). Lamport kernels check the flag at entry and in their polls.
// UBNEXT_BREAK_NO_ABORT_CHECK (test-only) never reads the flag (failures are still recorded).
//
// A peer that has left never arrives. A rank that closes its communicator, or whose process exits,
// first finishes its own work, then sets word [rank] of UBNEXT_SYNC_DEPARTED in every rank's region
// (from the host). A wait for peer p that has lasted UBX_DEPARTED_GRACE_NS reads our word [p] with its
// abort poll; set, it reads what it waits for once more (the departure's acquire orders every store
// the peer made before leaving: a call the peer completed still completes here) and only then reports
// UBNEXT_ERR_PEER_LEFT, which aborts the communicator like a timeout, within the grace instead of the
// whole timeout. The grace keeps the extra load off every wait that ends in normal time.
// UBNEXT_BREAK_NO_DEPARTURE_CHECK (test-only) never reads the word: waiters time out instead.
#pragma once

#include "platform.cuh"
#include "desc.cuh"
#include "ptx.cuh"
#include "vec.cuh"

#ifndef UBX_ABORT_POLL_NS
#define UBX_ABORT_POLL_NS 50000ull /* a waiting thread reads the local abort flag once per 50 us */
#endif
#ifndef UBX_DEPARTED_GRACE_NS
#define UBX_DEPARTED_GRACE_NS 100000000ull /* 100 ms: a wait this long also polls the peer's departure */
#endif

#ifndef UBNEXT_DEFAULT_TIMEOUT_NS
#define UBNEXT_DEFAULT_TIMEOUT_NS 10000000000ull /* used when desc->timeout_ns == 0 */
#endif

namespace ubx {

// UBNEXT_TEST_DESC_NOINLINE (test-only, a compile check: tests/unit/test_kernels_compile.py) makes sync_words a
// function that is not inlined, as any helper may become: it indexes the descriptor (peer_base[rank]) through
// its pointer. The kernels' descriptor is __grid_constant__ (entry.cuh), so that pointer is the parameter's own
// address and no copy is made; without it (UBNEXT_BREAK_DESC_COPY) every thread copies the 256 bytes to its
// stack frame, which the frame check (python -m ubnext.kernels build --fail-on-spill) must refuse.
#if !defined(UBNEXT_TEST_DESC_NOINLINE)
#define UBX_DESC_HELPER UBX_DEV
#else
#define UBX_DESC_HELPER __device__ __noinline__
#endif

// This rank's (or a peer's) sync region, as 32-bit words.
UBX_DESC_HELPER uint32_t* sync_words(const ubnext_comm_desc* d, uint32_t rank) {
  return reinterpret_cast<uint32_t*>(static_cast<uint64_t>(d->peer_base[rank] + d->sync_off));
}

// The multicast address of a pointer that lies in this rank's pool (0 if the pool has no multicast).
UBX_DEV uint64_t mc_addr(const ubnext_comm_desc* d, const void* p) {
  if (d->mc_base == 0) return 0;
  return static_cast<uint64_t>(d->mc_base) +
         (reinterpret_cast<uint64_t>(p) - static_cast<uint64_t>(d->peer_base[d->rank]));
}

// The same byte of a pool pointer in peer `peer`'s pool (pool layouts are identical on every rank).
UBX_DEV uint64_t peer_addr(const ubnext_comm_desc* d, const void* p, uint32_t peer) {
  return static_cast<uint64_t>(d->peer_base[peer]) +
         (reinterpret_cast<uint64_t>(p) - static_cast<uint64_t>(d->peer_base[d->rank]));
}

UBX_DEV uint64_t timeout_ns(const ubnext_comm_desc* d) {
  const uint64_t t = d->timeout_ns;
  return t ? t : UBNEXT_DEFAULT_TIMEOUT_NS;
}

// Fill the host-visible error word (desc.cuh: UBNEXT_ERR_WORDS) unless it already holds a record (the first
// failure wins). The claim is made in device memory, the record then copied to the host word:
//   1. take this rank's lock word UBNEXT_SYNC_ERR_LOCK (its sync region, device memory) by a CAS 0 -> 1.
//      A CAS on the host-mapped word itself, as before, is atomic only where the device has native host
//      atomics (the CUDA Programming Guide promises no more); on device memory it is atomic for every thread
//      of this GPU, the only writers of this rank's word. (.sys scope, the one CAS ptx.cuh has: a cold path.)
//      A thread that finds the lock taken returns at once: the holder is reporting, so a record will be
//      there (its own or an earlier one), as a thread that lost the old CAS returned.
//   2. after the CAS, a .sys fence (with it, an acquire: an earlier holder's copy, released in 4, is
//      visible), then the host word's code: nonzero means a record that the host has not taken: leave it.
//   3. copy: words 1..7 by plain (relaxed .sys) stores, a .sys fence, then the code by a plain store. The
//      fence orders the details before the code for every observer, so a reader that sees a nonzero code
//      sees the whole record: ubnext_take_kernel_error (csrc/host) loads the code with acquire before it
//      reads the rest; Python (ubnext/comm/_executor.py) reads the details after a synchronisation. The
//      code goes from 0 straight to its final value: the word never shows a half-written record.
//   4. release the lock (st.release.sys: orders the copy before a later holder's step 2).
// Reset: the lock is 0 between launches, since a thread holds it only across steps 2-3 and kernels do not
// trap there (the sync region, lock included, is zeroed when a communicator is created). The record stays
// until the host takes it: ubnext_take_kernel_error zeroes the host word (after a synchronisation); Python
// never does (the communicator is broken for good). A later kernel of the aborted communicator finds the
// word zero again and reports the failure anew, as the C API promises.
// UBNEXT_BREAK_ERR_NO_CLAIM (test-only) copies without the lock: racing reports then mix their records, which
// tests/unit/test_emu_waits.py (test_racing_reports_*) must see.
UBX_DEV void write_error_word(const ubnext_comm_desc* d, const uint32_t (&w)[UBNEXT_ERR_WORDS]) {
  uint32_t* err = reinterpret_cast<uint32_t*>(static_cast<uint64_t>(d->err_ptr));
  if (err == nullptr) return;
  uint32_t* lock = sync_words(d, static_cast<uint32_t>(d->rank)) + UBNEXT_SYNC_ERR_LOCK;
#if !defined(UBNEXT_BREAK_ERR_NO_CLAIM)
  if (atom_cas_relaxed_sys_u32(lock, 0u, 1u) != 0u) return;
  fence_acq_rel_sys();
#endif
  if (ld_relaxed_sys_u32(err) == 0u) {
    for (int i = 1; i < UBNEXT_ERR_WORDS; ++i) st_relaxed_sys_u32(err + i, w[i]);
    fence_acq_rel_sys();
    st_relaxed_sys_u32(err, w[0]);
  }
  st_release_sys_u32(lock, 0u);
}

// This rank's abort flag: 0, or 1 + the rank whose failure aborted the communicator. A relaxed load,
// so that it never holds up the loads issued after it (the Lamport push reads `in` meanwhile);
// adopt_abort's fence makes it an acquire when it is non-zero.
UBX_DEV uint32_t abort_flag(const ubnext_comm_desc* d) {
#if !defined(UBNEXT_BREAK_NO_ABORT_CHECK)
  return ld_volatile_u32(sync_words(d, static_cast<uint32_t>(d->rank)) + UBNEXT_SYNC_ABORT);
#else
  (void)d;
  return 0u;  // test-only broken build: nobody learns of an abort
#endif
}

// A failure this thread detected: into the error word, and (first failure of this rank only) into every
// rank's sync region, which aborts the communicator everywhere (see "Sticky abort" above). Plain stores
// to the peers, no peer atomics; our own region first.
UBX_DEV void report_error(const ubnext_comm_desc* d, uint32_t code, uint32_t op, uint32_t peer, uint32_t field = 0,
                          uint32_t mine = 0, uint32_t theirs = 0) {
  const uint32_t me = static_cast<uint32_t>(d->rank), nranks = static_cast<uint32_t>(d->nranks);
  const uint32_t w[UBNEXT_ERR_WORDS] = {code, op, me, peer, field, mine, theirs, 0u};
  write_error_word(d, w);
  if (atom_cas_relaxed_sys_u32(sync_words(d, me) + UBNEXT_SYNC_ABORT_CLAIM, 0u, 1u) != 0u) return;
  const uint32_t rec[6] = {code, op, peer, field, mine, theirs};
  for (uint32_t i = 0; i < nranks; ++i) {
    uint32_t* region = sync_words(d, (me + i) % nranks);
    for (int k = 0; k < 6; ++k) st_relaxed_sys_u32(region + UBNEXT_SYNC_ABORT_RECORD + me * 8u + k, rec[k]);
    st_release_sys_u32(region + UBNEXT_SYNC_ABORT, me + 1u);  // publishes the record
  }
}

UBX_DEV void report_timeout(const ubnext_comm_desc* d, uint32_t op, uint32_t peer) {
  report_error(d, UBNEXT_ERR_TIMEOUT, op, peer);
}

// The communicator was found aborted (flag = 1 + r): report rank r's recorded failure.
UBX_DEV void adopt_abort(const ubnext_comm_desc* d, uint32_t flag) {
  fence_acq_rel_sys();  // with the relaxed read of the flag, an acquire: rank r's record is visible
  const uint32_t r = (flag - 1u) % UBNEXT_MAX_RANKS;
  const uint32_t* rec = sync_words(d, static_cast<uint32_t>(d->rank)) + UBNEXT_SYNC_ABORT_RECORD + r * 8u;
  uint32_t v[6];
  for (int k = 0; k < 6; ++k) v[k] = ld_volatile_u32(rec + k);
  const uint32_t w[UBNEXT_ERR_WORDS] = {v[0], v[1], r, v[2], v[3], v[4], v[5], 1u};
  write_error_word(d, w);
}

enum WaitResult { kArrived = 0, kTimedOut = 1, kAborted = 2, kPeerLeft = 3, kWaiting = 4 };

// Whether peer `peer` has left for good (see "A peer that has left" above). An acquire: a set word
// orders every store the peer made before leaving.
UBX_DEV bool peer_departed(const ubnext_comm_desc* d, uint32_t peer) {
#if !defined(UBNEXT_BREAK_NO_DEPARTURE_CHECK)
  return ld_acquire_sys_u32(sync_words(d, static_cast<uint32_t>(d->rank)) + UBNEXT_SYNC_DEPARTED + peer) != 0u;
#else
  (void)d;
  (void)peer;
  return false;  // test-only broken build: a departed peer is waited for until the timeout
#endif
}

// The verdict on a wait for `peer` begun at t0 (SpinWait calls it at its clock reads): kAborted when
// the communicator has been aborted (then reported), kPeerLeft when the peer has left (the caller reads
// its word once more before reporting), kTimedOut past `limit`, else kWaiting. The abort flag and the
// departure word are read once per UBX_ABORT_POLL_NS, the departure only after UBX_DEPARTED_GRACE_NS.
UBX_DEV WaitResult wait_verdict(const ubnext_comm_desc* d, uint32_t peer, uint64_t t0, uint64_t limit,
                                uint64_t& next_check) {
  const uint64_t now = globaltimer_ns();
  if (now >= next_check) {
    next_check = now + UBX_ABORT_POLL_NS;
    const uint32_t f = abort_flag(d);
    if (f != 0u) {
      adopt_abort(d, f);
      return kAborted;
    }
    if (now - t0 > UBX_DEPARTED_GRACE_NS && peer_departed(d, peer)) return kPeerLeft;
  }
  return now - t0 > limit ? kTimedOut : kWaiting;
}

// The one spin of every cross-rank wait (wait_flag_polls, poll_ready_v4, LamportSrc::wait, lamport_poll.cuh
// poll_slots). The caller loads what it waits for; each time it is not there, the caller calls step(peer),
// which pauses (spin_pause: the emulator's scheduling point, a short sleep on the GPU) and, on the first call
// and then on every UBX_SPIN_CLOCK_EVERY-th, reads %globaltimer: the first read starts the wait (t0), each
// later one gives wait_verdict (the abort flag and the departure on their own time base, then the timeout).
// A wait of K steps reads the clock ceil(K / UBX_SPIN_CLOCK_EVERY) times (tests/unit/test_emu_waits.py pins it),
// where every step read it before; NCCL's waits likewise check their abort flag every N spins.
// Why 16. A %globaltimer read is a special-register read (S2R, tens of cycles) plus a 64-bit compare and a
// branch, which sit after the poll's load in the loop (the asm is volatile: never hoisted), so each one
// delays the next load; a step is the 20 ns pause plus the poll's L2 round trip (143 ns on H100, docs/PERF.md's
// dependent-chain probe). Read every 16th step, the clock costs a few cycles per step, about 1 % of it. The
// price is the resolution: a verdict is up to 16 steps late, about 16 x (20 + 143) ns = 2.6 us on the GPU
// (more where a step polls several slots), far under UBX_ABORT_POLL_NS (so the abort flag still ends a wait
// within about 53 us, as before within 50) and negligible against any timeout (UBNEXT_TIMEOUT is in
// seconds). In the emulator a step of a block whose fibers all spin may back off 20-200 us (3.2 ms in count
// mode, csrc/emu/README.md): 16 steps is at most 3.2 ms (51 ms), still far under the 1-5 s timeouts the
// tests use, and every step still yields there (spin_pause), so no worker busy-loops between clock reads.
#ifndef UBX_SPIN_CLOCK_EVERY
#define UBX_SPIN_CLOCK_EVERY 16u
#endif
static_assert((UBX_SPIN_CLOCK_EVERY & (UBX_SPIN_CLOCK_EVERY - 1u)) == 0u, "a power of two: steps may wrap");
struct SpinWait {
  const ubnext_comm_desc* d;
  uint64_t limit;
  uint64_t t0 = 0;
  uint64_t next_check = 0;
  uint32_t steps = 0;  // may wrap (a wait past 2^32 steps): the clock stays on every 16th, t0 stays put
  bool started = false;

  UBX_DEV SpinWait(const ubnext_comm_desc* desc, uint64_t limit_ns) : d(desc), limit(limit_ns) {}

  // After a poll that found nothing: kWaiting (then paused), or why the wait ends (wait_verdict).
  UBX_DEV WaitResult step(uint32_t peer) {
    WaitResult r = kWaiting;
    if ((steps++ & (UBX_SPIN_CLOCK_EVERY - 1u)) == 0u) {
      if (started) {
        r = wait_verdict(d, peer, t0, limit, next_check);
      } else {
        started = true;
        t0 = globaltimer_ns();
        next_check = t0 + UBX_ABORT_POLL_NS;
      }
    }
    if (r == kWaiting) spin_pause();
    return r;
  }
};

// A wait for `peer` ended without its word: report why (a timeout or a departure; an abort was
// reported when it was seen).
UBX_DEV void report_wait_failure(const ubnext_comm_desc* d, WaitResult r, uint32_t op, uint32_t peer) {
  if (r == kTimedOut) report_timeout(d, op, peer);
  if (r == kPeerLeft) report_error(d, UBNEXT_ERR_PEER_LEFT, op, peer);
}

// What this rank was asked to do, as the 4 words peers compare (desc.cuh: UBNEXT_HDR_*). Only
// kernels that read their peers' `in` at their own offset publish one: two ranks whose pool
// histories differ would otherwise reduce unrelated memory without noticing.
UBX_DEV uint4 call_header(uint32_t op, uint32_t dtype, int n, int hidden, int flags, const ubnext_comm_desc* d,
                          const void* in) {
  const uint64_t off = reinterpret_cast<uint64_t>(in) - static_cast<uint64_t>(d->peer_base[d->rank]);
  return make_uint4(op | (dtype << 8) | ((static_cast<uint32_t>(flags) & 0xffffu) << 16), static_cast<uint32_t>(n),
                    static_cast<uint32_t>(hidden), static_cast<uint32_t>(off >> 4));
}

// The eps word of a call header (desc.cuh UBNEXT_HDR_EPS): a fused call's RMSNorm eps as its fp32 bits,
// else 0 (a plain call's eps is unused, and callers pass whatever they like). -0 goes as +0: both give the
// same norm (ssq / hidden + eps is never -0), the hosts accept both, and 0x80000000 is the Lamport
// sentinel, which no header word may be.
UBX_DEV uint32_t header_eps(float eps, int flags) {
  if ((flags & UBNEXT_F_FUSED_NORM) == 0) return 0u;
  const uint32_t bits = f32_as_u32(eps);
  return bits == 0x80000000u ? 0u : bits;
}

// The header slot set (0 or 1) of the barrier that reaches `epoch` (desc.cuh: why two).
UBX_DEV uint32_t header_parity(uint32_t epoch) {
#if !defined(UBNEXT_BREAK_SINGLE_HEADER_SLOT)
  return epoch & 1u;
#else
  (void)epoch;
  return 0u;  // test-only broken build: one slot set, overwritten by a rank a call ahead
#endif
}

// Wrap-safe "a has reached b".
UBX_DEV bool epoch_reached(uint32_t a, uint32_t b) { return static_cast<int32_t>(a - b) >= 0; }

// Spin (acquire, .sys) until peer `peer`'s *flag has reached `target`, at most `limit` ns, watching the
// abort flag and the peer's departure.
UBX_DEV WaitResult wait_flag_polls(const ubnext_comm_desc* d, const uint32_t* flag, uint32_t target, uint64_t limit,
                                   uint32_t peer) {
  SpinWait spin(d, limit);
  for (;;) {
    if (epoch_reached(ld_acquire_sys_u32(flag), target)) return kArrived;
    const WaitResult r = spin.step(peer);
    if (r == kPeerLeft && epoch_reached(ld_acquire_sys_u32(flag), target)) return kArrived;
    if (r != kWaiting) return r;
  }
}
UBX_DEV WaitResult wait_flag_reached(const ubnext_comm_desc* d, const uint32_t* flag, uint32_t target, uint64_t limit,
                                     uint32_t peer) {
  UBX_COUNT_WAIT_BEGIN();
  const WaitResult r = wait_flag_polls(d, flag, target, limit, peer);
  UBX_COUNT_WAIT_END_AT(flag, target, r == kArrived);
  return r;
}

// Lamport-style poll of one 16-byte vector until no 32-bit word is the sentinel 0x80000000 (vec.cuh's
// is_ready rule, restated here so that this header does not need vec.cuh). On timeout report
// {TIMEOUT, op, rank, peer} (or PEER_LEFT); stop when the communicator is aborted (by that report from
// any thread, here or on a peer), so that a dead peer costs one timeout rather than one per thread.
UBX_DEV bool v4_ready(const uint4& v) {
  return (v.x != 0x80000000u) & (v.y != 0x80000000u) & (v.z != 0x80000000u) & (v.w != 0x80000000u);
}

UBX_DEV bool poll_ready_v4_polls(const void* addr, uint4& v, const ubnext_comm_desc* d, uint32_t op, uint32_t peer) {
  SpinWait spin(d, timeout_ns(d));
  for (;;) {
    v = ld_volatile_v4(addr);
    if (v4_ready(v)) return true;
    const WaitResult r = spin.step(peer);
    if (r == kPeerLeft && v4_ready(v = ld_volatile_v4(addr))) return true;
    if (r != kWaiting) {
      report_wait_failure(d, r, op, peer);
      return false;
    }
  }
}
UBX_DEV bool poll_ready_v4(const void* addr, uint4& v, const ubnext_comm_desc* d, uint32_t op, uint32_t peer) {
  UBX_COUNT_WAIT_BEGIN();
  const bool ready = poll_ready_v4_polls(addr, v, d, op, peer);
  UBX_COUNT_WAIT_END(addr, 16, ready);
  return ready;
}

// The barrier, as a per-block object: open it once at kernel entry (the descriptor loads and the
// epoch load are then issued early, overlapping each other and the kernel's other setup, instead of
// sitting on the critical path of the first barrier), then call sync() at each barrier point.
// Warp 0 does all the work; every lane keeps only its own peer's addresses.
struct RankBarrier {
  const ubnext_comm_desc* d;
  uint32_t* epoch_word;   // lane 0: sync[BARRIER_EPOCH + b] of this rank (local, this block only)
  uint32_t* signal;       // lane 0 (multicast) or lane p (peer p's copy of slot [b][rank]); else null
  const uint32_t* wait;   // lane p != rank, p < nranks: our copy of slot [b][p]; else null
  uint64_t limit_ns;
  uint32_t abort_at_open;  // lane 0: the abort flag, read at kernel entry (checked by the first sync)
  uint32_t epoch;         // the last epoch this block reached (register copy, written back each sync)
  uint32_t op;
  // call header, published with the first signal and compared after the first wait
  bool header_pending;
  bool eps_pending;       // block 0 of a fused call: the eps word goes beside the header (see above)
  uint32_t eps;           // header_eps of this call
  uint4 header;
  void* header_out;       // the signalling lane's target for our header (multicast or peer p's copy)
  const void* header_in;  // lane p: our copy of peer p's header for this block
};

UBX_DEV RankBarrier barrier_open(const ubnext_comm_desc* d, uint32_t op, const uint4* header = nullptr) {
  RankBarrier br;
  br.d = d;
  br.op = op;
  br.header_pending = header != nullptr;
  br.eps_pending = false;
  br.eps = 0u;
  br.header = header ? *header : make_uint4(0u, 0u, 0u, 0u);
  br.header_out = nullptr;
  br.header_in = nullptr;
  br.epoch_word = nullptr;
  br.signal = nullptr;
  br.wait = nullptr;
  br.limit_ns = 0;
  br.abort_at_open = 0;
  br.epoch = 0;
  if (threadIdx.x < 32) {
    const uint32_t lane = threadIdx.x;
    const uint32_t rank = static_cast<uint32_t>(d->rank);
    const uint32_t nranks = static_cast<uint32_t>(d->nranks);
    const uint64_t mc = d->mc_base;
    const uint32_t b = blockIdx.x;
    uint32_t* my_sync = sync_words(d, rank);
    const uint32_t slot = UBNEXT_SYNC_BARRIER_FLAG + b * UBNEXT_MAX_RANKS + rank;
    br.epoch_word = my_sync + UBNEXT_SYNC_BARRIER_EPOCH + b;
    if (lane == 0) {
      br.epoch = *br.epoch_word;
      br.abort_at_open = abort_flag(d);
    }
    br.epoch = __shfl_sync(0xffffffffu, br.epoch, 0);
    if (mc != 0) {
      if (lane == 0) br.signal = reinterpret_cast<uint32_t*>(static_cast<uint64_t>(mc + d->sync_off)) + slot;
    } else if (lane < nranks && lane != rank) {
      br.signal = sync_words(d, lane) + slot;
    }
    if (lane < nranks && lane != rank) br.wait = my_sync + UBNEXT_SYNC_BARRIER_FLAG + b * UBNEXT_MAX_RANKS + lane;
    br.limit_ns = timeout_ns(d);
    if (br.header_pending) {
      // the slot set of the epoch the first sync will reach (desc.cuh: why two)
      const uint32_t set = header_parity(br.epoch + 1u) * UBNEXT_MAX_BLOCKS;
      const uint32_t hslot = UBNEXT_SYNC_CALL_HEADER + ((set + b) * UBNEXT_MAX_RANKS + rank) * 4;
      if (mc != 0) {
        if (lane == 0) br.header_out = reinterpret_cast<uint32_t*>(static_cast<uint64_t>(mc + d->sync_off)) + hslot;
      } else if (lane < nranks && lane != rank) {
        br.header_out = sync_words(d, lane) + hslot;
      }
      if (lane < nranks && lane != rank)
        br.header_in = my_sync + UBNEXT_SYNC_CALL_HEADER + ((set + b) * UBNEXT_MAX_RANKS + lane) * 4;
    }
  }
  return br;
}

// The barrier of a kernel that reads its peers' `in` at its own offset: its first sync compares call
// headers (see call_header), and in block 0 of a fused call the eps word (see "A fused call's eps"; the
// exchanges, never fused, leave eps out).
UBX_DEV RankBarrier barrier_open_checked(const ubnext_comm_desc* d, uint32_t op, uint32_t dtype, int n, int hidden,
                                         int flags, const void* in, float eps = 0.f) {
  const uint4 header = call_header(op, dtype, n, hidden, flags, d, in);
  RankBarrier br = barrier_open(d, op, &header);
  br.eps_pending = blockIdx.x == 0 && (flags & UBNEXT_F_FUSED_NORM) != 0;
  br.eps = header_eps(eps, flags);
  return br;
}

// Word [parity][rank] of UBNEXT_SYNC_CALL_EPS, from a sync region's base.
UBX_DEV uint32_t call_eps_word(uint32_t parity, uint32_t rank) {
  return UBNEXT_SYNC_CALL_EPS + parity * UBNEXT_MAX_RANKS + rank;
}

// Steps 2-4 of the protocol for lane `lane` of warp 0 (and the call-header check); 1 if it failed.
UBX_DEV uint32_t barrier_signal_and_wait(RankBarrier& br, uint32_t lane) {
  const uint32_t epoch = ++br.epoch;
  if (lane == 0) *br.epoch_word = epoch;  // persist for the next kernel; nobody waits on it
  if (br.header_out != nullptr) {  // before the signal, whose release publishes it
    if (br.d->mc_base != 0) multimem_st_v4(br.header_out, br.header);
    else st_relaxed_sys_v4(br.header_out, br.header);
    if (br.eps_pending) {  // the same lanes, to the same ranks: our word [parity][rank]
      const uint32_t w = call_eps_word(header_parity(epoch), static_cast<uint32_t>(br.d->rank));
      if (br.d->mc_base != 0)
        multimem_st_relaxed_u32(reinterpret_cast<uint32_t*>(static_cast<uint64_t>(br.d->mc_base + br.d->sync_off)) + w,
                                br.eps);
      else st_relaxed_sys_u32(sync_words(br.d, lane) + w, br.eps);
    }
  }
  if (br.signal != nullptr) {
#if !defined(UBNEXT_BREAK_NO_RELEASE)
    if (br.d->mc_base != 0) {
      // No fence.proxy.alias after the multicast signal (issue 24 A; it cost one MEMBAR.SC + CCTL.IVALL,
      // about an NVLink round trip, per barrier). A proxy fence orders one thread's accesses to the SAME
      // bytes through two virtual aliases (PTX ISA, "Proxies"); this lane never reads through unicast
      // what it writes through multicast: it writes slot [b][rank], our header slot and eps word, and the
      // polls (lanes p != rank) read slots [b][p] and peer p's header slot and eps word, other bytes. Across ranks, a
      // multicast release seen by a peer's unicast acquire is the pairing NCCL's NVLS barrier uses with
      // no proxy fence (nccl_device lsa_barrier: multimem.red.release.sys, then ld.acquire of its own
      // inbox). Data a block stored through multicast and reads back through unicast after a barrier
      // carries its own fence at its store (nvls.cu's two-shot); this lane's fence was never on the
      // path from a peer's store to our reads anyway (it came after our signal, not after their data).
      multimem_st_release_u32(br.signal, epoch);
    } else {
      st_release_sys_u32(br.signal, epoch);
    }
#else
    // Test-only broken build: a relaxed signal publishes nothing, so the block's earlier stores (the
    // two-shot broadcast) may reach a peer after the flag does. The integration tests must catch it.
    if (br.d->mc_base != 0) multimem_st_relaxed_u32(br.signal, epoch);
    else st_relaxed_sys_u32(br.signal, epoch);
#endif
  }
  uint32_t failed = 0;
#if !defined(UBNEXT_BREAK_SKIP_BARRIER)
  if (br.wait != nullptr) {
    const WaitResult r = wait_flag_reached(br.d, br.wait, epoch, br.limit_ns, lane);
    report_wait_failure(br.d, r, br.op, lane);  // lane p waits for peer p: the report names it
    failed = r != kArrived;
  }
#if !defined(UBNEXT_BREAK_NO_HEADER_CHECK)
  // Peer p's header came with its signal (ordered by our acquire of it). Every rank compares
  // every peer, so a difference is seen on every rank, at this same barrier: all of them leave
  // before touching data, and their epochs stay in step.
  if (!failed && br.header_in != nullptr) {
    const uint4 theirs = ld_relaxed_sys_v4(br.header_in);
    const uint32_t m[4] = {br.header.x, br.header.y, br.header.z, br.header.w};
    const uint32_t t[4] = {theirs.x, theirs.y, theirs.z, theirs.w};
    for (uint32_t f = 0; f < 4; ++f) {
      if (m[f] != t[f]) {
        report_error(br.d, UBNEXT_ERR_MISMATCH, br.op, lane, f, m[f], t[f]);
        failed = 1;
        break;
      }
    }
#if !defined(UBNEXT_BREAK_NO_EPS_CHECK)
    // peer p's eps word came with the same signal (block 0 of a fused call; the headers matched, so the
    // peer's call is fused too and published it)
    if (!failed && br.eps_pending) {
      const uint32_t me = static_cast<uint32_t>(br.d->rank);
      const uint32_t eps_theirs = ld_relaxed_sys_u32(sync_words(br.d, me) + call_eps_word(header_parity(epoch), lane));
      if (eps_theirs != br.eps) {
        report_error(br.d, UBNEXT_ERR_MISMATCH, br.op, lane, UBNEXT_HDR_EPS, br.eps, eps_theirs);
        failed = 1;
      }
    }
#endif
  }
#endif
  br.header_pending = false;
  br.eps_pending = false;
  br.header_out = nullptr;
  br.header_in = nullptr;
#else
  // Test-only broken build: signal but never wait. The integration tests must catch the
  // resulting races (stale or partially reduced data), proving that they exercise the barrier.
#endif
  return failed;
}

// One barrier. Collective over the whole block (every thread calls it, uniformly). Returns true when
// block blockIdx.x of every rank has arrived; false on timeout, header mismatch or abort (reported; the caller must leave the
// kernel's cross-rank work: every thread of the block gets `false`).
UBX_DEV bool barrier_sync(RankBarrier& br) {
  __shared__ uint32_t s_failed;
  __syncthreads();  // every thread's earlier accesses of this block happen before the signal
  if (threadIdx.x < 32) {
    const uint32_t lane = threadIdx.x;
    // found aborted at kernel entry: leave before signalling or touching anything
    const uint32_t aborted = __shfl_sync(0xffffffffu, br.abort_at_open, 0);
    br.abort_at_open = 0;
    uint32_t failed = aborted != 0u;
    if (aborted != 0u) {
      if (lane == 0) adopt_abort(br.d, aborted);
    } else {
      failed = barrier_signal_and_wait(br, lane);
    }
    failed = __any_sync(0xffffffffu, failed);
    if (lane == 0) s_failed = failed;
  }
  __syncthreads();  // warp 0's acquire happens before every thread's later accesses
  return s_failed == 0;
}

}  // namespace ubx
