"""ABI checks without a GPU: every kernel's PTX .entry parameters match the argument kinds
the Python launcher passes, and Python packs the descriptor in desc.cuh's field order."""

import re
import struct

import pytest

from ubnext import errors, kernels, pool

# the descriptor by value: 256 bytes, 8-byte aligned (its u64 fields), as the launcher lays it out
PTX_KIND = {
    "ptr": {".u64", ".b64"},
    "i32": {".u32", ".s32", ".b32"},
    "f32": {".f32"},
    "desc": {f".align 8 .b8 [{pool.DESC_STRUCT_BYTES}]"},
}
ENTRY = re.compile(r"\.entry\s+(\w+)\s*\((.*?)\)", re.S)
PARAM = re.compile(r"\.param\s+(?:(\.align\s+\d+)\s+)?(\.\w+)(?:\s+\.ptr[^ ]*)*(?:\s+\.align\s+\d+)?\s+\w+(\[\d+\])?")


def _entries(ptx: str) -> dict[str, list[str]]:
    """Each .entry's parameters as their PTX types: ".u64", or ".align 8 .b8 [256]" for a struct."""

    def kind(p):
        align, type_, array = p.groups()
        return f"{align} {type_} {array}" if array else type_

    return {m.group(1): [kind(p) for p in PARAM.finditer(m.group(2))] for m in ENTRY.finditer(ptx)}


@pytest.mark.parametrize("fname", sorted(kernels.ALGOS.values() and set(kernels.ALGOS.values())))
def test_entry_parameters_match_launcher(fname):
    if not (kernels.CSRC / "kernels" / fname).exists():
        pytest.fail(f"csrc/kernels/{fname} is missing")
    entries = _entries(kernels.compile_ptx(fname, "sm_90"))
    expected_names = kernels.sources()[fname]
    for name in expected_names:
        assert name in entries, f"{fname} has no .entry {name}"
        params = entries[name]
        assert len(params) == len(kernels.KERNEL_SIGNATURE), (
            f"{name}: {len(params)} params, launcher passes {len(kernels.KERNEL_SIGNATURE)}"
        )
        for (arg, kind), ptx_type in zip(kernels.KERNEL_SIGNATURE, params):
            assert ptx_type in PTX_KIND[kind], f"{name}: parameter {arg} is {ptx_type} in PTX, launcher passes {kind}"


def test_abi_check_catches_a_mismatch():
    """The parser is not vacuous: a kernel with a float where an int belongs is caught."""
    ptx = ".entry ubnext_x(\n .param .align 8 .b8 d[128],\n .param .u64 a,\n .param .f32 b\n)\n{"
    assert _entries(ptx) == {"ubnext_x": [".align 8 .b8 [128]", ".u64", ".f32"]}
    assert ".f32" not in PTX_KIND["i32"]
    assert ".align 8 .b8 [128]" not in PTX_KIND["desc"], "a descriptor of another size must be caught"


def test_descriptor_field_order_matches_header():
    text = (kernels.CSRC / "device" / "desc.cuh").read_text()
    body = re.search(r"typedef struct ubnext_comm_desc \{(.*?)\} ubnext_comm_desc;", text, re.S).group(1)
    fields = re.findall(r"unsigned long long (\w+(?:\[\w+\])?);", body)
    fields = [f.replace("UBNEXT_MAX_RANKS", str(pool.MAX_RANKS)) for f in fields]
    assert tuple(fields) == pool.DESC_FIELDS
    assert f"#define UBNEXT_MAX_RANKS {pool.MAX_RANKS}" in text
    assert f"#define UBNEXT_SYNC_BYTES {pool.SYNC_BYTES}" in text
    assert f"#define UBNEXT_DESC_BYTES {pool.DESC_BYTES}" in text
    assert f"#define UBNEXT_LAMPORT_HEADER_BYTES {pool.LAMPORT_HEADER_BYTES}" in text
    assert f"#define UBNEXT_SYNC_DEPARTED {pool.SYNC_DEPARTED}" in text
    for name in ("ABORT", "ABORT_CLAIM", "ABORT_RECORD", "ERR_LOCK"):
        assert f"#define UBNEXT_SYNC_{name} {getattr(pool, 'SYNC_' + name)}" in text, name
    for name in ("TIMEOUT", "MISMATCH", "PEER_LEFT"):
        assert re.search(rf"#define UBNEXT_ERR_{name} {getattr(errors, 'ERR_' + name)}\b", text), name
    for flag in ("FUSED_NORM", "FP8_STATIC", "FP8_PER_TOKEN", "MULTICAST"):
        assert f"#define UBNEXT_F_{flag} {getattr(kernels, 'F_' + flag)}" in text
    assert f"#define UBNEXT_F_RANK_ORDER {kernels.F_RANK_ORDER:#x}" in text
    assert kernels.F_RANK_ORDER <= 0xFFFF, "the call headers compare the low 16 flag bits only"
    for flag in ("FMT_MASK", "NVFP4", "MXFP8", "GROUP128", "SWIZZLED", "UE8M0"):
        value = getattr(kernels, "F_BLOCK_" + flag)
        assert f"#define UBNEXT_F_BLOCK_{flag} {value:#x}" in text, flag
        assert value <= 0xFFFF, "the call headers compare the low 16 flag bits only"
    packed = pool.pack_desc(
        rank=1,
        nranks=2,
        timeout_ns=5,
        err_ptr=6,
        mc_base=7,
        layout=pool.PoolLayout(2, 4096, 8192),
        peer_bases=[100, 200],
    )
    assert len(packed) == pool.DESC_STRUCT_BYTES == 8 * (16 + pool.MAX_RANKS) <= pool.DESC_BYTES
    from ubnext.runtime import _emu

    assert _emu.DESC_BYTES == pool.DESC_STRUCT_BYTES  # the emulator binding passes as many bytes by value


def test_header_fields_match_header():
    """The call-header words' numbers (desc.cuh UBNEXT_HDR_*) are the mismatch error's fields, eps as the
    fifth (issue 40 W3), and a mismatch of eps reads as the values the callers wrote."""
    text = (kernels.CSRC / "device" / "desc.cuh").read_text()
    for name, field in (("KIND", 0), ("COUNT", 1), ("HIDDEN", 2), ("IN_OFFSET", 3), ("EPS", 4)):
        assert re.search(rf"#define UBNEXT_HDR_{name} {field}\b", text), name
    assert errors._HEADER_FIELDS[4] == "eps"
    bits = {eps: int.from_bytes(struct.pack("<f", eps), "little") for eps in (1e-5, 1e-6)}
    message = str(errors.kernel_error([errors.ERR_MISMATCH, 5, 1, 0, 4, bits[1e-6], bits[1e-5], 0], 5.0, 1))
    assert "rank 1 with eps 1e-06 but rank 0 with eps 1e-05" in message, message
