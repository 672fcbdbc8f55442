"""The CPU emulator's pool backend: shared memfd host memory."""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Callable
from typing import cast

import numpy as np
import torch

from .. import envs
from ._backend import PoolSetupError, _agree, _Backend, _share_fd

log = logging.getLogger("ubnext")


class EmulatorBackend(_Backend):
    """Shared host memory for the CPU emulator: one memfd per rank, passed to every peer over
    Unix sockets (like cuMem POSIX-fd handles), each peer mapped at this process's own
    address; a reserved address range stands for the multicast address. In count mode
    (UBNEXT_EMU_COUNT) each memfd also holds the stamps of its rank's copy, after the copy, so
    that every rank sees every copy's stamps (csrc/emu/memory.cpp)."""

    name = "emulator"

    def __init__(self, size: int, rank: int, nranks: int, allgather: Callable[[object], list]):
        from ..runtime import _emu

        self.device = torch.device("cpu")
        self.size = size
        self._lib = _emu.load(envs.get("UBNEXT_EMU_BREAK"))
        self._handle = None
        self._maps: list[mmap.mmap] = []
        self._arrays: list[np.ndarray] = []
        self._local: torch.Tensor | None = None
        self.mc_base = 0
        counting = envs.get("UBNEXT_EMU_COUNT")
        mapped = size * (1 + _emu.STAMP_BYTES_PER_BYTE) if counting else size
        fd, error = -1, None
        try:
            fd = os.memfd_create(f"ubnext-pool-r{rank}", os.MFD_CLOEXEC)
            os.ftruncate(fd, mapped)
        except OSError as exc:
            error = str(exc)
        fds = _share_fd(
            fd,
            error,
            rank,
            nranks,
            allgather,
            "creating the pool's shared memory",
            "exchanging the pool's file descriptors",
        )
        error = None
        try:
            for peer_fd in fds:
                self._maps.append(mmap.mmap(peer_fd, mapped, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE))
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
        self._arrays = [np.frombuffer(m, dtype=np.uint8, count=size) for m in self._maps]
        self.peer_bases = [a.__array_interface__["data"][0] for a in self._arrays]
        self.mc_base = self._lib.reserve(size) if envs.get("UBNEXT_EMU_MULTICAST") else 0
        self._handle = self._lib.register(rank, nranks, self.peer_bases, size, self.mc_base)
        if counting:
            self._lib.register_stamps(self._handle, [base + size for base in self.peer_bases])
            self._lib.set_counting(True)
        self._local = torch.from_numpy(self._arrays[rank])

    def local_tensor(self) -> torch.Tensor:
        # set at the end of __init__; cleared only when the backend closes, after its last use
        return cast(torch.Tensor, self._local)

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
