// Every inline PTX instruction of ubnext lives here, each wrapped in one function.
//
// Under nvcc / NVRTC each function is the real instruction. Under UBNEXT_EMULATOR (g++, host code)
// each has a host twin that calls the emulator runtime (csrc/emu/emu_runtime.h): that is where
// cross-rank memory traffic is counted, where multicast addresses fan out to every rank's copy,
// where chaos mode delays and reorders stores, and where a spinning emulated thread lets the
// others run. Kernels must therefore touch cross-rank memory (peer mappings, the multicast range,
// flags written by other blocks or ranks) ONLY through these functions.
//
// Memory-model mapping (PTX -> emulator):
//   ld/st .volatile, .relaxed.sys      -> relaxed; in chaos mode stores sit in a store buffer
//   ld.acquire / st.release / red.release / atom.acq_rel -> acquire / release; a release first
//                                         drains the thread's buffered stores (and those it saw
//                                         through __syncthreads, for cumulativity)
//   fence.acq_rel.{sys,gpu}            -> drains the store buffer
#pragma once

#include "platform.cuh"

#if defined(UBNEXT_EMULATOR)
#include "../emu/emu_runtime.h"
#endif

namespace ubx {

// ---------------------------------------------------------------- loads
UBX_DEV uint4 ld_volatile_v4(const void* p) {
  uint4 v;
#if defined(UBNEXT_EMULATOR)
  ::ubx_emu::mem_load(&v, p, 16, ::ubx_emu::kRelaxed);
#else
  asm volatile("ld.volatile.global.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
#endif
  return v;
}

UBX_DEV uint32_t ld_volatile_u32(const uint32_t* p) {
  uint32_t v;
#if defined(UBNEXT_EMULATOR)
  ::ubx_emu::mem_load(&v, p, 4, ::ubx_emu::kRelaxed);
#else
  asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
#endif
  return v;
}

UBX_DEV uint4 ld_relaxed_sys_v4(const void* p) {
  uint4 v;
#if defined(UBNEXT_EMULATOR)
  ::ubx_emu::mem_load(&v, p, 16, ::ubx_emu::kRelaxed);
#else
  asm volatile("ld.relaxed.sys.global.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
#endif
  return v;
}

// One element of a peer's pool: the reduce-scatter's head and tail, where a shard starts or ends inside a
// 16-byte vector.
UBX_DEV uint16_t ld_relaxed_sys_u16(const uint16_t* p) {
  uint16_t v;
#if defined(UBNEXT_EMULATOR)
  ::ubx_emu::mem_load(&v, p, 2, ::ubx_emu::kRelaxed);
#else
  asm volatile("ld.relaxed.sys.global.u16 %0, [%1];" : "=h"(v) : "l"(p) : "memory");
#endif
  return v;
}

UBX_DEV uint32_t ld_relaxed_sys_u32(const uint32_t* p) {
  uint32_t v;
#if defined(UBNEXT_EMULATOR)
  ::ubx_emu::mem_load(&v, p, 4, ::ubx_emu::kRelaxed);
#else
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
#endif
  return v;
}

UBX_DEV uint32_t ld_acquire_sys_u32(const uint32_t* p) {
  uint32_t v;
#if defined(UBNEXT_EMULATOR)
  ::ubx_emu::mem_load(&v, p, 4, ::ubx_emu::kAcquire);
#else
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
#endif
  return v;
}

// An ordinary 16-byte load, for memory that this kernel may have written through the multicast alias
// (read back after fence_proxy_alias). On the GPU it is the plain load the compiler would emit; the
// emulator routes it through its memory model, whose chaos mode checks the proxy fence.
UBX_DEV uint4 ld_plain_v4(const void* p) {
#if defined(UBNEXT_EMULATOR)
  uint4 v;
  ::ubx_emu::mem_load(&v, p, 16, ::ubx_emu::kRelaxed);
  return v;
#else
  return *reinterpret_cast<const uint4*>(p);
#endif
}

// ---------------------------------------------------------------- stores
UBX_DEV void st_volatile_v4(void* p, uint4 v) {
#if defined(UBNEXT_EMULATOR)
  ::ubx_emu::mem_store(p, &v, 16, ::ubx_emu::kRelaxed);
#else
  asm volatile("st.volatile.global.v4.u32 [%0], {%1,%2,%3,%4};"
               :
               : "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
#endif
}

UBX_DEV void st_relaxed_sys_v4(void* p, uint4 v) {
#if defined(UBNEXT_EMULATOR)
  ::ubx_emu::mem_store(p, &v, 16, ::ubx_emu::kRelaxed);
#else
  asm volatile("st.relaxed.sys.global.v4.u32 [%0], {%1,%2,%3,%4};"
               :
               : "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
#endif
}

UBX_DEV void st_relaxed_sys_u32(uint32_t* p, uint32_t v) {
#if defined(UBNEXT_EMULATOR)
  ::ubx_emu::mem_store(p, &v, 4, ::ubx_emu::kRelaxed);
#else
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" : : "l"(p), "r"(v) : "memory");
#endif
}

// 16 bits: the inside half of a 32-bit word that a message ends in the middle of (slices.cuh).
UBX_DEV void st_relaxed_sys_u16(uint16_t* p, uint16_t v) {
#if defined(UBNEXT_EMULATOR)
  ::ubx_emu::mem_store(p, &v, 2, ::ubx_emu::kRelaxed);
#else
  asm volatile("st.relaxed.sys.global.u16 [%0], %1;" : : "l"(p), "h"(v) : "memory");
#endif
}

// One byte: the all-gather's head and tail, where a shard starts or ends inside a 16-byte vector (any
// shard size; multimem.st has no byte form, so these go to each peer).
UBX_DEV void st_relaxed_sys_u8(uint8_t* p, uint8_t v) {
#if defined(UBNEXT_EMULATOR)
  ::ubx_emu::mem_store(p, &v, 1, ::ubx_emu::kRelaxed);
#else
  asm volatile("st.relaxed.sys.global.u8 [%0], %1;" : : "l"(p), "r"(static_cast<uint32_t>(v)) : "memory");
#endif
}

UBX_DEV void st_release_sys_u32(uint32_t* p, uint32_t v) {
#if defined(UBNEXT_EMULATOR)
  ::ubx_emu::mem_store(p, &v, 4, ::ubx_emu::kRelease);
#else
  asm volatile("st.release.sys.global.u32 [%0], %1;" : : "l"(p), "r"(v) : "memory");
#endif
}

// ---------------------------------------------------------------- atomics and fences
UBX_DEV void red_release_sys_add_u32(uint32_t* p, uint32_t v) {
#if defined(UBNEXT_EMULATOR)
  ::ubx_emu::red_add_u32(p, v, ::ubx_emu::kRelease);
#else
  asm volatile("red.release.sys.global.add.u32 [%0], %1;" : : "l"(p), "r"(v) : "memory");
#endif
}

// Fire and forget: the Lamport finish's arrival count (lamport_rotation.cuh), whose result nobody waits for.
UBX_DEV void red_release_gpu_add_u32(uint32_t* p, uint32_t v) {
#if defined(UBNEXT_EMULATOR)
  ::ubx_emu::red_add_u32(p, v, ::ubx_emu::kRelease, ::ubx_emu::kScopeGpu);
#else
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" : : "l"(p), "r"(v) : "memory");
#endif
}

UBX_DEV void red_relaxed_gpu_add_u32(uint32_t* p, uint32_t v) {
#if defined(UBNEXT_EMULATOR)
  ::ubx_emu::red_add_u32(p, v, ::ubx_emu::kRelaxed, ::ubx_emu::kScopeGpu);
#else
  asm volatile("red.relaxed.gpu.global.add.u32 [%0], %1;" : : "l"(p), "r"(v) : "memory");
#endif
}

// Returns the old value.
UBX_DEV uint32_t atom_add_acq_rel_gpu_u32(uint32_t* p, uint32_t v) {
#if defined(UBNEXT_EMULATOR)
  return ::ubx_emu::atomic_add_u32(p, v, ::ubx_emu::kAcqRel);
#else
  uint32_t old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
#endif
}

// Returns the old value. Generic addressing (no .global): the targets are the host-visible error
// word (mapped host memory) and this rank's own sync region; never a peer's memory.
UBX_DEV uint32_t atom_cas_relaxed_sys_u32(uint32_t* p, uint32_t cmp, uint32_t val) {
#if defined(UBNEXT_EMULATOR)
  return ::ubx_emu::atomic_cas_u32(p, cmp, val, ::ubx_emu::kRelaxed);
#else
  uint32_t old;
  asm volatile("atom.relaxed.sys.cas.b32 %0, [%1], %2, %3;" : "=r"(old) : "l"(p), "r"(cmp), "r"(val) : "memory");
  return old;
#endif
}

UBX_DEV void fence_acq_rel_sys() {
#if defined(UBNEXT_EMULATOR)
  ::ubx_emu::fence(::ubx_emu::kScopeSys);
#else
  asm volatile("fence.acq_rel.sys;" : : : "memory");
#endif
}

UBX_DEV void fence_acq_rel_gpu() {
#if defined(UBNEXT_EMULATOR)
  ::ubx_emu::fence(::ubx_emu::kScopeGpu);
#else
  asm volatile("fence.acq_rel.gpu;" : : : "memory");
#endif
}

// Orders this thread's accesses through one virtual address before its later accesses through another
// that maps the same memory: a multicast address and the unicast mapping of the same bytes are distinct
// proxies in the PTX memory consistency model (PTX ISA, "Memory Consistency Model" > "Proxies";
// CUDA Programming Guide, Virtual Memory Management > "Virtual Aliasing Support"). Needed wherever a
// kernel reads through unicast what it (or, through a barrier, its block or its peers) wrote through
// multicast with plain loads; a poll that validates its own data does not need it (lamport.cu). Each
// site has its own test-only break (UBNEXT_BREAK_NO_PROXY_FENCE_<SITE>), which the emulator's chaos
// mode catches.
UBX_DEV void fence_proxy_alias() {
#if defined(UBNEXT_EMULATOR)
  ::ubx_emu::fence_proxy_alias();
#else
  asm volatile("fence.proxy.alias;" : : : "memory");
#endif
}

// ---------------------------------------------------------------- programmatic dependent launch
// A kernel launched with the programmatic-stream-serialization attribute (sm_90+; ubnext/_cuda.py,
// csrc/host/collectives.cpp) may start while the kernel before it on the stream is still running.
// griddepcontrol.wait blocks until every grid this one depends on has completed and its memory
// operations are visible: a kernel calls it before its first access to memory a previous kernel may
// have written (its inputs, the pool). Without the attribute it returns at once. Below sm_90 the
// attribute is never set, and both are no-ops. The emulator serialises launches, so its twin only
// records that the wait came before the thread's first memory access (memory.cpp), which it checks.
UBX_DEV void griddep_wait() {
#if defined(UBNEXT_EMULATOR)
  ::ubx_emu::griddep_wait();
#elif defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  asm volatile("griddepcontrol.wait;" : : : "memory");
#endif
}

// Lets the next kernel on the stream (if launched with the attribute) start its blocks once every block
// of this grid has called this or exited. Memory needs no care here: the dependent's own griddep_wait
// still waits for this whole grid to complete. Called once the inputs are read, so that the dependent's
// launch and prologue overlap this kernel's tail.
UBX_DEV void griddep_launch_dependents() {
#if defined(UBNEXT_EMULATOR)
  ::ubx_emu::griddep_launch_dependents();
#elif defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  asm volatile("griddepcontrol.launch_dependents;" : : : "memory");
#endif
}

// ---------------------------------------------------------------- multicast (NVLS, sm_90+)
// `p` is a multicast address. Below sm_90 these trap: the host never picks an NVLS kernel there.
#if !defined(UBNEXT_EMULATOR) && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ < 900)
#define UBX_NO_MULTIMEM 1
#endif

// Sum of every rank's 8 bf16 values, accumulated in fp32 by the switch, rounded to bf16.
UBX_DEV uint4 multimem_ld_reduce_bf16x8(const void* p) {
  uint4 v;
#if defined(UBNEXT_EMULATOR)
  ::ubx_emu::mc_ld_reduce(&v, p, ::ubx_emu::kMcBf16);
#elif defined(UBX_NO_MULTIMEM)
  (void)p;
  v = make_uint4(0, 0, 0, 0);
  __trap();
#else
  asm volatile("multimem.ld_reduce.relaxed.sys.global.add.acc::f32.v4.bf16x2 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
#endif
  return v;
}

UBX_DEV uint4 multimem_ld_reduce_f16x8(const void* p) {
  uint4 v;
#if defined(UBNEXT_EMULATOR)
  ::ubx_emu::mc_ld_reduce(&v, p, ::ubx_emu::kMcF16);
#elif defined(UBX_NO_MULTIMEM)
  (void)p;
  v = make_uint4(0, 0, 0, 0);
  __trap();
#else
  asm volatile("multimem.ld_reduce.relaxed.sys.global.add.acc::f32.v4.f16x2 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
#endif
  return v;
}

// Four fp32 sums; the bits come back in a uint4.
UBX_DEV uint4 multimem_ld_reduce_f32x4(const void* p) {
  uint4 v;
#if defined(UBNEXT_EMULATOR)
  ::ubx_emu::mc_ld_reduce(&v, p, ::ubx_emu::kMcF32);
#elif defined(UBX_NO_MULTIMEM)
  (void)p;
  v = make_uint4(0, 0, 0, 0);
  __trap();
#else
  asm volatile("multimem.ld_reduce.relaxed.sys.global.add.v4.f32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
#endif
  return v;
}

// 16 bytes to every rank's copy. The data type is irrelevant to a store, so f32 carries any bits.
UBX_DEV void multimem_st_v4(void* p, uint4 v) {
#if defined(UBNEXT_EMULATOR)
  ::ubx_emu::mc_store(p, &v, 16, ::ubx_emu::kRelaxed);
#elif defined(UBX_NO_MULTIMEM)
  (void)p;
  (void)v;
  __trap();
#else
  asm volatile("multimem.st.relaxed.sys.global.v4.f32 [%0], {%1,%2,%3,%4};"
               :
               : "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
#endif
}

UBX_DEV void multimem_st_release_u32(uint32_t* p, uint32_t v) {
#if defined(UBNEXT_EMULATOR)
  ::ubx_emu::mc_store(p, &v, 4, ::ubx_emu::kRelease);
#elif defined(UBX_NO_MULTIMEM)
  (void)p;
  (void)v;
  __trap();
#else
  asm volatile("multimem.st.release.sys.global.u32 [%0], %1;" : : "l"(p), "r"(v) : "memory");
#endif
}

// Relaxed: orders nothing. Data (the all-gather's 4-byte words, ordered by the barrier after them), and
// the test-only broken build UBNEXT_BREAK_NO_RELEASE's barrier signal (barrier.cuh); a correct barrier
// signal is multimem_st_release_u32.
UBX_DEV void multimem_st_relaxed_u32(uint32_t* p, uint32_t v) {
#if defined(UBNEXT_EMULATOR)
  ::ubx_emu::mc_store(p, &v, 4, ::ubx_emu::kRelaxed);
#elif defined(UBX_NO_MULTIMEM)
  (void)p;
  (void)v;
  __trap();
#else
  asm volatile("multimem.st.relaxed.sys.global.u32 [%0], %1;" : : "l"(p), "r"(v) : "memory");
#endif
}

UBX_DEV void multimem_red_release_add_u32(uint32_t* p, uint32_t v) {
#if defined(UBNEXT_EMULATOR)
  ::ubx_emu::mc_red_add_u32(p, v, ::ubx_emu::kRelease);
#elif defined(UBX_NO_MULTIMEM)
  (void)p;
  (void)v;
  __trap();
#else
  asm volatile("multimem.red.release.sys.global.add.u32 [%0], %1;" : : "l"(p), "r"(v) : "memory");
#endif
}

// ---------------------------------------------------------------- thread-block clusters (sm_90+)
// A launch with the cluster-dimension attribute (csrc/host/launch_rules.h) groups consecutive CTAs into
// clusters that the GPU runs at once on one GPC; a CTA reaches its siblings' shared memory (distributed
// shared memory) through a shared::cluster address from mapa_shared, and they synchronise with the cluster
// barrier. The emulator's twins (csrc/emu/sched.cpp): each block's __shared__ lives in its worker's
// thread-local storage, and mapa translates to the same offset in the sibling's. Below sm_90 these trap:
// the host never launches a cluster there.
#if !defined(UBNEXT_EMULATOR) && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ < 900)
#define UBX_NO_CLUSTER 1
#endif
// A shared::cluster address: 32 bits on the GPU; the emulator's is a host pointer.
#if defined(UBNEXT_EMULATOR)
typedef uint64_t dsm_addr_t;
#else
typedef uint32_t dsm_addr_t;
#endif

// This CTA's rank in its cluster, and the cluster's size in CTAs (1 without a cluster launch).
UBX_DEV uint32_t cluster_ctarank() {
#if defined(UBNEXT_EMULATOR)
  return ::ubx_emu::cluster_ctarank();
#elif defined(UBX_NO_CLUSTER)
  return 0;
#else
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
#endif
}

UBX_DEV uint32_t cluster_nctarank() {
#if defined(UBNEXT_EMULATOR)
  return ::ubx_emu::cluster_nctarank();
#elif defined(UBX_NO_CLUSTER)
  return 1;
#else
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(r));
  return r;
#endif
}

// The shared::cluster address of the __shared__ bytes at `p` (this CTA's) in the CTA of rank `rank` of the
// cluster.
UBX_DEV dsm_addr_t mapa_shared(const void* p, uint32_t rank) {
#if defined(UBNEXT_EMULATOR)
  return ::ubx_emu::dsm_map(p, rank);
#elif defined(UBX_NO_CLUSTER)
  (void)p;
  (void)rank;
  __trap();
  return 0;
#else
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
  return r;
#endif
}

UBX_DEV uint32_t ld_shared_cluster_u32(dsm_addr_t a) {
  uint32_t v;
#if defined(UBNEXT_EMULATOR)
  ::ubx_emu::dsm_load(&v, a, 4);
#elif defined(UBX_NO_CLUSTER)
  (void)a;
  v = 0;
  __trap();
#else
  asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(v) : "r"(a) : "memory");
#endif
  return v;
}

UBX_DEV void st_shared_cluster_u32(dsm_addr_t a, uint32_t v) {
#if defined(UBNEXT_EMULATOR)
  ::ubx_emu::dsm_store(a, &v, 4);
#elif defined(UBX_NO_CLUSTER)
  (void)a;
  (void)v;
  __trap();
#else
  asm volatile("st.shared::cluster.u32 [%0], %1;" : : "r"(a), "r"(v) : "memory");
#endif
}

// The cluster barrier, split: every thread of the cluster arrives, then waits until all have arrived
// (.aligned: every thread of the warp executes it together). The release arrive orders the thread's earlier
// stores (shared::cluster ones included) before its arrival; the acquire wait orders the later loads after
// the arrivals it waited for: a store before a sibling's arrive.release is visible after one's own wait.
UBX_DEV void cluster_arrive_release() {
#if defined(UBNEXT_EMULATOR)
  ::ubx_emu::cluster_arrive(::ubx_emu::kRelease);
#elif defined(UBX_NO_CLUSTER)
  __trap();
#else
  asm volatile("barrier.cluster.arrive.release.aligned;" : : : "memory");
#endif
}

// Orders nothing: a barrier for control only (and the test-only broken builds that drop the release).
UBX_DEV void cluster_arrive_relaxed() {
#if defined(UBNEXT_EMULATOR)
  ::ubx_emu::cluster_arrive(::ubx_emu::kRelaxed);
#elif defined(UBX_NO_CLUSTER)
  __trap();
#else
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" : : : "memory");
#endif
}

UBX_DEV void cluster_wait_acquire() {
#if defined(UBNEXT_EMULATOR)
  ::ubx_emu::cluster_wait();
#elif defined(UBX_NO_CLUSTER)
  __trap();
#else
  asm volatile("barrier.cluster.wait.acquire.aligned;" : : : "memory");
#endif
}

// ---------------------------------------------------------------- time and waiting
// Nanoseconds of wall time; the emulator uses CLOCK_MONOTONIC so the kernels' own timeout checks
// behave the same on both.
UBX_DEV uint64_t globaltimer_ns() {
#if defined(UBNEXT_EMULATOR)
  return ::ubx_emu::globaltimer_ns();
#else
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
#endif
}

// Call inside every spin loop: on the GPU it frees issue slots for the other warps; in the
// emulator it lets the other emulated threads (and ranks, on few cores) run.
UBX_DEV void spin_pause() {
#if defined(UBNEXT_EMULATOR)
  ::ubx_emu::spin_pause();
#elif defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 700)
  __nanosleep(20);
#endif
}

}  // namespace ubx
