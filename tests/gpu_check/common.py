"""What every step of the one-GPU check shares: its context, and the shape of its results.

A step is a module ``tests/gpu_check/step_<name>.py`` with ``run(ctx: Context) -> dict``. It runs in
a process of its own (``python -m tests.gpu_check.step <name>``), so that a step that crashes, hangs
or poisons the CUDA context costs that step only. Its result is one JSON object:

- ``status``: ``pass``, ``fail`` or ``skip``; ``reason`` whenever it is not ``pass``;
- ``figures``: name -> ``figure(...)`` (a value with its unit and its method) or ``skipped(...)``;
- anything else the step finds worth keeping (test outcomes, per-kernel rows), plain JSON.

``Context.rehearse`` is true for ``scripts/gpu_check.sh --rehearse``: the same steps on the CPU,
against the emulator and the stub driver (tests/stub_driver). A step says what it cannot do there
with ``skipped(reason)``; the rehearsal test (tests/mpi/test_gpu_check_rehearsal.py) lists by name
every step and figure that may skip, so that a new skip fails it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
STEPS = ("facts", "kernels", "gpu_tests", "world1", "loopback", "ranks2", "timings", "probes")


@dataclasses.dataclass
class Context:
    rehearse: bool  # on the CPU: the emulator and the stub driver stand in for the GPU
    out: Path  # where the step may leave a file (at most 8 files come back from the device)
    timeout_s: float  # this step's own bound; its subprocesses get less
    stub_dir: Path | None = None  # rehearse: the folder holding the stub libcuda.so.1
    result_path: Path | None = None  # where the step's result goes (tests/gpu_check/step.py)

    def save_partial(self, outcome: dict) -> None:
        """Write what a long step has so far: if it is killed at its bound, the harness keeps this
        (marked ``fail`` with the cause) instead of losing everything."""
        if self.result_path is not None:
            write_json(self.result_path, outcome)

    @classmethod
    def from_env(cls) -> Context:
        stub = os.environ.get("GPU_CHECK_STUB_DIR")
        return cls(
            rehearse=os.environ.get("GPU_CHECK_REHEARSE") == "1",
            out=Path(os.environ.get("GPU_CHECK_OUT", ROOT / "build" / "gpu_check")),
            timeout_s=float(os.environ.get("GPU_CHECK_STEP_TIMEOUT", "120")),
            stub_dir=Path(stub) if stub else None,
        )


def figure(value: Any, unit: str, method: str, **extra: Any) -> dict:
    """One measured or read value: every figure names its unit and how it was obtained."""
    return {"value": value, "unit": unit, "method": method, **extra}


def skipped(reason: str) -> dict:
    """A figure (or a step) that was not obtained here, and why."""
    return {"status": "skip", "reason": reason}


def result(status: str, reason: str | None = None, **fields: Any) -> dict:
    out: dict[str, Any] = {"status": status}
    if reason is not None:
        out["reason"] = reason
    out.update(fields)
    return out


def verdict(checks: dict[str, str | None]) -> tuple[str, str | None]:
    """``pass`` when every check is None (no problem), else ``fail`` with the problems joined."""
    problems = [f"{name}: {why}" for name, why in checks.items() if why]
    return ("fail", "; ".join(problems)) if problems else ("pass", None)


def crash_result(exc: BaseException) -> dict:
    """A step that raised: ``fail``, with the exception and the end of its traceback."""
    tail = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)[-6:])
    return result("fail", f"{type(exc).__name__}: {exc}", traceback=tail[-3000:])


def write_json(path: Path, obj: Any) -> None:
    """Atomically: a run killed mid-write still leaves the last whole file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=False, default=str) + "\n")
    tmp.replace(path)


def log(message: str) -> None:
    print(f"[gpu_check] {message}", file=sys.stderr, flush=True)


def run_bounded(command: list[str], timeout_s: float, **kwargs) -> tuple[int | None, str]:
    """Run ``command`` in a session of its own; past ``timeout_s`` kill its whole process group (torchrun's
    workers, pytest's children, the program under compute-sanitizer), so nothing outlives the step on the
    GPU. Returns (exit status, or None when killed; stdout and stderr together)."""
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, **kwargs
    )
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, output
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return None, output
