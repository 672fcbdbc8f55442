"""``timings``: what only one GPU can time honestly, by CUDA events or graph replays, at world 1 through
the ``UBNEXT_WORLD1_KERNELS`` seam (a one-rank communicator takes its kernel paths).

Sections, each a group of figures (names as in ``figures``):

- ``host_us.<call>`` and ``host_floors.<call>``: host microseconds per call of ``comm.all_reduce``,
  ``comm.all_reduce_add_rmsnorm`` and their ``torch.ops.ubnext`` forms, beside a no-op ``torch.library``
  operator (``noop(Tensor x, Tensor(a!) out) -> ()``, define + impl: the floor) and a bare torch op
  (``torch.add(x, y, out=z)``), timed in the same alternating rounds (median of ROUNDS); a floor figure
  is the median over the rounds of (call - floor) / floor. On the GPU the host clock times the calls
  while a ``torch.cuda._sleep`` queued ahead keeps the GPU busy, so the host never waits on it (each
  round checks that the sleep outlasted the calls: ``rounds_gpu_ran_dry``). In the rehearsal the same
  code runs over the emulator's pool with the GPU code path and a recorder in place of the launch
  (as ``python -m ubnext.bench --host``): those are real figures of the Python path, marked so.
- ``chain_us.pdl_<on|off>.event_<on|off>.<default|side>_stream.<eager|graph>``: CHAIN dependent
  one-rank Lamport launches (each reads the previous one's output; exact at one rank), microseconds per
  kernel by CUDA events around the chain, with a sleep queued ahead so that the whole chain is queued
  before the first kernel runs (issue 36 R3). ubnext's own launch (``Executor._run``) where it does
  what the configuration asks: ``event_on ... eager`` (its ordering event after every kernel) and
  ``event_off ... graph`` (a captured call records none); the other two launch the same ``Launch``
  through ``_cuda.launch``: ``event_off ... eager`` without the event, and ``event_on ... graph`` with a
  record after every kernel inside the capture (not what ubnext does; timed for the comparison).
  A configuration that raises is a figure ``{"status": "fail", ...}``. ``chain_pdl_gain_kept.<stream>``
  is the fraction of PDL's per-kernel gain kept when every eager launch records the event; ``defeats``
  says whether the event defeats PDL (less than half kept); it skips where PDL's gain without the event
  is not above the runs' spread.
- ``local_gbps.<op>.<ubnext|d2d_copy|torch>``: the local kernels (``comm.quantize`` nvfp4, mxfp8,
  fp8_group128, ``comm.quantize_fp8`` per row, the add + RMSNorm kernel the fused op runs past the
  pool) in GB/s = (bytes read + bytes written) / time by CUDA events over LOCAL_REPS calls; against a
  device-to-device copy of the same traffic and the torch code users would run instead (torchao's
  quantizers where importable, torch eager ops otherwise; each counts its own inputs and outputs once).
- ``graph_vs_eager.<op>.<eager_us|eager_queued_us|graph_us>``: microseconds per op of ``all_reduce``
  and the fused op eager (CUDA events around GRAPH_CALLS calls: as the host paces them, and with the
  GPU held until all are queued) and in a replayed CUDA graph of the same calls.
- ``dependent_chains.*``: ``tests/gpu_check/chains.py``'s figures (``measure(device_index)``, or
  ``rehearse()``), or one skip naming why they are missing.

A section that raises makes the step ``fail`` (its traceback in ``tracebacks``); the other sections
still run. Within the chains, graph and local sections one configuration or op that raises is a figure
``{"status": "fail", "reason": ...}`` and the section goes on (a torch counterpart that raises is a skip:
not ubnext's failure). Rehearsal: every figure that needs a GPU is ``skipped`` with its reason, after the Python
that can run on the CPU has run (the chain's launches through ``_run`` on the emulator, each local op
called once on the emulator and its torch counterpart on the CPU)."""

from __future__ import annotations

import importlib
import os
import statistics
import time
import traceback
from contextlib import ExitStack, contextmanager

from tests.gpu_check.common import Context, figure, log, result, skipped

SHAPE = (8, 4096)  # tokens x hidden, bf16: the host-cost and chain message (64 KB)
EPS = 1e-6
ROUNDS = 7
# calls per function per round: each queues a kernel and an event, below the launch queue's depth (about
# a thousand entries), past which the host would wait for the sleeping GPU
HOST_CALLS = 200
CHAIN = 200
CHAIN_REPS = 5
CHAIN_REHEARSE_LINKS = 3
LOCAL_SHAPE = (8192, 4096)  # 64 MB of bf16: past the H100's 50 MB L2
LOCAL_SHAPE_REHEARSE = (16, 4096)
LOCAL_REPS = 20
LOCAL_BLOCKS = 3
GRAPH_CALLS = 50
GRAPH_REPS = 5
BUSY_MS = 40.0  # how long the GPU sleeps ahead of a timed block
QUANT_FORMATS = ("nvfp4", "mxfp8", "fp8_group128")
HOST_CALL_NAMES = (
    "noop_op",
    "torch_add_out",
    "comm.all_reduce",
    "comm.all_reduce_add_rmsnorm",
    "torch.ops.ubnext.all_reduce",
    "torch.ops.ubnext.all_reduce_add_rmsnorm",
)
LOCAL_OPS = tuple(f"quantize_{fmt}" for fmt in QUANT_FORMATS) + ("quantize_fp8", "add_rmsnorm")
GRAPH_OPS = ("all_reduce", "all_reduce_add_rmsnorm")
STREAMS = ("default_stream", "side_stream")

NO_GPU = "no GPU (torch is a CPU build)"


def chain_configs() -> list[tuple[bool, bool, str, bool]]:
    """(pdl, event, stream, captured) of every chain timed."""
    return [
        (pdl, event, stream, captured)
        for captured in (False, True)
        for stream in STREAMS
        for pdl in (True, False)
        for event in (True, False)
    ]


def chain_name(pdl: bool, event: bool, stream: str, captured: bool) -> str:
    return (
        f"chain_us.pdl_{'on' if pdl else 'off'}.event_{'on' if event else 'off'}.{stream}."
        f"{'graph' if captured else 'eager'}"
    )


# -- the one-rank communicator ---------------------------------------------------------------------


def _world1_communicator(rehearse: bool):
    import torch
    import torch.distributed as dist

    os.environ["UBNEXT_WORLD1_KERNELS"] = "1"  # the seam: read when the communicator is made
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    from ubnext.comm import Communicator

    if not rehearse:
        torch.cuda.set_device(0)
    comm = Communicator(emulate=rehearse, max_hidden=SHAPE[1])
    if comm.mode != ("emulator" if rehearse else "gpu"):
        raise RuntimeError(f"the communicator is in {comm.mode} mode: {comm._pool_error}")
    comm.prepare()
    if comm._pool is None:
        raise RuntimeError(f"no pool at world 1: {comm._pool_error}")
    return comm


def _inputs(shape, device, seed: int = 0):
    """x, residual, weight in bf16; x holds small integers, which a one-rank sum returns exactly."""
    import torch

    g = torch.Generator().manual_seed(seed)
    n = shape[0] * shape[1]
    x = ((torch.arange(n) * 7 + seed) % 251 - 125).to(torch.bfloat16).view(shape)
    residual = torch.randn(shape, generator=g).to(torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(torch.bfloat16)
    return x.to(device), residual.to(device), weight.to(device)


# -- keeping the GPU busy --------------------------------------------------------------------------


class _GpuBusy:
    """A sleep kernel queued ahead of a timed block keeps the GPU from reaching the block's work before
    the host has queued all of it. ``start`` queues it and an event after it; ``ran_dry`` says whether
    that event had completed by the end of the block (the sleep ended early: the GPU may have waited for
    the host, or the host for the GPU)."""

    def __init__(self, ms: float = BUSY_MS):
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)  # warm-up: the first launch of the sleep kernel
        probe = 20_000_000
        start.record()
        torch.cuda._sleep(probe)
        end.record()
        end.synchronize()
        self.cycles_per_ms = probe / start.elapsed_time(end)
        self.cycles = int(self.cycles_per_ms * ms)

    def start(self):
        import torch

        torch.cuda._sleep(self.cycles)
        after = torch.cuda.Event()
        after.record()
        return after

    @staticmethod
    def ran_dry(token) -> bool:
        return bool(token.query())

    @staticmethod
    def settle() -> None:
        import torch

        torch.cuda.synchronize()


class _NoGpu:
    """The rehearsal's stand-in: nothing to keep busy."""

    cycles_per_ms = None

    def start(self):
        return None

    @staticmethod
    def ran_dry(token) -> bool:
        return False

    @staticmethod
    def settle() -> None:
        return None


# -- host microseconds per call --------------------------------------------------------------------

_noop = None


def _noop_op():
    """The floor: an operator that does nothing, registered as ubnext's are (Library define + impl)."""
    global _noop
    if _noop is None:
        import torch

        lib = torch.library.Library("ubnext_gpu_check", "FRAGMENT")  # noqa: TOR901 - a test-only operator
        lib.define("noop(Tensor x, Tensor(a!) out) -> ()")
        lib.impl("noop", lambda x, out: None, "CompositeExplicitAutograd")
        _noop = (lib, torch.ops.ubnext_gpu_check.noop)
    return _noop[1]


@contextmanager
def _recorder_in_place_of_the_launch(comm):
    """The rehearsal: the communicator takes its GPU code path over the emulator's pool, with a fake
    current stream and a recorder in place of the kernel launch (python -m ubnext.bench --host's set-up);
    yields the recorder's launch count (a one-element list)."""
    from unittest import mock

    import torch

    from ubnext import kernels
    from ubnext.bench import _FakeStream
    from ubnext.runtime import _cuda

    launches = [0]

    def record_launch(*args):
        launches[0] += 1

    with ExitStack() as patches:
        patches.enter_context(mock.patch.object(_cuda, "current_stream_handle", lambda index: _FakeStream.cuda_stream))
        patches.enter_context(mock.patch.object(torch.cuda, "current_stream", lambda device=None: _FakeStream))
        patches.enter_context(mock.patch.object(kernels, "load_kernel", lambda name, index: name))
        patches.enter_context(mock.patch.object(_cuda, "launch", record_launch))
        patches.enter_context(mock.patch.object(_cuda, "pdl_enabled", lambda index: True))
        patches.enter_context(mock.patch.object(_cuda, "kernel_handle", lambda kernel: kernel))
        patches.enter_context(mock.patch.object(_cuda, "_primary_context", lambda index: (None, 0)))  # kept by configs
        patches.enter_context(mock.patch.object(_cuda, "create_event", lambda index: None))
        comm.mode = "gpu"
        try:
            yield launches
        finally:
            comm.mode = "emulator"
            comm._plans.clear()  # made in gpu mode
            comm._calls.clear()
            _cuda.launch_config.cache_clear()  # its configs name no context


def _alternating_rounds(fns: dict, busy, calls: int, rounds: int) -> tuple[dict, dict]:
    """Microseconds per call of each function, ``rounds`` rounds of ``calls`` calls, the functions taking
    turns within each round (a row and its floor are timed in the same phase of the machine), and how
    many rounds of each the GPU ran dry."""
    for fn in fns.values():
        for _ in range(20):
            fn()
    busy.settle()
    times = {name: [] for name in fns}
    dry = dict.fromkeys(fns, 0)
    for _ in range(rounds):
        for name, fn in fns.items():
            token = busy.start()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            elapsed = time.perf_counter() - start
            dry[name] += busy.ran_dry(token)
            busy.settle()
            times[name].append(elapsed / calls * 1e6)
    return times, dry


def _host_section(ctx: Context, comm, figures: dict, details: dict) -> None:
    import torch

    from ubnext import plan

    x, residual, weight = _inputs(SHAPE, comm.device)
    y, z, noop_out = torch.randn_like(x), torch.empty_like(x), torch.empty_like(x)
    noop = _noop_op()
    fns = {
        "noop_op": lambda: noop(x, noop_out),
        "torch_add_out": lambda: torch.add(x, y, out=z),
        "comm.all_reduce": lambda: comm.all_reduce(x),
        "comm.all_reduce_add_rmsnorm": lambda: comm.all_reduce_add_rmsnorm(x, residual, weight, EPS),
        "torch.ops.ubnext.all_reduce": lambda: torch.ops.ubnext.all_reduce(x, comm.key, ""),
        "torch.ops.ubnext.all_reduce_add_rmsnorm": lambda: torch.ops.ubnext.all_reduce_add_rmsnorm(
            x, residual, weight, EPS, comm.key
        ),
    }
    assert tuple(fns) == HOST_CALL_NAMES
    shape = f"{SHAPE[0]}x{SHAPE[1]} bf16"
    with ExitStack() as stack:
        stack.enter_context(torch.inference_mode())
        if ctx.rehearse:
            launches = stack.enter_context(_recorder_in_place_of_the_launch(comm))
            busy = _NoGpu()
            method = (
                f"CPU rehearsal (no GPU): host time.perf_counter over {HOST_CALLS} calls, median of {ROUNDS} "
                f"alternating rounds; the GPU code path (comm.mode 'gpu') over the emulator's pool with a fake "
                f"current stream and a recorder in place of the kernel launch (as python -m ubnext.bench "
                f"--host): the Python path's cost, not the driver's; world 1 through UBNEXT_WORLD1_KERNELS; "
                f"{shape}; inference_mode"
            )
        else:
            launches = None
            busy = _GpuBusy()
            details["sleep_cycles_per_ms"] = round(busy.cycles_per_ms)
            method = (
                f"host time.perf_counter over {HOST_CALLS} calls, median of {ROUNDS} alternating rounds, the "
                f"real driver, the GPU kept busy by torch.cuda._sleep ({BUSY_MS:g} ms) queued ahead of each "
                f"timed block so that the host never waits on it; world 1 through UBNEXT_WORLD1_KERNELS; "
                f"{shape}; inference_mode"
            )
        paths = {}
        for name, fn in fns.items():  # each ubnext call once: the kernel path, not the one-rank copy
            fn()
            if name.startswith(("comm.", "torch.ops.ubnext.")):
                paths[name] = comm.last_path
        details["host_paths"] = paths
        wrong = {name: path for name, path in paths.items() if path not in plan.KERNEL_PATHS}
        if wrong:
            raise AssertionError(f"calls that took no kernel path: {wrong}")
        launched_before = launches[0] if launches else 0
        times, dry = _alternating_rounds(fns, busy, HOST_CALLS, ROUNDS)
        if launches is not None:
            expected = 4 * (20 + HOST_CALLS * ROUNDS)  # four ubnext calls, each one launch
            if launches[0] - launched_before != expected:
                raise AssertionError(f"the recorder saw {launches[0] - launched_before} launches, not {expected}")
    floor = times["noop_op"]
    for name, per_round in times.items():
        extra = {"rounds_us": [round(t, 3) for t in per_round]}
        if not ctx.rehearse:
            extra["rounds_gpu_ran_dry"] = dry[name]
        figures[f"host_us.{name}"] = figure(round(statistics.median(per_round), 3), "us per call", method, **extra)
        if name != "noop_op":
            ratios = [(t - f) / f for t, f in zip(per_round, floor)]
            figures[f"host_floors.{name}"] = figure(
                round(statistics.median(ratios), 3),
                "floors: (call - no-op op) / no-op op",
                f"per round against the no-op Library operator timed in the same round, median over the rounds; "
                f"{method}",
            )


# -- launch chains -----------------------------------------------------------------------------------


def _chain_launch(comm):
    """The one-rank Lamport allreduce of SHAPE as the planner would make it (``Executor._launch_for``)."""
    import torch

    n = SHAPE[0] * SHAPE[1]
    return comm._launch_for("lamport", torch.bfloat16, n, 0, 0.0, 0), n


def _chain_buffers(n: int, device):
    """CHAIN + 1 rows: the first the input, the others NaN until the chain writes them; link k reduces row
    k into row k + 1 (at one rank: a copy), so the last row equals the first when every link ran in order."""
    import torch

    x, _, _ = _inputs((1, n), device, seed=3)
    buffers = torch.full((CHAIN + 1, n), float("nan"), dtype=torch.bfloat16, device=device)
    buffers[0] = x[0]
    pointers = [(buffers[k].data_ptr(), buffers[k + 1].data_ptr(), 0, 0, 0, 0, 0) for k in range(CHAIN)]
    return buffers, pointers


def _rehearse_chain(comm, details: dict) -> None:
    """The chain's launches through ubnext's own ``_run`` on the emulator, for a few links: the Launch,
    the buffers and the pointers the GPU run uses, and the result check."""
    import torch

    how, n = _chain_launch(comm)
    buffers, pointers = _chain_buffers(n, comm.device)
    comm._check_usable()
    for p in pointers[:CHAIN_REHEARSE_LINKS]:
        comm._run(how, p)
    exact = torch.equal(buffers[CHAIN_REHEARSE_LINKS], buffers[0])
    untouched = bool(buffers[CHAIN_REHEARSE_LINKS + 1 :].isnan().all())
    details["chain_rehearsal"] = {
        "kernel": how.name,
        "grid": how.grid,
        "block": how.block,
        "links_run_on_the_emulator": CHAIN_REHEARSE_LINKS,
        "exact": exact,
    }
    if not (exact and untouched):
        raise AssertionError(
            f"the emulated chain of {CHAIN_REHEARSE_LINKS} links: exact={exact}, later rows untouched={untouched}"
        )


def _chain_enqueue(comm, how, pointers, pdl: bool, event: bool, captured: bool, extra_event):
    """A function that queues the CHAIN launches on the current stream. ubnext's own launch
    (``Executor._run``) where it does what the configuration asks: eager, it records the communicator's
    ordering event after every kernel; captured, none. The other two (eager without the event, captured
    with a record after every kernel) launch the same Launch through ``_cuda.launch`` directly."""
    import torch

    from ubnext.runtime import _cuda

    how = how._replace(pdl=pdl)
    device_index = comm._device_index
    if event != captured:

        def enqueue():
            comm._check_usable()  # this stream becomes the call's (comm._stream), captured or not
            if comm._capturing != captured:
                raise AssertionError(f"the communicator sees capturing={comm._capturing}")
            for p in pointers:
                comm._run(how, p)

        return enqueue
    done = extra_event if event else None

    def enqueue():
        config = _cuda.launch_config(
            how.grid, how.block, torch.cuda.current_stream().cuda_stream, pdl, device_index, how.cluster
        )
        for p in pointers:
            _cuda.launch(how.kernel, config, how.params, p, done)

    return enqueue


def _time_chain(comm, buffers, stream, busy, enqueue=None, graph=None) -> tuple[float, bool, bool]:
    """(microseconds per kernel, exact, the GPU ran dry) of one chain on ``stream``."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        buffers[1:].fill_(float("nan"))
        torch.cuda._sleep(busy.cycles)
        start.record()
        if graph is not None:
            graph.replay()
        else:
            enqueue()
        end.record()
        dry = bool(start.query())
    end.synchronize()
    exact = torch.equal(buffers[CHAIN], buffers[0]) and int(comm._pool.err_view[0]) == 0
    return start.elapsed_time(end) * 1000.0 / CHAIN, exact, dry


def _chain_section(ctx: Context, comm, figures: dict, details: dict) -> None:
    if ctx.rehearse:
        _rehearse_chain(comm, details)
        why = (
            f"{NO_GPU}: CUDA events, programmatic dependent launch and CUDA graphs need one; the chain's "
            f"launches ran through Executor._run on the emulator for {CHAIN_REHEARSE_LINKS} links "
            "(details.chain_rehearsal)"
        )
        for config in chain_configs():
            figures[chain_name(*config)] = skipped(why)
        for stream in STREAMS:
            figures[f"chain_pdl_gain_kept.{stream}"] = skipped(why)
        return
    import torch

    from ubnext.runtime import _cuda

    how, n = _chain_launch(comm)
    buffers, pointers = _chain_buffers(n, comm.device)
    busy = _GpuBusy()
    streams = {"default_stream": torch.cuda.default_stream(), "side_stream": torch.cuda.Stream()}
    extra_event = _cuda.create_event(comm._device_index)  # never comm's own: a capture records it
    details["chain"] = {
        "kernel": how.name,
        "grid": how.grid,
        "block": how.block,
        "bytes_per_link": n * 2,
        "links": CHAIN,
        "pdl_supported": _cuda.pdl_enabled(comm._device_index),
    }
    medians, spreads, problems, graphs = {}, {}, [], []
    for pdl, event, stream_name, captured in chain_configs():
        name = chain_name(pdl, event, stream_name, captured)
        try:
            figures[name] = _one_chain(
                comm,
                how,
                n,
                buffers,
                pointers,
                busy,
                streams[stream_name],
                extra_event,
                pdl,
                event,
                stream_name,
                captured,
                graphs,
            )
        except Exception as exc:  # noqa: BLE001 - this configuration's failure; the others still run
            figures[name] = {"status": "fail", "reason": f"{type(exc).__name__}: {exc}"}
            problems.append(f"{name}: {type(exc).__name__}: {exc}")
            continue
        if not figures[name].pop("exact"):
            problems.append(f"{name}: the chain's result is wrong or a kernel reported an error")
        medians[name] = figures[name]["value"]
        spreads[name] = max(figures[name]["runs_us"]) - min(figures[name]["runs_us"])
    del graphs
    for stream_name in STREAMS:
        names = {
            (pdl, event): chain_name(pdl, event, stream_name, False) for pdl in (True, False) for event in (True, False)
        }
        if not all(n in medians for n in names.values()):
            figures[f"chain_pdl_gain_kept.{stream_name}"] = skipped("an eager chain it compares failed")
            continue
        t = {key: medians[n] for key, n in names.items()}
        noise = max(spreads[n] for n in names.values())
        gain_without, gain_with = t[(False, False)] - t[(True, False)], t[(False, True)] - t[(True, True)]
        if gain_without <= noise:
            figures[f"chain_pdl_gain_kept.{stream_name}"] = skipped(
                f"PDL's gain without the event ({t[(False, False)]:.3f} - {t[(True, False)]:.3f} = {gain_without:.3f} "
                f"us per kernel) is not above the runs' spread ({noise:.3f} us): nothing measurable for the event "
                "to defeat"
            )
            continue
        kept = gain_with / gain_without
        figures[f"chain_pdl_gain_kept.{stream_name}"] = figure(
            round(kept, 3),
            "fraction of PDL's per-kernel gain kept with the per-launch event",
            "eager chains: (pdl off - pdl on) with the event over the same without it, from the chain_us medians; "
            "defeats: less than half kept",
            defeats=kept < 0.5,
            gain_without_event_us=round(gain_without, 3),
            gain_with_event_us=round(gain_with, 3),
            runs_spread_us=round(noise, 3),
        )
    details["event_defeats_pdl"] = {s: figures[f"chain_pdl_gain_kept.{s}"].get("defeats") for s in STREAMS}
    if problems:
        raise AssertionError("; ".join(problems))


def _one_chain(
    comm,
    how,
    n,
    buffers,
    pointers,
    busy,
    stream,
    extra_event,
    pdl: bool,
    event: bool,
    stream_name: str,
    captured: bool,
    graphs: list,
) -> dict:
    """One configuration's figure, with ``exact`` (every run's result right, no kernel error) to pop."""
    import torch

    enqueue = _chain_enqueue(comm, how, pointers, pdl, event, captured, extra_event)
    graph = None
    if captured:
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            enqueue()
        graphs.append(graph)  # kept until every chain is timed
    _time_chain(comm, buffers, stream, busy, enqueue, graph)  # warm-up
    runs = [_time_chain(comm, buffers, stream, busy, enqueue, graph) for _ in range(CHAIN_REPS)]
    us = [r[0] for r in runs]
    how_launched = {
        (True, False): "Executor._run (ubnext's eager launch: its ordering event after each kernel)",
        (False, True): "Executor._run under capture (ubnext's: no event)",
        (False, False): "_cuda.launch without the event",
        (True, True): "_cuda.launch with a cuEventRecord after each kernel inside the capture "
        "(ubnext records none when captured)",
    }[(event, captured)]
    return figure(
        round(statistics.median(us), 3),
        "us per kernel",
        f"CUDA events around {CHAIN} dependent one-rank {how.name} launches ({n * 2} bytes each) on the "
        f"{stream_name.replace('_', ' ')}, {'replayed CUDA graph' if captured else 'eager'}, launched by "
        f"{how_launched}; the chain queued behind a torch.cuda._sleep; median of {CHAIN_REPS}",
        runs_us=[round(u, 3) for u in us],
        runs_gpu_ran_dry=sum(r[2] for r in runs),
        exact=all(r[1] for r in runs),
    )


# -- local kernels -----------------------------------------------------------------------------------


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _torchao_quantizer(fmt: str):
    """torchao's eager quantizer of ``fmt``, or the reason there is none."""
    try:
        if fmt == "nvfp4":
            from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize

            return lambda x: nvfp4_quantize(x, 16, None), "torchao nvfp4_quantize(x, 16)"
        import torch
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import to_mx

        return (
            lambda x: to_mx(x, torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL),
            "torchao to_mx(x, float8_e4m3fn, 32, RCEIL)",
        )
    except Exception as exc:  # noqa: BLE001 - not installed, or an API that moved
        return None, f"torchao is not importable here ({type(exc).__name__}: {exc})"


def _local_cases(comm, shape) -> dict:
    """op -> (ubnext call, bytes it reads, torch call or None, what the torch call is or why there is
    none, bytes the torch call reads). Each call returns its outputs."""
    import torch
    import torch.nn.functional as F

    from ubnext import kernels
    from ubnext.reference._checks import quantize_fp8_reference

    x, residual, weight = _inputs(shape, comm.device, seed=5)
    hidden = shape[-1]
    cases = {}
    for fmt in QUANT_FORMATS:
        if fmt == "fp8_group128":
            alt, what = (
                (lambda x=x: quantize_fp8_reference(x, 128, None)),
                "torch eager ops: ubnext.reference._checks.quantize_fp8_reference over groups of 128 (no torchao form)",
            )
        else:
            quantizer, what = _torchao_quantizer(fmt)
            alt = None if quantizer is None else (lambda q=quantizer: q(x))
        cases[f"quantize_{fmt}"] = ((lambda fmt=fmt: comm.quantize(x, fmt)), _nbytes(x), alt, what, _nbytes(x))
    cases["quantize_fp8"] = (
        (lambda: comm.quantize_fp8(x)),
        _nbytes(x),
        (lambda: quantize_fp8_reference(x, hidden, None)),
        "torch eager ops: ubnext.reference._checks.quantize_fp8_reference per row",
        _nbytes(x),
    )
    # the add + RMSNorm kernel, as the fused op runs it on torch.distributed's fp32 sum past the pool
    # (ubnext/comm/_fused.py, Planner._call_for's norm launch)
    reduced = x.float()
    norm = comm._launch_for("add_rmsnorm", torch.bfloat16, x.numel(), hidden, EPS, kernels.F_FUSED_NORM)

    def add_rmsnorm():
        out, residual_out = torch.empty_like(x), torch.empty_like(residual)
        comm._check_usable()
        comm._launch(norm, reduced, out, residual, residual_out, weight)
        return out, residual_out

    def torch_add_rmsnorm():
        residual_out = x + residual
        return F.rms_norm(residual_out, (hidden,), weight, EPS), residual_out

    cases["add_rmsnorm"] = (
        add_rmsnorm,
        _nbytes(reduced, residual, weight),
        torch_add_rmsnorm,
        "torch eager: x + residual, then F.rms_norm (bf16 x: the sum a bf16 allreduce returns)",
        _nbytes(x, residual, weight),
    )
    return cases


def _outputs_bytes(outputs) -> int:
    import torch

    if isinstance(outputs, torch.Tensor):
        return _nbytes(outputs)
    return sum(_outputs_bytes(o) for o in outputs if o is not None and not isinstance(o, (int, float, str)))


def _kernel_of(comm, op: str) -> str | None:
    """The path the communicator remembered for ``op``'s signature (quantize_* or add_rmsnorm)."""
    paths = {call.path for key, call in comm._calls.items() if key[0] == op}
    return next(iter(paths)) if len(paths) == 1 else None


def _gpu_us_per_call(fn, reps: int, busy) -> tuple[float, int]:
    """Median over LOCAL_BLOCKS blocks of ``reps`` calls, CUDA events around each block queued behind a
    sleep; and in how many blocks the GPU ran dry."""
    import torch

    fn()
    torch.cuda.synchronize()
    per_call, dry = [], 0
    for _ in range(LOCAL_BLOCKS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(busy.cycles)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        dry += bool(start.query())
        end.synchronize()
        per_call.append(start.elapsed_time(end) * 1000.0 / reps)
    return statistics.median(per_call), dry


def _local_section(ctx: Context, comm, figures: dict, details: dict) -> None:
    import torch

    shape = LOCAL_SHAPE_REHEARSE if ctx.rehearse else LOCAL_SHAPE
    cases = _local_cases(comm, shape)
    assert tuple(cases) == LOCAL_OPS
    if ctx.rehearse:
        ran = {}
        for op, (call, read, alt, what, _alt_read) in cases.items():
            written = _outputs_bytes(call())
            kernel = _kernel_of(comm, op) if op != "add_rmsnorm" else "add_rmsnorm"
            if kernel != op:
                raise AssertionError(f"{op} ran {kernel or 'no kernel'} on the emulator, not its kernel")
            alt_ran = (
                "none: " + what if alt is None else f"{what}: ran once on the CPU, {_outputs_bytes(alt())} bytes out"
            )
            ran[op] = {
                "ubnext": f"ran its kernel once on the emulator at {shape[0]}x{shape[1]} bf16",
                "bytes_read": read,
                "bytes_written": written,
                "torch": alt_ran,
            }
        details["local_rehearsal"] = ran
        why = (
            f"{NO_GPU}: GB/s by CUDA events needs one; each op was called once on the emulator and its torch "
            "counterpart on the CPU (details.local_rehearsal)"
        )
        for op in cases:
            for side in ("ubnext", "d2d_copy", "torch"):
                figures[f"local_gbps.{op}.{side}"] = skipped(why)
        return
    busy = _GpuBusy()
    shape_text = f"{shape[0]}x{shape[1]} bf16"
    events = (
        f"CUDA events around {LOCAL_REPS} calls queued behind a torch.cuda._sleep, median of "
        f"{LOCAL_BLOCKS} blocks; {shape_text}"
    )
    problems = []
    for op, (call, read, alt, what, alt_read) in cases.items():
        try:
            traffic = read + _outputs_bytes(call())
            if op != "add_rmsnorm" and _kernel_of(comm, op) != op:
                raise AssertionError(f"took {_kernel_of(comm, op)}, not its kernel")
            us, dry = _gpu_us_per_call(call, LOCAL_REPS, busy)
            figures[f"local_gbps.{op}.ubnext"] = figure(
                round(traffic / us / 1e3, 1),
                "GB/s (bytes read + written per second, 1e9)",
                f"ubnext's kernel; {events}",
                us_per_call=round(us, 3),
                bytes=traffic,
                blocks_gpu_ran_dry=dry,
            )
            half = torch.empty(traffic // 2, dtype=torch.uint8, device=comm.device)
            other = torch.empty_like(half)
            copy_us, copy_dry = _gpu_us_per_call(lambda dst=other, src=half: dst.copy_(src), LOCAL_REPS, busy)
            figures[f"local_gbps.{op}.d2d_copy"] = figure(
                round(2 * half.numel() / copy_us / 1e3, 1),
                "GB/s (bytes read + written per second, 1e9)",
                f"device-to-device copy_ of {half.numel()} bytes (the kernel's traffic, read and written); {events}",
                us_per_call=round(copy_us, 3),
                blocks_gpu_ran_dry=copy_dry,
            )
            del half, other
        except Exception as exc:  # noqa: BLE001 - this op's failure; the others still run
            problems.append(f"{op}: {type(exc).__name__}: {exc}")
            for side in ("ubnext", "d2d_copy"):
                figures.setdefault(f"local_gbps.{op}.{side}", {"status": "fail", "reason": problems[-1]})
        figures[f"local_gbps.{op}.torch"] = _torch_counterpart(alt, what, alt_read, events, busy)
    if problems:
        raise AssertionError("; ".join(problems))


def _torch_counterpart(alt, what: str, alt_read: int, events: str, busy) -> dict:
    """The torch code's figure; a skip where there is none, or where it raised (not ubnext's failure)."""
    if alt is None:
        return skipped(what)
    try:
        alt_traffic = alt_read + _outputs_bytes(alt())
        alt_us, alt_dry = _gpu_us_per_call(alt, LOCAL_REPS, busy)
    except Exception as exc:  # noqa: BLE001 - a third party's failure is reported, not ours
        return skipped(f"{what} raised {type(exc).__name__}: {exc}")
    return figure(
        round(alt_traffic / alt_us / 1e3, 1),
        "GB/s (its own inputs read once + outputs written once, 1e9)",
        f"{what}; {events}",
        us_per_call=round(alt_us, 3),
        bytes=alt_traffic,
        blocks_gpu_ran_dry=alt_dry,
    )


# -- graph replay against eager -------------------------------------------------------------------


def _graph_section(ctx: Context, comm, figures: dict, details: dict) -> None:
    if ctx.rehearse:
        for op in GRAPH_OPS:
            for side in ("eager_us", "eager_queued_us", "graph_us"):
                figures[f"graph_vs_eager.{op}.{side}"] = skipped(f"{NO_GPU}: CUDA graphs and CUDA events need one")
        return
    import torch

    x, residual, weight = _inputs(SHAPE, comm.device, seed=9)
    out = torch.empty_like(x)
    fns = {
        "all_reduce": lambda: comm.all_reduce(x, out=out),
        "all_reduce_add_rmsnorm": lambda: comm.all_reduce_add_rmsnorm(x, residual, weight, EPS),
    }
    assert tuple(fns) == GRAPH_OPS
    busy = _GpuBusy()
    shape = f"{SHAPE[0]}x{SHAPE[1]} bf16, world 1"
    problems = []
    for op, fn in fns.items():
        try:
            _graph_against_eager(comm, op, fn, busy, shape, figures, details)
        except Exception as exc:  # noqa: BLE001 - this op's failure; the other still runs
            problems.append(f"{op}: {type(exc).__name__}: {exc}")
            for side in ("eager_us", "eager_queued_us", "graph_us"):
                figures.setdefault(f"graph_vs_eager.{op}.{side}", {"status": "fail", "reason": problems[-1]})
    if problems:
        raise AssertionError("; ".join(problems))


def _graph_against_eager(comm, op: str, fn, busy, shape: str, figures: dict, details: dict) -> None:
    import torch

    from ubnext import plan

    fn()
    if comm.last_path not in plan.KERNEL_PATHS:
        raise AssertionError(f"took {comm.last_path}, not a kernel path")
    details.setdefault("graph_paths", {})[op] = comm.last_path
    torch.cuda.synchronize()
    eager, replayed = [], []
    for _ in range(GRAPH_REPS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(GRAPH_CALLS):
            fn()
        end.record()
        end.synchronize()
        eager.append(start.elapsed_time(end) * 1000.0 / GRAPH_CALLS)
    queued_us, queued_dry = _gpu_us_per_call(fn, GRAPH_CALLS, busy)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    for _ in range(GRAPH_REPS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        replayed.append(start.elapsed_time(end) * 1000.0 / GRAPH_CALLS)
    del graph
    figures[f"graph_vs_eager.{op}.eager_us"] = figure(
        round(statistics.median(eager), 3),
        "us per op",
        f"CUDA events around {GRAPH_CALLS} eager calls as the host issues them (host-paced), median of "
        f"{GRAPH_REPS}; {shape}",
        runs_us=[round(u, 3) for u in eager],
    )
    figures[f"graph_vs_eager.{op}.eager_queued_us"] = figure(
        round(queued_us, 3),
        "us per op",
        f"CUDA events around {GRAPH_CALLS} eager calls queued behind a torch.cuda._sleep (the GPU's own time "
        f"per op), median of {LOCAL_BLOCKS}; {shape}",
        blocks_gpu_ran_dry=queued_dry,
    )
    figures[f"graph_vs_eager.{op}.graph_us"] = figure(
        round(statistics.median(replayed), 3),
        "us per op",
        f"CUDA events around one replay of a CUDA graph of {GRAPH_CALLS} captured calls, median of "
        f"{GRAPH_REPS}; {shape}",
        runs_us=[round(u, 3) for u in replayed],
    )


# -- dependent-load chains (tests/gpu_check/chains.py) -------------------------------------------------


def _dependent_chains_section(ctx: Context, comm, figures: dict, details: dict) -> None:
    try:
        chains = importlib.import_module("tests.gpu_check.chains")
    except Exception as exc:  # noqa: BLE001 - missing, or broken: the figure says which
        figures["dependent_chains"] = skipped(
            f"tests/gpu_check/chains.py is not importable: {type(exc).__name__}: {exc}"
        )
        return
    what = "rehearse()" if ctx.rehearse else "measure(0)"
    try:
        got = chains.rehearse() if ctx.rehearse else chains.measure(comm._device_index)
    except Exception as exc:  # noqa: BLE001 - its own failure is recorded, not this step's
        figures["dependent_chains"] = skipped(f"tests.gpu_check.chains.{what} raised {type(exc).__name__}: {exc}")
        details["dependent_chains_traceback"] = traceback.format_exc()[-3000:]
        return
    if isinstance(got, dict) and isinstance(got.get("figures"), dict):
        details["dependent_chains"] = {k: v for k, v in got.items() if k != "figures"}
        got = got["figures"]
    elif not isinstance(got, dict):
        got = {}
    if not got:
        figures["dependent_chains"] = skipped(f"tests.gpu_check.chains.{what} returned no figures")
    for name, value in got.items():
        figures[f"dependent_chains.{name}"] = value


# -- the step ----------------------------------------------------------------------------------------

SECTIONS = (
    ("host", _host_section),
    ("chains", _chain_section),
    ("graph", _graph_section),
    ("local", _local_section),
    ("dependent_chains", _dependent_chains_section),
)


def run(ctx: Context) -> dict:
    comm = _world1_communicator(ctx.rehearse)
    figures: dict = {}
    details: dict = {"pool_backend": type(comm._pool.backend).__name__, "has_multicast": comm._pool.has_multicast}
    failures, tracebacks = [], {}
    try:
        for name, section in SECTIONS:
            started = time.monotonic()
            try:
                section(ctx, comm, figures, details)
            except Exception as exc:  # noqa: BLE001 - one section's failure; the others still run
                failures.append(f"{name}: {type(exc).__name__}: {exc}")
                tracebacks[name] = traceback.format_exc()[-3000:]
            log(f"timings: {name} in {time.monotonic() - started:.1f} s")
    finally:
        comm.close()
    if failures:
        return result("fail", "; ".join(failures), figures=figures, tracebacks=tracebacks, **details)
    return result("pass", figures=figures, **details)
