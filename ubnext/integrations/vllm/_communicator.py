"""The communicator subclass that serves vLLM's tensor-parallel group with ubnext.

``communicator_class(base)`` makes ``Ubnext<Base>``, a subclass of the class vLLM's platform names
(``CpuCommunicator``, ``CudaCommunicator``), once per base. vLLM's ``GroupCoordinator`` builds one per
group of world size > 1, in each worker. For the group whose name starts with ``tp`` the subclass
builds ubnext's communicator over the group's device group and prepares it (pool, kernels, agreement,
self-test) in its own ``__init__``: that runs inside ``init_distributed_environment``, before vLLM loads
the model, warms up or captures a CUDA graph, so no ubnext call's first use falls inside a capture.
Every other group, and everything but the all-reduce, stays the parent's.

Each ``all_reduce`` takes ubnext where ubnext's planner has a kernel path for its size and dtype, and the
parent's path (vLLM's own: the CPU SHM all-reduce, custom all-reduce or NCCL on CUDA) where it would
only fall back to torch.distributed; the decision is cached per size and dtype. The fused operator of
the pass (``_ops.py``) reaches ``fused``. Both count their calls here, by op and path, for
``worker_stats()``: the Communicator's own hot path counts nothing.

The pool is sized from vLLM's config: ``max(max_cudagraph_capture_size, max_num_batched_tokens)`` tokens
of the model's hidden size, capped where one fp32 message would pass ``MESSAGE_CAP`` (16 MiB: above
it ubnext's planner takes torch.distributed at every world size, so room for it is wasted), and never
below ubnext's own ``UBNEXT_MAX_BATCH``. ``UBNEXT_SYMM_POOL_SIZE``, if set, fixes the total as
everywhere in ubnext. The batch-invariant mode follows vLLM's ``VLLM_BATCH_INVARIANT`` as vLLM reads it.

Sleep mode (``suspend``/``resume``, vLLM's ``cumem`` sleep on CUDA) keeps ubnext's pool: it is not in
vLLM's sleep pool, CUDA graphs captured before sleep hold its addresses, and a pool remade on wake-up
would lie elsewhere. The pool's size is logged once when vLLM suspends. ``destroy`` (vLLM's shutdown)
closes the ubnext communicator on every rank (bounded, agreed close) before the parent's teardown."""

from __future__ import annotations

import logging
import math
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ... import envs
from ...errors import UbnextError
from ...plan import KERNEL_PATHS
from . import _ops

__all__ = ["communicator_class", "Context", "pool_sizing", "serving", "MESSAGE_CAP"]

log = logging.getLogger("ubnext")
MESSAGE_CAP = 16 << 20  # bytes of one fp32 message the pool is sized for, at most
_DEVICE_PATHS = (*KERNEL_PATHS, "torch_symm")


@dataclass(frozen=True)
class Context:
    """What the subclass reads of vLLM when it builds ubnext's communicator."""

    hidden: int = 0  # the model's hidden size (0: unknown)
    itemsize: int = 2  # bytes per activation
    capture_max: int = 0  # the largest CUDA-graph capture size (0: no capture)
    max_batched: int = 0  # max_num_batched_tokens
    batch_invariant: bool = False  # VLLM_BATCH_INVARIANT


def vllm_context() -> Context:
    """Read from vLLM (the current config, vllm.envs); only called where vLLM runs."""
    import vllm.envs as vllm_envs
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    batch_invariant = bool(vllm_envs.VLLM_BATCH_INVARIANT)
    if config is None or config.model_config is None:
        return Context(batch_invariant=batch_invariant)
    return Context(
        hidden=int(config.model_config.get_hidden_size()),
        itemsize=int(config.model_config.dtype.itemsize),
        capture_max=int(config.compilation_config.max_cudagraph_capture_size or 0),
        max_batched=int(config.scheduler_config.max_num_batched_tokens or 0),
        batch_invariant=batch_invariant,
    )


def pool_sizing(ctx: Context) -> dict[str, Any]:
    """The ``max_hidden`` that makes ubnext's pool (``UBNEXT_MAX_BATCH`` x ``max_hidden`` x 4 bytes per
    message) hold ``tokens`` rows of the model's hidden size, and how ``tokens`` was chosen."""
    per_call = envs.get("UBNEXT_MAX_BATCH")
    if ctx.hidden <= 0:
        return {"tokens": per_call, "max_hidden": None, "why": "no vLLM model config: ubnext's default sizing"}
    wanted = max(ctx.capture_max, ctx.max_batched)
    cap = max(1, MESSAGE_CAP // (ctx.hidden * 4))
    tokens = max(min(wanted, cap), per_call)
    why = (
        f"max(cudagraph capture {ctx.capture_max}, max_num_batched_tokens {ctx.max_batched}) = {wanted} tokens"
        + (f", capped at {cap} (16 MiB fp32 messages)" if wanted > cap else "")
        + f", hidden {ctx.hidden}"
    )
    return {"tokens": tokens, "max_hidden": math.ceil(tokens * ctx.hidden / per_call), "why": why}


def make_communicator(group: Any, max_hidden: int | None, batch_invariant: bool) -> Any:
    from ... import Communicator

    return Communicator(group, max_hidden=max_hidden, batch_invariant=batch_invariant)


# the subclass instances that serve a group in this process (worker_stats reads them)
_serving: weakref.WeakSet[Any] = weakref.WeakSet()
_classes: dict[type, type] = {}


def serving() -> list[Any]:
    return sorted(_serving, key=lambda c: c.unique_name)


class _UbnextServed:
    """The methods every ``Ubnext<Base>`` adds to or overrides in its base (see the module docstring).
    Reads the base's ``unique_name``, ``world_size`` and ``device_group``."""

    unique_name: str
    world_size: int
    device_group: Any
    # what the subclass is built with; tests replace them with stand-ins
    context: Callable[[], Context] = staticmethod(vllm_context)
    factory: Callable[[Any, int | None, bool], Any] = staticmethod(make_communicator)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ubnext: Any = None
        self.calls: Counter[tuple[str, str]] = Counter()
        self.sizing: dict[str, Any] = {}
        self._paths: dict[tuple[torch.dtype, int], bool] = {}
        if not self.unique_name.startswith("tp") or self.world_size < 2:
            return
        ctx = type(self).context()
        self.sizing = pool_sizing(ctx)
        comm = type(self).factory(self.device_group, self.sizing["max_hidden"], ctx.batch_invariant)
        comm.prepare()  # collective, before vLLM's warm-up and any graph capture
        self.ubnext = comm
        _ops.serve(self.unique_name, self)
        _serving.add(self)

    def _takes_ubnext(self, x: torch.Tensor) -> bool:
        # contiguity per call, outside the cache: the plan depends on dtype and size only, and a
        # non-contiguous tensor of a cached size must still take the parent's path
        if not x.is_contiguous():
            return False
        key = (x.dtype, x.numel())
        takes = self._paths.get(key)
        if takes is None:
            path = self.ubnext.explain(x).split(":", 1)[0]
            takes = self._paths[key] = path in _DEVICE_PATHS
        return takes

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        comm = self.ubnext
        if comm is None:
            return super().all_reduce(input_)  # type: ignore[misc]
        if not self._takes_ubnext(input_):
            self.calls[("all_reduce", "vllm")] += 1
            return super().all_reduce(input_)  # type: ignore[misc]
        out = comm.all_reduce(input_)
        self.calls[("all_reduce", comm.last_path)] += 1
        return out

    def fused(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused all-reduce + residual add + RMSNorm of the pass's operator: (normed, residual_out)."""
        comm = self.ubnext
        if comm is None:
            raise UbnextError(f"vLLM group {self.unique_name!r} has no ubnext communicator")
        out, residual_out, _ = comm.all_reduce_add_rmsnorm(x, residual, weight, eps)
        self.calls[("all_reduce_add_rmsnorm", comm.last_path)] += 1
        return out, residual_out

    def stats(self) -> dict[str, Any]:
        comm = self.ubnext
        return {
            "group": self.unique_name,
            "calls": {f"{op} {path}": n for (op, path), n in sorted(self.calls.items())},
            "batch_invariant": None if comm is None else bool(comm.batch_invariant),
            "ubnext_mode": None if comm is None else comm.mode,
            "pool": self.sizing,
        }

    def suspend(self) -> None:
        super().suspend()  # type: ignore[misc]
        if self.ubnext is not None:
            size = self.ubnext.pool_stats().get("size", 0)
            log.warning(
                "ubnext: vLLM sleep keeps ubnext's pool of group %s (%d bytes): graphs captured before sleep "
                "hold its addresses, so it is neither freed nor moved",
                self.unique_name,
                size,
            )

    def destroy(self) -> None:
        comm, self.ubnext = self.ubnext, None
        if comm is not None:
            _ops.unserve(self.unique_name, self)
            _serving.discard(self)
            try:
                comm.close()
            except Exception as exc:  # noqa: BLE001 - shutdown goes on; the reason is logged
                log.warning("ubnext: closing the communicator of vLLM group %s failed: %s", self.unique_name, exc)
        super().destroy()  # type: ignore[misc]


def communicator_class(base: type, name: str | None = None) -> type:
    """``Ubnext<Base>``: ``base`` with the tensor-parallel all-reduce served by ubnext (made once per base)."""
    cls = _classes.get(base)
    if cls is None:
        name = name or f"Ubnext{base.__name__}"
        cls = type(name, (_UbnextServed, base), {"__module__": "ubnext.integrations.vllm", "__qualname__": name})
        _classes[base] = cls
    return cls
