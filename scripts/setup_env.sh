#!/usr/bin/env bash
# Creates (or reuses) the test environment of one Megatron-Bridge release of
# requirements/releases.conf (no argument: the default, 0.6.2 in .venv): its Python, the pinned CPU
# test stack of its lock file, the real megatron-core and megatron-bridge, and bridge_fgo itself
# (editable).
#
# Built once per machine: the heavy part (5.6 GB: torch, the stack, Megatron) lives in a cache shared
# by every checkout, under ${XDG_CACHE_HOME:-~/.cache}/bridge-fgo/envs/RELEASE-STAMP, STAMP a hash of
# every input (the lock, the release's line, these scripts); the checkout's .venv (REL_VENV) is a link
# to it. A fresh clone on a machine that built it before costs a link and bridge_fgo's editable install.
# Changing an input builds a new one; `rm -rf ~/.cache/bridge-fgo` frees them all.
#
# Usage: scripts/setup_env.sh [RELEASE]. PYTHON chooses the interpreter (it must be the release's
# Python version); BRIDGE_FGO_VENV a directory of its own instead of the shared one (built in place).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$root/scripts/releases.sh"
release_row "${1:-}"
lock=$root/requirements/$REL_LOCK
MCORE=megatron-core==$REL_MCORE
BRIDGE=megatron-bridge==$REL_BRIDGE
NVRX=nvidia-resiliency-ext==$REL_NVRX

pick_python() {
  if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"; return; fi
  # pyenv machines: a bare python3.X fails while pyenv's global version is another one.
  if command -v pyenv >/dev/null 2>&1; then
    v=$(pyenv versions --bare 2>/dev/null | grep -E "^${REL_PYTHON//./\\.}\.[0-9]+$" | sort -V | tail -n 1 || true)
    if [ -n "$v" ]; then echo "env PYENV_VERSION=$v python$REL_PYTHON"; return; fi
  fi
  echo "python$REL_PYTHON"
}

# the heavy part's inputs (bridge_fgo itself is installed editable: its sources are not among them)
stamp=$(printf '%s' "$(cat "$lock" "$0" "$root/scripts/releases.sh"; echo "$REL_BRIDGE $REL_PYTHON $MCORE $BRIDGE $NVRX")" \
        | sha256sum | cut -c1-16)

build() {  # build the heavy part into $1 (a new directory)
  local env=$1 py got site
  py=$(pick_python)
  echo "setup_env: creating $env (megatron-bridge $REL_BRIDGE) with: $py" >&2
  $py -m venv "$env"
  got=$("$env/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  if [ "$got" != "$REL_PYTHON" ]; then
    echo "setup_env: $py is Python $got; megatron-bridge $REL_BRIDGE is tested on $REL_PYTHON" >&2
    return 1
  fi
  local pip=("$env/bin/python" -m pip --disable-pip-version-check -q)
  "${pip[@]}" install -U pip
  "${pip[@]}" install -r "$lock"
  # Megatron's own requirements would drag Transformer Engine and friends: the lock holds what importing
  # Bridge's training modules needs, so these go in without dependencies.
  "${pip[@]}" install --no-deps "$MCORE" "$BRIDGE"
  # Bridge's pretrain.py imports nvidia_resiliency_ext unconditionally. Bridge 0.3.1 pins 0.4.1
  # (manylinux_2_31: installs normally). For the others: 0.6.0 ships only manylinux_2_39 wheels (newer
  # glibc than Debian 12's 2.36, so pip refuses it) and 0.4.1 lacks the __version__ Megatron-Core >= 0.17
  # reads; the Python parts of 0.6.0 import fine, so where pip refuses them, place them by hand.
  "${pip[@]}" install --no-deps defusedxml==0.7.1
  if ! "${pip[@]}" install --no-deps --only-binary=:all: "$NVRX" 2>/dev/null; then
    site=$("$env/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    "${pip[@]}" install --no-deps --only-binary=:all: --platform manylinux_2_39_x86_64 --python-version "$REL_PYTHON" \
      --implementation cp --upgrade --target "$site" "$NVRX"
  fi
  echo "$stamp" > "$env/.bridge_fgo_stamp"
}

editable() {  # bridge_fgo from this checkout, editable, in environment $1 (unless it is already)
  local env=$1 target
  target=$("$env/bin/python" - <<'EOF'
import json
from importlib import metadata
try:
    print(json.loads(metadata.distribution("bridge-fgo").read_text("direct_url.json") or "{}").get("url", ""))
except metadata.PackageNotFoundError:
    print("")
EOF
)
  local want="file://$root"
  if [ "$target" = "$want" ] && [ -f "$env/.bridge_fgo_pyproject" ] \
      && cmp -s "$env/.bridge_fgo_pyproject" "$root/pyproject.toml"; then
    return 0
  fi
  "$env/bin/python" -m pip --disable-pip-version-check -q install --no-deps -e "$root"
  cp "$root/pyproject.toml" "$env/.bridge_fgo_pyproject"
}

if [ -n "${BRIDGE_FGO_VENV:-}" ]; then  # a directory of its own, built in place
  venv=$BRIDGE_FGO_VENV
  if ! { [ -f "$venv/.bridge_fgo_stamp" ] && [ "$(cat "$venv/.bridge_fgo_stamp")" = "$stamp" ]; }; then
    rm -rf "$venv"
    build "$venv"
  fi
  editable "$venv"
  exit 0
fi

cache=${XDG_CACHE_HOME:-$HOME/.cache}/bridge-fgo/envs
shared=$cache/$REL_BRIDGE-$stamp
venv=$root/$REL_VENV
mkdir -p "$cache"
exec 9>"$cache/.lock-$REL_BRIDGE"
flock 9  # one build per release at a time; checkouts of the same machine wait for it
if ! [ -f "$shared/.bridge_fgo_stamp" ]; then
  rm -rf "$shared"
  if ! build "$shared"; then rm -rf "$shared"; exit 1; fi
fi
touch "$shared/.bridge_fgo_stamp"  # last used: this release's environments unused for a week are removed
find "$cache" -maxdepth 2 -path "$cache/$REL_BRIDGE-*/.bridge_fgo_stamp" -mtime +7 -printf '%h\n' | xargs -r rm -rf
if [ "$(readlink "$venv" 2>/dev/null)" != "$shared" ]; then
  rm -rf "$venv"
  ln -s "$shared" "$venv"
fi
editable "$shared"
flock -u 9
