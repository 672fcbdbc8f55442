"""Which path a call takes: the Communicator's glue between a call's signature and plan.py's pure
path choice, and the cache of both.

``Planner`` is one of the Communicator's parts (ubnext/comm/__init__.py). A plan is a function of the
call's signature, the forced algorithm and what the pool offers (its layout's sizes, never what
this rank has allocated), so every rank plans identically; a signature's path and launch are
then remembered in ``_calls`` and a repeated call skips its checks and its planning. It reads
``_algo``, ``_env_algo``, ``_allow_nondeterministic``, ``batch_invariant``, ``_disabled``, ``_pool`` and
``_pool_error``,
and keeps ``_plans`` and ``_calls``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from .. import kernels, plan
from ..errors import CLOSED, UbnextError
from ..plan import KERNEL_PATHS
from ._executor import Call

# the contract (ubnext/comm/_contracts.py): needs State, Prepared, Executing; provides Planned
if TYPE_CHECKING:
    from ._contracts import Executing, Planned, Prepared, State

    class Part(State, Prepared, Planned, Executing): ...
else:
    Part = object


class Planner(Part):
    """The Communicator's path choice, cached per call signature."""

    def _pool_view(self) -> plan.PoolView:
        pool = self.pool if self.mode != "torch" else None
        if pool is None:
            return plan.PoolView(self._pool_error or "no symmetric pool", mode=self.mode, world_size=self.world_size)
        symm_op = hasattr(torch.ops, "symm_mem") and hasattr(torch.ops.symm_mem, "one_shot_all_reduce")
        # sizes of the layout only, never what this rank has allocated: ranks plan identically
        return plan.PoolView(
            None,
            pool.has_multicast,
            pool.lamport_capacity,
            pool.layout.staging_bytes,
            self.mode,
            symm_op,
            tuple(sorted(self._disabled.items())),
            pool.layout.sized_by,
            self.world_size,
        )

    def _capabilities(self, nbytes: int, dtype: torch.dtype, fused: bool, hidden: int = 0) -> dict[str, str | None]:
        """For each path: None if it can run this call, else why not."""
        return plan.capabilities(
            nbytes, dtype.itemsize, fused, hidden, self._pool_view(), batch_invariant=self.batch_invariant
        )

    def _plan(
        self, nbytes: int, dtype: torch.dtype, fused: bool, hidden: int = 0, in_place_pool: bool = False
    ) -> plan.Plan:
        """The plan of a call, cached: its inputs are the call's signature, the forced algorithm
        and what the pool offers, all identical on every rank and fixed once the pool exists
        (the self-test's verdict included), so a cached plan is the one every rank would
        compute. The pool's creation (or failure) and the forced algorithm are in the key."""
        if self._closed:
            raise UbnextError(CLOSED)
        key = (nbytes, dtype, fused, hidden, in_place_pool, self._algo, self._pool is None, self._pool_error)
        chosen = self._plans.get(key)
        if chosen is None:
            chosen = self._choose(nbytes, dtype, fused, hidden, in_place_pool)
            for path, why in chosen.skipped:  # once per plan, not per call
                self._log_once(path, f"not using {path}: {why}")
            if len(self._plans) < 4096:
                self._plans[key] = chosen
        return chosen

    def _choose(self, nbytes: int, dtype: torch.dtype, fused: bool, hidden: int, in_place_pool: bool) -> plan.Plan:
        """plan.choose for a call of this communicator, neither cached nor logged."""
        return plan.choose(
            nbytes,
            dtype.itemsize,
            fused,
            hidden,
            self._pool_view(),
            forced=self._algo or self._env_algo,
            allow_nondeterministic=self._allow_nondeterministic,
            in_place_pool=in_place_pool,
            batch_invariant=self.batch_invariant,
        )

    def explain(self, x: torch.Tensor, *, fused: bool = False, in_place: bool = False) -> str:
        """Which path an allreduce (``fused``: the fused norm over x's last dimension; ``in_place``:
        ``out=x``) of ``x`` would take, and why the better ones would not. A query: it logs
        nothing (the call itself logs each skipped path once)."""
        if self._closed:
            raise UbnextError(CLOSED)
        nbytes = x.numel() * x.element_size()
        chosen = self._choose(
            nbytes,
            x.dtype,
            fused,
            x.shape[-1] if fused and x.dim() else 0,
            in_place and not fused and self._in_pool_aligned(x),
        )
        lines = [f"{chosen.path}: {chosen.reason} ({nbytes} bytes, {self.world_size} ranks, mode {self.mode})"]
        lines += [f"  not {p}: {why}" for p, why in chosen.skipped]
        return "\n".join(lines)

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
    ) -> Call:
        """The path and the launch of a call whose arguments passed their checks (``hidden``: the
        fused norm's row, 0 for a plain allreduce). Remembered under ``signature``, everything
        the checks and the plan read of the arguments (shapes, dtypes, eps, the forced path), so
        that a call with the same signature skips both and only checks what varies per call
        (contiguity, devices). Like the plan, a function of the call's arguments and of what the
        pool offers: identical on every rank."""
        n = math.prod(shape)
        nbytes = n * dtype.itemsize
        chosen = self._plan(nbytes, dtype, fused=bool(hidden), hidden=hidden, in_place_pool=in_place_pool)
        launch = norm = None
        if chosen.path in KERNEL_PATHS:
            if self.batch_invariant and not hidden and chosen.path in plan.RANK_ORDER_NVLS:
                # the plain NVLS two-shot sums in rank order instead of in the switch (csrc/kernels/nvls.cu);
                # fused rows always do
                flags |= kernels.F_RANK_ORDER
            launch = self._launch_for(chosen.path, dtype, n, hidden, eps, flags)
        elif (
            hidden
            and not self._pool_view().unavailable
            and (hidden * dtype.itemsize) % 16 == 0
            and nbytes <= plan.KERNEL_MAX_BYTES
        ):
            # the message is past the pool: torch.distributed reduces it, and the fusion stays
            norm = self._launch_for("add_rmsnorm", dtype, n, hidden, eps, flags)
        call = Call(chosen.path, launch, norm)
        if len(self._calls) < 4096:
            self._calls[signature] = call
        return call
