// Polling a Lamport buffer: the rank-order sum of one vector over every slot (LamportSrc) and the call
// header check (lamport_headers_match), shared by the Lamport one-shot (lamport.cu) and the push form of
// nvls_lamport (nvls.cu). The words are self-validating (vec.cuh: the sentinel); the buffers' rotation is
// lamport_rotation.cuh's.
#pragma once

#include "platform.cuh"
#include "desc.cuh"
#include "vec.cuh"
#include "barrier.cuh"

namespace ubx {

// Reduced sums of one 16-byte vector of our own Lamport buffer: polls every slot, sums in rank order.
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

  // Slow path: spin on one slot until ready. On timeout (or the peer's departure) report it, which
  // aborts the communicator; stop when it is aborted (barrier.cuh), so that a dead peer costs one
  // timeout, not one per thread.
  UBX_DEV bool wait(const uint8_t* addr, uint4& v, uint32_t peer) const {
    UBX_COUNT_WAIT_BEGIN();
    const bool ready = wait_polls(addr, v, peer);
    UBX_COUNT_WAIT_END(addr, 16, ready);
    return ready;
  }
  UBX_DEV bool wait_polls(const uint8_t* addr, uint4& v, uint32_t peer) const {
    const uint64_t t0 = globaltimer_ns();
    uint64_t next_check = t0 + UBX_ABORT_POLL_NS;
    for (;;) {
      spin_pause();
      v = ld_volatile_v4(addr);
      if (is_ready(v)) return true;
      const WaitResult r = wait_verdict(desc, peer, t0, limit_ns, next_check);
      if (r == kPeerLeft && is_ready(v = ld_volatile_v4(addr))) return true;
      if (r != kWaiting) {
        report_wait_failure(desc, r, op, peer);
        return false;
      }
    }
  }

  UBX_DEV bool operator()(int64_t gi, float (&acc)[DType<T>::kElems]) {
    constexpr int V = DType<T>::kElems;
    constexpr int kBatch = 8;  // slots loaded back to back before the first check (latency hiding)
#pragma unroll
    for (int j = 0; j < V; ++j) acc[j] = 0.f;
    if (failed) return false;
    const uint8_t* base = buf + gi * 16;
    for (uint32_t p0 = 0; p0 < nranks; p0 += kBatch) {
      uint4 v[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j)
        if (p0 + j < nranks) v[j] = ld_volatile_v4(base + (p0 + j) * slot_bytes);
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        if (p0 + j < nranks) {
          if (!is_ready(v[j]) && !wait(base + (p0 + j) * slot_bytes, v[j], p0 + j)) {
            failed = true;
#pragma unroll
            for (int e = 0; e < V; ++e) acc[e] = 0.f;
            return false;
          }
#if defined(UBNEXT_STAMPS)
          if (slot_stamps != nullptr) slot_stamps[p0 + j] = globaltimer_ns();
#endif
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

// Thread 0 of block 0: every peer's call header in our buffer equals ours, else report the first
// differing word (UBNEXT_HDR_*, the last one as UBNEXT_HDR_EPS) as a mismatch. The headers are loaded
// back to back, kBatch at a time (one round trip, as LamportSrc's slots), then checked. False if a
// header differs, did not come, or the communicator was aborted.
template <typename T>
UBX_DEV bool lamport_headers_match(const LamportSrc<T>& src, const uint4& mine, uint32_t rank) {
#if !defined(UBNEXT_BREAK_NO_LAMPORT_HEADER_CHECK)
  constexpr uint32_t kBatch = 8;
  const uint8_t* headers = src.buf - UBNEXT_LAMPORT_HEADER_BYTES;  // slot 0's header
  for (uint32_t p0 = 0; p0 < src.nranks; p0 += kBatch) {
    uint4 h[kBatch];
#pragma unroll
    for (uint32_t j = 0; j < kBatch; ++j)
      if (p0 + j < src.nranks && p0 + j != rank) h[j] = ld_volatile_v4(headers + (p0 + j) * src.slot_bytes);
#pragma unroll
    for (uint32_t j = 0; j < kBatch; ++j) {
      const uint32_t p = p0 + j;
      if (p >= src.nranks || p == rank) continue;
      if (!is_ready(h[j]) && !src.wait(headers + p * src.slot_bytes, h[j], p)) return false;
      const uint32_t m[4] = {mine.x, mine.y, mine.z, mine.w};
      const uint32_t t[4] = {h[j].x, h[j].y, h[j].z, h[j].w};
#if !defined(UBNEXT_BREAK_NO_EPS_CHECK)
      constexpr uint32_t kWords = 4;
#else
      constexpr uint32_t kWords = 3;  // test-only broken build: the eps word is pushed but never compared
#endif
      for (uint32_t f = 0; f < kWords; ++f) {
        if (m[f] != t[f]) {
          report_error(src.desc, UBNEXT_ERR_MISMATCH, src.op, p, f == 3 ? UBNEXT_HDR_EPS : f, m[f], t[f]);
          return false;
        }
      }
    }
  }
#else
  (void)src;
  (void)mine;
  (void)rank;  // test-only broken build: headers are pushed but never compared
#endif
  return true;
}

}  // namespace ubx
