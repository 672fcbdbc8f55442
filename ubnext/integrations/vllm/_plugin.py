"""What the plugin changes in vLLM when ``UBNEXT_VLLM=1`` (imported by ``register()`` only then; it imports
vLLM). Each change is recorded in ``CHANGES`` and reported by ``worker_stats()``:

1. ``Platform.get_device_communicator_cls()`` returns ``ubnext.integrations.vllm.Ubnext<Base>`` for the
   bases in ``BASES`` (vLLM's ``CpuCommunicator`` and ``CudaCommunicator``); other platforms keep theirs.
2. ``Platform.use_custom_op_collectives()`` returns True on CPU (CUDA's already does), so that
   ``GroupCoordinator.all_reduce`` goes through ``torch.ops.vllm.all_reduce(x, group_name)``: an opaque
   operator in compiled graphs, which the pass can match and name by vLLM's group, where the CPU's
   direct call would be traced into whatever the communicator runs.
3. ``Platform.check_and_update_config`` is wrapped; after the platform's own, it sets
   ``pass_config.fuse_allreduce_rms = False`` (FlashInfer's fusion; ubnext's pass takes those sites),
   ``ir_enable_torch_wrap = True`` where the backend is Inductor (the CPU platform turns it off under
   ``DYNAMO_TRACE_ONCE``; without it vLLM's RMSNorm is traced as plain arithmetic), and puts the pass in
   ``inductor_compile_config["post_grad_custom_post_pass"]`` (chaining a pass the user put there). Under
   ``VLLM_COMPILE`` vLLM's ``PostGradPassManager`` runs that entry after its own fusion passes and before
   its IR lowering; under ``DYNAMO_TRACE_ONCE`` Inductor runs it directly. No private pass manager is
   patched.

All three are public or documented hooks of vLLM 0.32 and 0.33 (read in both); ``register()`` refuses
other versions before any of this runs."""

from __future__ import annotations

import logging
from typing import Any

from vllm.compilation.passes.inductor_pass import InductorPass

from ._pass import UbnextVllmPass

log = logging.getLogger("ubnext")

# our class name -> the vLLM base it extends (qualified name, as Platform.get_device_communicator_cls gives it)
BASES = {
    "UbnextCpuCommunicator": "vllm.distributed.device_communicators.cpu_communicator.CpuCommunicator",
    "UbnextCudaCommunicator": "vllm.distributed.device_communicators.cuda_communicator.CudaCommunicator",
}
PASS_KEY = "post_grad_custom_post_pass"
CHANGES: list[str] = []
CONFIG_CHANGES: list[str] = []


class VllmPass(UbnextVllmPass, InductorPass):
    """The pass as vLLM's config and pass manager take it (an ``InductorPass``); uuid: UbnextVllmPass's."""


def adjust_config(vllm_config: Any) -> list[str]:
    """Change 3 (see the module docstring) on a VllmConfig; returns what changed."""
    from vllm.config import CompilationMode

    changed = []
    cc = vllm_config.compilation_config
    if getattr(cc.pass_config, "fuse_allreduce_rms", False):
        cc.pass_config.fuse_allreduce_rms = False
        changed.append("pass_config.fuse_allreduce_rms: True -> False")
    if cc.mode not in (None, CompilationMode.NONE) and cc.backend == "inductor":
        if not cc.ir_enable_torch_wrap:
            cc.ir_enable_torch_wrap = True
            changed.append("compilation_config.ir_enable_torch_wrap: False -> True")
        existing = cc.inductor_compile_config.get(PASS_KEY)
        if not isinstance(existing, VllmPass):
            cc.inductor_compile_config[PASS_KEY] = VllmPass(existing)
            changed.append(
                f"inductor_compile_config[{PASS_KEY!r}]: the ubnext pass" + (" (chained)" if existing else "")
            )
    else:
        changed.append(f"no pass: compilation mode {cc.mode}, backend {cc.backend!r}")
    CONFIG_CHANGES[:] = changed
    return changed


def install() -> list[str]:
    """Changes 1 to 3 on the current platform's class; returns what changed."""
    from vllm.platforms import current_platform

    platform_cls = type(current_platform)
    base = current_platform.get_device_communicator_cls()
    ours = next((name for name, qualified in BASES.items() if qualified == base), None)
    if ours is None:
        log.warning(
            "ubnext: UBNEXT_VLLM=1, but platform %s's communicator %s is not one ubnext serves: vLLM left as it is",
            platform_cls.__name__,
            base,
        )
        return []
    target = f"ubnext.integrations.vllm.{ours}"
    platform_cls.get_device_communicator_cls = classmethod(lambda cls: target)
    CHANGES.append(f"{platform_cls.__name__}.get_device_communicator_cls: {base} -> {target}")
    if not current_platform.use_custom_op_collectives():
        platform_cls.use_custom_op_collectives = classmethod(lambda cls: True)
        CHANGES.append(f"{platform_cls.__name__}.use_custom_op_collectives: False -> True")
    original = platform_cls.check_and_update_config

    def check_and_update_config(cls: type, vllm_config: Any) -> None:
        original(vllm_config)
        adjust_config(vllm_config)

    platform_cls.check_and_update_config = classmethod(check_and_update_config)
    CHANGES.append(f"{platform_cls.__name__}.check_and_update_config: wrapped (fusion pass, see config changes)")
    return list(CHANGES)


def base_class(ours: str) -> type:
    from vllm.utils.import_utils import resolve_obj_by_qualname

    return resolve_obj_by_qualname(BASES[ours])
