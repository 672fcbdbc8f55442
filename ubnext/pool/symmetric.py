"""The pool itself: one per communicator, over the backend the environment and the machine allow;
the descriptor and the Lamport buffers initialised, the staging region, and the data arenas that
hand out pool tensors."""

from __future__ import annotations

import ctypes
import gc
import logging
import math
import threading
import time
import weakref
from collections.abc import Callable
from typing import cast

import torch

from .. import envs
from ..runtime import _cuda
from ._backend import PoolSetupError, _agree, _Backend, _Slot, release_deferred
from .allocator import Allocator, NoRoom, RingAllocator
from .emulator import EmulatorBackend
from .layout import (
    ERR_WORDS,
    SENTINEL_WORD,
    SYNC_ABORT,
    SYNC_ABORT_CLAIM,
    SYNC_ABORT_RECORD,
    SYNC_BYTES,
    SYNC_DEPARTED,
    PoolLayout,
    pack_desc,
)
from .torch_symm import TorchSymmBackend
from .vmm import VmmBackend

log = logging.getLogger("ubnext")

# Collections under way, by thread (gc.callbacks): see collect_garbage.
_COLLECTING: dict[int, int] = {}
_COLLECTING_LOCK = threading.Lock()


def _on_collection(phase: str, info: dict) -> None:
    me = threading.get_ident()
    with _COLLECTING_LOCK:
        _COLLECTING[me] = _COLLECTING.get(me, 0) + (1 if phase == "start" else -1)
        if not _COLLECTING[me]:
            del _COLLECTING[me]


gc.callbacks.append(_on_collection)


def collect_garbage(patience_s: float = 5.0) -> None:
    """A full garbage collection that has run when this returns. gc.collect() returns at once,
    collecting nothing, while another thread's collection is under way (a finaliser inside it may
    hand the interpreter to this thread): the ring allocator would then decide on uncollected
    garbage that a peer rank has already collected, and the ranks' offsets would differ. So wait
    for the other thread's collection to end (briefly: collections take milliseconds), then run
    one of ours."""
    me = threading.get_ident()
    deadline = time.monotonic() + patience_s
    while True:
        with _COLLECTING_LOCK:
            others = any(t != me for t in _COLLECTING)
        if not others or time.monotonic() > deadline:
            break
        time.sleep(0.0005)
    gc.collect()


# Pools closed after a CUDA graph captured work on them: kept until the process exits.
_KEPT_FOR_GRAPHS: list[SymmetricPool] = []


class SymmetricPool:
    """One communicator's pool: backend memory, descriptor, Lamport buffers, data arenas."""

    def __init__(
        self,
        *,
        layout: PoolLayout,
        rank: int,
        group,
        device: torch.device,
        allgather: Callable[[object], list],
        timeout_s: float,
        backend: str | None = None,
    ):
        release_deferred()
        self.layout = layout
        self.timeout_s = timeout_s  # the kernels' bound on every wait for a peer
        self.rank = rank
        self._allgather = allgather
        name = backend or envs.get("UBNEXT_POOL_BACKEND")
        self.backend = self._open_backend(name, layout, rank, group, device, allgather)
        self.device = self.backend.device
        # this rank's pool; the descriptor sits at its start, so this is also the kernels' first
        # argument, read on every launch
        self.base = self.backend.peer_bases[rank]
        # multicast decides which kernels run: use it only if every rank has it
        self.mc_base = self.backend.mc_base if all(allgather(bool(self.backend.mc_base))) else 0
        log.info(
            "ubnext pool: backend %s, %d bytes, multicast %s",
            self.backend.name,
            layout.pool_bytes,
            "yes" if self.mc_base else "no",
        )
        error = None
        try:
            # host-visible error word (ERR_WORDS): pinned memory is mapped into the GPU's
            # address space under UVA, so kernels write it and the host reads it unsynchronised
            pin = self.device.type == "cuda"
            self.err_word = torch.zeros(ERR_WORDS, dtype=torch.int32, pin_memory=pin)
            self._err_ptr = _device_pointer_of_pinned(self.err_word) if pin else self.err_word.data_ptr()
            self.err_view = self.err_word.numpy()  # the error word again, for the hot path: ~0.1 us to index
            self._initialise()
        except Exception as exc:  # noqa: BLE001 - voted below, then raised on every rank
            error = f"{type(exc).__name__}: {exc}"
        try:
            # also the barrier after which peers may push into our (now poisoned) Lamport buffers
            _agree(allgather, error, "initialising the pool")
        except PoolSetupError:
            self.backend.close()
            raise
        # [staging | eager arena | graph arena]: staging sits at the same offset on every rank and
        # for every call, so where a call stages never depends on this rank's allocation history.
        # Both arenas place a tensor by the sequence of allocations alone, so every rank of SPMD
        # code gets the same offset without asking its peers: the eager ring whatever its garbage
        # collector has returned yet (allocator.py), the graph arena because it never frees.
        rest = layout.data_bytes - layout.staging_bytes
        half = rest // 2 // 256 * 256
        arena_off = layout.data_off + layout.staging_bytes
        self.arenas: dict[str, RingAllocator | Allocator] = {
            "eager": RingAllocator(arena_off, half, min_align=16, collect=collect_garbage),
            "graph": Allocator(arena_off + half, rest - half, min_align=16),
        }
        self._staging_bytes: torch.Tensor | None = _Slot(
            self.base + layout.data_off, layout.staging_bytes, self.device, self.backend
        ).tensor(self.device)
        self._staging_views: dict[tuple, torch.Tensor] = {}
        self.fallbacks = 0
        self.captured = False  # set when captured work used this pool (kernels, staging, graph arena)
        self._graph_tensors: list[torch.Tensor] = []
        self._closed = False

    @staticmethod
    def _open_backend(name, layout, rank, group, device, allgather) -> _Backend:
        size = layout.pool_bytes
        if name == "auto":
            name = "emulator" if device.type == "cpu" else "torch_symm"
        if name == "emulator":
            return EmulatorBackend(size, rank, layout.nranks, allgather)
        if device.type != "cuda":
            raise ValueError(f"pool backend {name!r} needs a CUDA device")
        if name == "torch_symm":
            backend, error = None, None
            try:
                backend = TorchSymmBackend(size, group, device, allgather)
            except Exception as exc:  # refused (e.g. several ranks per GPU) or missing
                error = exc
            # every rank must take the same backend, or the next rendezvous pairs up wrongly
            if all(allgather(backend is not None)):
                return cast(TorchSymmBackend, backend)  # every rank's, this one's too, was made
            if backend is not None:
                backend.close()
            log.warning(
                "ubnext pool: torch symmetric memory unavailable on some rank (%s); using ubnext's own VMM",
                error or "refused on a peer",
            )
        return VmmBackend(size, rank, layout.nranks, device, allgather)

    def _initialise(self) -> None:
        lay = self.layout
        desc = pack_desc(
            rank=self.rank,
            nranks=lay.nranks,
            timeout_ns=min(int(self.timeout_s * 1e9), 2**63),  # a "forever" group timeout still fits
            err_ptr=self._err_ptr,
            mc_base=self.mc_base,
            layout=lay,
            peer_bases=self.backend.peer_bases,
        )
        self.desc = desc  # every kernel takes it by value (csrc/device/entry.cuh); the pool's header holds it too
        local = self.backend.local_tensor()
        local[: len(desc)].copy_(torch.frombuffer(bytearray(desc), dtype=torch.uint8))
        local[lay.sync_off : lay.sync_off + SYNC_BYTES].zero_()
        local[lay.lamport_off : lay.lamport_off + lay.lamport_bytes].view(torch.int32).fill_(SENTINEL_WORD)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- addresses ---------------------------------------------------------------------------

    @property
    def has_multicast(self) -> bool:
        return self.mc_base != 0

    @property
    def lamport_capacity(self) -> int:
        """The bytes a Lamport call may reduce: its slot, less the call header."""
        return self.layout.lamport_capacity

    def contains(self, t: torch.Tensor) -> bool:
        start = t.data_ptr()
        return (
            t.device == self.device
            and self.base + self.layout.data_off <= start
            and start + t.numel() * t.element_size() <= self.base + self.layout.pool_bytes
        )

    # -- allocation --------------------------------------------------------------------------

    def empty(
        self, shape: tuple[int, ...], dtype: torch.dtype, *, align: int = 256, arena: str | None = None
    ) -> torch.Tensor:
        """A tensor in the data arena; raises NoRoom when it does not fit."""
        if self._closed:
            raise RuntimeError("ubnext pool is closed")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        if any((not isinstance(s, int)) or s < 0 for s in shape):
            raise ValueError(f"shape must be non-negative ints, got {shape}")
        elem = dtype.itemsize
        nbytes = elem
        for s in shape:
            nbytes *= s
        if nbytes <= 0:
            raise ValueError(f"pool tensors must hold at least one element, got shape {shape}")
        if arena is None:
            arena = "graph" if _cuda.capturing(self.device) else "eager"
        allocator = self.arenas[arena]
        try:
            offset = allocator.alloc(nbytes, align)
        except NoRoom:
            self.fallbacks += 1
            raise
        slot = _Slot(self.base + offset, nbytes, self.device, self.backend)
        tensor = slot.tensor(self.device).view(dtype).view(shape)
        if arena == "graph":
            # a captured graph reads and writes this memory on every replay, long after the
            # Python tensor is gone: graph-arena memory is held for the pool's lifetime
            self._graph_tensors.append(tensor)
            self.captured = True
        else:
            weakref.finalize(slot, _free_if_open, weakref.ref(self), arena, offset)
        return tensor

    def staging(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A view of the staging region (fixed offset; every call may reuse it: no kernel ends on a
        rank before its peers are done with that rank's input: a final barrier, or for
        nvls_lamport the Lamport polls of data its peers wrote after reading it)."""
        if self._closed:
            raise RuntimeError("ubnext pool is closed")
        if _cuda.capturing(self.device):
            self.captured = True  # a captured GEMM or copy into staging replays after close() too
        key = (tuple(shape), dtype)
        view = self._staging_views.get(key)
        if view is None:
            nbytes = math.prod(shape) * dtype.itemsize
            if nbytes > self.layout.staging_bytes:
                raise NoRoom(f"{nbytes} bytes exceed the staging region ({self.layout.staging_bytes} bytes)")
            with torch.inference_mode(False):  # kept for every later call, in or out of inference mode
                # the region is dropped only by close(), after which staging() raises above
                view = cast(torch.Tensor, self._staging_bytes)[:nbytes].view(dtype).view(shape)
            if len(self._staging_views) < 256:  # the views of a model's few shapes, made once
                self._staging_views[key] = view
        return view

    def offset_of(self, t: torch.Tensor) -> int:
        return t.data_ptr() - self.base

    def stats(self) -> dict[str, int | str]:
        eager, graph = self.arenas["eager"], self.arenas["graph"]
        return {
            "backend": self.backend.name,
            "size": self.layout.pool_bytes,
            "data_bytes": self.layout.data_bytes,
            "staging_bytes": self.layout.staging_bytes,
            "lamport_capacity": self.layout.lamport_capacity,
            "used": eager.stats.used + graph.stats.used,
            "peak": eager.stats.peak + graph.stats.peak,
            "largest_free": max(eager.largest_free(), graph.largest_free()),
            "allocations": eager.stats.allocations + graph.stats.allocations,
            "fallbacks": self.fallbacks,
            "multicast": int(self.has_multicast),
        }

    def announce_departure(self) -> None:
        """Tell every peer that this rank has left for good: set word [rank] of UBNEXT_SYNC_DEPARTED in
        every rank's sync region, so that a peer still waiting for this rank raises within
        UBX_DEPARTED_GRACE_NS instead of the whole timeout (csrc/device/barrier.cuh). The caller has
        finished this rank's work first (its kernels completed): a peer that finds the word set reads
        what it waits for once more, and a call this rank completed still completes there. Not for a
        pool captured into a CUDA graph, whose replays may still need this rank."""
        if self._closed or self.captured:
            return
        words = [base + self.layout.sync_off + 4 * (SYNC_DEPARTED + self.rank) for base in self.backend.peer_bases]
        if self.device.type == "cuda":
            _cuda.store_words(self.device.index, words, 1)
            return
        for address in words:
            ctypes.c_int32.from_address(address).value = 1

    def abort_from_host(self, code: int) -> bool:
        """Abort the communicator on every rank from the host, as a kernel's report_error does
        (csrc/device/barrier.cuh, "Sticky abort"): record [rank] {code, 0, rank, 0, 0, 0} in every rank's
        sync region, then each rank's abort flag; every wait of every rank's kernels ends at its next look
        at the flag (UBX_ABORT_POLL_NS) and reports the record. Nothing when a failure of this rank
        already aborted it (the claim word). Emulator pools only (host memory, written from any thread:
        the Ctrl-C of ubnext/runtime/_watchdog.py); False where it did nothing."""
        if self._closed or self.device.type == "cuda":
            return False
        sync = [base + self.layout.sync_off for base in self.backend.peer_bases]
        claim = ctypes.c_int32.from_address(sync[self.rank] + 4 * SYNC_ABORT_CLAIM)
        if claim.value:
            return False
        claim.value = 1
        for region in sync:
            record = region + 4 * (SYNC_ABORT_RECORD + 8 * self.rank)
            for k, word in enumerate((code, 0, self.rank, 0, 0, 0)):
                ctypes.c_int32.from_address(record + 4 * k).value = word
        for region in sync:  # after every record: the flag publishes it (x86 keeps stores in order)
            ctypes.c_int32.from_address(region + 4 * SYNC_ABORT).value = self.rank + 1
        return True

    def departed_peers(self) -> list[int]:
        """The peers whose departure word (UBNEXT_SYNC_DEPARTED) is set in this rank's sync region: each has
        left, or is closing (close() announces the departure before it agrees; ``Communicator.close``)."""
        if self._closed:
            return []
        start = self.layout.sync_off + 4 * SYNC_DEPARTED
        words = self.backend.local_tensor()[start : start + 4 * self.layout.nranks].view(torch.int32).tolist()
        return [r for r, word in enumerate(words) if word and r != self.rank]

    def close(self) -> None:
        """Collective. The memory is released once no pool tensor points into it (_Backend), and
        never when a kernel of this pool was captured into a CUDA graph: the graph addresses the
        pool directly (its sync region, buffers and staging) and may be replayed at any time."""
        if self._closed:
            return
        self._closed = True
        self._staging_bytes = None
        self._staging_views.clear()
        if self.captured:
            log.warning(
                "ubnext: a pool used in CUDA graph capture stays mapped until the process exits "
                "(a captured graph may still be replayed)"
            )
            _KEPT_FOR_GRAPHS.append(self)  # the error word too: a replay may still write it
            return
        self._graph_tensors.clear()
        self.backend.close()


def _device_pointer_of_pinned(t: torch.Tensor) -> int:
    """The device-side address of a pinned host tensor. torch pins with cudaHostAlloc (mapped
    under UVA, device pointer == host pointer) or, with ``pinned_use_cuda_host_register``,
    with cudaHostRegister, whose device pointer equals the host pointer only where
    CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM holds on every visible device
    (cuMemHostGetDevicePointer docs). cuMemHostGetDevicePointer answers for both."""
    from ..runtime._cuda import CudaError, check, driver

    host = t.data_ptr()
    try:
        return int(check(driver().cuMemHostGetDevicePointer(host, 0), "cuMemHostGetDevicePointer"))
    except CudaError as exc:
        # not mapped for the device: the UVA host pointer is the only candidate left
        log.warning("ubnext: %s; kernels write the error word through its host address", exc)
        return host


def _free_if_open(pool_ref, arena: str, offset: int) -> None:
    pool = pool_ref()
    if pool is not None and not pool._closed:
        pool.arenas[arena].free(offset)
