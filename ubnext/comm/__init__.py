"""The Communicator: ubnext's public face over a torch.distributed group.

This module holds its construction, its state and its lifecycle; each decision it makes lives in
one part, a module of its own that the class is assembled from:

- ``_prepare.Preparation``: the pool, the kernels and the self-test, made once, collectively;
- ``_planning.Planner``: which path a call takes (plan.py's choice, cached per call signature);
- ``_executor.Executor``: the launch, stream ordering, the error word and alignment staging;
- ``_allreduce.AllReduceOps``, ``_fused.FusedNormOps``, ``_exchange.ExchangeOps``,
  ``_quantize.QuantizeOps``: one operation family each, its torch fallback beside its kernels.

Argument checks and reference math are in ``_checks`` (shared with the operators' fake
implementations in ``ops``), the exceptions in ``errors``.

Paths, best first (``comm.last_path`` uses these names, as does ``UBNEXT_ALGO``):

1. ``lamport``: ubnext Lamport one-shot, when the message fits a Lamport slot of the pool;
2. ``nvls_twoshot`` / ``nvls_lamport`` / ``nvls_oneshot`` (multicast pools) or ``twoshot``
   (unicast): in place in the pool's data arena, when the message fits it;
3. ``torch``: ``torch.distributed.all_reduce`` (NCCL on GPUs, gloo on CPU; multi-node).

``torch_symm`` (torch's symmetric-memory one-shot op) runs only when asked for (plan.auto_order says
why).

The fused op falls back to the chosen allreduce, then add + RMSNorm in torch. Each fallback
step is logged once per communicator with its reason.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .. import envs, plan
from ..errors import UbnextError, UbnextTimeoutError
from ..plan import PATHS, Plan
from ..pool import SymmetricPool
from ..reference._checks import reference_add_rmsnorm, rmsnorm
from ..runtime import _lifecycle
from ..runtime._cuda import gpu_available, no_gpu_reason
from ._allreduce import AllReduceOps
from ._exchange import ExchangeOps
from ._executor import GRID_CAP, Call, Executor
from ._fused import FusedNormOps
from ._planning import Planner
from ._prepare import Preparation, announce_departure_in_store, check_in, refuse_setup, setup_serial
from ._quantize import QuantizeOps

log = logging.getLogger("ubnext")

__all__ = [
    "Communicator",
    "UbnextError",
    "UbnextTimeoutError",
    "PATHS",
    "reference_add_rmsnorm",
    "rmsnorm",
]


_SIGNATURE = "ubnext.Communicator(group=None, *, emulate=None, max_hidden=None, algo=None, batch_invariant=None)"


class Communicator(Preparation, Planner, Executor, AllReduceOps, FusedNormOps, ExchangeOps, QuantizeOps):
    """Collectives over a torch.distributed group, on ubnext kernels where they can run.

    Collective: every rank of ``group`` constructs it, and calls every op, in the same order.
    ``emulate=True`` (or ``UBNEXT_EMULATE=1``) runs the ubnext kernels on the CPU emulator with
    CPU tensors; without a GPU and without emulation every op uses torch.distributed (gloo).
    ``max_hidden`` sizes the pool (see ``register_hidden``); ``algo`` overrides ``UBNEXT_ALGO``.
    ``batch_invariant=True`` (default: ``UBNEXT_BATCH_INVARIANT``) sums every allreduce and
    reduce-scatter in rank order in fp32 on every path and size (docs/BATCH_INVARIANT.md);
    an ``algo`` that reduces through the switch is then refused.
    """

    def __init__(
        self,
        group=None,
        *,
        emulate: bool | None = None,
        max_hidden: int | None = None,
        algo: str | None = None,
        batch_invariant: bool | None = None,
    ):
        # every variable, on every rank, before anything collective (issue 40 C3); a rank with a bad
        # value still tells its peers, which would otherwise wait for it in the rendezvous or the set-up
        environment_problem = envs.first_problem()
        if not dist.is_initialized():
            _lifecycle.bootstrap()  # compares every rank's environment there: a bad one raises on all
        self.group = _lifecycle.process_group(group, _SIGNATURE)
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        if environment_problem is not None:
            # the group was there already: the peers learn it at the first set-up step, where they wait
            refuse_setup(self.group, self.rank, setup_serial(self.group), str(environment_problem))
            raise environment_problem
        # one rank has nothing to reduce: its ops copy, unless the one-GPU check asks for the kernel paths
        # (UBNEXT_WORLD1_KERNELS, a test seam: a one-rank pool runs every unicast kernel on one GPU)
        self._copy_at_world_size_1 = self.world_size == 1 and not envs.get("UBNEXT_WORLD1_KERNELS")
        emulate = envs.get("UBNEXT_EMULATE") if emulate is None else bool(emulate)
        self._sm_count = 0  # GPUs (and count mode): the grid bound, agreed at pool creation
        self._device_index = 0  # GPUs only: the launch's device
        self._count_geometry = False  # the emulator launches as the GPU would (UBNEXT_EMU_COUNT)
        if emulate:
            self.mode, self.device = "emulator", torch.device("cpu")
            if envs.get("UBNEXT_EMU_COUNT"):
                self._count_geometry = True
                self._sm_count = min(GRID_CAP, envs.get("UBNEXT_EMU_SM_COUNT"))
        elif gpu_available():
            self.mode, self.device = "gpu", torch.device("cuda", torch.cuda.current_device())
            self._device_index = self.device.index
            props = torch.cuda.get_device_properties(self.device)
            self._sm_count = min(GRID_CAP, props.multi_processor_count)
            self._nvls_ctas = 32 if props.major >= 10 else 16
        else:
            self.mode, self.device = "torch", torch.device("cpu")
        self._max_hidden = max_hidden or 0
        if algo is not None and algo not in envs.ALGORITHMS:
            raise ValueError(f"algo must be one of {envs.ALGORITHMS}, got {algo!r}")
        self._algo = algo  # overrides UBNEXT_ALGO for this communicator
        self._pool: SymmetricPool | None = None
        self._pool_error: str | None = None
        self._emu = None
        self._symm_buffers: dict[torch.dtype, torch.Tensor] = {}  # torch_symm's, one per dtype
        self._broken: str | None = None
        self._closed = False
        # the stream of the last eager call, and the event recorded after the last eager launch
        # (_order_after_other_stream); gpu mode
        self._last_stream: int | None = None
        self._launch_done = None
        self._stream = 0  # the current call's stream (gpu mode, raw handle), set by _check_usable
        self._capturing = False  # whether the current call is captured (gpu mode), set by _check_usable
        self._disabled: dict[str, str] = {}  # kernel paths the self-test turned off, on every rank
        self._run_self_test = False  # agreed at pool creation
        self._setup_serial = setup_serial(self.group)  # names its set-up steps in the store
        self._flight_group = self.group.group_name  # names its flight record in the store (_watchdog)
        self._setup_steps = 0
        self._setup_failed: UbnextError | None = None  # a set-up step that gave up on a peer
        # read once per communicator (docs/RUNTIME.md, how the environment is read): the hot path reads no
        # environment, and a plan, once made, stays right
        self._env_algo = envs.get("UBNEXT_ALGO")
        self.batch_invariant = envs.get("UBNEXT_BATCH_INVARIANT") if batch_invariant is None else bool(batch_invariant)
        if self.batch_invariant:  # before anything collective: every rank refuses alike
            plan.refuse_in_batch_invariant_mode(self._algo or self._env_algo)
        self._allow_nondeterministic = envs.get("UBNEXT_ALLOW_NONDETERMINISTIC")
        self._debug = envs.get("UBNEXT_DEBUG")
        self._plans: dict[tuple, Plan] = {}
        self._calls: dict[tuple, Call] = {}  # per call signature: its plan and launch (_call_for)
        self.last_path: str | None = None
        if self.mode == "torch":
            self._pool_error = f"no GPU ({no_gpu_reason()}) and emulation is off"
        # the name under which torch.ops.ubnext.* find this communicator
        self.key = _lifecycle.register(self)

    # -- lifecycle ----------------------------------------------------------------------------

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc_type is None:
            self.close()
        else:
            # leaving on an error is a departure: its peers may never close (the error may be theirs)
            self._release()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Release the pool (collective: every rank calls it). This rank finishes its work and marks
        itself departed in every peer's pool (a peer that calls the communicator after this rank
        closed it raises at once, instead of waiting out the timeout), then waits for every rank to
        reach close() before its pool goes (docs/ARCHITECTURE.md, "Closing agrees across ranks"), for
        the kernels' timeout at most: past it the pool goes all the same and UbnextTimeoutError names
        the ranks that never came. No word to the peers when the pool was never made (no op ran), and
        no wait when this communicator has failed (an abort, a set-up step that gave up), whose peers
        may have left for good."""
        self._release(agree=True)

    def _release(self, agree: bool = False) -> None:
        """Release the pool and drop the process group: a held group keeps gloo's worker
        threads alive into interpreter finalisation (ubnext/runtime/_lifecycle.py says why that aborts).
        ``agree``: close()'s agreement; the departure paths (interpreter exit, ``__exit__`` on an
        exception) leave without it, so that a rank's peers need not be there."""
        if self._closed:
            return
        self._closed = True
        failure = None
        if self.world_size > 1 and self.group is not None and dist.is_initialized():
            # a peer waiting for this rank in a set-up step (its first op, this rank's never) stops there
            announce_departure_in_store(self.group.group_name, self._setup_serial, self.rank)
        try:
            pool = self._pool
            if pool is not None:
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                # this rank's work is done: a peer still waiting for it (it called once more, or this
                # rank is leaving early: an exception, interpreter exit) raises within 100 ms
                pool.announce_departure()
                if agree and self.world_size > 1:
                    failure = self._agree_on_teardown(pool)
                pool.close()
        finally:
            self._pool = None
            self._calls.clear()
            self._symm_buffers.clear()
            # the reference to the process group goes (runtime/_lifecycle.py says why); a closed
            # communicator refuses every call before it reads the group
            self.group = None  # type: ignore[assignment]
        if failure is not None:
            raise failure

    def _agree_on_teardown(self, pool: SymmetricPool) -> UbnextError | None:
        """close()'s agreement: check in under this communicator's close key in the process group's
        store and wait for every rank's (``_prepare.check_in``), bounded by the kernels' timeout as the
        ranks agreed on it at pool creation. Past the bound, the error to raise once the pool is gone
        (the teardown goes on: a rank that waited that long for its peers has nothing left to wait
        for, and a raise is what tells the program that its ranks closed differently). A failed
        communicator checks in without waiting: a peer that left on an error never checks in."""
        if not dist.is_initialized():  # the process group, and its store, destroyed before close()
            log.warning(
                "ubnext: closing %r after its process group was destroyed: no agreement with the "
                "peers before its pool goes",
                self,
            )
            return None
        failed = bool(self._broken or pool.err_view[0])
        try:
            why = check_in(
                f"ubnext/close/{self.group.group_name}/{self._setup_serial}",
                self.rank,
                self.world_size,
                pool.timeout_s,
                wait=not failed,
                departed=pool.departed_peers,
            )
        except RuntimeError as exc:  # the store is unreachable: its server's rank has exited, say
            return UbnextError(
                f"ubnext: while closing the communicator, rank {self.rank} could not reach the "
                f"process group's store ({type(exc).__name__}: {exc}); its pool was released all the same"
            )
        if why is None:
            return None
        return UbnextTimeoutError(
            f"ubnext: while closing the communicator, rank {self.rank} {why} (UBNEXT_TIMEOUT, else the process "
            "group's timeout); its pool was released all the same: every rank must close() it, or leave "
            "(an exception out of its with-block, interpreter exit) without waiting for the others"
        )

    def __repr__(self) -> str:
        return f"Communicator(rank={self.rank}, world_size={self.world_size}, mode={self.mode})"


# the class _lifecycle builds for a group's cached communicator (ubnext.get_communicator)
_lifecycle.communicator_class = Communicator

if TYPE_CHECKING:  # pragma: no cover

    def _contracts_hold() -> Communicator:
        """Never run: mypy checks this body. Constructing the class is refused while any member that a
        part's contract needs (ubnext/comm/_contracts.py) is left abstract, that is, provided by no
        part and set by no constructor line."""
        return Communicator()
