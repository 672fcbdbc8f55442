/* C API of the CPU emulator (libubnext_emu.so). Bound from Python by ubnext/_emu.py.
 * All functions return 0 (or a valid value) on success; the launch writes a message into `err`
 * on failure. Calls are not meant to run concurrently with a launch in the same process, except
 * ubnext_emu_traffic after it returns. */
#pragma once
#include <stdint.h>

/* The library is built with -fvisibility=hidden: only this API and the kernels are exported. */
#define UBNEXT_EMU_API __attribute__((visibility("default")))

#ifdef __cplusplus
extern "C" {
#endif

#define UBNEXT_EMU_MAX_RANKS 16
#define UBNEXT_EMU_MAX_GRID 256
/* Words of ubnext_emu_traffic: [peer_store_bytes[16], peer_store_ops[16], peer_load_bytes[16],
 * peer_load_ops[16], mc_store_bytes, mc_store_ops, mc_ld_reduce_bytes, mc_ld_reduce_ops,
 * mc_red_bytes, mc_red_ops, peer_atomic_ops]. */
#define UBNEXT_EMU_TRAFFIC_WORDS (4 * UBNEXT_EMU_MAX_RANKS + 7)

/* Launch kernel `kernel` (an extern "C" kernel of this library with the collective ABI of
 * docs/ARCHITECTURE.md) with `grid` blocks of `block` threads in clusters of `cluster` blocks
 * (1: no cluster; blocks [k*cluster, (k+1)*cluster) form cluster k, as a 1-D launch with the GPU's
 * cluster-dimension attribute); args[i] points to parameter i, as cuLaunchKernel's kernelParams
 * (args[0] to the 256-byte descriptor). Synchronous. `flags`: UBNEXT_EMU_LAUNCH_PDL, as a GPU launch
 * with the programmatic-stream-serialization attribute: a memory access of a thread before its
 * griddepcontrol.wait fails the launch; UBNEXT_EMU_LAUNCH_CLUSTER_NONPORTABLE, as the
 * non-portable-cluster-size-allowed attribute: clusters of 9..16 blocks (without it at most 8, the
 * portable size; 16 is Hopper's most). A grid that is not a multiple of the cluster is refused, as
 * cuLaunchKernelEx refuses it. Returns 0, or nonzero with a message in err: 1 bad arguments, 2 unknown
 * kernel, 3 the kernel failed (deadlock inside a block, __trap, stack overflow, an access before the
 * wait, a distributed-shared-memory access out of bounds or to an exited block). A launch that runs
 * past the watchdog prints a report and aborts the process. */
#define UBNEXT_EMU_LAUNCH_PDL 1
#define UBNEXT_EMU_LAUNCH_CLUSTER_NONPORTABLE 2
#define UBNEXT_EMU_MAX_CLUSTER_PORTABLE 8
#define UBNEXT_EMU_MAX_CLUSTER 16
UBNEXT_EMU_API int ubnext_emu_launch(const char* kernel, int grid, int block, int cluster, const void* const* args,
                                     int flags, char* err, int errlen);
/* Words of ubnext_emu_griddep, for the last launch that succeeded: [threads, threads that executed
 * griddepcontrol.wait, threads that executed griddepcontrol.launch_dependents]. */
#define UBNEXT_EMU_GRIDDEP_WORDS 3
UBNEXT_EMU_API int ubnext_emu_griddep(uint64_t* out, int nwords);

/* Register a symmetric region: peer_bases[r] is rank r's copy as mapped in this process (own rank
 * included), all `bytes` long; mc_base is this region's multicast range (from ubnext_emu_reserve)
 * or 0. Returns a handle >= 0, or -1 when the table is full or the arguments are invalid. */
UBNEXT_EMU_API int64_t ubnext_emu_register(int rank, int nranks, const uint64_t* peer_bases, uint64_t bytes,
                                           uint64_t mc_base);
UBNEXT_EMU_API int ubnext_emu_unregister(int64_t handle);

/* An inaccessible (PROT_NONE) address range to serve as a multicast address; 0 on failure. */
UBNEXT_EMU_API uint64_t ubnext_emu_reserve(uint64_t bytes);
UBNEXT_EMU_API int ubnext_emu_release(uint64_t addr, uint64_t bytes);

/* Traffic of the last launch (see UBNEXT_EMU_TRAFFIC_WORDS); returns the words written. */
UBNEXT_EMU_API int ubnext_emu_traffic(uint64_t* out, int nwords);

/* Count mode (memory.cpp states its rules): each launch measures its critical path. Stamps need a
 * shadow beside every rank's copy of a region, as shared as the copy: stamp_bases[r] is rank r's,
 * 6 bytes of shadow per byte of region (three 8-byte words per 4-byte word), zero-filled. */
UBNEXT_EMU_API int ubnext_emu_register_stamps(int64_t handle, const uint64_t* stamp_bases);
UBNEXT_EMU_API void ubnext_emu_set_counting(int on);
/* Words of ubnext_emu_counts, for the last launch in count mode: [ctas, hops, fences,
 * max_cta_bytes, total_bytes]: the longest chain of NVLink crossings (hops) and the system-scope
 * fences on it, the most bytes one block moved, and all blocks' bytes; then the calibrated model's
 * (issue 38 item 1; memory.cpp states the rules) [t_hops, l2, atomics, waits, cta_load_bytes,
 * cta_inflight, cta_remote_load_bytes]: the NVLink crossings, dependent local L2 round trips, atomics
 * and serialised waits of its critical chain (the chain its weights make longest), and, of the block
 * that needs the most rounds of its bytes in flight, the bytes it loaded, the most it had in flight at
 * one control point, and how many of its loaded bytes came from peers or the switch; then
 * [mc_ld_bytes, mc_store_bytes]: the launch's multimem.ld_reduce bytes and its multimem.st and .red bytes
 * (each counted once, at its size); then [dsm, cluster_syncs]: the distributed-shared-memory accesses of
 * a sibling block and the cluster barriers on the calibrated model's critical chain. A reader of the first 5
 * words sees what it saw before. */
#define UBNEXT_EMU_COUNT_WORDS 16
UBNEXT_EMU_API int ubnext_emu_counts(uint64_t* out, int nwords);
/* Count mode: the count words of every launch since the previous call (oldest first; at most the newest
 * 4096 are kept), up to max_launches records of UBNEXT_EMU_COUNT_WORDS words each; forgets them all.
 * Returns the records written. */
UBNEXT_EMU_API int ubnext_emu_count_log(uint64_t* out, int max_launches);
/* Count mode: the weights (ns) that order the calibrated model's chains: per NVLink hop, dependent local
 * L2 round trip, atomic, serialised wait (default 600, 143, 533, 143: the calibrated Hopper constants). */
UBNEXT_EMU_API void ubnext_emu_set_count_weights(uint32_t hop, uint32_t l2, uint32_t atomic, uint32_t wait);
/* Count mode: the weights (ns) of a distributed-shared-memory access of a sibling block and of a cluster
 * barrier in that order (default 103 and 206: memory.cpp's count-mode section gives their sources). */
UBNEXT_EMU_API void ubnext_emu_set_cluster_weights(uint32_t dsm, uint32_t cluster_sync);

/* chaos != 0: random delays and store reordering. seed 0: derived from time and pid. */
UBNEXT_EMU_API void ubnext_emu_configure(int chaos, uint64_t seed);
/* Wall-clock bound of one launch before the watchdog aborts the process (default 90 s); in count mode
 * with a progress page, a bound of stall time instead (below). */
UBNEXT_EMU_API void ubnext_emu_set_watchdog_ns(uint64_t ns);
/* Map the file `path` (created, 4096 bytes) as the progress page shared by every rank that passes the
 * same path. In count mode with a page, the kernels' clock (globaltimer_ns: their timeouts) and the
 * watchdog count stall time, the time in which no rank sharing the page did any work, instead of
 * wall-clock time (sched.cpp). null or "": no page (wall-clock time). Returns 0 or an errno. */
UBNEXT_EMU_API int ubnext_emu_share_progress(const char* path);

#ifdef __cplusplus
}
#endif
