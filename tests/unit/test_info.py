"""python -m ubnext.info: runs here (no GPU) and says so; with a faked GPU and driver it reports
the devices, the driver problem and the one-visible-GPU fallback. Its first line is the driver's
verdict (issue 36 R8): OK, PROBLEM (an old driver) or no GPU."""

import os
import subprocess
import sys

import pytest
import torch

from ubnext import info
from ubnext.runtime import _cuda


def test_runs_here_and_says_there_is_no_gpu():
    env = dict(os.environ, UBNEXT_EMULATE="0", CUDA_VISIBLE_DEVICES="")  # no GPU, also on a GPU node
    proc = subprocess.run(
        [sys.executable, "-W", "error", "-m", "ubnext.info", "--world-size", "4", "--no-build"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.splitlines()[0].startswith("no GPU: "), f"the first line is not the verdict:\n{out}"
    for needle in (
        "torch ",
        "NVRTC",
        "no GPU:",
        "What runs instead",
        "pool backend",
        "sm_90:",
        "sm_100:",
        "emulator",
        "paths for 4 ranks",
    ):
        assert needle in out, f"{needle!r} missing:\n{out}"
    rows = [
        line.split()
        for line in out.splitlines()
        if line.strip().endswith(("lamport", "twoshot", "torch", "torch_symm"))
    ]
    sizes = [" ".join(r[:2]) for r in rows]
    assert sizes == ["8 KB", "64 KB", "256 KB", "1 MB", "4 MB", "16 MB", "64 MB"], out
    assert all(r[2] == "torch" for r in rows), "without a GPU or emulation every size takes torch here"
    assert rows[0][4] == "lamport", "an 8 KB message takes Lamport on GPUs"


def test_emulated_paths(monkeypatch):
    monkeypatch.setenv("UBNEXT_EMULATE", "1")
    out = info.report(4, 8192, build_emulator=False)
    assert "pool backend     emulator" in out
    assert "UBNEXT_EMULATE=1, so the ubnext kernels run on the CPU emulator" in out, out
    assert "every ubnext op falls back" not in out, out
    row = next(line for line in out.splitlines() if line.strip().startswith("8 KB"))
    assert row.split()[2:4] == ["lamport", "lamport"], row


def _fake_gpu(monkeypatch, driver_cuda: int):
    """One H100 as the probe, the driver and NVRTC 13 would report it."""
    monkeypatch.setenv("UBNEXT_EMULATE", "0")
    monkeypatch.setattr(_cuda, "_probe", (True, "1 CUDA device(s)"))  # what gpu_available() reads, everywhere
    monkeypatch.setattr(_cuda, "driver_version", lambda: driver_cuda)
    monkeypatch.setattr(info.kernels, "nvrtc_version", lambda: "13.0")
    monkeypatch.setattr(
        info,
        "gpus",
        lambda: [
            {"index": 0, "name": "NVIDIA H100 80GB HBM3", "arch": "sm_90", "sms": 132, "multicast": True, "peers": []}
        ],
    )


def test_fake_gpu_with_old_driver(monkeypatch):
    _fake_gpu(monkeypatch, 12080)
    out = info.report(8, 8192, build_emulator=False)
    verdict = out.splitlines()[0]
    assert verdict.startswith("driver PROBLEM: the NVIDIA driver supports CUDA 12.8") and "R580" in verdict, out
    assert "torch.distributed (NCCL)" in verdict, verdict
    assert "[0] NVIDIA H100 80GB HBM3 sm_90, 132 SMs, multicast yes" in out
    assert "  driver         supports CUDA 12.8" in out
    assert "only one GPU is visible" in out
    assert "sm_90: " in out and "sm_100: " not in out


def test_fake_gpu_with_a_good_driver(monkeypatch):
    _fake_gpu(monkeypatch, 13000)
    out = info.report(8, 8192, build_emulator=False)
    assert out.splitlines()[0] == "driver OK: CUDA 13.0 driver loads NVRTC 13 cubins", out
    assert "PROBLEM" not in out, out


def test_no_gpu_verdict_comes_first(monkeypatch):
    monkeypatch.setenv("UBNEXT_EMULATE", "0")
    monkeypatch.setattr(_cuda, "_probe", (False, "torch sees no CUDA device"))
    out = info.report(4, 8192, build_emulator=False)
    assert out.splitlines()[0] == "no GPU: torch sees no CUDA device", out


def test_a_driver_that_cannot_be_read_is_said_so(monkeypatch):
    _fake_gpu(monkeypatch, 13000)

    def no_nvrtc():
        raise ImportError("libnvrtc.so.13: cannot open shared object file")

    monkeypatch.setattr(info.kernels, "nvrtc_version", no_nvrtc)
    verdict = _cuda.driver_verdict(info.kernels.nvrtc_version)
    assert verdict == "driver unchecked: ImportError: libnvrtc.so.13: cannot open shared object file", verdict


@pytest.mark.skipif(torch.version.cuda is not None, reason="the README sample shows a CPU build of torch")
def test_readme_sample_is_what_info_prints():
    """README.md's sample is info's real output (scripts/readme_info_sample.py regenerates it): a
    change to info's report, or a sample edited by hand, fails here with the diff."""
    import importlib.util

    from tests.conftest import ROOT

    spec = importlib.util.spec_from_file_location("readme_info_sample", ROOT / "scripts" / "readme_info_sample.py")
    sample = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sample)
    assert sample.main(["--check"]) == 0
    # the check itself can fail: a sample with one word changed is caught
    edited = sample.readme_sample().replace("pool backend     none", "pool backend     vmm")
    assert sample.comparable(edited) != sample.comparable(sample.generate())
