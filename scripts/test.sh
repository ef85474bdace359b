#!/usr/bin/env bash
# The test command: sets up .venv if needed, then runs the whole suite against the real
# megatron-core 0.19.2 and megatron-bridge 0.6.2 on CPU. Extra arguments go to pytest.
# The other Bridge releases: scripts/test_releases.sh (what CI runs).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/setup_env.sh"
cd "$root"
exec "$root/.venv/bin/python" -m pytest "$@"
