// FP8 (e4m3) quantisation of a local tensor, writing the data and its scale_inv in one kernel (the
// FP8 scale-inverse seed: the kernel that writes the bits writes the scale that decodes them). FSDP2's
// FP8 weights run it on each rank's shard before the all-gather, so q and scale_inv travel together.
//
// Kernels: ubnext_quantize_fp8_{bf16,fp16,fp32}, with the one ABI parameter list (docs/ARCHITECTURE.md):
// in (n elements of T), out (n e4m3 bytes), scale, scale_inv, n, hidden, flags. desc, residual,
// residual_out, weight and eps are unused: no peer is involved, nothing waits.
//
// It uses the fused kernels' per-vector arithmetic (norm.cuh: nan_max, per_token_scale_inv, quantize_fp8)
// without the allreduce and the norm, so both quantise with the same bits, under the contract of
// docs/ARCHITECTURE.md's FP8 output:
//   UBNEXT_F_FP8_PER_TOKEN: rows of `hidden` elements; scale_inv[row] = max(amax_row / 448, 1e-12) and
//     q = e4m3_satfinite(x / scale_inv[row]). hidden = n gives ONE scale for the whole tensor (one row;
//     past ONE_CTA_BYTES the host takes the amax first and runs the static mode instead).
//   UBNEXT_F_FP8_STATIC: q = e4m3_satfinite(x / scale[0]), scale_inv[0] = scale[0] (a device float, read
//     by the kernel, so a captured graph picks up a new value on replay).
// Both loops keep kInFlight 16-byte loads in flight per thread (issue 24 item F). The kernel is local
// and has no barrier between blocks, so its grid is not capped by residency: the host sizes it from the
// work (launch_rules.h quantize_grid, ubnext/_quantize.py quantize_geometry).
// Contract: hidden % V == 0 and n % hidden == 0 (whole 16-byte vectors per row); in 16-byte aligned; out
// 8-byte aligned; scale_inv holds n / hidden floats (per row) or 1 (static).
#include "../device/platform.cuh"
#include "../device/desc.cuh"
#include "../device/entry.cuh"
#include "../device/vec.cuh"
#include "../device/reduce.cuh"
#include "../device/norm.cuh"
#include "../device/slices.cuh"
#include "../device/blockscale.cuh"

namespace ubx {

// Loads each thread keeps in flight: a static scale makes every element independent, so a thread
// issues kInFlight 16-byte loads before it converts any (one load per loop trip waits a memory latency
// per vector: the row path's loop, ~6 GB/s on one SM).
constexpr int kInFlight = 4;

// UBNEXT_F_FP8_STATIC alone: flat over the whole grid, grid-strided, kInFlight vectors per trip. The
// same arithmetic as the row path's static mode (q = e4m3_satfinite(x / scale[0]) of the fp32 values
// of x), so the bits do not depend on which path or grid ran. Rows do not matter here: the host's row
// split only sizes the grid.
template <typename T>
UBX_DEV void quantize_static_flat(const void* in, void* out, const float* scale, float* scale_inv, int n) {
  constexpr int V = DType<T>::kElems;
  if (blockIdx.x == 0 && threadIdx.x == 0) scale_inv[0] = scale[0];
  const float div = scale[0];
  const int64_t nv = n / V, stride = global_threads();
  for (int64_t first = global_tid(); first < nv; first += stride * kInFlight) {
    uint4 v[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u)
      if (first + u * stride < nv) v[u] = load_whole_vec(in, first + u * stride);
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      if (first + u * stride >= nv) break;
      float y[V];
      uint8_t q[V];
      unpack<T>(v[u], y);
      quantize_fp8<V>(y, div, q);
      store_fp8<V>(out, first + u * stride, n, q);
    }
  }
}

// ---------------------------------------------------------------- one scale per row (per token)
// Rows are local and independent, so instead of norm_row's one block per row with one load per loop
// trip, a row gets a group of G threads (a power of two), G chosen so that each thread holds about
// kInFlight vectors of it; a block holds blockDim / G rows. Rows of up to kHeld * G vectors stay in
// registers between the amax and the quantisation (one read of memory); longer rows (G = blockDim
// already) are read twice, kInFlight vectors per trip each time. The arithmetic is norm.cuh's own
// (nan_max of |y|, per_token_scale_inv, quantize_fp8), so the bits are those of rows_phase's
// per-token mode: the max of a set does not depend on the order it is taken in.
constexpr int kHeld = 2 * kInFlight;

// G for rows of nv vectors: the largest power of two with G * kInFlight <= nv that divides blockDim (at
// least 1), so a block holds whole groups. The host sizes the grid with the same rule
// (ubnext/_quantize.py, csrc/host/launch_rules.h); any grid is correct, since blocks stride over the
// row groups.
UBX_DEV int row_group_threads(int nv) {
  int g = 1;
  while (2 * g * kInFlight <= nv && blockDim.x % (2 * g) == 0) g *= 2;
  return g;
}

// The max over the G threads of this thread's group (groups are aligned runs of G threads), every
// thread of the group getting it. Collective over the block (uniform control flow): groups wider than
// a warp meet in `scratch` (UBX_RED_SCRATCH floats) between two barriers.
UBX_DEV float group_max(float v, int g, float* scratch) {
  if (g <= 32) return lanes_max(v, g);
  v = warp_max(v);
  const int warp = threadIdx.x >> 5, per = g >> 5, first = (warp / per) * per;
  if ((threadIdx.x & 31) == 0) scratch[warp] = v;
  __syncthreads();
  float s = scratch[first];
  for (int w = first + 1; w < first + per; ++w) s = nan_max(s, scratch[w]);
  __syncthreads();  // scratch is free again
  return s;
}

template <typename T>
UBX_DEV float vec_abs_max(const uint4& v, float amax) {
  float y[DType<T>::kElems];
  unpack<T>(v, y);
  return nan_max(amax, vec_amax(y));
}

template <typename T>
UBX_DEV void quantize_vec_store(const uint4& v, float s, void* out, int64_t gi, int64_t n) {
  constexpr int V = DType<T>::kElems;
  float y[V];
  uint8_t q[V];
  unpack<T>(v, y);
  quantize_fp8<V>(y, s, q);
  store_fp8<V>(out, gi, n, q);
}

// A row too long to hold: vectors lane, lane + g, ... < nv of the row at g0, kInFlight loads issued
// before fn(vector, index in the row) sees any of them. The amax pass and the quantising pass share it.
template <class Fn>
UBX_DEV void stream_row(const void* in, int64_t g0, int lane, int g, int nv, Fn&& fn) {
  uint4 v[kInFlight];
  for (int i0 = lane; i0 < nv; i0 += kInFlight * g) {
#pragma unroll
    for (int u = 0; u < kInFlight; ++u)
      if (i0 + u * g < nv) v[u] = load_whole_vec(in, g0 + i0 + u * g);
#pragma unroll
    for (int u = 0; u < kInFlight; ++u)
      if (i0 + u * g < nv) fn(v[u], i0 + u * g);
  }
}

template <typename T>
UBX_DEV void quantize_per_row(const void* in, void* out, float* scale_inv, int64_t n, int hidden, float* scratch) {
  constexpr int V = DType<T>::kElems;
  const int nv = hidden / V;
  const int64_t nrows = n / hidden;
  const int g = row_group_threads(nv);
  const int lane = static_cast<int>(threadIdx.x) % g;
  const int64_t groups = blockDim.x / g, mine = threadIdx.x / g;
  const int per = (nv + g - 1) / g;  // the most vectors of a row one thread handles
  const bool held = per <= kHeld;
  // block-uniform trip count: group_max may hold barriers
  for (int64_t base = blockIdx.x * groups; base < nrows; base += static_cast<int64_t>(gridDim.x) * groups) {
    const int64_t row = base + mine;
    const bool live = row < nrows;
    const int64_t g0 = row * nv;
    float amax = 0.f;
    uint4 v[kHeld];
    if (held) {
#pragma unroll
      for (int u = 0; u < kHeld; ++u)
        if (live && lane + u * g < nv) v[u] = load_whole_vec(in, g0 + lane + u * g);
#pragma unroll
      for (int u = 0; u < kHeld; ++u)
        if (live && lane + u * g < nv) amax = vec_abs_max<T>(v[u], amax);
    } else if (live) {
      stream_row(in, g0, lane, g, nv, [&](const uint4& x, int) { amax = vec_abs_max<T>(x, amax); });
    }
    const float s = per_token_scale_inv(group_max(amax, g, scratch));
    if (!live) continue;
    if (lane == 0) scale_inv[row] = s;
    if (held) {
#pragma unroll
      for (int u = 0; u < kHeld; ++u)
        if (lane + u * g < nv) quantize_vec_store<T>(v[u], s, out, g0 + lane + u * g, n);
    } else {
      stream_row(in, g0, lane, g, nv, [&](const uint4& x, int i) { quantize_vec_store<T>(x, s, out, g0 + i, n); });
    }
  }
}

template <typename T>
UBX_DEV void quantize_rows(const void* in, void* out, const float* scale, float* scale_inv, int n, int hidden,
                           int flags) {
  __shared__ float s_red[UBX_RED_SCRATCH];
  flags &= UBNEXT_F_FP8_STATIC | UBNEXT_F_FP8_PER_TOKEN;
  if (n <= 0 || flags == 0 || !row_shape_ok<T>(n, hidden, flags)) return;  // the host checks
  if (flags == UBNEXT_F_FP8_STATIC) quantize_static_flat<T>(in, out, scale, scale_inv, n);
  else  // per token wins over static, as in norm.cuh's out_mode
    quantize_per_row<T>(in, out, scale_inv, n, hidden, s_red);
}

}  // namespace ubx

#define UBX_QUANTIZE_ENTRY(NAME, T)                                          \
  UBX_KERNEL(NAME) {                                                         \
    (void)desc, (void)residual, (void)residual_out, (void)weight, (void)eps; \
    ::ubx::kernel_begin();                                                   \
    ::ubx::quantize_rows<T>(in, out, scale, scale_inv, n, hidden, flags);    \
  }

UBX_QUANTIZE_ENTRY(ubnext_quantize_fp8_bf16, __nv_bfloat16)
UBX_QUANTIZE_ENTRY(ubnext_quantize_fp8_fp16, __half)
UBX_QUANTIZE_ENTRY(ubnext_quantize_fp8_fp32, float)
