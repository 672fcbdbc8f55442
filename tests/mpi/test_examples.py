"""examples/ run as users run them: under mpirun (and torchrun), checked by their exit status.
examples/llama_tp.py compares a tensor-parallel Llama-style model, made through torch's
parallelize_module with ubnext's styles, against the dense model in fp64, with a bound derived in
the example, and requires bitwise identical logits on every rank."""

import pytest

from tests.conftest import ROOT, assert_mpi_ok, run_mpi, run_torchrun

EXAMPLE = ROOT / "examples" / "llama_tp.py"


@pytest.mark.mpi
@pytest.mark.parametrize(
    "np,emulate,flags",
    [
        (2, "1", []),
        (2, "1", ["--fused"]),
        (4, "1", ["--fused"]),
        (2, "0", []),
    ],
    ids=["np2-emulator", "np2-emulator-fused", "np4-emulator-fused", "np2-torch"],
)
def test_llama_tp_example(mpi, np, emulate, flags):
    proc = mpi(np, EXAMPLE, *flags, env={"UBNEXT_EMULATE": emulate}, timeout=300)
    assert_mpi_ok(proc)
    path = "lamport" if emulate == "1" else "torch"
    assert f"tp={np} fused={bool(flags)}" in proc.stdout and f"paths ['{path}']" in proc.stdout, proc.stdout


@pytest.mark.mpi
@pytest.mark.parametrize(
    "np,how,sites",
    [
        (4, "model", "4 all_reduce_add_rmsnorm, 0 all_reduce"),  # every norm of 2 layers, the final one too
        (2, "block", "1 all_reduce_add_rmsnorm, 1 all_reduce"),  # one graph for both layers, cut before the MLP's norm
    ],
    ids=["np4-model", "np2-block"],
)
def test_llama_tp_example_compiled_with_fusion(mpi, np, how, sites):
    """The plain model made tensor-parallel with torch's own styles, compiled with ubnext.fusion on:
    the fused op runs at the norms the example names, on the emulator, within the example's bound.
    Without the FX graph cache, whose graphs (from an earlier run) would not run the pass and go
    uncounted; one compile thread per rank, not a worker pool on each of the np ranks; scalar C++
    kernels (TORCHINDUCTOR_VEC_ISA_OK=0): on an empty Inductor cache the vector ISA probes alone
    build and load a program per ISA, about 10 s of the two CI cores, for kernels whose speed
    nothing here measures (the example's bound does not depend on the order of a reduction)."""
    env = {
        "UBNEXT_EMULATE": "1",
        "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",
        "TORCHINDUCTOR_AUTOGRAD_CACHE": "0",
        "TORCHINDUCTOR_COMPILE_THREADS": "1",
        "TORCHINDUCTOR_VEC_ISA_OK": "0",
    }
    proc = mpi(np, EXAMPLE, "--compile", how, env=env, timeout=300)
    assert_mpi_ok(proc)
    assert f"tp={np} " in proc.stdout and "paths ['lamport']" in proc.stdout, proc.stdout
    assert f"compile={how}: {sites} in the compiled graphs" in proc.stdout, proc.stdout


@pytest.mark.mpi
def test_llama_tp_example_under_torchrun(tmp_path):
    proc = run_torchrun(2, EXAMPLE, "--fused", env={"UBNEXT_EMULATE": "1"}, timeout=300, cwd=tmp_path)
    assert_mpi_ok(proc)
    assert "tp=2 fused=True" in proc.stdout, proc.stdout


@pytest.mark.mpi
def test_tp_group_example():
    """examples/tp_group.py: Megatron- and vLLM-style hooks on a tensor-parallel sub-group (TP 2 x
    DP 2), each bitwise equal to torch.distributed's all-reduce on that group, on the emulator."""
    proc = run_mpi(4, ROOT / "examples" / "tp_group.py", env={"UBNEXT_EMULATE": "1"}, timeout=300)
    assert_mpi_ok(proc)
    lines = sorted(line for line in proc.stdout.splitlines() if " tp group " in line)
    assert len(lines) == 4 and all("styles ['megatron', 'vllm'] path lamport" in line for line in lines), proc.stdout
