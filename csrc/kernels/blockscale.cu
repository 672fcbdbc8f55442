// Block-scaled quantisation of a local tensor (comm.quantize, issue 28): NVFP4, MXFP8 and per-token-group
// FP8, with the device pieces of csrc/device/blockscale.cuh (the fused path calls the same ones).
//
// Kernels: ubnext_quantize_{nvfp4,mxfp8,fp8_group128}_{bf16,fp16,fp32}, with the one ABI parameter list
// (docs/ARCHITECTURE.md): in (x, n elements of T, rows of `hidden` = K), out (q), scale (NVFP4's
// one-element fp32 global scale, or null), scale_inv (the block scales), n, hidden, flags
// (UBNEXT_F_BLOCK_SWIZZLED, UBNEXT_F_BLOCK_UE8M0). desc, residual, residual_out, weight and eps are unused: local, no
// peer, nothing waits, so the grid is the work's (no residency cap).
//   nvfp4        q: n / 2 bytes, two e2m1 per byte, the even element low; scales: e4m3, one per 16.
//   mxfp8        q: n e4m3 bytes; scales: e8m0, one per 32.
//   fp8_group128 q: n e4m3 bytes; scales: fp32, one per 128 (UBNEXT_F_BLOCK_UE8M0: powers of two).
// Scales are row-major [n / K, K / block], or (UBNEXT_F_BLOCK_SWIZZLED, nvfp4 and mxfp8) in to_blocked's layout
// with its padding zeroed by this kernel.
//
// Each thread keeps kInFlight 16-byte loads in flight: vector gi = w0 + lane + u * stride, so for every
// u the 32 lanes of a warp hold 32 consecutive vectors, and a quantisation block (block / V vectors,
// which divides 32) lies in aligned adjacent lanes, as in the fused path's rows.
// Contract (the host checks): hidden % block == 0, n % hidden == 0; in 16-byte aligned; out aligned to
// its per-vector store (V bytes, or V / 2 for nvfp4); scale_inv 4-byte aligned.
#include "../device/platform.cuh"
#include "../device/desc.cuh"
#include "../device/entry.cuh"
#include "../device/vec.cuh"
#include "../device/reduce.cuh"
#include "../device/blockscale.cuh"

namespace ubx {

constexpr int kBlockInFlight = 4;

template <typename T, BlockFormat F>
UBX_DEV void quantize_blocks(const void* in, void* out, const float* gs, void* scales, int n, int hidden, int flags) {
  constexpr int V = DType<T>::kElems;
  constexpr int B = FormatTraits<F>::kBlock;
  if (n <= 0 || hidden <= 0 || hidden % B != 0 || n % hidden != 0) return;  // the host checks
  const int64_t nv = n / V, nrows = n / hidden, stride = global_threads();
  const int64_t lane = threadIdx.x & 31;
  // warp-uniform trips (the block's amax is a shuffle): the warp's first vector decides
  for (int64_t w0 = global_tid() - lane; w0 < nv; w0 += stride * kBlockInFlight) {
    uint4 v[kBlockInFlight];
#pragma unroll
    for (int u = 0; u < kBlockInFlight; ++u) {
      const int64_t gi = w0 + lane + u * stride;
      v[u] = gi < nv ? load_whole_vec(in, gi) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int u = 0; u < kBlockInFlight; ++u) {
      const int64_t gi = w0 + lane + u * stride;
      float y[V];
      unpack<T>(v[u], y);
      quantize_block_vals<T, F>(y, gi < nv, gi, out, scales, gs, hidden, flags);
    }
  }
  if (F != BlockFormat::kGroup128 && (flags & UBNEXT_F_BLOCK_SWIZZLED))
    zero_swizzle_padding(reinterpret_cast<uint8_t*>(scales), nrows, hidden / B, global_tid(), stride);
}

}  // namespace ubx

#define UBX_BLOCKSCALE_ENTRY(NAME, T, F)                                       \
  UBX_KERNEL(NAME) {                                                           \
    (void)desc, (void)residual, (void)residual_out, (void)weight, (void)eps;   \
    ::ubx::kernel_begin();                                                     \
    ::ubx::quantize_blocks<T, F>(in, out, scale, scale_inv, n, hidden, flags); \
  }

UBX_BLOCKSCALE_ENTRY(ubnext_quantize_nvfp4_bf16, __nv_bfloat16, ::ubx::BlockFormat::kNvfp4)
UBX_BLOCKSCALE_ENTRY(ubnext_quantize_nvfp4_fp16, __half, ::ubx::BlockFormat::kNvfp4)
UBX_BLOCKSCALE_ENTRY(ubnext_quantize_nvfp4_fp32, float, ::ubx::BlockFormat::kNvfp4)
UBX_BLOCKSCALE_ENTRY(ubnext_quantize_mxfp8_bf16, __nv_bfloat16, ::ubx::BlockFormat::kMxfp8)
UBX_BLOCKSCALE_ENTRY(ubnext_quantize_mxfp8_fp16, __half, ::ubx::BlockFormat::kMxfp8)
UBX_BLOCKSCALE_ENTRY(ubnext_quantize_mxfp8_fp32, float, ::ubx::BlockFormat::kMxfp8)
UBX_BLOCKSCALE_ENTRY(ubnext_quantize_fp8_group128_bf16, __nv_bfloat16, ::ubx::BlockFormat::kGroup128)
UBX_BLOCKSCALE_ENTRY(ubnext_quantize_fp8_group128_fp16, __half, ::ubx::BlockFormat::kGroup128)
UBX_BLOCKSCALE_ENTRY(ubnext_quantize_fp8_group128_fp32, float, ::ubx::BlockFormat::kGroup128)
