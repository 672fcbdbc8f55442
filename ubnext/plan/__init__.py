"""Path choice as a pure function: the call's signature and what the pool offers in, a plan out.

Its inputs are identical on every rank (the call's arguments, the pool's layout and kind), never
per-rank state such as which pool tensors this rank has allocated or freed: ranks whose
histories differ still choose the same path.

The Communicator describes its pool as a :class:`PoolView`; ``python -m ubnext.info`` builds
one from the pool layout a world size would get, so both answer "which path, and why not the
better ones" with the same code.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import _thresholds

PATHS = ("lamport", "nvls_oneshot", "nvls_twoshot", "nvls_lamport", "twoshot", "torch_symm", "torch")
KERNEL_PATHS = ("lamport", "nvls_oneshot", "nvls_twoshot", "nvls_lamport", "twoshot")
# the kernels that reduce a pool tensor where it lies (out is in); the others read `in` while
# writing `out`, so an in-place call of theirs is staged
IN_PLACE_PATHS = ("nvls_twoshot", "twoshot")
# The automatic order of the paths for a message, fastest first, comes from the calibrated cost model
# per operation, world size and multicast (ubnext/plan/_thresholds.py, generated; ubnext/tuning/_crossovers.py
# says how). Tests that plan without a world size get this one's table.
DEFAULT_WORLD = 8
# The paths that reduce through the switch (multimem.ld_reduce), whose summation order is not promised:
# the batch-invariant mode never reduces with them (its multicast stores may still broadcast, as Lamport's
# push does)
LD_REDUCE_PATHS = ("nvls_oneshot", "nvls_twoshot", "nvls_lamport")
# ... except these two, whose owner sums its portion by unicast loads in rank order instead (fp32, one
# rounding: csrc/device/slices.cuh owner_add_round) and broadcasts it with multicast stores: always for
# the fused op's rows, and for a plain allreduce under the kernel flag UBNEXT_F_RANK_ORDER, which the
# mode sets (ubnext/comm/_allreduce.py). The mode keeps them. nvls_oneshot has no such form.
RANK_ORDER_NVLS = ("nvls_twoshot", "nvls_lamport")
NOT_RANK_ORDER = (
    "multimem.ld_reduce sums in the switch's order, not in rank order, which the batch-invariant mode needs"
)


@dataclass(frozen=True)
class PoolView:
    """What the planner needs to know of a communicator and its pool."""

    unavailable: str | None  # why no ubnext kernel can run at all, or None
    has_multicast: bool = False
    lamport_capacity: int = 0
    staging_bytes: int = 0  # the pool's staging region (fixed by the layout, equal on every rank)
    mode: str = "torch"  # gpu | emulator | torch
    torch_symm_op: bool = False  # torch has a symmetric-memory allreduce op
    disabled: tuple[tuple[str, str], ...] = ()  # (path, why): turned off by the agreed self-test
    sized_by: str = ""  # what fixed the pool's sizes (PoolLayout.sized_by)
    world_size: int = DEFAULT_WORLD  # the group's size: which table of path orders applies


@dataclass
class Plan:
    path: str
    reason: str
    skipped: list[tuple[str, str]] = field(default_factory=list)


def capabilities(
    nbytes: int,
    elem_bytes: int,
    fused: bool,
    hidden: int,
    pool: PoolView,
    in_place_pool: bool = False,
    batch_invariant: bool = False,
) -> dict[str, str | None]:
    """For each path: None if it can run this call, else why not. ``in_place_pool``: the call
    reduces a pool tensor in place. That is an argument of the call, like its shape: every rank
    must pass the same kind of tensor (UBNEXT_DEBUG compares it). Ranks that differ get a clear
    error only where they all reach a kernel (the call header compares their offsets); past the
    staging region, a rank passing an ordinary tensor takes torch.distributed instead, and both
    sides wait until their timeouts."""
    why: dict[str, str | None] = {}
    if pool.unavailable:
        no_kernels = pool.unavailable
    elif nbytes > KERNEL_MAX_BYTES:
        no_kernels = TOO_LARGE
    elif fused and (hidden * elem_bytes) % 16:
        # the norm kernels work on whole 16-byte vectors per row (csrc/device/norm.cuh)
        no_kernels = f"hidden size {hidden} is not a multiple of {16 // elem_bytes} elements"
    else:
        no_kernels = None
    disabled = dict(pool.disabled)
    for path in KERNEL_PATHS:
        if no_kernels:
            why[path] = no_kernels
        elif path in disabled:
            why[path] = f"disabled by the self-test at preparation ({disabled[path]})"
        elif batch_invariant and path in LD_REDUCE_PATHS and path not in RANK_ORDER_NVLS:
            why[path] = NOT_RANK_ORDER
        elif path.startswith("nvls") and not pool.has_multicast:
            why[path] = "the pool has no multicast address"
        elif (
            path in ("lamport", "nvls_lamport")
            and (needed := lamport_bytes_needed(path, nbytes, fused, pool.world_size, batch_invariant))
            > pool.lamport_capacity
        ):
            what = f"{nbytes} bytes" if needed == nbytes else f"{nbytes} bytes ({needed} in its push form's slot)"
            why[path] = f"{what} exceed the Lamport slot ({pool.lamport_capacity} bytes{_sizing(pool)}"
        elif (
            path != "lamport"
            and nbytes > pool.staging_bytes
            and not (in_place_pool and path in IN_PLACE_PATHS)
            and not pushes(path, fused, batch_invariant)
        ):
            # a pool tensor reduced in place by a two-shot kernel already sits where the kernel
            # reduces it; the push form reads only this rank's x, wherever it is; every other call
            # is staged
            why[path] = f"{nbytes} bytes exceed the pool's staging region ({pool.staging_bytes} bytes{_sizing(pool)}"
        elif path == "nvls_oneshot" and fused:
            why[path] = "nvls_oneshot does not promise identical bits, which the fused norm needs"
        else:
            why[path] = None
    if batch_invariant:
        why["torch_symm"] = "torch's symmetric-memory op promises no summation order"
    elif pool.mode != "gpu":
        why["torch_symm"] = "torch symmetric-memory ops need CUDA tensors"
    elif fused or not pool.torch_symm_op:
        why["torch_symm"] = "torch has no symmetric-memory allreduce op for this call"
    else:
        why["torch_symm"] = None
    why["torch"] = None
    return why


def lamport_bytes_needed(path: str, nbytes: int, fused: bool, world_size: int, batch_invariant: bool) -> int:
    """The bytes of one Lamport slot (less its header) that a call of ``path`` fills: the message for
    ``lamport``, and at most the message for ``nvls_lamport``; the batch-invariant mode's plain
    ``nvls_lamport`` (its push form, csrc/kernels/nvls.cu) holds each rank's portion twice, received
    and broadcast: 2 x 16 x ceil(vectors / N), a quarter of the message at 8 ranks."""
    if pushes(path, fused, batch_invariant):
        vectors = -(-nbytes // 16)  # 16-byte vectors, rounded up
        return 2 * 16 * -(-vectors // world_size)
    return nbytes


def pushes(path: str, fused: bool, batch_invariant: bool) -> bool:
    """Whether a call runs nvls_lamport's push form (the batch-invariant mode's plain nvls_lamport,
    kernel flag UBNEXT_F_RANK_ORDER): it reads only this rank's x, so it is never staged
    (ubnext/comm/_executor.py reads_own_input_only says the same of its launch)."""
    return path == "nvls_lamport" and batch_invariant and not fused


def _sizing(pool: PoolView) -> str:
    """The end of a "does not fit" reason: what sized the pool, and how to get a larger one."""
    sized = f", from {pool.sized_by}" if pool.sized_by else ""
    return (
        f"{sized}): the pool is sized when the communicator is first used; set UBNEXT_MAX_BATCH "
        "(or UBNEXT_SYMM_POOL_SIZE) larger, or register the larger hidden size (comm.register_hidden, "
        "which ubnext.nn.Linear does when built) before the first op"
    )


def auto_order(
    nbytes: int,
    fused: bool,
    has_multicast: bool,
    allow_nondeterministic: bool,
    world_size: int = DEFAULT_WORLD,
    elem_bytes: int = 2,
) -> list[str]:
    """Paths to try, best first, for a message of ``nbytes``: the order the calibrated cost model gives
    at this world size (the largest tabled world's above it), among ubnext's kernels and, by its
    published figures, torch.distributed (NCCL), which then ends the chain (ubnext/tuning/_crossovers.py).
    ``nvls_oneshot`` only for a plain allreduce that may differ in the last bit across ranks.
    ``torch_symm`` is not among them (issue 23): where the chain reaches torch.distributed, NCCL
    serves the message at least as fast as torch's one-shot op (slower than NCCL from 32 MiB), and
    that op refuses fp16 and 2-byte tensors of odd length and needs torch's own symmetric pool; it
    runs only when asked for (UBNEXT_ALGO=torch_symm, or a layer's symmetric_ar_type naming a torch
    op)."""
    order = [
        p
        for p in model_order(nbytes, fused, has_multicast, world_size, elem_bytes)
        if p != "nvls_oneshot" or (not fused and allow_nondeterministic)
    ]
    return order[: order.index("torch") + 1]


def model_order(nbytes: int, fused: bool, has_multicast: bool, world_size: int, elem_bytes: int) -> tuple[str, ...]:
    """Every path of the table (ubnext/plan/_thresholds.py) for this call, fastest first by the model."""
    # the fused op's rows: fp32 ones carry twice the bytes per token of 2-byte ones
    key = ("all_reduce_add_rmsnorm", 4 if elem_bytes >= 4 else 2) if fused else ("all_reduce", None)
    world = min(max(world_size, _thresholds.MEASURED_WORLDS[0]), _thresholds.MEASURED_WORLDS[-1])
    segments = _thresholds.ORDERS[(*key, world, has_multicast)]
    return next(order for up_to, order in segments if up_to is None or nbytes <= up_to)


def refuse_in_batch_invariant_mode(forced: str) -> None:
    """A forced path that cannot keep the batch-invariant mode's rank order is an error, not a
    fallback: the caller asked for two things that contradict each other."""
    if forced in LD_REDUCE_PATHS + ("torch_symm",) and forced not in RANK_ORDER_NVLS:
        why = "torch's symmetric-memory op promises no summation order" if forced == "torch_symm" else NOT_RANK_ORDER
        raise ValueError(
            f"algo {forced!r} cannot run in the batch-invariant mode: {why}; force lamport or "
            "twoshot, or leave the choice to auto"
        )


def choose(
    nbytes: int,
    elem_bytes: int,
    fused: bool,
    hidden: int,
    pool: PoolView,
    *,
    forced: str = "auto",
    allow_nondeterministic: bool = False,
    in_place_pool: bool = False,
    batch_invariant: bool = False,
) -> Plan:
    """The path for one call. ``forced`` is UBNEXT_ALGO (or the communicator's ``algo``): a
    forced path that cannot run falls back down the automatic order. ``batch_invariant``: only the
    paths that sum in rank order (never multimem.ld_reduce), and a forced one that does not is
    refused; "torch" is then the Communicator's rank-ordered fallback."""
    if batch_invariant:
        refuse_in_batch_invariant_mode(forced)
    caps = capabilities(nbytes, elem_bytes, fused, hidden, pool, in_place_pool, batch_invariant)
    order = auto_order(
        nbytes, fused, pool.has_multicast and not pool.unavailable, allow_nondeterministic, pool.world_size, elem_bytes
    )
    skipped: list[tuple[str, str]] = []
    if forced != "auto":
        if forced == "nvls":  # the two deterministic multicast kernels, in the model's order for this size
            wanted = [
                p
                for p in model_order(nbytes, fused, True, pool.world_size, elem_bytes)
                if p in ("nvls_lamport", "nvls_twoshot")
            ]
        else:
            wanted = [forced]
        for path in wanted:
            why_not = caps[path]
            if why_not is None:
                return Plan(path, f"UBNEXT_ALGO={forced}", skipped)
            skipped.append((path, why_not))
        order = [p for p in order if p not in wanted]
    for path in order:
        why_not = caps[path]
        if why_not is None:
            reason = (
                f"auto: the fastest path that can run, by the cost model at {pool.world_size} ranks "
                "(ubnext/plan/_thresholds.py)"
            )
            return Plan(path, reason, skipped)
        skipped.append((path, why_not))
    raise AssertionError("torch.distributed is always available")  # pragma: no cover


# FSDP2's collectives (ubnext.fsdp): one kernel each, else torch.distributed
EXCHANGE_KERNELS = ("allgather", "reduce_scatter")


# The kernels take their element count (the all-gather its byte count) as a 32-bit int, as every
# CUDA kernel ABI of ubnext does (csrc/device/desc.cuh): a message of 2 GiB or more goes to
# torch.distributed, never to a kernel that would count it wrapped round.
KERNEL_MAX_BYTES = (1 << 31) - 1
TOO_LARGE = "the message is 2 GiB or more, beyond the kernels' 32-bit counts"


def exchange_path(op: str, nbytes: int, in_pool: bool, pool: PoolView) -> tuple[str, str]:
    """(path, reason) of an all-gather or reduce-scatter: the kernel ``op`` or ``"torch"``.
    ``nbytes`` is the pool buffer it needs (the gathered output, or the reduce-scatter's input);
    ``in_pool``: the caller's buffer already lies in the pool (comm.empty, ubnext.fsdp's allocate),
    an argument of the call that every rank passes alike, as for the in-place allreduce. The
    kernels take any shard size (head and tail bytes or elements outside the 16-byte vectors go one
    at a time). Like ``choose``, a function of values identical on every rank."""
    disabled = dict(pool.disabled)
    if pool.unavailable:
        why = pool.unavailable
    elif nbytes > KERNEL_MAX_BYTES:
        why = TOO_LARGE
    elif "twoshot" in disabled:  # the same peer loads, stores and barriers
        why = f"disabled by the self-test at preparation ({disabled['twoshot']})"
    elif not in_pool and nbytes > pool.staging_bytes:
        why = (
            f"{nbytes} bytes exceed the pool's staging region ({pool.staging_bytes} bytes{_sizing(pool)}; "
            "or pass a buffer from the pool (comm.empty, or ubnext.fsdp's allocate)"
        )
    else:
        return op, "fits"
    return "torch", why
