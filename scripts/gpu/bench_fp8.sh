#!/usr/bin/env bash
# Usage (on a two-GPU device, under run_kit.sh --te /tmp/te): scripts/gpu/bench_fp8.sh GROUP...
#   one      GPU 0, one after another: bf16 without offload and with the streamed step, then for the delayed
#            and the tensorwise (current) FP8 recipes: without offload, the one-window engine (chunk_mb=0)
#            and the streamed step; the same model, Transformer Engine's layers and FusedAdam
#   resume   tensorwise and delayed: a save at iteration 4 and a resume from it, without offload (GPU 0) and
#            with the streamed step (GPU 1) side by side
#   dp2      tensorwise and delayed, data-parallel 2 (the amax reduction over two ranks): without and with
#   blockwise  blockwise (subchannel) FP8 parameters: without (GPU 0) and with (GPU 1)
# Issue 33's GPU runs. A run is skipped when its JSON exists or fewer than MIN_S seconds remain before
# DEADLINE_S. Results and logs under /tmp/fp8 (run_kit.sh --logs /tmp/fp8 tars them into $OUT).
set -u
DEADLINE_S=${DEADLINE_S:-560}
MIN_S=${MIN_S:-60}
ITERS=${ITERS:-8}
R=/tmp/fp8; CK=/tmp/fp8ck; mkdir -p $R $CK
source "$(dirname "${BASH_SOURCE[0]}")/deadline_runs.sh"
# deterministic_mode: Transformer Engine's layers otherwise differ from run to run from the third iteration
# (2026-11-27: two runs without offload of the same FP8 configuration), which hides what the streamed step does
B="scripts/bench_offload.py run --optimizer te --te-spec --deterministic --iters $ITERS"
# delayed scaling's TE extra state is a pickle; TE loads it only when told (these checkpoints are this script's)
export NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1
# side by side on two GPUs: each single-process run its own rendezvous port
base() { local name=$1 gpu=$2; shift 2; run $name env CUDA_VISIBLE_DEVICES=$gpu MASTER_PORT=$((29600 + gpu)) python3 $B --mode base "$@"; }
fgo() { local name=$1 gpu=$2; shift 2; run $name env CUDA_VISIBLE_DEVICES=$gpu MASTER_PORT=$((29600 + gpu)) $PATCH python3 $B --mode builtin "$@"; }
for g in "$@"; do
  case $g in
    one)
      base bf16_base 0; fgo bf16_streamed 0
      for r in delayed tensorwise; do
        base ${r}_base 0 --fp8 $r
        BRIDGE_FGO_CHUNK_MB=0 fgo ${r}_onewindow 0 --fp8 $r
        fgo ${r}_streamed 0 --fp8 $r
      done ;;
    resume)
      for r in tensorwise delayed; do
        base ${r}_save_base 0 --fp8 $r --save $CK/${r}_base --save-interval 4 &
        fgo ${r}_save_streamed 1 --fp8 $r --save $CK/${r}_streamed --save-interval 4; wait
        base ${r}_resume_base 0 --fp8 $r --load $CK/${r}_base --ckpt-step 4 &
        fgo ${r}_resume_streamed 1 --fp8 $r --load $CK/${r}_streamed --ckpt-step 4; wait
      done ;;
    dp2)
      for r in tensorwise delayed; do
        run ${r}_dp2_base env CUDA_VISIBLE_DEVICES=0,1 torchrun --standalone --nproc-per-node 2 $B --mode base --fp8 $r
        run ${r}_dp2_streamed env CUDA_VISIBLE_DEVICES=0,1 $PATCH torchrun --standalone --nproc-per-node 2 $B \
          --mode builtin --fp8 $r
      done ;;
    blockwise)
      base blockwise_base 0 --fp8 blockwise &
      fgo blockwise_streamed 1 --fp8 blockwise; wait ;;
    *) echo "unknown group $g" >&2; exit 2 ;;
  esac
done
echo "left: $(left) s"
