"""``facts``: what machine and toolchain the check ran on, the driver gate's verdict first.

Versions are read from the packages themselves (NVRTC through ``nvrtcVersion``, the driver through
``cuDriverGetVersion``), never assumed: the device image's versions are unknown until read."""

from __future__ import annotations

import datetime
import importlib.metadata
import platform
import subprocess

from tests.gpu_check.common import Context, figure, result, skipped


def _package_version(name: str) -> dict:
    try:
        return figure(importlib.metadata.version(name), "version", "importlib.metadata")
    except importlib.metadata.PackageNotFoundError:
        return skipped(f"{name} is not installed")


def verdict() -> str:
    """The driver gate's verdict (issue 36 R8), as ``python -m ubnext.info`` says it first."""
    from ubnext import kernels
    from ubnext.runtime import _cuda

    return _cuda.driver_verdict(kernels.nvrtc_version)


def run(ctx: Context) -> dict:
    import torch

    from ubnext import kernels
    from ubnext.runtime import _cuda

    gate = verdict()
    figures = {
        "torch": figure(torch.__version__, "version", "torch.__version__"),
        "torch_cuda": figure(torch.version.cuda, "version", "torch.version.cuda")
        if torch.version.cuda
        else skipped("torch is a CPU build"),
        "python": figure(platform.python_version(), "version", "platform.python_version"),
        "cuda_bindings": _package_version("cuda-bindings"),
        "cuda_core": _package_version("cuda-core"),
        "nvidia_cuda_nvrtc": _package_version("nvidia-cuda-nvrtc"),
        "nvrtc": figure(kernels.nvrtc_version(), "version", "cuda.bindings.nvrtc.nvrtcVersion"),
    }
    if _cuda.gpu_available():
        figures["driver_cuda"] = figure(
            _cuda.format_cuda_version(_cuda.driver_version()), "CUDA version", "cuDriverGetVersion"
        )
        props = torch.cuda.get_device_properties(0)
        figures["device"] = figure(props.name, "name", "torch.cuda.get_device_properties")
        figures["arch"] = figure(_cuda.device_arch(0), "sm", "cuda.core Device.compute_capability")
        figures["sm_count"] = figure(props.multi_processor_count, "SMs", "torch.cuda.get_device_properties")
        figures["gpu_count"] = figure(torch.cuda.device_count(), "GPUs", "torch.cuda.device_count")
        try:
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            )
            figures["driver"] = figure(smi.stdout.strip(), "version", "nvidia-smi --query-gpu=driver_version")
        except (OSError, subprocess.TimeoutExpired) as exc:
            figures["driver"] = skipped(f"nvidia-smi: {exc}")
    else:
        why = f"no GPU ({_cuda.no_gpu_reason()})"
        for name in ("driver_cuda", "device", "arch", "sm_count", "gpu_count", "driver"):
            figures[name] = skipped(why)
    return result(
        "pass",
        verdict=gate,
        rehearsal=ctx.rehearse,
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        host=platform.node(),
        figures=figures,
    )
