// The one place that decides between the GPU toolchains (nvcc, NVRTC) and the CPU emulator (g++).
// The emulator prelude must come before any CUDA header: crt/host_defines.h keeps an existing
// __global__ / __device__ / __shared__ definition, so ours win only if they are first.
#pragma once

#if defined(UBNEXT_EMULATOR)
#include "../emu/emu_prelude.h"
#endif

#if defined(__CUDACC_RTC__)
// NVRTC has no C library headers.
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef int int32_t;
typedef unsigned long long uint64_t;
typedef long long int64_t;
#else
#include <stdint.h>
#endif

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#if defined(UBNEXT_EMULATOR)
#define UBX_DEV inline
// the GPU faults on a misaligned vector access by itself; the emulator must be told to, and it
// counts the bytes of plain accesses too (its critical-path count, csrc/emu/memory.cpp)
#define UBX_VECTOR_LOAD(p, bytes, access) ::ubx_emu::vector_access((p), (bytes), (access), true)
// the emulator's critical-path count: a wait's polls count once, as the value they waited for
#define UBX_COUNT_WAIT_BEGIN() ::ubx_emu::count_wait_begin()
#define UBX_COUNT_WAIT_END(p, bytes, arrived) ::ubx_emu::count_wait_end((p), (bytes), (arrived), 0, 0u)
#define UBX_COUNT_WAIT_END_AT(p, target, arrived) ::ubx_emu::count_wait_end((p), 4, (arrived), 1, (target))
// a poll of several slots that re-loads every outstanding one on each pass: one wait (lamport_poll.cuh)
#define UBX_COUNT_POLL_BEGIN() ::ubx_emu::count_poll_begin()
#define UBX_COUNT_POLL_END(repolled, arrived) ::ubx_emu::count_poll_end((repolled), (arrived))
#define UBX_VECTOR_STORE(p, bytes, access) ::ubx_emu::vector_access((p), (bytes), (access), false)
#else
#define UBX_DEV __device__ __forceinline__
#define UBX_VECTOR_LOAD(p, bytes, access) ((void)0)
#define UBX_COUNT_WAIT_BEGIN() ((void)0)
#define UBX_COUNT_WAIT_END(p, bytes, arrived) ((void)0)
#define UBX_COUNT_WAIT_END_AT(p, target, arrived) ((void)0)
#define UBX_COUNT_POLL_BEGIN() ((void)0)
#define UBX_COUNT_POLL_END(repolled, arrived) ((void)0)
#define UBX_VECTOR_STORE(p, bytes, access) ((void)0)
#endif
