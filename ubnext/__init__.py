"""ubnext: symmetric-memory allreduce (NVLS and Lamport), optionally fused with residual add +
RMSNorm (+FP8), for tensor-parallel PyTorch on NVLink GPUs; runs on a CPU emulator or falls
back to torch.distributed where it cannot run its kernels."""

from __future__ import annotations

import logging

from . import envs
from .comm import PATHS, Communicator, UbnextError, UbnextTimeoutError
from .envs import EnvError

__version__ = "0.1.0"

__all__ = [
    "Communicator",
    "UbnextError",
    "UbnextTimeoutError",
    "EnvError",
    "PATHS",
    "all_reduce",
    "all_reduce_add_rmsnorm",
    "get_communicator",
    "__version__",
]

_log = logging.getLogger("ubnext")
_log.setLevel(envs.get("UBNEXT_LOG_LEVEL").upper())
if not _log.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))
    _log.addHandler(_handler)

_communicators: dict[str, Communicator] = {}


def get_communicator(group=None) -> Communicator:
    """The cached communicator of ``group`` (the default group when None); created on first
    use, which is collective."""
    import torch.distributed as dist

    if not dist.is_initialized():
        comm = Communicator(group)
        _communicators[comm.group.group_name] = comm
        return comm
    key = (group if group is not None else dist.group.WORLD).group_name
    comm = _communicators.get(key)
    if comm is None or comm._closed:
        comm = _communicators[key] = Communicator(group)
    return comm


def all_reduce(x, group=None, *, out=None):
    """``get_communicator(group).all_reduce(x, out=out)``."""
    return get_communicator(group).all_reduce(x, out=out)


def all_reduce_add_rmsnorm(x, residual, weight, eps: float = 1e-6, *, group=None, out_dtype=None, scale=None):
    """``get_communicator(group).all_reduce_add_rmsnorm(...)``."""
    return get_communicator(group).all_reduce_add_rmsnorm(x, residual, weight, eps, out_dtype=out_dtype, scale=scale)
