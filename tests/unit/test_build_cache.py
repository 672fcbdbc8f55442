"""The build cache: its lock (compile once per node, bounded wait), its key (by content, never by
path), the cubins carried to another machine (``python -m ubnext.kernels export``, UBNEXT_CUBIN_DIR),
and the driver check that decides whether a cubin's NVRTC can load, with a faked driver and NVRTC."""

import json
import logging
import shutil
import threading
import time
from pathlib import Path

import pytest

from ubnext import kernels
from ubnext.kernels.__main__ import main as kernels_main
from ubnext.runtime import _cuda, _filelock


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


@pytest.fixture
def own_csrc(tmp_path, monkeypatch):
    """A copy of csrc that the kernels compile and hash: sources edited meanwhile in the checkout
    cannot change the cache key in the middle of a test."""
    csrc = tmp_path / "csrc"
    shutil.copytree(kernels.CSRC, csrc)
    monkeypatch.setattr(kernels, "CSRC", csrc)
    return csrc


def test_ranks_that_miss_the_cache_together_compile_once(tmp_path, monkeypatch, own_csrc):
    monkeypatch.setenv("UBNEXT_CACHE_DIR", str(tmp_path))
    compiles = []

    def slow_compile(fname, arch, wants, defines=()):
        compiles.append(fname)
        time.sleep(0.5)
        return {want: want.upper().encode() + fname.encode() for want in wants}, ""

    monkeypatch.setattr(kernels, "nvrtc_version", lambda: "13.0")
    monkeypatch.setattr(kernels, "_nvrtc_images", slow_compile)
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(kernels.compile_kernels("lamport.cu", "sm_90")))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert compiles == ["lamport.cu"], compiles
    assert [image for image, _ in results] == [b"CUBINlamport.cu"] * 4
    assert kernels.is_cached("lamport.cu", "sm_90") and not kernels.is_cached("nvls.cu", "sm_90")
    # the compile's PTX is kept beside its cubin: the ABI test reads it instead of compiling again
    assert kernels.compile_ptx("lamport.cu", "sm_90") == "PTXlamport.cu" and compiles == ["lamport.cu"]


@pytest.mark.parametrize(
    "driver_cuda,nvrtc_major,ok",
    [
        (13000, 13, True),
        (13020, 13, True),
        (12080, 13, False),
        (12020, 13, False),
        (12020, 12, True),
        (13000, 12, True),
        (11080, 12, False),
    ],
)
def test_driver_check(driver_cuda, nvrtc_major, ok):
    problem = _cuda.driver_problem(driver_cuda, nvrtc_major)
    assert (problem is None) == ok, problem
    if not ok:
        version = f"{driver_cuda // 1000}.{driver_cuda % 1000 // 10}"
        assert f"supports CUDA {version}" in problem and "upgrade the driver" in problem


def test_old_driver_refuses_before_any_load(monkeypatch):
    monkeypatch.setattr(_cuda, "driver_version", lambda: 12080)  # R570
    monkeypatch.setattr(_cuda, "device_arch", lambda index: "sm_90")
    monkeypatch.setattr(kernels, "nvrtc_version", lambda: "13.0")
    monkeypatch.setattr(kernels, "_nvrtc_images", lambda *a: pytest.fail("compiled for an unsupported driver"))
    monkeypatch.setattr(kernels, "_load_file", lambda *a: pytest.fail("loaded a kernel on an unsupported driver"))
    with pytest.raises(_cuda.CudaError, match=r"supports CUDA 12\.8.*R580 or newer"):
        kernels.load_all(0)


# --- the cache key -------------------------------------------------------------------------------


def _checkout(csrc: Path, cuda: Path, monkeypatch) -> None:
    """Point the key computation at csrc and CUDA headers in other places (another checkout and
    virtual environment): kernels.CSRC and the include directories."""
    monkeypatch.setattr(kernels, "CSRC", csrc)
    monkeypatch.setattr(kernels, "_include_dirs", lambda: [csrc, cuda])


@pytest.fixture
def two_checkouts(tmp_path):
    """Two copies of csrc at different paths, and two paths to the same CUDA headers (a link:
    another venv's copy of the same wheel), copied once so that an edit of csrc meanwhile cannot
    make them differ."""
    first = tmp_path / "a" / "csrc"
    shutil.copytree(kernels.CSRC, first)
    second = tmp_path / "elsewhere" / "b" / "csrc"
    shutil.copytree(first, second)
    cuda = kernels.cuda_include_dir()
    other_venv = tmp_path / "venv2" / "include"
    other_venv.parent.mkdir()
    other_venv.symlink_to(cuda, target_is_directory=True)
    return (first, cuda), (second, other_venv)


def test_the_cache_key_is_the_same_in_another_checkout(two_checkouts, tmp_path, monkeypatch):
    """R7: the key holds no path. A cubin cached from one checkout is found from another checkout
    of the same sources with another venv's CUDA headers, without compiling."""
    monkeypatch.setenv("UBNEXT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(kernels, "nvrtc_version", lambda: "13.0")
    compiles = []
    monkeypatch.setattr(
        kernels,
        "_nvrtc_images",
        lambda fname, arch, wants, defines=(): (compiles.append(fname) or {w: b"image" for w in wants}, ""),
    )
    (csrc_a, cuda_a), (csrc_b, cuda_b) = two_checkouts
    _checkout(csrc_a, cuda_a, monkeypatch)
    key_a = kernels._cache_key("lamport.cu", "sm_90")
    assert kernels._cached_or_compiled("lamport.cu", "sm_90").origin == "compiled"
    assert str(csrc_a).encode() in b" ".join(kernels._options("sm_90", ())), "the compile itself uses the paths"
    _checkout(csrc_b, cuda_b, monkeypatch)
    assert kernels._cache_key("lamport.cu", "sm_90") == key_a
    assert kernels.is_cached("lamport.cu", "sm_90")
    assert kernels._cached_or_compiled("lamport.cu", "sm_90").origin == "cache" and compiles == ["lamport.cu"]


def _headers_with(tmp_path: Path, cuda: Path, changed: str) -> Path:
    """The CUDA include directory with one header's content changed (every other entry a link)."""
    copy = tmp_path / f"cuda-{changed.replace('/', '_')}"
    copy.mkdir()
    top = changed.split("/")[0]  # the changed header, or the folder that holds it
    for entry in cuda.iterdir():
        if entry.name != top:
            (copy / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
    if (cuda / top).is_dir():
        shutil.copytree(cuda / top, copy / top)
    else:
        shutil.copy(cuda / top, copy / top)
    with open(copy / changed, "a") as fh:
        fh.write("\n// changed\n")
    return copy


@pytest.mark.parametrize(
    "header,used",
    [("cuda_bf16.hpp", True), ("nv/target", True), ("cuda_fp4.h", False)],
    ids=["included-by-an-included-header", "angle-include-in-a-subfolder", "not-included"],
)
def test_the_cache_key_follows_the_cuda_headers_content(two_checkouts, tmp_path, monkeypatch, header, used):
    """A change in a CUDA header that the kernels include (directly or through another header)
    changes the key; a change in one they never include does not."""
    monkeypatch.setattr(kernels, "nvrtc_version", lambda: "13.0")
    (csrc, cuda), _ = two_checkouts
    _checkout(csrc, cuda, monkeypatch)
    key = kernels._cache_key("lamport.cu", "sm_90")
    _checkout(csrc, _headers_with(tmp_path, cuda, header), monkeypatch)
    assert (kernels._cache_key("lamport.cu", "sm_90") != key) == used


def test_the_cache_key_follows_the_sources_and_the_nvrtc_version(two_checkouts, tmp_path, monkeypatch):
    (csrc, cuda), _ = two_checkouts
    _checkout(csrc, cuda, monkeypatch)
    monkeypatch.setattr(kernels, "nvrtc_version", lambda: "13.0")
    key = kernels._cache_key("lamport.cu", "sm_90")
    assert kernels._cache_key("lamport.cu", "sm_100") != key and kernels._cache_key("nvls.cu", "sm_90") != key
    monkeypatch.setattr(kernels, "nvrtc_version", lambda: "13.1")
    assert kernels._cache_key("lamport.cu", "sm_90") != key
    monkeypatch.setattr(kernels, "nvrtc_version", lambda: "13.0")
    with open(csrc / "device" / "ptx.cuh", "a") as fh:
        fh.write("\n// changed\n")
    assert kernels._cache_key("lamport.cu", "sm_90") != key


# --- carried cubins ------------------------------------------------------------------------------


def _fake_nvrtc(compiles: list):
    """NVRTC's stand-in: an image naming the file and arch, and a ptxas log for each kernel."""

    def images(fname, arch, wants, defines=()):
        compiles.append((fname, arch))
        log = "".join(
            f"ptxas info    : Compiling entry function '{name}' for '{arch}'\n"
            f"ptxas info    : Used 40 registers, used 1 barriers\n"
            for name in kernels.sources()[fname]
        )
        return {want: f"{want} of {fname} for {arch}".encode() for want in wants}, log

    return images


@pytest.fixture
def exported(tmp_path, monkeypatch, own_csrc):
    """Cubins exported by NVRTC "12.8" (faked) from a copy of csrc, into tmp_path/carried, through the
    command line; then an empty cache and UBNEXT_CUBIN_DIR pointing at the export."""
    monkeypatch.setenv("UBNEXT_CACHE_DIR", str(tmp_path / "cache-here"))
    monkeypatch.setattr(kernels, "nvrtc_version", lambda: "12.8")
    compiles = []
    monkeypatch.setattr(kernels, "_nvrtc_images", _fake_nvrtc(compiles))
    assert kernels_main(["export", "--arch", "sm_90", "--to", str(tmp_path / "carried")]) == 0
    assert sorted(compiles) == sorted((f, "sm_90") for f in kernels.sources())
    # the other machine: its own NVRTC, an empty cache, and the carried folder
    monkeypatch.setattr(kernels, "nvrtc_version", lambda: "13.0")
    monkeypatch.setenv("UBNEXT_CACHE_DIR", str(tmp_path / "cache-there"))
    monkeypatch.setenv("UBNEXT_CUBIN_DIR", str(tmp_path / "carried"))
    compiles.clear()
    return tmp_path / "carried", own_csrc, compiles


def test_exported_cubins_round_trip(exported):
    """The manifest names, per file and arch, the source hash, the NVRTC that built the cubin, its
    file and resources; the other machine uses each carried cubin as it is, without compiling, and
    says which NVRTC built it and that it was carried."""
    folder, _, compiles = exported
    manifest = json.loads((folder / kernels.MANIFEST).read_text())
    assert sorted(manifest["files"]) == sorted(kernels.sources())
    for fname, names in kernels.sources().items():
        entry = manifest["files"][fname]["sm_90"]
        assert entry["source_hash"] == kernels.source_hash() and entry["nvrtc"] == "12.8"
        assert (folder / entry["cubin"]).read_bytes() == f"cubin of {fname} for sm_90".encode()
        assert sorted(r["name"] for r in entry["resources"]) == sorted(names)
        cubin = kernels.cubin_for(fname, "sm_90")
        assert (cubin.origin, cubin.nvrtc, cubin.image) == ("carried", "12.8", f"cubin of {fname} for sm_90".encode())
        assert [r.registers for r in cubin.resources] == [40] * len(names)
    assert compiles == []
    assert kernels.cubin_for("lamport.cu", "sm_100").origin == "compiled", "no carried cubin for that arch"


def test_a_stale_carried_cubin_is_ignored_and_logged(exported, caplog):
    """A carried cubin built from other sources than this checkout's is not used: the cubin is
    compiled here, and the log says which one was ignored and why."""
    folder, csrc, compiles = exported
    with open(csrc / "device" / "ptx.cuh", "a") as fh:
        fh.write("\n// edited after the export\n")
    with caplog.at_level(logging.WARNING, logger="ubnext"):
        cubin = kernels.cubin_for("lamport.cu", "sm_90")
    assert (cubin.origin, cubin.nvrtc) == ("compiled", "13.0") and compiles == [("lamport.cu", "sm_90")]
    assert "ignoring the carried cubin of lamport.cu for sm_90" in caplog.text
    assert "it was built from sources" in caplog.text


def test_a_truncated_carried_cubin_is_ignored_and_logged(exported, caplog):
    folder, _, compiles = exported
    manifest = json.loads((folder / kernels.MANIFEST).read_text())
    cubin_file = folder / manifest["files"]["nvls.cu"]["sm_90"]["cubin"]
    cubin_file.write_bytes(cubin_file.read_bytes()[:5])
    with caplog.at_level(logging.WARNING, logger="ubnext"):
        assert kernels.cubin_for("nvls.cu", "sm_90").origin == "compiled"
    assert "its sha256 differs" in caplog.text


@pytest.fixture
def fake_gpu(monkeypatch):
    """load_all up to the driver: an sm_90, and the cubins each file would load, recorded."""
    monkeypatch.setattr(_cuda, "device_arch", lambda index: "sm_90")
    loads = {}
    monkeypatch.setattr(kernels, "_load_file", lambda cubin, index: loads.__setitem__(cubin.fname, cubin))
    return loads


def test_load_all_checks_the_driver_against_the_carried_cubins_nvrtc(exported, fake_gpu, monkeypatch):
    """The carried cubins' NVRTC (12.8) is what the driver must load, not this machine's (13.0): a
    CUDA 12.8 driver, which refuses this NVRTC's cubins, loads them."""
    monkeypatch.setattr(_cuda, "driver_version", lambda: 12080)
    kernels.load_all(0)
    assert sorted(fake_gpu) == sorted(kernels.sources())
    assert {(c.origin, c.nvrtc) for c in fake_gpu.values()} == {("carried", "12.8")}
    assert exported[2] == [], "compiled although every cubin was carried"


def test_load_all_refuses_a_stale_carried_cubin_on_a_driver_for_carried_ones_only(exported, fake_gpu, monkeypatch):
    """One carried cubin stale: that file needs this NVRTC (13.0), which the CUDA 12.8 driver
    refuses: the driver problem is raised before anything compiles or loads."""
    folder, csrc, compiles = exported
    monkeypatch.setattr(_cuda, "driver_version", lambda: 12080)
    manifest = json.loads((folder / kernels.MANIFEST).read_text())
    manifest["files"]["twoshot.cu"]["sm_90"]["source_hash"] = "0" * 24
    (folder / kernels.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(_cuda.CudaError, match=r"supports CUDA 12\.8.*NVRTC 13"):
        kernels.load_all(0)
    assert fake_gpu == {} and compiles == []


def test_load_all_leaves_a_carried_cubin_the_driver_cannot_load(exported, fake_gpu, monkeypatch, caplog):
    """Carried cubins of NVRTC 13.0 on a CUDA 12.8 driver, which cannot load them: this machine's
    NVRTC (12.8) builds them instead, and the log says why the carried ones were left."""
    folder, _, compiles = exported
    manifest = json.loads((folder / kernels.MANIFEST).read_text())
    for archs in manifest["files"].values():
        archs["sm_90"]["nvrtc"] = "13.0"
    (folder / kernels.MANIFEST).write_text(json.dumps(manifest))
    monkeypatch.setattr(kernels, "nvrtc_version", lambda: "12.8")
    monkeypatch.setattr(_cuda, "driver_version", lambda: 12080)
    with caplog.at_level(logging.WARNING, logger="ubnext"):
        kernels.load_all(0)
    assert {(c.origin, c.nvrtc) for c in fake_gpu.values()} == {("compiled", "12.8")}
    assert sorted(compiles) == sorted((f, "sm_90") for f in kernels.sources())
    assert "not using the carried cubin of lamport.cu (NVRTC 13.0)" in caplog.text
