"""The watchdog and Ctrl-C on a job whose ranks made different calls (issue 40 H3, H4;
tests/mpi/watchdog.py): each rank names what it waits in and its peers' last calls after
UBNEXT_WARN_AFTER, and one SIGINT to the job's process group ends every rank within 2 s."""

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "watchdog.py"
TIMEOUT_S = 120  # UBNEXT_TIMEOUT: without the abort on Ctrl-C, the ranks would wait this long
SIGINT_BOUND_S = 2.0  # the bound from the Ctrl-C to the job's end


@pytest.mark.mpi
def test_the_watchdog_names_the_calls_and_one_ctrl_c_ends_the_job():
    mpirun = shutil.which("mpirun", path=str(Path(sys.executable).parent)) or shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("mpirun not found")
    env = dict(
        os.environ,
        UBNEXT_EMULATE="1",
        UBNEXT_TIMEOUT=str(TIMEOUT_S),
        UBNEXT_WARN_AFTER="1",
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
    )
    proc = subprocess.Popen(
        [mpirun, "-np", "2", sys.executable, str(SCRIPT)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while sum("ubnext watchdog: rank" in line for line in lines) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        warned = [line for line in lines if "ubnext watchdog: rank" in line]
        assert len(warned) == 2, "".join(lines[-60:])
        sent = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # what a Ctrl-C in the terminal does
        proc.wait(timeout=30)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    reader.join(timeout=5)
    out = "".join(lines)
    # what each rank waits in, and its peer's last call, read from the store
    zero = next(line for line in warned if "rank 0 has waited" in line)
    one = next(line for line in warned if "rank 1 has waited" in line)
    assert "path lamport" in zero.split("its peers")[0] and "1024 elements" in zero.split("its peers")[0], zero
    assert re.search(r"rank 1: call #\d+ \(path (?!lamport)\w+, kernel \w+, 786432 elements", zero), zero
    assert "786432 elements" in one.split("its peers")[0], one
    assert re.search(r"rank 0: call #\d+ \(path lamport, kernel \w+, 1024 elements", one), one
    # one Ctrl-C: every rank says where it waited and stops, and the job ends within the bound
    for rank in (0, 1):
        assert re.search(rf"ubnext rank {rank}: Ctrl-C while waiting in call #\d+", out), out[-4000:]
        assert f"rank {rank} interrupted after" in out, out[-4000:]
    assert took < SIGINT_BOUND_S, f"the job ended {took:.2f} s after the Ctrl-C (bound {SIGINT_BOUND_S} s)"
