"""The Megatron-Core offload generations bridge_fgo knows, each declared in its own module
(generations/<generation>.py: detection, request, refusals, adapter, status text, native wiring).

A new generation is one new module listed here.
"""
from __future__ import annotations

import sys
from typing import Iterable, Optional

from . import chunked, none, three_method
from .base import Adapter, Generation

# Detection order, newest first: `none` matches any optimizer, so it comes last.
GENERATIONS = (chunked.GENERATION, three_method.GENERATION, none.GENERATION)
# offload=builtin runs the builtin engine, whatever the generation.
BUILTIN = none.GENERATION

__all__ = ["Adapter", "Generation", "GENERATIONS", "BUILTIN", "of_classes", "native_wiring_names", "of_wiring", "of_objects", "installed",
           "installed_if_loaded"]


def of_classes(classes: Iterable[Optional[type]]) -> Generation:
    """The first generation (newest first) any of these classes belongs to; the last, `none`,
    when none does."""
    classes = [c for c in classes if c is not None]
    return next((g for g in GENERATIONS if any(g.detect(c) for c in classes)), GENERATIONS[-1])


def native_wiring_names() -> frozenset:
    return frozenset(n for g in GENERATIONS for n in g.native_wiring)


def of_wiring(names) -> Optional[Generation]:
    """The generation whose offload methods Bridge's own loop calls (native wiring), if any."""
    return next((g for g in GENERATIONS if set(g.native_wiring) & set(names)), None)


def of_objects(objects) -> Generation:
    """The generation of the optimizers in hand (the chain's children first, then the chain)."""
    return of_classes(type(o) for o in objects)


def installed() -> Optional[Generation]:
    """Generation of the installed Megatron-Core, importing its optimizer module; None if absent."""
    try:
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
        from megatron.core.optimizer.optimizer import MegatronOptimizer
    except Exception:
        return None
    return of_classes((MegatronOptimizer, DistributedOptimizer))


def installed_if_loaded() -> Optional[Generation]:
    """Like installed(), without importing anything: None until Megatron-Core's optimizer is loaded."""
    if "megatron.core.optimizer.distrib_optimizer" not in sys.modules:
        return None
    return installed()
