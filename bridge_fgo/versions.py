"""The versions of the packages that matter: installed metadata, and the Megatron-Core actually loaded."""
from __future__ import annotations

import importlib.metadata
import sys
from typing import Dict, Optional



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
