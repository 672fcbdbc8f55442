/*
 * ubnext: symmetric-memory allreduce (optionally fused with residual add, RMSNorm and FP8
 * output) for tensor-parallel layers on one NVLink/NVSwitch node.
 *
 * This is the public C99 API of libubnext.so. It launches the collective kernels on a CUDA
 * stream; it does not create communicators or symmetric memory. The caller (normally the
 * ubnext Python pool) maps the symmetric pool on every rank and fills one communicator
 * descriptor per rank, whose layout is `struct ubnext_comm_desc` in <ubnext/desc.cuh>
 * (csrc/device/desc.cuh in the source tree; docs/ARCHITECTURE.md explains the pool layout).
 *
 * Conventions that hold for every function below unless its comment says otherwise:
 *  - Every function returning ubnext_status_t validates all its arguments before it touches
 *    CUDA, and on failure stores a one-line explanation for ubnext_get_last_error_string().
 *  - Pointers passed in are borrowed: the library keeps none of them after the call returns,
 *    except that device pointers must stay valid until the enqueued kernel has finished.
 *  - Thread safety: every function may be called concurrently from several threads.
 *    Launches that share one communicator must still be ordered (see ubnext_launch_t).
 *  - Without a usable GPU (no device, no driver) calls that need CUDA return
 *    UBNEXT_STATUS_NO_DEVICE; they never abort, hang or print.
 */
#ifndef UBNEXT_H_
#define UBNEXT_H_

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#define UBNEXT_API
#elif defined(__GNUC__)
/* The library is built with hidden visibility; only what is marked here is exported. */
#define UBNEXT_API __attribute__((visibility("default")))
#else
#define UBNEXT_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------------------------------- */
/* Version                                                                                  */
/* ---------------------------------------------------------------------------------------- */

#define UBNEXT_VERSION_MAJOR 0
#define UBNEXT_VERSION_MINOR 1
#define UBNEXT_VERSION_PATCH 0
/* Comparable integer: UBNEXT_VERSION >= UBNEXT_VERSION_CODE(0, 1, 0). */
#define UBNEXT_VERSION_CODE(major, minor, patch) ((major) * 10000 + (minor) * 100 + (patch))
#define UBNEXT_VERSION UBNEXT_VERSION_CODE(UBNEXT_VERSION_MAJOR, UBNEXT_VERSION_MINOR, UBNEXT_VERSION_PATCH)

/* ---------------------------------------------------------------------------------------- */
/* Status and errors                                                                        */
/* ---------------------------------------------------------------------------------------- */

typedef enum ubnext_status {
  UBNEXT_STATUS_SUCCESS = 0,
  /* An argument was rejected before anything was launched; nothing happened. */
  UBNEXT_STATUS_INVALID_ARGUMENT = 1,
  /* No CUDA device or no driver in this process. */
  UBNEXT_STATUS_NO_DEVICE = 2,
  /* A CUDA call failed; the last-error text names the call and the CUDA error. */
  UBNEXT_STATUS_CUDA_ERROR = 3,
  /* A kernel gave up waiting for a peer (reported by ubnext_take_kernel_error). */
  UBNEXT_STATUS_TIMEOUT = 4,
  /* Valid request that this build, device or descriptor cannot serve (for example an
   * algorithm needing multicast on a pool without it, or a kernel not compiled in). */
  UBNEXT_STATUS_UNSUPPORTED = 5,
  /* The message does not fit the space the descriptor provides (Lamport buffers, data
   * arena); a caller can fall back to another algorithm. */
  UBNEXT_STATUS_NO_ROOM = 6,
  /* A bug in ubnext or a corrupted descriptor / error word. */
  UBNEXT_STATUS_INTERNAL = 7,
  /* A kernel stopped waiting for a peer that had left: it set its word of UBNEXT_SYNC_DEPARTED in
   * this rank's sync region (closed its communicator, or its process exited), as ubnext's Python
   * host does and a C host may (reported by ubnext_take_kernel_error). */
  UBNEXT_STATUS_PEER_LEFT = 8
} ubnext_status_t;

/* Number of status codes; codes are 0 .. UBNEXT_STATUS_COUNT-1. */
#define UBNEXT_STATUS_COUNT 9

/* Static, never-NULL name of a status ("UBNEXT_STATUS_TIMEOUT"); unknown values give
 * "UBNEXT_STATUS_<unknown>". */
UBNEXT_API const char* ubnext_status_string(ubnext_status_t status);

/* Detail of the most recent call on this thread that returned ubnext_status_t: empty after
 * success. Never NULL. The text belongs to the library and stays valid until the next ubnext
 * call on the same thread. */
UBNEXT_API const char* ubnext_get_last_error_string(void);

/* Version of the loaded library (may differ from the header's UBNEXT_VERSION_*).
 * Any of the pointers may be NULL. Never fails. */
UBNEXT_API void ubnext_get_version(int* major, int* minor, int* patch);

/* ---------------------------------------------------------------------------------------- */
/* Data types                                                                               */
/* ---------------------------------------------------------------------------------------- */

typedef enum ubnext_dtype {
  UBNEXT_DTYPE_BF16 = 0,
  UBNEXT_DTYPE_FP16 = 1,
  UBNEXT_DTYPE_FP32 = 2,
  /* Output-only format, produced by the fused op with FP8 scaling; never an input. */
  UBNEXT_DTYPE_FP8_E4M3 = 3
} ubnext_dtype_t;

/* Bytes per element, or 0 for a value that is not a ubnext_dtype_t. */
UBNEXT_API size_t ubnext_dtype_size(ubnext_dtype_t dtype);

/* ---------------------------------------------------------------------------------------- */
/* Devices                                                                                  */
/* ---------------------------------------------------------------------------------------- */

/* Number of visible CUDA devices. Without a device or driver: *count = 0 and
 * UBNEXT_STATUS_NO_DEVICE. Errors: INVALID_ARGUMENT (count NULL), NO_DEVICE, CUDA_ERROR. */
UBNEXT_API ubnext_status_t ubnext_device_count(int* count);

/* ---------------------------------------------------------------------------------------- */
/* Launch configuration                                                                     */
/* ---------------------------------------------------------------------------------------- */

/* Allreduce algorithms; see docs/ARCHITECTURE.md for the protocols. "Arena" is this rank's
 * data arena of the symmetric pool, [peer_base[rank] + data_off, peer_base[rank] + pool_bytes);
 * "anywhere" means any device memory. Buffer contracts of ubnext_allreduce:
 *  LAMPORT       one-shot push into Lamport buffers; lowest latency. `in` anywhere, not
 *                modified; `out` anywhere, may equal `in`. Needs count * dtype size, rounded up
 *                to 16 bytes, plus the 16-byte call header (UBNEXT_LAMPORT_HEADER_BYTES),
 *                <= the descriptor's lamport_slot_bytes. Every rank compares its peers' call
 *                headers (dtype, count, hidden, flags): a difference is UBNEXT_ERR_MISMATCH.
 *  NVLS_ONESHOT  every rank reduces the whole message through the multicast address. `in` in
 *                the arena, not modified (peers read it during the call); `out` anywhere but
 *                never on `in`. Needs multicast. Ranks may differ in the last bits (the switch
 *                picks the reduction order), hence never fused.
 *  NVLS_TWOSHOT  multicast reduce-scatter + broadcast. `in` in the arena and OVERWRITTEN with
 *                the allreduce result; `out` may equal `in`, or be any buffer not overlapping
 *                it (the result is copied there after the exchange). Plain allreduce with `out`
 *                in the arena too (at the same offset on every rank, checked as the call header):
 *                the broadcast goes straight into `out`, and `in` is left unmodified. Needs
 *                multicast. Bitwise identical on every rank.
 *  NVLS_LAMPORT  NVLS two-shot whose broadcast lands in the Lamport buffers. `in` in the arena,
 *                not modified; `out` anywhere but never on `in`. Needs multicast, and the
 *                message (rounded up to 16 bytes) must fit the Lamport slot with the same
 *                16-byte margin as LAMPORT (one bound for both Lamport-buffer algorithms).
 *  TWOSHOT       unicast reduce-scatter + broadcast; `in` and `out` as NVLS_TWOSHOT (`in` is
 *                overwritten with the result). No multicast.
 * Everywhere: `out` equals `in` (where allowed above) or does not overlap it.
 * Fused op (ubnext_allreduce_add_rmsnorm, every algorithm but NVLS_ONESHOT): `in` as above; the
 * row math runs on every rank after the exchange, so `out`, `residual`, `residual_out`,
 * `weight`, `scale` and `scale_inv` lie anywhere (see ubnext_rmsnorm_args_t). */
typedef enum ubnext_algo {
  UBNEXT_ALGO_LAMPORT = 0,
  UBNEXT_ALGO_NVLS_ONESHOT = 1,
  UBNEXT_ALGO_NVLS_TWOSHOT = 2,
  UBNEXT_ALGO_NVLS_LAMPORT = 3,
  UBNEXT_ALGO_TWOSHOT = 4
} ubnext_algo_t;

/* Static name of an algorithm ("lamport", "nvls_twoshot", ...) or "unknown". */
UBNEXT_API const char* ubnext_algo_string(ubnext_algo_t algo);

/* ubnext_launch_t.flags */
/* LAMPORT only: push once through the multicast address instead of once per peer. */
#define UBNEXT_LAUNCH_LAMPORT_MULTICAST 1u
/* Launch in plain stream order. Without it, on sm_90 and later, kernels are launched with the
 * programmatic-stream-serialization attribute (programmatic dependent launch): a kernel may start
 * while the kernel before it on the stream is ending, and waits for it (griddepcontrol.wait)
 * before it touches memory, so stream order still holds for every buffer. What Python's
 * UBNEXT_PDL=0 does (the C library reads no environment variable). Any collective. */
#define UBNEXT_LAUNCH_NO_PDL 2u

/* The communicator descriptor; layout in <ubnext/desc.cuh>. Left incomplete here so that
 * this header stays free of it; include desc.cuh to fill one. */
struct ubnext_comm_desc;

/* Where and how to launch. Initialise with UBNEXT_LAUNCH_INIT so that struct_size is set and
 * every later-added field takes its default.
 *
 * Ordering: a launch is enqueued on `stream` and the call returns before it runs. Launches
 * that share one descriptor must be issued from one stream (or be ordered by events) and in
 * the same order on every rank: two streams on one sync region deadlock. */
typedef struct ubnext_launch {
  /* sizeof(ubnext_launch_t) as the caller compiled it (versioning). */
  size_t struct_size;
  /* This rank's descriptor in DEVICE memory (the pool base). */
  const struct ubnext_comm_desc* desc;
  /* A HOST copy of the same descriptor, read during the call to validate the request
   * (rank, multicast, buffer capacity, arena bounds) and passed to the kernel by value (its
   * fields then sit in the kernel's constant bank). Must match `desc`. */
  const struct ubnext_comm_desc* host_desc;
  /* A cudaStream_t; NULL is the legacy default stream. */
  void* stream;
  /* Blocks, 1..128 and at most the kernel's co-resident limit. 0 picks the rule the Python
   * launcher uses (ubnext/comm.py): fused op, one block per token row, min(tokens, SM count);
   * plain allreduce, one 16-byte vector per thread of the vectors this rank reduces --
   * ceil(vectors / nranks) for NVLS_TWOSHOT, TWOSHOT and NVLS_LAMPORT, the whole message for
   * LAMPORT and NVLS_ONESHOT -- capped at the SM count. Always capped at 128 and the
   * co-resident limit. Must be equal on every rank: pass it explicitly when ranks run
   * different GPU models. */
  unsigned int grid;
  /* Threads per block, a multiple of 32 up to 1024; 0 means 256. Equal on every rank. */
  unsigned int block;
  /* UBNEXT_LAUNCH_* bits. */
  unsigned int flags;
} ubnext_launch_t;

#define UBNEXT_LAUNCH_INIT {sizeof(ubnext_launch_t), NULL, NULL, NULL, 0u, 0u, 0u}

/* ---------------------------------------------------------------------------------------- */
/* Collectives                                                                              */
/* ---------------------------------------------------------------------------------------- */

/*
 * Rules shared by ubnext_allreduce and ubnext_allreduce_add_rmsnorm:
 *
 * Collective: every rank of the communicator makes the same call (algo, dtype, count, hidden,
 *   FP8 mode, grid, block, flags), in the same order. A rank that does not makes the others
 *   time out; the timeout surfaces through ubnext_take_kernel_error(), not as a return value.
 * Stream ordering: enqueued on launch->stream; returns before the kernel runs. The input is
 *   read and the outputs written in stream order; keep every buffer alive until then.
 * CUDA graphs: capturable (no host synchronisation, allocation or stream query); a replay is
 *   correct because the Lamport buffer rotation lives in device memory. Make the first call
 *   of each algorithm and dtype on a device outside capture: it loads the kernel module and
 *   probes the launch limits.
 * Buffers: device pointers, 16-byte aligned, placed as the algorithm requires (see
 *   ubnext_algo_t); 1 <= count <= INT32_MAX, any count (a partial last 16-byte vector is
 *   handled; nothing is stored past `count` elements). The padded size, count * dtype size
 *   rounded up to 16 bytes, is what must fit the arena (`in`) and the Lamport slot.
 * Ownership: every pointer is borrowed for the duration of the enqueued kernel; `in` of
 *   NVLS_TWOSHOT and TWOSHOT is written by this rank and its peers during the call.
 * Errors: INVALID_ARGUMENT (all checked before any CUDA call, except an explicit grid above
 *   the kernel's co-resident limit), NO_ROOM (the message exceeds the descriptor's Lamport
 *   slot), UNSUPPORTED (no multicast for an NVLS algorithm, kernel not compiled in),
 *   NO_DEVICE, CUDA_ERROR (the launch failed; the CUDA error is consumed, so it does not
 *   resurface from cudaGetLastError in unrelated code).
 */

/* out[i] = sum over ranks of in[i], for i < count, in `dtype` (bf16, fp16 or fp32; summed in
 * fp32). `in` and `out` as the algorithm requires (see ubnext_algo_t): NVLS_TWOSHOT and TWOSHOT
 * also leave the result in `in`; the others leave `in` unmodified. Collective, stream-ordered
 * and capturable as described above. */
UBNEXT_API ubnext_status_t ubnext_allreduce(const ubnext_launch_t* launch, ubnext_algo_t algo, ubnext_dtype_t dtype,
                                            const void* in, void* out, size_t count);

/* FP8 output of the fused op; the scale travels as scale_inv (dequantisation factor):
 * y ~= float(out) * scale_inv. */
typedef enum ubnext_fp8_scaling {
  /* Output in the input dtype. scale and scale_inv must be NULL. */
  UBNEXT_FP8_NONE = 0,
  /* e4m3 output, q = sat(y / *scale); *scale_inv = *scale. scale: 1 float in device
   * memory, read by the kernel (so a graph picks up a new value on replay). */
  UBNEXT_FP8_STATIC = 1,
  /* e4m3 output, one scale per token: scale_inv[m] = max(amax_m / 448, tiny). scale NULL. */
  UBNEXT_FP8_PER_TOKEN = 2
} ubnext_fp8_scaling_t;

/* Arguments of the fused allreduce + residual add + RMSNorm. Initialise with
 * UBNEXT_RMSNORM_ARGS_INIT. All pointers are device memory. With `tokens = count / hidden`:
 *   r              = allreduce(in) + residual
 *   residual_out   = r                                   (tokens x hidden, dtype)
 *   out            = r / sqrt(mean_row(r^2) + eps) * weight   (dtype or e4m3, see fp8)
 * Placement: `in` as the algorithm requires (see ubnext_algo_t; NVLS_TWOSHOT and TWOSHOT
 * overwrite it with the allreduce result). Every rank runs the row math on every row after the
 * exchange, from its own residual and weight, so `out`, `residual`, `residual_out`, `weight`,
 * `scale` and `scale_inv` may lie anywhere; they need not be in the pool. Overlaps: `out` may
 * equal `in` for dtype output with LAMPORT, NVLS_TWOSHOT and TWOSHOT; e4m3 output never
 * overlaps `in`; `residual_out` may equal `residual`; otherwise no buffer the kernel writes
 * (`in`, `out`, `residual_out`, `scale_inv`) overlaps any other buffer here. Ranks get
 * bitwise-identical results given identical residual and weight. */
typedef struct ubnext_rmsnorm_args {
  size_t struct_size;
  const void* in;       /* this rank's partial sums, count elements of dtype */
  void* out;            /* count elements: dtype, or bytes of e4m3 when fp8 != NONE */
  const void* residual; /* count elements of dtype */
  void* residual_out;   /* count elements of dtype; may alias residual */
  const void* weight;   /* hidden elements of dtype */
  size_t count;         /* elements, a multiple of hidden, 1..INT32_MAX */
  size_t hidden;        /* row length; hidden * dtype size a multiple of 16 bytes */
  float eps;            /* finite, >= 0 */
  ubnext_fp8_scaling_t fp8;
  const float* scale;   /* FP8_STATIC: 1 float */
  float* scale_inv;     /* FP8_STATIC: 1 float; FP8_PER_TOKEN: count / hidden floats */
} ubnext_rmsnorm_args_t;

#define UBNEXT_RMSNORM_ARGS_INIT \
  {sizeof(ubnext_rmsnorm_args_t), NULL, NULL, NULL, NULL, NULL, 0, 0, 1e-6f, UBNEXT_FP8_NONE, NULL, NULL}

/* The fused op above with `algo` LAMPORT, NVLS_TWOSHOT, NVLS_LAMPORT or TWOSHOT (NVLS_ONESHOT
 * gives UNSUPPORTED: ranks could normalise different bits). Buffers as ubnext_rmsnorm_args_t
 * says; `args` itself is read during the call only. Collective (args.count, hidden, eps and fp8
 * equal on every rank: the kernels compare all four, a difference is a mismatch reported through
 * ubnext_take_kernel_error; residual, weight and a static scale's value must be equal too, and are not
 * compared), stream-ordered, capturable, with the error rules of ubnext_allreduce. */
UBNEXT_API ubnext_status_t ubnext_allreduce_add_rmsnorm(const ubnext_launch_t* launch, ubnext_algo_t algo,
                                                        ubnext_dtype_t dtype, const ubnext_rmsnorm_args_t* args);

/* ---------------------------------------------------------------------------------------- */
/* FSDP collectives and FP8 quantisation                                                    */
/* ---------------------------------------------------------------------------------------- */

/* All-gather of bytes, one shot: rank r's `in` lands at out + r * bytes on every rank. `out`
 * (nranks * bytes, 16-byte aligned) lies in the data arena at the same offset on every rank (the
 * kernel compares the offsets: a mismatch is reported through ubnext_take_kernel_error); `in`
 * (bytes, 4-byte aligned) lies anywhere and may be this rank's own slice of `out` (it is then not
 * copied again), but may not overlap `out` otherwise. bytes % 4 == 0 and 1 <= bytes <= INT32_MAX.
 * The kernel pushes through the multicast address when the descriptor has one, else once per peer.
 * launch->flags: 0 or UBNEXT_LAUNCH_NO_PDL. Collective (bytes equal on every rank), stream-ordered, capturable,
 * with the error rules of ubnext_allreduce. */
UBNEXT_API ubnext_status_t ubnext_allgather(const ubnext_launch_t* launch, const void* in, void* out, size_t bytes);

/* Reduce-scatter: out[i] = dtype(factor * sum over ranks r of in_r[rank * count + i]) for
 * i < count, the sum in fp32 in rank order 0..N-1 and rounded once (bf16/fp16 inputs keep their
 * traffic and gain fp32 accumulation). `in` (nranks * count elements) lies in the data arena at
 * the same offset on every rank and is not modified; `out` (count elements, 16-byte aligned) lies
 * anywhere, not overlapping `in`. count * dtype size must be a multiple of 16 bytes; factor finite
 * (1 for a sum, 1/nranks for an average). launch->flags: 0 or UBNEXT_LAUNCH_NO_PDL. Collective (dtype, count and
 * factor equal on every rank), stream-ordered, capturable, with the error rules of
 * ubnext_allreduce. */
UBNEXT_API ubnext_status_t ubnext_reduce_scatter(const ubnext_launch_t* launch, ubnext_dtype_t dtype, const void* in,
                                                 void* out, size_t count, float factor);

/* FP8 (e4m3) quantisation of `count` elements of `in` into `out` (count bytes, 8-byte aligned),
 * with its scale_inv written by the same kernel (the contract of ubnext_fp8_scaling_t):
 * FP8_PER_TOKEN: one scale per row of `hidden` elements, scale_inv[row] = max(amax / 448, 1e-12)
 * (hidden == count: one scale for the whole tensor); FP8_STATIC: q = sat(x / *scale) and
 * *scale_inv = *scale (scale: 1 float in device memory). hidden must divide count, and
 * hidden * dtype size be a multiple of 16 bytes. `in` 16-byte aligned; in, out and scale_inv do
 * not overlap. Local (no descriptor, no peer), enqueued on `stream` (a cudaStream_t, NULL: the
 * legacy default stream) in plain stream order (no programmatic dependent launch), capturable. */
UBNEXT_API ubnext_status_t ubnext_quantize_fp8(void* stream, ubnext_dtype_t dtype, ubnext_fp8_scaling_t scaling,
                                               const void* in, void* out, size_t count, size_t hidden,
                                               const float* scale, float* scale_inv);

/* ---------------------------------------------------------------------------------------- */
/* Kernel-side errors                                                                       */
/* ---------------------------------------------------------------------------------------- */

/* Reads and clears the error word that kernels of this communicator write (host_desc->err_ptr:
 * host-visible uint32_t[UBNEXT_ERR_WORDS] = {code, op, rank, peer, field, mine, theirs, aborted},
 * mapped pinned memory). Returns SUCCESS if no kernel reported an error, TIMEOUT (last-error
 * text names the op, this rank and the peer it waited for), INVALID_ARGUMENT when ranks made
 * different calls (UBNEXT_ERR_MISMATCH: the text names the differing call-header field and both
 * values, e.g. the pool offsets of `in`), PEER_LEFT
 * (the peer it waited for had left: UBNEXT_ERR_PEER_LEFT), or INTERNAL (unknown code). Not collective, no CUDA call, not ordered with
 * any stream: call it after synchronising the stream (or polling an event) so that the
 * kernels that could write it have finished. A timeout, a departure or a mismatch aborts the communicator
 * on every rank: every later kernel of it returns at once and reports the original failure again
 * (the text then starts "communicator aborted: "). Rebuild it (a fresh, zeroed sync region)
 * before the next collective. */
UBNEXT_API ubnext_status_t ubnext_take_kernel_error(const struct ubnext_comm_desc* host_desc);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* UBNEXT_H_ */
