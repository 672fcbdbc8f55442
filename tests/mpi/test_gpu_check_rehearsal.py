"""The one-GPU check's rehearsal (issue 36): ``scripts/gpu_check.sh --rehearse`` runs the whole harness on
the CPU (the emulator, the stub driver), as CI runs it, and cannot pass vacuously:

- ``facts``, ``kernels``, ``world1`` and ``ranks2`` must pass;
- a step or a figure may skip only where this file names it, with (part of) its reason, so that a new
  skip fails here;
- every figure that was obtained names its unit and its method;
- the ``kernels`` step fails when the stub driver reports a wrong parameter size, or no room for one CTA
  per SM.

It reuses the suite's kernel build (the cubin cache) and emulator build; on its own, warm, the whole
rehearsal takes about 25 s on the 2-core machine, and each faulty ``kernels`` run about 5 s.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT

MUST_PASS = ("facts", "kernels", "world1", "ranks2")
# step -> what its rehearsal reason says
STEP_SKIPS = {
    "gpu_tests": "every GPU test skipped",
    "loopback": "the emulator runs one launch at a time per process",
}
# (step, figure) -> what its reason says
FIGURE_SKIPS = {
    **{("facts", name): "no GPU" for name in ("driver_cuda", "device", "arch", "sm_count", "gpu_count", "driver")},
    ("facts", "torch_cuda"): "CPU build",
    # timings: what only CUDA events, PDL and graphs can time
    **{
        ("timings", f"chain_us.pdl_{pdl}.event_{event}.{stream}_stream.{mode}"): "no GPU"
        for pdl in ("on", "off")
        for event in ("on", "off")
        for stream in ("default", "side")
        for mode in ("eager", "graph")
    },
    **{("timings", f"chain_pdl_gain_kept.{stream}_stream"): "no GPU" for stream in ("default", "side")},
    **{
        ("timings", f"graph_vs_eager.{op}.{kind}"): "no GPU"
        for op in ("all_reduce", "all_reduce_add_rmsnorm")
        for kind in ("eager_us", "eager_queued_us", "graph_us")
    },
    **{
        ("timings", f"local_gbps.{op}.{against}"): "no GPU"
        for op in ("quantize_nvfp4", "quantize_mxfp8", "quantize_fp8_group128", "quantize_fp8", "add_rmsnorm")
        for against in ("ubnext", "d2d_copy", "torch")
    },
    **{
        ("timings", f"dependent_chains.{chain}"): "no GPU to time it on"
        for chain in ("ld_relaxed_sys_v4", "ld_volatile_v4", "atom_add_acq_rel_gpu")
    },
    ("timings", "dependent_chains.dsmem_ld_and_barrier_cluster"): "no clusters yet",
    # probes: what neither torch's CPU build nor the stub driver stands in for
    ("probes", "mig.torch"): "torch is a CPU build",
    ("probes", "mig.nvidia_smi"): "NVML",
}


def _rehearse(
    out: Path, *args: str, env: dict | None = None, timeout: float = 400
) -> tuple[subprocess.CompletedProcess, dict]:
    full_env = dict(os.environ, OUT=str(out), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **(env or {}))
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--rehearse", *args],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    report_path = out / "gpu_check.json"
    assert report_path.exists(), f"no gpu_check.json:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc, json.loads(report_path.read_text())


def _figures(step: dict):
    yield from (step.get("figures") or {}).items()


def test_the_rehearsal_passes_and_every_skip_is_named(tmp_path):
    proc, report = _rehearse(tmp_path)
    from tests.gpu_check.common import STEPS

    assert list(report) == list(STEPS), f"steps in gpu_check.json: {list(report)}"
    assert proc.stdout.splitlines()[0].startswith("driver gate: no GPU"), proc.stdout[:500]
    for name in MUST_PASS:
        assert report[name]["status"] == "pass", f"{name}: {json.dumps(report[name])[:3000]}"
    for name, step in report.items():
        if step["status"] == "skip":
            assert name in STEP_SKIPS, f"a new skip: step {name}: {step.get('reason')}"
            assert STEP_SKIPS[name] in step["reason"], f"{name}'s reason changed: {step['reason']}"
        else:
            assert step["status"] == "pass", f"{name}: {json.dumps(step)[:3000]}"
        for figure_name, value in _figures(step):
            if value.get("status") == "skip":
                expected = FIGURE_SKIPS.get((name, figure_name))
                assert expected is not None, f"a new skipped figure: {name}.{figure_name}: {value['reason']}"
                assert expected in value["reason"], f"{name}.{figure_name}'s reason changed: {value['reason']}"
            else:
                assert {"value", "unit", "method"} <= set(value), (
                    f"{name}.{figure_name} lacks its unit or method: {value}"
                )
    assert report["world1"]["figures"]["cases"]["value"] >= 190, "world1 ran fewer cases than every unicast path needs"
    named = {(step, fig) for step, fig in FIGURE_SKIPS}
    seen = {
        (name, fig) for name, step in report.items() for fig, value in _figures(step) if value.get("status") == "skip"
    }
    assert seen == named, f"skips named here but not seen (stale names): {sorted(named - seen)}"
    files = [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")]
    assert len(files) <= 8, f"more files than the device returns: {files}"


# the stub driver's answers for the whole program (tests/stub_driver/stub_libcuda.c, cuInit): the descriptor
# one u64 short of the ABI's 256 bytes; no CTA fits on an SM
FAULTS = {"param_size": {"STUB_PARAM_SIZES": "248,8,8,8,8,8,8,8,4,4,4,4"}, "occupancy": {"STUB_OCCUPANCY": "0"}}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_the_kernels_step_fails_on_a_wrong_parameter_size_or_no_room(tmp_path, fault):
    proc, report = _rehearse(tmp_path, "--only", "kernels", env=FAULTS[fault], timeout=200)
    step = report["kernels"]
    assert step["status"] == "fail", json.dumps(step)[:2000]
    expected = "parameter" if fault == "param_size" else "occupancy"
    assert expected in step["reason"], step["reason"]
