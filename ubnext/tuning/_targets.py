"""Issue 38 item 2's targets as they stand, from one ``python -m ubnext.bench --model`` run: ubnext's rows and
the ``peer:`` rows, both priced by the calibrated model (``cal_us``: H100, graph + PDL; ``_calibration``).
Printed only: it chooses nothing and writes nothing."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from . import _calibration
from ._peers import Kernel

Row = dict[str, Any]
FUSED = "all_reduce_add_rmsnorm"
NVLS_PATHS = ("nvls_twoshot", "nvls_lamport", "nvls_oneshot")
SWITCH_LOAD_PATHS = ("nvls_twoshot", "nvls_oneshot")  # their CTAs' loads are multimem.ld_reduce
MB = 1 << 20


def _best(rows: Sequence[Row], op: str, nbytes: int, paths: Sequence[str] | None = None) -> Row | None:
    cands = [
        r
        for r in rows
        if r["op"] == op
        and r["bytes"] == nbytes
        and r.get("cal_us") is not None
        and not str(r["path"]).endswith("/ro")
        and (paths is None or r["path"] in paths)
    ]
    return min(cands, key=lambda r: r["cal_us"]) if cands else None


def _peer(peers: Sequence[Row], path: str, op: str, nbytes: int) -> Row | None:
    return next((p for p in peers if p["path"] == path and p["op"] == op and p["bytes"] == nbytes), None)


def nvls_floor_us(nbytes: int, world: int) -> float:
    """The least time the calibrated model gives ANY allreduce through the switch (H100, graph + PDL), whatever
    its kernel: the inputs must be known ready before a multimem.ld_reduce reads them (an arrival crosses to
    the peers, one hop, and is polled, one wait), the ld_reduce is a round trip (two hops), and the reduced
    share's multimem store must land (one hop) where a reader polls for it (one wait); every such allreduce
    moves NCCL's bus bytes, S/N + S, through the switch at its peak. No pointer or flag read, no atomic, one
    round of loads: the rest of any real kernel only adds. The NVLS targets below this floor's reach are
    out of reach of any kernel under the frozen model, NCCL's own structure included."""
    floor = Kernel(
        "any NVLS allreduce",
        "ubnext/tuning/_targets.py nvls_floor_us",
        hops=1 + 2 + 1,
        waits=2,
        multicast_bytes=nbytes // world + nbytes,
    )
    return round(_calibration.kernel_us(floor, _calibration.TARGET_MODE, "H100", _calibration.hopper_values()), 2)


def targets(rows: Sequence[Row], peers: Sequence[Row]) -> list[Row]:
    """One row per target case: ubnext's best path there (and the planner's choice), its calibrated time,
    the peer's, the bound and whether it holds."""
    out: list[Row] = []

    def add(case: str, op: str, nbytes: int, paths: Sequence[str] | None, peer_path: str, factor: float) -> None:
        best, peer = _best(rows, op, nbytes, paths), _peer(peers, peer_path, op, nbytes)
        chosen = next((r for r in rows if r["op"] == op and r["bytes"] == nbytes and r.get("chosen")), None)
        if best is None or peer is None:
            return
        bound = round(factor * float(peer["cal_us"]), 2)
        counts = {k: best.get(k) for k in ("t_hops", "l2", "atomics", "waits", "cta_load_bytes", "cta_inflight")}
        floor = {"floor_us": nvls_floor_us(nbytes, best["world"])} if paths == NVLS_PATHS else {}
        out.append(
            {
                **floor,
                "table": "targets",
                "case": case,
                "bytes": nbytes,
                "path": best["path"],
                "ubnext_us": best["cal_us"],
                "chosen_path": chosen["path"] if chosen else None,
                "chosen_us": chosen.get("cal_us") if chosen else None,
                "peer": peer_path,
                "peer_us": peer["cal_us"],
                "bound_us": bound,
                "holds": best["cal_us"] <= bound,
                "counts": counts,
                "peer_counts": {k: peer.get(k) for k in ("hops", "l2", "atomics", "waits")},
            }
        )

    for tokens in (1, 16):
        add(f"fused {tokens}x8192 <= 0.9 x FlashInfer", FUSED, tokens * 8192 * 2, None, "peer:flashinfer_oneshot", 0.9)
    for nbytes in sorted({r["bytes"] for r in rows if r["op"] == "all_reduce" and r["bytes"] <= 64 * 1024}):
        add(f"allreduce {nbytes} B <= NCCL LL", "all_reduce", nbytes, None, "peer:nccl_symmetric_ll", 1.0)
    for nbytes in sorted({r["bytes"] for r in rows if r["op"] == "all_reduce" and 4 * MB <= r["bytes"] <= 64 * MB}):
        add(
            f"NVLS allreduce {nbytes // MB} MB <= 0.9 x NCCL NVLS",
            "all_reduce",
            nbytes,
            NVLS_PATHS,
            "peer:nccl_nvls",
            0.9,
        )
    one = next((r for r in out if r["case"].startswith("fused 1x")), None)
    if one is not None:
        out.append(
            {
                "table": "targets",
                "case": "fused 1x8192 <= 4 us",
                "ubnext_us": one["ubnext_us"],
                "bound_us": 4.0,
                "holds": one["ubnext_us"] <= 4.0,
                "path": one["path"],
            }
        )
    big = _best(rows, "all_reduce", 64 * MB, NVLS_PATHS)
    if big is not None:
        world = big["world"]
        inflight_us, cap_us = nvls_data_terms(big, 64 * MB)
        # the issue asks for the in-flight term binding; where the cap binds, the row also gives the busbw the
        # path's own bytes in flight would reach without the cap (what its memory-level parallelism supports)
        uncapped_us = big["cal_us"] - max(inflight_us, cap_us) + inflight_us
        busbw = busbw_GBps(64 * MB, world, big["cal_us"])
        out.append(
            {
                "table": "targets",
                "case": "busbw at 64 MB >= 450 GB/s",
                "path": big["path"],
                "ubnext_us": big["cal_us"],
                "busbw_GBps": round(busbw, 1),
                "holds": busbw >= 450.0,
                "inflight_term_us": round(inflight_us, 2),
                "nvls_cap_term_us": round(cap_us, 2),
                "binding": "in-flight bytes" if inflight_us >= cap_us else "NVLS cap",
                "inflight_busbw_GBps": round(busbw_GBps(64 * MB, world, uncapped_us), 1),
            }
        )
    return out


def busbw_GBps(nbytes: int, world: int, us: float) -> float:
    """nccl-tests' bus bandwidth of an allreduce: 2 (N - 1) / N x bytes / time."""
    return 2 * (world - 1) / world * nbytes / (us * 1e3)


def nvls_data_terms(row: Row, nbytes: int) -> tuple[float, float]:
    """The two data terms of an NVLS path's time (launch_cal_us): its CTA's extra rounds of loads, and NCCL's
    bus bytes S/N + S at the NVLS peak. A round is a trip through the switch (two hops) where the CTA's loads
    are multimem.ld_reduce (the two-shot, the one-shot), a local L2 round trip where they are polls of its
    own memory (nvls_lamport): launch_cal_us's rule, by the path, as the row carries no remote bytes."""
    v = _calibration.hopper_values()
    rounds = _calibration.rounds(row)
    world = row["world"]
    rt = 2 * v["hop_us"] if row["path"] in SWITCH_LOAD_PATHS else v["l2_rt_us"]
    return (rounds - 1) * rt, (nbytes // world + nbytes) / (v["nvls_GBps"] * 1e3)


def print_targets(rows: list[Row], as_json: bool, out: TextIO = sys.stdout) -> None:
    if as_json:
        for r in rows:
            print(json.dumps(r), file=out)
        return
    print("# issue 38 item 2's targets as they stand (calibrated model, H100, 8 ranks, graph + PDL)", file=out)
    for r in rows:
        peer = f" vs {r['peer']} {r['peer_us']:.2f} us (bound {r['bound_us']:.2f})" if "peer" in r else ""
        if "floor_us" in r:
            peer += f"; any NVLS allreduce >= {r['floor_us']:.2f}"
        extra = (
            f" busbw {r['busbw_GBps']} GB/s ({r['binding']} binding; its bytes in flight alone:"
            f" {r['inflight_busbw_GBps']} GB/s)"
            if "busbw_GBps" in r
            else ""
        )
        print(
            f"{r['case']:44} {r['path']:14} {r['ubnext_us']:8.2f} us{peer}{extra}  {'holds' if r['holds'] else 'MISSES'}",
            file=out,
        )
