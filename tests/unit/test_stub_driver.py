"""ubnext's launch path (_cuda.launch) run through the real cuda.core and cuda.bindings against the
stub driver (tests/stub_driver): the kernel, grid, block, stream and all twelve argument values
reach the driver's launch, with the device's primary context current on the launching thread, and
a thread that had no context current has none after it. The GPU-less check of the code that only a
GPU would otherwise run."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests import stub_driver

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import ctypes, struct, sys, threading
    import numpy as np
    from ubnext import kernels, pool
    from ubnext._cuda import (KernelParams, core, driver, kernel_handle, launch, launch_config, pack_kernel_args,
                              pdl_enabled)

    stub = ctypes.CDLL("libcuda.so.1")
    assert hasattr(stub, "stub_launch_count"), "libcuda.so.1 is not the stub"
    sizes = (ctypes.c_uint * 16).in_dll(stub, "stub_param_sizes")
    for i, (_, kind) in enumerate(kernels.KERNEL_SIGNATURE):
        sizes[i] = {"desc": pool.DESC_STRUCT_BYTES, "ptr": 8}.get(kind, 4)
    recorded = lambda name, kind=ctypes.c_void_p: kind.in_dll(stub, name).value
    check = lambda result: result[0] == 0 or (_ for _ in ()).throw(RuntimeError(result))
    check(driver().cuInit(0))
    kernel = kernel_handle(core().ObjectCode.from_cubin(b"\\x7fELF not a cubin").get_kernel("ubnext_lamport_bf16"))
    desc = pool.pack_desc(rank=1, nranks=2, timeout_ns=5, err_ptr=6, mc_base=7, layout=pool.PoolLayout(2, 4096, 8192),
                          peer_bases=[0x1_0000_0000, 0x2_0000_0000])
    pointers = tuple(0x7F0000001000 + 0x100 * i for i in range(7))
    scalars = (4096, 512, 1e-6, 13)
    params = KernelParams(desc, pack_kernel_args(kernels.KERNEL_SIGNATURE[8:], scalars))
    pdl = pdl_enabled(0)  # the device's compute capability through cuda.core, UBNEXT_PDL through envs
    seen = {}

    def fresh_thread():  # no context is current on a new thread
        launch(kernel, launch_config(3, 256, 0x5A00, pdl), params.address(pointers), 0)
        seen["after"] = int(driver().cuCtxGetCurrent()[1])

    worker = threading.Thread(target=fresh_thread)
    worker.start()
    worker.join()
    assert seen["after"] == 0, "the launch left a context current on a thread that had none"
    assert recorded("stub_push_count", ctypes.c_ulonglong) == 1
    assert recorded("stub_launch_count", ctypes.c_ulonglong) == 1
    assert recorded("stub_last_func") == int(kernel)
    assert recorded("stub_last_stream") == 0x5A00
    assert recorded("stub_last_grid", ctypes.c_uint) == 3 and recorded("stub_last_block", ctypes.c_uint) == 256
    primary_context = driver().cuDevicePrimaryCtxRetain(driver().cuDeviceGet(0)[1])[1]
    primary = int(primary_context)
    assert recorded("stub_last_ctx") == primary, "the kernel's context was not current at the launch"
    assert bytes((ctypes.c_ubyte * 256).in_dll(stub, "stub_last_param_bytes")) == desc, "the descriptor by value"
    values = list((ctypes.c_ulonglong * 16).in_dll(stub, "stub_last_args"))
    assert tuple(values[1:8]) == pointers, [hex(v) for v in values[1:8]]
    assert values[8] == 4096 and values[9] == 512 and values[11] == 13
    assert values[10] == struct.unpack("<I", struct.pack("<f", 1e-6))[0]
    nattrs = recorded("stub_last_nattrs", ctypes.c_uint)
    ids, attr_values = ((ctypes.c_int * 8).in_dll(stub, name) for name in ("stub_last_attr_ids", "stub_last_attr_values"))
    attributes = [(ids[i], attr_values[i]) for i in range(nattrs)]
    pss = int(driver().CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
    assert attributes == ([(pss, 1)] if pdl else []), attributes
    # the primary context already current (torch's threads): launched without a switch
    check(driver().cuCtxSetCurrent(primary_context))
    launch(kernel, launch_config(1, 64, 0x5B00, pdl), params.address(pointers), 0)
    assert recorded("stub_launch_count", ctypes.c_ulonglong) == 2 and recorded("stub_last_stream") == 0x5B00
    assert recorded("stub_push_count", ctypes.c_ulonglong) == 1, "switched to a context that was current"
    assert int(driver().cuCtxGetCurrent()[1]) == primary
    print("stub launch ok, pdl", pdl)
""")


@pytest.fixture(scope="module")
def stub_dir(tmp_path_factory):
    # a C compiler is part of the set-up (the emulator needs one too): no compiler is a failure
    return stub_driver.build(tmp_path_factory.mktemp("stub_driver"))


@pytest.mark.parametrize("env,pdl", [({}, True), ({"UBNEXT_PDL": "0"}, False),
                                     ({"STUB_COMPUTE_CAPABILITY": "8.0"}, False),
                                     ({"STUB_COMPUTE_CAPABILITY": "10.0"}, True)],
                         ids=["sm_90", "sm_90-UBNEXT_PDL=0", "sm_80", "sm_100"])
def test_launch_reaches_the_driver_with_every_argument(stub_dir, env, pdl):
    """cuLaunchKernelEx gets the kernel, geometry, stream, the descriptor's 256 bytes by value, the
    pointers and scalars, and the programmatic-stream-serialization attribute on sm_90 and later
    unless UBNEXT_PDL=0 (the compute capability asked through cuda.core of the stub)."""
    result = _run_with_stub(stub_dir, SCRIPT, **env)
    assert result.returncode == 0 and f"stub launch ok, pdl {pdl}" in result.stdout, result.stdout + result.stderr


LOAD_SCRIPT = textwrap.dedent("""
    import ctypes, threading
    from ubnext import kernels
    from ubnext._cuda import driver

    stub = ctypes.CDLL("libcuda.so.1")
    assert hasattr(stub, "stub_last_load_ctx"), "libcuda.so.1 is not the stub"
    check = lambda result: result[0] == 0 or (_ for _ in ()).throw(RuntimeError(result))
    drv = driver()
    check(drv.cuInit(0))
    kernels.compile_kernels = lambda fname, arch: (b"\\x7fELF not a cubin", [])  # NVRTC crashes on the stub
    primary = int(drv.cuDevicePrimaryCtxRetain(drv.cuDeviceGet(0)[1])[1])
    current = lambda: int(drv.cuCtxGetCurrent()[1])
    loaded_in = lambda: ctypes.c_void_p.in_dll(stub, "stub_last_load_ctx").value

    # the caller works in a context of its own (another device's, say)
    check(drv.cuCtxPushCurrent(drv.CUcontext(0xD0D0D000)))
    kernels.load_kernel("ubnext_lamport_bf16", 0)
    assert loaded_in() == primary, "the cubin was not loaded in the device's primary context"
    assert current() == 0xD0D0D000, f"the load left {current():#x} current, not the caller's context"
    check(drv.cuCtxPopCurrent())
    assert current() == 0, "the load changed the caller's context stack"

    seen = {}

    def fresh_thread():  # no context current there
        kernels._loaded.clear()
        kernels.load_kernel("ubnext_lamport_bf16", 0)
        seen["loaded_in"], seen["after"] = loaded_in(), current()

    worker = threading.Thread(target=fresh_thread)
    worker.start()
    worker.join()
    assert seen == {"loaded_in": primary, "after": 0}, seen
    print("stub load ok")
""")


def test_kernel_loading_leaves_the_callers_context(stub_dir):
    """Issue 23 item 4, through the installed cuda.core against the stub driver: the kernels are
    loaded with the device's primary context current, and the calling thread's own context (or
    none) is current again afterwards. cuda.core's Device.set_current, which the loader used, does
    not restore it: 0.3 pushes the primary context without a pop, 1.x replaces the current one."""
    env = dict(os.environ, LD_LIBRARY_PATH=f"{stub_dir}:{os.environ.get('LD_LIBRARY_PATH', '')}",
               PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "-c", LOAD_SCRIPT], env=env, cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and "stub load ok" in result.stdout, result.stdout + result.stderr


def _run_with_stub(stub_dir, script: str, **env) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, LD_LIBRARY_PATH=f"{stub_dir}:{os.environ.get('LD_LIBRARY_PATH', '')}",
                    PYTHONPATH=str(ROOT), **env)
    return subprocess.run([sys.executable, "-c", script], env=full_env, cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


PROBE_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    import ubnext._cuda as cu

    # torch's CPU build ends the probe before the driver ("torch is a CPU build"): stand in for a CUDA
    # build, so that the driver part runs through cuda.bindings against the stub
    torch.version.cuda, torch.cuda.is_available = "13.0", lambda: True
    print(cu.gpu_available(), cu.no_gpu_reason())
    print(cu.gpu_available())  # probed once: the driver is not asked again
    if cu.gpu_available():
        print("-- the probe ends here", file=sys.stderr, flush=True)  # cuda.core's Device calls cuInit itself
        print(cu.device_arch(0))
""")


@pytest.mark.parametrize("env,expected", [
    ({}, ["True 1 CUDA device(s)", "True", "sm_90"]),
    ({"STUB_DEVICE_COUNT": "4", "STUB_COMPUTE_CAPABILITY": "10.0"}, ["True 4 CUDA device(s)", "True", "sm_100"]),
    ({"STUB_COMPUTE_CAPABILITY": "12.1"}, ["True 1 CUDA device(s)", "True", "sm_121"]),
    ({"STUB_DEVICE_COUNT": "0"}, ["False no CUDA device", "False"]),
    ({"STUB_INIT_ERROR": "100"}, ["False CUDA driver unusable: cuInit failed: CUDA_ERROR_NO_DEVICE (100)", "False"]),
], ids=["sm_90", "sm_100", "sm_121", "no-device", "cuInit-fails"])
def test_the_gpu_probe_and_the_arch_through_the_driver(stub_dir, env, expected):
    """The GPU probe (cuInit, cuDeviceGetCount) and device_arch (cuda.core's Device.compute_capability)
    through the installed cuda.bindings and cuda.core: their return conventions ((status, value)
    tuples, the enum that names a failure) and the attributes cuda.core asks for (75 and 76, major
    and minor), whatever versions are installed (scripts/floor_check.sh runs this at the floors).
    The driver is asked once, also when it failed."""
    result = _run_with_stub(stub_dir, PROBE_SCRIPT, STUB_TRACE="1", **env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines() == expected, result.stdout + result.stderr[-3000:]
    assert result.stderr.split("-- the probe ends here")[0].count("[stub] cuInit\n") == 1, result.stderr[-3000:]


PINNED_SCRIPT = textwrap.dedent("""
    import torch
    from ubnext._cuda import check, driver
    from ubnext.pool.symmetric import _device_pointer_of_pinned

    drv = driver()
    check(drv.cuInit(0))
    # torch's CPU build cannot pin (pin_memory needs a CUDA build): the word is page-locked through
    # the driver as torch does with pinned_use_cuda_host_register (cudaHostRegister)
    word = torch.zeros(4, dtype=torch.int32)
    check(drv.cuMemHostRegister(word.data_ptr(), word.nbytes, 0))
    offset = 0x100000000000  # the stub's device address of page-locked memory: not the host one
    assert _device_pointer_of_pinned(word) == word.data_ptr() + offset, hex(_device_pointer_of_pinned(word))
    assert _device_pointer_of_pinned(word[1:]) == word.data_ptr() + 4 + offset
    check(drv.cuMemHostUnregister(word.data_ptr()))
    # memory that is not page-locked: the driver refuses, the host (UVA) address is all that is left
    assert _device_pointer_of_pinned(word) == word.data_ptr()
    print("stub pinned ok")
""")


def test_the_error_words_device_address_is_the_drivers(stub_dir):
    """The pinned error word's device address comes from cuMemHostGetDevicePointer through the
    installed cuda.bindings (a host int in, flags 0, a CUdeviceptr out), not from an assumption that
    it equals the host address: where the device cannot use host pointers for registered memory
    (CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM 0, which the stub models), they differ. Memory that is
    not page-locked is refused by the driver and the host address is used, with a warning."""
    result = _run_with_stub(stub_dir, PINNED_SCRIPT)
    assert result.returncode == 0 and "stub pinned ok" in result.stdout, result.stdout + result.stderr
    assert "cuMemHostGetDevicePointer failed: CUDA_ERROR_INVALID_VALUE" in result.stderr, result.stderr
