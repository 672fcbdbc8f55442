"""A small Llama-style model made tensor-parallel through torch's own API, with ubnext's styles.

    UBNEXT_EMULATE=1 mpirun -np 2 python examples/llama_tp.py     # CPU: kernels on the emulator
    mpirun -np 8 python examples/llama_tp.py                      # one GPU per rank
    UBNEXT_EMULATE=1 mpirun -np 2 python examples/llama_tp.py --compile model   # torch's styles + fusion

Every rank builds the same dense model (same seed), computes its output as the reference, then
parallelizes a copy with ``parallelize_module`` and a plan dict: q/k/v and gate/up column-parallel,
o and down row-parallel through ubnext. Attention is sharded by heads, so the tensor-parallel size
must divide the query and the key/value heads (checked, naming both). With ``--fused``, each
layer's o projection also does the residual add and the post-attention RMSNorm in one ubnext call
(``RowwiseParallel('ubnext_add_rms')`` and the layer's forward taking that path).

With ``--compile model`` the model stays as written: torch's own ``ColwiseParallel`` and
``RowwiseParallel`` make it tensor-parallel, ``ubnext.fusion.enable()`` and ``torch.compile`` do the
rest. The compiled graph holds each row-parallel output's all-reduce (DTensor's Partial to
Replicate) followed by the residual add and the next RMSNorm, and the pass runs the fused op there:
at every post-attention norm, and at every post-MLP norm (the next layer's input norm, the final
norm after the last layer). ``--compile block`` compiles each layer on its own, as per-block
compilation does: the post-MLP norm then lies in the next graph, so only the post-attention norms
are fused and each MLP's all-reduce runs as a plain ``ubnext.all_reduce``.

Self-contained rather than transformers' LlamaForCausalLM: the block below is the same
computation (RMSNorm, rotary-free GQA attention, SwiGLU MLP) in 60 lines, and keeps the example
and its CI run free of a large dependency.

Exit status 0 when the tensor-parallel output matches the dense one within the bound below and
is bitwise identical on every rank.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

import ubnext
from ubnext.parallel import ColwiseParallel, RowwiseParallel, check_attention_heads


class RMSNorm(torch.nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(torch.nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int):
        super().__init__()
        self.head_dim = hidden // heads
        self.q_proj = torch.nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k_proj = torch.nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v_proj = torch.nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o_proj = torch.nn.Linear(heads * self.head_dim, hidden, bias=False)

    def heads(self, x):
        # head counts from the projections' outputs: whole on one rank, this rank's share when sharded
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        b, t, _ = x.shape
        q, k, v = (p.view(b, t, -1, self.head_dim).transpose(1, 2) for p in (q, k, v))
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # GQA: each kv head serves a group
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(1, 2).reshape(b, t, -1)


class DecoderLayer(torch.nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn: int):
        super().__init__()
        self.input_norm = RMSNorm(hidden)
        self.attn = Attention(hidden, heads, kv_heads)
        self.post_attention_norm = RMSNorm(hidden)
        self.gate_proj = torch.nn.Linear(hidden, ffn, bias=False)
        self.up_proj = torch.nn.Linear(hidden, ffn, bias=False)
        self.down_proj = torch.nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        a = self.attn.heads(self.input_norm(x))
        if getattr(self.attn.o_proj, "symmetric_ar_type", None) == "ubnext_add_rms":
            # o projection, allreduce, residual add and the post-attention norm in one call
            normed, h = self.attn.o_proj(a, x)
        else:
            h = x + self.attn.o_proj(a)
            normed = self.post_attention_norm(h)
        return h + self.down_proj(F.silu(self.gate_proj(normed)) * self.up_proj(normed))


class Model(torch.nn.Module):
    def __init__(self, vocab=128, hidden=64, heads=8, kv_heads=4, ffn=176, layers=2):
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.layers = torch.nn.ModuleList(DecoderLayer(hidden, heads, kv_heads, ffn) for _ in range(layers))
        self.norm = RMSNorm(hidden)
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def torch_tensor_parallel(model: Model, tp: int) -> Model:
    """The same plan with torch's own styles: the model's modules stay nn.Linear (DTensor weights)."""
    from torch.distributed.tensor.parallel import ColwiseParallel as TorchColwise
    from torch.distributed.tensor.parallel import RowwiseParallel as TorchRowwise

    check_attention_heads(model.heads, model.kv_heads, tp)
    mesh = init_device_mesh(ubnext.get_communicator().device.type, (tp,))
    plan = {
        f"layers.*.{name}": TorchColwise()
        for name in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "gate_proj", "up_proj")
    }
    plan.update({"layers.*.attn.o_proj": TorchRowwise(), "layers.*.down_proj": TorchRowwise()})
    parallelize_module(model, mesh, plan)
    return model


def tensor_parallel(model: Model, tp: int, fused: bool) -> Model:
    """The plan dict of torchtitan-style code, with ubnext's styles."""
    check_attention_heads(model.heads, model.kv_heads, tp)
    mesh = init_device_mesh(ubnext.get_communicator().device.type, (tp,))
    plan = {
        "layers.*.attn.q_proj": ColwiseParallel(),
        "layers.*.attn.k_proj": ColwiseParallel(),
        "layers.*.attn.v_proj": ColwiseParallel(),
        "layers.*.attn.o_proj": RowwiseParallel("ubnext_add_rms" if fused else "ubnext"),
        "layers.*.gate_proj": ColwiseParallel(),
        "layers.*.up_proj": ColwiseParallel(),
        "layers.*.down_proj": RowwiseParallel(),
    }
    parallelize_module(model, mesh, plan)
    if fused:
        for layer in model.layers:
            with torch.no_grad():  # the fused call owns the norm that follows it
                layer.attn.o_proj.norm_weight.copy_(layer.post_attention_norm.weight)
    return model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fused", action="store_true", help="fuse o_proj with the residual add and RMSNorm")
    parser.add_argument(
        "--compile",
        choices=("model", "block"),
        help="torch's own styles, ubnext.fusion and torch.compile of the whole model or of each layer",
    )
    args = parser.parse_args()
    comm = ubnext.get_communicator()  # initialises torch.distributed from mpirun/torchrun
    rank, tp, device = dist.get_rank(), dist.get_world_size(), comm.device
    torch.manual_seed(0)
    dense = Model()
    with torch.no_grad():
        for p in dense.parameters():  # norm weights away from 1, so that a lost norm weight shows
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    tokens = torch.randint(0, 128, (2, 12))
    reference = copy.deepcopy(dense).double()(tokens)
    dense32 = dense.to(device)(tokens.to(device)).detach().cpu().double()
    if args.compile:
        model = torch_tensor_parallel(copy.deepcopy(dense).to(device), tp)
        ubnext.fusion.enable()
        if args.compile == "model":
            model = torch.compile(model)
        else:
            for layer in model.layers:
                layer.compile()
    else:
        model = tensor_parallel(copy.deepcopy(dense).to(device), tp, args.fused)
    with torch.no_grad():
        logits = model(tokens.to(device)).cpu().double()
    # Bound: fp32 against the fp64 model. The dense fp32 model's own error is the rounding of this
    # computation in this order; tensor parallelism only splits the row-parallel dot products into
    # per-rank partial sums added in another order (and the fused norm sums in fp32 too), which
    # changes each sum by a few roundings of its size, u * |sum| (u = 2^-24). So the tensor-parallel
    # error stays within twice the dense one plus a few u * max|logit|; a real mistake (a lost norm
    # weight, a wrong eps, a wrong shard) is orders of magnitude larger.
    u = 2.0**-24
    dense_err = (dense32 - reference).abs().max().item()
    bound = 2 * dense_err + 8 * u * reference.abs().max().item()
    err = (logits - reference).abs().max().item()
    if args.compile:  # the layers are torch's; the communicator saw the compiled code's calls
        paths = [comm.last_path]
        rewritten = ubnext.fusion.stats()
        # sites per compiled graph: with --compile block, one graph serves every layer
        how = (
            f"compile={args.compile}: {rewritten['all_reduce_add_rmsnorm']} all_reduce_add_rmsnorm, "
            f"{rewritten['all_reduce']} all_reduce in the compiled graphs"
        )
    else:
        paths = sorted(
            {layer.down_proj.last_path for layer in model.layers}
            | {layer.attn.o_proj.last_path for layer in model.layers}
        )
        o_proj = model.layers[0].attn.o_proj
        how = f"o_proj {type(o_proj).__name__}({o_proj.symmetric_ar_type!r})"
    blobs = [None] * tp
    dist.all_gather_object(blobs, logits.numpy().tobytes())
    if rank == 0:
        print(
            f"tp={tp} fused={args.fused} max |logits - fp64 dense| = {err:.3e} (bound {bound:.3e}, dense fp32 "
            f"{dense_err:.3e}); o_proj and down_proj allreduce paths {paths}; {how}"
        )
    ok = err <= bound and all(b == blobs[0] for b in blobs)
    if rank == 0 and not ok:
        print("FAILED: " + ("over the bound" if err > bound else "ranks' logits differ"))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
