#!/usr/bin/env python3
"""Benchmark: real Megatron-Bridge pretrain() with and without bridge_fgo's builtin offload engine.

  python scripts/bench_offload.py all --out-dir DIR --modes base,builtin:0,builtin:256,dev-base,dev-auto:256
  python scripts/bench_offload.py run --mode builtin --chunk-mb 256 --out F   # one mode (under torchrun too)

Parallel layouts for scripts/bench_matrix.py: --tp, --pp/--vpp, --experts/--ep (a mixture-of-experts
model on Megatron-Core's local spec); checkpoints for scripts/check_checkpoint.py: --save/--save-interval/
--async-save, --load/--ckpt-step/--resume-fix.

Workload: Llama-style GPT, 887M parameters (16 layers, hidden 2048, ffn 5632, seq 1024, mbs 2, gbs 16),
bf16, distributed optimizer (torch AdamW inside: no Transformer Engine), mock data, Megatron-Core's
'local' transformer implementation. Per iteration it records the forward-backward peak (from
forward_backward_func's entry, after offload and release, to gradient finalization), the whole-
iteration peak, step time and loss; at the end a hash of the final parameters. `all` also measures
pinned host<->device bandwidth with bridge_fgo's own pinned buffer, and checks the targets.
"""
import argparse
import hashlib
import json
import logging
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
GIB = 2**30


def run(args):
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29517").items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    if args.deterministic:  # before CUDA and NCCL start: Bridge asserts NCCL_ALGO; cuBLAS needs a fixed workspace
        os.environ.setdefault("NCCL_ALGO", "Ring")
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s: %(message)s")
    sys.path.insert(0, HERE)
    import bench_imports

    bench_imports.install()
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

    def measured_step(forward_step_func, data_iterator, model, optimizer, *a, **k):
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
            torch.cuda.reset_peak_memory_stats()
            return fbf(*fa, **fk)

        a[3] = fb_probe
        torch.cuda.synchronize()
        recs.append({"iter": len(recs) + 1})
        stats0 = torch.cuda.memory_stats()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
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
        print("ITER " + json.dumps(r), flush=True)
        return out

    T.train_step = measured_step
    if not os.path.exists(os.path.join(os.path.dirname(mcd.__file__), "Makefile")):
        from megatron.core.datasets import helpers_cpp  # noqa: F401  the wheel ships it prebuilt

        initialize.compile_helpers = lambda: None  # the wheel has no Makefile for `make`

    # --fp16: dynamic loss scaling from --loss-scale, high enough that the first steps overflow and are skipped
    fp16 = dict(initial_loss_scale=args.loss_scale) if args.fp16 else {}
    opt = C.OptimizerConfig(optimizer="adam", lr=3e-4, min_lr=3e-5, weight_decay=0.1, bf16=not args.fp16,
                            fp16=args.fp16, **fp16,
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
    model = GPTModelProvider(
        transformer_layer_spec=local_layer_spec, transformer_impl="local", num_layers=args.layers,
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
        logger=C.LoggerConfig(log_interval=1, tensorboard_dir=None),
        tokenizer=C.TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=32000),
        # --save: one synchronous torch_dist checkpoint at the last iteration (scripts/check_checkpoint.py)
        checkpoint=C.CheckpointConfig(save=args.save, load=args.load, ckpt_step=args.ckpt_step,
                                      save_interval=(args.save_interval or args.iters) if args.save else None,
                                      ckpt_format="torch_dist", async_save=args.async_save, save_optim=True),
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
    h = hashlib.sha256()
    for chunk in held["model"]:  # every virtual-pipeline chunk of this rank
        for p in chunk.parameters():
            h.update(p.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
    steady = [r for r in recs if r["iter"] > 2]
    rank = int(os.environ.get("RANK", "0"))
    summary = {
        "mode": args.mode, "chunk_mb": args.chunk_mb, "recompute": args.recompute, "rank": rank,
        "layout": {"tp": args.tp, "pp": args.pp, "vpp": args.vpp, "ep": args.ep, "dp": dp, "experts": args.experts,
                   "deterministic": args.deterministic, "overlap": overlap},
        "checkpoint": {"save": args.save, "save_interval": args.save_interval, "async_save": args.async_save,
                       "load": args.load, "ckpt_step": args.ckpt_step, "resume_fix": args.resume_fix}, "megatron_core_from": os.path.dirname(sys.modules["megatron.core"].__file__),
        "te_adam_check_bypassed": args.bypass_te_adam_check, "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "iters": len(recs), "pretrain_wall_s": wall,
        "first_iter_s": recs[0]["step_s"], "second_iter_s": recs[1]["step_s"] if len(recs) > 1 else None,
        "steady_step_median_s": statistics.median(r["step_s"] for r in steady),
        "steady_fwdbwd_peak_gib": max(r["fwdbwd_peak_gib"] for r in steady),
        "resident_gib": statistics.median(r["alloc_fwdbwd_entry_gib"] for r in steady),
        "steady_iter_peak_gib": max(r["iter_peak_gib"] for r in steady),
        "max_iter_peak_gib": max(r["iter_peak_gib"] for r in recs),
        "losses": [r["loss"] for r in recs],
        "skipped_iters": [r["iter"] for r in recs if r["skipped"]],
        "final_params_sha256": h.hexdigest(),
        "sessions": report_holder.get("sessions", []),
    }
    print("SUMMARY " + json.dumps(summary), flush=True)
    if args.out:
        out = args.out if rank == 0 else args.out.replace(".json", f".rank{rank}.json")
        with open(out, "w") as f:
            json.dump({"summary": summary, "iters": recs}, f, indent=1)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


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
    from bridge_fgo.engine import PinnedBuffer

    n = gib * GIB
    t0 = time.perf_counter()
    host = PinnedBuffer(n, cuda=True)
    pin_s = time.perf_counter() - t0
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    out = {"bytes": n, "pin_s": pin_s, "registered": host.registered}
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


def parse_modes(text):
    """'base,builtin:0,builtin:64,dev-base,dev-auto:256' -> [(tag, mode, chunk_mb, dev)]. A mode may
    repeat (A/B/A/B), then its tags get a run number. dev-: Megatron-Core from --dev-mcore."""
    tokens = text.split(",")
    out = []
    for i, token in enumerate(tokens):
        name, _, mb = token.partition(":")
        dev = name.startswith("dev-")
        mode = name[4:] if dev else name
        tag = name + mb
        if tokens.count(token) > 1:
            tag += f"_{i}"
        out.append((tag, mode, int(mb) if mb else None, dev))
    return out


def checks(runs, default_mb):
    """The streamed step's targets (issue 9), as ratios within this call."""
    base, one, streamed = runs.get("base"), runs.get("builtin0"), runs.get(f"builtin{default_mb}")
    dev_base, chunked = runs.get("dev-base"), next((v for k, v in runs.items() if k.startswith("dev-auto")), None)
    if not (base and streamed):
        return {}
    sess = streamed["sessions"]
    step_peak = sum(s.get("step_peak_bytes", 0) for s in sess) / GIB
    offloaded = sum(s.get("bytes", 0) for s in sess)
    pinned = sum(s.get("pinned_bytes", 0) for s in sess)
    masters = sum(s.get("master_bytes", 0) for s in sess) / GIB
    floor = max(streamed["steady_fwdbwd_peak_gib"], streamed["resident_gib"])
    bound = (floor + step_peak) * 1.03
    overhead = streamed["steady_step_median_s"] - base["steady_step_median_s"]
    out = {
        "whole_iteration_peak_gib": {k: v["steady_iter_peak_gib"] for k, v in runs.items()},
        "forward_backward_peak_gib": {k: v["steady_fwdbwd_peak_gib"] for k, v in runs.items()},
        "steady_step_median_s": {k: v["steady_step_median_s"] for k, v in runs.items()},
        "first_iter_s": {k: v["first_iter_s"] for k, v in runs.items()},
        "losses_bit_identical": len({json.dumps(v["losses"]) for v in runs.values()}) == 1,
        "final_params_identical": len({v["final_params_sha256"] for v in runs.values()}) == 1,
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
    }
    if one:
        out["one_window_peak_gib"] = one["steady_iter_peak_gib"]
    if chunked:
        chunked_overhead = chunked["steady_step_median_s"] - (dev_base or base)["steady_step_median_s"]
        gap = chunked["steady_iter_peak_gib"] - streamed["steady_iter_peak_gib"]
        out.update({
            "chunked_overhead_s": chunked_overhead,
            "overhead_over_chunked": overhead / chunked_overhead if chunked_overhead > 0 else None,
            "overhead_within_0_8x_chunked": overhead <= 0.8 * chunked_overhead,
            "peak_below_chunked_gib": gap,
            "peak_below_chunked_over_masters": gap / masters if masters else None,
            "peak_below_chunked_by_80pct_masters": bool(masters) and gap >= 0.8 * masters,
        })
    return out


def run_all(args):
    os.makedirs(args.out_dir, exist_ok=True)
    results = {}
    for tag, mode, chunk_mb, dev in parse_modes(args.modes):
        path = os.path.join(args.out_dir, f"{tag}.json")
        log = os.path.join(args.out_dir, f"{tag}.log")
        env = dict(os.environ)
        if dev:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.abspath(args.dev_mcore), env.get("PYTHONPATH")) if p)
        cmd = [sys.executable, os.path.abspath(__file__), "run", "--mode", mode, "--iters", str(args.iters),
               "--out", path]
        cmd += ["--chunk-mb", str(chunk_mb)] if chunk_mb is not None else []
        cmd += ["--recompute"] if args.recompute else []
        cmd += ["--fp16"] if args.fp16 else []
        cmd += ["--bypass-te-adam-check"] if args.bypass_te_adam_check else []
        with open(log, "w") as f:
            rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        if rc != 0:
            print(f"{tag} run failed (rc={rc}); see {log}", flush=True)
            continue
        with open(path) as f:
            results[tag] = json.load(f)["summary"]
        print(f"{tag}: iteration peak {results[tag]['steady_iter_peak_gib']:.2f} GiB, forward-backward "
              f"{results[tag]['steady_fwdbwd_peak_gib']:.2f} GiB, step {results[tag]['steady_step_median_s']:.3f} s, "
              f"first {results[tag]['first_iter_s']:.2f} s", flush=True)
    summary = {"workload": "887M" + (" full recompute" if args.recompute else "") + (" fp16" if args.fp16 else ""),
               "runs": results,
               "checks": checks(results, args.default_chunk_mb)}
    if args.bandwidth:
        summary["bandwidth"] = bandwidth()
    with open(os.path.join(args.out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary["checks"], indent=1))


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
    r.add_argument("--recompute", action="store_true", help="full activation recomputation")
    r.add_argument("--save", help="save torch_dist checkpoints here (at the last iteration, or every --save-interval)")
    r.add_argument("--save-interval", type=int)
    r.add_argument("--async-save", action="store_true", help="Bridge's async_save=True")
    r.add_argument("--load", help="resume from this checkpoint directory")
    r.add_argument("--ckpt-step", type=int, help="with --load: the iteration to resume from")
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
    a = sub.add_parser("all")
    a.add_argument("--out-dir", required=True)
    a.add_argument("--iters", type=int, default=10)
    a.add_argument("--modes", default="base,builtin:0,builtin:256",
                   help="comma-separated MODE[:CHUNK_MB]; a dev- prefix runs with --dev-mcore first on PYTHONPATH")
    a.add_argument("--dev-mcore", default=".mlm", help="a Megatron-LM source tree (its megatron/core) for dev- modes")
    a.add_argument("--default-chunk-mb", type=int, default=256, help="the window the targets judge")
    a.add_argument("--recompute", action="store_true")
    a.add_argument("--fp16", action="store_true")
    a.add_argument("--bandwidth", action="store_true", help="also measure pinned host<->device bandwidth")
    a.add_argument("--bypass-te-adam-check", action="store_true")
    args = ap.parse_args()
    run(args) if args.cmd == "run" else run_all(args)


if __name__ == "__main__":
    main()
