// Dependent-access chains (issue 36, the one-GPU check; tests/gpu_check/chains.py launches this and turns
// what it writes into figures): the round trip of one memory access whose address depends on the result of
// the one before, for the constants of the calibrated cost model (docs/PERF.md). TEST ONLY: not a
// collective, not in ubnext.kernels' ALGOS, never loaded by ubnext itself. It takes the one kernel parameter
// list (entry.cuh) only so that ubnext's launch path (ubnext/_cuda.py) and the emulator launch it as any
// kernel; the descriptor is unused.
//
// ubnext_probe_chain: thread 0 of CTA 0 (the others leave at once) walks a single cycle of 16-byte links
// in `in`, link i's first 32-bit word holding the index of the next link (the host lays out a random
// cycle, so that neither a prefetcher nor the compiler can run ahead). It first walks `hidden` links
// untimed (the host passes the cycle's length: every link once, into L2 and the TLB), then `n` links between
// two %globaltimer reads. One access per link, chosen by `flags` (the ptx.cuh wrapper of each):
//   0  ld_relaxed_sys_v4        ld.relaxed.sys.global.v4.u32: 16 bytes, strong, system scope, relaxed
//   1  ld_volatile_v4           ld.volatile.global.v4.u32: the Lamport poll's load (PTX treats .volatile
//                               as .relaxed.sys)
//   2  atom_add_acq_rel_gpu_u32 atom.acq_rel.gpu.global.add.u32 of 0, returning the next index: the GPU-scope
//                               atomic of the row split's counter (norm.cuh)
// Every access is .sys or .gpu scope, so none is served from L1: the chain times L2 round trips (plus DRAM
// where the cycle does not fit L2, which the host's 256 KiB cycle does). `out` (u64[4]) receives the
// timed links' ns (the second read may pass the last link's access in flight: one link in n), n, the
// index reached (the host checks it: the whole walk happened), and the mode.
// The atomic mode writes `in` (adding 0): the host's own scratch buffer.
#include "../device/platform.cuh"
#include "../device/entry.cuh"
#include "../device/ptx.cuh"

namespace ubx {

template <int kMode>
UBX_DEV uint32_t next_link(uint8_t* links, uint32_t i) {
  uint8_t* link = links + static_cast<uint64_t>(i) * 16u;
  if constexpr (kMode == 0) return ld_relaxed_sys_v4(link).x;
  else if constexpr (kMode == 1) return ld_volatile_v4(link).x;
  else return atom_add_acq_rel_gpu_u32(reinterpret_cast<uint32_t*>(link), 0u);
}

template <int kMode>
UBX_DEV void walk_chain(uint8_t* links, int untimed, int timed, uint64_t* result) {
  uint32_t i = 0;
  for (int k = 0; k < untimed; ++k) i = next_link<kMode>(links, i);
  const uint64_t t0 = globaltimer_ns();
  for (int k = 0; k < timed; ++k) i = next_link<kMode>(links, i);
  const uint64_t t1 = globaltimer_ns();
  result[0] = t1 - t0;
  result[1] = static_cast<uint64_t>(timed);
  result[2] = i;
  result[3] = static_cast<uint64_t>(kMode);
}

}  // namespace ubx

UBX_KERNEL(ubnext_probe_chain) {
  ::ubx::kernel_begin();
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  uint8_t* links = static_cast<uint8_t*>(const_cast<void*>(in));  // the host's scratch (the atomic mode adds 0)
  uint64_t* result = static_cast<uint64_t*>(out);
  switch (flags) {
    case 0: ::ubx::walk_chain<0>(links, hidden, n, result); break;
    case 1: ::ubx::walk_chain<1>(links, hidden, n, result); break;
    case 2: ::ubx::walk_chain<2>(links, hidden, n, result); break;
    default: result[3] = ~0ull;  // an unknown mode: the host sees it
  }
}
