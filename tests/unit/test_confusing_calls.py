"""Calls that worked or failed confusingly (issue 40, "Confusing, not wrong"): a mismatch error that
showed raw flag bits (C1), a communicator made on a rank outside its group (C8), torch.distributed's
positional reduce op or a group given by name (C9), and fallback lines repeated per communicator
without the rank (C10). At world size 1 on gloo: none of these needs a peer."""

from __future__ import annotations

import logging
import re

import pytest
import torch
import torch.distributed as dist

import ubnext
from ubnext import errors, kernels
from ubnext.comm import Communicator, _executor
from ubnext.runtime import _lifecycle


@pytest.fixture(scope="module")
def world(world1_comm):
    return world1_comm


# -- C1: the mismatch error names the call's output form, and speaks of offsets only for an offset --


def _mismatch(field: int, mine: int, theirs: int) -> str:
    return str(errors.kernel_error([errors.ERR_MISMATCH, 4, 0, 1, field, mine, theirs, 0], 5.0, 0))


def _kind(flags: int) -> int:
    return 4 | (1 << 8) | (flags << 16)  # nvls_lamport, bf16


def test_a_flags_mismatch_names_the_output_forms():
    """The issue's case: 0x19 against 0x29 is the fused op with NVFP4 output against MXFP8 output."""
    message = _mismatch(0, _kind(0x19), _kind(0x29))
    assert "(nvls_lamport, bf16, fused add+RMSNorm, multicast, NVFP4 output)" in message, message
    assert "(nvls_lamport, bf16, fused add+RMSNorm, multicast, MXFP8 output)" in message, message
    assert "0x19" not in message and "0x29" not in message
    plain = _mismatch(0, _kind(0), _kind(kernels.F_FUSED_NORM | kernels.F_FP8_PER_TOKEN))
    assert "plain (no norm, no quantisation)" in plain and "FP8 output with per-token scales" in plain, plain


def test_every_flag_has_a_name():
    """Each F_* bit of ubnext.kernels (and each block format) reads as a name, never as 'unknown'."""
    flags = {name: value for name, value in vars(kernels).items() if re.fullmatch(r"F_[A-Z0-9_]+", name)}
    assert flags, "no F_* constants in ubnext.kernels"
    for name, value in flags.items():
        if name == "F_BLOCK_FMT_MASK":
            continue
        names = errors._flag_names(value)
        assert names and not any("unknown" in n for n in names), (name, names)
    assert errors._flag_names(0x100) == ["unknown flags 0x100"]
    swizzled = errors._flag_names(
        kernels.F_FUSED_NORM
        | kernels.F_BLOCK_GROUP128
        | kernels.F_BLOCK_SWIZZLED
        | kernels.F_BLOCK_UE8M0
        | kernels.F_RANK_ORDER
    )
    assert swizzled == [
        "fused add+RMSNorm",
        "FP8 group-128 output",
        "swizzled scales",
        "ue8m0 scales",
        "rank-order sum (batch-invariant)",
    ]


OFFSETS = "same offset on every rank"


@pytest.mark.parametrize(
    "field,mine,theirs", [(0, _kind(1), _kind(0x21)), (1, 1024, 2048), (2, 4096, 8192), (4, 0x3727C5AC, 0x358637BD)]
)
def test_the_offsets_sentence_is_left_out_where_offsets_do_not_matter(field, mine, theirs):
    message = _mismatch(field, mine, theirs)
    assert OFFSETS not in message and "every rank must make the same calls with the same arguments" in message


def test_an_offset_mismatch_says_how_pool_tensors_get_the_same_offset():
    message = _mismatch(3, 4, 8)
    assert "in offset +0x40 but rank 1 with in offset +0x80" in message and OFFSETS in message, message


# -- C8: a rank outside the group --


def test_a_rank_outside_the_group_is_told_so(world):
    """torch.distributed.new_group gives a non-member GroupMember.NON_GROUP_MEMBER, an int: it used to
    end in "'int' object has no attribute 'group_name'"."""
    outside = dist.GroupMember.NON_GROUP_MEMBER
    for call in (
        lambda: Communicator(outside, emulate=False),
        lambda: ubnext.get_communicator(outside),
        lambda: ubnext.all_reduce(torch.ones(4), outside),
    ):
        with pytest.raises(ValueError, match="rank 0 is not a member of this group .*only on the group's ranks"):
            call()


# -- C9: torch.distributed habits --


def test_a_reduce_op_in_the_group_place_gets_the_signature(world):
    with pytest.raises(TypeError) as info:
        ubnext.all_reduce(torch.ones(4), dist.ReduceOp.SUM)
    message = str(info.value)
    assert message.startswith("ubnext.all_reduce(x, group=None, *, out=None) -> Tensor: got the reduce op")
    assert "always sums" in message and "x = ubnext.all_reduce(x)" in message and "out=x" in message


def test_something_that_is_no_group_gets_the_signature(world):
    with pytest.raises(
        TypeError,
        match=r"^ubnext\.all_reduce\(x, group=None.*ProcessGroup, its group_name \(str\) "
        r"or None, not int",
    ):
        ubnext.all_reduce(torch.ones(4), 3)
    with pytest.raises(TypeError, match=r"^ubnext\.all_reduce_add_rmsnorm\(.*not list"):
        ubnext.all_reduce_add_rmsnorm(torch.ones(2, 4), torch.ones(2, 4), torch.ones(4), group=[0])


def test_a_group_by_name_is_accepted(world):
    x = torch.arange(4.0)
    y = ubnext.all_reduce(x, dist.group.WORLD.group_name)
    assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()  # one rank: the sum is x, in a new tensor
    assert ubnext.get_communicator(dist.group.WORLD.group_name) is world
    sub = dist.new_group([0])  # not cached: resolved by name
    assert torch.equal(ubnext.all_reduce(x, sub.group_name), x)
    _lifecycle.cached.pop(sub.group_name).close()


def test_an_unknown_group_name_is_refused(world):
    with pytest.raises(
        ValueError,
        match=r"no process group named 'tp' in this process \(its groups' group_name: "
        r"'0'",
    ):
        ubnext.all_reduce(torch.ones(4), "tp")


# -- C10: each fallback once per process, with the rank --


def test_a_fallback_is_logged_once_per_process_with_the_rank(world, monkeypatch, caplog):
    """Two communicators planning the same 8 MB call: each skipped path is said once, by rank."""
    monkeypatch.setattr(_executor, "_logged_fallbacks", set())
    second = Communicator(emulate=False)
    try:
        with caplog.at_level(logging.INFO, logger="ubnext"):
            for comm in (world, second):
                comm._plan(8 << 20, torch.float32, False)
                comm._plan(8 << 20, torch.float32, True, hidden=4096)
    finally:
        second.close()
    lines = [rec.getMessage() for rec in caplog.records if "not using" in rec.getMessage()]
    assert lines, caplog.text
    assert len(lines) == len(set(lines)), lines
    assert all(line.startswith("rank 0: not using ") for line in lines), lines
