"""``python -m ubnext.bench``: allreduce benchmark, like nccl-tests' all_reduce_perf.

Run it under a launcher (``mpirun -np 4 python -m ubnext.bench``; ``scripts/bench.sh``). For
each mode (GPU kernels where there is a GPU; otherwise the CPU emulator running the same
kernels, and torch.distributed/gloo) and each message size it prints the path that ran, the
time per call (the slowest rank's mean), the bus bandwidth, and the largest error against a
float64 reference next to the bound that the arithmetic allows.

CPU-emulator timings measure the emulator, not a GPU: they are there to show the table is
real, and to compare paths' relative costs in the model, never as GPU figures.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from .comm import Communicator, UbnextError
from .runtime._cuda import gpu_available
from .testing import allreduce_bound, rank_input, reference_sum
from .tuning._plot import plot_rows

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _parse_size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    text = text.strip().lower().rstrip("b")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def _time_calls(fn, sync, iters: int, budget_s: float) -> tuple[float, int]:
    fn()  # warm-up (compiles / sets up on first call)
    sync()
    done = 0
    start = time.perf_counter()
    while done < iters:
        fn()
        done += 1
        if time.perf_counter() - start > budget_s and done >= 3:
            break
    sync()
    return (time.perf_counter() - start) / done, done


def bench_mode(
    comm: Communicator,
    label: str,
    sizes: list[int],
    dtype: torch.dtype,
    iters: int,
    budget_s: float,
    op: str,
    rows: list,
) -> None:
    """Rows of ``op`` (all_reduce, all_reduce_add_rmsnorm, all_gather, reduce_scatter) for each
    message size: the all-gather's message is its gathered output, the reduce-scatter's its input,
    both in pool buffers (comm.empty) as FSDP2's allocate gives them."""
    if op in ("all_gather", "reduce_scatter"):
        return bench_exchange(comm, label, sizes, dtype, iters, budget_s, op, rows)
    fused = op == "all_reduce_add_rmsnorm"
    elem = dtype.itemsize
    device = comm.device
    for nbytes in sizes:
        numel = max(1, nbytes // elem)
        hidden = min(numel, 4096)
        numel -= numel % hidden
        inputs = [rank_input(r, numel, dtype, nbytes) for r in range(comm.world_size)]
        x = inputs[comm.rank].to(device)
        sync = _sync(device)
        try:
            if fused:
                residual = torch.zeros(numel // hidden, hidden, dtype=dtype, device=device)
                weight = torch.ones(hidden, dtype=dtype, device=device)
                x2 = x.view(-1, hidden)
                call = functools.partial(comm.all_reduce_add_rmsnorm, x2, residual, weight)
            else:
                out = torch.empty_like(x)
                call = functools.partial(comm.all_reduce, x, out=out)
            seconds, calls = _time_calls(call, sync, iters, budget_s)
        except UbnextError as exc:
            rows.append((label, "error", nbytes, str(exc)[:60], None, None, None, None))
            continue
        path = comm.last_path
        if fused:
            # residual_out = allreduce(x) + 0: the same bound as the plain sum
            _, result, _ = call()
        else:
            result = out
        err = (result.reshape(-1).double().cpu() - reference_sum(inputs)).abs()
        bound = allreduce_bound(inputs, dtype)
        ok = bool((err <= bound).all())
        # the slowest rank's mean decides the collective's time
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=comm.group)
        us = t.item() * 1e6
        n = comm.world_size
        busbw = (2 * (n - 1) / n) * numel * elem / t.item() / 1e9
        rows.append((label, path, numel * elem, f"{calls}", us, busbw, err.max().item(), ok))


def ratio_lines(rows: list) -> list[str]:
    """A markdown table of each message size: the fastest ubnext kernel path, torch.distributed's
    time (NCCL on a GPU) and torch's symmetric-memory op's (the torch_symm path, torch's one-shot
    allreduce), and the ratios. Rows outside their error bound do not count."""
    from .plan import KERNEL_PATHS

    best: dict[int, tuple[float, str]] = {}
    peers: dict[tuple[str, int], float] = {}
    for label, path, nbytes, _, us, _, _, ok in rows:
        if us is None or not ok:
            continue
        if path in KERNEL_PATHS and (nbytes not in best or us < best[nbytes][0]):
            best[nbytes] = (us, path)
        elif label == "torch.distributed" or path == "torch_symm":
            key = ("nccl" if label == "torch.distributed" else "torch_symm", nbytes)
            peers[key] = min(us, peers.get(key, us))
    lines = [
        "| bytes | ubnext best path | ubnext us | torch.distributed us | ratio | torch_symm us | ratio |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for nbytes, (us, path) in sorted(best.items()):
        cells = [f"{nbytes}", path, f"{us:.1f}"]
        for peer in ("nccl", "torch_symm"):
            other = peers.get((peer, nbytes))
            cells += [f"{other:.1f}", f"{us / other:.2f}"] if other else ["-", "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _sync(device: torch.device):
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def bench_exchange(
    comm: Communicator,
    label: str,
    sizes: list[int],
    dtype: torch.dtype,
    iters: int,
    budget_s: float,
    op: str,
    rows: list,
) -> None:
    n, elem = comm.world_size, dtype.itemsize
    for nbytes in sizes:
        shard = max(16 // elem, nbytes // elem // n // (16 // elem) * (16 // elem))  # whole 16-byte vectors
        numel = shard * n
        inputs = [rank_input(r, numel, dtype, nbytes) for r in range(n)]
        try:
            if op == "all_gather":
                out = comm.empty(numel, dtype=dtype)
                x = inputs[comm.rank][comm.rank * shard : (comm.rank + 1) * shard].to(comm.device)
                call = functools.partial(comm.all_gather, x, out=out)
                want = torch.cat([inputs[r][r * shard : (r + 1) * shard] for r in range(n)]).double()
                bound = torch.zeros_like(want)  # bytes move unchanged
            else:
                x = comm.empty(numel, dtype=dtype).copy_(inputs[comm.rank].to(comm.device))
                out = torch.empty(shard, dtype=dtype, device=comm.device)
                call = functools.partial(comm.reduce_scatter, x, out=out)
                mine = [t[comm.rank * shard : (comm.rank + 1) * shard] for t in inputs]
                want, bound = reference_sum(mine), allreduce_bound(mine, dtype)
            seconds, calls = _time_calls(call, _sync(comm.device), iters, budget_s)
        except UbnextError as exc:
            rows.append((label, "error", nbytes, str(exc)[:60], None, None, None, None))
            continue
        err = (out.reshape(-1).double().cpu() - want).abs()
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=comm.group)
        # nccl-tests' bus bandwidth of both: (N-1)/N of the whole message crosses each rank's links
        busbw = ((n - 1) / n) * numel * elem / t.item() / 1e9
        rows.append(
            (
                label,
                comm.last_path,
                numel * elem,
                f"{calls}",
                t.item() * 1e6,
                busbw,
                err.max().item(),
                bool((err <= bound).all()),
            )
        )


# ---------------------------------------------------------------------------------- host overhead


class _FakeStream:
    """Stands in for torch's current CUDA stream: each call reads its raw handle
    (_cuda.current_stream_handle) and compares it with the last one's; the object itself is asked
    for once, when the stream changes."""

    cuda_stream = 0x1234


def _interleaved(fns: dict, calls: int, repeats: int) -> dict[str, list[float]]:
    """Microseconds per call of each function, ``repeats`` rounds of ``calls`` calls, the
    functions taking turns within each round: a row and the floor it is compared with are timed
    seconds apart, in the same phase of a machine whose speed drifts."""
    for fn in fns.values():
        for _ in range(max(200, calls // 10)):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - t) / calls * 1e6)
    return times


def _median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2]


STUB_DEVICE_NAME = "Stub GPU"  # what tests/stub_driver's cuDeviceGetName answers
STUB_ARCH = "sm_90"  # the compute capability it reports
STUB_ATTRIBUTE_LAUNCH_COUNT = 0x5754  # its cuDeviceGetAttribute code for the launches it has seen


def _driver_is_the_stub() -> bool:
    """Whether libcuda.so.1 is the stub driver (tests/stub_driver): the only driver to which
    ``--launch driver`` may hand launches of kernels whose pointers are CPU memory."""
    from .runtime import _cuda

    try:
        drv = _cuda.driver()
        if drv.cuInit(0)[0] != 0:
            return False
        status, name = drv.cuDeviceGetName(64, drv.cuDeviceGet(0)[1])
        return status == 0 and name.split(b"\0")[0].decode() == STUB_DEVICE_NAME
    except Exception:  # noqa: BLE001 - no driver at all, or a real one that refuses: not the stub
        return False


def _stub_launch_count() -> int:
    """How many launches the stub driver has seen (its STUB_ATTRIBUTE_LAUNCH_COUNT)."""
    from .runtime import _cuda

    drv = _cuda.driver()
    return _cuda.check(
        drv.cuDeviceGetAttribute(STUB_ATTRIBUTE_LAUNCH_COUNT, drv.cuDeviceGet(0)[1]), "cuDeviceGetAttribute"
    )


def host_overhead(
    calls: int, tokens: int, hidden: int, repeats: int = 7, launch: str = "recorder"
) -> list[tuple[str, float, float, float, float]]:
    """Host time per call of the GPU code path, on a machine without one: the communicator runs
    in gpu mode over an emulator pool with a fake current stream. ``launch="recorder"``: a
    recorder replaces the kernel launch, so the same Python runs up to the launch call.
    ``launch="driver"``: the launch itself runs too (kernels.load_kernel through cuda.core,
    _cuda.launch through cuda.bindings' cuLaunchKernelEx), into the stub driver of tests/stub_driver, which must be libcuda.so.1 (on
    LD_LIBRARY_PATH); only the real driver's own work is then missing. Returns rows of (what,
    median us, median us above the floor, min and max of that over the rounds). The floor is a
    no-op operator registered with Library define + impl, timed in every round next to each row;
    the Linear row subtracts the layer's own F.linear too."""
    from contextlib import ExitStack
    from unittest import mock

    from . import all_reduce as ubnext_all_reduce
    from . import get_communicator, kernels, ops
    from .nn import Linear
    from .runtime import _cuda

    if launch == "driver":
        if not _driver_is_the_stub():
            raise SystemExit(
                "--launch driver needs the stub driver as libcuda.so.1: scripts/host_bench.sh builds "
                "it and puts it on LD_LIBRARY_PATH (a real driver would be handed CPU pointers)"
            )
        # NVRTC looks for the driver too and crashes on the stub: the kernels must be compiled already
        missing = [f for f in kernels.sources() if not kernels.is_cached(f, STUB_ARCH)]
        if missing:
            raise SystemExit(
                f"--launch driver: {', '.join(missing)} not compiled for the stub's {STUB_ARCH}; run "
                f"python -m ubnext.kernels build --arch {STUB_ARCH} without the stub first"
            )
    comm = get_communicator()  # the one ubnext.nn.Linear uses too
    if comm.mode != "emulator":
        raise SystemExit(
            "python -m ubnext.bench --host times the GPU code path over an emulator pool: run it with UBNEXT_EMULATE=1"
        )
    comm.register_hidden(hidden)
    comm.prepare()
    launches: list[Any] = [0, None]  # how many, and the last one's arguments

    def record_launch(*args):
        # a count and the last call only: a list of every launch would make the garbage
        # collector's passes, charged to the timed code, grow with the run
        launches[0] += 1
        launches[1] = args

    def launches_so_far() -> int:
        return launches[0] if launch == "recorder" else _stub_launch_count()

    x = torch.randn(tokens, hidden, dtype=torch.bfloat16)
    residual = torch.randn(tokens, hidden, dtype=torch.bfloat16)
    weight = torch.randn(hidden, dtype=torch.bfloat16)
    lib = torch.library.Library("ubnext_bench", "FRAGMENT")
    lib.define("noop(Tensor x, str comm) -> Tensor")
    lib.impl("noop", lambda t, c: t, "CompositeExplicitAutograd")
    # the fused operator's own schema, doing nothing: how much of its row is dispatch alone
    lib.define("noop_fused(Tensor x, Tensor residual, Tensor weight, float eps, str comm) -> (Tensor, Tensor)")
    lib.impl("noop_fused", lambda t, r, w, e, c: (t, r), "CompositeExplicitAutograd")
    # a small fp32 layer: its GEMM, subtracted, must not drown the host time in its own noise
    # (a bf16 GEMM on this CPU takes 12-14 us and varies by 2)
    lin = 16
    linear = Linear(
        lin * dist.get_world_size(),
        lin,
        bias=False,
        parallel_mode="row",
        symmetric_ar_type="ubnext",
        dtype=torch.float32,
    )
    linear.weight.data.normal_()
    xl = torch.randn(tokens, lin, dtype=torch.float32)
    floor = ("floor", lambda: torch.ops.ubnext_bench.noop(x, comm.key))
    cases = [
        ("comm.all_reduce", {"call": lambda: comm.all_reduce(x)}),
        ("comm.all_reduce_add_rmsnorm", {"call": lambda: comm.all_reduce_add_rmsnorm(x, residual, weight)}),
        ("torch.ops.ubnext.all_reduce", {"call": lambda: torch.ops.ubnext.all_reduce(x, comm.key, "")}),
        # issue 38's bound names these two as well: the module-level entry point (the default group's
        # communicator, found by the group's name) and the operators' Python entry point
        ("ubnext.all_reduce", {"call": lambda: ubnext_all_reduce(x)}),
        ("ubnext.ops.all_reduce", {"call": lambda: ops.all_reduce(x, comm.key)}),
        (
            "torch.ops.ubnext.all_reduce_add_rmsnorm",
            {"call": lambda: torch.ops.ubnext.all_reduce_add_rmsnorm(x, residual, weight, 1e-6, comm.key)},
        ),
        (
            "(no-op with the fused op's schema: dispatch alone)",
            {"call": lambda: torch.ops.ubnext_bench.noop_fused(x, residual, weight, 1e-6, comm.key)},
        ),
        (
            f"nn.Linear forward ({lin * dist.get_world_size()} -> {lin} fp32) minus F.linear",
            {"call": lambda: linear(xl), "minus": lambda: torch.nn.functional.linear(xl, linear.weight)},
        ),
    ]
    rows = []
    with ExitStack() as patches:
        patches.enter_context(mock.patch.object(_cuda, "current_stream_handle", lambda index: _FakeStream.cuda_stream))
        patches.enter_context(mock.patch.object(torch.cuda, "current_stream", lambda device=None: _FakeStream))
        if launch == "recorder":
            patches.enter_context(mock.patch.object(kernels, "load_kernel", lambda name, index: name))
            patches.enter_context(mock.patch.object(_cuda, "launch", record_launch))
            # what the launch's preparation asks the driver (the GPU's arch for PDL, the kernel's
            # handle, the primary context a config keeps): answered here, so that no driver is needed
            patches.enter_context(mock.patch.object(_cuda, "pdl_enabled", lambda index: True))
            patches.enter_context(mock.patch.object(_cuda, "kernel_handle", lambda kernel: kernel))
            patches.enter_context(mock.patch.object(_cuda, "_primary_context", lambda index: (None, 0)))
            # the event each launch records (stream ordering): made once, by the driver in --launch driver
            patches.enter_context(mock.patch.object(_cuda, "create_event", lambda index: None))
        patches.enter_context(torch.inference_mode())
        comm.mode = "gpu"  # the GPU branch of every decision, up to the launch
        try:
            floors = []
            for what, fns in cases:
                launched_before = launches_so_far()
                times = _interleaved({floor[0]: floor[1], **fns}, calls, repeats)
                launched = launches_so_far() - launched_before
                if not what.startswith("(") and launched < calls * repeats:
                    raise AssertionError(f"{what}: {launched} kernel launches in {calls * repeats} calls")
                above = [  # in floors (issue 38 item 3's unit): (call - floor) / floor, per round
                    (c - f - m) / f
                    for c, f, m in zip(times["call"], times["floor"], times.get("minus", [0.0] * repeats))
                ]
                floors += times["floor"]
                rows.append((what, _median(times["call"]), _median(above), min(above), max(above)))
            rows.insert(0, ("no-op Library op (floor)", _median(floors), 0.0, min(floors), max(floors)))
        finally:
            comm.mode = "emulator"
            comm._plans.clear()  # made in gpu mode
            comm._calls.clear()
            if launch == "recorder":
                _cuda.launch_config.cache_clear()  # its configs name no context
    assert comm.last_path != "torch", "the timed path did not reach a kernel launch"
    return rows


def host_main(args) -> int:
    rows = host_overhead(args.calls, args.tokens, args.hidden, launch=args.launch)
    if dist.get_rank() == 0:
        print(
            f"# ubnext.bench --host: host time per call, {args.tokens}x{args.hidden} bf16, "
            f"{dist.get_world_size()} ranks, medians of 7 rounds of {args.calls} calls"
        )
        if args.launch == "recorder":
            print("# gpu-mode code path with a fake stream and a recorder in place of the kernel launch:")
            print("# the launch itself (cuda.core, the driver) is not timed here.")
        else:
            print("# gpu-mode code path with a fake stream, launching through cuLaunchKernelEx into the stub driver:")
            print("# everything up to the driver's cuLaunchKernelEx is timed, not the real driver's own work.")
        print("# floors: (call - floor) / floor, per round against that round's floor; min..max: the spread")
        print(f"{'call':52} {'us/call':>8} {'floors':>12} {'min..max':>14}")
        for i, (what, med, above, lo, hi) in enumerate(rows):
            if i == 0:
                print(f"{what:52} {med:8.2f} {'':>12} {lo:6.2f}..{hi:<6.2f}")
            else:
                print(f"{what:52} {med:8.2f} {above:12.2f} {lo:6.2f}..{hi:<6.2f}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ubnext.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes",
        nargs="+",
        default=None,
        help="message sizes in bytes (suffix k/m): default 8k..8m on GPU, 8k..1m on CPU",
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--iters", type=int, default=None, help="calls per size (default 200 GPU, 20 CPU)")
    parser.add_argument("--budget", type=float, default=2.0, help="seconds per size at most (CPU)")
    parser.add_argument(
        "--op",
        choices=["all_reduce", "all_reduce_add_rmsnorm", "all_gather", "reduce_scatter"],
        default="all_reduce",
        help="the operation timed (message: the all-gather's output, the reduce-scatter's input)",
    )
    parser.add_argument("--fused", action="store_true", help="the same as --op all_reduce_add_rmsnorm")
    parser.add_argument("--modes", nargs="+", choices=["gpu", "emulator", "torch"], default=None)
    parser.add_argument(
        "--algo",
        nargs="+",
        default=None,
        help="force a path (UBNEXT_ALGO's values) in the gpu/emulator modes; several: one pass each",
    )
    parser.add_argument(
        "--ratios",
        metavar="FILE.md",
        default=None,
        help="append, to FILE.md (docs/PERF.md on a GPU node), each size's fastest ubnext path "
        "against torch.distributed and torch's symmetric-memory op (pass torch_symm in --algo), "
        "with the command, machine and date",
    )
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        default=None,
        help="also draw us per call and busbw against message size, one line per mode and "
        "path (needs matplotlib: pip install 'ubnext[plot]')",
    )
    parser.add_argument(
        "--host", action="store_true", help="host time per call of the GPU code path (recorder instead of the launch)"
    )
    parser.add_argument(
        "--launch",
        choices=["recorder", "driver"],
        default="recorder",
        help="--host: a recorder in place of the kernel launch, or the launch itself into the "
        "stub driver (scripts/host_bench.sh sets it up)",
    )
    parser.add_argument("--calls", type=int, default=2000, help="--host: calls per timing")
    parser.add_argument(
        "--model",
        action="store_true",
        help="the critical-path model (ubnext/tuning/_costmodel.py): counts every path on the CPU "
        "emulator at a GPU's launch geometry and models its time; starts its own ranks",
    )
    parser.add_argument("--world", type=int, default=8, help="--model: emulated ranks")
    parser.add_argument(
        "--write-thresholds",
        action="store_true",
        help="--model: measure every allreduce and fused path at --worlds, with and without "
        "multicast, and write the planner's path orders to ubnext/plan/_thresholds.py "
        "(ubnext/tuning/_crossovers.py says how)",
    )
    parser.add_argument(
        "--worlds",
        type=int,
        nargs="+",
        default=None,
        help="--write-thresholds: the worlds measured (default 2 4 8; those between are interpolated)",
    )
    parser.add_argument("--json", action="store_true", help="--model: one JSON object per line")
    parser.add_argument(
        "--calibration",
        action="store_true",
        help="--model: the calibrated model's table (ubnext/tuning/_calibration.py): per published peer figure, "
        "the modeled time and the time with the fitted constants re-fitted without it; runs no emulator",
    )
    parser.add_argument("--quick", action="store_true", help="--model: the smallest sizes only (tests)")
    parser.add_argument("--tokens", type=int, default=8, help="--host: rows of the message")
    parser.add_argument("--hidden", type=int, default=4096, help="--host: row length")
    args = parser.parse_args(argv)
    if args.host:
        return host_main(args)
    if args.model and args.write_thresholds:
        from .tuning import _crossovers

        torders = _crossovers.write(tuple(args.worlds or _crossovers.MEASURED_WORLDS))
        print("\n".join(_crossovers.format_orders(torders)))
        return 0
    if args.model and args.calibration:
        from .tuning import _calibration

        _calibration.print_calibration(_calibration.calibration_table(), args.json)
        return 0
    if args.model:
        from .tuning import _costmodel

        model_rows = _costmodel.run(args.world, quick=args.quick)
        _costmodel.print_table(model_rows, args.json)
        from .tuning import _invariant

        _invariant.print_invariant(_invariant.invariant_rows(model_rows), args.json)
        from .tuning import _calibration

        peers = _calibration.peer_rows(args.world, _costmodel.ALLREDUCE_BYTES)
        _calibration.print_peer_rows(peers, args.json)
        from .tuning import _targets

        _targets.print_targets(_targets.targets(model_rows, peers), args.json)
        return 0

    gpu = gpu_available()
    modes = args.modes or (["gpu", "torch"] if gpu else ["emulator", "torch"])
    default_sizes = ["8k", "64k", "512k", "2m", "8m"] if gpu else ["8k", "64k", "256k", "1m"]
    sizes = [_parse_size(s) for s in (args.sizes or default_sizes)]
    iters = args.iters or (200 if gpu else 20)
    dtype = DTYPES[args.dtype]

    op = "all_reduce_add_rmsnorm" if args.fused else args.op
    rows: list = []
    for mode in modes:
        if mode == "gpu" and not gpu:
            continue
        for algo in ["torch"] if mode == "torch" else args.algo or [None]:
            comm = Communicator(emulate=(mode == "emulator"), max_hidden=4096, algo=algo)
            label = {
                "gpu": f"gpu:{torch.cuda.get_device_name() if gpu else ''}",
                "emulator": "cpu-emulator",
                "torch": "torch.distributed",
            }[mode]
            if algo not in (None, "torch") and len(args.algo) > 1:
                # a forced path that cannot run falls back: its rows must not join another pass's line
                label += f" (forced {algo})"
            bench_mode(comm, label, sizes, dtype, iters, args.budget, op, rows)
            comm.close()

    if dist.get_rank() == 0:
        print(f"# ubnext.bench {op} dtype={args.dtype} ranks={dist.get_world_size()}")
        print(
            f"{'mode':22} {'path':14} {'bytes':>10} {'calls':>6} {'us/call':>10} {'busbw GB/s':>11} "
            f"{'max |err|':>11} {'<= bound':>8}"
        )
        for label, path, nbytes, calls, us, busbw, err, ok in rows:
            if us is None:
                print(f"{label:22} {path:14} {nbytes:10d} {calls}")
                continue
            print(f"{label:22} {path:14} {nbytes:10d} {calls:>6} {us:10.1f} {busbw:11.3f} {err:11.3e} {str(ok):>8}")
        if not gpu:
            print("# no GPU: cpu-emulator rows time the CPU emulator running the real kernels, not a GPU")
        if args.ratios:
            import datetime

            machine = torch.cuda.get_device_name() if gpu else "CPU emulator and gloo (no GPU: not GPU figures)"
            section = [
                f"\n## {op} against torch.distributed and torch's symmetric-memory op "
                f"({datetime.date.today().isoformat()})",
                "",
                f"**Command:** `mpirun -np {dist.get_world_size()} python -m ubnext.bench {' '.join(argv or sys.argv[1:])}`",
                f"**Machine:** {dist.get_world_size()} x {machine}; {args.dtype}; us per call, the slowest rank's "
                "mean; ratio = ubnext / the other (below 1: ubnext faster).",
                "",
                *ratio_lines(rows),
                "",
            ]
            with open(args.ratios, "a") as f:
                f.write("\n".join(section) + "\n")
            print("\n".join(section))
        if args.plot:
            title = f"ubnext.bench {op}, {args.dtype}, {dist.get_world_size()} ranks" + (
                "" if gpu else " (no GPU: CPU emulator and gloo)"
            )
            plot_rows(rows, args.plot, title)
            print(f"# plot: {args.plot}")
    failed = any(r[7] is False or r[1] == "error" for r in rows)
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
