"""Issue 40 C5: torch.compile of a function that calls ubnext before any communicator exists. The
first use bootstraps torch.distributed and sets the communicator up, collective host work that
Dynamo cannot trace; it failed deep inside it (``_socket.gethostname``, ``Intracomm.bcast``) with
no hint. Now the set-up refuses while Dynamo traces, naming ``ubnext.get_communicator()``. No
process group is made: bootstrap is replaced by one that fails the test if it is reached."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import ubnext
from ubnext.errors import UbnextError
from ubnext.runtime import _lifecycle


def _bootstrap_reached():
    raise AssertionError("bootstrap ran while Dynamo traced")


def test_compiled_all_reduce_before_any_communicator_names_get_communicator(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(_lifecycle, "bootstrap", _bootstrap_reached)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: ubnext.all_reduce(x) + 1, backend="eager", fullgraph=True)
    # Dynamo reports an exception raised while it traces as its own "Observed exception", with ours in it
    with pytest.raises(Exception, match=r"create the communicator before compiling.*ubnext\.get_communicator\(\)"):
        compiled(torch.ones(4))
    torch._dynamo.reset()


def test_making_a_communicator_while_compiling_is_refused(monkeypatch):
    """An initialised group whose communicator does not exist yet (get_communicator() inside the
    compiled function): refused before the Communicator is constructed."""

    class Group:
        group_name = "never_set_up"

    def construct(group):
        raise AssertionError("a communicator was constructed while Dynamo traced")

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(_lifecycle, "communicator_class", construct)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(
        UbnextError, match=r"'never_set_up' has no ubnext communicator yet.*ubnext\.get_communicator\(\)"
    ):
        _lifecycle.communicator_of(Group())
