#!/usr/bin/env bash
# The main job: set up .venv if needed, then run the demo against the real Megatron-Bridge.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$root/scripts/setup_env.sh"
# this checkout's bridge_fgo first, whatever checkout the shared environment's editable install points at
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec "$root/.venv/bin/python" -W ignore "$root/scripts/demo.py"
