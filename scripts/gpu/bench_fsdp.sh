#!/usr/bin/env bash
# Usage (on a two-GPU device, under run_kit.sh --te /tmp/te --logs /tmp/fsdp): scripts/gpu/bench_fsdp.sh GROUP...
#   learn    Megatron-FSDP (optim_grads_params, data-parallel 2) without offload: the layout before and after
#            the first step (--dump-layout), bf16 with a save at 4 and a resume from it, FP8 tensorwise, and
#            Megatron-Core's CPU optimizer beside it (its figures or its failure, as it happens)
#   bf16     without offload and with the streamed step, three of each interleaved, then a save at 4 and a
#            resume from it with each
#   fp8      the same with FP8 tensorwise (current scaling) parameters, one of each and the resume
#   final    bf16 with and without (each saving at 4, then resumed from it) and FP8 tensorwise with and without:
#            what one call of at most 10 minutes holds
#   strategies  optim and optim_grads, without offload and with the streamed step
#   resumed  the streamed step saving at 4 and resumed from it, bf16 and FP8 tensorwise (compared with final's
#            uninterrupted runs without offload: the same final parameters)
#   fp8resume the FP8 tensorwise streamed step saving at 4 and resumed from it, then FP8 without offload
#            uninterrupted (the same final parameters and FP8 scales; resumed's second half on its own)
#   overhead bf16 without offload and with the streamed step, three of each interleaved (the step's overhead)
#   hsdp     HSDP (--hsdp optim: two optimizer instances on the outer dimension, the masters sharded over every
#            rank): without offload, and the streamed step saving at 4 and resumed from it
#   hsdpfp8  the same with FP8 tensorwise, without offload and streamed
#   plain    optim_grads_params without and with offload, one each (with NPROC=4: data-parallel 4)
# NPROC (default 2): the GPUs and data-parallel ranks; with 4 and --hsdp, dp_shard 2 x two outer instances.
# Issue 41's GPU runs: the 887M shape on Transformer Engine's layers and FusedAdam, deterministic_mode. A run
# is skipped when its JSON exists or fewer than MIN_S seconds remain before DEADLINE_S. Results and logs
# under /tmp/fsdp; summary.txt: each run's peaks, step and digest per rank.
set -u
DEADLINE_S=${DEADLINE_S:-570}
MIN_S=${MIN_S:-50}
ITERS=${ITERS:-8}
R=/tmp/fsdp; CK=/tmp/fsdpck; mkdir -p $R $CK
source "$(dirname "${BASH_SOURCE[0]}")/deadline_runs.sh"
NPROC=${NPROC:-2}  # GPUs (data-parallel ranks): 2, or 4 on a four-GPU machine
DEVS=$(seq -s, 0 $((NPROC - 1)))
T="torchrun --standalone --nproc-per-node $NPROC scripts/bench_offload.py run --optimizer te --te-spec --deterministic"
S="--fsdp optim_grads_params"
base() { local name=$1; shift; run $name env CUDA_VISIBLE_DEVICES=$DEVS $T --mode base --iters $ITERS "$@"; }
fgo() { local name=$1; shift; run $name env CUDA_VISIBLE_DEVICES=$DEVS $PATCH $T --mode builtin --iters $ITERS "$@"; }
for g in "$@"; do
  case $g in
    learn)
      base learn_bf16 $S --dump-layout $R/layout_bf16 --save $CK/learn --save-interval 4
      [[ -n "${LEARN_RESUME:-}" ]] && base learn_bf16_resume $S --load $CK/learn --ckpt-step 4
      rm -rf $CK/learn
      base learn_fp8 $S --fp8 tensorwise --dump-layout $R/layout_fp8
      run learn_cpu env CUDA_VISIBLE_DEVICES=$DEVS $T --mode cpu --iters $ITERS $S ;;
    bf16)
      for i in 1 2 3; do base bf16_base_$i $S; fgo bf16_streamed_$i $S; done
      base bf16_save_base $S --save $CK/bf16_base --save-interval 4
      fgo bf16_save_streamed $S --save $CK/bf16_streamed --save-interval 4
      base bf16_resume_base $S --load $CK/bf16_base --ckpt-step 4
      fgo bf16_resume_streamed $S --load $CK/bf16_streamed --ckpt-step 4
      rm -rf $CK/bf16_base $CK/bf16_streamed ;;
    fp8)
      base fp8_base $S --fp8 tensorwise; fgo fp8_streamed $S --fp8 tensorwise
      base fp8_save_base $S --fp8 tensorwise --save $CK/fp8_base --save-interval 4
      fgo fp8_save_streamed $S --fp8 tensorwise --save $CK/fp8_streamed --save-interval 4
      base fp8_resume_base $S --fp8 tensorwise --load $CK/fp8_base --ckpt-step 4
      fgo fp8_resume_streamed $S --fp8 tensorwise --load $CK/fp8_streamed --ckpt-step 4
      rm -rf $CK/fp8_base $CK/fp8_streamed ;;
    final)  # what one device call holds: bf16 fresh (saving at 4) and resumed, with and without, then FP8
      fgo bf16_save_streamed $S --save $CK/bf16_streamed --save-interval 4
      base bf16_save_base $S --save $CK/bf16_base --save-interval 4
      fgo bf16_resume_streamed $S --load $CK/bf16_streamed --ckpt-step 4
      base bf16_resume_base $S --load $CK/bf16_base --ckpt-step 4
      rm -rf $CK/bf16_base $CK/bf16_streamed
      fgo fp8_streamed $S --fp8 tensorwise
      base fp8_base $S --fp8 tensorwise ;;
    streamed)  # final's runs with the streamed step only (a second call, its baselines from the first)
      fgo bf16_save_streamed $S --save $CK/bf16_streamed --save-interval 4
      fgo bf16_resume_streamed $S --load $CK/bf16_streamed --ckpt-step 4
      rm -rf $CK/bf16_streamed
      fgo fp8_streamed $S --fp8 tensorwise ;;
    resumed)
      fgo bf16_save_streamed $S --save $CK/bf16_streamed --save-interval 4
      fgo bf16_resume_streamed $S --load $CK/bf16_streamed --ckpt-step 4
      rm -rf $CK/bf16_streamed
      fgo fp8_save_streamed $S --fp8 tensorwise --save $CK/fp8_streamed --save-interval 4
      fgo fp8_resume_streamed $S --fp8 tensorwise --load $CK/fp8_streamed --ckpt-step 4
      rm -rf $CK/fp8_streamed ;;
    fp8resume)
      fgo fp8_save_streamed $S --fp8 tensorwise --save $CK/fp8_streamed --save-interval 4
      fgo fp8_resume_streamed $S --fp8 tensorwise --load $CK/fp8_streamed --ckpt-step 4
      rm -rf $CK/fp8_streamed
      base fp8_base $S --fp8 tensorwise ;;
    overhead)
      for i in 1 2 3; do base bf16_base_$i $S; fgo bf16_streamed_$i $S; done ;;
    hsdp)  # HSDP as the Nemotron recipes set it (two optimizer instances, outer_dp_sharding_strategy optim)
      base hsdp_base $S --hsdp optim
      fgo hsdp_save_streamed $S --hsdp optim --save $CK/hsdp --save-interval 4
      fgo hsdp_resume_streamed $S --hsdp optim --load $CK/hsdp --ckpt-step 4
      rm -rf $CK/hsdp ;;
    hsdpfp8)
      base hsdp_fp8_base $S --hsdp optim --fp8 tensorwise
      fgo hsdp_fp8_streamed $S --hsdp optim --fp8 tensorwise ;;
    plain)  # optim_grads_params without HSDP, one of each (data-parallel NPROC)
      base plain_base $S; fgo plain_streamed $S ;;
    strategies)
      for s in optim optim_grads; do base ${s}_base --fsdp $s; fgo ${s}_streamed --fsdp $s; done ;;
    *) echo "unknown group $g" >&2; exit 2 ;;
  esac
done
python3 - "$R" > $R/summary.txt <<'EOF'
import glob, json, os, sys
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    if "layout_" in path:
        continue
    try:
        s = json.load(open(path))["summary"]
    except Exception as e:
        print(os.path.basename(path), "unreadable:", e); continue
    keys = ("run_peak_gib", "steady_iter_peak_gib", "setup_peak_gib", "first_iter_peak_gib", "resume_peak_gib", "steady_step_median_s", "final_params_sha256", "final_fp8_meta_sha256", "losses")
    print(os.path.basename(path), json.dumps({k: s.get(k) for k in keys if k in s}))
EOF
# the host link, for the overhead's bound: pinned copies each way on GPU 0
python3 -c "import sys, json; sys.path.insert(0, 'scripts'); import bench_run; print('bandwidth', json.dumps(bench_run.bandwidth()))" >> $R/summary.txt 2>&1
cat $R/summary.txt
echo "left: $(left) s"
