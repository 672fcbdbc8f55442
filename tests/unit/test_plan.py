"""The planner is a pure function of rank-identical inputs: the Communicator builds its view
from the pool's layout, never from the allocator's state."""

from types import SimpleNamespace

import pytest
import torch

import ubnext.runtime._cuda
from ubnext import plan
from ubnext.comm import Communicator
from ubnext.pool import plan_layout


def _comm_with(pool):
    comm = object.__new__(Communicator)  # no process group: only what _pool_view reads
    comm._closed, comm._pool, comm._pool_error, comm.mode = False, pool, None, "emulator"
    comm._disabled, comm.world_size = {}, 4
    return comm


def test_view_comes_from_the_layout_only():
    layout = plan_layout(4, 4096)

    class NoArenas:
        has_multicast = True
        lamport_capacity = layout.lamport_slot_bytes

        def __init__(self):
            self.layout = layout

        @property
        def arenas(self):
            raise AssertionError("the planner read this rank's allocator state")

    view = _comm_with(NoArenas())._pool_view()
    assert view.staging_bytes == layout.staging_bytes and view.has_multicast and view.world_size == 4


@pytest.mark.parametrize("nbytes", [16, 8 << 10, 1 << 20, (1 << 20) + 16, 4 << 20, 64 << 20])
@pytest.mark.parametrize("fused", [False, True])
def test_same_signature_same_plan(nbytes, fused):
    """Two ranks with the same layout and world size plan the same path: the first of the model's
    order (ubnext/plan/_thresholds.py) that this pool can run, torch.distributed past them all."""
    layout = plan_layout(8, 8192)
    views = [
        plan.PoolView(None, True, layout.lamport_slot_bytes, layout.staging_bytes, "gpu", True, world_size=8)
        for _ in range(2)
    ]
    plans = [plan.choose(nbytes, 2, fused, 8192, v) for v in views]
    assert plans[0] == plans[1]
    caps = plan.capabilities(nbytes, 2, fused, 8192, views[0])
    order = plan.auto_order(nbytes, fused, True, False, 8)
    assert plans[0].path == next(p for p in order if caps[p] is None)
    if nbytes > layout.staging_bytes:
        assert plans[0].path == "torch"  # NCCL past the staging region: torch_symm only when asked for


def test_torch_symm_runs_only_when_asked_for():
    """Issue 23: torch_symm left the automatic chain (plan.auto_order says why); forced, it still
    runs where torch has the op, and falls back to torch.distributed where not."""
    layout = plan_layout(8, 8192)
    big = layout.staging_bytes * 2
    view = plan.PoolView(None, True, layout.lamport_slot_bytes, layout.staging_bytes, "gpu", True)
    assert "torch_symm" not in plan.auto_order(big, False, True, False)
    assert plan.choose(big, 2, False, 8192, view).path == "torch"
    assert plan.choose(big, 2, False, 8192, view, forced="torch_symm").path == "torch_symm"
    no_op = plan.PoolView(None, True, layout.lamport_slot_bytes, layout.staging_bytes, "gpu", False)
    assert plan.choose(big, 2, False, 8192, no_op, forced="torch_symm").path == "torch"


@pytest.mark.parametrize("nbytes", [16, 1 << 20, (1 << 20) + 16, 4 << 20, 64 << 20])
@pytest.mark.parametrize("fused", [False, True])
def test_the_batch_invariant_mode_never_plans_a_switch_reduction(nbytes, fused):
    """Issue 26: the mode's choice is the default's without the paths that reduce in the switch
    (nvls_oneshot; torch's symmetric op); one of them forced is an error naming the mode, not a
    fallback. The two NVLS two-shot paths stay, plain and fused: they sum in rank order (fused rows
    always; plain calls under the flag the mode sets). Where the default's nvls_lamport does not fit
    the Lamport slot, the mode's plain one (its push form, 2/N of the message per slot) may: the
    mode then takes it, the path the model orders first (4 MB at 8 ranks)."""
    layout = plan_layout(8, 8192)
    view = plan.PoolView(None, True, layout.lamport_slot_bytes, layout.staging_bytes, "gpu", True)
    default = plan.choose(nbytes, 2, fused, 8192, view, allow_nondeterministic=True)
    mode = plan.choose(nbytes, 2, fused, 8192, view, allow_nondeterministic=True, batch_invariant=True)
    kept = ("nvls_twoshot", "nvls_lamport")
    assert mode.path in ("lamport", "twoshot", "torch") + kept, mode
    push_fits = (
        not fused
        and plan.lamport_bytes_needed("nvls_lamport", nbytes, False, view.world_size, True)
        <= view.lamport_capacity
        < nbytes
    )
    order = plan.auto_order(nbytes, fused, True, True, view.world_size)
    if push_fits and default.path in order and order.index("nvls_lamport") < order.index(default.path):
        assert mode.path == "nvls_lamport", mode
    elif default.path != "nvls_oneshot":
        assert mode.path == default.path
    else:
        assert ("nvls_oneshot", plan.NOT_RANK_ORDER) in mode.skipped
    for forced in plan.LD_REDUCE_PATHS + ("nvls", "torch_symm"):
        if forced in kept + ("nvls",):
            assert plan.choose(nbytes, 2, fused, 8192, view, forced=forced, batch_invariant=True)
            continue
        with pytest.raises(ValueError, match=f"algo '{forced}' cannot run in the batch-invariant mode"):
            plan.choose(nbytes, 2, fused, 8192, view, forced=forced, batch_invariant=True)


def test_forced_path_falls_back_down_the_chain():
    view = plan.PoolView(None, False, 1 << 20, 1 << 22, "emulator")
    chosen = plan.choose(1 << 10, 2, False, 0, view, forced="nvls_twoshot")
    assert chosen.path == "lamport" and chosen.skipped[0] == ("nvls_twoshot", "the pool has no multicast address")


def test_grid_bound_and_timeout_are_agreed_at_pool_creation(monkeypatch):
    """Blocks wait on the same block of every peer: a rank with more SMs must not launch more, nor a
    Blackwell rank a larger NVLS grid than its Hopper peer. And no rank gives up on a peer sooner than
    another rank would wait: the longest timeout wins."""
    import ubnext.comm._prepare as comm_mod

    comm = object.__new__(Communicator)
    comm.mode, comm.world_size, comm.rank, comm.group, comm._max_hidden = "gpu", 2, 0, None, 1024
    comm.device, comm._sm_count, comm._nvls_ctas, comm._pool_error = None, 128, 32, None
    comm._algo, comm._env_algo = None, "auto"  # what the set-up report's settings read (_setup_settings)
    comm._prepare_kernels = lambda: None
    reports = [
        {"error": None, "sm_count": 128, "nvls_ctas": 32, "timeout_s": 30.0, "host": "node1/b", "selftest": True},
        {"error": None, "sm_count": 114, "nvls_ctas": 16, "timeout_s": 600.0, "host": "node1/b", "selftest": True},
    ]
    gathered = iter([reports, [None, None]])  # this rank, then its peer
    comm._setup_allgather = lambda obj, step=None: _with_own(obj, next(gathered))
    created = {}
    monkeypatch.setattr(
        comm_mod, "SymmetricPool", lambda **kw: created.update(kw) or SimpleNamespace(close=lambda: None)
    )
    assert comm._create_pool() is not None
    assert created["timeout_s"] == 600.0
    assert comm._sm_count == 114 and comm._nvls_ctas == 16
    # half the SMs for a kernel that waits on its peers (no deadlock between two communicators)
    assert comm._geometry("twoshot", 1 << 24, 2, 0, False)[0] == 57
    assert comm._geometry("nvls_twoshot", 1 << 24, 2, 0, False)[0] == 8  # NCCL's ceil(16 / 2 ranks)
    # the batch-invariant mode's form sums by unicast loads: the unicast two-shot's grid
    assert comm._geometry("nvls_twoshot", 1 << 24, 2, 0, False, rank_order=True)[0] == 57
    assert comm._geometry("quantize_fp8", 1 << 24, 2, 1 << 14, True)[0] == 114  # local: the whole device


def test_the_batch_invariant_mode_is_agreed_at_pool_creation(monkeypatch):
    """A rank in the mode and a rank out of it would plan different kernels (or the ordered fallback
    against NCCL's allreduce) and wait for each other: every rank refuses alike, before any launch."""
    import ubnext.comm._prepare as comm_mod

    comm = _bare_communicator()
    comm.batch_invariant = True
    reports = [
        {"error": None, "sm_count": 0, "timeout_s": 30.0, "host": "node1/b", "selftest": True, "batch_invariant": mode}
        for mode in (True, False)
    ]
    comm._setup_allgather = lambda obj, step=None: _with_own(obj, reports)
    monkeypatch.setattr(comm_mod, "SymmetricPool", lambda **kw: pytest.fail("allocated a pool across modes"))
    with pytest.raises(ValueError, match=r"batch-invariant mode differs across ranks \(on at rank\(s\) 0 only\)"):
        comm._create_pool()


def _with_own(obj, reports):
    """Crafted pool-creation reports, each completed with what this rank's own report holds and they do
    not (the settings every rank must share, the hidden size): the ranks agree on everything else."""
    if not isinstance(obj, dict):
        return reports
    return [{**obj, **report} for report in reports]


def _bare_communicator(mode="emulator"):
    comm = object.__new__(Communicator)
    comm.mode, comm.world_size, comm.rank, comm.group, comm._max_hidden = mode, 2, 0, None, 1024
    comm.device, comm._sm_count, comm._pool_error = None, 0, None
    comm._pool, comm._closed, comm._disabled = None, False, {}
    comm._algo, comm._env_algo = None, "auto"  # what the set-up report's settings read (_setup_settings)
    comm._prepare_kernels = lambda: None
    return comm


def test_a_group_across_hosts_takes_the_torch_path(monkeypatch):
    """The pool is shared through one node's file descriptors: a group spanning hosts agrees on the
    torch path at creation, before any rank allocates, and says why."""
    import ubnext.comm._prepare as comm_mod

    comm = _bare_communicator()
    reports = [
        {"error": None, "sm_count": 0, "timeout_s": 30.0, "host": h, "selftest": True} for h in ("node1/b1", "node1/b2")
    ]  # one hostname, two machines (boot ids)
    comm._setup_allgather = lambda obj, step=None: _with_own(obj, reports)
    monkeypatch.setattr(comm_mod, "SymmetricPool", lambda **kw: pytest.fail("allocated a pool across hosts"))
    assert comm._create_pool() is None
    assert "spans 2 hosts (node1)" in comm._pool_error


def test_first_use_inside_graph_capture_is_refused(monkeypatch):
    """Creating the pool synchronises and rendezvouses, which a capture cannot contain: a clear
    error that names comm.prepare(), instead of a broken capture."""
    import torch

    from ubnext.comm import UbnextError

    comm = _bare_communicator("gpu")
    comm.device = torch.device("cuda", 0)
    comm._create_pool = lambda: pytest.fail("created the pool during capture")
    monkeypatch.setattr(ubnext.runtime._cuda, "capturing", lambda device: device.type == "cuda")
    with pytest.raises(UbnextError, match=r"comm\.prepare\(\)"):
        _ = comm.pool


def test_a_second_stream_waits_for_the_last_launch_not_the_stream(monkeypatch):
    """Two streams must never run this communicator's kernels at the same time (one sync region):
    a call from a new stream makes it wait for the event recorded right after the last eager
    launch (issue 23 risk: waiting for the old stream as it is at the switch would also wait for
    compute queued there since, which was meant to overlap). No wait while the stream stays, none
    for a captured call, and a captured launch records nothing. The calls go to the driver through
    _cuda (create_event, launch with its ``done`` event, wait_event), recorded here."""
    from types import SimpleNamespace

    calls = []
    comm = _bare_communicator("gpu")
    comm.device, comm._device_index, comm._debug = torch.device("cuda", 3), 3, False
    comm._broken, comm._last_stream, comm._launch_done = None, None, None
    words = torch.zeros(8, dtype=torch.int32)
    comm._pool = SimpleNamespace(err_view=words.numpy(), err_word=words, captured=False, timeout_s=1.0)
    current, capture = [0x10], [False]
    monkeypatch.setattr(ubnext.runtime._cuda, "current_stream_handle", lambda index: current[0])
    monkeypatch.setattr(ubnext.runtime._cuda, "capturing", lambda device: capture[0])
    monkeypatch.setattr(ubnext.runtime._cuda, "create_event", lambda index: calls.append(("create", index)) or "E")
    monkeypatch.setattr(
        ubnext.runtime._cuda, "wait_event", lambda stream, event, index: calls.append(("wait", stream, event, index))
    )
    monkeypatch.setattr(
        ubnext.runtime._cuda,
        "record_event",
        lambda event, stream, index: calls.append(("record", stream, event, index)),
    )
    monkeypatch.setattr(
        ubnext.runtime._cuda, "launch_config", lambda grid, block, stream, pdl, index, cluster=1: stream
    )
    monkeypatch.setattr(
        ubnext.runtime._cuda,
        "launch",
        lambda kernel, stream, params, pointers, done=None: calls.append(("launch", stream, done)),
    )
    how = SimpleNamespace(kernel=0, grid=1, block=32, pdl=True, cluster=1, params=None)

    def op(stream):
        current[0] = stream
        comm._check_usable()
        comm._run(how, (0,) * 7)

    for stream in (0x10, 0x10, 0x20, 0x20, 0x10):
        op(stream)
    assert calls == [
        ("create", 3),
        ("launch", 0x10, "E"),
        ("launch", 0x10, "E"),
        ("wait", 0x20, "E", 3),
        ("launch", 0x20, "E"),
        ("launch", 0x20, "E"),
        ("wait", 0x10, "E", 3),
        ("launch", 0x10, "E"),
    ]
    # an op that reads the staging region after its kernel (the copy out of an in-place two-shot)
    # moves the event past that read, so the next stream waits for it too
    calls.clear()
    comm._pool_reads_done()
    op(0x20)
    assert calls == [("record", 0x10, "E", 3), ("wait", 0x20, "E", 3), ("launch", 0x20, "E")]
    calls.clear()
    capture[0] = True
    op(0x10)  # captured, from another stream: ordered by the graph's owner, and no event in the graph
    assert calls == [("launch", 0x10, None)] and comm._last_stream == 0x20 and comm._pool.captured


def test_torch_symm_never_allocates_inside_capture(monkeypatch):
    """torch_symm needs a symmetric buffer per (numel, dtype); making one allocates and
    rendezvouses, which breaks a capture: a captured call without one takes torch.distributed."""
    import torch
    import torch.distributed._symmetric_memory as symm_mem

    comm = _bare_communicator("gpu")
    comm._symm_buffers = {}
    comm._pool = SimpleNamespace(backend=SimpleNamespace(name="torch_symm"))
    used = []
    comm._torch_all_reduce = lambda x, out: used.append("torch")
    monkeypatch.setattr(symm_mem, "empty", lambda *a, **k: pytest.fail("allocated inside capture"))
    monkeypatch.setattr(ubnext.runtime._cuda, "capturing", lambda device: True)
    x = torch.ones(8)
    comm._torch_symm_all_reduce(x, x)
    assert used == ["torch"]


@pytest.mark.parametrize(
    "dtype,numel,backend,refused",
    [
        (torch.float16, 8, "torch_symm", "float32 and bfloat16 only"),
        (torch.bfloat16, 7, "torch_symm", "whole 4-byte words"),
        (torch.float32, 8, "vmm", "not torch's symmetric memory (vmm)"),
        (torch.bfloat16, 8, "torch_symm", None),
    ],
)
def test_torch_symm_takes_only_what_torchs_op_takes(monkeypatch, caplog, dtype, numel, backend, refused):
    """Issue 23 item 1: what torch's symmetric-memory op refuses inside the user's call (fp16, odd
    2-byte sizes, a pool that is not torch's) goes to torch.distributed instead, said once; the
    rest reaches torch's allocation (faked here: CPU torch has no symmetric memory)."""
    import torch.distributed._symmetric_memory as symm_mem

    monkeypatch.setattr(ubnext.comm._executor, "_logged_fallbacks", set())  # each fallback is logged once per process
    comm = _bare_communicator("gpu")
    comm._symm_buffers = {}
    comm._pool = SimpleNamespace(backend=SimpleNamespace(name=backend))
    used = []
    comm._torch_all_reduce = lambda x, out: used.append("torch")

    def reached_torch(*args, **kwargs):
        raise LookupError("reached symm_mem.empty")

    monkeypatch.setattr(symm_mem, "empty", reached_torch)
    monkeypatch.setattr(ubnext.runtime._cuda, "capturing", lambda device: False)
    x = torch.ones(numel, dtype=dtype)
    if refused is None:
        with pytest.raises(LookupError, match="reached symm_mem.empty"):
            comm._torch_symm_all_reduce(x, x.clone())
        return
    with caplog.at_level("INFO", logger="ubnext"):
        comm._torch_symm_all_reduce(x, x.clone())
    assert used == ["torch"] and comm.last_path == "torch"
    assert refused in caplog.text, caplog.text


def test_torch_symm_keeps_one_buffer_per_dtype(monkeypatch):
    """Issue 23 item 1, the leak: a torch symmetric buffer per call size cost an allocation, a
    rendezvous and a multicast object for every prefill length, forever. One buffer per dtype,
    grown to the largest call (whole 2 MiB segments) and freed when replaced; torch's op gets a
    view of its first elements (it finds the allocation from the storage, at the view's offset).
    A buffer a captured call used is kept for the graph. Fakes: CPU torch has no symmetric memory."""
    import gc
    import weakref

    import torch.distributed._symmetric_memory as symm_mem

    from ubnext.comm import _allreduce

    comm = _bare_communicator("gpu")
    comm._symm_buffers = {}
    comm._pool = SimpleNamespace(backend=SimpleNamespace(name="torch_symm"))
    comm.group, comm.device = SimpleNamespace(group_name="g"), torch.device("cpu")
    comm._capturing, comm._launch_done, comm._stream, comm._device_index = False, "E", 0, 0
    recorded = []  # the ordering event, moved after each op that used torch's symmetric buffer
    monkeypatch.setattr(ubnext.runtime._cuda, "record_event", lambda event, stream, index: recorded.append(event))
    made, rendezvous, reduced, fallbacks = [], [], [], []
    comm._torch_all_reduce = lambda x, out: fallbacks.append(x.numel()) or out.copy_(2 * x)

    def empty(numel, dtype, device):
        t = torch.zeros(numel, dtype=dtype)
        made.append(weakref.ref(t))
        return t

    def one_shot_all_reduce(buf, op, group):
        reduced.append((buf.numel(), buf.untyped_storage().data_ptr(), buf.storage_offset()))
        return buf * 2  # two ranks with the same input

    monkeypatch.setattr(symm_mem, "empty", empty)
    monkeypatch.setattr(symm_mem, "rendezvous", lambda t, name: rendezvous.append(t.numel()))
    monkeypatch.setattr(torch.ops.symm_mem, "one_shot_all_reduce", one_shot_all_reduce)
    monkeypatch.setattr(_allreduce, "_SYMM_KEPT_FOR_GRAPHS", [])
    capture = [False]
    monkeypatch.setattr(ubnext.runtime._cuda, "capturing", lambda device: capture[0])

    def reduce(n, dtype=torch.float32):
        x = torch.arange(n, dtype=dtype)
        out = torch.empty_like(x)
        comm._torch_symm_all_reduce(x, out)
        assert torch.equal(out, 2 * x)

    for n in (1000, 1002, 10, 600_000, 1002, 2 << 20, 64):  # prefill lengths, fp32
        reduce(n)
    reduce(512, torch.bfloat16)
    gc.collect()
    seg = 2 << 20
    assert rendezvous == [seg // 4, 2 * seg // 4, 4 * seg // 4, seg // 2], rendezvous
    assert set(comm._symm_buffers) == {torch.float32, torch.bfloat16}
    assert sum(r() is not None for r in made) == 2, "a replaced buffer was not freed"
    fp32 = comm._symm_buffers[torch.float32]
    assert reduced[-2] == (64, fp32.untyped_storage().data_ptr(), 0), "torch's op did not get a view of the buffer"
    capture[0] = True
    reduce(100)  # fits: the captured graph now uses this buffer
    reduce(4 << 20)  # does not fit, and cannot grow inside capture: torch.distributed
    assert fallbacks == [4 << 20] and len(made) == 4
    capture[0] = False
    reduce(4 << 20)  # grows: the captured buffer is replaced, but kept for its graph
    gc.collect()
    assert any(kept is fp32 for kept in _allreduce._SYMM_KEPT_FOR_GRAPHS)
    assert len(comm._symm_buffers) == 2


def test_a_path_the_self_test_disabled_is_never_planned():
    """The self-test's verdict is agreed and part of the planner's input: a disabled path is
    skipped, with the reason, even when forced."""
    view = plan.PoolView(None, True, 1 << 20, 1 << 22, "gpu", False, (("twoshot", "rank 1: 3 sums wrong"),))
    chosen = plan.choose(1 << 21, 2, False, 0, view, forced="twoshot")
    assert chosen.path == "nvls_twoshot"
    assert ("twoshot", "disabled by the self-test at preparation (rank 1: 3 sums wrong)") in chosen.skipped


def test_isolated_gpus_make_the_fallback_say_why(monkeypatch, caplog):
    """Ranks that each see one GPU: when the pool cannot be built, the warning says what to change."""
    import torch

    import ubnext.comm._prepare as comm_mod
    from ubnext.pool import PoolSetupError

    comm = _bare_communicator("gpu")
    comm.device = torch.device("cuda", 0)
    comm._allgather = lambda obj: [obj, obj] if not isinstance(obj, dict) else [obj, dict(obj)]
    comm._setup_allgather = lambda obj, step=None: comm._allgather(
        obj
    )  # the store's check-in: tests/unit/test_misuse.py

    def refuse(**kwargs):
        raise PoolSetupError("mapping the peers' memory failed on rank 1: cuMemImportFromShareableHandle failed")

    monkeypatch.setattr(comm_mod, "SymmetricPool", refuse)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    monkeypatch.setattr(ubnext.runtime._cuda, "capturing", lambda device: False)
    with caplog.at_level("WARNING", logger="ubnext"):
        assert comm._create_pool() is None
    assert "every rank sees one GPU, CUDA_VISIBLE_DEVICES='3'" in comm._pool_error
    assert "torch.cuda.set_device" in caplog.text


def test_an_in_place_pool_tensor_is_not_held_to_the_staging_size():
    """Issue 15, fix 1: a pool tensor reduced in place by a two-shot kernel needs no staging, so
    the staging region's size does not rule those kernels out; every other kernel path is still
    staged (nvls_oneshot and nvls_lamport read `in` while writing `out`) and still ruled out."""
    view = plan.PoolView(None, True, 1 << 18, 1 << 19, "gpu", False)
    nbytes = 640 << 10  # 160 rows of 1024 fp32, past 128 rows of staging
    staged = plan.capabilities(nbytes, 4, False, 0, view)
    in_place = plan.capabilities(nbytes, 4, False, 0, view, in_place_pool=True)
    for path in ("nvls_twoshot", "twoshot"):
        assert "staging region" in staged[path] and in_place[path] is None
    for path in ("nvls_oneshot", "nvls_lamport", "lamport"):
        assert in_place[path] is not None
    assert plan.choose(nbytes, 4, False, 0, view).path == "torch"
    assert plan.choose(nbytes, 4, False, 0, view, in_place_pool=True).path == "nvls_twoshot"


def test_a_call_that_does_not_fit_says_what_sized_the_pool_and_the_fix(monkeypatch):
    """Issue 15, item 5: the fallback's reason names the sizes, what set them and how to get more."""
    from ubnext.pool import plan_layout

    monkeypatch.setenv("UBNEXT_MAX_BATCH", "32")
    layout = plan_layout(2, 1024)
    # the call header has a place of its own: a call of UBNEXT_MAX_BATCH tokens, fp32, still fits
    assert layout.lamport_capacity >= 32 * 1024 * 4
    view = plan.PoolView(None, True, layout.lamport_capacity, layout.staging_bytes, "gpu", False, (), layout.sized_by)
    why = plan.capabilities(1 << 20, 2, False, 0, view)
    assert why["lamport"].startswith(
        f"1048576 bytes exceed the Lamport slot ({layout.lamport_capacity} bytes, "
        "from UBNEXT_MAX_BATCH=32 tokens x hidden 1024 x 4 bytes)"
    )
    for path in ("lamport", "nvls_twoshot"):
        assert "UBNEXT_MAX_BATCH" in why[path] and "comm.register_hidden" in why[path], why[path]
    monkeypatch.setenv("UBNEXT_SYMM_POOL_SIZE", "8")
    assert plan_layout(2, 1024).sized_by == "UBNEXT_SYMM_POOL_SIZE=8 MB"


def test_attention_heads_must_be_whole_on_every_rank():
    from ubnext.parallel import check_attention_heads

    check_attention_heads(32, 8, 8)
    with pytest.raises(
        ValueError,
        match=r"tensor parallelism 4 must divide the attention heads \(32\) and the "
        r"key/value heads \(2\); it does not divide key/value heads 2",
    ):
        check_attention_heads(32, 2, 4)
    with pytest.raises(ValueError, match="does not divide heads 6 or key/value heads 3"):
        check_attention_heads(6, 3, 4)


def test_one_scale_quantize_spreads_over_the_grid():
    """Issue 24 item F's count: FP8 quantisation with one scale over 64 MB (bf16) used to be one row,
    so one CTA. Past ONE_CTA_BYTES its amax comes first and the static mode runs, whose grid comes
    from the work alone (the kernel is local: no residency cap): one trip of IN_FLIGHT vectors per
    thread, 4096 CTAs for 64 MB (the issue asks at least 64). Rows take a group of threads each,
    sized so each thread holds IN_FLIGHT vectors. The same numbers are pinned for the C API's rule
    (tests/c/test_launch_rules.cpp test_quantize_grid)."""
    from ubnext.comm._quantize import LOCAL_GRID_MAX, SPLIT_ROW_VECTORS, quantize_geometry, row_group_threads, split_row

    comm = _bare_communicator("gpu")
    comm._sm_count = 128
    n = 32 << 20  # 64 MB of bf16
    assert quantize_geometry(n, 2, split_row(n, 2), True, 256, LOCAL_GRID_MAX) == (4096, 256)
    assert comm._local_geometry(n, 2, split_row(n, 2), True) == (4096, 256)
    assert quantize_geometry(n, 2, 8192, False, 256, LOCAL_GRID_MAX) == (4096, 256)
    assert quantize_geometry(1000 * 128, 2, 128, False, 256, LOCAL_GRID_MAX) == (16, 256)
    assert quantize_geometry(8, 2, 8, False, 256, LOCAL_GRID_MAX) == (1, 256)
    assert (row_group_threads(16, 256), row_group_threads(4096, 256)) == (4, 256)
    assert (row_group_threads(3, 256), row_group_threads(24, 256)) == (1, 4)
    assert row_group_threads(4096, 96) == 32  # groups divide the block: 3 rows of a 96-thread block
    for n, elem in ((8 * 3, 2), (4 * 7 * 1024, 4), (16 * 5, 1), (8 * 4096 * 3, 2)):
        h = split_row(n, elem)
        assert n % h == 0 and (h * elem) % 16 == 0 and h * elem <= 16 * SPLIT_ROW_VECTORS, (n, elem, h)


def test_messages_of_2_gib_or_more_never_reach_a_kernel():
    """Issue 23, risk "silent int32 wraparound": the kernels count in 32 bits, and numpy 1.x wraps
    np.int32(n) silently for n >= 2**31. Such messages take torch.distributed, on every path,
    and packing such a count for a launch refuses."""
    from ubnext import kernels
    from ubnext.runtime import _cuda

    view = plan.PoolView(None, True, 1 << 40, 1 << 40, "gpu")
    for nbytes in (1 << 31, 3 << 30):
        caps = plan.capabilities(nbytes, 2, False, 0, view, in_place_pool=True)
        assert all(caps[p] == plan.TOO_LARGE for p in plan.KERNEL_PATHS), caps
        assert plan.choose(nbytes, 2, False, 0, view, in_place_pool=True).path == "torch"
        assert plan.exchange_path("allgather", nbytes, True, view) == ("torch", plan.TOO_LARGE)
    just_below = (1 << 31) - 2
    assert plan.choose(just_below, 2, False, 0, view, in_place_pool=True).path != "torch"
    with pytest.raises(OverflowError, match="does not fit in 32 bits"):
        _cuda.pack_kernel_args(kernels.KERNEL_SIGNATURE[-4:], (1 << 31, 0, 0.0, 0))


def test_the_push_form_fits_by_its_slot_not_the_staging_region():
    """Issue 26: the batch-invariant mode's plain nvls_lamport (its push form) holds 2/N of the message
    per Lamport slot and reads only this rank's x, never staged: at 8 ranks the default pool (a 2 MB
    slot, a 4 MB staging region) runs it to 8 MB, where the default's paths leave the kernels past
    4 MB. The fused op's nvls_lamport is the barrier form (a whole row portion per slot, staged)."""
    layout = plan_layout(8, 8192)
    view = plan.PoolView(None, True, layout.lamport_capacity, layout.staging_bytes, "gpu", True, world_size=8)
    fits = layout.lamport_capacity // 32 * 8 * 16  # the most whole vectors whose 1/8 shares fit twice
    assert layout.staging_bytes < fits <= plan.KERNEL_MAX_BYTES
    mode = plan.capabilities(fits, 2, False, 0, view, batch_invariant=True)
    assert mode["nvls_lamport"] is None, mode["nvls_lamport"]
    assert "staging region" in plan.capabilities(fits, 2, False, 0, view)["nvls_twoshot"]
    too_big = plan.capabilities(fits + 8 * 16, 2, False, 0, view, batch_invariant=True)["nvls_lamport"]
    assert too_big.startswith(
        f"{fits + 128} bytes ({plan.lamport_bytes_needed('nvls_lamport', fits + 128, False, 8, True)} "
        "in its push form's slot) exceed the Lamport slot"
    ), too_big
    assert plan.choose(fits, 2, False, 0, view, batch_invariant=True).path == "nvls_lamport"
    assert plan.choose(fits, 2, False, 0, view).path == "torch"
    assert "Lamport slot" in plan.capabilities(fits, 2, True, 8192, view, batch_invariant=True)["nvls_lamport"]
