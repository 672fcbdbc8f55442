"""Capture ubnext's collectives into a CUDA graph and replay them, as a decode loop does. GPUs only,
one rank per GPU:

    .venv/bin/torchrun --nproc-per-node 2 examples/cuda_graph.py

The steps that matter: comm.prepare() before capture (creating the pool synchronises and talks to
the other ranks, which a capture cannot); a warm-up on a side stream (torch.cuda.graph's rule); the
captured inputs and outputs are static tensors that the loop refills. Each replay's result is
checked against the sum it must give, every rank alike. Exits 2, saying why, without a GPU.
"""

import os
import sys

import torch

import ubnext

if not torch.cuda.is_available():
    print("examples/cuda_graph.py needs CUDA GPUs (one rank per GPU)", file=sys.stderr)
    sys.exit(2)

comm = ubnext.get_communicator()
comm.prepare()
n, hidden = comm.world_size, 4096
x = torch.empty(8, hidden, dtype=torch.bfloat16, device=comm.device)  # static input
residual = torch.zeros_like(x)
weight = torch.ones(hidden, dtype=torch.bfloat16, device=comm.device)

side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):  # warm-up outside the capture
    x.fill_(1.0)
    comm.all_reduce(x)
    comm.all_reduce_add_rmsnorm(x, residual, weight)
torch.cuda.current_stream().wait_stream(side)

graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    summed = comm.all_reduce(x)  # static outputs
    normed, residual_out, _ = comm.all_reduce_add_rmsnorm(x, residual, weight)

for step in range(5):
    x.fill_(float(comm.rank + step + 1))  # refill the captured input, then replay
    graph.replay()
    want = float(sum(r + step + 1 for r in range(n)))
    assert torch.equal(summed, torch.full_like(summed, want)), (step, summed[0, :4])
    assert torch.equal(residual_out, summed), step  # the residual was zero
    # rmsnorm of a constant row is 1 (up to eps), times a unit weight
    assert (normed.float() - 1.0).abs().max() < 1e-2, (step, normed[0, :4])
comm.synchronize()
os.write(1, f"rank {comm.rank}: 5 replays of all_reduce and all_reduce_add_rmsnorm ok ({comm.last_path})\n".encode())
