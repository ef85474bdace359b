"""The update of part of the parameters: the inner optimizer's own step() over a subset, and
Megatron-Core's own master -> model copy over the same subset.

Group-level state. Transformer Engine's and apex's FusedAdam keep the step count in the param group
and advance it once per step() per non-empty group (a device tensor, in place, when capturable). So
every pass over a subset gets every param group at its original index (apex pairs param_groups with
param_groups_master by position; both optimizers skip empty groups untouched), each with copies of the
group's values as they were before the step; what the passes changed is written back once, after
the last pass, exactly as one step() over everything would have left it.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Dict, List

from ..errors import BridgeFGOError
from . import quantized
from .tensors import kind_of
from .uninterrupted import each

_MISSING = object()


def _clone(value):
    import torch

    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return value


def _equal(a, b) -> bool:
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        # compared without reading device values (no synchronisation): what a pass over any
        # subset makes of a tensor field must at least have the same shape, dtype and device
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and a.device == b.device)
    return type(a) is type(b) and a == b


class GroupState:
    """One optimizer step's group-level values: taken before the first pass, written back once."""

    def __init__(self, inner):
        self.inner = inner
        self.before = [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]
        self.after: Dict[int, dict] = {}

    def groups(self, params_by_group: Dict[int, list]) -> List[dict]:
        return [dict(_clone(values), params=list(params_by_group.get(gi, ())))
                for gi, values in enumerate(self.before)]

    def record(self, groups: List[dict]) -> None:
        for gi, g in enumerate(groups):
            if not g["params"]:
                continue
            values = {k: v for k, v in g.items() if k != "params"}
            seen = self.after.setdefault(gi, values)
            if seen is not values and (seen.keys() != values.keys()
                                       or not all(_equal(seen[k], values[k]) for k in seen)):
                # a contract says its group fields do not depend on the subset (contracts.py)
                raise BridgeFGOError(f"internal: {type(self.inner).__name__}'s param group {gi} changed "
                                     "differently for different subsets of its parameters")

    def commit(self) -> None:
        """Write the step's group values back, keeping each tensor object (captured graphs hold it)."""
        import torch

        for gi, values in self.after.items():
            group = self.inner.param_groups[gi]
            for k, v in values.items():
                old = group.get(k, _MISSING)
                if isinstance(old, torch.Tensor) and isinstance(v, torch.Tensor) and old.shape == v.shape:
                    old.copy_(v)
                elif old is not v:
                    group[k] = v
        self.after = {}


_HOOK_CODE = None


def has_step_hooks(inner) -> bool:
    """Whether torch's step hooks will see this optimizer's step: its own or global, pre or post."""
    from torch.optim import optimizer as torch_optimizer

    return bool(getattr(inner, "_optimizer_step_pre_hooks", None) or getattr(inner, "_optimizer_step_post_hooks", None)
                or getattr(torch_optimizer, "_global_optimizer_pre_hooks", None)
                or getattr(torch_optimizer, "_global_optimizer_post_hooks", None))


def _torch_hooked(step) -> bool:
    """Whether `step` is torch's wrapper (Optimizer.profile_hook_step, put on every optimizer class by
    Optimizer._patch_step_function): it fires the step hooks and the profiler's step marker, then calls
    the class's own step, its __wrapped__. Recognised by its code, so a wrapper copying its attributes
    (functools.wraps copies `hooked`) is not taken for it."""
    global _HOOK_CODE
    if _HOOK_CODE is None:
        import torch

        _HOOK_CODE = torch.optim.Optimizer.profile_hook_step(lambda *a, **k: None).__code__
    return getattr(step, "__code__", None) is _HOOK_CODE and callable(getattr(step, "__wrapped__", None))


def hooked_once(inner, body, *args, **kwargs):
    """`body(inner, *args, **kwargs)`, the passes of one streamed step, inside torch's step wrapper: the
    global and per-instance step pre/post hooks and the profiler's marker fire once for the whole step,
    as for one step() over everything (each pass runs the class's step without them: step_subset)."""
    if not _torch_hooked(type(inner).step):
        return body(inner, *args, **kwargs)
    return type(inner).profile_hook_step(body)(inner, *args, **kwargs)


def step_subset(inner, state: GroupState, params_by_group: Dict[int, list]) -> None:
    """The inner optimizer's own step() over these parameters only: the class's step itself, without
    torch's hook wrapper, which hooked_once runs once around all the passes."""
    step = type(inner).step
    if _torch_hooked(step):
        step = step.__wrapped__
    groups = state.groups(params_by_group)
    with narrowed(inner, groups):
        step(inner)
    state.record(groups)


@contextlib.contextmanager
def narrowed(inner, groups: List[dict]):
    """The inner optimizer with these param groups in place of its own, for the body."""
    saved = inner.param_groups
    inner.param_groups = groups
    try:
        yield
    finally:
        inner.param_groups = saved


class Shadows:
    """Instance attributes set for a while and then put back exactly as they were (set or absent).
    The objects are held weakly: one that is gone has nothing to put back."""

    def __init__(self):
        self._saved: List[tuple] = []

    def set(self, obj, name: str, value) -> None:
        self._saved.append((weakref.ref(obj), name, obj.__dict__.get(name, _MISSING)))
        setattr(obj, name, value)

    def restore(self) -> None:
        """Newest first; finished whatever is raised meanwhile (uninterrupted.each)."""
        saved, self._saved = self._saved[::-1], []
        each(saved, _put_back)

    def __bool__(self) -> bool:
        return bool(self._saved)


def _put_back(saved) -> None:
    ref, name, prior = saved
    obj = ref()
    if obj is None:
        return
    if prior is _MISSING:
        obj.__dict__.pop(name, None)
    else:
        setattr(obj, name, prior)


@contextlib.contextmanager
def shadowed(obj, **attrs):
    shadows = Shadows()
    try:
        for name, value in attrs.items():
            shadows.set(obj, name, value)
        yield
    finally:
        shadows.restore()


def copy_masters(opt, masters, model_of, kept=None) -> None:
    """Megatron-Core's own _copy_main_params_to_model_params, narrowed to these masters, so the
    model parameters read whole, updated masters while they are on the GPU. Quantized parameters
    (quantized.py) are only kept in `kept` here: their one cast is copy_rest's."""
    kind = kind_of(opt)
    n_groups = len(getattr(opt, kind.models))
    mains, models = [[] for _ in range(n_groups)], [[] for _ in range(n_groups)]
    for m in masters:
        gi, model_param = model_of[id(m)]
        if kept is not None and quantized.is_quantized(opt, model_param):
            kept.keep(m, model_param)
            continue
        mains[gi].append(m)
        models[gi].append(model_param)
    extra = {} if kept is None else quantized.without_quantization(opt)
    with shadowed(opt, **{kind.masters: mains, kind.models: models}, **{name: [] for name in kind.fp32}, **extra):
        type(opt)._copy_main_params_to_model_params(opt)


def copy_rest(opt, copied_masters: bool, *args, kept=None, **kwargs):
    """Megatron-Core's call after the inner step: masters of bf16/fp16 parameters were copied subset
    by subset while on the GPU; the fp32 parameters (their own masters) are copied here, and the
    quantized parameters cast from their kept copies, all quantized parameters in one call."""
    copy = type(opt)._copy_main_params_to_model_params
    if not copied_masters:
        return copy(opt, *args, **kwargs)
    mains, models = kept.groups(opt) if kept is not None else ([], [])
    kind = kind_of(opt)
    try:
        with shadowed(opt, **{kind.masters: mains, kind.models: models}):
            return copy(opt, *args, **kwargs)
    finally:
        if kept is not None:
            kept.clear()
