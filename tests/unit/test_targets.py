"""Issue 38 item 2's target rows (ubnext/tuning/_targets.py), from pinned peer records and synthetic ubnext
rows: no emulator run. The floor argument, the busbw row's binding term."""

from __future__ import annotations

import pytest

from ubnext.plan import _thresholds
from ubnext.tuning import _calibration as C
from ubnext.tuning import _crossovers as X
from ubnext.tuning import _targets as T

MB = 1 << 20
NVLS_SIZES = (4 * MB, 16 * MB, 64 * MB)


def _nccl_nvls_us(nbytes: int) -> float:
    rows = C.peer_rows(8, (nbytes,))
    return float(next(r["cal_us"] for r in rows if r["path"] == "peer:nccl_nvls"))


@pytest.mark.parametrize("nbytes", NVLS_SIZES)
def test_no_nvls_allreduce_can_meet_ten_percent_below_nccl_under_the_frozen_model(nbytes: int) -> None:
    # the floor holds only the least any switch allreduce does (4 hops, 2 waits, S/N + S bus bytes at the
    # peak); NCCL's own record sits within 1 us above it, so 0.9 x NCCL is below the floor at 4-64 MB
    floor, nccl = T.nvls_floor_us(nbytes, 8), _nccl_nvls_us(nbytes)
    assert floor <= nccl < floor + 1.0
    assert floor > 0.9 * nccl


def _nvls_row(load: int, inflight: int, us: float) -> dict[str, object]:
    return {
        "op": "all_reduce",
        "path": "nvls_twoshot",
        "bytes": 64 * MB,
        "world": 8,
        "cal_us": us,
        "cta_load_bytes": load,
        "cta_inflight": inflight,
        "chosen": True,
    }


def _busbw_row(row: dict[str, object]) -> dict[str, object]:
    return next(r for r in T.targets([row], []) if r["case"].startswith("busbw"))


def test_the_busbw_row_names_the_term_that_binds() -> None:
    hop = C.HOPPER["hop_us"].value
    cap_us = (8 * MB + 64 * MB) / (C.HOPPER["nvls_GBps"].value * 1e3)
    # 65 rounds of 64 KB: 64 extra round trips through the switch, below the cap's term
    deep = _busbw_row(_nvls_row(65 * 65536, 65536, 150.0))
    assert deep["binding"] == "NVLS cap"
    assert deep["inflight_term_us"] == pytest.approx(64 * 2 * hop, abs=0.01)
    assert deep["nvls_cap_term_us"] == pytest.approx(cap_us, abs=0.01)
    assert deep["inflight_busbw_GBps"] > deep["busbw_GBps"]  # without the cap, its own depth goes further
    # 16 KB in flight (the 16-row measurement's): four times the rounds, the in-flight term binds
    shallow = _busbw_row(_nvls_row(4 * 65 * 65536, 16384, 313.0))
    assert shallow["binding"] == "in-flight bytes"
    assert shallow["inflight_busbw_GBps"] == shallow["busbw_GBps"]
    assert shallow["busbw_GBps"] == pytest.approx(2 * 7 / 8 * 64 * MB / 313e3, abs=0.1)
    assert not shallow["holds"]
    # nvls_lamport's CTAs poll their own memory: a round is a local L2 round trip, not two hops
    lamport = _busbw_row({**_nvls_row(65 * 65536, 65536, 150.0), "path": "nvls_lamport"})
    assert lamport["inflight_term_us"] == pytest.approx(64 * C.HOPPER["l2_rt_us"].value, abs=0.01)


@pytest.mark.parametrize("path", T.NVLS_PATHS)
def test_the_round_by_path_name_is_the_counts_round(path: str) -> None:
    # launch_cal_us takes two hops a round where most of a CTA's loaded bytes come from peers or the switch;
    # the target rows carry no remote bytes, so nvls_data_terms decides by the path: the measured counts agree
    for world in X.MEASURED_WORLDS:
        for _, _, launches in _thresholds.COUNTS[("all_reduce", world, True, path)]:
            for launch in launches:
                c = dict(zip(X.LAUNCH_FIELDS, launch))
                if c["cta_load_bytes"] > 4096:  # a round's worth: tiny launches are flags and headers
                    assert (2 * c["cta_remote_load_bytes"] > c["cta_load_bytes"]) == (path in T.SWITCH_LOAD_PATHS)
