"""Host time of one kernel launch into the stub driver (tests/stub_driver): ubnext's ``_cuda.launch``
beside cuda.core's ``launch`` of the same twelve arguments, in ns per call. Run it through
`scripts/launch_bench.sh`, which builds the stub and puts it first on LD_LIBRARY_PATH.

Rows, each timed in every round, the rounds alternating their order (ABBA), medians and spread over
the rounds:
- cuda.core's ``launch(stream, config, kernel, *args)``: the descriptor's address, the seven pointers
  and the four numpy scalars (what ubnext launched before the descriptor went by value, which cuda.core
  cannot pass), its Stream and LaunchConfig (with PDL) made once; then with the Stream looked up per
  launch (an lru_cache of Stream.from_handle), as ubnext's launch through cuda.core did;
- ``_cuda.launch`` as the communicator makes it: the primary context current, the PDL attribute, the
  seven pointers patched into the call signature's KernelParams, the ``done`` event recorded; with
  its config made once (as cuda.core's), then with launch_config's lookup in the timed call;
- the same through cuda.bindings' public calls (``bind_launch_calls(public=True)``: what cuda-bindings
  without the v2 module gets).
Each row's driver calls per launch are counted by the stub. The stub's own work (recording the
launch: 0.3-0.4 us here) is in every row alike; only differences mean anything, and on a shared
machine only differences within a round."""

from __future__ import annotations

import argparse
import ctypes
import functools
import os
import statistics
import time

from ubnext import kernels, pool
from ubnext.bench import _driver_is_the_stub
from ubnext.runtime import _cuda


def _timed(fn, calls: int) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls * 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20000, help="launches per row and round")
    parser.add_argument("--rounds", type=int, default=9, help="rounds (at least 7)")
    args = parser.parse_args()
    if not _driver_is_the_stub():
        raise SystemExit("launch_bench needs the stub driver as libcuda.so.1: run scripts/launch_bench.sh")
    stub = ctypes.CDLL("libcuda.so.1")
    sizes = (ctypes.c_uint * 16).in_dll(stub, "stub_param_sizes")
    calls_made = ctypes.c_ulonglong.in_dll(stub, "stub_call_count")
    last_args = (ctypes.c_ulonglong * 16).in_dll(stub, "stub_last_args")
    # the sizes the driver reads for each parameter: ubnext's ABI (the descriptor by value), and the
    # same with the descriptor's address in its place for cuda.core's row
    ours_sizes = [{"desc": pool.DESC_STRUCT_BYTES, "ptr": 8}.get(kind, 4) for _, kind in kernels.KERNEL_SIGNATURE]
    core_sizes = [8] + ours_sizes[1:]

    core = _cuda.core()
    core.Device(0).set_current()  # the primary context current, as torch leaves it
    kernel = core.ObjectCode.from_cubin(b"\x7fELF not a cubin").get_kernel("ubnext_lamport_bf16")
    stream_handle, grid, block = 0x5A00, 3, 256
    pointers = tuple(0x7F0000001000 + 0x100 * i for i in range(7))
    scalars = _cuda.pack_kernel_args(kernels.KERNEL_SIGNATURE[8:], (4096, 512, 1e-6, 13))
    core_args = (0x7E0000000000, *pointers, *scalars)
    core_stream = core.Stream.from_handle(stream_handle)
    core_config = core.LaunchConfig(grid=grid, block=block, programmatic_stream_serialization=True)
    launch_core = core.launch

    def public_bound(public: bool):
        """_cuda.launch's arguments under one binding of its driver calls (bound anew)."""
        _cuda.forget_launch_calls()
        v2 = _cuda.bind_launch_calls(public=public)
        params = _cuda.KernelParams(bytes(pool.DESC_STRUCT_BYTES), scalars)
        return v2, _cuda.kernel_handle(kernel), _cuda.launch_config(grid, block, stream_handle, True, 0), params

    v2, handle, config, params = public_bound(False)
    done = _cuda.create_event(0)
    launch = _cuda.launch
    launch_config = _cuda.launch_config
    # how ubnext found the stream object per launch when it launched through cuda.core (before 2026-11-26)
    wrap_stream = functools.lru_cache(maxsize=64)(core.Stream.from_handle)
    rows = {
        "cuda.core launch": (core_sizes, lambda: launch_core(core_stream, core_config, kernel, *core_args)),
        "cuda.core launch with the stream's lookup": (
            core_sizes,
            lambda: launch_core(wrap_stream(stream_handle), core_config, kernel, *core_args),
        ),
        "_cuda.launch, config made once": (ours_sizes, lambda: launch(handle, config, params, pointers, done)),
        "_cuda.launch with launch_config's lookup": (
            ours_sizes,
            lambda: launch(handle, launch_config(grid, block, stream_handle, True, 0), params, pointers, done),
        ),
    }
    public = "_cuda.launch through the public calls"
    _, handle_pub, config_pub, params_pub = public_bound(True)

    def launch_public():
        launch(handle_pub, config_pub, params_pub, pointers, done)

    rows[public] = (ours_sizes, launch_public)

    bound = [True]  # whether the public calls are bound now

    def bind(name: str) -> None:
        sizes[:12] = rows[name][0]
        if (name == public) != bound[0]:
            public_bound(name == public)
            bound[0] = name == public

    per_launch = {}
    for name, (_, fn) in rows.items():  # each row reaches the driver with the twelve values
        bind(name)
        fn()  # a thread's first launch retains the primary context
        before = calls_made.value
        fn()
        per_launch[name] = calls_made.value - before
        if tuple(last_args[1:8]) != pointers or last_args[8:10] != [4096, 512]:
            raise AssertionError(f"{name}: the stub saw {[hex(v) for v in last_args[:12]]}")
    times: dict[str, list[float]] = {name: [] for name in rows}
    names = list(rows)
    for name in names:  # warm-up
        bind(name)
        _timed(rows[name][1], max(200, args.calls // 10))
    for r in range(max(args.rounds, 7)):
        for name in names if r % 2 == 0 else reversed(names):
            bind(name)
            times[name].append(_timed(rows[name][1], args.calls))
    core_times = times["cuda.core launch"]
    print(
        f"# launch into the stub driver, ns per call: median (min..max) of {len(core_times)} rounds of "
        f"{args.calls} calls, ABBA; load average {os.getloadavg()[0]:.1f}; launch's calls: "
        f"{'cuda.bindings v2' if v2 else 'public (no v2 module)'}"
    )
    print("# vs core: the median over the rounds of (row / cuda.core's row in the same round)")
    print(f"{'row':46} {'driver calls':>12} {'median':>7} {'min..max':>13} {'vs core':>8}")
    for name, values in times.items():
        ratio = statistics.median(v / c for v, c in zip(values, core_times))
        spread = f"{min(values):.0f}..{max(values):.0f}"
        print(f"{name:46} {per_launch[name]:12d} {statistics.median(values):7.0f} {spread:>13} {ratio:8.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
