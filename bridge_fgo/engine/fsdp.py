"""Megatron-FSDP's part of the streamed step: where its optimizer keeps the masters, and its own
master -> model copy run once after the last chunk.

Under cfg.ddp.use_megatron_fsdp, Megatron-Core's DistributedOptimizer returns early from its constructor
(megatron-core 0.19.2): Megatron-FSDP holds the fp32 masters, one flat buffer per parameter group
(`main_weight_buffer.data`, this rank's shard for the optim, optim_grads and optim_grads_params
strategies), and the inner optimizer steps `nn.Parameter(DTensor)`s whose local tensors are views of
that buffer. The states are DTensors of their own storage (Transformer Engine's FusedAdam wraps what it
makes in DTensor.from_local). Measured on two H200s on 2026-11-27 (docs/design.md#megatron-fsdp). HSDP
(num_distributed_optimizer_instances > 1) lays them out the same way over a (dp_outer, dp_shard) mesh: see
sharding().

What this module does for the engine:
- the masters are the local tensors of the optimizer's parameters (`local`), rebound in place like a
  distributed optimizer's masters (`local.data = view`); Megatron-FSDP's own DTensors over the same
  storage (`dist_main_weight`) are made to share them, so one rebinding serves both;
- a flat buffer is given up once none of its masters is bound to it any more: `data` becomes a tensor on
  the meta device (a read fails loudly, never reads freed memory) and the GPU storage goes with the
  last reference (retire); unpatch makes it again, the masters views of it as before (restore);
- after each pass the updated masters are kept in the model's dtype in their own gradients' storage
  (the FP8 case of quantized.py, for every parameter here), and Megatron-Core's own
  `_copy_main_params_to_model_params` (Megatron-FSDP's `copy_main_weights_to_model_weights`, the FP8
  cast and its amax reduction among it) runs once after the last chunk over those copies, each group's
  main-weight buffer presented by what was kept (copy_rest). Transformer Engine's FP8 cast reads a
  master only through `master.to(model dtype)` (quantized.py), and a bf16 copy of a kept bf16 value is
  the value: the same bits as Megatron-FSDP's own copy from the fp32 masters.

Imports no torch at module level.
"""
from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Dict, List, Optional, Set

from ..errors import BridgeFGOError
from ..log import once, rank_prefix

STRATEGIES = ("optim", "optim_grads", "optim_grads_params")


def serves(opt) -> bool:
    """Whether `opt` is a DistributedOptimizer whose states Megatron-FSDP holds."""
    return bool(getattr(getattr(opt, "ddp_config", None), "use_megatron_fsdp", False)) and not getattr(
        opt, "is_stub_optimizer", False)


def is_dtensor(t) -> bool:
    return type(t).__name__ == "DTensor" or (hasattr(t, "_local_tensor") and hasattr(t, "_spec"))


def local(t):
    """A DTensor's local tensor (what holds the memory); any other tensor itself."""
    return t._local_tensor if is_dtensor(t) else t


def strategy(opt) -> Optional[str]:
    return getattr(getattr(opt, "ddp_config", None), "data_parallel_sharding_strategy", None)


def sharding(opt) -> str:
    """The sharding found, as the per-rank lines and status say it: the strategy, and HSDP's outer dimension
    (num_distributed_optimizer_instances > 1: the masters of a main-weight buffer are this rank's shard over
    every data-parallel rank with outer_dp_sharding_strategy "optim", over its instance's ranks with
    "no_shard"; either way views of one flat buffer, served as without HSDP)."""
    text = str(strategy(opt))
    instances, outer = _hsdp(opt)
    if instances > 1:
        text += f", HSDP: {instances} optimizer instances, outer {outer}"
    return text


def _hsdp(opt):
    """(num_distributed_optimizer_instances, outer_dp_sharding_strategy): HSDP where the first is over 1."""
    ddp = getattr(opt, "ddp_config", None)
    return (getattr(ddp, "num_distributed_optimizer_instances", 1) or 1,
            getattr(ddp, "outer_dp_sharding_strategy", None))


# Megatron-FSDP's main-weight buffers whose data fsdp_construction.py made in host memory
_on_host: "weakref.WeakSet" = weakref.WeakSet()


def made_on_host(buf) -> bool:
    """Whether main-weight buffer `buf`'s data is the host tensor fsdp_construction.py made for it."""
    return buf in _on_host and buf.data.device.type == "cpu"


def mark_on_host(buf) -> None:
    _on_host.add(buf)


def _buffers(pgb):
    for g in getattr(pgb, "parameter_groups", None) or ():
        yield g


class Flat:
    """One parameter group's main-weight buffer and the masters that are views of it."""

    def __init__(self, group, mbuf, items, empties=(), device=None):
        self._group = weakref.ref(group)
        self.mbuf = mbuf
        self.items = items  # [(item_id, optimizer parameter, element offset in the flat, local shape)]
        # parameters with no elements on this rank whose empty local tensor is still a view of the flat:
        # rebound to an empty tensor of their own when it is given up, so they do not keep it alive
        self.empties = list(empties)
        data = mbuf.data
        # the device Megatron-FSDP meant it for: the buffer's own, unless it was made on the host
        # (fsdp_construction.py)
        self.dtype, self.numel, self.device = data.dtype, data.numel(), device if device is not None else data.device
        self.on_host = made_on_host(mbuf)
        self.retired = False

    @property
    def group(self):
        return self._group()


class Layout:
    """The Megatron-FSDP layout of one DistributedOptimizer: its flats, and its parameters by item."""

    def __init__(self, opt):
        import torch

        self._opt = weakref.ref(opt)
        self.flats: List[Flat] = []
        self.by_orig: Dict[int, object] = {}  # id(Megatron-FSDP's original parameter) -> optimizer parameter
        self.kept: Dict[int, object] = {}  # id(optimizer parameter) -> its updated master in the model's dtype
        # the module's own parameters the optimizer updates, those with no element here included: the ones
        # Megatron-FSDP's `_grad_acc` hooks take the gradients of, so hooks of ours mark backward (head.py)
        self.model_params: List[object] = []
        inner_ids = {id(p) for g in opt.optimizer.param_groups for p in g["params"]}
        for chunk in getattr(opt, "model_chunks", None) or ():
            pgb = getattr(chunk, "param_and_grad_buffer", None)
            if pgb is None:
                continue
            named = dict(getattr(pgb, "optimizer_named_parameters", None) or ())
            for name, dist in (getattr(pgb, "dist_main_weight", None) or {}).items():
                p = named.get(name)
                if p is not None and is_dtensor(dist) and dist is not p and local(dist) is not local(p):
                    dist._local_tensor = local(p)  # one object over the storage: rebinding it serves both
            for p in named.values():
                orig = getattr(p, "orig_param", None)
                if orig is not None:
                    self.by_orig[id(orig)] = p
            for g in _buffers(pgb):
                mbuf = getattr(g, "main_weight_buffer", None)
                data = getattr(mbuf, "data", None)
                if mbuf is None or data is None or data.device.type == "meta":
                    continue
                items, empties = [], []
                base = data.data_ptr()
                for item_id, orig in enumerate(g.params):
                    p = self.by_orig.get(id(orig))
                    if p is None or id(p) not in inner_ids:
                        continue
                    self.model_params.append(orig)
                    lt = local(p)
                    if lt.numel() == 0:  # all of it on other ranks (the flat is sharded, not each parameter)
                        if lt.untyped_storage().data_ptr() == data.untyped_storage().data_ptr():
                            empties.append(p)
                        continue
                    if lt.untyped_storage().data_ptr() != data.untyped_storage().data_ptr():
                        raise BridgeFGOError(
                            f"{rank_prefix()}bridge_fgo cannot offload Megatron-FSDP's optimizer states: a "
                            f"parameter of shape {tuple(p.shape)} is not a view of its group's main-weight buffer "
                            "(an unknown Megatron-FSDP layout). Nothing was moved. Fix: drop offload, or report "
                            "the megatron-core version")
                    items.append((item_id, p, (lt.data_ptr() - base) // lt.element_size(), tuple(lt.shape)))
                device = getattr(pgb, "device", None)
                self.flats.append(Flat(g, mbuf, items, empties, torch.device(device) if device is not None else None))

    @property
    def opt(self):
        opt = self._opt()
        if opt is None:
            raise BridgeFGOError("internal: an optimizer the engine serves was garbage-collected")
        return opt

    # -- what moves -------------------------------------------------------------------------------
    def masters(self) -> List[object]:
        """The local tensors of the optimizer's parameters that are views of a main-weight buffer."""
        return [local(p) for f in self.flats for _, p, _, _ in f.items]

    def flat_storages(self) -> Set[int]:
        return {f.mbuf.data.untyped_storage().data_ptr() for f in self.flats if not f.retired}

    def excluded(self) -> Set[int]:
        """Storages that never move: the model weights, their transpose, the gradients."""
        keys = set()
        for chunk in getattr(self.opt, "model_chunks", None) or ():
            for g in _buffers(getattr(chunk, "param_and_grad_buffer", None)):
                for attr in ("model_weight_buffer", "transpose_weight_buffer", "main_grad_buffer",
                             "hfsdp_helper_wbuf", "hfsdp_helper_wtbuf", "hfsdp_helper_gbuf"):
                    data = getattr(getattr(g, attr, None), "data", None)
                    if data is not None and data.device.type != "meta":
                        keys.add(data.untyped_storage().data_ptr())
        return keys

    # -- the flats ----------------------------------------------------------------------------------
    def retire(self) -> int:
        """Each flat none of whose masters is bound to it any more: `data` on the meta device, its storage
        left to go with its last reference. Returns the GPU bytes given up (a flat made on the host shares one
        landing block with the others of its construction: it goes with the last of them)."""
        import torch

        freed = 0
        for f in self.flats:
            if f.retired:
                continue
            key = f.mbuf.data.untyped_storage().data_ptr()
            if any(local(p).untyped_storage().data_ptr() == key for _, p, _, _ in f.items):
                continue
            old = f.mbuf.data
            for p in f.empties:
                local(p).data = torch.empty(local(p).shape, dtype=old.dtype, device=f.device)
            f.mbuf.data = torch.empty(old.shape, dtype=old.dtype, device="meta")
            f.retired = True
            if f.on_host:
                continue
            # uses of the storage beside `old` and the storage object this call makes
            users = torch._C._storage_Use_Count(old.untyped_storage()._cdata) - 2
            nbytes = old.untyped_storage().nbytes()
            del old
            if users > 0:
                once(("fsdp-flat-held",), logging.WARNING,
                     "%sMegatron-FSDP's main-weight buffer is still referenced elsewhere after its masters moved "
                     "to the host: its GPU memory (%d bytes for one group) stays allocated", rank_prefix(), nbytes)
            else:
                freed += nbytes
        return freed

    def restore(self, device) -> None:
        """Every retired flat made again on `device`, each master copied in from where it is bound and
        bound to its view of the flat, as Megatron-FSDP laid it out (unpatch)."""
        import torch

        for f in self.flats:
            if not f.retired:
                continue
            data = torch.empty(f.numel, dtype=f.dtype, device=device)
            for _, p, offset, shape in f.items:
                lt = local(p)
                n = lt.numel()
                view = data[offset:offset + n].view(shape)
                view.copy_(lt)
                lt.data = view
            f.mbuf.data = data
            f.retired = False

    # -- the update ---------------------------------------------------------------------------------
    def keep(self, params) -> None:
        """After the pass that updated these parameters: each master in its model parameter's dtype, in
        its gradient's storage where that holds it (read by no one after the inner step)."""
        import torch

        for p in params:
            orig = getattr(p, "orig_param", None)
            lt = local(p)
            if orig is None or lt.numel() == 0:
                continue
            dtype = orig.dtype
            n = lt.numel()
            need = n * torch.empty((), dtype=dtype).element_size()
            grad = getattr(p, "decoupled_grad", None) if getattr(self.opt.optimizer, "use_decoupled_grad", False) \
                else p.grad
            g = local(grad) if grad is not None else None
            if (g is not None and g.device == lt.device and g.is_contiguous()
                    and g.numel() * g.element_size() >= need):
                out = g.view(-1).view(torch.uint8)[:need].view(dtype)
            else:
                out = torch.empty(n, dtype=dtype, device=lt.device)
            out.copy_(lt.reshape(-1))  # round to nearest even, as the copy and the FP8 cast do first
            self.kept[id(p)] = out

    def copy_rest(self, copy, *args, **kwargs):
        """Megatron-Core's _copy_main_params_to_model_params (`copy`), once, over the kept copies."""
        try:
            with self.presented(kept=True):
                return copy(*args, **kwargs)
        finally:
            self.kept = {}

    def hook(self, shadows, synchronize) -> None:
        """Megatron-FSDP's copy_main_weights_to_model_weights called outside an update (a load, a conversion
        tool's install_optimized_model_weights): it reads the masters where they are, each in its model's
        dtype on the GPU (the same bits, as in the update), never the given-up buffer."""
        me = weakref.ref(self)
        for chunk in getattr(self.opt, "model_chunks", None) or ():
            pgb = getattr(chunk, "param_and_grad_buffer", None)
            if pgb is None:
                continue
            prior = vars(pgb).get("copy_main_weights_to_model_weights")  # whatever was bound there, kept
            shadows.set(pgb, "copy_main_weights_to_model_weights",
                        _copy_hook(me, weakref.ref(pgb), synchronize, prior))

    @contextlib.contextmanager
    def presented(self, kept: bool):
        """Each group's main-weight buffer presented by its masters: the kept copies of the update (`kept`),
        else the masters as bound now, cast to their model's dtype on the compute device."""
        swapped = []
        try:
            for f in self.flats:
                g = f.group
                if g is None or not f.retired:
                    continue
                by_item = {}
                for item_id, p, _, _ in f.items:
                    if kept:
                        out = self.kept.get(id(p))
                        if out is None:
                            raise BridgeFGOError(f"{rank_prefix()}internal: a master of Megatron-FSDP's optimizer "
                                                 "was not updated by any pass of the streamed step")
                    else:
                        out = local(p).reshape(-1).to(device=f.device, dtype=p.orig_param.dtype)
                    by_item[item_id] = out
                swapped.append((g, g.main_weight_buffer))
                g.main_weight_buffer = _Presented(f.mbuf, by_item)
            yield
        finally:
            for g, mbuf in reversed(swapped):
                g.main_weight_buffer = mbuf


    # -- checkpoints (fsdp_dtensor) -------------------------------------------------------------------
    @contextlib.contextmanager
    def checkpoint_io(self, host_key: int, shadows, stand_in=None):
        """During a checkpoint save or load: the masters and states that live in the host buffer (storage
        `host_key`) presented as DTensors on the host, read and written in place (`shadows`, a subset.Shadows
        the caller restores afterwards, holds the optimizer's shadowed state-dict method). `stand_in` (an
        asynchronous save's snapshot, streamed/snapshot.py) gives each presented host view's stand-in.

        The optimizer's DTensors keep the GPU as their own device while their local tensors are host views,
        and torch refuses such a DTensor in its operations (the module's state_dict detaches each parameter:
        'Attempted to set the storage of a tensor on device "cpu" to a storage on different device "cuda:0"',
        2xH200, 2026-11-27); DTensor.from_local, which Megatron-FSDP's SwiGLU split and Transformer Engine
        call, moves a host local tensor to the mesh's device (a GPU copy, and a load would fill the copy).
        So for the call:
        - the module's DTensor parameters (what Megatron-FSDP's state_dict pre-hook swaps in, from
          `optimizer_named_parameters`) are twins over the same local tensors, each on the host; the module
          is put back as it was afterwards;
        - the optimizer's fsdp_dtensor state dict holds such twins of its states; any twin a load bound into
          the inner optimizer is replaced by its original afterwards;
        - DTensor.from_local keeps a view of the host buffer where it is."""
        from torch.distributed.tensor import DTensor

        opt, inner = self.opt, self.opt.optimizer
        twins: Dict[int, tuple] = {}  # id(twin) -> (twin, original): the twin held while its id is a key
        keys = {host_key}  # the storages presented: the host buffer's, and the snapshot's a save hands over

        def on_host(t) -> bool:
            lt = local(t)
            return lt.device.type == "cpu" and lt.untyped_storage().data_ptr() in keys

        def twin(t):
            lt = local(t) if stand_in is None else stand_in(local(t))
            keys.add(lt.untyped_storage().data_ptr())
            tw = DTensor(lt, t._spec, requires_grad=False)
            twins[id(tw)] = (tw, t)
            return tw

        prior = vars(opt).get("sharded_param_state_fsdp_dtensor")  # whatever was bound there, kept
        modules = []
        from_local = DTensor.__dict__["from_local"]
        try:
            chunks = [c for c in getattr(opt, "model_chunks", None) or ()
                      if hasattr(getattr(c, "module", None), "_replace_param_with_raw_if_needed")
                      and getattr(c, "param_and_grad_buffer", None) is not None]
            if chunks and not hasattr(opt, "param_to_name"):
                # Megatron-Core names the optimizer's parameters from the module's at its first checkpoint: while
                # the module holds the optimizer's own DTensors, as without offload (never the twins below)
                for c in chunks:
                    c.module._replace_param_with_distributed_if_needed()
                first = next((p for g in inner.param_groups for p in g["params"]), None)
                if first is not None:
                    opt._param_name(first)
            for c in chunks:
                mod, pgb = c.module, c.param_and_grad_buffer
                was = bool(getattr(mod, "is_param_fsdp_distributed", False))
                mod._replace_param_with_raw_if_needed()
                named = pgb.optimizer_named_parameters
                modules.append((mod, pgb, named, was))
                pgb.optimizer_named_parameters = [(n, _twin_param(twin(p), p) if on_host(p) else p) for n, p in named]

            def sharded_param_state_fsdp_dtensor(*args, **kwargs):
                out = (prior(*args, **kwargs) if prior is not None
                       else type(opt).sharded_param_state_fsdp_dtensor(opt, *args, **kwargs))
                out["state"] = {k: ({n: twin(v) if is_dtensor(v) and on_host(v) else v for n, v in sd.items()}
                                    if isinstance(sd, dict) else sd) for k, sd in out["state"].items()}
                return out

            shadows.set(opt, "sharded_param_state_fsdp_dtensor", sharded_param_state_fsdp_dtensor)

            def kept_on_host(local_tensor, device_mesh=None, placements=None, *, run_check=False, shape=None,
                             stride=None, **kwargs):
                if (device_mesh is not None and placements is not None and shape is not None and stride is not None
                        and not kwargs and device_mesh.device_type != "cpu" and on_host(local_tensor)):
                    return host_dtensor(local_tensor, device_mesh, placements, shape, stride)
                return from_local.__func__(local_tensor, device_mesh, placements, run_check=run_check, shape=shape,
                                           stride=stride, **kwargs)

            DTensor.from_local = staticmethod(kept_on_host)
            yield
        finally:
            DTensor.from_local = from_local
            for mod, pgb, named, was in reversed(modules):
                mod._replace_param_with_raw_if_needed()  # (its shared weights found among the twins)
                pgb.optimizer_named_parameters = named
                if was:
                    mod._replace_param_with_distributed_if_needed()
            for st in list(inner.state.values()):  # a load binds what it is given (torch AdamW): the originals back
                for k, v in list(st.items()):
                    _, orig = twins.get(id(v), (None, None))
                    if orig is not None:
                        if local(orig) is not local(v) and stand_in is None:  # (a save's snapshot stays its own)
                            orig._local_tensor = local(v)
                        st[k] = orig


def _copy_hook(layout_ref, pgb_ref, synchronize, prior):
    def copy_main_weights_to_model_weights(*args, **kwargs):
        layout, pgb = layout_ref(), pgb_ref()

        def real():
            if prior is not None:
                return prior(*args, **kwargs)
            return type(pgb).copy_main_weights_to_model_weights(pgb, *args, **kwargs)

        if layout is None or layout.kept or not any(f.retired for f in layout.flats):
            return real()  # inside the update's copy (presented there), or nothing moved
        synchronize()  # the last update's device-to-host copies done: the host masters are whole
        with layout.presented(kept=False):
            return real()

    return copy_main_weights_to_model_weights


def _twin_param(tw, orig):
    """An nn.Parameter over DTensor `tw` carrying the attributes of `orig`, the parameter it stands for
    (Megatron-FSDP's and Megatron-Core's: orig_param, megatron_fsdp_slice, the tensor-parallel ones)."""
    import torch

    p = torch.nn.Parameter(tw, requires_grad=orig.requires_grad)
    p.__dict__.update({k: v for k, v in vars(orig).items() if k != "_is_param"})
    return p


def host_dtensor(lt, mesh, placements, shape, stride):
    """DTensor.from_local(lt, mesh, placements, shape=, stride=) without moving lt to the mesh's device."""
    import torch
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    placements = tuple(Shard(p.dim + lt.ndim) if type(p) is Shard and p.dim < 0 else p for p in placements)
    spec = DTensorSpec(mesh, placements, tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), lt.dtype))
    return DTensor(lt.view_as(lt), spec, requires_grad=lt.requires_grad)


class _Presented:
    """A main-weight buffer as Megatron-FSDP's copy reads it during the one copy after the update: each
    item its kept copy (an item with no local elements: an empty tensor), everything else the buffer's."""

    def __init__(self, mbuf, by_item):
        self._mbuf, self._by_item = mbuf, by_item

    def __getattr__(self, name):
        return getattr(self._mbuf, name)

    def get_item(self, item_id, only_shard: bool = False):
        kept = self._by_item.get(item_id)
        if kept is not None:
            return kept
        import torch

        return torch.empty(0, dtype=self._mbuf.dtype, device=self._mbuf.device)


# HSDP as run on four H200s (docs/benchmarks.md#gpu-2026-11-28f): outer "optim", bf16 parameters, bit-identical
# fresh and resumed. What else HSDP allows is served the same way but has not run on a GPU: said once per rank.
HSDP_RUN_ON_GPU = "optim"


def unverified(opt) -> Optional[str]:
    """What to say once per rank where this run's HSDP has not run on a GPU under the streamed step, else None."""
    instances, outer = _hsdp(opt)
    if instances <= 1:
        return None
    fp8 = bool(getattr(getattr(opt, "ddp_config", None), "fp8_param_gather", False))
    what = []
    if outer != HSDP_RUN_ON_GPU:
        what.append(f"cfg.ddp.outer_dp_sharding_strategy={outer!r} (checked on CPU on Megatron-FSDP's own buffers, "
                    "tests/test_fsdp.py)")
    if fp8:
        what.append("FP8 parameters (cfg.ddp.fp8_param_gather=True: not run under HSDP)")
    if not what:
        return None
    return (f"Megatron-FSDP's HSDP under the streamed step has run on GPUs with outer_dp_sharding_strategy="
            f"{HSDP_RUN_ON_GPU!r} and bf16 parameters (bit-identical to no offload, fresh and resumed, on four H200s); "
            f"this run's {' and '.join(what)} has not. Compare the first steps' losses with a run without offload, "
            "or drop offload for this run")


def problems(opt) -> List[str]:
    """What the streamed step cannot serve of this Megatron-FSDP optimizer, each naming the field."""
    out = []
    s = strategy(opt)
    if s not in STRATEGIES:
        out.append(f"cfg.ddp.data_parallel_sharding_strategy={s!r} with Megatron-FSDP: the streamed step serves "
                   f"{', '.join(repr(x) for x in STRATEGIES)} (the masters sharded over data-parallel ranks); set "
                   "one of them, or drop offload")
    try:  # the layout as this engine knows it (checked here, where refusals are agreed on by every rank)
        Layout(opt)
    except BridgeFGOError as exc:
        out.append(str(exc).replace(rank_prefix(), "", 1))
    if getattr(getattr(opt, "config", None), "use_precision_aware_optimizer", False):
        out.append("cfg.optimizer.use_precision_aware_optimizer=True with Megatron-FSDP: not yet served by the "
                   "streamed step (Transformer Engine holds the masters and reads decoupled gradients); set it to "
                   "False, or drop offload")
    return out
