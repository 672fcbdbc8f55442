"""What the Communicator's parts promise one another, in a form the type checker holds them to.

The :class:`~ubnext.comm.Communicator` is assembled from parts (``_prepare.Preparation``,
``_planning.Planner``, ``_executor.Executor`` and one part per op family) that share ``self``. Each
part reads state that another part, or the constructor, provides. This module names that state, one
``Protocol`` per provider:

- :class:`State`: what ``Communicator.__init__`` sets, before any part runs;
- :class:`Prepared`: the pool, the kernels and the set-up collectives (``Preparation``);
- :class:`Planned`: the path and the launch of a call signature (``Planner``);
- :class:`Executing`: the checks every call makes, and the launch itself (``Executor``);
- :class:`AllReducing`: the allreduce that the other families build on (``AllReduceOps``);
- :class:`Quantizing`: the block quantiser that the fused op's torch fallback ends with (``QuantizeOps``).

Each part module opens with its contract: a ``Part`` protocol, made only while type checking, that
joins what the part needs and what it provides; the part derives from it. mypy then checks that:

- a part uses only what its contract names (anything else is an ``attr-defined`` error);
- a part's own definitions match what its contract says it provides (an override error);
- the assembled Communicator provides everything each part needs: a member that no part and no
  constructor line defines leaves the class abstract, and ``Communicator(...)`` fails to type-check.

At run time ``Part`` is ``object``: the contracts cost a call nothing. Nothing here is imported at
run time by the parts, so the types below may name any of them.

The operators (``ubnext.ops``) reach a communicator through their own contract, ``ops.OpTarget``;
``comm/__init__.py`` checks that the Communicator meets it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # pragma: no cover
    import torch
    import torch.distributed as dist

    from ..errors import UbnextError
    from ..plan import Plan, PoolView
    from ..pool import SymmetricPool
    from ..runtime._emu import Emulator
    from ._executor import Call, Launch


class State:
    """Set by ``Communicator.__init__`` (its comments say what each holds); read by every part.

    A plain class of annotations, not a ``Protocol``: mypy then holds an assignment in any part to
    the declared type (a part that sets ``self._pool_error = "..."`` would otherwise narrow the
    attribute to ``str`` for every part after it)."""

    group: dist.ProcessGroup
    rank: int
    world_size: int
    device: torch.device
    mode: str  # "gpu", "emulator" or "torch"
    key: str
    batch_invariant: bool
    last_path: str | None
    _algo: str | None
    _env_algo: str
    _allow_nondeterministic: bool
    _debug: bool
    _calls: dict[tuple, Call]
    _plans: dict[tuple, Plan]
    _pool: SymmetricPool | None
    _pool_error: str | None
    _closed: bool
    _disabled: dict[str, str]
    _symm_buffers: dict[torch.dtype, torch.Tensor]
    _copy_at_world_size_1: bool
    _count_geometry: bool
    _device_index: int
    _sm_count: int
    _emu: Emulator | None
    _capturing: bool
    _setup_serial: int
    _setup_steps: int
    _setup_failed: UbnextError | None
    _broken: str | None
    _last_stream: int | None
    _max_hidden: int
    _nvls_ctas: int
    _run_self_test: bool


class Prepared(Protocol):
    """``Preparation``: the pool and the kernels, made once and collectively."""

    _kernels_tried: bool

    @property
    def pool(self) -> SymmetricPool | None: ...

    def _allgather(self, obj: Any) -> list[Any]: ...

    def _prepare_kernels(self) -> str | None: ...


class Planned(Protocol):
    """``Planner``: which path a call signature takes, decided once and cached."""

    def _pool_view(self) -> PoolView: ...

    def _capabilities(self, nbytes: int, dtype: torch.dtype, fused: bool, hidden: int = 0) -> dict[str, str | None]: ...

    def _call_for(
        self,
        signature: tuple,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        *,
        hidden: int = 0,
        eps: float = 0.0,
        flags: int = 0,
        in_place_pool: bool = False,
    ) -> Call: ...


class Executing(Protocol):
    """``Executor``: the checks every call makes, and the launch."""

    def _log_once(self, key: str, message: str) -> None: ...

    def _check_usable(self) -> None: ...

    def _check_device(self, names: str, *tensors: torch.Tensor) -> None: ...

    def _check_same_across_ranks(self, what: tuple) -> None: ...

    def _launch_for(
        self,
        algo: str,
        dtype: torch.dtype,
        n: int,
        hidden: int,
        eps: float,
        flags: int,
        geometry: tuple[int, int] | None = None,
    ) -> Launch: ...

    def _launch(
        self,
        how: Launch,
        inp: torch.Tensor,
        out: torch.Tensor,
        residual: torch.Tensor | None = None,
        residual_out: torch.Tensor | None = None,
        weight: torch.Tensor | None = None,
        scale: torch.Tensor | None = None,
        scale_inv: torch.Tensor | None = None,
    ) -> None: ...

    def _run(self, how: Launch, pointers: tuple) -> None: ...

    def _pool_reads_done(self) -> None: ...

    def _in_pool_aligned(self, x: torch.Tensor) -> bool: ...


class AllReducing(Protocol):
    """``AllReduceOps``: the allreduce the fused and exchange families build on."""

    def _all_reduce(self, x: torch.Tensor, out: torch.Tensor, call: Call | None = None) -> torch.Tensor: ...

    def _all_reduce_by(self, call: Call, x: torch.Tensor, out: torch.Tensor) -> None: ...

    def _rank_order_sum(self, flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor: ...

    def _rank_order_shard(self, shards: torch.Tensor, factor: float = 1.0) -> torch.Tensor: ...


class Quantizing(Protocol):
    """``QuantizeOps``: the block-scaled quantiser, which the fused op's torch fallback applies to its
    unquantised output (so that fusion changes no bit)."""

    def _quantize_blocks(
        self, x: torch.Tensor, fmt: str, global_scale: torch.Tensor | None, swizzled: bool, ue8m0: bool
    ) -> tuple[torch.Tensor, torch.Tensor]: ...
