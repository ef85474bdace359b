"""StreamedEngine: the streamed step's call sites, in the order train_step reaches them, over its
four parts (plan.py, transfers.py, update.py, readers.py).

One StreamedEngine per optimizer as train_step sees it (a DistributedOptimizer, or Megatron-Core's
ChainedOptimizer of several): one host buffer and one GPU window for the whole chain, so the window
the per-rank line states is the bound for every engine of a mixture-of-experts chain too.

Where the data is:
- between updates (every reader outside the optimizer step: checkpoint save and load, logging,
  evaluation, reload_model_params, unpatch): masters bound to their host views
  (`master.data = view`), states and scales host views in the optimizer's dicts, the last chunks'
  device-to-host copies possibly still in flight (readers.py guards until they are done);
- from gradient finalization to the update: masters bound to GPU tensors without storage, so
  Megatron-Core can attach their fp32 gradients (PyTorch checks only device, dtype and shape);
- during the update: each chunk bound to views of a window slot (update.py);
- under a memory budget, the bundles kept resident are ordinary GPU tensors, updated in place.
"""
from __future__ import annotations

import weakref
from typing import Optional

from ...errors import BridgeFGOError
from ...log import logger, rank_prefix
from .. import budget
from .plan import Plan
from .readers import TORN_FIX, Readers
from .transfers import Transfers
from .update import Update

GiB = 2**30


def _weakly(method):
    """`method` (bound to the engine) callable without keeping the engine alive."""
    ref = weakref.WeakMethod(method)
    return lambda: ref()()


class StreamedEngine:
    def __init__(self, dist_optimizers, chunk_bytes: int, budget_bytes: Optional[int] = None):
        self.plan = Plan(dist_optimizers, chunk_bytes)
        self.transfers = Transfers(self.plan)
        self.readers = Readers(self.plan, self.transfers, _weakly(self.synchronize))
        self.update = Update(self.plan, self.transfers, self.readers, _weakly(self.synchronize))
        self.budget_bytes = budget_bytes
        self.budget_note: Optional[str] = None
        self._held_after_backward = 0  # bytes the allocator held right after the first backward (budget)
        self.setup_peak: Optional[int] = None
        self.steps_streamed = 0

    # -- what the adapter, status and tests read -------------------------------------------------
    parts = property(lambda self: self.plan.parts)
    chunks = property(lambda self: self.plan.chunks)
    device = property(lambda self: self.plan.device)
    window_bytes = property(lambda self: self.plan.window_bytes)
    bytes = property(lambda self: self.plan.bytes)
    resident_bytes = property(lambda self: self.plan.resident_bytes)
    master_bytes = property(lambda self: self.plan.master_bytes)
    tensors = property(lambda self: self.plan.tensors)
    copies = property(lambda self: self.transfers.copies)
    buffer = property(lambda self: self.transfers.buffer)
    host_wait = property(lambda self: self.transfers.host_wait)
    torn = property(lambda self: self.readers.torn)

    @property
    def states_after_load(self) -> bool:
        return self.readers.states_after_load

    @states_after_load.setter
    def states_after_load(self, value: bool) -> None:
        self.readers.states_after_load = value

    @property
    def pinned_bytes(self) -> int:
        return self.buffer.nbytes if self.buffer is not None else 0

    def plan_bytes(self) -> int:
        return self.plan.lay_out()

    def optimizers(self):
        return self.plan.optimizers()

    def on_host(self) -> bool:
        return self.plan.on_host()

    # -- before the first step --------------------------------------------------------------------
    def prepare(self) -> None:
        """Pin the host buffer once, for the plan (after every rank's check); take in every state that
        exists, create the rest in their host views; hook the loads. A training after a parked one
        pins the same buffer again, in place."""
        t = self.transfers
        if t.buffer is not None:
            if t.buffer.unpinned:
                t.buffer.repin()
                self._note_setup_peak()
            return
        t.pin()
        t.take_all()  # masters made on the host at construction, states a load put elsewhere
        if not self.readers.states_after_load:
            t.materialize()
        self.readers.hook_loads()
        self._note_setup_peak()
        if t.copies.device_copies:
            t.warm()

    def _note_setup_peak(self) -> None:
        if self.transfers.copies.device_copies:
            import torch

            self.setup_peak = torch.cuda.max_memory_allocated(self.device)

    def after_load(self) -> None:
        if self.transfers.buffer is not None:
            self.readers.after_load()

    # -- the call sites ---------------------------------------------------------------------------
    def offload(self) -> int:
        """Start of forward-backward: make the host copy canonical (transfers.adopt)."""
        if self.update.armed:
            self.settle()  # a rerun after finalization: the prefetched chunks go back unused
        if self.transfers.buffer is None:
            return 0
        if self.torn is not None:
            raise self.readers.refusal("an optimizer step")
        self.transfers.adopt()
        return self.bytes

    def release(self) -> None:
        """After the param-buffer copy: free the GPU storage of what offload() adopted."""
        if (self.transfers.release() and self.budget_bytes is not None and self.budget_note is None
                and self.copies.device_copies):
            import torch

            # The budget is judged by the memory the allocator holds through the first step: give back,
            # once, what setup left cached (the masters just freed), so that is not counted
            torch.cuda.empty_cache()

    def reload(self) -> int:
        """Gradient finalization: arm the update (update.arm)."""
        if self.update.armed or self.transfers.buffer is None:
            return 0
        self.copies.collect()
        if not self.on_host():
            self.offload()
            self.release()
        self.readers.drop_guards()  # the update's own copies are ordered after the tail on the GPU
        if self.budget_bytes is not None and self.budget_note is None and self.copies.device_copies:
            import torch

            # right after backward: the caching allocator still holds the forward-backward peak's memory
            # (only empty_cache gives it back, and Megatron calls that after this point)
            self._held_after_backward = max(self._held_after_backward, torch.cuda.memory_reserved(self.device))
        self.update.arm()
        return self.bytes

    def wait_reload(self) -> None:
        """Nothing to wait for before the step: each chunk waits for its own copy."""

    def settle(self, wait: bool = False) -> None:
        """train_step is over (done, skipped, failed, or a rerun): the hooks removed, every entry bound
        to its host view, the window given back. The last device-to-host copies may still run
        (readers are guarded until they end) unless `wait`."""
        was_armed = self.update.disarm()
        t = self.transfers
        if t.buffer is None:
            return
        if was_armed and self.torn is None and self.update.stopped_between_parts():
            self.update.where = "between the optimizers of the chain"
            self.readers.torn = self.update.failure()
            logger.error("%s%s. %s", rank_prefix(), self.torn, TORN_FIX)
        loose = list(self.plan.away())
        if loose:  # a skipped step (masters on their shells) or a failed one
            t.copies.host_wait_all()
            for _, b, e, _ in loose:
                # never the window's data: a failed pass's is partial. Before any pass the host copy is
                # the states as before the step; after one, the states are torn anyway
                b.set(e, e.host)
        t.window.close()
        t.copies.end_step()
        if self.update.stepped:
            self.steps_streamed += 1
            self.update.stepped = False
        if wait:
            self.synchronize()
        if self.torn is not None or (not wait and t.tail is not None and was_armed):
            self.readers.guard()
        if self.budget_bytes is not None and self.steps_streamed == 1 and self.budget_note is None:
            self._apply_budget()

    def synchronize(self) -> None:
        """The host copy is whole and current: wait for every copy in flight."""
        try:
            self.transfers.wait_all()
        except BaseException as exc:
            if self.transfers.tail is None or self.torn is not None:
                raise
            self.update.raise_torn(exc, (
                f"waiting for the last update's device-to-host copies failed ({type(exc).__name__}: {exc}), so "
                "the optimizer states are torn: their host copy is part of that step, part of the one before"))
        self.readers.drop_guards()

    # -- the memory budget ------------------------------------------------------------------------
    def _apply_budget(self) -> None:
        """After the first streamed step: keep resident as many bundles as fit under the budget."""
        peak, basis = budget.held(self.device, self._held_after_backward)
        kept = budget.choose([bd for part in self.parts for bd in part.bundles], self.budget_bytes, peak)
        if kept is None:
            self.budget_note = (f"gpu_budget_gib {self.budget_bytes / GiB:.2f} GiB cannot be met: the {basis} is "
                                f"{peak / GiB:.2f} GiB; everything stays offloaded")
            logger.warning("%s%s", rank_prefix(), self.budget_note)
            return
        self.synchronize()
        for bundle in kept:
            part = self.parts[bundle.part]
            b = part.bindings
            for e in bundle.entries:
                if not e.dropped and b.get(e) is not None:
                    self.transfers.to_device(part, b, e)
            bundle.resident = True
        self.plan.cut()
        self.transfers.new_window()
        self.budget_note = (f"gpu_budget_gib {self.budget_bytes / GiB:.2f} GiB, {basis} {peak / GiB:.2f} GiB: "
                            f"{len(kept)} parameter(s) keep their states on the GPU "
                            f"({self.resident_bytes / GiB:.2f} GiB), {self.bytes / GiB:.2f} GiB move each way per "
                            f"step in {len(self.chunks)} chunk(s)")
        logger.info("%s%s", rank_prefix(), self.budget_note)

    # -- after training ---------------------------------------------------------------------------
    def states_on(self) -> str:
        """Where the optimizer states are between steps, for status."""
        buf = self.transfers.buffer
        if buf is None or buf.freed:
            return "GPU"
        where = "host (parked, unpinned)" if buf.unpinned else "host"
        return where + (f"; {self.resident_bytes} bytes on the GPU (gpu_budget_gib)" if self.resident_bytes else "")

    def park(self) -> None:
        """train() is over: every copy finished, the states stay where they are between steps (host
        memory) and the buffer is unpinned in place, so nothing stays locked and no GPU memory is taken
        back; a next train() pins it again (prepare), unpatch() brings the states to the GPU (close)."""
        self.settle(wait=True)
        if self.transfers.buffer is not None:
            self.transfers.buffer.unpin()

    def close(self) -> None:
        """Unpatch: states back on the GPU as ordinary tensors, the host buffer freed (exactly once)."""
        if self.torn is not None:
            logger.warning("%sunpatch(): %s. They go back to the GPU as they are, and checkpoint saves and optimizer "
                           "steps of them stay refused until a checkpoint is loaded. %s", rank_prefix(), self.torn,
                           TORN_FIX)
        self.settle(wait=True)
        t = self.transfers
        if t.buffer is None:
            return
        for part in self.parts:
            try:
                b = part.bindings
            except BridgeFGOError:  # the optimizer is gone: nothing left to give back
                continue
            for bundle in part.bundles:
                for e in bundle.entries:
                    if b.get(e) is not None and not bundle.resident and not e.dropped:
                        t.to_device(part, b, e)
        if self.device is not None and self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)
        self.readers.unhook_loads()
        t.free()
