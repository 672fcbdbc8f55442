// Fallback for the emulator build only: the pip-installed CUDA headers (nvidia/cu13/include) ship
// vector_types.h, cuda_fp16.h, cuda_bf16.h and cuda_fp8.h but not crt/host_defines.h, which they
// include. This is the subset those headers need in host code with g++ (no __CUDACC__). It is on
// the include path AFTER the real CUDA include directory, so a complete toolkit's own file wins.
#pragma once
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#error "csrc/emu/shim is for the emulator's host build only"
#endif

#define __no_return__ __attribute__((noreturn))
#ifndef __forceinline__
#define __forceinline__ __inline__ __attribute__((always_inline))
#endif
#define __inline_hint__ __attribute__((nv_inline_hint))
#define __align__(n) __attribute__((aligned(n)))
#define __builtin_align__(a) __align__(a)
#define __maxnreg__(a)
#define __local_maxnreg__(a)
#define __thread__ __thread
#define __import__
#define __export__
#define __cdecl
#define __annotate__(a)
#define __location__(a)
#define __launch_bounds__(...)
#define __cluster_dims__(...)
#define __block_size__(...)
#define __specialization_static
#define CUDARTAPI
#define CUDARTAPI_CDECL
#define __device_builtin__
#define __device_builtin_texture_type__
#define __device_builtin_surface_type__
#define __cudart_builtin__
#ifndef __host__
#define __host__
#endif
#ifndef __device__
#define __device__
#endif
#ifndef __global__
#define __global__
#endif
#ifndef __shared__
#define __shared__
#endif
#ifndef __constant__
#define __constant__
#endif
#ifndef __managed__
#define __managed__
#endif
#ifndef __grid_constant__
#define __grid_constant__
#endif
#ifndef __nv_pure__
#define __nv_pure__
#endif
#define __CUDA_ARCH_HAS_FEATURE__(_FEAT) __CUDA_ARCH_FEAT_##_FEAT
#define __CUDA_HAS_ARCH_FAMILY_SPECIFIC(N) 0
#define __CUDA_HAS_ARCH_SPECIFIC(N) 0
