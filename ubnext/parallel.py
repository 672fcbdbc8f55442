"""ParallelStyles for torch's tensor-parallel API: ``parallelize_module`` with a plan dict, the
convention of torchtitan-style code, turning ``nn.Linear`` children into ``ubnext.nn.Linear``.

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from ubnext.parallel import ColwiseParallel, RowwiseParallel

    mesh = init_device_mesh("cuda", (tp,))
    parallelize_module(block, mesh, {"mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel()})

Each style takes this rank's shard of the dense layer's weights (the layout of ``ubnext.nn``) and
converts the module in place: with a plan dict, ``parallelize_module`` discards what a style
returns for a child (torch/distributed/tensor/parallel/api.py), so the child object itself must
become the tensor-parallel layer. The dense weights come from rank ``src_data_rank`` of the group
(``parallelize_module``'s argument, default 0), broadcast before sharding, as torch's own styles
do; with ``src_data_rank=None`` each rank shards its own copy, which must then be the same on
every rank. The conversion keeps the module's training mode and each parameter's
``requires_grad``; it refuses a module with hooks (convert before registering them), and a weight
tied to another module's (an ``lm_head`` sharing the embedding) is not tied afterwards: keep tied
layers out of the plan. Activations stay ordinary tensors (no DTensor): a column-parallel layer's
output is this rank's shard of the features, a row-parallel layer takes that shard and returns
the full, all-reduced output.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor.parallel.style import ParallelStyle

from .nn import Linear

__all__ = ["ColwiseParallel", "RowwiseParallel", "check_attention_heads", "distributed_state_dict"]


def _mesh_group(device_mesh):
    if device_mesh.ndim != 1:
        raise ValueError(
            f"ubnext's styles take a 1-D (tensor-parallel) mesh, got {device_mesh.ndim} dimensions; "
            "pass the tensor-parallel sub-mesh (mesh['tp'])"
        )
    return device_mesh.get_group()


def _hooks(module: torch.nn.Module) -> list[str]:
    names = (
        "_forward_hooks",
        "_forward_pre_hooks",
        "_backward_hooks",
        "_backward_pre_hooks",
        "_state_dict_hooks",
        "_state_dict_pre_hooks",
        "_load_state_dict_pre_hooks",
        "_load_state_dict_post_hooks",
    )
    return [name for name in names if getattr(module, name, None)]


def _become(module: torch.nn.Module, layer: Linear) -> Linear:
    """Make ``module`` (the object its parent holds) the tensor-parallel ``layer``, in the dense
    module's training mode and with its parameters' requires_grad."""
    layer.train(module.training)
    for name, param in layer.named_parameters(recurse=False):
        dense = getattr(module, name, None)
        if isinstance(dense, torch.nn.Parameter):
            param.requires_grad_(dense.requires_grad)
    module.__dict__.clear()
    module.__dict__.update(layer.__dict__)
    module.__class__ = Linear
    return module  # type: ignore[return-value]


class _LinearStyle(ParallelStyle):
    parallel_mode = ""

    def __init__(self, symmetric_ar_type: str | None = None, *, eps: float = 1e-6):
        self.symmetric_ar_type = symmetric_ar_type
        self.eps = eps

    def _apply(self, module: torch.nn.Module, device_mesh) -> torch.nn.Module:
        if type(module) is not torch.nn.Linear:
            raise TypeError(f"{type(self).__name__} converts torch.nn.Linear modules, got {type(module).__name__}")
        hooks = _hooks(module)
        if hooks:
            raise ValueError(
                f"{type(self).__name__} replaces the module in place and would drop its hooks "
                f"({', '.join(hooks)}): parallelize before registering them"
            )
        group = _mesh_group(device_mesh)
        if self.src_data_rank is not None:
            source = dist.get_global_rank(group, self.src_data_rank)
            with torch.no_grad():
                for param in module.parameters():
                    dist.broadcast(param.data, src=source, group=group)
        layer = Linear.from_dense(
            module,
            parallel_mode=self.parallel_mode,
            tp_group=group,
            symmetric_ar_type=self.symmetric_ar_type,
            eps=self.eps,
        )
        return _become(module, layer)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(symmetric_ar_type={self.symmetric_ar_type!r})"


class ColwiseParallel(_LinearStyle):
    """Column-parallel ``ubnext.nn.Linear``: output features sharded; ``symmetric_ar_type``
    (None, 'nccl' or 'ubnext') all-reduces the input gradient in the backward."""

    parallel_mode = "column"


class RowwiseParallel(_LinearStyle):
    """Row-parallel ``ubnext.nn.Linear``: input features sharded, output all-reduced by
    ``symmetric_ar_type`` (default 'ubnext'; 'ubnext_add_rms' fuses the residual add and the
    RMSNorm that follow: the layer then takes ``forward(x, residual)``)."""

    parallel_mode = "row"

    def __init__(self, symmetric_ar_type: str | None = "ubnext", *, eps: float = 1e-6):
        super().__init__(symmetric_ar_type, eps=eps)


def check_attention_heads(num_heads: int, num_kv_heads: int, tp: int) -> None:
    """Attention sharded by heads needs whole query and key/value heads on every rank: a GQA
    key/value head split across ranks would pair queries with the wrong keys."""
    bad = [f"{what} {count}" for what, count in (("heads", num_heads), ("key/value heads", num_kv_heads)) if count % tp]
    if bad:
        raise ValueError(
            f"tensor parallelism {tp} must divide the attention heads ({num_heads}) and the key/value "
            f"heads ({num_kv_heads}); it does not divide {' or '.join(bad)}"
        )


def _placement(layer: Linear, name: str):
    from torch.distributed.tensor import Replicate, Shard

    dim = layer.shard_dim(name)
    return Replicate() if dim is None else Shard(dim)


def distributed_state_dict(model: torch.nn.Module) -> dict:
    """``model.state_dict()`` with every tensor-parallel ``ubnext.nn.Linear``'s tensors as DTensors
    over its group: column weight and bias ``Shard(0)``, row weight ``Shard(1)``, row bias and norm
    weight ``Replicate()``. They share the parameters' memory, so

        dcp.save(distributed_state_dict(model), checkpoint_id=path)   # the global tensors
        dcp.load(distributed_state_dict(other), checkpoint_id=path)   # into other's parameters

    loads a checkpoint saved at one tensor-parallel size into a model of another (or into a
    dense model's plain ``state_dict()``, when the names match: a ``'ubnext_add_rms'`` layer's
    ``norm_weight`` is the following norm's weight, under another name in a dense model):
    torch.distributed.checkpoint reshards by the placements."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    state = model.state_dict()
    meshes: dict[str, DeviceMesh] = {}
    for prefix, layer in model.named_modules(remove_duplicate=False):  # as state_dict() names them
        if not isinstance(layer, Linear) or layer.parallel_mode is None:
            continue
        group = layer._group()
        key = f"{group.group_name}/{layer.weight.device.type}"
        if key not in meshes:
            meshes[key] = DeviceMesh.from_group(group, layer.weight.device.type)
        for name, param in layer.named_parameters(recurse=False):
            full = f"{prefix}.{name}" if prefix else name
            state[full] = DTensor.from_local(param.detach(), meshes[key], [_placement(layer, name)], run_check=False)
    return state
