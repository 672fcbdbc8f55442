// Communicator descriptor and sync-region layout. Read by kernels, packed by ubnext/pool.py
// (field order checked by tests/unit/test_abi.py), and used by the C API.
// Plain C so that include/ubnext.h users and the emulator can share it.
#pragma once

#define UBNEXT_MAX_RANKS 16
#define UBNEXT_MAX_BLOCKS 128
#define UBNEXT_DESC_BYTES 4096
#define UBNEXT_SYNC_BYTES 81920
#define UBNEXT_DESC_MAGIC 0x55424e5800000002ull /* "UBNX" v2: 80 KiB sync region with call headers */

/* Flags: kernel parameter `flags`. */
#define UBNEXT_F_FUSED_NORM 1
#define UBNEXT_F_FP8_STATIC 2
#define UBNEXT_F_FP8_PER_TOKEN 4
#define UBNEXT_F_MULTICAST 8
/* A block-scaled output of the fused norm (issue 28; csrc/device/blockscale.cuh): a two-bit format field
 * (out = q, scale = NVFP4's global scale or null, scale_inv = the block scales), the scales' to_blocked
 * layout, and fp8_group128's power-of-two scales. The standalone quantize kernels name their format and
 * read SWIZZLED and UE8M0 only. In the low 16 bits, so that the call headers compare them across ranks. */
#define UBNEXT_F_BLOCK_FMT_MASK 0x30
#define UBNEXT_F_BLOCK_NVFP4 0x10
#define UBNEXT_F_BLOCK_MXFP8 0x20
#define UBNEXT_F_BLOCK_GROUP128 0x30
#define UBNEXT_F_BLOCK_SWIZZLED 0x40
#define UBNEXT_F_BLOCK_UE8M0 0x80
/* The plain nvls_twoshot / nvls_lamport sum their portion by unicast loads in rank order (fp32, one
 * rounding: slices.cuh sum_over_ranks) instead of multimem.ld_reduce, keeping the multicast broadcast:
 * the batch-invariant mode's form of them (issue 26). Bit 15, the top of the 16 flag bits that every
 * call header carries (barrier.cuh call_header, lamport.cu: (flags & 0xffff) << 16), so ranks that
 * disagree on it fail with a mismatch instead of summing in two orders; set far from the low bits
 * that the output formats use. */
#define UBNEXT_F_RANK_ORDER 0x8000

/* The error word, err_ptr[0..7] = {code, op, rank, peer, field, mine, theirs, aborted}: the first
 * kernel thread to fail takes this rank's lock word UBNEXT_SYNC_ERR_LOCK (device memory), writes the
 * other words, a system fence, then the code, and releases the lock (csrc/device/barrier.cuh,
 * write_error_word): a nonzero code orders the whole record before it. field/mine/theirs are set for
 * a mismatch only. `rank` is the rank that detected the failure; aborted = 1 when this rank stopped
 * because the communicator had been aborted (by that rank, or by this one in an earlier launch), not
 * because it detected the failure itself in this launch. */
#define UBNEXT_ERR_WORDS 8
#define UBNEXT_ERR_TIMEOUT 1
#define UBNEXT_ERR_MISMATCH 2 /* a peer's call header differs from ours (field, mine, theirs) */
#define UBNEXT_ERR_PEER_LEFT 3 /* the awaited peer closed its communicator or its process exited */
#define UBNEXT_ERR_INTERRUPTED 4 /* written by the host only: a rank interrupted (SIGINT) while it waited */
#define UBNEXT_OP_LAMPORT 1
#define UBNEXT_OP_NVLS_ONESHOT 2
#define UBNEXT_OP_NVLS_TWOSHOT 3
#define UBNEXT_OP_NVLS_LAMPORT 4
#define UBNEXT_OP_TWOSHOT 5
#define UBNEXT_OP_ALLGATHER 6
#define UBNEXT_OP_REDUCE_SCATTER 7

/* Every field is 64 bits wide so that the layout is the same for every compiler and for
 * Python's struct.pack("<...Q"). */
typedef struct ubnext_comm_desc {
  unsigned long long magic;
  unsigned long long rank;
  unsigned long long nranks;
  unsigned long long timeout_ns;
  unsigned long long err_ptr;            /* host-visible uint32_t[UBNEXT_ERR_WORDS] */
  unsigned long long mc_base;            /* multicast address of the pool base, 0 if none */
  unsigned long long sync_off;
  unsigned long long lamport_off;
  unsigned long long lamport_slot_bytes; /* capacity of one rank's slot in one buffer */
  unsigned long long data_off;
  unsigned long long pool_bytes;
  unsigned long long reserved[5];
  unsigned long long peer_base[UBNEXT_MAX_RANKS]; /* every rank's pool base, in this process */
} ubnext_comm_desc;

/* Sync region, in 32-bit words from sync_off. */
#define UBNEXT_SYNC_LAMPORT_CALL 0
#define UBNEXT_SYNC_LAMPORT_BLOCKS_DONE 1
#define UBNEXT_SYNC_LAMPORT_BYTES 2 /* [3] */
/* A Lamport one-shot slot starts with the pushing rank's call header (lamport.cu), then the data. Its
 * words: UBNEXT_HDR_KIND, _COUNT, _HIDDEN, then the eps word (lamport_poll.cuh, lamport_call_header),
 * where a barrier header has the `in` offset. */
#define UBNEXT_LAMPORT_HEADER_BYTES 16
/* Sticky abort (barrier.cuh): 0, or 1 + the rank whose failure aborted the communicator. Any rank
 * sets it in every rank's sync region (plain release stores; every writer writes a valid value). */
#define UBNEXT_SYNC_ABORT 8
/* Local: 0 until this rank has broadcast its abort (CAS 0 -> 1 by the first failing thread). */
#define UBNEXT_SYNC_ABORT_CLAIM 9
/* Local: the error word's lock (barrier.cuh, write_error_word), 1 only while a thread of this rank copies
 * its record to the host word; 0 between launches. */
#define UBNEXT_SYNC_ERR_LOCK 10
/* [UBNEXT_MAX_RANKS] words: word [r] is 1 once rank r has left for good (closed its communicator or
 * exited). Rank r writes it into every rank's region from the host (ubnext/pool/symmetric.py,
 * announce_departure); a wait for peer r reads it (barrier.cuh, wait_verdict). */
#define UBNEXT_SYNC_DEPARTED 16
/* [UBNEXT_MAX_RANKS][8] words: record [r] is written only by rank r, before it sets ABORT:
 * {code, op, peer, field, mine, theirs, 0, 0} of the failure rank r detected. */
#define UBNEXT_SYNC_ABORT_RECORD 256
/* [2][UBNEXT_MAX_RANKS] words, peers write: the eps word of a fused call (UBNEXT_HDR_EPS), published by
 * block 0 of every barrier kernel with its call header and compared by block 0 only (barrier.cuh says why
 * the header's four words have no room for it and why block 0 suffices). The first index is the parity of
 * block 0's barrier epoch, as for the headers. */
#define UBNEXT_SYNC_CALL_EPS 384
#define UBNEXT_SYNC_CALL_EPS_END 416
#define UBNEXT_SYNC_BARRIER_EPOCH 64 /* [UBNEXT_MAX_BLOCKS], local */
/* Test-only (the build UBNEXT_STAMPS, csrc/device/stamps.cuh; tests/gpu_check/stamps.py decodes it), local:
 * [UBNEXT_STAMP_COUNT] 64-bit %globaltimer stamps of this rank's last stamped Lamport call, each phase where
 * thread 0 of CTA 0 passed it. Words 416..1023 are otherwise unused; the record starts 8-byte aligned. The
 * normal build never reads or writes it. */
#define UBNEXT_SYNC_STAMPS 512
#define UBNEXT_STAMP_COUNT (5 + UBNEXT_MAX_RANKS) /* entry, wait, push, row exchange, exit; then one per slot */
#define UBNEXT_SYNC_STAMPS_END 576
#define UBNEXT_SYNC_BARRIER_FLAG 1024 /* [UBNEXT_MAX_BLOCKS][UBNEXT_MAX_RANKS], peers write */
/* Words 3072..4095 are unused: the fused row split's exchange (norm.cuh, norm_row_part) moved from them into
 * distributed shared memory (issue 38 item 2). */
/* Call headers, published with the first barrier signal of every kernel that reads its peers'
 * `in` at its own offset: [2][UBNEXT_MAX_BLOCKS][UBNEXT_MAX_RANKS][4] words, peers write. The
 * first index is the parity of the barrier epoch that carries the header: a peer can be one
 * barrier ahead, and its next header must not overwrite the one we have yet to read. */
#define UBNEXT_SYNC_CALL_HEADER 4096
/* Words of a call header (also the `field` of a mismatch error). */
#define UBNEXT_HDR_KIND 0      /* op | dtype << 8 | (flags & 0xffff) << 16 */
#define UBNEXT_HDR_COUNT 1     /* n */
#define UBNEXT_HDR_HIDDEN 2    /* hidden */
#define UBNEXT_HDR_IN_OFFSET 3 /* offset of `in` from the pool base, in 16-byte units */
/* A fused call's RMSNorm eps, as its fp32 bits (barrier.cuh header_eps; 0 for a plain call): word 3 of a
 * Lamport header, the UBNEXT_SYNC_CALL_EPS word beside a barrier header. */
#define UBNEXT_HDR_EPS 4
/* dtype codes in a call header */
#define UBNEXT_HDR_DTYPE_BF16 1
#define UBNEXT_HDR_DTYPE_FP16 2
#define UBNEXT_HDR_DTYPE_FP32 3
#define UBNEXT_HDR_DTYPE_BYTES 4 /* the all-gather moves bytes whatever they hold */
