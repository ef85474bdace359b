#!/usr/bin/env bash
# The manual check for a Megatron-Bridge that is not on PyPI (main, a branch, a fork): builds a wheel
# from the source tree, installs it in place of the PyPI release in an environment of its own (made
# like the default release's, requirements/releases.conf's first line: Python, megatron-core, lock),
# and runs the whole suite there. Installing, not PYTHONPATH: the launcher and status tests start
# fresh interpreters with a PYTHONPATH of their own, and the package metadata then names the tree's
# version. Never run by CI (it cannot fetch the tree); nothing of the tree enters this checkout.
# Bridge main follows Megatron-LM main (its 3rdparty/Megatron-LM submodule, commit in .main.commit),
# not a PyPI megatron-core: --mcore /path/to/Megatron-LM installs megatron-core from that tree too.
# Usage: scripts/test_source_tree.sh [--mcore /path/to/Megatron-LM] /path/to/Megatron-Bridge [-- PYTEST_ARGS...]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
usage="usage: scripts/test_source_tree.sh [--mcore /path/to/Megatron-LM] /path/to/Megatron-Bridge [-- PYTEST_ARGS...]"
mcore_tree=
if [ "${1:-}" = "--mcore" ]; then mcore_tree=$(cd "${2:?$usage}" && pwd); shift 2; fi
tree=$(cd "${1:?$usage}" && pwd)
shift
[ "${1:-}" = "--" ] && shift
source "$root/scripts/releases.sh"
release_row ""
venv=$root/.venv-bridge-src
BRIDGE_FGO_VENV=$venv bash "$root/scripts/setup_env.sh"  # reused when cached; the tree's wheel replaces Bridge each run
wheels=$(mktemp -d)
# Bridge's build requirements (setuptools, torch) are already in the environment: no isolated build,
# which would download torch again.
"$venv/bin/python" -m pip --disable-pip-version-check -q wheel --no-deps --no-build-isolation -w "$wheels" "$tree"
"$venv/bin/python" -m pip --disable-pip-version-check -q install --no-deps --force-reinstall "$wheels"/megatron_bridge-*.whl
if [ -n "$mcore_tree" ]; then
  # Megatron-Core's build needs only setuptools/pybind11 (its C++ dataset helper is optional): isolated.
  "$venv/bin/python" -m pip --disable-pip-version-check -q wheel --no-deps -w "$wheels" "$mcore_tree"
  "$venv/bin/python" -m pip --disable-pip-version-check -q install --no-deps --force-reinstall "$wheels"/megatron_core-*.whl
else  # the release line's megatron-core, in case an earlier run replaced it
  "$venv/bin/python" -m pip --disable-pip-version-check -q install --no-deps --force-reinstall "megatron-core==$REL_MCORE"
fi
rm -rf "$wheels"
commit=$(git -C "$tree" rev-parse --short HEAD 2>/dev/null || echo "not a git checkout")
versions=$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("megatron-bridge"), m.version("megatron-core"))')
echo "== megatron-bridge ${versions% *} from $tree ($commit), megatron-core ${versions#* }${mcore_tree:+ from $mcore_tree}" >&2
cd "$root"
rc=0
"$venv/bin/python" -m pytest "$@" || rc=$?
[ "$rc" -eq 5 ] && { echo "no tests ran" >&2; exit 1; }
exit "$rc"
