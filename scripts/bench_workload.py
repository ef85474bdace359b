"""The workload of scripts/bench_offload.py: Bridge's configuration of the model, data, optimizer and
checkpoints for one run (build), and the optimizer stack it asserts (check_optimizer). The model is the
same local-spec model in every optimizer stack (norm_safe_spec). Imports no torch at module level.
"""
import os
import sys

# --optimizer -> what the module of the optimizer inside Megatron-Core's DistributedOptimizer must contain
OPTIMIZER_MODULES = {"torch": "torch.optim", "apex": "apex.optimizers", "te": "transformer_engine"}
# --fp8: Bridge's mixed-precision recipe for each scaling, fp8_param_gather on (the subchannel recipe leaves
# it off; it is turned on here)
FP8_RECIPES = {"delayed": "bf16_with_fp8_delayed_scaling_mixed", "tensorwise": "bf16_with_fp8_current_scaling_mixed",
               "blockwise": "bf16_with_fp8_subchannel_scaling_mixed"}
CPU_OPTIMIZER_MODULE = "megatron.core.optimizer.cpu_offloading"


MUON_CLASS = "TensorParallelMuon"  # Megatron-Core's subclass of emerging-optimizers' Muon


def inner_optimizers(optimizer):
    """The optimizers inside Megatron-Core's wrappers: one per chained optimizer (MoE: dense and expert;
    Muon: the layer-wise optimizer's), nested chains walked."""
    chain = getattr(optimizer, "chained_optimizers", None)
    if chain is None:
        return [getattr(optimizer, "optimizer", optimizer)]
    return [o for part in chain for o in inner_optimizers(part)]


def check_optimizer(optimizer, stack, cpu=False, muon=False):
    """'module.qualname' of the optimizer Megatron-Core built; raises if it is not the stack's (with `cpu`,
    Megatron-Core's CPU optimizer, HybridDeviceOptimizer; with `muon`, Muon on the matrices beside the
    stack's Adam)."""
    names = sorted({f"{type(o).__module__}.{type(o).__qualname__}" for o in inner_optimizers(optimizer)})
    expected = CPU_OPTIMIZER_MODULE if cpu else OPTIMIZER_MODULES[stack]
    wrong = [n for n in names if expected not in n.rsplit(".", 1)[0] and not (muon and n.endswith("." + MUON_CLASS))]
    if muon and not any(n.endswith("." + MUON_CLASS) for n in names):
        wrong.append(f"no {MUON_CLASS}")
    if wrong or not names:
        raise RuntimeError(f"--optimizer {stack}{' --mode cpu' if cpu else ''}{' --muon' if muon else ''}: Megatron-Core "
                           f"built {names or 'no optimizer'}, expected a class from {expected}"
                           f"{f' and a {MUON_CLASS}' if muon else ''} (not: {', '.join(wrong) or 'none'}); the "
                           "optimizer stack is not what this run claims")
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


def qk_clip(args) -> dict:
    """--qk-clip THRESHOLD: MuonClip (Megatron-Core's clip_qk after each step, TE's attention records the logits)."""
    if getattr(args, "qk_clip", None) is None:
        return {}
    if not args.te_spec:
        sys.exit("--qk-clip needs --te-spec: Megatron-Core records the max attention logits in TE's attention")
    return dict(qk_clip=True, qk_clip_threshold=args.qk_clip)


def mixed_precision(args):
    """Bridge's mixed-precision recipe: bf16 or fp16, or with --fp8 an FP8 one with FP8 parameters."""
    if not getattr(args, "fp8", None):
        return "fp16_mixed" if args.fp16 else "bf16_mixed"
    if not args.te_spec or args.fp16:
        sys.exit("--fp8 needs --te-spec (FP8 runs in Transformer Engine's layers) and bf16")
    from megatron.bridge.training.mixed_precision import get_mixed_precision_config

    mp = get_mixed_precision_config(FP8_RECIPES[args.fp8])
    mp.fp8_param_gather = True  # kept in sync with fp8_param by Bridge
    return mp


def recipe_optimizer_utils():
    """Bridge's megatron/bridge/recipes/utils/optimizer_utils.py, loaded from its file: importing it by name runs
    the recipes package, which imports every model family's recipes (diffusers among their needs)."""
    import importlib.util

    name = "megatron.bridge.recipes.utils.optimizer_utils"
    if name in sys.modules:
        return sys.modules[name]
    (root,) = importlib.util.find_spec("megatron.bridge").submodule_search_locations
    spec = importlib.util.spec_from_file_location(name, os.path.join(root, "recipes", "utils", "optimizer_utils.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(args):
    """Bridge's ConfigContainer for this run: (cfg, its OptimizerConfig, the norms replaced, data-parallel
    size, whether gradient reduction and parameter gathering overlap)."""
    import torch
    from megatron.bridge.models.gpt_provider import GPTModelProvider, local_layer_spec
    from megatron.bridge.training import config as C

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
    # --mode cpu: Megatron-Core's CPU optimizer (HybridDeviceOptimizer, NeMo-RL's way): Adam on the host for
    # --offload-fraction of the parameters (default all), its copies overlapped with the host's update
    cpu = (dict(optimizer_cpu_offload=True, overlap_cpu_optimizer_d2h_h2d=True,
                optimizer_offload_fraction=1.0 if args.offload_fraction is None else args.offload_fraction)
           if args.mode == "cpu" else {})
    opt = C.OptimizerConfig(optimizer="adam", lr=3e-4, min_lr=3e-5, weight_decay=0.1, bf16=not args.fp16,
                            fp16=args.fp16, **fp16, **precision, **cpu,
                            adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, use_distributed_optimizer=True,
                            clip_grad=1.0)
    sched = C.SchedulerConfig(start_weight_decay=0.033, end_weight_decay=0.033, weight_decay_incr_style="constant",
                              lr_decay_style="cosine", lr_warmup_iters=2, lr_warmup_init=0.0, lr_decay_iters=None,
                              override_opt_param_scheduler=True)
    if getattr(args, "muon", False):
        # Bridge's own Muon recipe helper (Kimi-K2, DeepSeek-V4): dist_muon with its Muon settings, Adam on the
        # rest, the distributed optimizer off (set below for DDP, as the recipes do)
        opt, sched = recipe_optimizer_utils().distributed_muon_with_cosine_annealing(precision="16-mixed" if args.fp16 else "bf16-mixed",
                                                            lr_warmup_iters=2, lr_decay_iters=args.iters,
                                                            max_lr=3e-4, min_lr=3e-5, clip_grad=1.0)
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
        seq_length=args.seq_length, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        position_embedding_type="rope", share_embeddings_and_output_weights=False, make_vocab_size_divisible_by=128,
        bf16=not args.fp16, fp16=args.fp16, params_dtype=torch.half if args.fp16 else torch.bfloat16,
        attention_dropout=0.0, hidden_dropout=0.0,
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
        virtual_pipeline_model_parallel_size=args.vpp, expert_model_parallel_size=args.ep,
        # deterministic kernels (MoE's token unpermute adds with atomics otherwise); Bridge then wants
        # NCCL_ALGO set and turns on torch.use_deterministic_algorithms
        deterministic_mode=args.deterministic, **off, **recompute, **moe, **qk_clip(args))
    overlap = dp > 1  # gradient reduce-scatter and param all-gather overlap only exist with DP > 1
    # --fsdp STRATEGY: Megatron-FSDP as Bridge's Llama3 70B recipes set it (average_in_collective off, no
    # FP8 transpose cache); Bridge's validation turns the distributed optimizer on
    fsdp = (dict(use_megatron_fsdp=True, data_parallel_sharding_strategy=args.fsdp, keep_fp8_transpose_cache=False)
            if getattr(args, "fsdp", None) else {})
    if fsdp and getattr(args, "hsdp", None):  # HSDP as Bridge's Nemotron 3 Ultra recipes set it (outer: optim)
        fsdp.update(num_distributed_optimizer_instances=args.hsdp_instances, outer_dp_sharding_strategy=args.hsdp)
    elif getattr(args, "hsdp", None):
        raise SystemExit("--hsdp needs --fsdp optim_grads_params")
    cfg = C.ConfigContainer(
        model=model,
        train=C.TrainingConfig(train_iters=args.iters, global_batch_size=args.global_batch,
                               micro_batch_size=args.micro_batch, exit_signal_handler=False),
        validation=C.ValidationConfig(eval_interval=None, eval_iters=0),
        optimizer=opt, scheduler=sched,
        # fp16: Megatron raises on the first inf gradient unless the NaN check is off
        ddp=C.DistributedDataParallelConfig(check_for_nan_in_grad=not args.fp16, grad_reduce_in_fp32=not args.fp16,
                                            overlap_grad_reduce=overlap,
                                            overlap_param_gather=overlap and not getattr(args, "muon", False),
                                            average_in_collective=not fsdp,
                                            use_distributed_optimizer=not getattr(args, "muon", False), **fsdp),
        dataset=C.MockGPTDatasetConfig(seq_length=args.seq_length, random_seed=1234, reset_attention_mask=False,
                                       reset_position_ids=False, eod_mask_loss=False, num_dataset_builder_threads=1,
                                       split="9999,8,2", dataloader_type="single", num_workers=1,
                                       persistent_workers=False, data_sharding=True,
                                       skip_getting_attention_mask_from_dataset=True),
        logger=C.LoggerConfig(log_interval=1, tensorboard_dir=None, log_params_norm=args.log_params_norm),
        tokenizer=C.TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=32000),
        # --save: one synchronous torch_dist checkpoint at the last iteration (scripts/check_checkpoint.py)
        checkpoint=C.CheckpointConfig(save=args.save, load=args.load, ckpt_step=args.ckpt_step,
                                      save_interval=(args.save_interval or args.iters) if args.save else None,
                                      ckpt_format="fsdp_dtensor" if fsdp else "torch_dist",
                                      async_save=args.async_save, save_optim=True,
                                      dist_ckpt_optim_fully_reshardable=args.fully_reshardable),
        rng=C.RNGConfig(seed=1234), mixed_precision=mixed_precision(args),
    )
    if args.mode in ("flag", "auto"):
        # a plain attribute where Megatron-Core has no such field (then nothing reads it)
        opt.offload_optimizer_states = True
        if hasattr(opt, "chunked_optimizer_state_offload"):
            # Megatron-Core's chunked line (dev since 2026-08-18): the alias is turned into this field
            # only in __post_init__, which ran before the attribute above was set
            opt.chunked_optimizer_state_offload = True
            if args.chunk_mb is not None:
                opt.optimizer_state_offload_chunk_size_mb = args.chunk_mb
    if args.offload_fraction is not None and args.mode != "cpu":
        # the chunked line's share of parameter bundles whose states go to the host
        if args.mode not in ("flag", "auto") or not hasattr(opt, "optimizer_state_offload_fraction"):
            sys.exit(f"--offload-fraction needs --mode flag/auto on Megatron-Core's chunked line (dev since "
                     f"2026-08-18, with optimizer_state_offload_fraction); here: --mode {args.mode}, Megatron-Core "
                     f"from {os.path.dirname(sys.modules['megatron.core'].__file__)}")
        opt.optimizer_state_offload_fraction = args.offload_fraction
    return cfg, opt, norm_override, dp, overlap
