"""Shared test helpers: start ranks under mpirun with a hard timeout."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MPI_WORKER = ROOT / "tests" / "mpi" / "worker.py"


def run_mpi(
    np: int,
    script: Path | str,
    *args: str,
    env: dict | None = None,
    timeout: float = 240,
    cwd: Path | str | None = None,
) -> subprocess.CompletedProcess:
    """Run ``script`` on ``np`` ranks; a hung job is killed after ``timeout`` seconds."""
    mpirun = shutil.which("mpirun", path=str(Path(sys.executable).parent)) or shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("mpirun not found (pip install mpich)")
    full_env = dict(os.environ)
    full_env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    if os.geteuid() == 0:  # Open MPI refuses root without both words (a container's only user is root)
        full_env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
    full_env.update(env or {})
    cmd = [mpirun, "-np", str(np), sys.executable, str(script), *args]
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=full_env, start_new_session=True, cwd=cwd
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(
            f"mpirun -np {np} {script} {' '.join(args)} hung for {timeout} s:\n"
            f"{(exc.stdout or b'')[-4000:]!r}\n{(exc.stderr or b'')[-4000:]!r}"
        ) from None
    return proc


def run_torchrun(
    np: int,
    script: Path | str,
    *args: str,
    env: dict | None = None,
    timeout: float = 240,
    cwd: Path | str | None = None,
) -> subprocess.CompletedProcess:
    """Run ``script`` on ``np`` local ranks under torchrun (the rendezvous store binds a port the
    kernel picks: --standalone)."""
    full_env = dict(os.environ)
    full_env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    full_env.update(env or {})
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(np),
            str(script),
            *args,
        ],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        cwd=cwd,
    )


def run_script(command: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``command`` through bash from the checkout, as a user types it (the scripts set up and use
    .venv themselves). A hung command is killed with its whole process group (the mpirun jobs a
    script starts too) after ``timeout`` seconds."""
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **(env or {}))
    proc = subprocess.Popen(
        ["bash", "-c", command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=full_env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{command} hung for {timeout} s:\n{out[-4000:]}\n{err[-4000:]}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def assert_mpi_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, (
        f"exit code {proc.returncode}\nstdout:\n{proc.stdout[-6000:]}\nstderr:\n{proc.stderr[-6000:]}"
    )


@pytest.fixture
def mpi():
    return run_mpi
