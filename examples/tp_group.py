"""ubnext inside a framework's own tensor-parallel group, as Megatron-, vLLM- and SGLang-style code
plugs it in. Runs on any rank count divisible by 2 (tensor parallelism 2, the rest data parallel):

    .venv/bin/mpirun -np 4 .venv/bin/python examples/tp_group.py      # on GPUs: one rank per GPU
    UBNEXT_EMULATE=1 .venv/bin/mpirun -np 4 .venv/bin/python examples/tp_group.py   # on CPU

Each style's all-reduce is checked against torch.distributed's on the same group, bitwise (the
inputs are small integers, so every summation order gives the same bits), and each rank prints
one line. The frameworks themselves are not imported: the functions below stand where their
hooks are.
"""

import os

import torch
import torch.distributed as dist

import ubnext

TP = 2

comm_world = ubnext.get_communicator()  # bootstraps torch.distributed from mpirun or torchrun
rank, world = dist.get_rank(), dist.get_world_size()
assert world % TP == 0, f"run on a multiple of {TP} ranks, not {world}"
device = comm_world.device

# The framework builds its groups; every rank creates every group, in the same order, as
# torch.distributed requires. Rank r is in TP group r // TP.
tp_groups = [dist.new_group(list(range(start, start + TP))) for start in range(0, world, TP)]
tp_group = tp_groups[rank // TP]


# Megatron-style: the model parallel state hands out the TP group; the group's communicator
# (made on first use, collective over the group, then cached) serves the row-parallel layers.
class RowParallelLinear(torch.nn.Module):
    def __init__(self, in_per_rank: int, out_features: int, tp_comm: ubnext.Communicator):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(out_features, in_per_rank, device=device))
        self.comm = tp_comm

    def forward(self, x):
        return self.comm.all_reduce(x @ self.weight.t())  # partial sums of this rank's input slice


# vLLM- / SGLang-style: the framework calls one function for every tensor-parallel all-reduce
# (tensor_model_parallel_all_reduce); its body becomes ubnext's, on the framework's group. The
# framework keeps its own choice for what ubnext would not take faster (comm.explain says why).
def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    return ubnext.all_reduce(x, group=tp_group)


tp_comm = ubnext.get_communicator(tp_group)  # the one tensor_model_parallel_all_reduce uses too
tp_rank = dist.get_rank(tp_group)
x = torch.full((4, 8), float(tp_rank + 1), device=device)  # this rank's slice of the input
layer = RowParallelLinear(8, 16, tp_comm)
want = torch.full((4, 16), 8.0 * sum(r + 1 for r in range(TP)), device=device)

got = {"megatron": layer(x), "vllm": tensor_model_parallel_all_reduce(x @ layer.weight.detach().t())}
reference = x @ layer.weight.detach().t()
dist.all_reduce(reference, group=tp_group)
for style, out in got.items():
    assert torch.equal(out, want) and torch.equal(out, reference), f"{style}: {out[0, :4]} != {want[0, :4]}"

# one write(2) per line: the ranks share the output pipe
os.write(1, f"rank {rank} tp group {rank // TP} styles {sorted(got)} path {tp_comm.last_path}\n".encode())
