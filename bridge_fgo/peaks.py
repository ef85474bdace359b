"""The run's GPU memory peak since the process started, and the phase that set it.

A run goes out of memory at its highest point, setup and every resume included, so that is the figure
users compare. The call sites note it after the optimizer's construction, after a checkpoint load and
after every training step (torch.cuda.max_memory_allocated: a counter read, no synchronisation). A
benchmark or profiler may reset the allocator's peak; the highest value seen is kept.
"""
from __future__ import annotations

import sys
import threading
from typing import Optional, Tuple

_lock = threading.Lock()
_peak: Tuple[int, Optional[str]] = (0, None)


def note(phase: str) -> None:
    """Read the allocator's peak; if it is the highest so far, `phase` set it."""
    global _peak
    torch = sys.modules.get("torch")  # never imports torch: nothing to read where it is not loaded
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return
    value = int(torch.cuda.max_memory_allocated())
    with _lock:
        if value > _peak[0]:
            _peak = (value, phase)


def peak() -> Tuple[int, Optional[str]]:
    """(bytes, phase) of the highest peak noted; (0, None) before any or without a GPU."""
    return _peak


def describe() -> str:
    value, phase = _peak
    if phase is None:
        return ""
    return f"run's GPU peak since the process started: {value / 2**30:.2f} GiB, reached by the end of {phase}"


def reset() -> None:
    """For tests."""
    global _peak
    with _lock:
        _peak = (0, None)
