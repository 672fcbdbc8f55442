"""FSDP2 (``fully_shard``) over the symmetric pool.

Two pieces, usable together or apart:

* :class:`AllGather` / :class:`ReduceScatter`: FSDP2's custom collectives
  (``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter``), on ubnext's kernels.
  ``allocate`` hands out pool buffers (``comm.empty``: the same offset on every rank, or an
  ordinary tensor on every rank when the pool is full), so the peers write the gathered
  parameters, and read the gradients to reduce, where FSDP2 keeps them. The reduce-scatter sums
  bf16 gradients in fp32 (bf16 traffic, one rounding). Anything the kernels cannot take goes to
  torch.distributed, logged once. :func:`use_ubnext_collectives` installs both on a model.
* :class:`FP8AllGatherWeight`: an ``nn.Linear`` weight whose shard is cast to e4m3 before the
  all-gather by one kernel that also writes its ``scale_inv``, and the two travel in the same
  all-gather, so the scale used is always the one written with the data: no separate amax
  all-reduce and no precompute step after the optimizer (torchao's tensorwise mode needs both).
  The optimizer keeps updating the high-precision shard. :func:`convert_to_fp8_all_gather`
  converts a model's ``nn.Linear`` layers by name.

Scaling modes of the FP8 weight (``scaling=``):

* ``"row"``: one scale per output row (``out_features``), as FSDP2 shards rows, each shard's
  scales are complete where they are computed;
* ``"shard"``: one scale per rank's shard;
* ``"tensor"``: one scale for the whole weight: the shards' amax is all-reduced (max) first,
  the semantics of torchao's tensorwise FP8 all-gather;
* ``"static"``: a scale the caller gives (a one-element fp32 tensor, read at each all-gather).

After the all-gather the weight is dequantised to FSDP2's ``param_dtype`` (``q * scale_inv``),
what a CPU or a GPU without FP8 GEMMs computes with; :func:`fp8_gathered` returns the gathered
``(q, scale_inv)`` of a layer for an FP8 GEMM (``torch._scaled_mm``) on GPUs that have one.

Streams: FSDP2 issues its collectives on its own streams. A communicator's kernels share one
sync region, so each op first orders its stream after the stream of the previous op
(``Communicator._order_after_other_stream``): ubnext's collectives never overlap one another,
whatever streams FSDP2 uses; they still overlap with compute.

Needs a torch with ``FSDPModule.set_custom_all_gather`` (torch >= 2.9, pytorch#155189) for the
collectives and the five-argument ``fsdp_pre_all_gather`` hook for the FP8 weight; both are
checked, with an error that says so.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from .comm import Communicator
from .reference._checks import FP8_MAX, FP8_TINY_SCALE_INV, POOL_DTYPES
from .runtime import _lifecycle

__all__ = [
    "AllGather",  # noqa: F822 (made on first use by the module's __getattr__)
    "ReduceScatter",  # noqa: F822
    "use_ubnext_collectives",
    "FP8AllGatherWeight",
    "convert_to_fp8_all_gather",
    "fp8_gathered",
    "SCALINGS",
    "require_fsdp2",
]

SCALINGS = ("row", "shard", "tensor", "static")
_NEEDS = "torch >= 2.9 (FSDPModule.set_custom_all_gather / set_custom_reduce_scatter, pytorch#155189)"


def require_fsdp2():
    """FSDP2's custom-collective API of the installed torch, or an error naming what is needed."""
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard import _fsdp_api
    except ImportError as exc:
        raise RuntimeError(f"ubnext.fsdp needs {_NEEDS}; torch {torch.__version__} has no FSDP2 ({exc})") from exc
    if not (hasattr(FSDPModule, "set_custom_all_gather") and hasattr(_fsdp_api, "AllGather")):
        raise RuntimeError(f"ubnext.fsdp needs {_NEEDS}; torch {torch.__version__} lacks it")
    return _fsdp_api


def _comm_of(comm: Communicator | None, group) -> Communicator:
    """The communicator that serves FSDP2's ``group``: the one given, which must span the same
    ranks, or the group's cached communicator."""
    if comm is None:
        return _lifecycle.communicator_of(group)
    if (
        group is not None
        and group is not comm.group
        and (dist.get_process_group_ranks(group) != dist.get_process_group_ranks(comm.group))
    ):
        raise ValueError(
            f"FSDP2 runs this collective over ranks {dist.get_process_group_ranks(group)}, but the "
            f"ubnext communicator spans {dist.get_process_group_ranks(comm.group)}: give each FSDP "
            "mesh its own communicator (or none: the group's own is used)"
        )
    return comm


class _PoolAlloc:
    """FSDP2's ``allocate``: a pool buffer (collective: FSDP2 allocates in the same order on every
    rank), placed by that order with no host round trip (comm.empty), or an ordinary tensor when
    the pool has no room or does not hold the dtype (an fp64 ``param_dtype``: its all-gather then
    passes through the staging region)."""

    def __init__(self, comm: Communicator | None = None):
        self.comm = comm

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        comm = self.comm if self.comm is not None else _lifecycle.communicator_of(None)
        shape = tuple(int(s) for s in size)
        if comm.mode == "torch" or device != comm.device or not shape or 0 in shape or dtype not in POOL_DTYPES:
            return torch.empty(shape, dtype=dtype, device=device)
        return comm.empty(shape, dtype=dtype)


def _classes():
    api = require_fsdp2()

    class AllGather(_PoolAlloc, api.AllGather):
        """FSDP2's all-gather on ubnext: ``fsdp_module.set_custom_all_gather(AllGather(comm))``."""

        def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
            _comm_of(self.comm, group).all_gather(input_tensor, out=output_tensor)
            return None  # stream-ordered: FSDP2 waits on its stream's event, not on a Work

    class ReduceScatter(_PoolAlloc, api.ReduceScatter):
        """FSDP2's reduce-scatter on ubnext (fp32 accumulation whatever the dtype):
        ``fsdp_module.set_custom_reduce_scatter(ReduceScatter(comm))``."""

        def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
            _comm_of(self.comm, group).reduce_scatter(input_tensor, op=op, out=output_tensor)
            return None

    return AllGather, ReduceScatter


def __getattr__(name: str):
    # the classes derive from torch's FSDP2 interfaces, which older torch lacks: made on first use
    if name in ("AllGather", "ReduceScatter"):
        all_gather, reduce_scatter = _classes()
        globals().update(AllGather=all_gather, ReduceScatter=reduce_scatter)
        return globals()[name]
    raise AttributeError(f"module 'ubnext.fsdp' has no attribute {name!r}")


def _shard_group(module) -> dist.ProcessGroup | None:
    """The process group over which FSDP2 all-gathers and reduce-scatters ``module``'s own
    parameters: its param group's shard group, or None when it has none (no parameters of its own,
    or a replicate-only mesh). Read from FSDP2's state, not from the parameters' DTensor mesh, which
    also spans the other dimensions: HSDP's replicate dimension and tensor parallelism's."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo

    # torch >= 2.9; torch 2.13 keeps it for a module with one param group and raises for several (a
    # per-parameter mesh from shard_placement_fn), where set_custom_all_gather refuses too
    param_group = module._get_fsdp_state()._fsdp_param_group
    if param_group is None:
        return None
    mesh_info = param_group.mesh_info
    return mesh_info.shard_process_group if isinstance(mesh_info, FSDPMeshInfo) else None


def use_ubnext_collectives(model: torch.nn.Module, comm: Communicator | None = None) -> int:
    """Install ubnext's all-gather and reduce-scatter on every FSDP2 module of ``model`` (after
    ``fully_shard``, and after ``convert_to_fp8_all_gather`` when used). Each module is served over
    its FSDP2 shard group: the whole mesh for plain FSDP, the shard dimension for HSDP (FSDP2 keeps
    the replicate all-reduce), the data-parallel mesh under tensor parallelism. ``comm`` defaults to
    the cached communicator of that group (``ubnext.get_communicator``); a given one must span the
    same ranks. Returns how many modules were set."""
    require_fsdp2()
    from torch.distributed.fsdp import FSDPModule

    all_gather, reduce_scatter = _classes()
    count = 0
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = _shard_group(module)
        if group is None:
            continue
        module_comm = _comm_of(comm, group)
        module.set_custom_all_gather(all_gather(module_comm))
        module.set_custom_reduce_scatter(reduce_scatter(module_comm))
        for param in module.parameters():  # the FP8 weights quantise through the same communicator
            local = getattr(param, "_local_tensor", param.data)
            if isinstance(local, FP8AllGatherWeight):
                local._comm = module_comm
        count += 1
    if not count:
        raise ValueError("no FSDP2 module with a shard group in the model: call fully_shard on it first")
    return count


# -- the FP8 weight ---------------------------------------------------------------------------------

_aten = torch.ops.aten
# FSDP2's sharding and copies of a parameter keep it an FP8AllGatherWeight; every other op sees
# the high-precision tensor (the optimizer's updates land in it)
_KEEP_SUBCLASS = {
    _aten.empty_like.default,
    _aten.new_zeros.default,
    _aten.slice.Tensor,
    _aten.copy_.default,
    _aten.view.default,
    _aten.as_strided.default,
    _aten._to_copy.default,
    _aten._pin_memory.default,
    _aten.split.Tensor,
    _aten.clone.default,
    _aten.detach.default,
    _aten.chunk.default,
    _aten.narrow.default,
}


def _check_scaling(scaling: str, scale: torch.Tensor | None) -> None:
    if scaling not in SCALINGS:
        raise ValueError(f"scaling must be one of {SCALINGS}, got {scaling!r}")
    if (scaling == "static") != (scale is not None):
        raise ValueError("scale is required with scaling='static' and meaningless otherwise")
    if scale is not None and (scale.numel() != 1 or scale.dtype != torch.float32):
        raise ValueError("scale must be a one-element float32 tensor (the dequantisation scale)")


class FP8AllGatherWeight(torch.Tensor):
    """A high-precision weight whose FSDP2 all-gather sends e4m3 data and its scale_inv.

    Behaves as the high-precision tensor it wraps for every op (the optimizer updates it); only
    FSDP2's hooks see the FP8 form. ``scaling`` is one of :data:`SCALINGS`; ``scale``, for
    ``"static"``, a one-element fp32 tensor (the dequantisation scale)."""

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, scaling: str = "row", scale: torch.Tensor | None = None):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            tensor.size(),
            strides=tensor.stride(),
            storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype,
            layout=tensor.layout,
            device=tensor.device,
            requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: torch.Tensor, scaling: str = "row", scale: torch.Tensor | None = None):
        _check_scaling(scaling, scale)
        self._tensor = tensor
        self._scaling = scaling
        self._scale = scale
        self._comm: Communicator | None = None  # use_ubnext_collectives's, else FSDP2's group's own

    # torch's stubs type Tensor.__torch_function__ as a classmethod of another signature; the
    # disabled impl is torch's own way to turn it off (torch.sparse's subclasses ignore it alike)
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    _gathered_at: int  # the storage address _set_gathered filed the gathered weight under, once set

    # mypy rejects every override of Tensor.__repr__, its own signature included (so does DTensor's)
    def __repr__(self) -> str:  # type: ignore[override]
        return f"FP8AllGatherWeight(scaling={self._scaling!r}, {self._tensor!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        found: list[FP8AllGatherWeight] = []

        def unwrap(t: FP8AllGatherWeight) -> torch.Tensor:
            found.append(t)
            return t._tensor

        args, kwargs = pytree.tree_map_only(cls, unwrap, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _KEEP_SUBCLASS:
            return out
        first = found[0]

        def rewrap(t: torch.Tensor) -> FP8AllGatherWeight:
            weight = cls(t, first._scaling, first._scale)
            # a copy (load_state_dict's copy_ / module_load, FSDP2's resharding) quantises through
            # the communicator use_ubnext_collectives chose, not the group's default one
            weight._comm = first._comm
            return weight

        return pytree.tree_map_only(torch.Tensor, rewrap, out)

    def __tensor_flatten__(self):
        names = ["_tensor"] + (["_scale"] if self._scale is not None else [])
        return names, {"scaling": self._scaling}

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return FP8AllGatherWeight(inner["_tensor"], meta["scaling"], inner.get("_scale"))

    # -- FSDP2's hooks ------------------------------------------------------------------------------

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """This rank's shard as (q, scale_inv), written by one kernel (comm.quantize_fp8). Rows that
        do not divide among the ranks: FSDP2 shards ceil(rows / N) per rank, the last ones short, and
        the short shards are padded with zero rows that get their own scales and are cut after the
        gather. FSDP2 then takes only inputs of the padded shard's shape from every rank, so q goes
        alone: scales that differ per rank ("row", "shard") take their own all-gather, on the same
        communicator and stream, and a scale every rank shares ("tensor", "static") stays here."""
        world = mesh.size()
        if len(outer_size) != 2:
            raise ValueError(f"FP8 all-gather needs a 2-D weight, got {tuple(outer_size)}")
        group = mesh.get_group()
        comm = _comm_of(self._comm, group)
        shard = self._tensor.contiguous()
        padded_rows = -(-outer_size[0] // world)
        uneven = outer_size[0] % world != 0
        if shard.shape[0] != padded_rows:
            shard = torch.cat([shard, shard.new_zeros(padded_rows - shard.shape[0], shard.shape[1])])
        if self._scaling == "row":
            q, scale_inv = comm.quantize_fp8(shard, scaling="row")
        elif self._scaling == "shard":
            q, scale_inv = comm.quantize_fp8(shard, scaling="tensor")
        else:
            if self._scaling == "tensor":
                amax = shard.detach().abs().amax().float().reshape(1)
                dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
                scale = torch.clamp(amax / FP8_MAX, min=FP8_TINY_SCALE_INV)
            else:
                scale = self._scale.to(shard.device)
            q, scale_inv = comm.quantize_fp8(shard, scaling="static", scale=scale)
        if not uneven:
            return (q, scale_inv), (self._scaling, tuple(outer_size), None)
        if self._scaling in ("row", "shard"):
            scale_inv = comm.all_gather(scale_inv)
        return (q,), (self._scaling, tuple(outer_size), scale_inv)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """The full weight, dequantised to ``param_dtype`` from the gathered (q, scale_inv), the
        padding rows of uneven shards cut off."""
        scaling, outer_size, scale_inv = metadata
        if scale_inv is None:
            q, scale_inv = all_gather_outputs
        else:
            (q,) = all_gather_outputs
        rows = outer_size[0]
        q = q[:rows]
        if scaling == "row":
            scale_inv = scale_inv[:rows]
        weight = dequantize(q, scale_inv, scaling, param_dtype)
        if out is not None:
            # out is FSDP2's unsharded Parameter, refilled in place (the backward's re-gather):
            # autograd saved it in the forward, and FSDP2 itself refills its gather buffers
            # without counting a version, as here, since the values are those that were saved
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
                out.copy_(weight)
            _set_gathered(self, out, q, scale_inv, scaling)
            return None
        _set_gathered(self, weight, q, scale_inv, scaling)
        return weight, (weight,)


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, scaling: str, dtype: torch.dtype) -> torch.Tensor:
    """``q * scale_inv`` of a gathered weight: scale_inv holds one value per row ("row"), or one
    per rank's shard of FSDP2's rows (ceil(rows / N) each, the last ones short: "shard"; equal on
    every rank, or a single value, for "tensor" and "static")."""
    rows = q.shape[0]
    if scaling == "row":
        row_scale = scale_inv.reshape(rows, 1)
    else:
        per = -(-rows // scale_inv.numel())
        row_scale = scale_inv.repeat_interleave(per)[:rows].reshape(rows, 1)
    return (q.float() * row_scale).to(dtype)


# storage address of a gathered weight -> (q, scale_inv, scaling) it was dequantised from. FSDP2
# wraps what fsdp_post_all_gather returns in a new Parameter that shares its storage, so the
# storage, not the object, identifies it; one entry per FP8AllGatherWeight.
_GATHERED: dict[int, tuple] = {}


def _set_gathered(owner: FP8AllGatherWeight, weight: torch.Tensor, q, scale_inv, scaling: str) -> None:
    previous = getattr(owner, "_gathered_at", None)
    if previous is not None:
        _GATHERED.pop(previous, None)
    owner._gathered_at = weight.untyped_storage().data_ptr()
    _GATHERED[owner._gathered_at] = (q, scale_inv, scaling)


def fp8_gathered(weight: torch.Tensor):
    """The ``(q, scale_inv, scaling)`` the unsharded weight of a converted layer was dequantised
    from (``layer.weight`` while FSDP2 holds the layer unsharded), or None: the operands of an FP8
    GEMM, ``weight ~= dequantize(q, scale_inv, scaling)``. They are FSDP2's all-gather buffers,
    valid until it reshards the layer."""
    return _GATHERED.get(weight.untyped_storage().data_ptr())


def convert_to_fp8_all_gather(
    model: torch.nn.Module,
    *,
    scaling: str = "row",
    scale: torch.Tensor | None = None,
    include: Callable[[str, torch.nn.Module], bool] | str = "*",
) -> list[str]:
    """Make the weights of ``model``'s ``nn.Linear`` layers FP8AllGatherWeights, before
    ``fully_shard``. ``include``: a glob over module names (``"layers.*.mlp.*"``) or a function
    ``(name, module) -> bool``. Returns the converted names.

    A layer converted already takes the new ``scaling`` and ``scale`` (its weight stays the same
    Parameter, so an optimizer made in between keeps it): the conversion only says how the weight
    is all-gathered, which nothing has used before ``fully_shard``. After ``fully_shard`` (or
    tensor parallelism) the weights are DTensors, which the conversion refuses: FSDP2 has set its
    parameters up from the plain weights, and a wrapped DTensor failed at the first forward."""
    _check_scaling(scaling, scale)
    chosen = include if callable(include) else (lambda name, _m: fnmatch.fnmatch(name, include))
    layers = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and chosen(name, module)
    ]
    sharded = [name for name, module in layers if hasattr(module.weight, "_local_tensor")]
    if sharded:
        raise ValueError(
            f"convert_to_fp8_all_gather: the weights of {sharded[:3]}{' ...' if len(sharded) > 3 else ''} "
            "are DTensors: the model is sharded already (fully_shard, or parallelize_module). "
            "Convert first, then fully_shard: convert_to_fp8_all_gather(model); fully_shard(...); "
            "use_ubnext_collectives(model)"
        )
    converted = []
    for name, module in layers:
        weight = module.weight
        if isinstance(weight, FP8AllGatherWeight):
            weight._scaling, weight._scale = scaling, scale
        else:
            module.weight = torch.nn.Parameter(
                FP8AllGatherWeight(weight.data, scaling, scale), requires_grad=weight.requires_grad
            )
        if not getattr(module, "_ubnext_fp8_state_dict_hooks", False):
            module.register_state_dict_post_hook(_plain_state_dict)
            module.register_load_state_dict_pre_hook(_fp8_load_state_dict)
            # torch's stubs admit only Tensors and Modules through Module.__setattr__; a flag is fine
            module._ubnext_fp8_state_dict_hooks = True  # type: ignore[assignment]
        converted.append(name)
    return converted


# -- checkpoints ------------------------------------------------------------------------------------
# A converted layer's state dict holds its plain high-precision weight (a DTensor over a plain local
# shard under FSDP2), as the unconverted layer's would: the subclass is how the weight is gathered,
# not what it is. So a checkpoint loads with torch.load's weights_only default and DCP's reader
# (neither accepts an unknown class), into models with or without ubnext, and DCP's planner sees
# an ordinary DTensor (its metadata and local shard) to reshard. A pickling hook (__reduce_ex__)
# would still leave the subclass in the state dict, where DCP's planner, get_model_state_dict's
# full_tensor() and load-time copies meet it; rewriting the state dict keeps it out of all of them.
# The plain tensors share the weights' memory, as state_dict's tensors do, so dcp.load into them
# fills the model in place.


def _fp8_local(tensor):
    """The FP8AllGatherWeight behind ``tensor`` (itself, or a DTensor's local shard), or None."""
    local = getattr(tensor, "_local_tensor", tensor)
    return local if isinstance(local, FP8AllGatherWeight) else None


def _with_local(tensor, local: torch.Tensor):
    """``local`` in place of ``tensor``: as a DTensor with ``tensor``'s mesh, placements and
    global shape when ``tensor`` is one."""
    if not hasattr(tensor, "_local_tensor"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local, tensor.device_mesh, tensor.placements, run_check=False, shape=tensor.shape, stride=tensor.stride()
    )


def _plain_state_dict(module, state_dict, prefix, local_metadata) -> None:
    for name, param in module._parameters.items():
        value = state_dict.get(prefix + name)
        # keep_vars=True asks for the Parameter objects themselves (not a checkpoint): left alone
        if value is None or value is param or (fp8 := _fp8_local(value)) is None:
            continue
        state_dict[prefix + name] = _with_local(value, fp8._tensor.detach())


def _fp8_load_state_dict(
    module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
) -> None:
    # load_state_dict copies into the FP8AllGatherWeight either way, but assign=True (and DCP's
    # set_model_state_dict onto meta parameters) installs the given tensor as the parameter: wrap
    # it first so that the layer keeps all-gathering in FP8
    for name, param in module._parameters.items():
        value = state_dict.get(prefix + name)
        current = None if param is None else _fp8_local(param)
        if current is None or not isinstance(value, torch.Tensor) or _fp8_local(value) is not None:
            continue
        if hasattr(value, "_local_tensor") != hasattr(param, "_local_tensor"):
            continue  # a DTensor against a plain tensor: load_state_dict's own error says so
        local = getattr(value, "_local_tensor", value)
        wrapped = FP8AllGatherWeight(local, current._scaling, current._scale)
        wrapped._comm = current._comm
        state_dict[prefix + name] = _with_local(value, wrapped)
