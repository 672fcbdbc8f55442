// NVLS (NVLink SHARP, multicast) allreduce kernels, optionally fused with residual add + RMSNorm and
// FP8 e4m3 output. sm_90+ with a multicast-capable pool (desc->mc_base != 0).
//
// Kernels (the one ABI parameter list, docs/ARCHITECTURE.md):
//   ubnext_nvls_twoshot_{bf16,fp16,fp32}   in place: reduce-scatter by multimem.ld_reduce, broadcast by
//                                           multimem.st, per-block barriers around it
//   ubnext_nvls_oneshot_{...}              every rank multimem.ld_reduces the whole message
//   ubnext_nvls_lamport_{...}              two-shot whose broadcast lands in the pre-poisoned Lamport
//                                           buffers and is polled, instead of a final barrier; plain
//                                           with UBNEXT_F_RANK_ORDER: its push form (no barrier at all)
//
// Addresses: a pool pointer p of this rank has the multicast address mc_base + (p - peer_base[rank])
// (barrier.cuh: mc_addr). `in` must lie in this rank's pool data arena for all three kernels.
//
// ---------------------------------------------------------------- nvls_twoshot
//   barrier -> rank r reduces ITS portion of the message (slices.cuh: 1/N of the flat message, or 1/N of
//   every token row in row mode) with multimem.ld_reduce (fp32 accumulation in the switch, result rounded
//   to T) -> multimem.st of the T result back to the same offset of `in`, i.e. into every rank's copy ->
//   (fused rows, see "One rounding" below, and plain calls with UBNEXT_F_RANK_ORDER, see "Rank order":
//   unicast loads of the peers' copies instead, summed in fp32 in rank order, plus the owner's residual
//   when fused, rounded once) ->
//   barrier -> (row mode) every rank runs the row math (residual add, RMSNorm, FP8) on every row, from its
//   own, now complete, copy of `in`, writing out / residual_out / scale_inv locally.
//   Each element is reduced once and broadcast, and the row math is deterministic (norm.cuh), so every
//   rank gets IDENTICAL bits (given identical residual and weight on every rank, the tensor-parallel case).
//   Why the row math runs after the broadcast, on every rank, instead of on the owner before it: the
//   outputs (out, residual_out, per-token scale_inv) then need not lie in the pool nor be broadcast (one
//   multicast store of the reduced value instead of two or three), the residual add uses each rank's own
//   residual (the unfused semantics: all_reduce(in) + residual), and FP8 output works. The price is
//   N-fold duplicated row math, which is local memory traffic (HBM/L2, ~7x NVLink bandwidth).
//   Contract:
//     in == out (plain; in place), or out any buffer not overlapping in (copied after the exchange; in
//       then also holds the result), or (flat, UBNEXT_F_MULTICAST) out in the pool at the same offset on
//       every rank, not overlapping in: the broadcast goes straight into out, and in is left unmodified.
//     Grid (flat): NCCL's multicast grid, ceil(16 / nranks) CTAs below sm_100 (launch_rules.h).
//     Row mode: `in` is clobbered (it ends holding the allreduce result in T). out == in is allowed for
//       dtype output; FP8 output needs out (n bytes) not overlapping in. residual / residual_out / weight /
//       scale / scale_inv anywhere (device memory), not overlapping in or out; residual_out may alias
//       residual. Results: residual_out = T(sum + residual), one rounding, with the residual of each
//       portion's owner; out = T((r * rms) * w) (norm.cuh) or its e4m3 quantisation; scale_inv[0] = scale[0]
//       (FP8_STATIC), scale_inv[row] (FP8_PER_TOKEN).
//   One rounding (issue 26), and why fused rows do not ld_reduce: multimem.ld_reduce on bf16/fp16 returns
//   the sum already rounded to T, so T(ld_reduce + residual) rounds twice (where the sum and the residual
//   cancel, up to 116 times the result's own rounding error). The two ways to keep one rounding: stage
//   every rank's input as fp32 and ld_reduce that (twice the switch bytes and a staging area twice the
//   message, and the switch's summation order is not the rank order, so the bits would still differ from
//   the Lamport path's), or read the portion from each peer by unicast and sum in fp32 in rank order
//   (slices.cuh, owner_add_round: the bits of every other fused path). We take the second: the owner
//   loads (N-1)/N of the message's bytes over NVLink instead of the switch delivering 1/N reduced, the
//   same hops (a load round trip either way), and at decode sizes, where the fused op runs, latency
//   rather than bytes is the cost. `python -m ubnext.bench --model` counts it (docs/PERF.md).
//   Ordering: barrier 1 (release/acquire .sys) orders every rank's earlier writes of `in` before any
//   ld_reduce; barrier 2 orders every rank's multimem.st before the reads of the row phase / the end of the
//   kernel. No trailing barrier is needed in row mode: after barrier 2 no rank touches another rank's
//   memory in this call, and block b passes barrier 2 only when block b of every rank has finished its
//   ld_reduces and stores; the next call's barrier 1 covers the rest (its peers' previous kernels are
//   complete by stream order).
//   Traffic per rank (B = message bytes): multimem.ld_reduce of B/N bytes and multimem.st of B/N bytes;
//   the switch reads B bytes out of each rank's memory in total (every slice) and delivers B bytes of
//   broadcast into it. Barriers: 2 x one 4-byte multimem.st.release per block.
//
// ---------------------------------------------------------------- nvls_oneshot
//   barrier -> every rank multimem.ld_reduces the WHOLE message into its own `out` (anywhere), or runs the
//   row math on every row from ld_reduce -> barrier.
//   The trailing barrier: peers read our `in` through the multicast address until they are done; without
//   it our next producer (any kernel after this one on our stream) could overwrite `in` while a slow peer
//   still reads it. Block b passes it only when block b of every rank has finished reading.
//   Bits: every rank reduces every element itself and the switch's summation order is not specified, so
//   results MAY DIFFER IN THE LAST BIT BETWEEN RANKS. Use nvls_twoshot when ranks must agree bitwise.
//   In row mode with rows longer than the shared-memory row cache (hidden > 16384 for 16-bit types,
//   > 8192 for fp32) and no residual_out, norm_row re-reads a vector through ld_reduce; the switch may
//   round that second sum differently, so r may differ in the last bit from the value used for the RMS.
//   Contract: in in the pool (not modified); out, residual, residual_out, weight, scale, scale_inv anywhere,
//   not overlapping in; residual_out may alias residual.
//   Traffic per rank: multimem.ld_reduce of B bytes (the switch reads N*B bytes out of each rank's memory,
//   in total), no multicast stores except the barriers (2 per block).
//
// ---------------------------------------------------------------- nvls_lamport
//   barrier -> reduce our portion with ld_reduce, sanitise -0 (so no word can equal the sentinel), and
//   multimem.st it into slot [rank] of Lamport buffer k % 3 (slices.cuh gives the position) -> re-poison our
//   copy of buffer (k + 2) % 3 -> poll our own copy (volatile loads, every word ready) and copy to out, or
//   run the row math from it -> block 0 advances the rotation (lamport_rotation.cuh, shared with
//   lamport.cu: same counters, same buffers, same bytes-per-slot meaning).
//   No final barrier: when our poll completes, every rank has finished its ld_reduces (each vector is
//   stored only after it was reduced), so nobody reads our `in` any more; the Lamport buffer is protected
//   by the rotation (see lamport_rotation.cuh), and barrier 1 even guarantees that every peer is in this
//   call.
//   Bits: identical on every rank (as nvls_twoshot; -0 results come out as +0).
//   Contract: in in the pool (NOT modified); out, residual, residual_out, weight, scale, scale_inv anywhere,
//   not overlapping in; residual_out may alias residual. Per-slot bytes nrows*ceil(nv/N)*16 <= message
//   bytes must fit desc->lamport_slot_bytes (the host checks bytes <= slot, which implies it).
//   Traffic per rank: multimem.ld_reduce of B/N bytes, multimem.st of ~B/N bytes into the Lamport buffers
//   (each rank receives ~B bytes); locally: the poll reads ~B bytes, the re-poison writes ~B bytes.
//
// Common: any n >= 1 in flat mode (a partial last vector: see slices.cuh); row mode needs hidden % V == 0
// and n % hidden == 0; gridDim.x <= UBNEXT_MAX_BLOCKS and the same grid on every rank; blockDim.x a multiple of 32. Violations
// (all ranks see the same arguments) make every rank return at once, touching nothing.
// On a timeout the kernel reports {TIMEOUT, op, rank, peer} and aborts the communicator on every rank
// (barrier.cuh: sticky abort); it must then be re-created.
#include "../device/platform.cuh"
#include "../device/desc.cuh"
#include "../device/entry.cuh"
#include "../device/ptx.cuh"
#include "../device/barrier.cuh"
#include "../device/vec.cuh"
#include "../device/reduce.cuh"
#include "../device/norm.cuh"
#include "../device/slices.cuh"
#include "../device/lamport_rotation.cuh"
#include "../device/lamport_poll.cuh"

namespace ubx {

// multimem.ld_reduce for the kernel dtype.
template <typename T>
struct McReduce;
template <>
struct McReduce<__nv_bfloat16> {
  UBX_DEV static uint4 ld(uint64_t mc) { return multimem_ld_reduce_bf16x8(reinterpret_cast<const void*>(mc)); }
};
template <>
struct McReduce<__half> {
  UBX_DEV static uint4 ld(uint64_t mc) { return multimem_ld_reduce_f16x8(reinterpret_cast<const void*>(mc)); }
};
template <>
struct McReduce<float> {
  UBX_DEV static uint4 ld(uint64_t mc) { return multimem_ld_reduce_f32x4(reinterpret_cast<const void*>(mc)); }
};

// Host contract checks shared by the NVLS kernels; false: return without touching anything.
template <typename T>
UBX_DEV bool nvls_args_ok(const ubnext_comm_desc* d, int n, int hidden, int flags) {
  return d->mc_base != 0 && barrier_kernel_args_ok<T>(n, hidden, flags);
}

// Rank order (issue 26's batch-invariant mode): multimem.ld_reduce promises no summation order (and
// rounds to T before a fused residual add), so the two-shot kernels sum their portion by unicast loads of
// every rank's copy, in rank order, in fp32, rounded once (slices.cuh: owner_add_round, the unicast
// two-shot's and Lamport's bits), for fused rows always and for a plain call when the host asks with
// UBNEXT_F_RANK_ORDER; the broadcast stays multicast. Cost: the owner loads (N-1)/N of the message over
// NVLink instead of the switch delivering 1/N reduced; the model counts the flagged form on its own
// (ubnext/_costmodel.py). The plain flagged nvls_lamport does not load: its ranks push the portions to
// their owners instead (nvls_lamport_push, below: 2 hops, no barrier). nvls_oneshot has no such form: every rank would load the whole message from
// every peer, the unicast one-shot's (Lamport's) traffic without its single hop.
// UBNEXT_BREAK_RANK_ORDER_IGNORED (test-only) ignores the flag: the plain call ld_reduces, whose order
// the emulator's chaos mode shuffles, and the mode's rank-order reference must see it (3+ ranks).
UBX_DEV bool sums_in_rank_order(int flags) {
#if !defined(UBNEXT_BREAK_RANK_ORDER_IGNORED)
  return (flags & (UBNEXT_F_FUSED_NORM | UBNEXT_F_RANK_ORDER)) != 0;
#else
  return (flags & UBNEXT_F_FUSED_NORM) != 0;
#endif
}

// Row-mode source for nvls_oneshot: the sum comes straight from the switch.
template <typename T>
struct McSrc {
  uint64_t mc_in;
  UBX_DEV bool operator()(int64_t gi, float (&s)[DType<T>::kElems]) const {
    unpack<T>(McReduce<T>::ld(mc_in + static_cast<uint64_t>(gi) * 16u), s);
    return true;
  }
};

// Row-mode source for nvls_lamport: vector gi of the message, polled in our own Lamport buffer, at the
// slot and position where its owner rank stored it.
template <typename T>
struct LamportSliceSrc {
  const uint8_t* buf;  // our copy of buffer b, slot 0
  uint64_t slot_bytes;
  Slices sl;
  const ubnext_comm_desc* d;
  bool failed;
  UBX_DEV bool operator()(int64_t gi, float (&s)[DType<T>::kElems]) {
    constexpr int V = DType<T>::kElems;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (!failed) {
      const int64_t row = gi / sl.nv, i = gi - row * sl.nv;
      const uint32_t owner = static_cast<uint32_t>(i / sl.cv);
      const int64_t pos = row * sl.cv + (i - static_cast<int64_t>(owner) * sl.cv);
      const uint8_t* addr = buf + owner * slot_bytes + static_cast<uint64_t>(pos) * 16u;
      v = ld_volatile_v4(addr);
      if (!is_ready(v) && !poll_ready_v4(addr, v, d, UBNEXT_OP_NVLS_LAMPORT, owner)) {
        failed = true;
        v = make_uint4(0u, 0u, 0u, 0u);
      }
    }
    unpack<T>(v, s);
    if (failed) {
#pragma unroll
      for (int j = 0; j < V; ++j) s[j] = 0.f;
    }
    return !failed;
  }
};

// multimem.ld_reduce loads a thread keeps in flight on the switch's path (nvls_twoshot: why 16).
constexpr int kMulticastDepth = 16;

// ---------------------------------------------------------------- nvls_twoshot
template <typename T>
UBX_DEV void nvls_twoshot(const ubnext_comm_desc* d, const void* in, void* out, const void* residual,
                          void* residual_out, const void* weight, const float* scale, float* scale_inv, int n,
                          int hidden, float eps, int flags) {
  constexpr int V = DType<T>::kElems;
  __shared__ uint4 s_cache[UBX_ROW_CACHE_VECS];
  __shared__ float s_red[UBX_RED_SCRATCH];
  if (!nvls_args_ok<T>(d, n, hidden, flags)) return;
  // Straight into `out` (flat, out != in, UBNEXT_F_MULTICAST): the host found `out` in the pool, at the same
  // offset on every rank, so the broadcast lands in every rank's `out` and no portion is copied afterwards
  // (nor `in` staged by a host that has both in the pool). The call header carries out's offset in the
  // word that flat calls leave unused (hidden), so ranks that disagree on `out` fail with a mismatch at
  // the first barrier, before anything is stored.
  const bool direct = !uses_rows(flags) && out != in && (flags & UBNEXT_F_MULTICAST) != 0;
  const uint64_t out_off = reinterpret_cast<uint64_t>(out) - static_cast<uint64_t>(d->peer_base[d->rank]);
  const int header_hidden = direct ? static_cast<int>(static_cast<uint32_t>(out_off >> 4)) : hidden;
  // opened early: its loads overlap the setup below
  RankBarrier br = barrier_open_checked(d, UBNEXT_OP_NVLS_TWOSHOT, DType<T>::kCode, n, header_hidden, flags, in, eps);
  const uint32_t rank = static_cast<uint32_t>(d->rank);
  const uint32_t nranks = static_cast<uint32_t>(d->nranks);
  const Slices sl = message_slices<T>(n, hidden, flags, nranks);
  const uint64_t mc_in = mc_addr(d, in);
  const void* dst = direct ? out : in;  // where the reduced portions land, on every rank
  const uint64_t mc_dst = mc_addr(d, dst);

  if (!barrier_sync(br)) return;
  // Fused rows, and plain calls with UBNEXT_F_RANK_ORDER: the owner's fp32 rank-order sum by unicast
  // loads (owner_add_round; see "Rank order" above); else the switch's.
  const bool unicast_sum = sums_in_rank_order(flags);
  const uint64_t in_off = reinterpret_cast<uint64_t>(in) - static_cast<uint64_t>(d->peer_base[rank]);
  auto load = [&](int64_t gi) -> uint4 {
    if (unicast_sum) return owner_add_round<T>(d, in_off + static_cast<uint64_t>(gi) * 16u, residual, gi);
    return McReduce<T>::ld(mc_in + static_cast<uint64_t>(gi) * 16u);
  };
  const int64_t partial = (n % V != 0) ? static_cast<int64_t>(n) / V : -1;  // index of a partial last vector
  auto store = [&](int64_t gi, int64_t, const uint4& v) {
    if (gi != partial) {
      multimem_st_v4(reinterpret_cast<void*>(mc_dst + static_cast<uint64_t>(gi) * 16u), v);
    } else {  // slices.cuh: never store past n
      for (uint32_t p = 0; p < nranks; ++p)
        store_partial_sys<T>(reinterpret_cast<void*>(peer_addr(d, dst, p) + static_cast<uint64_t>(gi) * 16u), v,
                             static_cast<int64_t>(n) - gi * V);
    }
  };
  // Loads in flight per thread: 16 on the switch's path (256 threads x 16 x 16 B = 64 KB per CTA, what NCCL's
  // allreduceMultimem keeps with 512 threads x 8: at NCCL's grid of ceil(16 / N) CTAs the rounds of a CTA's
  // loads are NCCL's), 4 on the unicast rank-order path, whose every item already loads N peers' vectors.
  // Why deeper unrolling and not 512-thread CTAs: the block size is part of the launch rules that the
  // Python launcher and the C API share (launch_rules.h) and of their pins; the depth is this kernel's own.
  if (unicast_sum) for_my_slice<4>(sl, rank, load, store);
  else for_my_slice<kMulticastDepth>(sl, rank, load, store);
  // The one fence.proxy.alias left on a kernel path (issue 24 A), and only where this kernel reads the
  // broadcast back through unicast: the row phase, or the flat copy to an `out` other than `in`. Those
  // reads are plain loads, which validate nothing and may be served from L1, of bytes that this thread,
  // its block and block b of every peer stored through multicast. The PTX model orders two aliases'
  // accesses only with an alias proxy fence on the causality path from the store to the load; for a
  // peer's store that path runs through the peer's barrier signal, so the fence sits here, at the
  // store, in every storing thread, before barrier 2 publishes it. Flat and in place, nothing of this
  // kernel reads the result, nor when it went straight into `out`: its readers are later kernels
  // (all-gather's argument, allgather.cu).
  // UBNEXT_BREAK_NO_PROXY_FENCE_NVLS_TWOSHOT (test-only) drops it; chaos mode's proxy model then hands
  // the storing thread the bytes from before its store, and the fused two-shot rows come out wrong.
#if !defined(UBNEXT_BREAK_NO_PROXY_FENCE_NVLS_TWOSHOT)
  if (sl.rows || (out != in && !direct)) fence_proxy_alias();
#endif
  // Barrier 2 also when nothing follows it here: it tells this rank that every peer's stores into its
  // copy have landed, and every peer that nobody reads its `in` any more, before the next kernel.
  if (!barrier_sync(br)) return;
  griddep_launch_dependents();  // every rank has reduced its slice of `in` (ptx.cuh)
  if (direct) return;
  twoshot_local_phase<T>(sl, nranks, in, out, row_phase_residual(residual), residual_out, weight, scale, scale_inv, n,
                         hidden, eps, flags, s_cache, s_red);
}

// ---------------------------------------------------------------- nvls_oneshot
template <typename T>
UBX_DEV void nvls_oneshot(const ubnext_comm_desc* d, const void* in, void* out, const void* residual,
                          void* residual_out, const void* weight, const float* scale, float* scale_inv, int n,
                          int hidden, float eps, int flags) {
  constexpr int V = DType<T>::kElems;
  constexpr int kBatch = 4;
  __shared__ uint4 s_cache[UBX_ROW_CACHE_VECS];
  __shared__ float s_red[UBX_RED_SCRATCH];
  if (!nvls_args_ok<T>(d, n, hidden, flags)) return;
  // opened early: its loads overlap the setup below
  RankBarrier br = barrier_open_checked(d, UBNEXT_OP_NVLS_ONESHOT, DType<T>::kCode, n, hidden, flags, in, eps);
  const uint64_t mc_in = mc_addr(d, in);
  const int64_t nvec = (static_cast<int64_t>(n) + V - 1) / V;  // last one may be partial

  if (!barrier_sync(br)) return;
  if (!uses_rows(flags)) {
    const int64_t first = global_tid(), step = global_threads();
    for (int64_t g0 = first; g0 < nvec; g0 += kBatch * step) {
      uint4 v[kBatch];  // zeroed: only entries with a valid index are loaded / used
      for (int u = 0; u < kBatch; ++u) v[u] = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
      for (int u = 0; u < kBatch; ++u)
        if (g0 + u * step < nvec) v[u] = McReduce<T>::ld(mc_in + static_cast<uint64_t>(g0 + u * step) * 16u);
#pragma unroll
      for (int u = 0; u < kBatch; ++u)
        if (g0 + u * step < nvec) store_vec<T>(out, g0 + u * step, n, v[u]);
    }
  } else {
    McSrc<T> src{mc_in};
    rows_phase<T>(src, nvec / (hidden / V), residual, residual_out, weight, scale, scale_inv, out, n, hidden, eps,
                  flags, s_cache, s_red);
  }
  // Trailing barrier: peers may still be reading our `in` (see the header).
  (void)barrier_sync(br);
  griddep_launch_dependents();  // after its last wait on a peer (launch_rules.h, pair_grid_cap: a parked dependent then waits only for a grid that waits on nobody)
}

// ---------------------------------------------------------------- nvls_lamport
// Flat mode, after the broadcast: every owner's item j of this thread (j = global thread index, grid-
// strided; the same mapping as the exchange), polled in our copy of the Lamport buffer (slot r's item j
// at data0 + r * slot + 16 j: every word ready) and written to out. The owners' items are polled together
// (lamport_poll.cuh poll_slots: all loads issued first, every outstanding one re-loaded on each pass), then
// written, each to its own place: the bits do not depend on the order they came in. False on a timeout
// (reported).
template <typename T>
UBX_DEV bool poll_portions_flat(const ubnext_comm_desc* d, const uint8_t* data0, uint64_t slot, const Slices& sl,
                                uint32_t nranks, void* out, int n) {
  constexpr int kPeers = 8;
  const uint64_t limit = timeout_ns(d);
  for (int64_t j = global_tid(); j < sl.cv; j += global_threads()) {
    const uint8_t* item = data0 + static_cast<uint64_t>(j) * 16u;
    for (uint32_t r0 = 0; r0 < nranks; r0 += kPeers) {
      uint32_t todo = 0u;  // the owners whose portion has an item j (the last portions may be shorter)
#pragma unroll
      for (int u = 0; u < kPeers; ++u)
        if (r0 + u < nranks && static_cast<int64_t>(r0 + u) * sl.cv + j < sl.nv) todo |= 1u << u;
      if (todo == 0u) continue;
      uint4 v[kPeers];
      auto any = [](uint32_t, const uint4&) { return true; };
      if (!poll_slots<kPeers>(item, slot, r0, todo, v, d, limit, UBNEXT_OP_NVLS_LAMPORT, any)) return false;
#pragma unroll
      for (int u = 0; u < kPeers; ++u)
        if (todo & (1u << u)) store_vec<T>(out, static_cast<int64_t>(r0 + u) * sl.cv + j, n, v[u]);
    }
  }
  return true;
}

// ---------------------------------------------------------------- nvls_lamport, push form
// The batch-invariant mode's plain nvls_lamport (UBNEXT_F_RANK_ORDER, flat; issue 26): a rank-order sum
// without nvls_lamport's barrier and its load round trip. The pull form (rank-order unicast loads of the
// peers' `in` after a barrier) costs 5 hops; this one 2, with the same bytes.
// Slot s of every rank's copy of Lamport buffer b = k % 3 (lamport_rotation.cuh), cv = ceil(nv / N):
//   [0, H)                 rank s's call header (H = UBNEXT_LAMPORT_HEADER_BYTES), multicast by rank s
//   [H, H + 16 cv)         owner s's reduced portion, multicast by s into every copy (the broadcast)
//   [H + 16 cv, H + 32 cv) on rank j's copy: rank s's values of portion j, stored by s (the push)
//   1. push: thread t loads its items j (t, t + G, ...) of EVERY owner's portion of `in` (sanitised:
//      -0 -> +0, so no word is the sentinel) and stores owner s's item j at slot [rank], H + 16 (cv + j)
//      of rank s's copy (relaxed .sys stores, peers first, our own last); the header thread
//      (is_lamport_header_thread) multicasts our call header into slot [rank].
//   2. re-poison our copy of the previous call's buffer while the peers' data is in flight.
//   3. the header thread compares every peer's header with ours (lamport.cu's check); every thread
//      polls its items j of OUR portion in every slot's receive region, sums them in fp32 in rank order
//      0..N-1 from +0 (lamport_poll.cuh LamportSrc: the Lamport one-shot's sum, bit for bit), rounds
//      once to T, sanitises and multicasts the vector into slot [rank], H + 16 j of every copy.
//   4. every thread polls its items j of every owner's broadcast in our copy and writes out.
//   5. block 0 records H + 32 cv bytes per slot for the re-poison of the next call but one.
// Deadlock freedom: thread t waits only for thread t of every rank (the same grid on every rank), which
// pushes before it waits (step 3), and then for thread t's broadcast of every owner, which follows only
// that owner's step-3 wait; no cycle, and no wait on another block: any grid is safe.
// The rotation's argument (lamport_rotation.cuh, "a word seen is a store landed") holds as for
// lamport.cu: every word of our copy written in a call is polled by us in that call (our portion's
// receive slots, every owner's broadcast, every peer's header), but our own header, which nobody reads.
// No fence between the multicast store of step 3 and the unicast poll of our own broadcast slot in
// step 4: the poll validates itself, as lamport.cu's does (its comment gives the argument).
// The sum is sanitised before its broadcast, as a formality: it is never -0. Every input is a multiple of
// T's smallest subnormal, so the fp32 sum (from +0) is either exactly +0 or at least that subnormal in
// magnitude, which rounds to a nonzero T.
// UBNEXT_BREAK_RANK_ORDER_IGNORED (test-only; nvls_twoshot's plain form ld_reduces instead, above): the
// owner sums the slots in the order N-1..0, and the mode's rank-order reference must see it (3+ ranks).
// Contract: flat (no row flags); `in` and `out` anywhere (only this rank reads `in`, each vector by the
// thread that writes that vector of `out`, after it read it: in == out is allowed), not overlapping the
// pool's Lamport buffers; H + 32 cv <= desc->lamport_slot_bytes (the host checks: ubnext/plan.py
// lamport_bytes_needed), else every rank returns at once, touching nothing.
template <typename T>
UBX_DEV void nvls_lamport_push(const ubnext_comm_desc* d, const void* in, void* out, int n, int hidden, int flags) {
  constexpr int V = DType<T>::kElems;
  constexpr int kOwners = 8;  // loads of `in` in flight before the first push store
  const uint32_t rank = static_cast<uint32_t>(d->rank);
  const uint32_t nranks = static_cast<uint32_t>(d->nranks);
  const Slices sl = message_slices<T>(n, hidden, flags, nranks);
  const uint64_t slot = d->lamport_slot_bytes;
  const uint64_t recv_off = UBNEXT_LAMPORT_HEADER_BYTES + static_cast<uint64_t>(sl.cv) * 16u;
  const uint64_t bytes_used = recv_off + static_cast<uint64_t>(sl.cv) * 16u;
  if (sl.rows || bytes_used > slot) return;  // host contract
  const uint32_t aborted = abort_flag(d);  // tested after the first loads of `in` (lamport.cu)

  const LamportRot rot = lamport_rot_begin(d);  // before this block's done increment (step 5)
  const uint64_t buf_off = lamport_buffer_off(d, rot.b);
  const uint8_t* my_buf = rot.own + buf_off;  // our copy of buffer b, slot 0
  const uint64_t mc_slot = static_cast<uint64_t>(d->mc_base) + buf_off + static_cast<uint64_t>(rank) * slot;
  const uint64_t my_recv = buf_off + static_cast<uint64_t>(rank) * slot + recv_off;  // in every rank's copy

  // ---- 1. push
  for (int64_t j = global_tid(); j < sl.cv && aborted == 0u; j += global_threads()) {
    for (uint32_t i0 = 0; i0 < nranks; i0 += kOwners) {
      uint4 v[kOwners];
#pragma unroll
      for (uint32_t u = 0; u < kOwners; ++u) {
        const uint32_t s = (rank + 1u + i0 + u) % nranks;  // peers first, our own portion last
        const int64_t gi = static_cast<int64_t>(s) * sl.cv + j;
        v[u] = i0 + u < nranks && gi < sl.nv ? sanitize<T>(load_vec<T>(in, gi, n)) : make_uint4(0u, 0u, 0u, 0u);
      }
      if (aborted != 0u) break;  // tested after the loads, which overlap the flag's
#pragma unroll
      for (uint32_t u = 0; u < kOwners; ++u) {
        const uint32_t s = (rank + 1u + i0 + u) % nranks;
        if (i0 + u < nranks && static_cast<int64_t>(s) * sl.cv + j < sl.nv)
          st_relaxed_sys_v4(reinterpret_cast<void*>(static_cast<uint64_t>(d->peer_base[s]) + my_recv +
                                                    static_cast<uint64_t>(j) * 16u),
                            v[u]);
      }
    }
  }
  const uint4 header =
      lamport_call_header(UBNEXT_OP_NVLS_LAMPORT, DType<T>::kCode, n, hidden, flags, 0.f);  // flat: no eps
  const bool header_thread = is_lamport_header_thread();
  if (header_thread && aborted == 0u) multimem_st_v4(reinterpret_cast<void*>(mc_slot), header);
  if (aborted != 0u) adopt_abort(d, aborted);

  // ---- 2. re-poison our copy of the previous call's buffer
  lamport_repoison(d, rot);

  // ---- 3. header check; our portion: poll, sum in rank order, broadcast
  LamportSrc<T> headers{my_buf + UBNEXT_LAMPORT_HEADER_BYTES, slot, nranks, d, timeout_ns(d), aborted != 0u};
  LamportSrc<T> recv{my_buf + recv_off, slot, nranks, d, timeout_ns(d), aborted != 0u};
  headers.op = recv.op = UBNEXT_OP_NVLS_LAMPORT;
  if (header_thread && !recv.failed && !lamport_headers_match(headers, header, rank)) recv.failed = true;
  for (int64_t j = global_tid(); j < sl.cv && static_cast<int64_t>(rank) * sl.cv + j < sl.nv; j += global_threads()) {
    float acc[V];
#if !defined(UBNEXT_BREAK_RANK_ORDER_IGNORED)
    if (!recv(j, acc)) break;  // timed out or aborted (reported): still finish below
#else
    for (int e = 0; e < V; ++e) acc[e] = 0.f;
    for (uint32_t p = nranks; p-- > 0u && !recv.failed;) {  // test-only: the order N-1..0
      const uint8_t* at = recv.buf + j * 16 + p * slot;
      uint4 v = ld_volatile_v4(at);
      if (!is_ready(v) && !recv.wait(at, v, p)) recv.failed = true;
      float f[V];
      unpack<T>(v, f);
      for (int e = 0; e < V; ++e) acc[e] += f[e];
    }
    if (recv.failed) break;
#endif
    multimem_st_v4(reinterpret_cast<void*>(mc_slot + UBNEXT_LAMPORT_HEADER_BYTES + static_cast<uint64_t>(j) * 16u),
                   sanitize<T>(pack<T>(acc)));
  }

  // ---- 4. every owner's broadcast: poll, write out
  if (!recv.failed) (void)poll_portions_flat<T>(d, my_buf + UBNEXT_LAMPORT_HEADER_BYTES, slot, sl, nranks, out, n);

  // ---- 5. finish (also after a timeout: the done counter must count every block)
  lamport_rot_finish(d, rot, bytes_used, UBNEXT_OP_NVLS_LAMPORT);
  griddep_launch_dependents();  // after its last wait on a peer (launch_rules.h, pair_grid_cap)
}

template <typename T>
UBX_DEV void nvls_lamport(const ubnext_comm_desc* d, const void* in, void* out, const void* residual,
                          void* residual_out, const void* weight, const float* scale, float* scale_inv, int n,
                          int hidden, float eps, int flags) {
  __shared__ uint4 s_cache[UBX_ROW_CACHE_VECS];
  __shared__ float s_red[UBX_RED_SCRATCH];
  if (!nvls_args_ok<T>(d, n, hidden, flags)) return;
  if ((flags & UBNEXT_F_RANK_ORDER) && !uses_rows(flags)) {  // the plain rank-order form: no barrier (above)
    nvls_lamport_push<T>(d, in, out, n, hidden, flags);
    return;
  }
  // opened early: its loads overlap the setup below
  RankBarrier br = barrier_open_checked(d, UBNEXT_OP_NVLS_LAMPORT, DType<T>::kCode, n, hidden, flags, in, eps);
  const uint32_t rank = static_cast<uint32_t>(d->rank);
  const uint32_t nranks = static_cast<uint32_t>(d->nranks);
  const Slices sl = message_slices<T>(n, hidden, flags, nranks);
  const uint64_t slot = d->lamport_slot_bytes;
  const uint64_t slot_bytes_used = slice_slot_bytes(sl);
  if (slot_bytes_used > slot) return;  // host contract (bytes <= slot implies this)

  const LamportRot rot = lamport_rot_begin(d);  // before this block's done increment (finish)
  const uint64_t buf_off = lamport_buffer_off(d, rot.b);
  const uint8_t* my_buf = rot.own + buf_off;  // our copy of buffer b, slot 0
  const uint64_t mc_in = mc_addr(d, in);
  const uint64_t mc_slot = static_cast<uint64_t>(d->mc_base) + buf_off + static_cast<uint64_t>(rank) * slot;

  if (barrier_sync(br)) {
    // ---- exchange: our portion, reduced and sanitised, into slot [rank] of every rank's buffer b (fused
    // rows: r = residual_out, the owner's one rounding of its fp32 sum plus the residual; see nvls_twoshot)
    const bool unicast_sum = sums_in_rank_order(flags);  // as nvls_twoshot
    const uint64_t in_off = reinterpret_cast<uint64_t>(in) - static_cast<uint64_t>(d->peer_base[rank]);
    auto load = [&](int64_t gi) -> uint4 {
      if (unicast_sum)
        return sanitize<T>(owner_add_round<T>(d, in_off + static_cast<uint64_t>(gi) * 16u, residual, gi));
      return sanitize<T>(McReduce<T>::ld(mc_in + static_cast<uint64_t>(gi) * 16u));
    };
    auto store = [&](int64_t, int64_t pos, const uint4& v) {
      multimem_st_v4(reinterpret_cast<void*>(mc_slot + static_cast<uint64_t>(pos) * 16u), v);
    };
    if (unicast_sum) for_my_slice<4>(sl, rank, load, store);
    else for_my_slice<kMulticastDepth>(sl, rank, load, store);  // as nvls_twoshot
    // No fence.proxy.alias before the poll reads our own slot through unicast (issue 24 A): the poll
    // validates itself, as lamport.cu's does (its comment there gives the argument: a stale read is
    // the sentinel of the re-poison two calls ago, and the poll sees the store land before the next
    // re-poison of this buffer).

    // ---- re-poison our copy of the previous call's buffer while the peers' data is in flight
    lamport_repoison(d, rot);

    // ---- poll our copy of buffer b, write out (or the row math)
    if (!sl.rows) {
      (void)poll_portions_flat<T>(d, my_buf, slot, sl, nranks, out, n);
    } else {
      LamportSliceSrc<T> src{my_buf, slot, sl, d, false};
      rows_phase<T>(src, sl.nrows, row_phase_residual(residual), residual_out, weight, scale, scale_inv, out, n, hidden,
                    eps, flags, s_cache, s_red);
    }
  }
  // Even after a timeout: keep the done counter consistent (the communicator is dead anyway, but a
  // half-counted launch would leave the counter off by some blocks forever).
  lamport_rot_finish(d, rot, slot_bytes_used, UBNEXT_OP_NVLS_LAMPORT);
  griddep_launch_dependents();  // after its last wait on a peer (launch_rules.h, pair_grid_cap: a parked dependent then waits only for a grid that waits on nobody)
}

}  // namespace ubx

#define UBX_NVLS_ENTRY(ALGO, NAME, T)                                                                        \
  UBX_KERNEL(NAME) {                                                                                         \
    ::ubx::kernel_begin();                                                                                   \
    ::ubx::ALGO<T>(&desc, in, out, residual, residual_out, weight, scale, scale_inv, n, hidden, eps, flags); \
  }

UBX_NVLS_ENTRY(nvls_twoshot, ubnext_nvls_twoshot_bf16, __nv_bfloat16)
UBX_NVLS_ENTRY(nvls_twoshot, ubnext_nvls_twoshot_fp16, __half)
UBX_NVLS_ENTRY(nvls_twoshot, ubnext_nvls_twoshot_fp32, float)
UBX_NVLS_ENTRY(nvls_oneshot, ubnext_nvls_oneshot_bf16, __nv_bfloat16)
UBX_NVLS_ENTRY(nvls_oneshot, ubnext_nvls_oneshot_fp16, __half)
UBX_NVLS_ENTRY(nvls_oneshot, ubnext_nvls_oneshot_fp32, float)
UBX_NVLS_ENTRY(nvls_lamport, ubnext_nvls_lamport_bf16, __nv_bfloat16)
UBX_NVLS_ENTRY(nvls_lamport, ubnext_nvls_lamport_fp16, __half)
UBX_NVLS_ENTRY(nvls_lamport, ubnext_nvls_lamport_fp32, float)
