"""ubnext's vLLM plugin without vLLM: ``register()`` with UBNEXT_VLLM unset imports and changes nothing (in a
fresh interpreter), an unsupported vLLM is left alone, and the communicator subclass (ubnext/integrations/
vllm/_communicator.py) on a stand-in base class: built and prepared for the ``tp`` group only, the pool sized
from vLLM's config, the batch-invariant mode from VLLM_BATCH_INVARIANT, each all-reduce on ubnext or the
parent's path, its calls counted, sleep and shutdown."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import tomllib
from typing import Any

import pytest
import torch

from tests.conftest import ROOT
from ubnext.integrations.vllm import _communicator, _ops
from ubnext.integrations.vllm._communicator import Context, communicator_class, pool_sizing


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in __import__("os").environ.items() if k != "UBNEXT_VLLM"}
    full.update(env)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=full, cwd=ROOT, timeout=120
    )


def test_the_entry_point_is_register():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["entry-points"]["vllm.general_plugins"] == {"ubnext": "ubnext.integrations.vllm:register"}
    assert "vllm" not in " ".join(project["project"]["dependencies"])


OFF_CHECK = """
    import sys, types
    import torch._inductor.config as inductor_config
    import ubnext
    # a stand-in vLLM whose every attribute access is recorded: the plugin must touch none of it
    touched = []
    class Recorder(types.ModuleType):
        def __getattr__(self, name):
            touched.append(name)
            raise AttributeError(name)
    sys.modules["vllm"] = Recorder("vllm")
    before = set(sys.modules)
    from importlib.metadata import EntryPoint
    register = EntryPoint("ubnext", "ubnext.integrations.vllm:register", "vllm.general_plugins").load()
    loaded = set(sys.modules) - before
    register()
    assert set(sys.modules) - before == loaded, sorted(set(sys.modules) - before - loaded)
    assert loaded == {"ubnext.integrations", "ubnext.integrations.vllm"}, sorted(loaded)
    assert touched == [], touched
    assert inductor_config.post_grad_custom_post_pass is None
    print("untouched")
"""


def test_installing_ubnext_without_ubnext_vllm_changes_nothing():
    """vLLM loads the entry point in every process; unset, register() imports nothing (ubnext.envs was
    imported with ubnext) and reads no attribute of vLLM."""
    proc = _python(OFF_CHECK)
    assert proc.returncode == 0 and "untouched" in proc.stdout, proc.stderr[-3000:]
    proc = _python(OFF_CHECK, UBNEXT_VLLM="0")
    assert proc.returncode == 0 and "untouched" in proc.stdout, proc.stderr[-3000:]


def test_the_off_check_can_fail():
    """The same check with UBNEXT_VLLM=1 sees register() reach for vLLM's version."""
    proc = _python(OFF_CHECK, UBNEXT_VLLM="1")
    assert proc.returncode != 0 and "__version__" in proc.stderr, proc.stderr[-3000:]


def test_an_unsupported_vllm_is_left_alone():
    proc = _python(
        """
        import sys, types
        sys.modules["vllm"] = types.SimpleNamespace(__version__="0.31.2")
        import ubnext.integrations.vllm as plugin
        plugin.register(); plugin.register()
        assert "ubnext.integrations.vllm._plugin" not in sys.modules
        print(plugin.worker_stats()["refused"])
    """,
        UBNEXT_VLLM="1",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "vllm 0.31.2 is not a version ubnext serves (0.32., 0.33.)" in proc.stdout
    assert proc.stderr.count("vLLM left as it is") == 1  # logged once


# -- the communicator subclass on a stand-in base ------------------------------------------------------


class StandInBase:
    """vLLM's DeviceCommunicatorBase as far as the subclass uses it (vllm 0.32: __init__'s arguments,
    all_reduce returning the sum, suspend / resume / destroy)."""

    def __init__(
        self,
        cpu_group: Any,
        device: Any = None,
        device_group: Any = None,
        unique_name: str = "",
        use_all2all: bool = False,
    ) -> None:
        self.unique_name, self.world_size, self.device_group = unique_name, 2, device_group
        self.parent_calls, self.suspended, self.destroyed = 0, False, False

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        self.parent_calls += 1
        return input_ * 2

    def suspend(self) -> None:
        self.suspended = True

    def resume(self) -> None:
        self.suspended = False

    def destroy(self) -> None:
        self.destroyed = True


class FakeUbnext:
    """ubnext's Communicator as the subclass calls it: a kernel path up to 1024 elements, torch above."""

    def __init__(self, group: Any, max_hidden: Any, batch_invariant: bool) -> None:
        self.group, self.max_hidden, self.batch_invariant = group, max_hidden, batch_invariant
        self.prepared = self.closed = False
        self.mode, self.last_path, self.rank = "emulator", None, 0

    def prepare(self) -> FakeUbnext:
        self.prepared = True
        return self

    def explain(self, x: torch.Tensor) -> str:
        return "lamport: small" if x.numel() <= 1024 else "torch: larger than the pool"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.last_path = "lamport"
        return x * 2

    def all_reduce_add_rmsnorm(self, x, residual, weight, eps):
        self.last_path = "lamport"
        return x * 2 + residual, x * 2 + residual, None

    def pool_stats(self) -> dict[str, int]:
        return {"size": 4096}

    def close(self) -> None:
        self.closed = True


DEFAULT_CONTEXT = Context(128, 2, 0, 1024, False)


@pytest.fixture
def make(monkeypatch):
    made: list[Any] = []

    def factory(group, max_hidden, batch_invariant):
        made.append(FakeUbnext(group, max_hidden, batch_invariant))
        return made[-1]

    def build(name: str = "tp:0", ctx: Context = DEFAULT_CONTEXT):
        cls = communicator_class(StandInBase)
        monkeypatch.setattr(cls, "context", staticmethod(lambda: ctx))
        monkeypatch.setattr(cls, "factory", staticmethod(factory))
        return cls(None, device_group="gloo-group", unique_name=name)

    build.made = made  # type: ignore[attr-defined]
    return build


def test_the_subclass_is_the_platforms_class_with_ubnext_in_tp_only(make):
    comm = make()
    assert isinstance(comm, StandInBase) and type(comm).__name__ == "UbnextStandInBase"
    assert type(comm).__module__ == "ubnext.integrations.vllm" and communicator_class(StandInBase) is type(comm)
    assert comm.ubnext.prepared and comm.ubnext.group == "gloo-group"  # prepared in __init__
    assert _ops.served("tp:0") is comm
    other = make("pp:0")
    assert other.ubnext is None and len(make.made) == 1  # no ubnext for other groups
    x = torch.ones(4, 8)
    assert torch.equal(other.all_reduce(x), x * 2) and other.parent_calls == 1 and not other.calls


def test_each_all_reduce_takes_ubnext_where_it_has_a_kernel_path(make):
    comm = make()
    small, large = torch.ones(4, 8), torch.ones(64, 64)
    assert torch.equal(comm.all_reduce(small), small * 2)
    assert torch.equal(comm.all_reduce(small), small * 2)
    assert torch.equal(comm.all_reduce(large), large * 2)
    assert comm.parent_calls == 1  # the large one: vLLM's own path, not ubnext's torch fallback
    assert comm.stats()["calls"] == {"all_reduce lamport": 2, "all_reduce vllm": 1}
    out, res = torch.ops.ubnext_vllm.all_reduce_add_rmsnorm(small, small, torch.ones(8), 1e-6, "tp:0")
    assert torch.equal(res, small * 3) and comm.stats()["calls"]["all_reduce_add_rmsnorm lamport"] == 1


def test_a_non_contiguous_tensor_takes_vllms_path_after_a_contiguous_one_of_its_size(make):
    """ubnext's allreduce refuses a non-contiguous x; the routing cache is by dtype and size, so
    contiguity is judged per call (the review's case: the cached answer of a contiguous call of the
    same size sent a transposed one to ubnext)."""
    comm = make()
    assert torch.equal(comm.all_reduce(torch.ones(8, 16)), torch.ones(8, 16) * 2)
    transposed = torch.ones(16, 8).t()
    assert torch.equal(comm.all_reduce(transposed), transposed * 2)
    assert comm.stats()["calls"] == {"all_reduce lamport": 1, "all_reduce vllm": 1}


def test_batch_invariant_follows_vllm(make):
    assert make(ctx=Context(128, 2, 0, 64, True)).ubnext.batch_invariant is True
    assert make("tp:1", ctx=Context(128, 2, 0, 64, False)).ubnext.batch_invariant is False


def test_the_pool_is_sized_from_vllms_config(monkeypatch):
    monkeypatch.delenv("UBNEXT_MAX_BATCH", raising=False)
    monkeypatch.delenv("NVTE_UB_MAXBATCH", raising=False)
    # capture 512, max_num_batched_tokens 8192, hidden 4096: 16 MiB of fp32 rows caps it at 1024 tokens
    sizing = pool_sizing(Context(4096, 2, 512, 8192, False))
    assert sizing["tokens"] == 1024 and sizing["max_hidden"] == 1024 * 4096 // 64
    assert 64 * sizing["max_hidden"] * 4 == _communicator.MESSAGE_CAP  # ubnext's pool: 64 x max_hidden x fp32
    # below the cap, the larger of the two; never below UBNEXT_MAX_BATCH
    assert pool_sizing(Context(128, 2, 256, 1024, False))["tokens"] == 1024
    assert pool_sizing(Context(128, 2, 0, 16, False))["tokens"] == 64
    monkeypatch.setenv("UBNEXT_MAX_BATCH", "128")
    assert pool_sizing(Context(128, 2, 0, 1024, False))["max_hidden"] == 1024 * 128 // 128
    assert pool_sizing(Context(0, 2, 0, 0, False))["max_hidden"] is None  # no model config: ubnext's default


def test_sleep_keeps_the_pool_and_shutdown_closes_it(make, caplog):
    comm = make()
    fake = comm.ubnext
    with caplog.at_level(logging.WARNING, logger="ubnext"):
        comm.suspend()
    assert comm.suspended and not fake.closed and comm.ubnext is fake
    assert "vLLM sleep keeps ubnext's pool of group tp:0 (4096 bytes)" in caplog.text
    comm.resume()
    comm.destroy()
    assert fake.closed and comm.destroyed and comm.ubnext is None
    with pytest.raises(Exception, match="'tp:0' is not served"):
        _ops.served("tp:0")
