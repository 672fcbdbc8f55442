"""``ranks2``: two ranks as processes on the one GPU (torchrun, ``CUDA_VISIBLE_DEVICES=0``, the VMM pool,
gloo), running the worker cases of the mpi tier that need no multicast. The two processes' kernels are
time-sliced on one GPU: this proves correctness across processes (the fd exchange, the mappings, the
kernels' cross-process memory ordering), not speed.

In the rehearsal the same torchrun job runs on the emulator without multicast, a shorter list (the mpi
tier runs every case on the emulator already): it proves the harness's launch and reading."""

from __future__ import annotations

import os
import re
import sys
import time

from tests.gpu_check.common import ROOT, Context, figure, result, run_bounded

# tests/mpi/worker.py's cases that need no multicast and no second GPU
GPU_CASES = (
    "allreduce",
    "paths",
    "fused",
    "fused_paths",
    "fp8",
    "rotation",
    "pool",
    "bad_input",
    "misaligned",
    "fp8_nan",
    "divergent",
    "uneven_history",
    "header_race",
    "timeout",
    "selftest",
    "all_gather",
    "reduce_scatter",
    "quantize_fp8",
    "quantize_blocks",
    "fused_quant",
    "batch_invariant",
    "threads",
    "streams",
    "cuda_graph",
    "close_live",
)
REHEARSAL_CASES = ("allreduce", "fused", "all_gather", "reduce_scatter")
WORKER = ROOT / "tests" / "mpi" / "worker.py"


def run(ctx: Context) -> dict:
    cases = REHEARSAL_CASES if ctx.rehearse else GPU_CASES
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if ctx.rehearse:
        mode = "emulator"
        env.update(UBNEXT_EMU_MULTICAST="0")
    else:
        mode = "gpu"
        env.update(
            CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0], UBNEXT_POOL_BACKEND="vmm"
        )
    # One torchrun job runs the cases in order and stops at the first that fails; the cases after it
    # then run in a job of their own, so that one failure does not hide the others' verdicts.
    seconds: dict[str, float] = {}
    failures: dict[str, str] = {}
    remaining = list(cases)
    deadline = time.monotonic() + ctx.timeout_s - 10
    while remaining:
        left = deadline - time.monotonic()
        if left < 15:
            break
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(WORKER),
            mode,
            *remaining,
        ]
        status, output = run_bounded(command, left, cwd=ROOT, env=env)
        seconds.update({name: float(s) for name, s in re.findall(rf"{mode} (\w+): ok \(([\d.]+) s\)", output)})
        if status == 0:
            break
        failed = next((c for c in remaining if c not in seconds), None)
        if failed is None:
            failures["(after the last case)"] = output[-3000:]
            break
        why = f"ran past {left:.0f} s" if status is None else f"exit status {status}"
        failures[failed] = f"{why}: {output[-3000:]}"
        remaining = remaining[remaining.index(failed) + 1 :]
    figures = {"cases_passed": figure(len(seconds), "cases", "tests/mpi/worker.py's 'ok' lines, rank 0")}
    missing = [c for c in cases if c not in seconds]
    if failures or missing:
        return result(
            "fail",
            f"failed: {', '.join(failures) or 'none'}; not run: "
            f"{', '.join(c for c in missing if c not in failures) or 'none'}",
            cases=list(cases),
            seconds=seconds,
            figures=figures,
            failures=failures,
        )
    return result(
        "pass",
        mode=mode,
        cases=list(cases),
        seconds=seconds,
        figures=figures,
        note=(
            "time-sliced processes on one GPU: correctness, not speed"
            if not ctx.rehearse
            else "rehearsal: emulator ranks without multicast, a shorter case list"
        ),
    )
