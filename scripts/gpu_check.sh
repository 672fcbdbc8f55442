#!/usr/bin/env bash
# On a GPU node: the GPU test tier and the benchmark in one go (one rank per GPU).
# Output also goes to ${OUT:-build}/gpu_check.log.
source "$(dirname "$0")/_setup.sh"
out="${OUT:-$ROOT/build}"
mkdir -p "$out"
export UBNEXT_CACHE_DIR="${UBNEXT_CACHE_DIR:-$ROOT/build/cache}"
ngpu=$(python -c "import torch; print(torch.cuda.device_count())")
{
  nvidia-smi -L || true
  python -m ubnext.kernels build --arch sm_90 sm_100 --fail-on-spill
  # tests/gpu includes two communicators with kernels in flight on two streams in opposite orders
  # (case two_comms_two_streams: the grid cap of csrc/host/launch_rules.h keeps them deadlock-free)
  # tests/gpu/test_gpu_pdl.py: programmatic dependent launch, its overlap and a kernel without its wait
  python -m pytest -q -rs tests/gpu
  if [ "$ngpu" -ge 2 ]; then
    mpirun -np "$ngpu" python -m ubnext.bench
    mpirun -np "$ngpu" python -m ubnext.bench --fused
    # every path against NCCL and torch's symmetric-memory op at the same sizes; the ratios go to
    # docs/PERF.md (commit them with the run's log)
    paths="lamport nvls_lamport nvls_twoshot twoshot torch_symm"
    mpirun -np "$ngpu" python -m ubnext.bench --algo $paths --sizes 8k 64k 512k 2m 8m 32m --ratios docs/PERF.md
    mpirun -np "$ngpu" python -m ubnext.bench --fused --algo lamport nvls_lamport nvls_twoshot twoshot \
      --sizes 16k 64k 512k 2m 8m --ratios docs/PERF.md
    # one FSDP2 training step: NCCL's collectives, torch's symmetric-memory staging, ubnext's
    for mode in nccl torch_symm ubnext; do
      mpirun -np "$ngpu" python scripts/fsdp_step_bench.py --mode "$mode"
    done
  else
    echo "bench: needs >= 2 GPUs for a collective ($ngpu found)"
  fi
} 2>&1 | tee "$out/gpu_check.log"
exit "${PIPESTATUS[0]}"
