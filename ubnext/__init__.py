"""ubnext: symmetric-memory allreduce (NVLS and Lamport), optionally fused with residual add +
RMSNorm (+FP8), for tensor-parallel PyTorch on NVLink GPUs; runs on a CPU emulator or falls
back to torch.distributed where it cannot run its kernels."""

from __future__ import annotations

import logging

import torch.distributed as _dist

from . import envs, ops
from .comm import PATHS, Communicator, UbnextError, UbnextTimeoutError
from .envs import EnvError
from .runtime import _lifecycle

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
    "fusion",
    "__version__",
]

_log = logging.getLogger("ubnext")
_log.setLevel(envs.get("UBNEXT_LOG_LEVEL").upper())
if not _log.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))
    _log.addHandler(_handler)


def __getattr__(name: str):
    # ubnext.fusion imports torch._inductor (about a second): only for a program that uses it
    if name == "fusion":
        import importlib

        return importlib.import_module(".fusion", __name__)  # `from . import` would ask __getattr__ again
    raise AttributeError(f"module 'ubnext' has no attribute {name!r}")


def get_communicator(group=None) -> Communicator:
    """The cached communicator of ``group`` (the default group when None); created on first
    use, which is collective. Bootstraps torch.distributed from mpirun/torchrun variables when
    it is not initialised; ubnext then also tears it down at exit."""
    return _lifecycle.communicator_of(group)


_ALL_REDUCE_SIGNATURE = "ubnext.all_reduce(x, group=None, *, out=None) -> Tensor"
_FUSED_SIGNATURE = "ubnext.all_reduce_add_rmsnorm(x, residual, weight, eps=1e-6, *, group=None, ...)"


def _group_key(group, signature: str = _ALL_REDUCE_SIGNATURE) -> str:
    # torch.distributed is imported at the top: an import statement here cost 0.3 us a call
    if not _dist.is_initialized():
        _lifecycle.communicator_of(None)
    try:
        # WORLD is set once torch.distributed is initialised (above); anything else is caught below
        return (group if group is not None else _dist.group.WORLD).group_name  # type: ignore[union-attr]
    except AttributeError:  # off the hot path: a group's name, or something that is no group
        if isinstance(group, str) and group in _lifecycle.cached:
            return group
        return _lifecycle.process_group(group, signature).group_name


def all_reduce(x, group=None, *, out=None):
    """The sum of ``x`` over the ranks of ``group`` (a ProcessGroup, its ``group_name``, or None for the
    default group), returned as a new tensor as torch's functional collectives do: ``x`` is left as it
    was unless ``out=x``. ``get_communicator(group).all_reduce(x, out=out)``; compiles under torch.compile."""
    if out is None:
        return ops.all_reduce(x, _group_key(group))
    return ops.all_reduce_out(x, out, _group_key(group))


def all_reduce_add_rmsnorm(
    x,
    residual,
    weight,
    eps: float = 1e-6,
    *,
    group=None,
    out_dtype=None,
    scale=None,
    quant=None,
    global_scale=None,
    swizzled=False,
    ue8m0=False,
):
    """``get_communicator(group).all_reduce_add_rmsnorm(...)``; compiles under torch.compile."""
    return ops.all_reduce_add_rmsnorm(
        x,
        residual,
        weight,
        eps,
        _group_key(group, _FUSED_SIGNATURE),
        out_dtype=out_dtype,
        scale=scale,
        quant=quant,
        global_scale=global_scale,
        swizzled=swizzled,
        ue8m0=ue8m0,
    )
