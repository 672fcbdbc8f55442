"""The Lamport one-shot's per-phase stamps (issue 36): where the test-only build UBNEXT_STAMPS leaves
them, what they are called, how to read them, and the stamped build itself.

With the define, thread 0 of CTA 0 of each rank writes the %globaltimer (ns) at which it passed each
phase of its call into its own sync region (csrc/device/stamps.cuh says what each phase is, and why one
thread of CTA 0 rather than a record per CTA; csrc/device/desc.cuh, UBNEXT_SYNC_STAMPS, where):

    image = compile_stamped("lamport.cu", "sm_90")       # the stamped cubin (NVRTC, -DUBNEXT_STAMPS)
    ... launch a Lamport kernel from it, wait for it, copy the rank's sync region to the host ...
    stamps = decode(sync_region_bytes, nranks)          # {"entry": ns, ..., "exit": ns, "slots": [ns, ...]}
    assert not order_problems(stamps, row_split=False)  # entry <= wait <= push <= slots <= exit
    since_entry(stamps)                                 # the same, in ns after the entry stamp

The emulator builds the same define as ``ubnext.runtime._emu.load("stamps")`` (UBNEXT_EMU_BREAK=stamps);
tests/mpi/emu_worker.py's case ``stamps`` runs it at 2 ranks.

%globaltimer counts ns, but how often it moves is the GPU's (steps of about a microsecond have been
reported on some): phases shorter than its step read as 0 ns apart. Read the step off before trusting a
short phase (the smallest nonzero difference over many calls' stamps).
"""

from __future__ import annotations

import struct

from ubnext.pool.layout import MAX_RANKS, SYNC_STAMPS

DEFINE = "UBNEXT_STAMPS"
EMU_BUILD = "stamps"  # ubnext.runtime._emu.BREAKS' name of the same build
# stamps.cuh's StampPhase, in record order; one stamp per slot (rank) follows them
PHASES = ("entry", "wait", "push", "row_exchange", "exit")
STAMP_COUNT = len(PHASES) + MAX_RANKS  # UBNEXT_STAMP_COUNT
OFFSET = 4 * SYNC_STAMPS.start  # bytes from the start of a rank's sync region (sync_off)
RECORD_BYTES = 8 * STAMP_COUNT
if RECORD_BYTES > 4 * len(SYNC_STAMPS):
    raise AssertionError("the stamp record outgrows UBNEXT_SYNC_STAMPS .. UBNEXT_SYNC_STAMPS_END")


def decode(sync_region: bytes, nranks: int | None = None) -> dict:
    """The stamps of one rank's last stamped Lamport call, from its sync region's bytes (from sync_off,
    at least through the record): ``{phase: ns or None}`` for each of PHASES (None: the call did not
    pass that phase, e.g. ``row_exchange`` outside the fused row split), and ``"slots"``: for p = 0..
    nranks - 1, the ns at which slot p (rank p's data, this rank's own included) was seen, or None.
    Without ``nranks``, the slots up to the last one stamped."""
    if len(sync_region) < OFFSET + RECORD_BYTES:
        raise ValueError(
            f"the stamp record ends at byte {OFFSET + RECORD_BYTES} of the sync region; got {len(sync_region)} bytes"
        )
    if nranks is not None and not 1 <= nranks <= MAX_RANKS:
        raise ValueError(f"nranks must be 1..{MAX_RANKS}, got {nranks}")
    words = struct.unpack_from(f"<{STAMP_COUNT}Q", sync_region, OFFSET)
    out: dict = {name: words[i] or None for i, name in enumerate(PHASES)}
    slots = list(words[len(PHASES) :])
    if nranks is None:
        while slots and slots[-1] == 0:
            slots.pop()
    else:
        slots = slots[:nranks]
    out["slots"] = [s or None for s in slots]
    return out


def order_problems(stamps: dict, *, row_split: bool) -> list[str]:
    """What is wrong with a decoded record (``decode``), empty when nothing is: every phase stamped
    (``row_exchange`` exactly when ``row_split``, the fused kernel's rows shared by several CTAs) and at
    least one slot, in program order: entry <= wait <= push <= each slot <= row_exchange <= exit (the slots
    among themselves in the order they arrived)."""
    problems = []
    wanted = [p for p in PHASES if p != "row_exchange" or row_split]
    for phase in wanted:
        if stamps.get(phase) is None:
            problems.append(f"{phase} was not stamped")
    if not row_split and stamps.get("row_exchange") is not None:
        problems.append("row_exchange was stamped without the row split")
    slots = stamps.get("slots") or []
    if not slots or any(s is None for s in slots):
        problems.append(f"slot stamps missing: {slots}")
    if problems:
        return problems
    before = [("entry", stamps["entry"]), ("wait", stamps["wait"]), ("push", stamps["push"])]
    after = ([("row_exchange", stamps["row_exchange"])] if row_split else []) + [("exit", stamps["exit"])]
    for (a, ta), (b, tb) in zip(before + after, (before + after)[1:]):
        if ta > tb:
            problems.append(f"{a} ({ta} ns) after {b} ({tb} ns)")
    # the slots in the order they were seen (lamport_poll.cuh's poll re-loads every outstanding slot on
    # each pass), not in rank order: each one between the push and the next phase
    for p, s in enumerate(slots):
        if s < before[-1][1]:
            problems.append(f"push ({before[-1][1]} ns) after slot {p} ({s} ns)")
        if s > after[0][1]:
            problems.append(f"slot {p} ({s} ns) after {after[0][0]} ({after[0][1]} ns)")
    return problems


def since_entry(stamps: dict) -> dict:
    """``decode``'s record with every stamp in ns after the entry stamp (None stays None)."""
    entry = stamps["entry"]
    if entry is None:
        raise ValueError("no entry stamp: not a stamped call")
    out: dict = {p: None if stamps[p] is None else stamps[p] - entry for p in PHASES}
    out["slots"] = [None if s is None else s - entry for s in stamps["slots"]]
    return out


def compile_stamped(fname: str = "lamport.cu", arch: str = "sm_90") -> bytes:
    """The cubin of csrc/kernels/``fname`` built with the stamps (NVRTC through ubnext.kernels' compile
    helper, with ubnext's own options; not cached: a test-only build). Needs no GPU."""
    from ubnext import kernels

    image, _ = kernels._nvrtc_compile(fname, arch, "cubin", (DEFINE,))
    return image
