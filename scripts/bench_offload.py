#!/usr/bin/env python3
"""Benchmark: real Megatron-Bridge pretrain() with and without bridge_fgo's builtin offload engine.

  python scripts/bench_offload.py all --out-dir DIR --modes base,builtin:0,builtin:256,dev-base,dev-auto:256
  python scripts/bench_offload.py all --out-dir DIR --optimizer te --modes base,builtin:256,builtin:256+budget=16.2
  python scripts/bench_offload.py run --mode builtin --chunk-mb 256 --out F   # one mode (under torchrun too)

Modes of `all`: MODE[:CHUNK_MB][+key=value...], comma-separated; a dev- prefix runs with --dev-mcore
first on PYTHONPATH. Keys: budget=GIB (builtin: BRIDGE_FGO_GPU_BUDGET_GIB for that run), fraction=F
(flag/auto on Megatron-Core's chunked line: optimizer_state_offload_fraction). Each run's tag (its file
names) is the mode with ':' and '+'/'=' dropped: builtin:256+budget=16.2 -> builtin256_budget16.2.

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

Workload: Llama-style GPT, 887M parameters (16 layers, hidden 2048, ffn 5632, seq 1024, mbs 2, gbs 16),
bf16, distributed optimizer (--optimizer picks what runs inside), mock data, Megatron-Core's
'local' transformer implementation. Per iteration it records the forward-backward peak (from
forward_backward_func's entry, after offload and release, to gradient finalization), the whole-
iteration peak, step time and loss; at the end a hash of the final parameters. Peaks from process start:
setup_peak_gib (everything setup allocated, read at the first train_step's entry), first_iter_peak_gib,
run_peak_gib (setup, every iteration, and what ran between iterations and after the last, such as a
checkpoint save), resume_peak_gib (setup_peak_gib of a run with --load). `all` also measures
pinned host<->device bandwidth with bridge_fgo's own pinned buffer, and checks the targets.
"""
import argparse
import hashlib
import resource
import importlib
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
GIB = 2**30


def prepare_out(path):
    """--out's folder made before the run: a missing one used to fail the profile at its iteration, or
    the JSON after the last."""
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)


def run(args):
    prepare_out(args.out)
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29517").items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    if args.act_offload:  # Bridge requires it with Transformer Engine >= 2.10 (its own activation offload off)
        os.environ.setdefault("NVTE_CPU_OFFLOAD_V1", "1")
    if args.deterministic:  # before CUDA and NCCL start: Bridge asserts NCCL_ALGO; cuBLAS needs a fixed workspace
        os.environ.setdefault("NCCL_ALGO", "Ring")
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s: %(message)s")
    sys.path.insert(0, HERE)
    import bench_imports

    # before anything imports Megatron-Core: it picks its Adam at import time
    hidden = bench_imports.stack_hides(args.optimizer)
    bench_imports.install(hide=hidden)
    # the stack's optimizer must import here, with its compiled parts (fail now, not after model setup)
    for need in {"te": ("transformer_engine.pytorch.optimizers",), "apex": ("apex.optimizers", "amp_C")}.get(
            args.optimizer, ()):
        try:
            importlib.import_module(need)
        except Exception as e:  # an ImportError, or an OSError from a missing shared library
            sys.exit(f"--optimizer {args.optimizer}: import {need} failed: {type(e).__name__}: {e} (PYTHONPATH: "
                     f"{os.environ.get('PYTHONPATH', '')!r}); see docs/gpu-route.md")
    import bridge_fgo

    if args.resume_fix != "none":
        import resume_fix

        resume_fix.install(restore_step=args.resume_fix == "full")

    if args.mode == "builtin":
        # under bridge-fgo-run --offload builtin: already patched, a no-op
        bridge_fgo.patch(offload="builtin", **({} if args.chunk_mb is None else {"chunk_mb": args.chunk_mb}))
    elif args.mode == "auto":
        bridge_fgo.patch()  # Megatron-Core's own offloader, through cfg.optimizer.offload_optimizer_states
    if args.bypass_te_adam_check:
        bypass_te_adam_check()
    import torch
    from megatron.bridge.models.gpt_provider import GPTModelProvider, local_layer_spec
    from megatron.bridge.training import config as C
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain
    import megatron.bridge.training.initialize as initialize
    import megatron.bridge.training.train as T
    import megatron.core.datasets as mcd
    from megatron.core.utils import get_model_config

    recs, held = [], {}
    inner_step = T.train_step
    saves, finalizes = [], []
    if args.save:  # each save and each finalize that found one pending, timed on the training thread
        import bench_saves

        bench_saves.instrument(saves, finalizes)

    def measured_step(forward_step_func, data_iterator, model, optimizer, *a, **k):
        # the peak since the last reset: at the first entry everything setup allocated (model, grad
        # buffers, Megatron-Core's fp32 masters, a loaded checkpoint); later, the previous iteration's
        # last phase and whatever ran between the two iterations
        entry_peak = torch.cuda.max_memory_allocated() / GIB
        if not recs:
            held["setup_peak_gib"] = entry_peak
            held["inner_optimizer"] = check_optimizer(optimizer, args.optimizer)
        else:
            recs[-1]["tail_peak_gib"] = entry_peak
        held["model"] = model
        cfg = get_model_config(model[0])
        if not getattr(cfg, "_bench_probe", False):
            base = cfg.finalize_model_grads_func

            # Probes wait for the compute stream only: a device-wide synchronize would also wait for
            # bridge_fgo's copy streams and serialise the very transfers that should overlap.
            def probe(*fa, **fk):  # outermost: runs before bridge_fgo's reload
                torch.cuda.current_stream().synchronize()
                recs[-1]["fwdbwd_peak_gib"] = torch.cuda.max_memory_allocated() / GIB
                recs[-1]["t_finalize"] = time.perf_counter()
                if len(recs) > 1:  # see fb_probe
                    torch.cuda.reset_peak_memory_stats()
                return base(*fa, **fk)

            cfg.finalize_model_grads_func, cfg._bench_probe = probe, True
        a = list(a)
        fbf = a[3]  # Bridge 0.6 passes forward_backward_func positionally, 8th argument

        def fb_probe(*fa, **fk):
            torch.cuda.current_stream().synchronize()
            recs[-1]["pre_fwdbwd_peak_gib"] = torch.cuda.max_memory_allocated() / GIB
            recs[-1]["alloc_fwdbwd_entry_gib"] = torch.cuda.memory_allocated() / GIB
            recs[-1]["t_fwdbwd"] = time.perf_counter()
            # Not inside the first iteration: bridge_fgo reads the allocator's peak through its first
            # step (chunk_mb=auto, gpu_budget_gib; engine/firststep.py). Its phase peaks are then
            # cumulative from the iteration's start (phase_peaks="cumulative")
            if len(recs) > 1:
                torch.cuda.reset_peak_memory_stats()
            return fbf(*fa, **fk)

        a[3] = fb_probe
        torch.cuda.synchronize()
        recs.append({"iter": len(recs) + 1, "phase_peaks": "cumulative" if not recs else "per phase"})
        stats0 = torch.cuda.memory_stats()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        if args.profile_iter == len(recs):  # this iteration under torch.profiler: its op tables beside --out
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                out = inner_step(forward_step_func, data_iterator, model, optimizer, *a, **k)
                torch.cuda.synchronize()
            write_profile(prof, (args.out or "bench") + f".profile-iter{len(recs)}")
        else:
            out = inner_step(forward_step_func, data_iterator, model, optimizer, *a, **k)
        torch.cuda.synchronize()
        r = recs[-1]
        t1 = time.perf_counter()
        r["step_s"] = t1 - t0
        # phases: before forward-backward (zero grads, offload, copy, release), forward-backward, the rest
        # (reload, finalization, optimizer step)
        r["pre_s"] = r.pop("t_fwdbwd", t0) - t0
        r["fwdbwd_s"] = r.pop("t_finalize", t1) - t0 - r["pre_s"]
        r["post_s"] = r["step_s"] - r["pre_s"] - r["fwdbwd_s"]
        r["finalize_step_peak_gib"] = torch.cuda.max_memory_allocated() / GIB
        r["iter_peak_gib"] = max(r.get("pre_fwdbwd_peak_gib", 0), r.get("fwdbwd_peak_gib", 0), r["finalize_step_peak_gib"])
        r["loss"] = float(out[0]["lm loss"]) if out[0] else None
        r["skipped"] = bool(out[1])  # train_step returns (loss_dict, skipped_iter, ...)
        stats1 = torch.cuda.memory_stats()
        # allocator events in this step: device mallocs/frees and whole-device synchronisations (which
        # would wait for bridge_fgo's copy streams too)
        for key in ("num_device_alloc", "num_device_free", "num_sync_all_streams", "num_alloc_retries"):
            r[key] = stats1.get(key, 0) - stats0.get(key, 0)
        r["reserved_gib"] = torch.cuda.memory_reserved() / GIB
        if args.save:
            r.update(bench_saves.host_figures())
        print("ITER " + json.dumps(r), flush=True)
        return out

    T.train_step = measured_step
    norms = []
    if args.log_params_norm:  # what train() logs each iteration (through bridge_fgo's wrapper when patched)
        logged_norm = T.calc_params_l2_norm

        def recorded_norm(*a, **k):
            value = logged_norm(*a, **k)
            norms.append(float(value))
            return value

        T.calc_params_l2_norm = recorded_norm
    if not os.path.exists(os.path.join(os.path.dirname(mcd.__file__), "Makefile")):
        from megatron.core.datasets import helpers_cpp  # noqa: F401  the wheel ships it prebuilt

        initialize.compile_helpers = lambda: None  # the wheel has no Makefile for `make`

    # --fp16: dynamic loss scaling from --loss-scale, high enough that the first steps overflow and are skipped
    fp16 = dict(initial_loss_scale=args.loss_scale) if args.fp16 else {}
    # --precision-aware (Transformer Engine's FusedAdam only): bf16 moments. OptimizerConfig's checks
    # (run by Bridge's finalize): adam, the distributed optimizer, TE's FusedAdam taking the dtype
    # arguments; main_params_dtype fp32 (then TE's FusedAdam keeps the master weights, master_weights=True,
    # with store_param_remainders on TE >= 2.1) and main_grads_dtype fp32; Bridge: optimizer.bf16 as the
    # model's.
    precision = (dict(use_precision_aware_optimizer=True, main_params_dtype=torch.float32,
                      main_grads_dtype=torch.float32, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
                 if args.precision_aware else {})
    opt = C.OptimizerConfig(optimizer="adam", lr=3e-4, min_lr=3e-5, weight_decay=0.1, bf16=not args.fp16,
                            fp16=args.fp16, **fp16, **precision,
                            adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, use_distributed_optimizer=True,
                            clip_grad=1.0)
    sched = C.SchedulerConfig(start_weight_decay=0.033, end_weight_decay=0.033, weight_decay_incr_style="constant",
                              lr_decay_style="cosine", lr_warmup_iters=2, lr_warmup_init=0.0, lr_decay_iters=None,
                              override_opt_param_scheduler=True)
    # full activation recomputation: activations shrink to one layer's, so optimizer states dominate
    recompute = (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
                 if args.recompute else {})
    # mixture of experts on Megatron-Core's local spec (SequentialMLP experts, no grouped GEMM: no TE)
    moe = (dict(num_moe_experts=args.experts, moe_router_topk=args.topk, moe_ffn_hidden_size=args.moe_ffn,
                moe_grouped_gemm=False, moe_token_dispatcher_type="alltoall", moe_permute_fusion=False,
                moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2)
           if args.experts else {})
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dp = world // (args.tp * args.pp)
    off = dict(masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
               gradient_accumulation_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
               cross_entropy_loss_fusion=False)
    norm_override = {}
    # --te-spec: Transformer Engine's layers (what Megatron-Bridge's activation offloading requires);
    # else Megatron-Core's local spec, the same model in every optimizer stack
    spec = (dict(transformer_impl="transformer_engine") if args.te_spec else
            dict(transformer_layer_spec=norm_safe_spec(local_layer_spec, norm_override), transformer_impl="local"))
    act = (dict(fine_grained_activation_offloading=True, offload_modules=args.act_offload_modules.split(","))
           if args.act_offload else {})
    model = GPTModelProvider(
        **spec, **act,
        num_layers=args.layers,
        hidden_size=args.hidden, ffn_hidden_size=args.ffn, num_attention_heads=args.heads, num_query_groups=args.groups,
        seq_length=1024, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        position_embedding_type="rope", share_embeddings_and_output_weights=False, make_vocab_size_divisible_by=128,
        bf16=not args.fp16, fp16=args.fp16, params_dtype=torch.half if args.fp16 else torch.bfloat16,
        attention_dropout=0.0, hidden_dropout=0.0,
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
        virtual_pipeline_model_parallel_size=args.vpp, expert_model_parallel_size=args.ep,
        # deterministic kernels (MoE's token unpermute adds with atomics otherwise); Bridge then wants
        # NCCL_ALGO set and turns on torch.use_deterministic_algorithms
        deterministic_mode=args.deterministic, **off, **recompute, **moe)
    overlap = dp > 1  # gradient reduce-scatter and param all-gather overlap only exist with DP > 1
    cfg = C.ConfigContainer(
        model=model,
        train=C.TrainingConfig(train_iters=args.iters, global_batch_size=16, micro_batch_size=2, exit_signal_handler=False),
        validation=C.ValidationConfig(eval_interval=None, eval_iters=0),
        optimizer=opt, scheduler=sched,
        # fp16: Megatron raises on the first inf gradient unless the NaN check is off
        ddp=C.DistributedDataParallelConfig(check_for_nan_in_grad=not args.fp16, grad_reduce_in_fp32=not args.fp16,
                                            overlap_grad_reduce=overlap, overlap_param_gather=overlap,
                                            average_in_collective=True, use_distributed_optimizer=True),
        dataset=C.MockGPTDatasetConfig(seq_length=1024, random_seed=1234, reset_attention_mask=False,
                                       reset_position_ids=False, eod_mask_loss=False, num_dataset_builder_threads=1,
                                       split="9999,8,2", dataloader_type="single", num_workers=1,
                                       persistent_workers=False, data_sharding=True,
                                       skip_getting_attention_mask_from_dataset=True),
        logger=C.LoggerConfig(log_interval=1, tensorboard_dir=None, log_params_norm=args.log_params_norm),
        tokenizer=C.TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=32000),
        # --save: one synchronous torch_dist checkpoint at the last iteration (scripts/check_checkpoint.py)
        checkpoint=C.CheckpointConfig(save=args.save, load=args.load, ckpt_step=args.ckpt_step,
                                      save_interval=(args.save_interval or args.iters) if args.save else None,
                                      ckpt_format="torch_dist", async_save=args.async_save, save_optim=True,
                                      dist_ckpt_optim_fully_reshardable=args.fully_reshardable),
        rng=C.RNGConfig(seed=1234), mixed_precision="fp16_mixed" if args.fp16 else "bf16_mixed",
    )
    report_holder = {}
    if args.mode in ("flag", "auto"):
        # a plain attribute where Megatron-Core has no such field (then nothing reads it)
        opt.offload_optimizer_states = True
        if hasattr(opt, "chunked_optimizer_state_offload"):
            # Megatron-Core's chunked line (dev since 2026-08-18): the alias is turned into this field
            # only in __post_init__, which ran before the attribute above was set
            opt.chunked_optimizer_state_offload = True
            if args.chunk_mb is not None:
                opt.optimizer_state_offload_chunk_size_mb = args.chunk_mb
    if args.offload_fraction is not None:
        # the chunked line's share of parameter bundles whose states go to the host
        if args.mode not in ("flag", "auto") or not hasattr(opt, "optimizer_state_offload_fraction"):
            sys.exit(f"--offload-fraction needs --mode flag/auto on Megatron-Core's chunked line (dev since "
                     f"2026-08-18, with optimizer_state_offload_fraction); here: --mode {args.mode}, Megatron-Core "
                     f"from {os.path.dirname(sys.modules['megatron.core'].__file__)}")
        opt.optimizer_state_offload_fraction = args.offload_fraction
    if args.mode in ("builtin", "auto"):
        # the per-optimizer figures, read before train() ends and unpatch would drop them
        inner_train = T.train_step

        def keep_report(*a, **k):
            out = inner_train(*a, **k)
            report_holder["sessions"] = bridge_fgo.status().sessions
            return out

        T.train_step = keep_report
    t0 = time.perf_counter()
    pretrain(cfg, forward_step)
    wall = time.perf_counter() - t0
    if recs:  # the last iteration's final phase and what ran after it (a checkpoint save at the end)
        recs[-1]["tail_peak_gib"] = torch.cuda.max_memory_allocated() / GIB
    h = hashlib.sha256()
    for chunk in held["model"]:  # every virtual-pipeline chunk of this rank
        for p in chunk.parameters():
            h.update(p.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
    steady = [r for r in recs if r["iter"] > 2]
    rank = int(os.environ.get("RANK", "0"))
    summary = {
        "mode": args.mode, "chunk_mb": args.chunk_mb, "recompute": args.recompute, "rank": rank,
        "engine_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("BRIDGE_FGO_")},
        "offload_fraction": args.offload_fraction,
        "optimizer": args.optimizer, "inner_optimizer": held.get("inner_optimizer"), "hidden_modules": list(hidden),
        "precision_aware": precision_summary(opt, args.precision_aware),
        # the final norm Megatron-Core would have used instead (apex's FusedLayerNorm has no RMSNorm)
        "norm_override": norm_override or None,
        "layout": {"tp": args.tp, "pp": args.pp, "vpp": args.vpp, "ep": args.ep, "dp": dp, "experts": args.experts,
                   "deterministic": args.deterministic, "overlap": overlap},
        "model_spec": "transformer_engine" if args.te_spec else "local",
        "activation_offload": args.act_offload_modules.split(",") if args.act_offload else None,
        "checkpoint": {"save": args.save, "save_interval": args.save_interval, "async_save": args.async_save,
                       "load": args.load, "ckpt_step": args.ckpt_step, "resume_fix": args.resume_fix,
                       "fully_reshardable": args.fully_reshardable}, "megatron_core_from": os.path.dirname(sys.modules["megatron.core"].__file__),
        "te_adam_check_bypassed": args.bypass_te_adam_check, "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "iters": len(recs), "pretrain_wall_s": wall,
        "first_iter_s": recs[0]["step_s"], "second_iter_s": recs[1]["step_s"] if len(recs) > 1 else None,
        "steady_step_median_s": statistics.median(r["step_s"] for r in steady),
        "steady_fwdbwd_peak_gib": max(r["fwdbwd_peak_gib"] for r in steady),
        "resident_gib": statistics.median(r["alloc_fwdbwd_entry_gib"] for r in steady),
        "steady_iter_peak_gib": max(r["iter_peak_gib"] for r in steady),
        "max_iter_peak_gib": max(r["iter_peak_gib"] for r in recs),
        # from process start: setup's allocations (Megatron-Core's fp32 masters, a loaded checkpoint), the
        # first iteration, and the maximum over setup, every iteration and the gaps between them
        "setup_peak_gib": held["setup_peak_gib"],
        "first_iter_peak_gib": recs[0]["iter_peak_gib"],
        "run_peak_gib": max([held["setup_peak_gib"]] + [r["iter_peak_gib"] for r in recs]
                            + [r["tail_peak_gib"] for r in recs if "tail_peak_gib" in r]),
        "resume_peak_gib": held["setup_peak_gib"] if args.load else None,
        # host memory: the process's resident peak (ru_maxrss, KiB on Linux), pinned buffer included
        "host_peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB,
        "losses": [r["loss"] for r in recs],
        "params_norms": norms or None,
        "skipped_iters": [r["iter"] for r in recs if r["skipped"]],
        "final_params_sha256": h.hexdigest(),
        "sessions": report_holder.get("sessions", []),
    }
    if args.save:
        summary.update(bench_saves.summarize(recs, saves, finalizes))
    print("SUMMARY " + json.dumps(summary), flush=True)
    if args.out:
        out = args.out if rank == 0 else args.out.replace(".json", f".rank{rank}.json")
        with open(out, "w") as f:
            json.dump({"summary": summary, "iters": recs}, f, indent=1)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


# --optimizer -> what the module of the optimizer inside Megatron-Core's DistributedOptimizer must contain
OPTIMIZER_MODULES = {"torch": "torch.optim", "apex": "apex.optimizers", "te": "transformer_engine"}


def inner_optimizers(optimizer):
    """The optimizers inside Megatron-Core's wrapper: one per chained optimizer (MoE: dense and expert)."""
    return [getattr(o, "optimizer", o) for o in (getattr(optimizer, "chained_optimizers", None) or [optimizer])]


def check_optimizer(optimizer, stack):
    """'module.qualname' of the optimizer Megatron-Core built; raises if it is not the stack's."""
    names = sorted({f"{type(o).__module__}.{type(o).__qualname__}" for o in inner_optimizers(optimizer)})
    wrong = [n for n in names if OPTIMIZER_MODULES[stack] not in n.rsplit(".", 1)[0]]
    if wrong or not names:
        raise RuntimeError(f"--optimizer {stack}: Megatron-Core built {names or 'no optimizer'}, expected a class "
                           f"from {OPTIMIZER_MODULES[stack]}; the optimizer stack is not what this run claims")
    return names[0] if len(names) == 1 else names


def precision_summary(opt, on):
    if not on:
        return None
    return {k: str(getattr(opt, k, None)) for k in ("use_precision_aware_optimizer", "main_params_dtype",
                                                    "main_grads_dtype", "exp_avg_dtype", "exp_avg_sq_dtype",
                                                    "store_param_remainders")}


def norm_safe_spec(layer_spec_fn, record):
    """Megatron-Core's local layer spec with every norm a WrappedTorchNorm, in every optimizer stack.

    Without Transformer Engine, TransformerBlock's final layer norm is `LayerNormImpl`: apex's
    FusedLayerNorm as soon as apex imports, which has no RMSNorm; with Transformer Engine importable it
    is TE's TENorm. Both would make the model differ between stacks (and FusedLayerNorm refuses
    RMSNorm), so where the final norm would not be WrappedTorchNorm (what the torch stack gets) the spec
    becomes a block spec whose final norm is megatron.core.transformer.torch_norm.WrappedTorchNorm, and
    any FusedLayerNorm inside the layer spec is replaced too. `record` gets what was replaced
    (the summary's norm_override); where nothing needs replacing the local spec is used unchanged."""

    def spec(config, vp_stage=None):
        import dataclasses
        import functools

        import megatron.core.transformer.transformer_block as tb
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        try:
            from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
        except ImportError:
            FusedLayerNorm = None
        layer = layer_spec_fn(config)
        replaced = []

        def walk(obj, where):
            if isinstance(obj, functools.partial):
                for key, value in obj.keywords.items():
                    walk(value, f"{where}.{key}")
                return
            if not dataclasses.is_dataclass(obj) or isinstance(obj, type):  # ModuleSpec and *Submodules are
                return
            for f in dataclasses.fields(obj):
                value = getattr(obj, f.name)
                if FusedLayerNorm is not None and value is FusedLayerNorm:
                    setattr(obj, f.name, WrappedTorchNorm)
                    replaced.append(f"{where}.{f.name}")
                else:
                    walk(value, f"{where}.{f.name}")

        walk(layer, "layer")
        final = tb.LayerNormImpl
        if final is WrappedTorchNorm and not replaced:
            return layer
        record.update(final_norm="WrappedTorchNorm", instead_of=f"{final.__module__}.{final.__qualname__}",
                      layer_norms_replaced=sorted(set(replaced)))
        return tb.TransformerBlockSubmodules(layer_specs=[layer] * tb.get_num_layers_to_build(config, vp_stage),
                                             layer_norm=WrappedTorchNorm)

    return spec


def bypass_te_adam_check():
    """TEST-ONLY, for Megatron-Core's dev-line three-method offloader, whose constructor asserts
    Transformer Engine's FusedAdam (absent on the lent GPU: Megatron-Core uses torch AdamW there).
    During that constructor only, TE's optimizers module is a stand-in whose FusedAdam is the
    optimizer's own class, and the optimizer gets master_weights=False (masters live in
    shard_fp32_from_float16_groups, as with FusedAdam without master weights). Results that used it
    say so (te_adam_check_bypassed)."""
    import types

    try:
        from megatron.core.optimizer.cpu_offloading import optimizer_state_offloader as m
    except ImportError:
        return
    original = m.OptimizerStateOffloader.__init__

    def init(self, dist_opt, *a, **k):
        names = ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.optimizers")
        saved = {n: sys.modules.get(n) for n in names}
        stand_in = types.ModuleType(names[-1])
        stand_in.FusedAdam = type(dist_opt.optimizer)
        for n in names[:-1]:
            sys.modules[n] = types.ModuleType(n)
        sys.modules[names[-1]] = stand_in
        if not hasattr(dist_opt.optimizer, "master_weights"):
            dist_opt.optimizer.master_weights = False
        try:
            original(self, dist_opt, *a, **k)
        finally:
            for n, mod in saved.items():
                if mod is None:
                    sys.modules.pop(n, None)
                else:
                    sys.modules[n] = mod

    m.OptimizerStateOffloader.__init__ = init


def bandwidth(gib=2, reps=5):
    """Pinned host<->device copy bandwidth, through the same pinned buffer the engine uses."""
    import torch
    from bridge_fgo import hostmem

    n = gib * GIB
    t0 = time.perf_counter()
    host = hostmem.pin(n)
    pin_s = time.perf_counter() - t0
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    out = {"bytes": n, "pin_s": pin_s, "registered": getattr(host, "registered", None),
           "method": getattr(host, "method", None)}
    for name, (dst, src) in {"d2h": (host.tensor, dev), "h2d": (dev, host.tensor)}.items():
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src, non_blocking=True)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        out[f"{name}_GBps"] = n / statistics.median(times) / 1e9
    host.free()
    return out


# the extras of a mode, MODE[:CHUNK_MB]+key=value: key -> (the modes it applies to, how it reaches the run)
ENGINE_KEYS = {
    # bridge_fgo's builtin engine: a GPU memory budget in GiB (states that fit stay on the GPU)
    "budget": (("builtin",), ("env", "BRIDGE_FGO_GPU_BUDGET_GIB")),
    # Megatron-Core's chunked line: the share of parameter bundles whose states are offloaded
    "fraction": (("flag", "auto"), ("arg", "--offload-fraction")),
    # Megatron-Core's fine-grained activation offloading (act=1), beside whatever the mode offloads
    "act": (("base", "builtin"), ("switch", "--act-offload")),
}
MODES = ("base", "builtin", "flag", "auto")
_NUMBER = re.compile(r"[0-9]+(\.[0-9]+)?")
# Values resolved from the runs before them in the same call (issue 17's benchmark): budget=half is
# halfway between the no-offload run's whole-iteration peak and the full-offload streamed run's;
# fraction=moved is the share of the state bytes the first budget run still moved each step.
SYMBOLIC = {"budget": "half", "fraction": "moved"}
_TAG = re.compile(r"[A-Za-z0-9._-]+")


def write_profile(prof, stem):
    """The profiled iteration's ops, by host time and by device time (top 60 each), and the count of
    calls per op name: what the streamed step pays per chunk beyond its copies (STEM.txt); and its
    timeline, gzipped (STEM.trace.json.gz, for chrome://tracing or Perfetto): which stream waits for
    which."""
    import gzip
    import shutil

    prof.export_chrome_trace(stem + ".trace.json")
    with open(stem + ".trace.json", "rb") as src, gzip.open(stem + ".trace.json.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(stem + ".trace.json")
    averages = prof.key_averages()
    with open(stem + ".txt", "w") as f:
        for key in ("self_cpu_time_total", "self_device_time_total"):
            try:
                f.write(f"## sorted by {key}\n" + averages.table(sort_by=key, row_limit=60) + "\n\n")
            except (AttributeError, KeyError, RuntimeError):  # older torch names it self_cuda_time_total
                f.write(f"## sorted by self_cuda_time_total\n"
                        + averages.table(sort_by="self_cuda_time_total", row_limit=60) + "\n\n")


def parse_modes(text):
    """'base,builtin:256,builtin:256+budget=16.2,dev-auto:256+fraction=0.5' -> one dict per run: tag,
    mode, chunk_mb, dev, env (variables for that run), args (extra `run` arguments), extras. A mode may
    repeat (A/B/A/B), then its tags get a run number. dev-: Megatron-Core from --dev-mcore. Raises
    ValueError on anything else. Tags are file-name safe: letters, digits, '.', '_', '-'."""
    tokens = [t.strip() for t in text.split(",")]
    out = []
    for i, token in enumerate(tokens):
        head, *extras = token.split("+")
        name, colon, mb = head.partition(":")
        dev = name.startswith("dev-")
        mode = name[4:] if dev else name
        if mode not in MODES:
            raise ValueError(f"{token!r}: unknown mode {mode!r}; modes: {', '.join(MODES)}, each optionally dev-")
        if colon and not mb.isdigit():
            raise ValueError(f"{token!r}: CHUNK_MB must be a whole number of MB")
        run = {"tag": name + mb, "mode": mode, "chunk_mb": int(mb) if mb else None, "dev": dev, "env": {},
               "args": [], "extras": {}}
        for extra in extras:
            key, eq, value = extra.partition("=")
            if key not in ENGINE_KEYS:
                raise ValueError(f"{token!r}: unknown key {key!r}; keys: {', '.join(ENGINE_KEYS)}")
            modes, (kind, target) = ENGINE_KEYS[key]
            if mode not in modes:
                raise ValueError(f"{token!r}: {key}= applies to mode {' or '.join(modes)}, not {mode}")
            symbolic = value == SYMBOLIC.get(key)
            if kind == "switch":
                if value != "1":
                    raise ValueError(f"{token!r}: {key}= is a switch: {key}=1")
            elif not symbolic and (not eq or not _NUMBER.fullmatch(value) or float(value) <= 0):
                raise ValueError(f"{token!r}: {key}= needs a number > 0 (or {SYMBOLIC[key]}), got {value!r}")
            if key == "fraction" and not symbolic and float(value) > 1:
                raise ValueError(f"{token!r}: fraction= is a share of the states, at most 1")
            if key in run["extras"]:
                raise ValueError(f"{token!r}: {key}= given twice")
            run["extras"][key] = value
            if kind == "env":
                run["env"][target] = value
            elif kind == "switch":
                run["args"] += [target]
            else:
                run["args"] += [target, value]
            run["tag"] += f"_{key}" if kind == "switch" else f"_{key}{value}"
        if tokens.count(token) > 1:
            run["tag"] += f"_{i}"
        if not _TAG.fullmatch(run["tag"]):
            raise ValueError(f"{token!r}: tag {run['tag']!r} is not file-name safe")
        out.append(run)
    tags = [r["tag"] for r in out]
    clash = sorted({t for t in tags if tags.count(t) > 1})
    if clash:
        raise ValueError(f"two different modes give the same tag {clash}")
    return out


def streamed_tag(default_mb):
    """The full-offload streamed run the targets judge: `builtin` (chunk_mb auto) or builtin<MB>."""
    return "builtin" if default_mb in (None, "auto") else f"builtin{default_mb}"


def _overhead(run, ref):
    return run["steady_step_median_s"] - ref["steady_step_median_s"]


def _ratio(a, b):
    return a / b if b and b > 0 else None


def checks(runs, default_mb, extras=None):
    """The streamed step's targets (issue 9), as ratios within this call; and, when present, the budget
    runs (peak against budget, overhead against the full-offload streamed run's) and the chunked line
    (overhead ratios). `extras`: tag -> {key: value} from parse_modes."""
    extras = extras or {}
    base, one, streamed = runs.get("base"), runs.get("builtin0"), runs.get(streamed_tag(default_mb))
    dev_base = runs.get("dev-base")
    chunked_tags = [k for k in runs if k.startswith("dev-auto") and not extras.get(k)]
    chunked = runs[chunked_tags[0]] if chunked_tags else None
    out = {}
    if runs:
        out.update({
            "whole_iteration_peak_gib": {k: v["steady_iter_peak_gib"] for k, v in runs.items()},
            "run_peak_gib": {k: v.get("run_peak_gib") for k, v in runs.items()},
            "setup_peak_gib": {k: v.get("setup_peak_gib") for k, v in runs.items()},
            "forward_backward_peak_gib": {k: v["steady_fwdbwd_peak_gib"] for k, v in runs.items()},
            "steady_step_median_s": {k: v["steady_step_median_s"] for k, v in runs.items()},
            "first_iter_s": {k: v["first_iter_s"] for k, v in runs.items()},
            "inner_optimizer": {k: v.get("inner_optimizer") for k, v in runs.items()},
            "losses_bit_identical": len({json.dumps(v["losses"]) for v in runs.values()}) == 1,
            "final_params_identical": len({v["final_params_sha256"] for v in runs.values()}) == 1,
        })
    overhead = _overhead(streamed, base) if base and streamed else None
    if base and streamed:
        sess = streamed["sessions"]
        step_peak = sum(s.get("step_peak_bytes", 0) for s in sess) / GIB
        offloaded = sum(s.get("bytes", 0) for s in sess)
        pinned = sum(s.get("pinned_bytes", 0) for s in sess)
        masters = sum(s.get("master_bytes", 0) for s in sess) / GIB
        floor = max(streamed["steady_fwdbwd_peak_gib"], streamed["resident_gib"])
        bound = (floor + step_peak) * 1.03
        out.update({
            "peak_bound_gib": bound,
            "peak_within_bound": streamed["steady_iter_peak_gib"] <= bound,
            "step_peak_gib": step_peak,
            "master_gib": masters,
            "builtin_overhead_s": overhead,
            "first_iter_ratio": streamed["first_iter_s"] / base["first_iter_s"],
            "first_iter_within_1_2x": streamed["first_iter_s"] <= 1.2 * base["first_iter_s"],
            "bytes_offloaded": offloaded,
            "pinned_over_offloaded": pinned / offloaded if offloaded else None,
            "pinned_within_5pct": bool(offloaded) and abs(pinned / offloaded - 1) <= 0.05,
        })
        if one:
            out["one_window_peak_gib"] = one["steady_iter_peak_gib"]
        if chunked:
            chunked_overhead = _overhead(chunked, dev_base or base)
            gap = chunked["steady_iter_peak_gib"] - streamed["steady_iter_peak_gib"]
            out.update({
                "chunked_overhead_s": chunked_overhead,
                "overhead_over_chunked": _ratio(overhead, chunked_overhead),
                "overhead_within_0_8x_chunked": overhead <= 0.8 * chunked_overhead,
                "peak_below_chunked_gib": gap,
                "peak_below_chunked_over_masters": gap / masters if masters else None,
                "peak_below_chunked_by_80pct_masters": bool(masters) and gap >= 0.8 * masters,
            })
    budget = {}
    for tag, extra in extras.items():
        if "budget" not in extra or tag not in runs:
            continue
        r, gib = runs[tag], float(extra["budget"])
        entry = {"budget_gib": gib, "whole_iteration_peak_gib": r["steady_iter_peak_gib"],
                 "run_peak_gib": r.get("run_peak_gib"),
                 "peak_within_budget": r["steady_iter_peak_gib"] <= gib,
                 "run_peak_within_budget": r.get("run_peak_gib") is not None and r["run_peak_gib"] <= gib}
        if base:
            entry["overhead_s"] = _overhead(r, base)
            entry["overhead_over_streamed"] = _ratio(entry["overhead_s"], overhead)
        budget[tag] = entry
    if budget:
        out["budget_runs"] = budget
    line = {}
    for tag in (k for k in runs if k.startswith("dev-auto") or k.startswith("auto")):
        ref = dev_base if tag.startswith("dev-") and dev_base else base
        if not ref:
            continue
        r = runs[tag]
        entry = {"offload_fraction": (extras.get(tag) or {}).get("fraction"), "overhead_s": _overhead(r, ref),
                 "step_over_base": _ratio(r["steady_step_median_s"], ref["steady_step_median_s"]),
                 "whole_iteration_peak_gib": r["steady_iter_peak_gib"]}
        if chunked and tag not in chunked_tags:
            entry["overhead_over_full_chunked"] = _ratio(entry["overhead_s"], _overhead(chunked, dev_base or base))
        if overhead is not None:
            entry["streamed_overhead_over_this"] = _ratio(overhead, entry["overhead_s"])
        line[tag] = entry
    if line:
        out["chunked_line"] = line
    both = activation_offload(runs, default_mb)
    if both:
        out["activation_offload"] = both
    norms = params_norms(runs)
    if norms:
        out["params_norm"] = norms
    return out


def params_norms(runs):
    """Each run's logged parameter norms against the base run's: the largest relative difference (0.0:
    bit-identical), for issue 24's log_params_norm."""
    base = (runs.get("base") or {}).get("params_norms")
    if not base:
        return None
    out = {}
    for tag, r in runs.items():
        mine = r.get("params_norms")
        if tag == "base" or not mine or len(mine) != len(base):
            continue
        out[tag] = {"identical": mine == base,
                    "largest_relative_difference": max(abs(a - b) / abs(b) for a, b in zip(mine, base) if b)}
    return out or None


def activation_offload(runs, default_mb):
    """The four cases of issue 24 (neither, activation offload alone, the streamed step alone, both):
    whether the savings add up (both within 5% of the base's peak less both savings) and the overheads
    too (both at most the sum of the two single overheads), and bit-identical losses."""
    tag = streamed_tag(default_mb)
    base, act, streamed, both = (runs.get(t) for t in ("base", "base_act", tag, f"{tag}_act"))
    if not (base and act and streamed and both):
        return None
    peak = {k: r["steady_iter_peak_gib"] for k, r in (("base", base), ("act", act), ("streamed", streamed),
                                                      ("both", both))}
    additive = peak["base"] - (peak["base"] - peak["act"]) - (peak["base"] - peak["streamed"])
    over = {k: _overhead(r, base) for k, r in (("act", act), ("streamed", streamed), ("both", both))}
    return {"whole_iteration_peak_gib": peak, "both_expected_gib": additive,
            "both_within_5pct_of_additive": peak["both"] <= 1.05 * additive,
            "overhead_s": over, "both_overhead_at_most_sum": over["both"] <= over["act"] + over["streamed"],
            "losses_bit_identical": len({json.dumps(r["losses"]) for r in (base, act, streamed, both)}) == 1,
            "final_params_identical": len({r["final_params_sha256"] for r in (base, act, streamed, both)}) == 1}


def peak_line(tag, s):
    """One run's line in `all`: whole-iteration peak first, then the peaks from process start."""
    def gib(key):
        v = s.get(key)
        return "-" if v is None else f"{v:.2f}"

    return (f"{tag}: iteration peak {gib('steady_iter_peak_gib')} GiB (run {gib('run_peak_gib')}, setup "
            f"{gib('setup_peak_gib')}, first iteration {gib('first_iter_peak_gib')}"
            + (f", resume {gib('resume_peak_gib')}" if s.get("resume_peak_gib") is not None else "")
            + f"), forward-backward {gib('steady_fwdbwd_peak_gib')} GiB, step {s['steady_step_median_s']:.3f} s, "
            f"first {s['first_iter_s']:.2f} s, {s.get('inner_optimizer')}")


def resolve_symbolic(run, results, default_mb) -> bool:
    """Replace budget=half / fraction=moved by numbers from the runs already made (False: cannot)."""
    for key, word in SYMBOLIC.items():
        if run["extras"].get(key) != word:
            continue
        if key == "budget":
            base, full = results.get("base"), results.get(streamed_tag(default_mb))
            if not (base and full):
                return False
            value = f"{(base['steady_iter_peak_gib'] + full['steady_iter_peak_gib']) / 2:.3f}"
        else:
            budgeted = next((r for t, r in results.items() if "_budget" in t), None)
            sess = budgeted and budgeted.get("sessions")
            if not sess:
                return False
            moved, resident = sum(s.get("bytes", 0) for s in sess), sum(s.get("resident_bytes") or 0 for s in sess)
            value = f"{moved / (moved + resident):.4f}" if moved + resident else "1"
        run["extras"][key] = value
        kind, target = ENGINE_KEYS[key][1]
        if kind == "env":
            run["env"][target] = value
        else:
            run["args"] = [a if a != word else value for a in run["args"]]
    return True


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
        # a variable a mode can set is that mode's alone: never inherited from the caller's shell
        env = {k: v for k, v in os.environ.items() if k not in managed}
        env.update(run["env"])
        if run["dev"]:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.abspath(args.dev_mcore), env.get("PYTHONPATH")) if p)
        cmd = [sys.executable, os.path.abspath(__file__), "run", "--mode", run["mode"], "--iters", str(args.iters),
               "--out", path, "--optimizer", args.optimizer, *run["args"]]
        cmd += ["--chunk-mb", str(run["chunk_mb"])] if run["chunk_mb"] is not None else []
        cmd += ["--precision-aware"] if args.precision_aware else []
        cmd += ["--recompute"] if args.recompute else []
        cmd += ["--te-spec"] if args.te_spec else []
        cmd += ["--log-params-norm"] if args.log_params_norm else []
        cmd += ["--fp16"] if args.fp16 else []
        cmd += ["--bypass-te-adam-check"] if args.bypass_te_adam_check else []
        cmd += ["--profile-iter", str(args.profile_iter)] if args.profile_iter else []
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
               + (" TE spec" if args.te_spec else ""),
               "optimizer": args.optimizer + (" precision-aware" if args.precision_aware else ""),
               "modes": args.modes, "runs": results,
               "checks": checks(results, args.default_chunk_mb, {r["tag"]: r["extras"] for r in runs})}
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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--mode", choices=("base", "builtin", "flag", "auto"), required=True,
                   help="base: no offload; builtin: bridge_fgo's engine; flag: cfg.optimizer.offload_optimizer_states="
                        "True without bridge_fgo; auto: the flag and bridge_fgo.patch()")
    r.add_argument("--bypass-te-adam-check", action="store_true",
                   help="test-only: let the dev-line offloader accept torch AdamW (see bypass_te_adam_check)")
    r.add_argument("--iters", type=int, default=10)
    r.add_argument("--chunk-mb", type=int, help="builtin: bridge_fgo's window; auto: Megatron-Core's chunk size")
    add_optimizer_args(r)
    r.add_argument("--offload-fraction", type=float, metavar="F",
                   help="flag/auto on Megatron-Core's chunked line: optimizer_state_offload_fraction (0 < F <= 1)")
    r.add_argument("--recompute", action="store_true", help="full activation recomputation")
    r.add_argument("--te-spec", action="store_true", help="Transformer Engine's layer spec (needs TE installed)")
    r.add_argument("--log-params-norm", action="store_true",
                   help="Bridge's log_params_norm: the parameter norm after every step, recorded (params_norms)")
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
    r.add_argument("--tp", type=int, default=1)
    r.add_argument("--pp", type=int, default=1)
    r.add_argument("--vpp", type=int, help="virtual pipeline stages per pipeline rank")
    r.add_argument("--ep", type=int, default=1, help="expert-parallel size (with --experts)")
    r.add_argument("--experts", type=int, help="a mixture-of-experts model with this many experts")
    r.add_argument("--topk", type=int, default=2)
    r.add_argument("--moe-ffn", type=int, default=1408)
    r.add_argument("--deterministic", action="store_true", help="the model's deterministic_mode (needs NCCL_ALGO)")
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
    a.add_argument("--dev-mcore", default=".mlm", help="a Megatron-LM source tree (its megatron/core) for dev- modes")
    a.add_argument("--default-chunk-mb", default="auto",
                   help="the streamed run the targets judge: auto (mode builtin) or a chunk size (builtin:MB)")
    a.add_argument("--recompute", action="store_true")
    a.add_argument("--te-spec", action="store_true", help="every run with Transformer Engine's layer spec")
    a.add_argument("--log-params-norm", action="store_true", help="every run logs the parameter norm (compared)")
    a.add_argument("--fp16", action="store_true")
    a.add_argument("--bandwidth", action="store_true", help="also measure pinned host<->device bandwidth")
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
    args = ap.parse_args()
    if args.precision_aware and args.optimizer != "te":
        ap.error("--precision-aware needs --optimizer te (Megatron-Core takes it only from Transformer Engine's FusedAdam)")
    if args.cmd == "run" and args.act_offload and not args.te_spec:
        ap.error("--act-offload needs --te-spec: Megatron-Bridge allows activation offloading only with "
                 "transformer_impl='transformer_engine'")
    if args.cmd == "run" and args.offload_fraction is not None:
        if not 0 < args.offload_fraction <= 1:
            ap.error("--offload-fraction must be in (0, 1]")
        if args.mode not in ("flag", "auto"):
            ap.error("--offload-fraction needs --mode flag or auto (Megatron-Core's chunked line)")
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
    run(args) if args.cmd == "run" else run_all(args)


if __name__ == "__main__":
    main()
