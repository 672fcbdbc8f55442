"""ubnext.fsdp and the FSDP2-facing pieces of the communicator, without ranks: the reduce-scatter's
factor, the exchange planner, the FP8 weight subclass, dequantisation and the conversion."""

import pytest
import torch
import torch.distributed as dist

from ubnext import fsdp as UF
from ubnext import plan
from ubnext.reference._checks import (
    FP8,
    check_all_gather_args,
    check_quantize_args,
    check_reduce_scatter_args,
    quantize_fp8_reference,
    reduce_factor,
)


def test_reduce_factor():
    assert reduce_factor("sum", 4) == 1.0
    assert reduce_factor("avg", 4) == 0.25
    assert reduce_factor(0.5, 4) == 0.5
    assert reduce_factor(dist.ReduceOp.SUM, 4) == 1.0
    assert reduce_factor(dist.ReduceOp.AVG, 8) == 0.125
    assert reduce_factor(dist._make_nccl_premul_sum(0.125), 2) == 0.125  # FSDP2's gradient divide factor
    for bad in ("max", dist.ReduceOp.MAX, True, None):
        with pytest.raises(ValueError, match="reduce-scatter op"):
            reduce_factor(bad, 2)


def test_exchange_plan_is_a_function_of_the_call():
    view = plan.PoolView(None, True, 1 << 20, 4096, "emulator", False, (), "UBNEXT_MAX_BATCH=64 tokens")
    assert plan.exchange_path("allgather", 4096, False, view) == ("allgather", "fits")
    path, why = plan.exchange_path("allgather", 8192, False, view)
    assert path == "torch" and "staging region (4096 bytes" in why and "comm.empty" in why
    assert plan.exchange_path("allgather", 8192, True, view)[0] == "allgather"  # a pool buffer
    off = plan.PoolView("no symmetric pool")
    assert plan.exchange_path("allgather", 64, True, off) == ("torch", "no symmetric pool")
    broken = plan.PoolView(None, False, 1 << 20, 4096, "emulator", False, (("twoshot", "wrong sums"),))
    assert "self-test" in plan.exchange_path("reduce_scatter", 64, True, broken)[1]


def test_argument_checks():
    x = torch.zeros(8, 4, dtype=torch.bfloat16)
    check_all_gather_args(x, torch.zeros(16, 4, dtype=torch.bfloat16), 2)
    check_all_gather_args(torch.zeros(12, dtype=torch.uint8), None, 2)  # bytes are fine
    with pytest.raises(ValueError, match="world_size x"):
        check_all_gather_args(x, torch.zeros(8, 4, dtype=torch.bfloat16), 2)
    with pytest.raises(ValueError, match="contiguous"):
        check_all_gather_args(x.t(), None, 2)
    check_reduce_scatter_args(x, torch.zeros(4, 4, dtype=torch.bfloat16), 2)
    with pytest.raises(ValueError, match="multiple of the world size"):
        check_reduce_scatter_args(torch.zeros(3, 4), None, 2)
    with pytest.raises(TypeError, match="bfloat16, float16 and float32"):
        check_reduce_scatter_args(torch.zeros(4, dtype=torch.uint8), None, 2)
    with pytest.raises(ValueError, match="hidden"):
        check_quantize_args(torch.zeros(10), 4, None)
    with pytest.raises(ValueError, match="one-element float32"):
        check_quantize_args(torch.zeros(8), 8, torch.ones(2))


def test_quantize_reference_contract():
    y = torch.tensor([[1.0, -2.0, 448.0 * 3], [0.0, 0.0, 0.0]])
    q, s = quantize_fp8_reference(y, 3, None)
    assert torch.equal(s, torch.tensor([3.0, 1e-12]))  # amax / 448, and the floor of an all-zero row
    assert q[0].float().tolist() == [0.34375, -0.6875, 448.0]  # 1/3 and -2/3 to the nearest e4m3
    q, s = quantize_fp8_reference(y, 3, torch.tensor([1.0]))
    assert s.tolist() == [1.0] and q[0, 2].float() == 448.0  # saturates, never NaN


def test_dequantize_modes():
    q = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]]).to(FP8)
    rows = UF.dequantize(q, torch.tensor([1.0, 2.0, 3.0, 4.0]), "row", torch.float32)
    assert rows.tolist() == [[1, 2], [6, 8], [15, 18], [28, 32]]
    shards = UF.dequantize(q, torch.tensor([1.0, 10.0]), "shard", torch.float32)  # 2 ranks, 2 rows each
    assert shards.tolist() == [[1, 2], [3, 4], [50, 60], [70, 80]]


def test_fp8_weight_is_its_tensor_for_every_op_but_the_hooks():
    w = torch.randn(8, 4)
    fw = UF.FP8AllGatherWeight(w, "row")
    # FSDP2's sharding ops keep the subclass, with the scaling mode
    for piece in torch.chunk(fw, 2):
        assert isinstance(piece, UF.FP8AllGatherWeight) and piece._scaling == "row"
    assert isinstance(fw.detach(), UF.FP8AllGatherWeight)
    assert isinstance(fw.new_zeros(3, 4), UF.FP8AllGatherWeight)
    # arithmetic (the optimizer) sees the plain tensor and updates it in place
    out = fw * 2
    assert type(out) is torch.Tensor and torch.equal(out, w * 2)
    fw.add_(torch.ones(8, 4))
    assert torch.equal(fw._tensor, w)  # the same storage: w was updated
    names, meta = fw.__tensor_flatten__()
    again = UF.FP8AllGatherWeight.__tensor_unflatten__({"_tensor": w}, meta, w.shape, w.stride())
    assert names == ["_tensor"] and again._scaling == "row"
    static = UF.FP8AllGatherWeight(w, "static", torch.tensor([0.5]))
    assert static.__tensor_flatten__()[0] == ["_tensor", "_scale"]
    with pytest.raises(ValueError, match="scaling must be one of"):
        UF.FP8AllGatherWeight(w, "block")
    with pytest.raises(ValueError, match="scale is required"):
        UF.FP8AllGatherWeight(w, "static")
    with pytest.raises(ValueError, match="one-element float32"):
        UF.FP8AllGatherWeight(w, "static", torch.tensor([1.0, 2.0]))


def test_fp8_weight_refuses_non_2d():
    class Mesh:
        def size(self):
            return 4

    fw = UF.FP8AllGatherWeight(torch.randn(3, 8), "row")
    with pytest.raises(ValueError, match="needs a 2-D weight"):
        fw.fsdp_pre_all_gather(Mesh(), torch.Size([10, 8, 2]), (16, 2, 1), None, None)


def test_dequantize_uneven_rows():
    """Issue 25 point 4: scales per FSDP2 shard of 40 rows over 3 ranks (14, 14, 12 rows, the
    padding cut), per row, and one for the whole weight: each row times its scale, exactly (an
    fp32 product of an e4m3 value (4 significant bits) and an fp32 scale (24) rounds the exact
    product once, as does the cast of the exact fp64 product)."""
    q = (torch.randn(40, 6) * 100).clamp(-448, 448).to(FP8)
    shard_scales = torch.tensor([0.5, 0.25, 3.0])
    row_scale = {
        "shard": shard_scales.repeat_interleave(torch.tensor([14, 14, 12])),
        "row": torch.rand(40) + 0.1,
        "tensor": torch.full((40,), 0.75),
    }
    given = {"shard": shard_scales, "row": row_scale["row"], "tensor": torch.tensor([0.75])}
    for scaling, scales in given.items():
        want = (q.double() * row_scale[scaling].double().view(40, 1)).float()
        assert torch.equal(UF.dequantize(q, scales, scaling, torch.float32), want), scaling


def test_convert_by_name():
    model = torch.nn.ModuleDict(
        {
            "attn": torch.nn.Linear(4, 8),
            "mlp": torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)),
        }
    )
    assert UF.convert_to_fp8_all_gather(model, include="mlp.*") == ["mlp.0", "mlp.2"]
    assert isinstance(model["mlp"][0].weight.data, UF.FP8AllGatherWeight)
    assert isinstance(model["mlp"][0].weight, torch.nn.Parameter) and model["mlp"][0].weight.requires_grad
    assert not isinstance(model["attn"].weight.data, UF.FP8AllGatherWeight)
    assert UF.convert_to_fp8_all_gather(model, include=lambda name, m: name == "attn") == ["attn"]
    # a second conversion applies (issue 40 C4: it returned [] and kept the first scaling), to the same
    # Parameter objects, so an optimizer made in between still holds them
    weight = model["mlp"][0].weight
    assert UF.convert_to_fp8_all_gather(model, scaling="tensor") == ["attn", "mlp.0", "mlp.2"]
    assert model["mlp"][0].weight is weight and weight._scaling == "tensor" and weight._scale is None
    UF.convert_to_fp8_all_gather(model, include="attn", scaling="static", scale=torch.tensor([0.5]))
    assert model["attn"].weight._scaling == "static" and model["attn"].weight._scale.tolist() == [0.5]
    assert model["mlp"][2].weight._scaling == "tensor"
    with pytest.raises(ValueError, match="scale is required"):  # checked before any layer changes
        UF.convert_to_fp8_all_gather(model, scaling="static")
    assert model["mlp"][2].weight._scaling == "tensor"
    # the converted layer computes as before
    x = torch.randn(2, 4)
    assert torch.equal(
        model["attn"](x), torch.nn.functional.linear(x, model["attn"].weight._tensor, model["attn"].bias)
    )


def test_missing_fsdp2_api_is_named(monkeypatch):
    from torch.distributed.fsdp import FSDPModule

    monkeypatch.delattr(FSDPModule, "set_custom_all_gather")
    with pytest.raises(RuntimeError, match=r"torch >= 2.9 .*set_custom_all_gather"):
        UF.require_fsdp2()


def _pair():
    """A converted model (one "row", one "static" layer) and a plain one of the same shapes."""

    def make():
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))

    torch.manual_seed(0)
    converted, plain = make(), make()
    UF.convert_to_fp8_all_gather(converted, include="0")
    UF.convert_to_fp8_all_gather(converted, include="2", scaling="static", scale=torch.tensor([0.5]))
    return converted, plain


def _assert_converted(model, comm):
    assert model[0].weight._scaling == "row" and model[2].weight._scaling == "static"
    assert model[2].weight._scale.tolist() == [0.5]
    for layer in (model[0], model[2]):
        assert isinstance(layer.weight, UF.FP8AllGatherWeight) and isinstance(layer.weight, torch.nn.Parameter)
        assert layer.weight.requires_grad and layer.weight._comm is comm


def _sgd_step(model, x):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(x).square().mean().backward()
    opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_fp8_checkpoint_is_plain_and_loads_both_ways(tmp_path):
    """A converted model's state dict holds its plain weights (sharing their memory), so torch.load's
    defaults (weights_only) read it; it loads into a model without FP8 and back, and the converted
    model stays converted (scaling, scale, communicator), also with assign=True."""
    converted, plain = _pair()
    comm = object()  # stands for use_ubnext_collectives's communicator
    for layer in (converted[0], converted[2]):
        layer.weight._comm = comm
    state = converted.state_dict()
    assert all(type(v) is torch.Tensor for v in state.values())
    assert state["0.weight"].data_ptr() == converted[0].weight._tensor.data_ptr()
    torch.save(state, tmp_path / "fp8.pt")
    loaded = torch.load(tmp_path / "fp8.pt")
    assert all(type(v) is torch.Tensor and torch.equal(v, state[k]) for k, v in loaded.items())
    plain.load_state_dict(loaded)
    assert all(torch.equal(v, loaded[k]) for k, v in plain.state_dict().items())

    # the reverse: a plain checkpoint into the converted model, copied and assigned
    for assign in (False, True):
        torch.manual_seed(1 + assign)
        other = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
        torch.save(other.state_dict(), tmp_path / "plain.pt")
        converted.load_state_dict(torch.load(tmp_path / "plain.pt"), assign=assign)
        _assert_converted(converted, comm)
        assert all(torch.equal(v, other.state_dict()[k]) for k, v in converted.state_dict().items())
    # and it trains as the plain model does (the layer computes with its high-precision weight)
    x = torch.randn(3, 4)
    assert all(torch.equal(a, b) for a, b in zip(_sgd_step(converted, x), _sgd_step(other, x)))
    _assert_converted(converted, comm)
    # keep_vars asks for the parameters themselves, not for a checkpoint
    assert converted.state_dict(keep_vars=True)["0.weight"] is converted[0].weight


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_converting_after_fully_shard_is_refused(one_rank_group):
    """Issue 40 C4: converted after fully_shard, the layers reported success and the first forward
    failed inside FSDP2 ('FP8AllGatherWeight' object has no attribute '_local_tensor'). Now the
    conversion refuses, saying to convert first; also a converted model converted again once sharded.
    A one-rank gloo mesh on CPU: the refusal needs FSDP2's DTensor parameters, no collective."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1,))
    plain = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    fully_shard(plain, mesh=mesh)
    with pytest.raises(ValueError, match=r"\['0', '2'\] are DTensors.*Convert first, then fully_shard"):
        UF.convert_to_fp8_all_gather(plain)
    assert not any(isinstance(p._local_tensor, UF.FP8AllGatherWeight) for p in plain.parameters())

    converted, _ = _pair()
    fully_shard(converted, mesh=mesh)
    with pytest.raises(ValueError, match="Convert first, then fully_shard"):
        UF.convert_to_fp8_all_gather(converted, scaling="tensor")
    assert converted[0].weight._local_tensor._scaling == "row"
