"""The streamed step fitted to the run's GPU memory, from what the first streamed step measures
(firststep.py), on a GPU only:

- at the first step's gradient finalization (chunk_mb=auto): the first window, two slots of chunks no
  larger than fit under the run's peak so far (setup's, a load's or the first forward-backward's,
  whichever is higher), so that the first step does not set the run's peak either (sizing.first;
  under full recomputation a fixed 256 MB first window did: H100, 2026-11-26);
- after the first step, once: gpu_budget_gib's resident states (budget.py), then the window
  (sizing.choose; for a chunk_mb given, its slots), then the head (head.py).
"""
from __future__ import annotations

from typing import Callable, Optional

from ...log import logger, rank_prefix
from .. import budget, firststep, sizing
from ..firststep import margin
from .head import Head
from .plan import Plan
from .transfers import Transfers

GiB = 2**30
MIB = 2**20


class Fitting:
    def __init__(self, plan: Plan, transfers: Transfers, head: Head, budget_bytes: Optional[int], auto: bool):
        self.plan, self.transfers, self.head = plan, transfers, head
        self.budget_bytes = budget_bytes
        self.auto = auto  # chunk_mb=auto: the window sized from the run (sizing.py)
        self.probe = firststep.Probe()
        self.budget_note: Optional[str] = None
        self.window_note: Optional[str] = None
        self.first_note: Optional[str] = None  # why the first step's window is smaller than it starts

    def window_at(self, chunk_bytes: int, slots: int = 2):
        """The plan cut into chunks of at most chunk_bytes, with a window of `slots` slots for them:
        (window bytes, largest pass: a chunk or a piece of the resident states, chunks). Between updates
        only (the old window's memory is retired after its copies)."""
        self.plan.chunk_bytes, self.plan.slots = chunk_bytes, slots
        self.plan.cut()
        self.transfers.new_window()
        window, largest = self.plan.window_if()
        return window, largest, len(self.plan.chunks)

    def _scratch_per_byte(self) -> float:
        return max((p.contract.step_scratch for p in self.plan.parts), default=0.0)

    # -- the first step --------------------------------------------------------------------------
    def first_window(self) -> None:
        """At the first streamed step's gradient finalization, before its update is armed."""
        first = self.probe.first
        if not (self.auto and first.measured) or self.probe.done:
            return
        first.scratch_per_byte = self._scratch_per_byte()
        start = self.plan.chunk_bytes
        size, slots, why = sizing.first(self.window_at, first, start)
        self.window_at(size, slots)  # (the search re-cut the plan)
        if not why:
            return
        self.first_note = why
        logger.info("%sthe first step's window: %s", rank_prefix(), why)

    # -- after the first step --------------------------------------------------------------------
    def after_first_step(self, synchronize: Callable[[], None]) -> None:
        """Once: gpu_budget_gib's resident states, then (chunk_mb=auto) the window, then the prefetch
        during backward, from what the first streamed step measured."""
        plan = self.plan
        first = self.probe.at_step_end(plan.device, plan.window_bytes, max((c.nbytes for c in plan.chunks), default=0),
                                       self._scratch_per_byte())
        if self.budget_bytes is not None:
            self._apply_budget(first, synchronize)
        if self.auto or first.measured:
            if self.auto:
                size, slots, why = sizing.choose(self.window_at, first, plan.bytes, floor=plan.chunk_bytes)
            else:  # the chunk size as given; the slots as the headroom allows
                size = plan.chunk_bytes
                slots = sizing.slots(self.window_at, first, size)
                fits = sizing.fits(self.window_at, first, size, slots)
                why = (f"{size / MIB:.0f} MB as chunk_mb gives, {slots} slots "
                       f"{'within the headroom' if fits else '(the least: even two exceed the headroom)'}; "
                       f"{first.describe()}")
            self.window_at(size, slots)
            self.window_note = (f"window sized from the first step: {why}. {len(plan.chunks)} chunk(s), the step adds "
                                f"at most {plan.window_bytes} bytes on the GPU")
            logger.info("%s%s", rank_prefix(), self.window_note)
        if first.measured:  # under the run's peak through the first step: the step's where it set it (recompute)
            bound = budget.peak(first)
            self.head.enable(bound - margin(bound), plan.resident_bytes)
            if self.head.state == "on":
                logger.info("%s%s", rank_prefix(), self.head.describe())

    def _apply_budget(self, first, synchronize: Callable[[], None]) -> None:
        """Keep resident as many bundles as fit under the budget."""
        plan = self.plan

        def step_with(kept) -> int:  # the step's peak were `kept` resident: its window shrinks with them
            window, largest = plan.window_if({id(b) for b in kept})
            return first.base + window + first.scratch(largest)

        kept = budget.choose([bd for part in plan.parts for bd in part.bundles], self.budget_bytes, first, step_with,
                             plan.chunk_bytes)
        basis = (f"the run's allocated peak with everything offloaded {budget.peak(first) / GiB:.2f} GiB"
                 if first.measured else "nothing measured (no GPU)")
        if kept and first.measured:
            basis += f", planned with them {budget.planned(first, kept, step_with) / GiB:.2f} GiB"
        if kept is None:
            self.budget_note = (f"gpu_budget_gib {self.budget_bytes / GiB:.2f} GiB cannot be met: {basis}; "
                                "everything stays offloaded")
            logger.warning("%s%s", rank_prefix(), self.budget_note)
            return
        synchronize()
        try:
            for bundle in kept:
                part = plan.parts[bundle.part]
                b = part.bindings
                moved = []
                try:
                    for e in bundle.entries:
                        if not e.dropped and b.get(e) is not None:
                            self.transfers.to_device(part, b, e)
                            moved.append(e)
                except BaseException:  # (out of GPU memory): this bundle goes back whole, the others stay
                    for e in moved:
                        self.transfers.take(part, b, e, b.get(e))
                    raise
                bundle.resident = True  # only once all of it is on the GPU
        finally:
            self.window_at(plan.chunk_bytes, plan.slots)  # the chunks: what is not resident
        self.budget_note = (f"gpu_budget_gib {self.budget_bytes / GiB:.2f} GiB, {basis}: "
                            f"{len(kept)} parameter(s) keep their states on the GPU "
                            f"({plan.resident_bytes / GiB:.2f} GiB), {plan.bytes / GiB:.2f} GiB move each way per "
                            "step")
        logger.info("%s%s", rank_prefix(), self.budget_note)
