// Execution model of the emulator: a launch runs every block concurrently, each on its own worker
// OS thread (kernels whose blocks wait on each other need that), and the CUDA threads of a block
// as fibers on that worker. Fibers switch only at scheduling points: __syncthreads, warp
// shuffles/votes, and every host twin of ptx.cuh (so a thread spinning on a peer's flag lets the
// other threads of its block run). When a whole scheduling round did nothing but load and spin,
// the worker backs off, so that 4 ranks x many blocks still make progress on 2 cores.
//
// Count mode with a progress page (ubnext_emu_share_progress; python -m ubnext.bench --model): the
// kernels' clock (globaltimer_ns) and the watchdog measure STALL time, time during which no block of
// any rank sharing the page did any work, not wall-clock time. A wait there is never cut short while
// its peers still make progress, however slow two cores make them (issue 40 item 8: 8 ranks x 16 blocks
// of 256 fibers on 2 cores once took over 120 s for one nvls_lamport call); a real hang makes no
// progress anywhere, so it still times out after UBNEXT_TIMEOUT. In count mode an idle block also backs
// off further (to 3.2 ms): the counts never depend on timing, and 128 polling workers sleeping 200 us at
// most kept the two cores so busy waking them that the blocks with work barely ran.
#include <dlfcn.h>
#include <link.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sched.h>
#include <sys/prctl.h>
#include <signal.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>

#include "emu_internal.h"
#include "../device/desc.cuh"

#if !defined(__x86_64__) && !defined(UBX_EMU_UCONTEXT)
#define UBX_EMU_UCONTEXT 1
#endif
#if defined(UBX_EMU_UCONTEXT)
#include <ucontext.h>
#endif

namespace ubx_emu {

thread_local Idx3 tl_threadIdx, tl_blockIdx, tl_blockDim, tl_gridDim;
thread_local Block* tl_block = nullptr;

// ------------------------------------------------------------------------------ context switch
// A hand-written switch: swapcontext() makes a sigprocmask system call per switch, and the
// emulator switches at every cross-rank access.
#if !defined(UBX_EMU_UCONTEXT)
asm(R"(
.pushsection .text
.globl ubx_emu_ctx_switch
.hidden ubx_emu_ctx_switch
.type ubx_emu_ctx_switch,@function
ubx_emu_ctx_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $16, %rsp
  stmxcsr 8(%rsp)
  fnstcw (%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr 8(%rsp)
  fldcw (%rsp)
  addq $16, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size ubx_emu_ctx_switch, .-ubx_emu_ctx_switch
.globl ubx_emu_fiber_start
.hidden ubx_emu_fiber_start
.type ubx_emu_fiber_start,@function
ubx_emu_fiber_start:
  callq *%r12
  ud2
.size ubx_emu_fiber_start, .-ubx_emu_fiber_start
.popsection
)");
extern "C" void ubx_emu_ctx_switch(void** save_sp, void* load_sp);
extern "C" void ubx_emu_fiber_start();

static void fiber_main();

static void ctx_init(Fiber& f, char* stack_hi) {
  uint64_t* s = reinterpret_cast<uint64_t*>(reinterpret_cast<uintptr_t>(stack_hi) & ~uintptr_t(15));
  s[-1] = reinterpret_cast<uint64_t>(&ubx_emu_fiber_start);  // return address of the switch
  s[-2] = 0;                                                 // rbp
  s[-3] = 0;                                                 // rbx
  s[-4] = reinterpret_cast<uint64_t>(&fiber_main);           // r12: called by the trampoline
  s[-5] = s[-6] = s[-7] = 0;                                 // r13 r14 r15
  s[-8] = 0x1f80;                                            // mxcsr: default, all masked
  s[-9] = 0x037f;                                            // x87 control word: default
  f.sp = &s[-9];
}
static inline void ctx_switch(void** save, void* load) { ubx_emu_ctx_switch(save, load); }
#else
// Portable fallback (other architectures, or -DUBX_EMU_UCONTEXT to test it on x86-64).
static void fiber_main();
// The ucontext_t lives at the bottom of the fiber's own stack, above the canary.
static void ctx_init(Fiber& f, char* stack_hi) {
  auto* uc = reinterpret_cast<ucontext_t*>(f.stack_lo + 64);
  char* lo = f.stack_lo + ((64 + sizeof(ucontext_t) + 63) & ~size_t(63));
  getcontext(uc);
  uc->uc_stack.ss_sp = lo;
  uc->uc_stack.ss_size = static_cast<size_t>(stack_hi - lo);
  uc->uc_link = nullptr;
  makecontext(uc, fiber_main, 0);
  f.sp = uc;
}
static thread_local ucontext_t tl_sched_uc;
static inline void ctx_switch(void** save, void* load) {
  // *save is the slot of the side that suspends: the scheduler's slot holds null.
  ucontext_t* from = *save ? static_cast<ucontext_t*>(*save) : &tl_sched_uc;
  ucontext_t* to = load ? static_cast<ucontext_t*>(load) : &tl_sched_uc;
  swapcontext(from, to);
}
#endif

// ------------------------------------------------------------------------------ launches
// The kernel ABI (docs/ARCHITECTURE.md): the descriptor by value, seven pointers, four scalars.
using KernelFn = void (*)(ubnext_comm_desc, void*, void*, void*, void*, void*, void*, void*, int, int, float, int);

// A thread-block cluster: `size` consecutive blocks of a launch, run together (the GPU's co-scheduling
// guarantee: a cluster's CTAs are placed on one GPC at once). Each block's __shared__ variables live in its
// worker's thread-local storage (emu_prelude.h), so a sibling's shared memory is the same offset in the
// sibling worker's TLS block of this library (dsm_map). The cluster barrier (barrier.cluster.arrive/wait)
// counts the threads of all its blocks; threads that exited no longer count, as for __syncthreads here.
struct Cluster {
  unsigned size = 1;
  std::atomic<unsigned> started{0};            // blocks that published tls_lo (run_block waits for all)
  uintptr_t tls_lo[UBNEXT_EMU_MAX_CLUSTER] = {};  // block r's TLS block of this library in its worker
  std::atomic<bool> exited[UBNEXT_EMU_MAX_CLUSTER] = {};
  std::mutex m;                                // the barrier's state below
  unsigned pending = 0;                        // threads still to arrive in this phase
  unsigned live = 0;                           // threads that have not exited
  std::atomic<uint32_t> phase{0};              // completed phases
  Clock acc_c, res_c[2];                       // count mode: the chains brought to the phase being filled,
  Timed acc_t, res_t[2];                       // and of the last two completed ones (by phase parity)
};

struct Launch {
  std::string name;
  KernelFn fn = nullptr;
  ubnext_comm_desc desc{};
  void* ptr[7] = {};
  int n = 0, hidden = 0, flags = 0;
  float eps = 0.f;
  Idx3 grid{1, 1, 1}, block{32, 1, 1};
  std::vector<Block> blocks;
  std::vector<std::unique_ptr<Cluster>> clusters;
  std::mutex m;
  std::condition_variable cv;
  int done = 0;
  std::atomic<bool> failed{false};
  bool pdl = false;  // launched with the PDL attribute (UBNEXT_EMU_LAUNCH_PDL)
  void invoke() { fn(desc, ptr[0], ptr[1], ptr[2], ptr[3], ptr[4], ptr[5], ptr[6], n, hidden, eps, flags); }
};

static constexpr size_t kStackBytes = 128 * 1024;
static constexpr uint64_t kCanary = 0x5542584e43414e59ull;  // detects a fiber stack overflow
static std::atomic<uint64_t> g_watchdog_ns{90ull * 1000 * 1000 * 1000};

static void fail_block(Block& b, std::string msg) {
  if (b.error.empty()) b.error = std::move(msg);
  b.launch->failed.store(true, std::memory_order_relaxed);
}

static std::string where(const Block& b, const Fiber* f) {
  char buf[128];
  snprintf(buf, sizeof buf, "block (%u,%u,%u) thread (%u,%u,%u)", b.bidx.x, b.bidx.y, b.bidx.z, f ? f->tid.x : 0,
           f ? f->tid.y : 0, f ? f->tid.z : 0);
  return buf;
}

// Scheduling point: hand the OS thread back to the block's scheduler.
void yield_fiber(bool work) {
  Block* b = tl_block;
  if (!b || !b->cur) return;
  if (work) b->progress = true;
  Fiber* f = b->cur;
  ctx_switch(&f->sp, b->sched_sp);
}

static void complete_barrier(Block& b) {
  b.bar_result[0] = 0;
  b.bar_result[1] = b.bar_acc_count;
  b.bar_result[2] = b.bar_acc_and;
  b.bar_result[3] = b.bar_acc_or;
  b.bar_arrived = 0;
  b.bar_acc_count = 0;
  b.bar_acc_and = 1;
  b.bar_acc_or = 0;
  ++b.bar_gen;
  if (counting()) {
    std::vector<Fiber*> waiting;
    for (Fiber& f : b.fibers)
      if (f.state == kWaitBarrier) waiting.push_back(&f);
    join_clocks(waiting.data(), unsigned(waiting.size()));
  }
  for (Fiber& f : b.fibers) {
    if (f.state != kWaitBarrier) continue;
    f.state = kRunnable;
    // bar.sync makes this thread's earlier stores visible to the block; a later release by any
    // of its threads must order them too.
    for (PendingStore& s : f.sbuf) b.cumulative.push_back(s);
    f.sbuf.clear();
  }
  b.progress = true;
}

static void complete_warp(Block& b, unsigned warp) {
  Warp& w = b.warps[warp];
  const uint32_t arrived = w.arrived;
  Fiber* lanes = &b.fibers[warp * 32];
  uint32_t ballot = 0;
  for (unsigned l = 0; l < 32; ++l)
    if ((arrived >> l & 1) && lanes[l].xchg_value) ballot |= 1u << l;
  if (counting()) {
    Fiber* in_op[32];
    unsigned k = 0;
    for (unsigned l = 0; l < 32; ++l)
      if (arrived >> l & 1) in_op[k++] = &lanes[l];
    join_clocks(in_op, k);
  }
  for (unsigned l = 0; l < 32; ++l) {
    if (!(arrived >> l & 1)) continue;
    Fiber& f = lanes[l];
    if (w.kind == 1) {
      f.xchg_result = ballot;
    } else {
      const int s = f.xchg_src;
      f.xchg_result = (s >= 0 && s < 32 && (arrived >> s & 1)) ? lanes[s].xchg_value : f.xchg_value;
    }
    f.state = kRunnable;
  }
  w.arrived = 0;
  b.progress = true;
}

static Fiber& current(const char* what) {
  Block* b = tl_block;
  if (!b || !b->cur) {
    fprintf(stderr, "ubnext emulator: %s called outside a kernel launch\n", what);
    abort();
  }
  return *b->cur;
}

int syncthreads_op(int pred, int kind) {
  Fiber& f = current("__syncthreads");
  Block& b = *tl_block;
  b.bar_acc_count += pred != 0;
  b.bar_acc_and &= pred != 0;
  b.bar_acc_or |= pred != 0;
  f.state = kWaitBarrier;
  if (++b.bar_arrived == b.live) complete_barrier(b);
  else ctx_switch(&f.sp, b.sched_sp);
  return b.bar_result[kind & 3];
}

uint32_t warp_exchange(uint32_t mask, uint32_t value, int src, int kind) {
  Fiber& f = current("warp shuffle/vote");
  Block& b = *tl_block;
  const unsigned warp = f.linear / 32, lane = f.linear % 32;
  Warp& w = b.warps[warp];
  if (w.arrived == 0) {
    w.expected = mask & w.live;
    w.kind = kind;
  }
  f.xchg_value = value;
  f.xchg_src = src;
  f.state = kWaitWarp;
  w.arrived |= 1u << lane;
  if ((w.arrived & w.expected) == w.expected) complete_warp(b, warp);
  else ctx_switch(&f.sp, b.sched_sp);
  return f.xchg_result;
}

// ------------------------------------------------------------------------------ clusters
unsigned cluster_ctarank() {
  (void)current("%cluster_ctarank");
  return tl_block->crank;
}
unsigned cluster_nctarank() {
  (void)current("%cluster_nctarank");
  return tl_block->cluster->size;
}

[[noreturn]] static void abandon_fiber(Block& b, Fiber& f);
[[noreturn]] static void fail_here(const std::string& msg) {
  Block& b = *tl_block;
  fail_block(b, msg + " in " + where(b, b.cur));
  abandon_fiber(b, *b.cur);
}

// This library's thread-local storage in the calling OS thread (where its __shared__ variables live) and
// its size, from the dynamic linker (dl_iterate_phdr's dlpi_tls_data: allocated once the thread touched
// a thread_local of the library, as run_block has); 0 when unknown.
struct TlsBlock {
  uintptr_t lo = 0;
  size_t size = 0;
};
static thread_local TlsBlock tl_tls;
static TlsBlock own_tls() {
  if (tl_tls.lo) return tl_tls;
  struct Q {
    uintptr_t fn;
    TlsBlock t;
  } q{reinterpret_cast<uintptr_t>(&ubnext_emu_launch), {}};
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* data) -> int {
        Q& q = *static_cast<Q*>(data);
        bool ours = false;
        size_t tls = 0;
        for (int i = 0; i < info->dlpi_phnum; ++i) {
          const ElfW(Phdr) & ph = info->dlpi_phdr[i];
          if (ph.p_type == PT_LOAD && q.fn - (info->dlpi_addr + ph.p_vaddr) < ph.p_memsz) ours = true;
          if (ph.p_type == PT_TLS) tls = ph.p_memsz;
        }
        if (!ours) return 0;
        q.t = TlsBlock{reinterpret_cast<uintptr_t>(info->dlpi_tls_data), tls};
        return 1;
      },
      &q);
  if (q.t.lo && q.t.size) tl_tls = q.t;
  return q.t;
}

uint64_t dsm_map(const void* p, unsigned rank) {
  (void)current("mapa");
  Block& b = *tl_block;
  Cluster& c = *b.cluster;
  const uintptr_t off = reinterpret_cast<uintptr_t>(p) - c.tls_lo[b.crank];
  char msg[200];
  if (off >= tl_tls.size) {
    snprintf(msg, sizeof msg, "mapa of %p, which is not this block's shared memory", p);
    fail_here(msg);
  }
  if (rank >= c.size) {
    snprintf(msg, sizeof msg, "mapa to block rank %u of a cluster of %u", rank, c.size);
    fail_here(msg);
  }
  return c.tls_lo[rank] + off;
}

unsigned dsm_check(uint64_t addr, unsigned bytes, const char* access) {
  Block& b = *tl_block;
  Cluster& c = *b.cluster;
  char msg[200];
  for (unsigned r = 0; r < c.size; ++r) {
    if (addr - c.tls_lo[r] >= tl_tls.size) continue;
    if (addr + bytes - c.tls_lo[r] > tl_tls.size) break;
    if (c.exited[r].load(std::memory_order_acquire)) {
      snprintf(msg, sizeof msg, "%s of block rank %u of the cluster, which has exited (its shared memory is gone)",
               access, r);
      fail_here(msg);
    }
    return r;
  }
  snprintf(msg, sizeof msg, "%s at %#llx, which is not in the shared memory of a block of this cluster", access,
           static_cast<unsigned long long>(addr));
  fail_here(msg);
}

// Under c.m: the phase is complete; the next one waits for every thread still live.
static void complete_cluster(Cluster& c) {
  const uint32_t p = c.phase.load(std::memory_order_relaxed);
  c.res_c[p & 1] = c.acc_c;
  c.res_t[p & 1] = c.acc_t;
  c.acc_c = Clock{};
  c.acc_t = Timed{};
  c.pending = c.live;
  c.phase.store(p + 1, std::memory_order_release);
}

void cluster_arrive(int order) {
  Fiber& f = current("barrier.cluster.arrive");
  Block& b = *tl_block;
  if (f.cluster_arrived) fail_here("barrier.cluster.arrive twice without a barrier.cluster.wait");
  if (order == kRelease) release_stores(b);
  Cluster& c = *b.cluster;
  Clock cc;
  Timed tt;
  if (counting()) count_cluster_arrive(f, cc, tt);
  std::lock_guard<std::mutex> lk(c.m);
  f.cluster_phase = c.phase.load(std::memory_order_relaxed);
  f.cluster_arrived = true;
  c.acc_c.join(cc);
  c.acc_t.join(tt);
  if (--c.pending == 0) complete_cluster(c);
  b.progress = true;
}

static bool cluster_phase_done(const Block& b, const Fiber& f) {
  return b.cluster->phase.load(std::memory_order_acquire) != f.cluster_phase;
}

void cluster_wait() {
  Fiber& f = current("barrier.cluster.wait");
  Block& b = *tl_block;
  if (!f.cluster_arrived) fail_here("barrier.cluster.wait without a barrier.cluster.arrive");
  if (!cluster_phase_done(b, f)) {
    f.state = kWaitCluster;  // run_block makes it runnable once the phase completes
    ctx_switch(&f.sp, b.sched_sp);
  }
  f.cluster_arrived = false;
  if (counting()) {
    Cluster& c = *b.cluster;
    std::lock_guard<std::mutex> lk(c.m);  // res[parity] stays until this thread has arrived again
    count_cluster_wait(f, c.res_c[f.cluster_phase & 1], c.res_t[f.cluster_phase & 1]);
  }
}

// A thread that spins without touching memory through the twins still drains its store buffer.
void spin_pause() {
  yield_fiber(false);
  if (Block* b = tl_block) chaos_spin(*b);
}
void nanosleep_ns(unsigned) { spin_pause(); }

static uint64_t wall_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return uint64_t(ts.tv_sec) * 1000000000ull + uint64_t(ts.tv_nsec);
}

// ------------------------------------------------------------------------------ progress and stall time
// The progress page: a file mapped by every rank (ubnext_emu_share_progress); word 0 counts the
// scheduling rounds in which some block of some rank did work (a store, an atomic, a barrier or warp
// op completed, a thread exited), and launches' starts and ends.
static std::atomic<uint64_t*> g_progress{nullptr};
static void note_progress() {
  if (uint64_t* p = g_progress.load(std::memory_order_relaxed)) __atomic_fetch_add(p, 1, __ATOMIC_RELAXED);
}
// Whether waits and the watchdog measure stall time (count mode with a progress page).
static bool stall_clock_on() { return counting() && g_progress.load(std::memory_order_relaxed) != nullptr; }
// Stall time of this process: the wall-clock time between two successive samples (any thread's)
// in which the progress word did not change. Progress anywhere in an interval voids the whole
// interval, so the clock is lenient, never early; monotonic.
static std::mutex g_stall_mutex;
static uint64_t g_stall_seen = 0, g_stall_last = 0;
static std::atomic<uint64_t> g_stall_ns{0};
static uint64_t stall_ns() {
  std::unique_lock<std::mutex> lk(g_stall_mutex, std::try_to_lock);
  if (lk.owns_lock()) {  // else another thread is sampling: its value will do
    const uint64_t now = wall_ns();
    const uint64_t seen = __atomic_load_n(g_progress.load(std::memory_order_relaxed), __ATOMIC_RELAXED);
    if (g_stall_last != 0 && seen == g_stall_seen && now > g_stall_last)
      g_stall_ns.fetch_add(now - g_stall_last, std::memory_order_relaxed);
    g_stall_seen = seen;
    g_stall_last = now;
  }
  return g_stall_ns.load(std::memory_order_relaxed);
}

// What a kernel's %globaltimer reads: CLOCK_MONOTONIC, or stall time (above).
static thread_local uint64_t tl_clock_reads = 0;
uint64_t globaltimer_ns() {
  ++tl_clock_reads;
  return stall_clock_on() ? stall_ns() : wall_ns();
}
uint64_t globaltimer_reads() { return tl_clock_reads; }

[[noreturn]] static void abandon_fiber(Block& b, Fiber& f) {
  f.state = kDone;
  for (;;) ctx_switch(&f.sp, b.sched_sp);  // the scheduler never resumes a done fiber
}

void trap() {
  Block* b = tl_block;
  if (!b || !b->cur) {
    fprintf(stderr, "ubnext emulator: __trap() outside a kernel launch\n");
    abort();
  }
  fail_block(*b, "__trap() in " + where(*b, b->cur));
  abandon_fiber(*b, *b->cur);
}

void griddep_violation(const void* p, const char* access) {
  Block& b = *tl_block;  // memory.cpp calls it from inside a launch only
  char msg[200];
  snprintf(msg, sizeof msg,
           "%s at %p before griddepcontrol.wait (launched with the PDL attribute: the previous "
           "kernel may still be writing it)",
           access, p);
  fail_block(b, std::string(msg) + " in " + where(b, b.cur));
  abandon_fiber(b, *b.cur);
}

void check_aligned(const void* p, unsigned bytes, const char* access) {
  if (reinterpret_cast<uintptr_t>(p) % bytes == 0) return;
  char msg[200];
  snprintf(msg, sizeof msg, "misaligned %u-byte %s at %p (needs %u-byte alignment)", bytes, access, p, bytes);
  Block* b = tl_block;
  if (!b || !b->cur) {
    fprintf(stderr, "ubnext emulator: %s outside a kernel launch\n", msg);
    abort();
  }
  fail_block(*b, std::string(msg) + " in " + where(*b, b->cur));
  abandon_fiber(*b, *b->cur);
}

static void fiber_exit(Block& b, Fiber& f) {
  drain_all(b, f.sbuf);  // kernel end makes every store visible
  b.end_clock.join(f.ready());
  if (counting()) {
    count_settle(f);
    b.t_end.join(f.tready());
  }
  b.griddep_waited += f.griddep_waited;
  b.griddep_launched += f.griddep_launched;
  {  // an exited thread no longer counts for the cluster barrier
    Cluster& c = *b.cluster;
    std::lock_guard<std::mutex> lk(c.m);
    --c.live;
    if (!f.cluster_arrived && --c.pending == 0) complete_cluster(c);
  }
  if (*reinterpret_cast<uint64_t*>(f.stack_lo) != kCanary)
    fail_block(b, "fiber stack overflow (" + std::to_string(kStackBytes) + " bytes) in " + where(b, &f));
  f.state = kDone;
  --b.live;
  Warp& w = b.warps[f.linear / 32];
  w.live &= ~(1u << (f.linear % 32));
  w.expected &= w.live;
  // Exited threads no longer count for barriers and warp ops that others wait in.
  if (w.arrived && (w.arrived & w.expected) == w.expected) complete_warp(b, f.linear / 32);
  if (b.bar_arrived && b.bar_arrived == b.live) complete_barrier(b);
  b.progress = true;
  abandon_fiber(b, f);
}

static void fiber_main() {
  Block& b = *tl_block;
  b.launch->invoke();
  fiber_exit(b, *b.cur);
}

static void backoff(unsigned idle) {
  if (idle <= 2) {
    sched_yield();
    return;
  }
  unsigned us = 20u * (idle - 2 < 10 ? idle - 2 : 10);
  // count mode: keep doubling, 400 us .. 3.2 ms (see the top of this file)
  if (idle > 12 && counting()) us = 200u << (idle - 12 < 4 ? idle - 12 : 4);
  timespec ts{0, long(us) * 1000};
  nanosleep(&ts, nullptr);
}

// The co-scheduling of a cluster: publish this block's shared memory, then wait until every block of its
// cluster has (the GPU starts a cluster's CTAs together; here every block of a launch runs at once on its
// own worker, so this only waits for the siblings' workers to reach their start). False: the launch failed.
static bool start_in_cluster(Block& b) {
  Launch& L = *b.launch;
  Cluster& c = *b.cluster;
  const TlsBlock t = own_tls();
  if (!t.lo) {
    fail_block(b, "cannot locate the library's thread-local storage (shared memory) in this worker");
    return false;
  }
  c.tls_lo[b.crank] = t.lo;
  c.started.fetch_add(1, std::memory_order_release);
  for (unsigned idle = 0; c.started.load(std::memory_order_acquire) < c.size;)
    if (L.failed.load(std::memory_order_relaxed)) return false;
    else backoff(++idle);
  return true;
}

// Runs one block to completion on the calling worker thread, whose stack arena has room for it.
static void run_block(Block& b, char* arena) {
  Launch& L = *b.launch;
  tl_block = &b;
  tl_blockIdx = b.bidx;
  tl_blockDim = L.block;
  tl_gridDim = L.grid;
  const unsigned nthreads = L.block.x * L.block.y * L.block.z;
  b.fibers.resize(nthreads);
  b.warps.assign((nthreads + 31) / 32, Warp{});
  for (unsigned i = 0; i < nthreads; ++i) {
    Fiber& f = b.fibers[i];
    f.tid = Idx3{i % L.block.x, (i / L.block.x) % L.block.y, i / (L.block.x * L.block.y)};
    f.linear = i;
    f.state = kRunnable;
    f.sbuf.clear();
    f.mc_shadow.clear();
    f.clock = f.data = Clock{};
    f.tclock = f.tdata = f.tbase = f.own_max = Timed{};
    f.batch.clear();
    f.load_seq = 0;
    f.waiting = 0;
    f.poll_open = false;
    f.loaded.clear();
    f.griddep_waited = f.griddep_launched = false;
    f.cluster_arrived = false;
    f.cluster_phase = 0;
    f.dsm_landed = Timed{};
    f.stack_lo = arena + size_t(i) * kStackBytes;
    *reinterpret_cast<uint64_t*>(f.stack_lo) = kCanary;
    ctx_init(f, f.stack_lo + kStackBytes);
    b.warps[i / 32].live |= 1u << (i % 32);
  }
  b.live = nthreads;
  if (!start_in_cluster(b)) {
    b.cluster->exited[b.crank].store(true, std::memory_order_release);
    merge_traffic(b.traffic);
    tl_block = nullptr;
    return;
  }
  std::vector<unsigned> order(nthreads);
  for (unsigned i = 0; i < nthreads; ++i) order[i] = i;
  unsigned idle = 0;
  while (b.live > 0 && !L.failed.load(std::memory_order_relaxed)) {
    b.progress = false;
    if (b.chaos)  // an arbitrary interleaving of the block's threads, different every round
      for (unsigned i = nthreads - 1; i > 0; --i) std::swap(order[i], order[b.rng.below(i + 1)]);
    for (unsigned i : order) {
      Fiber& f = b.fibers[i];
      if (f.state == kWaitCluster && cluster_phase_done(b, f)) {
        f.state = kRunnable;
        b.progress = true;
      }
      if (f.state != kRunnable) continue;
      b.cur = &f;
      tl_threadIdx = f.tid;
      b.sched_sp = nullptr;
      ctx_switch(&b.sched_sp, f.sp);
      b.cur = nullptr;
      if (!b.error.empty()) break;
    }
    if (!b.error.empty()) break;
    if (b.chaos) chaos_round(b);  // parked threads' stores become visible eventually, unordered
    // Threads in the cluster barrier wait for the sibling blocks too: no deadlock while the phase can still
    // complete, i.e. unless a thread of this block that has not arrived is parked in __syncthreads or a
    // warp op (then nothing can move it: every other thread of the block is parked too).
    bool runnable = false, in_cluster = false, parked_unarrived = false;
    for (const Fiber& f : b.fibers) {
      runnable |= f.state == kRunnable || (f.state == kWaitCluster && cluster_phase_done(b, f));
      in_cluster |= f.state == kWaitCluster;
      parked_unarrived |= (f.state == kWaitBarrier || f.state == kWaitWarp) && !f.cluster_arrived;
    }
    if (!runnable && b.live > 0 && (!in_cluster || parked_unarrived)) {
      fail_block(b,
                 "block (" + std::to_string(b.bidx.x) + "): " + std::to_string(b.live) + " threads wait in " +
                     (in_cluster ? "__syncthreads, a warp op or the cluster barrier" : "__syncthreads or a warp op") +
                     " that the others never reach");
      break;
    }
    if (b.progress) {
      idle = 0;
      note_progress();
    } else {
      backoff(++idle);
    }
  }
  if (b.error.empty()) drain_all(b, b.cumulative);
  b.cluster->exited[b.crank].store(true, std::memory_order_release);
  merge_traffic(b.traffic);
  tl_block = nullptr;
}

// ------------------------------------------------------------------------------ worker pool
// Workers live for the whole process (never destroyed: at exit they are simply gone, so no
// static destructor can race with them). Each keeps its fiber stacks between launches.
struct Worker {
  std::mutex m;
  std::condition_variable cv;
  Block* job = nullptr;
  char* arena = nullptr;
  unsigned arena_threads = 0;

  void loop() {
    // The backoff's and chaos' sleeps are tens of microseconds: the default 50 us timer slack
    // would more than double each, and the emulator's latency is mostly such sleeps.
    prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);
    for (;;) {
      Block* b;
      {
        std::unique_lock<std::mutex> lk(m);
        cv.wait(lk, [&] { return job != nullptr; });
        b = job;
      }
      const unsigned need = b->launch->block.x * b->launch->block.y * b->launch->block.z;
      if (need > arena_threads) {
        if (arena) munmap(arena, size_t(arena_threads) * kStackBytes);
        arena = static_cast<char*>(mmap(nullptr, size_t(need) * kStackBytes, PROT_READ | PROT_WRITE,
                                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
        if (arena == MAP_FAILED) {
          fprintf(stderr, "ubnext emulator: cannot map fiber stacks\n");
          abort();
        }
        arena_threads = need;
      }
      run_block(*b, arena);
      {
        std::lock_guard<std::mutex> lk(m);
        job = nullptr;
      }
      Launch& L = *b->launch;
      std::lock_guard<std::mutex> lk(L.m);
      ++L.done;
      L.cv.notify_all();
    }
  }
};

static std::mutex g_launch_mutex;  // one launch at a time per process

// Count mode: the last launch's critical-path count (ubnext_emu_counts).
static std::mutex g_counts_mutex;
static uint64_t g_counts[UBNEXT_EMU_COUNT_WORDS] = {};
static uint64_t g_griddep[UBNEXT_EMU_GRIDDEP_WORDS] = {};  // of the last launch (ubnext_emu_griddep)
// Count mode: every launch's count words since the last ubnext_emu_count_log (the newest kCountLogMax).
static constexpr size_t kCountLogMax = 4096;
static auto* g_count_log = new std::vector<std::array<uint64_t, UBNEXT_EMU_COUNT_WORDS>>();
static std::vector<Worker*>* g_workers = new std::vector<Worker*>();

static void ensure_workers(size_t n) {
  while (g_workers->size() < n) {
    Worker* w = new Worker();
    std::thread(&Worker::loop, w).detach();
    g_workers->push_back(w);
  }
}

static void* self_handle() {
  static void* h = [] {
    Dl_info info;
    if (!dladdr(reinterpret_cast<void*>(&ubnext_emu_launch), &info)) return static_cast<void*>(nullptr);
    return dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD);
  }();
  return h;
}

[[noreturn]] static void watchdog_fire(Launch& L, uint64_t ns, bool stalled) {
  fprintf(stderr,
          "ubnext emulator watchdog: kernel %s (grid %u, block %u) did not finish within %.1f s%s; "
          "blocks still running:",
          L.name.c_str(), L.grid.x, L.block.x, double(ns) * 1e-9,
          stalled ? " without progress on any rank (count mode: stall time)" : "");
  // Racy reads, for the report only: the process is about to end.
  for (const Block& b : L.blocks)
    if (b.live) fprintf(stderr, " %u(%u threads left)", b.bidx.x, b.live);
  fprintf(stderr, "\nAborting: the emulated kernel is stuck (a wait without a bound, or a lost peer).\n");
  fflush(stderr);
  abort();
}

}  // namespace ubx_emu

using namespace ubx_emu;

static int set_err(char* err, int errlen, int code, const std::string& msg) {
  if (err && errlen > 0) snprintf(err, size_t(errlen), "%s", msg.c_str());
  return code;
}

extern "C" int ubnext_emu_launch(const char* kernel, int grid, int block, int cluster, const void* const* args,
                                 int flags, char* err, int errlen) {
  if (err && errlen > 0) err[0] = 0;
  if (!kernel || !args) return set_err(err, errlen, 1, "null kernel name or args");
  if (grid < 1 || grid > UBNEXT_EMU_MAX_GRID)
    return set_err(err, errlen, 1,
                   "grid " + std::to_string(grid) + " outside [1, " + std::to_string(UBNEXT_EMU_MAX_GRID) + "]");
  if (block < 32 || block > 1024 || block % 32)
    return set_err(err, errlen, 1, "block " + std::to_string(block) + " is not a multiple of 32 in [32, 1024]");
  const int cmax =
      flags & UBNEXT_EMU_LAUNCH_CLUSTER_NONPORTABLE ? UBNEXT_EMU_MAX_CLUSTER : UBNEXT_EMU_MAX_CLUSTER_PORTABLE;
  if (cluster < 1 || cluster > cmax)
    return set_err(
        err, errlen, 1,
        "cluster " + std::to_string(cluster) + " outside [1, " + std::to_string(cmax) + "]" +
            (cluster > cmax && cmax < UBNEXT_EMU_MAX_CLUSTER ? " (over 8 needs the non-portable cluster size attribute)"
                                                             : ""));
  if (grid % cluster)
    return set_err(err, errlen, 1,
                   "grid " + std::to_string(grid) + " is not a multiple of the cluster " + std::to_string(cluster));
  void* h = self_handle();
  void* sym = h ? dlsym(h, kernel) : nullptr;
  if (!sym) return set_err(err, errlen, 2, std::string("no kernel named ") + kernel + " in the emulator library");

  std::lock_guard<std::mutex> serial(g_launch_mutex);
  static uint64_t launch_count = 0;
  ++launch_count;
  Launch L;
  L.name = kernel;
  L.fn = reinterpret_cast<KernelFn>(sym);
  memcpy(&L.desc, args[0], sizeof L.desc);
  for (int i = 0; i < 7; ++i) L.ptr[i] = *static_cast<void* const*>(args[1 + i]);
  L.n = *static_cast<const int*>(args[8]);
  L.hidden = *static_cast<const int*>(args[9]);
  L.eps = *static_cast<const float*>(args[10]);
  L.flags = *static_cast<const int*>(args[11]);
  L.pdl = (flags & UBNEXT_EMU_LAUNCH_PDL) != 0;
  L.grid = Idx3{unsigned(grid), 1, 1};
  L.block = Idx3{unsigned(block), 1, 1};
  L.blocks.resize(size_t(grid));
  for (int k = 0; k < grid / cluster; ++k) {
    L.clusters.emplace_back(new Cluster());
    Cluster& c = *L.clusters.back();
    c.size = unsigned(cluster);
    c.live = c.pending = unsigned(cluster) * unsigned(block);
  }
  const bool chaos = chaos_enabled();
  const uint64_t seed = chaos_seed() ^ (uint64_t(getpid()) << 32) ^ (launch_count * 0x9e3779b97f4a7c15ull);
  for (int i = 0; i < grid; ++i) {
    Block& b = L.blocks[size_t(i)];
    b.launch = &L;
    b.bidx = Idx3{unsigned(i), 0, 0};
    b.cluster = L.clusters[size_t(i / cluster)].get();
    b.crank = unsigned(i % cluster);
    b.chaos = chaos;
    b.pdl = L.pdl;
    b.rng.seed(seed + uint64_t(i) * 0xbf58476d1ce4e5b9ull);
    b.live = unsigned(block);  // until the worker starts it, for the watchdog report
  }
  reset_traffic();
  if (counting()) count_new_launch();
  ensure_workers(size_t(grid));
  note_progress();
  for (int i = 0; i < grid; ++i) {
    Worker* w = (*g_workers)[size_t(i)];
    std::lock_guard<std::mutex> lk(w->m);
    w->job = &L.blocks[size_t(i)];
    w->cv.notify_one();
  }
  const uint64_t wd = g_watchdog_ns.load();
  {
    std::unique_lock<std::mutex> lk(L.m);
    if (stall_clock_on()) {  // the bound is stall time: a slow launch whose blocks still work goes on
      const uint64_t s0 = stall_ns();
      while (!L.cv.wait_for(lk, std::chrono::milliseconds(100), [&] { return L.done == grid; }))
        if (stall_ns() - s0 >= wd) watchdog_fire(L, wd, true);
    } else if (!L.cv.wait_for(lk, std::chrono::nanoseconds(wd), [&] { return L.done == grid; })) {
      watchdog_fire(L, wd, false);
    }
  }
  note_progress();
  // Each worker clears its job before reporting done, so L may now go away.
  for (const Block& b : L.blocks)
    if (!b.error.empty()) return set_err(err, errlen, 3, std::string(kernel) + ": " + b.error);
  {
    uint64_t griddep[UBNEXT_EMU_GRIDDEP_WORDS] = {uint64_t(grid) * uint64_t(block), 0, 0};
    for (const Block& b : L.blocks) {
      griddep[1] += b.griddep_waited;
      griddep[2] += b.griddep_launched;
    }
    std::lock_guard<std::mutex> lk(g_counts_mutex);
    memcpy(g_griddep, griddep, sizeof griddep);
  }
  if (counting()) {
    uint64_t counts[UBNEXT_EMU_COUNT_WORDS];
    count_launch_words(L.blocks.data(), grid, counts);
    std::lock_guard<std::mutex> lk(g_counts_mutex);
    memcpy(g_counts, counts, sizeof counts);
    if (g_count_log->size() >= kCountLogMax) g_count_log->erase(g_count_log->begin());
    g_count_log->emplace_back();
    memcpy(g_count_log->back().data(), counts, sizeof counts);
  }
  return 0;
}

// The last launch's record `words` (of `kept` words) into out, at most nwords of them: how many.
static int copy_last_launch(uint64_t* out, int nwords, const uint64_t* words, int kept) {
  if (!out || nwords < 0) return 0;
  std::lock_guard<std::mutex> lk(g_counts_mutex);
  const int n = nwords < kept ? nwords : kept;
  memcpy(out, words, size_t(n) * 8);
  return n;
}

extern "C" int ubnext_emu_griddep(uint64_t* out, int nwords) {
  return copy_last_launch(out, nwords, g_griddep, UBNEXT_EMU_GRIDDEP_WORDS);
}

extern "C" int ubnext_emu_counts(uint64_t* out, int nwords) {
  return copy_last_launch(out, nwords, g_counts, UBNEXT_EMU_COUNT_WORDS);
}

extern "C" int ubnext_emu_count_log(uint64_t* out, int max_launches) {
  std::lock_guard<std::mutex> lk(g_counts_mutex);
  const size_t n = !out || max_launches < 0 ? 0 : std::min(size_t(max_launches), g_count_log->size());
  for (size_t i = 0; i < n; ++i)
    memcpy(out + i * UBNEXT_EMU_COUNT_WORDS, (*g_count_log)[i].data(), sizeof(uint64_t) * UBNEXT_EMU_COUNT_WORDS);
  g_count_log->clear();
  return int(n);
}

extern "C" void ubnext_emu_set_watchdog_ns(uint64_t ns) { g_watchdog_ns.store(ns ? ns : 1); }

extern "C" int ubnext_emu_share_progress(const char* path) {
  if (!path || !*path) {
    g_progress.store(nullptr);  // the mapping stays: a launch of another thread may still read it
    return 0;
  }
  const int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) return errno ? errno : -1;
  struct stat st;
  // every rank extends the file to the same size: idempotent, a counter already there stays
  if (fstat(fd, &st) != 0 || (st.st_size < 4096 && ftruncate(fd, 4096) != 0)) {
    const int e = errno ? errno : -1;
    close(fd);
    return e;
  }
  void* p = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int e = p == MAP_FAILED ? (errno ? errno : -1) : 0;
  close(fd);
  if (e) return e;
  g_progress.store(static_cast<uint64_t*>(p));
  return 0;
}
