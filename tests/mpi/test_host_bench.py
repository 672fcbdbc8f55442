"""The benchmark scripts run as README.md and docs/PERF.md write them: `scripts/host_bench.sh` (the
host time per call with a recorder in place of the launch, then with the launch into the stub
driver, each row asserting that every timed call launched a kernel: the bench's own check) and
`UBNEXT_EMULATE=1 UBNEXT_BENCH_NP=2 scripts/bench.sh --host`; and the bench refuses a driver that
is not the stub. This checks that the scripts work, not their figures."""

from __future__ import annotations

from tests.conftest import assert_mpi_ok, run_script

ROWS = (
    "comm.all_reduce ",
    "comm.all_reduce_add_rmsnorm ",
    "torch.ops.ubnext.all_reduce_add_rmsnorm ",
    "ubnext.all_reduce ",
    "ubnext.ops.all_reduce ",
    "nn.Linear forward",
)
ENV = {"UBNEXT_EMULATE": "1", "UBNEXT_SELFTEST": "0"}


def _rows_present(stdout: str, times: int) -> None:
    for row in ROWS:
        found = sum(line.startswith(row) for line in stdout.splitlines())
        assert found == times, f"row {row!r} {found} times, want {times}:\n{stdout}"


def test_host_bench_script():
    # short runs; the script builds the stub driver and the sm_90 kernels it needs
    proc = run_script("scripts/host_bench.sh --calls 50")
    assert_mpi_ok(proc)
    assert "launching through cuLaunchKernelEx into the stub driver" in proc.stdout
    _rows_present(proc.stdout, 2)  # the recorder's run, then the stub driver's


def test_launch_bench_script():
    """`scripts/launch_bench.sh` (docs/PERF.md's launch timing) runs, short: every row present, each with
    the driver calls one launch makes against the stub (the bench checks that each row's launch reached
    the driver with the twelve values), and cuda.core's row the reference of the ratio column."""
    proc = run_script("scripts/launch_bench.sh --calls 50 --rounds 7")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {line[:46].strip(): line[46:].split() for line in proc.stdout.splitlines() if not line.startswith("#")}
    calls = {
        "cuda.core launch": "1",
        "cuda.core launch with the stream's lookup": "1",
        "_cuda.launch, config made once": "3",
    }
    calls |= {"_cuda.launch with launch_config's lookup": "3", "_cuda.launch through the public calls": "3"}
    assert {name: rows[name][0] for name in calls} == calls, proc.stdout
    assert rows["cuda.core launch"][-1] == "1.000", proc.stdout


def test_bench_script_host_mode_as_the_readme_writes_it():
    proc = run_script("scripts/bench.sh --host --calls 50", env={"UBNEXT_EMULATE": "1", "UBNEXT_BENCH_NP": "2"})
    assert_mpi_ok(proc)
    _rows_present(proc.stdout, 1)


def test_bench_script():
    """`scripts/bench.sh` (4 ranks; here the emulator's rows and gloo's), on one small size: one row
    per mode and path at 8192 bytes, each within its error bound (the last column)."""
    proc = run_script("scripts/bench.sh --sizes 8k")
    assert_mpi_ok(proc)
    assert "ranks=4" in proc.stdout, proc.stdout
    rows = [line.split() for line in proc.stdout.splitlines() if line and not line.startswith(("#", "mode"))]
    assert rows and all(row[2] == "8192" and row[-1] == "True" for row in rows), proc.stdout
    assert {row[0] for row in rows} >= {"cpu-emulator", "torch.distributed"}, proc.stdout


def test_host_bench_refuses_a_driver_that_is_not_the_stub(mpi):
    proc = mpi(1, "-m", "ubnext.bench", "--host", "--launch", "driver", env=ENV, timeout=120)
    assert proc.returncode != 0 and "needs the stub driver as libcuda.so.1" in proc.stderr + proc.stdout


def test_fsdp_step_bench_runs_as_gpu_check_runs_it():
    """`scripts/fsdp_step_bench.py` (gpu_check.sh times an FSDP2 step with NCCL, torch's
    symmetric-memory staging and ubnext's collectives, each in its own processes): here on the
    emulator and gloo, small, as a check that the script runs, never as timings."""
    from tests.conftest import MPI_WORKER  # noqa: F401  (the mpi tier's conventions: mpirun on PATH)

    small = "--hidden 64 --layers 2 --tokens 8 --steps 2"
    for mode, env in (("ubnext", {"UBNEXT_EMULATE": "1"}), ("gloo", {})):
        proc = run_script(f"mpirun -np 2 python scripts/fsdp_step_bench.py --mode {mode} {small}", env=env)
        assert_mpi_ok(proc)
        line = [text for text in proc.stdout.splitlines() if text.startswith("fsdp_step ")]
        assert len(line) == 1 and f"mode={mode} ranks=2" in line[0], proc.stdout[-2000:]
        assert (
            ("path=reduce_scatter" in line[0] or "path=allgather" in line[0])
            if mode == "ubnext"
            else "path=-" in line[0]
        )
