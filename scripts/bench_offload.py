#!/usr/bin/env python3
"""Benchmark: real Megatron-Bridge pretrain() with and without bridge_fgo's builtin offload engine.

  python scripts/bench_offload.py all --out-dir DIR --modes base,builtin:0,builtin:256,dev-base,dev-auto:256
  python scripts/bench_offload.py all --out-dir DIR --optimizer te --modes base,builtin:256,builtin:256+budget=16.2
  python scripts/bench_offload.py all --out-dir DIR --optimizer te --global-batch 8 --seq-length 2048 \
      --modes base,builtin,cpu,cpu+fraction=0.5,base,builtin,cpu,cpu+fraction=0.5,base,builtin,cpu,cpu+fraction=0.5
  python scripts/bench_offload.py run --mode builtin --chunk-mb 256 --out F   # one mode (under torchrun too)

Modes of `all`: MODE[:CHUNK_MB][+key=value...], comma-separated; a dev- prefix runs with --dev-mcore
first on PYTHONPATH. Keys: budget=GIB (builtin: BRIDGE_FGO_GPU_BUDGET_GIB for that run), fraction=F
(flag/auto on Megatron-Core's chunked line: optimizer_state_offload_fraction; cpu, Megatron-Core's CPU
optimizer: optimizer_offload_fraction). Each run's tag (its file names) is the mode with ':' and '+'/'='
dropped: builtin:256+budget=16.2 -> builtin256_budget16.2. A mode given more than once (base,builtin,base,
builtin,...) is run that often, interleaved; the checks then take medians by mode, with their spread.

Optimizer stack (--optimizer): torch (default; Transformer Engine and apex hidden even where
installed), apex (apex FusedAdam; TE hidden) or te (Transformer Engine FusedAdam, optionally
--precision-aware: bf16 moments). The model is the same local-spec model in every stack; the run
asserts the optimizer class Megatron-Core built and records it (inner_optimizer).

Checkpoint saves (issue 24, scripts/bench_saves.py): `all --save-every N` runs every mode once with
synchronous and once with asynchronous saves (TAG_sync, TAG_async), records per save the training-loop
stall, the iterations around it and the host memory, and compares each run's checkpoint with the first
run's, entry by entry.

Parallel layouts for scripts/bench_matrix.py: --tp, --pp/--vpp, --experts/--ep (a mixture-of-experts
model on Megatron-Core's local spec); checkpoints for scripts/check_checkpoint.py: --save/--save-interval/
--async-save, --fully-reshardable, --load/--ckpt-step/--resume-fix.

Each run: scripts/bench_run.py; its workload: scripts/bench_workload.py; the mode grammar: scripts/bench_modes.py;
the checks: scripts/bench_checks.py.
"""
import argparse
import json
import os
import subprocess
import sys

from bench_checks import checks, peak_line
from bench_modes import ENGINE_KEYS, MODES, parse_modes, resolve_symbolic
import bench_run
from bench_run import bandwidth
from bench_workload import FP8_RECIPES, OPTIMIZER_MODULES

HERE = os.path.dirname(os.path.abspath(__file__))


def run_all(args):
    import bench_saves

    try:
        runs = bench_saves.expand(parse_modes(args.modes), bench_saves.parse_kinds(args.save_kinds), args.save_every,
                                  args.out_dir)
    except ValueError as e:
        sys.exit(f"--modes / --save-every / --save-kinds: {e}")
    os.makedirs(args.out_dir, exist_ok=True)
    results = {}
    managed = [target for _, (kind, target) in ENGINE_KEYS.values() if kind == "env"]
    for run in runs:
        tag = run["tag"]
        if not resolve_symbolic(run, results, args.default_chunk_mb):
            print(f"{tag}: skipped, the runs its values come from are missing", flush=True)
            continue
        path = os.path.join(args.out_dir, f"{tag}.json")
        log = os.path.join(args.out_dir, f"{tag}.log")
        if args.keep_existing and os.path.exists(path):  # made by an earlier call on this machine
            with open(path) as f:
                results[tag] = json.load(f)["summary"]
            print(f"{tag}: kept from an earlier call", flush=True)
            continue
        # a variable a mode can set is that mode's alone: never inherited from the caller's shell
        env = {k: v for k, v in os.environ.items() if k not in managed}
        env.update(run["env"])
        if run["dev"]:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.abspath(args.dev_mcore), env.get("PYTHONPATH")) if p)
        cmd = [sys.executable, os.path.abspath(__file__), "run", "--mode", run["mode"], "--iters", str(args.iters),
               "--out", path, "--optimizer", args.optimizer, *run["args"]]
        cmd += ["--chunk-mb", str(run["chunk_mb"])] if run["chunk_mb"] is not None else []
        cmd += ["--precision-aware"] if args.precision_aware else []
        cmd += ["--muon"] if args.muon else []
        cmd += ["--recompute"] if args.recompute else []
        cmd += ["--te-spec"] if args.te_spec else []
        cmd += ["--log-params-norm"] if args.log_params_norm else []
        cmd += ["--qk-clip", str(args.qk_clip)] if args.qk_clip is not None else []
        cmd += ["--fp16"] if args.fp16 else []
        cmd += ["--bypass-te-adam-check"] if args.bypass_te_adam_check else []
        cmd += ["--profile-iter", str(args.profile_iter)] if args.profile_iter else []
        cmd += ["--seq-length", str(args.seq_length), "--micro-batch", str(args.micro_batch),
                "--global-batch", str(args.global_batch)]
        with open(log, "w") as f:
            f.write("$ " + " ".join(f"{k}={v}" for k, v in run["env"].items()) + (" " if run["env"] else "")
                    + " ".join(cmd) + "\n")
            f.flush()
            rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        if rc != 0:
            print(f"{tag} run failed (rc={rc}); see {log}", flush=True)
            continue
        with open(path) as f:
            results[tag] = json.load(f)["summary"]
        print(peak_line(tag, results[tag]), flush=True)
        if args.save_every:
            reference = next(r["tag"] for r in runs if r["tag"] in results)
            results[tag]["checkpoint_compare"] = bench_saves.compare_and_prune(
                args.out_dir, tag, reference, args.compare_at or args.save_every, args.keep_checkpoints)
            print(bench_saves.line(tag, results[tag]), flush=True)
    summary = {"workload": "887M" + (" full recompute" if args.recompute else "") + (" fp16" if args.fp16 else "")
               + (" TE spec" if args.te_spec else "")
               + f", {args.global_batch} x {args.seq_length} tokens a step (micro-batch {args.micro_batch})",
               "optimizer": ("Muon, " if args.muon else "") + args.optimizer
               + (" precision-aware" if args.precision_aware else ""),
               "modes": args.modes, "runs": results,
               "checks": checks(results, args.default_chunk_mb, {r["tag"]: r["extras"] for r in runs},
                                {r["tag"]: r["group"] for r in runs})}
    if args.save_every:
        summary["checks"]["saves"] = bench_saves.checks(results)
    if args.bandwidth:
        summary["bandwidth"] = bandwidth()
    with open(os.path.join(args.out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary["checks"], indent=1))


def add_optimizer_args(p):
    p.add_argument("--optimizer", choices=tuple(OPTIMIZER_MODULES), default="torch",
                   help="the Adam Megatron-Core builds: torch (AdamW; Transformer Engine and apex hidden even where "
                        "installed), apex (FusedAdam; Transformer Engine hidden) or te (Transformer Engine's "
                        "FusedAdam; apex hidden). The run fails unless Megatron-Core built that one")
    p.add_argument("--precision-aware", action="store_true",
                   help="with --optimizer te: use_precision_aware_optimizer with bf16 exp_avg and exp_avg_sq")
    p.add_argument("--muon", action="store_true",
                   help="Bridge's Muon recipe optimizer (distributed_muon_with_cosine_annealing: dist_muon, the "
                        "distributed optimizer off), --optimizer's Adam on the rest; bridge_fgo serves it with the "
                        "streamed step and builtin:0 (needs emerging-optimizers)")


def add_batch_args(p):
    p.add_argument("--seq-length", type=int, default=1024, help="tokens a sequence")
    p.add_argument("--micro-batch", type=int, default=2, help="sequences a micro-batch")
    p.add_argument("--global-batch", type=int, default=16, help="sequences a step (all data-parallel ranks)")


def parser():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--mode", choices=MODES, required=True,
                   help="base: no offload; builtin: bridge_fgo's engine; flag: cfg.optimizer.offload_optimizer_states="
                        "True without bridge_fgo; auto: the flag and bridge_fgo.patch(); cpu: Megatron-Core's CPU "
                        "optimizer (optimizer_cpu_offload=True, overlap_cpu_optimizer_d2h_h2d=True)")
    r.add_argument("--bypass-te-adam-check", action="store_true",
                   help="test-only: let the dev-line offloader accept torch AdamW (see bypass_te_adam_check)")
    r.add_argument("--iters", type=int, default=10)
    r.add_argument("--chunk-mb", type=int, help="builtin: bridge_fgo's window; auto: Megatron-Core's chunk size")
    add_optimizer_args(r)
    add_batch_args(r)
    r.add_argument("--offload-fraction", type=float, metavar="F",
                   help="flag/auto on Megatron-Core's chunked line: optimizer_state_offload_fraction; cpu: "
                        "optimizer_offload_fraction (default 1.0) (0 < F <= 1)")
    r.add_argument("--recompute", action="store_true", help="full activation recomputation")
    r.add_argument("--te-spec", action="store_true", help="Transformer Engine's layer spec (needs TE installed)")
    r.add_argument("--log-params-norm", action="store_true",
                   help="Bridge's log_params_norm: the parameter norm after every step, recorded (params_norms)")
    r.add_argument("--qk-clip", type=float, metavar="THRESHOLD",
                   help="MuonClip: cfg.model.qk_clip=True with this qk_clip_threshold (needs --te-spec: Megatron-Core "
                        "records the max attention logits in Transformer Engine's attention)")
    r.add_argument("--act-offload", action="store_true",
                   help="Megatron-Core's fine-grained activation offloading (needs --te-spec: Bridge requires TE)")
    r.add_argument("--act-offload-modules", default="core_attn,attn_proj,qkv_linear",
                   help="with --act-offload: offload_modules, comma-separated")
    r.add_argument("--save", help="save torch_dist checkpoints here (at the last iteration, or every --save-interval)")
    r.add_argument("--save-interval", type=int)
    r.add_argument("--async-save", action="store_true", help="Bridge's async_save=True")
    r.add_argument("--load", help="resume from this checkpoint directory")
    r.add_argument("--ckpt-step", type=int, help="with --load: the iteration to resume from")
    r.add_argument("--fully-reshardable", action="store_true",
                   help="save the optimizer state as fully_reshardable (dist_ckpt_optim_fully_reshardable=True; a load "
                        "reads the format the checkpoint records)")
    r.add_argument("--resume-fix", choices=("none", "prime", "full"), default="none",
                   help="Megatron-Core without TE/apex cannot load torch AdamW state; see scripts/resume_fix.py")
    r.add_argument("--fsdp", choices=("optim", "optim_grads", "optim_grads_params"),
                   help="Megatron-FSDP with this sharding strategy (the fsdp_dtensor checkpoint format)")
    r.add_argument("--hsdp", choices=("optim", "no_shard"),
                   help="with --fsdp optim_grads_params: HSDP, --hsdp-instances optimizer instances on the outer "
                        "data-parallel dimension, outer_dp_sharding_strategy this (Bridge's Nemotron recipes: optim)")
    r.add_argument("--hsdp-instances", type=int, default=2,
                   help="with --hsdp: cfg.ddp.num_distributed_optimizer_instances (default 2)")
    r.add_argument("--dump-layout", metavar="PATH",
                   help="write the optimizer's layout before and after the first step: PATH.PHASE.rankN.json")
    r.add_argument("--tp", type=int, default=1)
    r.add_argument("--pp", type=int, default=1)
    r.add_argument("--vpp", type=int, help="virtual pipeline stages per pipeline rank")
    r.add_argument("--ep", type=int, default=1, help="expert-parallel size (with --experts)")
    r.add_argument("--experts", type=int, help="a mixture-of-experts model with this many experts")
    r.add_argument("--topk", type=int, default=2)
    r.add_argument("--moe-ffn", type=int, default=1408)
    r.add_argument("--deterministic", action="store_true", help="the model's deterministic_mode (needs NCCL_ALGO)")
    r.add_argument("--fp8", choices=tuple(FP8_RECIPES),
                   help="FP8 parameters (fp8_param_gather) with Bridge's recipe for this scaling (needs --te-spec): "
                        + ", ".join(f"{k}: {v}" for k, v in FP8_RECIPES.items()))
    r.add_argument("--fp16", action="store_true", help="fp16 with dynamic loss scaling (the first steps are skipped)")
    r.add_argument("--loss-scale", type=float, default=2.0**16, help="with --fp16: the initial loss scale")
    r.add_argument("--layers", type=int, default=16)
    r.add_argument("--hidden", type=int, default=2048)
    r.add_argument("--ffn", type=int, default=5632)
    r.add_argument("--heads", type=int, default=16)
    r.add_argument("--groups", type=int, default=8)
    r.add_argument("--out")
    r.add_argument("--profile-iter", type=int, help="profile this iteration (torch.profiler): OUT.profile-iterN.txt")
    a = sub.add_parser("all")
    a.add_argument("--out-dir", required=True)
    a.add_argument("--iters", type=int, default=10)
    a.add_argument("--modes", default="base,builtin:0,builtin:256",
                   help="comma-separated MODE[:CHUNK_MB][+key=value...]; a dev- prefix runs with --dev-mcore first "
                        "on PYTHONPATH; keys: budget=GIB (builtin: BRIDGE_FGO_GPU_BUDGET_GIB), fraction=F (flag/auto: "
                        "optimizer_state_offload_fraction), e.g. builtin:256+budget=16.2,dev-auto:256+fraction=0.5")
    add_optimizer_args(a)
    add_batch_args(a)
    a.add_argument("--dev-mcore", default=".mlm", help="a Megatron-LM source tree (its megatron/core) for dev- modes")
    a.add_argument("--default-chunk-mb", default="auto",
                   help="the streamed run the targets judge: auto (mode builtin) or a chunk size (builtin:MB)")
    a.add_argument("--recompute", action="store_true")
    a.add_argument("--te-spec", action="store_true", help="every run with Transformer Engine's layer spec")
    a.add_argument("--log-params-norm", action="store_true", help="every run logs the parameter norm (compared)")
    a.add_argument("--qk-clip", type=float, metavar="THRESHOLD", help="every run with qk_clip at this threshold")
    a.add_argument("--fp16", action="store_true")
    a.add_argument("--bandwidth", action="store_true", help="also measure pinned host<->device bandwidth")
    a.add_argument("--keep-existing", action="store_true",
                   help="a run whose JSON is in --out-dir already (an earlier call cut short) is read, not run again")
    a.add_argument("--bypass-te-adam-check", action="store_true")
    a.add_argument("--profile-iter", type=int, help="each run profiles this iteration (see run)")
    a.add_argument("--save-every", type=int, metavar="N",
                   help="every mode once per --save-kinds, saving every N iterations (TAG_sync, TAG_async): the "
                        "stall per save, the iterations around it, host memory, checkpoints compared")
    a.add_argument("--save-kinds", default="sync,async", help="with --save-every: sync, async or both, in run order")
    a.add_argument("--compare-at", type=int, metavar="M",
                   help="with --save-every: the iteration whose checkpoints are compared (default N)")
    a.add_argument("--keep-checkpoints", action="store_true",
                   help="with --save-every: keep every checkpoint (default: only the reference run's compared one)")
    return ap


def main():
    ap = parser()
    args = ap.parse_args()
    if args.precision_aware and args.optimizer != "te":
        ap.error("--precision-aware needs --optimizer te (Megatron-Core takes it only from Transformer Engine's FusedAdam)")
    if args.muon and (args.precision_aware or getattr(args, "mode", None) == "cpu"):
        ap.error("--muon: Megatron-Core's Muon takes neither the precision-aware optimizer nor its CPU optimizer")
    if args.cmd == "run" and args.act_offload and not args.te_spec:
        ap.error("--act-offload needs --te-spec: Megatron-Bridge allows activation offloading only with "
                 "transformer_impl='transformer_engine'")
    if args.cmd == "run" and args.load and not os.path.isfile(os.path.join(args.load, "latest_checkpointed_iteration.txt")):
        # Bridge would train from scratch: a "resumed" run that resumed nothing (2026-11-28: a cleanup removed it)
        ap.error(f"--load {args.load}: no checkpoint there (no latest_checkpointed_iteration.txt)")
    if args.cmd == "run" and args.offload_fraction is not None:
        if not 0 < args.offload_fraction <= 1:
            ap.error("--offload-fraction must be in (0, 1]")
        if args.mode not in ENGINE_KEYS["fraction"][0]:
            ap.error("--offload-fraction needs --mode flag or auto (Megatron-Core's chunked line) or cpu (its CPU "
                     "optimizer)")
    if args.cmd == "all":
        import bench_saves

        try:
            bench_saves.expand(parse_modes(args.modes), bench_saves.parse_kinds(args.save_kinds), args.save_every,
                               args.out_dir)
        except ValueError as e:
            ap.error(f"--modes / --save-every / --save-kinds: {e}")
        if args.compare_at is not None and (not args.save_every or args.compare_at % args.save_every
                                            or args.compare_at > args.iters):
            ap.error("--compare-at needs --save-every and must be a multiple of it, at most --iters")
    bench_run.run(args) if args.cmd == "run" else run_all(args)


if __name__ == "__main__":
    main()
