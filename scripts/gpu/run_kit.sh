#!/usr/bin/env bash
# Usage (on the device): scripts/gpu/run_kit.sh [--te DIR] [--apex DIR] [--logs DIR] -- COMMAND [ARG...]
# Installs the carried wheel kit (.whl/*.whl, from prepare_wheels.sh) into /tmp/site, puts the repo,
# /tmp/site and the optional Transformer Engine (te_install.sh's /tmp/te) and apex folders on
# PYTHONPATH, runs COMMAND (e.g. python3 scripts/bench_offload.py all --out-dir /tmp/bench/te ...),
# then tars the logs folder (default /tmp/bench) into $OUT/bench-logs.tgz (bench-logs-<folder>.tgz for
# another folder, so that two kit runs in one call keep both) and copies its summary.json files beside it.
# The exit status is COMMAND's.
set -euo pipefail
usage="usage: $0 [--te DIR] [--apex DIR] [--logs DIR] -- COMMAND [ARG...]"
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
te='' apex='' logs=/tmp/bench
while [[ $# -gt 0 && "$1" != -- ]]; do
  case "$1" in
    --te) te=$2; shift 2 ;; --apex) apex=$2; shift 2 ;; --logs) logs=$2; shift 2 ;;
    *) echo "$usage" >&2; exit 2 ;;
  esac
done
[[ $# -ge 2 ]] || { echo "$usage" >&2; exit 2; }
shift
ls "$root"/.whl/*.whl >/dev/null 2>&1 || { echo "no .whl/*.whl: run prepare_wheels.sh here and carry .whl" >&2; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$root"/.whl/*.whl
export PYTHONPATH="${te:+$te:}${apex:+$apex:}/tmp/site:$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$logs"
if [[ -n "$te" ]]; then  # pydantic (the kit) is needed by transformer_engine.common.recipe
  python3 -c 'import transformer_engine as t, transformer_engine.pytorch, transformer_engine_torch; print("transformer_engine", t.__version__)' 2>&1 | tail -3
fi
[[ -z "$apex" ]] || python3 -c 'import apex.optimizers, amp_C; print("apex and amp_C import")' 2>&1 | tail -3
echo "+ $*"
rc=0
(cd "$root" && "$@") 2>&1 | tee "$logs/console.log" || rc=$?
if [[ -n "${OUT:-}" ]]; then
  tgz=bench-logs.tgz; [[ "$logs" == /tmp/bench ]] || tgz="bench-logs-$(basename "$logs").tgz"
  tar czf "$OUT/$tgz" -C "$(dirname "$logs")" "$(basename "$logs")"
  rm -f "$OUT"/partial-*.tgz  # deadline_runs.sh's tarball after each run: this one holds it all
  # each summary.json beside it too, while $OUT holds fewer than 8 files (what comes back)
  find "$logs" -name summary.json | sort | while read -r f; do
    [[ $(find "$OUT" -type f | wc -l) -lt 8 ]] || break
    rel=$(dirname "${f#"$logs"/}"); cp "$f" "$OUT/summary-$(echo "${rel/#./logs}" | tr -c 'A-Za-z0-9._\n-' '_').json"; done
fi
exit "$rc"
