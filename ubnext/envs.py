"""The one reader of ``os.environ`` in ubnext.

Every variable is declared once here, with its type, default and meaning. ``get`` reads the
environment each time it is called, but a Communicator reads what shapes its calls (UBNEXT_ALGO,
UBNEXT_ALLOW_NONDETERMINISTIC, UBNEXT_DEBUG, UBNEXT_BATCH_INVARIANT) once, when it is constructed, and the pool's
variables when the pool is created: a change takes effect on the next Communicator. A bad value raises
:class:`EnvError` naming the variable and what it accepts. ``NVTE_UB_MAXBATCH`` and
``NVTE_UB_SYMM_POOL_SIZE`` (TransformerEngine's names) are accepted as aliases; the ubnext name
wins when both are set.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["EnvError", "Var", "VARIABLES", "get", "check_all", "first_problem", "describe_table", "environment_with"]


class EnvError(ValueError):
    """An environment variable holds a value ubnext cannot use."""


@dataclass(frozen=True)
class Var:
    name: str
    parse: Callable[[str], Any]
    default: Any
    accepted: str
    doc: str
    aliases: tuple[str, ...] = field(default_factory=tuple)


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _bool(text: str) -> bool:
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(text)


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(text)
    return value


def _nonnegative_float(text: str) -> float:
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise ValueError(text)
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise ValueError(text)
    return value


def _nonnegative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


def _block_size(text: str) -> int:
    """Threads per block that the row math accepts: a power of two from 32 to 1024 (csrc/device/norm.cuh)."""
    value = int(text)
    if value < 32 or value > 1024 or value & (value - 1):
        raise ValueError(text)
    return value


def _choice(*options: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        low = text.strip().lower()
        if low not in options:
            raise ValueError(text)
        return low

    return parse


ALGORITHMS = (
    "auto",
    "lamport",
    "nvls",
    "nvls_oneshot",
    "nvls_twoshot",
    "nvls_lamport",
    "twoshot",
    "torch_symm",
    "torch",
)
POOL_BACKENDS = ("auto", "torch_symm", "vmm", "emulator")

VARIABLES: dict[str, Var] = {
    v.name: v
    for v in (
        Var(
            "UBNEXT_ALGO",
            _choice(*ALGORITHMS),
            "auto",
            "|".join(ALGORITHMS),
            "Force an allreduce path; a forced path that cannot run falls back down the chain and logs why.",
        ),
        Var(
            "UBNEXT_MAX_BATCH",
            _positive_int,
            64,
            "integer > 0",
            "Tokens per call the pool is sized for (x the largest registered hidden size).",
            aliases=("NVTE_UB_MAXBATCH",),
        ),
        Var(
            "UBNEXT_SYMM_POOL_SIZE",
            _positive_int,
            None,
            "integer MB > 0",
            "Symmetric pool size in MB; overrides the UBNEXT_MAX_BATCH sizing.",
            aliases=("NVTE_UB_SYMM_POOL_SIZE",),
        ),
        Var(
            "UBNEXT_POOL_BACKEND",
            _choice(*POOL_BACKENDS),
            "auto",
            "|".join(POOL_BACKENDS),
            "Symmetric memory backend. auto: torch_symm on GPUs, then vmm; emulator on CPU.",
        ),
        Var(
            "UBNEXT_TIMEOUT",
            _positive_float,
            None,
            "seconds > 0",
            "Bound on every wait across ranks inside a kernel (unset: the process group's timeout). "
            "Past it the op fails naming op, rank and peer, and the communicator is aborted on "
            "every rank.",
        ),
        Var(
            "UBNEXT_WARN_AFTER",
            _nonnegative_float,
            10.0,
            "seconds >= 0",
            "The watchdog: a rank whose ubnext kernel has waited this long logs once what it waits in "
            "(op, path, size, the call's number) and each peer's last call, from the store; 0 turns it off. "
            "Ctrl-C during such a wait aborts the communicator on every rank (emulator).",
        ),
        Var(
            "UBNEXT_SELFTEST",
            _bool,
            True,
            "0|1",
            "Run every kernel path once on known data when the pool is created, and disable, on "
            "every rank, a path that gives a wrong sum (a few ms once; 0 skips it).",
        ),
        Var(
            "UBNEXT_EMULATE",
            _bool,
            False,
            "0|1",
            "Run ubnext kernels on the CPU emulator (CPU tensors) instead of torch.distributed.",
        ),
        Var(
            "UBNEXT_EMU_CHAOS",
            _bool,
            False,
            "0|1",
            "Emulator chaos mode: random delays at cross-rank accesses and reordering of "
            "stores that no fence or release orders.",
        ),
        Var(
            "UBNEXT_EMU_MULTICAST",
            _bool,
            True,
            "0|1",
            "Give emulator pools a multicast address (1) or none (0: the unicast paths, as on "
            "PCIe P2P or several ranks per GPU).",
        ),
        Var(
            "UBNEXT_EMU_SEED",
            _nonnegative_int,
            0,
            "integer >= 0",
            "Seed of the emulator's chaos mode (0: derived from time and rank).",
        ),
        Var(
            "UBNEXT_EMU_COUNT",
            _bool,
            False,
            "0|1",
            "Emulator count mode: measure every launch's critical path (CTAs, NVLink hops, fences, "
            "bytes per CTA) at a GPU's launch geometry, for `python -m ubnext.bench --model`. "
            "Pools then map seven times their size (a stamp shadow of 6 bytes per byte, sparse: "
            "only what the kernels touch costs memory).",
        ),
        Var(
            "UBNEXT_EMU_SM_COUNT",
            _positive_int,
            132,
            "integer > 0",
            "SMs of the GPU that count mode's launch geometry stands for (132: H100 SXM).",
        ),
        Var(
            "UBNEXT_EMU_BLOCK",
            _block_size,
            64,
            "32|64|128|...|1024",
            "Threads per block of the emulator's launches outside count mode (a power of two: the row "
            "math's sum-of-squares order needs blockDim to divide 1024). Outputs must not depend on it.",
        ),
        Var(
            "UBNEXT_EMU_GRID",
            _positive_int,
            4,
            "integer > 0",
            "Most blocks per launch of the emulator outside count mode. Outputs must not depend on it.",
        ),
        Var(
            "UBNEXT_EMU_BREAK",
            _choice(
                "",
                "skip_repoison",
                "no_release",
                "skip_barrier",
                "no_header_check",
                "single_header_slot",
                "no_abort_check",
                "no_proxy_fence_nvls_twoshot",
                "twoshot_drop_peer",
                "allgather_short_push",
                "no_lamport_header_check",
                "no_eps_check",
                "no_departure_check",
                "extra_fence",
                "twoshot_reverse_order",
                "nvfp4_nibble_order",
                "swizzle",
                "no_pdl_wait",
                "ssq_block_order",
                "two_roundings",
                "cluster_ssq_order",
                "rank_order_ignored",
                "poll_reads_once",
                "err_no_claim",
                "stamps",
            ),
            "",
            "''|skip_repoison|no_release|skip_barrier|no_header_check|single_header_slot|no_abort_check|"
            "no_proxy_fence_nvls_twoshot|twoshot_drop_peer|allgather_short_push|no_lamport_header_check|no_eps_check|"
            "no_departure_check|extra_fence|"
            "twoshot_reverse_order|nvfp4_nibble_order|swizzle|no_pdl_wait|ssq_block_order|two_roundings|cluster_ssq_order|"
            "rank_order_ignored|poll_reads_once|err_no_claim|stamps",
            "TEST ONLY: build the emulator with a deliberately broken protocol, to show that the "
            "tests catch it; or, 'stamps', with the Lamport one-shot's per-phase time stamps "
            "(csrc/device/stamps.cuh).",
        ),
        Var(
            "UBNEXT_CACHE_DIR",
            str,
            os.path.join(os.path.expanduser("~"), ".cache", "ubnext"),
            "directory path",
            "Where compiled cubins and the emulator library are cached.",
        ),
        Var(
            "UBNEXT_CUBIN_DIR",
            str,
            None,
            "directory path",
            "A folder of cubins exported by `python -m ubnext.kernels export`: used before the cache and "
            "before compiling, whenever its source hash matches and the driver accepts that NVRTC major "
            "(for a machine that cannot compile the kernels itself).",
        ),
        Var(
            "UBNEXT_PDL",
            _bool,
            True,
            "0|1",
            "Programmatic dependent launch: on sm_90 and later, launch every kernel with the "
            "programmatic-stream-serialization attribute, so that its launch and prologue overlap the "
            "end of the kernel before it on the stream (each kernel waits with griddepcontrol.wait before "
            "it touches memory). 0 launches in plain stream order (the C API's equivalent is the launch "
            "flag UBNEXT_LAUNCH_NO_PDL).",
        ),
        Var(
            "UBNEXT_DEBUG",
            _bool,
            False,
            "0|1",
            "Check shapes across ranks (and the fused op's eps, static FP8 or NVFP4 global scale, and "
            "checksums of its residual and weight) and synchronise after every call to surface kernel "
            "errors at the call that caused them.",
        ),
        Var(
            "UBNEXT_ALLOW_NONDETERMINISTIC",
            _bool,
            False,
            "0|1",
            "Let the automatic choice pick nvls_oneshot, whose results may differ in the last bit between ranks.",
        ),
        Var(
            "UBNEXT_BATCH_INVARIANT",
            _bool,
            False,
            "0|1",
            "Batch-invariant mode for the communicators ubnext makes itself (get_communicator, "
            "ubnext.nn, ubnext.fsdp) and any made without batch_invariant=: every allreduce and "
            "reduce-scatter sums the ranks in rank order in fp32 on every path and size, never "
            "through multimem.ld_reduce, so a token's outputs do not depend on the batch around it.",
        ),
        Var(
            "UBNEXT_WORLD1_KERNELS",
            _bool,
            False,
            "0|1",
            "TEST ONLY (the one-GPU check, tests/gpu_check): a one-rank communicator runs its ops through "
            "the kernel paths instead of copying, so that one GPU can run every unicast kernel.",
        ),
        Var(
            "UBNEXT_LOG_LEVEL",
            _choice("debug", "info", "warning", "error"),
            "warning",
            "debug|info|warning|error",
            "Level of the 'ubnext' logger. A path not taken (`rank 1: not using lamport: ...`) is logged once per "
            "process, with the rank, whatever the number of communicators. The build lines (logger ubnext.build: "
            "the emulator, NVRTC) show at the default level; error silences them.",
        ),
        Var(
            "UBNEXT_VLLM",
            _bool,
            False,
            "0|1",
            "Turn on ubnext's vLLM plugin (the `vllm.general_plugins` entry point, docs/VLLM.md): vLLM's "
            "tensor-parallel all-reduce, and its all-reduce + RMSNorm in compiled graphs, run on ubnext. Unset, "
            "the plugin changes nothing in vLLM: loading its entry point imports the ubnext package (which "
            "defines torch.ops.ubnext), and register() reads this variable and returns.",
        ),
    )
}


def _raw(var: Var) -> tuple[str, str] | None:
    for name in (var.name, *var.aliases):
        text = os.environ.get(name)
        if text is not None:
            return name, text
    return None


def get(name: str) -> Any:
    """The typed value of ``name`` (its default when unset)."""
    try:
        var = VARIABLES[name]
    except KeyError:
        raise KeyError(f"ubnext has no environment variable {name!r}") from None
    found = _raw(var)
    if found is None:
        return var.default
    source, text = found
    try:
        return var.parse(text)
    except (ValueError, TypeError):
        alias = f" (alias of {var.name})" if source != var.name else ""
        raise EnvError(f"{source}{alias}={text!r} is not valid; accepted: {var.accepted}") from None


def check_all() -> None:
    """Read every variable once: the first bad value raises EnvError, whatever the mode (a
    variable the current mode does not use is refused too, rather than ignored until it is)."""
    for name in VARIABLES:
        get(name)


def first_problem() -> EnvError | None:
    """``check_all``'s verdict as a value: the first bad variable's EnvError, or None (for a caller that
    must tell its peers before it raises)."""
    try:
        check_all()
    except EnvError as exc:
        return exc
    return None


def describe_table() -> str:
    """The README's Markdown table of every variable."""
    rows = ["| variable | default | accepted | meaning |", "|---|---|---|---|"]
    for var in VARIABLES.values():
        names = " / ".join(f"`{n}`" for n in (var.name, *var.aliases))
        default = "unset" if var.default is None else f"`{var.default!r}`"
        if var.name == "UBNEXT_CACHE_DIR":
            default = "`~/.cache/ubnext`"
        rows.append(f"| {names} | {default} | {var.accepted} | {var.doc} |")
    return "\n".join(rows)


def cuda_visible_devices() -> str | None:
    """``CUDA_VISIBLE_DEVICES`` as the launcher set it (None when unset), for reports."""
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def launcher_info() -> dict[str, Any] | None:
    """Rank layout set by the launcher (torchrun or an MPI launcher), or None.

    Returns ``{"launcher", "rank", "world_size", "local_rank", "master_addr", "master_port"}``;
    master fields are None under MPI (ubnext then agrees on them over MPI).
    """
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return {
            "launcher": "torchrun",
            "rank": int(env["RANK"]),
            "world_size": int(env["WORLD_SIZE"]),
            "local_rank": int(env.get("LOCAL_RANK", "0")),
            "master_addr": env.get("MASTER_ADDR"),
            "master_port": env.get("MASTER_PORT"),
        }
    for rank_var, size_var, local_var in (
        ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),  # mpich (hydra)
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
        ("PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK"),
    ):
        if rank_var in env and size_var in env:
            return {
                "launcher": "mpi",
                "rank": int(env[rank_var]),
                "world_size": int(env[size_var]),
                "local_rank": int(env.get(local_var, env[rank_var])),
                "master_addr": None,
                "master_port": None,
            }
    return None


def environment_with(**overrides: str) -> dict[str, str]:
    """This process's environment with ``overrides``: for processes ubnext starts itself
    (``python -m ubnext.bench --model``'s emulated ranks)."""
    env = dict(os.environ)
    env.update(overrides)
    return env
