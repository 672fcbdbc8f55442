"""The planner's thresholds come from the calibrated model (issue 24 item D, issue 38): ubnext/plan/_thresholds.py
holds the counts the model measured and the path orders it gave; ubnext/tuning/_crossovers.py says how. Here,
without running ranks: the committed orders are what today's model makes of the committed counts
(else the table is stale, and the failure names the command that regenerates it), the planner
takes, at every sampled size, world and multicast, a path within 5 % of the model's fastest among
those that can run, and the interpolation of unmeasured worlds stands up against a measured one.
tests/mpi/test_costmodel.py checks the committed counts against a fresh measurement at 4 ranks."""

from __future__ import annotations

import itertools

import pytest

from ubnext import plan
from ubnext.plan import _thresholds
from ubnext.tuning import _calibration, _crossovers

MODEL = _crossovers.model_of(_thresholds.COUNTS, _thresholds.SM_COUNT)


def test_the_table_is_what_the_model_makes_of_its_counts():
    why = _crossovers.stale(_thresholds)
    assert why is None, why


def test_a_changed_model_makes_the_table_stale(monkeypatch):
    """The check above can fail: a hop that costs 3 us instead of the calibrated 0.6 reorders the paths, and
    the message says how to regenerate."""
    monkeypatch.setitem(_calibration.HOPPER, "hop_us", _calibration.Const(3.0, "us", "assumed", "a test's"))
    why = _crossovers.stale(_thresholds)
    assert why is not None and _crossovers.COMMAND in why, why


def _slower_than_5_percent(op, elem, multicast, worlds, step=3) -> list:
    """The calls for which plan.choose takes a path modeled more than 5 % slower than the fastest
    one that can run: at every ``step``-th sampled size of each world, for every set of up to two
    kernel paths the call cannot run (Lamport slot or staging region too small, disabled by the
    self-test), nondeterminism allowed or not; torch.distributed at its published figure."""
    fused = elem is not None
    kernel_paths = _crossovers.paths_of(op, multicast)
    largest = _thresholds.MEASURED_WORLDS[-1]
    bad = []
    for world in worlds:
        for nbytes in _crossovers.samples(op, elem)[::step]:
            times = MODEL.times(op, min(world, largest), multicast, nbytes, elem)
            for unable in itertools.chain.from_iterable(itertools.combinations(kernel_paths, k) for k in range(3)):
                view = plan.PoolView(
                    None,
                    multicast,
                    1 << 40,
                    1 << 40,
                    "gpu",
                    False,
                    tuple((p, "a test's") for p in unable),
                    world_size=world,
                )
                for nondet in (False, True) if not fused else (False,):
                    chosen = plan.choose(nbytes, elem or 2, fused, 8192, view, allow_nondeterministic=nondet).path
                    best = min(t for p, t in times.items() if p not in unable and (nondet or p != "nvls_oneshot"))
                    if times[chosen] > 1.05 * best:
                        bad.append((world, nbytes, unable, nondet, chosen, times))
    return bad


@pytest.mark.parametrize("op,elem", _crossovers.VARIANTS)
@pytest.mark.parametrize("multicast", [True, False])
def test_the_planner_takes_the_models_fastest_path_within_5_percent(op, elem, multicast):
    """Every world from 2 to the largest measured one, and twice that (which takes its orders)."""
    largest = _thresholds.MEASURED_WORLDS[-1]
    bad = _slower_than_5_percent(op, elem, multicast, (*range(2, largest + 1), 2 * largest))
    assert not bad, bad[:3]


def test_the_old_fixed_threshold_fails_that_check(monkeypatch):
    """The check above can fail: the rule before the table (Lamport up to 1 MB at every world, then
    the two-shot kernels) takes Lamport for the fused op at 8 ranks where nvls_lamport models
    faster."""
    old = {}
    for key in _thresholds.ORDERS:
        op, elem, world, multicast = key
        nv = ("nvls_twoshot",) if multicast else ()
        old[key] = ((1 << 20, ("lamport", *nv, "twoshot", "torch")), (None, (*nv, "twoshot", "lamport", "torch")))
    monkeypatch.setattr(_thresholds, "ORDERS", old)
    assert _slower_than_5_percent("all_reduce_add_rmsnorm", 2, True, (8,), step=8)


def test_choose_follows_the_order_of_the_calls_world():
    """plan.choose reads the world size from the pool view (every rank's is the same): it takes the
    first path of that world's order, which differs between 2 and 8 ranks at some sizes; a path
    that cannot run is skipped with its reason."""
    views = {w: plan.PoolView(None, True, 1 << 30, 1 << 30, "gpu", False, world_size=w) for w in (2, 8)}
    differ = 0
    for nbytes in (n for n in _crossovers.samples("all_reduce") if n <= 1 << 29):
        firsts = {w: plan.auto_order(nbytes, False, True, False, w)[0] for w in views}
        assert {w: plan.choose(nbytes, 2, False, 0, v).path for w, v in views.items()} == firsts, nbytes
        differ += firsts[2] != firsts[8]
    assert differ, "the table orders every size alike at 2 and 8 ranks"
    no_lamport_slot = plan.PoolView(None, True, 0, 1 << 30, "gpu", False, world_size=8)
    chosen = plan.choose(2048, 2, False, 0, no_lamport_slot)
    first = plan.auto_order(2048, False, True, False, 8)[0]
    if first in ("lamport", "nvls_lamport"):
        assert chosen.path != first and chosen.skipped[0][0] == first and "Lamport slot" in chosen.skipped[0][1]


def test_torch_distributed_is_weighed_by_its_published_figures():
    """NCCL's published times (shared/DESIGN.md section 9, flashinfer#3759) at the sizes they were
    measured; past 2 MB the published bus bandwidth adds the rest; the fused op adds ubnext's norm
    kernel."""
    assert [_crossovers.torch_us("all_reduce", n, 8, True) for n in (2048, 524288, 2097152)] == [16.6, 20.8, 40.0]
    extra = (64 << 20) - (2 << 20)
    assert _crossovers.torch_us("all_reduce", 64 << 20, 8, True) == pytest.approx(
        40.0 + extra * 2 * 7 / 8 / 480e3, abs=0.01
    )
    launch = _calibration.launch_us(_crossovers.LAUNCH_MODE, _calibration._values(_calibration.HOPPER))
    assert _crossovers.torch_us("all_reduce_add_rmsnorm", 2048, 8, True) > 16.6 + launch - 0.01


# Paths whose modeled times step with a CTA's whole rounds of loads (the two-shots' and the NVLS paths' shares
# sit between two worlds' round boundaries at some sizes): the interpolated world may miss the measured one by
# a round; their bounds are the worst misses when the table was made, rounded up. Every other path: 5 %.
ROUND_STEP_TOLERANCE = {
    ("all_reduce", "twoshot"): 0.20,
    ("all_reduce", "nvls_twoshot"): 0.16,
    ("all_reduce_add_rmsnorm", "nvls_lamport"): 0.10,
    ("all_reduce", "nvls_oneshot"): 0.08,
    ("all_reduce_add_rmsnorm", "nvls_twoshot"): 0.08,
}


def test_interpolated_worlds_stand_up_against_a_measured_one():
    """World 4 interpolated from the counts at 2 and 8 against world 4 as measured: every path's modeled
    time within 5 %, or within its ROUND_STEP_TOLERANCE (all under the calibration's own bar, +-25 %), and the
    path the interpolated order puts first within 5 % of the measured model's fastest."""
    inner = [w for w in _thresholds.MEASURED_WORLDS[1:-1]]
    assert inner, "the table measures no world between two others"
    world = inner[0]
    without = {k: v for k, v in MODEL.counts.items() if k[1] != world}
    interpolated = _crossovers.Model(without, MODEL.sm_count)
    assert max(ROUND_STEP_TOLERANCE.values()) < _calibration.BAR_MODEL
    for (op, elem), multicast in itertools.product(_crossovers.VARIANTS, (True, False)):
        for nbytes in _crossovers.samples(op, elem)[::4]:
            measured = MODEL.times(op, world, multicast, nbytes, elem)
            derived = interpolated.times(op, world, multicast, nbytes, elem)
            for p in measured:
                rel = ROUND_STEP_TOLERANCE.get((op, p), 0.05)
                assert derived[p] == pytest.approx(measured[p], rel=rel), (op, multicast, nbytes, p)
            first = _crossovers.ranked(derived)[0]
            assert measured[first] <= 1.05 * min(measured.values()), (op, multicast, nbytes, derived, measured)


def test_forced_nvls_takes_the_model_order_of_the_two_multicast_kernels():
    """UBNEXT_ALGO=nvls: nvls_lamport or nvls_twoshot, whichever the model puts first for the size
    and world, the other where the first cannot run. (Under the calibrated model nvls_lamport leads at
    every size at 8 ranks: 5 hops against 6, the same bytes; nvls_twoshot runs where its slot is too small.)"""
    view = plan.PoolView(None, True, 1 << 30, 1 << 30, "gpu", False, world_size=8)
    seen = set()
    for nbytes in (n for n in _crossovers.samples("all_reduce") if n <= 1 << 29):
        order = [
            p for p in plan.model_order(nbytes, False, True, 8, 2) if p.startswith("nvls_") and p != "nvls_oneshot"
        ]
        assert plan.choose(nbytes, 2, False, 0, view, forced="nvls").path == order[0], nbytes
        disabled = plan.PoolView(None, True, 1 << 30, 1 << 30, "gpu", False, ((order[0], "a test's"),), world_size=8)
        assert plan.choose(nbytes, 2, False, 0, disabled, forced="nvls").path == order[1], nbytes
        seen.add(tuple(order[:2]))
    assert seen == {("nvls_lamport", "nvls_twoshot")}, seen
