"""The critical-path model: ``python -m ubnext.bench --model [--world N] [--json]``.

Kernel speed cannot be timed without a GPU, so it is counted. The emulator's count mode
(``UBNEXT_EMU_COUNT=1``; the rules are in ``csrc/emu/memory.cpp``) runs every kernel at a GPU's
launch geometry (256 threads, grids up to ``UBNEXT_EMU_SM_COUNT`` blocks, capped as the GPU
path caps them) and measures, per launch: the CTAs, the serialised NVLink hops on the longest
chain of dependencies, the system-scope fences on that chain, and the most bytes one CTA moves.

This module starts its own emulated ranks (no launcher needed), runs each op on each kernel
path at sizes small enough for two CPU cores, and derives larger sizes from the largest
measured one of the same path (``derive``). A modeled time is built from the counts and the
constants below, each with its source, and the published peer figure is printed beside it.

The model's limits (repeated in docs/PERF.md): it knows no contention, caches, clocks or
occupancy; a hop is a fixed latency whatever the distance; bandwidth terms take the largest
of the per-CTA, HBM and NVLink bounds, never their overlap; torch's and NCCL's own kernels are
not modeled (the published figure stands for them).
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from ._constants import (  # noqa: F401 (Constant: tests build one through this module)
    CONSTANTS,
    HBM_GBPS,
    HOP_US,
    LAUNCH_US,
    NVLINK_GBPS,
    NVLS_GBPS,
    PEERS,
    SM_GBPS,
    Constant,
)
from ._emucounts import CAL_KEYS, CAL_ROW_KEYS, cal_row

HIDDEN = 8192
# Sizes the emulated ranks run; larger ones are derived. A launch of more blocks than this
# costs the emulator too much memory and time on two cores (a fiber per thread).
MEASURE_MAX_CTAS = 16
# and of at most this many rows of HIDDEN bf16: the measuring pool holds that many (UBNEXT_MAX_BATCH
# below), so a small grid alone (the NVLS two-shot's NCCL grid is 2 CTAs at any size) is not enough.
# 64 rows (1 MB): the NVLS two-shot's CTA then loads 64 KB of data, its loop's whole depth (16 loads a
# thread, nvls.cu kMulticastDepth), at NCCL's grid for every world (16 CTAs in all x 64 KB), so the bytes
# in flight its derived rows keep are the loop's (its 112 bytes of flag and pointer loads add one round
# to the rows derived from it: 65 at 64 MB where the loop makes 64; the NVLS cap binds there anyway).
# At 16 rows a CTA loaded 16 KB, all it had, and the rows derived from it kept 16 KB: four times the
# rounds the kernel makes. Not more than 64: the count sees no round end where a store consumes the
# round's loads (the loop's next batch waits for it on a GPU), so a larger message shows its whole share
# in flight at once.
MEASURE_MAX_TOKENS = 64
ALLREDUCE_BYTES = (2048, 16384, 65536, 262144, 1 << 20, 4 << 20, 16 << 20, 64 << 20)
FUSED_TOKENS = (1, 4, 16, 64, 256, 1024, 4096)
EXCHANGE_BYTES = (65536, 2 << 20, 32 << 20)
QUANTIZE_BYTES = (65536, 262144, 2 << 20, 64 << 20)
ALLREDUCE_PATHS = ("lamport", "nvls_lamport", "nvls_oneshot", "nvls_twoshot", "twoshot")
# The batch-invariant mode's own form of the plain NVLS two-shot paths (UBNEXT_F_RANK_ORDER: the owner
# sums by unicast loads in rank order, not by multimem.ld_reduce), counted on its own rows so that the
# mode's table times what the mode runs; their table label carries RANK_ORDER_SUFFIX. (The fused op's
# rows already sum so in both modes: its rows are the same.)
INVARIANT_ALLREDUCE_PATHS = ("nvls_lamport", "nvls_twoshot")
RANK_ORDER_SUFFIX = "/ro"
FUSED_PATHS = ("lamport", "nvls_lamport", "nvls_twoshot", "twoshot")
# issue 28: the fused op with NVFP4 output (swizzled scales, single-level), one kernel: its rows beside
# the fused op's show what the quantised output costs (the planner chooses as for the fused op)
FUSED_NVFP4 = "all_reduce_add_rmsnorm_nvfp4"
FUSED_OPS = ("all_reduce_add_rmsnorm", FUSED_NVFP4)
QUANTIZE_MODES = ("row", "tensor", "static")
KEYS = (
    "op",
    "path",
    "dtype",
    "tokens",
    "hidden",
    "bytes",
    "world",
    "ctas",
    "hops",
    "fences",
    "max_cta_bytes",
    "model_us",
    "chosen",
    # the calibrated model (issue 38 item 1; _calibration.launch_cal_us): its chain's counts and bytes in flight
    *CAL_ROW_KEYS,
)


def model_us(launches: list[dict]) -> float:
    """Modeled time of a sequence of launches, each: launch + hops x hop + its slowest bandwidth
    term (one CTA's bytes at one SM's bandwidth, all bytes at HBM's, peer bytes at NVLink's)."""
    total = 0.0
    for c in launches:
        data_us = max(
            c["max_cta_bytes"] / (SM_GBPS.value * 1e3),
            c["total_bytes"] / (HBM_GBPS.value * 1e3),
            c["nvlink_bytes"] / (NVLINK_GBPS.value * 1e3),
            c["multicast_bytes"] / (NVLS_GBPS.value * 1e3),
        )
        total += LAUNCH_US.value + c["hops"] * HOP_US.value + data_us
    return round(total, 2)


# ------------------------------------------------------------------ the cases


@dataclass(frozen=True)
class Case:
    op: str  # all_reduce | all_reduce_add_rmsnorm(_nvfp4) | all_gather | reduce_scatter | quantize
    path: str  # the kernel path forced; quantize: its scaling mode
    nbytes: int  # the message (all_gather: its output; reduce_scatter: its input)
    tokens: int = 0
    invariant: bool = False  # run by a batch-invariant communicator (INVARIANT_ALLREDUCE_PATHS)

    def row_key(self) -> tuple:
        return (self.op, self.label)

    @property
    def label(self) -> str:
        """The path as the table names it."""
        return self.path + RANK_ORDER_SUFFIX if self.invariant else self.path


def cases(world: int, quick: bool = False, only: frozenset | None = None) -> list[Case]:
    """Every (op, path, size) of the table, measured or derived; ``only``: the (op, path) pairs to
    keep (tests)."""
    out: list[Case] = []
    ar = ALLREDUCE_BYTES[:3] if quick else ALLREDUCE_BYTES
    for nbytes in ar:
        out += [Case("all_reduce", p, nbytes, nbytes // (2 * HIDDEN)) for p in ALLREDUCE_PATHS]
        out += [Case("all_reduce", p, nbytes, nbytes // (2 * HIDDEN), True) for p in INVARIANT_ALLREDUCE_PATHS]
    for tokens in FUSED_TOKENS[:2] if quick else FUSED_TOKENS:
        out += [Case("all_reduce_add_rmsnorm", p, tokens * HIDDEN * 2, tokens) for p in FUSED_PATHS]
        if not quick or only is not None:  # the published table, or a caller naming them (tests)
            out += [Case(FUSED_NVFP4, p, tokens * HIDDEN * 2, tokens) for p in FUSED_PATHS]
    for nbytes in EXCHANGE_BYTES[:1] if quick else EXCHANGE_BYTES:
        out += [Case("all_gather", "allgather", nbytes), Case("reduce_scatter", "reduce_scatter", nbytes)]
    for nbytes in QUANTIZE_BYTES[:1] if quick else QUANTIZE_BYTES:
        out += [Case("quantize", m, nbytes, nbytes // (2 * HIDDEN)) for m in QUANTIZE_MODES]
    return [c for c in out if only is None or c.row_key() in only]


def grid_of(case: Case, world: int, sm_count: int) -> int:
    """The grid the GPU launch would use (the Executor's own geometry)."""
    from ..comm._executor import GPU_BLOCK, GRID_CAP, gpu_max_blocks, launch_geometry

    sms = min(GRID_CAP, sm_count)
    n = case.nbytes // 2
    if case.op in FUSED_OPS:
        cap = gpu_max_blocks(case.path, sms, world, True)
        return launch_geometry(case.path, n, 2, case.tokens, True, world, GPU_BLOCK, cap)[0]
    if case.op == "quantize":
        from ..comm._quantize import LOCAL_GRID_MAX, ONE_CTA_BYTES, quantize_geometry

        # the Executor's rule for a local kernel (QuantizeOps._local_geometry): no residency cap; one
        # scale past ONE_CTA_BYTES runs as the static mode after its amax
        static = case.path == "static" or (case.path == "tensor" and case.nbytes > ONE_CTA_BYTES)
        hidden = HIDDEN if case.path == "row" else n
        return quantize_geometry(n, 2, hidden, static, GPU_BLOCK, LOCAL_GRID_MAX)[0]
    if case.op in ("all_gather", "reduce_scatter"):
        n //= world  # the kernel's vectors: one shard
    cap = gpu_max_blocks(case.path, sms, world, False, rank_order=case.invariant)
    return launch_geometry(case.path, n, 2, 0, False, world, GPU_BLOCK, cap)[0]


def measurable(case: Case, world: int, sm_count: int) -> bool:
    return grid_of(case, world, sm_count) <= MEASURE_MAX_CTAS and case.nbytes <= MEASURE_MAX_TOKENS * HIDDEN * 2


# ------------------------------------------------------------------ one emulated rank


def _run_case(comm, emu, case: Case, world: int, log=None):
    """The launches of the second of two identical calls: the steady state, in which a Lamport call
    re-poisons what a call of its own size wrote (the first call re-poisons an earlier case's)."""
    for _ in range(2):
        launches, error = _run_once(comm, emu, case, world, log)
        if error:
            return None, error
    return launches, None


def _run_once(comm, emu, case: Case, world: int, log=None):
    import torch

    from .. import errors
    from ..comm._quantize import ONE_CTA_BYTES

    comm._algo = case.path if case.op in ("all_reduce", *FUSED_OPS) else None
    n = case.nbytes // 2
    g = torch.Generator().manual_seed(1234 + comm.rank)
    dtype = torch.bfloat16
    if log is not None:
        log.take()  # forget launches before this call's
    with emu.recording() as launches:
        try:
            if case.op == "all_reduce":
                x = torch.randn(n, generator=g).to(dtype)
                comm.all_reduce(x, out=torch.empty_like(x))
            elif case.op == "all_reduce_add_rmsnorm":
                x = torch.randn(case.tokens, HIDDEN, generator=g).to(dtype)
                comm.all_reduce_add_rmsnorm(x, torch.randn_like(x), torch.ones(HIDDEN, dtype=dtype))
            elif case.op == FUSED_NVFP4:
                x = torch.randn(case.tokens, HIDDEN, generator=g).to(dtype)
                comm.all_reduce_add_rmsnorm(
                    x, torch.randn_like(x), torch.ones(HIDDEN, dtype=dtype), quant="nvfp4", swizzled=True
                )
            elif case.op == "all_gather":
                out = comm.empty(n, dtype=dtype)
                comm.all_gather(torch.randn(n // world, generator=g).to(dtype), out=out)
            elif case.op == "reduce_scatter":
                inp = comm.empty(n, dtype=dtype)
                inp.copy_(torch.randn(n, generator=g).to(dtype))
                comm.reduce_scatter(inp)
            else:
                x = torch.randn(max(1, case.tokens), n // max(1, case.tokens), generator=g).to(dtype)
                scale = torch.tensor([0.5]) if case.path == "static" else None
                comm.quantize_fp8(x, scaling=case.path, scale=scale)
        except errors.UbnextError as exc:
            return None, f"{type(exc).__name__}: {exc}"[:200]
    ran = comm.last_path
    if case.op in ("all_reduce", *FUSED_OPS) and ran != case.path:
        return None, f"ran {ran}, not {case.path}"
    counted = [c._asdict() for c in launches]
    full = log.take() if log is not None else []
    if log is not None and len(full) != len(counted):
        return None, f"count log has {len(full)} launches, the recording {len(counted)}"
    for c, f in zip(counted, full):
        c.update({k: getattr(f, k) for k in CAL_KEYS})
    if case.op == "quantize" and case.path == "tensor" and case.nbytes > ONE_CTA_BYTES:
        # the amax is torch's reduction (torch.aminmax), which the emulator does not count: modeled
        # as one launch reading the tensor at HBM bandwidth
        counted.insert(
            0,
            {
                "kernel": "torch.aminmax (modeled)",
                "ctas": 0,
                "block": 0,
                "hops": 0,
                "fences": 0,
                "max_cta_bytes": 0,
                "total_bytes": case.nbytes,
                "nvlink_bytes": 0,
                "multicast_bytes": 0,
            }
            | dict.fromkeys(CAL_KEYS, 0),
        )
    return counted, None


def _worker(
    rank: int,
    world: int,
    port: int,
    out_path: str,
    quick: bool,
    only: frozenset | None,
    progress_path: str | None = None,
) -> int:
    import torch.distributed as dist

    from .. import envs
    from ..comm import Communicator
    from ..runtime import _emu

    if progress_path:
        # the ranks' shared progress page: a wait times out only after UBNEXT_TIMEOUT without progress on
        # any rank, never because two cores run 8 ranks slowly (csrc/emu/sched.cpp; issue 40 item 8)
        _emu.load(envs.get("UBNEXT_EMU_BREAK") or "").share_progress(progress_path)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=datetime.timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    sm_count = envs.get("UBNEXT_EMU_SM_COUNT")
    todo = [case for case in cases(world, quick, only) if measurable(case, world, sm_count)]
    # the batch-invariant mode's cases on a communicator of their own (the mode is fixed at construction)
    comms = {
        mode: Communicator(emulate=True, max_hidden=HIDDEN, batch_invariant=mode)
        for mode in sorted({case.invariant for case in todo})
    }
    for comm in comms.values():
        comm.prepare()
    from . import _calibration, _emucounts

    log = _emucounts.CountLog(comms[todo[0].invariant]._emu) if todo else None
    if log is not None:
        h = _calibration.HOPPER  # the calibrated constants decide which chain is critical
        log.set_weights(h["hop_us"].value, h["l2_rt_us"].value, h["atomic_us"].value, h["l2_rt_us"].value)
    rows = []
    for case in todo:
        comm = comms[case.invariant]
        launches, error = _run_case(comm, comm._emu, case, world, log)
        rows.append({"case": case.__dict__, "launches": launches, "error": error})
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)
    for comm in comms.values():
        comm.close()
    dist.destroy_process_group()
    return 0


# ------------------------------------------------------------------ the table


def derive(measured: dict, case: Case, world: int, sm_count: int) -> list[dict] | None:
    """Counts of an unmeasured case from the largest measured case of its path no larger than it
    (the smallest one for a case below them all): the same launches with the same hops and fences
    (the chain's shape does not depend on how many vectors each thread handles), the GPU
    geometry's grid, and bytes scaled with the message: total bytes in proportion to the size,
    one CTA's bytes in proportion to its share."""
    same = [(c, ls) for c, ls in measured.items() if c.row_key() == case.row_key() and ls]
    if not same:
        return None
    below = [item for item in same if item[0].nbytes <= case.nbytes]
    base, launches = (
        max(below, key=lambda item: item[0].nbytes) if below else min(same, key=lambda item: item[0].nbytes)
    )
    ratio = case.nbytes / base.nbytes
    grid0, grid1 = grid_of(base, world, sm_count), grid_of(case, world, sm_count)
    out = []
    for c in launches:
        d = dict(c)
        d["ctas"] = grid1 if c["ctas"] == grid0 else c["ctas"]
        d["total_bytes"] = round(c["total_bytes"] * ratio)
        if c["ctas"]:
            d["max_cta_bytes"] = round(c["max_cta_bytes"] * ratio * c["ctas"] / d["ctas"])
        d["nvlink_bytes"] = round(c["nvlink_bytes"] * ratio)
        d["multicast_bytes"] = round(c["multicast_bytes"] * ratio)
        if "cta_load_bytes" in c:
            # the calibrated counts: a CTA's loads and bytes in flight scale with its share; a CTA that
            # issued all its loads at one control point (one round) still does (its loop has no wait), else
            # its depth per control point is its loop body's, which the size does not change
            share = ratio * c["ctas"] / d["ctas"] if c["ctas"] else ratio
            for k in ("cta_load_bytes", "cta_remote_load_bytes"):
                d[k] = round(c[k] * share)
            if c["cta_inflight"] >= c["cta_load_bytes"]:
                d["cta_inflight"] = d["cta_load_bytes"]
            d["mc_ld_bytes"] = round(c["mc_ld_bytes"] * ratio)
            d["mc_store_bytes"] = round(c["mc_store_bytes"] * ratio)
        out.append(d)
    return out


def chosen_path(case: Case, world: int, batch_invariant: bool = False) -> str:
    """The planner's choice for this call with the default pool at this world size and hidden
    8192 (the pool the model assumes), on a GPU with multicast; ``batch_invariant``: the mode's."""
    from .. import info, plan

    view = info.pool_view(world, HIDDEN, "gpu", True, None)
    if case.op in ("all_reduce", *FUSED_OPS):
        fused = case.op != "all_reduce"
        return plan.choose(case.nbytes, 2, fused, HIDDEN if fused else 0, view, batch_invariant=batch_invariant).path
    if case.op == "quantize":
        return case.path
    kernel = "allgather" if case.op == "all_gather" else "reduce_scatter"
    return plan.exchange_path(kernel, case.nbytes, True, view)[0]


def table(measured: dict, world: int, sm_count: int, quick: bool, only: frozenset | None = None) -> list[dict]:
    rows = []
    torch_rows: set = set()
    for case in cases(world, quick, only):
        chosen = chosen_path(case, world)
        if chosen == "torch" and (case.op, case.nbytes) not in torch_rows:
            # the planner leaves ubnext's kernels for torch.distributed (NCCL on a GPU), which the
            # model cannot count: the published figure stands for it
            torch_rows.add((case.op, case.nbytes))
            rows.append(
                {
                    "op": case.op,
                    "path": "torch",
                    "dtype": "bf16",
                    "tokens": case.tokens,
                    "hidden": HIDDEN if case.tokens else 0,
                    "bytes": case.nbytes,
                    "world": world,
                    "ctas": None,
                    "hops": None,
                    "fences": None,
                    "max_cta_bytes": None,
                    "model_us": None,
                    **dict.fromkeys(CAL_ROW_KEYS),
                    "chosen": True,
                    "derived": False,
                    "launches": 0,
                    "peer": _peer(case),
                }
            )
        launches = measured.get(case)
        derived = launches is None
        if derived:
            launches = derive(measured, case, world, sm_count)
        row = {
            "op": case.op,
            "path": case.label,
            "dtype": "bf16",
            "tokens": case.tokens,
            "hidden": HIDDEN if case.tokens else 0,
            "bytes": case.nbytes,
            "world": world,
        }
        if not launches:
            row.update(ctas=None, hops=None, fences=None, max_cta_bytes=None, model_us=None)
            row.update(dict.fromkeys(CAL_ROW_KEYS))
        else:
            row.update(
                ctas=max(c["ctas"] for c in launches),
                hops=sum(c["hops"] for c in launches),
                fences=sum(c["fences"] for c in launches),
                max_cta_bytes=max(c["max_cta_bytes"] for c in launches),
                model_us=model_us(launches),
            )
            row.update(cal_row(launches, world))
        row["chosen"] = chosen == case.path and not case.invariant  # the default's choice
        row["derived"] = derived
        row["launches"] = len(launches or [])
        row["peer"] = _peer(case)
        rows.append(row)
    return rows


def _peer(case: Case) -> str:
    return PEERS.get((case.op, case.tokens if case.op == "all_reduce_add_rmsnorm" else case.nbytes), "")


def run(
    world: int, *, quick: bool = False, only: frozenset | None = None, timeout_s: float = 840.0, env: dict | None = None
) -> list[dict]:
    """Start ``world`` emulated ranks, measure, derive; the table's rows. ``env``: more variables
    for the ranks (a test's UBNEXT_EMU_BREAK)."""
    from .. import envs

    measured = measure(world, quick=quick, only=only, timeout_s=timeout_s, env=env)
    return table(measured, world, envs.get("UBNEXT_EMU_SM_COUNT"), quick, only)


def measure(
    world: int, *, quick: bool = False, only: frozenset | None = None, timeout_s: float = 840.0, env: dict | None = None
) -> dict:
    """Start ``world`` emulated ranks and count every measurable case: {Case: its launches}."""
    import torch.distributed as dist

    from .. import envs

    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory(prefix="ubnext-model-") as tmp:
        out_path = os.path.join(tmp, "rows.json")
        progress_path = os.path.join(tmp, "progress")  # the ranks' progress page (_worker)
        # pool sized for the measured cases (MEASURE_MAX_TOKENS rows of hidden 8192), no self-test launches
        child_env = envs.environment_with(
            UBNEXT_EMULATE="1",
            UBNEXT_EMU_COUNT="1",
            UBNEXT_MAX_BATCH=str(MEASURE_MAX_TOKENS),
            UBNEXT_SELFTEST="0",
            UBNEXT_TIMEOUT=str(envs.get("UBNEXT_TIMEOUT") or 120),
            **(env or {}),
        )
        only_arg = json.dumps(sorted(only) if only is not None else None)
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "ubnext.tuning._costmodel",
                    str(r),
                    str(world),
                    str(store.port),
                    out_path,
                    "1" if quick else "0",
                    only_arg,
                    progress_path,
                ],
                env=child_env,
                start_new_session=True,
            )
            for r in range(world)
        ]
        deadline = time.monotonic() + timeout_s
        try:
            for p in procs:
                rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
                if rc != 0:
                    raise RuntimeError(f"ubnext.bench --model: an emulated rank exited with {rc}")
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, 9)
                    p.wait()
        with open(out_path) as f:
            raw = json.load(f)
    measured = {}
    errors = []
    for r in raw:
        case = Case(**r["case"])
        if r["error"]:
            errors.append(f"{case}: {r['error']}")
        measured[case] = r["launches"]
    if errors:
        raise RuntimeError("ubnext.bench --model: measured cases failed:\n  " + "\n  ".join(errors))
    return measured


def print_table(rows: list[dict], as_json: bool, out=sys.stdout) -> None:
    if as_json:
        for r in rows:
            print(json.dumps({k: r[k] for k in KEYS} | {"derived": r["derived"]}), file=out)
        return
    world = rows[0]["world"] if rows else 0
    print(
        f"# ubnext critical-path model, {world} ranks, bf16, hidden {HIDDEN}; * = the planner's choice; "
        f"~ = derived from a smaller measured size; {RANK_ORDER_SUFFIX} = the batch-invariant mode's form of the "
        "path (UBNEXT_F_RANK_ORDER: unicast rank-order sums)",
        file=out,
    )
    for name, c in CONSTANTS.items():
        print(f"#   {name} = {c.value:g} {c.unit}: {c.source}", file=out)
    print(
        "#   calibrated (issue 38 item 1; ubnext/tuning/_calibration.py): t_hops l2 atomics waits = the counts of "
        "the calibrated model's critical chain, rounds = a CTA's loaded bytes / its bytes in flight; cal_us "
        "graph + PDL, eager (H100); the peer: rows below are priced the same way",
        file=out,
    )
    print(
        f"{'op':28} {'path':15} {'bytes':>10} {'tok':>5} {'ctas':>5} {'hops':>5} {'fences':>6} "
        f"{'max_cta_bytes':>13} {'model_us':>9}  {'t_hops':>6} {'l2':>3} {'atom':>4} {'waits':>5} {'rounds':>6} "
        f"{'cal_us':>7} {'eager':>7}  peer",
        file=out,
    )
    for r in rows:
        mark = ("*" if r["chosen"] else " ") + ("~" if r["derived"] else " ")
        if r["ctas"] is None:
            print(
                f"{r['op']:28} {r['path']:15} {r['bytes']:10d} {r['tokens']:5d} {'-':>5} {'-':>5} {'-':>6} "
                f"{'-':>13} {'-':>9}{mark} {r['peer']}",
                file=out,
            )
            continue
        cal = f"{'-':>6} {'-':>3} {'-':>4} {'-':>5} {'-':>6} {'-':>7} {'-':>7}"
        if r["cal_us"] is not None:
            rounds = -(-r["cta_load_bytes"] // r["cta_inflight"]) if r["cta_inflight"] else 1
            cal = (
                f"{r['t_hops']:6d} {r['l2']:3d} {r['atomics']:4d} {r['waits']:5d} {rounds:6d} "
                f"{r['cal_us']:7.2f} {r['cal_eager_us']:7.2f}"
            )
        print(
            f"{r['op']:28} {r['path']:15} {r['bytes']:10d} {r['tokens']:5d} {r['ctas']:5d} {r['hops']:5d} "
            f"{r['fences']:6d} {r['max_cta_bytes']:13d} {r['model_us']:9.2f}{mark} {cal}  {r['peer']}",
            file=out,
        )


if __name__ == "__main__":
    _only = json.loads(sys.argv[6])
    sys.exit(
        _worker(
            int(sys.argv[1]),
            int(sys.argv[2]),
            int(sys.argv[3]),
            sys.argv[4],
            sys.argv[5] == "1",
            None if _only is None else frozenset(tuple(pair) for pair in _only),
            sys.argv[7] if len(sys.argv) > 7 else None,
        )
    )
