"""Programmatic dependent launch on a GPU (sm_90 and later), one GPU, no ranks: what the emulator,
which serialises launches, cannot show (docs/TESTING.md). A chain of one-rank Lamport allreduces, each
reading the previous one's output (with one rank, the identity), launched back to back:
- with the attribute, the chain's results are exact, and the chain takes less time per launch than in
  plain stream order (the overlap PDL is for: each kernel triggers its dependents once `in` is read);
- built without griddepcontrol.wait (the test-only UBNEXT_BREAK_NO_PDL_WAIT, compiled here by NVRTC), a
  kernel that starts early reads its input (and the rotation counter) before the previous kernel wrote
  it: the chain goes wrong, or a kernel reports a timeout.
Written without a GPU at hand: its first run is scripts/gpu_check.sh on a GPU node."""

import time

import pytest
import torch

from ubnext import _cuda, kernels, pool

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _cuda.gpu_available(), reason=f"GPU tier: {_cuda.no_gpu_reason()}")]

N = 1 << 16  # fp32 elements per call: 256 KB, about 64 blocks of 256 threads
CHAIN = 200


@pytest.fixture(scope="module")
def one_rank_pool():
    """A one-rank pool in plain device memory: the descriptor at its base, a zeroed sync region,
    poisoned Lamport buffers, a pinned error word."""
    if torch.cuda.get_device_capability(0)[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90 or later")
    from ubnext.pool.symmetric import _device_pointer_of_pinned

    layout = pool.PoolLayout(1, pool.PAGE * ((N * 4 + pool.LAMPORT_HEADER_BYTES) // pool.PAGE + 1), 1 << 20)
    memory = torch.zeros(layout.pool_bytes, dtype=torch.uint8, device="cuda:0")
    memory[layout.lamport_off:layout.lamport_off + layout.lamport_bytes].view(torch.int32).fill_(pool.SENTINEL_WORD)
    err = torch.zeros(pool.ERR_WORDS, dtype=torch.int32, pin_memory=True)
    desc = pool.pack_desc(rank=0, nranks=1, timeout_ns=2_000_000_000, err_ptr=_device_pointer_of_pinned(err),
                          mc_base=0, layout=layout, peer_bases=[memory.data_ptr()])
    memory[:len(desc)].copy_(torch.frombuffer(bytearray(desc), dtype=torch.uint8))
    torch.cuda.synchronize()
    return memory, err, desc


def _kernel(broken: bool):
    name = "ubnext_lamport_fp32"
    if not broken:
        return _cuda.kernel_handle(kernels.load_kernel(name, 0))
    image, _ = kernels._nvrtc_compile("lamport.cu", _cuda.device_arch(0), "cubin", ("UBNEXT_BREAK_NO_PDL_WAIT",))
    with _cuda.primary_context(0):
        return _cuda.kernel_handle(_cuda.core().ObjectCode.from_cubin(image).get_kernel(name))


def _chain(kernel, desc: bytes, pdl: bool) -> tuple[torch.Tensor, float]:
    """CHAIN launches, launch k reducing buffer k into buffer k + 1 (NaN until written); returns the
    buffers and the seconds the chain took."""
    buffers = torch.full((CHAIN + 1, N), float("nan"), device="cuda:0")
    buffers[0] = torch.arange(N, device="cuda:0", dtype=torch.float32)
    stream = torch.cuda.current_stream(0).cuda_stream
    params = _cuda.KernelParams(desc, _cuda.pack_kernel_args(kernels.KERNEL_SIGNATURE[8:], (N, 0, 0.0, 0)))
    config = _cuda.launch_config(N // 4 // 256, 256, stream, pdl)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for k in range(CHAIN):
        pointers = (buffers[k].data_ptr(), buffers[k + 1].data_ptr(), 0, 0, 0, 0, 0)
        _cuda.launch(kernel, config, params.address(pointers), 0)
    torch.cuda.synchronize()
    return buffers, time.perf_counter() - start


def test_a_pdl_chain_is_exact_and_overlaps(one_rank_pool):
    memory, err, desc = one_rank_pool
    kernel = _kernel(broken=False)
    _chain(kernel, desc, True)  # warm-up: module load, first launches
    times = {}
    for pdl in (False, True, False, True):
        buffers, seconds = _chain(kernel, desc, pdl)
        assert err[0].item() == 0, err.tolist()
        assert torch.equal(buffers[CHAIN], buffers[0]), f"pdl={pdl}: the chain's result is wrong"
        times.setdefault(pdl, []).append(seconds / CHAIN * 1e6)
    plain, overlapped = min(times[False]), min(times[True])
    print(f"one-rank Lamport chain, {N * 4} bytes per call: {plain:.2f} us per launch in stream order, "
          f"{overlapped:.2f} us with PDL")
    assert overlapped < plain, f"PDL did not shorten the chain: {overlapped:.2f} us against {plain:.2f} us"


def test_a_chain_without_the_wait_goes_wrong(one_rank_pool):
    memory, err, desc = one_rank_pool
    kernel = _kernel(broken=True)
    wrong = 0
    for _ in range(5):
        buffers, _ = _chain(kernel, desc, True)
        wrong += int(err[0].item() != 0) + int(not torch.equal(buffers[CHAIN], buffers[0]))
        if wrong:
            break
    assert wrong, "kernels that skip griddepcontrol.wait gave exact chains under PDL: the GPU test cannot see it"
