"""Ranks that make different calls (issue 40 H3, H4): after one call together, rank 0 reduces 1024
elements and every other rank 768 Ki (3 MB: past the Lamport slot, within the staging region), so they wait in different kernels (the Lamport one-shot against a
two-shot). Run under mpirun with UBNEXT_EMULATE=1, a long UBNEXT_TIMEOUT and a short UBNEXT_WARN_AFTER:
each rank's watchdog must log what it waits in and its peers' last calls; the test then sends one
SIGINT to the job's process group (a Ctrl-C in the terminal), which must end it on every rank at once."""

import sys
import time

import torch

import ubnext

comm = ubnext.get_communicator()
rank = comm.rank
comm.all_reduce(torch.ones(1024))
comm.synchronize()
print(f"rank {rank} waiting", flush=True)
start = time.monotonic()
try:
    comm.all_reduce(torch.ones(1024 if rank == 0 else 768 << 10))
    comm.synchronize()
except KeyboardInterrupt:
    print(f"rank {rank} interrupted after {time.monotonic() - start:.2f} s", flush=True)
    sys.exit(3)
except ubnext.UbnextError as exc:
    print(f"rank {rank} raised after {time.monotonic() - start:.2f} s: {exc}", flush=True)
    sys.exit(4)
print(f"rank {rank} completed a call its peer did not make", flush=True)
