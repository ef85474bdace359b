"""Megatron-FSDP's fp32 masters made in host memory while its ParamAndGradBuffer is built (issue 41).

Megatron-FSDP's constructor (megatron-core 0.16.1 to 0.19.2) makes each parameter group's main-weight buffer
whole on the GPU (`_init_each_parameter_group_buffers`: `mbuf.init_data(torch.empty(..., device=self.device))`),
fills it from the model's weights (`set_item`), makes each optimizer parameter a DTensor over a view of it
(`_init_distributed_params` -> `make_fsdp_dtensor`, with a tensor-parallel broadcast and checks on the local
tensor) and wraps each in nn.Parameter (`_init_optimizer_named_parameters`). Every master of the rank then sat on
the GPU until the engine took it at the first step, and the run's peak from process start counted them all.

build_on_host() runs that constructor with, for its duration only:
- each group's main-weight buffer given a host tensor instead, a view of one landing block
  (construction.Landing: counted by the host-memory check first, pinned while it is filled). The GPU tensor
  Megatron-FSDP made for it is dropped at once: one group's buffer on the GPU at most, never all. `set_item` then
  copies the weights across devices, each item first widened to fp32 where it is (on the GPU, exact): torch
  converts the dtype of a copy between devices on the CPU, one thread under torchrun;
- `make_fsdp_dtensor` given a GPU copy of each host view, so its broadcast and checks run as they do without
  offload. What it returns is copied back (the broadcast may change it), and its local tensor is left on the GPU
  without storage until the constructor returns: nn.Parameter(DTensor) detaches it, which torch refuses for a GPU
  DTensor over a host tensor (2xH200, 2026-11-27). One master on the GPU at a time;
- after it, each optimizer parameter's local tensor, and that of Megatron-FSDP's own DTensor over it, bound to its
  host view; the DTensors keep the GPU as their device, as the engine's rebinding leaves them.

The masters are staged (construction.stage): the engine takes them into its pinned buffer when it prepares, and the
optimizer built over them waits for a session (adoption.py). Left unadopted, restore() makes each buffer again on
the GPU, the masters views of it, as Megatron-FSDP laid them out.

Imports no torch at module level.
"""
from __future__ import annotations

import logging
import time
import weakref
from typing import Dict, List, Optional

from ..log import once, rank_prefix
from .construction import ALIGN, Built, Landing, is_staged, stage, unstage
from . import fsdp
from .fsdp import is_dtensor, local

# the names the constructor reaches through the module and the buffer class (checked before each use)
MAKE = "make_fsdp_dtensor"
INIT_DATA = "init_data"
SET_ITEM = "set_item"

# Megatron-FSDP's ParamAndGradBuffer -> what build_on_host made on the host for it
_records: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class _Record:
    """One construction: its host buffers and, per DTensor made over one of them, the host view it stands for."""

    def __init__(self):
        self.device = None  # the device Megatron-FSDP meant the buffers for
        self.buffers: Dict[int, object] = {}  # id(main-weight buffer) -> it, its data made on the host
        self.made: Dict[int, tuple] = {}  # id(DTensor make_fsdp_dtensor returned) -> (it, its host view)


def _moves(t) -> bool:
    """A tensor Megatron-FSDP made on the GPU: its place is taken by a host tensor (tests stand it in on CPU)."""
    return t.device.type == "cuda"


def missing(module) -> List[str]:
    """What of Megatron-FSDP's buffer module build_on_host reaches and cannot find."""
    out = []
    if not callable(vars(module).get(MAKE)):
        out.append(f"{module.__name__}.{MAKE}")
    buffer_cls = getattr(module, "DataParallelBuffer", None)
    for name in (INIT_DATA, SET_ITEM):
        if not callable(vars(buffer_cls).get(name) if buffer_cls is not None else None):
            out.append(f"{module.__name__}.DataParallelBuffer.{name}")
    return out


def build_on_host(module, wrapped, pgb, args, kwargs, built: Optional[Built] = None):
    """Megatron-FSDP's `ParamAndGradBuffer.__init__` (`wrapped`, bound to `pgb`) with its main-weight buffers made
    on the host. `module`: megatron_fsdp's param_and_grad_buffer module."""
    built = built if built is not None else Built()
    gone = missing(module)
    if gone:
        once(("fsdp-construction",), logging.WARNING,
             "%sMegatron-FSDP's main-weight buffers are made on the GPU, as without offload, until the first step "
             "takes them: %s not found (an unknown megatron-core). The run's peak from process start counts them",
             rank_prefix(), ", ".join(gone))
        return wrapped(*args, **kwargs)
    rec = _Record()
    buffer_cls = module.DataParallelBuffer
    init_data, set_item, make = vars(buffer_cls)[INIT_DATA], vars(buffer_cls)[SET_ITEM], vars(module)[MAKE]
    landing: List[Optional[Landing]] = [None]
    t0 = time.perf_counter()

    def init_data_on_host(buf, data, *a, **k):
        host = _host_for(pgb, rec, landing, buf, data, built)
        return init_data(buf, data if host is None else host, *a, **k)

    def set_item_widened(buf, item_id, item_data, *a, **k):
        if (id(buf) in rec.buffers and _moves(item_data) and type(item_data).__name__ in ("Tensor", "Parameter")
                and item_data.dtype != buf.data.dtype):
            item_data = item_data.detach().to(buf.data.dtype)  # one item at a time, where it is
        return set_item(buf, item_id, item_data, *a, **k)

    def make_from_host(*a, **k):
        lt = k["local_tensor"] if "local_tensor" in k else (a[0] if a else None)
        if lt is None or landing[0] is None or not _in_block(lt, landing[0]):
            return make(*a, **k)
        on_device = lt.to(rec.device, copy=True)
        if "local_tensor" in k:
            k = dict(k, local_tensor=on_device)
        else:
            a = (on_device, *a[1:])
        out = make(*a, **k)
        lt_out = local(out)
        if lt_out.numel():
            lt.copy_(lt_out.reshape(-1))  # its tensor-parallel broadcast may have changed it
            rec.made[id(out)] = (out, lt.view(lt_out.shape))
            lt_out.data = _shell(lt_out)  # the GPU copy goes; the storage-less tensor detaches as a GPU one
        return out

    setattr(buffer_cls, INIT_DATA, init_data_on_host)
    setattr(buffer_cls, SET_ITEM, set_item_widened)
    setattr(module, MAKE, make_from_host)
    try:
        result = wrapped(*args, **kwargs)
    finally:
        setattr(buffer_cls, INIT_DATA, init_data)
        setattr(buffer_cls, SET_ITEM, set_item)
        setattr(module, MAKE, make)
        if landing[0] is not None:
            landing[0].finish(built)
    _bind(pgb, rec, built)
    built.total_s = time.perf_counter() - t0
    if rec.buffers:
        _records[pgb] = rec
    return result


def _host_for(pgb, rec: _Record, landing, buf, data, built: Built):
    """A host tensor for `data` when `buf` is one of pgb's main-weight buffers and data was made on the GPU; None
    otherwise, or when the landing block is refused (the buffer is then made on the GPU, as without offload)."""
    if not _moves(data):
        return None
    mains = [g.main_weight_buffer for g in getattr(pgb, "parameter_groups", None) or ()
             if getattr(g, "main_weight_buffer", None) is not None]
    if not any(b is buf for b in mains):
        return None
    if landing[0] is None:
        landing[0] = Landing(sum(-(-b.data_size * b.dtype.itemsize // ALIGN) * ALIGN for b in mains))
    host = landing[0].slot((data.numel(),), data.dtype, built)
    if host is None:
        return None
    rec.device = data.device
    rec.buffers[id(buf)] = buf
    fsdp.mark_on_host(buf)
    built.batches += 1
    built.largest_batch = max(built.largest_batch, data.numel() * data.element_size())
    return host


def _in_block(t, landing: Landing) -> bool:
    return t.device.type == "cpu" and landing.storage is not None and t.untyped_storage().data_ptr() == landing.storage


def _shell(t):
    """A tensor like t on t's device with no storage."""
    import torch

    shell = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    shell.untyped_storage().resize_(0)
    return shell


def _bind(pgb, rec: _Record, built: Built) -> None:
    """After the constructor: each optimizer parameter's local tensor, and its Megatron-FSDP DTensor's, bound to
    its host view; the first staged for the engine."""
    dists = getattr(pgb, "dist_main_weight", None) or {}
    for name, p in getattr(pgb, "optimizer_named_parameters", None) or ():
        dist = dists.get(name)
        made = rec.made.get(id(dist))
        if made is None:
            continue
        view = made[1]
        for t in (local(dist), local(p)):
            t.data = view
        stage(local(p), rec.device)
        built.masters += 1
        built.bytes += view.numel() * view.element_size()


# -- an optimizer no session takes (adoption.py) ------------------------------------------------------

def _pgbs(opt):
    for chunk in getattr(opt, "model_chunks", None) or ():
        pgb = getattr(chunk, "param_and_grad_buffer", None)
        if pgb is not None and pgb in _records:
            yield pgb


def staged(opt) -> List[object]:
    """The masters of `opt` (a Megatron-FSDP optimizer) made on the host and not yet taken by a session."""
    return [local(p) for pgb in _pgbs(opt) for _, p in pgb.optimizer_named_parameters
            if is_dtensor(p) and is_staged(local(p))]


def restore(opt) -> None:
    """Each main-weight buffer of `opt` made on the host back on the device Megatron-FSDP meant, its masters views of
    it at their places, unstaged (no session took them)."""
    for pgb in list(_pgbs(opt)):
        rec = _records.pop(pgb)
        dists = getattr(pgb, "dist_main_weight", None) or {}
        tensors = [t for name, p in pgb.optimizer_named_parameters
                   for t in {id(x): x for x in (local(p), local(dists.get(name, p)))}.values()]
        for buf in rec.buffers.values():
            host = buf.data
            if host.device.type != "cpu":
                continue
            on_device = host.to(rec.device, copy=True)
            start, end = host.data_ptr(), host.data_ptr() + host.numel() * host.element_size()
            for t in tensors:
                if t.device.type == "cpu" and t.numel() and start <= t.data_ptr() < end:
                    at = (t.data_ptr() - start) // t.element_size()
                    t.data = on_device[at:at + t.numel()].view(t.shape)
            buf.data = on_device
        for _, p in pgb.optimizer_named_parameters:
            unstage(local(p))
