// CUDA's language extensions and device builtins for g++, so that the kernel sources compile as
// C++20 host code for the CPU emulator. Included by csrc/device/platform.cuh BEFORE any CUDA header:
// crt/host_defines.h keeps a __global__ / __device__ / __shared__ that is already defined.
//
// Execution model behind these names (csrc/emu/sched.cpp): each block runs on its own OS thread,
// each CUDA thread of the block is a fiber on it. Hence
//   - __shared__ is `thread_local`: one instance per OS thread = per block (at block scope a
//     thread_local variable is implicitly static, so `static __shared__` also works);
//   - threadIdx/blockIdx/blockDim/gridDim are thread_local variables that the scheduler sets
//     before it resumes a fiber;
//   - __syncthreads, warp shuffles and votes are scheduling points where fibers wait for each other.
// Limits: no dynamic (`extern __shared__`) shared memory; functions defined in headers must be
// inline (UBX_DEV, __forceinline__) or static, since every kernel file is linked into one library.
#pragma once

#if !defined(UBNEXT_EMULATOR)
#error "emu_prelude.h is only for the emulator build (-DUBNEXT_EMULATOR)"
#endif
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#error "the emulator build is host C++ (g++ -x c++), not nvcc/NVRTC"
#endif

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <algorithm>
#include <type_traits>

#include "emu_runtime.h"

// ---------------------------------------------------------------- language extensions
// Kernels are found by name with dlsym, so they must stay exported and out of line.
#define __global__ __attribute__((visibility("default"), used, noinline))
#define __device__
#define __host__
#define __forceinline__ __inline__ __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __shared__ thread_local
#define __constant__ const
#define __launch_bounds__(...)
#define __grid_constant__

// The CUDA headers are complete now that the extensions are defined; include them here so that
// the index macros below cannot clash with their parameter names (cudaLaunchKernel's gridDim...).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <vector_functions.h>

// ---------------------------------------------------------------- indices
#define threadIdx (::ubx_emu::tl_threadIdx)
#define blockIdx (::ubx_emu::tl_blockIdx)
#define blockDim (::ubx_emu::tl_blockDim)
#define gridDim (::ubx_emu::tl_gridDim)
#define warpSize 32

// ---------------------------------------------------------------- synchronisation
inline void __syncthreads() { (void)::ubx_emu::syncthreads_op(0, 0); }
inline int __syncthreads_count(int p) { return ::ubx_emu::syncthreads_op(p, 1); }
inline int __syncthreads_and(int p) { return ::ubx_emu::syncthreads_op(p, 2); }
inline int __syncthreads_or(int p) { return ::ubx_emu::syncthreads_op(p, 3); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { (void)::ubx_emu::warp_exchange(mask, 0, -1, 0); }
inline void __threadfence() { ::ubx_emu::fence(::ubx_emu::kScopeGpu); }
inline void __threadfence_system() { ::ubx_emu::fence(::ubx_emu::kScopeSys); }
// Block-scope ordering is free: the fibers of a block share one OS thread.
inline void __threadfence_block() {}
inline void __nanosleep(unsigned ns) { ::ubx_emu::nanosleep_ns(ns); }
[[noreturn]] inline void __trap() { ::ubx_emu::trap(); }

// ---------------------------------------------------------------- warp shuffles and votes
namespace ubx_emu_detail {
inline unsigned lane_id() { return (threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)) & 31u; }
// Shuffle a value of 1..8 bytes as one or two 32-bit exchanges. src < 0: keep own value.
template <typename T>
inline T shfl(unsigned mask, T v, int src) {
  static_assert(std::is_trivially_copyable<T>::value && sizeof(T) <= 8, "shuffle of this type");
  uint32_t w[2] = {0, 0};
  memcpy(w, &v, sizeof(T));
  w[0] = ::ubx_emu::warp_exchange(mask, w[0], src, 0);
  if (sizeof(T) > 4) w[1] = ::ubx_emu::warp_exchange(mask, w[1], src, 0);
  T out;
  memcpy(&out, w, sizeof(T));
  return out;
}
}  // namespace ubx_emu_detail

template <typename T>
inline T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32) {
  const int lane = (int)ubx_emu_detail::lane_id();
  return ubx_emu_detail::shfl(mask, v, (lane & ~(width - 1)) + (src_lane & (width - 1)));
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  const int lane = (int)ubx_emu_detail::lane_id();
  const int src = lane ^ lane_mask;
  // A lane may read from its own or an earlier segment of `width` lanes, not a later one.
  return ubx_emu_detail::shfl(mask, v, src >= ((lane / width) + 1) * width ? -1 : src);
}
template <typename T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  const int lane = (int)ubx_emu_detail::lane_id();
  return ubx_emu_detail::shfl(mask, v, (lane % width) + (int)delta >= width ? -1 : lane + (int)delta);
}
template <typename T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  const int lane = (int)ubx_emu_detail::lane_id();
  return ubx_emu_detail::shfl(mask, v, (lane % width) < (int)delta ? -1 : lane - (int)delta);
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
  return ::ubx_emu::warp_exchange(mask, pred != 0, 0, 1) & mask;
}
inline int __any_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) != 0; }
inline int __all_sync(unsigned mask, int pred) { return __ballot_sync(mask, !pred) == 0; }
inline unsigned __activemask() { return ::ubx_emu::warp_exchange(0xffffffffu, 1, 0, 1); }

// ---------------------------------------------------------------- atomics (block- or device-wide)
// Fibers of one block share an OS thread and blocks run on different OS threads, so the host
// atomics give exactly CUDA's device-scope semantics. Cross-rank atomics go through ptx.cuh.
inline unsigned atomicAdd(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
inline float atomicAdd(float* p, float v) {
  uint32_t* w = reinterpret_cast<uint32_t*>(p);
  uint32_t old = __atomic_load_n(w, __ATOMIC_RELAXED);
  for (;;) {
    float f;
    memcpy(&f, &old, 4);
    f += v;
    uint32_t nw;
    memcpy(&nw, &f, 4);
    if (__atomic_compare_exchange_n(w, &old, nw, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
      memcpy(&f, &old, 4);
      return f;
    }
  }
}
inline unsigned atomicCAS(unsigned* p, unsigned cmp, unsigned val) {
  __atomic_compare_exchange_n(p, &cmp, val, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
  return cmp;
}
inline int atomicCAS(int* p, int cmp, int val) {
  __atomic_compare_exchange_n(p, &cmp, val, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
  return cmp;
}
inline unsigned atomicExch(unsigned* p, unsigned v) { return __atomic_exchange_n(p, v, __ATOMIC_RELAXED); }
namespace ubx_emu_detail {
template <typename T, typename Pick>
inline T cas_loop(T* p, T v, Pick pick) {
  T old = __atomic_load_n(p, __ATOMIC_RELAXED);
  while (!__atomic_compare_exchange_n(p, &old, pick(old, v), false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
  return old;
}
}  // namespace ubx_emu_detail
inline unsigned atomicMax(unsigned* p, unsigned v) {
  return ubx_emu_detail::cas_loop(p, v, [](unsigned a, unsigned b) { return a > b ? a : b; });
}
inline int atomicMax(int* p, int v) {
  return ubx_emu_detail::cas_loop(p, v, [](int a, int b) { return a > b ? a : b; });
}
inline unsigned atomicMin(unsigned* p, unsigned v) {
  return ubx_emu_detail::cas_loop(p, v, [](unsigned a, unsigned b) { return a < b ? a : b; });
}
inline unsigned atomicOr(unsigned* p, unsigned v) { return __atomic_fetch_or(p, v, __ATOMIC_RELAXED); }

// ---------------------------------------------------------------- math and bit casts
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline float __frsqrt_rn(float x) { return 1.0f / sqrtf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline float __expf(float x) { return expf(x); }
inline float __saturatef(float x) { return x < 0.f ? 0.f : (x > 1.f ? 1.f : x); }
// clang-format off: four one-line bit-cast twins
inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
inline int __float_as_int(float f) { int i; memcpy(&i, &f, 4); return i; }
inline float __uint_as_float(unsigned i) { float f; memcpy(&f, &i, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned i; memcpy(&i, &f, 4); return i; }
// clang-format on
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
using std::max;
using std::min;
