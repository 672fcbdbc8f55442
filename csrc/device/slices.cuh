// How the two-shot kernels (nvls_twoshot, nvls_lamport, unicast twoshot) cut a message between ranks
// and threads, and the local "row phase" they share with nvls_oneshot.
//
// A message of nvec 16-byte vectors is seen as nrows rows of nv vectors:
//   - flat mode (plain allreduce): one row, nv = nvec;
//   - row mode (FUSED_NORM or FP8 flags): nrows = n / hidden token rows of nv = hidden / V vectors.
// Rank r owns the portion [r*cv, min((r+1)*cv, nv)) of EVERY row, cv = ceil(nv / nranks). Its portion of
// row `row`, item j (0 <= j < cv), is global vector gi = row*nv + r*cv + j, and has "slot position"
// pos = row*cv + j: nvls_lamport stores it at slot [r], byte pos*16, of the Lamport buffer, so every
// slot holds (nrows*cv)*16 <= message bytes, the same "bytes per slot" meaning as lamport.cu uses for its
// re-poisoning.
//
// Why a portion of every row, rather than whole tokens per rank: with 1..N tokens (decode) whole-token
// ownership leaves ranks idle and puts a whole row's ld_reduce on one rank; portions keep every rank
// busy with 1/N of every row, and token counts smaller than the world size need no special case.
// (Each RMS row still becomes local: the row math runs after the broadcast, see rows_phase.)
//
// Thread mapping, chosen so that block b only ever waits for data written by block b of the peers
// (barriers and Lamport polls are per block; no block depends on another block of any rank):
//   - flat: item j of the rank's portion belongs to global thread j % (gridDim*blockDim); after the
//     exchange that same thread handles item j of EVERY rank's portion (vectors s*cv + j).
//   - rows: row `row` belongs to block row % gridDim, on every rank and in every phase; inside the
//     block, vector i of a row belongs to thread i % blockDim -- the mapping of norm_row's loops
//     (norm.cuh), so the thread that stores vector i in the exchange is the thread that reads it back in
//     the row phase. That matters for nvls_lamport: a thread must not wait in a __syncthreads of the row
//     math while a vector that a peer (or this rank) polls for sits only in its own store path. GPUs drain
//     stores eventually anyway; the emulator's chaos mode holds them until the storing thread's next
//     access, and with this mapping that access is the storing thread's own poll of the vector.
#pragma once

#include "platform.cuh"
#include "desc.cuh"
#include "vec.cuh"
#include "reduce.cuh"
#include "norm.cuh"
#include "ptx.cuh"

namespace ubx {

struct Slices {
  int64_t nv;     // vectors per row (flat: whole message)
  int64_t nrows;  // 1 in flat mode
  int64_t cv;     // items per rank per row: ceil(nv / nranks)
  bool rows;      // row mode
};

UBX_DEV Slices make_slices(int64_t nvec, int64_t row_vecs /* 0: flat */, uint32_t nranks) {
  Slices s;
  s.rows = row_vecs > 0;
  s.nv = s.rows ? row_vecs : nvec;
  s.nrows = s.rows ? nvec / row_vecs : 1;
  s.cv = (s.nv + nranks - 1) / nranks;
  return s;
}

// The slices of a kernel's message: n elements of T, rows of `hidden` in row mode (uses_rows(flags)).
template <typename T>
UBX_DEV Slices message_slices(int n, int hidden, int flags, uint32_t nranks) {
  constexpr int V = DType<T>::kElems;
  return make_slices((static_cast<int64_t>(n) + V - 1) / V, uses_rows(flags) ? hidden / V : 0, nranks);
}

// Host contract checks of the kernels that wait on peers through per-block barriers (barrier.cuh: the
// block index selects the barrier slots); false: return at once, touching nothing (every rank sees the
// same arguments, so nobody is left waiting).
template <typename T>
UBX_DEV bool barrier_kernel_args_ok(int n, int hidden, int flags) {
  return gridDim.x <= UBNEXT_MAX_BLOCKS && n > 0 && row_shape_ok<T>(n, hidden, flags);
}

// acc = the fp32 sum, in rank order 0..N-1, of the 16-byte vector of T at byte `off` of every rank's pool
// (the unicast two-shot's and the reduce-scatter's reduction: deterministic, so every caller that sums the
// same vector gets the same bits). Up to kPeers peer loads are in flight before the first add: each is a
// cross-rank round trip.
// The sum starts from +0, as the Lamport one-shot's does (lamport.cu: its sanitised -0 inputs must sum
// like +0) and as torch's sum does: 0 + x == x for every x but -0, so a sum of all -0 is +0 on every
// path, which the batch-invariant mode's "the same bits on every path" needs.
// UBNEXT_BREAK_TWOSHOT_DROP_PEER (test-only) leaves the last rank's values out of the sum;
// UBNEXT_BREAK_TWOSHOT_REVERSE_ORDER (test-only) adds the ranks in the order N-1..0, a sum within
// rounding of the right one that the batch-invariant tests must still tell apart (3+ ranks).
template <typename T>
UBX_DEV void sum_over_ranks(const ubnext_comm_desc* d, uint64_t off, float (&acc)[DType<T>::kElems]) {
  constexpr int V = DType<T>::kElems;
  constexpr int kPeers = 8;
  const uint32_t nranks = static_cast<uint32_t>(d->nranks);
#if !defined(UBNEXT_BREAK_TWOSHOT_DROP_PEER)
  const uint32_t summed = nranks;
#else
  const uint32_t summed = nranks - 1;
#endif
  for (uint32_t p0 = 0; p0 < nranks; p0 += kPeers) {
    uint4 v[kPeers];  // zeroed: only entries with a valid index are loaded / used
    for (int u = 0; u < kPeers; ++u) v[u] = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
    for (int u = 0; u < kPeers; ++u)
      if (p0 + u < nranks)
        v[u] = ld_relaxed_sys_v4(reinterpret_cast<const void*>(static_cast<uint64_t>(d->peer_base[p0 + u]) + off));
#pragma unroll
    for (int u = 0; u < kPeers; ++u) {
      if (p0 + u < summed) {
        float f[V];
        unpack<T>(v[u], f);
        if (p0 + u == 0) {
#pragma unroll
          for (int e = 0; e < V; ++e) acc[e] = 0.0f + f[e];  // from +0 (above)
        } else {
#pragma unroll
          for (int e = 0; e < V; ++e) acc[e] += f[e];
        }
      }
    }
  }
#if defined(UBNEXT_BREAK_TWOSHOT_REVERSE_ORDER)
  for (int e = 0; e < V; ++e) {  // test-only: the same values again, added N-1..0
    float r = 0.0f;
    for (uint32_t p = nranks; p-- > 0;)
      r += DType<T>::to_float(vec_elem_bits<T>(
          ld_relaxed_sys_v4(reinterpret_cast<const void*>(static_cast<uint64_t>(d->peer_base[p]) + off)), e));
    acc[e] = r;
  }
#endif
}

// The same sum for the one element of T at byte `off` (a shard's head or tail, outside its whole
// vectors): the same rank order and the same fp32 adds, so the element gets the bits it would get
// inside a vector.
template <typename T>
UBX_DEV float sum_elem_over_ranks(const ubnext_comm_desc* d, uint64_t off) {
  constexpr int kPeers = 8;
  const uint32_t nranks = static_cast<uint32_t>(d->nranks);
#if !defined(UBNEXT_BREAK_TWOSHOT_DROP_PEER)
  const uint32_t summed = nranks;
#else
  const uint32_t summed = nranks - 1;
#endif
  float acc = 0.0f;
  for (uint32_t p0 = 0; p0 < nranks; p0 += kPeers) {
    uint32_t bits[kPeers] = {};
#pragma unroll
    for (int u = 0; u < kPeers; ++u) {
      if (p0 + u >= nranks) continue;
      const uint64_t at = static_cast<uint64_t>(d->peer_base[p0 + u]) + off;
      if constexpr (DType<T>::kBytes == 4) bits[u] = ld_relaxed_sys_u32(reinterpret_cast<const uint32_t*>(at));
      else bits[u] = ld_relaxed_sys_u16(reinterpret_cast<const uint16_t*>(at));
    }
#pragma unroll
    for (int u = 0; u < kPeers; ++u) {
      if (p0 + u >= summed) continue;
      const float f = DType<T>::to_float(bits[u]);
      acc = p0 + u == 0 ? 0.0f + f : acc + f;  // from +0, as sum_over_ranks
    }
  }
  return acc;
}

// One arithmetic on every fused path (issue 26): residual_out = T(s + residual), ONE rounding, s the fp32
// sum over ranks. A two-shot path therefore cannot round s to T before the exchange and add the residual
// after it, as it once did (two roundings: where s and the residual cancel, residual_out was up to 116
// times its own rounding error off). The owner of a portion adds the residual to its fp32 sum and rounds
// once; what it broadcasts is r = residual_out itself, and the row phase only stores it and normalises
// (rows_phase without a residual). Every rank's row phase then reads the owner's residual for that portion:
// the same values as its own in tensor parallelism, where every rank holds the same residual (the fused
// op's contract: ranks get identical bits given identical residual and weight).
// Why the owner adds it rather than broadcasting the fp32 s: the exchange keeps its bytes (s in fp32 would
// double them for 16-bit types, and not fit `in` or a Lamport slot sized for T).
// s is the rank-order fp32 sum (sum_over_ranks, from +0 as the Lamport path's): every fused path gives a
// token the same bits.
// UBNEXT_BREAK_TWO_ROUNDINGS (test-only) rounds s to T first and leaves the residual to the row phase.
#if !defined(UBNEXT_BREAK_TWO_ROUNDINGS)
#define UBX_OWNER_ADDS_RESIDUAL 1
#else
#define UBX_OWNER_ADDS_RESIDUAL 0
#endif
template <typename T>
UBX_DEV uint4 owner_add_round(const ubnext_comm_desc* d, uint64_t off, const void* residual, int64_t gi) {
  constexpr int V = DType<T>::kElems;
  float acc[V];
  sum_over_ranks<T>(d, off, acc);
  if (UBX_OWNER_ADDS_RESIDUAL && residual != nullptr) return add_round<T>(acc, true, load_whole_vec(residual, gi));
  return pack<T>(acc);
}
// The residual the row phase adds: none when the owner already did.
UBX_DEV const void* row_phase_residual(const void* residual) { return UBX_OWNER_ADDS_RESIDUAL ? nullptr : residual; }

// Bytes each rank's slot of a Lamport buffer holds for this message.
UBX_DEV uint64_t slice_slot_bytes(const Slices& s) { return static_cast<uint64_t>(s.nrows * s.cv) * 16u; }

// Rows of block b (rows b, b + G, b + 2G, ...).
UBX_DEV int64_t rows_of_block(int64_t nrows) {
  const int64_t b = blockIdx.x, g = gridDim.x;
  return b < nrows ? (nrows - 1 - b) / g + 1 : 0;
}

// This thread's work items of rank r's portions: k = first, first + step, ... < total.
struct SliceWork {
  int64_t first, step, total;
  int64_t i_first, n_i;  // rows: the thread's first vector index in the portion, and how many per row
};
UBX_DEV SliceWork slice_work(const Slices& s, uint32_t r) {
  SliceWork w;
  if (s.rows) {
    // Vectors i of the portion [lo, hi) with i % blockDim == threadIdx.x.
    const int64_t bd = blockDim.x;
    const int64_t lo = static_cast<int64_t>(r) * s.cv;
    const int64_t hi = lo + s.cv < s.nv ? lo + s.cv : s.nv;
    w.i_first = lo + ((static_cast<int64_t>(threadIdx.x) - lo % bd) % bd + bd) % bd;
    w.n_i = w.i_first < hi ? (hi - 1 - w.i_first) / bd + 1 : 0;
    w.first = 0;
    w.step = 1;
    w.total = rows_of_block(s.nrows) * w.n_i;
  } else {
    w.i_first = w.n_i = 0;
    w.first = global_tid();
    w.step = global_threads();
    w.total = s.cv;
  }
  return w;
}

// Work item k of owner rank r -> global vector gi and slot position pos. false: past the row's end
// (flat mode: the last rank's portion can be short, or empty when nv < nranks).
UBX_DEV bool slice_item(const Slices& s, const SliceWork& w, uint32_t r, int64_t k, int64_t& gi, int64_t& pos) {
  int64_t row = 0, i;
  if (s.rows) {
    const int64_t t = k / w.n_i;
    i = w.i_first + (k - t * w.n_i) * static_cast<int64_t>(blockDim.x);
    row = static_cast<int64_t>(blockIdx.x) + t * static_cast<int64_t>(gridDim.x);
  } else {
    i = static_cast<int64_t>(r) * s.cv + k;
  }
  if (i >= s.nv) return false;
  gi = row * s.nv + i;
  pos = row * s.cv + (i - static_cast<int64_t>(r) * s.cv);
  return true;
}

// Phase A driver: for every item of THIS rank's portions, v = load(gi) then store(gi, pos, v), kBatch
// items at a time (all loads of a batch are issued before the first store: the loads are cross-rank
// round trips, so they must overlap).
template <int kBatch, class Load, class Store>
UBX_DEV void for_my_slice(const Slices& s, uint32_t rank, Load& load, Store& store) {
  const SliceWork w = slice_work(s, rank);
  for (int64_t k0 = w.first; k0 < w.total; k0 += kBatch * w.step) {
    int64_t gi[kBatch], pos[kBatch];
    bool ok[kBatch];
    uint4 v[kBatch];  // zeroed: only entries with a valid index are loaded / used
    for (int u = 0; u < kBatch; ++u) v[u] = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int64_t k = k0 + u * w.step;
      ok[u] = k < w.total && slice_item(s, w, rank, k, gi[u], pos[u]);
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u)
      if (ok[u]) v[u] = load(gi[u]);
#pragma unroll
    for (int u = 0; u < kBatch; ++u)
      if (ok[u]) store(gi[u], pos[u], v[u]);
  }
}

// load_vec of this rank's copy of `in` after the exchange, which nvls_twoshot wrote through the
// multicast alias: whole vectors through ld_plain_v4 (ptx.cuh), the load the emulator's proxy model sees.
template <typename T>
UBX_DEV uint4 load_exchanged_vec(const void* base, int64_t gi, int64_t n) {
  if ((gi + 1) * DType<T>::kElems <= n) return ld_plain_v4(reinterpret_cast<const uint4*>(base) + gi);
  return load_vec<T>(base, gi, n);
}

// Reduced values that already lie in local memory (T bits): the two-shot kernels after the exchange.
template <typename T>
struct LocalSrc {
  const void* x;
  int64_t n;
  UBX_DEV bool operator()(int64_t gi, float (&s)[DType<T>::kElems]) const {
    unpack<T>(load_exchanged_vec<T>(x, gi, n), s);
    return true;
  }
};

// The row phase: every block runs norm_row (csrc/device/norm.cuh) on its rows (row % gridDim ==
// blockIdx.x), writing residual_out / out / scale_inv of THIS rank with plain stores. Collective over
// the block. Same code path and arithmetic as lamport.cu, so identical reduced rows give identical bits.
template <typename T, class Src>
UBX_DEV void rows_phase(Src& src, int64_t nrows, const void* residual, void* residual_out, const void* weight,
                        const float* scale, float* scale_inv, void* out, int64_t n, int hidden, float eps, int flags,
                        uint4* cache, float* scratch) {
  row_outputs_begin(flags, scale, scale_inv, nrows, hidden);
  const RowParams rp{residual, weight, scale, hidden, eps, flags};
  const GlobalSink<T> sink{residual_out, out, scale_inv, n};
  for (int64_t row = blockIdx.x; row < nrows; row += gridDim.x)
    if (!norm_row<T>(rp, row, src, sink, cache, UBX_ROW_CACHE_VECS, scratch)) break;  // block-uniform
}

// Flat mode, after the exchange: copy every rank's portion item j of this thread from `from` to `to`
// (same mapping as the exchange, so only data written by this block index of the peers is touched).
// n: elements; a partial last vector is copied element-wise (vec.cuh load_vec / store_vec).
template <typename T>
UBX_DEV void copy_all_portions(const Slices& s, uint32_t nranks, const void* from, void* to, int64_t n) {
  for (int64_t j = global_tid(); j < s.cv; j += global_threads())
    for (uint32_t r = 0; r < nranks; ++r) {
      const int64_t gi = static_cast<int64_t>(r) * s.cv + j;
      if (gi < s.nv) store_vec<T>(to, gi, n, load_exchanged_vec<T>(from, gi, n));
    }
}

// After the exchange of an in-place two-shot kernel (nvls_twoshot, unicast twoshot) and its barrier,
// this rank's copy of `in` holds the whole reduced message in T. Flat mode: copy it to `out` unless in
// place; row mode: the row phase from it. Collective over the block.
template <typename T>
UBX_DEV void twoshot_local_phase(const Slices& sl, uint32_t nranks, const void* in, void* out, const void* residual,
                                 void* residual_out, const void* weight, const float* scale, float* scale_inv, int n,
                                 int hidden, float eps, int flags, uint4* cache, float* scratch) {
  if (!sl.rows) {
    if (out != in) copy_all_portions<T>(sl, nranks, in, out, n);
    return;
  }
  LocalSrc<T> src{in, static_cast<int64_t>(n)};
  rows_phase<T>(src, sl.nrows, residual, residual_out, weight, scale, scale_inv, out, n, hidden, eps, flags, cache,
                scratch);
}

// ---------------------------------------------------------------- messages that end inside a vector
// Flat mode accepts any n (the Python layer passes n = 5 bf16, say). Loads of the last, partial vector
// read the whole 16 bytes: `in` is 16-byte aligned inside the pool (host contract), so the bytes past n
// are mapped; their values are summed too but never stored anywhere a caller can see. Stores of it must
// not touch the bytes past n (they may belong to the caller: `in` can be a view of a larger pool tensor),
// so the partial vector goes to each rank with 32-bit relaxed .sys stores, and a 32-bit word that is half
// inside (16-bit types, odd n) gets a 16-bit store of its inside half. No atomics: peer atomics may be
// missing between GPUs on PCIe, and none is needed, since no other thread writes those bytes in this
// call and the barrier after the exchange orders the stores before any reader.
template <typename T>
UBX_DEV void store_partial_sys(void* vec, const uint4& v, int64_t valid /* elements inside, 0 < valid < V */) {
  uint32_t* w = reinterpret_cast<uint32_t*>(vec);
  constexpr int kPerWord = 4 / DType<T>::kBytes;  // elements per 32-bit word
  for (int k = 0; k < 4; ++k) {
    const int64_t e0 = static_cast<int64_t>(k) * kPerWord;
    const uint32_t x = vec_word(v, k);
    if (e0 + kPerWord <= valid) {
      st_relaxed_sys_u32(w + k, x);
    } else if (e0 < valid) {  // 16-bit type: only the low half (element e0, the lower address) is inside
      st_relaxed_sys_u16(reinterpret_cast<uint16_t*>(w + k), static_cast<uint16_t>(x & 0xFFFFu));
    }
  }
}

}  // namespace ubx
