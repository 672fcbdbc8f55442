"""Kernel registry, NVRTC compilation to cubin, the on-disk cache and loading.

Kernels are compiled from ``csrc/`` by NVRTC (through cuda.bindings) to a cubin for the
GPU's exact architecture. PTX is never handed to the driver: PTX from a newer NVRTC fails to
JIT on an older driver, a cubin does not need the JIT. Cubins are cached under
``UBNEXT_CACHE_DIR/cubin``, keyed by the hash of every source they include, the architecture,
the options and the NVRTC version.

``python -m ubnext.kernels build --arch sm_90 sm_100`` compiles everything ahead of time
(no GPU needed) and prints each kernel's registers, spills and shared memory.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .. import envs
from .._filelock import exclusive
from .._sources import CSRC

__all__ = [
    "KERNEL_SIGNATURE",
    "DTYPES",
    "ALGOS",
    "algo_dtypes",
    "kernel_name",
    "sources",
    "compile_kernels",
    "compile_ptx",
    "load_all",
    "load_kernel",
    "is_cached",
    "KernelResources",
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
    return dirs


def cuda_include_dir() -> Path:
    dirs = _include_dirs()
    if len(dirs) < 2:
        raise RuntimeError("CUDA headers (cuda_bf16.h) not found: install nvidia-cuda-runtime")
    return dirs[1]


def _source_hash(extra: str) -> str:
    h = hashlib.sha256()
    for path in sorted(CSRC.rglob("*")):
        if path.suffix in (".cu", ".cuh", ".h") and "emu" not in path.parts:
            h.update(str(path.relative_to(CSRC)).encode())
            h.update(path.read_bytes())
    h.update(extra.encode())
    return h.hexdigest()[:24]


@functools.lru_cache(maxsize=None)
def nvrtc_version() -> str:
    from cuda.bindings import nvrtc

    from .._cuda import check

    major, minor = check(nvrtc.nvrtcVersion(), "nvrtcVersion")
    return f"{major}.{minor}"


def _options(arch: str, defines: tuple[str, ...]) -> list[bytes]:
    opts = [
        f"--gpu-architecture={arch}",
        "-std=c++17",
        "--ptxas-options=-v",
        "-lineinfo",
        "-DUBNEXT_NVRTC=1",
    ]
    opts += [f"-I{d}" for d in _include_dirs()]
    opts += [f"-D{d}" for d in defines]
    return [o.encode() for o in opts]


def _nvrtc_compile(fname: str, arch: str, want: str, defines: tuple[str, ...] = ()) -> tuple[bytes, str]:
    """Compile csrc/kernels/<fname>; ``want`` is "cubin" or "ptx". Returns (image, log)."""
    images, log = _nvrtc_images(fname, arch, (want,), defines)
    return images[want], log


def _nvrtc_images(fname: str, arch: str, wants: tuple[str, ...],
                  defines: tuple[str, ...] = ()) -> tuple[dict[str, bytes], str]:
    """One NVRTC compile of csrc/kernels/<fname>, and each image of ``wants`` ("cubin", "ptx": a
    compile for a real architecture keeps its PTX too) with the program log."""
    from cuda.bindings import nvrtc

    from .._cuda import CudaError, check

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


@dataclass
class KernelResources:
    name: str
    arch: str
    registers: int
    spill_stores: int
    spill_loads: int
    shared_bytes: int
    stack_bytes: int


_PTXAS_FUNC = re.compile(r"Compiling entry function '(\w+)' for '(sm_\w+)'")
_PTXAS_USED = re.compile(r"Used (\d+) registers")
_PTXAS_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas_log(log: str, arch: str) -> list[KernelResources]:
    """Per-kernel resources from ptxas -v output (NVRTC's program log)."""
    out: list[KernelResources] = []
    current = None
    for line in log.splitlines():
        m = _PTXAS_FUNC.search(line)
        if m:
            current = KernelResources(m.group(1), arch, 0, 0, 0, 0, 0)
            out.append(current)
            continue
        if current is None:
            continue
        m = _PTXAS_SPILL.search(line)
        if m:
            current.stack_bytes, current.spill_stores, current.spill_loads = map(int, m.groups())
        m = _PTXAS_USED.search(line)
        if m:
            current.registers = int(m.group(1))
        m = _PTXAS_SMEM.search(line)
        if m:
            current.shared_bytes = int(m.group(1))
    return out


def _cache_dir() -> Path:
    path = Path(envs.get("UBNEXT_CACHE_DIR")) / "cubin"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _cubin_path(fname: str, arch: str) -> Path:
    key = _source_hash(f"{fname}|{arch}|{nvrtc_version()}|{_options(arch, ())}")
    return _cache_dir() / f"{Path(fname).stem}-{arch}-{key}.cubin"


def is_cached(fname: str, arch: str) -> bool:
    """Whether the cubin of one kernel file for ``arch`` is in the cache (nothing compiles)."""
    path = _cubin_path(fname, arch)
    return path.exists() and path.with_suffix(".json").exists()


def _read_cached(cubin_path: Path) -> tuple[bytes, list[KernelResources]] | None:
    info_path = cubin_path.with_suffix(".json")
    if not (cubin_path.exists() and info_path.exists()):
        return None
    info = json.loads(info_path.read_text())
    return cubin_path.read_bytes(), [KernelResources(**r) for r in info]


def compile_kernels(fname: str, arch: str) -> tuple[bytes, list[KernelResources]]:
    """Cubin of one kernel file for one architecture, from the disk cache when possible.
    Ranks of one node that miss the cache together compile once: one compiles under a file
    lock, the others wait (bounded) and read what it wrote."""
    cubin_path = _cubin_path(fname, arch)
    cached = _read_cached(cubin_path)
    if cached is not None:
        return cached
    with exclusive(cubin_path.with_suffix(".lock"), f"compile {fname} for {arch}"):
        cached = _read_cached(cubin_path)
        if cached is not None:
            return cached
        images, log = _nvrtc_images(fname, arch, ("cubin", "ptx"))
        image = images["cubin"]
        resources = parse_ptxas_log(log, arch)
        # Atomic publish, the JSON last: a reader that sees it sees whole files (the PTX: compile_ptx).
        info = json.dumps([r.__dict__ for r in resources]).encode()
        for path, data in ((cubin_path, image), (cubin_path.with_suffix(".ptx"), images["ptx"]),
                           (cubin_path.with_suffix(".json"), info)):
            fd, tmp = tempfile.mkstemp(dir=path.parent)
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(tmp, path)
    return image, resources


_loaded: dict[tuple[str, int], object] = {}


def load_all(device_index: int) -> None:
    """Load every collective kernel on a GPU, after checking that its driver can load cubins
    from this NVRTC (the communicator's preparation step; raises CudaError naming the cause)."""
    from .._cuda import CudaError, driver_problem, driver_version

    problem = driver_problem(driver_version(), int(nvrtc_version().split(".")[0]))
    if problem:
        raise CudaError(problem)
    for names in sources().values():
        for name in names:
            load_kernel(name, device_index)


def load_kernel(name: str, device_index: int):
    """A launchable cuda.core kernel for this process's GPU (cubin for its exact arch)."""
    key = (name, device_index)
    if key in _loaded:
        return _loaded[key]
    from .._cuda import core, device_arch, primary_context

    algo = name[len("ubnext_"):].rsplit("_", 1)[0]
    fname = ALGOS[algo]
    arch = device_arch(device_index)
    image, _ = compile_kernels(fname, arch)
    mod = core()
    # cuda.core loads modules into the current context: the device's primary context, the one
    # torch uses, so kernels and torch's tensors share an address space; the caller's own context
    # is current again afterwards
    with primary_context(device_index):
        obj = mod.ObjectCode.from_cubin(image) if hasattr(mod.ObjectCode, "from_cubin") else mod.ObjectCode(image, "cubin")
        kernel = obj.get_kernel(name)
    _loaded[key] = kernel
    return kernel
