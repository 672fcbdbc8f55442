"""The pool backend over torch symmetric memory, the default on GPUs."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import cast

import torch

from ._backend import _agree, _Backend
from .layout import _align

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
        backend = symm_mem.get_backend(device) if hasattr(symm_mem, "get_backend") else None
        if backend not in (None, "CUDA"):
            # TORCH_SYMMMEM=NVSHMEM or NCCL: buffer_ptrs may be null and offsets follow other rules
            # than the CUDA backend's, which the checks below assume; ubnext's own VMM serves instead
            raise RuntimeError(
                f"torch symmetric memory uses its {backend} backend; ubnext's pool needs its "
                "CUDA backend (TORCH_SYMMMEM=CUDA, torch's default)"
            )
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None and not hasattr(enable, "__deprecated__"):
            # torch < 2.8 needs it. Newer torch deprecates it ("There is no need to call this function
            # anymore"), and it is not harmless there: it marks the group so that Inductor lowers
            # every compiled all_reduce of the group to torch's one-shot op (comm_lowering.py), which
            # refuses fp16 and odd 2-byte lengths. So it is called only where it is needed.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                enable(group_name)
        # a whole number of the caching allocator's large segments (2 MiB), so that a fresh
        # allocation starts its own block (see the offset check below)
        self._tensor, self._handle, error = None, None, None
        try:
            self._tensor = symm_mem.empty(_align(size, TORCH_SYMM_SEGMENT), dtype=torch.uint8, device=device)
        except Exception as exc:  # noqa: BLE001 - any refusal: agreed below, the caller takes VMM
            error = f"{type(exc).__name__}: {exc}"
        _agree(allgather, error, "symm_mem.empty")  # the rendezvous is collective
        # symm_mem.empty returned on every rank (_agree raised otherwise), so the tensor is set
        tensor = cast(torch.Tensor, self._tensor)
        self._handle = symm_mem.rendezvous(tensor, group_name)
        bases = [int(p) for p in self._handle.buffer_ptrs]
        # buffer_ptrs are the bases of the symmetric blocks, and torch's pool may place a tensor
        # inside a block. The multicast address is then ambiguous: older torch returns the
        # block's multicast base from multicast_ptr, newer torch (and the NCCL backend) adds the
        # tensor's offset, and one revision has get_offset() yet returns the bare base. Only at
        # offset 0 do both conventions agree, so anything else is refused (the caller falls back to
        # ubnext's own VMM, agreed across ranks).
        offset = tensor.data_ptr() - bases[group.rank()]
        if offset != 0:
            self._tensor = self._handle = None
            raise RuntimeError(
                f"torch symmetric memory placed the pool {offset} bytes into its block, where "
                "torch versions disagree on the multicast address"
            )
        self.peer_bases = bases
        self.mc_base = int(getattr(self._handle, "multicast_ptr", 0) or 0)

    def local_tensor(self) -> torch.Tensor:
        # set by __init__; cleared only when the backend closes, after its last use
        return cast(torch.Tensor, self._tensor)

    def _release_all(self) -> None:
        # work queued through a view that has died may still run: the block goes back to torch's
        # pool, and another allocation could reuse it, only after it ends
        torch.cuda.synchronize(self.device)
        self._handle = None
        self._tensor = None
