"""Import Megatron-Bridge on a GPU box that lacks Transformer Engine, megatron-energon and PuLP.

Transformer Engine: tests/support/te_free.py (the unguarded TE import of the Bridge modules that have one neutralised).
megatron.energon and pulp are imported at module level by code pretraining never runs (energon data
modules; modelopt's architecture search): an inert placeholder module stands in, only when absent.
"""
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

import os

# the TE-free import lives with the tests, outside the installed package
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests"))
from support import te_free


class _Placeholder(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (), {"__module__": self.__name__})
        setattr(self, name, value)
        return value


class _Loader(importlib.abc.Loader):
    def create_module(self, spec):
        m = _Placeholder(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        pass


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, prefixes):
        self.prefixes = tuple(prefixes)

    def find_spec(self, name, path, target=None):
        if any(name == p or name.startswith(p + ".") for p in self.prefixes):
            return importlib.machinery.ModuleSpec(name, _Loader(), is_package=True)
        return None


def _absent(name):
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):
        return True


def install():
    te_free.install()
    absent = [m for m in ("megatron.energon", "pulp") if _absent(m)]
    if absent:
        sys.meta_path.insert(0, _Finder(absent))
    return absent
