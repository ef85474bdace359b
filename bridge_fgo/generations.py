"""Which Megatron-Core offload generation is installed, decided from the objects themselves.

- none: no optimizer-state offload (every PyPI release up to 0.19.x, and main).
- three-method: the dev line of 2026-01..2026-08: DistributedOptimizer.offload_states(),
  .release_offloaded_gpu_states(), .reload_offloaded_states().
- chunked: dev since 2026-08-18 (Megatron-LM 9050d4c5fb): MegatronOptimizer.offload_optimizer_state_for_forward()
  and friends; offload_optimizer_states is a deprecated alias of chunked_optimizer_state_offload.
"""
from __future__ import annotations

import importlib.metadata
import sys
from typing import Dict, Optional

NONE = "none"
THREE_METHOD = "three-method"
CHUNKED = "chunked"

THREE_METHODS = ("offload_states", "release_offloaded_gpu_states", "reload_offloaded_states")
CHUNKED_METHODS = (
    "offload_optimizer_state_for_forward",
    "prefetch_optimizer_state_for_gradient_finalization",
)

MEANING = {
    NONE: "this Megatron-Core has no optimizer-state offload; bridge_fgo's builtin engine can provide it",
    THREE_METHOD: "Megatron-Core's three-method offloader: bridge_fgo wires it when the config flag is set",
    CHUNKED: "Megatron-Core's chunked offload API: bridge_fgo wires it when the config flag is set",
}


def of_class(dist_opt_cls, base_cls=None) -> str:
    """Generation from DistributedOptimizer (and MegatronOptimizer, where the chunked API lives)."""
    for cls in (base_cls, dist_opt_cls):
        if cls is not None and all(hasattr(cls, m) for m in CHUNKED_METHODS):
            return CHUNKED
    if all(hasattr(dist_opt_cls, m) for m in THREE_METHODS):
        return THREE_METHOD
    return NONE


def of_object(optimizer) -> str:
    return of_class(type(optimizer))


def installed() -> Optional[str]:
    """Generation of the installed Megatron-Core, importing its optimizer module; None if absent."""
    try:
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
        from megatron.core.optimizer.optimizer import MegatronOptimizer
    except Exception:
        return None
    return of_class(DistributedOptimizer, MegatronOptimizer)


def installed_if_loaded() -> Optional[str]:
    """Like installed(), without importing anything: None until Megatron-Core's optimizer is loaded."""
    if "megatron.core.optimizer.distrib_optimizer" not in sys.modules:
        return None
    return installed()


def version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def megatron_core_version() -> Optional[str]:
    """The version of the Megatron-Core that is loaded, where it is: a source tree on PYTHONPATH can
    shadow an installed wheel whose metadata would say otherwise."""
    core = sys.modules.get("megatron.core")
    loaded = getattr(core, "__version__", None) if core is not None else None
    installed = version("megatron-core")
    if loaded and installed and _public(loaded) != _public(installed):
        return f"{loaded} (loaded from {getattr(core, '__file__', '?')}; installed metadata says {installed})"
    return installed or loaded


def _public(v: str) -> str:
    """'0.19.2+f7bcd05' -> '0.19.2' (wheels carry a local build tag in __version__)."""
    from packaging.version import InvalidVersion, Version

    try:
        return Version(v).public
    except InvalidVersion:
        return v


def versions() -> Dict[str, Optional[str]]:
    return {
        "python": ".".join(map(str, sys.version_info[:3])),
        "bridge-fgo": version("bridge-fgo"),
        "torch": version("torch"),
        "wrapt": version("wrapt"),
        "megatron-core": megatron_core_version(),
        "megatron-bridge": version("megatron-bridge"),
    }
