"""Generation `chunked`: Megatron-Core's chunked optimizer-state offload (dev line since 2026-08-18,
Megatron-LM 9050d4c5fb; read at dev d48bd6be0a85cc0d6d3cc71e8750cf357cc6bdb1).

All calls go to the top-level optimizer (ChainedOptimizer forwards them to its children), placed as
Megatron-LM dev's own train_step places them:
- before the param-buffer copy: when the optimizer needs a pre-forward parameter sync, first
  ensure_master_weights_for_pre_forward_param_sync() and start_param_sync_for_bucket_group_subset(
  force_sync=True); then offload_optimizer_state_for_forward(offload_master=not delay), where delay
  means the mxfp8 param-buffer copy (reuse_grad_buf_for_mxfp8_param_ag with overlap_param_gather)
  still needs the master weights;
- after the copy, when delayed: offload_optimizer_state_for_forward() for the masters;
- in the finalize wrapper: prefetch_optimizer_state_for_gradient_finalization().
The optimizer's own step() waits for its prefetch, and sharded_state_dict() synchronises the states
for a checkpoint itself (synchronize_optimizer_state_for_checkpoint), so neither is called here.
"""
from __future__ import annotations

import weakref
from typing import List, Optional, Tuple

from .base import Adapter, Generation

METHODS = ("offload_optimizer_state_for_forward", "prefetch_optimizer_state_for_gradient_finalization")


def delays_master_offload(cfg) -> bool:
    return bool(getattr(getattr(cfg, "optimizer", None), "reuse_grad_buf_for_mxfp8_param_ag", False)
                and getattr(getattr(cfg, "ddp", None), "overlap_param_gather", False))


def _offloaders(optimizer) -> List[object]:
    """Each child's ChunkedOptimizerStateOffloader, found by what it has (its attribute on the
    optimizer is private to Megatron-Core)."""
    children = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [v for child in children for v in vars(child).values()
            if hasattr(v, "selected_params") and hasattr(v, "chunks")]


def _plan_figures(offloaders) -> Tuple[Optional[int], Optional[int]]:
    """(tensors, bytes) the offloaders' plans move per step: each selected parameter's tensor states
    plus its master where it has one. The byte figure is the plan's own (_estimated_bundle_bytes,
    what chunking and the offload fraction are computed from; Megatron-Core has no public one at
    d48bd6be). None where an offloader does not say."""
    tensors = nbytes = 0
    try:
        for off in offloaders:
            for param in off.selected_params:
                tensors += len(off.state_dtypes) + bool(off._param_has_master(param))
                nbytes += int(off._estimated_bundle_bytes(param))
    except AttributeError:  # another Megatron-Core revision: say "unknown", never guess
        return None, None
    return (tensors, nbytes) if offloaders else (None, None)


class ChunkedAdapter(Adapter):
    def __init__(self, optimizer, cfg):
        self._optimizer = weakref.ref(optimizer)  # never keeps the optimizer alive
        self.delay_master = delays_master_offload(cfg)
        # Megatron-Core builds its offloaders with the optimizers and plans once: read them once
        offloaders = _offloaders(optimizer)
        self.tensors, self.bytes = _plan_figures(offloaders)
        self.n_optimizers = len(getattr(optimizer, "chained_optimizers", None) or [optimizer])

    @property
    def optimizer(self):
        return self._optimizer()

    def offload(self) -> Optional[int]:
        opt = self.optimizer
        if opt.optimizer_state_offload_requires_pre_forward_param_sync():
            opt.ensure_master_weights_for_pre_forward_param_sync()
            opt.start_param_sync_for_bucket_group_subset(force_sync=True)
        opt.offload_optimizer_state_for_forward(offload_master=not self.delay_master)
        return self.bytes

    def release(self) -> None:
        if self.delay_master:  # the param-buffer copy has read the masters: now they can go
            self.optimizer.offload_optimizer_state_for_forward()

    def reload(self) -> Optional[int]:
        self.optimizer.prefetch_optimizer_state_for_gradient_finalization()
        return self.bytes

    def describe(self):
        out = {"optimizers": self.n_optimizers}
        if self.bytes is not None:
            out.update(tensors=self.tensors, bytes=self.bytes)
        return out


def _requested(opt) -> bool:
    # The chunked line's __post_init__ turns the deprecated offload_optimizer_states into
    # chunked_optimizer_state_offload and resets the alias to False.
    if getattr(opt, "chunked_optimizer_state_offload", False):
        return getattr(opt, "optimizer_state_offload_fraction", 1.0) > 0.0
    return bool(getattr(opt, "offload_optimizer_states", False))


class _Chunked(Generation):
    name = mode = "chunked"
    meaning = "Megatron-Core's chunked offload API: bridge_fgo wires it when the config flag is set"
    who = "Megatron-Core's chunked optimizer-state offload"
    flag = "cfg.optimizer.chunked_optimizer_state_offload (or its deprecated alias offload_optimizer_states)"
    native_wiring = (*METHODS, "synchronize_optimizer_state_for_checkpoint")
    self_driven = True  # the offloader streams states inside step() once built

    def detect(self, cls) -> bool:
        return all(hasattr(cls, m) for m in METHODS)

    def requested(self, cfg) -> bool:
        return _requested(getattr(cfg, "optimizer", None))

    def refusals(self, cfg, options, inner_optimizers) -> List[str]:
        # Megatron-LM dev's own checks for the chunked line (arguments.py, checkpointing.py at d48bd6be)
        from .. import refusals

        return refusals.async_checkpoint(cfg, "the chunked offload's pinned buffers cannot be handed to a "
                                              "background writer") + refusals.checkpoint_format(cfg)

    def build(self, optimizer, cfg, dist_optimizers, options) -> Adapter:
        return ChunkedAdapter(optimizer, cfg)

    def verdict(self) -> str:
        return ("offload will run (mode auto) through Megatron-Core's chunked offloader, in runs whose config "
                "sets cfg.optimizer.chunked_optimizer_state_offload=True (or its deprecated alias "
                "offload_optimizer_states); runs without it are left alone")


GENERATION = _Chunked()
