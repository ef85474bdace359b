"""One run of scripts/bench_offload.py (`run`): real Megatron-Bridge pretrain() with the measurements.

Workload (bench_workload.py): Llama-style GPT, 887M parameters (16 layers, hidden 2048, ffn 5632; by default
sequences of 1024 tokens, micro-batch 2, global batch 16: --seq-length, --micro-batch, --global-batch),
bf16, distributed optimizer (--optimizer picks what runs inside), mock data, Megatron-Core's
'local' transformer implementation. Per iteration it records the forward-backward peak (from
forward_backward_func's entry, after offload and release, to gradient finalization), the whole-
iteration peak, step time and loss; at the end a hash of the final parameters. Peaks from process start:
setup_peak_gib (everything setup allocated, read at the first train_step's entry), first_iter_peak_gib,
run_peak_gib (setup, every iteration, and what ran between iterations and after the last, such as a
checkpoint save), resume_peak_gib (setup_peak_gib of a run with --load). `all` also measures
pinned host<->device bandwidth with bridge_fgo's own pinned buffer, and checks the targets.
"""
import hashlib
import importlib
import json
import logging
import os
import resource
import statistics
import sys
import time

import bench_workload
import fsdp_layout
from bench_workload import check_optimizer, precision_summary

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
    if not args.fsdp:  # Megatron-FSDP asserts it is unset or > 1
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    if args.act_offload:  # Bridge requires it with Transformer Engine >= 2.10 (its own activation offload off)
        os.environ.setdefault("NVTE_CPU_OFFLOAD_V1", "1")
    if args.deterministic:  # before CUDA and NCCL start: Bridge asserts NCCL_ALGO; cuBLAS needs a fixed workspace
        os.environ.setdefault("NCCL_ALGO", "Ring")
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        # Megatron-Core refuses TE's DotProductAttention under deterministic_mode otherwise
        os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
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
        bench_workload.bypass_te_adam_check()
    import torch
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain
    import megatron.bridge.training.initialize as initialize
    import megatron.bridge.training.train as T
    import megatron.core.datasets as mcd
    from megatron.core.utils import get_model_config

    recs, held = [], {}
    inner_step = T.train_step
    saves, finalizes = [], []
    import bench_saves

    bench_saves.instrument_setup(held)  # Bridge's setup and load timers, bridge_fgo's pinning (issue 43)
    if args.save:  # each save and each finalize that found one pending, timed on the training thread
        bench_saves.instrument(saves, finalizes)

    def measured_step(forward_step_func, data_iterator, model, optimizer, *a, **k):
        # the peak since the last reset: at the first entry everything setup allocated (model, grad
        # buffers, Megatron-Core's fp32 masters, a loaded checkpoint); later, the previous iteration's
        # last phase and whatever ran between the two iterations
        entry_peak = torch.cuda.max_memory_allocated() / GIB
        if not recs:
            held["setup_peak_gib"] = entry_peak
            held["inner_optimizer"] = check_optimizer(optimizer, args.optimizer, cpu=args.mode == "cpu",
                                                      muon=getattr(args, "muon", False))
        else:
            recs[-1]["tail_peak_gib"] = entry_peak
        held["model"] = model
        held["optimizer"] = optimizer
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
        first = not recs
        recs.append({"iter": len(recs) + 1, "phase_peaks": "from process start" if first else "per phase"})
        stats0 = torch.cuda.memory_stats()
        if not first:
            # never before the first iteration: bridge_fgo sizes its first step under the run's peak so far,
            # setup's included, as in a run nobody resets (its phase peaks then count from process start)
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        if args.profile_iter == len(recs):  # this iteration under torch.profiler: its op tables beside --out
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                out = inner_step(forward_step_func, data_iterator, model, optimizer, *a, **k)
                torch.cuda.synchronize()
            write_profile(prof, (args.out or "bench") + f".profile-iter{len(recs)}")
        else:
            if args.dump_layout and first:
                dump_layout(args, "before_step1", model, optimizer)
            out = inner_step(forward_step_func, data_iterator, model, optimizer, *a, **k)
            if args.dump_layout and first:
                dump_layout(args, "after_step1", model, optimizer)
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
    logits = []
    if getattr(args, "qk_clip", None) is not None:  # what train_step's clip_qk returns: the max attention logit
        logged_clip = T.clip_qk

        def recorded_clip(*a, **k):
            value = logged_clip(*a, **k)
            logits.append(None if value is None else float(value))
            return value

        T.clip_qk = recorded_clip
    if not os.path.exists(os.path.join(os.path.dirname(mcd.__file__), "Makefile")):
        from megatron.core.datasets import helpers_cpp  # noqa: F401  the wheel ships it prebuilt

        initialize.compile_helpers = lambda: None  # the wheel has no Makefile for `make`

    cfg, opt, norm_override, dp, overlap = bench_workload.build(args)
    report_holder = {}
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
    h, meta = ((fsdp_layout.digest(held["model"], held["optimizer"]), fp8_meta_digest(held["model"]))
               if fsdp_layout.is_fsdp(held["model"]) else params_digest(held["model"]))
    steady = [r for r in recs if r["iter"] > 2] or recs[-1:]  # a run of 2 iterations (a checkpoint's prep): its last
    rank = int(os.environ.get("RANK", "0"))
    summary = {
        "mode": args.mode, "chunk_mb": args.chunk_mb, "recompute": args.recompute, "rank": rank,
        "batch": {"seq_length": args.seq_length, "micro_batch": args.micro_batch, "global_batch": args.global_batch},
        "engine_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("BRIDGE_FGO_")},
        "offload_fraction": args.offload_fraction,
        "optimizer": args.optimizer, "inner_optimizer": held.get("inner_optimizer"), "hidden_modules": list(hidden),
        "precision_aware": precision_summary(opt, args.precision_aware),
        # the final norm Megatron-Core would have used instead (apex's FusedLayerNorm has no RMSNorm)
        "norm_override": norm_override or None,
        "layout": {"tp": args.tp, "pp": args.pp, "vpp": args.vpp, "ep": args.ep, "dp": dp, "experts": args.experts, "fsdp": args.fsdp,
                   "hsdp": getattr(args, "hsdp", None) and [args.hsdp, args.hsdp_instances],
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
        # the phases: before forward-backward (offload, the param-buffer copy, release), forward-backward, and
        # the step phase (reload, gradient finalization, the optimizer step)
        "steady_pre_median_s": statistics.median(r["pre_s"] for r in steady),
        "steady_fwdbwd_median_s": statistics.median(r["fwdbwd_s"] for r in steady),
        "steady_post_median_s": statistics.median(r["post_s"] for r in steady),
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
        # with --qk-clip: each step's max attention logit before clipping (above the threshold: the step clipped)
        "max_attention_logits": logits or None, "qk_clip_threshold": getattr(args, "qk_clip", None),
        "skipped_iters": [r["iter"] for r in recs if r["skipped"]],
        "final_params_sha256": h,
        "fp8": getattr(args, "fp8", None),
        # FP8 runs: every TE module's scaling state (amax history, scale) at the end
        "final_fp8_meta_sha256": meta,
        "sessions": report_holder.get("sessions", []),
    }
    summary.update(bench_saves.setup_figures(held, recs))
    if args.save:
        summary.update(bench_saves.summarize(recs, saves, finalizes))
    print("SUMMARY " + json.dumps(summary), flush=True)
    if args.out:
        out = args.out if rank == 0 else args.out.replace(".json", f".rank{rank}.json")
        with open(out, "w") as f:
            json.dump({"summary": summary, "iters": recs}, f, indent=1)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


# a quantized parameter's own bytes (Transformer Engine's Float8Tensor and blockwise tensors): its data and
# scales, not a dequantized copy; transposes are derived from them
QUANTIZED_FIELDS = ("_data", "_scale_inv", "_rowwise_data", "_rowwise_scale_inv", "_columnwise_data",
                    "_columnwise_scale_inv")


def dump_layout(args, phase, model, optimizer):
    """--dump-layout PATH: Megatron-FSDP's layout as this rank holds it (scripts/fsdp_layout.py), one JSON per
    rank and phase."""
    rank = int(os.environ.get("RANK", "0"))
    try:
        desc = fsdp_layout.describe(model, optimizer)
    except Exception as e:  # the probe must not end the run it describes
        desc = {"error": f"{type(e).__name__}: {e}"}
    with open(f"{args.dump_layout}.{phase}.rank{rank}.json", "w") as f:
        json.dump(desc, f, indent=1, default=str)


def feed(h, t):
    """The bytes of `t` into the hash `h`."""
    import torch

    h.update(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())


def fp8_meta_digest(model):
    """sha256 of every TE module's fp8_meta amax history and scale, or None without FP8."""
    import torch

    m, any_meta = hashlib.sha256(), False
    for chunk in model:
        for mod in chunk.modules():
            fp8_meta = getattr(mod, "fp8_meta", None)
            if isinstance(fp8_meta, dict):
                for key in ("scaling_fwd", "scaling_bwd"):
                    s = fp8_meta.get(key)
                    for t in (getattr(s, "amax_history", None), getattr(s, "scale", None)):
                        if isinstance(t, torch.Tensor):
                            feed(m, t.view(-1))
                            any_meta = True
    return m.hexdigest() if any_meta else None


def params_digest(model):
    """(sha256 of every parameter's bytes, FP8 parameters as their FP8 data and scales; fp8_meta_digest)."""
    import torch

    h = hashlib.sha256()
    for chunk in model:  # every virtual-pipeline chunk of this rank
        for p in chunk.parameters():
            fields = [getattr(p, f, None) for f in QUANTIZED_FIELDS]
            if any(isinstance(t, torch.Tensor) for t in fields):
                for t in fields:
                    if isinstance(t, torch.Tensor):
                        feed(h, t.view(-1))
                q = getattr(p, "_quantizer", None)
                for t in (getattr(q, "scale", None), getattr(q, "amax", None)):
                    if isinstance(t, torch.Tensor) and t.numel():
                        feed(h, t.view(-1))
            else:
                feed(h, p)
    return h.hexdigest(), fp8_meta_digest(model)


def bandwidth(gib=2, reps=5):
    """Pinned host<->device copy bandwidth, through the same pinned buffer the engine uses (the copies timed
    as scripts/bench_numa.py times them)."""
    import torch
    from bench_numa import timed_copies
    from bridge_fgo import hostmem

    n = gib * GIB
    t0 = time.perf_counter()
    host = hostmem.pin(n)
    pin_s = time.perf_counter() - t0
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    out = {"bytes": n, "pin_s": pin_s, "registered": getattr(host, "registered", None),
           "method": getattr(host, "method", None)}
    for name, figures in timed_copies(host.tensor, dev, reps).items():
        out[f"{name}_GBps"] = figures["GBps_median"]
    host.free()
    return out


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
                f.write("## sorted by self_cuda_time_total\n"
                        + averages.table(sort_by="self_cuda_time_total", row_limit=60) + "\n\n")
