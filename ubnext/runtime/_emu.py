"""Binding of the CPU emulator (``csrc/emu``, ``libubnext_emu.so``).

The emulator runs the real kernel sources (``csrc/kernels/*.cu``) as host C++: g++ compiles
them with ``-DUBNEXT_EMULATOR`` together with the emulator runtime (``csrc/emu/*.cpp``) and its
self-test kernels (``csrc/emu/*.cu``) into one shared library. See ``csrc/emu/README.md``.

This is host code, and the only module of ubnext that uses ctypes.

API::

    path = build(break_name="")        # compile (or reuse the cached) library, return its path
    emu = load(break_name="")          # build + dlopen once per process and break name
    emu.launch(kernel, grid, block, [("desc", d), ("ptr", p), ("i32", n), ("f32", eps), ...], pdl=True)
    emu.griddep()                      # GridDep of the last launch
    handle = emu.register(rank, nranks, peer_bases, nbytes, mc_base)
    emu.unregister(handle)
    mc = emu.reserve(nbytes); emu.release(mc, nbytes)
    emu.traffic()                      # Traffic of the last launch
    emu.configure(chaos, seed)
    emu.register_stamps(handle, stamp_bases); emu.set_counting(True)
    emu.share_progress(path)           # count mode: timeouts in stall time, shared by the ranks
    with emu.recording() as launches:  # count mode: one LaunchCount per launch inside the block
        ...

``python -m ubnext.runtime._emu build [--break NAME | --all]`` builds ahead of time and prints the path(s).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from .. import envs
from ._build_progress import announce
from ._filelock import exclusive
from ._sources import CSRC

__all__ = ["BREAKS", "EmulatorError", "Traffic", "LaunchCount", "GridDep", "Emulator", "build", "load"]

# Test-only protocol breaks: name -> macro. "" is the correct build.
BREAKS = {
    "": None,
    "skip_repoison": "UBNEXT_BREAK_SKIP_REPOISON",
    "no_release": "UBNEXT_BREAK_NO_RELEASE",
    "skip_barrier": "UBNEXT_BREAK_SKIP_BARRIER",
    "no_header_check": "UBNEXT_BREAK_NO_HEADER_CHECK",
    "single_header_slot": "UBNEXT_BREAK_SINGLE_HEADER_SLOT",
    "no_abort_check": "UBNEXT_BREAK_NO_ABORT_CHECK",
    "no_proxy_fence_nvls_twoshot": "UBNEXT_BREAK_NO_PROXY_FENCE_NVLS_TWOSHOT",
    "twoshot_drop_peer": "UBNEXT_BREAK_TWOSHOT_DROP_PEER",
    "allgather_short_push": "UBNEXT_BREAK_ALLGATHER_SHORT_PUSH",
    "no_lamport_header_check": "UBNEXT_BREAK_NO_LAMPORT_HEADER_CHECK",
    "no_eps_check": "UBNEXT_BREAK_NO_EPS_CHECK",
    "no_departure_check": "UBNEXT_BREAK_NO_DEPARTURE_CHECK",
    "extra_fence": "UBNEXT_BREAK_EXTRA_FENCE",
    "ssq_block_order": "UBNEXT_BREAK_SSQ_BLOCK_ORDER",
    "two_roundings": "UBNEXT_BREAK_TWO_ROUNDINGS",
    "cluster_ssq_order": "UBNEXT_BREAK_CLUSTER_SSQ_ORDER",
    "twoshot_reverse_order": "UBNEXT_BREAK_TWOSHOT_REVERSE_ORDER",
    "rank_order_ignored": "UBNEXT_BREAK_RANK_ORDER_IGNORED",
    "poll_reads_once": "UBNEXT_BREAK_POLL_READS_ONCE",
    # not protocols but layouts: comm.quantize's NVFP4 nibble order and to_blocked swizzle (blockscale.cuh)
    "nvfp4_nibble_order": "UBNEXT_BREAK_NVFP4_NIBBLE_ORDER",
    "swizzle": "UBNEXT_BREAK_SWIZZLE",
    "no_pdl_wait": "UBNEXT_BREAK_NO_PDL_WAIT",
    # the error word copied without its lock (barrier.cuh write_error_word): racing reports mix their records
    "err_no_claim": "UBNEXT_BREAK_ERR_NO_CLAIM",
    # not a break: the Lamport one-shot's per-phase stamps (csrc/device/stamps.cuh, tests/gpu_check/stamps.py)
    "stamps": "UBNEXT_STAMPS",
}
# what a test-only build adds to the flags: an object's key leaves it out (_object_key)
_BUILD_FLAGS = frozenset(f"-D{macro}" for macro in BREAKS.values() if macro)
# -g1: line tables for backtraces, at a quarter less compile time than -g (the suite builds ~120 objects)
CXXFLAGS = (
    "-std=c++20",
    "-O2",
    "-g1",
    "-fPIC",
    "-pthread",
    "-fvisibility=hidden",
    "-Wall",
    "-Wno-unused-function",
    "-DUBNEXT_EMULATOR",
)
MAX_RANKS = 16
MAX_GRID = 256  # UBNEXT_EMU_MAX_GRID: count mode launches the GPU's grids (up to 128 blocks, and some room)
TRAFFIC_WORDS = 4 * MAX_RANKS + 7
COUNT_WORDS = 5
# Bytes of stamp shadow per byte of a region in count mode (three 8-byte words per 4-byte word).
STAMP_BYTES_PER_BYTE = 6
_ERRLEN = 1024


class EmulatorError(RuntimeError):
    """A launch the emulator refused or a kernel that failed (deadlock in a block, __trap)."""


def _sources() -> list[Path]:
    """Translation units of the library: the runtime, its self-test kernels, every kernel, and the
    one-GPU check's probes (csrc/probes: test-only kernels, run here to check what they compute)."""
    return (
        sorted((CSRC / "emu").glob("*.cpp"))
        + sorted((CSRC / "emu").glob("*.cu"))
        + sorted((CSRC / "kernels").glob("*.cu"))
        + sorted((CSRC / "probes").glob("*.cu"))
    )


def _include_dirs() -> list[Path]:
    from ..kernels import cuda_include_dir

    # The shim directory goes last: it only supplies crt/host_defines.h where the CUDA headers
    # come from the pip wheel, which lacks it (csrc/emu/shim/crt/host_defines.h says why).
    return [CSRC, cuda_include_dir(), CSRC / "emu" / "shim"]


def _compiler() -> str:
    cxx = shutil.which("g++")
    if cxx is None:
        raise EmulatorError("the emulator needs g++ (C++20), which is not on PATH")
    return cxx


@functools.cache
def _compiler_version(cxx: str) -> str:
    return subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout


def _flags(break_name: str) -> list[str]:
    if break_name not in BREAKS:
        raise ValueError(f"unknown emulator break {break_name!r}; known: {sorted(BREAKS)}")
    flags = list(CXXFLAGS)
    if BREAKS[break_name]:
        flags.append(f"-D{BREAKS[break_name]}")
    return flags + [f"-I{d}" for d in _include_dirs()]


def _build_key(cxx: str, flags: Sequence[str]) -> str:
    h = hashlib.sha256()
    for path in sorted(p for p in CSRC.rglob("*") if p.suffix in (".h", ".cuh", ".cu", ".cpp", ".hpp")):
        h.update(str(path.relative_to(CSRC)).encode() + b"\0" + path.read_bytes())
    inc = _include_dirs()[1]
    for name in ("cuda_bf16.h", "cuda_fp16.h", "cuda_fp8.h", "vector_types.h"):
        if (inc / name).exists():
            h.update((inc / name).read_bytes())
    h.update("\0".join(flags).encode())
    h.update(_compiler_version(cxx).encode())
    return h.hexdigest()[:20]


def _object_key(cxx: str, flags: Sequence[str], src: Path, lang: Sequence[str]) -> str:
    """What an object file depends on: its preprocessed text (every header it includes, every macro
    it sees, a test-only build's macro among them), the other flags and the compiler. A test-only macro
    that a translation unit never sees leaves its key, so those builds share that object."""
    proc = subprocess.run([cxx, *flags, *lang, "-E", str(src)], capture_output=True)
    if proc.returncode != 0:
        raise EmulatorError(f"g++ -E failed on {src.relative_to(CSRC.parent)}:\n{proc.stderr.decode()[-8000:]}")
    h = hashlib.sha256(proc.stdout)
    h.update("\0".join(f for f in flags if f not in _BUILD_FLAGS).encode())
    h.update(_compiler_version(cxx).encode())
    return h.hexdigest()[:20]


def _compile(cxx: str, flags: Sequence[str], sources: Iterable[Path], workdir: Path, out: Path, objects: Path) -> None:
    """Link ``out`` from the objects of ``sources``, each compiled into ``objects`` unless an
    object with its key is there already."""
    sources = list(sources)
    objects.mkdir(parents=True, exist_ok=True)

    def one(src: Path) -> Path:
        lang = ["-x", "c++"] if src.suffix == ".cu" else []
        obj = objects / f"{src.parent.name}_{src.stem}-{_object_key(cxx, flags, src, lang)}.o"
        if obj.exists():
            return obj
        tmp = workdir / obj.name
        proc = subprocess.run([cxx, *flags, *lang, "-c", str(src), "-o", str(tmp)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise EmulatorError(f"g++ failed on {src.relative_to(CSRC.parent)}:\n{proc.stderr[-8000:]}")
        os.replace(tmp, obj)  # atomic: a build beside this one finds the whole object or none
        return obj

    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        objs = list(pool.map(one, sources))
    proc = subprocess.run(
        [cxx, "-shared", "-pthread", *map(str, objs), "-ldl", "-o", str(out)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise EmulatorError(f"linking the emulator failed:\n{proc.stderr[-8000:]}")


def build(break_name: str = "", *, force: bool = False) -> Path:
    """Compile the emulator library (or find it in the cache) and return its path.

    The cache is ``UBNEXT_CACHE_DIR/emu/``, keyed by every source under csrc/, the flags (the
    break name among them), the CUDA headers and the compiler version; its objects under ``obj/``,
    keyed by their preprocessed text (``_object_key``), so a broken build compiles only the
    translation units its macro reaches. ``force`` compiles every object afresh. Ranks that build at once
    are safe: one builds under a file lock (bounded wait), into a temporary file renamed into
    place; the others wait and load it.
    """
    cxx = _compiler()
    flags = _flags(break_name)
    key = _build_key(cxx, flags)
    cache = Path(envs.get("UBNEXT_CACHE_DIR")) / "emu"
    cache.mkdir(parents=True, exist_ok=True)
    lib = cache / f"libubnext_emu-{break_name or 'ok'}-{key}.so"
    if lib.exists() and not force:
        return lib
    with exclusive(cache / f".lock-{key}", f"build the emulator library {lib.name}"):
        if lib.exists() and not force:
            return lib
        with announce("the CPU emulator library", lib), tempfile.TemporaryDirectory(dir=cache, prefix=".build-") as tmp:
            out = Path(tmp) / lib.name
            _compile(cxx, flags, _sources(), Path(tmp), out, objects=Path(tmp) / "obj" if force else cache / "obj")
            os.replace(out, lib)
    return lib


@dataclass(frozen=True)
class Traffic:
    """Memory traffic of one launch on this rank. Peer lists are indexed by rank (own rank: 0).
    Multicast accesses are counted once each, at their size."""

    peer_store_bytes: tuple[int, ...]
    peer_store_ops: tuple[int, ...]
    peer_load_bytes: tuple[int, ...]
    peer_load_ops: tuple[int, ...]
    mc_store_bytes: int
    mc_store_ops: int
    mc_ld_reduce_bytes: int
    mc_ld_reduce_ops: int
    mc_red_bytes: int
    mc_red_ops: int
    peer_atomic_ops: int  # atomics on a peer's memory: none allowed (PCIe peers may lack them)


_ARG_TYPES: dict[str, type[ctypes._SimpleCData]] = {
    "ptr": ctypes.c_void_p,
    "i32": ctypes.c_int32,
    "f32": ctypes.c_float,
}
DESC_BYTES = 8 * (16 + 16)  # sizeof(ubnext_comm_desc): 16 u64 fields, then 16 peer bases (desc.cuh)
LAUNCH_PDL = 1  # UBNEXT_EMU_LAUNCH_PDL (emu_api.h)
LAUNCH_CLUSTER_NONPORTABLE = 2  # UBNEXT_EMU_LAUNCH_CLUSTER_NONPORTABLE
GRIDDEP_WORDS = 3


class GridDep(NamedTuple):
    """griddepcontrol in the last launch that succeeded: its threads, and how many of them executed
    the wait and launch_dependents (csrc/device/ptx.cuh)."""

    threads: int
    waited: int
    launched: int


def _desc_arg(kernel: str, value) -> ctypes.Array:
    """The descriptor's bytes (bytes, or a uint64 numpy array as the tests pack it; 0 or None: all
    zero) as the buffer that parameter 0 points to."""
    raw = bytes(DESC_BYTES) if value is None or (isinstance(value, int) and value == 0) else bytes(value)
    if len(raw) != DESC_BYTES:
        raise EmulatorError(f"{kernel}: the descriptor is {DESC_BYTES} bytes, got {len(raw)}")
    return ctypes.create_string_buffer(raw, DESC_BYTES)


class LaunchCount(NamedTuple):
    """One launch's critical-path count (count mode; csrc/emu/memory.cpp states the rules):
    ``hops`` is the longest chain of NVLink crossings, ``fences`` the system-scope fences on it,
    ``max_cta_bytes`` the most bytes one block moved, ``total_bytes`` all blocks' bytes;
    ``nvlink_bytes`` what this rank stored into and loaded from peers' memory through unicast,
    ``multicast_bytes`` through the multicast address (from the traffic counters)."""

    kernel: str
    ctas: int
    block: int
    hops: int
    fences: int
    max_cta_bytes: int
    total_bytes: int
    nvlink_bytes: int
    multicast_bytes: int


class Emulator:
    """The loaded library. One launch runs at a time per process (the library serialises)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        lib = ctypes.CDLL(str(path))
        u64, i64, i32 = ctypes.c_uint64, ctypes.c_int64, ctypes.c_int
        lib.ubnext_emu_launch.argtypes = [
            ctypes.c_char_p,
            i32,
            i32,
            i32,
            ctypes.POINTER(ctypes.c_void_p),
            i32,
            ctypes.c_char_p,
            i32,
        ]
        lib.ubnext_emu_launch.restype = i32
        lib.ubnext_emu_register.argtypes = [i32, i32, ctypes.POINTER(u64), u64, u64]
        lib.ubnext_emu_register.restype = i64
        lib.ubnext_emu_unregister.argtypes = [i64]
        lib.ubnext_emu_unregister.restype = i32
        lib.ubnext_emu_reserve.argtypes = [u64]
        lib.ubnext_emu_reserve.restype = u64
        lib.ubnext_emu_release.argtypes = [u64, u64]
        lib.ubnext_emu_release.restype = i32
        lib.ubnext_emu_traffic.argtypes = [ctypes.POINTER(u64), i32]
        lib.ubnext_emu_traffic.restype = i32
        lib.ubnext_emu_configure.argtypes = [i32, u64]
        lib.ubnext_emu_configure.restype = None
        lib.ubnext_emu_set_watchdog_ns.argtypes = [u64]
        lib.ubnext_emu_set_watchdog_ns.restype = None
        lib.ubnext_emu_share_progress.argtypes = [ctypes.c_char_p]
        lib.ubnext_emu_share_progress.restype = i32
        lib.ubnext_emu_register_stamps.argtypes = [i64, ctypes.POINTER(u64)]
        lib.ubnext_emu_register_stamps.restype = i32
        lib.ubnext_emu_set_counting.argtypes = [i32]
        lib.ubnext_emu_set_counting.restype = None
        lib.ubnext_emu_counts.argtypes = [ctypes.POINTER(u64), i32]
        lib.ubnext_emu_counts.restype = i32
        lib.ubnext_emu_griddep.argtypes = [ctypes.POINTER(u64), i32]
        lib.ubnext_emu_griddep.restype = i32
        self._lib = lib
        self._watchdog_s: float | None = None
        self._counting = False
        self._recorded: list[LaunchCount] | None = None

    def launch(
        self,
        kernel: str,
        grid: int,
        block: int,
        args: Sequence[tuple[str, Any]],  # each value's type follows its kind: bytes, an int, a float, None
        *,
        timeout_s: float | None = None,
        pdl: bool = False,
        cluster: int = 1,
        nonportable_cluster: bool = False,
    ) -> None:
        """Run ``kernel`` (extern "C" in the library) on ``grid`` x ``block`` emulated threads,
        synchronously. ``args`` is the kernel's parameter list as (type, value) pairs, type in
        "ptr" (int address or 0/None), "i32", "f32". Raises EmulatorError on failure. A launch
        that does not end within the watchdog (``set_watchdog``, else 3 x the kernels' timeout
        ``timeout_s``, else 3 x UBNEXT_TIMEOUT or 30 min) aborts the process with a report: a
        hang must not outlive the test that caused it. ``cluster``: blocks per thread-block cluster (the GPU's
        cluster-dimension attribute; ``grid`` a multiple of it, at most 8 unless ``nonportable_cluster``, as
        the non-portable-cluster-size attribute, allows 16)."""
        if len(args) != 12:
            raise EmulatorError(f"{kernel}: the kernel ABI has 12 parameters, got {len(args)}")
        values: list[ctypes._CData] = []
        for i, (kind, value) in enumerate(args):
            if kind == "desc":
                values.append(_desc_arg(kernel, value))
                continue
            if kind not in _ARG_TYPES:
                raise EmulatorError(f"{kernel}: parameter {i} has unknown type {kind!r}")
            # numpy scalars and None are accepted: convert to the Python type ctypes wants
            values.append(_ARG_TYPES[kind](float(value or 0) if kind == "f32" else int(value or 0)))
        ptrs = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
        watchdog = self._watchdog_s or 3.0 * (timeout_s or envs.get("UBNEXT_TIMEOUT") or 1800.0)
        self._lib.ubnext_emu_set_watchdog_ns(int(watchdog * 1e9))
        err = ctypes.create_string_buffer(_ERRLEN)
        flags = (LAUNCH_PDL if pdl else 0) | (LAUNCH_CLUSTER_NONPORTABLE if nonportable_cluster else 0)
        rc = self._lib.ubnext_emu_launch(
            kernel.encode(), int(grid), int(block), int(cluster), ptrs, flags, err, _ERRLEN
        )
        if rc != 0:
            raise EmulatorError(
                f"emulator launch of {kernel} (grid {grid}, block {block}) failed: {err.value.decode(errors='replace')}"
            )
        if self._counting and self._recorded is not None:
            words = (ctypes.c_uint64 * COUNT_WORDS)()
            self._lib.ubnext_emu_counts(words, COUNT_WORDS)
            ctas, hops, fences, most, total = words
            t = self.traffic()
            self._recorded.append(
                LaunchCount(
                    kernel,
                    ctas,
                    int(block),
                    hops,
                    fences,
                    most,
                    total,
                    sum(t.peer_store_bytes) + sum(t.peer_load_bytes),
                    t.mc_store_bytes + t.mc_ld_reduce_bytes + t.mc_red_bytes,
                )
            )

    def griddep(self) -> GridDep:
        """griddepcontrol of the last launch that succeeded (GridDep)."""
        words = (ctypes.c_uint64 * GRIDDEP_WORDS)()
        self._lib.ubnext_emu_griddep(words, GRIDDEP_WORDS)
        return GridDep(*words)

    def set_watchdog(self, seconds: float | None) -> None:
        """Override the watchdog bound of later launches (None: from the kernels' timeout)."""
        self._watchdog_s = seconds

    def register(self, rank: int, nranks: int, peer_bases: Sequence[int], nbytes: int, mc_base: int = 0) -> int:
        """Tell the twins about a symmetric region: ``peer_bases[r]`` is rank r's copy as mapped
        in this process, each ``nbytes`` long; ``mc_base`` its multicast range (``reserve``) or 0.
        Returns the handle for ``unregister``. Not while a launch runs."""
        if len(peer_bases) != nranks:
            raise ValueError(f"{len(peer_bases)} peer bases for {nranks} ranks")
        bases = (ctypes.c_uint64 * max(1, nranks))(*peer_bases)
        handle = self._lib.ubnext_emu_register(rank, nranks, bases, nbytes, mc_base or 0)
        if handle < 0:
            raise EmulatorError(
                f"cannot register a region (rank {rank} of {nranks}, {nbytes} bytes): bad arguments or too many regions"
            )
        return int(handle)

    def unregister(self, handle: int) -> None:
        if self._lib.ubnext_emu_unregister(handle) != 0:
            raise EmulatorError(f"no registered region {handle}")

    def reserve(self, nbytes: int) -> int:
        """An inaccessible address range to use as a multicast address (a plain access faults)."""
        addr = self._lib.ubnext_emu_reserve(nbytes)
        if not addr:
            raise EmulatorError(f"cannot reserve {nbytes} bytes of address space")
        return int(addr)

    def release(self, addr: int, nbytes: int) -> None:
        if self._lib.ubnext_emu_release(addr, nbytes) != 0:
            raise EmulatorError(f"cannot release {nbytes} bytes at {addr:#x}")

    def traffic(self) -> Traffic:
        """Traffic counters of the last launch."""
        words = (ctypes.c_uint64 * TRAFFIC_WORDS)()
        self._lib.ubnext_emu_traffic(words, TRAFFIC_WORDS)
        w = list(words)
        r = MAX_RANKS
        return Traffic(
            tuple(w[0:r]), tuple(w[r : 2 * r]), tuple(w[2 * r : 3 * r]), tuple(w[3 * r : 4 * r]), *w[4 * r : 4 * r + 7]
        )

    def register_stamps(self, handle: int, stamp_bases: Sequence[int]) -> None:
        """Count mode: rank r's copy of region ``handle`` has its stamps at ``stamp_bases[r]``,
        ``STAMP_BYTES_PER_BYTE`` times its size, zero-filled and shared like the copy."""
        bases = (ctypes.c_uint64 * max(1, len(stamp_bases)))(*stamp_bases)
        if self._lib.ubnext_emu_register_stamps(handle, bases) != 0:
            raise EmulatorError(f"no registered region {handle}")

    def share_progress(self, path: str | os.PathLike | None) -> None:
        """Count mode: share the progress page ``path`` (a file, created if missing) with every rank
        that passes the same path; the kernels' timeouts and the watchdog then count stall time,
        time in which no rank made progress, not wall-clock time (csrc/emu/sched.cpp). None: no page."""
        raw = os.fsencode(path) if path is not None else None
        rc = self._lib.ubnext_emu_share_progress(raw)
        if rc != 0:
            raise EmulatorError(f"cannot map the progress page {path}: {os.strerror(rc) if rc > 0 else rc}")

    def set_counting(self, on: bool) -> None:
        """Count mode on/off for later launches (csrc/emu/memory.cpp)."""
        self._counting = bool(on)
        self._lib.ubnext_emu_set_counting(1 if on else 0)

    @contextlib.contextmanager
    def recording(self):
        """Count mode: yields a list that receives one LaunchCount per launch made inside the block."""
        if not self._counting:
            raise EmulatorError("recording launches needs count mode (UBNEXT_EMU_COUNT=1)")
        previous, self._recorded = self._recorded, []
        try:
            yield self._recorded
        finally:
            self._recorded = previous

    def configure(self, chaos: bool, seed: int = 0) -> None:
        """Chaos mode on/off for later launches; seed 0 derives one from the time and pid."""
        self._lib.ubnext_emu_configure(1 if chaos else 0, int(seed) & (2**64 - 1))


_loaded: dict[str, Emulator] = {}
_load_lock = threading.Lock()


def load(break_name: str = "") -> Emulator:
    """The emulator library for ``break_name`` ("" = correct build), built and loaded once."""
    with _load_lock:
        if break_name not in _loaded:
            _loaded[break_name] = Emulator(build(break_name))
        return _loaded[break_name]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ubnext.runtime._emu", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build the emulator library and print its path")
    b.add_argument(
        "--break",
        dest="break_name",
        default="",
        choices=sorted(BREAKS),
        help="TEST ONLY: a deliberately broken protocol build",
    )
    b.add_argument(
        "--all", action="store_true", help="also every test-only broken build (the test suite's, ahead of its tiers)"
    )
    b.add_argument("--force", action="store_true", help="rebuild even if cached")
    ns = parser.parse_args(argv)
    try:
        print(build(ns.break_name, force=ns.force))
        if ns.all:
            # the correct build first: the broken builds share most of its objects
            with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
                for path in pool.map(lambda name: build(name, force=ns.force), sorted(set(BREAKS) - {ns.break_name})):
                    print(path)
    except EmulatorError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
