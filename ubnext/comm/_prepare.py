"""Everything collective that happens once per communicator: the kernels' build or load and its
agreement across ranks, the pool's creation (or the agreed reason there is none), the self-test
of every kernel path, and the pool tensors handed to users (``comm.empty``).

``Preparation`` is one of the Communicator's parts (ubnext/comm/__init__.py). Every step here talks to
all ranks through ``_allgather``, and every decision is taken from what all ranks reported, so
that no rank launches a kernel its peers never join. It sets ``_pool`` or ``_pool_error``, ``_emu``,
``_sm_count``, ``_nvls_ctas``, ``_run_self_test`` and ``_disabled``, from ``mode``, ``device``, ``rank``, ``group``
and ``_max_hidden``.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Self

import torch
import torch.distributed as dist

from .. import envs, kernels, plan
from ..errors import CLOSED, UbnextError
from ..pool import NoRoom, SymmetricPool, plan_layout
from ..reference._checks import POOL_DTYPES
from ..runtime import _cuda, _lifecycle, _watchdog

if TYPE_CHECKING:  # pragma: no cover
    pass

log = logging.getLogger("ubnext")
# the kernels' wait bound above which start-up says so (a silent 30 minutes is gloo's default)
LONG_TIMEOUT_S = 300.0

DEFAULT_HIDDEN = 8192


def p2p_report(device: torch.device) -> dict | None:
    """This rank's GPU (its UUID) and which of the GPUs it can see it can reach directly
    (``{uuid: bool}``), for ``p2p_problem``; None without a GPU, or when it sees only its own."""
    if device is None or device.type != "cuda" or torch.cuda.device_count() < 2:
        return None
    me = device.index if device.index is not None else torch.cuda.current_device()
    uuid = lambda i: str(torch.cuda.get_device_properties(i).uuid)  # noqa: E731
    reach = {
        uuid(i): bool(torch.cuda.can_device_access_peer(me, i)) for i in range(torch.cuda.device_count()) if i != me
    }
    return {"uuid": uuid(me), "reach": reach}


def p2p_problem(reports: list) -> str | None:
    """Why the ranks' GPUs cannot share a pool, from every rank's ``p2p_report`` (the same answer on
    every rank), or None. A pair of distinct GPUs that one rank sees and cannot reach (a PCIe box
    with NVLink pairs, ACS on) would hang torch's rendezvous, or fault the first kernel that reads a
    peer; a GPU a rank cannot see (CUDA_VISIBLE_DEVICES per rank) is left to the backends."""
    for a, ra in enumerate(reports):
        for b, rb in enumerate(reports):
            if ra is None or rb is None:
                continue
            if rb["uuid"] != ra["uuid"] and ra["reach"].get(rb["uuid"]) is False:
                return (
                    f"rank {a}'s GPU cannot access rank {b}'s GPU directly (no peer-to-peer path: "
                    "a PCIe topology without NVLink between them, or ACS enabled)"
                )
    return None


# the emulator's variables that change its launches' geometry or its pools (agreed at pool creation)
EMULATOR_GEOMETRY = [
    "UBNEXT_EMU_BLOCK",
    "UBNEXT_EMU_GRID",
    "UBNEXT_EMU_COUNT",
    "UBNEXT_EMU_SM_COUNT",
    "UBNEXT_EMU_MULTICAST",
]


def settings_mismatch(reports: list[dict[str, tuple[Any, str]]]) -> str | None:
    """Each setting whose value differs across the ranks' ``_setup_settings`` reports (``{name: (value,
    how it was set)}``), with each rank's value as it was set (the same text on every rank), or None
    when all agree."""
    parts = []
    for name in reports[0]:
        values = [report.get(name, (None, f"{name} unset")) for report in reports]
        if len({value for value, _ in values}) > 1:
            parts.append(
                f"{name} differs: " + ", ".join(f"rank {rank} has {shown}" for rank, (_, shown) in enumerate(values))
            )
    return "; ".join(parts) or None


_setup_serials: dict[str, itertools.count] = {}


def setup_serial(group) -> int:
    """This communicator's number among those made on ``group`` in this process. The constructor is
    collective, so the number is the same on every rank of the group, and names the communicator's
    set-up steps in the store (``Preparation._setup_allgather``)."""
    return next(_setup_serials.setdefault(group.group_name, itertools.count()))


# check_in's ``departed``: how long a departed peer has to check in (a closing rank announces its
# departure just before it checks in) before the wait takes it for gone, and how often it looks
DEPARTED_GRACE_S = 2.0
DEPARTED_POLL_S = 0.25


def departure_key(group_name: str, serial: int, rank: int) -> str:
    """The store key rank ``rank`` sets when it leaves communicator ``serial`` of its group (close(),
    interpreter exit) before or without its pool: a peer waiting for it in a set-up step stops there
    (issue 40 H2). Per communicator, so that a later communicator of the same group starts clean."""
    return f"ubnext/departed/{group_name}/{serial}/{rank}"


def announce_departure_in_store(group_name: str, serial: int, rank: int) -> None:
    """Set this rank's departure key (``departure_key``): one store write, never a wait. A store already
    gone (its server's rank has exited) has nobody left to tell."""
    try:
        dist.distributed_c10d._get_default_store().set(departure_key(group_name, serial, rank), "1")
    except (RuntimeError, ValueError):  # the store or the default group is gone
        pass


def _wait_for_keys(
    store, keys: list[str], timeout_s: float, departed, departure_keys: list[str] | None = None
) -> str | None:
    """Wait for every key, for ``timeout_s`` at most: None when all are set, else why not. The wait is
    sliced (``DEPARTED_POLL_S``), so that a Ctrl-C is seen between slices and a departed peer ends it:
    ``departed`` (a callable giving the peers that announced their departure in the pool, or None): a
    peer that announced it and has not checked in ``DEPARTED_GRACE_S`` later has left without closing;
    ``departure_keys`` (per rank, or None): a peer whose departure key is set in the store has left
    before or without its pool (``departure_key``), and the wait ends at once."""
    deadline = time.monotonic() + timeout_s
    first_seen: dict[int, float] = {}
    while True:
        left = deadline - time.monotonic()
        if left < 0.01:  # the store counts whole ms, and reads a wait of 0 ms as no bound at all:
            time.sleep(max(left, 0.0))  # the last few ms slept, so the wait is never shorter than its bound
            return "timeout"
        slice_s = min(DEPARTED_POLL_S, left)
        try:
            store.wait(keys, timedelta(seconds=slice_s))
            return None
        except RuntimeError:
            pass
        if departure_keys is None and departed is None:
            continue  # nothing but the bound ends this wait: no peer to look up
        missing = [peer for peer, key in enumerate(keys) if not store.check([key])]
        if departure_keys is not None:
            gone = [peer for peer in missing if store.check([departure_keys[peer]])]
            if gone:
                return f"rank(s) {gone} left without reaching it (closed the communicator, or the script ended there)"
        if departed is not None:
            now = time.monotonic()
            for peer in departed():
                if peer in missing and now - first_seen.setdefault(peer, now) > DEPARTED_GRACE_S:
                    return f"rank {peer} left without reaching it (its departure word is set)"


def setup_step_prefix(group, serial: int, step: int) -> str:
    """The store key prefix of set-up step ``step`` (from 1) of communicator ``serial`` on ``group``."""
    return f"ubnext/setup/{group.group_name}/{serial}/{step}"


# a set-up step's verdict set by a rank that refused to take part, followed by its reason (refuse_setup)
REFUSED = "refused: "


def refuse_setup(group, rank: int, serial: int, reason: str) -> None:
    """Tell the peers of a communicator this rank will not make (its environment is bad) at the first
    set-up step, where they would wait for it: the step's verdict becomes ``reason``, and this rank checks
    in, so that their wait ends as soon as they all arrive and they raise with it. Two store writes, no
    wait: this rank raises at once."""
    store = dist.distributed_c10d._get_default_store()
    prefix = setup_step_prefix(group, serial, 1)
    store.compare_set(f"{prefix}/verdict", "", f"{REFUSED}rank {rank} refused to make the communicator: {reason}")
    store.set(f"{prefix}/{rank}", "1")


def check_in(
    prefix: str,
    rank: int,
    world_size: int,
    timeout_s: float,
    wait: bool = True,
    departed=None,
    departure: tuple[str, int] | None = None,
) -> str | None:
    """Check in under ``<prefix>/<rank>`` in the default store and wait, for ``timeout_s`` at most, for
    every rank of ``world_size`` to check in too: None when they all did, else why not (``waited ... for
    rank(s) [...] of the group, which never reached it``). One verdict per prefix, the first proposal to
    reach the store (``go`` or ``abandon``): ``go`` only comes from a rank that saw every rank check in,
    so a rank arriving just after a peer gave up is told so and gives up too, instead of going on while
    its peers have stopped. ``wait=False`` checks in for the peers' sake and returns None at once;
    ``departed``: see ``_wait_for_keys`` (close() passes its pool's departure words, so that a peer gone on
    an error does not cost the whole timeout); ``departure``: (group name, communicator serial) whose
    store departure keys end the wait (``departure_key``; the set-up steps pass it).
    The once-per-communicator agreements (``Preparation._setup_allgather``, ``Communicator.close``)
    use it: two store writes and a wait each, never on the hot path."""
    store = dist.distributed_c10d._get_default_store()
    store.set(f"{prefix}/{rank}", "1")
    if not wait:
        return None
    keys = [f"{prefix}/{r}" for r in range(world_size)]
    departure_keys = None if departure is None else [departure_key(*departure, r) for r in range(world_size)]
    try:
        why = _wait_for_keys(store, keys, timeout_s, departed, departure_keys)
    except KeyboardInterrupt:
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        log.error("ubnext rank %d: interrupted while waiting at %s for rank(s) %s", rank, prefix, missing)
        raise
    proposal = "go" if why is None else "abandon"  # "go": every rank checked in
    verdict = store.compare_set(f"{prefix}/verdict", "", proposal).decode()
    if verdict == "go":
        return None
    if verdict.startswith(REFUSED):  # refuse_setup's
        return verdict
    if proposal == "go":  # this rank saw everyone, but only after a peer had given up
        return f"reached the step only after a peer had given up waiting for it ({timeout_s:g} s)"
    if why != "timeout":
        return why
    missing = [r for r, key in enumerate(keys) if not store.check([key])]
    return f"waited {timeout_s:g} s for rank(s) {missing} of the group, which never reached it"


# the contract (ubnext/comm/_contracts.py): needs State, Planned, Executing, AllReducing; provides Prepared
if TYPE_CHECKING:
    from ._contracts import AllReducing, Executing, Planned, Prepared, State

    class Part(State, Prepared, Planned, Executing, AllReducing): ...
else:
    Part = object


class Preparation(Part):
    """The Communicator's pool and kernels, made once, collectively."""

    # this rank's kernels, built or loaded once (_prepare_kernels), and why they cannot be if so
    _kernels_tried = False
    _kernels_problem: str | None = None

    def register_hidden(self, hidden: int) -> None:
        """Size the pool for rows of ``hidden`` elements (call before the first op)."""
        if hidden <= 0:
            raise ValueError(f"hidden must be positive, got {hidden}")
        self._max_hidden = max(self._max_hidden, hidden)

    def _allgather(self, obj):
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _setup_allgather(self, obj, step: str = "creating the pool"):
        """``_allgather`` for a once-per-communicator set-up step, bounded: every rank first checks in
        under the step's key in the process group's store, and a rank that finds a peer missing after
        the kernels' timeout raises a UbnextError naming the step and the missing ranks, before it
        enters the all-gather (so gloo's own, much later and nameless error never comes, and no
        collective is left half entered). Two store writes and one wait per step, once per
        communicator: none on the hot path."""
        if self._setup_failed is not None:
            # a step already gave up: the handlers around the pool's steps catch and vote, and each
            # vote must raise at once instead of waiting out the timeout again
            raise self._setup_failed
        self._setup_steps += 1
        prefix = setup_step_prefix(self.group, self._setup_serial, self._setup_steps)
        why = check_in(
            prefix,
            self.rank,
            self.world_size,
            _lifecycle.kernel_timeout_s(self.group, self.device),
            departure=(self.group.group_name, self._setup_serial),
        )
        if why is None:
            return self._allgather(obj)
        if why.startswith(REFUSED):
            self._setup_failed = UbnextError(
                f"ubnext: while {step}, rank {self.rank} learnt that {why[len(REFUSED) :]}"
            )
        else:
            self._setup_failed = UbnextError(
                f"ubnext: while {step}, rank {self.rank} {why} (UBNEXT_TIMEOUT, else the process group's timeout): "
                "every rank must create the communicator and make the same first call (or comm.prepare())"
            )
        self._broken = str(self._setup_failed)
        raise self._setup_failed

    @property
    def pool(self) -> SymmetricPool | None:
        """The symmetric pool, created on first use (collective)."""
        if self._closed:
            raise UbnextError(CLOSED)
        if self._pool is None and self._pool_error is None:
            if _cuda.capturing(self.device):
                raise UbnextError(
                    "ubnext: this communicator's first use is inside CUDA graph capture, but creating its "
                    "pool and loading its kernels synchronise the device and talk to the other ranks, which "
                    "a capture cannot contain: call comm.prepare() on every rank before capturing"
                )
            self._pool = self._create_pool()
            if self._pool is not None:
                if self.world_size > 1:
                    _watchdog.watch(self)
                self._self_test()
        return self._pool

    def prepare(self) -> Self:
        """Create the pool and load every kernel now (collective: every rank calls it). The first
        op does this otherwise; call it before CUDA graph capture, and to keep first-call latency
        (NVRTC compiles, the ranks' rendezvous) out of timed or captured regions."""
        _ = self.pool
        return self

    def _self_test(self) -> None:
        """Run every kernel path once on known data (UBNEXT_SELFTEST=0 skips it), so that a first
        run on new hardware cannot silently give wrong numbers. The inputs are small integers, so
        every correct path returns the exact sum bit for bit, in any summation order. A path that
        differs on any rank is disabled on every rank (agreed), with a warning naming it and the
        mismatch. A kernel that fails outright (timeout, mismatch) raises, as any call would."""
        if not self._run_self_test:  # agreed at pool creation: it is collective
            return
        numel = 2048 * self.world_size + 3  # whole vectors, and a tail that ends inside one
        i = torch.arange(numel, dtype=torch.int64)
        mine = (((i * 7 + self.rank * 3) % 13) - 6).to(torch.bfloat16).to(self.device)
        want = torch.stack([((i * 7 + r * 3) % 13) - 6 for r in range(self.world_size)]).sum(0).to(torch.bfloat16)
        algo, failures = self._algo, {}
        try:
            runnable = self._capabilities(numel * 2, torch.bfloat16, fused=False)
            for path in plan.KERNEL_PATHS:
                if runnable[path] is not None:
                    continue  # this pool cannot run it (no multicast, say): nothing to test
                self._algo = path
                out = self._all_reduce(mine, torch.empty_like(mine))
                got = out.cpu()
                if not torch.equal(got, want):
                    bad = (got != want).nonzero().flatten()
                    k = int(bad[0])
                    failures[path] = (
                        f"rank {self.rank}: {bad.numel()} of {numel} sums wrong, first at {k}: "
                        f"got {got[k].item():g}, want {want[k].item():g}"
                    )
        finally:
            self._algo, self.last_path = algo, None
            self._plans.clear()  # the plans made here did not know the verdict yet
            self._calls.clear()
        for report in self._setup_allgather(failures, "agreeing on the self-test's verdict"):
            for path, why in report.items():
                if path not in self._disabled:
                    self._disabled[path] = why
                    log.warning(
                        "ubnext self-test: %s gave wrong sums (%s); %s is disabled on every rank", path, why, path
                    )

    def _create_pool(self) -> SymmetricPool | None:
        # Agreed before anything is allocated: a rank that cannot build or load the kernels sends
        # every rank to the torch path; a group that spans hosts too (the pool's memory is shared
        # within one node only); the grid bound (blocks wait on the same blocks of their peers)
        # and the kernels' timeout.
        reports = self._setup_allgather(
            {
                "error": self._prepare_kernels(),
                "sm_count": self._sm_count,
                "nvls_ctas": self._nvls_ctas,
                "host": _lifecycle.host_identity(),
                "timeout_s": _lifecycle.kernel_timeout_s(self.group, self.device),
                "selftest": envs.get("UBNEXT_SELFTEST"),
                "p2p": p2p_report(self.device),
                "batch_invariant": getattr(self, "batch_invariant", False),
                "settings": self._setup_settings(),
                "max_hidden": self._max_hidden,
            },
            "agreeing on the kernels before creating the pool",
        )
        modes = [bool(r.get("batch_invariant")) for r in reports]
        if len(set(modes)) > 1:
            # ranks planning in different modes would pair a Lamport launch with a barrier kernel, or
            # the ordered fallback with NCCL's allreduce: refused alike on every rank, before any launch
            on = ", ".join(str(i) for i, m in enumerate(modes) if m)
            raise ValueError(
                f"ubnext: the batch-invariant mode differs across ranks (on at rank(s) {on} only); "
                "set UBNEXT_BATCH_INVARIANT or Communicator(batch_invariant=...) alike on every rank"
            )
        differing = settings_mismatch([r["settings"] for r in reports])
        if differing:
            # ranks with another path or pool layout would pair different kernels, or map a peer's pool at
            # the wrong size (once "mmap length is greater than file size" on one rank, "Broken pipe" on
            # the other): refused alike on every rank, before anything is allocated
            raise ValueError(f"ubnext: settings differ across ranks: {differing}; set them alike on every rank")
        # the pool is sized for the largest hidden size any rank registered, the same layout on every rank
        self._max_hidden = max(r["max_hidden"] for r in reports)
        self._run_self_test = all(r["selftest"] for r in reports)
        if self.mode == "gpu":
            self._sm_count = min(r["sm_count"] for r in reports)
            self._nvls_ctas = min(r["nvls_ctas"] for r in reports)
        # the longest: no rank gives up on a peer that another rank is still willing to wait for
        timeout_s = max(r["timeout_s"] for r in reports)
        if timeout_s > LONG_TIMEOUT_S and self.rank == 0:
            # a peer that is alive but never calls (a rank stuck elsewhere) is waited for this long
            log.info(
                "ubnext: kernels wait up to %g s for a peer (the process group's timeout); "
                "set UBNEXT_TIMEOUT=<seconds> for a shorter bound",
                timeout_s,
            )
        errors = [f"rank {i}: {r['error']}" for i, r in enumerate(reports) if r["error"]]
        if errors:
            self._pool_error = f"ubnext kernels unavailable ({'; '.join(errors)})"
            log.warning("%s; using torch.distributed", self._pool_error)
            return None
        hosts = {r["host"] for r in reports}
        if len(hosts) > 1:
            names = ", ".join(sorted({h.split("/")[0] for h in hosts}))
            self._pool_error = (
                f"the group spans {len(hosts)} hosts ({names}); ubnext's symmetric pool works within one node"
            )
            log.warning("%s; using torch.distributed", self._pool_error)
            return None
        unreachable = p2p_problem([r.get("p2p") for r in reports])
        if unreachable:
            self._pool_error = f"symmetric pool unavailable: {unreachable}"
            log.warning("%s; using torch.distributed", self._pool_error)
            return None
        layout = plan_layout(self.world_size, self._max_hidden or DEFAULT_HIDDEN)
        pool, error = None, None
        try:
            pool = SymmetricPool(
                layout=layout,
                rank=self.rank,
                group=self.group,
                device=self.device,
                allgather=self._setup_allgather,
                timeout_s=timeout_s,
            )
        except (RuntimeError, OSError, ImportError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        # every rank must agree, or one rank launches kernels its peers never join
        errors = [e for e in self._setup_allgather(error) if e]
        if errors:
            if pool is not None:
                pool.close()
            self._pool_error = f"symmetric pool unavailable: {errors[0]}" + self._isolated_gpu_hint()
            log.warning("%s; using torch.distributed", self._pool_error)
            return None
        return pool

    def _setup_settings(self) -> dict[str, Any]:
        """The settings that choose the kernels or lay out the pool, as this rank read them: every rank
        must hold the same (``settings_mismatch``). An unreadable value is reported as its error."""
        algo = self._algo if self._algo is not None else self._env_algo
        shown = f"Communicator(algo={algo!r})" if self._algo is not None else f"UBNEXT_ALGO={algo!r}"
        settings: dict[str, tuple[Any, str]] = {"algo": (algo, shown)}
        names = ["UBNEXT_MAX_BATCH", "UBNEXT_SYMM_POOL_SIZE", "UBNEXT_POOL_BACKEND"]
        if self.mode == "emulator":
            names += EMULATOR_GEOMETRY
        for name in names:
            value = envs.get(name)
            settings[name] = (value, f"{name}={value!r}")
        return settings

    def _isolated_gpu_hint(self) -> str:
        """Why a GPU pool may fail where every rank sees a single GPU (CUDA_VISIBLE_DEVICES set per
        rank, common under SLURM): importing a peer's memory needs the peer's GPU to be visible
        to the driver in this process, as NCCL's own P2P/IPC transports do."""
        if self.mode != "gpu" or self.world_size < 2 or torch.cuda.device_count() != 1:
            return ""
        return (
            f" (every rank sees one GPU, CUDA_VISIBLE_DEVICES={envs.cuda_visible_devices()!r}: the driver "
            "may refuse to map a peer's memory on a GPU this process cannot see. Give each rank all of the "
            "node's GPUs and pick one with torch.cuda.set_device(local_rank))"
        )

    def _prepare_kernels(self) -> str | None:
        """Build or load every kernel this communicator may launch, once: for the pool's agreement, or
        before it for a local op (ubnext/comm/_quantize.py), which must not wait for a peer. None, or why
        this rank cannot."""
        if not self._kernels_tried:
            self._kernels_tried = True
            self._kernels_problem = self._load_kernels()
        return self._kernels_problem

    def _load_kernels(self) -> str | None:
        try:
            if self.mode == "emulator":
                from ..runtime import _emu

                self._emu = _emu.load(envs.get("UBNEXT_EMU_BREAK"))
                seed = envs.get("UBNEXT_EMU_SEED")
                # 0 lets the emulator derive a seed per process; a fixed seed differs per rank
                self._emu.configure(envs.get("UBNEXT_EMU_CHAOS"), seed + self.rank if seed else 0)
            else:
                kernels.load_all(self.device.index)
        except Exception as exc:  # noqa: BLE001 - any failure here means "use torch", agreed below
            log.warning("rank %d cannot prepare the ubnext kernels: %s: %s", self.rank, type(exc).__name__, exc)
            return f"{type(exc).__name__}: {exc}"
        return None

    def empty(self, *shape, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """A tensor in the symmetric pool (collective: every rank allocates the same shapes in the
        same order), so that a GEMM can write its output there (``out=``) and the allreduce runs
        in place. The offset is a function of that order alone (the pool's arenas), the same on
        every rank without a word between them, whenever each rank's garbage collector frees
        the earlier ones. Inside CUDA graph capture it comes from the graph arena, held for the
        pool's life. Falls back to an ordinary tensor, counted in ``pool_stats()['fallbacks']``,
        when it does not fit."""
        if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
            shape = tuple(shape[0])
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"negative dimension in shape {shape}")
        if math.prod(shape) == 0:
            raise ValueError(f"pool tensors must hold at least one element, got shape {shape}")
        if dtype not in POOL_DTYPES:
            raise TypeError(
                f"ubnext pool tensors support bf16, fp16, fp32, e4m3 and uint8 (bytes, as FSDP2 "
                f"all-gathers mixed dtypes), got {dtype}"
            )
        pool = self.pool
        if pool is None:
            return torch.empty(shape, dtype=dtype, device=self.device)
        try:
            return pool.empty(shape, dtype)
        except NoRoom as exc:
            self._log_once("pool", f"comm.empty{shape} {dtype} is not in the pool: {exc}; returning an ordinary tensor")
        return torch.empty(shape, dtype=dtype, device=self.device)

    def pool_stats(self) -> dict[str, Any]:
        pool = self.pool
        if pool is None:
            return {
                "backend": None,
                "size": 0,
                "used": 0,
                "peak": 0,
                "largest_free": 0,
                "fallbacks": 0,
                "reason": self._pool_error,
            }
        return pool.stats()
