#!/usr/bin/env bash
# Opt-in soak (issue 40 item 8): `python -m ubnext.bench --model --world 8` RUNS times quiet, then RUNS
# times with one core kept busy by a shell loop; prints each run's wall time and exit status, and exits
# non-zero if any run failed. Not in scripts/test.sh: one run is ~20-25 s on two cores (~40-60 s loaded).
#   bash scripts/soak_eight_ranks.sh [RUNS]      (default 5)
set -u
cd "$(dirname "$0")/.."
RUNS=${1:-5}
[ -f .venv/bin/activate ] && source .venv/bin/activate
export UBNEXT_CACHE_DIR=${UBNEXT_CACHE_DIR:-$PWD/build/cache}
python -m ubnext.runtime._emu build >/dev/null || exit 1
log=$(mktemp -d)
fails=0
run() {  # $1: label
  local t0 t1 rc
  t0=$(date +%s%N)
  python -m ubnext.bench --model --world 8 >"$log/$1.out" 2>"$log/$1.err"
  rc=$?
  t1=$(date +%s%N)
  printf '%-10s %6d ms  rc=%d\n' "$1" "$(( (t1 - t0) / 1000000 ))" "$rc"
  if [ "$rc" -ne 0 ]; then fails=$((fails + 1)); tail -5 "$log/$1.err"; fi
}
for i in $(seq "$RUNS"); do run "quiet$i"; done
( while :; do :; done ) &
busy=$!
trap 'kill $busy 2>/dev/null' EXIT
for i in $(seq "$RUNS"); do run "loaded$i"; done
kill $busy 2>/dev/null
echo "failed: $fails of $((2 * RUNS)); logs in $log"
[ "$fails" -eq 0 ]
