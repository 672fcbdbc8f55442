"""The one-GPU check's ``timings`` and ``probes`` steps (tests/gpu_check) run on the CPU as the rehearsal
runs them (``python -m tests.gpu_check.step NAME RESULT.json``, GPU_CHECK_REHEARSE=1; probes under the stub
driver): each passes, its result is JSON, every figure names its unit and method or is a skip with a
reason, and the figures that skip are exactly the listed ones, so that a new skip fails here. The GPU
branch of ``timings`` also runs once against a fake ``torch.cuda`` (events, streams, graphs, sleep) and a
launch that copies (the one-rank Lamport sum), so that its first GPU run can fail only on what a GPU
alone shows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests import stub_driver

ROOT = Path(__file__).resolve().parents[2]

CHAIN_NAMES = {
    f"chain_us.pdl_{p}.event_{e}.{s}.{m}"
    for p in ("on", "off")
    for e in ("on", "off")
    for s in ("default_stream", "side_stream")
    for m in ("eager", "graph")
}
TIMINGS_SKIPS = (
    CHAIN_NAMES
    | {f"chain_pdl_gain_kept.{s}" for s in ("default_stream", "side_stream")}
    | {
        f"graph_vs_eager.{op}.{side}"
        for op in ("all_reduce", "all_reduce_add_rmsnorm")
        for side in ("eager_us", "eager_queued_us", "graph_us")
    }
    | {
        f"local_gbps.{op}.{side}"
        for op in ("quantize_nvfp4", "quantize_mxfp8", "quantize_fp8_group128", "quantize_fp8", "add_rmsnorm")
        for side in ("ubnext", "d2d_copy", "torch")
    }
)
HOST_CALLS = (
    "noop_op",
    "torch_add_out",
    "comm.all_reduce",
    "comm.all_reduce_add_rmsnorm",
    "torch.ops.ubnext.all_reduce",
    "torch.ops.ubnext.all_reduce_add_rmsnorm",
)
TIMINGS_FIGURES = {f"host_us.{c}" for c in HOST_CALLS} | {f"host_floors.{c}" for c in HOST_CALLS[1:]}
PROBES_SKIPS = {"mig.torch", "mig.nvidia_smi"}
PROBES_FIGURES = {
    "driver_problem",
    "device_name",
    "multicast_supported",
    "multicast_create_one_device",
    "module_loading.env",
    "module_loading.driver",
    "compute_mode",
}
# where ubnext.kernels.kernel_report exists and the stub's sm_90 cubins are all in the cache, the eager-loading
# probe runs under the stub; otherwise it says which of the two it lacks
KERNELS_LOADED_SKIP_PREFIXES = ("ubnext.kernels.kernel_report is missing", "rehearsal: ")


def _run_step(name: str, tmp_path: Path, **env) -> dict:
    result_path = tmp_path / f"{name}.json"
    full_env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        GPU_CHECK_REHEARSE="1",
        GPU_CHECK_OUT=str(tmp_path),
        GPU_CHECK_STEP_TIMEOUT="120",
        **env,
    )
    full_env.setdefault("UBNEXT_CACHE_DIR", str(ROOT / "build" / "cache"))
    done = subprocess.run(
        [sys.executable, "-m", "tests.gpu_check.step", name, str(result_path)],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    return json.loads(result_path.read_text())  # the harness wrote it with json.dumps: it is JSON


def _check_shapes(figures: dict) -> tuple[set, set]:
    """Every figure is a value with unit and method, or a skip with a reason; (figure names, skip names)."""
    measured, skips = set(), set()
    for name, f in figures.items():
        if f.get("status") == "skip":
            assert f.get("reason"), f"{name}: a skip without its reason: {f}"
            skips.add(name)
        else:
            assert "value" in f and f.get("unit") and f.get("method"), f"{name}: not a figure: {f}"
            measured.add(name)
    return measured, skips


def _chains_module_exists() -> bool:
    return (ROOT / "tests" / "gpu_check" / "chains.py").exists()


def test_timings_rehearsal(tmp_path):
    outcome = _run_step("timings", tmp_path)
    assert outcome["status"] == "pass", outcome.get("reason", "") + json.dumps(outcome.get("tracebacks", {}))[:3000]
    figures = outcome["figures"]
    measured, skips = _check_shapes(figures)
    # tests/gpu_check/chains.py's own figures (under dependent_chains.) are its test's business; missing,
    # it is one skip
    own_skips = {n for n in skips if not n.startswith("dependent_chains.")}
    expected = TIMINGS_SKIPS | (set() if _chains_module_exists() else {"dependent_chains"})
    assert own_skips == expected, (sorted(own_skips - expected), sorted(expected - own_skips))
    assert {n for n in measured if not n.startswith("dependent_chains.")} == TIMINGS_FIGURES
    for name in TIMINGS_FIGURES:
        assert figures[name]["method"].startswith("CPU rehearsal") or name.startswith("host_floors."), name
        assert figures[name]["value"] > (0 if name.startswith("host_us.") else -1), figures[name]
    assert outcome["host_paths"] == {c: "lamport" for c in HOST_CALLS[2:]}
    assert outcome["chain_rehearsal"]["exact"] is True
    assert set(outcome["local_rehearsal"]) == {
        "quantize_nvfp4",
        "quantize_mxfp8",
        "quantize_fp8_group128",
        "quantize_fp8",
        "add_rmsnorm",
    }


@pytest.fixture(scope="module")
def stub_dir(tmp_path_factory):
    return stub_driver.build(tmp_path_factory.mktemp("stub_driver"))


def test_probes_rehearsal_under_the_stub_driver(tmp_path, stub_dir):
    outcome = _run_step(
        "probes",
        tmp_path,
        GPU_CHECK_STUB_DIR=str(stub_dir),
        LD_LIBRARY_PATH=os.pathsep.join(p for p in (str(stub_dir), os.environ.get("LD_LIBRARY_PATH")) if p),
    )
    assert outcome["status"] == "pass", outcome.get("reason")
    assert list(outcome)[:2] == ["status", "verdict"], list(outcome)  # the driver gate's verdict first
    figures = outcome["figures"]
    measured, skips = _check_shapes(figures)
    loaded = figures["module_loading.kernels_loaded"]
    if loaded.get("status") == "skip":
        assert loaded["reason"].startswith(KERNELS_LOADED_SKIP_PREFIXES), loaded
        skips.discard("module_loading.kernels_loaded")
    else:
        measured.discard("module_loading.kernels_loaded")
    assert skips == PROBES_SKIPS, skips
    assert measured == PROBES_FIGURES, measured
    for name in PROBES_FIGURES - {"module_loading.env"}:
        assert figures[name]["method"].startswith("stub driver (rehearsal)"), figures[name]
    assert figures["device_name"]["value"] == "Stub GPU"  # the stub answered, not a real driver
    assert figures["driver_problem"]["value"] == "none"  # the stub reports CUDA 13.0


def test_nvidia_smi_xml_is_read():
    from tests.gpu_check.step_probes import parse_nvidia_smi_xml

    xml = textwrap.dedent("""\
        <?xml version="1.0" ?>
        <nvidia_smi_log><driver_version>580.65.06</driver_version>
          <gpu id="00000000:18:00.0"><product_name>NVIDIA H100 80GB HBM3</product_name>
            <mig_mode><current_mig>Disabled</current_mig><pending_mig>Disabled</pending_mig></mig_mode>
            <compute_mode>Default</compute_mode></gpu></nvidia_smi_log>""")
    assert parse_nvidia_smi_xml(xml) == {
        "product_name": "NVIDIA H100 80GB HBM3",
        "current_mig": "Disabled",
        "pending_mig": "Disabled",
        "compute_mode": "Default",
        "driver_version": "580.65.06",
    }
    assert parse_nvidia_smi_xml("<nvidia_smi_log><gpu></gpu></nvidia_smi_log>")["current_mig"] is None


# The GPU branch of every timings section, on the CPU: torch.cuda's events, streams, graphs and sleep are
# stand-ins that keep the order of work (a graph records the launches captured in it and replays them), the
# communicator takes its GPU code path over the emulator's pool, and the launch decodes its parameters
# (kernelParams: the addresses of the twelve values) and, for the plain Lamport one-shot, copies `in` to
# `out` as a one-rank sum does. Figures are not timings of anything: only that the code runs is checked.
FAKE_GPU_SCRIPT = textwrap.dedent("""
    import contextlib, ctypes, json, os, time
    from pathlib import Path
    from unittest import mock

    import torch
    import torch.distributed as dist

    os.environ["UBNEXT_WORLD1_KERNELS"] = "1"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    from tests.gpu_check import step_timings as T
    from tests.gpu_check.common import Context
    from ubnext.runtime import _cuda
    from ubnext import kernels
    from ubnext.comm import Communicator

    comm = Communicator(emulate=True, max_hidden=T.SHAPE[1])
    comm.prepare()
    T.LOCAL_SHAPE = (16, 4096)

    class Stream:
        handles = iter(range(0x5000, 0x6000, 0x10))

        def __init__(self, handle=None):
            self.cuda_stream = next(Stream.handles) if handle is None else handle

    DEFAULT = Stream(0)
    PRIMARY = 0xC7C7C000  # device index i's primary context: PRIMARY + i
    state = {"current": DEFAULT, "graph": None, "launches": 0}

    class Event:
        def __init__(self, enable_timing=False):
            self.at = None

        def record(self, stream=None):
            assert state["graph"] is None, "a timing event recorded inside a capture"
            self.at = time.perf_counter()

        def query(self):
            return True

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return (end.at - self.at) * 1e3 + 1e-6

    class Graph:
        def __init__(self):
            self.work = []

        def replay(self):
            assert state["graph"] is None
            for work in self.work:
                work()

    @contextlib.contextmanager
    def graph(g, *args, **kwargs):
        previous = state["current"]
        state["graph"], state["current"] = g, Stream()
        try:
            yield
        finally:
            state["graph"], state["current"] = None, previous

    @contextlib.contextmanager
    def stream(s):
        previous, state["current"] = state["current"], s
        try:
            yield
        finally:
            state["current"] = previous

    def launch(kernel, config, params, pointers, done=None):
        assert isinstance(kernel, str) and config.context_address == PRIMARY + 0, (kernel, config)  # device 0's
        assert config.stream_handle == state["current"].cuda_stream, "launched on another stream than the current one"
        values = (ctypes.c_uint64 * 12).from_address(params.address(pointers))
        pointer = lambda i: ctypes.c_uint64.from_address(values[i]).value
        src, dst, residual = pointer(1), pointer(2), pointer(3)
        n = ctypes.c_int32.from_address(values[8]).value
        def work():
            state["launches"] += 1
            if kernel == "ubnext_lamport_bf16" and residual == 0:
                ctypes.memmove(dst, src, 2 * n)
        if state["graph"] is not None:
            state["graph"].work.append(work)
        else:
            work()

    patches = [
        mock.patch.object(torch.cuda, "Event", Event), mock.patch.object(torch.cuda, "_sleep", lambda cycles: None),
        mock.patch.object(torch.cuda, "synchronize", lambda device=None: None),
        mock.patch.object(torch.cuda, "Stream", Stream), mock.patch.object(torch.cuda, "default_stream", lambda d=None: DEFAULT),
        mock.patch.object(torch.cuda, "current_stream", lambda d=None: state["current"]),
        mock.patch.object(torch.cuda, "stream", stream), mock.patch.object(torch.cuda, "CUDAGraph", Graph),
        mock.patch.object(torch.cuda, "graph", graph),
        mock.patch.object(_cuda, "current_stream_handle", lambda index: state["current"].cuda_stream),
        mock.patch.object(_cuda, "capturing", lambda device: state["graph"] is not None),
        mock.patch.object(kernels, "load_kernel", lambda name, index: name),
        mock.patch.object(_cuda, "kernel_handle", lambda kernel: kernel),
        mock.patch.object(_cuda, "_primary_context", lambda index: (None, PRIMARY + index)),
        mock.patch.object(_cuda, "launch", launch), mock.patch.object(_cuda, "pdl_enabled", lambda index: True),
        mock.patch.object(_cuda, "create_event", lambda index: object()),
        mock.patch.object(_cuda, "wait_event", lambda *args: None),
        mock.patch.object(_cuda, "record_event", lambda *args: None),
    ]
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        comm.mode = "gpu"
        figures, details, failures = {}, {}, {}
        ctx = Context(rehearse=False, out=Path("."), timeout_s=120)
        for name, section in T.SECTIONS:
            try:
                section(ctx, comm, figures, details)
            except Exception as exc:
                import traceback
                failures[name] = traceback.format_exc()
    print(json.dumps({"figures": figures, "details": details, "failures": failures, "launches": state["launches"]},
                     default=str))
""")


def test_timings_gpu_branch_runs_against_a_fake_cuda():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.setdefault("UBNEXT_CACHE_DIR", str(ROOT / "build" / "cache"))
    done = subprocess.run(
        [sys.executable, "-c", FAKE_GPU_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    assert not outcome["failures"], "\n".join(outcome["failures"].values())
    figures = outcome["figures"]
    measured, skips = _check_shapes(figures)
    names = measured | skips
    for name in TIMINGS_FIGURES | TIMINGS_SKIPS:  # the GPU run names every figure the rehearsal does
        assert name in names, name
    assert all(figures[n]["status"] == "skip" for n in skips)
    # the chains ran whole and exact on every configuration (the step raises otherwise); the GPU-only skips
    # are PDL's gain (timings of a fake) and torchao where it is not installed
    assert skips <= {
        "chain_pdl_gain_kept.default_stream",
        "chain_pdl_gain_kept.side_stream",
        "dependent_chains",
        "local_gbps.quantize_nvfp4.torch",
        "local_gbps.quantize_mxfp8.torch",
    }, skips
    assert outcome["details"]["host_paths"] == {c: "lamport" for c in HOST_CALLS[2:]}
    assert outcome["launches"] > 16 * 6 * 200
