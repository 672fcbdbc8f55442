"""All-gather and reduce-scatter (FSDP2's collectives: ubnext.fsdp), on the kernels through the
pool or, where plan.exchange_path says they cannot run, on torch.distributed.

``ExchangeOps`` is one of the Communicator's parts (ubnext/comm/__init__.py). It reads ``_calls``
(Planner), ``_pool``, ``_debug``, ``batch_invariant`` and ``key``, and sets ``last_path``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .. import ops, plan
from ..reference._checks import check_all_gather_args, check_reduce_scatter_args, reduce_factor
from ._executor import Call, flight_recorded

# the contract (ubnext/comm/_contracts.py): needs State, Planned, Executing, AllReducing
if TYPE_CHECKING:
    from ._contracts import AllReducing, Executing, Planned, State

    class Part(State, Planned, Executing, AllReducing): ...
else:
    Part = object


class ExchangeOps(Part):
    """The Communicator's all-gather and reduce-scatter, each with its torch fallback."""

    def all_gather(self, x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Every rank's ``x`` concatenated along the first dimension, in rank order: shape
        ``(world_size * x.shape[0], *x.shape[1:])``, any dtype (the kernel moves bytes). ``out``
        may be a pool tensor (``comm.empty``, or ubnext.fsdp's allocate): the peers then write
        straight into it; otherwise the result passes through the pool's staging region, and a
        result larger than that takes torch.distributed. Whether ``out`` is a pool tensor is an
        argument of the call: every rank passes the same kind (``UBNEXT_DEBUG=1`` compares it).
        Differentiable without ``out``: the gradient of ``x`` is the reduce-scatter (sum) of the
        output's gradient, as torch's functional all-gather's."""
        if out is None:
            return ops.all_gather(x, self.key)
        return ops.all_gather_out(x, out, self.key)

    def reduce_scatter(self, x: torch.Tensor, *, op="sum", out: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's shard of the sum over the ranks: ``x`` is ``world_size`` equal shards along
        its first dimension, and rank r gets ``factor * sum_ranks(shard r)``, summed in fp32 (in
        rank order, rounded once) whatever the dtype. ``op``: "sum", "avg", a factor, or a
        torch.distributed ReduceOp (SUM, AVG, PREMUL_SUM(f)). ``x`` may be a pool tensor, read by
        the peers where it lies; otherwise it is staged as for ``all_gather``. Differentiable without
        ``out``: the gradient of ``x`` is the all-gather of the output's gradient times the factor
        (torch's functional reduce-scatter's for "sum"; it refuses "avg" at backward)."""
        factor = reduce_factor(op, self.world_size)
        if out is None:
            return ops.reduce_scatter(x, factor, self.key)
        return ops.reduce_scatter_out(x, out, factor, self.key)

    def _exchange_call(
        self, signature: tuple, algo: str, dtype: torch.dtype, n: int, nbytes: int, in_pool: bool, factor: float = 0.0
    ) -> Call:
        """The path and launch of an all-gather or reduce-scatter signature (plan.exchange_path),
        made once and remembered like the allreduce's."""
        path, why = plan.exchange_path(algo, nbytes, in_pool, self._pool_view())
        if path == "torch":
            self._log_once(algo, f"{algo} takes torch.distributed: {why}")
        launch = self._launch_for(algo, dtype, n, 0, factor, 0) if path != "torch" else None
        call = Call(path, launch)
        if len(self._calls) < 4096:
            self._calls[signature] = call
        return call

    def _all_gather(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """torch.ops.ubnext.all_gather(_out)'s implementation (the _out operator has refused an out that
        partly overlaps x: check_out_overlap)."""
        check_all_gather_args(x, out, self.world_size)
        if x.device != self.device or out.device != self.device:
            self._check_device("x out", x, out)
        self._check_usable()
        nbytes = x.numel() * x.element_size()
        in_pool = self._in_pool_aligned(out)
        if self._debug:
            self._check_same_across_ranks(("all_gather", nbytes, in_pool))
        if self._copy_at_world_size_1 or nbytes == 0:
            self.last_path = "torch"
            out.view(-1).copy_(x.view(-1))
            return
        signature = ("all_gather", nbytes, in_pool)
        call = self._calls.get(signature)
        if call is None:
            call = self._exchange_call(signature, "allgather", torch.uint8, nbytes, self.world_size * nbytes, in_pool)
        self.last_path = call.path
        if call.launch is None:
            self._torch_all_gather(x, out)
            return
        target = out if in_pool else self._pool.staging((self.world_size * nbytes,), torch.uint8)  # type: ignore[union-attr]  # a kernel path: there is a pool
        src = _on_grid_of(x, target.data_ptr() + self.rank * nbytes)
        self._run(call.launch, (src.data_ptr(), target.data_ptr(), 0, 0, 0, 0, 0))
        if target is not out:
            out.view(-1).view(torch.uint8).copy_(target)
            self._pool_reads_done()

    @flight_recorded("all_gather")
    def _torch_all_gather(self, x: torch.Tensor, out: torch.Tensor) -> None:
        # all_gather_single is all_gather_into_tensor's newer name (torch >= 2.10 deprecates the old one)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out.view(-1), x.reshape(-1), group=self.group)

    def _reduce_scatter(self, x: torch.Tensor, out: torch.Tensor, factor: float) -> None:
        """torch.ops.ubnext.reduce_scatter(_out)'s implementation (the _out operator has refused an out
        that overlaps x: check_out_overlap)."""
        check_reduce_scatter_args(x, out, self.world_size)
        if x.device != self.device or out.device != self.device:
            self._check_device("x out", x, out)
        self._check_usable()
        n, elem = out.numel(), x.element_size()
        in_pool = self._in_pool_aligned(x)
        if self._debug:
            self._check_same_across_ranks(("reduce_scatter", n, str(x.dtype), factor, in_pool))
        if self._copy_at_world_size_1:
            self.last_path = "torch"
            out.view(-1).copy_(x.view(-1).float().mul(factor) if factor != 1.0 else x.view(-1))
            return
        signature = ("reduce_scatter", n, x.dtype, factor, in_pool)
        call = self._calls.get(signature)
        if call is None:
            call = self._exchange_call(signature, "reduce_scatter", x.dtype, n, x.numel() * elem, in_pool, factor)
        self.last_path = call.path
        if call.launch is None:
            self._torch_reduce_scatter(x, out, factor)
            return
        src = x if in_pool else self._pool.staging((x.numel(),), x.dtype).copy_(x.view(-1))  # type: ignore[union-attr]  # a kernel path: there is a pool
        target = out if out.data_ptr() % elem == 0 else torch.empty_like(out)  # the kernel stores whole elements
        self._run(call.launch, (src.data_ptr(), target.data_ptr(), 0, 0, 0, 0, 0))
        if target is not out:
            out.copy_(target)

    @flight_recorded("reduce_scatter")
    def _torch_reduce_scatter(self, x: torch.Tensor, out: torch.Tensor, factor: float) -> None:
        if self.batch_invariant:  # the kernel's bits: the rank-order fp32 sum, then the factor (_allreduce.py)
            out.view(-1).copy_(self._rank_order_shard(x.reshape(-1), factor))
            return
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # as all_gather_single
        if x.device.type == "cpu" and x.dtype != torch.float32:
            # gloo sums in the tensor's dtype; sum in fp32 like the kernel
            acc = torch.empty(out.numel(), dtype=torch.float32)
            scatter(acc, x.reshape(-1).float(), group=self.group)
            out.view(-1).copy_(acc.mul_(factor) if factor != 1.0 else acc)
            return
        scatter(out.view(-1), x.reshape(-1), group=self.group)
        if factor != 1.0:
            out.mul_(factor)


def _on_grid_of(x: torch.Tensor, dst: int) -> torch.Tensor:
    """``x``'s bytes at an address that lies like ``dst`` on the 16-byte grid: the all-gather kernel
    pushes whole vectors only where its input and its slice of the output do (allgather.cu), else
    one byte at a time. ``x`` itself when it does, as FSDP2's in-place slice always does."""
    if (x.data_ptr() - dst) % 16 == 0:
        return x
    nbytes = x.numel() * x.element_size()
    buf = torch.empty(nbytes + 16, dtype=torch.uint8, device=x.device)
    start = (dst - buf.data_ptr()) % 16
    return buf[start : start + nbytes].copy_(x.reshape(-1).view(torch.uint8))
