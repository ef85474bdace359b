"""The Megatron-Core offload generations bridge_fgo knows, each declared in its own module
(adapters/<generation>.py: detection, request, refusals, adapter, status text, native wiring).

A new generation is one new module listed here.
"""
from __future__ import annotations

from typing import Iterable, Optional

from . import builtin, chunked, three_method
from .base import Adapter, Generation

# Detection order, newest first: `none` matches any optimizer, so it comes last.
GENERATIONS = (chunked.GENERATION, three_method.GENERATION, builtin.GENERATION)
# offload=builtin runs the builtin engine, whatever the generation.
BUILTIN = builtin.GENERATION

__all__ = ["Adapter", "Generation", "GENERATIONS", "BUILTIN", "of_classes", "native_wiring_names"]


def of_classes(classes: Iterable[Optional[type]]) -> Generation:
    """The first generation (newest first) any of these classes belongs to; the last, `none`,
    when none does."""
    classes = [c for c in classes if c is not None]
    return next((g for g in GENERATIONS if any(g.detect(c) for c in classes)), GENERATIONS[-1])


def native_wiring_names() -> frozenset:
    return frozenset(n for g in GENERATIONS for n in g.native_wiring)
