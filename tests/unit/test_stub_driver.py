"""ubnext's launch path (_cuda.launch) run through the real cuda.core and cuda.bindings against the
stub driver (tests/stub_driver): the kernel, grid, block, stream and all twelve argument values
reach the driver's launch, with the device's primary context current on the launching thread, and
a thread that had no context current has none after it. The GPU-less check of the code that only a
GPU would otherwise run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests import stub_driver
from ubnext import kernels, pool

ROOT = Path(__file__).resolve().parents[2]

# Every kernel's parameter sizes as the driver would read them from a cubin built from KERNEL_SIGNATURE
# (the stub cannot read cubins): the descriptor by value, 8-byte pointers, 4-byte scalars
ABI_SIZES_INTO_STUB = textwrap.dedent("""
    sizes = (ctypes.c_uint * 16).in_dll(stub, "stub_param_sizes")
    for i, (_, kind) in enumerate(kernels.KERNEL_SIGNATURE):
        sizes[i] = {"desc": pool.DESC_STRUCT_BYTES, "ptr": 8}.get(kind, 4)
""")

SCRIPT = (
    textwrap.dedent("""
    import ctypes, importlib.util, struct, sys, threading
    from ubnext import kernels, pool
    from ubnext.runtime._cuda import (CudaError, KernelParams, bind_launch_calls, core, create_event, driver, kernel_handle,
                                      launch, launch_config, max_active_clusters, pack_kernel_args, pdl_enabled)

    stub = ctypes.CDLL("libcuda.so.1")
    assert hasattr(stub, "stub_launch_count"), "libcuda.so.1 is not the stub"
""")
    + ABI_SIZES_INTO_STUB
    + textwrap.dedent("""
    recorded = lambda name, kind=ctypes.c_void_p: kind.in_dll(stub, name).value
    check = lambda result: result[0] == 0 or (_ for _ in ()).throw(RuntimeError(result))
    call_count = ctypes.c_ulonglong.in_dll(stub, "stub_call_count")
    call_names = (ctypes.c_char_p * 64).in_dll(stub, "stub_call_names")

    def driver_calls(fn):  # the stub's entry points that fn() reached, in order ("_v2" ABI suffixes dropped)
        before = call_count.value
        fn()
        return [call_names[i % 64].decode().removesuffix("_v2") for i in range(before, call_count.value)]

    check(driver().cuInit(0))
    public = sys.argv[1] == "public"
    v2 = bind_launch_calls(public=public)
    # where cuda.bindings has the v2 module, its calls are the ones bound: a signature that no longer
    # matches would fall back to the slower public calls silently
    assert v2 == (not public and importlib.util.find_spec("cuda.bindings._v2") is not None), v2
    kernel = kernel_handle(core().ObjectCode.from_cubin(b"\\x7fELF not a cubin").get_kernel("ubnext_lamport_bf16"))
    desc = pool.pack_desc(rank=1, nranks=2, timeout_ns=5, err_ptr=6, mc_base=7, layout=pool.PoolLayout(2, 4096, 8192),
                          peer_bases=[0x1_0000_0000, 0x2_0000_0000])
    pointers = tuple(0x7F0000001000 + 0x100 * i for i in range(7))
    scalars = (4096, 512, 1e-6, 13)
    params = KernelParams(desc, pack_kernel_args(kernels.KERNEL_SIGNATURE[8:], scalars))
    pdl = pdl_enabled(0)  # the device's compute capability through cuda.core, UBNEXT_PDL through envs
    config = launch_config(3, 256, 0x5A00, pdl, 0)
    done = create_event(0)
    seen = {}

    def fresh_thread():  # no context is current on a new thread
        seen["calls"] = driver_calls(lambda: launch(kernel, config, params, pointers, done))
        seen["after"] = int(driver().cuCtxGetCurrent()[1])

    worker = threading.Thread(target=fresh_thread)
    worker.start()
    worker.join()
    assert seen["after"] == 0, "the launch left a context current on a thread that had none"
    assert seen["calls"] == ["cuCtxGetCurrent", "cuCtxPushCurrent", "cuLaunchKernelEx", "cuEventRecord",
                             "cuCtxPopCurrent"], seen["calls"]
    assert recorded("stub_launch_count", ctypes.c_ulonglong) == 1
    assert recorded("stub_last_func") == kernel
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
    # the primary context already current (torch's threads): launched without a switch, in three calls
    # (two without an event), other pointers patched into the same buffer
    check(driver().cuCtxSetCurrent(primary_context))
    other = tuple(0x7E0000002000 + 0x100 * i for i in range(7))
    calls = driver_calls(lambda: launch(kernel, launch_config(1, 64, 0x5B00, pdl, 0), params, other, done))
    assert calls == ["cuCtxGetCurrent", "cuLaunchKernelEx", "cuEventRecord"], calls
    assert recorded("stub_launch_count", ctypes.c_ulonglong) == 2 and recorded("stub_last_stream") == 0x5B00
    assert tuple((ctypes.c_ulonglong * 16).in_dll(stub, "stub_last_args")[1:8]) == other
    assert driver_calls(lambda: launch(kernel, config, params, pointers)) == ["cuCtxGetCurrent", "cuLaunchKernelEx"]
    assert int(driver().cuCtxGetCurrent()[1]) == primary
    # a cluster launch (the Lamport row split): the cluster-dimension attribute after PDL's, its x the cluster
    launch(kernel, launch_config(16, 128, 0x5B00, pdl, 0, 8), params, pointers)
    nattrs = recorded("stub_last_nattrs", ctypes.c_uint)
    cdim = int(driver().CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION)
    attributes = [(ids[i], attr_values[i]) for i in range(nattrs)]
    assert attributes == ([(pss, 1)] if pdl else []) + [(cdim, 8)], attributes
    assert recorded("stub_last_grid", ctypes.c_uint) == 16 and recorded("stub_last_block", ctypes.c_uint) == 128
    # cuOccupancyMaxActiveClusters asked at the cluster's shape
    ctypes.c_int.in_dll(stub, "stub_max_clusters").value = 5
    assert max_active_clusters(kernel, 128, 4, 0) == 5
    assert recorded("stub_last_cluster_asked", ctypes.c_int) == 4
    # a failed launch raises CudaError, and a pushed context is popped all the same
    ctypes.c_int.in_dll(stub, "stub_launch_result").value = 719  # CUDA_ERROR_LAUNCH_FAILED

    def failing_thread():
        try:
            launch(kernel, config, params, pointers, done)
        except CudaError as exc:
            seen["error"] = str(exc)
        seen["after"] = int(driver().cuCtxGetCurrent()[1])

    worker = threading.Thread(target=failing_thread)
    worker.start()
    worker.join()
    assert "launch" in seen.get("error", "").lower() and "fail" in seen["error"].lower(), seen
    assert seen["after"] == 0 and recorded("stub_launch_count", ctypes.c_ulonglong) == 4
    print("stub launch ok, pdl", pdl)
""")
)


@pytest.fixture(scope="module")
def stub_dir(tmp_path_factory):
    # a C compiler is part of the set-up (the emulator needs one too): no compiler is a failure
    return stub_driver.build(tmp_path_factory.mktemp("stub_driver"))


@pytest.mark.parametrize("calls", ["default", "public"])
@pytest.mark.parametrize(
    "env,pdl",
    [
        ({}, True),
        ({"UBNEXT_PDL": "0"}, False),
        ({"STUB_COMPUTE_CAPABILITY": "8.0"}, False),
        ({"STUB_COMPUTE_CAPABILITY": "10.0"}, True),
    ],
    ids=["sm_90", "sm_90-UBNEXT_PDL=0", "sm_80", "sm_100"],
)
def test_launch_reaches_the_driver_with_every_argument(stub_dir, env, pdl, calls):
    """cuLaunchKernelEx gets the kernel, geometry, stream, the descriptor's 256 bytes by value, the
    pointers and scalars, and the programmatic-stream-serialization attribute on sm_90 and later
    unless UBNEXT_PDL=0 (the compute capability asked through cuda.core of the stub), with the
    device's primary context current and the thread's own context (none) current again after it.
    Where that context is current already, a launch makes three driver calls (two without an event):
    the count docs/PERF.md's launch timing rests on. Through the calls bound by default (cuda.bindings'
    v2 module where it has one) and through its public ones; a failed launch raises CudaError."""
    result = _run_with_stub(stub_dir, SCRIPT, argv=(calls,), **env)
    assert result.returncode == 0 and f"stub launch ok, pdl {pdl}" in result.stdout, result.stdout + result.stderr


LOAD_SCRIPT = textwrap.dedent("""
    import ctypes, threading
    from ubnext import kernels
    from ubnext.runtime._cuda import driver

    stub = ctypes.CDLL("libcuda.so.1")
    assert hasattr(stub, "stub_last_load_ctx"), "libcuda.so.1 is not the stub"
    check = lambda result: result[0] == 0 or (_ for _ in ()).throw(RuntimeError(result))
    drv = driver()
    check(drv.cuInit(0))
    # NVRTC crashes on the stub; the stub does not read the cubin
    kernels.cubin_for = lambda fname, arch: kernels.Cubin(fname, arch, b"\\x7fELF not a cubin", (), "13.0", "compiled")
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
    env = dict(os.environ, LD_LIBRARY_PATH=f"{stub_dir}:{os.environ.get('LD_LIBRARY_PATH', '')}", PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [sys.executable, "-c", LOAD_SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and "stub load ok" in result.stdout, result.stdout + result.stderr


# KERNEL_SIGNATURE's sizes, written out: the descriptor by value, 7 pointers, 4 scalars
ABI_SIZES = [pool.DESC_STRUCT_BYTES] + [8] * 7 + [4] * 4

REPORT_SCRIPT = (
    textwrap.dedent("""
    import ctypes, json, os, sys
    from pathlib import Path
    from ubnext import kernels, pool
    from ubnext.runtime._cuda import driver

    stub = ctypes.CDLL("libcuda.so.1")
    assert hasattr(stub, "stub_func_load_count"), "libcuda.so.1 is not the stub"
    sizes = (ctypes.c_uint * 16).in_dll(stub, "stub_param_sizes")
    if "STUB_PARAM_SIZES" not in os.environ:  # else cuInit sets them
""")
    + textwrap.indent(ABI_SIZES_INTO_STUB, "    ")
    + textwrap.dedent("""
    csrc, odd, compiling = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "compile"
    kernels.CSRC = csrc  # the test's copy: an edit of the checkout meanwhile cannot change the source hash
    stub_int = lambda name: ctypes.c_int.in_dll(stub, name)
    stub_int("stub_num_regs").value, stub_int("stub_local_bytes").value = 40, 16
    if odd != "none":  # one kernel the driver answers differently for
        (ctypes.c_char * 128).in_dll(stub, "stub_odd_kernel").value = b"ubnext_nvls_twoshot_fp16"
    if odd == "param_size":  # n (parameter 8) as 8 bytes
        odd_sizes = (ctypes.c_uint * 16).in_dll(stub, "stub_odd_param_sizes")
        odd_sizes[:] = sizes[:]
        odd_sizes[8] = 8
    if odd == "occupancy":
        stub_int("stub_odd_occupancy").value = 0

    def fake_nvrtc(fname, arch, wants, defines=()):  # NVRTC crashes on the stub; the stub does not read cubins
        assert compiling, f"{fname} compiled, not taken from the cache or the carried folder"
        return {want: b"\\x7fELF not a cubin" for want in wants}, ""

    kernels._nvrtc_images = fake_nvrtc
    drv = driver()
    drv.cuInit(0)
    rows = kernels.kernel_report(0, block=512)
    kernels.load_all(0)  # a second preparation loads nothing again
    print(json.dumps({
        "rows": rows, "problems": kernels.report_problems(rows),
        "func_loads": ctypes.c_ulonglong.in_dll(stub, "stub_func_load_count").value,
        "function_ctx": ctypes.c_void_p.in_dll(stub, "stub_last_function_ctx").value,
        "primary": int(drv.cuDevicePrimaryCtxRetain(drv.cuDeviceGet(0)[1])[1]),
        "occupancy_block": stub_int("stub_last_occupancy_block").value,
        "nvrtc": kernels.nvrtc_version(),
    }))
""")
)


def _report(stub_dir, csrc: Path, odd: str = "none", compiling: bool = False, **env) -> dict:
    """kernel_report and report_problems of a process under the stub driver."""
    result = _run_with_stub(stub_dir, REPORT_SCRIPT, **env, argv=(str(csrc), odd, "compile" if compiling else "-"))
    assert result.returncode == 0, result.stdout + result.stderr[-5000:]
    return json.loads(result.stdout.splitlines()[-1])


@pytest.fixture
def csrc_copy(tmp_path):
    csrc = tmp_path / "csrc"
    shutil.copytree(kernels.CSRC, csrc)
    return csrc


def test_load_all_loads_every_kernel_at_once_and_the_report_is_clean(stub_dir, tmp_path, csrc_copy):
    """R1: load_all loads each kernel it may launch into the device's primary context itself
    (cuKernelGetFunction with that context current, then cuFuncLoad once per kernel, not again at a
    second preparation), and kernel_report shows what the driver says of each: loaded, the
    parameter sizes of KERNEL_SIGNATURE, registers, local memory and occupancy at the block asked
    for, the NVRTC that built the cubin and where it came from; report_problems finds nothing."""
    names = [name for names in kernels.sources().values() for name in names]
    cache = str(tmp_path / "cache")
    report = _report(stub_dir, csrc_copy, compiling=True, UBNEXT_CACHE_DIR=cache)
    assert report["problems"] == [], report["problems"]
    rows = report["rows"]
    assert [row["name"] for row in rows] == names
    assert report["func_loads"] == len(names), "cuFuncLoad once per kernel"
    assert report["function_ctx"] == report["primary"], "the kernels' functions are not the primary context's"
    assert report["occupancy_block"] == 512
    for row in rows:
        assert row["file"] == kernels.ALGOS[row["name"][len("ubnext_") :].rsplit("_", 1)[0]]
        assert (row["arch"], row["origin"], row["nvrtc"]) == ("sm_90", "compiled", report["nvrtc"]), row
        assert row["loaded"] and row["param_sizes"] == ABI_SIZES and row["abi_param_sizes"] == ABI_SIZES, row
        assert (row["registers"], row["local_bytes"], row["block"], row["max_blocks_per_sm"]) == (40, 16, 512, 8), row
    again = _report(stub_dir, csrc_copy, UBNEXT_CACHE_DIR=cache)
    assert {row["origin"] for row in again["rows"]} == {"cache"} and again["problems"] == []


def test_the_report_names_the_carried_cubins_nvrtc(stub_dir, tmp_path, csrc_copy, monkeypatch):
    """Cubins exported elsewhere (NVRTC 12.8, faked) load from UBNEXT_CUBIN_DIR without a compile or the
    cache, and each row names the NVRTC that built its cubin, not this machine's."""
    monkeypatch.setattr(kernels, "CSRC", csrc_copy)
    monkeypatch.setenv("UBNEXT_CACHE_DIR", str(tmp_path / "export-cache"))
    monkeypatch.setattr(kernels, "nvrtc_version", lambda: "12.8")
    monkeypatch.setattr(
        kernels,
        "_nvrtc_images",
        lambda fname, arch, wants, defines=(): ({want: b"\x7fELF not a cubin" for want in wants}, ""),
    )
    kernels.export_cubins(tmp_path / "carried", ["sm_90"])
    # the sizes through the environment this time, as a whole program under the stub gets them
    abi = ",".join(str(size) for size in ABI_SIZES)
    report = _report(
        stub_dir,
        csrc_copy,
        UBNEXT_CACHE_DIR=str(tmp_path / "empty-cache"),
        UBNEXT_CUBIN_DIR=str(tmp_path / "carried"),
        STUB_PARAM_SIZES=abi,
    )
    assert {(row["origin"], row["nvrtc"]) for row in report["rows"]} == {("carried", "12.8")}
    assert report["problems"] == []


@pytest.mark.parametrize("odd,why", [("param_size", "parameter sizes"), ("occupancy", "occupancy 0")])
def test_report_problems_names_the_kernel_the_driver_disagrees_on(stub_dir, tmp_path, csrc_copy, odd, why):
    """The driver reports, for one kernel, a parameter of another size than KERNEL_SIGNATURE's (n as
    8 bytes), or no block of 512 threads per SM: report_problems gives one message, naming that
    kernel and what is wrong."""
    report = _report(stub_dir, csrc_copy, odd, compiling=True, UBNEXT_CACHE_DIR=str(tmp_path / "cache"))
    assert len(report["problems"]) == 1, report["problems"]
    message = report["problems"][0]
    assert message.startswith("ubnext_nvls_twoshot_fp16 (nvls.cu, sm_90") and why in message, message
    if odd == "param_size":
        assert "first at parameter 8, n" in message, message


def _run_with_stub(stub_dir, script: str, argv: tuple[str, ...] = (), **env) -> subprocess.CompletedProcess:
    full_env = dict(
        os.environ, LD_LIBRARY_PATH=f"{stub_dir}:{os.environ.get('LD_LIBRARY_PATH', '')}", PYTHONPATH=str(ROOT), **env
    )
    return subprocess.run(
        [sys.executable, "-c", script, *argv], env=full_env, cwd=ROOT, capture_output=True, text=True, timeout=120
    )


PROBE_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    import ubnext.runtime._cuda as cu

    # torch's CPU build ends the probe before the driver ("torch is a CPU build"): stand in for a CUDA
    # build, so that the driver part runs through cuda.bindings against the stub
    torch.version.cuda, torch.cuda.is_available = "13.0", lambda: True
    print(cu.gpu_available(), cu.no_gpu_reason())
    print(cu.gpu_available())  # probed once: the driver is not asked again
    if cu.gpu_available():
        print("-- the probe ends here", file=sys.stderr, flush=True)  # cuda.core's Device calls cuInit itself
        print(cu.device_arch(0))
""")


@pytest.mark.parametrize(
    "env,expected",
    [
        ({}, ["True 1 CUDA device(s)", "True", "sm_90"]),
        ({"STUB_DEVICE_COUNT": "4", "STUB_COMPUTE_CAPABILITY": "10.0"}, ["True 4 CUDA device(s)", "True", "sm_100"]),
        ({"STUB_COMPUTE_CAPABILITY": "12.1"}, ["True 1 CUDA device(s)", "True", "sm_121"]),
        ({"STUB_DEVICE_COUNT": "0"}, ["False no CUDA device", "False"]),
        (
            {"STUB_INIT_ERROR": "100"},
            ["False CUDA driver unusable: cuInit failed: CUDA_ERROR_NO_DEVICE (100)", "False"],
        ),
    ],
    ids=["sm_90", "sm_100", "sm_121", "no-device", "cuInit-fails"],
)
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
    from ubnext.runtime._cuda import check, driver
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
