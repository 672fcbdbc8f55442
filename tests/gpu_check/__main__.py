"""The one-GPU check's harness: every step in a process of its own, with its own timeout, and
``gpu_check.json`` rewritten after each one, so that a run killed at the device's limit still returns
what finished. ``scripts/gpu_check.sh`` calls this (no install step: the machine's ``python3`` and torch,
the checkout on ``PYTHONPATH``).

    python3 -m tests.gpu_check [--rehearse] [--only STEP[,STEP...]] [--out DIR] [--budget SECONDS]

Output (``--out``, else ``$OUT``, else ``build/gpu_check``): ``gpu_check.json``, one object whose top-level
keys are the steps, and ``gpu_check.log``; a step may add a file of its own (at most 8 files in all come
back from the device). The driver gate's verdict is the first line printed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.gpu_check.common import ROOT, STEPS, log, result, run_bounded, write_json

# Each step's own bound on the device, in seconds: about twice the estimate, so that a slow
# step fails alone instead of eating the next one's time. `kernels` may compile when no cubins are
# carried (nvls.cu is the long pole).
STEP_TIMEOUT_S = {
    "facts": 30,
    "kernels": 240,
    "gpu_tests": 180,
    "world1": 120,
    "loopback": 200,
    "ranks2": 240,
    "timings": 150,
    "probes": 60,
}
# The kernels' wait bound in every step: a lost peer shows in seconds, not in the group's 30 minutes.
STEP_UBNEXT_TIMEOUT_S = "5"
# The rehearsal's sm_90 kernel build before the stub-driver steps (cold on 2 cores: about 40 s)
REHEARSAL_BUILD_TIMEOUT_S = 600
# Steps that talk to the driver directly: in the rehearsal they run against the stub driver. The others
# run without it (the stub cannot share a process with NVRTC, and the emulator needs no driver).
STUB_DRIVER_STEPS = ("kernels", "probes")


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rehearse", action="store_true", help="run on the CPU: the emulator and the stub driver stand in for the GPU"
    )
    parser.add_argument("--only", default="", help=f"comma-separated steps to run (of {', '.join(STEPS)})")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "build" / "gpu_check"))
    parser.add_argument(
        "--budget",
        type=float,
        default=480.0,
        help="seconds for the whole run: a step that cannot get its own bound is skipped",
    )
    args = parser.parse_args(argv)
    args.steps = [s for s in args.only.split(",") if s] or list(STEPS)
    unknown = [s for s in args.steps if s not in STEPS]
    if unknown:
        parser.error(f"unknown step(s) {unknown}; the steps are {', '.join(STEPS)}")
    return args


def _abi_param_sizes() -> str:
    """The collective kernels' parameter sizes in the ABI's order, as STUB_PARAM_SIZES takes them."""
    from ubnext import kernels, pool

    sizes = {"desc": pool.DESC_STRUCT_BYTES, "ptr": 8, "i32": 4, "f32": 4}
    return ",".join(str(sizes[kind]) for _, kind in kernels.KERNEL_SIGNATURE)


def _step_env(
    name: str, args: argparse.Namespace, out: Path, stub_dir: Path | None, timeout_s: float | None = None
) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("UBNEXT_CACHE_DIR", str(ROOT / "build" / "cache"))
    env.update(
        {
            "UBNEXT_TIMEOUT": STEP_UBNEXT_TIMEOUT_S,
            "PYTHONUNBUFFERED": "1",
            "GPU_CHECK_REHEARSE": "1" if args.rehearse else "0",
            "GPU_CHECK_OUT": str(out),
            "GPU_CHECK_STEP_TIMEOUT": str(timeout_s or STEP_TIMEOUT_S[name]),
        }
    )
    if stub_dir is not None:
        env["GPU_CHECK_STUB_DIR"] = str(stub_dir)
        if name in STUB_DRIVER_STEPS:
            env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(stub_dir), env.get("LD_LIBRARY_PATH", "")) if p)
            # the stub answers the ABI's parameter sizes, unless a test asks for a wrong one (and
            # STUB_OCCUPANCY for its occupancy)
            env.setdefault("STUB_PARAM_SIZES", _abi_param_sizes())
    return env


def _run_step(name: str, args: argparse.Namespace, out: Path, stub_dir: Path | None, timeout_s: float) -> dict:
    result_path = out / f".{name}.json"
    result_path.unlink(missing_ok=True)
    start = time.monotonic()
    status, output = run_bounded(
        [sys.executable, "-m", "tests.gpu_check.step", name, str(result_path)],
        timeout_s,
        cwd=ROOT,
        env=_step_env(name, args, out, stub_dir, timeout_s),
    )
    crashed = (
        f"timed out after {timeout_s:g} s"
        if status is None
        else None
        if status == 0
        else f"the step's process exited with status {status}"
    )
    seconds = round(time.monotonic() - start, 1)
    with open(out / "gpu_check.log", "a") as fh:
        fh.write(f"\n===== {name} ({seconds} s)\n{output}")
    if result_path.exists():
        outcome = json.loads(result_path.read_text())
        result_path.unlink()
        if crashed and outcome.get("status") == "pass":
            outcome.update(status="fail", reason=crashed)
    else:
        outcome = result("fail", crashed or "the step wrote no result", output_tail=output[-3000:])
    outcome["seconds"] = seconds
    return outcome


def _driver_verdict(args: argparse.Namespace, out: Path, stub_dir: Path | None) -> str:
    """The driver gate's verdict (``ubnext.runtime._cuda.driver_verdict``), read in a process of its own so that
    this one never touches the driver; the ``facts`` step records it too."""
    code = "from tests.gpu_check.step_facts import verdict; print(verdict())"
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code],
            cwd=ROOT,
            env=_step_env("facts", args, out, stub_dir),
            capture_output=True,
            text=True,
            timeout=60,
        )
    except subprocess.TimeoutExpired:
        return "unknown: reading it took over 60 s"
    lines = proc.stdout.strip().splitlines()
    return lines[-1] if proc.returncode == 0 and lines else f"unknown: {(proc.stderr or proc.stdout)[-300:]}"


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.only:  # a rerun of some steps adds to the first run's log
        (out / "gpu_check.log").write_text("")
    json_path = out / "gpu_check.json"
    stub_dir = None
    if args.rehearse:
        from tests import stub_driver

        stub_dir = stub_driver.build(ROOT / "build" / "stub_driver")
        # the stub driver cannot share a process with NVRTC: the cubins that the `kernels` step loads under
        # it are compiled here first, in a process of their own (from the cache when warm: about a second)
        status, output = run_bounded(
            [sys.executable, "-m", "ubnext.kernels", "build", "--arch", "sm_90"],
            REHEARSAL_BUILD_TIMEOUT_S,
            cwd=ROOT,
            env=_step_env("kernels", args, out, None),
        )
        if status != 0:
            print(f"rehearsal: the sm_90 kernel build failed ({status}):\n{output[-3000:]}", flush=True)
            return 1
    # --only keeps what an earlier run found for the other steps, so that a rerun of the failed steps
    # completes the same file
    print(f"driver gate: {_driver_verdict(args, out, stub_dir)}", flush=True)  # the first thing the check says
    report = json.loads(json_path.read_text()) if args.only and json_path.exists() else {}
    deadline = time.monotonic() + args.budget
    failed = []
    for name in args.steps:
        left = deadline - time.monotonic()
        if left < min(30.0, STEP_TIMEOUT_S[name]):
            report[name] = result("skip", f"out of time: {left:.0f} s of the {args.budget:g} s budget left")
        else:
            log(f"{name}: running (at most {min(STEP_TIMEOUT_S[name], left):.0f} s)")
            report[name] = _run_step(name, args, out, stub_dir, min(STEP_TIMEOUT_S[name], left))
        outcome = report[name]
        print(f"{name}: {outcome['status']}" + (f" ({outcome['reason']})" if outcome.get("reason") else ""), flush=True)
        if outcome["status"] == "fail":
            failed.append(name)
        write_json(json_path, {step: report[step] for step in STEPS if step in report})
    print(f"gpu_check.json: {json_path}" + (f"; failed: {', '.join(failed)}" if failed else "; nothing failed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
