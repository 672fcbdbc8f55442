// Polling a Lamport buffer: every outstanding slot re-loaded on each pass (poll_slots), the rank-order sum
// of one vector over every slot (LamportSrc) and the call header check (lamport_headers_match), shared by
// the Lamport one-shot (lamport.cu) and nvls_lamport (nvls.cu: its push form, and poll_portions_flat). The words are self-validating (vec.cuh: the sentinel); the buffers' rotation is
// lamport_rotation.cuh's.
#pragma once

#include "platform.cuh"
#include "desc.cuh"
#include "vec.cuh"
#include "barrier.cuh"

namespace ubx {

// Polls slots p0 + j of a Lamport buffer (j < K with bit j of `todo`; slot p at base + p * stride) until
// every one is ready, re-loading EVERY outstanding slot on each pass, as FlashInfer's one-shot
// (`while (!done) { for r: load; done &= ready }`) and NCCL's LL recvUnrolled do. A poll that spins on one
// slot before it looks at the next judges the later slots on their first loads: once the last peer lands,
// each slot still counted as outstanding costs one more serial L2 round trip (up to K - 1); here one more
// pass sees them all. The first pass issues every load before the first check (latency hiding); a slot found
// ready leaves `todo` and on_ready(j, value) sees it once, in rank order within a pass (a header check, a
// stamp; it may refuse: false ends the poll, which fails). v[j] keeps the value accepted. Callers consume
// the values only after the poll, in rank order, so the result is that of any other poll: the bits do not
// depend on the order of arrival.
// Bounded as every wait (barrier.cuh): one limit for the whole poll (t0 at its first re-poll); the verdict
// names the lowest slot still outstanding (the peer a rank-order consumer waits on first), watching the
// abort flag and that peer's departure; a departed peer's slot is read once more before the failure is
// reported, naming op, rank and peer. Count mode (platform.cuh, memory.cpp "a multi-slot poll"): one wait,
// ending one round trip after the last of the slots landed, however many were outstanding.
// UBNEXT_BREAK_POLL_READS_ONCE (test-only): each re-poll pass loads only the slot it names, and once that one
// is ready the poll accepts every other slot as its first pass read it: stale values (the sentinel's words,
// +0 and -0 as data: that rank's share is left out of the sum). The header check is left whole (kBreakable
// false), so that the break shows where it matters, as wrong sums, not as a header the peer never sent.
template <int K, typename OnReady, bool kBreakable = true>
UBX_DEV bool poll_slots(const uint8_t* base, uint64_t stride, uint32_t p0, uint32_t todo, uint4 (&v)[K],
                        const ubnext_comm_desc* d, uint64_t limit, uint32_t op, OnReady&& on_ready) {
  static_assert(K >= 1 && K <= 32, "one bit of `todo` per slot");
  UBX_COUNT_POLL_BEGIN();
  // One pass over the outstanding slots: re-load each (all loads before the first check), then take the
  // ready ones. False when on_ready refused one.
  auto pass = [&](uint32_t reload) -> bool {
#pragma unroll
    for (int j = 0; j < K; ++j)
      if (reload & (1u << j)) v[j] = ld_volatile_v4(base + (p0 + j) * stride);
#pragma unroll
    for (int j = 0; j < K; ++j) {
      if ((todo & (1u << j)) && is_ready(v[j])) {
        todo &= ~(1u << j);
        if (!on_ready(static_cast<uint32_t>(j), v[j])) return false;
      }
    }
    return true;
  };
  bool ok = pass(todo);
  const bool repolled = ok && todo != 0u;
  if (repolled) {
    UBX_COUNT_WAIT_BEGIN();
    SpinWait spin(d, limit);
    for (;;) {
      // todo != 0 here; the verdict names the lowest slot outstanding
      const uint32_t peer = p0 + static_cast<uint32_t>(__ffs(static_cast<int>(todo)) - 1);
      const WaitResult r = spin.step(peer);
      if (r != kWaiting && r != kPeerLeft) {
        report_wait_failure(d, r, op, peer);
        ok = false;
        break;
      }
      // kPeerLeft: this pass is the read once more (a slot the peer stored before it left is taken)
#if !defined(UBNEXT_BREAK_POLL_READS_ONCE)
      ok = pass(todo);
#else
      const uint32_t named = kBreakable ? todo & (0u - todo) : todo;  // test-only: the lowest outstanding slot
      ok = pass(named);
      if (kBreakable && ok && (todo & named) == 0u) {
#pragma unroll
        for (int j = 0; j < K; ++j)  // ... and judge every other slot on its first load
          if (ok && (todo & (1u << j))) ok = on_ready(static_cast<uint32_t>(j), v[j]);
        todo = 0u;
      }
#endif
      if (!ok || todo == 0u) break;
      if (r == kPeerLeft && (todo & (1u << (peer - p0))) != 0u) {
        report_wait_failure(d, r, op, peer);
        ok = false;
        break;
      }
    }
  }
  UBX_COUNT_POLL_END(repolled, ok);
  return ok;
}

// Reduced sums of one 16-byte vector of our own Lamport buffer: polls every slot (poll_slots: every
// outstanding slot re-loaded on each pass), then sums in rank order.
template <typename T>
struct LamportSrc {
  const uint8_t* buf;  // our buffer b, slot 0
  uint64_t slot_bytes;
  uint32_t nranks;
  const ubnext_comm_desc* desc;
  uint64_t limit_ns;
  bool failed;
  uint32_t op = UBNEXT_OP_LAMPORT;  // the op a timeout or mismatch report names
#if defined(UBNEXT_STAMPS)
  uint64_t* slot_stamps = nullptr;  // test-only (stamps.cuh): the stamping thread's slot stamps, first vector only
#endif

  // One slot, spun on until ready (the test-only rank_order_ignored build's reversed sum, nvls.cu, polls one
  // slot at a time with it). On timeout (or the peer's departure) report it, which aborts the communicator;
  // stop when it is aborted (barrier.cuh), so that a dead peer costs one timeout, not one per thread.
  UBX_DEV bool wait(const uint8_t* addr, uint4& v, uint32_t peer) const {
    UBX_COUNT_WAIT_BEGIN();
    const bool ready = wait_polls(addr, v, peer);
    UBX_COUNT_WAIT_END(addr, 16, ready);
    return ready;
  }
  UBX_DEV bool wait_polls(const uint8_t* addr, uint4& v, uint32_t peer) const {
    SpinWait spin(desc, limit_ns);
    for (;;) {
      const WaitResult r = spin.step(peer);
      if (r == kWaiting || r == kPeerLeft) {  // kPeerLeft: read once more (barrier.cuh)
        v = ld_volatile_v4(addr);
        if (is_ready(v)) return true;
      }
      if (r != kWaiting) {
        report_wait_failure(desc, r, op, peer);
        return false;
      }
    }
  }

  UBX_DEV bool operator()(int64_t gi, float (&acc)[DType<T>::kElems]) {
    constexpr int V = DType<T>::kElems;
    constexpr int kBatch = 8;  // slots polled together (every outstanding one re-loaded on each pass)
#pragma unroll
    for (int j = 0; j < V; ++j) acc[j] = 0.f;
    if (failed) return false;
    const uint8_t* base = buf + gi * 16;
    for (uint32_t p0 = 0; p0 < nranks; p0 += kBatch) {
      const uint32_t todo =
          nranks - p0 >= static_cast<uint32_t>(kBatch) ? (1u << kBatch) - 1u : (1u << (nranks - p0)) - 1u;
      uint4 v[kBatch];
      auto on_ready = [&](uint32_t j, const uint4&) {
#if defined(UBNEXT_STAMPS)
        if (slot_stamps != nullptr) slot_stamps[p0 + j] = globaltimer_ns();  // when the poll saw it
#else
        (void)j;
#endif
        return true;
      };
      if (!poll_slots<kBatch>(base, slot_bytes, p0, todo, v, desc, limit_ns, op, on_ready)) {
        failed = true;
#pragma unroll
        for (int e = 0; e < V; ++e) acc[e] = 0.f;
        return false;
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        if (todo & (1u << j)) {
          float f[V];
          unpack<T>(v[j], f);
          // Rank order 0..N-1, starting from +0: 0 + s_0 == s_0 exactly (no -0 after sanitising).
#pragma unroll
          for (int e = 0; e < V; ++e) acc[e] += f[e];
        }
      }
    }
#if defined(UBNEXT_STAMPS)
    slot_stamps = nullptr;
#endif
    return true;
  }
};

// A Lamport slot's call header: barrier.cuh's call_header with its last word the eps word (header_eps: a
// fused call's eps, else 0) instead of the `in` offset, which a Lamport kernel does not need (no rank reads
// another's `in`). That word was 0 before eps went there: LAMPORT_HEADER_BYTES keeps its meaning, and the
// header costs nothing more. No word is the sentinel: op != 0, n and hidden < 2^31, and header_eps sends
// -0 as +0.
UBX_DEV uint4 lamport_call_header(uint32_t op, uint32_t dtype, int n, int hidden, int flags, float eps) {
  return make_uint4(op | (dtype << 8) | ((static_cast<uint32_t>(flags) & 0xffffu) << 16), static_cast<uint32_t>(n),
                    static_cast<uint32_t>(hidden), header_eps(eps, flags));
}

// The one writer and reader of a Lamport call header: the LAST thread of block 0. Grid-stride work gives
// the last thread of a block the fewest vectors (none when the message does not fill block 0), so its
// header wait runs beside the data polls of the other threads instead of before one thread's data poll,
// where it was one more serialised wait on the critical path.
UBX_DEV bool is_lamport_header_thread() { return blockIdx.x == 0 && threadIdx.x == blockDim.x - 1; }

// The header thread (is_lamport_header_thread): every peer's call header in our buffer equals ours, else report a differing word
// (UBNEXT_HDR_*, the last one as UBNEXT_HDR_EPS) as a mismatch. The headers are polled together
// (poll_slots: all loaded at once, every outstanding one re-loaded on each pass: one wait however many
// peers are late, where a header-by-header spin cost up to N - 1 serial round trips), each compared when it
// is found ready: the first differing peer in rank order among those found in one pass, and a mismatch is
// reported without waiting for later headers. False if a header differs, did not come, or the communicator
// was aborted.
template <typename T>
UBX_DEV bool lamport_headers_match(const LamportSrc<T>& src, const uint4& mine, uint32_t rank) {
#if !defined(UBNEXT_BREAK_NO_LAMPORT_HEADER_CHECK)
  constexpr int kBatch = 8;
  const uint8_t* headers = src.buf - UBNEXT_LAMPORT_HEADER_BYTES;  // slot 0's header
  for (uint32_t p0 = 0; p0 < src.nranks; p0 += kBatch) {
    const uint32_t n = src.nranks - p0 >= static_cast<uint32_t>(kBatch) ? kBatch : src.nranks - p0;
    uint32_t todo = (1u << n) - 1u;
    if (rank >= p0 && rank - p0 < n) todo &= ~(1u << (rank - p0));  // our own header: nothing to check
    if (todo == 0u) continue;
    uint4 h[kBatch];
    auto same = [&](uint32_t j, const uint4& t4) {
      const uint32_t m[4] = {mine.x, mine.y, mine.z, mine.w};
      const uint32_t t[4] = {t4.x, t4.y, t4.z, t4.w};
#if !defined(UBNEXT_BREAK_NO_EPS_CHECK)
      constexpr uint32_t kWords = 4;
#else
      constexpr uint32_t kWords = 3;  // test-only broken build: the eps word is pushed but never compared
#endif
      for (uint32_t f = 0; f < kWords; ++f) {
        if (m[f] != t[f]) {
          report_error(src.desc, UBNEXT_ERR_MISMATCH, src.op, p0 + j, f == 3 ? UBNEXT_HDR_EPS : f, m[f], t[f]);
          return false;
        }
      }
      return true;
    };
    if (!poll_slots<kBatch, decltype(same)&, false>(headers, src.slot_bytes, p0, todo, h, src.desc, src.limit_ns,
                                                    src.op, same))
      return false;
  }
#else
  (void)src;
  (void)mine;
  (void)rank;  // test-only broken build: headers are pushed but never compared
#endif
  return true;
}

}  // namespace ubx
