"""The README's tensor-parallel block runs as written under mpirun -np 2."""

import re

import pytest

from tests.conftest import ROOT, assert_mpi_ok


@pytest.mark.mpi
@pytest.mark.parametrize("emulate", ["0", "1"])
def test_readme_block_runs(mpi, tmp_path, emulate):
    text = (ROOT / "README.md").read_text()
    snippet = re.search(r"```python\n(import torch\nimport ubnext\n.*?)```", text, re.S).group(1)
    script = tmp_path / "block.py"
    script.write_text(snippet)
    proc = mpi(2, script, env={"UBNEXT_EMULATE": emulate})
    assert_mpi_ok(proc)
    lines = [l for l in proc.stdout.splitlines() if "torch.Size([8, 1024])" in l]
    assert len(lines) == 2, proc.stdout
