"""tests/gpu_check/stamps.py, the reader of the Lamport one-shot's per-phase stamps (the test-only build
UBNEXT_STAMPS): its offsets and phase names are csrc's, and its decoder and order check see what they
must. The stamps themselves, from the kernel on the emulator: tests/mpi/test_emu_mpi.py."""

from __future__ import annotations

import re
import struct

import pytest

from tests.gpu_check import stamps
from ubnext import kernels
from ubnext.pool import layout

DESC = (kernels.CSRC / "device" / "desc.cuh").read_text()
STAMPS_CUH = (kernels.CSRC / "device" / "stamps.cuh").read_text()


def test_the_record_is_where_and_what_csrc_says():
    assert f"#define UBNEXT_SYNC_STAMPS {layout.SYNC_STAMPS.start}\n" in DESC
    assert f"#define UBNEXT_SYNC_STAMPS_END {layout.SYNC_STAMPS.stop}\n" in DESC
    count = re.search(r"#define UBNEXT_STAMP_COUNT \((\d+) \+ UBNEXT_MAX_RANKS\)", DESC)
    assert count and int(count.group(1)) + layout.MAX_RANKS == stamps.STAMP_COUNT
    enum = re.search(r"enum StampPhase : int \{(.*?)\};", STAMPS_CUH, re.S).group(1)
    names = [re.sub(r"\s*=.*", "", n).strip() for n in enum.split(",")]
    snake = [re.sub(r"(?<!^)([A-Z])", r"_\1", n[len("kStamp") :]).lower() for n in names]
    assert tuple(snake) == stamps.PHASES + ("slot0",)
    # inside the sync region, clear of the words the protocols use (desc.cuh: the barrier kernels' eps words
    # end at 416, the barrier flags start at 1024)
    eps_end = int(re.search(r"#define UBNEXT_SYNC_CALL_EPS_END (\d+)\n", DESC).group(1))
    assert eps_end <= layout.SYNC_STAMPS.start and layout.SYNC_STAMPS.stop <= 1024 and stamps.OFFSET % 8 == 0


def _region(values: dict, slots: list[int]) -> bytes:
    words = [values.get(p, 0) for p in stamps.PHASES] + slots + [0] * (layout.MAX_RANKS - len(slots))
    region = bytearray(layout.SYNC_BYTES)
    struct.pack_into(f"<{stamps.STAMP_COUNT}Q", region, stamps.OFFSET, *words)
    return bytes(region)


GOOD = {"entry": 100, "wait": 110, "push": 200, "exit": 900}


def test_decode_and_order_of_a_good_record():
    record = stamps.decode(_region(GOOD, [300, 310]), 2)
    assert record == {**GOOD, "row_exchange": None, "slots": [300, 310]}
    assert stamps.decode(_region(GOOD, [300, 310])) == record  # without nranks: up to the last slot stamped
    assert stamps.order_problems(record, row_split=False) == []
    assert stamps.since_entry(record) == {
        "entry": 0,
        "wait": 10,
        "push": 100,
        "row_exchange": None,
        "exit": 800,
        "slots": [200, 210],
    }
    split = stamps.decode(_region({**GOOD, "row_exchange": 500}, [300, 310]), 2)
    assert stamps.order_problems(split, row_split=True) == []


def test_slots_in_any_order_between_push_and_exit():
    """The poll re-loads every outstanding slot on each pass (lamport_poll.cuh): slots are stamped as they
    arrive, a later rank's before an earlier one's."""
    assert stamps.order_problems(stamps.decode(_region(GOOD, [310, 300]), 2), row_split=False) == []


@pytest.mark.parametrize(
    "values,slots,row_split,problem",
    [
        ({**GOOD, "push": 350}, [300, 310], False, "push (350 ns) after slot 0"),
        ({**GOOD, "exit": 305}, [300, 310], False, "slot 1 (310 ns) after exit"),
        ({**GOOD, "wait": 0}, [300, 310], False, "wait was not stamped"),
        (GOOD, [300, 0], False, "slot stamps missing"),
        (GOOD, [300, 310], True, "row_exchange was not stamped"),
        ({**GOOD, "row_exchange": 500}, [300, 310], False, "row_exchange was stamped without the row split"),
        ({**GOOD, "row_exchange": 250}, [300, 310], True, "slot 1 (310 ns) after row_exchange"),
    ],
    ids=["push-late", "exit-early", "no-wait", "slot-missing", "no-exchange", "stray-exchange", "exchange-early"],
)
def test_order_problems_are_caught(values, slots, row_split, problem):
    problems = stamps.order_problems(stamps.decode(_region(values, slots), 2), row_split=row_split)
    assert any(problem in p for p in problems), problems


def test_decode_refuses_a_short_region():
    with pytest.raises(ValueError, match="stamp record ends"):
        stamps.decode(bytes(stamps.OFFSET))
