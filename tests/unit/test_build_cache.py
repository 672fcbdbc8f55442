"""The build cache's lock (compile once per node, bounded wait) and the driver check that
decides whether this NVRTC's cubins can load, with a faked driver."""

import threading
import time

import pytest

from ubnext import _cuda, _filelock, kernels


def test_lock_wait_is_bounded_and_names_the_holder(tmp_path):
    lock = tmp_path / "x.lock"
    with _filelock.exclusive(lock, "build x"):
        t0 = time.monotonic()
        with pytest.raises(_filelock.LockTimeout, match=r"to build x; it is held by pid \d+"):
            with _filelock.exclusive(lock, "build x", timeout=0.3):
                pass
        assert 0.3 <= time.monotonic() - t0 < 3
    with _filelock.exclusive(lock, "build x", timeout=0.3):  # released: taken at once
        pass


def test_ranks_that_miss_the_cache_together_compile_once(tmp_path, monkeypatch):
    monkeypatch.setenv("UBNEXT_CACHE_DIR", str(tmp_path))
    compiles = []

    def slow_compile(fname, arch, wants, defines=()):
        compiles.append(fname)
        time.sleep(0.5)
        return {want: want.upper().encode() + fname.encode() for want in wants}, ""

    monkeypatch.setattr(kernels, "nvrtc_version", lambda: "13.0")
    monkeypatch.setattr(kernels, "_nvrtc_images", slow_compile)
    results = []
    threads = [threading.Thread(target=lambda: results.append(kernels.compile_kernels("lamport.cu", "sm_90")))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert compiles == ["lamport.cu"], compiles
    assert [image for image, _ in results] == [b"CUBINlamport.cu"] * 4
    assert kernels.is_cached("lamport.cu", "sm_90") and not kernels.is_cached("nvls.cu", "sm_90")
    # the compile's PTX is kept beside its cubin: the ABI test reads it instead of compiling again
    assert kernels.compile_ptx("lamport.cu", "sm_90") == "PTXlamport.cu" and compiles == ["lamport.cu"]


@pytest.mark.parametrize("driver_cuda,nvrtc_major,ok", [
    (13000, 13, True), (13020, 13, True), (12080, 13, False), (12020, 13, False),
    (12020, 12, True), (13000, 12, True), (11080, 12, False),
])
def test_driver_check(driver_cuda, nvrtc_major, ok):
    problem = _cuda.driver_problem(driver_cuda, nvrtc_major)
    assert (problem is None) == ok, problem
    if not ok:
        version = f"{driver_cuda // 1000}.{driver_cuda % 1000 // 10}"
        assert f"supports CUDA {version}" in problem and "upgrade the driver" in problem


def test_old_driver_refuses_before_any_load(monkeypatch):
    monkeypatch.setattr(_cuda, "driver_version", lambda: 12080)  # R570
    monkeypatch.setattr(kernels, "nvrtc_version", lambda: "13.0")
    monkeypatch.setattr(kernels, "load_kernel", lambda *a: pytest.fail("loaded a kernel on an unsupported driver"))
    with pytest.raises(_cuda.CudaError, match=r"supports CUDA 12\.8.*R580 or newer"):
        kernels.load_all(0)
