"""gpu_budget_gib: how much of the optimizer states may stay on the GPU.

Judged once, after the first streamed step, from what that step measured with everything offloaded
(firststep.py): the run's allocated peak by then. Each state kept on the GPU adds its bytes to every
phase of the iteration, so the states kept fit in the budget minus that peak and a margin, and the
run's peak lands within the margin under the budget.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

from . import layout
from .firststep import FirstStep, margin

GiB = 2**30


def peak(first: FirstStep) -> int:
    """The run's allocated peak through the first step with everything offloaded (0: not measured)."""
    return max(first.backward, first.step)


def choose(bundles: Sequence[layout.Bundle], budget: int, first: FirstStep) -> Optional[List[layout.Bundle]]:
    """The bundles to keep resident under the budget; None when even everything offloaded exceeds it."""
    room = budget - peak(first) - margin(budget if first.measured else 0)
    if room <= 0:
        return None
    return layout.keep_resident(bundles, room)
