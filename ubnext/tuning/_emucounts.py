"""The emulator's full count record per launch (issue 38 item 1): ``ubnext_emu_count_log`` returns every
launch's count words since its last call, the planner's chain (what ``Emulator.recording`` gives) and the
calibrated model's (rules at the top of the count-mode section of ``csrc/emu/memory.cpp``): dependent local
L2 round trips, GPU-scope atomics, serialised waits and the bytes a CTA has in flight. The model's ranks
(``_costmodel``) read it beside their recordings; ``_calibration`` prices it."""

from __future__ import annotations

import ctypes
from typing import Any, NamedTuple

# UBNEXT_EMU_COUNT_WORDS (csrc/emu/emu_api.h)
COUNT_WORDS = 16
LOG_MAX = 4096


class Counts(NamedTuple):
    """One launch's count words, in emu_api.h's order."""

    ctas: int
    hops: int
    fences: int
    max_cta_bytes: int
    total_bytes: int
    t_hops: int  # the calibrated model's critical chain: NVLink crossings,
    l2: int  # dependent local L2 round trips,
    atomics: int  # atomics whose result the thread waits for,
    waits: int  # serialised waits;
    cta_load_bytes: int  # of the CTA needing the most rounds: the bytes it loaded,
    cta_inflight: int  # the most it had in flight at one control point,
    cta_remote_load_bytes: int  # and its loaded bytes from peers or the switch;
    mc_ld_bytes: int  # the launch's multimem.ld_reduce bytes,
    mc_store_bytes: int  # its multimem.st and .red bytes (once each, at its size);
    dsm: int  # the critical chain's distributed-shared-memory accesses of a sibling block,
    cluster_syncs: int  # and its cluster barriers


class CountLog:
    """The count log of one loaded emulator library (an ``_emu.Emulator``)."""

    def __init__(self, emu: Any) -> None:
        lib = emu._lib  # the library the Emulator loaded: the same process-wide state
        lib.ubnext_emu_count_log.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_int]
        lib.ubnext_emu_count_log.restype = ctypes.c_int
        lib.ubnext_emu_set_count_weights.argtypes = [ctypes.c_uint32] * 4
        lib.ubnext_emu_set_count_weights.restype = None
        self._lib = lib

    def set_weights(self, hop_us: float, l2_us: float, atomic_us: float, wait_us: float) -> None:
        """The weights (us, rounded to ns) that decide which chain is critical: the calibrated constants."""
        ns = [max(1, round(v * 1000)) for v in (hop_us, l2_us, atomic_us, wait_us)]
        self._lib.ubnext_emu_set_count_weights(*ns)

    def take(self) -> list[Counts]:
        """The launches since the last call, oldest first; forgets them."""
        buf = (ctypes.c_uint64 * (COUNT_WORDS * LOG_MAX))()
        n = self._lib.ubnext_emu_count_log(buf, LOG_MAX)
        return [Counts(*buf[i * COUNT_WORDS : (i + 1) * COUNT_WORDS]) for i in range(n)]


# launch keys the calibrated counts add (_emucounts.Counts), zero in a launch the emulator did not count
CAL_KEYS = (
    "t_hops",
    "l2",
    "atomics",
    "waits",
    "cta_load_bytes",
    "cta_inflight",
    "cta_remote_load_bytes",
    "mc_ld_bytes",
    "mc_store_bytes",
    "dsm",
    "cluster_syncs",
)

CAL_ROW_KEYS = (
    "t_hops",
    "l2",
    "atomics",
    "waits",
    "dsm",
    "cluster_syncs",
    "cta_load_bytes",
    "cta_inflight",
    "cal_us",
    "cal_eager_us",
)


def cal_row(launches: list[dict], world: int) -> dict:
    """A row's calibrated counts (summed over its launches; a CTA's bytes: the launch needing the most rounds)
    and its calibrated time, graph + PDL and eager (``_calibration.launch_cal_us``)."""
    from . import _calibration

    if any("cta_load_bytes" not in c for c in launches):
        return dict.fromkeys(CAL_ROW_KEYS)
    worst = max(launches, key=lambda c: (_calibration.rounds(c), c["cta_load_bytes"]))
    return {
        "t_hops": sum(c["t_hops"] for c in launches),
        "l2": sum(c["l2"] for c in launches),
        "atomics": sum(c["atomics"] for c in launches),
        "waits": sum(c["waits"] for c in launches),
        # issue 38 item 2's cluster counts (memory.cpp), shown beside the others; _calibration prices them
        "dsm": sum(c["dsm"] for c in launches),
        "cluster_syncs": sum(c["cluster_syncs"] for c in launches),
        "cta_load_bytes": worst["cta_load_bytes"],
        "cta_inflight": worst["cta_inflight"],
        "cal_us": round(sum(_calibration.launch_cal_us(c, world, _calibration.TARGET_MODE) for c in launches), 2),
        "cal_eager_us": round(sum(_calibration.launch_cal_us(c, world, "eager") for c in launches), 2),
    }
