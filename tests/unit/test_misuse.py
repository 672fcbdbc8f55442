"""Careless calls that must fail clearly before any work (issue 29): tensors on the meta device mixed
with real ones (caught in the operators' fake implementations, where such a call lands), and a bad
environment variable whatever the mode."""

from __future__ import annotations

import pytest
import torch

from ubnext import envs, ops
from ubnext.comm import Communicator
from ubnext.errors import UbnextError

X = torch.ones(2, 64, dtype=torch.bfloat16)


def meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t, device="meta")


CALLS = {  # entry point -> (the call with one argument on meta, that argument's name)
    "all_reduce out": (lambda: ops.all_reduce_out(X, meta(X), "no-comm"), "out"),
    "linear weight": (lambda: ops.linear_all_reduce(X, meta(torch.ones(32, 64, dtype=X.dtype)), "no-comm"), "weight"),
    "fused residual": (
        lambda: ops.all_reduce_add_rmsnorm(X, meta(X), torch.ones(64, dtype=X.dtype), 1e-6, "no-comm"),
        "residual",
    ),
    "fused weight": (
        lambda: ops.all_reduce_add_rmsnorm(X, X.clone(), meta(torch.ones(64, dtype=X.dtype)), 1e-6, "no-comm"),
        "weight",
    ),
    "fused scale": (
        lambda: ops.all_reduce_add_rmsnorm(
            X,
            X.clone(),
            torch.ones(64, dtype=X.dtype),
            1e-6,
            "no-comm",
            out_dtype=torch.float8_e4m3fn,
            scale=meta(torch.ones(1)),
        ),
        "scale",
    ),
}


def _bare_communicator() -> Communicator:
    comm = object.__new__(Communicator)
    comm.world_size, comm.key = 2, "no-comm"
    return comm


COMM_CALLS = {
    "all_gather out": (lambda c: c.all_gather(X, out=meta(torch.ones(4, 64, dtype=X.dtype))), "out"),
    "reduce_scatter out": (lambda c: c.reduce_scatter(X, out=meta(torch.ones(1, 64, dtype=X.dtype))), "out"),
    "quantize scale": (lambda c: c.quantize_fp8(X, scaling="static", scale=meta(torch.ones(1))), "scale"),
}


@pytest.mark.parametrize("what", sorted(CALLS))
def test_a_meta_argument_beside_real_ones_is_named(what):
    call, name = CALLS[what]
    with pytest.raises(ValueError, match=rf"^{name} (is on meta|must be .* on x's device)"):
        call()


@pytest.mark.parametrize("what", sorted(COMM_CALLS))
def test_a_meta_argument_of_a_communicator_method_is_named(what):
    call, name = COMM_CALLS[what]
    with pytest.raises(ValueError, match=rf"^{name} (is on meta|must be .* on x's device)"):
        call(_bare_communicator())


@pytest.mark.parametrize("what", sorted(set(CALLS) - {"fused scale"}))  # scale: the argument checks name it
def test_without_the_check_the_tests_above_fail(monkeypatch, what):
    """The check switched off, the same calls raise nothing: the dispatcher sends a call with any meta
    argument to the fake implementation, which answers with empty tensors on x's device without
    running anything (no communicator "no-comm" exists, and none was asked for)."""
    monkeypatch.setattr(ops, "check_same_device", lambda names, *tensors: None)
    CALLS[what][0]()  # returns, where the check raises


def test_all_meta_arguments_still_trace():
    """Every argument on meta is shape inference (what torch.compile's fake tensors do): allowed."""
    out, residual_out, _ = ops.all_reduce_add_rmsnorm(
        meta(X), meta(X), meta(torch.ones(64, dtype=X.dtype)), 1e-6, "no-comm"
    )
    assert out.shape == X.shape and out.is_meta


def test_every_variable_is_checked_when_a_communicator_is_made(monkeypatch):
    """UBNEXT_MAX_BATCH sizes the pool, which the torch mode never makes: it is refused all the
    same, before anything collective, rather than ignored until the mode changes."""
    monkeypatch.setenv("UBNEXT_MAX_BATCH", "-3")
    with pytest.raises(envs.EnvError, match="UBNEXT_MAX_BATCH"):
        envs.check_all()
    with pytest.raises(envs.EnvError, match="UBNEXT_MAX_BATCH"):
        Communicator(emulate=False)


class _Group:
    group_name = "test-group"


def _preparing_rank(rank: int, gathered: list) -> Communicator:
    """A communicator as far as its set-up steps need it: rank ``rank`` of 2, its all-gather recorded."""
    comm = object.__new__(Communicator)
    comm.group, comm.rank, comm.world_size, comm.device = _Group(), rank, 2, torch.device("cpu")
    comm._setup_serial, comm._setup_steps, comm._setup_failed, comm._broken = 0, 0, None, None
    comm._allgather = lambda obj: gathered.append((rank, obj)) or [obj, obj]
    return comm


@pytest.fixture
def store(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setenv("UBNEXT_TIMEOUT", "0.3")
    hash_store = dist.HashStore()
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: hash_store)
    return hash_store


def test_a_set_up_step_names_the_rank_that_never_came(store):
    """Issue 29: before the pool exists, a missing peer is a ubnext error naming the step and the rank,
    after UBNEXT_TIMEOUT, instead of gloo's nameless wait; the communicator then refuses at once."""
    import time

    gathered = []
    comm = _preparing_rank(0, gathered)
    start = time.monotonic()
    with pytest.raises(UbnextError, match=r"while making a step, rank 0 waited 0.3 s for rank\(s\) \[1\] of the group"):
        comm._setup_allgather("report", "making a step")
    assert time.monotonic() - start < 5 and not gathered, "it entered the all-gather without its peer"
    start = time.monotonic()
    with pytest.raises(UbnextError, match=r"rank\(s\) \[1\]"):
        comm._setup_allgather("report", "the next step")
    assert time.monotonic() - start < 0.2, "a second step waited again"


def test_a_rank_arriving_after_its_peer_gave_up_raises_too(store):
    """The peer that gave up raised before its all-gather: the late rank must not enter its own alone."""
    gathered = []
    with pytest.raises(UbnextError):
        _preparing_rank(0, gathered)._setup_allgather("report", "making a step")
    with pytest.raises(UbnextError, match="rank 1 reached the step only after a peer had given up"):
        _preparing_rank(1, gathered)._setup_allgather("report", "making a step")
    assert not gathered


def test_ranks_that_all_arrive_go_on_to_the_all_gather(store):
    import threading

    gathered = []
    ranks = [_preparing_rank(r, gathered) for r in range(2)]
    threads = [threading.Thread(target=c._setup_allgather, args=(f"from {c.rank}",)) for c in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert sorted(gathered) == [(0, "from 0"), (1, "from 1")]


def test_gpus_without_a_peer_path_never_reach_the_rendezvous(monkeypatch):
    """Issue 23 risk "partial P2P topologies hang in torch's rendezvous": every rank reports which of
    the GPUs it sees it can reach (torch.cuda.can_device_access_peer), and all decide from all the
    reports, before any allocation: one unreachable pair sends every rank to torch.distributed,
    naming the pair. Faked: 4 GPUs in NVLink pairs (0-1, 2-3) with no path between the pairs."""
    from ubnext.comm import _prepare

    pairs = {(0, 1), (1, 0), (2, 3), (3, 2)}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: (a, b) in pairs)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: type("P", (), {"uuid": f"GPU-{i}"})())
    reports = [_prepare.p2p_report(torch.device("cuda", r)) for r in range(4)]
    assert reports[0] == {"uuid": "GPU-0", "reach": {"GPU-1": True, "GPU-2": False, "GPU-3": False}}
    why = _prepare.p2p_problem(reports)
    assert why is not None and "rank 0's GPU cannot access rank 2's GPU" in why
    assert _prepare.p2p_problem(reports[:2]) is None  # ranks 0 and 1 alone: one NVLink pair
    assert _prepare.p2p_problem([reports[0], reports[0]]) is None  # two ranks on one GPU
    # a GPU this rank cannot see (one GPU visible per rank) is not judged here
    alone = [{"uuid": "GPU-0", "reach": {}}, {"uuid": "GPU-1", "reach": {}}]
    assert _prepare.p2p_problem(alone) is None
    assert _prepare.p2p_problem([None, None]) is None  # emulator or CPU
