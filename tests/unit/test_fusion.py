"""ubnext.fusion on one process (a gloo group of one rank): what the pass rewrites, as the code
Inductor generates shows it, what it leaves alone and why, the pass's installation, and the results
against float64 within the fused op's bounds, or bit for bit where the contract promises the same
bits (the FP8 forms). With one rank the all-reduce sums one term, so these tests check the rewrite
and the norm's arithmetic; the sums over ranks are checked by the mpi tier (worker case fusion,
examples/llama_tp.py --compile).

Compiling is what these tests spend their time on (CI starts with an empty Inductor cache, on two
cores), so each graph is compiled once and holds many sites: one graph for every RMSNorm form, one
for the FP8 forms, one for what is not fused, each read by the tests of its part (module-scoped
fixtures). A site's result comes out of its own graph outputs, so one graph checks them all."""

from __future__ import annotations

import logging
from types import SimpleNamespace

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
FP8_CALL = "torch.ops.ubnext.all_reduce_add_rmsnorm_fp8.default("
PLAIN_CALL = "torch.ops.ubnext.all_reduce.default("
TORCH_CALL = "torch.ops._c10d_functional.all_reduce"
HIDDEN = 64
FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def group():
    """One rank, and Inductor's C++ kernels without the vector ISA. On an empty cache Inductor
    first builds and loads a probe program per vector ISA (about 10 s on two cores); these tests
    check graphs and results, not kernel speed, and scalar kernels compute the same arithmetic
    (the bounds below do not depend on the order of a reduction). Inductor keeps the ISA it finds
    for the process, so later compiles in this process are scalar too."""
    with torch._inductor.config.patch({"cpp.vec_isa_ok": False}):
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


def compile_once(fn, *calls, dynamic_dim0=True):
    """``fn`` compiled once with fusion on (as the ``fusion`` fixture sets it up), without a
    gradient, and called with each argument tuple of ``calls`` (dimension 0 of every tensor marked
    dynamic: one graph serves every token count). Returns the outputs of each call, the generated
    code, the number of graphs Dynamo compiled, stats() and the debug lines logged meanwhile."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    ubnext.fusion.stats(reset=True)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(fn, backend=counter, fullgraph=True)
    lines = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("ubnext")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    ubnext.fusion.enable()
    try:
        with torch._inductor.config.patch(fx_graph_cache=False), torch.no_grad():
            outs = []
            for args in calls:
                if dynamic_dim0:
                    for a in args:
                        if isinstance(a, torch.Tensor) and a.dim() > 1:
                            torch._dynamo.mark_dynamic(a, 0)
                if not outs:
                    out, code = run_and_get_code(compiled, *args)
                else:
                    out = compiled(*args)
                outs.append(out)
    finally:
        ubnext.fusion.disable()
        logger.removeHandler(handler)
        logger.setLevel(level)
    result = SimpleNamespace(
        outs=outs, code="\n".join(code), graphs=counter.frame_count, stats=ubnext.fusion.stats(reset=True), lines=lines
    )
    torch._dynamo.reset()
    return result


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


# every form of the norm, each in a dtype, in one graph
NORM_FORMS = [
    ("nn.RMSNorm", torch.bfloat16),
    ("F.rms_norm", torch.float32),
    ("F.rms_norm-no-weight", torch.bfloat16),
    ("transformers", torch.bfloat16),
    ("input-dtype", torch.float16),
]
NORM_EPS = 1e-5


def norm_form_inputs(tokens):
    return [inputs(dtype, tokens, seed=tokens + i)[:2] for i, (_, dtype) in enumerate(NORM_FORMS)]


@pytest.fixture(scope="module")
def norm_forms(group):
    """The graph of every norm form, with the token count dynamic, called at 3, 8 and 17 tokens."""
    forms = [norms(inputs(dtype, seed=i)[2], NORM_EPS)[name] for i, (name, dtype) in enumerate(NORM_FORMS)]

    def blocks(*xs_and_residuals):
        outs = []
        for i, (norm, _) in enumerate(forms):
            x, residual = xs_and_residuals[2 * i : 2 * i + 2]
            # the residual on either side of the add
            h = (
                residual + funcol.all_reduce(x, "sum", dist.group.WORLD)
                if i % 2
                else funcol.all_reduce(x, "sum", dist.group.WORLD) + residual
            )
            outs += [norm(h), h]
        return outs

    calls = [[t for pair in norm_form_inputs(tokens) for t in pair] for tokens in (3, 8, 17)]
    return compile_once(blocks, *calls), calls, [weight for _, weight in forms]


def test_all_reduce_add_rmsnorm_is_fused(norm_forms):
    """nn.RMSNorm, F.rms_norm (with and without weight), transformers' norm and the hand-written
    one in the activations' dtype, in bf16, fp16 and fp32: each runs the fused op, within its bounds."""
    compiled, calls, weights = norm_forms
    assert compiled.code.count(FUSED_CALL) == len(NORM_FORMS) and TORCH_CALL not in compiled.code, compiled.code
    assert compiled.stats["all_reduce_add_rmsnorm"] == len(NORM_FORMS), compiled.stats
    assert compiled.stats["graphs"] == {"inference": 1}, compiled.stats
    for args, outs in zip(calls, compiled.outs):
        for i in range(len(NORM_FORMS)):
            check_fused_result(outs[2 * i], outs[2 * i + 1], *args[2 * i : 2 * i + 2], weights[i], NORM_EPS)


def test_dynamic_token_counts_compile_once(norm_forms):
    """A token count marked dynamic: one graph, fused, for every count (3, 8, 17)."""
    compiled, calls, _ = norm_forms
    assert compiled.graphs == 1 and len(compiled.outs) == 3
    assert [outs[0].shape[0] for outs in compiled.outs] == [3, 8, 17]


def test_the_block_scaled_form_compiles_and_the_pass_leaves_it(fusion):
    """all_reduce_add_rmsnorm(..., quant=fmt) under torch.compile(fullgraph=True) with fusion on: one
    opaque operator (no graph break), which the pass neither matches nor rewrites, and eager's bits."""
    x, residual, weight = inputs(torch.bfloat16, tokens=3)

    def f(x, residual, weight):
        return ubnext.all_reduce_add_rmsnorm(x, residual, weight, NORM_EPS, quant="mxfp8", swizzled=True)

    out, code = compiled_code(f, x, residual, weight)
    assert "torch.ops.ubnext.all_reduce_add_rmsnorm_quant.default(" in code and FUSED_CALL not in code, code
    assert fusion.stats()["all_reduce_add_rmsnorm"] == 0, fusion.stats()
    with torch.no_grad():
        want = f(x, residual, weight)
    for got, ref in zip(out, want):
        assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))


# -- FP8 -------------------------------------------------------------------------------------------


def quantise_static(y, scale):
    """A static FP8 quantisation as models write it in torch ops: the fused op's FP8 form takes it."""
    return (y.float() / scale).clamp(-448, 448).to(FP8)


def quantise_per_token(y):
    """A per-token FP8 quantisation: the FP8 values and the [tokens, 1] dequantisation scales."""
    yf = y.float()
    amax = yf.abs().amax(-1, keepdim=True)
    s = (amax / 448).clamp(min=1e-12)
    return (yf / s).clamp(-448, 448).to(FP8), s


# near misses: the fused op would not give the composite's bits (ubnext/fusion/_match.py)
FP8_LEFT_IN_TORCH = {
    "bf16 quotient": (
        "the quantisation computes in torch.bfloat16, not on y.float()",
        lambda y, h, s1, s0: (y / s0).clamp(-448, 448).to(FP8),
    ),  # a 0-dim scale keeps bf16
    "reciprocal": (
        "a multiplication by the reciprocal scale (the fused op divides: one FP8 step apart at times)",
        lambda y, h, s1, s0: (y.float() * (1 / s1)).clamp(-448, 448).to(FP8),
    ),
    "y used too": (
        "the normed tensor is used unquantised too (the FP8 form returns only the FP8 values)",
        lambda y, h, s1, s0: (quantise_static(y, s1), y),
    ),
    "per-tensor": (
        "a per-tensor scale computed from the normed tensor (dynamic scaling; the fused op's is static or per token)",
        lambda y, h, s1, s0: quantise_static(y, y.float().abs().amax() / 448),
    ),
    "scale of h": (
        "a scale computed from the residual sum (dynamic scaling; the fused op's is static or per token)",
        lambda y, h, s1, s0: quantise_static(y, h.float().abs().amax() / 448),
    ),
    "e5m2": (
        "an FP8 format other than float8_e4m3fn (torch.float8_e5m2)",
        lambda y, h, s1, s0: (y.float() / s1).clamp(-448, 448).to(torch.float8_e5m2),
    ),
}
FP8_EPS = 1e-6


@pytest.fixture(scope="module")
def fp8_forms(group):
    """One graph: the static form on bf16 (a [1] scale) and on fp32 activations (a 0-dim scale,
    torch.clamp with keyword bounds), the per-token form on bf16, then each near miss on bf16;
    the token count dynamic, called at 8 and 5 tokens."""
    weight, weight32 = inputs(torch.bfloat16)[2], inputs(torch.float32, seed=1)[2]
    scale1, scale0 = torch.tensor([0.01]), torch.tensor(0.02)

    def sites(x, residual, x32, residual32):
        def normed(k, x, residual, w):
            h = residual + funcol.all_reduce(x * k, "sum", dist.group.WORLD)  # x * k: a site of its own
            return F.rms_norm(h, (HIDDEN,), w, FP8_EPS), h

        y, h = normed(1, x, residual, weight)
        outs = [quantise_static(y, scale1), h]
        y, h = normed(2, x, residual, weight)
        outs += [*quantise_per_token(y), h]
        y, h = normed(1, x32, residual32, weight32)
        outs += [torch.clamp(y / scale0, min=-448.0, max=448.0).to(FP8), h]
        for k, (_, quantise) in enumerate(FP8_LEFT_IN_TORCH.values()):
            y, h = normed(3 + k, x, residual, weight)
            outs += [quantise(y, h, scale1, scale0)]
        return outs

    calls = [
        (*inputs(torch.bfloat16, tokens, seed=tokens)[:2], *inputs(torch.float32, tokens, seed=tokens + 1)[:2])
        for tokens in (8, 5)
    ]
    return compile_once(sites, *calls), calls, (weight, weight32, scale1, scale0)


def fused_normed(x, residual, weight):
    """(y, residual sum) of the plain fused op run eagerly: what the FP8 form quantises."""
    return torch.ops.ubnext.all_reduce_add_rmsnorm(x, residual, weight, FP8_EPS, dist.group.WORLD.group_name)


def bits(t):
    return t.view(torch.uint8) if t.dtype == FP8 else t


def test_fp8_static_and_per_token_quantisation_is_fused_bit_for_bit(fp8_forms):
    """The static form (bf16 and fp32 activations) and the per-token form run the fused op's FP8
    form, and give the bits of the same torch code run eagerly on the fused op's normed output:
    the FP8 values, the per-token scales and the residual sum."""
    compiled, calls, (weight, weight32, scale1, scale0) = fp8_forms
    assert compiled.code.count(FP8_CALL) == 3 and TORCH_CALL not in compiled.code, compiled.code
    assert compiled.stats["all_reduce_add_rmsnorm_fp8"] == 3 and compiled.graphs == 1, compiled.stats
    for (x, residual, x32, residual32), outs in zip(calls, compiled.outs):
        y, h = fused_normed(x, residual, weight)
        y2, h2 = fused_normed(x * 2, residual, weight)
        y32, h32 = fused_normed(x32, residual32, weight32)
        want = [
            quantise_static(y, scale1),
            h,
            *quantise_per_token(y2),
            h2,
            torch.clamp(y32 / scale0, min=-448.0, max=448.0).to(FP8),
            h32,
        ]
        for i, (got, expected) in enumerate(zip(outs, want)):
            assert got.dtype == expected.dtype and torch.equal(bits(got), bits(expected)), f"output {i}"


def test_fp8_forms_the_fused_op_cannot_take_stay_in_torch(fp8_forms):
    """Each near miss keeps its quantisation in torch after the plain fused op, counted in stats()
    with its reason and logged once. Its FP8 values are within one FP8 step of the same code run
    eagerly on the fused op's normed output: Inductor computes the composite's quotient in fp32
    where eager torch may round it to bf16 first, or multiplies by a Python divisor's reciprocal,
    which moves a value across an FP8 rounding boundary at most once (one step: 2^-3 relative,
    2^-9 absolute among the subnormals)."""
    compiled, calls, (weight, _, scale1, scale0) = fp8_forms
    near = len(FP8_LEFT_IN_TORCH)
    assert compiled.code.count(FUSED_CALL) == near, compiled.code
    assert compiled.stats["fp8_not_fused"] == {reason: 1 for reason, _ in FP8_LEFT_IN_TORCH.values()}, compiled.stats
    assert all(f"left in torch: {reason}" in "\n".join(compiled.lines) for reason, _ in FP8_LEFT_IN_TORCH.values())
    for (x, residual, *_), outs in zip(calls, compiled.outs):
        assert len(outs) == 7 + near
        for k, (got, (_, quantise)) in enumerate(zip(outs[7:], FP8_LEFT_IN_TORCH.values())):
            y, h = fused_normed(x * (3 + k), residual, weight)
            want = quantise(y, h, scale1, scale0)
            for g, w in zip(*((got, want) if isinstance(got, (list, tuple)) else ((got,), (want,)))):
                torch.testing.assert_close(g.float(), w.float(), rtol=2**-3, atol=2**-9)


# -- what is not fused -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def not_fused(group):
    """One graph (static shapes) of the all-reduces the pass does not fuse: bare ones, which run
    ubnext's all-reduce, and those the fused op cannot take, one of them (avg) twice."""
    x, residual, weight = inputs(torch.bfloat16)
    w32 = weight.float()

    def fn(x, y, residual, ints):
        group = dist.group.WORLD
        # functional collectives and torch.distributed.all_reduce traced by Dynamo (in place, on an input too)
        a = torch.relu(funcol.all_reduce(x, "sum", group))
        b = x * 2
        dist.all_reduce(b)
        dist.all_reduce(y)
        bare = a + b
        # another reduce op (twice: one log line) or dtype: torch's all-reduce stays
        avg = funcol.all_reduce(x, "avg", group) + funcol.all_reduce(x * 7, "avg", group)
        count = funcol.all_reduce(ints, "sum", group)
        # a norm the fused op cannot take: ubnext's all-reduce, the norm as it was
        h = residual + funcol.all_reduce(x * 9, "sum", group)
        over_tokens = h * torch.rsqrt(h.square().mean(0, keepdim=True) + 1e-6)
        h2 = residual + funcol.all_reduce(x * 3, "sum", group)
        promoted = F.rms_norm(h2, (HIDDEN,), w32, 1e-6)  # fp32 weight: an fp32 output
        s = funcol.all_reduce(x * 5, "sum", group)
        h3 = residual + s
        twice = F.rms_norm(h3, (HIDDEN,), weight, 1e-6) + s
        return bare, avg, count, over_tokens, promoted, twice

    y = inputs(torch.float32, seed=1)[0]  # fp32: an input all-reduced in place
    args = (x, y, residual, torch.arange(4))
    y_before = y.clone()
    compiled = compile_once(fn, args, dynamic_dim0=False)
    return compiled, fn, args, y_before


def test_a_bare_all_reduce_becomes_ubnext_all_reduce(not_fused):
    """Functional collectives and torch.distributed.all_reduce traced by Dynamo (in place, on an
    input too): each sum all-reduce with no norm after it runs torch.ops.ubnext.all_reduce."""
    compiled, _, (x, y, _, _), y_before = not_fused
    assert compiled.code.count(PLAIN_CALL) == 3 + 3 and FUSED_CALL not in compiled.code, compiled.code
    assert compiled.stats["all_reduce"] == 6, compiled.stats
    assert torch.equal(compiled.outs[0][0], torch.relu(x) + x * 2) and torch.equal(y, y_before)
    not_fused = compiled.stats["not_fused"]
    assert not_fused["no residual add after the all-reduce"] == 2  # relu; y's copy back
    assert not_fused["no RMSNorm of the residual sum"] == 1  # a + b


def test_what_the_fused_op_cannot_take_is_left_alone_and_logged_once(not_fused):
    """Another reduce op or dtype: the all-reduce stays torch's. A norm the fused op cannot take (over
    the first dimension, a weight of another dtype, the reduced tensor used twice): the all-reduce is
    ubnext's and the norm stays as it was. Each reason is logged once at debug level, the one met
    twice too."""
    compiled, fn, args, _ = not_fused
    assert compiled.code.count(TORCH_CALL) == 3, compiled.code
    assert compiled.stats["left_alone"] == {
        "reduce op 'avg' (ubnext sums)": 2,
        "dtype torch.int64 (ubnext takes bfloat16, float16 and float32)": 1,
    }
    bare = ("no RMSNorm of the residual sum", "no residual add after the all-reduce")  # the test above's
    not_fused = {k: v for k, v in compiled.stats["not_fused"].items() if k not in bare}
    assert not_fused == {
        "an RMSNorm over another dimension than the last": 1,
        "a norm weight of dtype torch.float32 with torch.bfloat16 activations": 1,
        "the reduced tensor is used by more than the residual add": 1,
    }, compiled.stats
    lines = [line for line in compiled.lines if "ubnext.fusion" in line]
    assert len(lines) == len(set(lines)) and sum("reduce op 'avg'" in line for line in lines) == 1, lines
    for reason in [*compiled.stats["left_alone"], *not_fused]:
        assert any(reason in line for line in lines), (reason, lines)
    # left alone, the composite is computed as without fusion: eager rounds each of the norm's up to five
    # steps to bf16, Inductor keeps them in fp32 and rounds once, so the two differ by at most six
    # bf16 roundings of the result, within 2^-5 relative
    with torch.no_grad():
        want = fn(*args)
    for got, expected in zip(compiled.outs[0][1:], want[1:]):
        torch.testing.assert_close(got, expected, rtol=2**-5, atol=1e-6)


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
