// Self-test kernels of the emulator's thread-block clusters (tests/unit/test_emu_cluster.py): the cluster
// ranks, distributed shared memory, the cluster barrier, the co-scheduling of a cluster's blocks, the
// launch failures they can cause, and their count-mode counts. The collective kernel ABI, parameters with
// their own meaning (below); every block of the launch takes part. Built only into the emulator library.
#include "../device/desc.cuh"
#include "../device/platform.cuh"
#include "../device/ptx.cuh"

#include "../device/entry.cuh"

namespace {

__shared__ uint32_t s_box[1024];  // written by the previous block of the cluster (DSM), read here
__shared__ uint32_t s_flag;       // the co-scheduling chain's flag, set by the next block of the cluster

constexpr uint64_t kSpinNs = 20000000000ull;  // a bounded spin: 20 s, then the kernel reports a timeout

// Spins (a scheduling point per pass) until the plain shared word reaches `v`; false after kSpinNs.
bool spin_until(const volatile uint32_t* w, uint32_t v) {
  const uint64_t t0 = ubx::globaltimer_ns();
  while (*w != v) {
    if (ubx::globaltimer_ns() - t0 > kSpinNs) return false;
    ubx::spin_pause();
  }
  return true;
}

void cluster_sync(bool release) {
  if (release) ubx::cluster_arrive_release();
  else ubx::cluster_arrive_relaxed();
  ubx::cluster_wait_acquire();
}

}  // namespace

// flags & 15 selects the test; o = out (uint32), T = blockIdx.x * blockDim.x + threadIdx.x.
//   0 ranks: o[2T] = %cluster_ctarank, o[2T + 1] = %cluster_nctarank.
//   1 message passing through DSM, n rounds: thread t of cluster rank r stores round i's value into s_box[t]
//     of rank r + 1 (mod the cluster) with st.shared::cluster, arrives (flags & 16: relaxed, else release),
//     waits, reads its own s_box[t] with a plain load and counts values other than the previous rank's round
//     i; a second barrier ends the round. o[T] = that count.
//   2 co-scheduling: after one cluster barrier (every block started), block rank r spins on its own s_flag
//     until rank r + 1 sets it through DSM, then sets rank r - 1's; the last rank starts the chain. Each
//     block waits for a sibling, so it completes only if the cluster's blocks run together. Then a last
//     barrier, so that no block exits while a sibling may still store into it. o[T] = 1, or 0xffffffff when
//     a spin timed out.
//   3 misuse, one per n (each fails the launch): 0 arrive twice; 1 wait without arrive; 2 mapa of memory
//     that is not shared; 3 mapa to a rank past the cluster; 4 thread 0 in __syncthreads while the others
//     wait in the cluster barrier (a deadlock inside the block); 5 rank 1 exits at once, rank 0 reads its
//     shared memory 100 ms later.
//   4 counts (one warp per block): a barrier, then n loads of rank (r + 1) mod the cluster's s_box (flags &
//     16: of the block's own, through the cluster window), each joined into control by __syncwarp, then a
//     barrier; flags & 32: instead, a store into the next rank's s_box before the last barrier.
extern "C" __global__ void ubnext_emu_selftest_cluster(UBX_KERNEL_PARAMS) {
  uint32_t* o = static_cast<uint32_t*>(out);
  const uint32_t t = threadIdx.x, T = blockIdx.x * blockDim.x + t;
  const uint32_t r = ubx::cluster_ctarank(), S = ubx::cluster_nctarank();
  const uint32_t next = (r + 1) % S, prev = (r + S - 1) % S;
  switch (flags & 15) {
    case 0:
      o[2 * T] = r;
      o[2 * T + 1] = S;
      return;
    case 1: {
      s_box[t] = 0;
      cluster_sync(true);  // every block's box is zero before any sibling writes it
      const ubx::dsm_addr_t to = ubx::mapa_shared(&s_box[t], next);
      uint32_t bad = 0;
      for (uint32_t i = 0; i < uint32_t(n); ++i) {
        ubx::st_shared_cluster_u32(to, (i + 1) * 64 + r);
        cluster_sync(!(flags & 16));
        bad += s_box[t] != (i + 1) * 64 + prev;
        cluster_sync(true);  // read before the next round overwrites it
      }
      o[T] = bad;
      return;
    }
    case 2: {
      s_flag = 0;
      cluster_sync(true);
      bool ok = true;
      if (r != S - 1) ok = spin_until(&s_flag, 1);
      if (r != 0) ubx::st_shared_cluster_u32(ubx::mapa_shared(&s_flag, prev), 1);
      cluster_sync(true);
      o[T] = ok ? 1 : 0xffffffffu;
      return;
    }
    case 3:
      switch (n) {
        case 0:
          ubx::cluster_arrive_release();
          ubx::cluster_arrive_release();
          return;
        case 1: ubx::cluster_wait_acquire(); return;
        case 2: (void)ubx::mapa_shared(o, next); return;
        case 3: (void)ubx::mapa_shared(&s_box[t], S); return;
        case 4:
          if (t == 0) __syncthreads();
          else cluster_sync(true);
          return;
        case 5:
          if (r == 1) return;
          if (r == 0) {
            const uint64_t t0 = ubx::globaltimer_ns();
            while (ubx::globaltimer_ns() - t0 < 100000000ull) ubx::spin_pause();
            o[T] = ubx::ld_shared_cluster_u32(ubx::mapa_shared(&s_box[t], 1));
          }
          return;
      }
      return;
    case 4: {
      s_box[t] = t;
      cluster_sync(true);
      uint32_t sum = 0;
      if (flags & 32) {
        ubx::st_shared_cluster_u32(ubx::mapa_shared(&s_box[t], next), r);
      } else {
        const ubx::dsm_addr_t from = ubx::mapa_shared(&s_box[t], (flags & 16) ? r : next);
        for (int i = 0; i < n; ++i) {
          sum += ubx::ld_shared_cluster_u32(from);
          __syncwarp();
        }
      }
      cluster_sync(true);
      o[T] = sum;
      return;
    }
  }
}
