"""Fixtures shared by the unit tests."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from ubnext.comm import Communicator
from ubnext.runtime import _lifecycle


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
