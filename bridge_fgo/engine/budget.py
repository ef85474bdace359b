"""gpu_budget_gib: how much of the optimizer states may stay on the GPU.

Judged once, after the first streamed step, from what that step measured with everything offloaded
(firststep.py). Each state kept on the GPU adds its bytes to every phase of the iteration, so the
states kept, plus the run's allocated peak with them kept, fit in the budget minus a margin, and the
run's peak lands within the margin under the budget.

That peak is forward-backward's, or the step's where the step sets it (full recomputation). The step's
depends on what is kept: its window is as large as the largest chunks left to stream, and keeping the
largest parameters (the embedding) shrinks it. So the step's figure is taken for the states kept, not
for everything offloaded (2026-11-26, H100: planned from the all-offloaded window, a recomputing run
left 0.95 GiB of an 11 GiB budget unused).
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence

from . import layout
from .firststep import FirstStep, margin

GiB = 2**30

# step_with(kept) -> the step phase's allocated peak (without the kept states' own bytes) were `kept`
# resident: what the step starts from, its window and the optimizer's scratch for them
StepWith = Callable[[Sequence[layout.Bundle]], int]


def peak(first: FirstStep) -> int:
    """The run's allocated peak through the first step with everything offloaded (0: not measured)."""
    return max(first.backward, first.step)


def planned(first: FirstStep, kept: Sequence[layout.Bundle], step_with: Optional[StepWith]) -> int:
    """The run's allocated peak with `kept` resident, as planned."""
    step = first.step if step_with is None or not first.measured else step_with(kept)
    return max(first.backward, step) + sum(b.nbytes for b in kept)


def choose(bundles: Sequence[layout.Bundle], budget: int, first: FirstStep,
           step_with: Optional[StepWith] = None, chunk_bytes: int = 0) -> Optional[List[layout.Bundle]]:
    """The bundles to keep resident under the budget; None when even everything offloaded exceeds it.

    The largest first within the room the all-offloaded peak leaves (layout.keep_resident); then, with
    `step_with`, more while the planned peak stays under the budget: what the kept ones took off the
    window is room too. A candidate is tried when it fits the room left, or when it is larger than a
    chunk of `chunk_bytes` (a chunk alone, it may set a window slot: keeping it may shrink the
    window by as much)."""
    bound = budget - margin(budget if first.measured else 0)
    room = bound - peak(first)
    if room <= 0:
        return None
    kept = layout.keep_resident(bundles, room)
    if step_with is None or not first.measured:
        return kept
    chosen = {id(b) for b in kept}
    slack = bound - planned(first, kept, step_with)
    for b in sorted((b for b in bundles if b.entries and not b.resident and id(b) not in chosen),
                    key=lambda b: -b.nbytes):
        if b.nbytes > slack and b.nbytes < chunk_bytes:  # it shares a chunk: the window hardly changes
            continue
        trial = planned(first, kept + [b], step_with)
        if trial <= bound:
            kept.append(b)
            chosen.add(id(b))
            slack = bound - trial
    return kept
