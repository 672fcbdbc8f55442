import re
from pathlib import Path

import pytest

from ubnext import envs

README = Path(__file__).resolve().parents[2] / "README.md"


def test_defaults(monkeypatch):
    for var in envs.VARIABLES.values():
        for name in (var.name, *var.aliases):
            monkeypatch.delenv(name, raising=False)
    assert envs.get("UBNEXT_MAX_BATCH") == 64
    assert envs.get("UBNEXT_SYMM_POOL_SIZE") is None
    assert envs.get("UBNEXT_ALGO") == "auto"
    assert envs.get("UBNEXT_TIMEOUT") is None  # the process group's timeout (test_kernel_timeout)


def test_aliases_and_precedence(monkeypatch):
    monkeypatch.delenv("UBNEXT_MAX_BATCH", raising=False)
    monkeypatch.setenv("NVTE_UB_MAXBATCH", "128")
    assert envs.get("UBNEXT_MAX_BATCH") == 128
    monkeypatch.setenv("UBNEXT_MAX_BATCH", "32")
    assert envs.get("UBNEXT_MAX_BATCH") == 32
    monkeypatch.delenv("UBNEXT_SYMM_POOL_SIZE", raising=False)
    monkeypatch.setenv("NVTE_UB_SYMM_POOL_SIZE", "256")
    assert envs.get("UBNEXT_SYMM_POOL_SIZE") == 256


@pytest.mark.parametrize(
    "name,value",
    [
        ("UBNEXT_ALGO", "fastest"),
        ("UBNEXT_MAX_BATCH", "0"),
        ("UBNEXT_MAX_BATCH", "many"),
        ("UBNEXT_TIMEOUT", "-1"),
        ("UBNEXT_EMULATE", "maybe"),
        ("UBNEXT_POOL_BACKEND", "cuda"),
    ],
)
def test_bad_value_names_variable_and_accepted(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(envs.EnvError) as info:
        envs.get(name)
    msg = str(info.value)
    assert name in msg and repr(value) in msg and envs.VARIABLES[name].accepted in msg


def test_bad_alias_value_names_alias(monkeypatch):
    monkeypatch.delenv("UBNEXT_MAX_BATCH", raising=False)
    monkeypatch.setenv("NVTE_UB_MAXBATCH", "-3")
    with pytest.raises(envs.EnvError, match="NVTE_UB_MAXBATCH.*alias of UBNEXT_MAX_BATCH"):
        envs.get("UBNEXT_MAX_BATCH")


def test_unknown_variable():
    with pytest.raises(KeyError):
        envs.get("UBNEXT_NOPE")


def test_readme_documents_every_variable():
    text = README.read_text()
    for var in envs.VARIABLES.values():
        assert f"`{var.name}`" in text, f"README lacks {var.name}"
    assert envs.describe_table() in text, "README's env table is stale: paste envs.describe_table()"


def test_only_envs_reads_the_environment():
    pkg = Path(envs.__file__).parent
    offenders = []
    for path in pkg.rglob("*.py"):
        if path.name == "envs.py":
            continue
        if re.search(r"os\.environ|os\.getenv|getenv\(", path.read_text()):
            offenders.append(path.name)
    csrc = pkg.parent / "csrc"
    for path in csrc.rglob("*"):
        if path.suffix in (".cu", ".cuh", ".h", ".cpp", ".c") and "getenv" in path.read_text():
            offenders.append(str(path.relative_to(pkg.parent)))
    assert not offenders, f"only ubnext/envs.py may read the environment: {offenders}"


class _FakeBackend:
    def __init__(self, seconds):
        import datetime

        self.options = type("Options", (), {"_timeout": datetime.timedelta(seconds=seconds)})()


class _FakeGroup:
    """A process group as kernel_timeout_s sees it: one backend per device type."""

    def __init__(self, **seconds_by_type):
        self.seconds = seconds_by_type

    def _get_backend(self, device):
        if device.type not in self.seconds:
            raise RuntimeError(f"no backend for {device}")
        return _FakeBackend(self.seconds[device.type])


def test_kernel_timeout(monkeypatch):
    """Unset, the kernels wait as long as the group's backend (so host drift that torch.distributed
    tolerates is not fatal); UBNEXT_TIMEOUT overrides; a backend without options gives torch's 30 min."""
    import torch

    from ubnext.runtime._lifecycle import kernel_timeout_s

    monkeypatch.delenv("UBNEXT_TIMEOUT", raising=False)
    group = _FakeGroup(cpu=77, cuda=600)
    assert kernel_timeout_s(group, torch.device("cpu")) == 77.0
    assert kernel_timeout_s(group, torch.device("cuda", 3)) == 600.0
    assert kernel_timeout_s(_FakeGroup(), torch.device("cpu")) == 1800.0
    monkeypatch.setenv("UBNEXT_TIMEOUT", "2.5")
    assert kernel_timeout_s(group, torch.device("cpu")) == 2.5


def test_kernel_timeout_reads_a_real_gloo_groups_timeout():
    """kernel_timeout_s against torch's own process group (a one-rank gloo group, in a process of
    its own so that no default group is left behind here), not the fake above: the timeout given to
    init_process_group is what it reads from the backend's options. NCCL's options exist only in
    torch's CUDA build: tests/gpu runs every case under the NCCL group's timeout."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    script = (
        "import datetime, torch, torch.distributed as dist\n"
        "from ubnext.runtime._lifecycle import kernel_timeout_s\n"
        "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1,\n"
        "                        timeout=datetime.timedelta(seconds=77))\n"
        "print(kernel_timeout_s(dist.group.WORLD, torch.device('cpu')))\n"
        "dist.destroy_process_group()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "UBNEXT_TIMEOUT"}
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.split() == ["77.0"], proc.stdout + proc.stderr[-2000:]


def test_every_test_only_break_is_accepted_by_envs(monkeypatch):
    """UBNEXT_EMU_BREAK accepts exactly the emulator's broken builds: a name missing here makes
    the kernels unavailable, and a broken-build test would then fail for that reason, not for
    the violation it is meant to show."""
    from ubnext.runtime import _emu

    for name in _emu.BREAKS:
        monkeypatch.setenv("UBNEXT_EMU_BREAK", name)
        assert envs.get("UBNEXT_EMU_BREAK") == name
    monkeypatch.setenv("UBNEXT_EMU_BREAK", "no_such_break")
    with pytest.raises(envs.EnvError):
        envs.get("UBNEXT_EMU_BREAK")
