"""The critical-path count (issue: latency-first kernels, item 1): `python -m ubnext.bench --model`
starts its own emulated ranks in count mode (csrc/emu/memory.cpp states the rules) and counts every
kernel path. The counts are pinned here, per path, at 4 ranks and the smallest sizes, with and
without multicast: a change that adds a barrier, a fence, a hop or bytes to a kernel fails this
file, and must update the pins and say why in its commit. A test-only build that adds one fence
to the Lamport kernel shows the count sees it; the builds without the call-header checks show the
checks cost no hop. No mpirun: the model starts its ranks itself (they are processes, hence this
tier)."""

from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import assert_mpi_ok, run_script
from ubnext.tuning import _costmodel

# (op, path, bytes) -> (ctas, hops, fences, max_cta_bytes), at 4 ranks, GPU geometry (256 threads,
# grids from 132 SMs capped at 128, halved for kernels that wait on peers: none of these small grids
# reaches that cap, and the flat NVLS two-shot's NCCL grid, ceil(16 / 4) = 4, neither), multicast on;
# steady state (the second of two calls).
# Issue 24 A moved the fences (and the hops they put on the chain), per site argued in the kernels:
# - lamport 1 -> 0 fences: no proxy fence between the multicast push and the self-validating poll;
# - every barrier 1 fewer fence (its release stays): no proxy fence after the multicast signal, so
#   nvls_oneshot, twoshot (multicast signals), reduce_scatter 4 -> 2, nvls_lamport 3 -> 1 (also its
#   poll's fence), all_gather 5 -> 2 and 5 -> 4 hops (its push's fence was on the chain too);
# - nvls_twoshot flat in place 5 -> 2 fences, 7 -> 6 hops: nothing in the kernel reads the broadcast
#   back, so its remaining fence is skipped; fused 5 -> 3, 7 hops: the row phase reads it, the fence
#   stays (no_proxy_fence_nvls_twoshot shows the emulator catches its absence).
PINNED_MULTICAST = {
    ("all_reduce", "lamport", 2048): (1, 1, 0, 22656),
    ("all_reduce", "nvls_lamport", 2048): (1, 5, 1, 7232),
    ("all_reduce", "nvls_oneshot", 2048): (1, 6, 2, 4160),
    ("all_reduce", "nvls_twoshot", 2048): (1, 6, 2, 1088),
    ("all_reduce", "twoshot", 2048): (1, 6, 2, 4160),
    ("all_reduce", "lamport", 16384): (4, 1, 0, 45184),
    ("all_reduce", "nvls_lamport", 16384): (1, 5, 1, 57408),
    ("all_reduce", "nvls_oneshot", 16384): (4, 6, 2, 8256),
    ("all_reduce", "nvls_twoshot", 16384): (1, 6, 2, 8256),
    ("all_reduce", "twoshot", 16384): (1, 6, 2, 32832),
    ("all_reduce", "lamport", 65536): (16, 1, 0, 45184),
    ("all_reduce", "nvls_lamport", 65536): (4, 5, 1, 57408),
    ("all_reduce", "nvls_oneshot", 65536): (16, 6, 2, 8256),
    ("all_reduce", "nvls_twoshot", 65536): (4, 6, 2, 8256),
    ("all_reduce", "twoshot", 65536): (4, 6, 2, 32832),
    # issue 26: the batch-invariant mode's plain NVLS two-shot paths (/ro: UBNEXT_F_RANK_ORDER), which sum
    # in rank order instead of by multimem.ld_reduce. nvls_twoshot/ro: by unicast loads of every rank's
    # copy: the same CTAs (at 4 ranks the unicast two-shot's grid equals NCCL's ceil(16 / 4)), hops and
    # fences as the default's form (a load round trip either way), and a CTA's bytes up by the N-1
    # peers' share it loads (at 16384: 4 x 4096 loaded, 4096 stored, 64 of barrier, against 4096
    # ld_reduced). nvls_lamport/ro: the push form (csrc/kernels/nvls.cu nvls_lamport_push): 2 hops (the
    # push, the multicast of the sum), no barrier, no fence; a CTA's bytes up by its pushes, the poll of
    # its receive slots and the re-poison of both regions (at 16384: 118,912)
    ("all_reduce", "nvls_lamport/ro", 2048): (1, 2, 0, 14976),
    ("all_reduce", "nvls_twoshot/ro", 2048): (1, 6, 2, 2624),
    ("all_reduce", "nvls_lamport/ro", 16384): (1, 2, 0, 118912),
    ("all_reduce", "nvls_twoshot/ro", 16384): (1, 6, 2, 20544),
    ("all_reduce", "nvls_lamport/ro", 65536): (4, 2, 0, 118912),
    ("all_reduce", "nvls_twoshot/ro", 65536): (4, 6, 2, 20544),
    # the Lamport fused op splits a row over a cluster of 8 CTAs of 128 threads at 1 token (norm.cuh's row
    # split: 1/8 of the bytes per CTA, the same single hop; CTA 0's share of the grid-wide re-poison is 128
    # threads' since issue 38 item 2, 8128 bytes fewer than at 256); at 4 tokens its 32 CTAs are past the
    # measured grids (derived, see
    # test_fused_row_split_at_8_ranks). The two-shot fused paths: the owner adds the residual before the
    # one rounding, so the row phase no longer loads it (fewer bytes), and nvls_twoshot's fused rows sum
    # by unicast loads instead of ld_reduce (the same hops: a round trip either way; issue 26)
    ("all_reduce_add_rmsnorm", "lamport", 16384): (8, 1, 0, 28800),
    ("all_reduce_add_rmsnorm", "nvls_lamport", 16384): (1, 5, 1, 106560),
    ("all_reduce_add_rmsnorm", "nvls_twoshot", 16384): (1, 7, 3, 86080),
    ("all_reduce_add_rmsnorm", "twoshot", 16384): (1, 6, 2, 98368),
    ("all_reduce_add_rmsnorm", "nvls_lamport", 65536): (4, 5, 1, 106560),
    ("all_reduce_add_rmsnorm", "nvls_twoshot", 65536): (4, 7, 3, 86080),
    ("all_reduce_add_rmsnorm", "twoshot", 65536): (4, 6, 2, 98368),
    ("all_gather", "allgather", 65536): (4, 4, 2, 8256),
    ("reduce_scatter", "reduce_scatter", 65536): (4, 6, 2, 20544),
    ("quantize", "row", 65536): (4, 0, 0, 24576),
    ("quantize", "tensor", 65536): (1, 0, 0, 98304),
    ("quantize", "static", 65536): (4, 0, 0, 24576),
}
# the same without a multicast address (PCIe peers, ranks sharing a GPU): unicast pushes need no
# proxy fence
UNICAST_PATHS = frozenset(
    {
        ("all_reduce", "lamport"),
        ("all_reduce", "twoshot"),
        ("all_reduce_add_rmsnorm", "lamport"),
        ("all_reduce_add_rmsnorm", "twoshot"),
        ("all_gather", "allgather"),
        ("reduce_scatter", "reduce_scatter"),
    }
)
PINNED_UNICAST = {
    ("all_reduce", "lamport", 2048): (1, 1, 0, 28848),
    ("all_reduce", "twoshot", 2048): (1, 6, 2, 4192),
    ("all_reduce", "lamport", 16384): (4, 1, 0, 57520),
    ("all_reduce", "twoshot", 16384): (1, 6, 2, 32864),
    ("all_reduce", "lamport", 65536): (16, 1, 0, 57520),
    ("all_reduce", "twoshot", 65536): (4, 6, 2, 32864),
    ("all_reduce_add_rmsnorm", "lamport", 16384): (8, 1, 0, 34992),
    ("all_reduce_add_rmsnorm", "twoshot", 16384): (1, 6, 2, 98400),
    ("all_reduce_add_rmsnorm", "twoshot", 65536): (4, 6, 2, 98400),
    ("all_gather", "allgather", 65536): (4, 4, 2, 20576),
    ("reduce_scatter", "reduce_scatter", 65536): (4, 6, 2, 20576),
}
LAMPORT = frozenset({("all_reduce", "lamport")})
TWOSHOTS = frozenset({("all_reduce", "twoshot"), ("all_reduce", "nvls_twoshot")})


@pytest.fixture(scope="module")
def multicast_at_4():
    """The counts at 4 ranks with multicast: one run that the pins and the planner's table share."""
    return _costmodel.run(4, quick=True)


@pytest.fixture(scope="module")
def unicast_at_4():
    return _costmodel.run(4, quick=True, only=UNICAST_PATHS, env={"UBNEXT_EMU_MULTICAST": "0"})


@pytest.fixture(scope="module")
def plain_rows_at_2():
    """The correct build's rows at 2 ranks for the paths the broken builds below change: one run
    that the comparisons share."""
    return _costmodel.run(2, quick=True, only=LAMPORT | TWOSHOTS)


@pytest.fixture(scope="module")
def plain_at_2(plain_rows_at_2):
    return _counts(plain_rows_at_2)


def _counts(rows, measured_only=True):
    return {
        (r["op"], r["path"], r["bytes"]): (r["ctas"], r["hops"], r["fences"], r["max_cta_bytes"])
        for r in rows
        if not (measured_only and r["derived"])
    }


def _assert_pinned(got: dict, want: dict) -> None:
    diff = {k: (got.get(k), v) for k, v in want.items() if got.get(k) != v}
    assert not diff and set(got) == set(want), (
        "critical-path counts changed, (got, pinned) per (op, path, bytes): "
        + json.dumps({" ".join(map(str, k)): v for k, v in diff.items()})
        + f"; unpinned: {sorted(set(got) - set(want))}"
    )


def test_counts_are_pinned_with_multicast(multicast_at_4):
    _assert_pinned(_counts(multicast_at_4), PINNED_MULTICAST)


def test_counts_are_pinned_without_multicast(unicast_at_4):
    _assert_pinned(_counts(unicast_at_4), PINNED_UNICAST)


def _differences_from_the_table(rows, world: int, multicast: bool) -> tuple[list[str], int]:
    """Where measured rows differ from the counts ubnext/plan/_thresholds.py keeps at that world (the counts
    its path orders were derived from), and how many cases both hold."""
    from ubnext.plan import _thresholds
    from ubnext.tuning import _crossovers

    model = _crossovers.model_of(_thresholds.COUNTS, _thresholds.SM_COUNT)
    differ, compared = [], 0
    for r in rows:
        measured = model.counts.get((r["op"], world, multicast, r["path"]), {})
        case = _costmodel.Case(r["op"], r["path"], r["bytes"], r["tokens"])
        if r["derived"] or case not in measured:
            continue
        compared += 1
        launches = measured[case]
        table = (
            max(c["ctas"] for c in launches),
            sum(c["hops"] for c in launches),
            sum(c["fences"] for c in launches),
            max(c["max_cta_bytes"] for c in launches),
            _costmodel.model_us(launches),
        )
        now = (r["ctas"], r["hops"], r["fences"], r["max_cta_bytes"], r["model_us"])
        if table != now:
            differ.append(f"{r['op']} {r['path']} {r['bytes']} multicast {multicast}: table {table}, measured {now}")
    return differ, compared


def test_the_planners_table_holds_todays_counts(multicast_at_4, unicast_at_4):
    """ubnext/plan/_thresholds.py keeps the counts its path orders were derived from: at 4 ranks they
    must be what the kernels count today, in every case both hold, else the orders are stale. (The
    fence test below shows a changed kernel fails this check.)"""
    from ubnext.tuning import _crossovers

    differ, compared = [], 0
    for multicast, rows in ((True, multicast_at_4), (False, unicast_at_4)):
        d, c = _differences_from_the_table(rows, 4, multicast)
        differ, compared = differ + d, compared + c
    assert compared >= 20, compared
    assert not differ, (
        f"ubnext/plan/_thresholds.py is stale (kernel counts changed): regenerate it with "
        f"`{_crossovers.COMMAND}`.\n  " + "\n  ".join(differ)
    )


def test_an_added_fence_raises_the_count(plain_at_2, plain_rows_at_2):
    """UBNEXT_EMU_BREAK=extra_fence adds one fence.acq_rel.sys to the Lamport kernel after its
    pushes: one more fence on the critical path, nothing else moves but the hops, by at most one.
    Since the proxy fence went (issue 24 A) the chain has no fence before the poll, and the added one
    (its stores landing: one hop) overlaps the peers' pushes crossing towards us (one hop too), so the
    hops stay at 1; with the proxy fence before it, it made them 2. The planner's table check sees it:
    the correct build's rows at 2 ranks match the table, the broken build's do not."""
    plain = {k: v for k, v in plain_at_2.items() if k[1] == "lamport"}
    broken_rows = _costmodel.run(2, quick=True, only=LAMPORT, env={"UBNEXT_EMU_BREAK": "extra_fence"})
    broken = _counts(broken_rows)
    assert plain.keys() == broken.keys() and plain
    for key, (ctas, hops, fences, nbytes) in plain.items():
        b_ctas, b_hops, b_fences, b_bytes = broken[key]
        assert (b_ctas, b_fences, b_bytes) == (ctas, fences + 1, nbytes), (key, plain[key], broken[key])
        assert hops <= b_hops <= hops + 1, (key, plain[key], broken[key])
    differ, compared = _differences_from_the_table(plain_rows_at_2, 2, True)
    assert compared and not differ, differ
    differ, compared = _differences_from_the_table(broken_rows, 2, True)
    assert compared and len(differ) == compared, differ


def _calibrated(rows):
    keys = ("t_hops", "l2", "atomics", "waits", "cta_load_bytes", "cta_inflight")
    return {(r["op"], r["path"], r["bytes"]): tuple(r[k] for k in keys) for r in rows if not r["derived"]}


def test_calibrated_counts_do_not_depend_on_scheduling(plain_rows_at_2):
    """Issue 38 item 1's counts (csrc/emu/memory.cpp): the same under chaos mode (other schedules, other
    orders in which the peers' values land) as in the plain run, and the Lamport poll's serialised waits
    there (a poll of every slot, re-loading the outstanding ones on each pass, is one wait: at least one)."""
    chaos = _costmodel.run(
        2, quick=True, only=LAMPORT | TWOSHOTS, env={"UBNEXT_EMU_CHAOS": "1", "UBNEXT_EMU_SEED": "5"}
    )
    plain = _calibrated(plain_rows_at_2)
    assert plain == _calibrated(chaos) and plain
    for key, (t_hops, _l2, _atomics, waits, load, inflight) in plain.items():
        assert t_hops >= 1 and waits >= 1 and 0 < inflight <= load, (key, plain[key])


def test_the_row_splits_cluster_counts_do_not_depend_on_scheduling():
    """Issue 38 item 2: the fused Lamport row split exchanges its partials in distributed shared memory
    with no counter its siblings race for (the global-memory exchange's l2/waits varied by a few between
    runs), so its calibrated counts are the same under chaos mode's other schedules. Its chain at one token
    is pinned: one hop (the push), two local round trips (the rotation's counters, the input), two
    serialised waits (the call header's poll, then the data's, on the header thread; the rotation's
    advance waits beside the data in flight, lamport_rotation.cuh lamport_rot_advance_early), and the
    cluster's own latencies: the partials PUSHED into the siblings (one dsm, a store landing) and ONE
    cluster barrier (norm.cuh: the exchange's opening phase completes long before it is waited for).
    Before this change: 3 waits, 2 dsm (the votes, then the partials, loaded) and 2 cluster barriers."""
    only = frozenset({("all_reduce_add_rmsnorm", "lamport")})
    keys = ("t_hops", "l2", "atomics", "waits", "dsm", "cluster_syncs", "cta_load_bytes", "cta_inflight")
    runs = [
        _costmodel.run(2, quick=True, only=only, env=env)
        for env in (
            {},
            {"UBNEXT_EMU_CHAOS": "1", "UBNEXT_EMU_SEED": "5"},
            {"UBNEXT_EMU_CHAOS": "1", "UBNEXT_EMU_SEED": "6"},
        )
    ]
    counts = [{r["tokens"]: tuple(r[k] for k in keys) for r in rows if not r["derived"]} for rows in runs]
    assert counts[0] and counts[0] == counts[1] == counts[2], counts
    (one,) = [r for r in runs[0] if r["tokens"] == 1 and not r["derived"]]
    chain = tuple(one[k] for k in ("t_hops", "l2", "atomics", "waits", "dsm", "cluster_syncs"))
    assert one["ctas"] == 8 and chain == (1, 2, 0, 2, 1, 1), one


def test_call_header_checks_add_no_hop(plain_at_2):
    """The call check (misuse issue, item 1): with and without it, the same hops and fences on every
    path that carries it. The Lamport header travels beside the data (16 bytes more per peer, in
    block 0); the barrier's header travels with its first signal."""
    for break_name, paths in (("no_lamport_header_check", LAMPORT), ("no_header_check", TWOSHOTS)):
        checked = {k: v for k, v in plain_at_2.items() if k[:2] in paths}
        unchecked = _counts(_costmodel.run(2, quick=True, only=paths, env={"UBNEXT_EMU_BREAK": break_name}))
        assert checked.keys() == unchecked.keys() and checked
        for key in checked:
            assert checked[key][:3] == unchecked[key][:3], (break_name, key, checked[key], unchecked[key])


FUSED = frozenset(("all_reduce_add_rmsnorm", path) for path in ("lamport", "twoshot", "nvls_twoshot", "nvls_lamport"))


def test_eps_check_adds_no_hop_and_no_byte():
    """A fused call's eps (issue 40 W3), compared with and without the check on every fused path: the same
    CTAs, hops, fences and bytes. In the Lamport header it took a word that was 0; beside a barrier header
    it is one 4-byte word per peer, published by block 0 with its first signal: latency the hops count,
    no data byte."""
    checked = _counts(_costmodel.run(2, quick=True, only=FUSED))
    unchecked = _counts(_costmodel.run(2, quick=True, only=FUSED, env={"UBNEXT_EMU_BREAK": "no_eps_check"}))
    assert checked == unchecked and {path for _, path, _ in checked} == {path for _, path in FUSED}, (
        checked,
        unchecked,
    )


def test_bench_model_command():
    """`python -m ubnext.bench --model` as README.md and docs/PERF.md write it, here at 2 ranks and
    the smallest sizes: one JSON object per line, with the keys the issue names, and the planner's
    choice marked once per (op, size)."""
    proc = run_script(f"{sys.executable} -m ubnext.bench --model --world 2 --quick --json", timeout=240)
    assert_mpi_ok(proc)
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    rows = [r for r in lines if "table" not in r and not r["path"].startswith("peer:")]
    # issue 38 item 1: the peer rows and ubnext's rows side by side under the calibrated model (cal_us)
    peers = [r for r in lines if "table" not in r and r["path"].startswith("peer:")]
    assert peers and all(r["cal_us"] > 0 and r["chosen"] is False for r in peers), peers[:2]
    assert all(r["cal_us"] > 0 for r in rows if r["ctas"] is not None), [r for r in rows if r["cal_us"] is None][:2]
    assert any(r.get("table") == "targets" for r in lines)
    assert rows and all(set(r) == set(_costmodel.KEYS) | {"derived"} for r in rows), rows[:2]
    # issue 26: the batch-invariant mode beside the default, per reducing op and size, never on a
    # path that reduces through the switch (the NVLS two-shot paths only in their rank-order form)
    invariant = {(r["op"], r["bytes"]): r for r in lines if r.get("table") == "batch_invariant"}
    assert invariant and all(
        r["mode_path"] in ("lamport", "twoshot", "torch", "nvls_twoshot", "nvls_lamport") for r in invariant.values()
    ), invariant
    assert invariant[("all_reduce", 16384)]["ratio"] == 1.0, invariant[("all_reduce", 16384)]
    chosen: dict = {}
    for r in rows:
        chosen.setdefault((r["op"], r["bytes"]), []).append(r["path"]) if r["chosen"] else None
    assert chosen[("all_reduce", 16384)] == ["lamport"]
    assert all(len(paths) == 1 for (op, _), paths in chosen.items() if op != "quantize"), chosen
    assert all(r["model_us"] > 0 for r in rows if r["ctas"] is not None)


def test_fused_row_split_at_8_ranks():
    """Issue 24 item 2 at its own geometry (8 ranks, bf16, hidden 8192, GPU grids from 132 SMs): the
    fused op at 1 token on the path the planner chooses spreads the row over at least 8 CTAs with 1 hop
    and no more fences than the path's pushes need; at 4 tokens (derived) 4 x 8 CTAs."""
    rows = _costmodel.run(
        8, quick=True, only=frozenset({("all_reduce_add_rmsnorm", "lamport"), (_costmodel.FUSED_NVFP4, "lamport")})
    )
    # issue 28: the NVFP4 form keeps the fused op's targets, in one launch
    nvfp4 = [r for r in rows if r["op"] == _costmodel.FUSED_NVFP4 and r["tokens"] == 1]
    assert (
        len(nvfp4) == 1
        and nvfp4[0]["ctas"] >= 8
        and (nvfp4[0]["hops"], nvfp4[0]["fences"], nvfp4[0]["launches"]) == (1, 0, 1)
    ), nvfp4
    rows = [r for r in rows if r["op"] == "all_reduce_add_rmsnorm"]
    by_tokens = {r["tokens"]: r for r in rows}
    one = by_tokens[1]
    assert one["chosen"] and not one["derived"], one
    assert one["ctas"] >= 8 and one["hops"] == 1, one
    assert by_tokens[4]["ctas"] == 32 and by_tokens[4]["hops"] == 1, by_tokens[4]


def test_fused_nvfp4_counts_at_4_ranks():
    """Issue 28's fused NVFP4 form (swizzled scales) at 1 x 8192 on the Lamport path, 4 ranks: ONE launch,
    the fused kernel quantising its own rows (csrc/device/norm.cuh store_row_out), with the unquantised
    op's counts (the row split over 8 CTAs, 1 hop, no fence) and fewer bytes per CTA than its 36,928
    (q is half a bf16 row). Two launches here would mean the form fell back to the fused op, then
    comm.quantize of its output, which it was before the one-kernel form. 27,264 bytes since the split's
    CTAs have 128 threads (issue 38 item 2; 35,392 at 256): CTA 0's share of the re-poison of the previous
    call's 255 vectors per slot (lamport_rotation.cuh: one vector per thread of the grid) is 128, not 255,
    vectors x 4 slots."""
    rows = _costmodel.run(4, quick=True, only=frozenset({(_costmodel.FUSED_NVFP4, "lamport")}))
    one = [r for r in rows if r["tokens"] == 1 and not r["derived"]]
    assert len(one) == 1, rows
    got = {k: one[0][k] for k in ("ctas", "hops", "fences", "max_cta_bytes", "launches")}
    assert got == {"ctas": 8, "hops": 1, "fences": 0, "max_cta_bytes": 27264, "launches": 1}, got
