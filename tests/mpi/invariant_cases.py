"""Issue 26's batch-invariant mode (``Communicator(batch_invariant=True)``), as worker cases
(tests/mpi/worker.py registers them; each makes its own communicators with a small pool, so that
token counts cross the Lamport slot, the staging region and the fallback past the pool).

The contract checked, bitwise:
- all_reduce and reduce_scatter: every element is the sum of the ranks' values in rank order
  0..N-1 from +0, each addition in fp32, rounded once to the dtype (a factor applied once in fp32
  after the sum), on every forced path and the automatic choice, at every size;
- the fused op: a token's outputs are those of the same token alone, at any position, among any
  number of tokens, on any path, compiled (dynamic token dimension) or eager, and a CUDA graph's
  replay (GPU tier); the same on every rank (each rank checks against a reference every rank
  computes alike, or against its own call of the token alone, whose bits the kernels already
  compare across ranks in the other cases).

The inputs spread over 2^±20 (2^±8 for fp16) with both signs and a column of -0 on every rank, so
that the fp32 sum's roundings depend on the order of the additions: at 3 ranks and more a sum in
another order differs (the test-only build twoshot_reverse_order shows it), and a sum of all -0
must come out +0 on every path, as Lamport's sanitised push gives it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import ubnext
from ubnext.plan import lamport_bytes_needed
from ubnext.reference._checks import FP8

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
HIDDEN = 256  # the fused cases' rows: 512 bytes in bf16
# paths the mode can force (the rest, nvls_oneshot's multimem.ld_reduce and torch's symmetric op, are
# refused); the NVLS two-shot paths sum in rank order by unicast loads, plain (under the kernel flag
# UBNEXT_F_RANK_ORDER) and fused, and need a multicast pool
FORCED = ("auto", "lamport", "twoshot", "torch")
NVLS_FORCED = ("nvls_twoshot", "nvls_lamport")
FORCED_ANY = FORCED + NVLS_FORCED
REFUSED = ("nvls_oneshot", "torch_symm")  # at construction and on a live communicator


def spread_input(rank: int, numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1009 + rank)
    span = 8 if dtype == torch.float16 else 20
    scale = torch.exp2(torch.randint(-span, span + 1, (numel,), generator=gen).double())
    x = (torch.randn(numel, generator=gen, dtype=torch.float64) * scale).to(dtype)
    x[::97] = -0.0
    return x


def rank_order(inputs: list[torch.Tensor], dtype: torch.dtype, factor: float = 1.0) -> torch.Tensor:
    """The mode's reference: from +0, each rank's value added in rank order in fp32, the factor
    once in fp32, one rounding to ``dtype``."""
    acc = torch.zeros(inputs[0].numel(), dtype=torch.float32)
    for x in inputs:
        acc = acc + x.float()
    if factor != 1.0:
        acc = acc * factor
    return acc.to(dtype)


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    g = got.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    w = want.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    if not torch.equal(g, w):
        elem = got.element_size()
        bad = (g != w).view(-1, elem).any(1).nonzero().flatten()
        i = int(bad[0])
        raise AssertionError(
            f"{what}: {bad.numel()} elements differ in their bits, first at {i}: "
            f"{got.reshape(-1)[i].item()!r} against {want.reshape(-1)[i].item()!r}"
        )


def _small_pool_comm(mode: str) -> ubnext.Communicator:
    # a pool whose layout is sized for hidden 128, so that every threshold is a small message
    return ubnext.Communicator(emulate=mode == "emulator", max_hidden=128, batch_invariant=True)


def _thresholds(comm) -> tuple[int, int]:
    if comm.pool is None:
        return 0, 0
    return comm.pool.lamport_capacity, comm.pool_stats()["staging_bytes"]


def _expect_path(comm, path: str, nbytes: int, dtype: torch.dtype, fused: bool, hidden: int = 0) -> None:
    if path != "auto" and comm._capabilities(nbytes, dtype, fused, hidden)[path] is None:
        assert comm.last_path.split("+")[0] == path, (path, comm.last_path)
    assert comm.last_path.split("+")[0] in FORCED_ANY, comm.last_path


def check_refusals(mode: str, comm) -> None:
    """A path that reduces through the switch (or torch's symmetric op, whose order is not
    promised) is refused in the mode, at construction and when forced on a live communicator,
    with an error that says why; the mode comes from UBNEXT_BATCH_INVARIANT when not given."""
    for algo in REFUSED:
        try:
            ubnext.Communicator(emulate=mode == "emulator", algo=algo, batch_invariant=True)
        except ValueError as e:
            assert "batch-invariant" in str(e) and algo in str(e), e
        else:
            raise AssertionError(f"algo={algo} was accepted in the batch-invariant mode")
        comm._algo = algo
        try:
            comm.all_reduce(torch.ones(8, device=comm.device))
        except ValueError as e:
            assert "batch-invariant" in str(e), e
        else:
            raise AssertionError(f"a forced {algo} reduced in the batch-invariant mode")
        finally:
            comm._algo = None
    if _multicast(comm):
        # at the staging size, with a last-bit difference across ranks allowed, the model's order may put
        # nvls_oneshot first (ubnext/plan/_thresholds.py): the mode never takes it, and where it precedes the
        # path taken, the explanation says why it was skipped
        from ubnext import plan

        comm._allow_nondeterministic, allowed = True, comm._allow_nondeterministic
        nbytes = comm.pool_stats()["staging_bytes"]
        try:
            text = comm.explain(torch.empty(nbytes // 4, device=comm.device))
        finally:
            comm._allow_nondeterministic = allowed
        want = _first_runnable(comm, nbytes, allow_nondeterministic=True)
        assert want != "nvls_oneshot" and text.startswith(want + ":"), (want, text)
        order = plan.auto_order(nbytes, False, True, True, dist.get_world_size(), 4)
        if "nvls_oneshot" in order and order.index("nvls_oneshot") < order.index(want):
            assert "not nvls_oneshot: multimem.ld_reduce sums in the switch's order" in text, text


def _multicast(comm) -> bool:
    return comm.pool is not None and comm.pool.has_multicast


def check_all_reduce(comm) -> None:
    n, rank = dist.get_world_size(), dist.get_rank()
    cap, staging = _thresholds(comm)
    for dtype in DTYPES:
        e = dtype.itemsize
        # below and at the Lamport slot, just past it (two-shot), past the staging region (fallback)
        sizes = sorted({1, 7, 1000, max(cap // e - 8, 1), cap // e + 8, staging // e + 8 * n + 3} - {0})
        for path in FORCED + (NVLS_FORCED if _multicast(comm) else ()):
            comm._algo = None if path == "auto" else path
            for numel in sizes:
                inputs = [spread_input(r, numel, dtype, numel) for r in range(n)]
                out = comm.all_reduce(inputs[rank].to(comm.device))
                assert_same_bits(
                    out, rank_order(inputs, dtype), f"all_reduce {path}->{comm.last_path} {dtype} n={numel}"
                )
                _expect_path(comm, path, numel * e, dtype, fused=False)
    comm._algo = None
    if _multicast(comm):
        # nvls_lamport's push form reads only this rank's x (csrc/kernels/nvls.cu): reduced in place, and
        # from a misaligned view (staged locally), with no staging copy for its peers
        comm._algo = "nvls_lamport"
        inputs = [spread_input(r, 1000, torch.bfloat16, 5) for r in range(n)]
        x = torch.zeros(1001, dtype=torch.bfloat16, device=comm.device)[1:]
        x.copy_(inputs[rank])
        assert comm.all_reduce(x, out=x) is x and comm.last_path == "nvls_lamport", comm.last_path
        assert_same_bits(x, rank_order(inputs, torch.bfloat16), "all_reduce nvls_lamport in place, misaligned")
        # the push form and the Lamport one-shot share the three buffers' rotation: alternate them with
        # changing sizes (each call re-poisons what the one before wrote, whatever its form and size)
        for k in range(60):
            comm._algo = ("nvls_lamport", "lamport")[k % 2]
            numel = (97, 1500, 8, 2048, 333)[k % 5] * (1 + k % 3)  # within the small pool's Lamport slot
            inputs = [spread_input(r, numel, torch.float32, 100 + k) for r in range(n)]
            out = comm.all_reduce(inputs[rank].to(comm.device))
            assert comm.last_path == comm._algo, (k, comm.last_path)
            assert_same_bits(out, rank_order(inputs, torch.float32), f"rotation soak call {k} {comm._algo} n={numel}")
        comm._algo = None
    if comm.pool is not None:
        # a pool tensor reduced in place past the staging region: a two-shot kernel where it lies, or
        # (chosen where it fits, and forced away from) nvls_lamport's push form, which stages nothing
        numel = staging // 4 + 8 * n + 3
        twoshot = "nvls_twoshot" if _multicast(comm) else "twoshot"
        push_fits = _multicast(comm) and lamport_bytes_needed("nvls_lamport", numel * 4, False, n, True) <= cap
        for forced in (None, twoshot) if push_fits else (None,):
            comm._algo = forced
            inputs = [spread_input(r, numel, torch.float32, 3) for r in range(n)]
            x = comm.empty(numel, dtype=torch.float32)
            x.copy_(inputs[rank])
            assert comm.all_reduce(x, out=x) is x
            assert_same_bits(
                x, rank_order(inputs, torch.float32), f"all_reduce in place in the pool ({comm.last_path})"
            )
            # not forced: the model's first path that the mode can run on this pool tensor (the push form where
            # it fits and leads; else a two-shot where x lies: at 2 ranks the unicast one leads, issue 38's model)
            want = forced or _first_runnable(comm, numel * 4, in_place_pool=True)
            assert comm.last_path == want, (comm.last_path, want)
            del x
        comm._algo = None


def _first_runnable(comm, nbytes: int, in_place_pool: bool = False, allow_nondeterministic: bool = False) -> str:
    """The batch-invariant mode's choice for a flat fp32 allreduce of ``nbytes``, worked out from the model's
    order (ubnext/plan/_thresholds.py) and what each path can run: its first path the mode and pool allow."""
    from ubnext import plan

    order = plan.auto_order(nbytes, False, _multicast(comm), allow_nondeterministic, dist.get_world_size(), 4)
    caps = plan.capabilities(nbytes, 4, False, 0, comm._pool_view(), in_place_pool, batch_invariant=True)
    return next(p for p in order if caps.get(p) is None)


def check_reduce_scatter(comm) -> None:
    n, rank = dist.get_world_size(), dist.get_rank()
    _, staging = _thresholds(comm)
    for dtype in DTYPES:
        for op, factor in (("sum", 1.0), ("avg", 1.0 / n), (dist._make_nccl_premul_sum(0.37), 0.37)):
            # a shard off the 16-byte grid, and an input past the staging region (the fallback)
            for shard in (5, 1000, staging // (n * dtype.itemsize) + 9):
                inputs = [spread_input(r, n * shard, dtype, shard + 7) for r in range(n)]
                out = comm.reduce_scatter(inputs[rank].to(comm.device), op=op)
                want = rank_order([x[rank * shard : (rank + 1) * shard] for x in inputs], dtype, factor)
                assert_same_bits(out, want, f"reduce_scatter {comm.last_path} {dtype} {op} shard={shard}")


def _fused_rows(comm, x, residual, weight, form: str | None):
    """The fused op's outputs as per-row tensors: (out, residual_out[, scale_inv per row]); ``form``:
    None (the dtype), "fp8" (per token) or a block-scaled format (issue 28; row-major scales)."""
    if form == "fp8":
        out, res, scale_inv = comm.all_reduce_add_rmsnorm(x, residual, weight, 1e-6, out_dtype=FP8)
        return out, res, scale_inv
    if form:
        return comm.all_reduce_add_rmsnorm(x, residual, weight, 1e-6, quant=form)
    out, res, _ = comm.all_reduce_add_rmsnorm(x, residual, weight, 1e-6)
    return out, res


class FusedRows:
    """A master set of token rows (every rank's x, the residual, the weight) and, for a few probe
    rows, the fused op's outputs with that token alone: what every other call must reproduce for
    it, at whatever position, among however many tokens, on whatever path."""

    PROBES = 3

    def __init__(self, comm, rows: int, dtype: torch.dtype, seed: int):
        rank = dist.get_rank()
        self.comm, self.rows, self.dtype = comm, rows, dtype
        # activations of ordinary size (the norm's rsqrt of 2^40-sized rows would hide nothing),
        # still spread enough that the order of the ranks' additions matters
        x = spread_input(rank, rows * HIDDEN, torch.float32, seed)
        self.x = (x * 2.0**-12).clamp(-30, 30).to(dtype).view(rows, HIDDEN)
        gen = torch.Generator().manual_seed(seed)
        self.residual = torch.randn(rows, HIDDEN, generator=gen).to(dtype)
        self.weight = (1 + 0.1 * torch.randn(HIDDEN, generator=gen)).to(dtype)
        self.probes = [0, rows // 2, rows - 1][: self.PROBES]
        self.alone: dict[tuple[int, str | None], tuple] = {}

    def call(self, idx: torch.Tensor, form: str | None):
        d = self.comm.device
        return _fused_rows(self.comm, self.x[idx].to(d), self.residual[idx].to(d), self.weight.to(d), form)

    def check(self, count: int, seed: int, form: str | None, what: str) -> None:
        """One call of ``count`` tokens holding every probe at a position fixed by ``seed``."""
        forced, self.comm._algo = self.comm._algo, None  # alone: the automatic choice (Lamport)
        try:
            for k in self.probes:
                if (k, form) not in self.alone:
                    self.alone[(k, form)] = tuple(t.cpu() for t in self.call(torch.tensor([k]), form))
        finally:
            self.comm._algo = forced
        gen = torch.Generator().manual_seed(seed)
        others = torch.tensor([i for i in range(self.rows) if i not in self.probes])
        idx = others[torch.randperm(others.numel(), generator=gen)][:count].clone()
        where = torch.randperm(count, generator=gen)[: min(count, len(self.probes))]
        for p, k in zip(where.tolist(), self.probes):
            idx[p] = k
        got = self.call(idx, form)
        path = self.comm.last_path
        bits = b"".join(t.cpu().contiguous().view(torch.uint8).numpy().tobytes() for t in got)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, bits)
        assert all(b == everyone[0] for b in everyone), f"fused {path} {count} tokens: the ranks' outputs differ"
        for p, k in zip(where.tolist(), self.probes):
            for i, (g, a) in enumerate(zip(got, self.alone[(k, form)])):
                assert_same_bits(
                    g[p],
                    a[0],
                    f"{what} ({path}) {self.dtype} form={form} {count} tokens: token {k} "
                    f"at position {p}, output {i}, against the token alone",
                )


def _fused_counts(comm, dtype: torch.dtype) -> dict[str, int]:
    cap, staging = _thresholds(comm)
    row = HIDDEN * dtype.itemsize
    return {"lamport": cap // row, "twoshot": cap // row + 1, "torch": max(cap, staging) // row + 3}


def check_fused(comm, paths: tuple[str, ...]) -> None:
    """Row invariance of the fused op across counts, positions and the given forced paths, each
    token against itself alone; FP8 per token and the block-scaled formats too."""
    for dtype in DTYPES:
        counts = _fused_counts(comm, dtype)
        rows = FusedRows(comm, counts["torch"] + 8, dtype, seed=dtype.itemsize)
        for path in paths:
            comm._algo = None if path == "auto" else path
            # a count fits a forced path only up to its own threshold (past it the plan falls back)
            top = {
                "lamport": counts["lamport"],
                "twoshot": counts["twoshot"],
                "nvls_twoshot": counts["twoshot"],
                "nvls_lamport": counts["lamport"],
            }.get(path, counts["torch"])
            for count in sorted({1, 2, 5, counts["lamport"], counts["twoshot"], counts["torch"]}):
                if count <= top:
                    rows.check(count, seed=count, form=None, what=f"fused {path}")
                    if path != "auto":
                        _expect_path(comm, path, count * HIDDEN * dtype.itemsize, dtype, True, HIDDEN)
            rows.check(min(top, 5), seed=11, form="fp8", what=f"fused {path}")
            rows.check(top, seed=12, form="fp8", what=f"fused {path}")
            # the block-scaled forms (issue 28): a token's q and scales are its own too
            for seed, form in enumerate(("nvfp4", "mxfp8", "fp8_group128")):
                rows.check(top if seed % 2 == 0 else min(top, 5), seed=13 + seed, form=form, what=f"fused {path}")
    comm._algo = None


def check_compiled(comm) -> None:
    """The fused op and the allreduce under torch.compile (fullgraph) with a dynamic token
    dimension: one compile for every count, the bits of eager at each (counts on Lamport and past
    the pool, where the mode's ordered fallback runs inside the compiled graph). The default
    (inductor) backend, at 2 ranks only: a compile costs 10 to 20 s on two cores, and what it
    compiles does not depend on the world size."""
    if dist.get_world_size() != 2:
        return
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    def step(x, residual, weight):
        out, res, _ = comm.all_reduce_add_rmsnorm(x, residual, weight, 1e-6)
        return out, res, comm.all_reduce(x)

    dtype = torch.bfloat16
    counts = _fused_counts(comm, dtype)
    rows = FusedRows(comm, counts["torch"] + 8, dtype, seed=5)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(step, fullgraph=True, backend=counter, dynamic=None)
    d = comm.device
    for count in (3, counts["lamport"], counts["torch"]):
        x, r = rows.x[:count].to(d), rows.residual[:count].to(d)
        torch._dynamo.mark_dynamic(x, 0)
        torch._dynamo.mark_dynamic(r, 0)
        got, want = compiled(x, r, rows.weight.to(d)), step(x, r, rows.weight.to(d))
        for i, (g, e) in enumerate(zip(got, want)):
            assert_same_bits(g, e, f"compiled against eager ({comm.last_path}), {count} tokens, output {i}")
    assert counter.frame_count == 1, f"{counter.frame_count} compiles for 3 token counts"


def case_batch_invariant(mode: str) -> None:
    """The mode's plain collectives against the rank-order reference on every forced path at sizes
    crossing every threshold, the refusals, the fused op's row invariance on Lamport and on the
    ordered fallback past the pool, and compiled against eager."""
    comm = _small_pool_comm(mode)
    try:
        assert comm.batch_invariant
        check_refusals(mode, comm)
        check_all_reduce(comm)
        check_reduce_scatter(comm)
        if comm.pool is None:
            # torch mode (no GPU, no emulator): the ordered fallback serves every size, and the
            # fused op's norm is torch's own (README: what the mode does not cover)
            return
        check_fused(comm, ("lamport", "torch"))
        check_compiled(comm)
    finally:
        comm.close()


def case_batch_invariant_fused(mode: str) -> None:
    """The fused op's row invariance where the unicast two-shot serves it (forced, and the
    automatic choice across every threshold): needs one rounding of sum + residual on the
    two-shot paths (issue 26's arithmetic, the rows branch)."""
    comm = _small_pool_comm(mode)
    try:
        check_fused(comm, ("twoshot", "auto") + (NVLS_FORCED if _multicast(comm) else ()))
    finally:
        comm.close()


def case_batch_invariant_graph(mode: str) -> None:
    """GPU only: a CUDA graph captured at one token count replays the bits of eager calls, and a
    token's rows there are those of the token alone."""
    if mode != "gpu":
        return
    comm = _small_pool_comm(mode)
    try:
        dtype = torch.bfloat16
        counts = _fused_counts(comm, dtype)
        rows = FusedRows(comm, counts["twoshot"] + 8, dtype, seed=21)
        d = comm.device
        for count in (1, counts["lamport"], counts["twoshot"]):
            x = rows.x[:count].to(d)
            r = rows.residual[:count].to(d)
            w = rows.weight.to(d)
            want = tuple(t.clone() for t in _fused_rows(comm, x, r, w, False))
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                got = _fused_rows(comm, x, r, w, False)
            graph.replay()
            torch.cuda.synchronize()
            for i, (g, e) in enumerate(zip(got, want)):
                assert_same_bits(g, e, f"graph replay ({comm.last_path}), {count} tokens, output {i}")
            alone = _fused_rows(comm, x[:1], r[:1], w, False)
            for i, (g, a) in enumerate(zip(got, alone)):
                assert_same_bits(
                    g[0], a[0], f"graph replay ({comm.last_path}), {count} tokens, token 0 alone, output {i}"
                )
    finally:
        comm.close()
