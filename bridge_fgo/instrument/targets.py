"""What the patch wraps in Megatron-Bridge, declared once (TARGETS), and recognising Bridge's layout.

Patching (patcher.py), the layout check (inspect_layout), `bridge-fgo status` and the tests all
read TARGETS. Nothing here imports torch or Megatron: callers hand in modules already imported.
"""
from __future__ import annotations

import bisect
import dataclasses
import inspect
import itertools
import operator
import sys
import types
from typing import Dict, Iterator, List, Mapping, Optional, Tuple

from ..codenames import code_names
from .generations import native_wiring_names

# Roles: which call site wraps a target (callsites.CallSites.site). A new role is a new method there.
LOOP = "loop"  # the training loop: decides per optimizer, states resident at its end, summary
STEP = "step"  # one training step: decides, makes the Session current while it runs
RELEASE_SITE = "release-site"  # offload before it, release after it
BUILD = "build"  # Megatron-Core makes the fp32 masters: made on the host, a batch at a time
BUILD_WHOLE = "build-whole"  # Megatron-Core makes Muon's whole fp32 masters: each moved to the host once made
LOAD = "load"  # a checkpoint load: the states placed on the host before it, so it writes there
PARAMS_NORM = "params-norm"  # the parameter norm train() logs: host-bound masters read as their norms
QK_CLIP = "qk-clip"  # clip_qk after optimizer.step(): served inside the streamed update
SAVE = "save"  # a checkpoint save: an asynchronous one is watched for writers holding the host buffer
ADOPT = "adopt"  # a DistributedOptimizer built: masters made on the host wait for a session, guarded
FSDP_BUILD = "fsdp-build"  # Megatron-FSDP builds its buffers: its main-weight buffers made on the host
# Where Bridge (or a fork) would call offload methods if it wired offload itself.
WIRING_ROLES = (LOOP, STEP)


@dataclasses.dataclass(frozen=True)
class Target:
    name: str  # the function's name in `module`; unique in TARGETS (status and problems key on it)
    module: str
    role: str
    purpose: str
    params: Tuple[str, ...] = ()  # parameters it must take (the wrappers read them by name)
    calls: Tuple[str, ...] = ()  # names its code must refer to: how the loop reaches the next site
    owner: Optional[str] = None  # a class of `module` holding the target (a method), or None: module level
    attr: Optional[str] = None  # the attribute bound in the holder, where it is not `name` (two classes' __init__)
    # a module that may be absent (Megatron-Core imports Megatron-FSDP's inside a try): then nothing to serve, no
    # problem, and the patch does not wait for it; present, the target is checked like any other
    optional: bool = False

    @property
    def attribute(self) -> str:
        return self.attr or self.name

    @property
    def qualname(self) -> str:
        return ".".join(x for x in (self.module, self.owner, self.attribute) if x)

    def holder(self, module):
        """Where the target is bound: the module, or its class `owner` (None if missing)."""
        return getattr(module, self.owner, None) if self.owner else module

    def raw(self, module):
        """The object bound there as stored (a classmethod object for a classmethod), or None."""
        holder = self.holder(module)
        return vars(holder).get(self.attribute) if holder is not None else None

    def func(self, module):
        """The target as callers reach it (a method bound to its class), or None."""
        holder = self.holder(module)
        if holder is None:
            return None
        return getattr(holder, self.attribute, None) if self.owner else vars(holder).get(self.attribute)


TRAIN_MODULE = "megatron.bridge.training.train"
CHECKPOINT_MODULE = "megatron.bridge.training.checkpointing"
DIST_OPTIMIZER_MODULE = "megatron.core.optimizer.distrib_optimizer"  # imported with Bridge's train module
OPTIMIZER_MODULE = "megatron.core.optimizer.optimizer"  # imported by the one above
# imported with megatron.core.distributed (by the two above), inside a try: absent where it cannot be imported
FSDP_BUFFER_MODULE = "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer"
TARGETS: Tuple[Target, ...] = (
    Target("train", TRAIN_MODULE, LOOP, "the training loop: states resident when it ends, the run's summary",
           params=("model", "optimizer", "global_state"), calls=("train_step",)),
    Target("train_step", TRAIN_MODULE, STEP, "one step: offload decided per optimizer, finalize wrapper installed",
           params=("model", "optimizer", "global_state", "forward_backward_func"),
           calls=("_handle_mxfp8_param_buffer_copy",)),
    Target("_handle_mxfp8_param_buffer_copy", TRAIN_MODULE, RELEASE_SITE,
           "the param-buffer copy helper: offload before it, release after it (it reads the masters)"),
    Target("load_checkpoint", CHECKPOINT_MODULE, LOAD,
           "a checkpoint load in setup: the engine takes the states onto the host first, so the load writes there",
           params=("state", "optimizer")),
    Target("calc_params_l2_norm", TRAIN_MODULE, PARAMS_NORM,
           "the parameter norm train() logs (log_params_norm): each master on the host read as its norm, taken in "
           "the update", params=("model",)),
    Target("clip_qk", TRAIN_MODULE, QK_CLIP,
           "clip_qk after optimizer.step() (qk_clip): deferred at gradient finalization, each layer clipped in the "
           "update's pass over its master", params=("model",)),
    Target("save_checkpoint", CHECKPOINT_MODULE, SAVE,
           "a checkpoint save: an asynchronous one must leave no writer reading the host buffer the next step rewrites",
           params=("state",)),
    Target("_build_model_and_main_param_groups", DIST_OPTIMIZER_MODULE, BUILD,
           "Megatron-Core's construction of the fp32 masters: run a batch of parameters at a time, masters to the host",
           params=("gbuf_ranges", "param_gbuf_map", "opt_group_ranges", "config"), owner="DistributedOptimizer"),
    Target("__init__", OPTIMIZER_MODULE, BUILD_WHOLE,
           "Megatron-Core's construction of whole fp32 masters (Muon's): each moved to the host as soon as it is made",
           params=("optimizer", "config", "grad_scaler", "init_state_fn"), calls=("copy_tensor_model_parallel_attributes",),
           owner="Float16OptimizerWithFloat16Params"),
    Target("DistributedOptimizer.__init__", DIST_OPTIMIZER_MODULE, ADOPT,
           "Megatron-Core's DistributedOptimizer built: masters made on the host go back to the GPU before anything "
           "reads them unless a session adopts them first", params=("optimizer", "config"),
           calls=("_build_model_and_main_param_groups",), owner="DistributedOptimizer", attr="__init__"),
    Target("ParamAndGradBuffer.__init__", FSDP_BUFFER_MODULE, FSDP_BUILD,
           "Megatron-FSDP builds its buffers: each main-weight buffer (the fp32 masters) made in host memory, one "
           "group's on the GPU at most", params=("ddp_config", "module"),
           calls=("_init_each_parameter_group_buffers", "_init_distributed_params",
                  "_init_optimizer_named_parameters"),
           owner="ParamAndGradBuffer", attr="__init__", optional=True),
)
# the modules the patch waits for (all imported: it applies), and those it takes where they were imported
MODULES: Tuple[str, ...] = tuple(dict.fromkeys(t.module for t in TARGETS if not t.optional))
OPTIONAL_MODULES: Tuple[str, ...] = tuple(dict.fromkeys(t.module for t in TARGETS if t.optional
                                                        and t.module not in MODULES))


def loaded(modules: Mapping[str, types.ModuleType]) -> Dict[str, Optional[types.ModuleType]]:
    """`modules` (each in MODULES) with each of OPTIONAL_MODULES as imported by now, or None."""
    return {**modules, **{name: sys.modules.get(name) for name in OPTIONAL_MODULES if name not in modules}}


@dataclasses.dataclass(frozen=True)
class Alias:
    """A name another Bridge module binds to a target; runs through it must reach the wrapper."""

    module: str
    name: str
    target: str  # the Target's name
    callers: str  # who starts training through the alias, in words

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.name}"


ALIASES: Tuple[Alias, ...] = (
    Alias("megatron.bridge.training.pretrain", "train", "train", "runs started through pretrain() (Bridge's recipes)"),
)


def target(name: str) -> Target:
    return next(t for t in TARGETS if t.name == name)


@dataclasses.dataclass(frozen=True)
class Problem:
    """Something that stops the patch; `target` names the target it is about (None: none)."""

    text: str
    target: Optional[str] = None

    def __str__(self) -> str:
        return self.text


@dataclasses.dataclass
class Layout:
    """What was found in Bridge's target modules."""

    found: Dict[str, bool]
    problems: List[Problem]
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


def inspect_layout(modules: Mapping[str, types.ModuleType]) -> Layout:
    """Check every target the patch needs, so it can patch all of them or none.
    `modules`: each module in MODULES by name."""
    modules = loaded(modules)
    funcs = {t.name: t.func(modules[t.module]) if modules.get(t.module) is not None else None for t in TARGETS}
    found = {name: callable(f) for name, f in funcs.items()}
    problems = [Problem(f"{t.qualname} is missing", t.name) for t in TARGETS
                if not found[t.name] and not (t.optional and modules.get(t.module) is None)]
    index = {}
    for t in TARGETS:
        if not found[t.name]:
            continue
        index[t.name], missing = _param_index(funcs[t.name], t.params)
        if missing:
            problems.append(Problem(f"{t.name}() has no parameter(s) {', '.join(missing)}", t.name))
        names = code_names(funcs[t.name])
        for callee in t.calls:
            if found.get(callee, True) and callee not in names:  # a missing callee is its own problem
                problems.append(Problem(f"{t.name}() no longer calls {callee}", t.name))
    wiring = native_wiring_names()
    native = sorted({n for t in TARGETS if t.role in WIRING_ROLES and found[t.name]
                     for n in code_names(funcs[t.name]) & wiring})
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
    return iter(holders_of([obj])[0])


def holders_of(objs) -> List[List[Tuple[types.ModuleType, str]]]:
    """holders(obj) for each of `objs`, from one pass over the loaded modules: thousands where Megatron
    is imported, read at every patch() and unpatch(). Every module's values are laid end to end; for
    each type among `objs`, the values of exactly that type are picked out (a value that is obj has
    obj's type) and compared with each of `objs` of that type by identity, both in C; the modules
    holding one are then read for its names."""
    found: List[List[Tuple[types.ModuleType, str]]] = [[] for _ in objs]
    modules, values, ends = [], [], []
    for mod in list(sys.modules.values()):
        try:
            ns = vars(mod)
        except TypeError:
            continue
        modules.append(mod)
        values.extend(list(ns.values()))
        ends.append(len(values))
    for kind in {type(obj) for obj in objs}:
        at = list(itertools.compress(range(len(values)), map(operator.is_, map(type, values), itertools.repeat(kind))))
        of_kind = list(map(values.__getitem__, at))
        for i, obj in enumerate(objs):
            if type(obj) is not kind:
                continue
            hits = itertools.compress(at, map(operator.is_, of_kind, itertools.repeat(obj)))
            for m in dict.fromkeys(bisect.bisect_right(ends, j) for j in hits):  # each module once, in order
                found[i].extend((modules[m], key) for key, value in list(vars(modules[m]).items()) if value is obj)
    return found
