// The emulator runtime as seen from device code: what the host twins in csrc/device/ptx.cuh and
// the execution-model builtins in emu_prelude.h call. Host-only (g++), never seen by nvcc/NVRTC.
#pragma once

#include <stddef.h>
#include <stdint.h>

namespace ubx_emu {

// Memory orders of the twins. Volatile and relaxed behave the same (relaxed in the emulator).
// Scopes are those of ptx.cuh: a kRelease there is .sys (count mode counts it as a fence) except the
// red's that passes kScopeGpu (the Lamport count, priced as a drain only); the one kAcqRel atomic is .gpu.
enum Order { kRelaxed = 0, kAcquire = 1, kRelease = 2, kAcqRel = 3 };
enum Scope { kScopeGpu = 0, kScopeSys = 1 };
// Element types of multimem.ld_reduce.
enum McType { kMcBf16 = 0, kMcF16 = 1, kMcF32 = 2 };

// Loads/stores of 2, 4 or 16 bytes (16 must be 16-byte aligned). Every call is a scheduling point:
// the calling emulated thread yields so that a spinning thread never starves the others.
void mem_load(void* dst, const void* src, unsigned bytes, int order);
void mem_store(void* dst, const void* src, unsigned bytes, int order);
uint32_t atomic_add_u32(uint32_t* p, uint32_t v, int order);                 // returns old
void red_add_u32(uint32_t* p, uint32_t v, int order, int scope = kScopeSys);                        // red: no result
uint32_t atomic_cas_u32(uint32_t* p, uint32_t cmp, uint32_t val, int order);  // returns old
void fence(int scope);
// fence.proxy.alias: ends the window in which this thread's unicast loads may miss its own multicast
// stores (chaos mode's proxy model, memory.cpp).
void fence_proxy_alias();

// Multicast: `mc` lies in a registered multicast range; the twin acts on every rank's copy.
void mc_ld_reduce(void* dst16, const void* mc, int mc_type);
void mc_store(void* mc, const void* src, unsigned bytes, int order);
void mc_red_add_u32(uint32_t* mc, uint32_t v, int order);

// Count mode (memory.cpp): between begin and end a thread's loads are polls that count nothing;
// the end counts the awaited bytes once and joins the stamp of the value waited for (with a
// target: the write that stored `target`, even if overwritten since; else the latest write).
void count_wait_begin();
void count_wait_end(const void* p, unsigned bytes, int arrived, int has_target, uint32_t target);
// A poll of several 16-byte slots of this rank's memory that re-loads every outstanding slot on each pass
// (lamport_poll.cuh's poll_slots): begin before its first pass, whose loads are the slots' first loads; its
// re-polls between count_wait_begin and this end (repolled: the end closes that wait too). The slots whose
// value landed after their first load's issue cost ONE wait together (memory.cpp, count_poll_end).
void count_poll_begin();
void count_poll_end(int repolled, int arrived);

uint64_t globaltimer_ns();
// How many times this worker thread (one block) has read globaltimer_ns: SpinWait's clock reads (selftest).
uint64_t globaltimer_reads();
void spin_pause();

// griddepcontrol (ptx.cuh). Launches are serialised, so the wait has nothing to wait for: it marks the
// thread as having waited, and in a launch made with the PDL attribute (ubnext_emu_launch's flags) any
// memory access of a thread that has not waited fails the launch, as it could read what the previous
// kernel is still writing on a GPU. launch_dependents is counted (ubnext_emu_griddep).
void griddep_wait();
void griddep_launch_dependents();

// Thread-block clusters (sched.cpp; ptx.cuh's cluster section). The calling block's rank in its cluster
// (%cluster_ctarank) and the cluster's size (%cluster_nctarank).
unsigned cluster_ctarank();
unsigned cluster_nctarank();
// mapa: where the __shared__ bytes at `p` of the calling block lie in block `rank` of its cluster. Fails the
// launch when `p` is not this block's shared memory or `rank` is outside the cluster.
uint64_t dsm_map(const void* p, unsigned rank);
// ld/st.shared::cluster of 4 or 16 bytes at an address from dsm_map (memory.cpp): scheduling points, a
// relaxed store sits in chaos mode's store buffer like a global one; the block they address must not have
// exited. Count mode counts a sibling's access as one `dsm` latency.
void dsm_load(void* dst, uint64_t addr, unsigned bytes);
void dsm_store(uint64_t addr, const void* src, unsigned bytes);
// barrier.cluster.arrive (order kRelease or kRelaxed) and barrier.cluster.wait (acquire): a thread arrives,
// then waits; the wait returns once every thread of the cluster that has not exited has arrived.
void cluster_arrive(int order);
void cluster_wait();

// Execution model (emu_prelude.h wraps these in the CUDA names).
struct Idx3 {
  unsigned int x, y, z;
};
// Set by the scheduler before it resumes a fiber (per OS thread = per block).
extern thread_local Idx3 tl_threadIdx, tl_blockIdx, tl_blockDim, tl_gridDim;
// Block barrier; kind 0: plain, 1: count of nonzero preds, 2: and, 3: or.
int syncthreads_op(int pred, int kind);
// Warp-wide exchange of 32-bit values among the lanes named in `mask` that have not exited.
// kind 0: returns the value of lane `src` (src < 0, or a lane not taking part: own value);
// kind 1: returns the ballot (bit per lane) of nonzero values. __syncwarp is kind 0 with src -1.
uint32_t warp_exchange(uint32_t mask, uint32_t value, int src, int kind);
void nanosleep_ns(unsigned ns);
[[noreturn]] void trap();
// A vector access of `bytes` at `p` that is not `bytes`-aligned fails the launch with a message
// naming the access, the pointer and the thread, as the GPU faults (cudaErrorMisalignedAddress)
// where x86 would silently go on or crash in an aligned SSE instruction.
void check_aligned(const void* p, unsigned bytes, const char* access);
// A plain (non-twin) vector load or store of kernel code: check_aligned, and counted in count mode.
void vector_access(const void* p, unsigned bytes, const char* access, bool is_load);

}  // namespace ubx_emu
