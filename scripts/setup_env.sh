#!/usr/bin/env bash
# Creates (or reuses) .venv: Python 3.12, the pinned CPU test stack, the real megatron-core and
# megatron-bridge, and bridge_fgo itself (editable, with its test extra). Idempotent: a stamp of the
# inputs skips the heavy part when nothing changed. Set PYTHON to choose the interpreter.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${BRIDGE_FGO_VENV:-$root/.venv}
MCORE=megatron-core==0.19.2
BRIDGE=megatron-bridge==0.6.2
NVRX=nvidia-resiliency-ext==0.6.0

pick_python() {
  if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"; return; fi
  # pyenv machines: a bare python3.12 fails while the global version is 3.11.
  if command -v pyenv >/dev/null 2>&1; then
    v=$(pyenv versions --bare 2>/dev/null | grep -E '^3\.12\.[0-9]+$' | sort -V | tail -n 1 || true)
    if [ -n "$v" ]; then echo "env PYENV_VERSION=$v python3.12"; return; fi
  fi
  echo python3.12
}

stamp_input=$(cat "$root/requirements/test-stack.lock" "$root/pyproject.toml" "$0"; echo "$MCORE $BRIDGE $NVRX")
stamp=$(printf '%s' "$stamp_input" | sha256sum | cut -d' ' -f1)
if [ -f "$venv/.bridge_fgo_stamp" ] && [ "$(cat "$venv/.bridge_fgo_stamp")" = "$stamp" ]; then
  exit 0
fi

py=$(pick_python)
echo "setup_env: creating $venv with: $py" >&2
rm -rf "$venv"
$py -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
"${pip[@]}" install -U pip
"${pip[@]}" install -r "$root/requirements/test-stack.lock"
# Megatron's own requirements would drag Transformer Engine and friends: the lock holds what importing
# Bridge's training modules needs, so these go in without dependencies.
"${pip[@]}" install --no-deps "$MCORE" "$BRIDGE"
# Bridge 0.6.2's pretrain.py imports nvidia_resiliency_ext unconditionally. 0.6.0 ships only
# manylinux_2_39 wheels (newer glibc than Debian 12's 2.36, so pip refuses it) and 0.4.1 lacks the
# __version__ Megatron-Core reads; the Python parts of 0.6.0 import fine, so place them by hand.
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"${pip[@]}" install --no-deps --only-binary=:all: --platform manylinux_2_39_x86_64 --python-version 3.12 \
  --implementation cp --upgrade --target "$site" "$NVRX" defusedxml==0.7.1
"${pip[@]}" install --no-deps -e "$root"
echo "$stamp" > "$venv/.bridge_fgo_stamp"
echo "setup_env: ready ($venv)" >&2
