#!/usr/bin/env bash
# Megatron-Bridge's own training unit tests (tests/unit_tests/training of a Bridge source tree), run
# on CPU against the INSTALLED megatron-bridge of .venv, unpatched and under bridge_fgo.patch(offload=MODE):
# "do no harm" (issue 44). Prints one summary line per way and the tests that pass unpatched but fail
# patched. docs/development.md#bridge-unit-tests.
#
#   bash scripts/bridge_unit_tests.sh BRIDGE_SRC [WAY...] [-- PYTEST_ARGS...]
#
# BRIDGE_SRC: a Megatron-Bridge source tree, or a clone of its git repository (bare or not): then the
# commit of scripts/bridge_ut/bridge.ref is extracted into .bridge-src/ (git-ignored; without docs/).
# WAY: none (unpatched), off, auto, builtin (default: all four). The test's path is relative to
# BRIDGE_SRC (default tests/unit_tests/training; pass another after --). Results: .bridge-ut/WAY.{xml,log}.
# FGO_UT_WORKERS (default 2) xdist workers, FGO_UT_TIMEOUT (default 300) seconds per test.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
usage="usage: $0 BRIDGE_SRC|BRIDGE_GIT_DIR [none|off|auto|builtin ...] [-- PYTEST_ARGS...]"
[ $# -ge 1 ] || { echo "$usage" >&2; exit 2; }
if [ ! -d "$1/tests/unit_tests" ] && git -C "$1" rev-parse --git-dir >/dev/null 2>&1; then
  read -r ref _ <"$root/scripts/bridge_ut/bridge.ref"
  rm -rf "$root/.bridge-src"; mkdir "$root/.bridge-src"
  git -C "$1" archive "$ref" -- . ':(exclude)docs' | tar -x -C "$root/.bridge-src"
  echo "Megatron-Bridge $ref extracted into .bridge-src/"
  set -- "$root/.bridge-src" "${@:2}"
fi
[ -d "$1/tests/unit_tests" ] || { echo "$usage" >&2; exit 2; }
src=$(cd "$1" && pwd); shift
ways=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do ways+=("$1"); shift; done
[ $# -gt 0 ] && shift
[ ${#ways[@]} -gt 0 ] || ways=(none off auto builtin)
args=("$@"); [ ${#args[@]} -gt 0 ] || args=(tests/unit_tests/training)
out="$root/.bridge-ut"; mkdir -p "$out"
py="$root/.venv/bin/python"
for way in "${ways[@]}"; do
  start=$(date +%s)
  # from the tree's root: its pyproject.toml (markers) and conftests apply; pytest puts the root (not
  # src/) on sys.path, so `megatron.bridge` is the installed one (the plugin checks), `tests.` is the tree's
  (cd "$src" && OMP_NUM_THREADS=1 FGO_UT_MODE="$way" PYTHONPATH="$root/scripts/bridge_ut:$root" \
    "$py" -m pytest -p fgo_ut_plugin -p no:cacheprovider --tb=native -n "${FGO_UT_WORKERS:-2}" \
    --junitxml="$out/$way.xml" -o junit_family=xunit1 "${args[@]}") >"$out/$way.log" 2>&1 || true
  echo "$way: $(( $(date +%s) - start )) s" >"$out/$way.time"
  grep -m2 -E '^(bridge_fgo|megatron.bridge):' "$out/$way.log" || { tail -20 "$out/$way.log"; exit 1; }
done
"$py" "$root/scripts/bridge_ut/compare.py" "$out" "${ways[@]}"
