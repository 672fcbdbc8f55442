"""The symmetric memory pool: one per communicator, the same layout and offsets on every rank.

Layout (docs/ARCHITECTURE.md, csrc/device/desc.cuh)::

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

import logging
import math
import mmap
import os
import struct
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from . import _cuda, envs
from .allocator import Allocator, NoRoom

__all__ = ["PoolLayout", "SymmetricPool", "NoRoom", "DESC_FIELDS", "pack_desc", "plan_layout"]

log = logging.getLogger("ubnext")

DESC_BYTES = 4096
SYNC_BYTES = 81920  # UBNEXT_SYNC_BYTES
MAX_RANKS = 16
DESC_MAGIC = 0x55424E5800000002
PAGE = 4096
# Field order of ubnext_comm_desc (csrc/device/desc.cuh); tests/unit/test_abi.py checks it.
DESC_FIELDS = (
    "magic", "rank", "nranks", "timeout_ns", "err_ptr", "mc_base", "sync_off", "lamport_off",
    "lamport_slot_bytes", "data_off", "pool_bytes", "reserved[5]", f"peer_base[{MAX_RANKS}]",
)
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
    message = _align(envs.get("UBNEXT_MAX_BATCH") * max_hidden * elem_bytes, PAGE)
    pool_mb = envs.get("UBNEXT_SYMM_POOL_SIZE")
    if pool_mb is None:
        # data arena: the in-place buffer plus room for a GEMM output, residual and norm output,
        # in each of the eager and graph halves
        return PoolLayout(nranks, message, 8 * message,
                          f"UBNEXT_MAX_BATCH={envs.get('UBNEXT_MAX_BATCH')} tokens x hidden {max_hidden} x {elem_bytes} bytes")
    total = pool_mb << 20
    reserved = DESC_BYTES + SYNC_BYTES
    minimum = reserved + 3 * nranks * PAGE + 2 * PAGE
    if total < minimum:
        raise ValueError(
            f"UBNEXT_SYMM_POOL_SIZE={pool_mb} MB is smaller than the reserved region "
            f"({minimum} bytes for {nranks} ranks)"
        )
    # give the Lamport buffers at most half of what is left, the data arena the rest
    slot = min(message, (total - reserved) // 2 // (3 * nranks) // PAGE * PAGE)
    slot = max(slot, PAGE)
    data = total - _align(reserved + 3 * nranks * slot, PAGE)
    return PoolLayout(nranks, slot, data, f"UBNEXT_SYMM_POOL_SIZE={pool_mb} MB")


def pack_desc(*, rank: int, nranks: int, timeout_ns: int, err_ptr: int, mc_base: int,
              layout: PoolLayout, peer_bases: list[int]) -> bytes:
    if len(peer_bases) != nranks:
        raise ValueError("one peer base per rank")
    values = [
        DESC_MAGIC, rank, nranks, timeout_ns, err_ptr, mc_base, layout.sync_off,
        layout.lamport_off, layout.lamport_slot_bytes, layout.data_off, layout.pool_bytes,
        0, 0, 0, 0, 0,
    ] + list(peer_bases) + [0] * (MAX_RANKS - nranks)
    return struct.pack(f"<{len(values)}Q", *values)


# --------------------------------------------------------------------------------------------
# Tensors over pool memory, freed when the last view is released


class _Slot:
    """A range of pool memory exported through the array interfaces, so torch can wrap it
    without copying. torch keeps this object alive as long as any view of the tensor lives;
    its finaliser then returns the range to the allocator."""

    def __init__(self, address: int, nbytes: int, device: torch.device, keepalive: object):
        self._keepalive = keepalive
        if isinstance(keepalive, _Backend):
            keepalive.track(self)
        interface = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False), "version": 3}
        if device.type == "cuda":
            interface["stream"] = None  # ordering is the caller's stream's, as for any tensor
            self.__cuda_array_interface__ = interface
        else:
            self.__array_interface__ = interface

    def tensor(self, device: torch.device) -> torch.Tensor:
        if device.type == "cuda":
            return torch.as_tensor(self, device=device)
        return torch.from_numpy(np.asarray(self))


# --------------------------------------------------------------------------------------------
# Backends


class _Backend:
    name = "?"
    device: torch.device
    peer_bases: list[int]
    mc_base: int = 0
    size: int

    # Lifetime: every pool tensor is a view through a _Slot, which keeps its backend alive and is
    # counted here; close() releases the memory at once if no view is left, else when the last
    # one goes. So no pool tensor ever points at unmapped or reused memory, and close() never
    # refuses (collective close on every rank, whatever each rank still holds).
    _views = 0
    _closing = False
    _released = False

    def local_tensor(self) -> torch.Tensor:
        """This rank's whole pool as a uint8 tensor (same lifetime as the backend)."""
        raise NotImplementedError

    def track(self, slot: "_Slot") -> None:
        with _VIEWS_LOCK:
            self._views += 1
        weakref.finalize(slot, self._view_gone)

    def _view_gone(self) -> None:
        # a finaliser: it may run on any thread, at any allocation
        with _VIEWS_LOCK:
            self._views -= 1
        self._release_if_unused()

    def close(self) -> None:
        """Release the memory now if no view of it is alive, else when the last view goes."""
        release_deferred()
        self._closing = True
        self._drop_own_views()
        self._release_if_unused()

    @property
    def released(self) -> bool:
        return self._released

    def _release_if_unused(self) -> None:
        with _VIEWS_LOCK:
            if not self._closing or self._views != 0 or self._released:
                return
            if _cuda.capturing(self.device):
                # synchronising or unmapping now would invalidate the capture in progress
                _RELEASE_LATER.append(self)
                return
            self._released = True
        self._release_all()

    def _drop_own_views(self) -> None:
        """Drop the backend's own views of its memory (they would keep it mapped forever)."""

    def _release_all(self) -> None:
        raise NotImplementedError


# reentrant: a finaliser (_view_gone) can run inside the locked region, on a garbage collection
_VIEWS_LOCK = threading.RLock()
_RELEASE_LATER: list[_Backend] = []  # closed, unused backends whose release met a capture


def release_deferred() -> None:
    """Release the backends whose last view went during a CUDA graph capture (at the next pool
    creation or close, outside capture)."""
    while True:
        with _VIEWS_LOCK:
            if not _RELEASE_LATER or _cuda.capturing(_RELEASE_LATER[0].device):
                return
            backend = _RELEASE_LATER.pop(0)
        backend._release_if_unused()


class PoolSetupError(RuntimeError):
    """A step of a multi-rank pool set-up failed on some rank; raised on every rank alike."""


def _agree(allgather: Callable[[object], list], error: str | None, step: str) -> None:
    """End one phase of a multi-rank set-up: every rank says whether its part of `step` worked,
    and if any rank's failed, every rank raises the same PoolSetupError here. No rank then goes
    on to a collective step (an fd exchange, a multicast bind that waits for every device) that
    its peers never reach, and every rank's caller sees the same cause."""
    _raise_if_any(allgather(error), step)


def _share_fd(fd: int, error: str | None, rank: int, nranks: int, allgather: Callable[[object], list],
              making: str, sharing: str, only_from: int | None = None) -> list[int]:
    """One fd-sharing phase of a set-up: agree that every rank made its fd (`error`: why this one
    did not), exchange the fds (_fdshare.exchange_fds), then agree that the exchange worked, since
    it can fail on one rank only (a socket error, a timeout) and that rank must not leave its peers
    pairing their next collective with its next one. Closes `fd` in every case; the caller owns
    the fds returned."""
    from . import _fdshare

    try:
        _agree(allgather, error, making)
        fds, error = [], None
        try:
            fds = _fdshare.exchange_fds(fd, rank, nranks, allgather, only_from=only_from)
        except Exception as exc:  # noqa: BLE001 - whatever it was, the peers must hear of it
            error = f"{type(exc).__name__}: {exc}"
        try:
            _agree(allgather, error, sharing)
        except PoolSetupError:
            for f in fds:
                if f >= 0:
                    os.close(f)
            raise
        return fds
    finally:
        if fd >= 0:
            os.close(fd)


def _raise_if_any(errors: list, step: str) -> None:
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if failed:
        r, e = failed[0]
        raise PoolSetupError(f"{step} failed on rank {r}: {e}")


class EmulatorBackend(_Backend):
    """Shared host memory for the CPU emulator: one memfd per rank, passed to every peer over
    Unix sockets (like cuMem POSIX-fd handles), each peer mapped at this process's own
    address; a reserved address range stands for the multicast address."""

    name = "emulator"

    def __init__(self, size: int, rank: int, nranks: int, allgather: Callable[[object], list]):
        from . import _emu

        self.device = torch.device("cpu")
        self.size = size
        self._lib = _emu.load(envs.get("UBNEXT_EMU_BREAK"))
        self._handle = None
        self._maps: list[mmap.mmap] = []
        self._arrays: list[np.ndarray] = []
        self._local = None
        self.mc_base = 0
        fd, error = -1, None
        try:
            fd = os.memfd_create(f"ubnext-pool-r{rank}", os.MFD_CLOEXEC)
            os.ftruncate(fd, size)
        except OSError as exc:
            error = str(exc)
        fds = _share_fd(fd, error, rank, nranks, allgather, "creating the pool's shared memory",
                        "exchanging the pool's file descriptors")
        error = None
        try:
            for peer_fd in fds:
                self._maps.append(mmap.mmap(peer_fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE))
        except OSError as exc:
            error = str(exc)
        finally:
            for peer_fd in fds:
                os.close(peer_fd)
        try:
            _agree(allgather, error, "mapping the peers' shared memory")
        except PoolSetupError:
            self._release_all()
            raise
        self._arrays = [np.frombuffer(m, dtype=np.uint8) for m in self._maps]
        self.peer_bases = [a.__array_interface__["data"][0] for a in self._arrays]
        self.mc_base = self._lib.reserve(size) if envs.get("UBNEXT_EMU_MULTICAST") else 0
        self._handle = self._lib.register(rank, nranks, self.peer_bases, size, self.mc_base)
        self._local = torch.from_numpy(self._arrays[rank])

    def local_tensor(self) -> torch.Tensor:
        return self._local

    def _release_all(self) -> None:
        if self._handle is not None:
            # the multicast range goes first, so no twin can reach a peer mapping being removed
            self._lib.unregister(self._handle)
            if self.mc_base:
                self._lib.release(self.mc_base, self.size)
        self._handle = None
        self._local = None
        self._arrays = []
        for m in self._maps:
            try:
                m.close()
            except BufferError:
                # a pool tensor is still referenced by the caller; the mapping goes with it
                log.warning("ubnext pool closed while pool tensors are alive; unmapping deferred")
        self._maps = []


# Pools closed after a CUDA graph captured work on them: kept until the process exits.
_KEPT_FOR_GRAPHS: list["SymmetricPool"] = []

TORCH_SYMM_SEGMENT = 2 << 20  # the CUDA caching allocator's large-segment granularity


class TorchSymmBackend(_Backend):
    """torch symmetric memory: ``symm_mem.empty`` + ``rendezvous``. ``multicast_ptr`` is 0
    where the system has no multicast (PCIe, several ranks on one GPU); ubnext keeps working
    on unicast paths then."""

    name = "torch_symm"

    def __init__(self, size: int, group, device: torch.device, allgather: Callable[[object], list]):
        import torch.distributed._symmetric_memory as symm_mem

        self.device = device
        self.size = size
        group_name = group.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # torch < 2.8 needs it
            # newer torch keeps it as a deprecated no-op-in-effect that warns (FutureWarning:
            # "There is no need to call this function anymore")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                symm_mem.enable_symm_mem_for_group(group_name)
        # a whole number of the caching allocator's large segments (2 MiB), so that a fresh
        # allocation starts its own block (see the offset check below)
        self._tensor, self._handle, error = None, None, None
        try:
            self._tensor = symm_mem.empty(_align(size, TORCH_SYMM_SEGMENT), dtype=torch.uint8, device=device)
        except Exception as exc:  # noqa: BLE001 - any refusal: agreed below, the caller takes VMM
            error = f"{type(exc).__name__}: {exc}"
        _agree(allgather, error, "symm_mem.empty")  # the rendezvous is collective
        self._handle = symm_mem.rendezvous(self._tensor, group_name)
        bases = [int(p) for p in self._handle.buffer_ptrs]
        # buffer_ptrs are the bases of the symmetric blocks, and torch's pool may place a tensor
        # inside a block. The multicast address is then ambiguous: older torch returns the
        # block's multicast base from multicast_ptr, newer torch (and the NCCL backend) adds the
        # tensor's offset, and one revision has get_offset() yet returns the bare base. Only at
        # offset 0 do both conventions agree, so anything else is refused (the caller falls back to
        # ubnext's own VMM, agreed across ranks).
        offset = self._tensor.data_ptr() - bases[group.rank()]
        if offset != 0:
            self._tensor = self._handle = None
            raise RuntimeError(f"torch symmetric memory placed the pool {offset} bytes into its block, where "
                               "torch versions disagree on the multicast address")
        self.peer_bases = bases
        self.mc_base = int(getattr(self._handle, "multicast_ptr", 0) or 0)

    def local_tensor(self) -> torch.Tensor:
        return self._tensor

    def _release_all(self) -> None:
        # work queued through a view that has died may still run: the block goes back to torch's
        # pool, and another allocation could reuse it, only after it ends
        torch.cuda.synchronize(self.device)
        self._handle = None
        self._tensor = None


class VmmBackend(_Backend):
    """ubnext's own VMM through cuda-python: cuMemCreate with POSIX-fd handles, export, fds
    over Unix sockets, import, map, set access; a multicast object where supported. Used
    when torch symmetric memory is missing or refuses (older torch, several ranks per GPU).

    Set-up runs in phases that end with a vote (_agree), and a failure anywhere releases
    everything made so far, on every rank."""

    name = "vmm"

    def __init__(self, size: int, rank: int, nranks: int, device: torch.device,
                 allgather: Callable[[object], list]):
        from ._cuda import check, driver

        self.device = device
        self._drv = driver()
        self._check = check
        self._handles: list = []
        self._mapped: list[tuple[int, int]] = []
        self._reserved: list[tuple[int, int]] = []
        self._mc = None
        self._mc_bound = False
        self._local = None
        self._dev = None
        self.mc_base = 0
        self.size = size
        try:
            self._set_up(size, rank, nranks, device, allgather)
        except BaseException:
            self._release_all()
            raise

    def _set_up(self, size, rank, nranks, device, allgather) -> None:
        from ._cuda import CudaError

        drv, check = self._drv, self._check
        # -- phase 1: what this GPU offers, agreed (sizes, multicast, which GPU)
        info, error = None, None
        try:
            info = self._query(size, nranks, device)
        except CudaError as exc:
            error = str(exc)
        agreed = allgather((info, error))
        _raise_if_any([e for _, e in agreed], "querying the GPU")
        gran, _, _, uuid = info
        # A multicast object takes one device per rank, and cuMulticastBindMem waits until all of
        # them have been added: ranks sharing a GPU would wait forever, so they get no multicast.
        infos = [i for i, _ in agreed]
        shared_gpu = len({i[3] for i in infos}) < len(infos)
        if shared_gpu:
            log.warning("ubnext vmm pool: several ranks share a GPU; multicast needs one GPU per rank, "
                        "so only the unicast paths run")
        self._mc_everywhere = not shared_gpu and all(i[1] for i in infos)
        self._mc_gran = _lcm(*(i[2] for i in infos if i[2])) if self._mc_everywhere else 0
        gran = _lcm(*(i[0] for i in infos), self._mc_gran or 1)
        self.size = size = _align(size, gran)

        # -- phase 2: our memory, exported
        fd, error = -1, None
        try:
            own = check(drv.cuMemCreate(size, self._alloc_prop(device), 0), "cuMemCreate")
            self._handles.append(own)
            fd = int(check(drv.cuMemExportToShareableHandle(
                own, drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0), "cuMemExportToShareableHandle"))
        except CudaError as exc:
            error = str(exc)
        fds = _share_fd(fd, error, rank, nranks, allgather, "allocating the pool",
                        "exchanging the pool's file descriptors")

        # -- phase 3: every rank's memory mapped here
        error = None
        self.peer_bases = []
        try:
            for peer, peer_fd in enumerate(fds):
                handle = self._handles[0] if peer == rank else check(drv.cuMemImportFromShareableHandle(
                    peer_fd, drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR), "cuMemImportFromShareableHandle")
                if peer != rank:
                    self._handles.append(handle)
                self.peer_bases.append(self._map(handle, 0))
        except CudaError as exc:
            error = str(exc)
        finally:
            for peer_fd in fds:
                os.close(peer_fd)
        _agree(allgather, error, "mapping the peers' memory")
        self._setup_multicast(rank, nranks, allgather)
        self._local = _Slot(self.peer_bases[rank], size, device, self).tensor(device)

    def _query(self, size: int, nranks: int, device: torch.device) -> tuple[int, bool, int, bytes]:
        """(allocation granularity, multicast supported, multicast granularity, GPU UUID)."""
        from ._cuda import CudaError

        drv, check = self._drv, self._check
        self._dev = dev = check(drv.cuDeviceGet(device.index), "cuDeviceGet")
        torch.cuda.set_device(device)
        torch.cuda.current_stream(device)  # makes torch's primary context current
        gran = int(check(drv.cuMemGetAllocationGranularity(
            self._alloc_prop(device), drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
            "cuMemGetAllocationGranularity"))
        # A multicast object's size and every bind's size/offsets must be multiples of
        # cuMulticastGetGranularity(CU_MULTICAST_GRANULARITY_MINIMUM) (cuMulticastCreate and
        # cuMulticastBindMem docs), so the allocation is sized for it before cuMemCreate. Every
        # rank must map the same size: the granularities are agreed across ranks.
        mc_supported = bool(check(drv.cuDeviceGetAttribute(
            drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED, dev), "cuDeviceGetAttribute(MULTICAST_SUPPORTED)"))
        mc_gran = 0
        if mc_supported:
            try:
                mc_gran = int(check(drv.cuMulticastGetGranularity(
                    self._mc_prop(nranks, _align(size, gran)),
                    drv.CUmulticastGranularity_flags.CU_MULTICAST_GRANULARITY_MINIMUM), "cuMulticastGetGranularity"))
            except CudaError as exc:  # agreed like the rest: no multicast anywhere
                log.info("ubnext vmm pool: %s; unicast paths only", exc)
                mc_supported = False
        uuid = bytes(check(drv.cuDeviceGetUuid(dev), "cuDeviceGetUuid").bytes)
        return gran, mc_supported, mc_gran, uuid

    def _alloc_prop(self, device: torch.device):
        drv = self._drv
        prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device.index
        prop.requestedHandleTypes = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        return prop

    def _map(self, handle, align: int) -> int:
        """Reserve a range, map `handle` there, give this GPU read/write access; its address."""
        drv, check = self._drv, self._check
        va = int(check(drv.cuMemAddressReserve(self.size, align, 0, 0), "cuMemAddressReserve"))
        self._reserved.append((va, self.size))
        check(drv.cuMemMap(va, self.size, 0, handle, 0), "cuMemMap")
        self._mapped.append((va, self.size))
        access = drv.CUmemAccessDesc()
        access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = self.device.index
        access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        check(drv.cuMemSetAccess(va, self.size, [access], 1), "cuMemSetAccess")
        return va

    def _setup_multicast(self, rank, nranks, allgather) -> None:
        from ._cuda import CudaError

        drv, check = self._drv, self._check
        if not self._mc_everywhere:  # agreed across ranks in phase 1
            log.info("ubnext vmm pool: no multicast on every rank; unicast paths only")
            return
        # -- phase 4: rank 0 creates the multicast object and shares it
        fd, error = -1, None
        if rank == 0:
            try:
                self._mc = check(drv.cuMulticastCreate(self._mc_prop(nranks, self.size)), "cuMulticastCreate")
                fd = int(check(drv.cuMemExportToShareableHandle(
                    self._mc, drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0), "cuMemExportToShareableHandle (multicast)"))
            except CudaError as exc:
                error = str(exc)
        fds = _share_fd(fd, error, rank, nranks, allgather, "creating the multicast object",
                        "sharing the multicast object", only_from=0)
        # -- phase 5: every device added (cuMulticastBindMem waits for all of them)
        error = None
        try:
            if rank != 0:
                self._mc = check(drv.cuMemImportFromShareableHandle(
                    fds[0], drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR), "cuMemImportFromShareableHandle (multicast)")
            check(drv.cuMulticastAddDevice(self._mc, self._dev), "cuMulticastAddDevice")
        except CudaError as exc:
            error = str(exc)
        finally:
            for f in fds:
                if f >= 0:
                    os.close(f)
        _agree(allgather, error, "adding every GPU to the multicast object")
        # -- phase 6: our memory bound, and the multicast range mapped here
        error = None
        try:
            check(drv.cuMulticastBindMem(self._mc, 0, self._handles[0], 0, self.size, 0), "cuMulticastBindMem")
            self._mc_bound = True
            # the multicast mapping's address is aligned to the multicast granularity
            # (cuMulticastGetGranularity: "a multiple for size, bind offsets and address mappings")
            align = self._mc_gran if (self._mc_gran & (self._mc_gran - 1)) == 0 else 0
            self.mc_base = self._map(self._mc, align)
        except CudaError as exc:
            error = str(exc)
        _agree(allgather, error, "binding and mapping the multicast object")

    def _mc_prop(self, nranks: int, size: int):
        drv = self._drv
        prop = drv.CUmulticastObjectProp()
        prop.numDevices = nranks
        prop.size = size
        prop.handleTypes = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        prop.flags = 0
        return prop

    def local_tensor(self) -> torch.Tensor:
        return self._local

    def _drop_own_views(self) -> None:
        self._local = None

    def _release_all(self) -> None:
        """Release whatever exists, in the documented order: unbind the multicast object before
        the memory is unmapped, the multicast range first; unmap, free the ranges, release."""
        drv = self._drv
        torch.cuda.synchronize(self.device)  # no kernel of ours may still use it
        if self._mc is not None and self._mc_bound:
            drv.cuMulticastUnbind(self._mc, self._dev, 0, self.size)
        if self.mc_base:  # the multicast mapping goes first
            self._mapped.sort(key=lambda m: m[0] != self.mc_base)
        for va, size in self._mapped:
            drv.cuMemUnmap(va, size)
        for va, size in self._reserved:
            drv.cuMemAddressFree(va, size)
        for h in self._handles:
            drv.cuMemRelease(h)
        if self._mc is not None:
            drv.cuMemRelease(self._mc)
        self._mc = None
        self._mc_bound = False
        self._mapped, self._reserved, self._handles = [], [], []
        self._local = None


# --------------------------------------------------------------------------------------------


class SymmetricPool:
    """One communicator's pool: backend memory, descriptor, Lamport buffers, data arenas."""

    def __init__(self, *, layout: PoolLayout, rank: int, group, device: torch.device,
                 allgather: Callable[[object], list], timeout_s: float, backend: str | None = None):
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
        log.info("ubnext pool: backend %s, %d bytes, multicast %s", self.backend.name,
                 layout.pool_bytes, "yes" if self.mc_base else "no")
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
        # for every call, so where a call stages never depends on this rank's allocation history
        rest = layout.data_bytes - layout.staging_bytes
        half = rest // 2 // 256 * 256
        arena_off = layout.data_off + layout.staging_bytes
        self.arenas = {
            "eager": Allocator(arena_off, half, min_align=16),
            "graph": Allocator(arena_off + half, rest - half, min_align=16),
        }
        self._staging_bytes = _Slot(self.base + layout.data_off, layout.staging_bytes, self.device,
                                    self.backend).tensor(self.device)
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
                return backend
            if backend is not None:
                backend.close()
            log.warning("ubnext pool: torch symmetric memory unavailable on some rank (%s); "
                        "using ubnext's own VMM", error or "refused on a peer")
        return VmmBackend(size, rank, layout.nranks, device, allgather)

    def _initialise(self) -> None:
        lay = self.layout
        desc = pack_desc(
            rank=self.rank, nranks=lay.nranks,
            timeout_ns=min(int(self.timeout_s * 1e9), 2**63),  # a "forever" group timeout still fits
            err_ptr=self._err_ptr, mc_base=self.mc_base, layout=lay,
            peer_bases=self.backend.peer_bases,
        )
        local = self.backend.local_tensor()
        local[: len(desc)].copy_(torch.frombuffer(bytearray(desc), dtype=torch.uint8))
        local[lay.sync_off: lay.sync_off + SYNC_BYTES].zero_()
        local[lay.lamport_off: lay.lamport_off + lay.lamport_bytes].view(torch.int32).fill_(SENTINEL_WORD)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- addresses ---------------------------------------------------------------------------

    @property
    def has_multicast(self) -> bool:
        return self.mc_base != 0

    @property
    def lamport_capacity(self) -> int:
        return self.layout.lamport_slot_bytes

    def contains(self, t: torch.Tensor) -> bool:
        start = t.data_ptr()
        return (t.device == self.device and self.base + self.layout.data_off <= start
                and start + t.numel() * t.element_size() <= self.base + self.layout.pool_bytes)

    # -- allocation --------------------------------------------------------------------------

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, *, align: int = 256,
              arena: str | None = None) -> torch.Tensor:
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
                view = self._staging_bytes[:nbytes].view(dtype).view(shape)
            if len(self._staging_views) < 256:  # the views of a model's few shapes, made once
                self._staging_views[key] = view
        return view

    def offset_of(self, t: torch.Tensor) -> int:
        return t.data_ptr() - self.base

    def stats(self) -> dict[str, int]:
        eager, graph = self.arenas["eager"], self.arenas["graph"]
        return {
            "backend": self.backend.name,
            "size": self.layout.pool_bytes,
            "data_bytes": self.layout.data_bytes,
            "staging_bytes": self.layout.staging_bytes,
            "lamport_capacity": self.layout.lamport_slot_bytes,
            "used": eager.stats.used + graph.stats.used,
            "peak": eager.stats.peak + graph.stats.peak,
            "largest_free": max(eager.largest_free(), graph.largest_free()),
            "allocations": eager.stats.allocations + graph.stats.allocations,
            "fallbacks": self.fallbacks,
            "multicast": int(self.has_multicast),
        }

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
            log.warning("ubnext: a pool used in CUDA graph capture stays mapped until the process exits "
                        "(a captured graph may still be replayed)")
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
    from ._cuda import CudaError, check, driver

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
