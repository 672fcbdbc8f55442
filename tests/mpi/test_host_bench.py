"""python -m ubnext.bench --host runs as docs/PERF.md and scripts/host_bench.sh run it: with a
recorder in place of the launch, and with the launch into the stub driver, each row asserting that
every timed call launched a kernel (the bench's own check); and it refuses a driver that is not the
stub. Short runs: this checks that the bench works, not its figures."""

from __future__ import annotations

import os

from tests import stub_driver
from tests.conftest import assert_mpi_ok

ROWS = ("comm.all_reduce ", "comm.all_reduce_add_rmsnorm ", "torch.ops.ubnext.all_reduce_add_rmsnorm ",
        "nn.Linear forward")
ENV = {"UBNEXT_EMULATE": "1", "UBNEXT_SELFTEST": "0"}


def _rows_present(stdout: str) -> None:
    for row in ROWS:
        assert any(line.startswith(row) for line in stdout.splitlines()), f"no row {row!r}:\n{stdout}"


def test_host_bench_with_the_recorder(mpi):
    proc = mpi(2, "-m", "ubnext.bench", "--host", "--calls", "50", env=ENV, timeout=300)
    assert_mpi_ok(proc)
    _rows_present(proc.stdout)


def test_host_bench_launching_into_the_stub_driver(mpi, tmp_path):
    # the kernels for the stub's sm_90 are compiled by scripts/test.sh's first step (NVRTC cannot
    # run beside the stub); the bench refuses with the command to run if they are not
    stub = stub_driver.build(tmp_path / "stub")
    env = dict(ENV, LD_LIBRARY_PATH=f"{stub}:{os.environ.get('LD_LIBRARY_PATH', '')}")
    proc = mpi(2, "-m", "ubnext.bench", "--host", "--launch", "driver", "--calls", "50", env=env, timeout=300)
    assert_mpi_ok(proc)
    assert "launching through cuda.core into the stub driver" in proc.stdout
    _rows_present(proc.stdout)


def test_host_bench_refuses_a_driver_that_is_not_the_stub(mpi):
    proc = mpi(1, "-m", "ubnext.bench", "--host", "--launch", "driver", env=ENV, timeout=120)
    assert proc.returncode != 0 and "needs the stub driver as libcuda.so.1" in proc.stderr + proc.stdout
