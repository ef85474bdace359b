"""Which tensors of a Megatron-Core optimizer move, and where each one is bound.

The optimizers whose states move (the parts): a DistributedOptimizer (Adam, its masters sharded over
the data-parallel group), and a Float16OptimizerWithFloat16Params (what Megatron-Core builds for Muon:
each matrix whole, under a LayerWiseDistributedOptimizer whole matrices per data-parallel rank).

What moves: the fp32 master copies of bf16/fp16 parameters (Kind.masters) and every per-parameter
tensor state of the inner optimizer (Adam's moments; TE FusedAdam's master_param and the scales of
its non-fp32 states; Muon's momentum). What never moves: model parameters, the param and grad
buffers, fp32 shards that alias model parameters, 0-dim states (torch's step counters), and any
tensor that does not own its whole storage (releasing that storage would free memory others use).

An Entry is one such tensor. It is reached through one of three bindings, so an engine can rebind
it (to a host view, a GPU window, a GPU tensor) without knowing which kind it is:
- MASTER: the master tensor itself (`master.data = t`, which keeps the object Megatron-Core and the
  optimizer hold; under Megatron-FSDP the local tensor of the optimizer's DTensor parameter, fsdp.py);
- STATE: `inner.state[p][key]` (a DTensor's local tensor: the DTensor stays, its local is rebound);
- SCALE: the optimizer's scale of state `key` (TE: `inner._scales[p][key]`).
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, List, Optional, Set, Tuple

from . import construction
from .fsdp import is_dtensor, local

MASTER, STATE, SCALE = "master", "state", "scale"
ALIGN = 512  # bytes: every entry of 512 bytes or more starts aligned, so copies are clean DMAs
SMALL_ALIGN = 16  # scales (4 bytes) need not waste 512


def aligned(offset: int, nbytes: int) -> int:
    a = ALIGN if nbytes >= ALIGN else SMALL_ALIGN
    return (offset + a - 1) // a * a


def padded(nbytes: int) -> int:
    """What an entry of nbytes can take in a buffer, alignment included."""
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def nbytes_of(t) -> int:
    return t.numel() * t.element_size()


def nbytes_like(p, dtype) -> int:
    """The bytes of a state shaped like `p` in `dtype` (one the optimizer has not created yet)."""
    import torch

    return p.numel() * torch.empty((), dtype=dtype).element_size()


def storage_key(t) -> int:
    return t.untyped_storage().data_ptr()


def owns_storage(t) -> bool:
    return (t.storage_offset() == 0 and t.is_contiguous()
            and t.untyped_storage().nbytes() == nbytes_of(t))


def flat(groups) -> Iterable:
    for group in groups or ():
        for t in group:
            if t is not None:
                yield t


def inner_tensors(t) -> List[object]:
    """A wrapper tensor subclass (Transformer Engine's Float8Tensor) holds its data in plain inner
    tensors (PyTorch's __tensor_flatten__ protocol); those are what can be moved in place."""
    import torch

    if type(t) in (torch.Tensor, torch.nn.Parameter) or not hasattr(t, "__tensor_flatten__"):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [x for n in names for x in inner_tensors(getattr(t, n))]


@dataclasses.dataclass(frozen=True)
class Kind:
    """Where one kind of part keeps, by param group: its fp32 masters of bf16/fp16 parameters, the model
    parameters they are masters of (same positions), the model's fp32 parameters (stepped in place), and
    a DistributedOptimizer's shards of the model's parameters (views of them)."""

    masters: str
    models: str
    model_fp32: str
    shards: Tuple[str, ...] = ()  # (fp32 shards first: stepped in place like the fp32 parameters)
    # its init_state_fn makes every state before a load builds what torch_dist fills (Megatron-Core 0.19.2:
    # Float16OptimizerWithFloat16Params.state_dict and sharded_state_dict with is_loading)
    inits_on_load: bool = False

    @property
    def model_groups(self) -> Tuple[str, ...]:
        """The model's own parameters, bf16/fp16 and fp32."""
        return (self.models, self.model_fp32)

    @property
    def fp32(self) -> Tuple[str, ...]:
        """What is stepped in place: the fp32 parameters and their shards."""
        return (*self.shards[:1], self.model_fp32)


DISTRIBUTED = Kind("shard_fp32_from_float16_groups", "model_float16_groups", "model_fp32_groups",
                   ("shard_fp32_groups", "shard_float16_groups"))
FLOAT16 = Kind("fp32_from_float16_groups", "float16_groups", "fp32_from_fp32_groups", inits_on_load=True)
KINDS = (DISTRIBUTED, FLOAT16)


def kind_of(opt) -> Kind:
    for kind in KINDS:
        if getattr(opt, kind.masters, None) is not None:
            return kind
    return DISTRIBUTED  # (a part without masters: nothing of it moves but its states)


def masters(opt, layout=None) -> List[object]:
    """The part's fp32 masters of bf16/fp16 parameters, in its order (under Megatron-FSDP, `layout`'s:
    the local tensors of the optimizer's parameters, fsdp.py)."""
    if layout is not None:
        return layout.masters()
    return list(flat(getattr(opt, kind_of(opt).masters, None)))


def model_params(opt, layout=None) -> List[object]:
    """The model's parameters whose masters (or fp32 selves) the part updates: their gradients mark
    backward's progress (streamed/head.py). Under Megatron-FSDP, `layout`'s: the module's own parameters."""
    if layout is not None:
        return list(layout.model_params)
    return [p for name in kind_of(opt).model_groups for p in flat(getattr(opt, name, None))]


def excluded_storages(opt, layout=None) -> Set[int]:
    """Storages that never move: model parameters, fp32 shards that alias them, param/grad buffers."""
    if layout is not None:
        return layout.excluded()
    keys = set()
    kind = kind_of(opt)
    for name in (*kind.model_groups, *kind.shards):
        keys.update(storage_key(t) for t in flat(getattr(opt, name, None)))
    for buf in getattr(opt, "buffers", None) or ():
        for attr in ("param_data", "grad_data"):
            t = getattr(buf, attr, None)
            if t is not None:
                keys.add(storage_key(t))
    return keys


class Movable:
    """Decides, for one DistributedOptimizer, whether a tensor may move: it must be a tensor with
    elements on the GPU (on CPU in tests, where no GPU exists), own its storage, and be neither
    excluded nor already taken."""

    def __init__(self, opt, layout=None):
        import torch

        self.torch = torch
        self.excluded = excluded_storages(opt, layout)
        # Megatron-FSDP's main-weight buffers: every master a view of one, moved view by view (fsdp.py)
        self.flats = layout.flat_storages() if layout is not None else set()
        self.seen: Set[object] = set()
        self.shared = 0  # skipped because they share storage
        self.cpu_is_host = torch.cuda.is_available()

    def take(self, t) -> bool:
        if not isinstance(t, self.torch.Tensor) or t.dim() == 0 or t.numel() == 0:
            return False  # scalars such as torch's step counter stay put
        if t.device.type not in ("cuda", "cpu"):
            return False
        if t.device.type == "cpu" and self.cpu_is_host and not construction.is_staged(t):
            return False  # already on the host (a master made there at construction still moves in)
        if t.untyped_storage().nbytes() == 0:
            return False  # released elsewhere; never copy from freed storage
        key = storage_key(t)
        # views, each taken once: Megatron-FSDP's masters of its main-weight buffers (fsdp.py), and masters made on
        # the host at construction, which share its landing block (construction.py)
        if key in self.flats or construction.is_staged(t):
            if (key, t.data_ptr()) in self.seen:
                return False
            self.seen.add((key, t.data_ptr()))
            return True
        if key in self.excluded or key in self.seen:
            return False
        if not owns_storage(t):
            self.shared += 1
            return False
        self.seen.add(key)
        return True


@dataclasses.dataclass(eq=False)
class Entry:
    """One tensor that moves."""

    kind: str  # MASTER, STATE or SCALE
    param: object  # the inner optimizer's parameter it belongs to (for MASTER: the master itself)
    key: Optional[str]  # the state's key (STATE, SCALE)
    shape: tuple
    dtype: object
    nbytes: int
    offset: int = 0  # in the host buffer
    host: object = None  # its host view, once the buffer exists
    dropped: bool = False  # the optimizer made it otherwise than predicted: it stays where it is

    @property
    def name(self) -> str:
        return "master weight" if self.kind == MASTER else f"{self.kind} {self.key!r}"


class Bindings:
    """Reading and rebinding entries of one inner optimizer (and its contract's scales)."""

    def __init__(self, inner, contract):
        self.inner, self.contract = inner, contract

    def get(self, e: Entry):
        if e.kind == MASTER:
            return e.param
        if e.kind == STATE:
            return local((self.inner.state.get(e.param) or {}).get(e.key))
        return self.contract.scale_of(self.inner, e.param, e.key)

    def set(self, e: Entry, t) -> None:
        if e.kind == MASTER:
            e.param.data = t
        elif e.kind == STATE:
            held = self.inner.state[e.param].get(e.key)
            if is_dtensor(held):  # Megatron-FSDP's states: the DTensor kept, its local tensor rebound
                held._local_tensor = t
            else:
                self.inner.state[e.param][e.key] = t
        else:
            self.contract.set_scale(self.inner, e.param, e.key, t)


def same(a, b) -> bool:
    """`a` is bound to exactly `b`'s memory."""
    return (a is not None and b is not None and a.device == b.device and a.data_ptr() == b.data_ptr()
            and tuple(a.shape) == tuple(b.shape))


def model_params_of_masters(opt) -> dict:
    """id(master) -> (group index, model parameter): for Megatron-Core's master -> model copy."""
    out, kind = {}, kind_of(opt)
    for gi, (models, masters) in enumerate(zip(getattr(opt, kind.models, None) or (),
                                               getattr(opt, kind.masters, None) or ())):
        for model_param, master in zip(models, masters):
            if master is not None:  # None under the precision-aware optimizer: the optimizer holds it
                out[id(master)] = (gi, model_param)
    return out


def inner_params(inner) -> List[Tuple[int, object]]:
    """(group index, parameter) in the inner optimizer's order."""
    return [(gi, p) for gi, g in enumerate(inner.param_groups) for p in g["params"]]
