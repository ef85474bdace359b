"""What a function's code refers to, read without running it: how bridge_fgo recognises Bridge's
loop (instrument/targets.py) and which weights an attention's clip_qk rewrites (engine/streamed/qkclip.py).
"""
from __future__ import annotations

import inspect
import types


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
