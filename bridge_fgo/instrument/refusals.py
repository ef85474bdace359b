"""Configurations optimizer-state offload cannot serve, refused before the first step.

Each check names the field and the fix. A generation's own refusals come from its declaration
(adapters/<generation>.py) and are listed first. The shared list follows Megatron-LM's own argument checks for
offload (distributed optimizer, adam, no Megatron-FSDP) and what cannot be combined with it.
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


def problems(cfg, inner_optimizers: List[object], dist_optimizers: List[object], who: str,
             extra: Sequence[str] = ()) -> List[str]:
    """Every reason `cfg` (Bridge's ConfigContainer) cannot be served; empty when it can.
    `extra`: the refusals of the generation that would serve it (Generation.refusals)."""
    opt, ddp, dist = getattr(cfg, "optimizer", None), getattr(cfg, "ddp", None), getattr(cfg, "dist", None)
    out = list(extra)
    if not getattr(opt, "use_distributed_optimizer", False):
        out.append(
            "cfg.optimizer.use_distributed_optimizer=False: set it (and cfg.ddp.use_distributed_optimizer) to "
            f"True; {who} offloads the distributed optimizer's sharded states"
        )
    elif inner_optimizers and not dist_optimizers:
        # (an empty chain is a rank without trainable parameters: nothing to move, nothing wrong)
        kinds = ", ".join(sorted({type(o).__name__ for o in inner_optimizers}))
        out.append(
            f"the optimizer holds no DistributedOptimizer (found {kinds}): set "
            "cfg.optimizer.use_distributed_optimizer=True and cfg.ddp.use_distributed_optimizer=True"
        )
    if getattr(opt, "optimizer", "adam") != "adam":
        out.append(f"cfg.optimizer.optimizer={opt.optimizer!r}: {who} supports only 'adam'; set optimizer='adam'")
    if getattr(ddp, "use_megatron_fsdp", False) or getattr(dist, "use_megatron_fsdp", False):
        out.append(
            "cfg.ddp.use_megatron_fsdp / cfg.dist.use_megatron_fsdp is True: Megatron-FSDP keeps its own "
            "optimizer-state layout; turn it off or drop offload"
        )
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


def check(cfg, inner_optimizers: List[object], dist_optimizers: List[object], who: str,
          extra: Sequence[str] = ()) -> None:
    found = problems(cfg, inner_optimizers, dist_optimizers, who, extra)
    if found:
        raise BridgeFGOConfigError(
            "optimizer-state offload cannot run with this configuration:\n  - " + "\n  - ".join(found)
        )
