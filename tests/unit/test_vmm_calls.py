"""VmmBackend's cuMem*/cuMulticast* call sequence, without a GPU: the driver functions are
replaced by a recorder (the structs and enums are cuda.bindings' own), one rank. Checks the
documented constraints: sizes multiples of the allocation and the multicast (MINIMUM)
granularity, argument order of cuMulticastBindMem/Unbind, the multicast mapping aligned to the
multicast granularity, and the teardown order (unbind, unmap, free the ranges, release)."""

import os
import threading
from types import SimpleNamespace

import pytest
import torch

driver = pytest.importorskip("cuda.bindings.driver")

from ubnext import pool  # noqa: E402

ALLOC_GRAN = 2 << 20
MC_GRAN = 8 << 20  # deliberately larger than the allocation granularity
PRIMARY = 0xC0000  # device d's primary context: PRIMARY + d
CALLER_CONTEXT = 0xCA11E7


class FakeDriver:
    def __init__(self, multicast: bool):
        self.calls = []
        self.multicast = multicast
        self._next = 0x7F00_0000_0000
        self._handles = 100
        self.contexts = [CALLER_CONTEXT]  # the caller's own, another device's say
        self.context_at_create = None
        self.current_at = []  # (call name, the thread's current context at that call)

    def __getattr__(self, name):  # structs and enums: the real ones
        return getattr(driver, name)

    def _rec(self, name, *args):
        self.calls.append((name, args))
        self.current_at.append((name, self.contexts[-1]))

    def cuDeviceGet(self, i):
        return (driver.CUresult.CUDA_SUCCESS, driver.CUdevice(i))

    # the calling thread's context stack, as the driver keeps it (one rank per driver here)
    def cuDevicePrimaryCtxRetain(self, dev):
        return (driver.CUresult.CUDA_SUCCESS, driver.CUcontext(PRIMARY + int(dev)))

    def cuCtxPushCurrent(self, ctx):
        self._rec("cuCtxPushCurrent", int(ctx))
        self.contexts.append(int(ctx))
        return (driver.CUresult.CUDA_SUCCESS,)

    def cuCtxPopCurrent(self):
        self._rec("cuCtxPopCurrent")
        return (driver.CUresult.CUDA_SUCCESS, driver.CUcontext(self.contexts.pop()))

    def cuMemGetAllocationGranularity(self, prop, flag):
        assert isinstance(prop, driver.CUmemAllocationProp)
        return (driver.CUresult.CUDA_SUCCESS, ALLOC_GRAN)

    def cuDeviceGetAttribute(self, attr, dev):
        assert attr == driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED
        return (driver.CUresult.CUDA_SUCCESS, int(self.multicast))

    def cuDeviceGetUuid(self, dev):
        # CUuuid.bytes is read-only: a stand-in with the same attribute
        return (driver.CUresult.CUDA_SUCCESS, SimpleNamespace(bytes=bytes([int(dev) + 1] * 16)))

    def cuMemImportFromShareableHandle(self, fd, kind):
        self._handles += 1
        self._rec("cuMemImportFromShareableHandle", self._handles)
        return (driver.CUresult.CUDA_SUCCESS, driver.CUmemGenericAllocationHandle(self._handles))

    def cuMulticastGetGranularity(self, prop, flag):
        assert isinstance(prop, driver.CUmulticastObjectProp)
        assert flag == driver.CUmulticastGranularity_flags.CU_MULTICAST_GRANULARITY_MINIMUM
        return (driver.CUresult.CUDA_SUCCESS, MC_GRAN)

    def cuMemCreate(self, size, prop, flags):
        self._rec("cuMemCreate", size, flags)
        self.context_at_create = self.contexts[-1]
        self._handles += 1
        return (driver.CUresult.CUDA_SUCCESS, driver.CUmemGenericAllocationHandle(self._handles))

    def cuMemExportToShareableHandle(self, handle, kind, flags):
        assert kind == driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        return (driver.CUresult.CUDA_SUCCESS, os.open(os.devnull, os.O_RDONLY))

    def cuMemAddressReserve(self, size, align, addr, flags):
        self._rec("cuMemAddressReserve", size, align)
        va = self._next
        self._next += size + (64 << 20)
        return (driver.CUresult.CUDA_SUCCESS, driver.CUdeviceptr(va))

    def cuMemMap(self, va, size, offset, handle, flags):
        self._rec("cuMemMap", int(va), size, int(handle))
        return (driver.CUresult.CUDA_SUCCESS,)

    def cuMemSetAccess(self, va, size, descs, count):
        assert count == len(descs) == 1 and isinstance(descs[0], driver.CUmemAccessDesc)
        assert descs[0].location.type == driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._rec("cuMemSetAccess", int(va), size)
        return (driver.CUresult.CUDA_SUCCESS,)

    def cuMulticastCreate(self, prop):
        self._rec("cuMulticastCreate", prop.size, prop.numDevices)
        return (driver.CUresult.CUDA_SUCCESS, driver.CUmemGenericAllocationHandle(999))

    def cuMulticastAddDevice(self, mc, dev):
        self._rec("cuMulticastAddDevice", int(mc), int(dev))
        return (driver.CUresult.CUDA_SUCCESS,)

    def cuMulticastBindMem(self, mc, mc_off, mem, mem_off, size, flags):
        self._rec("cuMulticastBindMem", int(mc), mc_off, int(mem), mem_off, size, flags)
        return (driver.CUresult.CUDA_SUCCESS,)

    def cuMulticastUnbind(self, mc, dev, mc_off, size):
        self._rec("cuMulticastUnbind", int(mc), int(dev), mc_off, size)
        return (driver.CUresult.CUDA_SUCCESS,)

    def cuMemUnmap(self, va, size):
        self._rec("cuMemUnmap", int(va), size)
        return (driver.CUresult.CUDA_SUCCESS,)

    def cuMemAddressFree(self, va, size):
        self._rec("cuMemAddressFree", int(va), size)
        return (driver.CUresult.CUDA_SUCCESS,)

    def cuMemRelease(self, handle):
        self._rec("cuMemRelease", int(handle))
        return (driver.CUresult.CUDA_SUCCESS,)


@pytest.fixture(autouse=True)
def _primary_contexts_of_this_test():
    """_cuda retains a device's primary context once per process: from this test's fake driver,
    and none left behind for a later test's driver."""
    import ubnext.runtime._cuda as cu

    cu._primary_context.cache_clear()
    yield
    cu._primary_context.cache_clear()


@pytest.fixture
def fake(monkeypatch):
    def make(multicast):
        drv = FakeDriver(multicast)
        import ubnext.runtime._cuda as cu

        monkeypatch.setattr(cu, "driver", lambda: drv)
        monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: None)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: None)
        monkeypatch.setattr(pool._Slot, "tensor", lambda self, device: None)
        return drv

    return make


def _names(drv):
    return [c[0] for c in drv.calls]


@pytest.mark.parametrize("multicast", [False, True])
def test_vmm_sizes_and_teardown(fake, multicast):
    drv = fake(multicast)
    backend = pool.VmmBackend(5 << 20, 0, 1, torch.device("cuda", 0), lambda obj: [obj])
    gran = MC_GRAN if multicast else ALLOC_GRAN
    assert backend.size % gran == 0 and backend.size >= 5 << 20
    (create,) = [c for c in drv.calls if c[0] == "cuMemCreate"]
    assert create[1] == (backend.size, 0)
    if multicast:
        (mc,) = [c for c in drv.calls if c[0] == "cuMulticastCreate"]
        assert mc[1] == (backend.size, 1)
        (bind,) = [c for c in drv.calls if c[0] == "cuMulticastBindMem"]
        assert bind[1] == (999, 0, int(backend._handles[0]), 0, backend.size, 0)
        reserves = [c for c in drv.calls if c[0] == "cuMemAddressReserve"]
        assert reserves[-1][1] == (backend.size, MC_GRAN)
        assert backend.mc_base
        names = _names(drv)
        assert names.index("cuMulticastAddDevice") < names.index("cuMulticastBindMem")
    size = backend.size
    drv.calls.clear()
    backend.close()
    assert _names(drv)[0] == "cuCtxPushCurrent" and _names(drv)[-1] == "cuCtxPopCurrent"  # test_release_*
    del drv.calls[0], drv.calls[-1]
    names = _names(drv)
    if multicast:
        assert names[0] == "cuMulticastUnbind"
        assert drv.calls[0][1] == (999, 0, 0, size)
    last_unmap = max(i for i, n in enumerate(names) if n == "cuMemUnmap")
    first_free = names.index("cuMemAddressFree")
    first_release = names.index("cuMemRelease")
    assert last_unmap < first_free < first_release
    assert names.count("cuMemUnmap") == names.count("cuMemAddressFree") == (2 if multicast else 1)
    assert names.count("cuMemRelease") == (2 if multicast else 1)


def test_the_set_up_leaves_the_callers_device_and_context(fake, monkeypatch):
    """Issue 23 item 4: the pool's memory is made in the device's primary context (torch's), and
    the caller's own context (here another device's) and torch's current device are its own again
    afterwards: a thread that works on another GPU must not find its later device="cuda"
    allocations on the communicator's GPU."""
    drv = fake(True)
    set_to = []
    monkeypatch.setattr(torch.cuda, "set_device", set_to.append)
    backend = pool.VmmBackend(5 << 20, 0, 1, torch.device("cuda", 1), lambda obj: [obj])
    assert set_to == [], f"the set-up changed torch's current device: set_device{tuple(set_to)}"
    assert drv.contexts == [CALLER_CONTEXT], f"the caller's context stack is now {drv.contexts}"
    assert drv.context_at_create == PRIMARY + 1, "the memory was not made in the device's primary context"
    backend.close()


RELEASE_CALLS = {"cuMulticastUnbind", "cuMemUnmap", "cuMemAddressFree", "cuMemRelease"}


def test_the_release_runs_in_the_devices_primary_context(fake):
    """Issue 36 R6: a deferred release runs at another pool's creation or close, on whichever thread
    makes it, where another device's context (or none) may be current: every release call runs in the
    pool's device's primary context, pushed around them, and the caller's own is current again after."""
    drv = fake(True)
    backend = pool.VmmBackend(5 << 20, 0, 1, torch.device("cuda", 1), lambda obj: [obj])
    drv.calls.clear(), drv.current_at.clear()
    backend.close()
    released = [(name, ctx) for name, ctx in drv.current_at if name in RELEASE_CALLS]
    assert {name for name, _ in released} == RELEASE_CALLS, drv.calls
    assert all(ctx == PRIMARY + 1 for _, ctx in released), f"released outside the device's primary context: {released}"
    assert drv.contexts == [CALLER_CONTEXT], f"the caller's context stack is now {drv.contexts}"


@pytest.mark.parametrize("failing", ["cuMemUnmap", "cuMemRelease", "cuCtxPushCurrent"])
def test_a_failing_release_call_is_logged_and_the_rest_still_run(monkeypatch, caplog, failing):
    """Issue 36 R6: a release call that fails is logged (logger "ubnext", naming the call and its
    status), never raised (a release runs where nobody can act on an exception: a failed set-up, a
    deferred release), and the calls after it still run, so that one failure leaks only its own part."""
    import ubnext.runtime._cuda as cu

    drv = FailingDriver(True)
    monkeypatch.setattr(cu, "driver", lambda: drv)
    for name in ("set_device", "current_stream", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, lambda *args: None)
    monkeypatch.setattr(pool._Slot, "tensor", lambda self, device: None)
    backend = pool.VmmBackend(5 << 20, 0, 1, torch.device("cuda", 0), lambda obj: [obj])
    drv.fail_at = (failing, drv.seen.get(failing, 0))  # its next call: the release's (the first one)
    drv.calls.clear()
    with caplog.at_level("WARNING", logger="ubnext"):
        backend.close()  # no exception
    logged = [rec.getMessage() for rec in caplog.records if rec.name == "ubnext"]
    assert len(logged) == 1 and failing in logged[0] and "CUDA_ERROR_OUT_OF_MEMORY" in logged[0], logged
    names = _names(drv)
    # everything else was still released: both mappings of a two-range pool, both handles
    assert names.count("cuMemAddressFree") == 2 and names.count("cuMemRelease") == 2 - (failing == "cuMemRelease"), (
        names
    )
    assert names.count("cuMemUnmap") == 2 - (failing == "cuMemUnmap"), names


@pytest.mark.parametrize("same_gpu", [True, False])
def test_ranks_sharing_a_gpu_get_no_multicast(fake, monkeypatch, same_gpu):
    """Two ranks (the peer faked by the allgather) on one GPU: a multicast object would wait in
    cuMulticastBindMem for a second device that never comes, so the pool must be unicast-only."""
    from ubnext.pool import _fdshare

    drv = fake(True)
    monkeypatch.setattr(
        _fdshare,
        "exchange_fds",
        lambda fd, rank, nranks, allgather, only_from=None: [
            os.dup(fd) if fd >= 0 else os.open(os.devnull, os.O_RDONLY) for _ in range(nranks)
        ],
    )

    def allgather(obj):
        if isinstance(obj, tuple) and isinstance(obj[0], tuple):  # (GPU info, error): the peer's own UUID
            info, error = obj
            return [obj, ((*info[:3], info[3] if same_gpu else bytes([9] * 16)), error)]
        return [obj, obj]

    backend = pool.VmmBackend(5 << 20, 0, 2, torch.device("cuda", 0), allgather)
    names = _names(drv)
    assert ("cuMulticastCreate" in names) == (not same_gpu)
    assert bool(backend.mc_base) == (not same_gpu)
    backend.close()


# ------------------------------------------------------------------ failures during a multi-rank set-up


class FailingDriver(FakeDriver):
    """FakeDriver whose `fail_at` = (call name, n) makes the n-th call of that name fail."""

    def __init__(self, multicast, fail_at=None):
        super().__init__(multicast)
        self.fail_at = fail_at
        self.seen = {}
        self.order = []  # (name, n) of every driver call, in the order made

    def __getattribute__(self, name):
        attr = object.__getattribute__(self, name)
        if not (name.startswith("cu") and callable(attr)):
            return attr
        seen, fail_at = object.__getattribute__(self, "seen"), object.__getattribute__(self, "fail_at")

        def call(*args):
            k = seen.get(name, 0)
            seen[name] = k + 1
            object.__getattribute__(self, "order").append((name, k))
            if fail_at == (name, k):
                return (driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY, None)
            return attr(*args)

        return call

    def multicast_part(self, nranks):
        """The calls of the multicast phases: every call after the last peer's cuMemSetAccess."""
        start = self.order.index(("cuMemSetAccess", nranks - 1)) + 1
        return set(self.order[start:])

    def leaks(self):
        """What was made and not released, from the recorded calls."""
        live = {"handles": 0, "reserved": 0, "mapped": 0, "bound": 0, "contexts pushed": 0}
        for name, _ in self.calls:
            delta = {
                "cuMemCreate": ("handles", 1),
                "cuMemImportFromShareableHandle": ("handles", 1),
                "cuMulticastCreate": ("handles", 1),
                "cuMemRelease": ("handles", -1),
                "cuMemAddressReserve": ("reserved", 1),
                "cuMemAddressFree": ("reserved", -1),
                "cuMemMap": ("mapped", 1),
                "cuMemUnmap": ("mapped", -1),
                "cuMulticastBindMem": ("bound", 1),
                "cuMulticastUnbind": ("bound", -1),
                "cuCtxPushCurrent": ("contexts pushed", 1),
                "cuCtxPopCurrent": ("contexts pushed", -1),
            }.get(name)
            if delta:
                live[delta[0]] += delta[1]
        return {k: v for k, v in live.items() if v}


class ThreadRanks:
    """Ranks as threads of this process: a barrier-based allgather and fd exchange."""

    def __init__(self, n):
        self.n = n
        self.barrier = threading.Barrier(n, timeout=20)
        self.slots = [None] * n

    def allgather(self, rank):
        def gather(obj):
            self.barrier.wait()
            self.slots[rank] = obj
            self.barrier.wait()
            out = list(self.slots)
            self.barrier.wait()
            return out

        return gather


TEARDOWN = {"cuMulticastUnbind", "cuMemUnmap", "cuMemAddressFree", "cuMemRelease"}


_RANK = threading.local()  # the driver of the rank a thread plays


def _close(backend, drv):
    """Close a rank's backend from this thread, with that rank's driver (its release asks for it)."""
    _RANK.drv = drv
    try:
        backend.close()
    finally:
        del _RANK.drv


def _set_up_two_ranks(monkeypatch, drivers, exchange_fails=None):
    import ubnext.runtime._cuda as cu
    from ubnext.pool import _fdshare

    monkeypatch.setattr(cu, "driver", lambda: _RANK.drv)
    cu._primary_context.cache_clear()  # so that each run retains, and a failure can be injected there
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: None)
    monkeypatch.setattr(pool._Slot, "tensor", lambda self, device: None)
    calls = [0, 0]

    def exchange_fds(fd, rank, nranks, allgather, only_from=None):
        # the owner makes one copy per receiver before anyone can close the original (the
        # threads share one fd table, as ranks on one node share the kernel's file objects)
        copies = allgather([os.dup(fd) if fd >= 0 else -1 for _ in range(nranks)])
        mine = [copies[src][rank] for src in range(nranks)]
        calls[rank] += 1
        if exchange_fails == (rank, calls[rank] - 1):  # after the internal allgather, as a socket error is
            for f in mine:
                if f >= 0:
                    os.close(f)
            raise TimeoutError(f"rank {rank}: accept timed out")
        return mine

    monkeypatch.setattr(_fdshare, "exchange_fds", exchange_fds)
    ranks = ThreadRanks(len(drivers))
    results = [None] * len(drivers)

    def run(rank):
        _RANK.drv = drivers[rank]
        try:
            results[rank] = pool.VmmBackend(
                5 << 20, rank, len(drivers), torch.device("cuda", rank), ranks.allgather(rank)
            )
        except Exception as exc:  # noqa: BLE001 - compared below
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(drivers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
        assert not t.is_alive(), "a rank hangs in the set-up"
    return results


def _fd_count():
    return len(os.listdir("/proc/self/fd"))


def test_a_failure_at_any_driver_call_on_one_rank_fails_every_rank_alike(monkeypatch):
    """Inject a failure at every driver call the set-up makes, on each rank in turn: every rank
    must raise the same PoolSetupError (or, where the failure only costs the multicast: the
    multicast granularity query and every call of the multicast phases, every rank must agree on
    a unicast pool), none may hang, and nothing may leak: handles, ranges, mappings, multicast
    binds, file descriptors."""
    reference = [FailingDriver(True) for _ in range(2)]
    ok = _set_up_two_ranks(monkeypatch, reference)
    assert all(isinstance(b, pool.VmmBackend) and b.mc_base for b in ok), ok
    # the set-up's calls only: the release's own (its context push too) come after the last vote (leaks()
    # checks them; test_a_failing_release_call_is_logged_and_the_rest_still_run their failures)
    set_up = [(dict(drv.seen), drv.multicast_part(2)) for drv in reference]
    for b, drv in zip(ok, reference):
        _close(b, drv)
    injected, soft = 0, 0
    for victim in range(2):
        seen, multicast_part = set_up[victim]
        for name, count in sorted(seen.items()):
            if name in TEARDOWN or name == "cuCtxPopCurrent":  # after the last vote: see leaks()
                continue
            for k in range(count):
                drivers = [FailingDriver(True, (name, k) if r == victim else None) for r in range(2)]
                fds = _fd_count()
                results = _set_up_two_ranks(monkeypatch, drivers)
                where = f"{name} #{k} failing on rank {victim}"
                if name == "cuMulticastGetGranularity" or (name, k) in multicast_part:
                    # no multicast, agreed: a unicast pool everywhere
                    assert all(isinstance(r, pool.VmmBackend) and not r.mc_base for r in results), f"{where}: {results}"
                    for r, drv in zip(results, drivers):
                        _close(r, drv)
                    soft += 1
                else:
                    assert all(isinstance(r, pool.PoolSetupError) for r in results), f"{where}: {results}"
                    assert len({str(r) for r in results}) == 1, f"{where}: ranks differ: {results}"
                    assert f"on rank {victim}" in str(results[0]) and name in str(results[0]), str(results[0])
                for r, drv in enumerate(drivers):
                    assert drv.leaks() == {}, f"{where}: rank {r} leaked {drv.leaks()}"
                assert _fd_count() == fds, f"{where}: file descriptors leaked"
                injected += 1
    assert injected >= 20 and soft >= 8, (injected, soft)


@pytest.mark.parametrize("rank,exchange", [(0, 0), (1, 0), (1, 1)], ids=["r0-memory", "r1-memory", "r1-multicast"])
def test_a_failed_fd_exchange_on_one_rank_fails_every_rank_alike(monkeypatch, rank, exchange):
    """The fd exchange can fail on one rank only (a timeout, a socket error): its outcome is voted
    too, so the peers do not pair their next collective with the failed rank's next one."""
    drivers = [FailingDriver(True) for _ in range(2)]
    fds = _fd_count()
    results = _set_up_two_ranks(monkeypatch, drivers, exchange_fails=(rank, exchange))
    assert all(isinstance(r, pool.PoolSetupError) for r in results), results
    assert len({str(r) for r in results}) == 1 and f"on rank {rank}: TimeoutError" in str(results[0]), results
    for r, drv in enumerate(drivers):
        assert drv.leaks() == {}, f"rank {r} leaked {drv.leaks()}"
    assert _fd_count() == fds


@pytest.mark.parametrize(
    "call,victim",
    [("cuMulticastCreate", 0)]
    + [  # only rank 0 creates it
        (call, victim)
        for call in ("cuMulticastAddDevice", "cuMulticastBindMem", "cuMemAddressReserve", "cuMemMap", "cuMemSetAccess")
        for victim in (0, 1)
    ],
)
def test_a_multicast_failure_costs_the_multicast_only(monkeypatch, caplog, call, victim):
    """A multicast call that fails on one rank (NCCL's NVLS holding the multicast resources, say)
    gives every rank a unicast pool, not a PoolSetupError that would send every call to
    torch.distributed: the multicast part (its object, binding and range) is released at once,
    the peers' memory stays mapped, each rank says so once, and close releases the rest. The
    address range calls fail on the multicast range (their third call: after the two peers')."""
    k = 2 if call.startswith("cuMem") else 0
    drivers = [FailingDriver(True, (call, k) if r == victim else None) for r in range(2)]
    fds = _fd_count()
    with caplog.at_level("WARNING", logger="ubnext"):
        results = _set_up_two_ranks(monkeypatch, drivers)
    assert all(isinstance(r, pool.VmmBackend) for r in results), results
    assert [r.mc_base for r in results] == [0, 0] and all(r.peer_bases and all(r.peer_bases) for r in results)
    for r, drv in enumerate(drivers):
        # what stays is the unicast pool: our memory and the peer's, each mapped once
        assert drv.leaks() == {"handles": 2, "reserved": 2, "mapped": 2}, f"rank {r}: {drv.leaks()}"
    warnings = [rec.getMessage() for rec in caplog.records if "without multicast" in rec.getMessage()]
    assert len(warnings) == 2 and all(f"on rank {victim}" in w and call in w for w in warnings), warnings
    for r, drv in zip(results, drivers):
        _close(r, drv)
    for r, drv in enumerate(drivers):
        assert drv.leaks() == {}, f"rank {r} leaked {drv.leaks()}"
    assert _fd_count() == fds
