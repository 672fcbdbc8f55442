"""ubnext.fusion on one process (a gloo group of one rank): what the pass rewrites, as the code
Inductor generates shows it, what it leaves alone and why, the pass's installation, and the results
against float64 within the fused op's bounds. With one rank the all-reduce sums one term, so these
tests check the rewrite and the norm's arithmetic; the sums over ranks are checked by the mpi tier
(worker case fusion, examples/llama_tp.py --compile)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.utils import run_and_get_code

import ubnext
from ubnext import testing as T

FUSED_CALL = "torch.ops.ubnext.all_reduce_add_rmsnorm.default("
PLAIN_CALL = "torch.ops.ubnext.all_reduce.default("
TORCH_CALL = "torch.ops._c10d_functional.all_reduce"
HIDDEN = 64


@pytest.fixture(scope="module")
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    ubnext.get_communicator().close()
    dist.destroy_process_group()


@pytest.fixture
def fusion(group):
    """Fusion on, counters and Dynamo's caches fresh; off again afterwards. Without the FX graph
    cache: a graph it serves (from an earlier run of these tests) does not run the pass, which
    then counts nothing in stats()."""
    torch._dynamo.reset()
    ubnext.fusion.stats(reset=True)
    ubnext.fusion.enable()
    with torch._inductor.config.patch(fx_graph_cache=False):
        yield ubnext.fusion
    ubnext.fusion.disable()
    torch._dynamo.reset()


def compiled_code(fn, *args, **compile_kwargs):
    """(result, generated code) of ``fn`` compiled with Inductor, without a gradient."""
    with torch.no_grad():
        out, code = run_and_get_code(torch.compile(fn, fullgraph=True, **compile_kwargs), *args)
    return out, "\n".join(code)


def inputs(dtype, tokens=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
    residual = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
    weight = (torch.rand(HIDDEN, generator=gen) + 0.5).to(dtype)
    return x, residual, weight


def check_fused_result(out, residual_out, x, residual, weight, eps):
    """The fused op's contract against float64 (ubnext/testing.py): the residual sum rounded once
    from fp32, the norm computed in fp32 from that rounded sum and rounded once. One rank: the
    all-reduce's sum is x itself."""
    dtype = x.dtype
    ref, bound = T.residual_bound([x], residual, dtype)
    assert ((residual_out.double() - ref).abs() <= bound).all(), "residual sum outside its bound"
    y = T.rmsnorm_reference(residual_out, weight, eps)
    assert ((out.double() - y).abs() <= T.rmsnorm_bound(y, dtype, HIDDEN)).all(), "norm outside its bound"


class HFRMSNorm(torch.nn.Module):
    """transformers' LlamaRMSNorm: fp32 statistics, cast back before the weight."""

    def __init__(self, weight, eps):
        super().__init__()
        self.weight, self.eps = torch.nn.Parameter(weight), eps

    def forward(self, h):
        h32 = h.float()
        h32 = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h32.to(h.dtype)


def norms(weight, eps):
    """RMSNorm as models write it: name -> (norm function, weight the fused op sees)."""
    module = torch.nn.RMSNorm(HIDDEN, eps=eps, dtype=weight.dtype)
    with torch.no_grad():
        module.weight.copy_(weight)
    return {
        "nn.RMSNorm": (module, weight),
        "F.rms_norm": (lambda h: F.rms_norm(h, (HIDDEN,), weight, eps), weight),
        "F.rms_norm-no-weight": (lambda h: F.rms_norm(h, (HIDDEN,), None, eps), torch.ones_like(weight)),
        "transformers": (HFRMSNorm(weight, eps), weight),
        # in the activations' dtype, as examples/llama_tp.py writes it
        "input-dtype": (lambda h: h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps) * weight, weight),
    }


@pytest.mark.parametrize("variant,dtype", [
    ("nn.RMSNorm", torch.bfloat16), ("F.rms_norm", torch.float32), ("F.rms_norm-no-weight", torch.bfloat16),
    ("transformers", torch.bfloat16), ("input-dtype", torch.float16),
])
def test_all_reduce_add_rmsnorm_is_fused(fusion, variant, dtype):
    eps = 1e-5
    x, residual, weight = inputs(dtype)
    norm, fused_weight = norms(weight, eps)[variant]

    def block(x, residual):
        h = residual + funcol.all_reduce(x, "sum", dist.group.WORLD)
        return norm(h), h

    (out, residual_out), code = compiled_code(block, x, residual)
    assert FUSED_CALL in code and TORCH_CALL not in code, code
    assert fusion.stats()["all_reduce_add_rmsnorm"] == 1 and fusion.stats()["graphs"] == {"inference": 1}
    check_fused_result(out, residual_out, x, residual, fused_weight, eps)


def test_dynamic_token_counts_compile_once(fusion):
    """A token count marked dynamic: one graph, fused, for every count."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("inductor")
    weight = inputs(torch.bfloat16)[2]
    norm = norms(weight, 1e-6)["nn.RMSNorm"][0]

    def block(x, residual):
        h = funcol.all_reduce(x, "sum", dist.group.WORLD) + residual
        return norm(h), h

    compiled = torch.compile(block, backend=counter, fullgraph=True)
    for tokens in (3, 8, 17):
        x, residual, _ = inputs(torch.bfloat16, tokens, seed=tokens)
        torch._dynamo.mark_dynamic(x, 0)
        torch._dynamo.mark_dynamic(residual, 0)
        with torch.no_grad():
            out, residual_out = compiled(x, residual)
        check_fused_result(out, residual_out, x, residual, weight, 1e-6)
    assert counter.frame_count == 1 and fusion.stats()["all_reduce_add_rmsnorm"] == 1, fusion.stats()


def test_a_bare_all_reduce_becomes_ubnext_all_reduce(fusion):
    """Functional collectives and torch.distributed.all_reduce traced by Dynamo (in place, on an
    input too): each sum all-reduce with no norm after it runs torch.ops.ubnext.all_reduce."""

    def fn(x, y):
        a = torch.relu(funcol.all_reduce(x, "sum", dist.group.WORLD))
        b = x * 2
        dist.all_reduce(b)
        dist.all_reduce(y)
        return a + b

    x, y, _ = inputs(torch.float32)
    y_before = y.clone()
    out, code = compiled_code(fn, x, y)
    assert code.count(PLAIN_CALL) == 3 and TORCH_CALL not in code, code
    assert torch.equal(out, torch.relu(x) + x * 2) and torch.equal(y, y_before)
    assert fusion.stats()["all_reduce"] == 3
    assert fusion.stats()["not_fused"] == {"no residual add after the all-reduce": 2,  # relu; y's copy back
                                           "no RMSNorm of the residual sum": 1}  # a + b


def test_what_the_fused_op_cannot_take_is_left_alone_and_logged_once(fusion, caplog):
    """Another reduce op or dtype: the all-reduce stays torch's. A norm the fused op cannot take (over
    the first dimension, a weight of another dtype, the reduced tensor used twice): the all-reduce is
    ubnext's and the norm stays as it was. Each reason is logged once at debug level."""
    x, residual, weight = inputs(torch.bfloat16)
    w32 = weight.float()

    def fn(x, residual, ints):
        group = dist.group.WORLD
        avg = funcol.all_reduce(x, "avg", group)
        count = funcol.all_reduce(ints, "sum", group)
        h = residual + funcol.all_reduce(x, "sum", group)
        over_tokens = h * torch.rsqrt(h.square().mean(0, keepdim=True) + 1e-6)
        h2 = residual + funcol.all_reduce(x * 3, "sum", group)
        promoted = F.rms_norm(h2, (HIDDEN,), w32, 1e-6)  # fp32 weight: an fp32 output
        s = funcol.all_reduce(x * 5, "sum", group)
        h3 = residual + s
        twice = F.rms_norm(h3, (HIDDEN,), weight, 1e-6) + s
        return avg, count, over_tokens, promoted, twice

    ints = torch.arange(4)
    caplog.set_level(logging.DEBUG, logger="ubnext")
    for _ in range(2):  # a second compile meets the same reasons: no new log line
        torch._dynamo.reset()
        (avg, count, over_tokens, promoted, twice), code = compiled_code(fn, x, residual, ints)
    assert code.count(TORCH_CALL) == 2 and code.count(PLAIN_CALL) == 3 and FUSED_CALL not in code, code
    stats = fusion.stats()
    assert stats["left_alone"] == {"reduce op 'avg' (ubnext sums)": 2,
                                   "dtype torch.int64 (ubnext takes bfloat16, float16 and float32)": 2}, stats
    assert stats["not_fused"] == {"an RMSNorm over another dimension than the last": 2,
                                  "a norm weight of dtype torch.float32 with torch.bfloat16 activations": 2,
                                  "the reduced tensor is used by more than the residual add": 2}, stats
    lines = [r.getMessage() for r in caplog.records if r.name == "ubnext" and "ubnext.fusion" in r.getMessage()]
    assert len(lines) == 5 and all(r.levelno == logging.DEBUG for r in caplog.records if r.name == "ubnext"), lines
    # left alone, the composite is computed as without fusion: eager rounds each of the norm's up to five
    # steps to bf16, Inductor keeps them in fp32 and rounds once, so the two differ by at most six
    # bf16 roundings of the result, within 2^-5 relative
    for got, want in zip((avg, count, over_tokens, promoted, twice), fn(x, residual, ints)):
        torch.testing.assert_close(got, want, rtol=2**-5, atol=1e-6)


class _CopyToTP(torch.autograd.Function):
    """Megatron's "copy to the tensor-parallel region": identity forward, all-reduced gradient."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return funcol.all_reduce(grad, "sum", dist.group.WORLD)


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return funcol.all_reduce(x, "sum", dist.group.WORLD)

    @staticmethod
    def backward(ctx, grad):
        return grad


def test_training_graphs_forward_and_backward(fusion):
    """Training: the forward graph runs the fused op (the rsqrt the backward needs is recomputed from
    its residual sum), the backward's all-reduce of the input gradient runs ubnext's, and the
    gradients are those of the same model compiled without fusion, bit for bit (the backward reads the
    same saved values; the loss's gradient does not depend on the normed values)."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)
    norm = torch.nn.RMSNorm(HIDDEN, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)

    def block(x, residual):
        h = residual + _ReduceFromTP.apply(layer(_CopyToTP.apply(x)))
        return norm(h), h

    x, residual, _ = inputs(torch.float32)

    def step():
        xs, rs = x.clone().requires_grad_(), residual.clone().requires_grad_()
        out, h = torch.compile(block, fullgraph=True)(xs, rs)
        (out.sum() + h.sum()).backward()
        return out.detach(), h.detach(), [t.grad.clone() for t in (xs, rs, layer.weight, norm.weight)]

    (out, h, grads), code = run_and_get_code(step)
    assert len(code) == 2 and FUSED_CALL in code[0] and PLAIN_CALL in code[1], code
    assert TORCH_CALL not in "".join(code)
    assert fusion.stats()["graphs"] == {"training forward": 1, "training backward": 1}, fusion.stats()
    check_fused_result(out, h, layer(x).detach(), residual, norm.weight.detach(), 1e-6)
    for p in (layer.weight, norm.weight):
        p.grad = None
    fusion.disable()
    torch._dynamo.reset()
    _, _, plain_grads = step()
    for got, want in zip(grads, plain_grads):
        assert torch.equal(got, want)


class _Recorder(CustomGraphPass):
    def __init__(self):
        self.calls = 0

    def __call__(self, graph):
        self.calls += 1

    def uuid(self):
        return "test-recorder"


def test_enable_chains_the_installed_pass_and_disable_gives_it_back(group, monkeypatch):
    """A pass already in post_grad_custom_post_pass runs before ubnext's and is back alone after
    disable(). Inductor's FX graph cache stays on and keys the graphs by the pass's uuid (stable
    across instances): the graph compiled after disable() is not the rewritten one, and with fusion
    on again the rewritten graph comes from the cache."""
    import random

    from torch._dynamo.utils import counters
    from torch._inductor import config

    recorder = _Recorder()
    monkeypatch.setattr(config, "post_grad_custom_post_pass", recorder)
    assert ubnext.fusion.FusionPass().uuid() == ubnext.fusion.FusionPass().uuid()
    new_in_this_run = random.random()  # a graph no earlier run has cached

    def fn(x):
        return funcol.all_reduce(x, "sum", dist.group.WORLD) + new_in_this_run

    x = torch.ones(4, HIDDEN)

    def compile_fn(fusion_on: bool):
        torch._dynamo.reset()
        if fusion_on:
            ubnext.fusion.enable()
        try:
            return compiled_code(fn, x)
        finally:
            ubnext.fusion.disable()

    counters.clear()
    ubnext.fusion.enable()
    ubnext.fusion.enable()  # twice: still one ubnext pass
    passes = config.post_grad_custom_post_pass
    assert passes[0] is recorder and len(passes) == 2 and isinstance(passes[1], ubnext.fusion.FusionPass)
    assert ubnext.fusion.is_enabled()
    _, code = compile_fn(True)
    assert PLAIN_CALL in code and recorder.calls == 1, code
    assert config.post_grad_custom_post_pass is recorder and not ubnext.fusion.is_enabled()
    out, code = compile_fn(False)
    assert TORCH_CALL in code and "ubnext" not in code and recorder.calls == 2, code
    assert torch.equal(out, x + new_in_this_run)
    _, code = compile_fn(True)
    assert PLAIN_CALL in code and recorder.calls == 2, "the rewritten graph was not served by the cache"
    assert not counters["inductor"]["fxgraph_cache_bypass"], dict(counters["inductor"])
