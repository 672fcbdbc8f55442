"""The kernels and the shared device headers compile everywhere they must, without a GPU: NVRTC for
sm_90 / sm_100 without register spills or any stack frame (the protocol's latency assumes neither), g++
as emulator host code with warnings on, and each deliberately broken test-only build."""

import shutil
import subprocess

import pytest

from ubnext import kernels
from ubnext.kernels import _ptxas

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
@pytest.mark.parametrize("fname", sorted(kernels.sources()))
def test_cubin_has_no_spills_and_no_stack_frame(fname, arch):
    """From the cubin cache when this tree's kernels were built (the suite's first step), else
    compiled now: ptxas's resources of each kernel, judged as ``--fail-on-spill`` judges them."""
    try:
        _, resources = kernels.compile_kernels(fname, arch)
    except ImportError:
        pytest.skip("cuda-bindings (NVRTC) not installed")
    assert sorted(r.name for r in resources) == sorted(kernels.sources()[fname]), resources
    assert _ptxas.frame_problems(resources) == []


@pytest.mark.parametrize("arch", ["sm_90"])
def test_frame_check_catches_a_descriptor_copied_to_the_stack(arch):
    """barrier.cuh's sync_words not inlined (UBNEXT_TEST_DESC_NOINLINE, a compile check only): with the
    descriptor __grid_constant__ its pointer is the parameter's own address, no frame; without
    (UBNEXT_BREAK_DESC_COPY) every thread copies the 256-byte descriptor to its stack, which the check
    names. allgather.cu: the smallest kernel file that reaches the helper. sm_90 only: for sm_100, NVRTC
    13.5 passes the parameter's own address even without the attribute (no copy, no frame), so there is
    nothing for the check to catch."""
    pytest.importorskip("cuda.bindings")

    def problems(*defines):
        _, log = kernels._nvrtc_images("allgather.cu", arch, ("cubin",), defines)
        resources = _ptxas.parse_ptxas_log(log, arch)
        assert [r.name for r in resources] == ["ubnext_allgather_u8"], log
        return resources, _ptxas.frame_problems(resources)

    assert problems("UBNEXT_TEST_DESC_NOINLINE")[1] == []
    resources, found = problems("UBNEXT_TEST_DESC_NOINLINE", "UBNEXT_BREAK_DESC_COPY")
    assert resources[0].stack_bytes >= 256, resources  # sizeof(ubnext_comm_desc)
    assert len(found) == 1 and found[0].startswith(f"ubnext_allgather_u8 ({arch}): "), found


def test_a_called_functions_figures_are_not_the_kernels():
    """ptxas lists a function that is not inlined after the kernels, with its own (here empty) frame: the
    kernel keeps its 256-byte frame (the parser once overwrote it with the function's 0)."""
    log = """ptxas info    : Compiling entry function 'ubnext_allgather_u8' for 'sm_90'
ptxas info    : Function properties for ubnext_allgather_u8
ptxas         .     256 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 64 registers, used 1 barriers, 256 bytes cumulative stack size, 4 bytes smem
ptxas info    : Function properties for _ZN3ubx10sync_wordsEPK16ubnext_comm_descj
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads"""
    (r,) = _ptxas.parse_ptxas_log(log, "sm_90")
    assert (r.name, r.registers, r.stack_bytes, r.shared_bytes) == ("ubnext_allgather_u8", 64, 256, 4)
    # a kernel whose own frame is empty but whose callee's is not: the cumulative size counts it
    log = log.replace("256 bytes stack frame", "0 bytes stack frame").replace("64 registers", "40 registers")
    (r,) = _ptxas.parse_ptxas_log(log, "sm_90")
    assert r.stack_bytes == 256 and _ptxas.frame_problems([r]) != []


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
