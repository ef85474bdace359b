"""Megatron-Core's chunked optimizer-state offload (dev line since 2026-08-18, Megatron-LM 9050d4c5fb;
read at dev d48bd6be0a85cc0d6d3cc71e8750cf357cc6bdb1).

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

from typing import Optional

from ..generations import CHUNKED
from ..session import Adapter


def delays_master_offload(cfg) -> bool:
    return bool(getattr(getattr(cfg, "optimizer", None), "reuse_grad_buf_for_mxfp8_param_ag", False)
                and getattr(getattr(cfg, "ddp", None), "overlap_param_gather", False))


class ChunkedAdapter(Adapter):
    name = CHUNKED

    def __init__(self, optimizer, cfg):
        self.optimizer = optimizer
        self.delay_master = delays_master_offload(cfg)

    def offload(self) -> Optional[int]:
        opt = self.optimizer
        if opt.optimizer_state_offload_requires_pre_forward_param_sync():
            opt.ensure_master_weights_for_pre_forward_param_sync()
            opt.start_param_sync_for_bucket_group_subset(force_sync=True)
        opt.offload_optimizer_state_for_forward(offload_master=not self.delay_master)
        return None

    def release(self) -> None:
        if self.delay_master:  # the param-buffer copy has read the masters: now they can go
            self.optimizer.offload_optimizer_state_for_forward()

    def reload(self) -> Optional[int]:
        self.optimizer.prefetch_optimizer_state_for_gradient_finalization()
        return None

    def describe(self):
        return {"optimizers": len(getattr(self.optimizer, "chained_optimizers", None) or [self.optimizer])}
