"""Careless calls that must fail clearly before any work (issue 29): tensors on the meta device mixed
with real ones (caught in the operators' fake implementations, where such a call lands), and a bad
environment variable whatever the mode."""

from __future__ import annotations

import pytest
import torch

from ubnext import envs, ops
from ubnext.comm import Communicator

X = torch.ones(2, 64, dtype=torch.bfloat16)


def meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t, device="meta")


CALLS = {  # entry point -> (the call with one argument on meta, that argument's name)
    "all_reduce out": (lambda: ops.all_reduce_out(X, meta(X), "no-comm"), "out"),
    "linear weight": (lambda: ops.linear_all_reduce(X, meta(torch.ones(32, 64, dtype=X.dtype)), "no-comm"), "weight"),
    "fused residual": (lambda: ops.all_reduce_add_rmsnorm(X, meta(X), torch.ones(64, dtype=X.dtype), 1e-6, "no-comm"),
                       "residual"),
    "fused weight": (lambda: ops.all_reduce_add_rmsnorm(X, X.clone(), meta(torch.ones(64, dtype=X.dtype)), 1e-6,
                                                        "no-comm"), "weight"),
    "fused scale": (lambda: ops.all_reduce_add_rmsnorm(X, X.clone(), torch.ones(64, dtype=X.dtype), 1e-6, "no-comm",
                                                       out_dtype=torch.float8_e4m3fn,
                                                       scale=meta(torch.ones(1))), "scale"),
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
    out, residual_out, _ = ops.all_reduce_add_rmsnorm(meta(X), meta(X), meta(torch.ones(64, dtype=X.dtype)), 1e-6,
                                                      "no-comm")
    assert out.shape == X.shape and out.is_meta


def test_every_variable_is_checked_when_a_communicator_is_made(monkeypatch):
    """UBNEXT_MAX_BATCH sizes the pool, which the torch mode never makes: it is refused all the
    same, before anything collective, rather than ignored until the mode changes."""
    monkeypatch.setenv("UBNEXT_MAX_BATCH", "-3")
    with pytest.raises(envs.EnvError, match="UBNEXT_MAX_BATCH"):
        envs.check_all()
    with pytest.raises(envs.EnvError, match="UBNEXT_MAX_BATCH"):
        Communicator(emulate=False)
