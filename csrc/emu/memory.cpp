// Memory model of the emulator: the runtime behind the host twins of csrc/device/ptx.cuh.
//
// "Device memory" is a shared mapping (a memfd per rank, mapped by every rank process), so plain
// host atomics on it are real cross-process accesses. What the hardware may do and x86 never does
// is modelled explicitly, in chaos mode:
//   - relaxed/volatile stores wait in a per-thread store buffer and become visible one at a time
//     in random order (at random later accesses and pauses of the thread, at random scheduling
//     rounds while it is parked in a barrier or warp op, or when forced); fences, release
//     stores/reds and acq_rel atomics drain the buffer first, kernel end drains everything. A
//     thread's own loads drain its buffered stores to the same bytes first, so it always reads
//     its own writes.
//   - random delays (extra yields, short OS-level stalls) at every access;
//   - multimem.ld_reduce sums the ranks' copies in a random rank order; multimem stores and reds
//     reach the ranks' copies in a random order.
//   - proxies: a multicast address and the unicast mapping of the same bytes are distinct proxies
//     (PTX ISA, "Proxies"). Until the storing thread executes fence.proxy.alias, its own unicast
//     loads of bytes it stored through multicast return what they held before the store: the first
//     such load always (so that a missing fence before a single read is caught rather than merely
//     possible), then each of up to kMaxStaleLoads - 1 more at random, after which the store shows
//     (the hardware makes a store visible eventually: a poll that validates its own data, as a
//     Lamport poll does, needs no fence, and NCCL's LL multicast path has none). Other threads see
//     the store. Its own later unicast store to those bytes ends the window for them.
// Traffic counters see every twin access: unicast bytes/ops per peer rank, multicast bytes/ops
// once per access.
//
// Count mode (ubnext_emu_set_counting) measures the critical path a GPU would pay, which timing on
// a CPU cannot show. Every thread carries a Clock (emu_internal.h); every 4-byte word of a region
// that has stamps (ubnext_emu_register_stamps: a shadow beside each rank's copy, shared like it)
// carries the Clock of its last writer. The rules, stated once (docs/PERF.md repeats them):
//   - a thread has two clocks: when it can issue (control) and when the values it loaded are there
//     (data); a store depends on both, an independent load only on control, so that a thread's
//     loads of N peers overlap as on the GPU instead of queuing behind each other;
//   - a store into this rank's copy stamps it with the later of the two; into a peer's copy or
//     through multicast, with that plus one hop (one NVLink crossing);
//   - a load of this rank's copy is there at the later of control and the word's stamp; a load of a
//     peer's copy or a multicast ld_reduce is a round trip: control + 2 hops, or stamp + 1 hop if
//     later; the data clock takes it. A wait's awaited value (count_wait_end) and an atomic's result
//     decide control flow: control takes them;
//   - a system-scope fence, a proxy fence, and a system-scope release (every release of ptx.cuh is
//     .sys; it waits for the thread's earlier stores to land): control becomes the later of the two
//     clocks plus one hop, and one fence;
//   - __syncthreads and warp ops give every participant the latest of all their clocks;
//   - stamps carry the launch they were written in: ranks launch the same kernels in the same order
//     (collectives), so a stamp of an earlier launch reads as zero (that data is already there).
// Beside that chain (the planner's, unchanged), count mode keeps the calibrated model's (issue 38 item 1;
// Timed in emu_internal.h), with the same two clocks and the same stamps, ordered by the weighted sum of
// its counts (the calibrated constants, ubnext_emu_set_count_weights):
//   - hops as above;
//   - l2: a strong or .sys load of this rank's memory (every load twin) is there one L2 round trip after
//     the later of its issue and the word's landing; loads that overlap count once, a dependent one adds;
//   - atomics: an atomic whose result the thread waits for costs one after the later of its issue and
//     the word's last update (plus the round trip to a peer); a red costs none;
//   - waits: serialised waits of a poll loop, as stated at t_wait_end below; counts stay independent of
//     timing (whether the kernel's first load already saw the value changes nothing);
//   - bytes in flight per CTA: the bytes its threads load at one control point (the barrier generation and
//     the issuing thread's control clock: a wait, an atomic, a fence or a barrier moves it on), as the
//     twins and vector accesses see them; the launch reports the CTA with the most rounds of them;
//   - dsm: a load of a sibling block's shared memory (ld.shared::cluster) is there one `dsm` latency after
//     its issue (loads issued together overlap, as for l2); a store to it lands one `dsm` after the thread's
//     ready clock, which the thread's next cluster-barrier arrive waits for. A block's own shared memory
//     through the cluster window costs nothing, as plain shared memory does;
//   - cluster_syncs: a cluster barrier gives every thread of the cluster the latest chain that arrived
//     (each arrival: the thread's ready clock and its sibling stores landed), plus one cluster barrier.
//     Both stay on the chip: stamps of global memory do not carry them (a 4-byte word's shadow has no room),
//     so a chain that leaves through global memory drops them, never adds;
//   - weights (ubnext_emu_set_cluster_weights): dsm 103 ns, the SM-to-SM network's ~180-cycle latency that
//     Luo et al. measured on H100 ("Benchmarking and Dissecting the Nvidia Hopper GPU Architecture",
//     arXiv:2402.13499) at 1.755 GHz; a cluster barrier twice that (an arrive travels to the cluster's
//     other SMs, its completion travels back), derived, not measured: a GPU figure replaces both.
// A writer stamps before it stores the data and a reader loads the data before the stamp, so a
// reader that sees the data sees its stamp. Bytes are the data a block moves: vector accesses
// (8 or 16 bytes through the twins, any plain access of vec.cuh), a load once per 16-byte granule
// per thread (a poll counts once, however long it spins). Flags, counters and atomics are latency,
// which the hops count; they move no bytes here (nor the 4-byte tail words of the all-gather).
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "emu_internal.h"

namespace ubx_emu {

// ------------------------------------------------------------------------------ regions
struct Region {
  std::atomic<bool> live{false};
  int rank = 0, nranks = 0;
  uint64_t base[UBNEXT_EMU_MAX_RANKS] = {};
  uint64_t bytes = 0;
  uint64_t mc = 0;
  uint64_t stamps[UBNEXT_EMU_MAX_RANKS] = {};  // count mode: copy p's stamp words (8 bytes per 4), or 0
};
static constexpr int kMaxRegions = 64;
static Region g_regions[kMaxRegions];
static std::atomic<int> g_region_end{0};  // one past the highest slot ever used
static std::mutex g_region_mutex;

struct Where {
  int region;  // -1: not registered memory
  int rank;    // copy addressed; -1: the multicast alias of every copy
  uint64_t off;
};

static Where locate(uint64_t a) {
  const int end = g_region_end.load(std::memory_order_acquire);
  for (int i = 0; i < end; ++i) {
    const Region& r = g_regions[i];
    if (!r.live.load(std::memory_order_acquire)) continue;
    if (r.mc && a - r.mc < r.bytes) return Where{i, -1, a - r.mc};
    for (int p = 0; p < r.nranks; ++p)
      if (a - r.base[p] < r.bytes) return Where{i, p, a - r.base[p]};
  }
  return Where{-1, -1, a};
}

// ------------------------------------------------------------------------------ configuration
static std::atomic<int> g_chaos{0};
static std::atomic<uint64_t> g_seed{0};
bool chaos_enabled() { return g_chaos.load(std::memory_order_relaxed) != 0; }
uint64_t chaos_seed() { return g_seed.load(std::memory_order_relaxed); }

// ------------------------------------------------------------------------------ count mode
static std::atomic<int> g_counting{0};
static uint32_t g_epoch = 0;  // launches are serialised per process (sched.cpp)
bool counting() { return g_counting.load(std::memory_order_relaxed) != 0; }
void count_new_launch() { ++g_epoch; }

// The weights that order the calibrated model's chains (Timed): ns per hop, L2 round trip, atomic, wait.
// Defaults: the calibrated Hopper constants (ubnext/tuning/_calibration.py), which the model sets anyway.
// Then a sibling's shared-memory access and a cluster barrier (sources: the rules above, "weights").
static std::atomic<uint32_t> g_weights[6] = {{600}, {143}, {533}, {143}, {103}, {206}};
uint64_t Timed::cost() const {
  return uint64_t(hops) * g_weights[0].load(std::memory_order_relaxed) +
         uint64_t(l2) * g_weights[1].load(std::memory_order_relaxed) +
         uint64_t(atomics) * g_weights[2].load(std::memory_order_relaxed) +
         uint64_t(waits) * g_weights[3].load(std::memory_order_relaxed) +
         uint64_t(dsm) * g_weights[4].load(std::memory_order_relaxed) +
         uint64_t(csyncs) * g_weights[5].load(std::memory_order_relaxed);
}

static constexpr uint32_t kHop = 1;
static Clock plus_hops(Clock c, uint32_t hops) {
  c.hops += hops;
  return c;
}
static Timed plus_hops(Timed t, uint32_t hops) {
  t.hops += hops;
  return t;
}
static Stamp plus_hops(Stamp s, uint32_t hops) {
  s.c.hops += hops;
  s.t.hops += hops;
  return s;
}
static Timed plus_l2(Timed t) {
  t.l2 += 1;
  return t;
}
static Timed plus_wait(Timed t) {
  t.waits += 1;
  return t;
}
static Timed plus_dsm(Timed t) {
  t.dsm += 1;
  return t;
}
// A stamp word: the launch (16 bits), the planner's chain (hops, fences: 8 bits each), the calibrated
// model's chain (hops, l2, atomics, waits: 8 bits each), each saturating at 255.
static uint64_t sat8(uint32_t v) { return v < 0xff ? v : 0xff; }
static uint64_t encode(const Stamp& s) {
  return (uint64_t(g_epoch & 0xffffu) << 48) | (sat8(s.c.hops) << 40) | (sat8(s.c.fences) << 32) |
         (sat8(s.t.hops) << 24) | (sat8(s.t.l2) << 16) | (sat8(s.t.atomics) << 8) | sat8(s.t.waits);
}
static Stamp decode(uint64_t v) {
  if (uint32_t(v >> 48) != (g_epoch & 0xffffu)) return Stamp{};
  Stamp s;
  s.c = Clock{uint32_t(v >> 40) & 0xffu, uint32_t(v >> 32) & 0xffu};
  s.t.hops = uint32_t(v >> 24) & 0xffu;
  s.t.l2 = uint32_t(v >> 16) & 0xffu;
  s.t.atomics = uint32_t(v >> 8) & 0xffu;
  s.t.waits = uint32_t(v) & 0xffu;
  return s;
}
static uint32_t encode_timed(const Timed& t) {
  return uint32_t(sat8(t.hops) << 24 | sat8(t.l2) << 16 | sat8(t.atomics) << 8 | sat8(t.waits));
}
// Shadow of one 4-byte word: the stamp of its last write, the stamp of the write before, and the
// value before (a flag's previous epoch): a waiter for epoch e of a flag that its one writer has
// already moved to e + 1 still finds e's stamp (count_wait_end), so that how late a waiter
// looks never changes its count. A writer is at most one epoch ahead of a waiter (it needs the
// waiter's own signal to pass the next barrier).
struct StampWord {
  uint64_t cur, prev, prev_value;
};
static_assert(sizeof(StampWord) == 8 * STAMP_WORDS_PER_WORD, "stamp shadow layout");
static StampWord* stamp_words(const Region& r, int rank, uint64_t off) {
  return r.stamps[rank] ? reinterpret_cast<StampWord*>(r.stamps[rank]) + off / 4 : nullptr;
}
static uint64_t words_of(uint64_t off, unsigned bytes) { return (off % 4 + bytes + 3) / 4; }
static Stamp read_stamps(const Region& r, int rank, uint64_t off, unsigned bytes) {
  Stamp s;
  if (StampWord* p = stamp_words(r, rank, off))
    for (uint64_t i = 0, n = words_of(off, bytes); i < n; ++i)
      s.join(decode(__atomic_load_n(&p[i].cur, __ATOMIC_SEQ_CST)));
  return s;
}
// join: keep the later of the old stamp and `c`, per chain (reductions: a reader depends on every adder).
static void write_stamps(const Region& r, int rank, uint64_t off, unsigned bytes, const Stamp& c, bool join) {
  StampWord* p = stamp_words(r, rank, off);
  if (!p) return;
  const uint64_t v = encode(c);
  const uint32_t* data = reinterpret_cast<const uint32_t*>(r.base[rank] + off / 4 * 4);
  for (uint64_t i = 0, n = words_of(off, bytes); i < n; ++i) {
    if (!join) {
      // prev, then prev_value, then cur: the order count_wait_end's reader relies on
      __atomic_store_n(&p[i].prev, __atomic_load_n(&p[i].cur, __ATOMIC_SEQ_CST), __ATOMIC_SEQ_CST);
      __atomic_store_n(&p[i].prev_value, uint64_t(__atomic_load_n(data + i, __ATOMIC_SEQ_CST)), __ATOMIC_SEQ_CST);
      __atomic_store_n(&p[i].cur, v, __ATOMIC_SEQ_CST);
      continue;
    }
    uint64_t old = __atomic_load_n(&p[i].cur, __ATOMIC_SEQ_CST);
    for (;;) {
      Stamp merged = decode(old);
      merged.join(c);
      const uint64_t nv = encode(merged);
      if (nv == old || __atomic_compare_exchange_n(&p[i].cur, &old, nv, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
        break;
    }
  }
}
// The stamp a store issued now by a thread at `s` leaves in the copy it lands in (-1: every copy).
static Stamp stamp_for(const Region& r, int rank, const Stamp& s) { return rank == r.rank ? s : plus_hops(s, kHop); }
static Stamp ready_stamp(const Fiber& f) { return Stamp{f.ready(), f.tready()}; }
static void stamp_store(const PendingStore& s, bool join) {
  if (s.key_region < 0) return;
  const Region& r = g_regions[s.key_region];
  for (int p = 0; p < r.nranks; ++p)
    if (s.key_rank < 0 || s.key_rank == p) write_stamps(r, p, s.key_off, s.bytes, s.stamp, join);
}
// When a load issued now by `f` returns a word stamped `seen`: at once from this rank's memory,
// after a round trip from a peer's (or the switch's).
static Clock arrival(const Fiber& f, bool own, Clock seen) {
  return own ? later(f.clock, seen) : later(plus_hops(f.clock, 2 * kHop), plus_hops(seen, kHop));
}
// The calibrated model's (Timed) arrival: a load of this rank's memory is one L2 round trip after the later
// of its issue and the word's landing; a peer's or the switch's, a round trip of two hops.
static Timed t_arrival(const Fiber& f, bool own, const Timed& seen) {
  return own ? plus_l2(later(f.tbase, seen)) : later(plus_hops(f.tbase, 2 * kHop), plus_hops(seen, kHop));
}
// The model's load, issued at the thread's base, read the value at `seen` only if it had landed by then (or
// is the thread's own store).
static bool fresh(const Fiber& f, const Timed& seen) { return later(f.tbase, f.own_max) < seen; }
// A control advance other than a batch wait: later loads issue from here.
static void set_base(Fiber& f) {
  f.tbase = f.tclock;
  f.own_max = Timed{};
}

// ---- the calibrated model's waits (Timed), stated once (t_wait_end):
// - a marked wait (count_wait_begin/end) of this rank's memory ends one L2 round trip (a `wait`) after
//   the later of the thread's control clock and the awaited value's landing, whether or not the value
//   was already there: so a wait that starts after another wait of the thread ended costs a round trip
//   after that end (the poll's re-load), and the count does not depend on timing;
// - an unmarked strong load of this rank's memory whose value landed after the load's issue (its stamp
//   later than the thread's ready clock) read the old value in the model, so the kernel, which checks the
//   value, waits for it: a wait at that load's place in program order (`pending`), applied when the thread
//   next waits for bytes it loaded later, or at its next control advance, store or exit (count_settle);
// - a marked wait on bytes the thread loaded unmarked before it (a Lamport batch then its checks) is a
//   wait only if the model's load had not seen the value (its landing later than that load's issue);
//   otherwise the model's load already had it (one L2 round trip, data clock only). Whether the kernel
//   actually entered the wait (a timing question) thus changes nothing;
// - waits are applied in the order of the loads they check, which is the kernels' order (a batch of
//   loads, then a check of each in turn).
// - a multi-slot poll (count_poll_begin/end: a first pass of loads, then passes that re-load every slot
//   still outstanding, as FlashInfer's and NCCL LL's polls) is ONE wait: the slots of its first pass whose
//   value landed after that load's issue end together, one round trip after the later of the thread's
//   control and the last of them landing; the others were there (one L2 round trip, data clock only).
//   Whether the kernel re-polled (timing) changes nothing, as for a single slot.
static constexpr size_t kMaxBatch = 1024;
static void apply_wait(Fiber& f, const Timed& seen) {
  f.tclock = plus_wait(later(f.tclock, seen));
  f.tdata.join(f.tclock);
}
static void settle_below(Fiber& f, uint32_t seq) {
  for (BatchLoad& l : f.batch)
    if (l.pending && l.seq < seq) {
      apply_wait(f, l.seen);
      l.pending = false;
    }
}
// Every wait the thread owes, before its chain is read (a store, an atomic, a fence, a barrier, its exit).
void count_settle(Fiber& f) { settle_below(f, UINT32_MAX); }
// A control advance other than a marked wait ends the batch.
static void end_batch(Fiber& f) {
  count_settle(f);
  f.batch.clear();
}

// A load by the running thread saw copy `rank` (-1: every copy, through ld_reduce) at `off`.
// Inside a wait (count_wait_begin) loads are polls: only the awaited value counts, at its end.
static void observe(Block& b, const Where& w, unsigned bytes, const void* p) {
  if (b.cur->waiting) return;
  Fiber& f = *b.cur;
  if (w.region < 0) {  // memory outside the pool (this GPU's): one L2 round trip, no stamp
    f.tdata.join(plus_l2(f.tbase));
    return;
  }
  const Region& r = g_regions[w.region];
  Stamp seen;
  for (int q = 0; q < r.nranks; ++q)
    if (w.rank < 0 || w.rank == q) seen.join(read_stamps(r, q, w.off, bytes));
  const bool own = w.rank == r.rank;
  f.data.join(arrival(f, own, seen.c));
  if (!own) {
    f.tdata.join(t_arrival(f, false, seen.t));
    return;
  }
  if (f.batch.size() >= kMaxBatch) end_batch(f);
  BatchLoad l{reinterpret_cast<uint64_t>(p) / 16, f.load_seq++, false, f.tbase, later(f.tbase, f.own_max), seen.t};
  l.poll = f.poll_open;
  if (fresh(f, seen.t)) {
    l.pending = true;  // the model's load read the old value: a wait, applied in program order
    f.tdata.join(plus_l2(f.tbase));
  } else {
    f.tdata.join(t_arrival(f, true, seen.t));
  }
  f.batch.push_back(l);
}
// A system-scope fence or release waits for the thread's stores to land.
static void count_fence(Block& b) {
  Fiber& f = *b.cur;
  f.clock = plus_hops(f.ready(), kHop);
  f.clock.fences += 1;
  end_batch(f);
  f.tclock = plus_hops(f.tready(), kHop);
  set_base(f);
}
// Bytes in flight: a CTA's loads issued at one control point (its barrier generation and the issuing
// thread's Timed control clock) are in flight together; a wait, an atomic, a fence or a barrier moves the
// control point on. Loads of a peer or through the switch are remote (a round trip of two hops).
static void count_load_bytes(Block& b, const void* p, unsigned bytes, bool remote, bool vector = false) {
  if (b.cur->waiting || (bytes < 8 && !vector)) return;
  if (!b.cur->loaded.insert(reinterpret_cast<uint64_t>(p) / 16).second) return;
  b.bytes_moved += bytes;
  b.load_bytes += bytes;
  if (remote) b.remote_load_bytes += bytes;
  b.inflight[uint64_t(b.bar_gen) << 32 | encode_timed(b.cur->tbase)] += bytes;
}
void count_wait_begin() {
  Block* b = tl_block;
  if (b && b->cur && counting()) ++b->cur->waiting;
}

// The calibrated model's end of a marked wait whose awaited value landed at `seen` (Timed), on bytes at p.
static void t_wait_end(Fiber& f, const void* p, bool own, const Timed& seen) {
  if (!own) {  // a poll of a peer's memory or the switch: each re-load a round trip
    count_settle(f);
    f.tclock = later(plus_hops(f.tclock, 2 * kHop), plus_hops(seen, kHop));
    f.tdata.join(f.tclock);
    set_base(f);
    return;
  }
  const uint64_t g = reinterpret_cast<uint64_t>(p) / 16;
  for (size_t i = f.batch.size(); i-- > 0;) {
    BatchLoad& l = f.batch[i];
    if (l.granule != g) continue;
    if (!(l.issue_ready < seen)) {  // the model's load had the value: no wait
      f.tdata.join(plus_l2(later(l.issue_ctrl, seen)));
      return;
    }
    // (issue_ctrl and issue_ready: the thread's base, and base joined with its own stores, at the load)
    settle_below(f, l.seq);
    l.pending = false;
    apply_wait(f, seen);
    return;
  }
  count_settle(f);
  apply_wait(f, seen);
  set_base(f);  // a wait the kernel always enters (its first check is inside it): loads issue after it
}

void count_poll_begin() {
  Block* b = tl_block;
  if (!b || !b->cur || !counting()) return;
  b->cur->poll_open = true;
}
// The end of a multi-slot poll (the rule above, "a multi-slot poll"). Every slot's value is still the one the
// poll accepted: its one writer wrote it in this launch and nothing overwrites it before the kernel ends
// (lamport_rotation.cuh), so its stamps are read here, whichever pass saw it.
void count_poll_end(int repolled, int arrived) {
  Block* b = tl_block;
  if (!b || !b->cur || !counting()) return;
  Fiber& f = *b->cur;
  if (repolled && f.waiting) --f.waiting;
  if (!f.poll_open) return;
  f.poll_open = false;
  size_t first = f.batch.size();
  for (size_t i = 0; i < f.batch.size(); ++i)
    if (f.batch[i].poll) {
      first = i;
      break;
    }
  if (first == f.batch.size()) return;  // no first-pass load of this rank's memory (or the batch ended)
  if (!arrived) {  // a timeout or an abort: no value was consumed
    for (size_t i = first; i < f.batch.size(); ++i) f.batch[i].poll = f.batch[i].pending = false;
    return;
  }
  settle_below(f, f.batch[first].seq);  // waits the thread owed before the poll
  bool wait = false;
  Timed last;
  for (size_t i = first; i < f.batch.size(); ++i) {
    BatchLoad& l = f.batch[i];
    if (!l.poll) continue;
    l.poll = l.pending = false;
    const uint64_t a = l.granule * 16;
    const Where w = locate(a);
    if (w.region < 0 || w.rank < 0) continue;
    const Stamp seen = read_stamps(g_regions[w.region], w.rank, w.off, 16);
    count_load_bytes(*b, reinterpret_cast<const void*>(a), 16, false);
    f.data.join(arrival(f, true, seen.c));
    if (l.issue_ready < seen.t) {  // the model's first load read the old value: the poll waits for it
      last.join(seen.t);
      wait = true;
    } else {
      f.tdata.join(plus_l2(later(l.issue_ctrl, seen.t)));
    }
  }
  if (repolled) f.clock.join(f.data);  // what the poll waited for decides what the thread does next
  if (wait) apply_wait(f, last);
}

void count_wait_end(const void* p, unsigned bytes, int arrived, int has_target, uint32_t target) {
  Block* b = tl_block;
  if (!b || !b->cur || !counting() || !b->cur->waiting) return;
  --b->cur->waiting;
  if (!arrived) return;  // a timeout or an abort: no value was consumed
  const Where w = locate(reinterpret_cast<uint64_t>(p));
  Fiber& f = *b->cur;
  if (w.region < 0) {  // memory outside the pool: this GPU's (a flag in device memory)
    count_load_bytes(*b, p, bytes, false);
    f.clock.join(f.data);
    t_wait_end(f, p, true, Timed{});
    return;
  }
  const bool own = w.rank == g_regions[w.region].rank;
  count_load_bytes(*b, p, bytes, !own);
  if (!has_target || w.rank < 0) {
    Stamp seen;
    const Region& r = g_regions[w.region];
    for (int q = 0; q < r.nranks; ++q)
      if (w.rank < 0 || w.rank == q) seen.join(read_stamps(r, q, w.off, bytes));
    f.data.join(arrival(f, own, seen.c));
    f.clock.join(f.data);  // what the wait polled for decides what the thread does next
    t_wait_end(f, p, own, seen.t);
    return;
  }
  // the write that stored `target` (a flag's epoch), whether or not it has been overwritten since
  const Region& r = g_regions[w.region];
  StampWord* s = stamp_words(r, w.rank, w.off);
  if (!s) return;
  // The one writer stores prev, then prev_value, then cur (write_stamps). prev_value == target: the
  // write of target is overwritten and prev is already its stamp. Otherwise cur is target's stamp,
  // unless the writer moved on while we read it: prev_value changed then, and we read again.
  Stamp seen;
  for (;;) {
    const uint64_t before = __atomic_load_n(&s->prev_value, __ATOMIC_SEQ_CST);
    if (uint32_t(before) == target) {
      seen = decode(__atomic_load_n(&s->prev, __ATOMIC_SEQ_CST));
      break;
    }
    seen = decode(__atomic_load_n(&s->cur, __ATOMIC_SEQ_CST));
    if (__atomic_load_n(&s->prev_value, __ATOMIC_SEQ_CST) == before) break;
  }
  f.clock = arrival(f, own, seen.c);
  t_wait_end(f, p, own, seen.t);
}

void count_cluster_arrive(Fiber& f, Clock& c, Timed& t) {
  end_batch(f);
  c = f.ready();
  t = later(f.tready(), f.dsm_landed);
  f.dsm_landed = Timed{};
}

void count_cluster_wait(Fiber& f, const Clock& c, const Timed& t) {
  end_batch(f);
  Timed done = t;
  done.csyncs += 1;
  f.clock = f.data = later(f.ready(), c);
  f.tclock = f.tdata = later(f.tready(), done);
  set_base(f);
}

void join_clocks(Fiber* const* fibers, unsigned n) {
  Clock m;
  Timed t;
  for (unsigned i = 0; i < n; ++i) {
    end_batch(*fibers[i]);
    m.join(fibers[i]->ready());
    t.join(fibers[i]->tready());
  }
  for (unsigned i = 0; i < n; ++i) {
    fibers[i]->clock = fibers[i]->data = m;
    fibers[i]->tclock = fibers[i]->tdata = t;
    set_base(*fibers[i]);
  }
}

// A launch's count words (emu_api.h): the planner's chain, the bytes, then the calibrated model's chain and
// the loads of the CTA that needs the most rounds of its bytes in flight (ties: the most bytes).
void count_launch_words(const Block* blocks, int nblocks, uint64_t* words) {
  Clock longest;
  Timed tlongest;
  uint64_t most = 0, total = 0, rounds = 0, loads = 0, inflight = 0, remote = 0;
  for (int i = 0; i < nblocks; ++i) {
    const Block& b = blocks[i];
    longest.join(b.end_clock);
    tlongest.join(b.t_end);
    most = b.bytes_moved > most ? b.bytes_moved : most;
    total += b.bytes_moved;
    uint64_t depth = 0;
    for (const auto& kv : b.inflight) depth = kv.second > depth ? kv.second : depth;
    const uint64_t r = depth ? (b.load_bytes + depth - 1) / depth : 0;
    if (r > rounds || (r == rounds && b.load_bytes > loads)) {
      rounds = r;
      loads = b.load_bytes;
      inflight = depth;
      remote = b.remote_load_bytes;
    }
  }
  uint64_t mc_ld = 0, mc_st = 0;
  for (int i = 0; i < nblocks; ++i) {
    mc_ld += blocks[i].traffic.mc_ld_bytes;
    mc_st += blocks[i].traffic.mc_store_bytes + blocks[i].traffic.mc_red_bytes;
  }
  const uint64_t w[UBNEXT_EMU_COUNT_WORDS] = {
      uint64_t(nblocks), longest.hops, longest.fences, most,   total, tlongest.hops, tlongest.l2,  tlongest.atomics,
      tlongest.waits,    loads,        inflight,       remote, mc_ld, mc_st,         tlongest.dsm, tlongest.csyncs};
  memcpy(words, w, sizeof w);
}

// ------------------------------------------------------------------------------ traffic
static std::mutex g_traffic_mutex;
static Traffic g_traffic{};
void reset_traffic() {
  std::lock_guard<std::mutex> lk(g_traffic_mutex);
  g_traffic = Traffic{};
}
void merge_traffic(const Traffic& t) {
  std::lock_guard<std::mutex> lk(g_traffic_mutex);
  g_traffic.add(t);
}
static void count_unicast(Block& b, const Where& w, unsigned bytes, bool store) {
  if (w.region < 0 || w.rank < 0 || w.rank == g_regions[w.region].rank) return;
  if (store) {
    b.traffic.peer_store_bytes[w.rank] += bytes;
    b.traffic.peer_store_ops[w.rank] += 1;
  } else {
    b.traffic.peer_load_bytes[w.rank] += bytes;
    b.traffic.peer_load_ops[w.rank] += 1;
  }
}

// ------------------------------------------------------------------------------ raw access
static inline void words_load(void* dst, const void* src, unsigned bytes, int mo) {
  if (bytes == 1) {
    *static_cast<uint8_t*>(dst) = __atomic_load_n(static_cast<const uint8_t*>(src), mo);
    return;
  }
  if (bytes == 2) {
    const uint16_t h = __atomic_load_n(static_cast<const uint16_t*>(src), mo);
    memcpy(dst, &h, 2);
    return;
  }
  const uint32_t* s = static_cast<const uint32_t*>(src);
  uint32_t* d = static_cast<uint32_t*>(dst);
  for (unsigned i = 0; i < bytes / 4; ++i) d[i] = __atomic_load_n(s + i, mo);
}
static inline void words_store(void* dst, const void* src, unsigned bytes, int mo) {
  if (bytes == 1) {
    __atomic_store_n(static_cast<uint8_t*>(dst), *static_cast<const uint8_t*>(src), mo);
    return;
  }
  if (bytes == 2) {
    uint16_t h;
    memcpy(&h, src, 2);
    __atomic_store_n(static_cast<uint16_t*>(dst), h, mo);
    return;
  }
  uint32_t* d = static_cast<uint32_t*>(dst);
  const uint32_t* s = static_cast<const uint32_t*>(src);
  for (unsigned i = 0; i < bytes / 4; ++i) __atomic_store_n(d + i, s[i], mo);
}

// Ranks of a region in the order a multicast operation visits them: random in chaos mode.
static int rank_order(Block* b, const Region& r, int* order) {
  for (int i = 0; i < r.nranks; ++i) order[i] = i;
  if (b && b->chaos)
    for (int i = r.nranks - 1; i > 0; --i) std::swap(order[i], order[b->rng.below(uint32_t(i) + 1)]);
  return r.nranks;
}

static void commit(Block* b, const PendingStore& s, int mo) {
  if (counting()) stamp_store(s, false);
  if (!s.mc) {
    words_store(reinterpret_cast<void*>(s.addr), s.data, s.bytes, mo);
    return;
  }
  const Region& r = g_regions[s.key_region];
  int order[UBNEXT_EMU_MAX_RANKS];
  const int n = rank_order(b, r, order);
  for (int i = 0; i < n; ++i) words_store(reinterpret_cast<void*>(r.base[order[i]] + s.key_off), s.data, s.bytes, mo);
}

// ------------------------------------------------------------------------------ store buffers
static bool overlaps(const PendingStore& s, const Where& w, unsigned bytes) {
  if (s.key_region != w.region) return false;
  if (s.key_rank >= 0 && w.rank >= 0 && s.key_rank != w.rank) return false;
  return s.key_off < w.off + bytes && w.off < s.key_off + s.bytes;
}

static void commit_at(Block& b, std::vector<PendingStore>& buf, size_t i) {
  commit(&b, buf[i], __ATOMIC_RELAXED);
  // A store that lands is progress a peer may be polling for: the block must not back off (sleep)
  // while its buffers still drain one store per round, or chaos mode pays a sleep per store.
  b.progress = true;
  buf[i] = buf.back();
  buf.pop_back();
}

// Entries of one buffer never overlap each other (see buffer_store), so any order is coherent.
void drain_all(Block& b, std::vector<PendingStore>& buf) {
  while (!buf.empty()) commit_at(b, buf, b.chaos ? b.rng.below(uint32_t(buf.size())) : 0);
}

static void drain_overlapping(Block& b, const Where& w, unsigned bytes) {
  // Stores that passed a __syncthreads are older than the thread's own buffered ones.
  for (std::vector<PendingStore>* buf : {&b.cumulative, &b.cur->sbuf})
    for (size_t i = 0; i < buf->size();)
      if (overlaps((*buf)[i], w, bytes)) commit_at(b, *buf, i);
      else ++i;
}

static void drain_for_release(Block& b) {
  drain_all(b, b.cumulative);
  drain_all(b, b.cur->sbuf);
}
void release_stores(Block& b) { drain_for_release(b); }

static constexpr size_t kMaxBuffered = 64;

// A store as the store buffer keeps it: where it lands, whatever alias it was issued through.
static PendingStore pending(const Where& w, uint64_t addr, const void* src, unsigned bytes, bool mc, Stamp clock) {
  PendingStore s;
  s.addr = addr;
  s.bytes = bytes;
  s.mc = mc;
  s.key_region = w.region;
  s.key_rank = mc ? -1 : w.rank;
  s.key_off = w.off;
  memcpy(s.data, src, bytes);
  s.stamp = w.region >= 0 && !mc ? stamp_for(g_regions[w.region], w.rank, clock) : plus_hops(clock, kHop);
  return s;
}

static void buffer_store(Block& b, const PendingStore& s) {
  const Where w{s.key_region, s.key_rank, s.key_off};
  drain_overlapping(b, w, s.bytes);  // the older store to these bytes must land first
  std::vector<PendingStore>& buf = b.cur->sbuf;
  buf.push_back(s);
  if (buf.size() > kMaxBuffered) commit_at(b, buf, b.rng.below(uint32_t(buf.size())));
}

// Lets out, with probability 1/one_in, ONE entry of `buf` chosen at random. Without a fence,
// release or kernel end, buffered stores leave only this way (or, the same, on buffer overflow):
// one at a time, in random order, so that no drain implies an order between a thread's stores.
static void drain_one_maybe(Block& b, std::vector<PendingStore>& buf, uint32_t one_in) {
  if (!buf.empty() && b.rng.one_in(one_in)) commit_at(b, buf, b.rng.below(uint32_t(buf.size())));
}

// Eventual visibility for the running thread (hardware drains eventually, and a waiting thread
// must not deadlock on its own buffered signal): at every twin access, and (more rarely, so as
// not to shorten the reordering window of a thread that pauses between its accesses) at every
// spin_pause / __nanosleep, so that a thread polling plain __shared__ memory drains too.
static void drain_some(Block& b, uint32_t one_in) {
  drain_one_maybe(b, b.cur->sbuf, one_in);
  drain_one_maybe(b, b.cumulative, 2 * one_in);
}

void chaos_spin(Block& b) {
  if (b.chaos && b.cur) drain_some(b, 16);
}

// Eventual visibility for threads that are parked (waiting in __syncthreads or a warp op for
// threads that may themselves wait on a peer that waits on these very stores): the scheduler calls
// this after every round, and each parked thread's buffer loses one random entry with probability
// 1/2. The entries stay in their thread's own buffer until then, so everything else holds: the
// thread's later fence/release drains them, a completed barrier moves them to `cumulative`, its
// loads see them. Nothing here orders them (any entry may leave first, a fence is still needed).
void chaos_round(Block& b) {
  if (!b.chaos) return;
  for (Fiber& f : b.fibers)
    if (f.state == kWaitBarrier || f.state == kWaitWarp || f.state == kWaitCluster) drain_one_maybe(b, f.sbuf, 2);
  drain_one_maybe(b, b.cumulative, 8);  // even when no thread of the block accesses memory any more
}

// Chaos at every access: let some buffered stores out, and delay this thread or the whole block.
static void chaos_point(Block& b) {
  drain_some(b, 4);
  if (b.rng.one_in(16))
    for (uint32_t k = 1 + b.rng.below(4); k; --k) yield_fiber(false);
  if (b.rng.one_in(512)) {
    timespec ts{0, long(b.rng.below(200)) * 1000};
    nanosleep(&ts, nullptr);
  }
}

// Common entry of every twin: the scheduling point, then chaos. Returns the calling block, or
// null when called outside a launch (then the twin acts directly).
static Block* enter(bool work) {
  Block* b = tl_block;
  if (!b || !b->cur) return nullptr;
  yield_fiber(work);
  if (b->chaos) chaos_point(*b);
  return b;
}

static int memorder(int order, bool is_load) {
  switch (order) {
    case kAcquire: return __ATOMIC_ACQUIRE;
    case kRelease: return __ATOMIC_RELEASE;
    case kAcqRel: return is_load ? __ATOMIC_ACQUIRE : __ATOMIC_ACQ_REL;
    default: return __ATOMIC_RELAXED;
  }
}

static const Region& mc_region(const Where& w, const void* p, const char* what) {
  if (w.region < 0 || w.rank >= 0) {
    char msg[160];
    snprintf(msg, sizeof msg, "%s on %p, which is not in a registered multicast range", what, p);
    if (tl_block && tl_block->cur) {
      fprintf(stderr, "ubnext emulator: %s\n", msg);
      trap();
    }
    fprintf(stderr, "ubnext emulator: %s\n", msg);
    abort();
  }
  return g_regions[w.region];
}

// ------------------------------------------------------------------------------ proxies
static constexpr size_t kMaxShadows = 256;  // beyond that the oldest is forgotten (as if fenced)
static constexpr uint32_t kMaxStaleLoads = 8;

static bool shadow_overlaps(const McShadow& s, const Where& w, unsigned bytes) {
  return s.region == w.region && s.off < w.off + bytes && w.off < s.off + s.bytes;
}

// Before a multicast store of the running thread (chaos mode): remember every copy's old bytes.
static void shadow_mc_store(Block& b, const Where& w, const Region& r, unsigned bytes) {
  std::vector<McShadow>& sh = b.cur->mc_shadow;
  for (size_t i = 0; i < sh.size();)
    if (shadow_overlaps(sh[i], w, bytes)) sh.erase(sh.begin() + long(i));
    else ++i;
  if (sh.size() >= kMaxShadows) sh.erase(sh.begin());
  McShadow s{};
  s.region = w.region;
  s.off = w.off;
  s.bytes = bytes;
  s.stale_loads = 1 + b.rng.below(kMaxStaleLoads);
  for (int p = 0; p < r.nranks; ++p)
    words_load(s.old[p], reinterpret_cast<const void*>(r.base[p] + w.off), bytes, __ATOMIC_RELAXED);
  sh.push_back(s);
}

// A unicast load of the running thread: bytes it stored through multicast and has not fenced read old.
static void shadow_load(Block& b, const Where& w, void* dst, unsigned bytes) {
  if (w.region < 0 || w.rank < 0) return;
  std::vector<McShadow>& sh = b.cur->mc_shadow;
  for (size_t i = 0; i < sh.size();) {
    McShadow& s = sh[i];
    if (!shadow_overlaps(s, w, bytes)) {
      ++i;
      continue;
    }
    const uint64_t lo = s.off > w.off ? s.off : w.off;
    const uint64_t hi = (s.off + s.bytes < w.off + bytes) ? s.off + s.bytes : w.off + bytes;
    memcpy(static_cast<char*>(dst) + (lo - w.off), reinterpret_cast<const char*>(s.old[w.rank]) + (lo - s.off),
           size_t(hi - lo));
    if (--s.stale_loads == 0) sh.erase(sh.begin() + long(i));  // the store has reached this thread's view
    else ++i;
  }
}

// A unicast store or atomic of the running thread: its own newer bytes end the window for them.
static void shadow_forget(Block& b, const Where& w, unsigned bytes) {
  std::vector<McShadow>& sh = b.cur->mc_shadow;
  for (size_t i = 0; i < sh.size();)
    if (w.rank >= 0 && shadow_overlaps(sh[i], w, bytes)) sh.erase(sh.begin() + long(i));
    else ++i;
}

void fence_proxy_alias() {
  if (Block* b = enter(true)) {
    b->cur->mc_shadow.clear();
    if (counting()) count_fence(*b);
  }
}

// PDL (ptx.cuh griddep_wait): in a launch with the attribute, a thread touches memory only after its
// griddepcontrol.wait. Plain scalar accesses of kernel code are not seen (only the twins and vector
// accesses are), so a scalar read before the wait would go unnoticed; every kernel waits at its entry.
static void griddep_check(Block& b, const void* p, const char* access) {
  if (b.pdl && !b.cur->griddep_waited) griddep_violation(p, access);
}

void griddep_wait() {
  if (Block* b = enter(true)) b->cur->griddep_waited = true;
}

void griddep_launch_dependents() {
  if (Block* b = enter(true)) b->cur->griddep_launched = true;
}

// ------------------------------------------------------------------------------ twins
void mem_load(void* dst, const void* src, unsigned bytes, int order) {
  if (bytes >= 8) check_aligned(src, bytes, "vector load");
  Block* b = enter(false);
  Where w{-1, -1, 0};
  if (b) {
    griddep_check(*b, src, "load");
    w = locate(reinterpret_cast<uint64_t>(src));
    drain_overlapping(*b, w, bytes);
    count_unicast(*b, w, bytes, false);
  }
  words_load(dst, src, bytes, memorder(order, true));
  if (b && !b->cur->mc_shadow.empty()) shadow_load(*b, w, dst, bytes);
  if (b && counting()) {
    count_load_bytes(*b, src, bytes, w.region >= 0 && w.rank != g_regions[w.region].rank);
    observe(*b, w, bytes, src);
  }
}

void mem_store(void* dst, const void* src, unsigned bytes, int order) {
  if (bytes >= 8) check_aligned(dst, bytes, "vector store");
  Block* b = enter(true);
  if (b) {
    griddep_check(*b, dst, "store");
    const Where w = locate(reinterpret_cast<uint64_t>(dst));
    count_unicast(*b, w, bytes, true);
    if (!b->cur->mc_shadow.empty()) shadow_forget(*b, w, bytes);
    if (order == kRelease || order == kAcqRel) {
      drain_for_release(*b);
      if (counting() && order == kRelease) count_fence(*b);
    }
    if (counting()) {
      if (bytes >= 8) b->bytes_moved += bytes;
      count_settle(*b->cur);  // the store's value may be what the thread waited for
      if (w.region >= 0 && w.rank == g_regions[w.region].rank) b->cur->own_max.join(b->cur->tready());
      PendingStore s = pending(w, reinterpret_cast<uint64_t>(dst), src, bytes, false, ready_stamp(*b->cur));
      if (b->chaos && order == kRelaxed) {
        buffer_store(*b, s);
        return;
      }
      stamp_store(s, false);
    } else if (b->chaos && order == kRelaxed) {
      buffer_store(*b, pending(w, reinterpret_cast<uint64_t>(dst), src, bytes, false, Stamp{}));
      return;
    }
  }
  words_store(dst, src, bytes, memorder(order, false));
}

// A release (a store's or a red's) at system scope waits for the thread's stores to land (count_fence: one
// hop). One at GPU scope is priced as a drain only: the model has no store acknowledgment inside one GPU, and
// ubnext's one GPU-scope release (the Lamport count, lamport_rotation.cuh) comes before the thread's first
// store. An acq_rel atomic gets no hop either: it is priced as an atomic (observe_result), whose measured
// cost (the one-GPU check's atom.acq_rel.gpu chain) includes its ordering.
static Where before_atomic(Block& b, const void* p, int order, int scope = kScopeSys) {
  griddep_check(b, p, "atomic");
  const Where w = locate(reinterpret_cast<uint64_t>(p));
  count_unicast(b, w, 4, true);
  if (w.region >= 0 && w.rank >= 0 && w.rank != g_regions[w.region].rank) b.traffic.peer_atomic_ops += 1;
  if (!b.cur->mc_shadow.empty()) shadow_forget(b, w, 4);
  if (order == kRelease || order == kAcqRel) drain_for_release(b);
  else drain_overlapping(b, w, 4);
  if (counting()) {
    if (order == kRelease && scope == kScopeSys) count_fence(b);
    end_batch(*b.cur);
    if (w.region >= 0 && w.rank >= 0) {
      const Region& r = g_regions[w.region];
      write_stamps(r, w.rank, w.off, 4, stamp_for(r, w.rank, ready_stamp(*b.cur)), true);
    }
  }
  return w;
}

// The old value an atomic returns decides what the thread does next ("am I the last block?").
// Calibrated model: an atomic (GPU or system scope) whose result the thread waits for costs one `atomic`
// after the later of its issue and the word's last update, plus the round trip to a peer's memory.
static void observe_result(Block& b, const Where& w) {
  Fiber& f = *b.cur;
  if (f.waiting) return;  // a poll made of atomics: its wait counts, at its end
  Timed seen;
  bool own = true;
  if (w.region >= 0) {
    const Region& r = g_regions[w.region];
    Stamp s;
    for (int q = 0; q < r.nranks; ++q)
      if (w.rank < 0 || w.rank == q) s.join(read_stamps(r, q, w.off, 4));
    own = w.rank == r.rank;
    f.data.join(arrival(f, own, s.c));
    seen = s.t;
  }
  f.clock.join(f.data);
  Timed t = own ? later(f.tready(), seen) : later(plus_hops(f.tready(), 2 * kHop), plus_hops(seen, kHop));
  t.atomics += 1;
  f.tclock = t;
  f.tdata.join(t);
  set_base(f);
}

uint32_t atomic_add_u32(uint32_t* p, uint32_t v, int order) {
  Block* b = enter(true);
  Where w{-1, -1, 0};
  if (b) w = before_atomic(*b, p, order);
  const uint32_t old = __atomic_fetch_add(p, v, memorder(order, false));
  if (b && counting()) observe_result(*b, w);
  return old;
}

void red_add_u32(uint32_t* p, uint32_t v, int order, int scope) {
  if (Block* b = enter(true)) before_atomic(*b, p, order, scope);
  __atomic_fetch_add(p, v, memorder(order, false));
}

uint32_t atomic_cas_u32(uint32_t* p, uint32_t cmp, uint32_t val, int order) {
  Block* b = enter(true);
  Where w{-1, -1, 0};
  if (b) w = before_atomic(*b, p, order);
  const int mo = memorder(order, false);
  __atomic_compare_exchange_n(p, &cmp, val, false, mo,
                              mo == __ATOMIC_RELEASE   ? __ATOMIC_RELAXED
                              : mo == __ATOMIC_ACQ_REL ? __ATOMIC_ACQUIRE
                                                       : mo);
  if (b && counting()) observe_result(*b, w);
  return cmp;
}

void fence(int scope) {
  if (Block* b = enter(true)) {
    drain_for_release(*b);
    if (counting() && scope == kScopeSys) count_fence(*b);
    else if (counting()) {
      end_batch(*b->cur);
      set_base(*b->cur);
    }
  }
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
}

// ld/st.shared::cluster (ptx.cuh): a sibling block's shared memory, or this block's through the cluster window.
void dsm_load(void* dst, uint64_t addr, unsigned bytes) {
  const void* p = reinterpret_cast<const void*>(addr);
  if (bytes >= 8) check_aligned(p, bytes, "ld.shared::cluster");
  Block* b = enter(false);
  unsigned rank = 0;
  if (b) {
    rank = dsm_check(addr, bytes, "ld.shared::cluster");
    drain_overlapping(*b, Where{-1, -1, addr}, bytes);  // it reads its own writes
  }
  words_load(dst, p, bytes, __ATOMIC_RELAXED);
  if (b && counting() && !b->cur->waiting && rank != b->crank) b->cur->tdata.join(plus_dsm(b->cur->tbase));
}

void dsm_store(uint64_t addr, const void* src, unsigned bytes) {
  void* p = reinterpret_cast<void*>(addr);
  if (bytes >= 8) check_aligned(p, bytes, "st.shared::cluster");
  Block* b = enter(true);
  if (b) {
    const unsigned rank = dsm_check(addr, bytes, "st.shared::cluster");
    if (counting()) {
      count_settle(*b->cur);
      if (rank != b->crank) b->cur->dsm_landed.join(plus_dsm(b->cur->tready()));
    }
    if (b->chaos) {  // relaxed: visible to the siblings after the thread's release (cluster arrive), or eventually
      buffer_store(*b, pending(Where{-1, -1, addr}, addr, src, bytes, false, Stamp{}));
      return;
    }
  }
  words_store(p, src, bytes, __ATOMIC_RELAXED);
}

// fp32 <-> 16-bit float conversions of the switch's reduction (round to nearest even).
static inline float f32_from_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
static inline uint32_t bits_from_f32(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
static inline float bf16_to_f32(uint16_t h) { return f32_from_bits(uint32_t(h) << 16); }
static inline uint16_t f32_to_bf16(float f) {
  uint32_t u = bits_from_f32(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
static inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ffu;
  if (e == 0x1f) return f32_from_bits(sign | 0x7f800000u | (m << 13));
  if (e == 0) return (sign ? -1.f : 1.f) * std::ldexp(float(m), -24);
  return f32_from_bits(sign | ((e + 112) << 23) | (m << 13));
}
static inline uint16_t f32_to_f16(float f) {
  uint32_t x = bits_from_f32(f);
  const uint16_t sign = uint16_t((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x > 0x7f800000u) return sign | 0x7e00u;
  if (x >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 rounds to infinity
  uint32_t r, rem, half;
  if (x < 0x38800000u) {  // below 2^-14: a half subnormal (or zero)
    if (x < 0x33000000u) return sign;
    const uint32_t e = x >> 23, m = (x & 0x7fffffu) | 0x800000u, shift = 126 - e;
    r = m >> shift;
    rem = m & ((1u << shift) - 1);
    half = 1u << (shift - 1);
  } else {
    x -= 0x38000000u;  // rebias the exponent from 127 to 15
    r = x >> 13;
    rem = x & 0x1fffu;
    half = 0x1000u;
  }
  if (rem > half || (rem == half && (r & 1u))) ++r;
  return uint16_t(sign | r);
}

void mc_ld_reduce(void* dst16, const void* mc, int mc_type) {
  check_aligned(mc, 16, "multimem.ld_reduce");
  Block* b = enter(false);
  const Where w = locate(reinterpret_cast<uint64_t>(mc));
  const Region& r = mc_region(w, mc, "multimem.ld_reduce");
  if (b) {
    griddep_check(*b, mc, "multimem.ld_reduce");
    drain_overlapping(*b, w, 16);
    b->traffic.mc_ld_bytes += 16;
    b->traffic.mc_ld_ops += 1;
  }
  int order[UBNEXT_EMU_MAX_RANKS];
  const int n = rank_order(b, r, order);
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int i = 0; i < n; ++i) {
    uint32_t v[4];
    words_load(v, reinterpret_cast<const void*>(r.base[order[i]] + w.off), 16, __ATOMIC_RELAXED);
    for (int k = 0; k < 4; ++k) {
      if (mc_type == kMcF32) {
        acc[k] += f32_from_bits(v[k]);
      } else {
        const uint16_t lo = uint16_t(v[k]), hi = uint16_t(v[k] >> 16);
        acc[2 * k] += mc_type == kMcBf16 ? bf16_to_f32(lo) : f16_to_f32(lo);
        acc[2 * k + 1] += mc_type == kMcBf16 ? bf16_to_f32(hi) : f16_to_f32(hi);
      }
    }
  }
  if (b && counting()) {
    count_load_bytes(*b, mc, 16, true);
    observe(*b, w, 16, mc);
  }
  uint32_t out[4];
  for (int k = 0; k < 4; ++k) {
    if (mc_type == kMcF32) out[k] = bits_from_f32(acc[k]);
    else if (mc_type == kMcBf16)
      out[k] = uint32_t(f32_to_bf16(acc[2 * k])) | uint32_t(f32_to_bf16(acc[2 * k + 1])) << 16;
    else out[k] = uint32_t(f32_to_f16(acc[2 * k])) | uint32_t(f32_to_f16(acc[2 * k + 1])) << 16;
  }
  memcpy(dst16, out, 16);
}

void mc_store(void* mc, const void* src, unsigned bytes, int order) {
  if (bytes >= 8) check_aligned(mc, bytes, "multimem.st");
  Block* b = enter(true);
  const Where w = locate(reinterpret_cast<uint64_t>(mc));
  mc_region(w, mc, "multimem.st");
  if (b) {
    griddep_check(*b, mc, "multimem.st");
    b->traffic.mc_store_bytes += bytes;
    b->traffic.mc_store_ops += 1;
    if (b->chaos) {
      drain_overlapping(*b, w, bytes);  // the thread's own older stores are part of "before"
      shadow_mc_store(*b, w, g_regions[w.region], bytes);
    }
    if (order == kRelease || order == kAcqRel) {
      drain_for_release(*b);
      if (counting() && order == kRelease) count_fence(*b);
    }
    if (counting() && bytes >= 8) b->bytes_moved += bytes;
    if (counting()) count_settle(*b->cur);
  }
  const PendingStore s =
      pending(w, reinterpret_cast<uint64_t>(mc), src, bytes, true, b && counting() ? ready_stamp(*b->cur) : Stamp{});
  if (b && b->chaos && order == kRelaxed) {
    buffer_store(*b, s);
    return;
  }
  commit(b, s, memorder(order, false));
}

void mc_red_add_u32(uint32_t* mc, uint32_t v, int order) {
  Block* b = enter(true);
  const Where w = locate(reinterpret_cast<uint64_t>(mc));
  const Region& r = mc_region(w, mc, "multimem.red");
  if (b) {
    griddep_check(*b, mc, "multimem.red");
    b->traffic.mc_red_bytes += 4;
    b->traffic.mc_red_ops += 1;
    if (order == kRelease || order == kAcqRel) drain_for_release(*b);
    else drain_overlapping(*b, w, 4);
    if (counting()) {
      if (order == kRelease) count_fence(*b);
      count_settle(*b->cur);
      for (int p = 0; p < r.nranks; ++p) write_stamps(r, p, w.off, 4, plus_hops(ready_stamp(*b->cur), kHop), true);
    }
  }
  int ord[UBNEXT_EMU_MAX_RANKS];
  const int n = rank_order(b, r, ord);
  for (int i = 0; i < n; ++i)
    __atomic_fetch_add(reinterpret_cast<uint32_t*>(r.base[ord[i]] + w.off), v, memorder(order, false));
}

// A plain vector access of kernel code (vec.cuh): faults when misaligned, as the GPU does, and
// counts its bytes in count mode (a load once per granule, as the twins').
void vector_access(const void* p, unsigned bytes, const char* access, bool is_load) {
  check_aligned(p, bytes, access);
  Block* b = tl_block;
  if (b && b->cur) griddep_check(*b, p, access);
  if (!b || !b->cur || !counting()) return;
  if (!is_load) b->bytes_moved += bytes;
  else count_load_bytes(*b, p, bytes, false, true);  // kernels touch a peer's memory only through the twins
}

}  // namespace ubx_emu

using namespace ubx_emu;

extern "C" int64_t ubnext_emu_register(int rank, int nranks, const uint64_t* peer_bases, uint64_t bytes,
                                       uint64_t mc_base) {
  if (nranks < 1 || nranks > UBNEXT_EMU_MAX_RANKS || rank < 0 || rank >= nranks || !peer_bases || !bytes) return -1;
  std::lock_guard<std::mutex> lk(g_region_mutex);
  for (int i = 0; i < kMaxRegions; ++i) {
    Region& r = g_regions[i];
    if (r.live.load()) continue;
    r.rank = rank;
    r.nranks = nranks;
    for (int p = 0; p < UBNEXT_EMU_MAX_RANKS; ++p) r.base[p] = p < nranks ? peer_bases[p] : 0;
    r.bytes = bytes;
    r.mc = mc_base;
    for (int p = 0; p < UBNEXT_EMU_MAX_RANKS; ++p) r.stamps[p] = 0;
    r.live.store(true, std::memory_order_release);
    if (g_region_end.load() <= i) g_region_end.store(i + 1, std::memory_order_release);
    return i;
  }
  return -1;
}

extern "C" int ubnext_emu_register_stamps(int64_t handle, const uint64_t* stamp_bases) {
  if (handle < 0 || handle >= kMaxRegions || !stamp_bases) return -1;
  std::lock_guard<std::mutex> lk(g_region_mutex);
  Region& r = g_regions[handle];
  if (!r.live.load()) return -1;
  for (int p = 0; p < r.nranks; ++p) r.stamps[p] = stamp_bases[p];
  return 0;
}

extern "C" void ubnext_emu_set_counting(int on) { g_counting.store(on ? 1 : 0); }

extern "C" void ubnext_emu_set_count_weights(uint32_t hop, uint32_t l2, uint32_t atomic, uint32_t wait) {
  const uint32_t w[4] = {hop, l2, atomic, wait};
  for (int i = 0; i < 4; ++i) g_weights[i].store(w[i]);
}

extern "C" void ubnext_emu_set_cluster_weights(uint32_t dsm, uint32_t cluster_sync) {
  g_weights[4].store(dsm);
  g_weights[5].store(cluster_sync);
}

extern "C" int ubnext_emu_unregister(int64_t handle) {
  if (handle < 0 || handle >= kMaxRegions) return -1;
  std::lock_guard<std::mutex> lk(g_region_mutex);
  if (!g_regions[handle].live.load()) return -1;
  g_regions[handle].live.store(false, std::memory_order_release);
  return 0;
}

extern "C" uint64_t ubnext_emu_reserve(uint64_t bytes) {
  if (!bytes) return 0;
  void* p = mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  return p == MAP_FAILED ? 0 : reinterpret_cast<uint64_t>(p);
}

extern "C" int ubnext_emu_release(uint64_t addr, uint64_t bytes) {
  return munmap(reinterpret_cast<void*>(addr), bytes) == 0 ? 0 : -1;
}

extern "C" int ubnext_emu_traffic(uint64_t* out, int nwords) {
  if (!out || nwords < 0) return 0;
  std::lock_guard<std::mutex> lk(g_traffic_mutex);
  const int n = nwords < UBNEXT_EMU_TRAFFIC_WORDS ? nwords : UBNEXT_EMU_TRAFFIC_WORDS;
  memcpy(out, &g_traffic, size_t(n) * 8);
  return n;
}

extern "C" void ubnext_emu_configure(int chaos, uint64_t seed) {
  if (seed == 0) {
    timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    seed = (uint64_t(ts.tv_sec) * 1000000007ull) ^ uint64_t(ts.tv_nsec) ^ (uint64_t(getpid()) << 40);
  }
  g_seed.store(seed);
  g_chaos.store(chaos ? 1 : 0);
}
