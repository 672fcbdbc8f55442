// Reduce-scatter over the symmetric pool: each rank sums its own shard of every rank's input, in fp32.
//
// Kernels: ubnext_reduce_scatter_{bf16,fp16,fp32}, with the one ABI parameter list (docs/ARCHITECTURE.md);
// `n` is the shard's element count and `eps` carries the FACTOR applied to the sum (1 for a sum, 1/N for
// an average, FSDP2's PREMUL_SUM factor). residual, residual_out, weight, scale, scale_inv and hidden are
// unused.
//
//   barrier 1 (every rank's `in` is written: peers are about to read it) ->
//   rank r loads elements [r*n, (r+1)*n) of `in` from every rank's pool (ld.relaxed.sys, rank order
//   0..N-1, the unicast two-shot's sum_over_ranks), adds in fp32, multiplies by the factor, rounds once
//   to T, and stores to its local `out` ->
//   barrier 2 (no rank's `in` is reused, by its next kernel or its caller, before every peer has read it).
// Why fp32: FSDP2 reduces bf16 gradients, and a bf16 accumulation across 8 ranks loses up to 3 bits;
// the traffic stays bf16. Why not multimem.ld_reduce: its rounding to bf16 comes before the factor
// (double rounding), and the pull by unicast loads keeps one deterministic order on every GPU.
//
// Contract: in: N*n elements in this rank's pool data arena, at the same offset on every rank (checked
// through the call header); not modified. out: n elements anywhere, not overlapping in. Any n >= 1: a
// shard that does not start or end on a 16-byte vector (n*elem % 16 != 0 puts rank r's shard at a byte
// offset r*n*elem from the 16-byte grid) has a head and a tail of fewer than V elements each, loaded
// one element per peer; the vectors between them load whole. `out` takes whole-vector stores where it
// lines up with the shard's vectors, element stores otherwise (FSDP2's output is 16-byte aligned, its
// odd ranks' shards are not). in and out are element-aligned.
// Result: out[i] = T(factor * sum_r in_r[rank*n + i]), the sum in fp32 in rank order: the same bits
// whichever GPU runs it, and whether element i is loaded in a vector or alone.
// Traffic per rank: (N-1)*n*elem bytes of peer loads; each rank's memory serves as much to its peers.
#include "../device/platform.cuh"
#include "../device/desc.cuh"
#include "../device/entry.cuh"
#include "../device/ptx.cuh"
#include "../device/barrier.cuh"
#include "../device/vec.cuh"
#include "../device/slices.cuh"

namespace ubx {

template <typename T>
UBX_DEV void store_elem(void* out, int64_t i, float f) {
  if constexpr (DType<T>::kBytes == 4) static_cast<uint32_t*>(out)[i] = DType<T>::from_float(f);
  else static_cast<uint16_t*>(out)[i] = static_cast<uint16_t>(DType<T>::from_float(f));
}

template <typename T>
UBX_DEV void reduce_scatter_pull(const ubnext_comm_desc* d, const void* in, void* out, int n, float factor, int flags) {
  constexpr int V = DType<T>::kElems;
  constexpr int E = DType<T>::kBytes;
  if (gridDim.x > UBNEXT_MAX_BLOCKS || n <= 0) return;  // the host checks: nobody waits
  RankBarrier br = barrier_open_checked(d, UBNEXT_OP_REDUCE_SCATTER, DType<T>::kCode, n, 0, flags, in);

  const uint32_t rank = static_cast<uint32_t>(d->rank);
  // Byte offset of this rank's shard of `in` in every pool (layouts are identical on every rank).
  const uint64_t shard_off = reinterpret_cast<uint64_t>(in) - static_cast<uint64_t>(d->peer_base[rank]) +
                             static_cast<uint64_t>(rank) * static_cast<uint64_t>(n) * E;
  // Elements before the shard's first 16-byte boundary, the whole vectors after it, and the tail.
  const int64_t to_grid = static_cast<int64_t>((16u - shard_off % 16u) % 16u) / E;
  const int64_t head = to_grid < n ? to_grid : n;
  const int64_t nvec = (n - head) / V;
  const int64_t tail0 = head + nvec * V;
  const int64_t nelem = head + (n - tail0);
  const bool out_vectors = (reinterpret_cast<uint64_t>(out) + static_cast<uint64_t>(head) * E) % 16u == 0;
  void* out_vec = static_cast<char*>(out) + head * E;

  if (!barrier_sync(br)) return;

  constexpr int kBatch = 2;  // vectors per thread in flight (each is N peer loads)
  const int64_t t0 = global_tid(), step = global_threads();
  for (int64_t i0 = t0; i0 < nvec; i0 += kBatch * step) {
    float acc[kBatch][V];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int64_t i = i0 + u * step;
      if (i < nvec) sum_over_ranks<T>(d, shard_off + static_cast<uint64_t>(head * E + i * 16), acc[u]);
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int64_t i = i0 + u * step;
      if (i >= nvec) continue;
#pragma unroll
      for (int e = 0; e < V; ++e) acc[u][e] *= factor;
      if (out_vectors) {
        store_whole_vec(out_vec, i, pack<T>(acc[u]));
      } else {
#pragma unroll
        for (int e = 0; e < V; ++e) store_elem<T>(out, head + i * V + e, acc[u][e]);
      }
    }
  }
  for (int64_t k = t0; k < nelem; k += step) {
    const int64_t i = k < head ? k : tail0 + (k - head);
    store_elem<T>(out, i, factor * sum_elem_over_ranks<T>(d, shard_off + static_cast<uint64_t>(i * E)));
  }
  (void)barrier_sync(br);
  griddep_launch_dependents();  // after its last wait on a peer (launch_rules.h, pair_grid_cap: a parked dependent then waits only for a grid that waits on nobody)
}

}  // namespace ubx

#define UBX_REDUCE_SCATTER_ENTRY(NAME, T)                                                         \
  UBX_KERNEL(NAME) {                                                                              \
    (void)residual, (void)residual_out, (void)weight, (void)scale, (void)scale_inv, (void)hidden; \
    ::ubx::kernel_begin();                                                                        \
    ::ubx::reduce_scatter_pull<T>(&desc, in, out, n, eps, flags);                                 \
  }

UBX_REDUCE_SCATTER_ENTRY(ubnext_reduce_scatter_bf16, __nv_bfloat16)
UBX_REDUCE_SCATTER_ENTRY(ubnext_reduce_scatter_fp16, __half)
UBX_REDUCE_SCATTER_ENTRY(ubnext_reduce_scatter_fp32, float)
