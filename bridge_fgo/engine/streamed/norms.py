"""The parameter norm Bridge logs (cfg.logger.log_params_norm), served by the streamed step.

Bridge's train() calls calc_params_l2_norm(model, model_config, ...) after each step. For every bf16/fp16
parameter it reads `param.main_param`, the DistributedOptimizer's fp32 master shard (Muon's
Float16OptimizerWithFloat16Params: the whole master), which the streamed step keeps bound to its host
view between updates. Every master passes through the GPU window in every
update, so its L2 norm is taken there, right after the pass wrote it (torch.norm, as Megatron-Core's
local multi_tensor_l2norm takes each tensor's), into one small GPU tensor. While calc_params_l2_norm
runs, each such parameter's `main_param` is a 1-element GPU view holding its master's norm, so Bridge's
own function does everything else (tensor-parallel duplicates, the MoE split, the data- and
context-parallel all-reduces) as without offload.

Exact where the summation allows: Megatron-Core's local multi_tensor_l2norm (no TE, no apex: what the
CPU tests run) takes the norm of the per-tensor norms, and the norm of a 1-element tensor is its value,
so the result is bit-identical. TE's and apex's multi_tensor_l2norm kernel sums every element's square
in its own blocks; over the norms it sums one square per master, so the last bits may differ.

A norm is valid until the master is written outside an update (plan.writes: a load,
reload_model_params, a take-over, a torn step); before the first update there is none. Missing ones
are taken on demand, on the GPU, from the host copy, a chunk's bytes of masters at a time.
"""
from __future__ import annotations

import contextlib
from typing import Dict, List, Optional

from ..tensors import MASTER, Entry
from .plan import Plan
from .transfers import Transfers


class Norms:
    def __init__(self, plan: Plan, transfers: Transfers):
        self.plan, self.transfers = plan, transfers
        self.in_update = False  # taken in every pass (log_params_norm); else only on demand
        self.values = None  # one fp32 per master of the plan, on the compute device
        self._slot: Dict[int, int] = {}  # id(entry) -> its index in values
        self._taken: Dict[int, int] = {}  # id(entry) -> plan.writes when its norm was taken

    def _value(self, e: Entry):
        if self.values is None:
            import torch

            masters = [m for part in self.plan.parts for m in part.entries() if m.kind == MASTER]
            self._slot = {id(m): i for i, m in enumerate(masters)}
            self.values = torch.zeros(len(masters), dtype=torch.float32, device=self.plan.device)
        i = self._slot[id(e)]
        return self.values[i:i + 1]

    def take(self, views) -> None:
        """The norms of the masters among these (entry, tensor on the GPU) pairs, as they are now."""
        import torch

        for e, t in views:
            if e.kind == MASTER:
                torch.norm(t, out=self._value(e)[0])
                self._taken[id(e)] = self.plan.writes

    def forget(self, entries) -> None:
        for e in entries:
            self._taken.pop(id(e), None)

    def passed(self, views) -> None:
        """A pass of the update wrote these (entry, window view) pairs."""
        if self.in_update:
            self.take(views)
        else:
            self.forget(e for e, _ in views)

    def valid(self, e: Entry) -> bool:
        return self._taken.get(id(e)) == self.plan.writes

    @contextlib.contextmanager
    def presented(self, model):
        """Around calc_params_l2_norm(model, ...): each parameter whose main_param is a master bound to
        its host copy reads as a 1-element GPU tensor holding that master's norm, then as its master again."""
        masters = self.plan.streamed_masters() if self.transfers.buffer is not None else {}
        found = []
        for chunk in (model if isinstance(model, (list, tuple)) else [model]):
            for p in chunk.parameters():
                m = getattr(p, "main_param", None)
                e: Optional[Entry] = masters.get(id(m)) if m is not None else None
                if e is not None and e.param is m and not e.dropped:
                    found.append((p, e))
        self._fill([e for _, e in found if not self.valid(e)])
        try:
            for p, e in found:
                p.main_param = self._value(e)
            yield
        finally:
            for p, e in found:
                p.main_param = e.param

    def _fill(self, missing: List[Entry]) -> None:
        """Norms of these masters from their host copies: brought to the GPU after every copy in flight,
        at most a chunk's bytes at a time (a larger master alone)."""
        batch, nbytes = [], 0
        for e in missing:
            if batch and nbytes + e.nbytes > self.plan.chunk_bytes:
                self._fill_batch(batch)
                batch, nbytes = [], 0
            batch.append(e)
            nbytes += e.nbytes
        if batch:
            self._fill_batch(batch)

    def _fill_batch(self, batch: List[Entry]) -> None:
        with self.transfers.on_device(batch) as views:
            self.take(views)
