"""Issue 40 W1: an ``out`` that partly overlaps its input is refused by every op that takes one
(all_reduce, all_gather, reduce_scatter), in the operator before anything collective, and in its fake
implementation (torch.compile's tracing, meta tensors); the in-place form and disjoint views of one
buffer are not. One process, a gloo group of one rank: the check lies in the operators, before any path
is chosen; tests/mpi/worker.py's case bad_input shows the kernel paths at 2 ranks refusing alike."""

from __future__ import annotations

import re

import pytest
import torch

from ubnext import ops
from ubnext.reference._checks import check_out_overlap

N = 1024
ELEM = 4  # float32


@pytest.fixture(scope="module")
def comm(world1_comm):
    return world1_comm


CALLS = {  # op -> its call with out=
    "all_reduce": lambda c, x, out: c.all_reduce(x, out=out),
    "all_gather": lambda c, x, out: c.all_gather(x, out=out),
    "reduce_scatter": lambda c, x, out: c.reduce_scatter(x, out=out),
}
# (x, out) as element ranges of one buffer of 2N: out over x's second half, x over out's second half,
# out a few bytes past x (the buf[8:1032]), and the two sharing only their last / first 4 bytes
OVERLAPS = {
    "later half": ((0, N), (N // 2, N + N // 2)),
    "earlier half": ((N // 2, N + N // 2), (0, N)),
    "a few bytes on": ((0, N), (8, N + 8)),
    "one element": ((0, N), (N - 1, 2 * N - 1)),
}


def _message(op: str, x: tuple[int, int], out: tuple[int, int]) -> str:
    """The start of the refusal: the op and both byte ranges in their storage."""
    partly = "" if op == "reduce_scatter" else "partly "
    return (
        f"{op}: out {partly}overlaps x: x is bytes [{x[0] * ELEM}, {x[1] * ELEM}) and out bytes "
        f"[{out[0] * ELEM}, {out[1] * ELEM}) of one storage; "
    )


@pytest.mark.parametrize("op", sorted(CALLS))
@pytest.mark.parametrize("how", sorted(OVERLAPS))
def test_an_out_that_partly_overlaps_x_is_refused(comm, op, how):
    (x0, x1), (o0, o1) = OVERLAPS[how]
    buf = torch.arange(2 * N, dtype=torch.float32)
    before = buf.clone()
    with pytest.raises(ValueError, match=f"^{re.escape(_message(op, (x0, x1), (o0, o1)))}"):
        CALLS[op](comm, buf[x0:x1], buf[o0:o1])
    assert torch.equal(buf, before), "refused, yet something was written"


@pytest.mark.parametrize("how", sorted(OVERLAPS))
def test_a_traced_call_is_refused_as_an_eager_one(comm, how):
    """Meta tensors (shape inference) land in the fake implementation: it compares storages and offsets,
    since a meta tensor's address is its offset from 0 whatever its storage."""
    (x0, x1), (o0, o1) = OVERLAPS[how]
    buf = torch.empty(2 * N, device="meta")
    for op, call in (
        ("all_reduce", lambda x, out: ops.all_reduce_out(x, out, comm.key)),
        ("all_gather", lambda x, out: torch.ops.ubnext.all_gather_out(x, out, comm.key)),
        ("reduce_scatter", lambda x, out: torch.ops.ubnext.reduce_scatter_out(x, out, 1.0, comm.key)),
    ):
        with pytest.raises(ValueError, match=f"^{re.escape(_message(op, (x0, x1), (o0, o1)))}"):
            call(buf[x0:x1], buf[o0:o1])


def test_under_torch_compile_the_overlap_fails_at_trace_time(comm):
    """Dynamo runs the operator on fake tensors, views of one fake storage: the fake implementation
    refuses there, before any graph runs (Dynamo wraps the ValueError in its own error)."""
    torch._dynamo.reset()
    compiled = torch.compile(lambda b: comm.all_reduce(b[:N], out=b[8 : N + 8]), backend="eager", fullgraph=True)
    with pytest.raises(Exception, match=re.escape(_message("all_reduce", (0, N), (8, N + 8)))):
        compiled(torch.arange(2 * N, dtype=torch.float32))
    ok = torch.compile(lambda b: comm.all_reduce(b[:N], out=b[N:]), backend="eager", fullgraph=True)
    buf = torch.arange(2 * N, dtype=torch.float32)
    ok(buf)
    assert torch.equal(buf[N:], buf[:N])  # one rank: the sum is x
    torch._dynamo.reset()


@pytest.mark.parametrize("op", ["all_reduce", "all_gather"])
def test_the_in_place_form_is_allowed(comm, op):
    """out is x, or another view of the same memory, shape and strides (what the dispatcher may hand
    the operator for the caller's x): all_reduce's in-place form; at one rank all_gather's (x as this
    rank's slice of out). reduce_scatter has no in-place form: its out must not overlap x at all."""
    buf = torch.arange(2 * N, dtype=torch.float32)
    x = buf[:N]
    for out in (x, buf[:N], buf.view(2, N)[0]):
        result = CALLS[op](comm, x, out)
        assert result.data_ptr() == x.data_ptr() and torch.equal(buf[:N], torch.arange(N, dtype=torch.float32))
    with pytest.raises(ValueError, match="^reduce_scatter: out overlaps x: .*; out must not overlap x$"):
        comm.reduce_scatter(x, out=x)


@pytest.mark.parametrize("op", sorted(CALLS))
def test_disjoint_views_of_one_buffer_are_allowed(comm, op):
    """Adjacent (sharing no byte) or apart: nothing overlaps."""
    for (x0, x1), (o0, o1) in (((0, N), (N, 2 * N)), ((N, 2 * N), (0, N)), ((0, N // 2), (N, N + N // 2))):
        buf = torch.arange(2 * N, dtype=torch.float32)
        CALLS[op](comm, buf[x0:x1], buf[o0:o1])
        assert torch.equal(buf[o0:o1], torch.arange(x0, x1, dtype=torch.float32))


def test_a_strided_out_is_named_by_the_contiguity_check(comm):
    """The span of a strided tensor is not the memory it uses: interleaved with x, it is refused as
    not contiguous, which it is, not as overlapping."""
    buf = torch.arange(2 * N + 1, dtype=torch.float32)
    with pytest.raises(ValueError, match="^out must be contiguous"):
        comm.all_reduce(buf[:N], out=buf[1::2][:N])


def test_separate_meta_tensors_do_not_overlap():
    """Every meta storage starts at address 0, so the fake implementations compare storages: by
    address, x and a view of another storage 32 bytes in would seem to overlap."""
    x, other = torch.empty(N, device="meta"), torch.empty(2 * N, device="meta")[8 : N + 8]
    check_out_overlap("all_reduce", x, other, by_storage=True)
    with pytest.raises(ValueError, match="^all_reduce: out partly overlaps x"):
        check_out_overlap("all_reduce", x, other)
