"""Helpers shared by the emulator's own tests (tests/unit/test_emu*.py, tests/mpi/emu_worker.py):
kernel arguments by name, pointers of numpy arrays, and a descriptor packed as csrc/device/desc.cuh
lays it out. Deliberately independent of ubnext.pool, so that the emulator is tested on its own."""

from __future__ import annotations

import numpy as np

SIGNATURE = (
    "desc",
    "in",
    "out",
    "residual",
    "residual_out",
    "weight",
    "scale",
    "scale_inv",
    "n",
    "hidden",
    "eps",
    "flags",
)
TYPES = ("desc",) + ("ptr",) * 7 + ("i32", "i32", "f32", "i32")  # desc: by value (pack_desc's array)
MAX_RANKS = 16
SYNC_BARRIER_FLAG = 1024  # UBNEXT_SYNC_BARRIER_FLAG, in u32 words


def ptr(a) -> int:
    return 0 if a is None else int(a.__array_interface__["data"][0])


class KernelArgs(list):
    """(type, value) pairs that also hold the arrays whose addresses they carry: an array
    written inline (``kargs(out=np.zeros(...))``) must outlive the launch, or the kernel writes
    into freed memory (seen as heap corruption with numpy 1.24)."""

    def __init__(self, pairs, arrays):
        super().__init__(pairs)
        self.arrays = arrays


def kargs(**kw) -> KernelArgs:
    """The 12 (type, value) kernel parameters; arrays become their addresses (the descriptor is passed
    by value), the rest is 0."""
    unknown = set(kw) - set(SIGNATURE)
    assert not unknown, unknown
    vals = [kw.get(name, 0) for name in SIGNATURE]
    arrays = [v for v in vals if isinstance(v, np.ndarray)]
    vals = [ptr(v) if isinstance(v, np.ndarray) and kind != "desc" else v for v, kind in zip(vals, TYPES)]
    return KernelArgs(zip(TYPES, vals), arrays)


def pack_desc(
    *,
    rank,
    nranks,
    peer_bases,
    timeout_ns=0,
    err_ptr=0,
    mc_base=0,
    sync_off=0,
    lamport_off=0,
    lamport_slot_bytes=0,
    data_off=0,
    pool_bytes=0,
) -> np.ndarray:
    """ubnext_comm_desc as a uint64 array (magic, rank, nranks, timeout_ns, err_ptr, mc_base,
    sync_off, lamport_off, lamport_slot_bytes, data_off, pool_bytes, reserved[5], peer_base[16])."""
    d = np.zeros(16 + MAX_RANKS, np.uint64)
    d[:11] = [
        0x55424E5800000002,
        rank,
        nranks,
        timeout_ns,
        err_ptr,
        mc_base,
        sync_off,
        lamport_off,
        lamport_slot_bytes,
        data_off,
        pool_bytes,
    ]
    d[16 : 16 + nranks] = peer_bases
    return d


def bf16_round(x: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bits, round to nearest even (finite inputs)."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_to_f32(h: np.ndarray) -> np.ndarray:
    return (np.asarray(h, np.uint16).astype(np.uint32) << 16).view(np.float32)


def reduce_in_order(copies: list[np.ndarray]) -> np.ndarray:
    """fp32 sum of the ranks' values in rank order 0..N-1 (the emulator's non-chaos order)."""
    acc = np.zeros_like(copies[0], dtype=np.float32)
    for c in copies:
        acc = (acc + c.astype(np.float32)).astype(np.float32)
    return acc
