// Residual add + RMSNorm row math and FP8 (e4m3) quantisation, shared by the Lamport and NVLS
// kernels. One block handles one token row at a time (norm_row); the caller supplies where the
// reduced values come from (Src) and where the results go (Sink), so every algorithm reuses the
// same arithmetic and therefore produces the same bits for the same reduced row.
//
// Semantics for one row (T = the kernel dtype, all arithmetic in fp32, "T(x)" = round to nearest
// even into T):
//   s_j  = reduced sum (fp32, from Src)
//   r_j  = T(s_j + residual_j)          fused with residual   -> stored to residual_out (if given)
//        = T(s_j)                       fused without residual, or FP8 without FUSED_NORM
//   rms  = 1 / sqrt(ssq / hidden + eps)  ssq: the sum of the ROUNDED r_j^2 in fp32, in the order row_ssq
//                                       fixes (below) from the row length alone; sqrt and / correctly
//                                       rounded, so that the emulator and a GPU agree (rsqrtf is an
//                                       approximation on the GPU)
//   y_j  = T((r_j * rms) * w_j)        fused
//        = r_j                          FP8 without FUSED_NORM (plain allreduce, quantised)
//   out:  y in T                        no FP8 flag
//         q_j = e4m3_satfinite(y_j / scale[0]);  scale_inv[0] := scale[0]     FP8_STATIC
//         a = max_j |y_j|; scale_inv[row] = max(a / 448, 1e-12); q_j = e4m3_satfinite(y_j / scale_inv[row])
//                                       FP8_PER_TOKEN (wins over FP8_STATIC if both are set)
//         q, scales of y in a block-scaled format (NVFP4, MXFP8, fp8_group128): blockscale.cuh's
//                                       quantize_block_vals, the standalone quantizer's own code on the
//                                       same rounded y       BLOCK_FMT field (wins over both FP8 flags)
// y is rounded to T before quantising (for fp32 that is a no-op), so the per-token amax is taken from
// exactly the values that are quantised, and a torch reference "rmsnorm in T, then quantise" matches.
// tiny = 1e-12 (not FLT_MIN): an all-zero row gets scale_inv = 1e-12 and q = 0; avoiding FLT_MIN keeps
// y / scale_inv out of the denormal range, where FTZ settings would make GPU and emulator differ.
// Saturation: __NV_SATFINITE clamps to +-448, never NaN for finite or infinite input (NaN stays NaN).
//
// Contract: hidden % DType<T>::kElems == 0 (whole 16-byte vectors per row; the host checks), so every
// vector of a row is whole. Vector gi of the flattened tensor covers elements [gi*V, gi*V + V).
// blockDim.x divides UBX_SSQ_SUPER_VECS (a power of two, 32..1024; see norm_row's thread mapping).
//
// The order of the sum of squares (issue 26: one arithmetic on every path; fixed by the row length alone,
// never by the block size, the grid or how many CTAs share a row, so that the emulator's 64-thread blocks,
// a GPU's 256 and the row split of lamport.cu give the same bits). With v the row's vectors:
//   q_i  = r_i0^2 + r_i1^2 + ... + r_i(V-1)^2, left to right; each square is __fmul_rn, which no compiler
//          contracts into an FMA with the add (nvcc would fuse a plain x * x + q; g++ would not)
//   G_g  = the xor butterfly of reduce.cuh's warp_sum over q_(32g + l), l = 0..31 (q = 0 past the row):
//          one group of 32 vectors
//   S_s  = the same butterfly over G_(32s + l) (G = 0 past the row): one superblock of 1024 vectors
//   ssq  = S_0 + S_1 + ..., left to right.
// Adding +0 is exact and no partial is -0 (squares are >= +0), so the padding changes no bits.
// ubnext/_checks.py (reference_add_rmsnorm) computes the same order in torch for the paths without a
// kernel. UBNEXT_BREAK_SSQ_BLOCK_ORDER (test-only) sums in the old, block-size-dependent order instead.
#pragma once

#include "platform.cuh"
#include "desc.cuh"
#include "vec.cuh"
#include "reduce.cuh"
#include "ptx.cuh"
#include "barrier.cuh"
#include "blockscale.cuh"
#include "stamps.cuh"

// Per-block row cache (dtype bits of r, then of y) in shared memory: 2048 x 16 B = 32 KB, i.e. rows up
// to hidden 16384 (bf16/fp16) or 8192 (fp32). Longer rows recompute instead (see norm_row).
#define UBX_ROW_CACHE_VECS 2048
#define UBX_SSQ_GROUP_VECS 32    /* vectors of one butterfly G_g */
#define UBX_SSQ_SUPER_VECS 1024  /* vectors of one superblock S_s: 32 groups */

namespace ubx {

enum { kOutDtype = 0, kOutFp8Static = 1, kOutFp8Token = 2, kOutBlock = 3 };

UBX_DEV bool uses_rows(int flags) {
  return (flags & (UBNEXT_F_FUSED_NORM | UBNEXT_F_FP8_STATIC | UBNEXT_F_FP8_PER_TOKEN | UBNEXT_F_BLOCK_FMT_MASK)) != 0;
}
// Host contract of row mode (the host checks before launching): whole vectors per row, whole rows. All
// ranks see the same arguments, so a kernel that returns when this fails leaves every rank untouched.
template <typename T>
UBX_DEV bool row_shape_ok(int n, int hidden, int flags) {
  return !uses_rows(flags) ||
         (hidden > 0 && hidden % DType<T>::kElems == 0 && n % hidden == 0 && UBX_SSQ_SUPER_VECS % blockDim.x == 0 &&
          blockDim.x % 32 == 0 && (!(flags & UBNEXT_F_BLOCK_FMT_MASK) || hidden % block_of(flags) == 0));
}
UBX_DEV int out_mode(int flags) {
  return (flags & UBNEXT_F_BLOCK_FMT_MASK)  ? kOutBlock
         : (flags & UBNEXT_F_FP8_PER_TOKEN) ? kOutFp8Token
         : (flags & UBNEXT_F_FP8_STATIC)    ? kOutFp8Static
                                            : kOutDtype;
}

struct RowParams {
  const void* residual;  // T[n] or null (used only with FUSED_NORM)
  const void* weight;    // T[hidden] (FUSED_NORM only)
  const float* scale;    // static FP8 dequant scale (FP8_STATIC), NVFP4's global scale or null (block formats)
  int hidden;
  float eps;
  int flags;
};

// Where results go. GlobalSink writes plain global memory (Lamport, NVLS one-shot). An algorithm that
// must broadcast its results (NVLS two-shot: multimem.st) supplies its own type with the same members.
template <typename T>
struct GlobalSink {
  void* residual_out;  // T[n] or null; may alias the residual input (each element is read before written,
                       // by the same thread)
  void* out;           // T[n], or n e4m3 bytes, or n / 2 e2m1 bytes (NVFP4)
  float* scale_inv;    // per-token: float[n / hidden]; block formats: the block scales (bytes, or fp32)
  int64_t n;

  UBX_DEV bool has_res() const { return residual_out != nullptr; }
  UBX_DEV void store_res(int64_t gi, const uint4& v) const { store_vec<T>(residual_out, gi, n, v); }
  // Reload what store_res wrote (same thread, so program order makes it visible). false: not kept.
  UBX_DEV bool reload_res(int64_t gi, uint4& v) const {
    if (residual_out == nullptr) return false;
    v = load_vec<T>(residual_out, gi, n);
    return true;
  }
  UBX_DEV void store_out(int64_t gi, const uint4& v) const { store_vec<T>(out, gi, n, v); }
  UBX_DEV void store_out_fp8(int64_t gi, const uint8_t (&q)[DType<T>::kElems]) const {
    store_fp8<DType<T>::kElems>(out, gi, n, q);
  }
  UBX_DEV void store_scale_inv(int64_t row, float s) const { scale_inv[row] = s; }
  // Block formats: vector gi's share of its block (all lanes of the warp call it; blockscale.cuh).
  UBX_DEV void store_out_blocks(int64_t gi, bool live, const float (&y)[DType<T>::kElems], const RowParams& p) const {
    quantize_block_vals_of<T>(y, live, gi, out, scale_inv, p.scale, p.hidden, p.flags);
  }
};

// What a row kernel writes once per call before its rows, over the whole grid: a static FP8 output's
// scale_inv (the dequant scale itself), a swizzled block-scale layout's padding zeros.
UBX_DEV void row_outputs_begin(int flags, const float* scale, float* scale_inv, int64_t nrows, int hidden) {
  if ((flags & UBNEXT_F_FP8_STATIC) && !(flags & (UBNEXT_F_FP8_PER_TOKEN | UBNEXT_F_BLOCK_FMT_MASK)) &&
      blockIdx.x == 0 && threadIdx.x == 0 && scale_inv != nullptr)
    scale_inv[0] = scale[0];
  zero_block_padding_of(flags, scale_inv, nrows, hidden);
}

// Stores the normed vector i of a row: y (floats, rounded to T) and yp (packed), in the output form of
// `mode` other than per-token FP8 (norm_row's pass 3). Every lane of the warp calls it, `live` false for a
// lane without a vector: the block formats' amax is a shuffle over lanes.
template <typename T, class Sink>
UBX_DEV void store_row_out(int mode, const RowParams& p, const Sink& sink, int64_t gi, bool live, const uint4& yp,
                           const float (&y)[DType<T>::kElems], float sdiv) {
  constexpr int V = DType<T>::kElems;
  if (mode == kOutBlock) {
    sink.store_out_blocks(gi, live, y, p);
  } else if (!live) {
    return;
  } else if (mode == kOutDtype) {
    sink.store_out(gi, yp);
  } else {
    uint8_t q[V];
    quantize_fp8<V>(y, sdiv, q);
    sink.store_out_fp8(gi, q);
  }
}

// ---------------------------------------------------------------- per-vector pieces
// x := T(x + residual) (or T(x) without residual), returned packed; x holds the rounded floats.
// res: the residual's vector (ignored without has_res).
template <typename T>
UBX_DEV uint4 add_round(float (&x)[DType<T>::kElems], bool has_res, const uint4& res) {
  constexpr int V = DType<T>::kElems;
  if (has_res) {
    float rv[V];
    unpack<T>(res, rv);
#pragma unroll
    for (int j = 0; j < V; ++j) x[j] += rv[j];
  }
  const uint4 r = pack<T>(x);
  unpack<T>(r, x);
  return r;
}
template <typename T>
UBX_DEV uint4 residual_round(float (&x)[DType<T>::kElems], const void* residual, int64_t gi) {
  return add_round<T>(x, residual != nullptr, residual != nullptr ? load_whole_vec(residual, gi) : uint4{});
}

// y := T((r * rms) * w), returned packed; y holds the rounded floats. Two multiplies and no add, so no
// FMA contraction can change the bits between compilers.
template <typename T>
UBX_DEV uint4 norm_vec_w(const uint4& r, float rms, bool has_weight, const uint4& wv, float (&y)[DType<T>::kElems]) {
  constexpr int V = DType<T>::kElems;
  unpack<T>(r, y);
  if (has_weight) {
    float w[V];
    unpack<T>(wv, w);
#pragma unroll
    for (int j = 0; j < V; ++j) y[j] = (y[j] * rms) * w[j];
  }
  const uint4 p = pack<T>(y);
  unpack<T>(p, y);
  return p;
}
template <typename T>
UBX_DEV uint4 norm_vec(const uint4& r, float rms, const void* weight, int iw, float (&y)[DType<T>::kElems]) {
  return norm_vec_w<T>(r, rms, weight != nullptr, weight != nullptr ? load_whole_vec(weight, iw) : uint4{}, y);
}

// ---------------------------------------------------------------- the sum of squares (order: above)
// q_i of one vector of rounded r.
template <typename T>
UBX_DEV float vec_ssq(const float (&x)[DType<T>::kElems]) {
  float q = __fmul_rn(x[0], x[0]);
#pragma unroll
  for (int j = 1; j < DType<T>::kElems; ++j) q += __fmul_rn(x[j], x[j]);
  return q;
}

// ssq of a row from its ng group partials, load(g) = G_g: every lane of every calling warp gets the same
// bits. Whole warps call it (warp_sum).
template <class Load>
UBX_DEV float fold_groups(int64_t ng, Load& load) {
  const int lane = threadIdx.x & 31;
  float ssq = 0.f;
  for (int64_t g0 = 0; g0 < ng; g0 += UBX_SSQ_GROUP_VECS) {
    const float s = warp_sum(g0 + lane < ng ? load(g0 + lane) : 0.f);
    ssq = g0 == 0 ? s : ssq + s;
  }
  return ssq;
}

UBX_DEV float rms_of(float ssq, int hidden, float eps) { return 1.0f / sqrtf(ssq / static_cast<float>(hidden) + eps); }

// ---------------------------------------------------------------- one row, one block
// Src: `bool operator()(int64_t gi, float (&s)[V])` gives the reduced fp32 sums of global vector gi,
// zero-filled and false when it gave up (timeout, already reported). It may be called again for the
// same gi (rows longer than the cache) and must then return the same bits.
// Collective over the block (uniform control flow). Returns false, in every thread, when any thread's
// Src failed; the caller then stops (the row's outputs are not written).
// `cache`: __shared__ uint4[cache_vecs]; `scratch`: __shared__ float[UBX_RED_SCRATCH].
// Thread mapping: vector i of the row belongs to thread i % blockDim.x in both passes (slices.cuh and
// lamport.cu rely on it). Pass 1 walks a superblock at a time, warp w taking its groups w, w + nwarps, ...:
// vector s*1024 + 32g + lane then lands on thread 32 (g % nwarps) + lane, which is i % blockDim.x because
// blockDim.x divides 1024.
template <typename T, class Src, class Sink>
UBX_DEV bool norm_row(const RowParams& p, int64_t row, Src& src, const Sink& sink, uint4* cache, int cache_vecs,
                      float* scratch) {
  constexpr int V = DType<T>::kElems;
  const bool fused = (p.flags & UBNEXT_F_FUSED_NORM) != 0;
  const int mode = out_mode(p.flags);
  const void* residual = fused ? p.residual : nullptr;
  const void* weight = fused ? p.weight : nullptr;
  const int nv = p.hidden / V;
  const int64_t g0 = row * nv;
  const bool cached = nv <= cache_vecs;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;

  // r of vector i of this row, packed. From the cache, else from residual_out (exact: it holds r),
  // else recomputed from Src (same bits: Src is repeatable and the arithmetic is the same).
  auto r_of = [&](int i) -> uint4 {
    if (cached) return cache[i];
    uint4 r;
    if (fused && sink.reload_res(g0 + i, r)) return r;
    float x[V];
    (void)src(g0 + i, x);
    return residual_round<T>(x, residual, g0 + i);
  };
  // Pass 1 of vector i: reduce, residual add, residual_out; its q_i.
  float fail = 0.f;
  auto first = [&](int i) -> float {
    float x[V];
    if (!src(g0 + i, x)) fail = 1.f;
    const uint4 r = residual_round<T>(x, residual, g0 + i);
    if (cached) cache[i] = r;  // read back only by this same thread: no barrier needed
    if (!fused) return 0.f;
    if (sink.has_res()) sink.store_res(g0 + i, r);
    return vec_ssq<T>(x);
  };

  // Pass 1, and the row's sum of squares in the fixed order: scratch[0..31] holds one superblock's G,
  // scratch[32 + w] warp w's failure count (an abort vote riding along with the sums).
  float ssq = 0.f;
#if !defined(UBNEXT_BREAK_SSQ_BLOCK_ORDER)
  for (int s0 = 0; s0 < nv; s0 += UBX_SSQ_SUPER_VECS) {
    const int ng =
        (nv - s0 < UBX_SSQ_SUPER_VECS ? nv - s0 + UBX_SSQ_GROUP_VECS - 1 : UBX_SSQ_SUPER_VECS) / UBX_SSQ_GROUP_VECS;
    for (int g = warp; g < ng; g += nwarps) {
      const int i = s0 + g * UBX_SSQ_GROUP_VECS + lane;
      const float G = warp_sum(i < nv ? first(i) : 0.f);
      if (lane == 0) scratch[g] = G;
    }
    const float wf = warp_sum(fail);
    if (lane == 0) scratch[32 + warp] = wf;
    __syncthreads();
    const float S = warp_sum(lane < ng ? scratch[lane] : 0.f);
    ssq = s0 == 0 ? S : ssq + S;
    fail = 0.f;
    for (int w = 0; w < nwarps; ++w) fail += scratch[32 + w];
    __syncthreads();  // scratch is free again
  }
#else
  // test-only: each thread sums its own vectors, then the block reduces: the order depends on blockDim.x
  for (int i = threadIdx.x; i < nv; i += blockDim.x) ssq += first(i);
  block_sum2(ssq, fail, scratch);
#endif
  if (fail != 0.f) return false;
  const float rms = fused ? rms_of(ssq, p.hidden, p.eps) : 1.f;

  // Pass 2: normalise; store (dtype, static FP8, block formats) or take the row amax (per-token FP8).
  // Warp-uniform trips (i0: the warp's first vector), since the block formats' amax is a shuffle.
  const float sdiv = (mode == kOutFp8Static) ? p.scale[0] : 1.f;
  float amax = 0.f;
  for (int i0 = threadIdx.x - lane; i0 < nv; i0 += blockDim.x) {
    const int i = i0 + lane;
    const bool live = i < nv;
    float y[V] = {};
    uint4 yp = make_uint4(0u, 0u, 0u, 0u);
    if (live) yp = norm_vec<T>(r_of(i), rms, weight, i, y);
    if (mode != kOutFp8Token) {
      store_row_out<T>(mode, p, sink, g0 + i, live, yp, y, sdiv);
    } else if (live) {
#pragma unroll
      for (int j = 0; j < V; ++j) amax = nan_max(amax, fabsf(y[j]));
      if (cached) cache[i] = yp;  // pass 3 quantises exactly these bits
    }
  }
  if (mode != kOutFp8Token) return true;

  // Pass 3 (per-token FP8): scale_inv of the row, then quantise the same y.
  const float s = per_token_scale_inv(block_max(amax, scratch));
  if (threadIdx.x == 0) sink.store_scale_inv(row, s);
  for (int i = threadIdx.x; i < nv; i += blockDim.x) {
    float y[V];
    if (cached) unpack<T>(cache[i], y);
    else (void)norm_vec<T>(r_of(i), rms, weight, i, y);
    uint8_t q[V];
    quantize_fp8<V>(y, s, q);
    sink.store_out_fp8(g0 + i, q);
  }
  return true;
}

// ---------------------------------------------------------------- one row, several CTAs (the row split)
// At 1..16 tokens one CTA per row leaves most SMs idle and puts a row's polls, its residual and weight
// loads and all its stores on one SM (issue 24 item 2). The host launches the grid nrows * split as clusters
// of `split` CTAs (launch_rules.h row_split, ubnext/comm/_executor.py: at most 8, the portable cluster size),
// so CTA b, of cluster rank b % split, works on part b % split of row b / split: the whole groups
// [part * gpp, (part + 1) * gpp) of the row, gpp = ceil(ng / split), so vector i of the row belongs to thread
// (i - lo) % blockDim.x of that CTA (at 1 x 8192 bf16: 8 CTAs of 128 threads, one vector per thread). Each CTA
// computes the G_g of its groups (the fixed order above: a group never straddles two CTAs) into its own
// shared memory, and every CTA of the row folds all of them in the same order through distributed shared
// memory: each gets the bits one CTA would have computed alone, whatever the split (issue 26).
//
// Exchange (issue 38 item 2; FlashInfer/TRT-LLM's one-shot fused reduces over a cluster too, by loads):
// every CTA PUSHES its G_g and its failure vote into every sibling's s_row (st.shared::cluster, fire and
// forget), then the cluster barrier (arrive.release: the thread's stores, the remote ones included, before
// its arrival; wait.acquire), then every CTA folds the whole row's G_g from its OWN shared memory
// (fold_groups). Pushing, not loading, keeps a sibling round trip off the critical path, and it needs no
// second barrier: once the barrier is passed nobody touches another CTA's shared memory, so a CTA may exit
// whenever it is done (a loading exchange must hold every CTA until its siblings' loads are done). Before
// its first push a CTA must know its siblings have started (a CTA's shared memory exists only then, CUDA
// Programming Guide, distributed shared memory): the kernel opens the exchange at its start
// (row_split_open: every thread arrives, relaxed) and waits for that phase just before pushing, by when
// it has long completed (the data polls came in between).
// No global memory, no atomic, no poll, no timeout: the barrier waits for threads that reach it in bounded
// time (a Src gives up at its own timeout, and a CTA without a part, or whose Src failed, still arrives,
// with its vote), and the cluster's CTAs are co-scheduled by the launch, not assumed co-resident. The
// exchange before clusters (a global counter and partials in the sync region) spun on its siblings, which a
// plain launch never promises to run together (under MPS or a green context with fewer SMs it timed out).
// Deadlock freedom: CTA (row, part) waits only for the CTAs of its cluster, which wait in turn only for
// (a) data the same CTA index of each peer pushes BEFORE it waits for anything (lamport.cu), (b) the
// cluster barrier and (c), in block 0's cluster, thread 0's bounded wait for every block of the grid to
// start (lamport_rotation.cuh lamport_rot_advance_early), which needs nothing of this cluster; no cycle,
// and the cluster runs at once by construction. Across communicators: the grid
// cap's argument (launch_rules.h pair_grid_cap) holds for clusters.
// UBNEXT_BREAK_CLUSTER_SSQ_ORDER (test-only): each CTA sums its own groups first and the cluster then adds
// the CTAs' sums, FlashInfer's order: it depends on the split, so the bits change with the geometry.
//
// When: not for per-token FP8 (its row amax would need a second exchange), only in a cluster launch of
// exactly nrows * split CTAs (without one, every row is one CTA's: norm_row, any grid), and only when a
// part fits the row cache; otherwise split = 1 (spare CTAs of the grid idle).
#define UBX_ROW_SPLIT_MIN_VECS 128 /* host rule: at least 128 vectors (4 groups) per CTA */
#define UBX_ROW_SPLIT_MAX 8        /* host rule: CTAs per row, a portable cluster */
#define UBX_ROW_PART_GROUPS (UBX_ROW_CACHE_VECS / UBX_SSQ_GROUP_VECS)

struct RowPart {
  int64_t row;  // the CTA's row
  int lo, hi;   // its vectors [lo, hi) of the row (empty: no part)
  int ng;       // groups of the row
  int gpp;      // groups per part: G_g lives in cluster rank g / gpp
  int part;     // this CTA's cluster rank: its part of the row, if any
  int nparts;   // CTAs of the row with a part (1: no split)
  bool active;  // this CTA has a part
};

// The split of this launch (uniform over the grid; all ranks agree: same arguments, same launch).
UBX_DEV int row_split_of(int64_t nrows, int nv, int flags) {
  const int split = static_cast<int>(cluster_nctarank());
  if (split < 2 || split > UBX_ROW_SPLIT_MAX || nrows <= 0 || out_mode(flags) == kOutFp8Token ||
      gridDim.x != nrows * split)
    return 1;  // (past UBX_ROW_SPLIT_MAX the pushes would overrun s_row: the host never launches that)
  const int ng = (nv + UBX_SSQ_GROUP_VECS - 1) / UBX_SSQ_GROUP_VECS;
  const int gpp = (ng + split - 1) / split;
  return gpp * UBX_SSQ_GROUP_VECS <= UBX_ROW_CACHE_VECS ? split : 1;
}

UBX_DEV RowPart row_part_of(int64_t nrows, int nv, int split) {
  RowPart rp;
  if (split <= 1 || nv <= 0) {  // no split: norm_row's one block per row
    rp.row = 0;
    rp.lo = rp.hi = rp.ng = rp.gpp = rp.part = 0;
    rp.nparts = 1;
    rp.active = false;
    return rp;
  }
  rp.ng = (nv + UBX_SSQ_GROUP_VECS - 1) / UBX_SSQ_GROUP_VECS;
  rp.gpp = (rp.ng + split - 1) / split;
  rp.nparts = (rp.ng + rp.gpp - 1) / rp.gpp;
  rp.row = blockIdx.x / split;
  rp.part = static_cast<int>(cluster_ctarank());  // == blockIdx.x % split: clusters of consecutive CTAs
  rp.active = rp.row < nrows && rp.part < rp.nparts;
  rp.lo = rp.part * rp.gpp * UBX_SSQ_GROUP_VECS;
  rp.lo = rp.lo < nv ? rp.lo : nv;
  rp.hi = rp.lo + rp.gpp * UBX_SSQ_GROUP_VECS < nv ? rp.lo + rp.gpp * UBX_SSQ_GROUP_VECS : nv;
  return rp;
}

// The residual and weight vectors of this thread's first kPrefetch vectors of its part, loaded before the
// wait for the peers' data so that their latency hides behind it.
template <typename T>
struct RowPrefetch {
  static constexpr int kPrefetch = 2;
  uint4 res[kPrefetch], w[kPrefetch];
  // Element k (< kPrefetch) by selects: a runtime index into the arrays would put them on the stack.
  UBX_DEV uint4 res_at(int k) const { return k == 0 ? res[0] : res[1]; }
  UBX_DEV uint4 w_at(int k) const { return k == 0 ? w[0] : w[1]; }
  UBX_DEV void load(const RowParams& p, const RowPart& rp) {
    const bool fused = (p.flags & UBNEXT_F_FUSED_NORM) != 0;
    const int nv = p.hidden / DType<T>::kElems;
#pragma unroll
    for (int k = 0; k < kPrefetch; ++k) {
      const int i = rp.lo + static_cast<int>(threadIdx.x) + k * static_cast<int>(blockDim.x);
      res[k] = w[k] = make_uint4(0u, 0u, 0u, 0u);
      if (!fused || !rp.active || i >= rp.hi) continue;
      if (p.residual != nullptr) res[k] = load_whole_vec(p.residual, rp.row * nv + i);
      if (p.weight != nullptr) w[k] = load_whole_vec(p.weight, i);
    }
  }
};

// A float into the shared memory of cluster rank `rank` (the same variable as `local`, in that CTA).
UBX_DEV void st_cluster_f32(float* local, uint32_t rank, float v) {
  st_shared_cluster_u32(mapa_shared(local, rank), f32_as_u32(v));
}

// Opens the row split's exchange at kernel start, in every thread of every CTA of the cluster (norm_row_part
// waits for this phase before its first push into a sibling). Collective over the cluster.
UBX_DEV void row_split_open() { cluster_arrive_relaxed(); }

// One CTA's part of a split row: the row math of norm_row (same arithmetic, same bits) with the exchange
// above. Collective over the CLUSTER: every CTA of a split row's cluster calls it, with a part or not; false
// in every thread of the cluster when a Src failed (reported).
template <typename T, class Src, class Sink>
UBX_DEV bool norm_row_part(const RowParams& p, const RowPart& rp, const RowPrefetch<T>& pre, Src& src, const Sink& sink,
                           uint4* cache, float* scratch, const ubnext_comm_desc* d, uint32_t op) {
#if !defined(UBNEXT_STAMPS)
  (void)d;  // d and op: the test-only stamps build's (below)
  (void)op;
#endif
  constexpr int V = DType<T>::kElems;
  constexpr int K = RowPrefetch<T>::kPrefetch;
  static_assert(K == 2, "res_at / w_at select among two");
  // the row's G_g (at g) and the CTAs' failure votes (at kVotes + part), pushed by the CTAs of the row
  constexpr int kVotes = UBX_ROW_SPLIT_MAX * UBX_ROW_PART_GROUPS;
  __shared__ float s_row[kVotes + UBX_ROW_SPLIT_MAX];
  __shared__ float s_mine[UBX_ROW_PART_GROUPS];  // this CTA's G_g, before the push
  const bool fused = (p.flags & UBNEXT_F_FUSED_NORM) != 0;
  const bool has_res = fused && p.residual != nullptr, has_w = fused && p.weight != nullptr;
  const int mode = out_mode(p.flags);
  const int nv = p.hidden / V;
  const int64_t g0 = rp.row * nv;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;

  float fail = 0.f;
  const int ngl = rp.active ? (rp.hi - rp.lo + UBX_SSQ_GROUP_VECS - 1) / UBX_SSQ_GROUP_VECS : 0;
  for (int gl = warp; gl < ngl; gl += nwarps) {
    const int i = rp.lo + gl * UBX_SSQ_GROUP_VECS + lane;  // == rp.lo + threadIdx.x + k * blockDim.x
    const int k = gl / nwarps;
    float q = 0.f;
    if (i < rp.hi) {
      float x[V];
      if (!src(g0 + i, x)) fail = 1.f;
      const uint4 r =
          add_round<T>(x, has_res, k < K ? pre.res_at(k) : (has_res ? load_whole_vec(p.residual, g0 + i) : uint4{}));
      cache[i - rp.lo] = r;
      if (fused) {
        if (sink.has_res()) sink.store_res(g0 + i, r);
        q = vec_ssq<T>(x);
      }
    }
    const float G = warp_sum(q);
    if (lane == 0) s_mine[gl] = G;
  }
  const float wf = warp_sum(fail);
  if (lane == 0) scratch[32 + warp] = wf;
  __syncthreads();  // s_mine and the warps' votes
  cluster_wait_acquire();  // the phase row_split_open arrived at: every sibling has started
  if (rp.active) {  // entry e < ngl: G of local group e; e == ngl: the vote; to every CTA c of the cluster
    const int split = static_cast<int>(cluster_nctarank());
    for (int t = threadIdx.x; t < (ngl + 1) * split; t += blockDim.x) {
      const int e = t / split, c = t % split;
      float v = 0.f;
      if (e < ngl) {
        v = s_mine[e];
      } else {
        for (int w = 0; w < nwarps; ++w) v += scratch[32 + w];
      }
      const int at = e < ngl ? rp.part * rp.gpp + e : kVotes + rp.part;
      st_cluster_f32(&s_row[at], static_cast<uint32_t>(c), v);
    }
  }
  cluster_arrive_release();  // this thread's pushes before its arrival
  cluster_wait_acquire();    // every CTA's pushes are in s_row; nobody touches a sibling's shared memory again
  if (op == UBNEXT_OP_LAMPORT) UBX_STAMP(d, kStampRowExchange);  // test-only build (stamps.cuh)
  fail = 0.f;
  for (int c = 0; c < rp.nparts; ++c) fail += s_row[kVotes + c];
  float ssq = 0.f;
  if (fail == 0.f) {  // cluster-uniform: every CTA read the same votes
#if !defined(UBNEXT_BREAK_CLUSTER_SSQ_ORDER)
    auto load_g = [&](int64_t g) -> float { return s_row[g]; };
    ssq = fold_groups(rp.ng, load_g);
#else
    // test-only: each CTA's groups summed first, then the CTAs' sums in cluster order
    for (int c = 0; c < rp.nparts; ++c) {
      const int lo = c * rp.gpp, n = rp.ng - lo < rp.gpp ? rp.ng - lo : rp.gpp;
      auto load_g = [&](int64_t g) -> float { return s_row[lo + g]; };
      const float part = fold_groups(n, load_g);
      ssq = c == 0 ? part : ssq + part;
    }
#endif
  }
  if (fail == 0.f && rp.active) {
    const float rms = fused ? rms_of(ssq, p.hidden, p.eps) : 1.f;
    const float sdiv = (mode == kOutFp8Static) ? p.scale[0] : 1.f;
    // warp-uniform trips, as norm_row's pass 2 (rp.lo is a multiple of 32 vectors)
    for (int i0 = rp.lo + static_cast<int>(threadIdx.x) - lane, k = 0; i0 < rp.hi; i0 += blockDim.x, ++k) {
      const int i = i0 + lane;
      const bool live = i < rp.hi;
      float y[V] = {};
      uint4 yp = make_uint4(0u, 0u, 0u, 0u);
      if (live)
        yp = norm_vec_w<T>(cache[i - rp.lo], rms, has_w,
                           k < K ? pre.w_at(k) : (has_w ? load_whole_vec(p.weight, i) : uint4{}), y);
      store_row_out<T>(mode, p, sink, g0 + i, live, yp, y, sdiv);
    }
  }
  return fail == 0.f;
}

}  // namespace ubx
