"""What the driver says about each loaded kernel, beside what ubnext expects of it: the one-GPU
check's "kernels" step (tests/gpu_check) reports it, and ``report_problems`` names what is wrong.

The driver's parameter sizes (cuKernelGetParamInfo) are the cubin's own layout: a kernel whose
parameters differ from KERNEL_SIGNATURE would read garbage from the parameter buffer that
``_cuda.KernelParams`` lays out. An occupancy of 0 blocks per SM at the launch's block size means
the launch itself fails (too many registers or too much shared memory for that block)."""

from __future__ import annotations

from typing import Any

from . import KERNEL_SIGNATURE, load_all, loaded_kernels

__all__ = ["kernel_report", "report_problems", "abi_param_sizes"]

# a kernel has fewer parameters than this: the bound of the loop that asks the driver one by one
_MAX_PARAMS = 64


def abi_param_sizes() -> list[int]:
    """Each KERNEL_SIGNATURE parameter's size in bytes, as ``_cuda.KernelParams`` passes it."""
    from ..pool.layout import DESC_STRUCT_BYTES

    size_of = {"desc": DESC_STRUCT_BYTES, "ptr": 8, "i32": 4, "f32": 4}
    return [size_of[kind] for _, kind in KERNEL_SIGNATURE]


def _driver_param_sizes(drv, kernel) -> list[int]:
    """The kernel's parameter sizes as the driver reads them from the cubin, in order, up to the
    index it refuses (CUDA_ERROR_INVALID_VALUE: past the last parameter)."""
    from ..runtime._cuda import check, kernel_address

    handle = drv.CUkernel(kernel_address(kernel))
    sizes = []
    for index in range(_MAX_PARAMS):
        status, _offset, size = drv.cuKernelGetParamInfo(handle, index)
        if status == drv.CUresult.CUDA_ERROR_INVALID_VALUE:
            break
        check(status, "cuKernelGetParamInfo")
        sizes.append(int(size))
    return sizes


def kernel_report(device_index: int, block: int = 256) -> list[dict[str, Any]]:
    """One row per kernel that ``load_all`` loads (it loads them first): name, file, arch, nvrtc (the
    NVRTC version that built its cubin), origin ("carried", "cache" or "compiled"), loaded (the
    driver says it is loaded: cuFuncIsLoaded), param_sizes (the driver's), abi_param_sizes
    (KERNEL_SIGNATURE's), registers and local_bytes (cuFuncGetAttribute), block and
    max_blocks_per_sm (cuOccupancyMaxActiveBlocksPerMultiprocessor at ``block`` threads, no
    dynamic shared memory)."""
    from ..runtime._cuda import check, driver, primary_context

    load_all(device_index)
    drv = driver()
    abi = abi_param_sizes()
    attribute = drv.CUfunction_attribute
    rows = []
    # a CUfunction belongs to the context it was loaded in: ask about it with that context current
    with primary_context(device_index):
        for loaded in loaded_kernels(device_index):
            state = check(drv.cuFuncIsLoaded(loaded.function), f"cuFuncIsLoaded({loaded.name})")
            rows.append(
                {
                    "name": loaded.name,
                    "file": loaded.fname,
                    "arch": loaded.arch,
                    "nvrtc": loaded.nvrtc,
                    "origin": loaded.origin,
                    "loaded": state == drv.CUfunctionLoadingState.CU_FUNCTION_LOADING_STATE_LOADED,
                    "param_sizes": _driver_param_sizes(drv, loaded.kernel),
                    "abi_param_sizes": abi,
                    "registers": check(
                        drv.cuFuncGetAttribute(attribute.CU_FUNC_ATTRIBUTE_NUM_REGS, loaded.function),
                        f"cuFuncGetAttribute({loaded.name})",
                    ),
                    "local_bytes": check(
                        drv.cuFuncGetAttribute(attribute.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, loaded.function),
                        f"cuFuncGetAttribute({loaded.name})",
                    ),
                    "block": block,
                    "max_blocks_per_sm": check(
                        drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(loaded.function, block, 0),
                        f"cuOccupancyMaxActiveBlocksPerMultiprocessor({loaded.name})",
                    ),
                }
            )
    return rows


def report_problems(rows: list[dict[str, Any]]) -> list[str]:
    """One message per kernel of ``kernel_report``'s rows that is not loaded, whose parameter sizes
    differ from KERNEL_SIGNATURE's, or of which no block fits on an SM; empty when all are right."""
    messages = []
    for row in rows:
        problems = []
        if not row["loaded"]:
            problems.append("not loaded into the context (cuFuncIsLoaded): it would load at its first launch")
        driver_sizes, abi = row["param_sizes"], row["abi_param_sizes"]
        if driver_sizes != abi:
            differ = [
                i
                for i in range(max(len(driver_sizes), len(abi)))
                if i >= len(driver_sizes) or i >= len(abi) or driver_sizes[i] != abi[i]
            ]
            first = differ[0]
            what = KERNEL_SIGNATURE[first][0] if first < len(KERNEL_SIGNATURE) else f"#{first}"
            problems.append(
                f"the driver's parameter sizes {driver_sizes} differ from KERNEL_SIGNATURE's {abi} "
                f"(first at parameter {first}, {what})"
            )
        if row["max_blocks_per_sm"] == 0:
            problems.append(
                f"no block of {row['block']} threads fits on an SM (occupancy 0; {row['registers']} "
                f"registers, {row['local_bytes']} bytes of local memory per thread)"
            )
        if problems:
            messages.append(
                f"{row['name']} ({row['file']}, {row['arch']}, {row['origin']} cubin of NVRTC "
                f"{row['nvrtc']}): " + "; ".join(problems)
            )
    return messages
