"""The inner optimizers Megatron-Core builds, and what each does to an engine that moves its states.

Megatron-Core (megatron/core/optimizer/__init__.py) builds Transformer Engine's FusedAdam when TE
imports, else apex's FusedAdam, else torch's AdamW (or Adam without decoupled weight decay); for
'muon', emerging-optimizers' Muon on the matrices (Lion or Adam on the rest). One
Contract per class says, from the optimizer's own code:
- which tensor states a parameter has once it has stepped, with their real dtypes and shapes, so the
  host buffer is laid out before step 1 (TE and apex create them inside step());
- which scale tensors travel with a state (TE keeps one per non-fp32 state in `_scales[p][name]`);
- whether the step count lives in the param group (`group["step"] += 1` once per step() per group:
  TE and apex) or per parameter (torch);
- what the streamed step cannot reproduce exactly for this instance (refused before the first step).

Classes are recognised by their import path, exactly: a subclass may change any of this. An unknown
class still runs with the one-window engine (chunk_mb=0), which moves whatever states exist and
never splits step().

Read from: torch 2.13 torch/optim/adamw.py and adam.py; Transformer Engine 2.x
transformer_engine/pytorch/optimizers/fused_adam.py (TE 2.20 main, commit 04912bf0); apex
apex/optimizers/fused_adam.py (main 6424da3b, 2026-07: empty param groups skipped since #1596,
param_groups_master paired by position since #1625); emerging-optimizers 0.3.0
orthogonalized_optimizers/ and scalar_optimizers/lion.py with megatron-core 0.19.2
optimizer/emerging_optimizers.py (Muon and Lion).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

TORCH_ADAMW = "torch.optim.adamw.AdamW"
TORCH_ADAM = "torch.optim.adam.Adam"
TE_FUSED_ADAM = "transformer_engine.pytorch.optimizers.fused_adam.FusedAdam"
APEX_FUSED_ADAM = "apex.optimizers.fused_adam.FusedAdam"
# emerging-optimizers' Muon as megatron-core subclasses it for 'muon' (the matrices: 0.18 and later in
# emerging_optimizers.py, 0.16 and 0.17 in muon.py), and emerging-optimizers' Lion for
# muon_scalar_optimizer='lion' (the rest)
MCORE_MUON = "megatron.core.optimizer.emerging_optimizers.TensorParallelMuon"
MCORE_MUON_0_17 = "megatron.core.optimizer.muon.TensorParallelMuon"
EO_MUON = "emerging_optimizers.orthogonalized_optimizers.muon.Muon"
EO_LION = "emerging_optimizers.scalar_optimizers.lion.Lion"
MUONS = (MCORE_MUON, MCORE_MUON_0_17, EO_MUON)


def path_of(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def class_path(obj) -> str:
    return path_of(type(obj))


@dataclasses.dataclass(frozen=True)
class StateSpec:
    """One tensor state a parameter will have: its key, dtype and shape (the parameter's)."""

    key: str
    dtype: object
    scaled: bool = False  # a [1]-shaped fp32 scale lives in optimizer._scales[p][key] (TE)


class Contract:
    name = ""  # how messages name the optimizer
    group_step = False  # step count in the param group, advanced once per step() per group
    # What step() allocates beyond its states, per byte of a chunk's states (sizing.py): the fused
    # optimizers update in place
    step_scratch = 0.0
    # step() may meet its peers in a collective per parameter (Muon's Newton-Schulz over the tensor- and
    # expert-tensor-parallel groups, muon_tp_mode 'duplicated' or 'distributed'): the streamed step's passes
    # then step the parameters in the optimizer's order on every rank, whatever each keeps resident under
    # gpu_budget_gib by its own memory (plan.Part.passes)
    in_order = False
    # step() makes the states of a parameter it then skips for having no gradient (TE 2.x: before the check), so a
    # parameter with no elements on this rank under Megatron-FSDP has (empty) states like every other rank's
    states_without_grad = False

    def states(self, inner, p, group) -> List[StateSpec]:
        raise NotImplementedError

    def streamed_problems(self, inner) -> List[str]:
        return []

    def create(self, inner, p, group, device) -> None:
        """Create p's states exactly as the optimizer's first step() would (its own code where it has a
        method for it), on p's device; `device` is where its step runs (for states kept there)."""
        raise NotImplementedError

    def made_in(self, inner, view_of, zeroed: bool = False):
        """A context: while it holds, the states the optimizer's own code makes (create(), its checkpoint
        loader) are made in the host views `view_of(param, key)` gives, where one fits, instead of fresh
        memory that is then copied there (`zeroed`: those views read as zero already, and are not zeroed
        again). Nothing changes where the contract has no such hook."""
        import contextlib

        return contextlib.nullcontext()

    def advance_step(self, inner) -> None:
        """What one step() does to a step count kept in the param groups (group_step), nothing else:
        Megatron-Core's dummy step before an fsdp_dtensor load leaves it there for the load to fill."""

    def reload_from_param(self, inner, p) -> None:
        """p's weights were loaded without optimizer state: remake, in place, what the optimizer derives
        from the parameter when it creates its states (nothing, but for TE's master_param)."""

    def scale_of(self, inner, p, key):
        """The scale tensor of state `key` of `p`, or None."""
        return None

    def set_scale(self, inner, p, key, tensor) -> None:
        raise NotImplementedError


class TorchAdam(Contract):
    """torch.optim.AdamW / Adam: per-parameter `step` (a 0-dim tensor that stays put), moments like
    the parameter, max_exp_avg_sq with amsgrad."""

    # foreach: one temporary like the parameters (sqrt of exp_avg_sq), per chunk; a chunk holds at
    # least the two moments of each (the master too, where the parameter is fp16/bf16)
    step_scratch = 0.5

    def __init__(self, name):
        self.name = name

    def states(self, inner, p, group):
        keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group.get("amsgrad") else [])
        return [StateSpec(k, p.dtype) for k in keys]

    def create(self, inner, p, group, device):
        import torch
        from torch.optim.optimizer import _get_scalar_dtype

        # torch/optim/adam.py and adamw.py, _init_group, `if len(state) == 0`
        state = inner.state[p]
        if group.get("capturable") or group.get("fused"):
            state["step"] = torch.zeros((), dtype=_get_scalar_dtype(is_fused=group.get("fused")), device=device)
        else:
            state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())
        for spec in self.states(inner, p, group):
            state[spec.key] = torch.zeros_like(p, memory_format=torch.preserve_format)


class TEFusedAdam(Contract):
    name = "Transformer Engine FusedAdam"
    group_step = True
    states_without_grad = True

    def states(self, inner, p, group):
        import torch

        dtypes = inner.name_to_dtype_map
        out = [StateSpec(k, dtypes[k], dtypes[k] != torch.float32) for k in ("exp_avg", "exp_avg_sq")]
        if inner.master_weights:
            if inner.store_param_remainders and p.dtype == torch.bfloat16:
                out.append(StateSpec("master_param", torch.int16))  # the fp32 master's low 16 bits
            else:
                dtype = dtypes["master_param"]
                out.append(StateSpec("master_param", dtype, dtype != torch.float32))
        return out

    def streamed_problems(self, inner):
        import torch

        fp8 = [k for k in ("exp_avg", "exp_avg_sq") if inner.name_to_dtype_map[k] == torch.uint8]
        if not fp8:
            return []
        return [f"{self.name} keeps {', '.join(fp8)} in FP8 (Float8Tensor, exp_avg_dtype/exp_avg_sq_dtype="
                "torch.uint8): a wrapper tensor whose device is fixed at creation, so it cannot be rebound to "
                "host memory between steps; use bf16 or fp32 moments, or chunk_mb=0"]

    def advance_step(self, inner):
        import torch

        # TE 2.20 step(): every group, empty ones too (a tensor in place when capturable)
        for group in inner.param_groups:
            if "step" in group:
                group["step"] += 1
            else:
                device = group["params"][0].device if group["params"] else inner._dummy_overflow_buf.device
                group["step"] = torch.tensor([1], dtype=torch.int, device=device) if inner.capturable else 1

    def create(self, inner, p, group, device):
        import torch

        # TE 2.x step(): `if len(state) == 0: self.initialize_state(p, store_param_remainders)`
        remainders = bool(inner.store_param_remainders and p.dtype == torch.bfloat16)
        inner.initialize_state(p, remainders)

    def made_in(self, inner, view_of, zeroed: bool = False):
        """TE makes each state in `_initialize_state(param, state_name, zero_buffer, store_param_remainders)` (TE
        2.x): `torch.empty_like(param)` where the parameter is, the host for a master, then `copy_` in
        set_scaled_state (its loader makes every state anew); for a DTensor parameter (Megatron-FSDP) like its
        local tensor, wrapped by DTensor.from_local, which moves it to the mesh's device. Shadowed on the
        instance, an fp32 state, or a master's int16 remainders, is the host view itself (zeroed where TE
        zeroes; under Megatron-FSDP a DTensor over it, kept on the host as the engine holds its states), so
        neither a first materialization nor a load makes fresh memory and copies it again; states with a
        scale (bf16/fp16/FP8) and quantized parameters are made by TE's own code, as before. In a buffer fresh
        from the kernel (`zeroed`) the zeros are there already: writing them would only fault the pages in
        on this thread, inside a checkpoint load's time."""
        import contextlib
        import inspect

        import torch

        method = getattr(type(inner), "_initialize_state", None)
        if method is None or list(inspect.signature(method).parameters)[:4] != [
                "self", "param", "state_name", "zero_buffer"]:
            return contextlib.nullcontext()  # another TE: its own code makes every state
        from . import fsdp
        from .subset import Shadows

        original = inner._initialize_state

        def initialize(param, state_name, zero_buffer, store_param_remainders=False):
            dtype = torch.int16 if store_param_remainders else inner.name_to_dtype_map[state_name]
            plain = fsdp.local(param)
            view = (view_of(param, state_name) if type(plain) in (torch.Tensor, torch.nn.Parameter)
                    and dtype in (torch.float32, torch.int16) else None)
            if view is None or view.dtype != dtype or tuple(view.shape) != tuple(plain.shape):
                return original(param, state_name, zero_buffer, store_param_remainders)
            if (zero_buffer or store_param_remainders) and not zeroed:  # (TE makes remainders with zeros_like)
                view.zero_()
            inner.state[param][state_name] = (fsdp.host_dtensor(view, param.device_mesh, param.placements,
                                                                param.size(), param.stride())
                                              if fsdp.is_dtensor(param) else view)
            return None

        @contextlib.contextmanager
        def shadowed():
            shadows = Shadows()
            shadows.set(inner, "_initialize_state", initialize)
            try:
                yield
            finally:
                shadows.restore()

        return shadowed()

    def reload_from_param(self, inner, p):
        import torch

        if not inner.master_weights or "master_param" not in inner.state[p]:
            return
        # as initialize_state makes it: remainders zero (the master is the bf16 weight), else the weight
        if inner.store_param_remainders and p.dtype == torch.bfloat16:
            inner.state[p]["master_param"].zero_()
        else:
            inner.set_scaled_state(p, "master_param", p.clone().detach().float())

    def scale_of(self, inner, p, key):
        return (inner._scales.get(p) or {}).get(key)

    def set_scale(self, inner, p, key, tensor):
        inner._scales[p][key] = tensor


class ApexFusedAdam(Contract):
    name = "apex FusedAdam"
    group_step = True

    def states(self, inner, p, group):
        import torch

        return [StateSpec(k, torch.float32) for k in ("exp_avg", "exp_avg_sq")]

    def advance_step(self, inner):
        # apex/optimizers/fused_adam.py step(): populated groups only
        for group in inner.param_groups:
            if group["params"]:
                group["step"] = group["step"] + 1 if "step" in group else 1

    def create(self, inner, p, group, device):
        import torch

        # apex/optimizers/fused_adam.py step(): `if len(state) == 0`
        state = inner.state[p]
        state["exp_avg"] = torch.zeros_like(p.data).float()
        state["exp_avg_sq"] = torch.zeros_like(p.data).float()

    def streamed_problems(self, inner):
        if getattr(inner, "master_weights", False):
            return [f"{self.name} with master_weights=True keeps fp32 master copies in param_groups_master, "
                    "outside its state, which the streamed step does not move; Megatron-Core never sets it. "
                    "Use chunk_mb=0"]
        return []


class Emerging(Contract):
    """An emerging-optimizers optimizer: per-parameter states made in its _init_group (`if len(state) ==
    0`: zeros like the parameter), nothing in the param group advanced by step(), each parameter updated
    on its own (Muon's Newton-Schulz on the whole matrix, inside step())."""

    # Muon: Newton-Schulz's temporaries, a few of the matrix's size, one matrix at a time
    step_scratch = 2.0

    def __init__(self, name, states, in_order=False):
        self.name = name
        self._states = states  # (inner, p, group) -> [StateSpec]
        self.in_order = in_order

    def states(self, inner, p, group):
        return self._states(inner, p, group)

    def create(self, inner, p, group, device):
        import torch

        state = inner.state[p]
        for spec in self.states(inner, p, group):
            state[spec.key] = torch.zeros_like(p.data)


def _muon_states(inner, p, group):
    # emerging-optimizers 0.3.0 OrthogonalizedOptimizer._init_group: `state["momentum_buffer"] =
    # torch.zeros_like(p.data)`
    return [StateSpec("momentum_buffer", p.dtype)]


def _lion_states(inner, p, group):
    return [StateSpec("exp_avg", p.dtype)]  # Lion._init_group


CONTRACTS: Dict[str, Contract] = {
    TORCH_ADAMW: TorchAdam("torch AdamW"),
    TORCH_ADAM: TorchAdam("torch Adam"),
    TE_FUSED_ADAM: TEFusedAdam(),
    APEX_FUSED_ADAM: ApexFusedAdam(),
    **{path: Emerging("Muon", _muon_states, in_order=True) for path in MUONS},
    EO_LION: Emerging("Lion", _lion_states),
}


def of(inner) -> Optional[Contract]:
    return CONTRACTS.get(class_path(inner))


def is_muon(inner) -> bool:
    return class_path(inner) in MUONS


def describe_class(cls) -> str:
    """'Transformer Engine FusedAdam (transformer_engine....FusedAdam)', for per-rank lines and status."""
    c = CONTRACTS.get(path_of(cls))
    return f"{c.name} ({path_of(cls)})" if c else path_of(cls)


def describe(inner) -> str:
    return describe_class(type(inner))


def streamed_problems(inners) -> List[str]:
    """What the streamed step cannot serve in these inner optimizers, each with the fix."""
    out: List[str] = []
    for inner in inners:
        c = of(inner)
        if c is None:
            out.append(f"the inner optimizer is {class_path(inner)}: the streamed step splits step() over chunks "
                       "of parameters and reproduces exactly only torch AdamW/Adam, Transformer Engine FusedAdam, "
                       "apex FusedAdam, and emerging-optimizers' Muon and Lion; use chunk_mb=0 (one window, step() "
                       "over everything)")
        else:
            out += [p for p in c.streamed_problems(inner) if p not in out]
    return out
