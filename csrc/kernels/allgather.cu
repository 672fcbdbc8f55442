// All-gather of bytes over the symmetric pool, one shot: every rank pushes its shard to every rank.
//
// Kernel: ubnext_allgather_u8, with the one ABI parameter list (docs/ARCHITECTURE.md); `n` is the shard's
// size in BYTES (the data is moved, never interpreted: FSDP2 gathers bf16 parameters, or FP8 data and its
// scale_inv packed as bytes, through the same kernel). residual, residual_out, weight, scale, scale_inv,
// hidden and eps are unused.
//
//   barrier 1 (every peer is done with its earlier use of `out`: we are about to write into it) ->
//   push: rank r stores its shard `in` to bytes [r*n, (r+1)*n) of `out` on every rank, by one
//   st.relaxed.sys per peer, or once through the multicast address (UBNEXT_F_MULTICAST) ->
//   barrier 2 (its release/acquire orders every rank's stores before anyone reads `out`).
//
// Contract:
//   out: world_size * n bytes in this rank's pool data arena, at the same offset on every rank (the call
//   header carries that offset, so ranks that disagree fail with a mismatch error instead of writing into
//   each other's unrelated tensors). in: n bytes anywhere, read locally; it may be this rank's own slice of
//   `out` (FSDP2 copies its shard there first), which is then not stored to again. n % 4 == 0 (16-byte
//   vectors where in and the destination allow, 4-byte words otherwise and for a tail).
// UBNEXT_BREAK_ALLGATHER_SHORT_PUSH (test-only) leaves the last 4-byte word of a shard with a partial
// vector unpushed.
// Traffic per rank: (N-1)*n bytes of peer stores (unicast), or n bytes once through multicast.
#include "../device/platform.cuh"
#include "../device/desc.cuh"
#include "../device/ptx.cuh"
#include "../device/barrier.cuh"
#include "../device/vec.cuh"
#include "../device/slices.cuh"

namespace ubx {

UBX_DEV void allgather_push(const ubnext_comm_desc* d, const void* in, void* out, int n, int flags) {
  if (gridDim.x > UBNEXT_MAX_BLOCKS || n <= 0 || n % 4 != 0) return;  // the host checks: nobody waits
  RankBarrier br = barrier_open_checked(d, UBNEXT_OP_ALLGATHER, UBNEXT_HDR_DTYPE_BYTES, n, 0, flags, out);

  const uint32_t rank = static_cast<uint32_t>(d->rank);
  const uint32_t nranks = static_cast<uint32_t>(d->nranks);
  const uint64_t my_base = static_cast<uint64_t>(d->peer_base[rank]);
  // Byte offset of this rank's slice of `out` in every pool (layouts are identical on every rank).
  const uint64_t dst_off = reinterpret_cast<uint64_t>(out) - my_base + static_cast<uint64_t>(rank) * n;
  const bool in_place = reinterpret_cast<uint64_t>(in) == my_base + dst_off;
  const bool multicast = (flags & UBNEXT_F_MULTICAST) != 0 && d->mc_base != 0;
  const bool vectors = (dst_off % 16 == 0) && (reinterpret_cast<uint64_t>(in) % 16 == 0);
  const int64_t nvec = vectors ? n / 16 : 0;
  const int64_t word0 = nvec * 4;  // 4-byte words past the whole vectors
#if !defined(UBNEXT_BREAK_ALLGATHER_SHORT_PUSH)
  const int64_t nwords = n / 4;
#else
  const int64_t nwords = n / 4 - 1;  // test-only broken build: the shard's last word never leaves
#endif

  if (!barrier_sync(br)) return;

  // Every rank starts with the rank after itself, so they do not all hit the same peer first.
  auto for_each_target = [&](auto&& put) {
    if (multicast) {
      put(static_cast<uint64_t>(d->mc_base) + dst_off);
      return;
    }
    uint32_t p = rank;
    for (uint32_t i = 0; i < nranks; ++i) {
      p = (p + 1u == nranks) ? 0u : p + 1u;
      if (p == rank && in_place) continue;
      put(static_cast<uint64_t>(d->peer_base[p]) + dst_off);
    }
  };
  const int64_t t0 = global_tid(), step = global_threads();
  for (int64_t i = t0; i < nvec; i += step) {
    const uint4 v = ld_plain_v4(static_cast<const char*>(in) + i * 16);
    for_each_target([&](uint64_t dst) {
      void* at = reinterpret_cast<void*>(dst + static_cast<uint64_t>(i) * 16u);
      if (multicast)
        multimem_st_v4(at, v);
      else
        st_relaxed_sys_v4(at, v);
    });
  }
  for (int64_t w = word0 + t0; w < nwords; w += step) {
    const uint32_t v = static_cast<const uint32_t*>(in)[w];
    for_each_target([&](uint64_t dst) {
      uint32_t* at = reinterpret_cast<uint32_t*>(dst + static_cast<uint64_t>(w) * 4u);
      if (multicast)
        multimem_st_relaxed_u32(at, v);
      else
        st_relaxed_sys_u32(at, v);
    });
  }
  if (multicast) fence_proxy_alias();  // the caller reads `out` back through unicast (ptx.cuh)
  (void)barrier_sync(br);
}

}  // namespace ubx

extern "C" __global__ void ubnext_allgather_u8(const ubnext_comm_desc* desc, const void* in, void* out,
                                               const void* residual, void* residual_out, const void* weight,
                                               const float* scale, float* scale_inv, int n, int hidden,
                                               float eps, int flags) {
  (void)residual, (void)residual_out, (void)weight, (void)scale, (void)scale_inv, (void)hidden, (void)eps;
  ::ubx::allgather_push(desc, in, out, n, flags);
}
