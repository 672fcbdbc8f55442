import pytest

from ubnext import pool


def test_default_sizing(monkeypatch):
    monkeypatch.delenv("UBNEXT_SYMM_POOL_SIZE", raising=False)
    monkeypatch.delenv("NVTE_UB_SYMM_POOL_SIZE", raising=False)
    monkeypatch.setenv("UBNEXT_MAX_BATCH", "64")
    lay = pool.plan_layout(4, 4096)
    # the message of UBNEXT_MAX_BATCH fp32 tokens, and the Lamport call header, page-aligned
    assert lay.lamport_slot_bytes == 64 * 4096 * 4 + pool.PAGE
    assert lay.lamport_capacity == 64 * 4096 * 4 + pool.PAGE - pool.LAMPORT_HEADER_BYTES
    assert lay.sync_off == pool.DESC_BYTES and lay.lamport_off == pool.DESC_BYTES + pool.SYNC_BYTES
    assert lay.data_off >= lay.lamport_off + 3 * 4 * lay.lamport_slot_bytes
    assert lay.data_off % pool.PAGE == 0


def test_pool_size_override(monkeypatch):
    monkeypatch.setenv("UBNEXT_SYMM_POOL_SIZE", "8")
    lay = pool.plan_layout(2, 4096)
    assert lay.pool_bytes == 8 << 20


def test_pool_size_below_reserved_region(monkeypatch):
    monkeypatch.setenv("UBNEXT_SYMM_POOL_SIZE", "0")
    with pytest.raises(Exception, match="UBNEXT_SYMM_POOL_SIZE"):
        pool.plan_layout(2, 4096)


@pytest.mark.parametrize("nranks,hidden", [(0, 4096), (17, 4096), (2, 0), (2, -5)])
def test_bad_layout_arguments(nranks, hidden):
    with pytest.raises(ValueError):
        pool.plan_layout(nranks, hidden)
