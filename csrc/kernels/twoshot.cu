// Unicast two-shot allreduce (no multicast: PCIe/NVLink P2P without NVLS, or several ranks on one GPU),
// optionally fused with residual add + RMSNorm and FP8 e4m3 output.
//
// Kernels: ubnext_twoshot_{bf16,fp16,fp32}, with the one ABI parameter list (docs/ARCHITECTURE.md).
//
//   barrier -> reduce-scatter: rank r sums ITS portion (slices.cuh: 1/N of the flat message, or 1/N of
//   every token row in row mode) by loading the same offset of `in` from every rank's pool
//   (ld.relaxed.sys, all peers' loads issued before the first add) and adding in fp32 in RANK ORDER
//   0..N-1, rounded once to T -> all-gather: st.relaxed.sys of the T result to that offset of `in` on every
//   rank (starting with rank r+1, so the ranks do not all hit the same peer first) -> barrier (its
//   release/acquire orders the stores before anyone reads them) -> (row mode) every rank runs the row math
//   (norm.cuh: RMSNorm, FP8) on every row from its own, now complete, copy of `in`. Fused, the owner adds
//   the residual to its fp32 sum before the one rounding (slices.cuh, owner_add_round): `in` then carries
//   residual_out.
//   Why the row math runs after the all-gather on every rank: see csrc/kernels/nvls.cu (outputs need not
//   be in the pool, per-rank residual, FP8 works, one broadcast instead of two or three).
//
// Bits: each element is summed once, in a fixed order, and broadcast; the row math is deterministic, so
// every rank gets IDENTICAL bits (given identical residual and weight on every rank).
//
// Contract (the same as nvls_twoshot):
//   in lies in this rank's pool data arena (peers read and write it at the same offset).
//   in == out (plain; in place), or out any buffer not overlapping in (copied after the exchange; in then
//   also holds the result).
//   Row mode (FUSED_NORM or an FP8 flag; needs hidden % V == 0, n % hidden == 0): `in` is clobbered (it
//   ends holding the allreduce result in T); out == in is allowed for dtype output; FP8 output needs out
//   (n bytes) not overlapping in. residual / residual_out / weight / scale / scale_inv anywhere, not
//   overlapping in or out; residual_out may alias residual.
//   residual_out = T(sum + residual) (one rounding; the residual of each portion's owner);
//   out = T((r * rms) * w) or its e4m3 values (norm.cuh);
//   scale_inv[0] = scale[0] (FP8_STATIC) or scale_inv[row] = max(amax_row / 448, 1e-12) (FP8_PER_TOKEN).
//   any n >= 1 in flat mode (a partial last vector: see slices.cuh); gridDim.x <= UBNEXT_MAX_BLOCKS, same grid on every rank.
//
// Ordering: barrier 1 (st.release.sys / ld.acquire.sys flags) orders every rank's earlier writes of `in`
// before any peer load; barrier 2 orders every rank's peer stores before the reads of the row phase and
// before this kernel ends (so the next kernel on our stream sees the whole result). No trailing barrier in
// row mode: after barrier 2 no rank touches another rank's memory in this call (see nvls.cu).
//
// Traffic per rank (B = message bytes, N ranks): peer loads (N-1)*B/N bytes (+ B/N local), peer stores
// (N-1)*B/N bytes (+ B/N local); each rank's memory serves (N-1)*B/N bytes of loads to peers and receives
// (N-1)*B/N bytes of stores. Barriers: 2 x (N-1) 4-byte release stores per block (or one multimem store
// per block when the pool has multicast anyway: barrier.cuh says why every kernel signals the same way).
#include "../device/platform.cuh"
#include "../device/desc.cuh"
#include "../device/entry.cuh"
#include "../device/ptx.cuh"
#include "../device/barrier.cuh"
#include "../device/vec.cuh"
#include "../device/reduce.cuh"
#include "../device/norm.cuh"
#include "../device/slices.cuh"

namespace ubx {

template <typename T>
UBX_DEV void twoshot_unicast(const ubnext_comm_desc* d, const void* in, void* out, const void* residual,
                             void* residual_out, const void* weight, const float* scale, float* scale_inv, int n,
                             int hidden, float eps, int flags) {
  constexpr int V = DType<T>::kElems;
  __shared__ uint4 s_cache[UBX_ROW_CACHE_VECS];
  __shared__ float s_red[UBX_RED_SCRATCH];
  if (!barrier_kernel_args_ok<T>(n, hidden, flags)) return;
  // opened early: its loads overlap the setup below
  RankBarrier br = barrier_open_checked(d, UBNEXT_OP_TWOSHOT, DType<T>::kCode, n, hidden, flags, in, eps);

  const uint32_t rank = static_cast<uint32_t>(d->rank);
  const uint32_t nranks = static_cast<uint32_t>(d->nranks);
  const Slices sl = message_slices<T>(n, hidden, flags, nranks);
  // Byte offset of `in` in every pool (layouts are identical on every rank).
  const uint64_t in_off = reinterpret_cast<uint64_t>(in) - static_cast<uint64_t>(d->peer_base[rank]);

  if (!barrier_sync(br)) return;

  // Reduce-scatter of one vector: rank order 0..N-1, fp32, rounded once to T; fused: with the residual
  // added before that one rounding (slices.cuh, owner_add_round).
  const bool fused = (flags & UBNEXT_F_FUSED_NORM) != 0;
  auto load = [&](int64_t gi) -> uint4 {
    const uint64_t off = in_off + static_cast<uint64_t>(gi) * 16u;
    if (fused) return owner_add_round<T>(d, off, residual, gi);
    float acc[V];
    sum_over_ranks<T>(d, off, acc);
    return pack<T>(acc);
  };
  // All-gather of one vector: to every rank, starting after ourselves.
  const int64_t partial = (n % V != 0) ? static_cast<int64_t>(n) / V : -1;  // index of a partial last vector
  auto store = [&](int64_t gi, int64_t, const uint4& v) {
    const uint64_t off = in_off + static_cast<uint64_t>(gi) * 16u;
    uint32_t p = rank;
    for (uint32_t i = 0; i < nranks; ++i) {
      p = (p + 1u == nranks) ? 0u : p + 1u;
      void* dst = reinterpret_cast<void*>(static_cast<uint64_t>(d->peer_base[p]) + off);
      if (gi != partial) st_relaxed_sys_v4(dst, v);
      else store_partial_sys<T>(dst, v, static_cast<int64_t>(n) - gi * V);  // slices.cuh: never past n
    }
  };
  for_my_slice<2>(sl, rank, load, store);
  if (!barrier_sync(br)) return;
  griddep_launch_dependents();  // every rank has reduced its slice of `in` (ptx.cuh)
  twoshot_local_phase<T>(sl, nranks, in, out, row_phase_residual(residual), residual_out, weight, scale, scale_inv, n,
                         hidden, eps, flags, s_cache, s_red);
}

}  // namespace ubx

#define UBX_TWOSHOT_ENTRY(NAME, T)                                                                              \
  UBX_KERNEL(NAME) {                                                                                            \
    ::ubx::kernel_begin();                                                                                      \
    ::ubx::twoshot_unicast<T>(&desc, in, out, residual, residual_out, weight, scale, scale_inv, n, hidden, eps, \
                              flags);                                                                           \
  }

UBX_TWOSHOT_ENTRY(ubnext_twoshot_bf16, __nv_bfloat16)
UBX_TWOSHOT_ENTRY(ubnext_twoshot_fp16, __half)
UBX_TWOSHOT_ENTRY(ubnext_twoshot_fp32, float)
