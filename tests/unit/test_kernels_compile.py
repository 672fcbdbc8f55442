"""The Lamport kernels and the shared device headers compile everywhere they must, without a GPU:
NVRTC for sm_90 / sm_100 without register spills (the protocol's latency assumes none), g++ as
emulator host code with warnings on, and each deliberately broken test-only build."""

import shutil
import subprocess

import pytest

from ubnext import kernels

LAMPORT = kernels.CSRC / "kernels" / "lamport.cu"


def _gxx(*defines: str) -> subprocess.CompletedProcess:
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ not found")
    cuda_inc = kernels.cuda_include_dir()
    cmd = [
        gxx,
        "-std=c++20",
        "-fsyntax-only",
        "-Wall",
        "-Wextra",
        "-Werror",
        "-Wno-unknown-pragmas",
        "-DUBNEXT_EMULATOR",
        *[f"-D{d}" for d in defines],
        "-x",
        "c++",
        f"-I{kernels.CSRC}",
        f"-I{cuda_inc}",
        f"-I{kernels.CSRC / 'emu' / 'shim'}",
        str(LAMPORT),
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    "defines", [(), ("UBNEXT_BREAK_SKIP_REPOISON",), ("UBNEXT_BREAK_NO_RELEASE",), ("UBNEXT_STAMPS",)]
)  # the per-phase stamps (stamps.cuh)
def test_lamport_compiles_as_emulator_host_code(defines):
    proc = _gxx(*defines)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.parametrize("arch", ["sm_90", "sm_100"])
def test_lamport_cubin_has_no_spills(arch):
    """From the cubin cache when this tree's kernels were built (the suite's first step), else
    compiled now: ptxas's resources of each dtype's kernel."""
    try:
        _, resources = kernels.compile_kernels("lamport.cu", arch)
    except ImportError:
        pytest.skip("cuda-bindings (NVRTC) not installed")
    assert sorted(r.name for r in resources) == sorted(kernels.sources()["lamport.cu"]), resources
    assert all(r.spill_stores == 0 and r.spill_loads == 0 for r in resources), resources


def test_nvrtc_writes_only_into_writable_buffers(monkeypatch):
    """NVRTC fills the buffers it is handed; an immutable bytes (b" " * 1 is CPython's shared b" ")
    would be corrupted for the whole process. A fake NVRTC writes as the C library does, through the
    buffer protocol, which refuses read-only memory."""
    cuda_bindings = pytest.importorskip("cuda.bindings")

    class FakeNvrtc:
        def __getattr__(self, name):
            outputs = {"nvrtcGetProgramLog": b"\0", "nvrtcGetPTX": b".version 8.0\0", "nvrtcGetCUBIN": b"\x7fELF"}
            sizes = {"nvrtcGetProgramLogSize": 1, "nvrtcGetPTXSize": 13, "nvrtcGetCUBINSize": 4}
            if name in outputs:

                def fill(prog, buf, data=outputs[name]):
                    memoryview(buf)[: len(data)] = data
                    return (0,)

                return fill
            if name in sizes:
                return lambda prog, size=sizes[name]: (0, size)
            return {
                "nvrtcCreateProgram": lambda *a: (0, object()),
                "nvrtcCompileProgram": lambda *a: (0,),
                "nvrtcDestroyProgram": lambda prog: (0,),
            }[name]

    monkeypatch.setattr(cuda_bindings, "nvrtc", FakeNvrtc(), raising=False)
    assert kernels._nvrtc_compile("lamport.cu", "sm_90", "ptx") == (b".version 8.0\0", "")
    assert kernels._nvrtc_compile("lamport.cu", "sm_90", "cubin") == (b"\x7fELF", "")
    assert bytes([0x20])[0] == 0x20
