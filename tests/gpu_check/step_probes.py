"""``probes``: what the driver and the device say about themselves, read-only; the driver gate's verdict
is the step's first field (``verdict``, after ``status``).

Figures:

- ``driver_problem``: ``_cuda.driver_problem(cuDriverGetVersion, NVRTC's major)`` computed here from the
  two versions ("none" when the driver loads NVRTC's cubins), beside ``verdict`` (``_cuda.driver_verdict``
  where it exists, else the same computation);
- ``device_name``: ``cuDeviceGetName``;
- ``multicast_supported``: ``CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED``;
- ``multicast_create_one_device``: the status ``cuMulticastCreate`` answers for a one-device object
  (expected refused on one GPU; an object it makes is released at once);
- ``module_loading.env``: ``CUDA_MODULE_LOADING`` as this process sees it, read before torch initialises
  CUDA here (torch sets LAZY where it is unset);
- ``module_loading.driver``: ``cuModuleGetLoadingMode``;
- ``module_loading.kernels_loaded``: how many of ``kernels.kernel_report(0)``'s rows (it runs ``load_all(0)``
  first) say ``loaded`` (ubnext's eager loading: cuFuncIsLoaded), or a skip naming what is missing;
- ``compute_mode``: ``CU_DEVICE_ATTRIBUTE_COMPUTE_MODE``;
- ``mig.torch``: ``torch.cuda.get_device_properties(0)`` (a MIG instance's name says MIG);
- ``mig.nvidia_smi``: ``nvidia-smi -q -x -i 0`` (read-only), the current and pending MIG modes.

Nothing here changes a setting of the device (no nvidia-smi -pm / -c / -mig, no clocks).

Rehearsal: the driver probes run against the stub driver (tests/stub_driver, first on LD_LIBRARY_PATH:
the harness puts it there for this step), which answers every call it does not know with success and
zeros; what it answers is recorded, each figure's method saying "stub driver (rehearsal)". torch is a
CPU build there and nvidia-smi reads NVML, which the stub does not stand in for: those two skip. A probe
that raises is a figure ``{"status": "fail", "reason": ...}`` and makes the step ``fail``."""

from __future__ import annotations

import inspect
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET

from tests.gpu_check.common import Context, figure, result, skipped

STUB_DEVICE_NAME = "Stub GPU"  # what tests/stub_driver's cuDeviceGetName answers (ubnext.bench says so too)
NVIDIA_SMI_TIMEOUT_S = 20
PROBES = (
    "driver_problem",
    "device_name",
    "multicast_supported",
    "multicast_create_one_device",
    "module_loading.env",
    "module_loading.driver",
    "module_loading.kernels_loaded",
    "compute_mode",
    "mig.torch",
    "mig.nvidia_smi",
)


def _failed(reason: str) -> dict:
    """A probe that raised: not a skip (nothing excuses it), not a figure."""
    return {"status": "fail", "reason": reason}


def verdict() -> tuple[str, str]:
    """(the driver gate's one-line verdict, how it was obtained)."""
    from ubnext import kernels
    from ubnext.runtime import _cuda

    gate = getattr(_cuda, "driver_verdict", None)
    if gate is not None:
        # driver_verdict(nvrtc_version) asks NVRTC's version through a callable (it sits below the kernel
        # registry); an older form took none
        takes_nvrtc = bool(inspect.signature(gate).parameters)
        return (gate(kernels.nvrtc_version) if takes_nvrtc else gate()), "ubnext.runtime._cuda.driver_verdict"
    problem = _cuda.driver_problem(_cuda.driver_version(), int(kernels.nvrtc_version().split(".")[0]))
    return (
        f"driver PROBLEM: {problem}" if problem else "driver OK",
        "_cuda.driver_problem(cuDriverGetVersion, NVRTC major) (ubnext.runtime._cuda.driver_verdict is missing)",
    )


class _Driver:
    """The driver through cuda.bindings, device 0, and how each figure names its source."""

    def __init__(self, rehearse: bool):
        from ubnext.runtime import _cuda

        self.rehearse = rehearse
        self.drv = _cuda.driver()
        self.check = _cuda.check
        self.check(self.drv.cuInit(0), "cuInit")
        self.dev = self.check(self.drv.cuDeviceGet(0), "cuDeviceGet")

    def method(self, call: str) -> str:
        return f"stub driver (rehearsal): {call}" if self.rehearse else f"driver: {call}"

    def attribute(self, name: str) -> int:
        return int(
            self.check(
                self.drv.cuDeviceGetAttribute(getattr(self.drv.CUdevice_attribute, name), self.dev),
                f"cuDeviceGetAttribute({name})",
            )
        )

    def name(self) -> str:
        raw = self.check(self.drv.cuDeviceGetName(256, self.dev), "cuDeviceGetName")
        return raw.split(b"\0")[0].decode(errors="replace")


def _driver_problem(ctx: Context, d: _Driver) -> dict:
    from ubnext import kernels
    from ubnext.runtime import _cuda

    driver_cuda, nvrtc = _cuda.driver_version(), kernels.nvrtc_version()
    problem = _cuda.driver_problem(driver_cuda, int(nvrtc.split(".")[0]))
    return figure(
        problem or "none",
        "problem",
        d.method("cuDriverGetVersion and nvrtcVersion into _cuda.driver_problem"),
        driver_cuda=_cuda.format_cuda_version(driver_cuda),
        nvrtc=nvrtc,
    )


def _device_name(ctx: Context, d: _Driver) -> dict:
    return figure(d.name(), "name", d.method("cuDeviceGetName(device 0)"))


def _multicast_supported(ctx: Context, d: _Driver) -> dict:
    value = d.attribute("CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED")
    return figure(
        value, "bool (1: supported)", d.method("cuDeviceGetAttribute(CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED)")
    )


def _multicast_create_one_device(ctx: Context, d: _Driver) -> dict:
    """cuMulticastCreate of a one-device object sized by cuMulticastGetGranularity (MINIMUM, as ubnext's VMM
    pool asks; 2 MiB where the driver gives none), POSIX-fd handles as the pool's. Whatever it makes is
    released at once."""
    drv = d.drv
    prop = drv.CUmulticastObjectProp()
    prop.numDevices = 1
    prop.handleTypes = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    prop.flags = 0
    prop.size = 2 << 20
    granularity_status, granularity = drv.cuMulticastGetGranularity(
        prop, drv.CUmulticastGranularity_flags.CU_MULTICAST_GRANULARITY_MINIMUM
    )
    granularity = int(granularity) if int(granularity_status) == 0 else 0
    if granularity:
        prop.size = -(-prop.size // granularity) * granularity
    status, handle = drv.cuMulticastCreate(prop)
    released = None
    if int(status) == 0:
        released = getattr(drv.cuMemRelease(handle)[0], "name", "?")
    return figure(
        getattr(status, "name", str(int(status))),
        "CUresult",
        d.method(f"cuMulticastCreate(numDevices=1, size={prop.size}, POSIX-fd handles)"),
        granularity_status=getattr(granularity_status, "name", str(int(granularity_status))),
        granularity=granularity,
        size=int(prop.size),
        released=released,
    )


def _module_loading_env(torch_initialised: bool) -> dict:
    from ubnext import envs

    value = envs.environment_with().get("CUDA_MODULE_LOADING")  # envs: ubnext's one reader of the environment
    return figure(
        value if value is not None else "unset",
        "CUDA_MODULE_LOADING",
        "this process's environment (ubnext.envs.environment_with), read "
        + ("after" if torch_initialised else "before")
        + " torch initialised CUDA here",
        torch_cuda_initialised=torch_initialised,
    )


def _module_loading_driver(ctx: Context, d: _Driver) -> dict:
    method = d.method("cuModuleGetLoadingMode")
    try:
        status, mode = d.drv.cuModuleGetLoadingMode()
    except ValueError as exc:
        # the binding converts the answer to the enum: a driver that wrote no valid mode (the stub writes
        # nothing) ends here
        return figure(
            "not a CUmoduleLoadingMode",
            "CUmoduleLoadingMode",
            method,
            answer=f"{type(exc).__name__}: " + re.sub(r"^-?\d+", "<value>", str(exc)),
        )
    d.check((status,), "cuModuleGetLoadingMode")
    return figure(getattr(mode, "name", str(mode)), "CUmoduleLoadingMode", method)


def _row_field(row, name: str):
    return row.get(name) if isinstance(row, dict) else getattr(row, name, None)


def _kernels_loaded(ctx: Context, d: _Driver) -> dict:
    from ubnext import kernels
    from ubnext.runtime import _cuda

    report = getattr(kernels, "kernel_report", None)
    if report is None:
        return skipped(
            "ubnext.kernels.kernel_report is missing (its rows' 'loaded' field says whether load_all "
            "loaded each kernel eagerly)"
        )
    arch = _cuda.device_arch(0)
    if ctx.rehearse:
        # NVRTC cannot run beside the stub driver (it crashes): the cubins must be in the cache already
        missing = [f for f in kernels.sources() if not kernels.is_cached(f, arch)]
        if missing:
            return skipped(
                f"rehearsal: {', '.join(missing)} not compiled for the stub's {arch}, and NVRTC cannot "
                f"run beside the stub driver (python -m ubnext.kernels build --arch {arch} first)"
            )
    rows = list(report(0))  # it runs load_all(0) first
    if not rows:
        return _failed("kernels.kernel_report(0) returned no rows")
    if any(_row_field(row, "loaded") is None for row in rows):
        return skipped("kernels.kernel_report(0)'s rows have no 'loaded' field")
    not_loaded = [str(_row_field(row, "name")) for row in rows if not _row_field(row, "loaded")]
    return figure(
        len(rows) - len(not_loaded),
        "kernels loaded",
        d.method("kernels.kernel_report(0)'s rows' loaded field (cuFuncIsLoaded), after its load_all(0)"),
        total=len(rows),
        eager=not not_loaded,
        not_loaded=not_loaded[:20],
        arch=arch,
    )


def _compute_mode(ctx: Context, d: _Driver) -> dict:
    value = d.attribute("CU_DEVICE_ATTRIBUTE_COMPUTE_MODE")
    try:
        name = d.drv.CUcomputemode(value).name
    except ValueError:
        name = f"not a CUcomputemode ({value})"
    return figure(name, "CUcomputemode", d.method("cuDeviceGetAttribute(CU_DEVICE_ATTRIBUTE_COMPUTE_MODE)"), raw=value)


def _mig_torch(ctx: Context, d: _Driver | None) -> dict:
    import torch

    if not torch.version.cuda:
        return skipped("torch is a CPU build: torch.cuda has no device to describe")
    if not torch.cuda.is_available():
        return skipped("torch sees no CUDA device")
    props = torch.cuda.get_device_properties(0)
    return figure(
        props.name,
        "name",
        "torch.cuda.get_device_properties(0) (a MIG instance's name says MIG)",
        mig_in_name="MIG" in props.name,
        uuid=str(getattr(props, "uuid", "")),
        multi_processor_count=props.multi_processor_count,
    )


def parse_nvidia_smi_xml(text: str) -> dict:
    """The first GPU of ``nvidia-smi -q -x``: its product name, MIG modes (current, pending), compute
    mode and the driver's version; a field it does not report is None."""
    root = ET.fromstring(text)
    gpu = root.find("gpu")
    if gpu is None:
        raise ValueError("nvidia-smi -q -x reported no <gpu>")

    def field(node, path):
        found = node.find(path)
        return found.text.strip() if found is not None and found.text else None

    return {
        "product_name": field(gpu, "product_name"),
        "current_mig": field(gpu, "mig_mode/current_mig"),
        "pending_mig": field(gpu, "mig_mode/pending_mig"),
        "compute_mode": field(gpu, "compute_mode"),
        "driver_version": field(root, "driver_version"),
    }


def _mig_nvidia_smi(ctx: Context, d: _Driver | None) -> dict:
    if ctx.rehearse:
        return skipped("rehearsal: nvidia-smi reads NVML, which the stub driver does not stand in for")
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return skipped("nvidia-smi is not on PATH")
    try:
        done = subprocess.run(
            [smi, "-q", "-x", "-i", "0"], capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return _failed(f"nvidia-smi -q -x -i 0 did not answer within {NVIDIA_SMI_TIMEOUT_S} s")
    if done.returncode != 0:
        return _failed(f"nvidia-smi -q -x -i 0 exited with {done.returncode}: {(done.stderr or done.stdout)[-500:]}")
    fields = parse_nvidia_smi_xml(done.stdout)
    return figure(fields["current_mig"] or "not reported", "MIG mode", "nvidia-smi -q -x -i 0 (read-only)", **fields)


DRIVER_PROBES = {
    "driver_problem": _driver_problem,
    "device_name": _device_name,
    "multicast_supported": _multicast_supported,
    "multicast_create_one_device": _multicast_create_one_device,
    "module_loading.driver": _module_loading_driver,
    "module_loading.kernels_loaded": _kernels_loaded,
    "compute_mode": _compute_mode,
}


def _driver_is_the_stub() -> bool:
    from ubnext.runtime import _cuda

    try:
        drv = _cuda.driver()
        return drv.cuInit(0)[0] == 0 and _Driver(True).name() == STUB_DEVICE_NAME
    except Exception:  # noqa: BLE001 - no driver at all, or one that refuses: not the stub
        return False


def run(ctx: Context) -> dict:
    import torch

    figures: dict = {}
    # before anything initialises CUDA through torch (torch sets CUDA_MODULE_LOADING where it is unset)
    figures["module_loading.env"] = _module_loading_env(bool(torch.version.cuda) and torch.cuda.is_initialized())
    driver, no_driver = None, None
    if ctx.rehearse and not _driver_is_the_stub():
        no_driver = (
            "rehearsal without the stub driver: libcuda.so.1 here is not tests/stub_driver's (the harness "
            "puts ctx.stub_dir first on LD_LIBRARY_PATH for this step)"
        )
    else:
        try:
            driver = _Driver(ctx.rehearse)
        except Exception as exc:  # noqa: BLE001 - every driver probe says so
            no_driver = f"the driver is unusable: {type(exc).__name__}: {exc}"
    gate, gate_method = verdict() if not no_driver else (f"driver unchecked: {no_driver}", "none")
    for name, probe in DRIVER_PROBES.items():
        if driver is None:
            figures[name] = _failed(no_driver) if not ctx.rehearse else skipped(no_driver)
            continue
        try:
            figures[name] = probe(ctx, driver)
        except Exception as exc:  # noqa: BLE001 - one probe's failure; the others still run
            figures[name] = _failed(f"{type(exc).__name__}: {exc}")
    for name, probe in (("mig.torch", _mig_torch), ("mig.nvidia_smi", _mig_nvidia_smi)):
        try:
            figures[name] = probe(ctx, driver)
        except Exception as exc:  # noqa: BLE001
            figures[name] = _failed(f"{type(exc).__name__}: {exc}")
    figures = {name: figures[name] for name in PROBES}
    failed = [f"{name}: {f['reason']}" for name, f in figures.items() if f.get("status") == "fail"]
    return result(
        "fail" if failed else "pass",
        "; ".join(failed) if failed else None,
        verdict=gate,
        verdict_method=gate_method,
        rehearsal=ctx.rehearse,
        figures=figures,
    )
