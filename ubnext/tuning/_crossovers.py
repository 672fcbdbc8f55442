"""The planner's path orders from the critical-path model (issue 24 item D), per operation, world
size and multicast: ``python -m ubnext.bench --model --write-thresholds`` writes them, with the
counts they come from, to ``ubnext/plan/_thresholds.py``, which ``ubnext.plan`` reads.

How an order is made:

- **Counts.** The model's emulated ranks (``_costmodel.measure``) count every all_reduce path and
  every fused-op path (hidden 8192, bf16) at the worlds in ``MEASURED_WORLDS``, with multicast and
  without (``UBNEXT_EMU_MULTICAST=0``: the unicast paths' own counts, without proxy fences), at
  every size whose grid the emulator can run. Those counts are the table's ``COUNTS``.
- **Other sizes** are derived from the nearest measured size of the same path (``_costmodel.derive``,
  the model table's own rule). **Other worlds** (3, 5, 6, 7) take the modeled times of the nearest
  measured worlds, interpolated linearly in N (one-shot paths, whose bytes grow as a + b N) or in 1/N
  (the others: a + b / N) (``Model.path_us``). Times, not counts: a CTA's rounds of loads are whole,
  and interpolated bytes would put it on the wrong side of a round.
- **Time**: the calibrated model's (``_calibration.launch_cal_us``, the frozen constants) of those counts,
  in a CUDA graph with PDL (``LAUNCH_MODE``), the mode issue 38's targets are judged in. torch.distributed
  (NCCL on GPUs) cannot be counted: it gets the published figures of shared/DESIGN.md section 9
  (``torch_us``).
- **Dtype** matters to the fused op only, through its row's bytes: its orders are made for rows of
  hidden 8192 in 2-byte and in 4-byte elements (``VARIANTS``), the 4-byte counts derived from the
  measured 2-byte ones as for a message of the same bytes with half the tokens.
- **Order**: at each sampled size (``SAMPLES_PER_OCTAVE`` per octave; whole tokens for the fused
  op) the paths are sorted by modeled time, and an order is kept for the next size as long as
  each of its paths models within ``TOLERANCE`` of the fastest path after it. Whatever paths a call
  then finds unable to run (a full Lamport slot, no staging room, nondeterminism not allowed), the
  first one that can run models within ``TOLERANCE`` of the fastest one that can.

Worlds above the largest measured one use its orders (``plan.auto_order``): a host has at most 8
NVLink GPUs on the machines the kernels target, and a one-shot's cost grows with the world, so
there the orders lean towards the one-shot paths; ``--worlds ... N`` measures a larger world.
Sizes between two samples (about 4 % apart) take the order of the segment they fall in.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import cast

from . import _calibration
from . import _costmodel as M
from ._emucounts import CAL_KEYS

COMMAND = "python -m ubnext.bench --model --write-thresholds"
MEASURED_WORLDS = (2, 4, 8)
TOLERANCE = 0.05
SAMPLES_PER_OCTAVE = 16
OPS = {"all_reduce": M.ALLREDUCE_PATHS, "all_reduce_add_rmsnorm": M.FUSED_PATHS}
# Where the dtype matters: the allreduce kernels move 16-byte vectors whatever the dtype (elem None),
# the fused op works a row per token, and a row of hidden 8192 is 16 KB in bf16/fp16, 32 KB in fp32.
VARIANTS = (("all_reduce", None), ("all_reduce_add_rmsnorm", 2), ("all_reduce_add_rmsnorm", 4))
UNICAST_PATHS = ("lamport", "twoshot")  # the kernel paths a pool without a multicast address runs
LAUNCH_FIELDS = (
    "ctas",
    "hops",
    "fences",
    "max_cta_bytes",
    "total_bytes",
    "nvlink_bytes",
    "multicast_bytes",
    *CAL_KEYS,
)
# the launch mode the orders are made for: a CUDA graph with programmatic dependent launch (issue 38's targets)
LAUNCH_MODE = _calibration.TARGET_MODE
# ties (equal modeled times) go to the earlier path: the one-shot Lamport first, torch.distributed last
PREFERENCE = ("lamport", "nvls_lamport", "nvls_oneshot", "nvls_twoshot", "twoshot", "torch")
MAX_BYTES = (1 << 31) - 1  # plan.KERNEL_MAX_BYTES: past it every call takes torch.distributed

# torch.distributed.all_reduce (NCCL on GPUs) is outside the model: its time is the published one
# (shared/DESIGN.md section 9). Up to 2 MB: NCCL on 8xH200 in a CUDA graph, medians, flashinfer#3759
# (16.6 us at 2 KB, 20.8 us at 512 KB, 40 us at 2 MB), interpolated between the points and the
# first one below them. Past 2 MB its bus bandwidth adds the rest: NVLS allreduce ~480 GB/s busbw
# on 8xH100 (nccl-tests#212) with multicast, NVLink4 ~370 GB/s effective without. Published for 8
# ranks; used at every world (a limit: NCCL's small-message latency is lower at fewer ranks).
NCCL_PUBLISHED_US = ((2048, 16.6), (524288, 20.8), (2097152, 40.0))
NCCL_BUSBW_GBPS = {True: 480.0, False: 370.0}


def torch_us(op: str, nbytes: int, world: int, multicast: bool) -> float:
    """torch.distributed's time for this call from the published figures; for the fused op plus the
    add + RMSNorm kernel ubnext runs after it (modeled: one launch reading x and the residual and
    writing residual_out and out at HBM bandwidth)."""
    points = NCCL_PUBLISHED_US
    if nbytes <= points[0][0]:
        us = points[0][1]
    elif nbytes >= points[-1][0]:
        size, last = points[-1]
        us = last + (nbytes - size) * 2 * (world - 1) / world / (NCCL_BUSBW_GBPS[multicast] * 1e3)
    else:
        (s0, t0), (s1, t1) = next((a, b) for a, b in zip(points, points[1:]) if nbytes <= b[0])
        us = t0 + (t1 - t0) * (nbytes - s0) / (s1 - s0)
    if op == "all_reduce_add_rmsnorm":
        us += launch_us(norm_launch(nbytes), world)
    return round(us, 2)


def norm_launch(nbytes: int) -> dict:
    """The add + RMSNorm kernel after torch.distributed's allreduce, counted as a launch: one dependent local
    round trip, x and the residual read and residual_out and out written through HBM."""
    launch = dict.fromkeys(LAUNCH_FIELDS, 0)
    launch.update(l2=1, total_bytes=4 * nbytes)
    return launch


def launch_us(launch: dict, world: int) -> float:
    """One launch's time under the calibrated model (``_calibration.launch_cal_us``), in LAUNCH_MODE."""
    return _calibration.launch_cal_us(launch, world, LAUNCH_MODE)


# ------------------------------------------------------------------ counts at any size and world


def paths_of(op: str, multicast: bool) -> tuple[str, ...]:
    return tuple(p for p in OPS[op] if multicast or p in UNICAST_PATHS)


def case_of(op: str, path: str, nbytes: int, elem: int | None = None) -> M.Case:
    """The model's case of a message; the fused op's tokens are rows of hidden 8192 of ``elem``
    bytes (a 4-byte row is derived from the measured 2-byte ones: twice the bytes per token)."""
    return M.Case(op, path, nbytes, nbytes // ((elem or 2) * M.HIDDEN))


# Paths on which every rank moves the whole message to or from every peer: their bytes grow as
# a + b N with the world size N. The others reduce a 1/N share per rank (two-shot, nvls_lamport):
# a + b / N.
ONE_SHOT_PATHS = ("lamport", "nvls_oneshot")


def world_fraction(path: str, w0: int, w1: int, world: int) -> float:
    """Where ``world`` sits between the measured worlds ``w0 < world < w1``, in the measure a path's bytes
    are linear in: N for the one-shot paths, 1/N for the others."""
    if path in ONE_SHOT_PATHS:
        return (world - w0) / (w1 - w0)
    return (1 / world - 1 / w0) / (1 / w1 - 1 / w0)


@dataclass
class Model:
    """The model's times from a table of measured counts: ``counts`` maps (op, world, multicast,
    path) to {Case: launches}."""

    counts: dict
    sm_count: int = 132

    def measured_worlds(self, op: str, multicast: bool) -> list[int]:
        return sorted({w for (o, w, mc, _) in self.counts if (o, mc) == (op, multicast)})

    def path_us(self, op: str, world: int, multicast: bool, path: str, nbytes: int, elem: int | None = None) -> float:
        """One path's modeled microseconds for this call: its launches priced at a measured world; between two
        measured worlds, those worlds' times interpolated (world_fraction). Times, not counts: a CTA's rounds
        of loads are whole, and interpolated bytes would put it on the wrong side of a round."""
        measured = self.counts.get((op, world, multicast, path))
        if measured is not None:
            case = case_of(op, path, nbytes, elem)
            launches = measured.get(case) or M.derive(measured, case, world, self.sm_count)
            if launches is None:
                raise LookupError(f"no measured counts of {op}'s {path!r} path at world {world} to derive {case} from")
            return sum(launch_us(c, world) for c in launches)
        worlds = self.measured_worlds(op, multicast)
        w0 = max(w for w in worlds if w < world)
        w1 = min(w for w in worlds if w > world)
        t0, t1 = (self.path_us(op, w, multicast, path, nbytes, elem) for w in (w0, w1))
        return t0 + world_fraction(path, w0, w1, world) * (t1 - t0)

    def times(self, op: str, world: int, multicast: bool, nbytes: int, elem: int | None = None) -> dict[str, float]:
        """Modeled microseconds of every path for this call (the calibrated model, LAUNCH_MODE), torch.distributed's
        from its figures."""
        out = {p: round(self.path_us(op, world, multicast, p, nbytes, elem), 2) for p in paths_of(op, multicast)}
        out["torch"] = torch_us(op, nbytes, world, multicast)
        return out

    def worlds(self) -> range:
        measured = sorted({w for (_, w, _, _) in self.counts})
        return range(measured[0], measured[-1] + 1)


def samples(op: str, elem: int | None = None) -> list[int]:
    """The message sizes at which orders are compared: SAMPLES_PER_OCTAVE per octave in whole
    16-byte vectors (whole rows of hidden 8192 of ``elem`` bytes for the fused op), up to MAX_BYTES."""
    unit = elem * M.HIDDEN if elem else 16
    out: list[int] = []
    k = 0
    while True:
        n = max(1, round(2 ** (k / SAMPLES_PER_OCTAVE))) * unit
        if n > MAX_BYTES:
            return out
        if not out or n > out[-1]:
            out.append(n)
        k += 1


def acceptable(order: tuple[str, ...], times: dict[str, float]) -> bool:
    """Whether each path of ``order`` models within TOLERANCE of the fastest path after it: then
    the first path of any subset is within TOLERANCE of that subset's fastest."""
    best_after = math.inf
    for path in reversed(order):
        best_after = min(best_after, times[path])
        if times[path] > (1 + TOLERANCE) * best_after:
            return False
    return True


def ranked(times: dict[str, float]) -> tuple[str, ...]:
    return tuple(sorted(times, key=lambda p: (times[p], PREFERENCE.index(p))))


def orders(model: Model) -> dict:
    """(op, elem, world, multicast) -> ((largest message in bytes or None for the rest, paths
    fastest first), ...)."""
    out = {}
    for op, elem in VARIANTS:
        sizes = samples(op, elem)
        for world in model.worlds():
            for multicast in (True, False):
                segments: list[tuple[int | None, tuple[str, ...]]] = []
                order: tuple[str, ...] | None = None
                last = 0
                for n in sizes:
                    times = model.times(op, world, multicast, n, elem)
                    if order is None or not acceptable(order, times):
                        if order is not None:
                            segments.append((last, order))
                        order = ranked(times)
                    last = n
                # samples() is never empty (its first size is below MAX_BYTES): order is set
                segments.append((None, cast("tuple[str, ...]", order)))
                out[(op, elem, world, multicast)] = tuple(segments)
    return out


# ------------------------------------------------------------------ the table module

HERE = os.path.dirname(os.path.abspath(__file__))
# the table is the planner's: ubnext/plan/_thresholds.py, this file being ubnext/tuning/_crossovers.py
TABLE_PATH = os.path.join(os.path.dirname(HERE), "plan", "_thresholds.py")


def measure(worlds=MEASURED_WORLDS, log=print) -> dict:
    """Count every path of both ops at each world, with multicast and without."""
    counts: dict = {}
    for world in worlds:
        for multicast in (True, False):
            only = frozenset((op, p) for op in OPS for p in paths_of(op, multicast))
            t = time.monotonic()
            measured = M.measure(world, only=only, env=None if multicast else {"UBNEXT_EMU_MULTICAST": "0"})
            log(
                f"# measured {world} ranks, multicast {'on' if multicast else 'off'}: {len(measured)} cases, "
                f"{time.monotonic() - t:.0f} s"
            )
            for case, launches in measured.items():
                counts.setdefault((case.op, world, multicast, case.path), {})[case] = launches
    return counts


def _launch_tuple(launch: dict) -> tuple:
    return tuple(int(launch[k]) for k in LAUNCH_FIELDS)


def model_of(table_counts: dict, sm_count: int = 132) -> Model:
    """The Model of a table module's COUNTS: (op, world, multicast, path) -> ((bytes, tokens,
    (launch tuple, ...)), ...)."""
    counts = {
        key: {
            M.Case(key[0], key[3], nbytes, tokens): [dict(zip(LAUNCH_FIELDS, launch)) for launch in launches]
            for nbytes, tokens, launches in cases
        }
        for key, cases in table_counts.items()
    }
    return Model(counts, sm_count)


def table_counts(counts: dict) -> dict:
    return {
        key: tuple(
            (c.nbytes, c.tokens, tuple(_launch_tuple(x) for x in launches))
            for c, launches in sorted(measured.items(), key=lambda item: item[0].nbytes)
        )
        for key, measured in sorted(counts.items())
    }


def render(tcounts: dict, torders: dict, worlds: tuple[int, ...], sm_count: int) -> str:
    lines = [
        '"""The planner\'s path order per message size, per operation, world size and multicast.',
        "",
        f"GENERATED by `{COMMAND}`",
        "from the calibrated model (ubnext/tuning/_crossovers.py says how); do not edit. Regenerate it",
        "whenever a kernel's counts, the launch geometry or the model's constants change:",
        'tests/unit/test_thresholds.py and tests/mpi/test_costmodel.py fail until then."""',
        "",
        f"COMMAND = {COMMAND!r}",
        f"MEASURED_WORLDS = {tuple(worlds)!r}",
        f"SM_COUNT = {sm_count!r}  # the GPU geometry's SMs the counts were taken at (UBNEXT_EMU_SM_COUNT)",
        f"LAUNCH_FIELDS = {LAUNCH_FIELDS!r}",
        "",
        "# (op, world, multicast, path) -> ((message bytes, tokens, (one tuple of LAUNCH_FIELDS per",
        "# launch, ...)), ...): the counts measured on the emulator, hidden 8192, bf16",
        "COUNTS = {",
    ]
    for key, cases in tcounts.items():
        lines.append(f"    {key!r}: (")
        lines += [f"        {case!r}," for case in cases]
        lines.append("    ),")
    lines += [
        "}",
        "",
        "# (op, element bytes of the fused op's rows or None, world, multicast) -> ((largest message in bytes,",
        "# or None for every larger one, paths to try, fastest first by the model), ...)",
        "ORDERS = {",
    ]
    for key, segments in torders.items():
        lines.append(f"    {key!r}: (")
        lines += [f"        {segment!r}," for segment in segments]
        lines.append("    ),")
    lines += ["}", ""]
    return "\n".join(lines)


def write(worlds=MEASURED_WORLDS, path: str = TABLE_PATH, log=print) -> dict:
    from .. import envs

    sm_count = envs.get("UBNEXT_EMU_SM_COUNT")
    tcounts = table_counts(measure(worlds, log))
    torders = orders(model_of(tcounts, sm_count))
    with open(path, "w") as f:
        f.write(render(tcounts, torders, tuple(worlds), sm_count))
    log(
        f"# wrote {path}; README's ubnext.info sample and docs/PERF.md's model table show these choices: "
        "python scripts/readme_info_sample.py, python -m ubnext.bench --model --world 8"
    )
    return torders


def stale(table) -> str | None:
    """Why a table module no longer matches the model (its orders recomputed from its own counts by
    today's model and geometry), or None."""
    if table.SM_COUNT is None:
        return f"ubnext/plan/_thresholds.py holds no counts: generate it with `{COMMAND}`"
    fresh = orders(model_of(table.COUNTS, table.SM_COUNT))
    if fresh == table.ORDERS:
        return None
    diff = [
        f"{key}: table {table.ORDERS.get(key)!r}, model {fresh[key]!r}"
        for key in fresh
        if fresh[key] != table.ORDERS.get(key)
    ][:3]
    return (
        "ubnext/plan/_thresholds.py is stale: the model now orders the paths differently (the constants, the "
        f"geometry or the derivation changed); regenerate it with `{COMMAND}`. First differences: " + "; ".join(diff)
    )


def format_orders(torders: dict) -> list[str]:
    """One line per (op, world, multicast): each segment's upper bound and its first paths."""
    out = []
    for (op, elem, world, multicast), segments in torders.items():
        parts = []
        for up_to, order in segments:
            bound = "rest" if up_to is None else f"<={_size(up_to)}"
            parts.append(f"{bound}: {'>'.join(order[:3])}")
        what = op + (f" {elem}-byte" if elem else "")
        out.append(f"{what} world {world} multicast {'on' if multicast else 'off'}: " + " | ".join(parts))
    return out


def _size(n: int) -> str:
    for unit, shift in (("M", 20), ("K", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):g}{unit}"
    return str(n)
