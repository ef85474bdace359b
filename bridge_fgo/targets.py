"""Finding what the patch wraps in Megatron-Bridge, and recognising Bridge's layout.

Nothing here imports torch or Megatron: callers hand in modules that are already imported.
"""
from __future__ import annotations

import dataclasses
import inspect
import sys
import types
from typing import Dict, Iterator, List, Optional, Tuple

TRAIN_MODULE = "megatron.bridge.training.train"
PRETRAIN_MODULE = "megatron.bridge.training.pretrain"
TRAIN = "train"
TRAIN_STEP = "train_step"
COPY_HELPER = "_handle_mxfp8_param_buffer_copy"

# The arguments the wrappers read, by name (positions drift between Bridge versions).
NEEDED_PARAMS = {TRAIN: ("model", "optimizer", "global_state"), TRAIN_STEP: ("model", "optimizer", "global_state")}

# Names whose presence in Bridge's loop means Bridge (or a fork) already wires offload itself.
NATIVE_WIRING_NAMES = frozenset(
    {
        "offload_states",
        "release_offloaded_gpu_states",
        "reload_offloaded_states",
        "offload_optimizer_state_for_forward",
        "prefetch_optimizer_state_for_gradient_finalization",
        "synchronize_optimizer_state_for_checkpoint",
    }
)


def code_names(func) -> frozenset:
    """Every global/attribute name the function's code (nested code included) refers to.
    Unwraps decorators first: Bridge's train_step sits under nvtx_decorator's functools.wraps."""
    try:
        code = inspect.unwrap(func).__code__
    except (AttributeError, ValueError):
        return frozenset()
    names, stack = set(), [code]
    while stack:
        c = stack.pop()
        names.update(c.co_names)
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    return frozenset(names)


@dataclasses.dataclass
class Layout:
    """What was found in Bridge's train module."""

    found: Dict[str, bool]
    problems: List[str]
    native_wiring: List[str]
    param_index: Dict[str, Dict[str, int]]

    @property
    def recognised(self) -> bool:
        return not self.problems


def _param_index(func, needed) -> Tuple[Dict[str, int], List[str]]:
    try:
        params = list(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        return {}, list(needed)
    return {n: params.index(n) for n in needed if n in params}, [n for n in needed if n not in params]


def inspect_layout(module: types.ModuleType) -> Layout:
    """Check every target the patch needs, so it can patch all of them or none."""
    ns = vars(module)
    found, problems, index = {}, [], {}
    for name in (TRAIN, TRAIN_STEP, COPY_HELPER):
        ok = callable(ns.get(name))
        found[name] = ok
        if not ok:
            problems.append(f"{TRAIN_MODULE}.{name} is missing")
    if found[TRAIN_STEP]:
        names = code_names(ns[TRAIN_STEP])
        if found[COPY_HELPER] and COPY_HELPER not in names:
            problems.append(f"{TRAIN_STEP} no longer calls {COPY_HELPER} (the release site)")
        if "forward_backward_func" not in inspect.signature(ns[TRAIN_STEP]).parameters:
            problems.append(f"{TRAIN_STEP} takes no forward_backward_func argument")
    for name in (TRAIN, TRAIN_STEP):
        if found[name]:
            index[name], missing = _param_index(ns[name], NEEDED_PARAMS[name])
            if missing:
                problems.append(f"{name}() has no parameter(s) {', '.join(missing)}")
    if found[TRAIN] and TRAIN_STEP not in code_names(ns[TRAIN]):
        problems.append(f"{TRAIN}() no longer calls {TRAIN_STEP}")
    native = sorted(
        n for name in (TRAIN, TRAIN_STEP) if found[name] for n in code_names(ns[name]) & NATIVE_WIRING_NAMES
    )
    return Layout(found=found, problems=problems, native_wiring=native, param_index=index)


def argument(index: Dict[str, int], name: str, args: tuple, kwargs: dict):
    """The value a call passed for parameter `name`, by keyword or by position."""
    if name in kwargs:
        return kwargs[name]
    i = index.get(name)
    if i is not None and i < len(args):
        return args[i]
    return None


def holders(obj) -> Iterator[Tuple[types.ModuleType, str]]:
    """(module, name) for every loaded module that binds `obj` at top level, e.g. pretrain's
    `from megatron.bridge.training.train import train`. Reads module dicts only: getattr on lazy
    modules (transformers') imports submodules."""
    for mod in list(sys.modules.values()):
        try:
            ns = vars(mod)
        except TypeError:
            continue
        for key, value in list(ns.items()):
            if value is obj:
                yield mod, key


def module_if_loaded(name: str) -> Optional[types.ModuleType]:
    return sys.modules.get(name)
