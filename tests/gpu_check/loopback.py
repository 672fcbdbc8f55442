"""N virtual ranks in one process on one GPU: one pool row, descriptor, error word and stream per rank, the
real unicast kernels launched concurrently, one per rank, and their results compared bitwise with the
rank-order reference and across ranks.

This is real GPU memory ordering between concurrent grids on one device (L2 and the SMs' store paths),
not NVLink: the peers' rows are local memory. Grids are capped so that all N are resident together (a
rank's CTAs wait on its peers' CTAs: N grids of at most SMs / N blocks, each of which fits at least one
CTA per SM, the ``kernels`` step's occupancy check). ``CUDA_DEVICE_MAX_CONNECTIONS`` is raised before
the CUDA context exists, so that N streams get N hardware queues and no launch queues behind a spinning
peer.

The case list, the inputs and the references are plain torch on the CPU, shared with the rehearsal.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from ubnext import pool as P
from ubnext.reference._checks import reference_add_rmsnorm
from ubnext.testing import rank_order_sum

ROUNDS = 30  # at least ten trips through the three Lamport buffers, and as many barrier epochs
HIDDEN = 8192
DTYPE = torch.bfloat16
EPS = 1e-6
MAX_CONNECTIONS = "32"


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    algo: str  # the kernel family (ubnext.kernels.ALGOS)
    numel: int  # elements each rank contributes
    fused: bool = False


CASES = (
    Case("lamport_16k", "lamport", 8192),  # the 16 KB allreduce
    Case("lamport_fused_1x8192", "lamport", HIDDEN, fused=True),  # one token row, split over several CTAs
    Case("lamport_fused_4x8192", "lamport", 4 * HIDDEN, fused=True),
    Case("twoshot_256k", "twoshot", 128 * 1024),
    Case("allgather_64k", "allgather", 32 * 1024),
    Case("reduce_scatter_256k", "reduce_scatter", 128 * 1024),
)


def inputs(case: Case, n: int, round_: int) -> list[torch.Tensor]:
    """Each rank's input for one round: small integers scaled by a power of two differ per rank and round,
    so that a stale or missing value shows in the sum, and a sum in the wrong order shows in the bits."""
    out = []
    for rank in range(n):
        g = torch.Generator().manual_seed(round_ * 1_000_003 + rank * 7919 + len(case.name))
        out.append((torch.randn(case.numel, generator=g) * (1 + rank)).to(DTYPE))
    return out


def norm_operands(round_: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused case's residual and weight: the same on every rank, as tensor parallelism has them."""
    g = torch.Generator().manual_seed(round_ + 17)
    return torch.randn(HIDDEN, generator=g).to(DTYPE), (1 + 0.1 * torch.randn(HIDDEN, generator=g)).to(DTYPE)


def reference(case: Case, xs: list[torch.Tensor], round_: int) -> list[torch.Tensor | tuple]:
    """What each rank must hold after the call, from the rank-order fp32 sum (csrc's contract)."""
    n = len(xs)
    if case.algo == "allgather":
        gathered = torch.cat([x.view(torch.uint8) for x in xs])
        return [gathered] * n
    s = rank_order_sum(xs)
    if case.algo == "reduce_scatter":
        shard = case.numel // n
        return [s[r * shard : (r + 1) * shard].to(DTYPE) for r in range(n)]
    if case.fused:
        residual, weight = norm_operands(round_)
        rows = s.view(-1, HIDDEN)
        y, residual_out, _ = reference_add_rmsnorm(rows, residual.expand_as(rows), weight, EPS, DTYPE, None)
        return [(y.reshape(-1), residual_out.reshape(-1))] * n
    return [s.to(DTYPE)] * n


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()


def compare(got: list, want: list) -> str | None:
    """None when every rank holds the reference's bits (and so the same bits as every other rank), else
    the first rank and output that differ."""
    for rank, (g, w) in enumerate(zip(got, want)):
        g = g if isinstance(g, tuple) else (g,)
        w = w if isinstance(w, tuple) else (w,)
        for i, (a, b) in enumerate(zip(g, w)):
            if _bits(a) != _bits(b):
                return f"rank {rank} output {i} differs from the rank-order reference"

    def bits_of(held) -> list[bytes]:
        return [_bits(t) for t in (held if isinstance(held, tuple) else (held,))]

    if all(bits_of(w) == bits_of(want[0]) for w in want[1:]):  # every rank must hold the same (not a reduce-scatter)
        first = bits_of(got[0])
        for rank, g in enumerate(got[1:], 1):
            if bits_of(g) != first:
                return f"rank {rank}'s bits differ from rank 0's"
    return None


def raise_max_connections() -> None:
    """Before the process's CUDA context exists (torch makes it lazily): N streams, N hardware queues."""
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = MAX_CONNECTIONS


class VirtualRanks:
    """N pool rows in one GPU allocation, as N ranks' symmetric pools: each row starts with its rank's
    descriptor (peer bases: the N rows), a zeroed sync region and poisoned Lamport buffers, as
    ``SymmetricPool._initialise`` leaves them."""

    def __init__(self, n: int, timeout_s: float, staging_bytes: int = 1 << 20, device: str = "cuda:0"):
        self.device = torch.device(device)
        self.n = n
        slot = P.PAGE * (-(-(4 * 4 * HIDDEN + P.LAMPORT_HEADER_BYTES) // P.PAGE))
        self.layout = P.PoolLayout(n, slot, 4 * staging_bytes)
        self.row_bytes = -(-self.layout.pool_bytes // (2 << 20)) * (2 << 20)
        self.memory = torch.zeros(n * self.row_bytes, dtype=torch.uint8, device=self.device)
        self.bases = [self.memory.data_ptr() + r * self.row_bytes for r in range(n)]
        on_gpu = self.device.type == "cuda"
        self.err = [torch.zeros(P.ERR_WORDS, dtype=torch.int32, pin_memory=on_gpu) for _ in range(n)]
        self.timeout_s = timeout_s
        self.descs = []
        lay = self.layout
        for r in range(n):
            row = self.row(r)
            row[lay.lamport_off : lay.lamport_off + lay.lamport_bytes].view(torch.int32).fill_(P.SENTINEL_WORD)
            desc = P.pack_desc(
                rank=r,
                nranks=n,
                timeout_ns=int(timeout_s * 1e9),
                err_ptr=self._device_address(self.err[r]),
                mc_base=0,
                layout=lay,
                peer_bases=self.bases,
            )
            row[: len(desc)].copy_(torch.frombuffer(bytearray(desc), dtype=torch.uint8))
            self.descs.append(desc)
        self.streams = [torch.cuda.Stream(device=0) for _ in range(n)] if on_gpu else []
        self.synchronize()

    def _device_address(self, pinned: torch.Tensor) -> int:
        from ubnext.pool.symmetric import _device_pointer_of_pinned

        return _device_pointer_of_pinned(pinned)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def max_blocks(self) -> int:
        """A grid bound that keeps all N grids resident together (one CTA per SM fits: ``kernels``)."""
        return max(1, torch.cuda.get_device_properties(0).multi_processor_count // self.n)

    def row(self, rank: int) -> torch.Tensor:
        return self.memory[rank * self.row_bytes : (rank + 1) * self.row_bytes]

    def staging(self, rank: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """The staging region of a rank's row (the data arena's start: the same offset on every rank)."""
        off = self.layout.data_off
        return self.row(rank)[off : off + nbytes].view(dtype)

    def launch(
        self,
        name: str,
        grid: int,
        block: int,
        scalars: tuple,
        pointers: list[tuple],
        ranks: list[int] | None = None,
        kernel=None,
        cluster: int = 1,
    ) -> None:
        """One launch per rank (``ranks``: a subset, to leave a peer missing), each on its own stream,
        without PDL (nothing precedes them), in thread-block clusters of ``cluster`` (the Lamport row split),
        then wait for all of them. ``scalars``: (n, hidden, eps, flags), or a list of them, one per rank (a
        forced mismatch)."""
        from ubnext import kernels
        from ubnext.runtime import _cuda

        # load_kernel keeps the object; ``kernel``: a handle of another build (the stamped one), kept by the caller
        kernel = kernel if kernel is not None else _cuda.kernel_handle(kernels.load_kernel(name, 0))
        for r in range(self.n) if ranks is None else ranks:
            mine = scalars[r] if isinstance(scalars, list) else scalars
            packed = _cuda.pack_kernel_args(kernels.KERNEL_SIGNATURE[-len(mine) :], mine)
            params = _cuda.KernelParams(self.descs[r], packed)
            config = _cuda.launch_config(grid, block, self.streams[r].cuda_stream, False, 0, cluster)
            _cuda.launch(kernel, config, params, pointers[r])
        self.synchronize()

    def sync_region(self, rank: int) -> bytes:
        """A rank's sync region as it is now (after a launch has ended)."""
        off = self.layout.sync_off
        return self.row(rank)[off : off + P.SYNC_BYTES].cpu().numpy().tobytes()

    def error(self) -> str | None:
        """ubnext's error for the first rank whose error word is set, else None."""
        from ubnext.errors import kernel_error

        for r in range(self.n):
            words = self.err[r].tolist()
            if words[0]:
                return str(kernel_error(words, self.timeout_s, r))
        return None


class RecordingRanks(VirtualRanks):
    """The rehearsal's stand-in: the same rows and descriptors in CPU memory, and a launch that checks what
    a GPU launch would get (the kernel exists, the scalars pack, every pointer lies in a tensor of the
    round) and records it instead of running it. The harness's glue runs whole; only the kernels do not."""

    H100_SMS = 132

    def __init__(self, n: int, timeout_s: float):
        self.launches: list[tuple] = []
        super().__init__(n, timeout_s, device="cpu")

    def _device_address(self, pinned: torch.Tensor) -> int:
        return pinned.data_ptr()

    def synchronize(self) -> None:
        pass

    def max_blocks(self) -> int:
        return max(1, self.H100_SMS // self.n)

    def launch(self, name, grid, block, scalars, pointers, ranks=None, kernel=None, cluster=1):
        from ubnext import kernels
        from ubnext.runtime import _cuda

        if not any(name in names for names in kernels.sources().values()):
            raise AssertionError(f"no kernel named {name}")
        for mine in scalars if isinstance(scalars, list) else [scalars]:
            _cuda.pack_kernel_args(kernels.KERNEL_SIGNATURE[-len(mine) :], mine)
        if not (1 <= grid <= self.max_blocks() and block == (128 if cluster > 1 else 256)):
            raise AssertionError(f"{name}: grid {grid} x {block} breaks the residency cap {self.max_blocks()}")
        if grid % cluster or not 1 <= cluster <= 8:
            raise AssertionError(f"{name}: grid {grid} in clusters of {cluster}")
        for r in range(self.n) if ranks is None else ranks:
            if len(pointers[r]) != 7 or not all(isinstance(p, int) for p in pointers[r]):
                raise AssertionError(f"{name}: rank {r}'s pointers {pointers[r]}")
            self.launches.append((name, grid, block, scalars[r] if isinstance(scalars, list) else scalars, r))
