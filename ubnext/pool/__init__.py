"""The symmetric memory pool: one per communicator, the same layout and offsets on every rank.

Layout (layout.py; docs/ARCHITECTURE.md, csrc/device/desc.cuh)::

    [0, 4096)                       this rank's ubnext_comm_desc
    [sync_off, +80 KiB)             rotation counters and barrier flags (zeroed)
    [lamport_off, +3*nranks*slot)   three Lamport buffers (poisoned with -0.0f words)
    [data_off, pool_bytes)          data arena: eager half, then CUDA-graph half

Backends, behind one interface (``UBNEXT_POOL_BACKEND``):

* ``torch_symm``: torch symmetric memory (``symm_mem.empty`` + ``rendezvous``); default on GPUs.
* ``vmm``: ubnext's own cuMem VMM allocation through cuda-python, POSIX-fd handles passed over
  Unix sockets, a multicast object where the driver supports it.
* ``emulator``: shared memfd host memory for the CPU emulator.

Allocations from the data arena are deterministic (same call order, same offsets on every
rank) and are freed when the returned tensor is released.
"""

from __future__ import annotations

from ._backend import PoolSetupError, _Backend, _Slot, release_deferred
from .allocator import NoRoom
from .emulator import EmulatorBackend
from .layout import (
    DESC_BYTES,
    DESC_FIELDS,
    DESC_MAGIC,
    DESC_STRUCT_BYTES,
    ERR_WORDS,
    LAMPORT_HEADER_BYTES,
    MAX_RANKS,
    PAGE,
    SENTINEL_WORD,
    SYNC_ABORT,
    SYNC_ABORT_CLAIM,
    SYNC_ABORT_RECORD,
    SYNC_BYTES,
    SYNC_DEPARTED,
    SYNC_ERR_LOCK,
    PoolLayout,
    pack_desc,
    plan_layout,
)
from .symmetric import SymmetricPool
from .torch_symm import TORCH_SYMM_SEGMENT, TorchSymmBackend
from .vmm import VmmBackend

# the pool's names, where every caller (and the tests) import them from
__all__ = [
    "PoolLayout",
    "SymmetricPool",
    "NoRoom",
    "PoolSetupError",
    "DESC_FIELDS",
    "DESC_BYTES",
    "DESC_STRUCT_BYTES",
    "DESC_MAGIC",
    "ERR_WORDS",
    "LAMPORT_HEADER_BYTES",
    "MAX_RANKS",
    "PAGE",
    "SENTINEL_WORD",
    "SYNC_ABORT",
    "SYNC_ABORT_CLAIM",
    "SYNC_ABORT_RECORD",
    "SYNC_BYTES",
    "SYNC_DEPARTED",
    "SYNC_ERR_LOCK",
    "TORCH_SYMM_SEGMENT",
    "EmulatorBackend",
    "TorchSymmBackend",
    "VmmBackend",
    "pack_desc",
    "plan_layout",
    "release_deferred",
    "_Backend",
    "_Slot",
]
