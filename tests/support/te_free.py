"""Import Megatron-Bridge where Transformer Engine is not installed.

Bridge's package __init__ reaches modules whose unguarded, module-level
`import transformer_engine.pytorch as te` is their only hard need of Transformer Engine for training
imports: megatron/bridge/peft/lora_layers.py (every release), and peft/lora.py too in 0.3.x. This
loads each such module from its real source with that single line replaced by an inert placeholder.
Which modules is read from their source (a column-0 import, not one inside a try: guard), not from a
list per release. It never puts a fake `transformer_engine` into sys.modules: Megatron-Core would
then believe TE is present and take TE code paths.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import re
import sys
import types

PACKAGE = "megatron.bridge."
# Only an unguarded module-level import: an indented one sits in a try/except that already copes.
TE_IMPORT = re.compile(r"^import transformer_engine\.pytorch as te$", re.MULTILINE)


class _Inert(types.ModuleType):
    """Answers any attribute with a placeholder class (te.* appears in annotations and base lists)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        placeholder = type(name, (), {"__module__": "transformer_engine.pytorch (absent)"})
        setattr(self, name, placeholder)
        return placeholder


class _Loader(importlib.abc.Loader):
    def __init__(self, origin: str, source: str):
        self.origin = origin
        self.source = source

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        source = TE_IMPORT.sub("te = __bridge_fgo_inert_te__", self.source, count=1)
        module.__dict__["__bridge_fgo_inert_te__"] = _Inert("transformer_engine.pytorch")
        exec(compile(source, self.origin, "exec"), module.__dict__)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if not name.startswith(PACKAGE):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.origin is None or not spec.origin.endswith(".py") \
                or spec.submodule_search_locations is not None:  # packages load as usual
            return None
        with open(spec.origin, encoding="utf-8") as f:
            source = f.read()
        if not TE_IMPORT.search(source):
            return None
        return importlib.util.spec_from_file_location(name, spec.origin, loader=_Loader(spec.origin, source))


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
