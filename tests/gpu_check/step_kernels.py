"""``kernels``: every kernel the communicator may launch, loaded eagerly (issue 36 R1), its parameter sizes
as the driver reads them (``cuKernelGetParamInfo``) against the ABI, its registers and local memory, and
its occupancy at the launch's block size: at least one CTA per SM must fit.

Carried cubins (``UBNEXT_CUBIN_DIR``, from ``python -m ubnext.kernels export``) are used where the driver
accepts them; each row says which NVRTC built its cubin and where it came from. In the rehearsal the same
code runs against the stub driver (tests/stub_driver), which answers the sizes and the occupancy the ABI
expects, and loads the cubins that the suite's kernel build step put in the cache."""

from __future__ import annotations

from tests.gpu_check.common import Context, figure, result

BLOCK = 256  # ubnext.comm._executor.GPU_BLOCK: every collective launch's block size


def run(ctx: Context) -> dict:
    from ubnext import kernels
    from ubnext.comm._executor import GPU_BLOCK

    assert GPU_BLOCK == BLOCK, "the launch's block size changed: the occupancy check must follow it"
    rows = kernels.kernel_report(0, block=BLOCK)
    problems = kernels.report_problems(rows)
    unloaded = [row["name"] for row in rows if not row.get("loaded")]
    if unloaded:
        problems.append(f"not loaded eagerly: {', '.join(unloaded)}")
    expected = sorted(name for names in kernels.sources().values() for name in names)
    missing = sorted(set(expected) - {row["name"] for row in rows})
    if missing:
        problems.append(f"missing from the report: {', '.join(missing)}")
    figures = {
        "kernels": figure(len(rows), "kernels", "kernels.kernel_report (one row per loaded kernel)"),
        "min_blocks_per_sm": figure(
            min((row["max_blocks_per_sm"] for row in rows), default=0),
            "CTAs per SM",
            f"cuOccupancyMaxActiveBlocksPerMultiprocessor at {BLOCK} threads",
        ),
        "max_registers": figure(
            max((row["registers"] for row in rows), default=0), "registers per thread", "cuFuncGetAttribute(NUM_REGS)"
        ),
        "max_local_bytes": figure(
            max((row["local_bytes"] for row in rows), default=0),
            "bytes per thread",
            "cuFuncGetAttribute(LOCAL_SIZE_BYTES)",
        ),
    }
    method = "stub driver (rehearsal)" if ctx.rehearse else "driver"
    if problems:
        return result("fail", "; ".join(problems), method=method, figures=figures, rows=rows)
    return result("pass", method=method, figures=figures, rows=rows)
