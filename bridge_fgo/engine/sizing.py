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
GIB = 2**30
MAX_CHUNK_MB = 1024
MIN_CHUNK_MB = 16  # the first step's least: smaller chunks cost more per byte than they save
STEP_MB = 32  # the sizes tried, from the cap down


WindowOf = Callable[[int, int], Tuple[int, int, int]]


def first(window_of: WindowOf, first: FirstStep, start: int) -> Tuple[int, int, str]:
    """The first step's chunk bytes, slots and why: `start` and two slots where that window and the
    optimizer's scratch (the contract's) fit the headroom; else the largest size that does, down to
    MIN_CHUNK_MB or the largest parameter's states; else the smallest larger size, up to MAX_CHUNK_MB, that
    does; else one slot (each chunk's copy in then waits for the one before to leave: slower, under the
    peak) where that fits; else the least with two."""
    if not first.measured or fits(window_of, first, start, 2):
        return start, 2, ""
    # below the largest parameter's states (a chunk alone whatever the size: the embedding's) the window
    # shrinks no further, and more chunks only cost time
    least = min(start, max(MIN_CHUNK_MB * MIB, window_of(1, 2)[1]))
    size = start
    while size > least:
        size = max(least, size - STEP_MB * MIB if size > STEP_MB * MIB else size // 2)
        if fits(window_of, first, size, 2):
            return size, 2, (f"{size / MIB:.0f} MB chunks, not {start / MIB:.0f}: two slots of those would raise the "
                             f"run's peak so far ({_room(first)})")
    # Larger chunks can make a smaller window: the parameters too large to share a chunk (an untied
    # embedding and output layer) take a slot each, or share one when another cut puts them both in it
    # (slot i holds chunks i, i + 2, ...). The nearest such size keeps the first copy in short.
    size = start
    while size < MAX_CHUNK_MB * MIB:
        size += STEP_MB * MIB
        if fits(window_of, first, size, 2):
            return size, 2, (f"{size / MIB:.0f} MB chunks, not {start / MIB:.0f}: two slots of {start / MIB:.0f} MB "
                             f"chunks would raise the run's peak so far ({_room(first)}); at {size / MIB:.0f} MB the "
                             "largest parameters' states share a slot")
    if fits(window_of, first, start, 1):
        return start, 1, (f"{start / MIB:.0f} MB chunks through one slot: two slots of even the least ({least / MIB:.0f} "
                          f"MB, or the largest parameter's states) would raise the run's peak so far ({_room(first)})")
    return least, 2, f"{least / MIB:.0f} MB chunks, the least: even those raise the run's peak so far ({_room(first)})"


def _room(first: FirstStep) -> str:
    return (f"{first.headroom() / MIB:.0f} MiB of headroom over {first.base / GIB:.2f} GiB allocated, under "
            f"{first.backward / GIB:.2f} GiB")


def choose(window_of: WindowOf, first: FirstStep, total: int, floor: int = FIRST_CHUNK_MB * MIB) -> Tuple[int, int, str]:
    """(chunk bytes, slots, why). window_of(chunk_bytes, slots) -> (window bytes, largest chunk, chunks)
    of the plan cut at that size; total: the bytes streamed each way; floor: the first step's chunk
    size, the least chosen."""
    if not first.measured:
        return floor, 2, f"{floor / MIB:.0f} MB: nothing measured (no GPU)"
    if total <= floor and window_of(floor, 2)[2] <= 1:
        return floor, 2, f"{floor / MIB:.0f} MB: the states fit in one chunk"
    room = first.headroom()
    size = max(floor, min(MAX_CHUNK_MB * MIB, total))
    while size > floor and not fits(window_of, first, size, 2):
        size = max(floor, size - STEP_MB * MIB)
    if size == floor and not fits(window_of, first, size, 2):
        if fits(window_of, first, floor, 1):  # one slot where only that keeps the step under the peak
            return floor, 1, (f"{floor / MIB:.0f} MB, one slot, the least: a larger window would raise the peak "
                              f"({room / MIB:.0f} MiB of headroom); {first.describe()}")
        # every window raises it: the one that raises it least (another cut can put the largest states,
        # chunks alone, into one slot: a larger size, a smaller window)
        size = min(range(floor, max(floor, min(MAX_CHUNK_MB * MIB, total)) + 1, STEP_MB * MIB),
                   key=lambda s: (need(window_of, first, s, 2), s))
        return size, 2, (f"{size / MIB:.0f} MB, the least window: every window would raise the peak "
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


def need(window_of: WindowOf, first: FirstStep, size: int, n: int) -> int:
    """What a window of n slots of chunks of `size`, and the optimizer's scratch, add to the step."""
    window, largest, _ = window_of(size, n)
    return window + first.scratch(largest)


def fits(window_of: WindowOf, first: FirstStep, size: int, n: int) -> bool:
    """Whether a window of n slots of chunks of `size`, and the optimizer's scratch, fit the headroom."""
    return need(window_of, first, size, n) <= first.headroom()
