"""The real csrc kernels on the CPU emulator, ranks as processes under mpirun, in normal and
chaos mode; and deliberately broken protocol builds, which these same tests must catch."""

import pytest

from tests.conftest import MPI_WORKER, assert_mpi_ok

FULL = [
    "allreduce",
    "auto",
    "paths",
    "fused",
    "fused_paths",
    "fp8",
    "rotation",
    "long_runs",
    "traffic",
    "pool",
    "bad_input",
    "timeout",
    "linear",
    "compile",
    "pool_cycles",
    "kernel_failure",
    "misaligned",
    "misaligned_unstaged",
    "divergent",
    "fp8_nan",
    "uneven_history",
    "header_race",
    "late_rank",
    "captured_sizes",
    "selftest",
    "in_place_past_staging",
    "linear_dense",
    "tp_checkpoint",
    "all_gather",
    "reduce_scatter",
    "quantize_fp8",
    "quantize_blocks",
    "fsdp",
    "fsdp_fp8",
    "exchange_compile",
    "mismatch",
    "mismatch_exchange",
    "misuse",
    "departed",
    "close_after_peer_left",
    "exchange_grad",
    "local_first",
    "setup_absent",
    "pool_gc_skew",
    "fsdp_steady",
    "fused_past_pool",
    "fused_arithmetic",
    # issue 28: the fused block-scaled forms, bitwise quantize of the unquantised call's output
    "fused_quant",
    # issue 25 (FSDP2 for real runs): checkpoints, any shard size, torchao's float8 training (2 ranks)
    "fsdp_checkpoint",
    "fsdp_odd_shards",
    "fsdp_torchao",
    # issue 24 E: nvls_twoshot straight into a pool `out`
    "nvls_twoshot_into_out",
    # issue 26: the batch-invariant mode (at 2 ranks a sum of two is order-free: 3 and 4 show the order)
    "batch_invariant",
    "batch_invariant_fused",
    # issue 38 item 2: the row split's cluster reduction in the fixed order
    "cluster_order",
    # issue 24 item C: griddepcontrol placed in every kernel (the emulator checks the wait)
    "pdl",
    # issue 40 H3 and C3: settings agreed at set-up; a bad environment on one rank stops its peers too
    "setup_settings",
    "bad_environment_peer",
]
CORE = [
    "allreduce",
    "paths",
    "fused_paths",
    "fused_arithmetic",
    "fp8",
    "rotation",
    "traffic",
    "timeout",
    "linear",
    "misaligned",
    "divergent",
    "subgroups",
    "linear_dense",
    "tp_checkpoint",
    "all_gather",
    "reduce_scatter",
    "quantize_fp8",
    "fsdp",
    "fsdp_fp8",
    "mismatch",
    "mismatch_exchange",
    "departed",
    "setup_absent",
    "pool_gc_skew",
    "fsdp_steady",
    # issue 25: checkpoints, any shard size, HSDP and FSDP x TP=2 (these two need 4 ranks)
    "fsdp_checkpoint",
    "fsdp_odd_shards",
    "hsdp",
    "fsdp_tp",
    "batch_invariant",
    "batch_invariant_fused",
    "fused_quant",
]
CHAOS = [
    "allreduce",
    "paths",
    "fused_paths",
    "rotation",
    "long_runs",
    "divergent",
    "header_race",
    "all_gather",
    "reduce_scatter",
    "fsdp",
    "nvls_twoshot_into_out",
]
# issue 26: nvls_lamport's push form under chaos where it runs and its rank order shows (multicast, 4 ranks)
CHAOS_NP4 = CHAOS + ["batch_invariant"]
# without a multicast address: unicast Lamport push, unicast two-shot and its barrier
UNICAST = [
    "allreduce",
    "auto",
    "paths",
    "fused_paths",
    "fused_arithmetic",
    "traffic",
    "rotation",
    "long_runs",
    "timeout",
    "misaligned",
    "divergent",
    "fp8_nan",
    "late_rank",
    "captured_sizes",
    "selftest",
    "in_place_past_staging",
    "all_gather",
    "reduce_scatter",
    "mismatch",
    "mismatch_exchange",
    "departed",
    # issue 25 at 3 ranks: shards that are not whole vectors, FP8 rows that do not divide among the ranks
    "fsdp_odd_shards",
    "fsdp_fp8_uneven",
    "cluster_order",
    "batch_invariant",
    "batch_invariant_fused",
    "pdl",
]


@pytest.mark.mpi
@pytest.mark.parametrize(
    "np,chaos,multicast,cases",
    [
        (2, "0", "1", FULL),
        (4, "0", "1", CORE),
        (3, "0", "0", UNICAST),
        (2, "1", "1", CHAOS),
        (4, "1", "1", CHAOS_NP4),
        (3, "1", "0", CHAOS),
    ],
    ids=["np2", "np4", "np3-unicast", "np2-chaos", "np4-chaos", "np3-unicast-chaos"],
)
def test_kernels_on_emulator(mpi, np, chaos, multicast, cases):
    # UBNEXT_EMULATE: the group's own communicator (ubnext.nn layers, ubnext.get_communicator)
    # emulates too, not only the ones the cases construct
    env = {"UBNEXT_EMU_CHAOS": chaos, "UBNEXT_EMU_MULTICAST": multicast, "UBNEXT_EMULATE": "1"}
    assert_mpi_ok(mpi(np, MPI_WORKER, "emulator", *cases, env=env, timeout=900))


@pytest.mark.mpi
@pytest.mark.parametrize("name,bad", [("UBNEXT_EMU_BLOCK", "48"), ("UBNEXT_POOL_BACKEND", "bogus")])
def test_bad_environment_on_one_rank_stops_every_rank(mpi, name, bad):
    """Issue 40 C3: before the rendezvous, only rank 1's value is bad; every rank raises EnvError naming it,
    within seconds (it was an EnvError on rank 1 and a gloo connect failure on rank 0)."""
    proc = mpi(2, MPI_WORKER.parent / "bad_environment.py", name, bad, env={"UBNEXT_EMULATE": "1"}, timeout=60)
    assert_mpi_ok(proc)
    assert "ok 0" in proc.stdout and "ok 1" in proc.stdout, proc.stdout + proc.stderr


# Each deliberately broken build (csrc, behind a test-only macro) must make a protocol test
# fail with a wrong or diverging result, not pass and not crash the emulator.
BROKEN = {
    "skip_repoison": ["rotation"],  # Lamport buffer not re-poisoned: stale data read as ready
    "no_release": ["paths"],  # barrier signal without release: flag overtakes the data
    "skip_barrier": ["paths"],  # two-shot barrier does not wait: peers read half-written data
    "no_header_check": ["divergent"],  # call headers not compared: differing offsets reduce wrong memory
    "single_header_slot": ["header_race"],  # one header slot: a rank a call ahead overwrites it
    "no_abort_check": ["late_rank"],  # nobody reads the abort flag: the late rank completes or times out alone
    # the one proxy fence left (issue 24 A), one break per site: chaos mode hands the storing thread the
    # bytes from before its multicast store, and the fused two-shot's row phase reads them
    "no_proxy_fence_nvls_twoshot": ["fused_paths"],
    "twoshot_drop_peer": ["reduce_scatter"],  # the shared rank-order sum leaves a rank out
    "allgather_short_push": ["all_gather"],  # a shard's last word never reaches the peers
    "no_lamport_header_check": ["mismatch"],  # Lamport pushes call headers but never compares them
    "no_eps_check": ["mismatch"],  # a fused call's eps pushed but never compared: each rank returns its own norm
    "no_departure_check": ["departed"],  # a departed peer is waited for until the timeout
    "ssq_block_order": [
        "fused_arithmetic"
    ],  # the norm's sum of squares in block order: bits change with the block size
    "two_roundings": ["fused_arithmetic"],  # two-shot fused paths round s before the residual add
    # the row split's cluster folds each CTA's groups first (FlashInfer's order): the bits follow the split
    "cluster_ssq_order": ["cluster_order"],
    # a two-shot portion summed N-1..0: the batch-invariant mode's rank-order reference catches it
    "twoshot_reverse_order": ["batch_invariant"],
    # the plain NVLS two-shot paths ignore the mode's rank-order flag and ld_reduce (chaos: in a random order)
    "rank_order_ignored": ["batch_invariant"],
    # lamport_poll.cuh's poll_slots re-polls only the slot it names and judges the others on their first load
    # (issue 38 item 2): a late peer's share is summed as the sentinel's zeros (3+ ranks: two peers late at once)
    "poll_reads_once": ["allreduce", "rotation"],
    # layouts rather than protocols (comm.quantize, csrc/device/blockscale.cuh): the bitwise comparison
    # with the reference must see them
    # the odd element of a byte in the low nibble; the swizzled scales' tile rows in plain order. fused_quant
    # first (CAUGHT_AS pins its message): the fused forms catch them too, the worker stopping at the first failure
    "nvfp4_nibble_order": ["fused_quant", "quantize_blocks"],
    "swizzle": ["fused_quant", "quantize_blocks"],
}
# a sum of two is the same in either order: a break of the order shows from 3 ranks
BROKEN_NP = {"twoshot_reverse_order": 3, "rank_order_ignored": 3, "poll_reads_once": 3}
# breaks whose catch must be a timeout that names the op and what it waited for
CAUGHT_AS = {
    "nvfp4_nibble_order": "nvfp4 1x8192 torch.bfloat16 swizzled=True ue8m0=False global_scale=True: q vs the "
    "reference differs",
    # one row's swizzled scales sit where plain order puts them: the 7-row shape shows the break
    "swizzle": "nvfp4 7x1040 torch.bfloat16 swizzled=True ue8m0=False global_scale=True: scales vs the "
    "reference differs",
}
# A violation is caught as a wrong result (AssertionError) or a lost peer (UbnextTimeoutError). Three
# breaks also show as a call header read wrong: their cases make the same call on every rank, so a
# mismatch error means the protocol delivered a header the peer never sent for this call: read from the
# peer's next call (single_header_slot), before it arrived because the flag overtook it (no_release:
# "rank 1 with op/dtype/flags (0, ...)"), or left from an earlier call in a buffer nobody re-poisoned
# (skip_repoison, since the Lamport slot carries a header: "rank 1 with element count 8"). Which form a
# run takes depends on timing; runs that saw only the mismatch failed this test before it was accepted
# for them.
CAUGHT = ("AssertionError", "UbnextTimeoutError")
CAUGHT_AS_MISMATCH = {"single_header_slot", "no_release", "skip_repoison"}
# header_race's calls in the broken runs: a rank gets a call ahead of its peer only now and then, and
# 200 calls missed it in about 1 run in 25
RACE_CALLS = "2000"


@pytest.mark.mpi
@pytest.mark.parametrize("break_name", sorted(BROKEN))
def test_broken_protocol_is_caught(mpi, break_name):
    # without the self-test, which would disable some broken paths before the tests reach them
    proc = mpi(
        BROKEN_NP.get(break_name, 2),
        MPI_WORKER,
        "emulator",
        *BROKEN[break_name],
        env={
            "UBNEXT_EMU_BREAK": break_name,
            "UBNEXT_EMU_CHAOS": "1",
            "UBNEXT_TIMEOUT": "5",
            "UBNEXT_SELFTEST": "0",
            "UBNEXT_TEST_RACE_CALLS": RACE_CALLS,
        },
        timeout=600,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, f"the {break_name} build passed the tests that should catch it:\n{output[-3000:]}"
    # the broken library itself must have run: not refused by envs, not replaced by torch.distributed
    assert "EnvError" not in output and "kernels unavailable" not in output, output[-4000:]
    caught = any(marker in output for marker in CAUGHT) or (
        break_name in CAUGHT_AS_MISMATCH and "with different arguments" in output
    )
    assert caught, (
        f"the {break_name} build failed for another reason than a caught protocol violation:\n{output[-4000:]}"
    )
    if break_name in CAUGHT_AS:
        assert CAUGHT_AS[break_name] in output, output[-4000:]


@pytest.mark.mpi
@pytest.mark.parametrize("np", [2, 3])
def test_selftest_disables_a_broken_path(mpi, np):
    """A kernel that gives wrong sums (the test-only twoshot_drop_peer build) is found by the
    self-test at preparation and disabled on every rank: the calls still get right sums."""
    assert_mpi_ok(
        mpi(
            np,
            MPI_WORKER,
            "emulator",
            "selftest",
            env={"UBNEXT_EMU_BREAK": "twoshot_drop_peer", "UBNEXT_EMU_MULTICAST": "0"},
            timeout=600,
        )
    )
