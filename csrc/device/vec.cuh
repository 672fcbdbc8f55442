// 16-byte vector I/O, dtype traits, -0 sanitising and the Lamport sentinel.
//
// Every ubnext data path moves 16-byte vectors (uint4): 8 bf16, 8 fp16 or 4 fp32 elements. Word w
// of a 16-bit vector holds element 2w in its low half and element 2w+1 in its high half (little
// endian, so the element at the lower address is the low half).
//
// Host-compatible: the same code compiles under nvcc/NVRTC and under g++ (UBNEXT_EMULATOR). Bit
// casts go through a union (defined behaviour in both compilers' dialects; no memcpy, which NVRTC
// lacks, and no __float_as_uint, which host code lacks).
#pragma once

#include "platform.cuh"
#include "desc.cuh"

namespace ubx {

// ---------------------------------------------------------------- bit casts
union F32Bits {
  float f;
  uint32_t u;
};
UBX_DEV int64_t global_tid() { return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; }
UBX_DEV int64_t global_threads() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

UBX_DEV float u32_as_f32(uint32_t u) {
  F32Bits b;
  b.u = u;
  return b.f;
}
UBX_DEV uint32_t f32_as_u32(float f) {
  F32Bits b;
  b.f = f;
  return b.u;
}

UBX_DEV uint32_t vec_word(const uint4& v, int w) { return w == 0 ? v.x : w == 1 ? v.y : w == 2 ? v.z : v.w; }
UBX_DEV void set_vec_word(uint4& v, int w, uint32_t x) {
  if (w == 0) v.x = x;
  else if (w == 1) v.y = x;
  else if (w == 2) v.z = x;
  else v.w = x;
}

// ---------------------------------------------------------------- dtype traits
// DType<T>: kElems elements per 16-byte vector, bits <-> float conversions (round to nearest even),
// and the -0 sanitiser for one 32-bit word.
template <typename T>
struct DType;

template <>
struct DType<__nv_bfloat16> {
  typedef uint16_t Bits;
  static constexpr uint32_t kCode = UBNEXT_HDR_DTYPE_BF16;
  static constexpr int kElems = 8;
  static constexpr int kBytes = 2;
  // Exact: a bf16 is the high half of an fp32.
  UBX_DEV static float to_float(uint32_t bits16) { return u32_as_f32(bits16 << 16); }
  UBX_DEV static uint32_t from_float(float f) {
    __nv_bfloat16_raw r = __nv_bfloat16_raw(__float2bfloat16_rn(f));
    return r.x;
  }
  // -0 (0x8000) -> +0 in each half.
  UBX_DEV static uint32_t sanitize_word(uint32_t w) {
    const uint32_t lo = ((w & 0xFFFFu) == 0x8000u) ? 0x0000FFFFu : 0u;
    const uint32_t hi = ((w & 0xFFFF0000u) == 0x80000000u) ? 0xFFFF0000u : 0u;
    return w & ~(lo | hi);
  }
};

template <>
struct DType<__half> {
  typedef uint16_t Bits;
  static constexpr uint32_t kCode = UBNEXT_HDR_DTYPE_FP16;
  static constexpr int kElems = 8;
  static constexpr int kBytes = 2;
  UBX_DEV static float to_float(uint32_t bits16) {
    __half_raw r;
    r.x = static_cast<unsigned short>(bits16);
    return __half2float(__half(r));
  }
  UBX_DEV static uint32_t from_float(float f) {
    __half_raw r = __half_raw(__float2half_rn(f));
    return r.x;
  }
  UBX_DEV static uint32_t sanitize_word(uint32_t w) { return DType<__nv_bfloat16>::sanitize_word(w); }
};

template <>
struct DType<float> {
  typedef uint32_t Bits;
  static constexpr uint32_t kCode = UBNEXT_HDR_DTYPE_FP32;
  static constexpr int kElems = 4;
  static constexpr int kBytes = 4;
  UBX_DEV static float to_float(uint32_t bits) { return u32_as_f32(bits); }
  UBX_DEV static uint32_t from_float(float f) { return f32_as_u32(f); }
  UBX_DEV static uint32_t sanitize_word(uint32_t w) { return w == 0x80000000u ? 0u : w; }
};

// ---------------------------------------------------------------- pack / unpack
// Element j of a vector as raw bits (16 or 32 significant bits).
template <typename T>
UBX_DEV uint32_t vec_elem_bits(const uint4& v, int j) {
  if constexpr (DType<T>::kBytes == 4) return vec_word(v, j);
  const uint32_t w = vec_word(v, j >> 1);
  return (j & 1) ? (w >> 16) : (w & 0xFFFFu);
}

template <typename T>
UBX_DEV void unpack(const uint4& v, float (&f)[DType<T>::kElems]) {
  if constexpr (DType<T>::kBytes == 4) {
    f[0] = u32_as_f32(v.x);
    f[1] = u32_as_f32(v.y);
    f[2] = u32_as_f32(v.z);
    f[3] = u32_as_f32(v.w);
  } else {
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const uint32_t x = vec_word(v, w);
      f[2 * w] = DType<T>::to_float(x & 0xFFFFu);
      f[2 * w + 1] = DType<T>::to_float(x >> 16);
    }
  }
}

// Rounds each float to T (round to nearest even) and packs.
template <typename T>
UBX_DEV uint4 pack(const float (&f)[DType<T>::kElems]) {
  // Every word is written below; the zeros only tell g++ so (its -Wmaybe-uninitialized cannot follow
  // set_vec_word through the loop). NVVM drops them.
  uint4 v = make_uint4(0u, 0u, 0u, 0u);
  if constexpr (DType<T>::kBytes == 4) {
    v.x = f32_as_u32(f[0]);
    v.y = f32_as_u32(f[1]);
    v.z = f32_as_u32(f[2]);
    v.w = f32_as_u32(f[3]);
  } else {
#pragma unroll
    for (int w = 0; w < 4; ++w)
      set_vec_word(v, w, DType<T>::from_float(f[2 * w]) | (DType<T>::from_float(f[2 * w + 1]) << 16));
  }
  return v;
}

// Round each float to T and back (the value a store of T would hold).
template <typename T>
UBX_DEV void round_to(float (&f)[DType<T>::kElems]) {
  const uint4 v = pack<T>(f);
  unpack<T>(v, f);
}

// ---------------------------------------------------------------- Lamport sentinel
// The "not yet written" pattern: 0x80000000 in every 32-bit word. For fp32 that is -0; for 16-bit
// types it is the pair (high = -0, low = +0). Pushed data is sanitised (-0 -> +0 per element), so no
// sanitised word can equal it, whatever the data (NaN payloads included). Readiness compares bit
// patterns, never floats: a float compare under FTZ could equate -0 and a negative subnormal.
#define UBX_SENTINEL_WORD 0x80000000u

UBX_DEV uint4 sentinel_vec() {
  uint4 v;
  v.x = v.y = v.z = v.w = UBX_SENTINEL_WORD;
  return v;
}

template <typename T>
UBX_DEV uint4 sanitize(uint4 v) {
  v.x = DType<T>::sanitize_word(v.x);
  v.y = DType<T>::sanitize_word(v.y);
  v.z = DType<T>::sanitize_word(v.z);
  v.w = DType<T>::sanitize_word(v.w);
  return v;
}

// Ready only when EVERY word differs from the sentinel: a 16-byte store may become visible word by
// word, and checking one word of 16 bytes is a known hang/garbage bug (DESIGN.md section 8).
UBX_DEV bool is_ready(const uint4& v) {
  return (v.x != UBX_SENTINEL_WORD) & (v.y != UBX_SENTINEL_WORD) & (v.z != UBX_SENTINEL_WORD) &
         (v.w != UBX_SENTINEL_WORD);
}

// ---------------------------------------------------------------- plain global vector I/O with tails
// Vector gi covers elements [gi*kElems, gi*kElems + kElems). Pointers are 16-byte aligned (host
// contract). For the last, partial vector (elements >= n) only the elements below n are touched:
// loads fill the rest with +0 (a valid, sanitised value), stores skip them.
// Whole vector gi of a 16-byte aligned array.
UBX_DEV uint4 load_whole_vec(const void* base, int64_t gi) {
  UBX_VECTOR_LOAD(reinterpret_cast<const uint4*>(base) + gi, 16, "vector load");
  return reinterpret_cast<const uint4*>(base)[gi];
}

UBX_DEV void store_whole_vec(void* base, int64_t gi, const uint4& v) {
  UBX_VECTOR_STORE(reinterpret_cast<uint4*>(base) + gi, 16, "vector store");
  reinterpret_cast<uint4*>(base)[gi] = v;
}

template <typename T>
UBX_DEV uint4 load_vec(const void* base, int64_t gi, int64_t n) {
  constexpr int V = DType<T>::kElems;
  const int64_t e0 = gi * V;
  if (e0 + V <= n) return load_whole_vec(base, gi);
  uint4 v = make_uint4(0u, 0u, 0u, 0u);
  for (int j = 0; j < V && e0 + j < n; ++j) {
    if constexpr (DType<T>::kBytes == 4) {
      set_vec_word(v, j, reinterpret_cast<const uint32_t*>(base)[e0 + j]);
    } else {
      const uint32_t x = reinterpret_cast<const uint16_t*>(base)[e0 + j];
      set_vec_word(v, j >> 1, vec_word(v, j >> 1) | ((j & 1) ? (x << 16) : x));
    }
  }
  return v;
}

template <typename T>
UBX_DEV void store_vec(void* base, int64_t gi, int64_t n, const uint4& v) {
  constexpr int V = DType<T>::kElems;
  const int64_t e0 = gi * V;
  if (e0 + V <= n) {
    store_whole_vec(base, gi, v);
    return;
  }
  for (int j = 0; j < V && e0 + j < n; ++j) {
    if constexpr (DType<T>::kBytes == 4) reinterpret_cast<uint32_t*>(base)[e0 + j] = vec_word(v, j);
    else reinterpret_cast<uint16_t*>(base)[e0 + j] = static_cast<uint16_t>(vec_elem_bits<T>(v, j));
  }
}

// FP8 bytes of one vector: kElems bytes at byte offset gi*kElems (8-byte store for 16-bit types,
// 4-byte store for fp32 when whole; byte stores for the tail).
template <int V>
UBX_DEV void store_fp8(void* base, int64_t gi, int64_t n, const uint8_t (&q)[V]) {
  const int64_t e0 = gi * V;
  uint8_t* p = reinterpret_cast<uint8_t*>(base) + e0;
  if (e0 + V <= n) {
    if constexpr (V == 8) {
      uint2 w;
      w.x = (uint32_t)q[0] | ((uint32_t)q[1] << 8) | ((uint32_t)q[2] << 16) | ((uint32_t)q[3] << 24);
      w.y = (uint32_t)q[4] | ((uint32_t)q[5] << 8) | ((uint32_t)q[6] << 16) | ((uint32_t)q[7] << 24);
      UBX_VECTOR_STORE(p, 8, "FP8 vector store");
      *reinterpret_cast<uint2*>(p) = w;
    } else {
      UBX_VECTOR_STORE(p, 4, "FP8 vector store");
      *reinterpret_cast<uint32_t*>(p) =
          (uint32_t)q[0] | ((uint32_t)q[1] << 8) | ((uint32_t)q[2] << 16) | ((uint32_t)q[3] << 24);
    }
    return;
  }
  for (int j = 0; j < V && e0 + j < n; ++j) p[j] = q[j];
}

}  // namespace ubx
