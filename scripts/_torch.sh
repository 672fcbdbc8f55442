# Sourced by scripts/_setup.sh and scripts/floor_check.sh: install_torch puts torch into the active
# venv when it has none. A GPU machine gets the default (CUDA) torch; a CPU-only one the CPU pin,
# never the default index's several GB of CUDA wheels.
TORCH_CPU_VERSION="2.13.0"

# install_torch [PIP_ARGS...]: the extra arguments (a constraints file, say) go to every pip call
install_torch() {
  if python -c "import torch" >/dev/null 2>&1; then
    return 0
  fi
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "[setup] GPU found and no torch: installing the default (CUDA) torch"
    python -m pip install -q "$@" torch
  else
    echo "[setup] no GPU: installing the CPU torch $TORCH_CPU_VERSION+cpu"
    # The exact CPU pin from pip's configured sources first (a local wheel where one lies in
    # find-links, its dependencies from the configured index); only then PyTorch's CPU index,
    # without retries, so an unreachable index costs seconds, not minutes.
    python -m pip install -q "$@" "torch==$TORCH_CPU_VERSION+cpu" ||
      python -m pip install -q --retries 0 --timeout 20 "$@" "torch==$TORCH_CPU_VERSION+cpu" \
        --index-url https://download.pytorch.org/whl/cpu
  fi
}
