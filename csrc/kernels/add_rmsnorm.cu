// Residual add + RMSNorm (+FP8) of a tensor already reduced elsewhere: the fused op's second half, for
// a call whose allreduce ran in torch.distributed (NCCL on a GPU) because the message is larger than the
// pool. The fused kernels' own row math (norm.cuh, rows_phase) over a local source, so a large message
// keeps the fusion (one kernel for add, norm and FP8 instead of torch's separate ops), with the same
// arithmetic per row as every fused path. No peer is involved, nothing waits.
//
// Kernels: ubnext_add_rmsnorm_{bf16,fp16,fp32}, with the one ABI parameter list (docs/ARCHITECTURE.md):
// in (the reduced n elements IN FP32, whatever T is), out, residual, residual_out, weight, scale, scale_inv,
// n, hidden, eps, flags (UBNEXT_F_FUSED_NORM, with UBNEXT_F_FP8_STATIC or _PER_TOKEN for an e4m3 out); the
// other pointers hold T. desc unused. One block per token row, as the fused paths' row phase.
// Why fp32 `in`: one arithmetic on every path (issue 26), residual_out = T(s + residual) with s the fp32
// sum, rounded once. Torch's allreduce of T would hand over s already rounded to T (two roundings); the
// caller (ubnext/_fused.py) reduces in fp32 instead, at twice the bytes for 16-bit types.
#include "../device/platform.cuh"
#include "../device/desc.cuh"
#include "../device/entry.cuh"
#include "../device/vec.cuh"
#include "../device/reduce.cuh"
#include "../device/norm.cuh"
#include "../device/slices.cuh"

namespace ubx {

// The fp32 sums of vector gi of T (V elements: V / 4 16-byte vectors of fp32). Rows are whole vectors.
template <typename T>
struct F32Src {
  const float* x;
  UBX_DEV bool operator()(int64_t gi, float (&s)[DType<T>::kElems]) const {
    constexpr int V = DType<T>::kElems;
#pragma unroll
    for (int k = 0; k < V / 4; ++k) {
      const uint4 v = load_whole_vec(x, gi * (V / 4) + k);
      s[4 * k] = u32_as_f32(v.x);
      s[4 * k + 1] = u32_as_f32(v.y);
      s[4 * k + 2] = u32_as_f32(v.z);
      s[4 * k + 3] = u32_as_f32(v.w);
    }
    return true;
  }
};

template <typename T>
UBX_DEV void add_rmsnorm_rows(const void* in, void* out, const void* residual, void* residual_out, const void* weight,
                              const float* scale, float* scale_inv, int n, int hidden, float eps, int flags) {
  __shared__ uint4 s_cache[UBX_ROW_CACHE_VECS];
  __shared__ float s_red[UBX_RED_SCRATCH];
  if (n <= 0 || !(flags & UBNEXT_F_FUSED_NORM) || !row_shape_ok<T>(n, hidden, flags)) return;  // the host checks
  F32Src<T> src{static_cast<const float*>(in)};
  rows_phase<T>(src, n / hidden, residual, residual_out, weight, scale, scale_inv, out, n, hidden, eps, flags, s_cache,
                s_red);
}

}  // namespace ubx

#define UBX_ADD_RMSNORM_ENTRY(NAME, T)                                                                            \
  UBX_KERNEL(NAME) {                                                                                              \
    (void)desc;                                                                                                   \
    ::ubx::kernel_begin();                                                                                        \
    ::ubx::add_rmsnorm_rows<T>(in, out, residual, residual_out, weight, scale, scale_inv, n, hidden, eps, flags); \
  }

UBX_ADD_RMSNORM_ENTRY(ubnext_add_rmsnorm_bf16, __nv_bfloat16)
UBX_ADD_RMSNORM_ENTRY(ubnext_add_rmsnorm_fp16, __half)
UBX_ADD_RMSNORM_ENTRY(ubnext_add_rmsnorm_fp32, float)
