#!/usr/bin/env bash
# The test command: sets up .venv if needed (scripts/setup_env.sh: shared by the checkouts of a machine),
# then runs the whole suite against the real megatron-core 0.19.2 and megatron-bridge 0.6.2 on CPU,
# spread over the machine's cores (pytest-xdist; `-n 0` runs it in one process). Extra arguments go to
# pytest. The other Bridge releases: scripts/test_releases.sh (what CI runs).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/setup_env.sh"
cd "$root"
# one thread per process: the workers and the tests' own subprocesses already fill the cores
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$root/.venv/bin/python" -m pytest -n auto --dist worksteal "$@"
