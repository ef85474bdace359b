#!/usr/bin/env bash
# Creates (or reuses) the test environment of one Megatron-Bridge release of
# requirements/releases.conf (no argument: the default, 0.6.2 in .venv): its Python, the pinned CPU
# test stack of its lock file, the real megatron-core and megatron-bridge, and bridge_fgo itself
# (editable). Idempotent: a stamp of the inputs skips the heavy part when nothing changed.
# Usage: scripts/setup_env.sh [RELEASE]. PYTHON chooses the interpreter (it must be the release's
# Python version); BRIDGE_FGO_VENV the directory.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$root/scripts/releases.sh"
release_row "${1:-}"
venv=${BRIDGE_FGO_VENV:-$root/$REL_VENV}
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

stamp_input=$(cat "$lock" "$root/pyproject.toml" "$0" "$root/scripts/releases.sh"
              echo "$REL_BRIDGE $REL_PYTHON $MCORE $BRIDGE $NVRX")
stamp=$(printf '%s' "$stamp_input" | sha256sum | cut -d' ' -f1)
if [ -f "$venv/.bridge_fgo_stamp" ] && [ "$(cat "$venv/.bridge_fgo_stamp")" = "$stamp" ]; then
  exit 0
fi

py=$(pick_python)
echo "setup_env: creating $venv (megatron-bridge $REL_BRIDGE) with: $py" >&2
rm -rf "$venv"
$py -m venv "$venv"
got=$("$venv/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [ "$got" != "$REL_PYTHON" ]; then
  echo "setup_env: $py is Python $got; megatron-bridge $REL_BRIDGE is tested on $REL_PYTHON" >&2
  exit 1
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
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
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  "${pip[@]}" install --no-deps --only-binary=:all: --platform manylinux_2_39_x86_64 --python-version "$REL_PYTHON" \
    --implementation cp --upgrade --target "$site" "$NVRX"
fi
"${pip[@]}" install --no-deps -e "$root"
echo "$stamp" > "$venv/.bridge_fgo_stamp"
echo "setup_env: ready ($venv)" >&2
