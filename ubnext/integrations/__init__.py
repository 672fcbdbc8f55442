"""ubnext inside other frameworks: one subpackage per framework, each opt-in (``ubnext.integrations.vllm``:
vLLM's ``vllm.general_plugins`` entry point, switched on by ``UBNEXT_VLLM=1``; docs/VLLM.md).

The integrations sit at the top of ubnext's layers: they may import every public part of ubnext, and
nothing in ubnext imports them (docs/ARCHITECTURE.md, tests/unit/test_structure.py)."""
