// The launch half of the C API: argument validation against the host copy of the descriptor,
// launch geometry, and the CUDA calls. Kernels are the extern "C" __global__ entry points of
// csrc/kernels/*.cu (parameter list: docs/ARCHITECTURE.md, "Kernel ABI").
#include <cuda_runtime_api.h>

#include <atomic>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "device/desc.cuh"
#include "launch_rules.h"
#include "status.h"
#include "ubnext.h"

// Host stubs of the kernels. Weak, so that a library built while a kernel file is missing
// still loads and reports UNSUPPORTED for that kernel instead of failing to dlopen; the
// `kernels_complete` ctest makes a missing kernel a test failure. The argument types do not
// matter here: only the stub's address is used, as the key cudaLaunchKernel looks up.
// clang-format off: X-macro tables, one line per kernel family
#define UBNEXT_FOR_EACH_KERNEL(X)                                              \
  X(lamport, bf16) X(lamport, fp16) X(lamport, fp32)                           \
  X(nvls_oneshot, bf16) X(nvls_oneshot, fp16) X(nvls_oneshot, fp32)            \
  X(nvls_twoshot, bf16) X(nvls_twoshot, fp16) X(nvls_twoshot, fp32)            \
  X(nvls_lamport, bf16) X(nvls_lamport, fp16) X(nvls_lamport, fp32)            \
  X(twoshot, bf16) X(twoshot, fp16) X(twoshot, fp32)
// The kernels outside ubnext_algo_t, after them in the table: FSDP2's collectives and the FP8 cast.
#define UBNEXT_FOR_EACH_EXTRA_KERNEL(X)                                                   \
  X(allgather, u8)                                                                          \
  X(reduce_scatter, bf16) X(reduce_scatter, fp16) X(reduce_scatter, fp32)                 \
  X(quantize_fp8, bf16) X(quantize_fp8, fp16) X(quantize_fp8, fp32)
// clang-format on

#define UBNEXT_DECLARE_STUB(algo, dt) __attribute__((weak, visibility("hidden"))) void ubnext_##algo##_##dt();
extern "C" {
UBNEXT_FOR_EACH_KERNEL(UBNEXT_DECLARE_STUB)
UBNEXT_FOR_EACH_EXTRA_KERNEL(UBNEXT_DECLARE_STUB)
}
#undef UBNEXT_DECLARE_STUB

namespace ubnext {
namespace {

constexpr int kNumDtypes = 3;  // inputs: bf16, fp16, fp32 (ubnext_dtype_t order)
constexpr unsigned kDefaultBlock = 256;
constexpr unsigned kMaxBlock = 1024;
constexpr int kMaxCachedDevices = 64;
constexpr uint32_t kKnownLaunchFlags = UBNEXT_LAUNCH_LAMPORT_MULTICAST | UBNEXT_LAUNCH_NO_PDL;

struct KernelEntry {
  const char* name;
  void (*stub)();
};

// Indexed [algo][dtype] in enum order (UBNEXT_FOR_EACH_KERNEL lists them in that order), then the
// extra kernels: the all-gather, then reduce-scatter and quantisation by dtype.
constexpr int kAllgatherKernel = kNumAlgos * kNumDtypes;
constexpr int kReduceScatterKernel = kAllgatherKernel + 1;
constexpr int kQuantizeKernel = kReduceScatterKernel + kNumDtypes;
constexpr int kNumKernels = kQuantizeKernel + kNumDtypes;
#define UBNEXT_KERNEL_ENTRY(algo, dt) {"ubnext_" #algo "_" #dt, &ubnext_##algo##_##dt},
const KernelEntry kKernels[kNumKernels] = {UBNEXT_FOR_EACH_KERNEL(UBNEXT_KERNEL_ENTRY)
                                               UBNEXT_FOR_EACH_EXTRA_KERNEL(UBNEXT_KERNEL_ENTRY)};
#undef UBNEXT_KERNEL_ENTRY

const char* op_name(uint32_t op) {
  if (op == UBNEXT_OP_ALLGATHER) return "allgather";
  if (op == UBNEXT_OP_REDUCE_SCATTER) return "reduce_scatter";
  for (int a = 0; a < kNumAlgos; ++a) {
    if (static_cast<uint32_t>(kAlgos[a].op) == op) {
      return ubnext_algo_string(static_cast<ubnext_algo_t>(a));
    }
  }
  return nullptr;
}

bool aligned(const void* p, uintptr_t to) { return reinterpret_cast<uintptr_t>(p) % to == 0; }

ubnext_status_t from_cuda(cudaError_t err, const char* call) {
  // The error is reported here; consume it so that it does not resurface from
  // cudaGetLastError in unrelated caller code.
  if (err != cudaSuccess) (void)cudaGetLastError();
  switch (err) {
    case cudaSuccess: return UBNEXT_STATUS_SUCCESS;
    // The runtime reports a missing libcuda as an insufficient or stub driver.
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorStubLibrary:
      return fail(UBNEXT_STATUS_NO_DEVICE, "no usable GPU or CUDA driver: %s: %s (%s)", call, cudaGetErrorName(err),
                  cudaGetErrorString(err));
    default: return fail(UBNEXT_STATUS_CUDA_ERROR, "%s: %s (%s)", call, cudaGetErrorName(err), cudaGetErrorString(err));
  }
}

#define UBNEXT_TRY(expr)                                                        \
  do {                                                                          \
    ubnext_status_t ubnext_try_status_ = (expr);                                \
    if (ubnext_try_status_ != UBNEXT_STATUS_SUCCESS) return ubnext_try_status_; \
  } while (0)

// The launch struct (already read into *launch) and its host descriptor, for any kernel that
// waits on peers; `what` names the call in errors.
ubnext_status_t check_launch(const ubnext_launch_t* launch, bool wants_multicast, const char* what,
                             const ubnext_comm_desc** desc) {
  if (launch->desc == nullptr || !aligned(launch->desc, 8)) {
    return fail(UBNEXT_STATUS_INVALID_ARGUMENT,
                "ubnext_launch_t.desc (device descriptor) is NULL or not 8-byte aligned");
  }
  if (launch->host_desc == nullptr) {
    return fail(UBNEXT_STATUS_INVALID_ARGUMENT, "ubnext_launch_t.host_desc is NULL");
  }
  if (launch->grid > UBNEXT_MAX_BLOCKS) {
    return fail(UBNEXT_STATUS_INVALID_ARGUMENT, "grid %u exceeds UBNEXT_MAX_BLOCKS (%d)", launch->grid,
                UBNEXT_MAX_BLOCKS);
  }
  if (launch->block % 32 != 0 || launch->block > kMaxBlock) {
    return fail(UBNEXT_STATUS_INVALID_ARGUMENT, "block %u must be 0 (default) or a multiple of 32 up to %u",
                launch->block, kMaxBlock);
  }
  if (launch->flags & ~kKnownLaunchFlags) {
    return fail(UBNEXT_STATUS_INVALID_ARGUMENT, "unknown ubnext_launch_t.flags bits 0x%x",
                launch->flags & ~kKnownLaunchFlags);
  }

  const ubnext_comm_desc* d = launch->host_desc;
  if (d->magic != UBNEXT_DESC_MAGIC) {
    return fail(UBNEXT_STATUS_INVALID_ARGUMENT,
                "host_desc magic 0x%llx is not 0x%llx: not a ubnext descriptor, or another "
                "layout version",
                d->magic, UBNEXT_DESC_MAGIC);
  }
  if (d->nranks < 1 || d->nranks > UBNEXT_MAX_RANKS || d->rank >= d->nranks) {
    return fail(UBNEXT_STATUS_INVALID_ARGUMENT, "host_desc has rank %llu of %llu ranks (1..%d ranks supported)",
                d->rank, d->nranks, UBNEXT_MAX_RANKS);
  }
  for (unsigned long long r = 0; r < d->nranks; ++r) {
    if (d->peer_base[r] == 0) {
      return fail(UBNEXT_STATUS_INVALID_ARGUMENT, "host_desc.peer_base[%llu] is 0", r);
    }
  }
  // kernels write the whole sync region (call headers included): nothing may start inside it
  if (d->lamport_off < d->sync_off + UBNEXT_SYNC_BYTES || d->data_off < d->sync_off + UBNEXT_SYNC_BYTES) {
    return fail(UBNEXT_STATUS_INVALID_ARGUMENT,
                "host_desc places the Lamport buffers (+%llu) or data (+%llu) inside the %d-byte sync "
                "region at +%llu",
                d->lamport_off, d->data_off, UBNEXT_SYNC_BYTES, d->sync_off);
  }
  if (wants_multicast && d->mc_base == 0) {
    return fail(UBNEXT_STATUS_UNSUPPORTED,
                "%s needs a multicast address and this communicator has none "
                "(use lamport or twoshot)",
                what);
  }
  *desc = d;
  return UBNEXT_STATUS_SUCCESS;
}

// Checks that hold for every collective: the launch struct, the descriptor, algo and dtype.
ubnext_status_t check_common(const ubnext_launch_t* user_launch, ubnext_algo_t algo, ubnext_dtype_t dtype,
                             ubnext_launch_t* launch, const ubnext_comm_desc** desc) {
  *launch = ubnext_launch_t UBNEXT_LAUNCH_INIT;
  UBNEXT_TRY(read_versioned(user_launch, launch, "ubnext_launch_t"));
  if (static_cast<unsigned>(algo) >= static_cast<unsigned>(kNumAlgos)) {
    return fail(UBNEXT_STATUS_INVALID_ARGUMENT, "algo %d is not a ubnext_algo_t", static_cast<int>(algo));
  }
  if (dtype == UBNEXT_DTYPE_FP8_E4M3) {
    return fail(UBNEXT_STATUS_INVALID_ARGUMENT,
                "dtype FP8_E4M3 is an output format only; reduce bf16/fp16/fp32 and ask for "
                "FP8 output through ubnext_rmsnorm_args_t.fp8");
  }
  if (static_cast<unsigned>(dtype) >= static_cast<unsigned>(kNumDtypes)) {
    return fail(UBNEXT_STATUS_INVALID_ARGUMENT, "dtype %d is not a ubnext_dtype_t", static_cast<int>(dtype));
  }
  if ((launch->flags & UBNEXT_LAUNCH_LAMPORT_MULTICAST) && algo != UBNEXT_ALGO_LAMPORT) {
    return fail(UBNEXT_STATUS_INVALID_ARGUMENT,
                "UBNEXT_LAUNCH_LAMPORT_MULTICAST applies to UBNEXT_ALGO_LAMPORT only, not %s",
                ubnext_algo_string(algo));
  }
  const bool wants_multicast = kAlgos[algo].needs_multicast || (launch->flags & UBNEXT_LAUNCH_LAMPORT_MULTICAST);
  return check_launch(launch, wants_multicast, ubnext_algo_string(algo), desc);
}

ubnext_status_t check_buffer(const void* p, const char* name, uintptr_t alignment) {
  if (p == nullptr) return fail(UBNEXT_STATUS_INVALID_ARGUMENT, "%s is NULL", name);
  if (!aligned(p, alignment)) {
    return fail(UBNEXT_STATUS_INVALID_ARGUMENT, "%s (%p) is not %u-byte aligned", name, p,
                static_cast<unsigned>(alignment));
  }
  return UBNEXT_STATUS_SUCCESS;
}

ubnext_status_t check_in_arena_named(const ubnext_comm_desc* d, const char* what, const void* p, size_t bytes,
                                     const char* name) {
  const uintptr_t base = d->peer_base[d->rank];
  const uintptr_t lo = base + d->data_off, hi = base + d->pool_bytes;
  const uintptr_t at = reinterpret_cast<uintptr_t>(p);
  if (at < lo || at > hi || hi - at < bytes) {
    return fail(UBNEXT_STATUS_INVALID_ARGUMENT,
                "%s needs %s in the symmetric pool: [%p, +%zu) is outside this rank's data "
                "arena [0x%" PRIxPTR ", 0x%" PRIxPTR ")",
                what, name, p, bytes, lo, hi);
  }
  return UBNEXT_STATUS_SUCCESS;
}

ubnext_status_t check_in_arena(const ubnext_comm_desc* d, ubnext_algo_t algo, const void* p, size_t bytes,
                               const char* name) {
  return check_in_arena_named(d, ubnext_algo_string(algo), p, bytes, name);
}

size_t round_up16(size_t bytes) { return (bytes + 15) / 16 * 16; }

// [p, +bytes) and [q, +bytes) share a byte.
bool overlaps(const void* p, size_t p_bytes, const void* q, size_t q_bytes) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p), b = reinterpret_cast<uintptr_t>(q);
  return p_bytes > 0 && q_bytes > 0 && a < b + q_bytes && b < a + p_bytes;
}

// Element count, placement of in/out for the algorithm, and capacity. `out_elem` is the size of
// an output element (e4m3 output of the fused op is narrower than the input). Any count >= 1:
// the kernels handle a partial last 16-byte vector (csrc/device/slices.cuh, vec.cuh) and never
// store past count elements, but they do read and move the whole vector, so the padded size is
// what must fit the data arena and the Lamport slot.
ubnext_status_t check_message(const ubnext_comm_desc* d, ubnext_algo_t algo, ubnext_dtype_t dtype, const void* in,
                              const void* out, size_t count, size_t out_elem) {
  UBNEXT_TRY(check_buffer(in, "in", 16));
  UBNEXT_TRY(check_buffer(out, "out", 16));
  const size_t elem = ubnext_dtype_size(dtype);
  // The kernel's n is an int32; bounding count first also keeps count * elem from overflowing.
  if (count == 0 || count > INT32_MAX) {
    return fail(UBNEXT_STATUS_INVALID_ARGUMENT, "count %zu is outside 1..%d", count, INT32_MAX);
  }
  const size_t bytes = count * elem, out_bytes = count * out_elem;
  const size_t padded = round_up16(bytes);
  const AlgoTraits& t = kAlgos[algo];
  if (out == in) {
    if (!t.out_may_be_in) {
      return fail(UBNEXT_STATUS_INVALID_ARGUMENT,
                  "%s leaves in unmodified (peers read it during the call): out must not be "
                  "in nor overlap it",
                  ubnext_algo_string(algo));
    }
  } else if (overlaps(in, bytes, out, out_bytes)) {
    // A partial overlap would read what was just written.
    return fail(UBNEXT_STATUS_INVALID_ARGUMENT, "out overlaps in without being equal to it");
  }
  if (t.in_in_arena) UBNEXT_TRY(check_in_arena(d, algo, in, padded, "in"));
  if (t.uses_lamport && padded + UBNEXT_LAMPORT_HEADER_BYTES > d->lamport_slot_bytes) {
    return fail(UBNEXT_STATUS_NO_ROOM,
                "%s: %zu bytes (%zu as 16-byte vectors) and the %d-byte call header do not fit the "
                "Lamport slot of %llu bytes",
                ubnext_algo_string(algo), bytes, padded, UBNEXT_LAMPORT_HEADER_BYTES, d->lamport_slot_bytes);
  }
  return UBNEXT_STATUS_SUCCESS;
}

// Per kernel and device, for the default block size: SM count and co-resident blocks. Probing
// costs a few microseconds, about the latency of the collective itself, so it is paid once.
struct Limits {
  int sms;
  int coresident;
  int cc_major;  // NVLS two-shot grid (launch_rules.h: nvls_twoshot_grid_cap)
};
std::atomic<long long> g_limits[kMaxCachedDevices][kNumKernels];

ubnext_status_t device_limits(int device, int kernel, unsigned block, Limits* out) {
  const bool cacheable = block == kDefaultBlock && device < kMaxCachedDevices;
  if (cacheable) {
    const long long packed = g_limits[device][kernel].load(std::memory_order_relaxed);
    if (packed > 0) {
      *out = Limits{static_cast<int>((packed >> 32) & 0xffffff), static_cast<int>(packed & 0xffffffff),
                    static_cast<int>(packed >> 56)};
      return UBNEXT_STATUS_SUCCESS;
    }
  }
  int sms = 0, per_sm = 0, cc_major = 0;
  UBNEXT_TRY(from_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
                       "cudaDeviceGetAttribute(MultiProcessorCount)"));
  UBNEXT_TRY(from_cuda(cudaDeviceGetAttribute(&cc_major, cudaDevAttrComputeCapabilityMajor, device),
                       "cudaDeviceGetAttribute(ComputeCapabilityMajor)"));
  UBNEXT_TRY(from_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
                           &per_sm, reinterpret_cast<const void*>(kKernels[kernel].stub), static_cast<int>(block), 0),
                       "cudaOccupancyMaxActiveBlocksPerMultiprocessor"));
  if (sms <= 0 || per_sm <= 0) {
    return fail(UBNEXT_STATUS_UNSUPPORTED, "%s cannot run with %u threads per block", kKernels[kernel].name, block);
  }
  *out = Limits{sms, sms * per_sm, cc_major};
  if (cacheable) {  // cc_major in bits 56..62, sms in 32..55, coresident in 0..31
    g_limits[device][kernel].store((static_cast<long long>(cc_major & 0x7f) << 56) |
                                       (static_cast<long long>(sms & 0xffffff) << 32) | out->coresident,
                                   std::memory_order_relaxed);
  }
  return UBNEXT_STATUS_SUCCESS;
}

// cudaOccupancyMaxActiveClusters of kernel `kernel` on `device` at the row split's block and `cluster` CTAs per
// cluster (launch_rules.h pair_clusters_fit), asked once per device, kernel and cluster size.
std::atomic<int> g_max_clusters[kMaxCachedDevices][kNumKernels][kRowSplitMax + 1];  // the answer + 1; 0: not asked

ubnext_status_t max_active_clusters(int device, int kernel, unsigned block, unsigned cluster, int* out) {
  const bool cacheable = device < kMaxCachedDevices && block == kRowSplitBlock && cluster <= kRowSplitMax;
  if (cacheable) {
    const int known = g_max_clusters[device][kernel][cluster].load(std::memory_order_relaxed);
    if (known > 0) {
      *out = known - 1;
      return UBNEXT_STATUS_SUCCESS;
    }
  }
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = cluster;
  attribute.val.clusterDim.y = attribute.val.clusterDim.z = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(cluster);
  config.blockDim = dim3(block);
  config.attrs = &attribute;
  config.numAttrs = 1;
  UBNEXT_TRY(
      from_cuda(cudaOccupancyMaxActiveClusters(out, reinterpret_cast<const void*>(kKernels[kernel].stub), &config),
                "cudaOccupancyMaxActiveClusters"));
  if (cacheable) g_max_clusters[device][kernel][cluster].store(*out + 1, std::memory_order_relaxed);
  return UBNEXT_STATUS_SUCCESS;
}

// The kernel ABI (docs/ARCHITECTURE.md): the descriptor by value (the caller's host copy, which must
// equal the device one: csrc/device/entry.cuh says why kernels take it so), then pointers and scalars.
struct KernelArgs {
  ubnext_comm_desc desc;
  const void* in;
  void* out;
  const void* residual;
  void* residual_out;
  const void* weight;
  const float* scale;
  float* scale_inv;
  int32_t n;
  int32_t hidden;
  float eps;
  int32_t flags;
};

// Whether launches on `device` carry the programmatic-stream-serialization attribute (PDL): on sm_90 and
// later (griddepcontrol needs them), unless the caller's launch flags say UBNEXT_LAUNCH_NO_PDL. The
// compute capability is asked once per device.
ubnext_status_t pdl_enabled(int device, uint32_t launch_flags, bool* on) {
  static std::atomic<int> major[kMaxCachedDevices];  // 0: not asked yet
  int m = device < kMaxCachedDevices ? major[device].load(std::memory_order_relaxed) : 0;
  if (m == 0) {
    UBNEXT_TRY(from_cuda(cudaDeviceGetAttribute(&m, cudaDevAttrComputeCapabilityMajor, device),
                         "cudaDeviceGetAttribute(ComputeCapabilityMajor)"));
    if (device < kMaxCachedDevices) major[device].store(m, std::memory_order_relaxed);
  }
  *on = !(launch_flags & UBNEXT_LAUNCH_NO_PDL) && m >= 9;
  return UBNEXT_STATUS_SUCCESS;
}

// Launch kernel `kernel` (an index of kKernels) with the default grid rule of launch_rules.h
// (default_grid: `bytes` of message, per-rank share or not, `tokens` rows, half the SMs for a kernel
// that waits on its peers, the NVLS two-shot's own cap when `nvls_twoshot`) unless launch.grid says
// otherwise. Kernels that wait on peers' blocks (`coresident`) refuse a grid larger than what fits at
// once; a local kernel (`local`: no peer, no barrier) takes any grid. The Lamport fused kernel's row split
// (`row_vectors` > 0, default grid) is a cluster launch of kRowSplitBlock-thread CTAs, one cluster per row,
// as the Python launcher makes it, when pair_clusters_fit allows (launch_rules.h).
ubnext_status_t launch_index(const ubnext_launch_t& launch, int kernel, bool per_rank_share, size_t bytes,
                             size_t tokens, size_t nranks, KernelArgs a, bool local = false, bool nvls_twoshot = false,
                             size_t row_vectors = 0) {
  const KernelEntry& k = kKernels[kernel];
  // The device first: NO_DEVICE describes the machine, whatever this build holds.
  int device = 0;
  UBNEXT_TRY(from_cuda(cudaGetDevice(&device), "cudaGetDevice"));
  if (k.stub == nullptr) {
    return fail(UBNEXT_STATUS_UNSUPPORTED, "kernel %s is not compiled into this libubnext", k.name);
  }
  unsigned block = launch.block ? launch.block : kDefaultBlock;
  Limits lim{};
  UBNEXT_TRY(device_limits(device, kernel, block, &lim));
  const bool default_grid_used = launch.grid == 0;
  unsigned grid = launch.grid;
  if (grid == 0) {
    const unsigned algo_cap = nvls_twoshot && tokens == 0 ? nvls_twoshot_grid_cap(nranks, lim.cc_major) : 0u;
    grid = default_grid(per_rank_share, bytes, tokens, nranks, block, lim.sms, lim.coresident, !local, algo_cap,
                        row_vectors);
  } else if (!local && grid > static_cast<unsigned>(lim.coresident)) {
    // Blocks wait on their peers' blocks; more than fit at once could wait forever.
    return fail(UBNEXT_STATUS_INVALID_ARGUMENT,
                "grid %u exceeds the co-resident limit of %d blocks for %s with %u threads", grid, lim.coresident,
                k.name, block);
  }
  unsigned cluster = default_grid_used && row_vectors > 0 ? row_cluster(tokens, grid) : 1u;
  if (cluster > 1) {
    if (!launch.block) block = kRowSplitBlock;
    int max_clusters = 0;
    UBNEXT_TRY(max_active_clusters(device, kernel, block, cluster, &max_clusters));
    if (!pair_clusters_fit(grid / cluster, max_clusters)) cluster = 1;  // each row one CTA's (norm.cuh)
  }
  bool pdl = false;
  UBNEXT_TRY(pdl_enabled(device, launch.flags, &pdl));
  void* params[] = {&a.desc,  &a.in,        &a.out, &a.residual, &a.residual_out, &a.weight,
                    &a.scale, &a.scale_inv, &a.n,   &a.hidden,   &a.eps,          &a.flags};
  // With the attribute the kernel may start before the previous kernel on the stream has ended; it
  // waits for it in griddepcontrol.wait before touching memory (csrc/device/ptx.cuh).
  // The cluster attribute: consecutive CTAs in clusters of `cluster` (the row split, norm.cuh).
  cudaLaunchAttribute attributes[2] = {};
  unsigned nattrs = 0;
  if (pdl) {
    attributes[nattrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attributes[nattrs++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster > 1) {
    attributes[nattrs].id = cudaLaunchAttributeClusterDimension;
    attributes[nattrs].val.clusterDim.x = cluster;
    attributes[nattrs].val.clusterDim.y = attributes[nattrs].val.clusterDim.z = 1;
    ++nattrs;
  }
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(block);
  config.dynamicSmemBytes = 0;
  config.stream = static_cast<cudaStream_t>(launch.stream);
  config.attrs = nattrs ? attributes : nullptr;
  config.numAttrs = nattrs;
  const cudaError_t err = cudaLaunchKernelExC(&config, reinterpret_cast<const void*>(k.stub), params);
  return from_cuda(err, k.name);
}

ubnext_status_t launch_kernel(const ubnext_launch_t& launch, ubnext_algo_t algo, ubnext_dtype_t dtype,
                              const ubnext_comm_desc* d, size_t tokens, KernelArgs a) {
  a.flags |= (launch.flags & UBNEXT_LAUNCH_LAMPORT_MULTICAST) ? UBNEXT_F_MULTICAST : 0;
  // the Lamport fused kernel's row split (launch_rules.h row_split), as the Python launcher sizes it
  const size_t row_vectors = (algo == UBNEXT_ALGO_LAMPORT && tokens > 0 && !(a.flags & UBNEXT_F_FP8_PER_TOKEN))
                                 ? static_cast<size_t>(a.hidden) * ubnext_dtype_size(dtype) / 16
                                 : 0;
  return launch_index(launch, static_cast<int>(algo) * kNumDtypes + static_cast<int>(dtype),
                      kAlgos[algo].per_rank_share, static_cast<size_t>(a.n) * ubnext_dtype_size(dtype), tokens,
                      static_cast<size_t>(d->nranks), a, false, algo == UBNEXT_ALGO_NVLS_TWOSHOT, row_vectors);
}

// count in 1..INT32_MAX (the kernels' n is an int32; it also keeps count * size from overflowing)
ubnext_status_t check_count(size_t count, const char* name) {
  if (count == 0 || count > INT32_MAX) {
    return fail(UBNEXT_STATUS_INVALID_ARGUMENT, "%s %zu is outside 1..%d", name, count, INT32_MAX);
  }
  return UBNEXT_STATUS_SUCCESS;
}

ubnext_status_t check_input_dtype(ubnext_dtype_t dtype) {
  if (static_cast<unsigned>(dtype) >= static_cast<unsigned>(kNumDtypes)) {
    return fail(UBNEXT_STATUS_INVALID_ARGUMENT, "dtype %d must be BF16, FP16 or FP32", static_cast<int>(dtype));
  }
  return UBNEXT_STATUS_SUCCESS;
}

// An fp32 given by its bits (a call header's eps word), in the fewest digits that give those bits back:
// 1e-05 as the caller wrote it, not 9.99999975e-06.
void f32_text(char* buf, size_t size, uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof value);
  for (int digits = 1; digits <= 9; ++digits) {
    std::snprintf(buf, size, "%.*g", digits, static_cast<double>(value));
    if (std::strtof(buf, nullptr) == value) return;
  }
}

}  // namespace
}  // namespace ubnext

using namespace ubnext;

extern "C" {

size_t ubnext_dtype_size(ubnext_dtype_t dtype) {
  switch (dtype) {
    case UBNEXT_DTYPE_BF16: return 2;
    case UBNEXT_DTYPE_FP16: return 2;
    case UBNEXT_DTYPE_FP32: return 4;
    case UBNEXT_DTYPE_FP8_E4M3: return 1;
  }
  return 0;
}

const char* ubnext_algo_string(ubnext_algo_t algo) {
  switch (algo) {
    case UBNEXT_ALGO_LAMPORT: return "lamport";
    case UBNEXT_ALGO_NVLS_ONESHOT: return "nvls_oneshot";
    case UBNEXT_ALGO_NVLS_TWOSHOT: return "nvls_twoshot";
    case UBNEXT_ALGO_NVLS_LAMPORT: return "nvls_lamport";
    case UBNEXT_ALGO_TWOSHOT: return "twoshot";
  }
  return "unknown";
}

ubnext_status_t ubnext_device_count(int* count) {
  clear_error();
  if (count == nullptr) return fail(UBNEXT_STATUS_INVALID_ARGUMENT, "count is NULL");
  *count = 0;
  int n = 0;
  UBNEXT_TRY(from_cuda(cudaGetDeviceCount(&n), "cudaGetDeviceCount"));
  if (n <= 0) return fail(UBNEXT_STATUS_NO_DEVICE, "cudaGetDeviceCount found no device");
  *count = n;
  return UBNEXT_STATUS_SUCCESS;
}

ubnext_status_t ubnext_allreduce(const ubnext_launch_t* user_launch, ubnext_algo_t algo, ubnext_dtype_t dtype,
                                 const void* in, void* out, size_t count) {
  clear_error();
  ubnext_launch_t launch;
  const ubnext_comm_desc* d = nullptr;
  UBNEXT_TRY(check_common(user_launch, algo, dtype, &launch, &d));
  UBNEXT_TRY(check_message(d, algo, dtype, in, out, count, ubnext_dtype_size(dtype)));
  int32_t flags = 0;
  if (algo == UBNEXT_ALGO_NVLS_TWOSHOT) {
    // UBNEXT_F_MULTICAST means "broadcast straight into out" to this kernel (nvls.cu): only for an out in
    // the arena (at the same offset on every rank, which the call header checks), never from the
    // Lamport launch flag.
    launch.flags &= ~static_cast<unsigned>(UBNEXT_LAUNCH_LAMPORT_MULTICAST);
    const size_t padded = round_up16(count * ubnext_dtype_size(dtype));
    if (out != in && check_in_arena(d, algo, out, padded, "out") == UBNEXT_STATUS_SUCCESS) flags = UBNEXT_F_MULTICAST;
    clear_error();  // an out outside the arena is allowed: the kernel copies into it
  }
  KernelArgs a{*d, in, out, nullptr, nullptr, nullptr, nullptr, nullptr, static_cast<int32_t>(count), 0, 0.0f, flags};
  return launch_kernel(launch, algo, dtype, d, 0, a);
}

ubnext_status_t ubnext_allreduce_add_rmsnorm(const ubnext_launch_t* user_launch, ubnext_algo_t algo,
                                             ubnext_dtype_t dtype, const ubnext_rmsnorm_args_t* user_args) {
  clear_error();
  ubnext_launch_t launch;
  const ubnext_comm_desc* d = nullptr;
  UBNEXT_TRY(check_common(user_launch, algo, dtype, &launch, &d));
  ubnext_rmsnorm_args_t args = UBNEXT_RMSNORM_ARGS_INIT;
  UBNEXT_TRY(read_versioned(user_args, &args, "ubnext_rmsnorm_args_t"));

  int32_t flags = UBNEXT_F_FUSED_NORM;
  switch (args.fp8) {
    case UBNEXT_FP8_NONE:
      if (args.scale != nullptr || args.scale_inv != nullptr) {
        return fail(UBNEXT_STATUS_INVALID_ARGUMENT, "scale and scale_inv must be NULL without FP8 output (fp8 = NONE)");
      }
      break;
    case UBNEXT_FP8_STATIC:
      UBNEXT_TRY(check_buffer(args.scale, "scale (FP8_STATIC)", 4));
      UBNEXT_TRY(check_buffer(args.scale_inv, "scale_inv (FP8_STATIC)", 4));
      flags |= UBNEXT_F_FP8_STATIC;
      break;
    case UBNEXT_FP8_PER_TOKEN:
      if (args.scale != nullptr) {
        return fail(UBNEXT_STATUS_INVALID_ARGUMENT,
                    "scale must be NULL with FP8_PER_TOKEN (the kernel computes one per token)");
      }
      UBNEXT_TRY(check_buffer(args.scale_inv, "scale_inv (FP8_PER_TOKEN)", 4));
      flags |= UBNEXT_F_FP8_PER_TOKEN;
      break;
    default:
      return fail(UBNEXT_STATUS_INVALID_ARGUMENT, "fp8 %d is not a ubnext_fp8_scaling_t", static_cast<int>(args.fp8));
  }
  if (!kAlgos[algo].can_fuse) {
    return fail(UBNEXT_STATUS_UNSUPPORTED,
                "%s sums in the switch's order, so ranks could normalise different bits; "
                "fuse with lamport, nvls_twoshot, nvls_lamport or twoshot",
                ubnext_algo_string(algo));
  }
  // e4m3 output over `in` would overwrite partial sums that are still to be exchanged.
  if (args.fp8 != UBNEXT_FP8_NONE && args.out == args.in) {
    return fail(UBNEXT_STATUS_INVALID_ARGUMENT, "FP8 output cannot be written in place (out == in)");
  }
  const size_t elem = ubnext_dtype_size(dtype);
  const size_t out_elem = ubnext_dtype_size(args.fp8 == UBNEXT_FP8_NONE ? dtype : UBNEXT_DTYPE_FP8_E4M3);
  UBNEXT_TRY(check_message(d, algo, dtype, args.in, args.out, args.count, out_elem));
  // The row math runs on every rank after the exchange, so these are plain device memory
  // anywhere (not in the pool, not broadcast).
  UBNEXT_TRY(check_buffer(args.residual, "residual", 16));
  UBNEXT_TRY(check_buffer(args.residual_out, "residual_out", 16));
  UBNEXT_TRY(check_buffer(args.weight, "weight", 16));
  if (args.hidden == 0 || args.hidden > static_cast<size_t>(INT32_MAX) || args.count % args.hidden != 0) {
    return fail(UBNEXT_STATUS_INVALID_ARGUMENT, "hidden %zu must be > 0 and divide count %zu into whole tokens",
                args.hidden, args.count);
  }
  if ((args.hidden * elem) % 16 != 0) {
    return fail(UBNEXT_STATUS_INVALID_ARGUMENT,
                "hidden %zu x %zu bytes is not a multiple of 16 bytes (rows move as 16-byte "
                "vectors)",
                args.hidden, elem);
  }
  if (!std::isfinite(args.eps) || args.eps < 0.0f) {
    return fail(UBNEXT_STATUS_INVALID_ARGUMENT, "eps %g must be finite and >= 0", static_cast<double>(args.eps));
  }
  // No buffer the kernel writes (out, residual_out, scale_inv; in, which the two-shot kernels
  // overwrite and the others read during the exchange) may overlap another one, except
  // out == in (check_message) and residual_out == residual (each element is read before the
  // same thread writes it). Read-only buffers (residual, weight, scale) may overlap each other.
  {
    const size_t tokens = args.count / args.hidden;
    const size_t bytes = args.count * elem;
    struct Region {
      const void* p;
      size_t bytes;
      const char* name;
      bool written;
    };
    const Region r[] = {
        {args.in, bytes, "in", true},
        {args.out, args.count * out_elem, "out", true},
        {args.residual_out, bytes, "residual_out", true},
        {args.scale_inv,
         args.fp8 == UBNEXT_FP8_PER_TOKEN ? tokens * sizeof(float)
                                          : (args.fp8 == UBNEXT_FP8_STATIC ? sizeof(float) : 0),
         "scale_inv", true},
        {args.residual, bytes, "residual", false},
        {args.weight, args.hidden * elem, "weight", false},
        {args.scale, args.fp8 == UBNEXT_FP8_STATIC ? sizeof(float) : 0, "scale", false},
    };
    const size_t nr = sizeof r / sizeof r[0];
    for (size_t i = 0; i < nr; ++i) {
      for (size_t j = i + 1; j < nr; ++j) {
        if (!r[i].written && !r[j].written) continue;
        if (i == 0 && j == 1) continue;  // in / out: check_message
        if (i == 2 && j == 4 && r[i].p == r[j].p) continue;  // residual_out aliases residual
        if (overlaps(r[i].p, r[i].bytes, r[j].p, r[j].bytes)) {
          return fail(UBNEXT_STATUS_INVALID_ARGUMENT, "%s overlaps %s", r[i].name, r[j].name);
        }
      }
    }
  }
  KernelArgs a{*d,
               args.in,
               args.out,
               args.residual,
               args.residual_out,
               args.weight,
               args.scale,
               args.scale_inv,
               static_cast<int32_t>(args.count),
               static_cast<int32_t>(args.hidden),
               args.eps,
               flags};
  return launch_kernel(launch, algo, dtype, d, args.count / args.hidden, a);
}

ubnext_status_t ubnext_allgather(const ubnext_launch_t* user_launch, const void* in, void* out, size_t bytes) {
  clear_error();
  ubnext_launch_t launch = UBNEXT_LAUNCH_INIT;
  UBNEXT_TRY(read_versioned(user_launch, &launch, "ubnext_launch_t"));
  if (launch.flags & ~UBNEXT_LAUNCH_NO_PDL) {
    return fail(UBNEXT_STATUS_INVALID_ARGUMENT,
                "ubnext_allgather takes no launch flags but UBNEXT_LAUNCH_NO_PDL (it pushes through multicast when the "
                "descriptor has it)");
  }
  const ubnext_comm_desc* d = nullptr;
  UBNEXT_TRY(check_launch(&launch, false, "allgather", &d));
  UBNEXT_TRY(check_count(bytes, "bytes"));
  if (bytes % 4 != 0) return fail(UBNEXT_STATUS_INVALID_ARGUMENT, "bytes %zu is not a multiple of 4", bytes);
  UBNEXT_TRY(check_buffer(in, "in", 4));
  UBNEXT_TRY(check_buffer(out, "out", 16));
  const size_t total = bytes * static_cast<size_t>(d->nranks);
  UBNEXT_TRY(check_in_arena_named(d, "allgather", out, round_up16(total), "out"));
  const char* own = static_cast<const char*>(out) + bytes * static_cast<size_t>(d->rank);
  if (in != own && overlaps(in, bytes, out, total)) {
    return fail(UBNEXT_STATUS_INVALID_ARGUMENT, "in overlaps out without being this rank's slice of it");
  }
  KernelArgs a{*d,      in,      out,
               nullptr, nullptr, nullptr,
               nullptr, nullptr, static_cast<int32_t>(bytes),
               0,       0.0f,    d->mc_base != 0 ? UBNEXT_F_MULTICAST : 0};
  return launch_index(launch, kAllgatherKernel, false, bytes, 0, static_cast<size_t>(d->nranks), a);
}

ubnext_status_t ubnext_reduce_scatter(const ubnext_launch_t* user_launch, ubnext_dtype_t dtype, const void* in,
                                      void* out, size_t count, float factor) {
  clear_error();
  ubnext_launch_t launch = UBNEXT_LAUNCH_INIT;
  UBNEXT_TRY(read_versioned(user_launch, &launch, "ubnext_launch_t"));
  if (launch.flags & ~UBNEXT_LAUNCH_NO_PDL) {
    return fail(UBNEXT_STATUS_INVALID_ARGUMENT, "ubnext_reduce_scatter takes no launch flags but UBNEXT_LAUNCH_NO_PDL");
  }
  UBNEXT_TRY(check_input_dtype(dtype));
  const ubnext_comm_desc* d = nullptr;
  UBNEXT_TRY(check_launch(&launch, false, "reduce_scatter", &d));
  UBNEXT_TRY(check_count(count, "count"));
  const size_t elem = ubnext_dtype_size(dtype), bytes = count * elem;
  if (bytes % 16 != 0) {
    return fail(UBNEXT_STATUS_INVALID_ARGUMENT,
                "count %zu x %zu bytes is not a multiple of 16 bytes (each shard moves as 16-byte vectors)", count,
                elem);
  }
  if (!std::isfinite(factor)) return fail(UBNEXT_STATUS_INVALID_ARGUMENT, "factor %g is not finite", factor);
  UBNEXT_TRY(check_buffer(in, "in", 16));
  UBNEXT_TRY(check_buffer(out, "out", 16));
  const size_t total = bytes * static_cast<size_t>(d->nranks);
  UBNEXT_TRY(check_in_arena_named(d, "reduce_scatter", in, total, "in"));
  if (overlaps(in, total, out, bytes)) return fail(UBNEXT_STATUS_INVALID_ARGUMENT, "out overlaps in");
  KernelArgs a{*d, in, out, nullptr, nullptr, nullptr, nullptr, nullptr, static_cast<int32_t>(count), 0, factor, 0};
  return launch_index(launch, kReduceScatterKernel + static_cast<int>(dtype), false, bytes, 0,
                      static_cast<size_t>(d->nranks), a);
}

ubnext_status_t ubnext_quantize_fp8(void* stream, ubnext_dtype_t dtype, ubnext_fp8_scaling_t scaling, const void* in,
                                    void* out, size_t count, size_t hidden, const float* scale, float* scale_inv) {
  clear_error();
  UBNEXT_TRY(check_input_dtype(dtype));
  UBNEXT_TRY(check_count(count, "count"));
  const size_t elem = ubnext_dtype_size(dtype);
  if (hidden == 0 || count % hidden != 0 || (hidden * elem) % 16 != 0) {
    return fail(UBNEXT_STATUS_INVALID_ARGUMENT, "hidden %zu must divide count %zu into rows of whole 16-byte vectors",
                hidden, count);
  }
  int32_t flags = 0;
  size_t scales = 0;
  if (scaling == UBNEXT_FP8_STATIC) {
    UBNEXT_TRY(check_buffer(scale, "scale (FP8_STATIC)", 4));
    flags = UBNEXT_F_FP8_STATIC;
    scales = 1;
  } else if (scaling == UBNEXT_FP8_PER_TOKEN) {
    if (scale != nullptr) return fail(UBNEXT_STATUS_INVALID_ARGUMENT, "scale must be NULL with FP8_PER_TOKEN");
    flags = UBNEXT_F_FP8_PER_TOKEN;
    scales = count / hidden;
  } else {
    return fail(UBNEXT_STATUS_INVALID_ARGUMENT, "scaling %d must be FP8_STATIC or FP8_PER_TOKEN",
                static_cast<int>(scaling));
  }
  UBNEXT_TRY(check_buffer(in, "in", 16));
  UBNEXT_TRY(check_buffer(out, "out", 8));
  UBNEXT_TRY(check_buffer(scale_inv, "scale_inv", 4));
  if (overlaps(in, count * elem, out, count) || overlaps(scale_inv, scales * sizeof(float), in, count * elem) ||
      overlaps(scale_inv, scales * sizeof(float), out, count)) {
    return fail(UBNEXT_STATUS_INVALID_ARGUMENT, "in, out and scale_inv must not overlap");
  }
  ubnext_launch_t launch = UBNEXT_LAUNCH_INIT;
  launch.stream = stream;
  launch.flags = UBNEXT_LAUNCH_NO_PDL;  // no launch struct to say otherwise: plain stream order, as before
  KernelArgs a{ubnext_comm_desc{},
               in,
               out,
               nullptr,
               nullptr,
               nullptr,
               scale,
               scale_inv,
               static_cast<int32_t>(count),
               static_cast<int32_t>(hidden),
               0.0f,
               flags};
  // a local kernel: its grid comes from the work alone (launch_rules.h quantize_grid; the bits do not
  // depend on it)
  launch.grid = quantize_grid(flags == UBNEXT_F_FP8_PER_TOKEN, count * elem, hidden * elem, kDefaultBlock);
  return launch_index(launch, kQuantizeKernel + static_cast<int>(dtype), false, 0, 0, 1, a, true);
}

ubnext_status_t ubnext_take_kernel_error(const struct ubnext_comm_desc* host_desc) {
  clear_error();
  if (host_desc == nullptr) return fail(UBNEXT_STATUS_INVALID_ARGUMENT, "host_desc is NULL");
  if (host_desc->magic != UBNEXT_DESC_MAGIC) {
    return fail(UBNEXT_STATUS_INVALID_ARGUMENT, "host_desc magic 0x%llx is not 0x%llx", host_desc->magic,
                UBNEXT_DESC_MAGIC);
  }
  if (host_desc->err_ptr == 0 || host_desc->err_ptr % 4 != 0) {
    return fail(UBNEXT_STATUS_INVALID_ARGUMENT, "host_desc.err_ptr is 0 or misaligned: no error word to read");
  }
  uint32_t* word = reinterpret_cast<uint32_t*>(static_cast<uintptr_t>(host_desc->err_ptr));
  // A kernel writes the details, a system fence, then the code (barrier.cuh, write_error_word): the
  // acquire on the code pairs with that fence, so a nonzero code comes with its whole record.
  const uint32_t code = __atomic_load_n(&word[0], __ATOMIC_ACQUIRE);
  if (code == 0) return UBNEXT_STATUS_SUCCESS;
  uint32_t w[UBNEXT_ERR_WORDS];
  for (int i = 1; i < UBNEXT_ERR_WORDS; ++i) w[i] = __atomic_load_n(&word[i], __ATOMIC_RELAXED);
  const uint32_t op = w[1], rank = w[2], peer = w[3];
  // w[7]: this rank stopped because the communicator had been aborted by `rank` (barrier.cuh)
  const char* aborted = w[7] ? "communicator aborted: " : "";
  for (int i = 1; i < UBNEXT_ERR_WORDS; ++i) __atomic_store_n(&word[i], 0u, __ATOMIC_RELAXED);
  __atomic_store_n(&word[0], 0u, __ATOMIC_RELEASE);

  const char* name = op_name(op);
  char op_text[32];
  if (name == nullptr) {
    std::snprintf(op_text, sizeof op_text, "op %u", op);
    name = op_text;
  }
  if (code == UBNEXT_ERR_TIMEOUT) {
    return fail(UBNEXT_STATUS_TIMEOUT,
                "%s%s timed out on rank %u waiting for peer %u (timeout %.3f ms); every rank "
                "must issue the same collectives in the same order",
                aborted, name, rank, peer, static_cast<double>(host_desc->timeout_ns) * 1e-6);
  }
  if (code == UBNEXT_ERR_PEER_LEFT) {
    return fail(UBNEXT_STATUS_PEER_LEFT,
                "%s%s: rank %u stopped waiting for peer %u, which has left (closed its communicator or "
                "exited)",
                aborted, name, rank, peer);
  }
  if (code == UBNEXT_ERR_MISMATCH && w[4] == UBNEXT_HDR_EPS) {  // a fused call's eps, as fp32 bits
    char mine[32], theirs[32];
    f32_text(mine, sizeof mine, w[5]);
    f32_text(theirs, sizeof theirs, w[6]);
    return fail(UBNEXT_STATUS_INVALID_ARGUMENT,
                "%s%s: ranks made different calls: rank %u has eps %s but rank %u has eps %s; every rank "
                "must pass the same eps",
                aborted, name, rank, mine, peer, theirs);
  }
  if (code == UBNEXT_ERR_MISMATCH) {
    static const char* const fields[4] = {"op/dtype/flags", "count", "hidden", "in offset (16-byte units)"};
    return fail(UBNEXT_STATUS_INVALID_ARGUMENT,
                "%s%s: ranks made different calls: rank %u has %s %u but rank %u has %u; every rank "
                "must make the same call, with `in` at the same pool offset",
                aborted, name, rank, w[4] < 4 ? fields[w[4]] : "header word", w[5], peer, w[6]);
  }
  return fail(UBNEXT_STATUS_INTERNAL, "kernel error word holds unknown code %u (%s, rank %u, peer %u)", code, name,
              rank, peer);
}

}  // extern "C"
