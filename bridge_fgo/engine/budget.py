"""gpu_budget_gib: how much of the optimizer states may stay on the GPU.

Judged once, after the first streamed step, from what the caching allocator held through that step
with everything offloaded (the largest of memory_reserved right after backward and at the step's end,
and max_memory_allocated). The allocator keeps what it allocated (the forward-backward peak, the
window) until empty_cache, and nobody resets it, unlike max_memory_allocated, which benchmarks and
profilers reset. So it bounds the step's peak from above and the plan errs on the safe side:
fragmentation counts too. What setup left cached (Megatron-Core creates the masters on the GPU) is
given back once, right after the first release, so it does not count.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from . import layout

GiB = 2**30


def margin(budget: int) -> int:
    """Kept free under a budget: the allocator rounds and fragments what the kept states take
    (measured 4 MiB over a 12.24 GiB budget without it; H100, 2026-11-23). 1%, at least 64 MiB."""
    return max(64 * 2**20, budget // 100)


def held(device, after_backward: int) -> Tuple[int, str]:
    """(bytes the step is judged to take with everything offloaded, how that was measured)."""
    if device is None or device.type != "cuda":
        return 0, "no GPU: nothing measured"
    import torch

    peak = max(after_backward, torch.cuda.memory_reserved(device), torch.cuda.max_memory_allocated(device))
    return peak, "GPU memory held through the first step with everything offloaded"


def choose(bundles: Sequence[layout.Bundle], budget: int, peak: int) -> Optional[List[layout.Bundle]]:
    """The bundles to keep resident under the budget; None when even everything offloaded exceeds it."""
    room = budget - peak - (margin(budget) if peak else 0)
    if room <= 0:
        return None
    return layout.keep_resident(bundles, room)
