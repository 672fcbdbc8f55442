"""The batch-invariant mode beside the default in ``python -m ubnext.bench --model`` (issue 26): each mode's
planner choice and its modeled time, from the critical-path model's rows (``_costmodel``)."""

from __future__ import annotations

import json
import sys

from . import _costmodel as M


def invariant_rows(rows: list[dict]) -> list[dict]:
    """The batch-invariant mode beside the default, per reducing op and size: each mode's planner
    choice (the mode's is the default's restricted to the paths that sum in rank order: no
    multimem.ld_reduce) and its modeled time, from the table's rows. all_gather reduces nothing and
    reduce_scatter's kernel sums in rank order in both modes, so neither changes. Past the pool
    both leave the kernels: the default for NCCL's allreduce, the mode for its rank-ordered
    fallback (ubnext/comm/_allreduce.py), whose bytes per rank are given as a multiple of a ring
    allreduce's 2 (N-1)/N of the message: the all-to-all and the all-gather in the dtype (x1),
    the fused op's all-gather in fp32 (x1.5 for bf16). A plain allreduce on an NVLS two-shot path
    is timed by the mode's own rows of it (RANK_ORDER_SUFFIX: unicast rank-order sums, not the
    default's multimem.ld_reduce)."""
    timed = {(r["op"], r["bytes"], r["path"]): r["model_us"] for r in rows}
    out = []
    for r in rows:
        if r["op"] not in ("all_reduce", "all_reduce_add_rmsnorm") or not r["chosen"]:
            continue
        case = M.Case(r["op"], r["path"], r["bytes"], r["tokens"])
        mode = M.chosen_path(case, r["world"], batch_invariant=True)
        timed_as = (
            mode + M.RANK_ORDER_SUFFIX if r["op"] == "all_reduce" and mode in M.INVARIANT_ALLREDUCE_PATHS else mode
        )
        default_us, mode_us = r["model_us"], timed.get((r["op"], r["bytes"], timed_as))
        out.append(
            {
                "op": r["op"],
                "bytes": r["bytes"],
                "tokens": r["tokens"],
                "world": r["world"],
                "default_path": r["path"],
                "default_us": default_us,
                "mode_path": mode,
                "mode_us": mode_us,
                "ratio": round(mode_us / default_us, 2) if default_us and mode_us else None,
                "fallback_bytes_vs_ring": (1.5 if r["op"] != "all_reduce" else 1.0) if mode == "torch" else None,
            }
        )
    return out


def print_invariant(rows: list[dict], as_json: bool, out=sys.stdout) -> None:
    if as_json:
        for r in rows:
            print(json.dumps({"table": "batch_invariant"} | r), file=out)
        return
    from ..pool.layout import plan_layout

    world = rows[0]["world"] if rows else 0
    layout = plan_layout(world, M.HIDDEN) if world else None
    print(
        f"# batch-invariant mode (Communicator(batch_invariant=True)) beside the default, {world} ranks, bf16, "
        f"hidden {M.HIDDEN}: each mode's planner choice and its modeled time above; the pool of both is the "
        f"default one ({layout.sized_by if layout else '-'}: a {layout.lamport_capacity if layout else 0} byte "
        f"Lamport slot, a {layout.staging_bytes if layout else 0} byte staging region); past it, the mode's "
        "rank-ordered fallback (all-to-all + all-gather on torch.distributed) moves the bytes of a ring "
        "allreduce times the last column",
        file=out,
    )
    print(
        f"{'op':24} {'bytes':>10} {'tok':>5} {'default':>14} {'us':>8} {'mode':>14} {'us':>8} {'ratio':>6} "
        f"{'fallback_x':>10}",
        file=out,
    )
    for r in rows:

        def us(v):
            return f"{v:8.2f}" if v is not None else f"{'-':>8}"

        ratio = f"{r['ratio']:6.2f}" if r["ratio"] is not None else f"{'-':>6}"
        fb = f"{r['fallback_bytes_vs_ring']:10.1f}" if r["fallback_bytes_vs_ring"] else f"{'-':>10}"
        print(
            f"{r['op']:24} {r['bytes']:10d} {r['tokens']:5d} {r['default_path']:>14} {us(r['default_us'])} "
            f"{r['mode_path']:>14} {us(r['mode_us'])} {ratio} {fb}",
            file=out,
        )
