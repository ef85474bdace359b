# Sourced by the GPU benchmark scripts (bench_node.sh, bench_fp8.sh, ...): runs that resume across device calls.
# Needs R (results folder), DEADLINE_S and MIN_S set; `start` is the sourcing script's start, or the call's
# where DEADLINE_FROM holds it (`DEADLINE_FROM=$(date +%s)` first in the device command: an install before
# the script then counts too, and the kit's tarball is written before the call's limit).
# run NAME CMD...: runs CMD with `--out $R/NAME.json` added, its output in $R/NAME.log, unless that JSON
# exists (an earlier call on the same machine made it) or fewer than MIN_S seconds are left.
start=$((SECONDS - (${DEADLINE_FROM:+$(date +%s) - DEADLINE_FROM} + 0)))
PATCH="python3 -m bridge_fgo.cli.launcher --offload builtin"
left() { echo $((DEADLINE_S - (SECONDS - start))); }
run() {
  local name=$1; shift
  if [[ -f $R/$name.json ]]; then echo "DONE $name"; return; fi
  if [[ $(left) -lt $MIN_S ]]; then echo "SKIP $name ($(left) s left)"; return; fi
  local t0=$SECONDS
  timeout $(($(left) - 10)) "$@" --out $R/$name.json > $R/$name.log 2>&1
  echo "RUN $name rc=$? $((SECONDS - t0)) s"
  # what is done so far comes back even if the call's limit ends it before run_kit.sh tars the whole (which
  # removes this one)
  [[ -z "${OUT:-}" ]] || tar czf "$OUT/partial-$(basename "$R").tgz" -C "$(dirname "$R")" "$(basename "$R")"
}
