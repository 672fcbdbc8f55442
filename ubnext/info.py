"""``python -m ubnext.info``: what ubnext finds on this node, and what it will do with it.

Run it on a node before anything else. Its first line is the driver's verdict
(``_cuda.driver_verdict``: whether ubnext's kernels can run here, or why every op falls back to
NCCL, or that there is no GPU). It then reports the versions (torch, CUDA, driver, NVRTC),
the GPUs with their P2P and multicast support (through cuda-python), the pool backend ubnext
would choose, whether cubins are cached for the GPU's architecture, whether the CPU emulator
builds, and which path each message size would take for a given world size. It needs no
process group and starts no ranks.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import shutil
import sys
from collections.abc import Callable

from . import __version__, envs, kernels, plan
from .pool import plan_layout
from .runtime._cuda import check, driver, driver_verdict, format_cuda_version, gpu_available, no_gpu_reason
from .runtime._sources import CSRC

SIZES = [8 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
DEFAULT_ARCHS = ("sm_90", "sm_100")


def _version(dist_name: str) -> str:
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _try(fn: Callable[[], str]) -> str:
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - the report says what failed instead of stopping
        return f"unavailable ({type(exc).__name__}: {exc})"


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KB"


def gpus() -> list[dict]:
    """Each visible GPU: name, arch, SMs, multicast support, and which peers it can access."""
    drv = driver()
    attr = drv.CUdevice_attribute
    out = []
    count = check(drv.cuDeviceGetCount(), "cuDeviceGetCount")
    devices = [check(drv.cuDeviceGet(i), "cuDeviceGet") for i in range(count)]
    for i, dev in enumerate(devices):

        def get(name, dev=dev):
            return check(drv.cuDeviceGetAttribute(getattr(attr, name), dev), name)

        name = check(drv.cuDeviceGetName(256, dev), "cuDeviceGetName").split(b"\0")[0].decode()
        peers = [
            j
            for j, other in enumerate(devices)
            if j != i and check(drv.cuDeviceCanAccessPeer(dev, other), "cuDeviceCanAccessPeer")
        ]
        out.append(
            {
                "index": i,
                "name": name,
                "arch": f"sm_{get('CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR')}{get('CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR')}",
                "sms": get("CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT"),
                "multicast": bool(get("CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED")),
                "peers": peers,
            }
        )
    return out


def pool_view(world_size: int, hidden: int, mode: str, multicast: bool, unavailable: str | None) -> plan.PoolView:
    """The planner's view of a fresh pool of the default size for this world size and hidden."""
    layout = plan_layout(world_size, hidden)
    return plan.PoolView(
        unavailable,
        multicast,
        layout.lamport_capacity,
        layout.staging_bytes,
        mode,
        torch_symm_op=mode == "gpu",
        sized_by=layout.sized_by,
        world_size=world_size,
    )


def report(world_size: int, hidden: int, build_emulator: bool) -> str:
    import torch

    lines: list[str] = []
    add = lines.append
    # first: whether ubnext's kernels can run here at all (an old driver sends every op to NCCL)
    add(driver_verdict(kernels.nvrtc_version))
    add(
        f"ubnext {__version__} ({os.path.dirname(__file__)}); kernel sources: {CSRC}"
        + ("" if (CSRC / "kernels").is_dir() else "  MISSING")
    )
    add("")
    add("versions")
    add(f"  python         {platform.python_version()}")
    add(f"  torch          {torch.__version__} (CUDA build: {torch.version.cuda or 'no, CPU build'})")
    add(f"  cuda-bindings  {_version('cuda-bindings')};  cuda-core {_version('cuda-core')}")
    add(f"  NVRTC          {_try(kernels.nvrtc_version)}")
    has_gpu = gpu_available()
    if has_gpu:
        from .runtime._cuda import driver_version

        add(f"  driver         {_try(lambda: 'supports CUDA ' + format_cuda_version(driver_version()))}")
    else:
        add("  driver         none in use (no GPU)")
    add("")

    add("GPUs")
    devices: list[dict] = []
    if not has_gpu:
        add(f"  no GPU: {no_gpu_reason()}.")
        if envs.get("UBNEXT_EMULATE"):
            add("  What runs instead: UBNEXT_EMULATE=1, so the ubnext kernels run on the CPU emulator (CPU")
            add("  tensors, ranks as processes); a Communicator(emulate=False) falls back to torch.distributed (gloo).")
        else:
            add("  What runs instead: every ubnext op falls back to torch.distributed (gloo); with")
            add("  UBNEXT_EMULATE=1 the ubnext kernels run on the CPU emulator (CPU tensors, ranks as processes).")
    else:
        devices = gpus()
        for d in devices:
            add(
                f"  [{d['index']}] {d['name']} {d['arch']}, {d['sms']} SMs, multicast "
                f"{'yes' if d['multicast'] else 'no'}, P2P to {d['peers'] or 'none'}"
            )
        visible = envs.cuda_visible_devices()
        if len(devices) == 1:
            add(f"  only one GPU is visible to this process (CUDA_VISIBLE_DEVICES={visible!r}): ranks that")
            add("  each see one GPU may be unable to map their peers' memory (not yet verified on hardware);")
            add("  ubnext then falls back to torch.distributed and logs why. Prefer giving every rank all")
            add("  the node's GPUs.")
    add("")

    emulate = envs.get("UBNEXT_EMULATE")
    backend = envs.get("UBNEXT_POOL_BACKEND")
    if emulate:
        mode, chosen = "emulator", "emulator (shared host memory; UBNEXT_EMULATE=1)"
        multicast = envs.get("UBNEXT_EMU_MULTICAST")
    elif has_gpu:
        mode = "gpu"
        try:
            import torch.distributed._symmetric_memory  # noqa: F401

            symm = True
        except ImportError:
            symm = False
        auto = "torch_symm" if symm else "vmm (torch symmetric memory missing)"
        chosen = auto if backend == "auto" else f"{backend} (UBNEXT_POOL_BACKEND)"
        multicast = bool(devices) and all(d["multicast"] for d in devices)
    else:
        mode, chosen, multicast = "torch", "none: no GPU and UBNEXT_EMULATE is off", False
    add(f"pool backend     {chosen}")
    add("")

    archs = sorted({d["arch"] for d in devices}) or list(DEFAULT_ARCHS)
    add(f"cubins (cache {envs.get('UBNEXT_CACHE_DIR')})" + ("" if devices else ": no GPU, showing sm_90 and sm_100"))
    for arch in archs:
        states = [f"{f} {'cached' if _cached(f, arch) else 'not cached'}" for f in sorted(kernels.sources())]
        add(f"  {arch}: " + ", ".join(states))
    add("  (python -m ubnext.kernels build --arch ... fills the cache ahead of time)")
    add("")

    add(f"emulator         {_emulator_state(build_emulator)}")
    add("")

    unavailable = None
    if mode == "torch":
        unavailable = "no GPU and emulation is off"
    add(
        f"paths for {world_size} ranks, bf16, pool sized for hidden {hidden} (mode {mode}, multicast "
        f"{'yes' if multicast else 'no'}, UBNEXT_ALGO={envs.get('UBNEXT_ALGO')})"
    )
    views = [("here", pool_view(world_size, hidden, mode, multicast, unavailable))]
    if mode != "gpu":
        views.append(("on GPUs with NVLS", pool_view(world_size, hidden, "gpu", True, None)))
    forced = envs.get("UBNEXT_ALGO")
    nondet = envs.get("UBNEXT_ALLOW_NONDETERMINISTIC")
    header = "".join(f"{label + ': allreduce':26} {'fused norm':14}" for label, _ in views)
    add(f"  {'message':>8}  {header}")
    for nbytes in SIZES:
        row = ""
        for _, view in views:
            plain = plan.choose(nbytes, 2, False, 0, view, forced=forced, allow_nondeterministic=nondet)
            fused = plan.choose(nbytes, 2, True, hidden, view, forced=forced, allow_nondeterministic=nondet)
            row += f"{plain.path:26} {fused.path:14}"
        add(f"  {_size(nbytes):>8}  {row}")
    if unavailable:
        add(f"  (here: torch.distributed, because {unavailable})")
    return "\n".join(line.rstrip() for line in lines)


def _cached(fname: str, arch: str) -> bool:
    try:
        return kernels.is_cached(fname, arch)
    except Exception:  # noqa: BLE001 - no NVRTC: nothing can be cached either
        return False


def _emulator_state(build: bool) -> str:
    from .runtime import _emu

    cxx = shutil.which("g++")
    if cxx is None:
        return "cannot build: g++ is not on PATH"
    if not build:
        return f"g++ at {cxx}; not built (--no-build)"
    try:
        return f"builds (g++ at {cxx}): {_emu.build()}"
    except Exception as exc:  # noqa: BLE001
        return f"does NOT build: {type(exc).__name__}: {str(exc)[:2000]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ubnext.info", description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=8, help="ranks to plan paths for (default 8)")
    parser.add_argument("--hidden", type=int, default=8192, help="hidden size the pool is sized for (default 8192)")
    parser.add_argument("--no-build", action="store_true", help="do not try to build the emulator")
    args = parser.parse_args(argv)
    print(report(args.world_size, args.hidden, not args.no_build))
    return 0


if __name__ == "__main__":
    sys.exit(main())
