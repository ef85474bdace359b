#!/usr/bin/env bash
# The whole suite against each Megatron-Bridge release of requirements/releases.conf (or the ones
# named), each in its own cached environment (scripts/setup_env.sh RELEASE). Arguments after `--` go
# to pytest. Runs every release even after a failure, prints one summary line per release, and exits
# non-zero if any release failed, including pytest's exit 5 (no tests ran).
# Usage: scripts/test_releases.sh [RELEASE...] [-- PYTEST_ARGS...]
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$root/scripts/releases.sh"
releases=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do releases+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
[ ${#releases[@]} -eq 0 ] && mapfile -t releases < <(release_names)

cd "$root"
summary=() failed=0
for rel in "${releases[@]}"; do
  release_row "$rel" || exit 2
  start=$SECONDS
  echo "== megatron-bridge $rel (Python $REL_PYTHON, megatron-core $REL_MCORE): $REL_VENV" >&2
  if ! bash "$root/scripts/setup_env.sh" "$rel"; then
    summary+=("$rel: FAILED to set up its environment"); failed=1; continue
  fi
  log=$(mktemp)
  # the venv's own console scripts (bridge-fgo, bridge-fgo-run, torchrun) are what the tests run. A suite
  # that hangs is stopped after TEST_TIMEOUT_S (SIGABRT: pytest's faulthandler prints where each thread
  # waits), so the other releases still run and CI fails with the place, not at its own limit
  # spread over the cores as scripts/test.sh does
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} timeout --signal=ABRT --kill-after=30 "${TEST_TIMEOUT_S:-1800}" \
    "$root/$REL_VENV/bin/python" -m pytest -n auto --dist worksteal "$@" 2>&1 \
    | tee "$log"
  rc=${PIPESTATUS[0]}
  counts=$(grep -E '^=*.* in [0-9.]+s' "$log" | tail -n 1 | sed -E 's/^=+ //; s/ =+$//')
  rm -f "$log"
  case $rc in
    0) verdict=ok ;;
    5) verdict="FAILED (no tests ran)"; failed=1 ;;
    124|137) verdict="FAILED (stopped after ${TEST_TIMEOUT_S:-1800} s: a hang? the traceback is above)"; failed=1 ;;
    *) verdict="FAILED (pytest exit $rc)"; failed=1 ;;
  esac
  summary+=("$rel: $verdict: ${counts:-no summary}; $((SECONDS - start)) s with set-up")
done
echo "== summary" >&2
printf '%s\n' "${summary[@]}" >&2
exit "$failed"
