#!/usr/bin/env bash
# Usage (on a four-GPU device, under run_kit.sh --te /tmp/te): scripts/gpu/bench_node.sh GROUP...
#   hostlink  the host link shared by 1, 2 and 4 ranks (scripts/bench_hostlink.py)
#   dp4       data-parallel 4; tp2dp2: tensor-parallel 2 x data-parallel 2; moe_ep4: 8 layers of 8 experts,
#             expert-parallel 4 (data-parallel 4 for the dense part): each without and with offload
#   one       the same model on one GPU of this machine, without and with offload (the per-rank reference)
#   peer8     one GPU, 8 sequences of 2048 a step: no offload, the streamed step, Megatron-Core's CPU optimizer
#             (fractions 1.0 and 0.5), three times each, interleaved (bench_offload.py all)
#   peer64    one GPU, 64 sequences of 2048 a step: no offload and the streamed step three times, the CPU
#             optimizer once
#   async2    data-parallel 2, an asynchronous save every 4 iterations, without and with offload
#   recompute one GPU, full recomputation, without and with offload (the first step's window)
# Issue 35's and 36's GPU runs. A run is skipped when its JSON exists (a later call on the same machine
# goes on where the last stopped) or when fewer than MIN_S seconds remain before DEADLINE_S. Results and
# logs under /tmp/node (run_kit.sh --logs /tmp/node tars them into $OUT).
set -u
DEADLINE_S=${DEADLINE_S:-560}
MIN_S=${MIN_S:-70}
OPT=${OPT:-te}
R=/tmp/node; CK=/tmp/nodeck; mkdir -p $R $CK
source "$(dirname "${BASH_SOURCE[0]}")/deadline_runs.sh"
B="scripts/bench_offload.py run --optimizer $OPT --iters 8"
pair() {  # pair NAME GPUS EXTRA...: without and with offload
  local name=$1 gpus=$2; shift 2
  local launch="python3"
  [[ $gpus -gt 1 ]] && launch="torchrun --standalone --nproc-per-node $gpus"
  run ${name}_base env CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((gpus - 1))) $launch $B --mode base "$@"
  run ${name}_builtin env CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((gpus - 1))) $PATCH $launch $B --mode builtin "$@"
}
all1() {  # all1 NAME ARGS...: bench_offload.py all on GPU 0 (its own deadline: one call)
  local name=$1; shift
  if [[ -f $R/$name/summary.json ]]; then echo "DONE $name"; return; fi
  if [[ $(left) -lt $MIN_S ]]; then echo "SKIP $name ($(left) s left)"; return; fi
  local t0=$SECONDS
  CUDA_VISIBLE_DEVICES=0 timeout $(($(left) - 15)) python3 scripts/bench_offload.py all --optimizer $OPT \
    --keep-existing --out-dir $R/$name "$@" >> $R/$name.log 2>&1
  echo "ALL $name rc=$? $((SECONDS - t0)) s"
}
for g in "$@"; do
  case $g in
    hostlink)
      for n in 1 2 4; do
        [[ -f $R/hostlink$n.json ]] && continue
        CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((n - 1))) timeout 120 torchrun --standalone --nproc-per-node $n \
          scripts/bench_hostlink.py --gib 2 --out $R/hostlink$n.json > $R/hostlink$n.log 2>&1
        echo "RUN hostlink$n rc=$?"
      done ;;
    one) pair one 1 ;;
    dp4) pair dp4 4 ;;
    tp2dp2) pair tp2dp2 4 --tp 2 ;;
    moe_ep4) pair moe_ep4 4 --experts 8 --ep 4 --layers 8 --deterministic ;;
    peer8)
      all1 peer8 --iters 8 --global-batch 8 --seq-length 2048 --micro-batch 2 \
        --modes base,builtin,cpu,cpu+fraction=0.5,base,builtin,cpu,cpu+fraction=0.5,base,builtin,cpu,cpu+fraction=0.5 ;;
    peer64)
      all1 peer64 --iters 6 --global-batch 64 --seq-length 2048 --micro-batch 2 \
        --modes base,builtin,cpu,base,builtin,base,builtin ;;
    async2)  # each its own checkpoint folder
      run async2_base env CUDA_VISIBLE_DEVICES=0,1 torchrun --standalone --nproc-per-node 2 $B --mode base \
        --save $CK/async_base --save-interval 4 --async-save
      run async2_builtin env CUDA_VISIBLE_DEVICES=0,1 $PATCH torchrun --standalone --nproc-per-node 2 $B --mode builtin \
        --save $CK/async_builtin --save-interval 4 --async-save
      rm -rf $CK/async_base $CK/async_builtin ;;
    recompute) pair recompute 1 --recompute ;;
    *) echo "unknown group $g" >&2; exit 2 ;;
  esac
done
echo "left: $(left) s"
