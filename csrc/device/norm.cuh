// Residual add + RMSNorm row math and FP8 (e4m3) quantisation, shared by the Lamport and NVLS
// kernels. One block handles one token row at a time (norm_row); the caller supplies where the
// reduced values come from (Src) and where the results go (Sink), so every algorithm reuses the
// same arithmetic and therefore produces the same bits for the same reduced row.
//
// Semantics for one row (T = the kernel dtype, all arithmetic in fp32, "T(x)" = round to nearest
// even into T):
//   s_j  = reduced sum (fp32, from Src)
//   r_j  = T(s_j + residual_j)          fused with residual   -> stored to residual_out (if given)
//        = T(s_j)                       fused without residual, or FP8 without FUSED_NORM
//   rms  = rsqrtf(sum_j r_j^2 / hidden + eps)    (sum over the ROUNDED r, fp32, block_sum order)
//   y_j  = T((r_j * rms) * w_j)        fused
//        = r_j                          FP8 without FUSED_NORM (plain allreduce, quantised)
//   out:  y in T                        no FP8 flag
//         q_j = e4m3_satfinite(y_j / scale[0]);  scale_inv[0] := scale[0]     FP8_STATIC
//         a = max_j |y_j|; scale_inv[row] = max(a / 448, 1e-12); q_j = e4m3_satfinite(y_j / scale_inv[row])
//                                       FP8_PER_TOKEN (wins over FP8_STATIC if both are set)
// y is rounded to T before quantising (for fp32 that is a no-op), so the per-token amax is taken from
// exactly the values that are quantised, and a torch reference "rmsnorm in T, then quantise" matches.
// tiny = 1e-12 (not FLT_MIN): an all-zero row gets scale_inv = 1e-12 and q = 0; avoiding FLT_MIN keeps
// y / scale_inv out of the denormal range, where FTZ settings would make GPU and emulator differ.
// Saturation: __NV_SATFINITE clamps to +-448, never NaN for finite or infinite input (NaN stays NaN).
//
// Contract: hidden % DType<T>::kElems == 0 (whole 16-byte vectors per row; the host checks), so every
// vector of a row is whole. Vector gi of the flattened tensor covers elements [gi*V, gi*V + V).
#pragma once

#include "platform.cuh"
#include "desc.cuh"
#include "vec.cuh"
#include "reduce.cuh"

#define UBX_FP8_E4M3_MAX 448.0f
#define UBX_FP8_SCALE_TINY 1e-12f
// Per-block row cache (dtype bits of r, then of y) in shared memory: 2048 x 16 B = 32 KB, i.e. rows up
// to hidden 16384 (bf16/fp16) or 8192 (fp32). Longer rows recompute instead (see norm_row).
#define UBX_ROW_CACHE_VECS 2048

namespace ubx {

enum { kOutDtype = 0, kOutFp8Static = 1, kOutFp8Token = 2 };

UBX_DEV bool uses_rows(int flags) {
  return (flags & (UBNEXT_F_FUSED_NORM | UBNEXT_F_FP8_STATIC | UBNEXT_F_FP8_PER_TOKEN)) != 0;
}
// Host contract of row mode (the host checks before launching): whole vectors per row, whole rows. All
// ranks see the same arguments, so a kernel that returns when this fails leaves every rank untouched.
template <typename T>
UBX_DEV bool row_shape_ok(int n, int hidden, int flags) {
  return !uses_rows(flags) || (hidden > 0 && hidden % DType<T>::kElems == 0 && n % hidden == 0);
}
UBX_DEV int out_mode(int flags) {
  return (flags & UBNEXT_F_FP8_PER_TOKEN) ? kOutFp8Token : (flags & UBNEXT_F_FP8_STATIC) ? kOutFp8Static : kOutDtype;
}

struct RowParams {
  const void* residual;  // T[n] or null (used only with FUSED_NORM)
  const void* weight;    // T[hidden] (FUSED_NORM only)
  const float* scale;    // static FP8 dequant scale (FP8_STATIC only)
  int hidden;
  float eps;
  int flags;
};

// Where results go. GlobalSink writes plain global memory (Lamport, NVLS one-shot). An algorithm that
// must broadcast its results (NVLS two-shot: multimem.st) supplies its own type with the same members.
template <typename T>
struct GlobalSink {
  void* residual_out;  // T[n] or null; may alias the residual input (each element is read before written,
                       // by the same thread)
  void* out;           // T[n], or n e4m3 bytes
  float* scale_inv;    // per-token: float[n / hidden]
  int64_t n;

  UBX_DEV bool has_res() const { return residual_out != nullptr; }
  UBX_DEV void store_res(int64_t gi, const uint4& v) const { store_vec<T>(residual_out, gi, n, v); }
  // Reload what store_res wrote (same thread, so program order makes it visible). false: not kept.
  UBX_DEV bool reload_res(int64_t gi, uint4& v) const {
    if (residual_out == nullptr) return false;
    v = load_vec<T>(residual_out, gi, n);
    return true;
  }
  UBX_DEV void store_out(int64_t gi, const uint4& v) const { store_vec<T>(out, gi, n, v); }
  UBX_DEV void store_out_fp8(int64_t gi, const uint8_t (&q)[DType<T>::kElems]) const {
    store_fp8<DType<T>::kElems>(out, gi, n, q);
  }
  UBX_DEV void store_scale_inv(int64_t row, float s) const { scale_inv[row] = s; }
};

// ---------------------------------------------------------------- per-vector pieces
// x := T(x + residual) (or T(x) without residual), returned packed; x holds the rounded floats.
template <typename T>
UBX_DEV uint4 residual_round(float (&x)[DType<T>::kElems], const void* residual, int64_t gi) {
  constexpr int V = DType<T>::kElems;
  if (residual != nullptr) {
    float rv[V];
    unpack<T>(load_whole_vec(residual, gi), rv);
#pragma unroll
    for (int j = 0; j < V; ++j) x[j] += rv[j];
  }
  const uint4 r = pack<T>(x);
  unpack<T>(r, x);
  return r;
}

// y := T((r * rms) * w), returned packed; y holds the rounded floats. Two multiplies and no add, so no
// FMA contraction can change the bits between compilers.
template <typename T>
UBX_DEV uint4 norm_vec(const uint4& r, float rms, const void* weight, int iw, float (&y)[DType<T>::kElems]) {
  constexpr int V = DType<T>::kElems;
  unpack<T>(r, y);
  if (weight != nullptr) {
    float w[V];
    unpack<T>(load_whole_vec(weight, iw), w);
#pragma unroll
    for (int j = 0; j < V; ++j) y[j] = (y[j] * rms) * w[j];
  }
  const uint4 p = pack<T>(y);
  unpack<T>(p, y);
  return p;
}

// q_j = e4m3(y_j / div), saturating to +-448. True division, as in the torch reference `y / scale_inv`.
template <int V>
UBX_DEV void quantize_fp8(const float (&y)[V], float div, uint8_t (&q)[V]) {
#pragma unroll
  for (int j = 0; j < V; ++j)
    q[j] = static_cast<uint8_t>(__nv_cvt_float_to_fp8(y[j] / div, __NV_SATFINITE, __NV_E4M3));
}

UBX_DEV float per_token_scale_inv(float amax) { return nan_max(amax / UBX_FP8_E4M3_MAX, UBX_FP8_SCALE_TINY); }

// ---------------------------------------------------------------- one row, one block
// Src: `bool operator()(int64_t gi, float (&s)[V])` gives the reduced fp32 sums of global vector gi,
// zero-filled and false when it gave up (timeout, already reported). It may be called again for the
// same gi (rows longer than the cache) and must then return the same bits.
// Collective over the block (uniform control flow). Returns false, in every thread, when any thread's
// Src failed; the caller then stops (the row's outputs are not written).
// `cache`: __shared__ uint4[cache_vecs]; `scratch`: __shared__ float[UBX_RED_SCRATCH].
template <typename T, class Src, class Sink>
UBX_DEV bool norm_row(const RowParams& p, int64_t row, Src& src, const Sink& sink, uint4* cache, int cache_vecs,
                      float* scratch) {
  constexpr int V = DType<T>::kElems;
  const bool fused = (p.flags & UBNEXT_F_FUSED_NORM) != 0;
  const int mode = out_mode(p.flags);
  const void* residual = fused ? p.residual : nullptr;
  const void* weight = fused ? p.weight : nullptr;
  const int nv = p.hidden / V;
  const int64_t g0 = row * nv;
  const bool cached = nv <= cache_vecs;

  // r of vector i of this row, packed. From the cache, else from residual_out (exact: it holds r),
  // else recomputed from Src (same bits: Src is repeatable and the arithmetic is the same).
  auto r_of = [&](int i) -> uint4 {
    if (cached) return cache[i];
    uint4 r;
    if (fused && sink.reload_res(g0 + i, r)) return r;
    float x[V];
    (void)src(g0 + i, x);
    return residual_round<T>(x, residual, g0 + i);
  };

  // Pass 1: reduce, residual add, residual_out, sum of squares of the rounded r.
  float ssq = 0.f, fail = 0.f;
  for (int i = threadIdx.x; i < nv; i += blockDim.x) {
    float x[V];
    if (!src(g0 + i, x)) fail = 1.f;
    const uint4 r = residual_round<T>(x, residual, g0 + i);
    if (fused) {
      if (sink.has_res()) sink.store_res(g0 + i, r);
#pragma unroll
      for (int j = 0; j < V; ++j) ssq += x[j] * x[j];
    }
    if (cached) cache[i] = r;  // read back only by this same thread: no barrier needed
  }
  block_sum2(ssq, fail, scratch);  // why one reduction: the abort vote rides along for free
  if (fail != 0.f) return false;
  const float rms = fused ? rsqrtf(ssq / static_cast<float>(p.hidden) + p.eps) : 1.f;

  // Pass 2: normalise; store (dtype / static FP8) or take the row amax (per-token FP8).
  const float sdiv = (mode == kOutFp8Static) ? p.scale[0] : 1.f;
  float amax = 0.f;
  for (int i = threadIdx.x; i < nv; i += blockDim.x) {
    float y[V];
    const uint4 yp = norm_vec<T>(r_of(i), rms, weight, i, y);
    if (mode == kOutDtype) {
      sink.store_out(g0 + i, yp);
    } else if (mode == kOutFp8Static) {
      uint8_t q[V];
      quantize_fp8<V>(y, sdiv, q);
      sink.store_out_fp8(g0 + i, q);
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j) amax = nan_max(amax, fabsf(y[j]));
      if (cached) cache[i] = yp;  // pass 3 quantises exactly these bits
    }
  }
  if (mode != kOutFp8Token) return true;

  // Pass 3 (per-token FP8): scale_inv of the row, then quantise the same y.
  const float s = per_token_scale_inv(block_max(amax, scratch));
  if (threadIdx.x == 0) sink.store_scale_inv(row, s);
  for (int i = threadIdx.x; i < nv; i += blockDim.x) {
    float y[V];
    if (cached)
      unpack<T>(cache[i], y);
    else
      (void)norm_vec<T>(r_of(i), rms, weight, i, y);
    uint8_t q[V];
    quantize_fp8<V>(y, s, q);
    sink.store_out_fp8(g0 + i, q);
  }
  return true;
}

}  // namespace ubx
