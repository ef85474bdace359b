#!/usr/bin/env bash
# Usage (on a two-GPU device, under run_kit.sh --te /tmp/te): scripts/gpu/bench_ckpt.sh [GROUP...]
#   GROUP: one-dp, one-full, one-dp-1t, one-fsdp, one-first (one GPU), dp2-dp, dp2-full, dp2-fsdp (data-parallel 2);
#   -dp: dp_reshardable (Bridge's default), -full: fully_reshardable, -fsdp: Megatron-FSDP (optim_grads_params,
#   Transformer Engine's layers, deterministic_mode: without it two runs of TE's layers differ, 2026-11-28) and
#   its fsdp_dtensor format; -1t: each run started with OMP_NUM_THREADS=1, as
#   torchrun starts every rank of a multi-GPU run; one-first: one-dp's load and the FIRST_ITERS (default 4)
#   iterations after it, no saves (about half a run's time: more repetitions of setup, the load and the first
#   iteration in one call). Default: one-dp one-full dp2-dp dp2-full (more than one device call holds: see below).
# Issue 43: checkpoint I/O with and without offload. Per group, one base run saves a checkpoint at
# iteration 2 (PREP); then REPS runs of each mode (base, builtin[, a variant]), interleaved, each resumed from it (the
# load, the first iteration after it, setup), training to 8 and saving every 2 iterations: at 4
# asynchronously (the first stall), at 6 asynchronously (the next one; where the first is still pending, with
# offload it gets a second snapshot, or finishes the first without room: the summary says how long finishing
# took), at 8 synchronously (BENCH_SYNC_AT). The first run of each mode keeps its checkpoints, compared
# byte for byte at 4 and 8 (scripts/ckpt_summary.py --compare); every other checkpoint is removed at once.
# A run is skipped when fewer than MIN_S seconds remain before DEADLINE_S or when its JSON exists (a later
# call on the same warm machine goes on where the last stopped). Ends with summary.txt (medians, spread,
# ratios against the targets); results and logs in /tmp/i43, tarred into $OUT with summary-i43.txt.
# The model: the 887M model's shape with LAYERS layers (default 4, about 0.32B parameters, a 3.8 GB
# checkpoint) so that a group's 7 runs fit about 4.5 minutes; LAYERS=16 is the 887M model itself (about
# 2.5x longer runs: one group a call). BENCH_LOAD_THREADS=N (passed to every run): torch's threads during the
# load, with and without offload alike (scripts/bench_saves.py). BENCH_PROFILE_LOAD=N: each run's load profiled
# (the summary shows where its time went); BENCH_LOAD_REGISTER=before|beside|after: the buffer registered before the
# load, beside its reads, or after them (the default); BENCH_LOAD_TOUCH=before|skip: its pages faulted in before
# the load, or not (unset: the engine's choice, not where the load brings the states; bench_saves.py);
# BENCH_CKPT_RESULTS=DIR: the results there (default /tmp/i43; the checkpoints in DIRck), so a second pass of a
# group under other settings runs in the same call (--logs DIR to get it back).
# BENCH_CKPT_VARIANT="NAME VAR=VALUE...[; NAME VAR=VALUE...]": one more mode each, builtin-NAME (builtin with those
# variables), run in each repetition right after base and builtin, its checkpoints compared with base's too:
# settings compared within one call's noise (a load varied by 0.8 s between runs of one call without offload, one
# H200, 2026-11-29). PROFILE_FIRST=1: after the repetitions, one run of base and one of builtin with the first
# iteration after the load under torch.profiler (GROUP_MODE_profile: op tables and timeline beside its JSON; not in
# the summary).
set -u
DEADLINE_S=${DEADLINE_S:-540}
MIN_S=${MIN_S:-45}
REPS=${REPS:-3}
LAYERS=${LAYERS:-4}
OPT=${OPT:-te}
R=${BENCH_CKPT_RESULTS:-/tmp/i43}; CK=${R}ck; mkdir -p $R $CK
FIRST_ITERS=${FIRST_ITERS:-4}
name_re='^[a-z0-9]+$' env_re='^([A-Z_][A-Z0-9_]*=[^ ]*( |$))+$'
declare -A VARIANT_ENV
MODES="base builtin"
IFS=';' read -ra specs <<< "${BENCH_CKPT_VARIANT:-}"
for spec in "${specs[@]}"; do
  read -r name env <<< "$spec"
  if [[ ! ( $name =~ $name_re && $env =~ $env_re ) || -n ${VARIANT_ENV[$name]:-} ]]; then
    echo "BENCH_CKPT_VARIANT='$BENCH_CKPT_VARIANT': 'NAME VAR=VALUE...[; NAME VAR=VALUE...]' (each NAME once, of a-z" \
      "and 0-9)" >&2; exit 2
  fi
  VARIANT_ENV[$name]=$env MODES+=" builtin-$name"
done
source "$(dirname "${BASH_SOURCE[0]}")/deadline_runs.sh"   # run NAME CMD..., left, PATCH, start
B="scripts/bench_offload.py run --optimizer $OPT --layers $LAYERS"
cmd() {  # cmd LAYOUT MODE: the launch of one run
  local launch
  case $1 in
    one) launch="python3 $B" ;;
    one1t) launch="env OMP_NUM_THREADS=1 python3 $B" ;;
    dp2) launch="torchrun --standalone --nproc-per-node 2 $B" ;;
  esac
  case $2 in
    base) echo "$launch --mode base" ;;
    builtin) echo "$PATCH $launch --mode builtin" ;;
    builtin-*) echo "env ${VARIANT_ENV[${2#builtin-}]} $PATCH $launch --mode builtin" ;;
  esac
}
group() {  # [SAVES=0] group NAME LAYOUT FORMAT-ARGS...
  local g=$1 layout=$2 saves=${SAVES:-1}; shift 2
  local fmt="$*"
  run ${g}_prep $(cmd $layout base) --iters 2 --save $CK/$g/prep --save-interval 2 $fmt
  for rep in $(seq 1 $REPS); do
    for mode in $MODES; do
      local name=${g}_${mode}_r${rep}
      if [[ $saves == 1 ]]; then
        run $name env BENCH_SYNC_AT=8 $(cmd $layout $mode) --iters 8 --load $CK/$g/prep --ckpt-step 2 \
          --save $CK/$g/$name --save-interval 2 --async-save $fmt
      else
        run $name $(cmd $layout $mode) --iters $((2 + FIRST_ITERS)) --load $CK/$g/prep --ckpt-step 2 $fmt
      fi
      [[ $rep == 1 ]] || rm -rf $CK/$g/$name
    done
  done
  if [[ ${PROFILE_FIRST:-0} == 1 ]]; then
    for mode in base builtin; do
      run ${g}_${mode}_profile $(cmd $layout $mode) --iters 4 --load $CK/$g/prep --ckpt-step 2 --profile-iter 1 $fmt
    done
  fi
  # kept while a later call needs it: a run of the group without its JSON (it resumes from prep), or a compare
  local missing=0 ours cmp
  for ours in ${MODES#base }; do
    [[ $saves == 1 ]] || continue
    cmp=$R/${g}_compare; [[ $ours == builtin ]] || cmp=$R/${g}_${ours}_compare
    if [[ ! -f $cmp.json && -d $CK/$g/${g}_base_r1 && -d $CK/$g/${g}_${ours}_r1 ]]; then
      python3 scripts/ckpt_summary.py --compare $cmp.json $CK/$g/${g}_base_r1 $CK/$g/${g}_${ours}_r1 4 8 > $cmp.log 2>&1
      echo "COMPARE $g $ours: $(tr '\n' ' ' < $cmp.log)"
    fi
    [[ -f $cmp.json ]] || missing=1
  done
  for rep in $(seq 1 $REPS); do for mode in $MODES; do [[ -f $R/${g}_${mode}_r${rep}.json ]] || missing=1; done; done
  [[ ${PROFILE_FIRST:-0} != 1 ]] || for mode in base builtin; do [[ -f $R/${g}_${mode}_profile.json ]] || missing=1; done
  [[ $missing == 1 ]] || rm -rf $CK/$g
}
[[ $# -gt 0 ]] || set -- one-dp one-full dp2-dp dp2-full
for g in "$@"; do
  case $g in
    one-dp) group one-dp one ;;
    one-full) group one-full one --fully-reshardable ;;
    one-dp-1t) group one-dp-1t one1t ;;
    one-fsdp) group one-fsdp one --fsdp optim_grads_params --te-spec --deterministic ;;
    one-first) SAVES=0 group one-first one ;;
    dp2-dp) group dp2-dp dp2 ;;
    dp2-full) group dp2-full dp2 --fully-reshardable ;;
    dp2-fsdp) group dp2-fsdp dp2 --fsdp optim_grads_params --te-spec --deterministic ;;
    *) echo "unknown group $g (one-dp, one-full, one-dp-1t, one-fsdp, one-first, dp2-dp, dp2-full, dp2-fsdp)" >&2 ;;
  esac
done
python3 scripts/ckpt_summary.py $R | tee $R/summary.txt
df -h /tmp /dev/shm | tee -a $R/summary.txt
if [[ -n "${OUT:-}" ]]; then
  tar czf "$OUT/$(basename $R)-$(date +%H%M).tgz" -C "$(dirname $R)" "$(basename $R)"
  cp $R/summary.txt "$OUT/summary-$(basename $R).txt"
fi
