"""cuda-python helpers: the GPU probe, error checks, streams and kernel launches.

Every GPU call ubnext makes itself (compile, load, launch, memory mapping) goes through
cuda-python; there is no ctypes and no torch C++ extension on the GPU path.

The GPU is probed once per process. A cuda.core/driver call that failed once can deadlock
when it is retried, so when the probe finds no usable device ubnext never calls the driver
again.
"""

from __future__ import annotations

import contextlib
import functools
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from .. import envs

__all__ = [
    "CudaError",
    "core",
    "gpu_available",
    "no_gpu_reason",
    "check",
    "driver",
    "driver_problem",
    "driver_verdict",
    "driver_version",
    "launch",
    "pack_kernel_args",
    "KernelParams",
    "pdl_enabled",
]


class CudaError(RuntimeError):
    """A CUDA driver/NVRTC call failed."""


@functools.cache
def core():
    """The cuda.core namespace, whichever layout is installed (top level since 0.4,
    ``cuda.core.experimental`` before)."""
    try:
        import cuda.core as mod

        if hasattr(mod, "Device") and hasattr(mod, "launch"):
            return mod
    except ImportError:
        pass
    import cuda.core.experimental as mod  # older layout

    return mod


_driver_module = None


def driver():
    """cuda.bindings.driver, imported on first use (an import statement costs ~0.2 us even when the
    module is loaded, and the launch asks on every call)."""
    global _driver_module
    if _driver_module is None:
        from cuda.bindings import driver as drv

        _driver_module = drv
    return _driver_module


def check(result: Any, what: str = "CUDA call") -> Any:
    """Unpack a cuda.bindings ``(status, *values)`` tuple, raising on failure."""
    if isinstance(result, tuple):
        status, values = result[0], result[1:]
    else:
        status, values = result, ()
    code = int(status)
    if code != 0:
        name = getattr(status, "name", str(code))
        raise CudaError(f"{what} failed: {name} ({code})")
    if not values:
        return None
    return values[0] if len(values) == 1 else values


_probe: tuple[bool, str] | None = None


def _probe_once() -> tuple[bool, str]:
    global _probe
    if _probe is not None:
        return _probe
    if not torch.version.cuda:
        _probe = (False, "torch is a CPU build")
    elif not torch.cuda.is_available():
        _probe = (False, "torch sees no CUDA device")
    else:
        try:
            drv = driver()
            check(drv.cuInit(0), "cuInit")
            count = check(drv.cuDeviceGetCount(), "cuDeviceGetCount")
            _probe = (count > 0, f"{count} CUDA device(s)" if count else "no CUDA device")
        except Exception as exc:  # the driver is never called again after this
            _probe = (False, f"CUDA driver unusable: {exc}")
    return _probe


def gpu_available() -> bool:
    """True when a CUDA GPU is usable through both torch and cuda-python (probed once)."""
    return _probe_once()[0]


def no_gpu_reason() -> str:
    return _probe_once()[1]


# The oldest driver branch that loads cubins from each NVRTC major: cubins stay loadable across
# minor versions of one major (CUDA minor-version compatibility), never on an older major.
DRIVER_BRANCH_FOR_CUDA_MAJOR = {12: "R525", 13: "R580"}


def driver_version() -> int:
    """The CUDA version the driver supports, as cuDriverGetVersion reports it (12080 = 12.8)."""
    return check(driver().cuDriverGetVersion(), "cuDriverGetVersion")


def format_cuda_version(version: int) -> str:
    return f"{version // 1000}.{version % 1000 // 10}"


def driver_problem(driver_cuda: int, nvrtc_major: int) -> str | None:
    """Why cubins from NVRTC ``nvrtc_major`` cannot load on a driver that supports CUDA
    ``driver_cuda`` (cuDriverGetVersion's number), or None when they can."""
    if driver_cuda // 1000 >= nvrtc_major:
        return None
    branch = DRIVER_BRANCH_FOR_CUDA_MAJOR.get(nvrtc_major, f"a CUDA {nvrtc_major} driver")
    return (
        f"the NVIDIA driver supports CUDA {format_cuda_version(driver_cuda)}, but ubnext's kernels "
        f"are compiled by NVRTC {nvrtc_major}, whose cubins need a driver for CUDA {nvrtc_major}.0 "
        f"({branch} or newer). Fix: upgrade the driver to {branch} or newer. Until then ubnext "
        "uses torch.distributed (NCCL)"
    )


def driver_verdict(nvrtc_version: Callable[[], str]) -> str:
    """One line on whether this node's driver runs ubnext's kernels, the first thing a node check
    says (``python -m ubnext.info``, the one-GPU check): ``driver OK: ...``, ``driver PROBLEM: <why,
    and the fix>`` (every op then falls back to NCCL), ``no GPU: <reason>``, or ``driver unchecked:
    <what failed>``. ``nvrtc_version`` is ``kernels.nvrtc_version`` (this module sits below the
    kernel registry), asked only where there is a GPU: without one, NVRTC does not matter."""
    if not gpu_available():
        return f"no GPU: {no_gpu_reason()}"
    try:
        driver_cuda, nvrtc_major = driver_version(), int(nvrtc_version().split(".")[0])
    except Exception as exc:  # noqa: BLE001 - the verdict says what could not be read instead of stopping
        return f"driver unchecked: {type(exc).__name__}: {exc}"
    problem = driver_problem(driver_cuda, nvrtc_major)
    if problem:
        return f"driver PROBLEM: {problem}"
    return f"driver OK: CUDA {format_cuda_version(driver_cuda)} driver loads NVRTC {nvrtc_major} cubins"


@functools.lru_cache(maxsize=64)
def _is_cuda(device) -> bool:
    # asked on every op: torch.device.type builds a new string each time (~0.2 us). A CUDA device
    # counts only where the probe found a GPU: torch's CPU build has CUDA device objects too, but
    # its capture query raises
    return device.type == "cuda" and gpu_available()


def capturing(device) -> bool:
    """Whether work issued now on ``device`` goes into a CUDA graph capture (never on CPU). The one
    place ubnext asks, so that tests can fake a capture on the emulator."""
    return _is_cuda(device) and torch.cuda.is_current_stream_capturing()


def _current_stream_handle_of_stream_object(device_index: int) -> int:
    return torch.cuda.current_stream(device_index).cuda_stream


# current_stream_handle(device_index): torch's current stream on that device, as its raw
# cudaStream_t (an int): what a launch needs. torch.cuda.current_stream builds a Stream object
# through three Python functions on every call (about 1 us); torch._C._cuda_getCurrentRawStream
# (torch/csrc/cuda/Module.cpp, what inductor's generated code calls) returns the handle itself,
# the same value as that object's .cuda_stream. torch's CPU build has neither, and never calls this.
current_stream_handle = getattr(torch._C, "_cuda_getCurrentRawStream", None) or _current_stream_handle_of_stream_object


def device_arch(device_index: int) -> str:
    """``sm_XY`` of a GPU; only called after the probe found one."""
    dev = core().Device(device_index)
    major, minor = dev.compute_capability
    return f"sm_{major}{minor}"


def pack_kernel_args(signature: Sequence[tuple[str, str]], values: Sequence[Any]) -> list:
    """Kernel scalar arguments typed as numpy scalars (int32, float32; pointers as Python ints):
    what ``KernelParams`` lays out, and what cuda.core's argument handler would pack the same way
    (tests/unit/test_launch_args.py)."""
    if len(signature) != len(values):
        raise TypeError(f"kernel takes {len(signature)} arguments, got {len(values)}")
    packed: list[int | np.int32 | np.float32] = []
    for (name, kind), value in zip(signature, values):
        if kind == "ptr":
            packed.append(int(value))
        elif kind == "i32":
            if not -(1 << 31) <= value < (1 << 31):
                # numpy 1.x wraps np.int32 silently; a kernel must never see a wrapped count
                raise OverflowError(f"kernel argument {name}={value} does not fit in 32 bits")
            packed.append(np.int32(value))
        elif kind == "f32":
            packed.append(np.float32(value))
        else:  # pragma: no cover - registry bug
            raise TypeError(f"unknown kernel argument kind {kind!r} for {name}")
    return packed


# The seven pointers as the kernel reads them: native void* (8 bytes on every platform CUDA runs on).
# "P" packs through PyLong_AsVoidPtr, about 60 ns less than "<7Q" for seven pointers.
_PACK_POINTERS = struct.Struct("7P").pack_into
assert struct.calcsize("P") == 8, "CUDA runs on 64-bit platforms only"


class KernelParams(threading.local):
    """One call signature's kernel parameters as cuLaunchKernelEx takes them (``kernelParams``: the
    address of an array of pointers, one to each parameter's value): the descriptor and the scalars
    written once, the seven pointers per call (``launch``, or ``address``). cuda.core's ``launch``
    cannot pass the descriptor, a struct by value, so ubnext builds the array itself. One buffer per
    thread (a ``threading.local``: ``__init__`` runs again, with the same arguments, on each thread
    that uses the object): the driver copies the values during the launch call, so a buffer is free
    again when the call returns, and calls from other threads (autograd's) never share one."""

    def __init__(self, desc: bytes, packed_scalars: Sequence[Any]):
        """``desc``: the descriptor's bytes (a multiple of 8, as its u64 fields); ``packed_scalars``:
        n, hidden, eps, flags as ``pack_kernel_args`` types them. The buffer holds the descriptor, the
        seven 8-byte pointers, then the four 4-byte scalars, each at its natural alignment."""
        if len(desc) % 8:
            raise ValueError(f"the descriptor's {len(desc)} bytes are not whole u64 fields")
        pointers_at = len(desc)
        scalars_at = pointers_at + 7 * 8
        values = bytearray(bytes(desc) + bytes(7 * 8) + b"".join(v.tobytes() for v in packed_scalars))
        view = np.frombuffer(values, dtype=np.uint8)  # its address; the export also pins the bytearray
        offsets = (
            [0] + [pointers_at + 8 * i for i in range(7)] + [scalars_at + 4 * i for i in range(len(packed_scalars))]
        )
        addresses = np.array(offsets, dtype=np.uint64) + np.uint64(view.__array_interface__["data"][0])
        self._pinned = (view, addresses)
        # what launch reads on every call, as one attribute (each costs a thread-local lookup)
        self.buffers = (values, pointers_at, int(addresses.__array_interface__["data"][0]))

    def address(self, pointers: Sequence[int]) -> int:
        """The kernelParams address with these seven pointers (in, out, residual, residual_out, weight,
        scale, scale_inv) in place; valid until this thread's next call."""
        values, pointers_at, address = self.buffers
        _PACK_POINTERS(values, pointers_at, *pointers)
        return address


def pdl_enabled(device_index: int) -> bool:
    """Whether launches on this GPU carry the programmatic-stream-serialization attribute: sm_90 and
    later (griddepcontrol needs them), unless UBNEXT_PDL=0."""
    return envs.get("UBNEXT_PDL") and _compute_major(device_index) >= 9


@functools.cache
def _compute_major(device_index: int) -> int:
    return core().Device(device_index).compute_capability[0]


def kernel_handle(kernel) -> int:
    """A cuda.core kernel's driver handle (a CUkernel from cuLibraryLoadData, which cuLaunchKernelEx takes
    in place of a CUfunction) as ``launch`` takes it: an int."""
    return kernel_address(kernel)


def kernel_address(kernel) -> int:
    """A cuda.core kernel's driver handle (a CUkernel) as an int: ``handle`` since cuda.core 0.4,
    ``_handle`` before."""
    handle = getattr(kernel, "handle", None)
    return int(handle if handle is not None else kernel._handle)


@functools.cache
def _primary_context(device_index: int):
    """The device's primary context (torch's), retained once for the process's lifetime, and its
    address."""
    drv = driver()
    dev = check(drv.cuDeviceGet(device_index), "cuDeviceGet")
    ctx = check(drv.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    return ctx, int(ctx)


CU_EVENT_DISABLE_TIMING = 0x2


def create_event(device_index: int) -> int:
    """An event of the device's primary context, without timing (the cheapest to record), as its
    handle: what ``launch`` records (cuda.bindings' calls take the int too)."""
    with primary_context(device_index):
        return int(check(driver().cuEventCreate(CU_EVENT_DISABLE_TIMING), "cuEventCreate"))


def wait_event(stream_handle: int, event, device_index: int) -> None:
    """Work queued on the stream (of the device's primary context: handle 0 is the null stream of
    whatever context is current) from now on waits for ``event``; the host does not wait."""
    drv = driver()
    with primary_context(device_index):
        check(drv.cuStreamWaitEvent(drv.CUstream(stream_handle), event, 0), "cuStreamWaitEvent")


def record_event(event, stream_handle: int, device_index: int) -> None:
    """Record ``event`` on the stream, in the device's primary context (as ``launch`` does after a
    kernel)."""
    drv = driver()
    with primary_context(device_index):
        check(drv.cuEventRecord(event, drv.CUstream(stream_handle)), "cuEventRecord")


def event_done(event, device_index: int) -> bool:
    """Whether the work before ``event``'s last record has completed (cuEventQuery), from any thread."""
    drv = driver()
    with primary_context(device_index):
        status = drv.cuEventQuery(event)[0]
    if status == drv.CUresult.CUDA_ERROR_NOT_READY:
        return False
    check(status, "cuEventQuery")
    return True


# launch's three driver calls, bound once (bind_launch_calls) to cuda.bindings' v2 driver module where it
# has them, else to its public one. The public calls convert their arguments and return a status tuple in
# Python-level code: against the stub driver, 90 ns for cuCtxGetCurrent, 215 for cuEventRecord and about
# 250 for cuLaunchKernelEx above the stub's own work, where the v2 calls (cpdef, int handles, raising on
# failure) take 75, 77 and about 150; with them, and the pointers packed as below, launch went from 1.9x
# cuda.core's launch of the same arguments to no slower (scripts/launch_bench.sh, docs/PERF.md).
_ctx_get_current: Callable[[], int]
_launch_kernel_ex: Callable[[Any, int, int, int], None]
_event_record: Callable[[int, int], None]
_DriverError: Any = ()  # what the bound calls raise instead of CudaError; `except ()` catches nothing
_bound: str | None = None  # "v2" or "public", once bound

# The v2 calls launch makes, as their signatures read (the first line of each docstring, which Cython
# writes). cuda.bindings._v2 is private (cuda-bindings 13.x has it, 12.9 has not): a module without
# these calls, or whose calls read otherwise, is not used, and launch takes the public calls instead.
_V2_CALLS = {
    "ctx_get_current": "ctx_get_current() -> intptr_t",
    "launch_kernel_ex": "launch_kernel_ex(config, intptr_t f, kernel_params, intptr_t extra)",
    "event_record": "event_record(intptr_t h_event, intptr_t h_stream)",
}


def _v2_driver():
    """cuda.bindings' v2 driver module where its calls match ``_V2_CALLS``, else None."""
    try:
        from cuda.bindings._v2 import driver as v2
    except ImportError:
        return None
    for name, signature in _V2_CALLS.items():
        doc = getattr(getattr(v2, name, None), "__doc__", None) or ""
        if doc.split("\n", 1)[0] != signature:
            return None
    return v2 if isinstance(getattr(v2, "DriverError", None), type) else None


def _public_calls(drv):
    """``launch``'s three calls through cuda.bindings' public driver module ``drv``, with v2's form:
    int handles in and out, an exception (CudaError) on failure."""

    def ctx_get_current() -> int:
        status, ctx = drv.cuCtxGetCurrent()
        if status:
            check(status, "cuCtxGetCurrent")
        return int(ctx)

    def launch_kernel_ex(config, kernel: int, params: int, extra: int) -> None:
        status = drv.cuLaunchKernelEx(config, kernel, params, extra)[0]
        if status:
            check(status, "cuLaunchKernelEx")

    def event_record(event: int, stream: int) -> None:
        status = drv.cuEventRecord(event, stream)[0]
        if status:
            check(status, "cuEventRecord")

    return ctx_get_current, launch_kernel_ex, event_record


def bind_launch_calls(public: bool = False) -> bool:
    """Bind ``launch``'s driver calls, once: the v2 ones where cuda.bindings has them (True), else the
    public ones (False). ``public``: bind the public ones, even where v2 ones are there (tests, after
    ``forget_launch_calls``)."""
    global _ctx_get_current, _launch_kernel_ex, _event_record, _DriverError, _bound
    if _bound is None:
        v2 = None if public else _v2_driver()
        if v2 is not None:
            _ctx_get_current, _launch_kernel_ex, _event_record = (
                v2.ctx_get_current,
                v2.launch_kernel_ex,
                v2.event_record,
            )
            _DriverError, _bound = v2.DriverError, "v2"
        else:
            _ctx_get_current, _launch_kernel_ex, _event_record = _public_calls(driver())
            _DriverError, _bound = (), "public"
    return _bound == "v2"


def forget_launch_calls() -> None:
    """Unbind ``launch``'s calls and drop what was made with them (the configs, the primary contexts), so
    that the next launch_config binds anew: for tests that fake the driver, before and after."""
    global _bound
    _bound = None
    launch_config.cache_clear()
    _primary_context.cache_clear()


def launch(
    kernel: int, config: LaunchConfig, params: KernelParams, pointers: Sequence[int], done: int | None = None
) -> None:
    """Launch a kernel (``kernel_handle``) with ``config`` (``launch_config``: geometry, stream, device and
    attributes), ``params`` (the call signature's ``KernelParams``) and its seven ``pointers``, from any
    thread. The kernel lives in the device's primary context, and launches come from any thread
    (autograd's backward threads, a user's own), where another context, or none, may be current: that
    context is pushed for the launch and popped after it, so the thread's own state is left as it was.
    ``done``: an event (``create_event``) recorded right after the kernel, on the same stream.

    Where the primary context is current already (torch's threads), a launch makes three driver calls:
    cuCtxGetCurrent, cuLaunchKernelEx, cuEventRecord (tests/unit/test_stub_driver.py pins them). Its host
    cost against the stub driver, beside cuda.core's ``launch`` of the same arguments:
    scripts/launch_bench.sh, docs/PERF.md."""
    values, pointers_at, address = params.buffers
    # unpacked here, not starred into pack_into: a star-call costs about 60 ns more
    p_in, p_out, p_res, p_res_out, p_w, p_scale, p_scale_inv = pointers
    _PACK_POINTERS(values, pointers_at, p_in, p_out, p_res, p_res_out, p_w, p_scale, p_scale_inv)
    _, arg, stream_handle, context, context_address = config
    try:
        if _ctx_get_current() == context_address:
            _launch_kernel_ex(arg, kernel, address, 0)
            if done is not None:
                _event_record(done, stream_handle)
            return
        check(driver().cuCtxPushCurrent(context), "cuCtxPushCurrent")
        try:
            _launch_kernel_ex(arg, kernel, address, 0)
            if done is not None:
                _event_record(done, stream_handle)
        finally:
            check(driver().cuCtxPopCurrent(), "cuCtxPopCurrent")
    except _DriverError as exc:  # the v2 calls raise their own; ubnext's callers know CudaError
        raise CudaError(f"kernel launch failed: {type(exc).__name__}: {exc}") from exc


@contextlib.contextmanager
def primary_context(device_index: int):
    """The device's primary context (torch's) current on this thread for the block, and the
    thread's own context current again after it, whatever it was: none, another device's, or one
    of the caller's making. Pushed and popped, so the caller's context stack is left exactly as it
    was (cuda.core's Device.set_current would not do: 0.3 pushes without a pop where the current
    context belongs to another device, and 1.x replaces the current context)."""
    drv = driver()
    ctx, _ = _primary_context(device_index)
    check(drv.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")
    try:
        yield
    finally:
        check(drv.cuCtxPopCurrent(), "cuCtxPopCurrent")


def store_words(device_index: int, addresses: Sequence[int], value: int) -> None:
    """Write one 32-bit word at each address, device memory of this device or of a peer mapped into
    it, and wait until all are written: cuMemsetD32 each (no kernel, no stream of torch's) in the
    device's primary context, then one cuCtxSynchronize, from any thread."""
    drv = driver()
    with primary_context(device_index):
        for address in addresses:
            check(drv.cuMemsetD32(address, value, 1), "cuMemsetD32")
        check(drv.cuCtxSynchronize(), "cuCtxSynchronize")


class LaunchConfig(NamedTuple):
    """A launch's configuration as ``launch`` hands it to the driver. ``native``: the CUlaunchConfig, which
    owns the memory that ``arg`` may point to (its attributes too); ``arg``: what the bound
    cuLaunchKernelEx takes (the struct's address for the v2 calls, the object for cuda.bindings' public
    one); ``stream_handle``: the stream as an int, for cuEventRecord; ``context`` and
    ``context_address``: the device's primary context, which the launch makes current."""

    native: Any
    arg: Any
    stream_handle: int
    context: Any
    context_address: int


@functools.lru_cache(maxsize=256)
def launch_config(
    grid: int, block: int, stream_handle: int, pdl: bool, device_index: int, cluster: int = 1
) -> LaunchConfig:
    """cuLaunchKernelEx's CUlaunchConfig for a 1-D grid and block on a stream (its raw handle) of a
    device, with the programmatic-stream-serialization attribute when ``pdl`` (``pdl_enabled``): the
    kernel may then start before the previous kernel on the stream has ended, and waits for it in
    griddepcontrol.wait (csrc/device/ptx.cuh); and, when ``cluster`` > 1, the cluster-dimension attribute:
    consecutive CTAs in thread-block clusters of ``cluster`` (the Lamport row split, csrc/device/norm.cuh).
    Made once per geometry, stream and device: building one costs microseconds. Binds ``launch``'s driver
    calls (``bind_launch_calls``): every launch takes a config made here first."""
    v2 = bind_launch_calls()
    drv = driver()
    config = drv.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid, 1, 1
    config.blockDimX, config.blockDimY, config.blockDimZ = block, 1, 1
    config.sharedMemBytes = 0
    config.hStream = drv.CUstream(stream_handle)
    attributes = []  # one per launch attribute asked for, each with its own value
    if pdl:
        attribute = drv.CUlaunchAttribute()
        attribute.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attribute.value.programmaticStreamSerializationAllowed = 1
        attributes.append(attribute)
    if cluster > 1:
        attribute = drv.CUlaunchAttribute()
        attribute.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attribute.value.clusterDim.x, attribute.value.clusterDim.y, attribute.value.clusterDim.z = cluster, 1, 1
        attributes.append(attribute)
    if attributes:
        config.attrs = attributes
    config.numAttrs = len(attributes)
    context, context_address = _primary_context(device_index)
    return LaunchConfig(config, int(config.getPtr()) if v2 else config, stream_handle, context, context_address)


def max_active_clusters(kernel, block: int, cluster: int, device_index: int) -> int:
    """cuOccupancyMaxActiveClusters: how many clusters of ``cluster`` CTAs of ``block`` threads of ``kernel``
    (``kernel_handle``) the device holds at once when empty (0: none fits, e.g. an MPS share with few SMs),
    in the device's primary context. Asked once per call signature (Executor._launch_for)."""
    ctx, _ = _primary_context(device_index)
    config = launch_config(cluster, block, 0, False, device_index, cluster).native
    check(driver().cuCtxPushCurrent(ctx), "cuCtxPushCurrent")
    try:
        return int(check(driver().cuOccupancyMaxActiveClusters(kernel, config)))
    finally:
        check(driver().cuCtxPopCurrent(), "cuCtxPopCurrent")
