"""The allreduce: its public methods, its implementation on every path (the kernels, torch's
symmetric-memory ops, torch.distributed), and the GEMM + allreduce of the row-parallel Linear.

``AllReduceOps`` is one of the Communicator's parts (ubnext/comm/__init__.py). Its public methods enter
through the operators (ubnext/ops/__init__.py); the operators call the underscored implementations here.
It reads ``_calls`` (Planner), ``_pool``, ``_algo``, ``_debug``, ``batch_invariant`` and ``key``, sets
``last_path``, and
keeps torch_symm's buffers in ``_symm_buffers`` (one per dtype).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .. import kernels, ops, plan
from ..pool import TORCH_SYMM_SEGMENT, NoRoom
from ..pool.layout import _align
from ..reference._checks import check_all_reduce_args, check_linear_args
from ..runtime import _cuda
from ._executor import Call, Launch, flight_recorded, reads_own_input_only

# torch symmetric buffers a captured call used: kept until the process exits (a graph may be
# replayed at any time)
_SYMM_KEPT_FOR_GRAPHS: list[torch.Tensor] = []


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of equal shape are the same memory (the dispatcher may hand an
    operator a different Python object for the tensor the caller passed)."""
    return a is b or (a.data_ptr() == b.data_ptr() and a.device == b.device and a.stride() == b.stride())


# the contract (ubnext/comm/_contracts.py): needs State, Prepared, Planned, Executing; provides AllReducing
if TYPE_CHECKING:
    from ._contracts import AllReducing, Executing, Planned, Prepared, State

    class Part(State, Prepared, Planned, Executing, AllReducing): ...
else:
    Part = object


class AllReduceOps(Part):
    """The Communicator's allreduce, with its torch fallbacks beside its kernel paths."""

    def all_reduce(self, x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Sum of ``x`` over the ranks. ``x`` is unchanged unless ``out is x``."""
        if out is None:
            return ops.all_reduce(x, self.key)
        return ops.all_reduce_out(x, out, self.key)

    def _all_reduce(self, x: torch.Tensor, out: torch.Tensor, call: Call | None = None) -> torch.Tensor:
        """The allreduce itself (torch.ops.ubnext.all_reduce's implementation); ``out`` may be x (an out
        the caller gave that partly overlaps x is refused before, by all_reduce_out: check_out_overlap).
        A caller that made x and out itself, fresh and contiguous, passes their signature's
        ``call`` (as _linear_all_reduce does): the signature's checks are then its word."""
        in_place = in_place_pool = False
        if call is None:
            try:
                in_place = _same_memory(out, x)
                # a pool tensor reduced where it lies needs no staging: part of the call's signature
                in_place_pool = in_place and self._in_pool_aligned(x)
                signature = ("all_reduce", x.shape, x.dtype, out.shape, out.dtype, in_place_pool, self._algo)
            except AttributeError:  # not a tensor (an operator passes None through): say which
                check_all_reduce_args(x, out)
                raise
            call = self._calls.get(signature)
            if call is None or not (x.is_contiguous() and out.is_contiguous()):
                check_all_reduce_args(x, out)  # what a remembered signature does not vouch for
        device = self.device
        if x.device != device or out.device != device:
            self._check_device("x out", x, out)
        self._check_usable()
        if self._debug:
            self._check_same_across_ranks(("all_reduce", tuple(x.shape), str(x.dtype), in_place_pool))
        if call is None:  # a remembered signature has more than one rank and elements to reduce
            if self._copy_at_world_size_1 or x.numel() == 0:
                self.last_path = "torch"
                return out if in_place else out.copy_(x)
            call = self._call_for(signature, x.shape, x.dtype, in_place_pool=in_place_pool)
        if in_place:
            out = x  # the kernels' in-place test is identity
        self.last_path = call.path
        self._all_reduce_by(call, x, out)
        return out

    def _all_reduce_by(self, call: Call, x: torch.Tensor, out: torch.Tensor) -> None:
        path, launch = call.path, call.launch
        if launch is None:  # torch_symm and torch: no ubnext kernel (Call)
            if path == "torch_symm":
                self._torch_symm_all_reduce(x, out)
            else:
                self._torch_all_reduce(x, out)
        elif path in ("lamport", "nvls_lamport") and reads_own_input_only(path, launch.scalars[3]):
            self._launch(launch, x, out)  # x anywhere, in place too: no peer reads it
        elif path in plan.IN_PLACE_PATHS:
            self._in_place(launch, x, out)
        else:  # nvls_oneshot, nvls_lamport
            # peers read `in` through multicast while this rank writes `out`: never the same memory
            in_pool = out is not x and self._in_pool_aligned(x)
            stage = x if in_pool else self._pool.staging(x.shape, x.dtype).copy_(x)  # type: ignore[union-attr]  # a kernel path's call exists only with a pool
            self._launch(launch, stage, out)

    def _straight_into_out(self, launch: Launch, dtype: torch.dtype) -> Launch:
        """``launch`` (a flat nvls_twoshot) with UBNEXT_F_MULTICAST: its broadcast lands in a pool
        ``out`` (made once per launch)."""
        cache = self.__dict__.setdefault("_straight_launches", {})
        key = (launch.name, launch.scalars)
        made = cache.get(key)
        if made is None:
            n, hidden, eps, flags = launch.scalars
            made = cache[key] = self._launch_for(launch.algo, dtype, n, hidden, eps, flags | kernels.F_MULTICAST)
        return made

    def _linear_all_reduce(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T`` summed over the ranks (torch.ops.ubnext.linear_all_reduce, the row-parallel
        ubnext.nn.Linear). A path that reduces through the pool's staging region finds the GEMM's
        output already there, at the same offset on every rank whatever each rank has allocated
        (no copy in); Lamport reads its input anywhere, so for a signature planned to take it the
        GEMM writes a fresh tensor. The sum lands in a fresh tensor, since the next call reuses
        the staging region."""
        shape = (*x.shape[:-1], weight.shape[0])
        # the plan of the GEMM output's allreduce, decided before the first GEMM of a signature,
        # so that every call of it runs the same GEMM
        signature = ("linear_all_reduce", x.shape, x.dtype, weight.shape, weight.dtype, self._algo)
        planned = self._calls.get(signature)
        if planned is None:
            check_linear_args(x, weight)
            if self.world_size > 1 and math.prod(shape) > 0:
                planned = self._call_for(signature, shape, x.dtype)
        if planned is not None and planned.path == "lamport":
            # in place: each Lamport thread reads its vectors of `in` before it writes them in `out`
            y = torch.nn.functional.linear(x, weight)
            return self._all_reduce(y, y, planned)
        staged = self._staging_or_none(shape, x.dtype)
        if staged is None:
            y = torch.nn.functional.linear(x, weight)
        else:
            y = torch.matmul(x, weight.t(), out=staged)
        return self._all_reduce(y, torch.empty_like(y))

    def _staging_or_none(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """A view of the pool's staging region, or None when there is no pool or the shape does
        not fit."""
        pool = self._pool
        if pool is None:
            pool = self.pool if self.mode != "torch" else None  # made on first use
        if pool is None:
            return None
        self._check_usable()  # before the caller's GEMM writes into staging
        try:
            return pool.staging(shape, dtype)
        except NoRoom:
            return None

    def _in_place(self, launch: Launch, x: torch.Tensor, out: torch.Tensor) -> None:
        if out is x and self._in_pool_aligned(x):
            self._launch(launch, x, x)
            return
        if (
            launch.algo == "nvls_twoshot"
            and self._in_pool_aligned(x)
            and self._in_pool_aligned(out)
            and (out.data_ptr() >= x.data_ptr() + x.nbytes or x.data_ptr() >= out.data_ptr() + out.nbytes)
        ):
            # both in the pool: the broadcast goes straight into out (csrc/kernels/nvls.cu), no staging
            # copy in and no copy out; x is left as it was
            self._launch(self._straight_into_out(launch, x.dtype), x, out)
            return
        stage = self._pool.staging(x.shape, x.dtype)  # type: ignore[union-attr]  # a kernel path: there is a pool
        if stage.data_ptr() != x.data_ptr():  # x may already be the staging region
            stage.copy_(x)
        self._launch(launch, stage, stage)
        out.copy_(stage)
        self._pool_reads_done()

    @flight_recorded("all_reduce")
    def _torch_all_reduce(self, x: torch.Tensor, out: torch.Tensor) -> None:
        if self.batch_invariant:
            out.view(-1).copy_(self._rank_order_sum(x.reshape(-1), x.dtype))
            return
        if x.device.type == "cpu" and x.dtype != torch.float32:
            # gloo sums in the tensor's dtype; sum in fp32 like the kernels do
            acc = x.float()
            dist.all_reduce(acc, group=self.group)
            out.copy_(acc)
            return
        if out is not x:
            out.copy_(x)
        dist.all_reduce(out, group=self.group)

    def _rank_order_sum(self, flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The batch-invariant mode's fallback (past the pool, or no kernels): the sum over the
        ranks of ``flat`` in rank order from +0, each addition in fp32, rounded once to ``dtype``
        (fp32: the fused op adds its residual to the unrounded sum), so its bits are the kernels'
        (sum_over_ranks in csrc/device/slices.cuh; Lamport's). torch.distributed's own allreduce
        promises no order, so the ranks' values travel instead: an all-to-all gives each rank every
        rank's value of its 1/N of the message, which it sums in rank order, and an all-gather hands
        everyone the whole. In the dtype that is the bytes of NCCL's ring allreduce, (N-1)/N of the
        message each way; in fp32 for a 16-bit message the all-gather's leg doubles (1.5 times).
        Returns ``flat``'s length."""
        n, world = flat.numel(), self.world_size
        m = -(-n // world)
        shards = torch.zeros(world * m, dtype=flat.dtype, device=flat.device)
        shards[:n].copy_(flat)
        mine = self._rank_order_shard(shards).to(dtype)
        gathered = torch.empty(world * m, dtype=dtype, device=flat.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # as _exchange.py
        gather(gathered.view(torch.uint8), mine.view(torch.uint8), group=self.group)
        return gathered[:n]

    def _rank_order_shard(self, shards: torch.Tensor, factor: float = 1.0) -> torch.Tensor:
        """``factor`` times the fp32 rank-order sum of this rank's 1/N of ``shards`` (a flat tensor
        of N equal shards, as a reduce-scatter takes it): fp32, one shard long. Bytes move as bytes,
        so any dtype and backend (gloo has no bf16 sum) takes the same route."""
        world = self.world_size
        m = shards.numel() // world
        received = torch.empty_like(shards)
        dist.all_to_all_single(received.view(torch.uint8), shards.view(torch.uint8), group=self.group)
        acc = torch.zeros(m, dtype=torch.float32, device=shards.device)  # from +0, as the kernels
        for part in received.view(world, m):
            acc.add_(part.float())
        return acc.mul_(factor) if factor != 1.0 else acc

    def _torch_symm_refusal(self, x: torch.Tensor, op_name: str) -> str | None:
        """Why torch's symmetric-memory op cannot take ``x`` here, or None: what torch 2.13 refuses
        inside the user's call (CUDASymmetricMemoryOps.cu dispatches float and bfloat16 only, and
        needs 4-byte-aligned sizes; rendezvous refuses a group whose ranks share a device, which is
        when ubnext's pool is its own VMM one). The same on every rank: dtype, size and the agreed
        backend."""
        if x.dtype not in (torch.float32, torch.bfloat16):
            return f"{op_name} takes float32 and bfloat16 only, not {x.dtype}"
        if (x.numel() * x.element_size()) % 4:
            return f"{op_name} needs a size in whole 4-byte words ({x.numel()} {x.dtype} elements)"
        pool = self.pool
        backend = pool.backend.name if pool is not None else None
        if backend != "torch_symm":
            return f"the pool is not torch's symmetric memory ({backend or self._pool_error})"
        return None

    def _torch_symm_all_reduce(self, x: torch.Tensor, out: torch.Tensor, op_name: str = "one_shot_all_reduce") -> None:
        import torch.distributed._symmetric_memory as symm_mem

        refusal = self._torch_symm_refusal(x, op_name)
        if refusal:
            self._log_once("torch_symm", f"torch_symm: {refusal}; using torch.distributed")
            self._torch_all_reduce(x, out)
            self.last_path = "torch"
            return
        buf = self._symm_buffers.get(x.dtype)
        capturing = _cuda.capturing(self.device)
        if (buf is None or buf.numel() < x.numel()) and capturing:
            # a larger buffer means an allocation and a rendezvous, which a capture cannot contain;
            # the buffers' sizes follow from the call sequence, the same on every rank: agreed
            self._log_once(
                "capture",
                f"torch_symm: no {x.dtype} buffer of {x.numel()} elements was made "
                "before capture; this captured call uses torch.distributed (run it once eagerly first)",
            )
            self._torch_all_reduce(x, out)
            return
        if buf is None or buf.numel() < x.numel():
            # one buffer per dtype, grown to the largest call (in whole segments of torch's allocator):
            # one per call size would cost a symmetric allocation, a rendezvous and a multicast object
            # for each prefill length, until the GPU runs out of one of them. The smaller one goes
            # back to torch, which synchronises the device before it unmaps it (AllocationRef)
            numel = _align(x.numel() * x.element_size(), TORCH_SYMM_SEGMENT) // x.element_size()
            self._symm_buffers.pop(x.dtype, None)
            del buf  # freed before the larger one is made, so that the two never coexist
            buf = symm_mem.empty(numel, dtype=x.dtype, device=self.device)
            symm_mem.rendezvous(buf, self.group.group_name)
            self._symm_buffers[x.dtype] = buf
        if capturing and not any(kept is buf for kept in _SYMM_KEPT_FOR_GRAPHS):
            # the graph addresses this buffer on every replay, long after it was replaced or closed
            _SYMM_KEPT_FOR_GRAPHS.append(buf)
        # torch's ops take a view: they find the allocation from the storage (rendezvous) and
        # address it at the view's storage offset, 0 here (CUDASymmetricMemoryOps.cu)
        buf = buf[: x.numel()]
        buf.copy_(x.reshape(-1))
        op = getattr(torch.ops.symm_mem, op_name)
        result = op(buf, "sum", self.group.group_name)
        # the in-place variants (trailing underscore) leave the sum in buf
        out.copy_((buf if op_name.endswith("_") else result).view_as(x))
        self._pool_reads_done()

    def all_reduce_torch_symm(self, x: torch.Tensor, op_name: str) -> torch.Tensor:
        """Allreduce by one named torch symmetric-memory op where it exists (CUDA tensors),
        else by the normal path choice (logged once)."""
        return ops.all_reduce(x, self.key, op_name)

    def _all_reduce_torch_symm(self, x: torch.Tensor, op_name: str) -> torch.Tensor:
        check_all_reduce_args(x)
        self._check_device("x", x)
        self._check_usable()
        usable = self.mode == "gpu" and hasattr(torch.ops, "symm_mem") and hasattr(torch.ops.symm_mem, op_name)
        if not usable or self.world_size == 1 or self.batch_invariant:
            why = "promises no summation order (batch-invariant mode)" if self.batch_invariant else "unavailable here"
            self._log_once("torch_symm", f"torch symmetric-memory op {op_name} {why}; using the ubnext path choice")
            return self._all_reduce(x, torch.empty_like(x))
        out = torch.empty_like(x)
        self.last_path = "torch_symm"  # unless it falls back (_torch_symm_all_reduce says so)
        self._torch_symm_all_reduce(x, out, op_name)
        return out
