"""A wheel built from the sdist works when installed outside the checkout: it carries the
kernel sources, and a 2-rank emulated allreduce builds the emulator from them, starting with an
empty cache, from a directory that is not the checkout."""

import os
import re
import subprocess
import sys
import tarfile
import textwrap

import pytest

from tests.conftest import ROOT, assert_mpi_ok

BUILD = textwrap.dedent("""
    import sys
    from setuptools import build_meta
    kind, src, out = sys.argv[1:]
    import os
    os.chdir(src)
    hook = build_meta.build_sdist if kind == "sdist" else build_meta.build_wheel
    print(hook(out))
""")

RUN = textwrap.dedent("""
    import os
    import torch
    import ubnext

    comm = ubnext.get_communicator()
    assert comm.mode == "emulator", comm.mode
    x = torch.arange(4096, dtype=torch.float32) * (comm.rank + 1)
    y = ubnext.all_reduce(x)
    n = comm.world_size
    assert torch.equal(y, torch.arange(4096, dtype=torch.float32) * (n * (n + 1) // 2)), y[:8]
    assert comm.last_path in ("lamport", "nvls_twoshot", "twoshot"), comm.last_path
    # one write(2) of under PIPE_BUF bytes: the ranks share a pipe, and a line written in pieces
    # (print with several arguments) can interleave with the other rank's
    os.write(1, f"rank {comm.rank} ok {comm.last_path} {ubnext.__file__}\\n".encode())
""")


def _python(*args, cwd, env=None):
    proc = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, f"{args}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.mark.mpi
def test_wheel_installed_outside_the_checkout(mpi, tmp_path):
    sdist_dir, wheel_dir, site, work, cache = (tmp_path / d for d in ("sdist", "wheel", "site", "work", "cache"))
    for d in (sdist_dir, wheel_dir, work):
        d.mkdir()
    sdist = sdist_dir / _python("-c", BUILD, "sdist", str(ROOT), str(sdist_dir), cwd=tmp_path).split()[-1]
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp_path / "unpacked", filter="data")
    (src,) = (tmp_path / "unpacked").iterdir()
    wheel = wheel_dir / _python("-c", BUILD, "wheel", str(src), str(wheel_dir), cwd=tmp_path).split()[-1]
    _python("-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site), str(wheel), cwd=tmp_path)
    assert (site / "ubnext" / "_data" / "csrc" / "kernels" / "lamport.cu").is_file()
    assert (site / "ubnext" / "_data" / "include" / "ubnext.h").is_file()

    script = work / "run.py"
    script.write_text(RUN)
    env = {"PYTHONPATH": str(site), "UBNEXT_CACHE_DIR": str(cache), "UBNEXT_EMULATE": "1"}
    proc = mpi(2, script, env=env, timeout=600, cwd=work)
    assert_mpi_ok(proc)
    reports = re.findall(r"rank (\d) ok (\S+) (\S+)", proc.stdout)
    assert sorted(r[0] for r in reports) == ["0", "1"], proc.stdout
    for _, _, module in reports:
        assert module.startswith(str(site)), f"ubnext was not imported from the wheel: {module}"
    assert any(cache.joinpath("emu").glob("libubnext_emu-*.so")), "the emulator was not built into the empty cache"
    assert not os.path.exists(ROOT / "ubnext" / "_data"), "the build wrote into the checkout"
