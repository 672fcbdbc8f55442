// Kernels that test the emulator itself (tests/unit/test_emu*.py, tests/mpi/emu_*.py). They use
// the collective kernel ABI of docs/ARCHITECTURE.md so that the one launch path serves them, but
// give the parameters their own meaning, documented per kernel. Built only into the emulator
// library; never compiled for the GPU.
#include "../device/desc.cuh"
#include "../device/platform.cuh"
#include "../device/ptx.cuh"
#include "../device/barrier.cuh"

#include "../device/entry.cuh"

#include <time.h>

// The descriptor comes by value, as to every kernel; all zero (magic 0) when the test gives none.
#define EMU_ST_PARAMS UBX_KERNEL_PARAMS

namespace {

// Per-block scratch whose value must survive interleaving with every other block.
__shared__ uint32_t s_block_tag;
__shared__ uint32_t s_vals[1024];

}  // namespace

// Execution model. out: uint32 [grid][blockDim][8] results, in the order written below;
// out2 = (uint32*)residual_out: [1] global atomic counter. flags & 1: deliberately diverge
// (lanes 0..15 of warp 0 shuffle while all others wait in __syncthreads): a deadlock to detect.
// flags & 2: thread 0 of block 0 calls __trap().
extern "C" __global__ void ubnext_emu_selftest_block(EMU_ST_PARAMS) {
  uint32_t* o = static_cast<uint32_t*>(out) + (blockIdx.x * blockDim.x + threadIdx.x) * 8;
  const uint32_t tid = threadIdx.x, lane = tid % 32;
  if (flags & 2 && blockIdx.x == 0 && tid == 0) __trap();
  if (flags & 1) {
    if (tid < 16) (void)__shfl_sync(0xffffffffu, tid, 0);
    else __syncthreads();
    return;
  }
  if (tid == 0) s_block_tag = 1000 + blockIdx.x;
  s_vals[tid] = tid * 3 + blockIdx.x;
  __syncthreads();
  // [0]: the reversed neighbour's shared value (needs the barrier and per-block shared memory)
  o[0] = s_vals[blockDim.x - 1 - tid];
  // [1]: warp sum of lane ids by xor butterfly (every lane: 496)
  uint32_t v = lane;
  for (int m = 16; m; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  o[1] = v;
  // [2]: shfl_down reduction of tid (lane 0 holds the sum of the warp's tids)
  float f = float(tid);
  for (int d = 16; d; d >>= 1) f += __shfl_down_sync(0xffffffffu, f, d);
  o[2] = lane == 0 ? uint32_t(f) : 0xffffffffu;
  // [3]: broadcast of lane 5's tid
  o[3] = __shfl_sync(0xffffffffu, tid, 5);
  // [4]: ballot of odd lanes; [5]: any(lane==7) | all(lane<32) << 1 | all(lane<31) << 2
  o[4] = __ballot_sync(0xffffffffu, lane & 1);
  o[5] = uint32_t(__any_sync(0xffffffffu, lane == 7)) | uint32_t(__all_sync(0xffffffffu, lane < 32)) << 1 |
         uint32_t(__all_sync(0xffffffffu, lane < 31)) << 2;
  // [6]: __syncthreads_count of even tids
  o[6] = uint32_t(__syncthreads_count((tid & 1) == 0));
  atomicAdd(static_cast<uint32_t*>(residual_out), 1u);
  // Let every other block run (spin_pause yields), then check this block's shared tag survived.
  for (int i = 0; i < 4; ++i) ubx::spin_pause();
  __syncthreads();
  // [7]: the block tag (1000 + blockIdx.x) seen by every thread
  o[7] = s_block_tag;
}

// Blocks that wait on each other: a grid-wide barrier on a counter (residual_out, uint32, zeroed),
// `n` rounds. out: uint32 [grid] = 1 passed, 2 timed out (timeout: 10 s).
extern "C" __global__ void ubnext_emu_selftest_gridsync(EMU_ST_PARAMS) {
  uint32_t* counter = static_cast<uint32_t*>(residual_out);
  const uint64_t t0 = ubx::globaltimer_ns();
  uint32_t ok = 1;
  for (int round = 1; round <= n && ok == 1; ++round) {
    __syncthreads();
    if (threadIdx.x == 0) {
      ubx::atom_add_acq_rel_gpu_u32(counter, 1);
      while (ubx::ld_acquire_sys_u32(counter) < uint32_t(round) * gridDim.x) {
        if (ubx::globaltimer_ns() - t0 > 10000000000ull) {
          ok = 2;
          break;
        }
        ubx::spin_pause();
      }
      s_vals[0] = ok;
    }
    __syncthreads();
    ok = s_vals[0];
  }
  if (threadIdx.x == 0) static_cast<uint32_t*>(out)[blockIdx.x] = ok;
}

// Multicast and traffic. desc: ubnext_comm_desc (rank, nranks, mc_base, peer_base). Pool layout
// from the pool base, per rank: [0, n*16) bf16 data, [n*16, 2n*16) f16, [2n*16, 3n*16) f32,
// [3n*16, 3n*16 + nranks*16) multicast-store slots, then one u32 red counter. Thread t < n:
//   out[t], out[n+t], out[2n+t] (uint4) = ld_reduce of vector t of each section;
//   multicast-stores {rank, t, 7, 9} into slot `rank` (thread 0 only), reds +1 into the counter
//   (thread 0 only); every thread stores 16 B to the next peer's scratch at 4n*16 + t*16 and
//   loads 4 B from every rank's (including its own) bf16 section.
extern "C" __global__ void ubnext_emu_selftest_multicast(EMU_ST_PARAMS) {
  const ubnext_comm_desc* d = &desc;
  const uint64_t mc = d->mc_base, rank = d->rank, nranks = d->nranks;
  uint4* o = static_cast<uint4*>(out);
  for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < n; t += gridDim.x * blockDim.x) {
    o[t] = ubx::multimem_ld_reduce_bf16x8(reinterpret_cast<const void*>(mc + uint64_t(t) * 16));
    o[n + t] = ubx::multimem_ld_reduce_f16x8(reinterpret_cast<const void*>(mc + uint64_t(n + t) * 16));
    o[2 * n + t] = ubx::multimem_ld_reduce_f32x4(reinterpret_cast<const void*>(mc + uint64_t(2 * n + t) * 16));
    const uint64_t next = d->peer_base[(rank + 1) % nranks];
    ubx::st_relaxed_sys_v4(reinterpret_cast<void*>(next + uint64_t(4 * n + t) * 16),
                           make_uint4(uint32_t(rank), uint32_t(t), 1, 2));
    for (uint64_t p = 0; p < nranks; ++p)
      (void)ubx::ld_volatile_u32(reinterpret_cast<const uint32_t*>(d->peer_base[p] + uint64_t(t) * 16));
    if (t == 0) {
      ubx::multimem_st_v4(reinterpret_cast<void*>(mc + uint64_t(3 * n + rank) * 16),
                          make_uint4(uint32_t(rank), 0xabcdu, 7, 9));
      ubx::multimem_red_release_add_u32(reinterpret_cast<uint32_t*>(mc + uint64_t(3 * n + nranks) * 16), 1);
    }
  }
}

// Proxy model (chaos mode): thread t multicast-stores vector t, then reads it back through this rank's
// unicast copy, with fence.proxy.alias between the two when flags & 1. out (uint4 [n]): what it read.
// Vectors start zeroed; the stored value is (t + 1, 0xabcd, rank, 7). flags & 2: a poll instead, reading
// again (at most 64 times) while it reads zeros, as a Lamport poll retries its sentinel; out[t] is the
// last read, and residual_out (uint32 [n]) the number of reads.
extern "C" __global__ void ubnext_emu_selftest_proxy(EMU_ST_PARAMS) {
  const ubnext_comm_desc* d = &desc;
  uint4* o = static_cast<uint4*>(out);
  for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < n; t += gridDim.x * blockDim.x) {
    ubx::multimem_st_v4(reinterpret_cast<void*>(d->mc_base + uint64_t(t) * 16),
                        make_uint4(uint32_t(t + 1), 0xabcdu, uint32_t(d->rank), 7u));
    if (flags & 1) ubx::fence_proxy_alias();
    const void* mine = reinterpret_cast<const void*>(d->peer_base[d->rank] + uint64_t(t) * 16);
    uint32_t reads = 1;
    o[t] = ubx::ld_plain_v4(mine);
    while ((flags & 2) && o[t].x == 0u && reads < 64u) {
      o[t] = ubx::ld_plain_v4(mine);
      ++reads;
    }
    if (flags & 2) static_cast<uint32_t*>(residual_out)[t] = reads;
  }
}

// Message-passing litmus test: writers push data then a flag, readers wait for the flag and check
// the data. Pairs by threadIdx, `n` messages each; all words zeroed beforehand.
//   no desc (one process): block 0 threads write, block 1 threads read (grid 2); the words are
//     in residual_out (uint32): data[t] at [t], flag[t] at [B + t], ack[t] at [2B + t], B = blockDim.
//   a desc (ranks): rank 0 writes, rank 1 reads, other ranks return (grid 1). data and flag are
//     in rank 1's pool at data_off, ack in rank 0's pool at data_off + 2B words.
// Writer: wait ack == i, data := i+1 (relaxed), [flags & 1: fence], flag := i+1 (relaxed).
// Reader: wait flag == i+1, read data, count data != i+1, ack := i+1 (release).
// out (uint32 [blockDim], reader side) = violations per reader thread; 0xffffffff on a 20 s timeout.
extern "C" __global__ void ubnext_emu_selftest_litmus(EMU_ST_PARAMS) {
  const uint32_t B = blockDim.x, t = threadIdx.x;
  uint32_t *data, *flag, *ack;
  bool writer;
  if (desc.magic != 0) {
    const ubnext_comm_desc* d = &desc;
    if (d->rank > 1) return;
    writer = d->rank == 0;
    uint32_t* rd = reinterpret_cast<uint32_t*>(d->peer_base[1] + d->data_off);
    uint32_t* wr = reinterpret_cast<uint32_t*>(d->peer_base[0] + d->data_off);
    data = rd + t;
    flag = rd + B + t;
    ack = wr + 2 * B + t;
  } else {
    uint32_t* w = static_cast<uint32_t*>(residual_out);
    writer = blockIdx.x == 0;
    data = w + t;
    flag = w + B + t;
    ack = w + 2 * B + t;
  }
  const uint64_t t0 = ubx::globaltimer_ns();
  uint32_t violations = 0;
  for (uint32_t i = 0; i < uint32_t(n); ++i) {
    if (writer) {
      while (ubx::ld_acquire_sys_u32(ack) != i) {
        if (ubx::globaltimer_ns() - t0 > 20000000000ull) return;
        ubx::spin_pause();
      }
      ubx::st_relaxed_sys_u32(data, i + 1);
      if (flags & 1) ubx::fence_acq_rel_sys();
      ubx::st_relaxed_sys_u32(flag, i + 1);
    } else {
      while (ubx::ld_acquire_sys_u32(flag) != i + 1) {
        if (ubx::globaltimer_ns() - t0 > 20000000000ull) {
          static_cast<uint32_t*>(out)[t] = 0xffffffffu;
          return;
        }
        ubx::spin_pause();
      }
      violations += ubx::ld_volatile_u32(data) != i + 1;
      ubx::st_release_sys_u32(ack, i + 1);
    }
  }
  if (!writer) static_cast<uint32_t*>(out)[t] = violations;
}

// A wait on a peer that never arrives. desc: ubnext_comm_desc (rank, timeout_ns, err_ptr,
// peer_base, sync_off). Thread 0 of each block waits until its own sync word
// [BARRIER_FLAG + block * MAX_RANKS + peer], which only rank `peer` (= hidden) writes, is nonzero. On timeout it records {1, OP = n, rank, peer} in err_ptr (first writer wins).
// flags & 1: ignore the timeout (spin forever: for the watchdog test).
extern "C" __global__ void ubnext_emu_selftest_wait(EMU_ST_PARAMS) {
  const ubnext_comm_desc* d = &desc;
  if (threadIdx.x != 0) return;
  const uint32_t peer = uint32_t(hidden);
  const uint32_t* word = reinterpret_cast<const uint32_t*>(d->peer_base[d->rank] + d->sync_off) +
                         UBNEXT_SYNC_BARRIER_FLAG + blockIdx.x * UBNEXT_MAX_RANKS + peer;
  const uint64_t t0 = ubx::globaltimer_ns();
  while (ubx::ld_acquire_sys_u32(word) == 0) {
    if (!(flags & 1) && ubx::globaltimer_ns() - t0 > d->timeout_ns) {
      uint32_t* err = reinterpret_cast<uint32_t*>(d->err_ptr);
      if (ubx::atom_cas_relaxed_sys_u32(err, 0, UBNEXT_ERR_TIMEOUT) == 0) {
        ubx::st_relaxed_sys_u32(err + 1, uint32_t(n));
        ubx::st_relaxed_sys_u32(err + 2, uint32_t(d->rank));
        ubx::st_relaxed_sys_u32(err + 3, peer);
        ubx::fence_acq_rel_sys();
      }
      return;
    }
    ubx::spin_pause();
  }
}

// The shared spin's clock (barrier.cuh SpinWait): thread 0 of block 0 takes `n` steps of one wait, as a
// poll that never finds its word would, with the descriptor's timeout (the test gives a long one). out:
// uint32 {clock reads during the steps, steps that ended the wait (none expected), UBX_SPIN_CLOCK_EVERY}.
extern "C" __global__ void ubnext_emu_selftest_spin(EMU_ST_PARAMS) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  uint32_t* o = static_cast<uint32_t*>(out);
  ubx::SpinWait spin(&desc, desc.timeout_ns);
  const uint64_t before = ::ubx_emu::globaltimer_reads();
  uint32_t ended = 0;
  for (int k = 0; k < n; ++k) ended += spin.step(1u) != ubx::kWaiting;
  o[0] = static_cast<uint32_t>(::ubx_emu::globaltimer_reads() - before);
  o[1] = ended;
  o[2] = UBX_SPIN_CLOCK_EVERY;
}

// The error word under contention (barrier.cuh write_error_word): every thread of every block reports a
// failure at once, each its own record, all of whose words derive from its global index g, so that a record
// mixed from two reports shows: {MISMATCH, op = base + g, rank, peer = g, field = g ^ 0x5a5a, mine = 3 g + 7,
// theirs = ~g, 0}, base = 100 + n. desc: nranks 1 (report_error also aborts the communicator: its own
// region only).
extern "C" __global__ void ubnext_emu_selftest_report(EMU_ST_PARAMS) {
  const uint32_t g = blockIdx.x * blockDim.x + threadIdx.x;
  ubx::report_error(&desc, UBNEXT_ERR_MISMATCH, 100u + static_cast<uint32_t>(n) + g, g, g ^ 0x5a5au, 3u * g + 7u, ~g);
}

// Warp-op variants: segment widths, shfl_up, 64-bit shuffles, block votes, exited lanes.
// out: uint32 [grid][blockDim][8], in the order written below.
extern "C" __global__ void ubnext_emu_selftest_warp(EMU_ST_PARAMS) {
  uint32_t* o = static_cast<uint32_t*>(out) + (blockIdx.x * blockDim.x + threadIdx.x) * 8;
  const uint32_t tid = threadIdx.x, lane = tid % 32;
  const unsigned full = 0xffffffffu;
  o[0] = __shfl_xor_sync(full, lane, 1, 16);
  o[1] = __shfl_down_sync(full, lane, 4, 8);
  o[2] = __shfl_up_sync(full, lane, 3);
  o[3] = __shfl_sync(full, lane, 3, 8);
  const double dv = __shfl_xor_sync(full, double(lane) * 1e10 + 0.5, 2);
  o[4] = uint32_t(dv / 1e10);
  const long long lv = __shfl_sync(full, (static_cast<long long>(lane) << 33) | 7, 31);
  o[5] = uint32_t(lv >> 33) + uint32_t(lv & 7) * 1000;
  o[6] = uint32_t(__syncthreads_and(tid < blockDim.x)) | uint32_t(__syncthreads_or(tid == 5)) << 1 |
         uint32_t(__syncthreads_and(tid != 3)) << 2;
  if (lane >= 16) return;
  o[7] = __activemask();
}

// Stores of a thread that parks. Thread 0 pushes 8 data words then a flag (all relaxed, no fence)
// and then parks until the rest of its block has seen the PEER's flag; threads 1..8 wait for the
// peer's flag and then read the peer's data word t-1 (all other threads also wait for the flag).
// On hardware the parked thread's stores drain eventually, in no particular order; an emulator
// that kept them buffered while the thread is parked deadlocks (each side waits for the other).
// How thread 0 parks: flags 0: __syncthreads; 1: __syncwarp (threads 1..31 of its warp poll,
// then __syncwarp; the other warps exit); 2: spin_pause on a __shared__ word that thread 1 sets
// after the peer's flag; 3: the same with __nanosleep.
//   no desc (one process, grid 2): block b is "rank" b; words in residual_out (uint32, zeroed):
//     rank r's inbox at [r * 16]: data [0..8), flag [8].
//   a desc (ranks, grid 1): rank r pushes into the inbox at data_off of rank (r+1) % nranks.
// n: the flag value, nonzero and different in consecutive launches (it also tags the __shared__
// word of modes 2/3, which survives launches). out (uint32 [grid][2], zeroed) per block: [0] 1 =
// saw the peer's flag, 0xffffffff = timed out (5 s); [1] data words found stale after the flag
// (a reordering, which is allowed: nothing orders the data before the flag).
extern "C" __global__ void ubnext_emu_selftest_parked(EMU_ST_PARAMS) {
  const uint32_t t = threadIdx.x, mode = uint32_t(flags) & 3;
  uint32_t *inbox, *outbox;
  if (desc.magic != 0) {
    const ubnext_comm_desc* d = &desc;
    inbox = reinterpret_cast<uint32_t*>(d->peer_base[d->rank] + d->data_off);
    outbox = reinterpret_cast<uint32_t*>(d->peer_base[(d->rank + 1) % d->nranks] + d->data_off);
  } else {
    uint32_t* w = static_cast<uint32_t*>(residual_out);
    inbox = w + blockIdx.x * 16;
    outbox = w + (blockIdx.x ^ 1) * 16;
  }
  const uint32_t v = uint32_t(n);
  uint32_t* o = static_cast<uint32_t*>(out) + blockIdx.x * 2;
  if (t == 0) {
    for (uint32_t i = 0; i < 8; ++i) ubx::st_relaxed_sys_u32(outbox + i, v + i);
    ubx::st_relaxed_sys_u32(outbox + 8, v);
    if (mode == 0) {
      __syncthreads();
    } else if (mode == 1) {
      __syncwarp();
    } else {
      while (s_block_tag != v) {  // plain __shared__: fibers switch only at the pause
        if (mode == 2) ubx::spin_pause();
        else __nanosleep(100);
      }
    }
    return;
  }
  if (mode == 1 && t >= 32) return;
  const uint64_t t0 = ubx::globaltimer_ns();
  bool ok = true;
  while (ubx::ld_acquire_sys_u32(inbox + 8) != v) {
    if (ubx::globaltimer_ns() - t0 > 5000000000ull) {
      ok = false;
      break;
    }
    ubx::spin_pause();
  }
  if (ok && t <= 8) atomicAdd(o + 1, uint32_t(ubx::ld_volatile_u32(inbox + t - 1) != v + t - 1));
  if (t == 1) {
    o[0] = ok ? 1u : 0xffffffffu;
    s_block_tag = v;
  }
  if (mode == 0) __syncthreads();
  else if (mode == 1) __syncwarp();
}

// Stall time (sched.cpp; issue 40 item 8): a wait bounded by desc.timeout_ns (the kernels' rule:
// globaltimer_ns() - t0 > limit) for a flag that a busy sibling sets only after n ms of wall-clock work.
// Block 0, thread 0: waits for *flag (uint32*) residual_out != 0; out (uint32[2]): [0] 2 if the flag
// came, 1 if the wait timed out; [1] the wait's length on the kernel's clock, in ms.
// Block 1, thread 0: n > 0: stores to a scratch word ((uint32*)residual) without pause
// for n ms of CLOCK_MONOTONIC (work the scheduler sees: every store), then sets the flag; n == 0: does
// nothing (a hang: nobody ever sets the flag). Launch with grid 2.
extern "C" __global__ void ubnext_emu_selftest_progress_wait(EMU_ST_PARAMS) {
  if (threadIdx.x != 0) return;
  uint32_t* flag = static_cast<uint32_t*>(residual_out);
  if (blockIdx.x == 1) {
    if (n <= 0) return;
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    const uint64_t end = uint64_t(ts.tv_sec) * 1000000000ull + uint64_t(ts.tv_nsec) + uint64_t(n) * 1000000ull;
    uint32_t* scratch = static_cast<uint32_t*>(const_cast<void*>(residual));
    for (uint32_t i = 1;; ++i) {
      ubx::st_relaxed_sys_u32(scratch, i);
      clock_gettime(CLOCK_MONOTONIC, &ts);
      if (uint64_t(ts.tv_sec) * 1000000000ull + uint64_t(ts.tv_nsec) >= end) break;
    }
    ubx::st_release_sys_u32(flag, 1u);
    return;
  }
  if (blockIdx.x != 0) return;
  uint32_t* o = static_cast<uint32_t*>(out);
  const uint64_t limit = desc.timeout_ns;
  const uint64_t t0 = ubx::globaltimer_ns();
  uint32_t result = 1;
  for (;;) {
    ubx::spin_pause();
    if (ubx::ld_volatile_u32(flag) != 0u) {
      result = 2;
      break;
    }
    if (ubx::globaltimer_ns() - t0 > limit) break;
  }
  o[0] = result;
  o[1] = static_cast<uint32_t>((ubx::globaltimer_ns() - t0) / 1000000ull);
}

// Count mode's calibrated counts (memory.cpp; tests/unit/test_emu_count.py). out (uint32*): a region
// registered with stamps: flag k at word 4 k (k < n <= 64), data vectors from word 1024, an atomic
// counter at word 512, scratch words at 516 and 520. Launch with grid 2, block 64 (mode 3: grid 1).
// flags & 3 = mode:
//   0: block 0, thread 0 loads a local word n times with a warp op between the loads (each load's value
//      joins the control clock: n dependent L2 round trips), or, with flags & 4, n times back to back
//      (independent: they overlap, one round trip); then stores the sum;
//   1: block 1, thread 0 sets the n flags (an atomic first unless flags & 8, so that its stamps are
//      later than the waiter's issue); block 0, thread 0 waits for each flag in turn (a marked wait), or,
//      with flags & 4, loads all n first and waits for those not yet set (the Lamport batch);
//      with flags & 16, loads all n first, then re-loads every one not yet set on each pass until none is
//      left (a multi-slot poll, lamport_poll.cuh's poll_slots: count_poll_begin/end);
//   2: block 0, thread 0 makes n dependent GPU-scope atomics on the counter and one red (no result);
//   3: every thread of block 0 loads n vectors of its own, then a barrier, then one more vector.
extern "C" __global__ void ubnext_emu_selftest_count(EMU_ST_PARAMS) {
  uint32_t* w = static_cast<uint32_t*>(out);
  const int mode = flags & 3;
  const uint32_t tid = threadIdx.x;
  if (mode == 3) {
    if (blockIdx.x != 0) return;
    uint32_t acc = 0;
    for (int i = 0; i < n; ++i) acc += ubx::ld_volatile_v4(w + 1024 + (tid * (n + 1) + i) * 4).x;
    __syncthreads();
    acc += ubx::ld_volatile_v4(w + 1024 + (tid * (n + 1) + n) * 4).x;
    if (acc == 0xdeadbeefu) ubx::st_relaxed_sys_u32(w + 516, acc);
    return;
  }
  if (tid != 0) {
    if (mode == 0 && blockIdx.x == 0 && !(flags & 4))
      for (int i = 0; i < n; ++i) __syncwarp();
    return;
  }
  if (mode == 0) {
    if (blockIdx.x != 0) return;
    uint32_t acc = 0;
    for (int i = 0; i < n; ++i) {
      acc += ubx::ld_volatile_u32(w + 516);
      if (!(flags & 4)) __syncwarp();
    }
    ubx::st_relaxed_sys_u32(w + 520, acc);
  } else if (mode == 1) {
    if (blockIdx.x == 1) {
      if (!(flags & 8)) (void)ubx::atom_add_acq_rel_gpu_u32(w + 512, 1u);
      for (int k = 0; k < n; ++k) ubx::st_relaxed_sys_u32(w + 4 * k, 1u);
      return;
    }
    uint32_t seen[64];
    if (flags & 16) {
      UBX_COUNT_POLL_BEGIN();
      uint64_t todo = 0;
      for (int k = 0; k < n; ++k)
        if (ubx::ld_volatile_u32(w + 4 * k) == 0u) todo |= 1ull << k;
      const bool repolled = todo != 0;
      if (repolled) UBX_COUNT_WAIT_BEGIN();
      while (todo != 0) {
        ubx::spin_pause();
        for (int k = 0; k < n; ++k)
          if ((todo >> k & 1) && ubx::ld_volatile_u32(w + 4 * k) != 0u) todo &= ~(1ull << k);
      }
      UBX_COUNT_POLL_END(repolled, 1);
      ubx::st_relaxed_sys_u32(w + 520, 1u);
      return;
    }
    if (flags & 4)
      for (int k = 0; k < n; ++k) seen[k] = ubx::ld_volatile_u32(w + 4 * k);
    for (int k = 0; k < n; ++k) {
      if ((flags & 4) && seen[k] != 0u) continue;
      UBX_COUNT_WAIT_BEGIN();
      while (ubx::ld_volatile_u32(w + 4 * k) == 0u) ubx::spin_pause();
      UBX_COUNT_WAIT_END(w + 4 * k, 4, 1);
    }
    ubx::st_relaxed_sys_u32(w + 520, 1u);
  } else {
    if (blockIdx.x != 0) return;
    for (int i = 0; i < n; ++i) (void)ubx::atom_add_acq_rel_gpu_u32(w + 512, 1u);
    ubx::red_release_sys_add_u32(w + 512, 1u);
  }
}
