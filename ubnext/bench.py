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
import sys
import time

import torch
import torch.distributed as dist

from ._cuda import gpu_available
from .comm import Communicator, UbnextError
from .testing import allreduce_bound, rank_input, reference_sum

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


def bench_mode(comm: Communicator, label: str, sizes: list[int], dtype: torch.dtype, iters: int,
               budget_s: float, fused: bool, rows: list) -> None:
    elem = torch.empty((), dtype=dtype).element_size()
    device = comm.device
    for nbytes in sizes:
        numel = max(1, nbytes // elem)
        hidden = min(numel, 4096)
        numel -= numel % hidden
        inputs = [rank_input(r, numel, dtype, nbytes) for r in range(comm.world_size)]
        x = inputs[comm.rank].to(device)
        sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
        try:
            if fused:
                residual = torch.zeros(numel // hidden, hidden, dtype=dtype, device=device)
                weight = torch.ones(hidden, dtype=dtype, device=device)
                x2 = x.view(-1, hidden)
                call = lambda: comm.all_reduce_add_rmsnorm(x2, residual, weight)  # noqa: E731
            else:
                out = torch.empty_like(x)
                call = lambda: comm.all_reduce(x, out=out)  # noqa: E731
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ubnext.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=None,
                        help="message sizes in bytes (suffix k/m): default 8k..8m on GPU, 8k..1m on CPU")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--iters", type=int, default=None, help="calls per size (default 200 GPU, 20 CPU)")
    parser.add_argument("--budget", type=float, default=2.0, help="seconds per size at most (CPU)")
    parser.add_argument("--fused", action="store_true", help="time all_reduce_add_rmsnorm instead")
    parser.add_argument("--modes", nargs="+", choices=["gpu", "emulator", "torch"], default=None)
    parser.add_argument("--algo", default=None, help="force a path (UBNEXT_ALGO's values) in the gpu/emulator modes")
    args = parser.parse_args(argv)

    gpu = gpu_available()
    modes = args.modes or (["gpu", "torch"] if gpu else ["emulator", "torch"])
    default_sizes = ["8k", "64k", "512k", "2m", "8m"] if gpu else ["8k", "64k", "256k", "1m"]
    sizes = [_parse_size(s) for s in (args.sizes or default_sizes)]
    iters = args.iters or (200 if gpu else 20)
    dtype = DTYPES[args.dtype]

    rows: list = []
    for mode in modes:
        if mode == "gpu" and not gpu:
            continue
        comm = Communicator(emulate=(mode == "emulator"), max_hidden=4096,
                            algo="torch" if mode == "torch" else args.algo)
        label = {"gpu": f"gpu:{torch.cuda.get_device_name() if gpu else ''}", "emulator": "cpu-emulator",
                 "torch": "torch.distributed"}[mode]
        bench_mode(comm, label, sizes, dtype, iters, args.budget, args.fused, rows)
        comm.close()

    if dist.get_rank() == 0:
        op = "all_reduce_add_rmsnorm" if args.fused else "all_reduce"
        print(f"# ubnext.bench {op} dtype={args.dtype} ranks={dist.get_world_size()}")
        print(f"{'mode':22} {'path':14} {'bytes':>10} {'calls':>6} {'us/call':>10} {'busbw GB/s':>11} "
              f"{'max |err|':>11} {'<= bound':>8}")
        for label, path, nbytes, calls, us, busbw, err, ok in rows:
            if us is None:
                print(f"{label:22} {path:14} {nbytes:10d} {calls}")
                continue
            print(f"{label:22} {path:14} {nbytes:10d} {calls:>6} {us:10.1f} {busbw:11.3f} {err:11.3e} {str(ok):>8}")
        if not gpu:
            print("# no GPU: cpu-emulator rows time the CPU emulator running the real kernels, not a GPU")
    failed = any(r[7] is False or r[1] == "error" for r in rows)
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
