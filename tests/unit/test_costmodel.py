"""The critical-path model's arithmetic (ubnext/tuning/_costmodel.py), without running ranks: the modeled
time of a launch, the derivation of large sizes from a measured one, and the planner's mark. The
counts themselves are pinned by tests/mpi/test_costmodel.py."""

from __future__ import annotations

import pytest

from ubnext.comm._executor import GPU_BLOCK, GRID_CAP, clusters_fit_pair, gpu_max_blocks, launch_geometry, row_cluster
from ubnext.tuning import _costmodel as M
from ubnext.tuning import _invariant


def _launch(**kw):
    base = {
        "kernel": "k",
        "ctas": 4,
        "block": 256,
        "hops": 0,
        "fences": 0,
        "max_cta_bytes": 0,
        "total_bytes": 0,
        "nvlink_bytes": 0,
        "multicast_bytes": 0,
    }
    return base | kw


def test_model_time_is_launch_plus_hops_plus_the_slowest_bandwidth_term():
    one_hop = _launch(hops=1)
    assert M.model_us([one_hop]) == pytest.approx(M.LAUNCH_US.value + M.HOP_US.value, abs=0.01)
    # 1 MB through one CTA: the per-SM term dominates HBM's and NVLink's
    per_cta = _launch(hops=2, max_cta_bytes=1 << 20, total_bytes=1 << 20, nvlink_bytes=1 << 20)
    want = M.LAUNCH_US.value + 2 * M.HOP_US.value + (1 << 20) / (M.SM_GBPS.value * 1e3)
    assert M.model_us([per_cta]) == pytest.approx(want, abs=0.01)
    # two launches run one after the other
    assert M.model_us([one_hop, one_hop]) == pytest.approx(2 * M.model_us([one_hop]), abs=0.02)


def test_every_constant_names_its_source():
    for name, c in M.CONSTANTS.items():
        assert c.value > 0 and len(c.source) > 20, name


def test_large_sizes_are_derived_from_the_largest_measured_size_of_their_path():
    small = M.Case("all_reduce", "twoshot", 65536)
    smaller = M.Case("all_reduce", "twoshot", 16384)
    grid0 = launch_geometry("twoshot", small.nbytes // 2, 2, 0, False, 8, GPU_BLOCK, GRID_CAP)[0]
    measured = {
        smaller: [_launch(ctas=1, hops=6, fences=4, max_cta_bytes=100, total_bytes=100)],
        small: [_launch(ctas=grid0, hops=6, fences=4, max_cta_bytes=1000, total_bytes=4000, nvlink_bytes=800)],
    }
    big = M.Case("all_reduce", "twoshot", 64 << 20)
    (d,) = M.derive(measured, big, 8, 132)
    ratio = big.nbytes / small.nbytes
    cap = gpu_max_blocks("twoshot", GRID_CAP, 8, False)  # half the SMs: it waits on its peers' blocks
    grid = launch_geometry("twoshot", big.nbytes // 2, 2, 0, False, 8, GPU_BLOCK, cap)[0]
    assert grid == cap == GRID_CAP // 2 == d["ctas"]
    assert (d["hops"], d["fences"]) == (6, 4)
    assert d["total_bytes"] == 4000 * ratio and d["nvlink_bytes"] == 800 * ratio
    assert d["max_cta_bytes"] == round(1000 * ratio * grid0 / grid)
    assert M.derive(measured, M.Case("all_reduce", "lamport", 1 << 20), 8, 132) is None


def test_the_planner_mark_follows_the_default_pool():
    """The mark is the planner's rule: the first path of the model's order at that world
    (ubnext/plan/_thresholds.py) that the default pool can run, torch.distributed past the staging region."""
    from ubnext import plan

    for world in (2, 8):
        for fused in (False, True):
            op = "all_reduce_add_rmsnorm" if fused else "all_reduce"
            assert (
                M.chosen_path(M.Case(op, "lamport", 16384, 1), world)
                == plan.auto_order(16384, fused, True, False, world)[0]
            ), (world, fused)
    assert M.chosen_path(M.Case("all_reduce", "lamport", 64 << 20, 4096), 8) == "torch"  # past the staging region


def test_quantize_at_64_mb_takes_the_grid_its_work_needs():
    """Issue 24 item F: one scale over 64 MB (bf16) runs at least 64 CTAs; so do rows. The model's
    grid is the Executor's rule for this local kernel (no residency cap): 4096 CTAs each, as many as
    a 64 KB measurement derives from (each CTA then moves what one measured CTA moved)."""
    for mode in M.QUANTIZE_MODES:
        case = M.Case("quantize", mode, 64 << 20, (64 << 20) // (2 * M.HIDDEN))
        assert M.grid_of(case, 8, 132) == 4096, mode
    # below ONE_CTA_BYTES one scale is one row: one CTA, its amax a block reduction
    assert M.grid_of(M.Case("quantize", "tensor", 65536, 4), 8, 132) == 1


def test_fused_lamport_rows_split_over_free_sms():
    """The Lamport fused launch at few tokens (csrc/device/norm.cuh's row split): a cluster of 8 CTAs of 128
    threads a row at hidden 8192 bf16 while the SMs allow (one vector per thread), fewer as the rows take the
    SMs, at most 8 (a portable cluster: fp32's 2048 vectors too), one CTA a row of 256 threads once the SMs
    run out and for per-token FP8; the other paths one CTA a row."""
    n = 8192

    def geometry(algo, tokens, elem=2, **kw):
        return launch_geometry(algo, tokens * n, elem, tokens, True, 8, GPU_BLOCK, 128, **kw)

    assert [geometry("lamport", t)[0] for t in (1, 2, 16, 32, 64, 128)] == [8, 16, 128, 128, 128, 128]
    assert [row_cluster("lamport", t, geometry("lamport", t)[0]) for t in (1, 16, 32, 64, 128)] == [8, 8, 4, 2, 1]
    assert geometry("lamport", 1) == (8, 128) and geometry("lamport", 128) == (128, GPU_BLOCK)
    assert geometry("lamport", 1, elem=4) == (8, 128)
    assert geometry("lamport", 1, split_rows=False) == (1, GPU_BLOCK)
    assert geometry("twoshot", 1)[0] == geometry("nvls_lamport", 1)[0] == 1
    assert row_cluster("twoshot", 1, 1) == row_cluster("lamport", 0, 64) == 1
    # the cluster rule between communicators (launch_rules.h pair_clusters_fit): twice the clusters fit
    assert clusters_fit_pair(8, 16) and not clusters_fit_pair(9, 17) and not clusters_fit_pair(1, 0)
    assert launch_geometry("lamport", 512, 2, 1, True, 8, GPU_BLOCK, 128)[0] == 1  # 64 vectors: < 2 x 128


def test_the_modes_plain_nvls_rows_are_timed_by_their_rank_order_form():
    """Issue 26: where the batch-invariant mode runs a plain allreduce on an NVLS two-shot path, its
    time is that of the path's own measured form (/ro: unicast rank-order sums), never the default's
    multimem.ld_reduce row of the same name; the fused op's rows sum so in both modes."""

    def row(op, path, nbytes, us, chosen=False):
        return {
            "op": op,
            "path": path,
            "bytes": nbytes,
            "tokens": nbytes // (2 * M.HIDDEN),
            "world": 8,
            "model_us": us,
            "chosen": chosen,
        }

    mb = 1 << 20
    assert M.chosen_path(M.Case("all_reduce", "nvls_lamport", mb, 64), 8) == "nvls_lamport"
    rows = [
        row("all_reduce", "nvls_lamport", mb, 6.0, chosen=True),
        row("all_reduce", "nvls_lamport" + M.RANK_ORDER_SUFFIX, mb, 7.5),
        row("all_reduce_add_rmsnorm", "nvls_lamport", mb, 7.0, chosen=True),
    ]
    plain, fused = _invariant.invariant_rows(rows)
    assert (plain["mode_path"], plain["mode_us"], plain["ratio"]) == ("nvls_lamport", 7.5, 1.25), plain
    assert (fused["mode_path"], fused["mode_us"], fused["ratio"]) == ("nvls_lamport", 7.0, 1.0), fused
    # the flagged two-shot sums by unicast loads: the unicast two-shot's grid, not NCCL's 2 CTAs at 8 ranks
    big = (M.Case("all_reduce", "nvls_twoshot", 4 * mb, 256), M.Case("all_reduce", "nvls_twoshot", 4 * mb, 256, True))
    assert (
        M.grid_of(big[0], 8, 132) == 2
        and M.grid_of(big[1], 8, 132) == M.grid_of(M.Case("all_reduce", "twoshot", 4 * mb, 256), 8, 132) == 64
    )
