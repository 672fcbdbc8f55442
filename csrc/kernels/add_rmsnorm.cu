// Residual add + RMSNorm (+FP8) of a tensor already reduced elsewhere: the fused op's second half, for
// a call whose allreduce ran in torch.distributed (NCCL on a GPU) because the message is larger than the
// pool. The fused kernels' own row math (norm.cuh, rows_phase) over a local source, so a large message
// keeps the fusion (one kernel for add, norm and FP8 instead of torch's separate ops), with the same
// arithmetic per row as every fused path. No peer is involved, nothing waits.
//
// Kernels: ubnext_add_rmsnorm_{bf16,fp16,fp32}, with the one ABI parameter list (docs/ARCHITECTURE.md):
// in (the reduced n elements of T), out, residual, residual_out, weight, scale, scale_inv, n, hidden,
// eps, flags (UBNEXT_F_FUSED_NORM, with UBNEXT_F_FP8_STATIC or _PER_TOKEN for an e4m3 out). desc unused.
// One block per token row, as the fused paths' row phase.
#include "../device/platform.cuh"
#include "../device/desc.cuh"
#include "../device/entry.cuh"
#include "../device/vec.cuh"
#include "../device/reduce.cuh"
#include "../device/norm.cuh"
#include "../device/slices.cuh"

namespace ubx {

template <typename T>
UBX_DEV void add_rmsnorm_rows(const void* in, void* out, const void* residual, void* residual_out, const void* weight,
                              const float* scale, float* scale_inv, int n, int hidden, float eps, int flags) {
  __shared__ uint4 s_cache[UBX_ROW_CACHE_VECS];
  __shared__ float s_red[UBX_RED_SCRATCH];
  if (n <= 0 || !(flags & UBNEXT_F_FUSED_NORM) || !row_shape_ok<T>(n, hidden, flags)) return;  // the host checks
  LocalSrc<T> src{in, static_cast<int64_t>(n)};
  rows_phase<T>(src, n / hidden, residual, residual_out, weight, scale, scale_inv, out, n, hidden, eps, flags,
                s_cache, s_red);
}

}  // namespace ubx

#define UBX_ADD_RMSNORM_ENTRY(NAME, T)                                                                     \
  UBX_KERNEL(NAME) {                                                                                        \
    (void)desc;                                                                                             \
    ::ubx::kernel_begin();                                                                                  \
    ::ubx::add_rmsnorm_rows<T>(in, out, residual, residual_out, weight, scale, scale_inv, n, hidden, eps,  \
                               flags);                                                                      \
  }

UBX_ADD_RMSNORM_ENTRY(ubnext_add_rmsnorm_bf16, __nv_bfloat16)
UBX_ADD_RMSNORM_ENTRY(ubnext_add_rmsnorm_fp16, __half)
UBX_ADD_RMSNORM_ENTRY(ubnext_add_rmsnorm_fp32, float)
