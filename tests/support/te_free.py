"""Import Megatron-Bridge where Transformer Engine is not installed.

Bridge's package __init__ reaches megatron/bridge/peft/lora_layers.py, whose module-level
`import transformer_engine.pytorch as te` is its only hard need of Transformer Engine for training
imports. This loads that one module from its real source with that single import replaced by an
inert placeholder. It never puts a fake `transformer_engine` into sys.modules: Megatron-Core would
then believe TE is present and take TE code paths.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

LORA_MODULE = "megatron.bridge.peft.lora_layers"
TE_IMPORT = "import transformer_engine.pytorch as te\n"


class _Inert(types.ModuleType):
    """Answers any attribute with a placeholder class (te.* appears in annotations and base lists)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        placeholder = type(name, (), {"__module__": "transformer_engine.pytorch (absent)"})
        setattr(self, name, placeholder)
        return placeholder


class _Loader(importlib.abc.Loader):
    def __init__(self, origin: str):
        self.origin = origin

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        with open(self.origin, encoding="utf-8") as f:
            source = f.read()
        if TE_IMPORT in source:
            source = source.replace(TE_IMPORT, "te = __bridge_fgo_inert_te__\n", 1)
            module.__dict__["__bridge_fgo_inert_te__"] = _Inert("transformer_engine.pytorch")
        exec(compile(source, self.origin, "exec"), module.__dict__)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != LORA_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.origin is None:
            return None
        return importlib.util.spec_from_file_location(name, spec.origin, loader=_Loader(spec.origin))


def needed() -> bool:
    try:
        return importlib.util.find_spec("transformer_engine") is None
    except (ImportError, ValueError):
        return True


def install() -> bool:
    """Install the finder when Transformer Engine is absent; True if it is (now) installed."""
    if not needed():
        return False
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    return True
