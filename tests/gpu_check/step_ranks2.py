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

from tests.gpu_check.common import ROOT, Context, figure, result, run_bounded

# tests/mpi/worker.py's cases that need no multicast and no second GPU
GPU_CASES = ("allreduce", "paths", "fused", "fused_paths", "fp8", "rotation", "pool", "bad_input", "misaligned",
             "fp8_nan", "divergent", "uneven_history", "header_race", "timeout", "selftest", "all_gather",
             "reduce_scatter", "quantize_fp8", "quantize_blocks", "fused_quant", "batch_invariant", "threads",
             "streams", "cuda_graph", "close_live")
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
        env.update(CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0],
                   UBNEXT_POOL_BACKEND="vmm")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(WORKER), mode, *cases]
    status, output = run_bounded(command, ctx.timeout_s - 10, cwd=ROOT, env=env)
    passed = re.findall(rf"{mode} (\w+): ok \(([\d.]+) s\)", output)
    seconds = {name: float(s) for name, s in passed}
    figures = {"cases_passed": figure(len(seconds), "cases", "tests/mpi/worker.py's 'ok' lines, rank 0")}
    missing = [c for c in cases if c not in seconds]
    if status != 0 or missing:
        why = f"ran past {ctx.timeout_s - 10:g} s" if status is None else f"exit status {status}"
        return result("fail", f"{why}; not ok: {', '.join(missing) or 'none'}",
                      cases=list(cases), seconds=seconds, figures=figures, output_tail=output[-4000:])
    return result("pass", mode=mode, cases=list(cases), seconds=seconds, figures=figures,
                  note=("time-sliced processes on one GPU: correctness, not speed" if not ctx.rehearse else
                        "rehearsal: emulator ranks without multicast, a shorter case list"))
