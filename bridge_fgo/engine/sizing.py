"""chunk_mb=auto: the streamed step's window sized from the run, once, after its first step.

The first step runs with FIRST_CHUNK_MB chunks and two slots. Its figures (firststep.py) give the
headroom: what the step may add to the memory it starts from without raising the bound, the first
forward-backward's peak (or setup's, or a load's, if higher: the run has reached it already). Fewer,
larger chunks cost less per step (each chunk costs the inner optimizer's per-call work and a few
launches; measured in docs/benchmarks.md), so chunks grow to the largest size whose two-slot window
and the optimizer's scratch fit in the headroom, capped at MAX_CHUNK_MB: the first chunk's copy in is
exposed whatever the size, and a 1 GiB chunk takes about 20 ms at 55 GB/s. Then the window takes as
many slots of that cut as the headroom holds: every slot is a chunk whose copy in can begin before
the update (during the last backward, head.py) instead of inside it. Where the step already sets the
peak (full recomputation), the window stays at FIRST_CHUNK_MB and two slots, where it was.
"""
from __future__ import annotations

from typing import Callable, Tuple

from ..options import FIRST_CHUNK_MB
from .firststep import FirstStep

MIB = 2**20
MAX_CHUNK_MB = 1024
STEP_MB = 32  # the sizes tried, from the cap down


WindowOf = Callable[[int, int], Tuple[int, int, int]]


def choose(window_of: WindowOf, first: FirstStep, total: int) -> Tuple[int, int, str]:
    """(chunk bytes, slots, why). window_of(chunk_bytes, slots) -> (window bytes, largest chunk, chunks)
    of the plan cut at that size; total: the bytes streamed each way."""
    floor = FIRST_CHUNK_MB * MIB
    if not first.measured:
        return floor, 2, f"{FIRST_CHUNK_MB} MB: nothing measured (no GPU)"
    if total <= floor:
        return floor, 2, f"{FIRST_CHUNK_MB} MB: the states fit in one chunk"
    room = first.headroom()
    size = max(floor, min(MAX_CHUNK_MB * MIB, total))
    while size > floor and not fits(window_of, first, size, 2):
        size = max(floor, size - STEP_MB * MIB)
    if size == floor and not fits(window_of, first, size, 2):
        return floor, 2, (f"{FIRST_CHUNK_MB} MB, the least: a larger window would raise the peak "
                          f"({room / MIB:.0f} MiB of headroom); {first.describe()}")
    n = slots(window_of, first, size)
    return size, n, (f"{size / MIB:.0f} MB, {n} slots, the window {window_of(size, n)[0] / MIB:.0f} MiB "
                     f"within {room / MIB:.0f} MiB of headroom; {first.describe()}")


def slots(window_of: WindowOf, first: FirstStep, size: int) -> int:
    """As many window slots of chunks of `size` as the headroom holds (two at least, one per chunk at
    most): with chunk_mb=auto and with a chunk_mb given, whose chunk size stays as given."""
    n = 2
    while first.measured:
        if n >= window_of(size, n)[2] or not fits(window_of, first, size, n + 1):
            break  # every chunk has its slot, or one more would raise the peak
        n += 1
    window_of(size, n)
    return n


def fits(window_of: WindowOf, first: FirstStep, size: int, n: int) -> bool:
    """Whether a window of n slots of chunks of `size`, and the optimizer's scratch, fit the headroom."""
    window, largest, _ = window_of(size, n)
    return window + first.scratch(largest) <= first.headroom()
