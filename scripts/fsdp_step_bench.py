"""Time one FSDP2 training step with each way of running its collectives, each in its own processes
(the three cannot share a process: torch's symmetric-memory staging is refused once custom
collectives are installed, and it needs NCCL):

    mpirun -np 8 python scripts/fsdp_step_bench.py --mode nccl        # FSDP2's own NCCL collectives
    mpirun -np 8 python scripts/fsdp_step_bench.py --mode torch_symm  # FSDP2.set_symm_mem_for_comm()
    mpirun -np 8 python scripts/fsdp_step_bench.py --mode ubnext      # ubnext.fsdp.use_ubnext_collectives

`scripts/gpu_check.sh` runs all three on a GPU node. Without a GPU, `--mode gloo` and `--mode ubnext`
(with UBNEXT_EMULATE=1) run the same step on CPU tensors: a check that the script works, whose times
say nothing about a GPU. Prints one line on rank 0: the mode, the step time (median over the steps of
the slowest rank), the loss, and the ubnext path of the last collective where there is one."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist


def _model(hidden: int, layers: int, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    blocks = [
        torch.nn.Sequential(torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(), torch.nn.Linear(4 * hidden, hidden))
        for _ in range(layers)
    ]
    return torch.nn.Sequential(*blocks).to(device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=["nccl", "torch_symm", "ubnext", "gloo"], required=True)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import ubnext
    import ubnext.fsdp as UF
    from ubnext.runtime import _lifecycle

    if not dist.is_initialized():
        _lifecycle.bootstrap()  # NCCL on a GPU, gloo without one
    gpu = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    if args.mode in ("nccl", "torch_symm") and not gpu:
        raise SystemExit(f"--mode {args.mode} needs GPUs (NCCL)")
    model = _model(args.hidden, args.layers, device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    comm = None
    if args.mode == "ubnext":
        # a block's buffers: its fp32 reduce-scatter input (4 bytes x ~8 h^2 parameters) and bf16
        # all-gather output (2 bytes each), two blocks' worth live with FSDP2's prefetch, in the
        # eager arena (about half the pool's data, after the staging quarter)
        block_bytes = 6 * 8 * args.hidden * args.hidden
        os.environ.setdefault("UBNEXT_SYMM_POOL_SIZE", str(max(64, -(-6 * block_bytes // (1 << 20)))))
        comm = ubnext.Communicator(max_hidden=args.hidden)
        UF.use_ubnext_collectives(model, comm)
    elif args.mode == "torch_symm":
        for module in model.modules():
            if hasattr(module, "set_symm_mem_for_comm"):
                module.set_symm_mem_for_comm()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(args.tokens, args.hidden, device=device, generator=None)
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    times, loss = [], None
    for step in range(args.steps + 2):  # two warm-up steps: pools, kernels, NCCL communicators
        sync()
        dist.barrier()
        start = time.perf_counter()
        loss = model(x).float().square().mean()
        loss.backward()
        loss = loss.detach()
        opt.step()
        opt.zero_grad()
        sync()
        if step >= 2:
            times.append(time.perf_counter() - start)
    slowest = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        path = comm.last_path if comm is not None else "-"
        print(
            f"fsdp_step mode={args.mode} ranks={dist.get_world_size()} hidden={args.hidden} layers={args.layers} "
            f"tokens={args.tokens} step_ms={slowest.item() * 1e3:.3f} loss={loss.item():.6g} path={path}",
            flush=True,
        )
    if comm is not None:
        comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
