// FP8 (e4m3) quantisation of a local tensor, writing the data and its scale_inv in one kernel (the
// FP8 scale-inverse seed: the kernel that writes the bits writes the scale that decodes them). FSDP2's
// FP8 weights run it on each rank's shard before the all-gather, so q and scale_inv travel together.
//
// Kernels: ubnext_quantize_fp8_{bf16,fp16,fp32}, with the one ABI parameter list (docs/ARCHITECTURE.md):
// in (n elements of T), out (n e4m3 bytes), scale, scale_inv, n, hidden, flags. desc, residual,
// residual_out, weight and eps are unused: no peer is involved, nothing waits.
//
// It is the fused kernels' row math (norm.cuh, rows_phase) without the allreduce and without the norm,
// so one code path quantises for both, with the contract of docs/ARCHITECTURE.md's FP8 output:
//   UBNEXT_F_FP8_PER_TOKEN: rows of `hidden` elements; scale_inv[row] = max(amax_row / 448, 1e-12) and
//     q = e4m3_satfinite(x / scale_inv[row]). hidden = n gives ONE scale for the whole tensor (FSDP2's
//     per-shard mode; the host launches one block then, since the amax is a block reduction).
//   UBNEXT_F_FP8_STATIC: q = e4m3_satfinite(x / scale[0]), scale_inv[0] = scale[0] (a device float, read
//     by the kernel, so a captured graph picks up a new value on replay); flat over the whole grid with
//     several loads in flight per thread (quantize_static_flat), since no element depends on another.
// Contract: hidden % V == 0 and n % hidden == 0 (whole 16-byte vectors per row); in 16-byte aligned; out
// 8-byte aligned; scale_inv holds n / hidden floats (per row) or 1 (static).
#include "../device/platform.cuh"
#include "../device/desc.cuh"
#include "../device/entry.cuh"
#include "../device/vec.cuh"
#include "../device/reduce.cuh"
#include "../device/norm.cuh"
#include "../device/slices.cuh"

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

template <typename T>
UBX_DEV void quantize_rows(const void* in, void* out, const float* scale, float* scale_inv, int n, int hidden,
                           int flags) {
  __shared__ uint4 s_cache[UBX_ROW_CACHE_VECS];
  __shared__ float s_red[UBX_RED_SCRATCH];
  flags &= UBNEXT_F_FP8_STATIC | UBNEXT_F_FP8_PER_TOKEN;  // never the norm: this is quantisation alone
  if (n <= 0 || flags == 0 || !row_shape_ok<T>(n, hidden, flags)) return;  // the host checks
  if (flags == UBNEXT_F_FP8_STATIC) {
    quantize_static_flat<T>(in, out, scale, scale_inv, n);
    return;
  }
  LocalSrc<T> src{in, static_cast<int64_t>(n)};
  rows_phase<T>(src, n / hidden, nullptr, nullptr, nullptr, scale, scale_inv, out, n, hidden, 0.f, flags, s_cache,
                s_red);
}

}  // namespace ubx

#define UBX_QUANTIZE_ENTRY(NAME, T)                                                                          \
  UBX_KERNEL(NAME) {                                                                                        \
    (void)desc, (void)residual, (void)residual_out, (void)weight, (void)eps;                               \
    ::ubx::kernel_begin();                                                                                  \
    ::ubx::quantize_rows<T>(in, out, scale, scale_inv, n, hidden, flags);                                  \
  }

UBX_QUANTIZE_ENTRY(ubnext_quantize_fp8_bf16, __nv_bfloat16)
UBX_QUANTIZE_ENTRY(ubnext_quantize_fp8_fp16, __half)
UBX_QUANTIZE_ENTRY(ubnext_quantize_fp8_fp32, float)
