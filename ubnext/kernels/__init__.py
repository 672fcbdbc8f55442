"""Kernel registry, NVRTC compilation to cubin, the on-disk cache and loading.

Kernels are compiled from ``csrc/`` by NVRTC (through cuda.bindings) to a cubin for the
GPU's exact architecture. PTX is never handed to the driver: PTX from a newer NVRTC fails to
JIT on an older driver, a cubin does not need the JIT. Cubins are cached under
``UBNEXT_CACHE_DIR/cubin``, keyed by the content of csrc's sources and of the CUDA headers they
include, the architecture, the options (include directories by role, not by path) and the NVRTC
version: a cache filled in one checkout or virtual environment serves another with the same
contents. A folder of cubins exported by ``python -m ubnext.kernels export`` (``UBNEXT_CUBIN_DIR``)
is used before the cache and before compiling, where its source hash matches.

``python -m ubnext.kernels build --arch sm_90 sm_100`` compiles everything ahead of time
(no GPU needed) and prints each kernel's registers, spills and shared memory.

Loading (``load_all``) loads every kernel into the device's primary context at once
(``cuFuncLoad``), not at its first launch: under lazy loading (``CUDA_MODULE_LOADING=LAZY``, the
default) a kernel loaded at its first launch may need a context synchronisation, which kernels
that wait on each other across ranks can deadlock (CUDA Programming Guide, Lazy Loading).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import envs
from ..runtime._build_progress import announce
from ..runtime._filelock import exclusive
from ..runtime._sources import CSRC
from ._ptxas import KernelResources, parse_ptxas_log

_log = logging.getLogger("ubnext")

__all__ = [
    "KERNEL_SIGNATURE",
    "DTYPES",
    "ALGOS",
    "algo_dtypes",
    "kernel_name",
    "sources",
    "compile_kernels",
    "compile_ptx",
    "cubin_for",
    "build_many",
    "export_cubins",
    "MANIFEST",
    "load_all",
    "load_kernel",
    "loaded_kernels",
    "is_cached",
    "source_hash",
    "cuda_headers_hash",
    "Cubin",
    "KernelResources",
    "LoadedKernel",
    "kernel_report",
    "report_problems",
]


# The one parameter list of every collective kernel (docs/ARCHITECTURE.md). The launcher,
# the emulator binding and the ABI test (tests/unit/test_abi.py) all use this list. "desc" is the
# 256-byte ubnext_comm_desc by value (csrc/device/entry.cuh says why).
KERNEL_SIGNATURE: tuple[tuple[str, str], ...] = (
    ("desc", "desc"),
    ("in", "ptr"),
    ("out", "ptr"),
    ("residual", "ptr"),
    ("residual_out", "ptr"),
    ("weight", "ptr"),
    ("scale", "ptr"),
    ("scale_inv", "ptr"),
    ("n", "i32"),
    ("hidden", "i32"),
    ("eps", "f32"),
    ("flags", "i32"),
)

DTYPES = ("bf16", "fp16", "fp32")
# algorithm -> source file under csrc/kernels
ALGOS = {
    "lamport": "lamport.cu",
    "nvls_oneshot": "nvls.cu",
    "nvls_twoshot": "nvls.cu",
    "nvls_lamport": "nvls.cu",
    "twoshot": "twoshot.cu",
    "allgather": "allgather.cu",
    "reduce_scatter": "reduce_scatter.cu",
    "quantize_fp8": "quantize.cu",
    "add_rmsnorm": "add_rmsnorm.cu",
    "quantize_nvfp4": "blockscale.cu",
    "quantize_mxfp8": "blockscale.cu",
    "quantize_fp8_group128": "blockscale.cu",
}
# Kernels for other element types than DTYPES: the all-gather moves bytes, whatever they hold.
_ALGO_DTYPES = {"allgather": ("u8",)}


def algo_dtypes(algo: str) -> tuple[str, ...]:
    return _ALGO_DTYPES.get(algo, DTYPES)


# Flags (csrc/device/desc.cuh)
F_FUSED_NORM = 1
F_FP8_STATIC = 2
F_FP8_PER_TOKEN = 4
F_MULTICAST = 8
F_RANK_ORDER = 0x8000
# a block-scaled output (issue 28): the format field, the scales' to_blocked layout, power-of-two scales
F_BLOCK_FMT_MASK = 0x30
F_BLOCK_NVFP4 = 0x10
F_BLOCK_MXFP8 = 0x20
F_BLOCK_GROUP128 = 0x30
F_BLOCK_SWIZZLED = 0x40
F_BLOCK_UE8M0 = 0x80


def kernel_name(algo: str, dtype: str) -> str:
    if algo not in ALGOS or dtype not in algo_dtypes(algo):
        raise ValueError(f"no kernel for algo={algo!r} dtype={dtype!r}")
    return f"ubnext_{algo}_{dtype}"


def sources() -> dict[str, list[str]]:
    """Kernel file name -> kernel names it defines (files that exist in csrc/kernels)."""
    files: dict[str, list[str]] = {}
    for algo, fname in ALGOS.items():
        if (CSRC / "kernels" / fname).exists():
            files.setdefault(fname, []).extend(kernel_name(algo, dt) for dt in algo_dtypes(algo))
    return files


def _include_dirs() -> list[Path]:
    """csrc/ and the CUDA headers of the nvidia-cuda-runtime wheel (cuda_bf16.h, ...)."""
    dirs = [CSRC]
    try:
        import nvidia

        for base in nvidia.__path__:
            for sub in ("cu13/include", "cuda_runtime/include", "cuda_nvrtc/include"):
                cand = Path(base) / sub
                if (cand / "cuda_bf16.h").exists():
                    dirs.append(cand)
    except ImportError:
        pass
    if len(dirs) == 1:
        toolkit = Path("/usr/local/cuda/include")
        if (toolkit / "cuda_bf16.h").exists():
            dirs.append(toolkit)
    if not any((d / "nv" / "target").exists() for d in dirs):
        # cuda_bf16.h includes <nv/target>, which CUDA 13 ships with CCCL: the nvidia-cuda-cccl wheel here,
        # the toolkit's include/cccl on a machine that has only the toolkit (the borrowed GPU's image)
        for cccl in (Path("/usr/local/cuda/include/cccl"), *Path("/usr/local/cuda/targets").glob("*/include/cccl")):
            if (cccl / "nv" / "target").exists():
                dirs.append(cccl)
                break
    return dirs


def _include_roles() -> list[tuple[str, Path]]:
    """Each include directory with the role that the cache key names it by: "csrc", then "cuda"
    ("cuda2", ... where the CUDA headers come from several wheels). Their paths differ between
    checkouts and virtual environments; what they hold enters the key by content."""
    dirs = _include_dirs()
    return [("csrc", dirs[0])] + [("cuda" if i == 0 else f"cuda{i + 1}", d) for i, d in enumerate(dirs[1:])]


def cuda_include_dir() -> Path:
    dirs = _include_dirs()
    if len(dirs) < 2:
        raise RuntimeError("CUDA headers (cuda_bf16.h) not found: install nvidia-cuda-runtime")
    return dirs[1]


def _kernel_sources() -> list[Path]:
    """What NVRTC reads from csrc: every .cu/.cuh/.h outside emu/ (the CPU emulator's own)."""
    return [
        path
        for path in sorted(CSRC.rglob("*"))
        if path.suffix in (".cu", ".cuh", ".h") and "emu" not in path.relative_to(CSRC).parts
    ]


def source_hash() -> str:
    """Hash of csrc's kernel sources, each by its path under csrc/ and its content: the same in every
    checkout of the same sources, whatever its path (an exported cubin carries it)."""
    h = hashlib.sha256()
    for path in _kernel_sources():
        h.update(str(path.relative_to(CSRC)).encode() + b"\0")
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()[:24]


_INCLUDE_LINE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*([<"])([^>"\n]+)[>"]', re.MULTILINE)


def cuda_headers_hash() -> str:
    """Hash of the CUDA headers that the kernels include, directly or through other headers, each by
    its role, its path under that include directory and its content. By content rather than by the
    header wheel's version: the headers may come from a toolkit (/usr/local/cuda) instead of a
    wheel, from several wheels, or from a wheel rebuilt under the same version; and the content
    of the headers used is what the cubin depends on. Every ``#include`` line is followed, also
    those inside an ``#if`` that NVRTC skips (a superset: a change there recompiles without need);
    a name found in no include directory is one of NVRTC's built-in headers, which the NVRTC
    version covers."""
    roles = _include_roles()
    root_of = {directory: role for role, directory in roles}
    todo = [CSRC / "kernels" / fname for fname in sources()]
    seen = set(todo)
    used: dict[str, bytes] = {}  # "role:path under it" -> content digest
    while todo:
        path = todo.pop()
        text = path.read_bytes()
        for kind, name in _INCLUDE_LINE.findall(text):
            bases = ([path.parent] if kind == b'"' else []) + [directory for _, directory in roles]
            found = next(
                (Path(os.path.normpath(base / name.decode())) for base in bases if (base / name.decode()).is_file()),
                None,
            )
            if found is None or found in seen:
                continue
            seen.add(found)
            todo.append(found)
            root = next((d for d in root_of if found.is_relative_to(d)), None)
            if root is None:
                used[f"?:{name.decode()}"] = hashlib.sha256(found.read_bytes()).digest()
            elif root_of[root] != "csrc":  # csrc's own sources enter the key through source_hash
                used[f"{root_of[root]}:{found.relative_to(root)}"] = hashlib.sha256(found.read_bytes()).digest()
    h = hashlib.sha256()
    for key in sorted(used):
        h.update(key.encode() + b"\0" + used[key])
    return h.hexdigest()[:24]


@functools.cache
def nvrtc_version() -> str:
    from cuda.bindings import nvrtc

    from ..runtime._cuda import check

    major, minor = check(nvrtc.nvrtcVersion(), "nvrtcVersion")
    return f"{major}.{minor}"


def _options(arch: str, defines: tuple[str, ...], *, include_paths: bool = True) -> list[bytes]:
    """NVRTC's options; ``include_paths=False``: each include directory named by its role instead
    of its path (``-I<csrc>``), as the cache key holds them."""
    opts = [
        f"--gpu-architecture={arch}",
        "-std=c++17",
        # unannotated functions are device functions: NVRTC 13.0 (the first GPU image's) takes a generic
        # lambda in a device function for a host function and refuses it in JIT mode (allgather.cu); 13.5
        # does not, and nothing here is host code
        "-default-device",
        "--ptxas-options=-v",
        "-lineinfo",
        "-DUBNEXT_NVRTC=1",
    ]
    opts += [f"-I{directory if include_paths else f'<{role}>'}" for role, directory in _include_roles()]
    opts += [f"-D{d}" for d in defines]
    return [o.encode() for o in opts]


def _nvrtc_compile(fname: str, arch: str, want: str, defines: tuple[str, ...] = ()) -> tuple[bytes, str]:
    """Compile csrc/kernels/<fname>; ``want`` is "cubin" or "ptx". Returns (image, log)."""
    images, log = _nvrtc_images(fname, arch, (want,), defines)
    return images[want], log


def _nvrtc_images(
    fname: str, arch: str, wants: tuple[str, ...], defines: tuple[str, ...] = ()
) -> tuple[dict[str, bytes], str]:
    """One NVRTC compile of csrc/kernels/<fname>, and each image of ``wants`` ("cubin", "ptx": a
    compile for a real architecture keeps its PTX too) with the program log."""
    from cuda.bindings import nvrtc

    from ..runtime._cuda import CudaError, check

    path = CSRC / "kernels" / fname
    src = path.read_bytes()
    prog = check(nvrtc.nvrtcCreateProgram(src, str(path).encode(), 0, [], []), "nvrtcCreateProgram")
    try:
        opts = _options(arch, defines)
        (status,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        # NVRTC writes into the buffers it is given: they must be bytearrays. b" " * n is immutable and,
        # for n == 1 (an empty log, its NUL), CPython's one shared b" ": overwriting it makes every
        # 0x20 byte the process reads afterwards (a pickle's BININT1 32, say) read as 0
        log_size = check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        log = bytearray(log_size)
        check(nvrtc.nvrtcGetProgramLog(prog, log), "nvrtcGetProgramLog")
        log_text = log.decode(errors="replace").rstrip("\x00 \n")
        if int(status) != 0:
            raise CudaError(f"NVRTC failed to compile {fname} for {arch}:\n{log_text}")
        images = {}
        for want in wants:
            if want == "cubin":
                size = check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
                image = bytearray(size)
                check(nvrtc.nvrtcGetCUBIN(prog, image), "nvrtcGetCUBIN")
            else:
                size = check(nvrtc.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
                image = bytearray(size)
                check(nvrtc.nvrtcGetPTX(prog, image), "nvrtcGetPTX")
            images[want] = bytes(image)
        return images, log_text
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def compile_ptx(fname: str, arch: str = "sm_90") -> str:
    """PTX text of a kernel file (for the ABI test; never loaded): the one its cached cubin was built
    from (compile_kernels keeps it, same source, options and NVRTC), else compiled now."""
    ptx_path = _cubin_path(fname, arch).with_suffix(".ptx")
    if ptx_path.exists() and is_cached(fname, arch):
        image = ptx_path.read_bytes()
    else:
        image, _ = _nvrtc_compile(fname, arch, "ptx")
    return image.rstrip(b"\x00").decode()


def _cache_dir() -> Path:
    path = Path(envs.get("UBNEXT_CACHE_DIR")) / "cubin"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _cache_key(fname: str, arch: str) -> str:
    """What a cached cubin depends on, and nothing that differs between two checkouts of the same
    sources: csrc's content, the content of the CUDA headers it includes, the file, the
    architecture, the NVRTC version and the options with the include directories by role."""
    options = b" ".join(_options(arch, (), include_paths=False)).decode()
    parts = (source_hash(), cuda_headers_hash(), fname, arch, nvrtc_version(), options)
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def _cubin_path(fname: str, arch: str) -> Path:
    return _cache_dir() / f"{Path(fname).stem}-{arch}-{_cache_key(fname, arch)}.cubin"


def is_cached(fname: str, arch: str) -> bool:
    """Whether the cubin of one kernel file for ``arch`` is in the cache (nothing compiles)."""
    path = _cubin_path(fname, arch)
    return path.exists() and path.with_suffix(".json").exists()


@dataclass(frozen=True)
class Cubin:
    """One kernel file's cubin for one architecture, with the NVRTC version that built it and where
    it came from: "carried" (a folder exported by ``python -m ubnext.kernels export``,
    UBNEXT_CUBIN_DIR), "cache" (UBNEXT_CACHE_DIR) or "compiled" (by NVRTC in this process)."""

    fname: str
    arch: str
    image: bytes
    resources: tuple[KernelResources, ...]
    nvrtc: str
    origin: str


def _write_atomically(path: Path, data: bytes) -> None:
    """A reader never sees part of ``path``: written aside, then renamed over it."""
    fd, tmp = tempfile.mkstemp(dir=path.parent)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)


def _read_cached(fname: str, arch: str, cubin_path: Path) -> Cubin | None:
    info_path = cubin_path.with_suffix(".json")
    if not (cubin_path.exists() and info_path.exists()):
        return None
    resources = tuple(KernelResources(**r) for r in json.loads(info_path.read_text()))
    return Cubin(fname, arch, cubin_path.read_bytes(), resources, nvrtc_version(), "cache")


def _cached_or_compiled(fname: str, arch: str) -> Cubin:
    """The cubin from the disk cache, else compiled by this NVRTC and cached. Ranks of one node that
    miss the cache together compile once: one compiles under a file lock, the others wait (bounded)
    and read what it wrote."""
    cubin_path = _cubin_path(fname, arch)
    cached = _read_cached(fname, arch, cubin_path)
    if cached is not None:
        return cached
    with exclusive(cubin_path.with_suffix(".lock"), f"compile {fname} for {arch}"):
        cached = _read_cached(fname, arch, cubin_path)
        if cached is not None:
            return cached
        with announce(f"the kernels of {fname} for {arch} (NVRTC {nvrtc_version()})", cubin_path.parent):
            images, ptxas_log = _nvrtc_images(fname, arch, ("cubin", "ptx"))
        resources = tuple(parse_ptxas_log(ptxas_log, arch))
        # The JSON last: a reader that sees it sees whole files (the PTX: compile_ptx).
        info = json.dumps([r.__dict__ for r in resources]).encode()
        for path, data in (
            (cubin_path, images["cubin"]),
            (cubin_path.with_suffix(".ptx"), images["ptx"]),
            (cubin_path.with_suffix(".json"), info),
        ):
            _write_atomically(path, data)
    return Cubin(fname, arch, images["cubin"], resources, nvrtc_version(), "compiled")


def cubin_for(fname: str, arch: str) -> Cubin:
    """One kernel file's cubin for one architecture: carried (UBNEXT_CUBIN_DIR, when its source hash
    matches), else from the cache, else compiled."""
    return carried_cubin(fname, arch) or _cached_or_compiled(fname, arch)


def compile_kernels(fname: str, arch: str) -> tuple[bytes, list[KernelResources]]:
    """Cubin of one kernel file for one architecture and its kernels' resources (``cubin_for``)."""
    cubin = cubin_for(fname, arch)
    return cubin.image, list(cubin.resources)


def build_many(
    jobs: list[tuple[str, str]], resolve: Callable[[str, str], Cubin] = cubin_for
) -> dict[tuple[str, str], Cubin]:
    """(kernel file, arch) -> its cubin (``resolve``), as many at once as there are cores: NVRTC
    releases the GIL while it compiles, and the cache publishes each cubin atomically."""
    if not jobs:
        return {}
    with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
        return dict(zip(jobs, pool.map(lambda job: resolve(*job), jobs)))


@dataclass(frozen=True)
class LoadedKernel:
    """A kernel loaded into a device's primary context, and the cubin it came from."""

    name: str
    fname: str
    arch: str
    nvrtc: str  # the NVRTC version that built its cubin
    origin: str  # Cubin.origin
    kernel: Any  # the cuda.core Kernel (its handle: a CUkernel)
    function: Any  # its CUfunction in the device's primary context (cuKernelGetFunction)
    loaded: bool  # cuFuncLoad done (False on a driver older than CUDA 12.4, which has none)
    object_code: Any  # the cuda.core ObjectCode: kept, so that its library stays loaded


# (name, device index) -> the cuda.core Kernel: what a launch asks for (load_kernel), one lookup;
# _records holds the rest of what was loaded, and keeps every object referenced
_loaded: dict[tuple[str, int], object] = {}
_records: dict[tuple[str, int], LoadedKernel] = {}
EAGER_LOADING_DRIVER = 12040  # cuFuncLoad came with CUDA 12.4


def _nvrtc_major(version: str) -> int:
    return int(version.split(".")[0])


def object_code(image: bytes):
    """A cuda.core ObjectCode of a cubin, in either cuda.core layout (``from_cubin`` since 0.2); load it in
    the primary context (``_cuda.primary_context``) and keep it referenced while its kernels are used."""
    from ..runtime._cuda import core

    mod = core()
    return mod.ObjectCode.from_cubin(image) if hasattr(mod.ObjectCode, "from_cubin") else mod.ObjectCode(image, "cubin")


def load_all(device_index: int) -> None:
    """Load every kernel a communicator may launch into the device's primary context, each loaded
    at once (cuFuncLoad), not at its first launch (the communicator's preparation step; raises
    CudaError naming the cause). Before any compile or load it checks that the driver loads cubins
    of the NVRTC that built them: a carried cubin's (UBNEXT_CUBIN_DIR), or this NVRTC's for the
    others; a carried cubin the driver cannot load is left for one of this NVRTC. Missing cubins
    compile in parallel."""
    from ..runtime._cuda import CudaError, device_arch, driver_problem, driver_version

    files = sources()
    arch = device_arch(device_index)
    driver_cuda = driver_version()
    carried: dict[str, Cubin | None] = {}
    for fname in files:
        cubin = carried_cubin(fname, arch)
        if cubin is not None:
            problem = driver_problem(driver_cuda, _nvrtc_major(cubin.nvrtc))
            if problem:
                _log.warning(
                    "UBNEXT_CUBIN_DIR: not using the carried cubin of %s (NVRTC %s): %s", fname, cubin.nvrtc, problem
                )
                cubin = None
        carried[fname] = cubin
    if not all(carried.values()):
        problem = driver_problem(driver_cuda, _nvrtc_major(nvrtc_version()))
        if problem:
            raise CudaError(problem)
    missing = [
        (fname, arch) for fname, names in files.items() if any((name, device_index) not in _loaded for name in names)
    ]
    cubins = build_many(missing, lambda fname, arch: carried[fname] or _cached_or_compiled(fname, arch))
    for cubin in cubins.values():
        _load_file(cubin, device_index)


@functools.cache
def _driver_loads_eagerly(driver_cuda: int) -> bool:
    """Whether the driver has cuFuncLoad (CUDA 12.4); says once when it has not."""
    from ..runtime._cuda import format_cuda_version

    if driver_cuda >= EAGER_LOADING_DRIVER:
        return True
    _log.warning(
        "the driver supports CUDA %s, which has no cuFuncLoad (12.4): the kernels load at their first "
        "launch, which may need a context synchronisation (CUDA_MODULE_LOADING=EAGER avoids it)",
        format_cuda_version(driver_cuda),
    )
    return False


def _load_file(cubin: Cubin, device_index: int) -> None:
    """Load one kernel file's cubin and every kernel it defines, each into the device's primary
    context at once (cuKernelGetFunction, then cuFuncLoad). cuda.core loads through
    cuLibraryLoadData, whose kernels the driver otherwise loads into a context at their first
    launch."""
    from ..runtime._cuda import check, driver, driver_version, kernel_address, primary_context

    drv = driver()
    eager = _driver_loads_eagerly(driver_version())
    records = []
    # cuda.core loads modules into the current context: the device's primary context, the one
    # torch uses, so kernels and torch's tensors share an address space; the caller's own context
    # is current again afterwards
    with primary_context(device_index):
        obj = object_code(cubin.image)
        for name in sources()[cubin.fname]:
            kernel = obj.get_kernel(name)
            function = check(
                drv.cuKernelGetFunction(drv.CUkernel(kernel_address(kernel))), f"cuKernelGetFunction({name})"
            )
            if eager:
                check(drv.cuFuncLoad(function), f"cuFuncLoad({name})")
            records.append(
                LoadedKernel(name, cubin.fname, cubin.arch, cubin.nvrtc, cubin.origin, kernel, function, eager, obj)
            )
    for record in records:
        _records[record.name, device_index] = record
        _loaded[record.name, device_index] = record.kernel


def _file_of(name: str) -> str:
    return ALGOS[name[len("ubnext_") :].rsplit("_", 1)[0]]


def load_kernel(name: str, device_index: int):
    """A launchable cuda.core kernel for this process's GPU (cubin for its exact arch); the first
    call for a file loads all of that file's kernels (``load_all`` loads every file)."""
    kernel = _loaded.get((name, device_index))
    if kernel is not None:
        return kernel
    from ..runtime._cuda import device_arch

    _load_file(cubin_for(_file_of(name), device_arch(device_index)), device_index)
    return _loaded[name, device_index]


def loaded_kernels(device_index: int) -> list[LoadedKernel]:
    """What is loaded on this device, in ``sources()`` order: each kernel, the NVRTC that built its
    cubin and where the cubin came from."""
    return [
        _records[name, device_index]
        for names in sources().values()
        for name in names
        if (name, device_index) in _records
    ]


# they use what is above
from .carried import MANIFEST, carried_cubin, export_cubins  # noqa: E402
from .inspect import kernel_report, report_problems  # noqa: E402
