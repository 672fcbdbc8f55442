"""The pool's layout: where the descriptor, the sync region, the Lamport buffers and the data arena
lie (the same offsets on every rank), how big each is, and the descriptor's bytes
(csrc/device/desc.cuh)."""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

from .. import envs

DESC_BYTES = 4096
SYNC_BYTES = 81920  # UBNEXT_SYNC_BYTES
MAX_RANKS = 16
DESC_MAGIC = 0x55424E5800000002
PAGE = 4096
# Field order of ubnext_comm_desc (csrc/device/desc.cuh); tests/unit/test_abi.py checks it.
# sizeof(ubnext_comm_desc): what pack_desc returns, and what every kernel takes by value
DESC_STRUCT_BYTES = 8 * (16 + MAX_RANKS)
DESC_FIELDS = (
    "magic",
    "rank",
    "nranks",
    "timeout_ns",
    "err_ptr",
    "mc_base",
    "sync_off",
    "lamport_off",
    "lamport_slot_bytes",
    "data_off",
    "pool_bytes",
    "reserved[5]",
    f"peer_base[{MAX_RANKS}]",
)
LAMPORT_HEADER_BYTES = 16  # UBNEXT_LAMPORT_HEADER_BYTES: a Lamport slot holds the call header, then data
SYNC_DEPARTED = 16  # UBNEXT_SYNC_DEPARTED: sync word [r] set once rank r has left (barrier.cuh)
# the sticky abort (csrc/device/barrier.cuh): UBNEXT_SYNC_ABORT (0, or 1 + the rank whose failure aborted),
# UBNEXT_SYNC_ABORT_CLAIM (local: set by this rank's first failure) and UBNEXT_SYNC_ABORT_RECORD (record [r]
# of 8 words, written by rank r only): a host abort (SymmetricPool.abort_from_host) writes them as a kernel does
SYNC_ABORT, SYNC_ABORT_CLAIM, SYNC_ABORT_RECORD = 8, 9, 256
# UBNEXT_SYNC_ERR_LOCK (local): the error word's lock, held while a kernel thread copies its record to the
# host word (barrier.cuh write_error_word); the host never touches it
SYNC_ERR_LOCK = 10
# UBNEXT_SYNC_STAMPS .. UBNEXT_SYNC_STAMPS_END: sync words of the test-only build UBNEXT_STAMPS, the Lamport
# one-shot's per-phase time stamps (csrc/device/stamps.cuh; tests/gpu_check/stamps.py decodes them)
SYNC_STAMPS = range(512, 576)
ERR_WORDS = 8  # UBNEXT_ERR_WORDS: {code, op, rank, peer, field, mine, theirs, 0}
SENTINEL_WORD = -0x80000000  # 0x80000000 as int32: -0.0f, the Lamport "not yet written" mark


def _align(value: int, to: int) -> int:
    return (value + to - 1) // to * to


def _lcm(*values: int) -> int:
    out = 1
    for v in values:
        out = out * v // math.gcd(out, v)
    return out


@dataclass(frozen=True)
class PoolLayout:
    nranks: int
    lamport_slot_bytes: int
    data_bytes: int
    sized_by: str = ""  # what fixed the sizes, for the messages of calls that do not fit

    @property
    def sync_off(self) -> int:
        return DESC_BYTES

    @property
    def lamport_off(self) -> int:
        return DESC_BYTES + SYNC_BYTES

    @property
    def lamport_bytes(self) -> int:
        return 3 * self.nranks * self.lamport_slot_bytes

    @property
    def lamport_capacity(self) -> int:
        """The bytes a Lamport call may reduce: one slot, less its call header."""
        return self.lamport_slot_bytes - LAMPORT_HEADER_BYTES

    @property
    def data_off(self) -> int:
        return _align(self.lamport_off + self.lamport_bytes, PAGE)

    @property
    def pool_bytes(self) -> int:
        return self.data_off + self.data_bytes

    @property
    def staging_bytes(self) -> int:
        """The staging region: a quarter of the data arena, at its start (a fixed offset)."""
        return self.data_bytes // 4 // 256 * 256


def plan_layout(nranks: int, max_hidden: int, *, elem_bytes: int = 4) -> PoolLayout:
    """Size the pool from ``UBNEXT_MAX_BATCH`` x ``max_hidden`` (fp32 worst case), unless
    ``UBNEXT_SYMM_POOL_SIZE`` (MB) fixes the total."""
    if not 1 <= nranks <= MAX_RANKS:
        raise ValueError(f"ubnext supports 1..{MAX_RANKS} ranks per communicator, got {nranks}")
    if max_hidden <= 0:
        raise ValueError(f"hidden size must be positive, got {max_hidden}")
    raw = envs.get("UBNEXT_MAX_BATCH") * max_hidden * elem_bytes
    message = _align(raw, PAGE)
    slot_bytes = _align(raw + LAMPORT_HEADER_BYTES, PAGE)  # a Lamport slot holds the call header too
    pool_mb = envs.get("UBNEXT_SYMM_POOL_SIZE")
    if pool_mb is None:
        # data arena: the in-place buffer plus room for a GEMM output, residual and norm output,
        # in each of the eager and graph halves
        return PoolLayout(
            nranks,
            slot_bytes,
            8 * message,
            f"UBNEXT_MAX_BATCH={envs.get('UBNEXT_MAX_BATCH')} tokens x hidden {max_hidden} x {elem_bytes} bytes",
        )
    total = pool_mb << 20
    reserved = DESC_BYTES + SYNC_BYTES
    minimum = reserved + 3 * nranks * PAGE + 2 * PAGE
    if total < minimum:
        raise ValueError(
            f"UBNEXT_SYMM_POOL_SIZE={pool_mb} MB is smaller than the reserved region "
            f"({minimum} bytes for {nranks} ranks)"
        )
    # give the Lamport buffers at most half of what is left, the data arena the rest
    slot = min(slot_bytes, (total - reserved) // 2 // (3 * nranks) // PAGE * PAGE)
    slot = max(slot, PAGE)
    data = total - _align(reserved + 3 * nranks * slot, PAGE)
    return PoolLayout(nranks, slot, data, f"UBNEXT_SYMM_POOL_SIZE={pool_mb} MB")


def pack_desc(
    *, rank: int, nranks: int, timeout_ns: int, err_ptr: int, mc_base: int, layout: PoolLayout, peer_bases: list[int]
) -> bytes:
    if len(peer_bases) != nranks:
        raise ValueError("one peer base per rank")
    values = (
        [
            DESC_MAGIC,
            rank,
            nranks,
            timeout_ns,
            err_ptr,
            mc_base,
            layout.sync_off,
            layout.lamport_off,
            layout.lamport_slot_bytes,
            layout.data_off,
            layout.pool_bytes,
            0,
            0,
            0,
            0,
            0,
        ]
        + list(peer_bases)
        + [0] * (MAX_RANKS - nranks)
    )
    return struct.pack(f"<{len(values)}Q", *values)
