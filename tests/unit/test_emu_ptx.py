"""csrc/device/ptx.cuh: every wrapper compiles with NVRTC to a cubin (so ptxas accepts the inline
PTX) for sm_90 and sm_100, emits exactly the instruction it names, and compiles for sm_80 with the
multicast wrappers reduced to traps. No GPU needed."""

from __future__ import annotations

import pytest

from ubnext import kernels

CALLS = r"""
#include "device/ptx.cuh"
extern "C" __global__ void ptx_probe(uint32_t* f, uint4* d, void* mc, uint32_t* err, uint64_t* t) {
  uint4 a = ubx::ld_volatile_v4(d);
  a.x += ubx::ld_volatile_u32(f);
  uint4 b = ubx::ld_relaxed_sys_v4(d + 1);
  a.y += ubx::ld_acquire_sys_u32(f + 1);
  ubx::st_volatile_v4(d + 2, a);
  ubx::st_relaxed_sys_v4(d + 3, b);
  ubx::st_relaxed_sys_u32(f + 2, 1);
  ubx::st_release_sys_u32(f + 3, 2);
  ubx::st_relaxed_sys_u16(reinterpret_cast<uint16_t*>(f + 6), 3);
  b.w += ubx::ld_plain_v4(d + 4).x;
  ubx::fence_proxy_alias();
  ubx::red_release_sys_add_u32(f + 4, 1);
  a.z = ubx::atom_add_acq_rel_gpu_u32(f + 5, 1);
  a.w = ubx::atom_cas_relaxed_sys_u32(err, 0, 1);
  ubx::fence_acq_rel_sys();
  ubx::fence_acq_rel_gpu();
  uint4 c = ubx::multimem_ld_reduce_bf16x8(mc);
  uint4 e = ubx::multimem_ld_reduce_f16x8((char*)mc + 16);
  uint4 g = ubx::multimem_ld_reduce_f32x4((char*)mc + 32);
  ubx::multimem_st_v4((char*)mc + 48, c);
  ubx::multimem_st_v4((char*)mc + 64, e);
  ubx::multimem_st_v4((char*)mc + 80, g);
  ubx::multimem_st_release_u32((uint32_t*)mc + 32, 1);
  ubx::multimem_st_relaxed_u32((uint32_t*)mc + 34, 1);
  ubx::multimem_red_release_add_u32((uint32_t*)mc + 33, 1);
  ubx::spin_pause();
  *t = ubx::globaltimer_ns();
  d[5] = a;
}
"""

INSTRUCTIONS = [
    "ld.volatile.global.v4.u32",
    "ld.volatile.global.u32",
    "ld.relaxed.sys.global.v4.u32",
    "ld.acquire.sys.global.u32",
    "st.volatile.global.v4.u32",
    "st.relaxed.sys.global.v4.u32",
    "st.relaxed.sys.global.u32",
    "st.release.sys.global.u32",
    "st.relaxed.sys.global.u16",
    "fence.proxy.alias",
    "red.release.sys.global.add.u32",
    "atom.acq_rel.gpu.global.add.u32",
    "atom.relaxed.sys.cas.b32",
    "fence.acq_rel.sys",
    "fence.acq_rel.gpu",
    "multimem.ld_reduce.relaxed.sys.global.add.acc::f32.v4.bf16x2",
    "multimem.ld_reduce.relaxed.sys.global.add.acc::f32.v4.f16x2",
    "multimem.ld_reduce.relaxed.sys.global.add.v4.f32",
    "multimem.st.relaxed.sys.global.v4.f32",
    "multimem.st.release.sys.global.u32",
    "multimem.st.relaxed.sys.global.u32",
    "multimem.red.release.sys.global.add.u32",
    "%globaltimer",
    "nanosleep.u32",
]


def _compile(arch: str, want: str) -> str:
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc")
    try:
        include = kernels.cuda_include_dir()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    prog = nvrtc.nvrtcCreateProgram(CALLS.encode(), b"ptx_probe.cu", 0, [], [])[1]
    try:
        opts = [
            f"--gpu-architecture={arch}".encode(),
            f"-I{kernels.CSRC}".encode(),
            f"-I{include}".encode(),
            b"-std=c++17",
        ]
        (status,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        size = nvrtc.nvrtcGetProgramLogSize(prog)[1]
        # writable buffers: NVRTC writing into b" " * 1 (an empty log) overwrites CPython's shared
        # b" " for the rest of the process (see ubnext.kernels._nvrtc_compile)
        log = bytearray(size)
        nvrtc.nvrtcGetProgramLog(prog, log)
        assert status == nvrtc.nvrtcResult.NVRTC_SUCCESS, log.decode(errors="replace")
        if want == "cubin":
            assert nvrtc.nvrtcGetCUBINSize(prog)[1] > 0
            return ""
        size = nvrtc.nvrtcGetPTXSize(prog)[1]
        ptx = bytearray(size)
        nvrtc.nvrtcGetPTX(prog, ptx)
        return ptx.rstrip(b"\x00 ").decode()
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


@pytest.mark.parametrize("arch", ["sm_90", "sm_100"])
def test_every_wrapper_emits_its_instruction(arch):
    ptx = _compile(arch, "ptx")
    missing = [i for i in INSTRUCTIONS if i not in ptx]
    assert not missing, f"{arch}: instructions missing from the PTX: {missing}"
    _compile(arch, "cubin")  # ptxas accepts every operand form


def test_pre_hopper_compiles_without_multimem():
    ptx = _compile("sm_80", "ptx")
    assert "multimem" not in ptx and "trap" in ptx


def test_compiling_leaves_the_interpreter_s_bytes_alone():
    _compile("sm_80", "ptx")  # the probe's log is empty: one NUL byte, the size that hit b" "
    assert bytes([0x20])[0] == 0x20, "NVRTC wrote into CPython's shared one-byte bytes object"
