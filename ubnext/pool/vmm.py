"""ubnext's own VMM pool backend through cuda-python (cuMem, POSIX-fd handles, multicast)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from typing import cast

import torch

from ._backend import PoolSetupError, _agree, _Backend, _raise_if_any, _share_fd, _Slot
from .layout import _align, _lcm

log = logging.getLogger("ubnext")


class VmmBackend(_Backend):
    """ubnext's own VMM through cuda-python: cuMemCreate with POSIX-fd handles, export, fds
    over Unix sockets, import, map, set access; a multicast object where supported. Used
    when torch symmetric memory is missing or refuses (older torch, several ranks per GPU).

    Set-up runs in phases that end with a vote (_agree), and a failure anywhere releases
    everything made so far, on every rank."""

    name = "vmm"

    def __init__(self, size: int, rank: int, nranks: int, device: torch.device, allgather: Callable[[object], list]):
        from ..runtime._cuda import check, driver

        self.device = device
        self._drv = driver()
        self._check = check
        self._handles: list = []
        self._mapped: list[tuple[int, int]] = []
        self._reserved: list[tuple[int, int]] = []
        self._mc = None
        self._mc_bound = False
        self._local: torch.Tensor | None = None
        self._dev = None
        self.mc_base = 0
        self._peer_ranges = 0  # the address ranges mapped before the multicast part's
        self.size = size
        # the cuMem calls act in the current context, which must be the device's primary one
        # (torch's): pushed in the first voted phase, popped after the set-up, so that the
        # caller's current device and context stay its own
        with contextlib.ExitStack() as context:
            try:
                self._set_up(size, rank, nranks, device, allgather, context)
            except BaseException:
                self._release_all()
                raise

    def _set_up(self, size, rank, nranks, device, allgather, context: contextlib.ExitStack) -> None:
        from ..runtime._cuda import CudaError, primary_context

        drv, check = self._drv, self._check
        # -- phase 1: what this GPU offers, agreed (sizes, multicast, which GPU)
        info: tuple[int, bool, int, bytes] | None = None
        error: str | None = None
        try:
            context.enter_context(primary_context(device.index))
            info = self._query(size, nranks, device)
        except CudaError as exc:
            error = str(exc)
        agreed = allgather((info, error))
        _raise_if_any([e for _, e in agreed], "querying the GPU")
        # every rank's query worked (_raise_if_any raised otherwise), so this one's is set
        gran, _, _, uuid = cast("tuple[int, bool, int, bytes]", info)
        # A multicast object takes one device per rank, and cuMulticastBindMem waits until all of
        # them have been added: ranks sharing a GPU would wait forever, so they get no multicast.
        infos = [i for i, _ in agreed]
        shared_gpu = len({i[3] for i in infos}) < len(infos)
        if shared_gpu:
            log.warning(
                "ubnext vmm pool: several ranks share a GPU; multicast needs one GPU per rank, "
                "so only the unicast paths run"
            )
        self._mc_everywhere = not shared_gpu and all(i[1] for i in infos)
        self._mc_gran = _lcm(*(i[2] for i in infos if i[2])) if self._mc_everywhere else 0
        gran = _lcm(*(i[0] for i in infos), self._mc_gran or 1)
        self.size = size = _align(size, gran)

        # -- phase 2: our memory, exported
        fd, error = -1, None
        try:
            own = check(drv.cuMemCreate(size, self._alloc_prop(device), 0), "cuMemCreate")
            self._handles.append(own)
            fd = int(
                check(
                    drv.cuMemExportToShareableHandle(
                        own, drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0
                    ),
                    "cuMemExportToShareableHandle",
                )
            )
        except CudaError as exc:
            error = str(exc)
        fds = _share_fd(
            fd, error, rank, nranks, allgather, "allocating the pool", "exchanging the pool's file descriptors"
        )

        # -- phase 3: every rank's memory mapped here
        error = None
        self.peer_bases = []
        try:
            for peer, peer_fd in enumerate(fds):
                handle = (
                    self._handles[0]
                    if peer == rank
                    else check(
                        drv.cuMemImportFromShareableHandle(
                            peer_fd, drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
                        ),
                        "cuMemImportFromShareableHandle",
                    )
                )
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
        from ..runtime._cuda import CudaError

        drv, check = self._drv, self._check
        self._dev = dev = check(drv.cuDeviceGet(device.index), "cuDeviceGet")
        gran = int(
            check(
                drv.cuMemGetAllocationGranularity(
                    self._alloc_prop(device), drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
                ),
                "cuMemGetAllocationGranularity",
            )
        )
        # A multicast object's size and every bind's size/offsets must be multiples of
        # cuMulticastGetGranularity(CU_MULTICAST_GRANULARITY_MINIMUM) (cuMulticastCreate and
        # cuMulticastBindMem docs), so the allocation is sized for it before cuMemCreate. Every
        # rank must map the same size: the granularities are agreed across ranks.
        mc_supported = bool(
            check(
                drv.cuDeviceGetAttribute(drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED, dev),
                "cuDeviceGetAttribute(MULTICAST_SUPPORTED)",
            )
        )
        mc_gran = 0
        if mc_supported:
            try:
                mc_gran = int(
                    check(
                        drv.cuMulticastGetGranularity(
                            self._mc_prop(nranks, _align(size, gran)),
                            drv.CUmulticastGranularity_flags.CU_MULTICAST_GRANULARITY_MINIMUM,
                        ),
                        "cuMulticastGetGranularity",
                    )
                )
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
        """Phases 4 to 6. A driver call of the multicast part that fails on any rank (agreed like
        every phase) costs the multicast only: what it made is released on every rank and the
        pool goes on unicast, as torch's symmetric memory does, rather than leaving every call
        to torch.distributed. NCCL's NVLS may have taken the multicast resources, for one. A
        failed fd exchange is no multicast matter (the sockets fail) and fails the pool as ever."""
        if not self._mc_everywhere:  # agreed across ranks in phase 1
            log.info("ubnext vmm pool: no multicast on every rank; unicast paths only")
            return
        self._peer_ranges = len(self._reserved)  # what _release_multicast keeps
        try:
            self._multicast_phases(rank, nranks, allgather)
        except _MulticastFailed as exc:
            self._release_multicast()
            log.warning("ubnext vmm pool: %s; the pool goes on without multicast (unicast paths only)", exc)

    def _multicast_phases(self, rank, nranks, allgather) -> None:
        from ..runtime._cuda import CudaError

        drv, check = self._drv, self._check
        # -- phase 4: rank 0 creates the multicast object and shares it
        fd, error = -1, None
        if rank == 0:
            try:
                self._mc = check(drv.cuMulticastCreate(self._mc_prop(nranks, self.size)), "cuMulticastCreate")
                fd = int(
                    check(
                        drv.cuMemExportToShareableHandle(
                            self._mc, drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0
                        ),
                        "cuMemExportToShareableHandle (multicast)",
                    )
                )
            except CudaError as exc:
                error = str(exc)
        fds = _share_fd(
            fd,
            error,
            rank,
            nranks,
            allgather,
            "creating the multicast object",
            "sharing the multicast object",
            only_from=0,
            making_fails=_MulticastFailed,
        )
        # -- phase 5: every device added (cuMulticastBindMem waits for all of them)
        error = None
        try:
            if rank != 0:
                self._mc = check(
                    drv.cuMemImportFromShareableHandle(
                        fds[0], drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
                    ),
                    "cuMemImportFromShareableHandle (multicast)",
                )
            check(drv.cuMulticastAddDevice(self._mc, self._dev), "cuMulticastAddDevice")
        except CudaError as exc:
            error = str(exc)
        finally:
            for f in fds:
                if f >= 0:
                    os.close(f)
        _agree(allgather, error, "adding every GPU to the multicast object", _MulticastFailed)
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
        _agree(allgather, error, "binding and mapping the multicast object", _MulticastFailed)

    def _mc_prop(self, nranks: int, size: int):
        drv = self._drv
        prop = drv.CUmulticastObjectProp()
        prop.numDevices = nranks
        prop.size = size
        prop.handleTypes = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        prop.flags = 0
        return prop

    def local_tensor(self) -> torch.Tensor:
        # set at the end of the set-up; cleared only when the backend closes, after its last use
        return cast(torch.Tensor, self._local)

    def _drop_own_views(self) -> None:
        self._local = None

    def _release_all(self) -> None:
        """Release whatever exists: the multicast part first (_release_multicast), then the
        peers' ranges and our memory."""
        torch.cuda.synchronize(self.device)  # no kernel of ours may still use it
        self._release(0, ([self._mc] if self._mc is not None else []) + self._handles)
        self._handles = []
        self._local = None

    def _release_multicast(self) -> None:
        """Release what the multicast phases made (its binding, its range, the object), and keep
        the peers' mappings: a unicast pool."""
        self._release(self._peer_ranges, [self._mc] if self._mc is not None else [])

    def _release(self, first_range: int, handles: list) -> None:
        """In the documented order: unbind our memory from the multicast object before it is
        unmapped (cuMulticastUnbind), unmap the ranges from `first_range` on, last mapped first
        (the multicast range, mapped last, before the memory bound to it), free them, release
        `handles`. In the device's primary context (the one the memory was made in), whichever
        context the calling thread has: a deferred release runs at another pool's creation or
        close, on any thread. It never raises: it also runs where an exception is already on its
        way (a failed set-up) and at the end of a pool's life, where nobody could act on one; so
        every failing call is logged, named with its status, and the rest still go (a failure left
        silent would leak the memory unseen)."""
        from ..runtime._cuda import CudaError, primary_context

        try:
            with contextlib.ExitStack() as context:
                try:
                    context.enter_context(primary_context(self.device.index))
                except CudaError as exc:
                    log.warning("ubnext vmm pool: %s; releasing the pool's memory in the thread's own context", exc)
                self._release_calls(first_range, handles)
        except CudaError as exc:  # popping the context, after every release call was made
            log.warning("ubnext vmm pool: %s after releasing the pool's memory", exc)
        del self._mapped[first_range:], self._reserved[first_range:]
        self._mc, self._mc_bound, self.mc_base = None, False, 0

    def _release_calls(self, first_range: int, handles: list) -> None:
        drv = self._drv
        if self._mc is not None and self._mc_bound:
            _log_failure(drv.cuMulticastUnbind(self._mc, self._dev, 0, self.size), "cuMulticastUnbind")
        for va, size in reversed(self._mapped[first_range:]):
            _log_failure(drv.cuMemUnmap(va, size), f"cuMemUnmap({va:#x}, {size})")
        for va, size in reversed(self._reserved[first_range:]):
            _log_failure(drv.cuMemAddressFree(va, size), f"cuMemAddressFree({va:#x}, {size})")
        for h in handles:
            _log_failure(drv.cuMemRelease(h), "cuMemRelease")


def _log_failure(result, what: str) -> None:
    """Log a release call's failure (cuda.bindings' ``(status, ...)``) instead of raising it."""
    from ..runtime._cuda import CudaError, check

    try:
        check(result, what)
    except CudaError as exc:
        log.warning(
            "ubnext vmm pool: %s; that part of the pool's memory may stay allocated until the process exits", exc
        )


class _MulticastFailed(PoolSetupError):
    """A multicast phase failed on some rank: on every rank, the pool goes on unicast."""


# --------------------------------------------------------------------------------------------
