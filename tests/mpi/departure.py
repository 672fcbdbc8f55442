"""A rank whose script ends, or raises, while its peer calls once more (issue 29: the caller spun
for 30 minutes and the finished rank hung at exit). Run under mpirun with UBNEXT_EMULATE=1 and a
long UBNEXT_TIMEOUT; argv[1] is "exit" or "raise"; argv[2] is "kernel" (the ranks made one call together
first: the caller waits in a kernel) or "setup" (the leaving rank never calls: the caller waits in the pool's
set-up, issue 40 H2). The leaving rank's interpreter exit announces its departure (ubnext closes its
communicators at exit: in the pool and in the store); the caller must raise within seconds, naming it."""

import sys
import time

import torch

import ubnext

comm = ubnext.get_communicator()
rank, last = comm.rank, comm.world_size - 1
x = torch.ones(1024)
if sys.argv[2] == "kernel":
    comm.all_reduce(x)
    comm.synchronize()
if rank == last:
    print(f"rank {rank} leaving ({sys.argv[1]})", flush=True)
    if sys.argv[1] == "raise":
        raise RuntimeError("a bug on the last rank")
    sys.exit(0)
start = time.monotonic()
try:
    comm.all_reduce(x)
    comm.synchronize()
except ubnext.UbnextError as exc:
    print(f"rank {rank} raised after {time.monotonic() - start:.2f} s: {type(exc).__name__}: {exc}", flush=True)
else:
    print(f"rank {rank} completed a call without its peer", flush=True)
