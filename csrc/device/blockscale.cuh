// Block-scaled quantisation for the GEMMs that follow a norm on Blackwell-class GPUs (issue 28): NVFP4
// (e2m1 data, an e4m3 scale per 16 elements, optional fp32 global scale), MXFP8 (e4m3 data, an e8m0
// scale per 32) and per-token-group FP8 (e4m3 data, an fp32 scale per 128). Each is bitwise the
// reference users already trust (docs/QUANTIZE.md): torchao 0.18's nvfp4_quantize and
// to_mx(..., RCEIL), and ubnext's own per-token FP8 rule for the groups of 128.
//
// The pieces work on ONE quantisation block of y values held in registers, spread over L adjacent
// lanes of a warp, V values per lane (V = DType<T>::kElems, one 16-byte vector; L = block / V, a power
// of two from 2 to 32 since every block holds at least 16 elements and V is 4 or 8). Lane l of a group
// holds elements [l*V, l*V + V) of its block. That is the layout of the kernels' row loops, where lane
// t of a warp holds vector t of a row (norm.cuh's vector i belongs to thread i % blockDim), so the
// fused path calls them on a row's normed y exactly as the standalone kernel (csrc/kernels/blockscale.cu)
// calls them on x:
//   amax  = lanes_max(vec_amax(y), L)                      (every lane of the warp calls: a shuffle)
//   scale = nvfp4_scale(amax, gs) / mxfp8_scale(amax) / group_scale(amax, ue8m0)
//   codes = nvfp4_codes(y, scale) / mxfp8_codes(y, scale) / quantize_fp8(y, scale) (norm.cuh)
//   the group's first lane (lane % L == 0) stores the scale at scale_index(row, block, ...).
// quantize_block_vals does all of it for one vector; the standalone kernel and norm.cuh's row output
// (the fused form: one kernel, the row's y quantised where it is computed) both call it.
// The arithmetic is the references' own, operation by operation, in fp32 with true divisions and no
// add after a multiply (nothing to contract into an FMA), so nvcc and the emulator's g++ agree.
#pragma once

#include "platform.cuh"
#include "desc.cuh"
#include "vec.cuh"
#include "reduce.cuh"

// The formats are kernel flags (desc.cuh UBNEXT_F_BLOCK_*): the standalone kernels' names say the format
// and read only SWIZZLED / UE8M0; the fused kernels read the format field too.
#define UBX_FP8_E4M3_MAX 448.0f
#define UBX_FP8_SCALE_TINY 1e-12f
#define UBX_NVFP4_BLOCK 16
#define UBX_MXFP8_BLOCK 32
#define UBX_GROUP_BLOCK 128
#define UBX_E2M1_MAX 6.0f
#define UBX_E4M3_SCALE_FLOOR 0.015625f  // 2^-6, e4m3's smallest normal: torchao's E4M3_EPS
// What torchao writes for every value of a NaN block (its bit-level e2m1 conversion of the NaN its
// CPU arithmetic produces); e2m1 has no NaN. Written as a constant so that no NaN payload, which
// differs between GPU and CPU arithmetic, can reach the bits.
#define UBX_E2M1_NAN_CODE 0x4u
#define UBX_E4M3_NAN_CODE 0x7Fu
#define UBX_E8M0_NAN 0xFFu
#define UBX_E8M0_INF 0xFEu

namespace ubx {

// ---------------------------------------------------------------- e4m3 with one scale (norm.cuh's FP8 forms)
// q_j = e4m3(y_j / div), saturating to +-448. True division, as in the torch reference `y / scale_inv`.
template <int V>
UBX_DEV void quantize_fp8(const float (&y)[V], float div, uint8_t (&q)[V]) {
#pragma unroll
  for (int j = 0; j < V; ++j) q[j] = static_cast<uint8_t>(__nv_cvt_float_to_fp8(y[j] / div, __NV_SATFINITE, __NV_E4M3));
}

UBX_DEV float per_token_scale_inv(float amax) { return nan_max(amax / UBX_FP8_E4M3_MAX, UBX_FP8_SCALE_TINY); }

// ---------------------------------------------------------------- the block's amax
template <int V>
UBX_DEV float vec_amax(const float (&y)[V]) {
  float a = 0.f;
#pragma unroll
  for (int j = 0; j < V; ++j) a = nan_max(a, fabsf(y[j]));
  return a;
}

// The max over aligned runs of `lanes` lanes (a power of two <= 32), every lane of a run getting it.
// Every lane of the warp must call it (uniform control flow): lanes without a block pass 0.
UBX_DEV float lanes_max(float v, int lanes) {
  for (int m = lanes >> 1; m > 0; m >>= 1) v = nan_max(v, __shfl_xor_sync(0xffffffffu, v, m));
  return v;
}

// ---------------------------------------------------------------- NVFP4
struct Nvfp4Scale {
  uint8_t code;  // the e4m3 block scale that is stored
  float mul;     // what the data is multiplied by before the e2m1 conversion
  bool nan;      // a NaN block: every value is UBX_E2M1_NAN_CODE
};

UBX_DEV float e4m3_decode_normal(uint32_t code) {  // codes 0x08..0x7E (the scale's clamp keeps it there)
  return u32_as_f32((((code >> 3) & 0xFu) + 120u) << 23 | (code & 7u) << 20);
}

// torchao nvfp4_quantize: s = amax / 6; single level: code = e4m3(clamp(s, 2^-6, 448)), mul = 1 / s8;
// two levels (gs = the per-tensor scale): code = e4m3(clamp(s / gs, 2^-6, 448)), mul = (1 / gs) / s8,
// s8 the code's value. A NaN s stays NaN through torch.clamp (code 0x7F).
UBX_DEV Nvfp4Scale nvfp4_scale(float amax, const float* global_scale) {
  float s = amax / UBX_E2M1_MAX;
  if (global_scale != nullptr) s = s / global_scale[0];
  Nvfp4Scale r;
  r.nan = s != s;
  if (r.nan) {
    r.code = UBX_E4M3_NAN_CODE;
    r.mul = 0.f;
    return r;
  }
  s = fminf(fmaxf(s, UBX_E4M3_SCALE_FLOOR), UBX_FP8_E4M3_MAX);
  r.code = static_cast<uint8_t>(__nv_cvt_float_to_fp8(s, __NV_SATFINITE, __NV_E4M3));
  const float s8 = e4m3_decode_normal(r.code);
  r.mul = global_scale != nullptr ? (1.0f / global_scale[0]) / s8 : 1.0f / s8;
  return r;
}

// fp32 -> e2m1 as torchao's _f32_to_floatx_unpacked does it, bit for bit: round to nearest even,
// saturate to 6, keep the sign (of -0 too). v is never NaN here (a NaN block never calls it).
UBX_DEV uint32_t e2m1_code(float v) {
  const uint32_t bits = f32_as_u32(v);
  const uint32_t sign = (bits >> 28) & 0x8u;
  const uint32_t abits = bits & 0x7FFFFFFFu;
  const float a = u32_as_f32(abits);
  uint32_t code;
  if (a >= UBX_E2M1_MAX) {
    code = 7u;
  } else if (a < 1.0f) {
    // subnormal range: adding 2^22 rounds a to a multiple of 0.5 (2^22's ulp), nearest even
    code = f32_as_u32(a + 4194304.0f) - (149u << 23);
  } else {
    const uint32_t odd = (abits >> 22) & 1u;
    code = (abits - (126u << 23) + ((1u << 21) - 1u) + odd) >> 22;
  }
  return sign | (code & 0x7u);
}

// V values -> V/2 bytes, the even element in the low nibble (torchao's pack_uint4).
template <int V>
UBX_DEV void nvfp4_codes(const float (&y)[V], const Nvfp4Scale& s, uint8_t (&packed)[V / 2]) {
#pragma unroll
  for (int j = 0; j < V; j += 2) {
    uint32_t lo = UBX_E2M1_NAN_CODE, hi = UBX_E2M1_NAN_CODE;
    if (!s.nan) {
      lo = e2m1_code(y[j] * s.mul);
      hi = e2m1_code(y[j + 1] * s.mul);
    }
#if !defined(UBNEXT_BREAK_NVFP4_NIBBLE_ORDER)
    packed[j / 2] = static_cast<uint8_t>(lo | (hi << 4));
#else  // TEST ONLY: the odd element in the low nibble
    packed[j / 2] = static_cast<uint8_t>(hi | (lo << 4));
#endif
  }
}

// ---------------------------------------------------------------- MXFP8 (RCEIL)
// The e8m0 exponent of d = amax / 448 rounded up to a power of two, exactly as cvt.rp.satfinite.ue8m0
// does it: 2^(code - 127) is the smallest power of two >= d, codes 0 (2^-127, also for d = 0) to 254.
// NaN -> 0xFF, inf -> 0xFE (torchao's rule and the instruction's).
UBX_DEV uint32_t ue8m0_ceil(float d) {
  const uint32_t bits = f32_as_u32(d) & 0x7FFFFFFFu;
  const uint32_t e = bits >> 23, m = bits & 0x7FFFFFu;
  if (e == 0xFFu) return m != 0 ? UBX_E8M0_NAN : UBX_E8M0_INF;
  if (e == 0) return m > 0x400000u ? 1u : 0u;  // below 2^-126: 2^-126 only above 2^-127
  const uint32_t code = e + (m != 0 ? 1u : 0u);
  return code > 254u ? 254u : code;
}

struct Mxfp8Scale {
  uint8_t code;  // the e8m0 byte that is stored
  float mul;     // torchao's rcp: 2^(127 - code); 1 for code 0; 2^-127 for an inf block
  bool nan;      // a NaN block: every value is UBX_E4M3_NAN_CODE
};

UBX_DEV Mxfp8Scale mxfp8_scale(float amax) {
  Mxfp8Scale r;
  const uint32_t code = ue8m0_ceil(amax / UBX_FP8_E4M3_MAX);
  r.code = static_cast<uint8_t>(code);
  r.nan = code == UBX_E8M0_NAN;
  r.mul = code == UBX_E8M0_INF ? u32_as_f32(0x00400000u)        // 2^-127
          : code == 0          ? 1.0f
          : r.nan              ? 0.f
                               : u32_as_f32((254u - code) << 23);  // 2^(127 - code), a normal float
  return r;
}

// q = e4m3(clamp(y * mul, +-448)); the satfinite conversion is that clamp.
template <int V>
UBX_DEV void mxfp8_codes(const float (&y)[V], const Mxfp8Scale& s, uint8_t (&q)[V]) {
#pragma unroll
  for (int j = 0; j < V; ++j)
    q[j] = s.nan ? static_cast<uint8_t>(UBX_E4M3_NAN_CODE)
                 : static_cast<uint8_t>(__nv_cvt_float_to_fp8(y[j] * s.mul, __NV_SATFINITE, __NV_E4M3));
}

// ---------------------------------------------------------------- per-token-group FP8
// The per-token FP8 rule (norm.cuh per_token_scale_inv: max(amax / 448, 1e-12)) over a group; with
// ue8m0, rounded up to a power of two, exactly. A NaN group's scale is the canonical NaN 0x7FFFFFFF
// (a NaN's payload would otherwise be the input's on one platform and the GPU's on another). The data:
// norm.cuh's quantize_fp8 (any NaN -> 0x7F, the conversion's canonical NaN).
UBX_DEV float group_scale(float amax, bool ue8m0) {
  const float s = per_token_scale_inv(amax);
  if (s != s) return u32_as_f32(0x7FFFFFFFu);
  if (!ue8m0) return s;
  const uint32_t bits = f32_as_u32(s);  // positive and normal (>= 1e-12)
  return (bits & 0x7FFFFFu) ? u32_as_f32(((bits >> 23) + 1u) << 23) : s;
}

// ---------------------------------------------------------------- where a block's scale goes
// Row-major [M, ncols] (ncols = K / block), or torchao's to_blocked layout: 128x4 tiles of the
// [round_up(M, 128), round_up(ncols, 4)] matrix in row-major tile order, each tile stored as 32 rows
// of 16 bytes where row r holds the tile's rows r, r + 32, r + 64, r + 96 (4 bytes each). Tiles that
// stick out past M or ncols are zero-filled (swizzled_scale_count counts them).
UBX_DEV int64_t scale_index(int64_t row, int64_t col, int64_t ncols, bool swizzled) {
  if (!swizzled) return row * ncols + col;
  const int64_t tile = (row >> 7) * ((ncols + 3) >> 2) + (col >> 2);
#if !defined(UBNEXT_BREAK_SWIZZLE)
  return tile * 512 + (row & 31) * 16 + ((row >> 5) & 3) * 4 + (col & 3);
#else  // TEST ONLY: the tile's rows in plain order
  return tile * 512 + (row & 127) * 4 + (col & 3);
#endif
}

// ---------------------------------------------------------------- one vector's share of its block
enum class BlockFormat { kNvfp4, kMxfp8, kGroup128 };

template <BlockFormat F>
struct FormatTraits;
template <>
struct FormatTraits<BlockFormat::kNvfp4> {
  static constexpr int kBlock = UBX_NVFP4_BLOCK;
};
template <>
struct FormatTraits<BlockFormat::kMxfp8> {
  static constexpr int kBlock = UBX_MXFP8_BLOCK;
};
template <>
struct FormatTraits<BlockFormat::kGroup128> {
  static constexpr int kBlock = UBX_GROUP_BLOCK;
};

UBX_DEV int block_of(int flags) {
  const int f = flags & UBNEXT_F_BLOCK_FMT_MASK;
  return f == UBNEXT_F_BLOCK_NVFP4 ? UBX_NVFP4_BLOCK : f == UBNEXT_F_BLOCK_MXFP8 ? UBX_MXFP8_BLOCK : UBX_GROUP_BLOCK;
}

template <int V>
UBX_DEV void store_e2m1(void* out, int64_t gi, const uint8_t (&p)[V / 2]) {
  uint8_t* at = reinterpret_cast<uint8_t*>(out) + gi * (V / 2);
  if constexpr (V == 8) {
    UBX_VECTOR_STORE(at, 4, "NVFP4 vector store");
    *reinterpret_cast<uint32_t*>(at) =
        (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
  } else {
    UBX_VECTOR_STORE(at, 2, "NVFP4 vector store");
    *reinterpret_cast<uint16_t*>(at) = static_cast<uint16_t>(p[0] | (p[1] << 8));
  }
}

// Vector gi (V values y of T's vector, elements [gi*V, gi*V + V) of rows of `hidden`): the block's amax over
// its lanes, the scale, the codes into `out` (q) and the scale into `scales` by the block's first lane.
// Every lane of the warp calls it (lanes_max is a shuffle); `live` false: a lane without a vector, which
// passes 0 and stores nothing. Lanes l..l+L-1 (l % L == 0) must hold one block's vectors in order, which
// holds when lane t holds vector w0 + t of a row (or of the tensor) with w0 a multiple of 32.
// gs: NVFP4's global scale (null: the single-level form).
template <typename T, BlockFormat F>
UBX_DEV void quantize_block_vals(const float (&y)[DType<T>::kElems], bool live, int64_t gi, void* out, void* scales,
                                 const float* gs, int hidden, int flags) {
  constexpr int V = DType<T>::kElems;
  constexpr int B = FormatTraits<F>::kBlock;
  constexpr int L = B / V;  // lanes per block
  const float amax = lanes_max(live ? vec_amax<V>(y) : 0.f, L);
  if (!live) return;
  const int64_t e0 = gi * V, row = e0 / hidden, col = (e0 - row * hidden) / B, ncols = hidden / B;
  const bool first = (threadIdx.x % L) == 0;
  const int64_t at = scale_index(row, col, ncols, (flags & UBNEXT_F_BLOCK_SWIZZLED) != 0);
  if constexpr (F == BlockFormat::kNvfp4) {
    const Nvfp4Scale s = nvfp4_scale(amax, gs);
    uint8_t p[V / 2];
    nvfp4_codes<V>(y, s, p);
    store_e2m1<V>(out, gi, p);
    if (first) reinterpret_cast<uint8_t*>(scales)[at] = s.code;
  } else if constexpr (F == BlockFormat::kMxfp8) {
    const Mxfp8Scale s = mxfp8_scale(amax);
    uint8_t q[V];
    mxfp8_codes<V>(y, s, q);
    store_fp8<V>(out, gi, e0 + V, q);
    if (first) reinterpret_cast<uint8_t*>(scales)[at] = s.code;
  } else {
    const float s = group_scale(amax, (flags & UBNEXT_F_BLOCK_UE8M0) != 0);
    uint8_t q[V];
    quantize_fp8<V>(y, s, q);
    store_fp8<V>(out, gi, e0 + V, q);
    if (first) reinterpret_cast<float*>(scales)[at] = s;
  }
}

// The same, with the format from the flags' format field (the fused kernels: one kernel for every format).
template <typename T>
UBX_DEV void quantize_block_vals_of(const float (&y)[DType<T>::kElems], bool live, int64_t gi, void* out, void* scales,
                                    const float* gs, int hidden, int flags) {
  switch (flags & UBNEXT_F_BLOCK_FMT_MASK) {
    case UBNEXT_F_BLOCK_NVFP4:
      quantize_block_vals<T, BlockFormat::kNvfp4>(y, live, gi, out, scales, gs, hidden, flags);
      break;
    case UBNEXT_F_BLOCK_MXFP8:
      quantize_block_vals<T, BlockFormat::kMxfp8>(y, live, gi, out, scales, gs, hidden, flags);
      break;
    default: quantize_block_vals<T, BlockFormat::kGroup128>(y, live, gi, out, scales, gs, hidden, flags); break;
  }
}

UBX_DEV int64_t swizzled_scale_count(int64_t rows, int64_t ncols) {
  return ((rows + 127) >> 7) * 128 * (((ncols + 3) >> 2) * 4);
}

// The zeros of the swizzled layout's padding (the rows past `rows`, the columns past `ncols` of the
// real rows), entries first, first + step, ...: a caller spreads them over its threads once per call.
UBX_DEV void zero_swizzle_padding(uint8_t* scales, int64_t rows, int64_t ncols, int64_t first, int64_t step) {
  const int64_t pcols = ((ncols + 3) >> 2) * 4;
  const int64_t tail_rows = (((rows + 127) >> 7) * 128 - rows) * pcols, tail_cols = rows * (pcols - ncols);
  for (int64_t k = first; k < tail_rows + tail_cols; k += step) {
    const int64_t row = k < tail_rows ? rows + k / pcols : (k - tail_rows) / (pcols - ncols);
    const int64_t col = k < tail_rows ? k % pcols : ncols + (k - tail_rows) % (pcols - ncols);
    scales[scale_index(row, col, ncols, true)] = 0;
  }
}

// The swizzled padding of a call with a block-scaled output in the flags' format field (a fused kernel),
// zeroed once over the grid. fp8_group128's fp32 scales are never swizzled.
UBX_DEV void zero_block_padding_of(int flags, void* scales, int64_t rows, int hidden) {
  const int f = flags & UBNEXT_F_BLOCK_FMT_MASK;
  if (f == 0 || f == UBNEXT_F_BLOCK_GROUP128 || !(flags & UBNEXT_F_BLOCK_SWIZZLED) || scales == nullptr) return;
  zero_swizzle_padding(reinterpret_cast<uint8_t*>(scales), rows, hidden / block_of(flags), global_tid(),
                       global_threads());
}

}  // namespace ubx
