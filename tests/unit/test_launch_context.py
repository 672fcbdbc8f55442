"""_cuda.launch runs with the device's primary context current on the calling thread (fake driver,
no GPU): kernels live in that context, and launches come from any thread (autograd's backward
threads, user threads), where another context, or none, may be current. The thread's own context
is restored after the launch."""

from __future__ import annotations

import threading

import pytest

driver = pytest.importorskip("cuda.bindings.driver")

import ubnext.runtime._cuda as cu  # noqa: E402

PRIMARY = {0: 0x1000, 1: 0x2000}


class FakeDriver:
    """Per-thread current context, as the driver keeps it; cuda.bindings' own structs and enums."""

    def __init__(self):
        self.local = threading.local()
        self.calls = []
        self.launches = []

    def __getattr__(self, name):  # CUlaunchConfig, CUstream, CUlaunchAttribute...: constructible without a GPU
        return getattr(driver, name)

    def cuDeviceGet(self, i):
        return (driver.CUresult.CUDA_SUCCESS, driver.CUdevice(i))

    def cuDevicePrimaryCtxRetain(self, dev):
        self.calls.append(("retain", int(dev)))
        return (driver.CUresult.CUDA_SUCCESS, driver.CUcontext(PRIMARY[int(dev)]))

    def cuCtxGetCurrent(self):
        return (driver.CUresult.CUDA_SUCCESS, driver.CUcontext(getattr(self.local, "ctx", 0)))

    def cuCtxPushCurrent(self, ctx):
        self.calls.append(("push", int(ctx)))
        self.local.stack = getattr(self.local, "stack", []) + [getattr(self.local, "ctx", 0)]
        self.local.ctx = int(ctx)
        return (driver.CUresult.CUDA_SUCCESS,)

    def cuCtxPopCurrent(self):
        self.calls.append(("pop", self.local.ctx))
        popped, self.local.ctx = self.local.ctx, self.local.stack.pop()
        return (driver.CUresult.CUDA_SUCCESS, driver.CUcontext(popped))

    def cuLaunchKernelEx(self, config, kernel, params, extra):
        # what the real driver requires: the kernel's context is current on this thread
        self.launches.append((threading.get_ident(), int(self.cuCtxGetCurrent()[1]), kernel, config, params))
        return (driver.CUresult.CUDA_SUCCESS,)

    def cuEventRecord(self, event, stream):
        self.calls.append(("record", event, stream))
        return (driver.CUresult.CUDA_SUCCESS,)


@pytest.fixture
def fakes(monkeypatch):
    """launch's calls bound to the fake driver (the public calls: the fake has no v2 module)."""
    drv = FakeDriver()
    cu.forget_launch_calls()
    monkeypatch.setattr(cu, "driver", lambda: drv)
    cu.bind_launch_calls(public=True)
    yield drv
    cu.forget_launch_calls()  # the next launch_config binds the real calls again


def test_launch_from_a_fresh_thread_and_after_another_device(fakes):
    drv = fakes
    params = cu.KernelParams(bytes(256), [])
    config = cu.launch_config(2, 128, 0x5A00, False, 1)  # on device 1
    after = {}

    def fresh_thread():  # no context current there
        cu.launch(0xABC, config, params, (0,) * 7, 0xE0)
        after["fresh"] = int(drv.cuCtxGetCurrent()[1])

    worker = threading.Thread(target=fresh_thread)
    worker.start()
    worker.join()
    drv.local.ctx = PRIMARY[0]  # this thread works on device 0
    cu.launch(0xABC, config, params, (0,) * 7)
    assert int(drv.cuCtxGetCurrent()[1]) == PRIMARY[0], "the launch left device 1's context current"
    drv.local.ctx = PRIMARY[1]
    cu.launch(0xABC, config, params, (0,) * 7)  # already current: no switch
    assert [ctx for _, ctx, *_ in drv.launches] == [PRIMARY[1]] * 3
    assert all(kernel == 0xABC and native is config.native for _, _, kernel, native, _ in drv.launches)
    assert after["fresh"] == 0
    assert [c[0] for c in drv.calls if c[0] in ("push", "pop")] == ["push", "pop"] * 2
    assert [c for c in drv.calls if c[0] == "record"] == [("record", 0xE0, 0x5A00)]  # `done`, on the stream
    assert [c for c in drv.calls if c[0] == "retain"] == [("retain", 1)]  # retained once


def test_the_launch_config_is_built_once_per_geometry_stream_and_device(fakes):
    """cuLaunchKernelEx's CUlaunchConfig (constructible without a GPU) costs microseconds to build:
    one per geometry, stream, PDL choice and device, with the grid, block and stream the launch asks
    for, the programmatic-stream-serialization attribute exactly when PDL is on, and the device's
    primary context."""
    pdl_id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    made = cu.launch_config(4, 256, 0x5A00, True, 0)
    config = made.native
    assert isinstance(config, driver.CUlaunchConfig) and made.arg is config  # the public calls take the object
    assert (config.gridDimX, config.gridDimY, config.gridDimZ) == (4, 1, 1)
    assert (config.blockDimX, config.blockDimY, config.blockDimZ) == (256, 1, 1)
    assert int(config.hStream) == 0x5A00 and config.sharedMemBytes == 0 and made.stream_handle == 0x5A00
    assert config.numAttrs == 1 and config.attrs[0].id == pdl_id
    assert config.attrs[0].value.programmaticStreamSerializationAllowed == 1
    assert made.context_address == PRIMARY[0] and int(made.context) == PRIMARY[0]
    assert cu.launch_config(4, 256, 0x5A00, True, 0) is made
    plain = cu.launch_config(4, 256, 0x5A00, False, 0)
    assert plain is not made and plain.native.numAttrs == 0
    assert int(cu.launch_config(4, 256, 0x5B00, True, 0).native.hStream) == 0x5B00
    assert cu.launch_config(4, 256, 0x5A00, True, 1).context_address == PRIMARY[1]


def test_capturing_asks_torch_only_for_a_usable_cuda_device(monkeypatch):
    """The capture query runs on every GPU op, so it skips torch.cuda.is_available(); a CUDA device
    object counts only where the GPU probe succeeded (torch's CPU build has CUDA device objects, and
    its capture query raises)."""
    import torch

    asked = []
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: asked.append(1) or True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("asked is_available on the hot path"))
    cu._is_cuda.cache_clear()
    try:
        monkeypatch.setattr(cu, "_probe", (False, "no GPU"))
        assert not cu.capturing(torch.device("cuda", 0)) and not cu.capturing(torch.device("cpu"))
        assert asked == []
        cu._is_cuda.cache_clear()
        monkeypatch.setattr(cu, "_probe", (True, "1 CUDA device(s)"))
        assert cu.capturing(torch.device("cuda", 0)) and asked == [1]
        assert not cu.capturing(torch.device("cpu")) and asked == [1]
    finally:
        cu._is_cuda.cache_clear()
