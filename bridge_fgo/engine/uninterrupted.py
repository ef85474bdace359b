"""Loops that put things back and must finish: a KeyboardInterrupt (or any exception) arriving between
two items would leave the rest where they were (a parameter on a temporary host tensor, an attribute
shadowed). `each` finishes every item first, then raises what arrived.

Each item's action must be idempotent: an interrupt that lands after an action but before the loop
moves on repeats that action.
"""
from __future__ import annotations

from typing import Callable, Sequence, TypeVar

T = TypeVar("T")

TRIES = 3  # an action that raises this often on its own (not an interrupt in passing) is given up


def each(items: Sequence[T], action: Callable[[T], None]) -> None:
    """action(item) for every item, in order, whatever is raised meanwhile; the first exception is
    raised once all are done (an item whose action kept failing is skipped after TRIES attempts)."""
    first = None
    i, tries = 0, 0
    while i < len(items):
        try:
            while i < len(items):
                action(items[i])
                i, tries = i + 1, 0
        except BaseException as exc:  # noqa: B902 (a KeyboardInterrupt must not cut the loop)
            if first is None:
                first = exc
            tries += 1
            if tries >= TRIES:
                i, tries = i + 1, 0
    if first is not None:
        raise first
