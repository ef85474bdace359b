"""Import Megatron-Bridge on a GPU box that lacks Transformer Engine, megatron-energon and PuLP, and
choose the optimizer stack Megatron-Core sees.

Optimizer stack: Megatron-Core 0.19.2 builds Transformer Engine's FusedAdam when `transformer_engine`
imports, else apex's FusedAdam when `apex` imports, else torch AdamW
(megatron/core/optimizer/__init__.py). `install(hide=...)` puts a meta-path blocker first on
sys.meta_path, before anything imports Megatron, so the named packages fail to import as if absent
(ModuleNotFoundError, also from importlib.util.find_spec) even where they are installed:
`stack_hides("torch")` hides both Transformer Engine and apex, `stack_hides("apex")` hides Transformer
Engine, `stack_hides("te")` hides apex (the model then differs from the torch stack's in nothing but
the optimizer). Nothing fake is put into sys.modules.

Transformer Engine: when it is absent (or hidden), tests/support/te_free.py neutralises the unguarded
TE import of the Bridge modules that have one (peft/lora_layers.py); with a real, visible Transformer
Engine Bridge is left alone. megatron.energon and pulp are imported at module level by code
pretraining never runs (energon data modules; modelopt's architecture search): an inert placeholder
module stands in, only when absent.
"""
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types

# the TE-free import lives with the tests, outside the installed package
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests"))
from support import te_free  # noqa: E402

# top-level modules of each package: its Python package and the compiled extensions it ships
TE_MODULES = ("transformer_engine", "transformer_engine_torch")
APEX_MODULES = ("apex", "amp_C", "fused_layer_norm_cuda", "fused_weight_gradient_mlp_cuda", "fused_adam_cuda")
STACK_HIDES = {"torch": TE_MODULES + APEX_MODULES, "apex": TE_MODULES, "te": APEX_MODULES}


def stack_hides(stack):
    """The top-level modules to hide for an optimizer stack ('torch', 'apex' or 'te')."""
    return STACK_HIDES[stack]


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


def _matches(name, prefixes):
    return any(name == p or name.startswith(p + ".") for p in prefixes)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, prefixes):
        self.prefixes = tuple(prefixes)

    def find_spec(self, name, path, target=None):
        if _matches(name, self.prefixes):
            return importlib.machinery.ModuleSpec(name, _Loader(), is_package=True)
        return None


class Blocker(importlib.abc.MetaPathFinder):
    """Makes installed packages look absent: their import raises ModuleNotFoundError."""

    def __init__(self, names):
        self.names = tuple(names)

    def find_spec(self, name, path, target=None):
        if _matches(name, self.names):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by bench_imports for this optimizer stack)",
                                      name=name)
        return None


def _absent(name):
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):
        return True


def present(name):
    """Whether `name` imports here (False where it is hidden)."""
    return not _absent(name)


def install(hide=()):
    """Hide the `hide` packages, then make Bridge importable. Returns the placeholder modules installed.
    Must run before Megatron is imported: a module already imported stays visible."""
    already = [n for n in hide if any(_matches(m, (n,)) for m in sys.modules)]
    if already:
        raise RuntimeError(f"cannot hide {already}: already imported")
    if hide and not any(isinstance(f, Blocker) and f.names == tuple(hide) for f in sys.meta_path):
        sys.meta_path.insert(0, Blocker(hide))
    te_free.install()  # only where Transformer Engine does not import (absent or hidden)
    absent = [m for m in ("megatron.energon", "pulp") if _absent(m)]
    if absent:
        sys.meta_path.insert(0, _Finder(absent))
    return absent
