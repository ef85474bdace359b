"""StreamedEngine: the streamed step's call sites, in the order train_step reaches them, over its
parts (plan.py, transfers.py, update.py, readers.py; norms.py, qkclip.py and head.py beside them).

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

import contextlib
import weakref
from typing import Optional

from ...errors import BridgeFGOError
from ...log import logger, rank_prefix
from .. import subset
from ..tensors import same
from .fitting import Fitting
from .head import Head
from .norms import Norms
from .plan import Plan
from .qkclip import QKClip
from .readers import TORN_FIX, Readers
from .snapshot import Snapshot
from .transfers import Transfers
from .update import Update


def _weakly(method):
    """`method` (bound to the engine) callable without keeping the engine alive; once the engine is
    gone, a call does nothing (its close() waited for every copy). Torn states' guards outlive it."""
    ref = weakref.WeakMethod(method)

    def call():
        bound = ref()
        if bound is not None:
            bound()

    return call


def _say_first_step(laps) -> None:
    """Once per rank: the first streamed step's own work (the first iteration after a load is that step)."""
    logger.info("%sthe first streamed step's own work took %.3f s: %s", rank_prefix(), sum(s for _, s in laps),
                ", ".join(f"{what} {s:.3f} s" for what, s in laps))


class _Clock:
    """Where prepare()'s time went, for the per-rank line (it runs inside a checkpoint load's time), and
    the first streamed step's own work (the first iteration after a load is that step)."""

    def __init__(self):
        import time

        self._now = time.perf_counter
        self._last = self._now()
        self.laps = []

    def lap(self, what: str) -> None:
        now = self._now()
        self.laps.append((what, now - self._last))
        self._last = now


class _Untimed:
    """A clock that times nothing: every reload after the first streamed step's (on the step's path)."""

    laps = ()

    def lap(self, what: str) -> None:
        pass


_UNTIMED = _Untimed()


# StreamedEngine.register_after_load: where a checkpoint load's buffer registration runs: beside the load's reads
# (False), or after them, beside what follows the load (True; the first use of the buffer waits for it, and the warm
# pass moves to the first step). After: one H200, 2026-11-29, the load 3.68 s (3.64-3.69) against 3.86 s
# (3.43-3.93) beside, n=3 each in one call, without offload 3.07 s (n=6); nothing waited for it
# (docs/benchmarks.md#gpu-2026-11-29k).
class StreamedEngine:
    def __init__(self, dist_optimizers, chunk_bytes: int, budget_bytes: Optional[int] = None, auto: bool = False,
                 norms_in_update: bool = False):
        self.plan = Plan(dist_optimizers, chunk_bytes)
        self.transfers = Transfers(self.plan)
        self.readers = Readers(self.plan, self.transfers, _weakly(self.synchronize))
        self.norms = Norms(self.plan, self.transfers)
        self.norms.in_update = norms_in_update  # log_params_norm: each master's norm taken in its pass
        self.qk = QKClip(self.plan, self.transfers, self.norms)
        self.update = Update(self.plan, self.transfers, self.readers, _weakly(self.synchronize), self.norms, self.qk)
        self.head = Head(self.plan, self.transfers)
        self.fitting = Fitting(self.plan, self.transfers, self.head, budget_bytes, auto)
        self.snapshot = Snapshot(self.plan)  # what asynchronous saves hand their writer (snapshot.py)
        self.setup_peak: Optional[int] = None
        self.prepare_laps: list = []  # (what, seconds) of the last prepare() that pinned the buffer
        self.steps_streamed = 0
        self._first_laps: list = []  # (what, seconds) of the first streamed step's own work, until it is said
        self._fsdp_hooks = subset.Shadows()
        self.defer_pinning = False  # a checkpoint load comes next: the registration deferred, the warm pass after it
        self._warm_pending = False

    # -- what the adapter, status and tests read -------------------------------------------------
    parts = property(lambda self: self.plan.parts)
    chunks = property(lambda self: self.plan.chunks)
    device = property(lambda self: self.plan.device)
    window_bytes = property(lambda self: self.plan.window_bytes)
    bytes = property(lambda self: self.plan.bytes)
    resident_bytes = property(lambda self: self.plan.resident_bytes)
    master_bytes = property(lambda self: self.plan.master_bytes)
    made_on_load = property(lambda self: self.plan.made_on_load)
    tensors = property(lambda self: self.plan.tensors)
    copies = property(lambda self: self.transfers.copies)
    buffer = property(lambda self: self.transfers.buffer)
    host_wait = property(lambda self: self.transfers.host_wait)
    torn = property(lambda self: self.readers.torn)
    auto = property(lambda self: self.fitting.auto)
    budget_note = property(lambda self: self.fitting.budget_note)
    window_note = property(lambda self: self.fitting.window_note)
    register_after_load = True  # where a checkpoint load's registration runs (the comment above the class)

    # (a test gives a probe in place of a GPU's figures)
    probe = property(lambda self: self.fitting.probe, lambda self, probe: setattr(self.fitting, "probe", probe))
    states_after_load = property(lambda self: self.readers.states_after_load,
                                 lambda self, value: setattr(self.readers, "states_after_load", value))

    @property
    def pinned_bytes(self) -> int:
        return self.buffer.nbytes if self.buffer is not None else 0

    def plan_bytes(self) -> int:
        return self.plan.lay_out()

    def optimizers(self):
        return self.plan.optimizers()

    def on_host(self) -> bool:
        return self.plan.on_host()

    def host_tensors(self) -> list:
        """The tensors bound to the host buffer's views (masters, states, scales): what a checkpoint
        writer is handed, and would hold on to (instrument/saves.py)."""
        if self.transfers.buffer is None:
            return []
        return [t for _, b, e in self.plan.streamed_entries() if (t := b.get(e)) is not None and same(t, e.host)]

    # -- before the first step --------------------------------------------------------------------
    def prepare(self) -> None:
        """Pin the host buffer once, for the plan (after every rank's check); take in every state that
        exists, create the rest in their host views; hook the loads. A training after a parked one
        pins the same buffer again, in place."""
        t = self.transfers
        if t.buffer is not None:
            self.prepare_laps = []  # (the buffer exists: nothing of the first preparation is done again)
            if t.buffer.unpinned:
                t.buffer.repin()
                self._note_setup_peak()
            self.snapshot.allocate()  # dropped when the last training parked
            return
        clock = _Clock()
        after = self.defer_pinning and self.register_after_load  # (no touch where the load writes the states first)
        t.pin(defer=self.defer_pinning, start=not after, touch=not (after and not self.readers.states_after_load))
        clock.lap("the buffer")
        t.take_all()  # masters made on the host at construction, states a load put elsewhere
        clock.lap("taking what exists")
        for part in self.parts:
            if part.fsdp is not None:  # Megatron-FSDP's own copy outside an update reads the host masters
                part.fsdp.hook(self._fsdp_hooks, _weakly(self.synchronize))
        if not self.readers.states_after_load:
            t.materialize(zeroed=t.buffer.zeroed)  # the states not taken: views nothing wrote since pin()
            clock.lap("making the states")
        self.readers.hook_loads()
        self.head.attach()
        self._note_setup_peak()
        self.snapshot.allocate(fault=not self.defer_pinning)  # beside a load: made at the first save
        clock.lap("the snapshot")
        self.prepare_laps = clock.laps
        if t.copies.device_copies:
            if t.buffer.pending:
                self._warm_pending = True  # after the load (after_load), once the registration is through
            else:
                t.warm()

    def _note_setup_peak(self) -> None:
        if self.transfers.copies.device_copies:
            import torch

            self.setup_peak = torch.cuda.max_memory_allocated(self.device)

    def after_load(self) -> list:
        """What follows a checkpoint load (inside its time): (what, seconds) of each part, for its per-rank line.
        The snapshot a load left for later is made at the first save (snapshot.py: never beside the load's end)."""
        clock = _Clock()
        if self.transfers.buffer is not None:
            later = self.register_after_load and self.transfers.buffer.pending  # beside what Bridge does next
            self.transfers.buffer.start_registration() if later else self.transfers.ready()
            clock.lap("the registration started" if later else "waiting for the registration")
            self.readers.after_load()  # (it waits for every copy in flight: before the warm pass is queued)
            clock.lap("taking what the load bound elsewhere")
            if self._warm_pending and not self.transfers.buffer.pending:
                self._warm_pending = False
                self.transfers.warm(wait=False)  # beside what Bridge's setup does after the load
                clock.lap("the warm pass queued")
        return clock.laps

    # -- the call sites ---------------------------------------------------------------------------
    def offload(self) -> int:
        """Start of forward-backward: make the host copy canonical (transfers.adopt)."""
        if self.update.armed:
            self.settle()  # a rerun after finalization: the prefetched chunks go back unused
        elif self.transfers.started:
            self.transfers.close_window()  # a backward prefetched, and no update came
        if self.transfers.buffer is None:
            return 0
        if self.torn is not None:
            raise self.readers.refusal("an optimizer step")
        if self._warm_pending:  # the registration ran after a load (register_after_load): its warm pass now
            self._warm_pending = False
            self.transfers.warm(wait=False)
        self.probe.at_offload(self.device)
        self.transfers.adopt()
        self.head.begin_step(measure=not self.probe.done and self.transfers.copies.device_copies)
        return self.bytes

    def release(self) -> None:
        """After the param-buffer copy: free the GPU storage of what offload() adopted."""
        self.transfers.release()

    def reload(self) -> int:
        """Gradient finalization: arm the update (update.arm)."""
        if self.update.armed or self.transfers.buffer is None:
            return 0
        self.copies.collect()
        if not self.on_host():  # no offload() this step: adopt now (no step of the probe or the head begins)
            if self.transfers.started:
                self.transfers.close_window()
            if self.torn is not None:
                raise self.readers.refusal("an optimizer step")
            self.transfers.adopt()
            self.release()
        self.readers.drop_guards()  # the update's own copies are ordered after the tail on the GPU
        clock = _Clock() if self.steps_streamed == 0 else _UNTIMED  # the first step's own work, said after it
        self.head.end_step()
        self.probe.at_reload(self.device)
        clock.lap("reading backward's memory curve")
        self.fitting.first_window()  # the first step's window under the run's peak so far (chunk_mb=auto)
        clock.lap("the first window")
        if self.steps_streamed == 0:
            self._first_laps = clock.laps
        self.update.arm()
        return self.bytes

    def wait_reload(self) -> None:
        """Nothing to wait for before the step: each chunk waits for its own copy."""

    def defer_clip_qk(self, model, clip_qk) -> None:
        """After gradient finalization: clip_qk served inside the armed update (qkclip.py)."""
        if self.update.armed:
            self.qk.defer(model, clip_qk)

    def settle(self, wait: bool = False) -> None:
        """train_step is over (done, skipped, failed, or a rerun): the hooks removed, every entry bound
        to its host view, the window given back. The last device-to-host copies may still run
        (readers are guarded until they end) unless `wait`."""
        was_armed = self.update.disarm()
        self.qk.reset()  # what was deferred and not finished (a rerun, an exit before the step) is dropped
        t = self.transfers
        if t.buffer is None:
            return
        if was_armed and self.torn is None:
            u = self.update
            where = ("between the optimizers of the chain" if u.stopped_between_parts() else
                     "in Megatron-Core's master -> model copy after the update (the FP8 cast among it)"
                     if u.stopped_before_copy() else None)
            if where:
                u.where = where
                self.readers.torn = u.failure()
                logger.error("%s%s. %s", rank_prefix(), self.torn, TORN_FIX)
        loose = list(self.plan.away())
        if loose:  # a skipped step (masters on their shells) or a failed one
            t.copies.host_wait_all()
            for _, b, e, _ in loose:
                # never the window's data: a failed pass's is partial. Before any pass the host copy is
                # the states as before the step; after one, the states are torn anyway
                b.set(e, e.host)
        t.close_window()
        t.copies.end_step()
        if self.update.stepped:
            self.steps_streamed += 1
            self.update.stepped = False
        if wait:
            self.synchronize()
        if self.torn is not None or (not wait and t.tail is not None and was_armed):
            self.readers.guard()
        if self.steps_streamed == 1 and not self.probe.done:
            clock = _Clock()
            self.fitting.after_first_step(self.synchronize)
            clock.lap("fitting the window and the head")
            _say_first_step(self._first_laps + clock.laps)

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

    @contextlib.contextmanager
    def checkpoint_io(self):
        """A checkpoint save or load: the host copy whole first; Megatron-FSDP's DTensors over the host buffer
        presented on the host for the call (engine/fsdp.py), over the snapshot in an asynchronous save that keeps
        one (entered inside snapshot.saving())."""
        parts = [p for p in self.parts if p.fsdp is not None]
        if not parts or self.transfers.buffer is None:
            yield
            return
        self.synchronize()
        key = self.transfers.buffer.tensor.untyped_storage().data_ptr()
        shadows = subset.Shadows()
        try:
            with contextlib.ExitStack() as stack:
                for part in parts:
                    stack.enter_context(part.fsdp.checkpoint_io(key, shadows, self.snapshot.stand_in
                                                                if self.snapshot.active else None))
                yield
        finally:
            shadows.restore()

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
        self.snapshot.drop()  # a save still writing it keeps its own references; a next train() makes another
        if self.transfers.buffer is not None:
            self.transfers.buffer.unpin()

    def close(self) -> None:
        """Unpatch: states back on the GPU as ordinary tensors, the host buffer freed (exactly once)."""
        if self.torn is not None:
            logger.warning("%sunpatch(): %s. They go back to the GPU as they are, and checkpoint saves and optimizer "
                           "steps of them stay refused until a checkpoint is loaded. %s", rank_prefix(), self.torn,
                           TORN_FIX)
        self.settle(wait=True)
        self.snapshot.drop()
        t = self.transfers
        if t.buffer is None:
            return
        for part in self.parts:
            try:
                b = part.bindings
            except BridgeFGOError:  # the optimizer is gone: nothing left to give back
                continue
            if part.fsdp is not None:  # Megatron-FSDP's buffers made again, the masters views of them
                part.fsdp.restore(self.device)
            for bundle in part.bundles:
                for e in bundle.entries:
                    if b.get(e) is not None and not bundle.resident and not e.dropped and not part.flat_master(e):
                        t.to_device(part, b, e)
        if self.device is not None and self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)
        self.readers.unhook_loads()
        self._fsdp_hooks.restore()
        self.head.detach()
        t.free()
