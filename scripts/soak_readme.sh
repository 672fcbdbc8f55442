#!/usr/bin/env bash
# Opt-in soak: run the README's drop-in block N times (default 20) under each of mpirun -np 2
# and torchrun --nproc-per-node 2, with and without UBNEXT_EMULATE=1, and count non-zero exits.
# Exits non-zero if any run failed; failed runs' output is kept under build/soak/.
source "$(dirname "$0")/_setup.sh"
export UBNEXT_CACHE_DIR="${UBNEXT_CACHE_DIR:-$ROOT/build/cache}"
runs="${1:-20}"
out="$ROOT/build/soak"
mkdir -p "$out"
python - "$out/block.py" <<'PY'
import sys
from tests.mpi.test_readme_snippet import readme_block
open(sys.argv[1], "w").write(readme_block())
PY
failed=0
for launcher in mpirun torchrun; do
  for emulate in 0 1; do
    bad=0
    for i in $(seq 1 "$runs"); do
      log="$out/$launcher-emu$emulate-$i.log"
      if [ "$launcher" = mpirun ]; then
        cmd=(mpirun -np 2 python "$out/block.py")
      else
        cmd=(python -m torch.distributed.run --standalone --nproc-per-node 2 "$out/block.py")
      fi
      if UBNEXT_EMULATE=$emulate timeout 300 "${cmd[@]}" > "$log" 2>&1; then
        rm -f "$log"
      else
        bad=$((bad + 1))
      fi
    done
    echo "$launcher UBNEXT_EMULATE=$emulate: $((runs - bad))/$runs exited 0"
    failed=$((failed + bad))
  done
done
exit $((failed > 0))
