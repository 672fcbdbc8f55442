"""The calibrated model (issue 38 item 1): named constants per architecture, each sourced, measured or
fitted, and the table ``python -m ubnext.bench --model --calibration [--json]`` prints: per published
figure, its modeled time, its time with every fitted constant re-fitted without it (left-out), and its
source. The peers' count records are in ``_peers``; the rules are in its docstring and docs/PERF.md.

A kernel's time: its launch (by mode) + l2 x L2_RT + hops x HOP + atomics x ATOMIC + waits x L2_RT +
dsm x DSM + cluster_syncs x CLUSTER_SYNC + its data term: the slowest of (rounds - 1) round trips of one CTA's loads
(rounds = its bytes over its bytes in flight; a round trip is two hops for peer or multicast loads, one
L2 round trip for local ones), its NVLink, multicast and HBM bytes at their bandwidths. A record's time
is the sum of its kernels'. Launch modes: graph (a graph node's dependent launch, also for the event nodes
a harness or library adds), graph + PDL (less the measured PDL gain), eager (plus the measured eager cost),
replay (a one-node graph replayed back to back: a whole graph launch per op).

This module runs no emulator: the table is computed from the records, so a unit test pins it.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, TextIO

from . import _peers
from ._peers import Kernel, Record

GIB = 2**30


@dataclass(frozen=True)
class Const:
    value: float
    unit: str
    kind: str  # sourced | measured | fitted | assumed (no figure: stated as such) | uncalibrated
    source: str


GPU_RUN = "docs/PERF.md 'The one-GPU check on an H100' (docs/gpu/h100-2026-11-27-run1.json)"

HOPPER: dict[str, Const] = {
    "hop_us": Const(
        0.6,
        "us",
        "sourced",
        "NCCL 5067397 src/graph/tuning.cc:159, hwLatencies[NVLINK][Ring/Tree][LL] = 0.6 us per hop",
    ),
    "l2_rt_us": Const(
        0.143, "us", "measured", f"ld.relaxed.sys.v4 dependent chain, L2-resident, 143 ns per link ({GPU_RUN})"
    ),
    "atomic_us": Const(0.533, "us", "measured", f"atom.add.acq_rel.gpu dependent chain, 533 ns per link ({GPU_RUN})"),
    "dsm_us": Const(
        0.103,
        "us",
        "sourced",
        "a load of a sibling block's shared memory in a thread-block cluster on Hopper: about 180 cycles at "
        "1.755 GHz (arXiv:2402.13499, SM-to-SM network latency; cited, not re-measured here)",
    ),
    "cluster_sync_us": Const(
        0.206,
        "us",
        "assumed",
        "a cluster barrier (barrier.cluster.arrive + wait) as two SM-to-SM crossings, 2 x dsm_us: no "
        "published or measured figure times one alone (the one-GPU check's probe is ready for the next GPU)",
    ),
    "launch_graph_us": Const(
        1.4694,
        "us",
        "fitted",
        "a graph node's dependent launch on Hopper (one kernel or event node after another in one graph), fitted "
        "over the calibration figures (--calibration)",
    ),
    "launch_replay_us": Const(
        5.2917,
        "us",
        "fitted",
        "a one-node graph replayed back to back (each op pays a whole graph launch, GPU- or host-paced), fitted "
        "over the calibration figures timed that way (FlagGems-vllm#773)",
    ),
    "pdl_gain_us": Const(
        0.46,
        "us",
        "measured",
        f"dependent ubnext_lamport_bf16 launches in a CUDA graph, PDL off 4.45 us vs on 3.99 us ({GPU_RUN})",
    ),
    "eager_extra_us": Const(
        0.90,
        "us",
        "measured",
        f"dependent ubnext_lamport_bf16 launches, PDL off, eager 5.35 us vs graph 4.45 us ({GPU_RUN})",
    ),
    "nvlink_GBps": Const(
        320 * GIB / 1e9, "GB/s", "sourced", "NCCL 5067397 src/sym_kernels.cc:415, peakBw = 320 GiB/s (unicast)"
    ),
    "nvls_GBps": Const(
        480 * GIB / 1e9,
        "GB/s",
        "sourced",
        "NCCL 5067397 src/sym_kernels.cc:415, peakBw = 480 GiB/s for RSxLDMC_AGxSTMC (nccl-tests#212's peak; "
        "no calibration figure is that peak)",
    ),
    "hbm_H100_GBps": Const(3350.0, "GB/s", "sourced", "H100 SXM HBM3 (NVIDIA H100 datasheet)"),
    "hbm_H200_GBps": Const(4800.0, "GB/s", "sourced", "H200 SXM HBM3e (NVIDIA H200 datasheet)"),
}

# Blackwell: NCCL's symmetric-kernel model (src/sym_kernels.cc:416-419) against its Hopper one (:412-415).
# No Blackwell figure calibrates it: every constant is uncalibrated. The launch and the latencies are
# Hopper's scaled by NCCL's LL base-latency ratio (11 / 4.5): NCCL's own statement of how much slower a
# small symmetric kernel is there, not a measurement of any one term.
BW_LATENCY_SCALE = 11.0 / 4.5
BLACKWELL: dict[str, Const] = {
    "latency_scale": Const(
        BW_LATENCY_SCALE,
        "x",
        "uncalibrated",
        "NCCL 5067397 src/sym_kernels.cc:413/:417, LL baseLat 11 us (Blackwell) / 4.5 us (Hopper)",
    ),
    "nvlink_GBps": Const(
        600 * GIB / 1e9, "GB/s", "uncalibrated", "NCCL 5067397 src/sym_kernels.cc:419, peakBw = 600 GiB/s"
    ),
    "nvls_GBps": Const(
        1000 * GIB / 1e9, "GB/s", "uncalibrated", "NCCL 5067397 src/sym_kernels.cc:419, peakBw = 1000 GiB/s"
    ),
    "hbm_B200_GBps": Const(8000.0, "GB/s", "uncalibrated", "B200 HBM3e (NVIDIA B200 datasheet)"),
}

FITTED = tuple(name for name, c in HOPPER.items() if c.kind == "fitted")
MAX_FITTED = 3
BAR_MODEL = 0.25
BAR_LEFT_OUT = 0.35
KEYS = ("peer", "case", "hardware", "published_us", "model_us", "left_out_us", "source")
# the launch mode issue 38's targets, the peer rows and the planner's orders are priced in
TARGET_MODE = "graph+pdl"


# ------------------------------------------------------------------ the model


def _values(consts: dict[str, Const], over: dict[str, float] | None = None) -> dict[str, float]:
    v = {k: c.value for k, c in consts.items()}
    v.update(over or {})
    return v


def hopper_values() -> dict[str, float]:
    """The calibrated Hopper constants by name."""
    return _values(HOPPER)


def launch_us(mode: str, v: dict[str, float]) -> float:
    if mode == "replay":
        return v["launch_replay_us"]
    base = v["launch_graph_us"]
    if mode == "graph+pdl":
        return base - v["pdl_gain_us"]
    if mode == "eager":
        return base + v["eager_extra_us"]
    if mode == "graph":
        return base
    raise ValueError(f"unknown launch mode {mode!r}")


def kernel_us(k: Kernel, mode: str, gpu: str, v: dict[str, float]) -> float:
    rt = 2 * v["hop_us"] if k.remote else v["l2_rt_us"]
    rounds = math.ceil(k.cta_bytes / k.inflight) if k.inflight else 1
    data = max(
        (rounds - 1) * rt,
        k.nvlink_bytes / (v["nvlink_GBps"] * 1e3),
        k.multicast_bytes / (v["nvls_GBps"] * 1e3),
        k.hbm_bytes / (v[f"hbm_{gpu}_GBps"] * 1e3),
    )
    latency = (
        (k.l2 + k.waits) * v["l2_rt_us"]
        + k.hops * v["hop_us"]
        + k.atomics * v["atomic_us"]
        + k.dsm * v["dsm_us"]
        + k.cluster_syncs * v["cluster_sync_us"]
    )
    return launch_us(mode, v) + latency + data


def rounds(c: Mapping[str, Any]) -> int:
    """Rounds of one CTA's loads: its loaded bytes over its bytes in flight (the emulator's counts)."""
    return math.ceil(c["cta_load_bytes"] / c["cta_inflight"]) if c.get("cta_inflight") else 1


def launch_cal_us(
    c: Mapping[str, Any], world: int, mode: str, gpu: str = "H100", v: dict[str, float] | None = None
) -> float:
    """Modeled time of one of ubnext's launches from the emulator's count mode (``_costmodel``'s launch dicts,
    csrc/emu/memory.cpp's rules), under the calibrated constants and kernel_us's rule: launch + (l2 + waits) x
    L2_RT + hops x HOP + atomics x ATOMIC + the slowest of the CTA's extra rounds (a round trip each: two hops
    when most of its loaded bytes come from peers or the switch, else one L2 round trip), its unicast NVLink
    bytes, its multicast bus bytes (ld_reduce bytes + stored bytes x N, NCCL's S/N + S) and its HBM bytes."""
    v = v or _values(HOPPER)
    remote = 2 * c["cta_remote_load_bytes"] > c["cta_load_bytes"]
    rt = 2 * v["hop_us"] if remote else v["l2_rt_us"]
    data = max(
        (rounds(c) - 1) * rt,
        c["nvlink_bytes"] / (v["nvlink_GBps"] * 1e3),
        (c["mc_ld_bytes"] + c["mc_store_bytes"] * world) / (v["nvls_GBps"] * 1e3),
        c["total_bytes"] / (v[f"hbm_{gpu}_GBps"] * 1e3),
    )
    latency = (
        (c["l2"] + c["waits"]) * v["l2_rt_us"]
        + c["t_hops"] * v["hop_us"]
        + c["atomics"] * v["atomic_us"]
        + c.get("dsm", 0) * v["dsm_us"]
        + c.get("cluster_syncs", 0) * v["cluster_sync_us"]
    )
    return launch_us(mode, v) + latency + data


def record_us(r: Record, over: dict[str, float] | None = None) -> float:
    """Modeled time of a record on Hopper constants (``over``: constants replaced, e.g. re-fitted ones)."""
    v = _values(HOPPER, over)
    return sum(kernel_us(k, r.mode, r.gpu, v) for k in r.kernels)


def blackwell_values() -> dict[str, float]:
    """Blackwell's constants (uncalibrated): Hopper's latencies and launches scaled, NCCL's bandwidths."""
    v = _values(HOPPER)
    for name in (
        "hop_us",
        "l2_rt_us",
        "atomic_us",
        "dsm_us",
        "cluster_sync_us",
        "launch_graph_us",
        "launch_replay_us",
        "pdl_gain_us",
        "eager_extra_us",
    ):
        v[name] *= BW_LATENCY_SCALE
    v.update(
        nvlink_GBps=BLACKWELL["nvlink_GBps"].value,
        nvls_GBps=BLACKWELL["nvls_GBps"].value,
        hbm_B200_GBps=BLACKWELL["hbm_B200_GBps"].value,
    )
    return v


# ------------------------------------------------------------------ fitting


def _loss(recs: list[Record], over: dict[str, float]) -> float:
    return sum(math.log(record_us(r, over) / r.published_us) ** 2 for r in recs)


def fit(recs: list[Record], names: tuple[str, ...] = FITTED) -> dict[str, float]:
    """The fitted constants that minimise the squared log error over ``recs``: coordinate descent with a
    golden-section search per constant on [0.01, 20] us, deterministic, from the constants' values."""
    over = {n: HOPPER[n].value for n in names}
    g = (math.sqrt(5) - 1) / 2
    for _ in range(30 if len(names) > 1 else 1):
        for n in names:
            lo, hi = 0.01, 20.0
            for _ in range(80):
                a, b = hi - g * (hi - lo), lo + g * (hi - lo)
                if _loss(recs, over | {n: a}) < _loss(recs, over | {n: b}):
                    hi = b
                else:
                    lo = a
            over[n] = round((lo + hi) / 2, 4)
    return over


def fitting_records() -> list[Record]:
    return [r for r in _peers.records() if r.fit]


def _same_figure(a: Record, b: Record) -> bool:
    return a.source == b.source and a.published_us == b.published_us


def calibration_table() -> list[dict[str, object]]:
    """One row per published figure: published, modeled (constants as committed), left-out (the fitted
    constants re-fitted over every other fitted figure), source, and the record's counts. A not-fitted
    reading of a fitted figure (another launch mode, another harness version) is priced under its own fit:
    the constants re-fitted with it in place of the fitted reading."""
    recs = list(_peers.records())
    fitting = [r for r in recs if r.fit]
    rows: list[dict[str, object]] = []
    for r in recs:
        pool = fitting
        if not r.fit and any(_same_figure(r, o) for o in fitting):
            pool = [r if _same_figure(r, o) else o for o in fitting]
        own = fit(pool) if pool is not fitting else {}
        # left out: the figure itself, in every reading of it (same source, same published time)
        refit = fit([o for o in pool if not _same_figure(o, r)])
        model = record_us(r, own)
        left = record_us(r, refit)
        rows.append(
            {
                "peer": r.peer,
                "case": r.case,
                "hardware": r.hardware,
                "published_us": r.published_us,
                "model_us": round(model, 2),
                "left_out_us": round(left, 2),
                "source": r.source,
                "mode": r.mode,
                "fitted": r.fit,
                "own_fit": own,
                "model_err": round(model / r.published_us - 1, 3),
                "left_out_err": round(left / r.published_us - 1, 3),
                "refit": refit,
            }
        )
    return rows


# ------------------------------------------------------------------ the freeze


def freeze_hash() -> str:
    """sha256 over the constants, the counting rules (this module's and _peers' source) and the records:
    pinned by tests/unit/test_calibration.py, so a change to any of them is a deliberate re-calibration."""
    h = hashlib.sha256()
    for consts in (HOPPER, BLACKWELL):
        h.update(json.dumps({k: [c.value, c.unit, c.kind] for k, c in consts.items()}, sort_keys=True).encode())
    for r in _peers.records():
        h.update(repr(replace(r, source="", mode_note="")).encode())
    h.update(inspect.getsource(kernel_us).encode())
    h.update(inspect.getsource(launch_us).encode())
    h.update(inspect.getsource(launch_cal_us).encode())
    h.update(inspect.getsource(rounds).encode())
    return h.hexdigest()


# ------------------------------------------------------------------ printing


def print_calibration(rows: list[dict[str, object]], as_json: bool, out: TextIO = sys.stdout) -> None:
    if as_json:
        for r in rows:
            print(json.dumps({k: r[k] for k in KEYS}), file=out)
        return
    print(
        "# calibrated model (issue 38 item 1), Hopper constants; left-out: every fitted constant re-fitted "
        f"without that figure; bar: model within {BAR_MODEL:.0%}, left-out within {BAR_LEFT_OUT:.0%}",
        file=out,
    )
    for name, c in HOPPER.items():
        print(f"#   {name} = {c.value:g} {c.unit} [{c.kind}]: {c.source}", file=out)
    for name, c in BLACKWELL.items():
        print(f"#   blackwell.{name} = {c.value:g} {c.unit} [{c.kind}]: {c.source}", file=out)
    print(f"#   freeze {freeze_hash()[:16]}", file=out)
    print(
        f"{'peer':11} {'case':42} {'hardware':9} {'mode':9} {'published':>9} {'model':>7} {'err':>6} "
        f"{'left_out':>8} {'err':>6}  source",
        file=out,
    )
    for r in rows:
        own = ", ".join(f"{k} {v:g}" for k, v in dict(r["own_fit"]).items())  # type: ignore[call-overload]
        mark = "" if r["fitted"] else f" (another reading, its own fit: {own})" if own else " (not fitted)"
        print(
            f"{r['peer']:11} {r['case']:42} {r['hardware']:9} {r['mode']:9} {r['published_us']:9.2f} "
            f"{r['model_us']:7.2f} {r['model_err']:+6.0%} {r['left_out_us']:8.2f} {r['left_out_err']:+6.0%}  "
            f"{r['source']}{mark}",
            file=out,
        )


# ------------------------------------------------------------------ peer rows beside --model's table

PEER_FUSED_TOKENS = (1, 16, 128)
PEER_LL_MAX_BYTES = 64 * 1024
PEER_NVLS_BYTES = (256 * 1024, 64 * 1024 * 1024)


def peer_rows(world: int, allreduce_bytes: tuple[int, ...], hidden: int = 8192) -> list[dict[str, object]]:
    """The peers' structures at ``world`` ranks on H100, graph + PDL, under the calibrated constants: the
    FlashInfer one-shot fused record (the TP2 record's structure) at 1, 16 and 128 tokens, NCCL's symmetric
    LL at every table size up to 64 KB, NCCL's NVLS from 256 KB to 64 MB. Their ``path`` starts with
    ``peer:``; they are printed only: never written to _thresholds.py, never chosen."""
    v = _values(HOPPER)
    out: list[dict[str, object]] = []

    def row(op: str, path: str, nbytes: int, tokens: int, k: Kernel) -> None:
        out.append(
            {
                "op": op,
                "path": path,
                "dtype": "bf16",
                "tokens": tokens,
                "hidden": hidden if tokens else 0,
                "bytes": nbytes,
                "world": world,
                "l2": k.l2,
                "hops": k.hops,
                "atomics": k.atomics,
                "waits": k.waits,
                "model_us": round(kernel_us(k, TARGET_MODE, "H100", v), 2),
                "cal_us": round(kernel_us(k, TARGET_MODE, "H100", v), 2),
                "cal_eager_us": round(kernel_us(k, "eager", "H100", v), 2),
                "chosen": False,
            }
        )

    for t in PEER_FUSED_TOKENS:
        k = _peers.flashinfer_oneshot(t, hidden, world)
        row("all_reduce_add_rmsnorm", "peer:flashinfer_oneshot", t * hidden * 2, t, k)
    for b in allreduce_bytes:
        if b <= PEER_LL_MAX_BYTES:
            row("all_reduce", "peer:nccl_symmetric_ll", b, 0, _peers.nccl_symmetric_ll(b, world))
        if PEER_NVLS_BYTES[0] <= b <= PEER_NVLS_BYTES[1]:
            row("all_reduce", "peer:nccl_nvls", b, 0, _peers.nccl_nvls(b, world))
    return out


def print_peer_rows(rows: list[dict[str, object]], as_json: bool, out: TextIO = sys.stdout) -> None:
    if as_json:
        for r in rows:
            print(json.dumps(r), file=out)
        return
    print("# peers' structures under the calibrated model (H100, graph + PDL); printed only, never chosen", file=out)
    for r in rows:
        print(
            f"{r['op']:28} {r['path']:24} {r['bytes']:10d} {r['tokens']:5d} l2 {r['l2']} hops {r['hops']} "
            f"atomics {r['atomics']} waits {r['waits']} {r['model_us']:9.2f}",
            file=out,
        )
