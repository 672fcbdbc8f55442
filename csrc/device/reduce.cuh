// Warp and block reductions in fp32, deterministic.
//
// Determinism: the warp step is an xor butterfly. At each step lane i computes v_i + v_(i^m) and
// lane i^m computes v_(i^m) + v_i, which are the same float (addition is commutative), so every lane
// ends with bitwise the same value, and the tree shape depends only on the warp width. The block
// step has every thread add the per-warp partials in warp order 0..W-1. The result therefore
// depends only on the inputs and blockDim.x, which every rank launches identically: every rank, and
// every thread of a block, gets identical bits.
//
// Contract: blockDim.x is a multiple of 32 and at most 1024; every thread of the block calls the
// block functions (uniform control flow: they contain __syncthreads). `scratch` is a __shared__
// float array of at least UBX_RED_SCRATCH floats, owned by the caller; it may be reused right after
// the call returns (the trailing __syncthreads makes that safe).
#pragma once

#include "platform.cuh"

#define UBX_RED_SCRATCH 64

namespace ubx {

struct SumOp {
  UBX_DEV float operator()(float a, float b) const { return a + b; }
};
// The larger of a and b, or NaN when either is NaN, as torch's amax and clamp do (fmaxf drops a NaN):
// a row holding a NaN must give a NaN scale_inv on every path, the torch fallback included.
UBX_DEV float nan_max(float a, float b) { return a != a ? a : (b != b ? b : fmaxf(a, b)); }

struct MaxOp {
  UBX_DEV float operator()(float a, float b) const { return nan_max(a, b); }
};

template <class Op>
UBX_DEV float warp_reduce(float v, Op op) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, m));
  return v;
}
UBX_DEV float warp_sum(float v) { return warp_reduce(v, SumOp{}); }
UBX_DEV float warp_max(float v) { return warp_reduce(v, MaxOp{}); }

// Reduction over the block; every thread gets the result.
template <class Op>
UBX_DEV float block_reduce(float v, float* scratch, Op op) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_reduce(v, op);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float s = scratch[0];
  for (int w = 1; w < nwarps; ++w) s = op(s, scratch[w]);
  __syncthreads();  // scratch is free again
  return s;
}
UBX_DEV float block_sum(float v, float* scratch) { return block_reduce(v, scratch, SumOp{}); }
UBX_DEV float block_max(float v, float* scratch) { return block_reduce(v, scratch, MaxOp{}); }

// Two independent sums in one pass (one pair of barriers instead of two).
UBX_DEV void block_sum2(float& a, float& b, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  a = warp_sum(a);
  b = warp_sum(b);
  if (lane == 0) {
    scratch[warp] = a;
    scratch[32 + warp] = b;
  }
  __syncthreads();
  float sa = scratch[0], sb = scratch[32];
  for (int w = 1; w < nwarps; ++w) {
    sa += scratch[w];
    sb += scratch[32 + w];
  }
  __syncthreads();
  a = sa;
  b = sb;
}

}  // namespace ubx
