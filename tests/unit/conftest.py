"""Fixtures shared by the unit tests."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from ubnext.comm import Communicator
from ubnext.runtime import _emu, _lifecycle


@pytest.fixture(scope="module")
def world1_comm():
    """A gloo group of one rank in this process and its communicator on the torch path (whatever
    UBNEXT_EMULATE says), registered as the default group's cached one, which ``ubnext.all_reduce``
    and the other module-level entry points use; all of it gone after the module, so that no later
    test finds a process group or a cached communicator."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    comm = _lifecycle.cached[dist.group.WORLD.group_name] = Communicator(emulate=False)
    yield comm
    _lifecycle.cached.clear()
    comm.close()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def emu():
    """The emulator library (the correct build), left in plain mode, not counting, without a watchdog."""
    e = _emu.load()
    yield e
    e.configure(False)
    e.set_counting(False)
    e.set_watchdog(None)


@pytest.fixture(params=[False, True], ids=["plain", "chaos"])
def chaos(request, emu):
    """Each test twice: plain, and in chaos mode with the module's CHAOS_SEED (12345 unless it names one)."""
    emu.configure(request.param, getattr(request.module, "CHAOS_SEED", 12345))
    yield request.param
    emu.configure(False)
