"""Issue 40 C3: rank 1 alone starts with a bad value of the variable named in argv[1] and no process group
yet: the communicator's bootstrap compares every rank's environment in the rendezvous, so every rank raises
an EnvError naming rank 1 and the value, within seconds, instead of rank 1 stopping before the rendezvous
and rank 0 failing to connect to it (or waiting for it). Prints "ok <rank>" on a rank that saw this."""

from __future__ import annotations

import os
import sys
import time

NAME, BAD = sys.argv[1], sys.argv[2]
RANK = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
if RANK == 1:
    os.environ[NAME] = BAD

import ubnext  # noqa: E402

start = time.monotonic()
try:
    ubnext.Communicator(emulate=True)
except ubnext.envs.EnvError as exc:
    took, msg = time.monotonic() - start, str(exc)
else:
    print(f"rank {RANK}: no error", flush=True)
    os._exit(1)
expected = f"rank 1: {NAME}={BAD!r} is not valid"
if expected not in msg or took > 10:
    print(f"rank {RANK}: after {took:.1f} s: {msg}", flush=True)
    os._exit(1)
print(f"ok {RANK} ({took:.2f} s): {msg}", flush=True)
# every rank has printed before any leaves: a rank that exits without MPI_Finalize gets its peers killed by
# mpirun, and a peer killed before its line reached mpirun lost it (the test failed once with "ok 0" missing)
from mpi4py import MPI  # noqa: E402  (initialised by ubnext's bootstrap)

MPI.COMM_WORLD.Barrier()
os._exit(0)  # the process group ubnext never finished making: nothing to close
