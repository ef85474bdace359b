"""Resuming a distributed-optimizer checkpoint with torch AdamW (no Transformer Engine, no apex).

Not part of bridge_fgo: a Megatron-Core defect that exists with or without offload, fixed here so
that resume can be checked (scripts/check_checkpoint.py --resume) and shown to users who train
without TE. Call install() before pretrain(); with TE or apex installed it does nothing.

Without TE or apex (`distrib_optimizer.HAVE_APEX_OR_TE` False), Megatron-Core keeps AdamW's step in
the inner torch optimizer's per-parameter state (megatron-core 0.16.1 to 0.19.2; Megatron-LM dev
d48bd6be and main d98e8a64 unchanged). Loading a checkpoint then goes wrong three times:

1. A load happens before the first step, when that state is still empty:
   `DistributedOptimizer.sharded_state_dict(is_loading=True)` calls `state_dict()`, which finds no
   step and fails `assert len(steps) == 1`. No checkpoint with optimizer state can be loaded.
2. `DistributedOptimizer.load_state_dict` gives every parameter the same step tensor. torch's AdamW
   increments each parameter's step in place, so after a resume that one tensor grows by the number
   of parameters each step and the bias correction is no longer the uninterrupted run's.
3. In the `dp_reshardable` format (Bridge's default), `load_state_dict` then copies the parameter
   state in, step included. The step is not in the checkpoint (a LocalNonpersistentObject), so what
   lands over the checkpoint's step is the step the optimizer held when the load was prepared.

4. The `fully_reshardable` and `dp_zero_gather_scatter` formats carry no per-parameter step, yet
   `_set_main_param_and_optimizer_states` looks up every tensor state the optimizer holds in what was
   loaded, step included: `KeyError: 'step'`. No such checkpoint can be loaded.

install() wraps the three methods on the class: before a load into an empty optimizer it creates the
state the optimizer's own `init_state_fn` creates plus a step of 0 (the load overwrites the tensors
from the checkpoint); while a parameter's state is set from a checkpoint without steps, its step is
set aside; after `load_state_dict`, every parameter gets its own step tensor holding the step saved in
the checkpoint's param groups.
"""
import functools
import inspect


def install(restore_step=True):
    """Patch megatron.core's DistributedOptimizer (idempotent). restore_step=False fixes only the
    assertion, to show what Megatron-Core's own step handling does to a resumed run."""
    from megatron.core.optimizer import distrib_optimizer as m

    cls = m.DistributedOptimizer
    if m.HAVE_APEX_OR_TE or getattr(cls, "_resume_fix", None) is not None:
        return
    sharded, load, setter = cls.sharded_state_dict, cls.load_state_dict, cls._set_main_param_and_optimizer_states
    is_loading_of = _argument_reader(sharded, "is_loading")
    state_dict_of = _argument_reader(load, "state_dict")

    @functools.wraps(sharded)
    def sharded_state_dict(self, *args, **kwargs):
        if is_loading_of(self, *args, **kwargs):
            prime(self)
        return sharded(self, *args, **kwargs)

    @functools.wraps(load)
    def load_state_dict(self, *args, **kwargs):
        step = saved_step(state_dict_of(self, *args, **kwargs))
        out = load(self, *args, **kwargs)
        if restore_step and step is not None:
            set_step(self, step)
        return out

    @functools.wraps(setter)
    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if "step" in tensors:
            return setter(self, model_param, tensors)
        state = main_state(self, model_param)
        step = state.pop("step", None)  # restored below, then set from the checkpoint by load_state_dict
        try:
            return setter(self, model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step

    cls.sharded_state_dict, cls.load_state_dict = sharded_state_dict, load_state_dict
    cls._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states
    cls._resume_fix = (sharded, load, setter)


def prime(dist_opt):
    """Give an optimizer that never stepped the state a step would have created, with step 0."""
    import torch

    inner = dist_opt.optimizer
    if len(inner.state):
        return
    dist_opt.init_state_fn(inner, dist_opt.config)
    for group in inner.param_groups:
        for p in group["params"]:
            inner.state[p]["step"] = torch.tensor(0.0)


def main_state(dist_opt, model_param):
    """The inner optimizer's state of the master of `model_param` (Megatron-Core's own lookup)."""
    group_index, group_order = dist_opt.model_param_group_index_map[model_param]
    return dist_opt.optimizer.state[dist_opt.optimizer.param_groups[group_index]["params"][group_order]]


def saved_step(state_dict):
    """The step DistributedOptimizer.state_dict() writes into every param group (None if absent)."""
    groups = (state_dict.get("optimizer") or {}).get("param_groups", []) if isinstance(state_dict, dict) else []
    steps = {float(g["step"]) for g in groups if "step" in g}
    return steps.pop() if len(steps) == 1 else None


def set_step(dist_opt, step):
    """One step tensor per parameter, as torch's AdamW keeps it, each holding `step`."""
    import torch

    for state in dist_opt.optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = torch.full_like(state["step"], step)


def _argument_reader(func, name):
    signature = inspect.signature(func)

    def read(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return bound.arguments[name]

    return read


def uninstall():
    from megatron.core.optimizer import distrib_optimizer as m

    cls = m.DistributedOptimizer
    saved = cls.__dict__.get("_resume_fix")
    if saved is not None:
        cls.sharded_state_dict, cls.load_state_dict, cls._set_main_param_and_optimizer_states = saved
        del cls._resume_fix
