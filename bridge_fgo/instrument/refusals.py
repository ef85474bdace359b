"""Configurations optimizer-state offload cannot serve, refused before the first step.

Each check names the field and the fix. A generation's own refusals come from its declaration
(generations/<generation>.py, built from the helpers here) and are listed first. The shared list
follows Megatron-LM's own argument checks for offload (distributed optimizer, adam, no
Megatron-FSDP) and what cannot be combined with it. The builtin engine's streamed step adds its
own (streamed()).
"""
from __future__ import annotations

from typing import List, Sequence

from ..errors import BridgeFGOConfigError


def _full_iteration_cuda_graph(model_cfg) -> bool:
    try:  # Bridge's own predicate where it has one
        from megatron.bridge.utils.cuda_graph import is_full_iteration_cuda_graph
    except ImportError:
        scope = getattr(model_cfg, "cuda_graph_scope", None)
        return "full_iteration" in str(scope or "")
    return bool(is_full_iteration_cuda_graph(model_cfg))


# What Megatron-Core 0.19.2 builds for the names Bridge's recipes use other than 'adam' (read in
# optimizer/__init__.py, emerging_optimizers.py, layer_wise_optimizer.py): said in the refusal
_EMERGING = ("muon", "adaptive_muon", "soap")
# The names whose states the builtin engine moves (the streamed step and the one window): emerging-optimizers'
# Muon on the matrices in Float16OptimizerWithFloat16Params (dist_: under a LayerWiseDistributedOptimizer),
# Adam or Lion (muon_scalar_optimizer) on the rest
# ('adaptive_muon' is not among them: with megatron-core 0.19.2 and emerging-optimizers 0.3.0 its step
# fails without offload, TensorParallelAdaptiveMuon having no scale_mode, so nothing could check it)
MUON = ("muon", "dist_muon")
ADAM = ("adam",)


def _not_adam(opt, name) -> str:
    if not isinstance(name, str):
        return ""  # (worded by its repr where it is refused)
    bare = name[len("dist_"):] if name.startswith("dist_") else name
    if bare in _EMERGING:
        layer_wise = name.startswith("dist_") or getattr(opt, "use_layer_wise_distributed_optimizer", False)
        layout = ("in a LayerWiseDistributedOptimizer, whole matrices per data-parallel rank" if layer_wise
                  else "every rank holding every matrix's states")
        how = ("bridge_fgo's builtin engine moves those states: offload=builtin"
               if name in MUON else "bridge_fgo does not move those states yet")
        return (f" (Megatron-Core builds {bare!r} from emerging-optimizers as Float16OptimizerWithFloat16Params "
                f"{layout}, beside a DistributedOptimizer or a Float16OptimizerWithFloat16Params for the rest; "
                f"{how})")
    if name in ("lion", "sgd"):
        return f" ({name!r}'s states have no contract in bridge_fgo's engine yet)"
    return ""


def _not_distributed(inner_optimizers) -> list:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return [o for o in inner_optimizers if not isinstance(o, DistributedOptimizer)]


def _muon_not_moved(opt, inner_optimizers, dist_optimizers) -> List[str]:
    """Muon's chain holding optimizers besides the parts the engine moves (decide.distributed_optimizers): in
    fp32, Megatron-Core's FP32Optimizer, or the torch optimizers the layer-wise optimizer then leaves unwrapped."""
    others = [o for o in inner_optimizers if not any(o is d for d in dist_optimizers)]
    if not others:
        return []
    kinds = ", ".join(sorted({type(o).__name__ for o in others}))
    if getattr(opt, "bf16", True):
        return [f"the optimizer holds {kinds} beside Muon's parts, whose states bridge_fgo does not move; drop offload"]
    return [f"cfg.optimizer.bf16=False with Muon: Megatron-Core then steps the model's fp32 parameters in place "
            f"({kinds}: no fp32 masters beside them), a layout whose states bridge_fgo does not move (serving it "
            "needs another kind of part in the engine, and its own saves and loads, none checked yet); train in bf16: "
            "cfg.mixed_precision='bf16_mixed' (it sets cfg.optimizer.bf16 and cfg.model.bf16), or drop offload"]


def _holds_muon(inner_optimizers) -> bool:
    from ..engine import contracts

    return any(contracts.is_muon(getattr(o, "optimizer", None)) for o in inner_optimizers)


def problems(cfg, inner_optimizers: List[object], dist_optimizers: List[object], who: str,
             extra: Sequence[str] = (), served: Sequence[str] = ADAM, fsdp: bool = False) -> List[str]:
    """Every reason `cfg` (Bridge's ConfigContainer) cannot be served; empty when it can.
    `extra`: the refusals of the generation that would serve it (Generation.refusals); `served`: the
    cfg.optimizer.optimizer names it serves (Generation.optimizers); `fsdp`: whether it serves Megatron-FSDP
    (Generation.serves_megatron_fsdp)."""
    opt, ddp, dist = getattr(cfg, "optimizer", None), getattr(cfg, "ddp", None), getattr(cfg, "dist", None)
    out = list(extra)
    name = getattr(opt, "optimizer", "adam")
    if name not in MUON and _holds_muon(inner_optimizers):
        # megatron-core 0.16 and 0.17 write muon_scalar_optimizer ('adam' or 'lion') into
        # cfg.optimizer.optimizer while they build Muon: the optimizers say what was chosen
        name = "muon"
    if name in MUON and name in served:
        # Muon's own layout: every rank its matrices' states (whole, or layer-wise), moved as they are
        out += _muon_not_moved(opt, inner_optimizers, dist_optimizers)
    elif not getattr(opt, "use_distributed_optimizer", False):
        out.append(
            "cfg.optimizer.use_distributed_optimizer=False: set it (and cfg.ddp.use_distributed_optimizer) to "
            f"True; {who} offloads the distributed optimizer's sharded states"
        )
    elif inner_optimizers and _not_distributed(inner_optimizers):
        # (an empty chain is a rank without trainable parameters: nothing to move, nothing wrong)
        others = _not_distributed(inner_optimizers)
        kinds = ", ".join(sorted({type(o).__name__ for o in others}))
        held = (f"no DistributedOptimizer (found {kinds})" if len(others) == len(inner_optimizers)
                else f"{kinds} beside its DistributedOptimizer")
        out.append(f"the optimizer holds {held}: set cfg.optimizer.use_distributed_optimizer=True and "
                   "cfg.ddp.use_distributed_optimizer=True")
    if name not in served:
        out.append(f"cfg.optimizer.optimizer={name!r}: {who} supports only "
                   f"{', '.join(repr(n) for n in served)}{_not_adam(opt, name)}; set "
                   "optimizer='adam', or drop offload")
    if getattr(ddp, "use_megatron_fsdp", False) or getattr(dist, "use_megatron_fsdp", False):
        out += megatron_fsdp(cfg, dist_optimizers, who) if fsdp else [
            "cfg.ddp.use_megatron_fsdp / cfg.dist.use_megatron_fsdp is True: Megatron-FSDP keeps its own "
            f"optimizer-state layout, which {who} does not offload; bridge_fgo's streamed step does: "
            "offload='builtin' with chunk_mb > 0 (BRIDGE_FGO_OFFLOAD=builtin), or turn Megatron-FSDP off"]
    if getattr(opt, "optimizer_cpu_offload", False):
        out.append(
            "cfg.optimizer.optimizer_cpu_offload=True already keeps optimizer states on the host; "
            "the two cannot be combined: set one of them to False"
        )
    if getattr(opt, "optimizer_cuda_graph", False):
        out.append(
            "cfg.optimizer.optimizer_cuda_graph=True: a captured optimizer step cannot follow states that "
            "move between host and GPU; set it to False"
        )
    model_cfg = getattr(cfg, "model", None)
    if model_cfg is not None and _full_iteration_cuda_graph(model_cfg):
        out.append(
            "cfg.model.cuda_graph_impl / cuda_graph_scope select a full_iteration CUDA graph, which cannot "
            "contain the host copies; use a narrower cuda_graph_scope or cuda_graph_impl='none'"
        )
    return out


def megatron_fsdp(cfg, dist_optimizers, who: str) -> List[str]:
    """What the streamed step cannot serve of a Megatron-FSDP run (engine/fsdp.py), each naming the field."""
    from ..engine import fsdp

    fix = "; or drop offload"
    out = []
    ddp, model, logger_cfg = (getattr(cfg, k, None) for k in ("ddp", "model", "logger"))
    for opt in dist_optimizers:
        for p in fsdp.problems(opt):
            if p not in out:
                out.append(p)
    if not dist_optimizers:
        found = getattr(ddp, "data_parallel_sharding_strategy", None)
        if found not in fsdp.STRATEGIES:
            out.append(f"cfg.ddp.data_parallel_sharding_strategy={found!r} with Megatron-FSDP: {who} serves "
                       f"{', '.join(repr(x) for x in fsdp.STRATEGIES)}{fix}")
    if getattr(logger_cfg, "log_params_norm", False):
        out.append("cfg.logger.log_params_norm=True with Megatron-FSDP: Bridge then reads every master through "
                   f"Megatron-FSDP's DTensors between steps, which the streamed step keeps on the host; set it to False{fix}")
    if getattr(model, "qk_clip", False):
        out.append(f"cfg.model.qk_clip=True with Megatron-FSDP: not served by the streamed step yet; set it to False{fix}")
    return out


def check(cfg, inner_optimizers: List[object], dist_optimizers: List[object], who: str,
          extra: Sequence[str] = (), served: Sequence[str] = ADAM, fsdp: bool = False) -> None:
    found = problems(cfg, inner_optimizers, dist_optimizers, who, extra, served, fsdp)
    if found:
        raise BridgeFGOConfigError(
            "optimizer-state offload cannot run with this configuration:\n  - " + "\n  - ".join(found)
        )


def _saves_or_loads_optim(ckpt):
    saves = bool(getattr(ckpt, "save", None) and getattr(ckpt, "save_optim", True))
    loads = bool(getattr(ckpt, "load", None) and getattr(ckpt, "load_optim", True))
    return saves, loads


def saves_optimizer_async(cfg) -> bool:
    """Whether checkpoints of this run save optimizer state asynchronously (cfg.checkpoint.async_save)."""
    ckpt = getattr(cfg, "checkpoint", None)
    return ckpt is not None and _saves_or_loads_optim(ckpt)[0] and bool(getattr(ckpt, "async_save", False))


def async_checkpoint(cfg, why: str) -> List[str]:
    """An asynchronous save of optimizer state, for an offloader that cannot serve one (`why`)."""
    if not saves_optimizer_async(cfg):
        return []
    return [f"cfg.checkpoint.async_save=True while optimizer state is saved: {why}; set async_save=False or "
            "save_optim=False"]


def checkpoint_format(cfg, fix: str = "") -> List[str]:
    """What an engine that keeps optimizer state in host buffers between steps cannot checkpoint: any
    format but torch_dist."""
    ckpt = getattr(cfg, "checkpoint", None)
    if ckpt is None or not any(_saves_or_loads_optim(ckpt)):
        return []
    fsdp = getattr(getattr(cfg, "ddp", None), "use_megatron_fsdp", False)
    if fsdp and getattr(ckpt, "ckpt_format", None) == "fsdp_dtensor":
        return []  # Megatron-FSDP's own format: its states are read and written through their DTensors
    if getattr(ckpt, "ckpt_format", "torch_dist") != "torch_dist":
        return [f"cfg.checkpoint.ckpt_format={ckpt.ckpt_format!r}: optimizer state kept in host buffers is "
                f"saved and loaded per rank only by 'torch_dist'; set ckpt_format='torch_dist'{fix}"]
    return []


# FP8 recipes whose parameters the streamed step has cast on a GPU (2xH200, 2026-11-27); the others share the
# code path (engine/quantized.py, tested on CPU) but need a Blackwell GPU no run here has had
SERVED_FP8_RECIPES = ("delayed", "tensorwise", "blockwise")


def fp8_recipe(cfg) -> str:
    """The run's FP8 recipe as Megatron-Core reads it (TransformerConfig.fp8_recipe; the optimizer's copy)."""
    for section in ("model", "optimizer"):
        recipe = getattr(getattr(cfg, section, None), "fp8_recipe", None)
        if recipe is not None:
            return str(getattr(recipe, "value", recipe))
    return "delayed"  # Megatron-Core's default


def quantized_params(cfg, fix: str) -> List[str]:
    """FP8/FP4 parameters under the streamed step: FP8 parameters are cast once after the last chunk from
    their masters kept in the model's dtype (engine/quantized.py)."""
    opt, ddp, model = getattr(cfg, "optimizer", None), getattr(cfg, "ddp", None), getattr(cfg, "model", None)
    out = []
    if getattr(ddp, "fp8_param_gather", False):
        recipe = fp8_recipe(cfg)
        if recipe not in SERVED_FP8_RECIPES:
            out.append(f"cfg.ddp.fp8_param_gather=True with fp8_recipe={recipe!r}: the streamed step has cast FP8 "
                       f"parameters on a GPU only for the recipes {', '.join(SERVED_FP8_RECIPES)} (Hopper; {recipe} "
                       f"was never run there by bridge_fgo: MXFP8 needs Blackwell); set fp8_param_gather=False{fix}")
        if getattr(opt, "use_precision_aware_optimizer", False) and (
                recipe == "delayed" or str(getattr(opt, "main_params_dtype", "torch.float32")) != "torch.float32"):
            # Megatron-Core's use_precision_aware_optimizer_no_fp8_or_ds_fp8: TE's FusedAdam holds the masters
            out.append(f"cfg.optimizer.use_precision_aware_optimizer=True with FP8 parameters (fp8_recipe={recipe!r}, "
                       f"main_params_dtype={getattr(opt, 'main_params_dtype', None)}): Transformer Engine's FusedAdam "
                       "then writes the FP8 parameters inside its own step, a layout the streamed step has never run; "
                       f"use fp8_recipe='tensorwise' with fp32 masters, or use_precision_aware_optimizer=False{fix}")
        if getattr(model, "qk_clip", False):
            out.append("cfg.model.qk_clip=True with cfg.ddp.fp8_param_gather=True: the streamed step clips a layer's "
                       "masters in its chunk, before the FP8 cast of every parameter at the end of the step; set "
                       f"one of them to False{fix}")
    if getattr(ddp, "fp4_param_gather", False):
        out.append("cfg.ddp.fp4_param_gather=True: NVFP4 parameters need a Blackwell GPU, and no run of bridge_fgo "
                   f"has cast them there; set it to False{fix}")
    return out


def streamed(cfg, inner_optimizers, options=None) -> List[str]:
    """What the builtin engine's streamed step (chunk_mb > 0) cannot serve, each with its field and
    the fix; the one-window engine (chunk_mb=0) serves all of these."""
    from ..engine import contracts

    opt, ddp = getattr(cfg, "optimizer", None), getattr(cfg, "ddp", None)
    fix = "; or use the one-window engine: chunk_mb=0 (bridge-fgo-run --chunk-mb 0, BRIDGE_FGO_CHUNK_MB=0)"
    out = []
    if getattr(opt, "reuse_grad_buf_for_mxfp8_param_ag", False):
        out.append("cfg.optimizer.reuse_grad_buf_for_mxfp8_param_ag=True: the MXFP8 param-buffer copy reads all "
                   f"master weights outside the optimizer step; set it to False{fix}")
    out += quantized_params(cfg, fix)
    # an asynchronous save is served: its writer copies the host states inside the save call (saves.py);
    # so is dist_ckpt_optim_fully_reshardable: its save gathers copies of the host views, as Megatron-Core
    # stages them without offload, and its load copies into them (tests/test_resume_dp.py)
    out += checkpoint_format(cfg, fix)
    out += [f"{p}" for p in contracts.streamed_problems(inner_optimizers)]
    # Muon is served as Adam is: qk_clip (MuonClip's) and the parameter norm inside the passes
    # (engine/streamed/qkclip.py, norms.py), a budget in the optimizer's order on every rank, whatever each
    # keeps resident, tensor parallelism too (contracts.Contract.in_order)
    return out
