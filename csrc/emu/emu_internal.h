// State shared by the emulator's scheduler (sched.cpp) and memory model (memory.cpp).
#pragma once

#include <stdint.h>

#include <atomic>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "emu_api.h"
#include "emu_runtime.h"

namespace ubx_emu {

// xorshift64*: cheap, and one per block keeps chaos decisions free of locks.
struct Rng {
  uint64_t s = 0x9e3779b97f4a7c15ull;
  void seed(uint64_t v) { s = v ? v : 0x9e3779b97f4a7c15ull; }
  uint64_t next() {
    s ^= s >> 12;
    s ^= s << 25;
    s ^= s >> 27;
    return s * 0x2545f4914f6cdd1dull;
  }
  uint32_t below(uint32_t n) { return n ? (uint32_t)((next() >> 32) % n) : 0; }
  bool one_in(uint32_t n) { return below(n) == 0; }
};

// The critical-path count (count mode, memory.cpp): the longest chain of serialised NVLink
// crossings that led to a thread's present state, and the system-scope fences on it. Ordered by
// hops, then fences: the chain with the most crossings is the critical one.
struct Clock {
  uint32_t hops = 0, fences = 0;
  bool operator<(const Clock& o) const { return hops != o.hops ? hops < o.hops : fences < o.fences; }
  void join(const Clock& o) {
    if (*this < o) *this = o;
  }
};
inline Clock later(Clock a, const Clock& b) {
  a.join(b);
  return a;
}

// The calibrated model's critical-path count (count mode, memory.cpp; issue 38 item 1), kept beside the
// Clock above (which stays the planner's count, unchanged): the chain's NVLink crossings, dependent local
// L2 round trips, GPU-scope atomics whose result the thread waits for, and serialised waits. The critical
// chain is the one a GPU would take longest over: ordered by the weighted sum of its counts (weights:
// count_weights(), the calibrated Hopper constants in ns), ties by the counts themselves, so that the
// order never depends on timing. `dsm` and `csyncs`: distributed-shared-memory accesses of a sibling block
// and cluster barriers (on-chip: a chain carries them through a cluster barrier, not through the stamps of
// global memory, whose words have no room for them; memory.cpp).
struct Timed {
  uint32_t hops = 0, l2 = 0, atomics = 0, waits = 0, dsm = 0, csyncs = 0;
  uint64_t cost() const;
  bool operator<(const Timed& o) const {
    const uint64_t a = cost(), b = o.cost();
    if (a != b) return a < b;
    if (hops != o.hops) return hops < o.hops;
    if (atomics != o.atomics) return atomics < o.atomics;
    if (l2 != o.l2) return l2 < o.l2;
    if (waits != o.waits) return waits < o.waits;
    if (csyncs != o.csyncs) return csyncs < o.csyncs;
    return dsm < o.dsm;
  }
  bool operator==(const Timed& o) const {
    return hops == o.hops && l2 == o.l2 && atomics == o.atomics && waits == o.waits && dsm == o.dsm &&
           csyncs == o.csyncs;
  }
  void join(const Timed& o) {
    if (*this < o) *this = o;
  }
};
inline Timed later(Timed a, const Timed& b) {
  a.join(b);
  return a;
}
// What a 4-byte word's shadow records of its writer: both chains.
struct Stamp {
  Clock c;
  Timed t;
  void join(const Stamp& o) {
    c.join(o.c);
    t.join(o.t);
  }
};

// Count mode: an unmarked strong load of this rank's memory, kept until the thread's next control advance
// so that a marked wait on the same bytes can tell whether the model's load had already seen the value
// (memory.cpp, "waits"). `pending`: the value landed after the load was issued (the model's load read the
// old value): a wait the model serialises at this load's place, applied at the next settle.
struct BatchLoad {
  uint64_t granule;  // address / 16
  uint32_t seq;
  bool pending;
  Timed issue_ctrl, issue_ready, seen;
  bool poll = false;  // a first-pass load of a multi-slot poll (count_poll_begin): its wait is the poll's
};

// A store that chaos mode holds back. `key_*` name the memory it lands in independently of the
// alias used (unicast copy or multicast), so that overlap checks see through multicast.
struct PendingStore {
  uint64_t addr;   // address as issued
  uint32_t bytes;  // 1, 2, 4 or 16
  bool mc;         // issued to a multicast address: lands in every rank's copy
  int key_region;  // -1: not in a registered region (then key_off is the raw address)
  int key_rank;    // copy the store lands in; -1 for multicast (every copy)
  uint64_t key_off;
  uint32_t data[4];
  Stamp stamp;  // count mode: what a reader of these bytes observes (the stamp at issue)
};

// A multicast store as the issuing thread's unicast loads may still see it (chaos mode's proxy model,
// memory.cpp): the bytes every copy held before it, for the next `stale_loads` overlapping loads.
struct McShadow {
  int region;
  uint64_t off;
  uint32_t bytes;
  uint32_t stale_loads;
  uint32_t old[UBNEXT_EMU_MAX_RANKS][4];
};

struct Traffic {
  uint64_t peer_store_bytes[UBNEXT_EMU_MAX_RANKS];
  uint64_t peer_store_ops[UBNEXT_EMU_MAX_RANKS];
  uint64_t peer_load_bytes[UBNEXT_EMU_MAX_RANKS];
  uint64_t peer_load_ops[UBNEXT_EMU_MAX_RANKS];
  uint64_t mc_store_bytes, mc_store_ops, mc_ld_bytes, mc_ld_ops, mc_red_bytes, mc_red_ops;
  uint64_t peer_atomic_ops;  // atomics on a peer's memory (PCIe peers may not support them)
  void add(const Traffic& o) {
    const uint64_t* a = reinterpret_cast<const uint64_t*>(&o);
    uint64_t* b = reinterpret_cast<uint64_t*>(this);
    for (unsigned i = 0; i < sizeof(Traffic) / 8; ++i) b[i] += a[i];
  }
};
static_assert(sizeof(Traffic) == UBNEXT_EMU_TRAFFIC_WORDS * 8, "traffic layout");

// kWaitCluster: in barrier.cluster.wait, for threads of this and the sibling blocks (sched.cpp).
enum FiberState { kRunnable, kWaitBarrier, kWaitWarp, kWaitCluster, kDone };

struct Fiber {
  void* sp = nullptr;  // saved stack pointer while switched out
  char* stack_lo = nullptr;
  Idx3 tid{0, 0, 0};
  unsigned linear = 0;
  FiberState state = kRunnable;
  std::vector<PendingStore> sbuf;  // chaos store buffer of this CUDA thread
  std::vector<McShadow> mc_shadow;  // its multicast stores not yet fenced by fence.proxy.alias
  uint32_t xchg_value = 0;
  int xchg_src = -1;
  uint32_t xchg_result = 0;
  // Count mode: `clock` is when the thread can issue its next access (control), `data` when the
  // values it has loaded are there. Independent loads issue together, as on the GPU: a load's
  // result waits for its round trip, the next load does not.
  Clock clock;
  Clock data;
  Clock ready() const { return clock < data ? data : clock; }
  // The calibrated model's chain (Timed), with the same two clocks; `batch`: its unmarked strong local
  // loads since its last control advance (memory.cpp, "waits").
  Timed tclock, tdata;
  Timed tready() const { return later(tclock, tdata); }
  // Where its loads issue in the calibrated model: its control clock at its last control advance other than
  // a wait on bytes it loaded before (whose place in time is the kernel's check order, settled lazily), and
  // the latest stamp of its own stores to this rank's memory since (a read-back of them is no wait).
  Timed tbase, own_max;
  std::vector<BatchLoad> batch;
  uint32_t load_seq = 0;
  unsigned waiting = 0;              // count mode: inside a wait (count_wait_begin): loads are polls
  bool poll_open = false;            // count mode: inside a multi-slot poll (count_poll_begin/end)
  bool griddep_waited = false;       // it executed griddepcontrol.wait in this launch
  bool griddep_launched = false;     // it executed griddepcontrol.launch_dependents
  std::unordered_set<uint64_t> loaded;  // count mode: 16-byte granules it loaded (a poll counts once)
  bool cluster_arrived = false;         // arrived at the cluster barrier, not yet waited
  uint32_t cluster_phase = 0;           // the cluster barrier's phase it arrived in
  Timed dsm_landed;                     // count mode: when its stores to a sibling's shared memory land
};

struct Warp {
  uint32_t live = 0;      // lanes that have not exited
  uint32_t arrived = 0;   // lanes waiting in the current warp op
  uint32_t expected = 0;  // lanes the current warp op waits for
  int kind = 0;
};

struct Launch;
struct Cluster;

// One block, run by one worker OS thread. Only that thread touches it while the block runs.
struct Block {
  Launch* launch = nullptr;
  Idx3 bidx{0, 0, 0};
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  Fiber* cur = nullptr;
  void* sched_sp = nullptr;
  unsigned live = 0;
  // __syncthreads state: accumulators of the barrier being filled, result of the last one.
  unsigned bar_arrived = 0;
  int bar_acc_count = 0, bar_acc_and = 1, bar_acc_or = 0;
  int bar_result[4] = {0, 0, 0, 0};
  // Stores that passed a __syncthreads before being drained: a later fence or release by any
  // thread of the block must drain them too (PTX release is cumulative over what the releasing
  // thread has observed, and bar.sync makes the other threads' stores observed).
  std::vector<PendingStore> cumulative;
  bool progress = false;  // something other than a load/spin happened this scheduling round
  bool chaos = false;
  Rng rng;
  Traffic traffic{};
  uint64_t bytes_moved = 0;  // count mode: bytes its threads loaded (once per granule) and stored
  Clock end_clock;           // count mode: the longest chain of its threads that ended
  Timed t_end;               // count mode: the calibrated model's longest chain of its threads that ended
  uint64_t load_bytes = 0;   // count mode: bytes its threads loaded (once per granule per thread)
  uint64_t remote_load_bytes = 0;  // of those, from a peer's copy or through multicast
  uint32_t bar_gen = 0;      // completed __syncthreads: a barrier ends every thread's loads in flight
  // count mode: bytes its threads loaded while at one control point (barrier generation, Timed control
  // clock encoded): the bytes in flight together (memory.cpp, "bytes in flight")
  std::unordered_map<uint64_t, uint64_t> inflight;
  Cluster* cluster = nullptr;  // its cluster (a launch without clusters: clusters of one block)
  unsigned crank = 0;          // its rank in the cluster
  bool pdl = false;          // launched with the PDL attribute: no memory access before griddepcontrol.wait
  uint32_t griddep_waited = 0, griddep_launched = 0;  // its ended threads that executed each
  std::string error;
};

// The block of the calling worker thread; null outside a launch (twins then act directly).
extern thread_local Block* tl_block;

// Scheduler hooks used by the memory model.
void yield_fiber(bool work);
// A memory access of the current thread, which has not executed griddepcontrol.wait, in a launch made
// with the PDL attribute: fails the launch naming the access and the thread; does not return.
[[noreturn]] void griddep_violation(const void* p, const char* access);

// A distributed-shared-memory access of `bytes` at `addr` by the running thread: fails the launch unless
// it lies in the shared memory of a block of the caller's cluster that has not exited; that block's rank.
unsigned dsm_check(uint64_t addr, unsigned bytes, const char* access);

// Memory-model hooks used by the scheduler.
// barrier.cluster.arrive.release: the thread's stores (and those it saw through __syncthreads) first.
void release_stores(Block& b);
// Count mode, the cluster barrier: what the arriving thread brings (its chains, its sibling stores landed),
// and what a thread takes from the barrier's completed phase (joined, plus one cluster barrier).
void count_cluster_arrive(Fiber& f, Clock& c, Timed& t);
void count_cluster_wait(Fiber& f, const Clock& c, const Timed& t);
void drain_all(Block& b, std::vector<PendingStore>& buf);
void chaos_spin(Block& b);   // at spin_pause/__nanosleep: maybe drain one store of the thread
void chaos_round(Block& b);  // after each round: maybe drain one store of each parked thread
void reset_traffic();
void merge_traffic(const Traffic& t);
bool chaos_enabled();
bool counting();
// Count mode, at the start of each launch: stamps of earlier launches read as zero.
void count_new_launch();
// Count mode: 8-byte words of stamp shadow per 4-byte word of a region (memory.cpp's StampWord).
constexpr unsigned STAMP_WORDS_PER_WORD = 3;
// Count mode: a thread at a barrier or warp op with the others takes the longest of their chains.
void join_clocks(Fiber* const* fibers, unsigned n);
// Count mode: the serialised waits the thread still owes (memory.cpp), applied before its chain is read.
void count_settle(Fiber& f);
// Count mode, at a launch's end: its count words (UBNEXT_EMU_COUNT_WORDS) from its blocks.
void count_launch_words(const Block* blocks, int nblocks, uint64_t* words);
uint64_t chaos_seed();

}  // namespace ubx_emu
