"""What every pool backend shares: tensors over pool memory that keep it mapped while any view
lives (``_Slot``), the backend's lifetime (``_Backend``), and the voted phases of a multi-rank
set-up (``_agree``, ``_share_fd``), after which every rank succeeds or every rank raises alike."""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable

import numpy as np
import torch

from ..runtime import _cuda

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
    # counted here; close() releases the memory at once if no view is left, else after the last
    # one goes, at the next pool creation or close (release_deferred). So no pool tensor ever
    # points at unmapped or reused memory, and close() never refuses (collective close on every
    # rank, whatever each rank still holds).
    _views = 0
    _closing = False
    _released = False

    def local_tensor(self) -> torch.Tensor:
        """This rank's whole pool as a uint8 tensor (same lifetime as the backend)."""
        raise NotImplementedError

    def track(self, slot: _Slot) -> None:
        with _VIEWS_LOCK:
            self._views += 1
        weakref.finalize(slot, self._view_gone)

    def _view_gone(self) -> None:
        # A finaliser: it may run on any thread, at any allocation, also while another thread
        # captures a CUDA graph in global mode, where releasing (a device synchronisation, an
        # unmap) is forbidden and would break that capture; whether one is under way cannot be
        # asked from here (only the calling thread's capture can). So the release waits for the
        # next pool creation or close, which the program makes itself.
        with _VIEWS_LOCK:
            self._views -= 1
            if self._closing and self._views == 0 and not self._released and self not in _RELEASE_LATER:
                _RELEASE_LATER.append(self)

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
_RELEASE_LATER: list[_Backend] = []  # closed backends whose last view went (or whose release met a capture)


def release_deferred() -> None:
    """Release the closed backends whose last view went after their close (in a finaliser), or
    whose release met a capture on this thread: at the next pool creation or close, outside
    capture."""
    while True:
        with _VIEWS_LOCK:
            if not _RELEASE_LATER or _cuda.capturing(_RELEASE_LATER[0].device):
                return
            backend = _RELEASE_LATER.pop(0)
        backend._release_if_unused()


class PoolSetupError(RuntimeError):
    """A step of a multi-rank pool set-up failed on some rank; raised on every rank alike."""


def _agree(
    allgather: Callable[[object], list], error: str | None, step: str, fails: type[PoolSetupError] = PoolSetupError
) -> None:
    """End one phase of a multi-rank set-up: every rank says whether its part of `step` worked,
    and if any rank's failed, every rank raises the same `fails` (a PoolSetupError) here. No rank
    then goes on to a collective step (an fd exchange, a multicast bind that waits for every
    device) that its peers never reach, and every rank's caller sees the same cause."""
    _raise_if_any(allgather(error), step, fails)


def _share_fd(
    fd: int,
    error: str | None,
    rank: int,
    nranks: int,
    allgather: Callable[[object], list],
    making: str,
    sharing: str,
    only_from: int | None = None,
    making_fails: type[PoolSetupError] = PoolSetupError,
) -> list[int]:
    """One fd-sharing phase of a set-up: agree that every rank made its fd (`error`: why this one
    did not; a failure raises `making_fails` on every rank), exchange the fds
    (_fdshare.exchange_fds), then agree that the exchange worked, since it can fail on one rank
    only (a socket error, a timeout) and that rank must not leave its peers pairing their next
    collective with its next one. Closes `fd` in every case; the caller owns the fds returned."""
    from . import _fdshare

    try:
        _agree(allgather, error, making, making_fails)
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


def _raise_if_any(errors: list, step: str, fails: type[PoolSetupError] = PoolSetupError) -> None:
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if failed:
        r, e = failed[0]
        raise fails(f"{step} failed on rank {r}: {e}")
