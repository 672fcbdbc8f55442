"""Process-wide lifecycle: bootstrapping torch.distributed, the communicator registry, and the
teardown at interpreter exit.

Why the teardown exists: gloo runs each collective on a worker thread
(``ProcessGroupGloo::runLoop``), which drops its reference to a finished work object, and with it
the work's tensors, a moment after the caller's ``wait()`` returned. Dropping a tensor that owns
a Python object takes the GIL. If the interpreter has begun finalising by then, taking the GIL
ends the thread with ``pthread_exit``, whose forced unwind passes through a ``noexcept``
destructor (``~AsyncWork``): ``std::terminate``, "terminate called without an active exception".
Those worker threads are joined only when the last reference to the process group goes away
(``destroy_process_group`` alone is not enough while something still holds the group). So, at
exit, ubnext closes its communicators, drops every reference it holds to a process group, and,
when it initialised torch.distributed itself, destroys the process group before finalisation.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import itertools
import logging
import socket
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from .. import envs
from ..errors import UbnextError
from . import _watchdog

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.distributed_c10d import GroupName

    from ..comm import Communicator

log = logging.getLogger("ubnext")

# torch's own default (torch.distributed.constants.default_pg_timeout), for a group whose backend
# does not say
_DEFAULT_GROUP_TIMEOUT_S = 1800.0


def kernel_timeout_s(group, device: torch.device) -> float:
    """How long a kernel waits for a peer before it aborts the communicator: ``UBNEXT_TIMEOUT``
    if set, else the timeout of ``group``'s backend for ``device``, the bound torch.distributed
    itself applies (NCCL's watchdog, gloo's wait). Host drift shorter than that (a checkpoint
    written by one rank, a first-use compile) is waited out, as NCCL would."""
    bound = envs.get("UBNEXT_TIMEOUT")
    if bound:
        return float(bound)
    try:
        backend = group._get_backend(torch.device(device.type))
        return float(backend.options._timeout.total_seconds())
    except Exception as exc:  # noqa: BLE001 - a backend without options: torch's default
        log.debug("ubnext: no timeout on the group's backend (%s); using %g s", exc, _DEFAULT_GROUP_TIMEOUT_S)
        return _DEFAULT_GROUP_TIMEOUT_S


_lock = threading.Lock()
# key -> weak reference to a live communicator (a plain dict: every op looks up its communicator
# here, and WeakValueDictionary.get costs a Python call more); an entry goes with its communicator
_registry: dict[str, weakref.ref[Communicator]] = {}
# communicators cached per process group (ubnext.get_communicator): group_name -> Communicator
cached: dict[str, Communicator] = {}
_serial = itertools.count()
# the default process group ubnext created (a weak reference: the user may destroy it and make
# their own, which ubnext must then leave alone)
_our_group: weakref.ref | None = None
_atexit_registered = False
# the class communicator_of builds: ubnext.comm.Communicator, set when that module is imported (this
# registry sits below the Communicator, which registers itself here)
communicator_class: type[Communicator] | None = None


def register(comm: Communicator) -> str:
    """A process-local key under which the ops (``torch.ops.ubnext.*``) find ``comm``."""
    _ensure_atexit()
    key = f"{comm.group.group_name}#{next(_serial)}"
    with _lock:
        _registry[key] = weakref.ref(comm, lambda _: _registry.pop(key, None))
    return key


def lookup(key: str) -> Communicator:
    """The communicator registered under ``key``; a bare group name means that group's cached
    communicator (created on first use, collectively)."""
    ref = _registry.get(key)
    comm = ref() if ref is not None else None
    if comm is not None:
        return comm
    if "#" in key:
        raise UbnextError(f"no live ubnext communicator {key!r} (it was closed or garbage-collected)")
    comm = cached.get(key)
    if comm is not None and not comm.closed:
        return comm  # without resolving the group from its name: the hot path of ubnext.nn.Linear
    # a key without "#" is a group's name (torch types those as the NewType GroupName over str)
    group = dist.distributed_c10d._resolve_process_group(cast("GroupName", key))
    return communicator_of(group)


def communicator_of(group=None) -> Communicator:
    """The cached communicator of ``group`` (the default group when None); created on first
    use, which is collective."""
    if not dist.is_initialized():
        _refuse_set_up_while_compiling("torch.distributed is not initialised")
        bootstrap()
    group = group if group is not None else dist.group.WORLD
    try:
        name = group.group_name
    except AttributeError:  # off the hot path: a group's name, or something that is no group
        group = process_group(group, "ubnext.get_communicator(group=None)")
        name = group.group_name
    comm = cached.get(name)
    if comm is None or comm.closed:
        _refuse_set_up_while_compiling(f"process group {name!r} has no ubnext communicator yet")
        # set when ubnext.comm is imported, which importing ubnext does before any communicator is asked for
        comm = cached[name] = cast("type[Communicator]", communicator_class)(group)
    return comm


def process_group(group, signature: str):
    """``group`` as a ProcessGroup: None is the default group, a str the name of a group this process
    knows (its ``group_name``, as torch's functional collectives take it). Anything else is refused
    with ``signature``, the call the user made: a rank outside the group (torch.distributed.new_group
    gives it ``GroupMember.NON_GROUP_MEMBER``, an int), or torch.distributed's habit of a reduce op in
    the second place."""
    if group is None:
        return dist.group.WORLD
    if isinstance(group, dist.ProcessGroup):
        return group
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"{signature}: rank {dist.get_rank()} is not a member of this group (torch.distributed.new_group "
            "returns GroupMember.NON_GROUP_MEMBER on the ranks outside it); make the communicator and call "
            "its ops only on the group's ranks, e.g. `if dist.get_rank() in ranks:`"
        )
    if isinstance(group, str):
        try:
            return dist.distributed_c10d._resolve_process_group(cast("GroupName", group))
        except RuntimeError:
            known = sorted(dist.distributed_c10d._world.pg_names.values())
            raise ValueError(
                f"{signature}: no process group named {group!r} in this process (its groups' "
                f"group_name: {', '.join(map(repr, known))}); pass the ProcessGroup or its "
                "group_name"
            ) from None
    if isinstance(group, (dist.ReduceOp, dist.ReduceOp.RedOpType)):
        raise TypeError(
            f"{signature}: got the reduce op {group} where the group goes; ubnext always sums (it "
            "takes no op), and returns the sum without writing into x: write x = ubnext.all_reduce(x), "
            "or ubnext.all_reduce(x, out=x) to sum into x in place"
        )
    raise TypeError(
        f"{signature}: group must be a torch.distributed ProcessGroup, its group_name (str) or None, "
        f"not {type(group).__name__}"
    )


def _refuse_set_up_while_compiling(missing: str) -> None:
    """Refuse to bootstrap torch.distributed or make a communicator while Dynamo traces: both are
    collective host work (sockets, MPI, the pool's set-up) that Dynamo cannot trace, and it failed
    deep inside them (``_socket.gethostname``, ``Intracomm.bcast``) with no hint. Under
    ``fullgraph=True`` Dynamo reports this error as its "Observed exception", with this text."""
    if torch.compiler.is_compiling():
        raise UbnextError(
            f"torch.compile is tracing a ubnext call, but {missing}: create the communicator before "
            "compiling, i.e. before the first call of the compiled function: call ubnext.get_communicator() "
            "(ubnext.get_communicator(group) for another group) in eager code first"
        )


def bootstrap() -> None:
    """Initialise torch.distributed from torchrun's or an MPI launcher's variables: NCCL on GPUs,
    gloo without one or where ranks share a GPU; ubnext then owns the process group and destroys it
    at exit."""
    global _our_group
    from ._cuda import gpu_available

    info = envs.launcher_info()
    problem = envs.first_problem()
    if info is None and problem is not None:
        raise problem  # no launcher, so no peers to tell: the bad value is the first thing to fix
    if info is None:
        raise UbnextError(
            "torch.distributed is not initialised and no launcher was found: call "
            "torch.distributed.init_process_group(), or start under torchrun or mpirun"
        )
    use_gpu = gpu_available()
    backend = "nccl" if use_gpu else "gloo"
    # made here rather than by init_process_group: the backend is chosen through it
    store = _store(info, _group_timeout(backend))
    _agree_on_environment(store, info["rank"], info["world_size"], problem)
    device_id = None
    if use_gpu:
        torch.cuda.set_device(info["local_rank"] % torch.cuda.device_count())
        device = torch.cuda.current_device()
        if _ranks_share_a_gpu(store, info["rank"], info["world_size"], _gpu_identity(device)):
            # NCCL refuses a communicator with two ranks on one GPU ("Duplicate GPU detected"), at
            # once with a device_id, else at the first collective; gloo takes CUDA tensors too
            backend = "gloo"
            if info["rank"] == 0:
                log.warning(
                    "ubnext: several ranks share a GPU, which NCCL refuses; torch.distributed "
                    "is initialised with gloo (the ubnext kernels still run on the GPU)"
                )
        else:
            device_id = torch.device("cuda", device)
    timeout = _group_timeout(backend)
    store.set_timeout(timeout)
    kwargs: dict[str, Any] = {
        "backend": backend,
        "rank": info["rank"],
        "world_size": info["world_size"],
        "timeout": timeout,
        "store": store,
    }
    if device_id is not None:
        kwargs["device_id"] = device_id
    _ensure_atexit()
    dist.init_process_group(**kwargs)
    _our_group = weakref.ref(dist.group.WORLD)


def _group_timeout(backend: str) -> datetime.timedelta:
    """The process group's timeout, also the kernels' default bound (kernel_timeout_s): torch's
    default unless UBNEXT_TIMEOUT asks for a shorter one."""
    try:
        bound = envs.get("UBNEXT_TIMEOUT")
    except envs.EnvError:
        bound = None  # refused on every rank by _agree_on_environment, once the rendezvous is made
    if bound:
        return datetime.timedelta(seconds=max(60.0, 4 * bound))
    # torch annotates a Backend, a str subclass, and only compares it with the backends' names
    return dist.distributed_c10d._get_default_timeout(backend)  # type: ignore[arg-type]


# how long a rank with a bad environment keeps the rendezvous store up for its peers to read the verdict
# (the store lives in one rank's process: rank 0's under MPI)
ENVIRONMENT_VERDICT_GRACE_S = 10.0


def _agree_on_environment(store, rank: int, world_size: int, problem: Exception | None) -> None:
    """Compare every rank's environment check in the rendezvous store, which every rank reaches anyway:
    a bad value on any rank raises EnvError on every rank, naming the rank and the value, instead of one
    rank stopping before the rendezvous and its peers failing to connect to it. Bounded by the store's
    timeout (the group's); one store write and one wait when all is well."""
    prefix = "ubnext/bootstrap/environment"
    store.set(f"{prefix}/{rank}", "" if problem is None else str(problem))
    keys = [f"{prefix}/{r}" for r in range(world_size)]
    store.wait(keys)
    bad = [(r, text) for r, text in enumerate(store.multi_get(keys)) if text]
    if not bad:
        return
    # rank 0 holds the store (under MPI, and torchrun's env:// without an agent store): it stays until
    # every rank has read the verdict, which would otherwise go with its process
    read = store.add(f"{prefix}/read", 1)
    deadline = time.monotonic() + ENVIRONMENT_VERDICT_GRACE_S
    while rank == 0 and read < world_size and time.monotonic() < deadline:
        time.sleep(0.02)
        read = store.add(f"{prefix}/read", 0)
    named = "; ".join(f"rank {r}: {text.decode()}" for r, text in bad)
    raise envs.EnvError(f"ubnext: the environment is not valid on every rank ({named}); every rank stops")


def _store(info: dict[str, Any], timeout: datetime.timedelta):
    """The store init_process_group would make: torchrun's env:// rendezvous under the prefix
    init_process_group gives it, or, under MPI, one announced over MPI."""
    if info["launcher"] != "torchrun":
        return _mpi_store(info["rank"], info["world_size"], timeout)
    store, _, _ = next(dist.rendezvous("env://", info["rank"], info["world_size"], timeout=timeout))
    store.set_timeout(timeout)
    return dist.PrefixStore("default_pg", store)


def _gpu_identity(device: int) -> str:
    """The physical GPU behind torch's ``device``, told apart across machines: two processes see
    the same UUID for one GPU whatever their CUDA_VISIBLE_DEVICES."""
    return f"{host_identity()}/{torch.cuda.get_device_properties(device).uuid}"


def host_identity() -> str:
    """Which machine this process runs on: hostname/boot id. The boot id (one per running
    kernel) tells apart nodes that share a hostname; the hostname names them in the message."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _ranks_share_a_gpu(store, rank: int, world_size: int, gpu: str) -> bool:
    """Whether any two ranks of the job run on one GPU; the same answer on every rank. Counted in
    the store by GPU identity, not guessed from the local rank count against the device count:
    ranks that each see one GPU (CUDA_VISIBLE_DEVICES set per rank) run on distinct GPUs."""
    prefix = "ubnext/bootstrap"
    if store.add(f"{prefix}/gpu/{gpu}", 1) > 1:
        store.add(f"{prefix}/shared", 1)
    store.set(f"{prefix}/counted/{rank}", "1")
    store.wait([f"{prefix}/counted/{r}" for r in range(world_size)])
    return store.add(f"{prefix}/shared", 0) > 0


def _mpi_store(rank: int, world_size: int, timeout: datetime.timedelta):
    """A TCPStore whose server (rank 0) binds a port the kernel picks, announced over MPI.
    Probing a free port and binding it later races with every other process on the host."""
    from mpi4py import MPI

    mpi = MPI.COMM_WORLD
    address: tuple[str, int] | Exception | None = None
    store = None
    if rank == 0:
        host = socket.gethostname() if world_size > 1 else "127.0.0.1"
        try:
            host = socket.gethostbyname(host)
        except OSError:
            host = "127.0.0.1"
        try:
            store = dist.TCPStore(host, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
            address = (host, store.port)
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            address = exc
    address = mpi.bcast(address, root=0)
    if isinstance(address, BaseException):
        raise RuntimeError(f"rank 0 could not start the rendezvous store: {address}") from address
    if store is None:
        store = dist.TCPStore(address[0], address[1], world_size, is_master=False, timeout=timeout)
    return store


def _ensure_atexit() -> None:
    global _atexit_registered
    with _lock:
        if not _atexit_registered:
            atexit.register(shutdown)
            _atexit_registered = True


def shutdown() -> None:
    """Close every live communicator and drop their process groups; destroy the process group
    when ubnext created it. Runs at interpreter exit; safe to call more than once."""
    global _our_group
    _watchdog.stop()  # before the communicators and the store it reads go
    comms = [comm for comm in (ref() for ref in list(_registry.values())) if comm is not None]
    cached.clear()
    for comm in comms:
        try:
            comm._release()
        except Exception as exc:  # noqa: BLE001 - exit must go on; say what was not released
            log.warning("closing %r at exit failed: %s", comm, exc)
    del comms
    ours = _our_group() if _our_group is not None else None
    _our_group = None
    if ours is not None and dist.is_initialized() and dist.group.WORLD is ours:
        del ours
        dist.destroy_process_group()
    # the group's worker threads are joined when its last reference goes: collect cycles now,
    # before finalisation, rather than during it
    gc.collect()
