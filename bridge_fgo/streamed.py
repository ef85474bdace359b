"""bridge_fgo's streamed optimizer step (chunk_mb > 0): optimizer states live on the host between
updates and reach the GPU only a bounded window at a time, during the update itself.

One StreamedEngine per DistributedOptimizer. What it moves is what the one-window Engine moves
(engine.candidates: the fp32 masters of bf16/fp16 parameters and every per-parameter tensor state
that owns its storage), laid out per parameter in one pinned host buffer in the inner optimizer's
parameter order, so a chunk of parameters is one contiguous host range: one DMA each way.

Where the data is:
- between updates (every reader outside the optimizer step: checkpoint save, logging, evaluation,
  reload_model_params, unpatch): masters are bound to their host views (`master.data = view`) and
  moments are host views in the optimizer's state dict; whole and current, because every copy has
  finished by the time train_step returns (settle());
- from gradient finalization to the update: masters are bound to GPU tensors without storage, so
  Megatron-Core can attach their fp32 gradients (PyTorch checks only the device, dtype and shape);
- during the update: each chunk of parameters is bound to views of a GPU slot; H2D of chunk N+1,
  the update of chunk N and the D2H of chunk N-1 overlap on three streams ordered by events, with
  two slots. A parameter is never split: a chunk holds whole parameters (a parameter larger than
  chunk_mb is a chunk of its own). The two slots are the two ends of one GPU arena sized for the
  largest pair of consecutive chunks, not twice the largest chunk: even chunks sit at its start, odd
  ones at its end, so a large parameter (an embedding) costs its own size once, not twice.

The update of a chunk is the inner optimizer's own step() over the chunk's parameters (its param
groups narrowed to them), followed by Megatron-Core's own _copy_main_params_to_model_params()
narrowed to the chunk's masters, so the model parameters read whole, updated masters while they
are on the GPU. Both are elementwise, so losses and parameters are bit-identical to one update over
everything. The hooks that do this are instance attributes set on the optimizer objects only while
an update is armed (reload() to settle()), so between steps the objects are untouched.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Dict, List, Optional

from .engine import PinnedBuffer, _align, candidates
from .errors import BridgeFGOError
from .log import rank_prefix

MIB = 2**20
_MISSING = object()


@dataclasses.dataclass
class Entry:
    """One tensor that moves: a master (key None) or one state of a parameter."""

    param: object
    key: Optional[str]
    shape: tuple
    dtype: object
    nbytes: int
    offset: int = 0  # in the host buffer
    host: object = None  # the host view, once the buffer exists


@dataclasses.dataclass
class Chunk:
    params: List[object]
    entries: List[Entry]
    start: int  # host byte range [start, end)
    end: int
    groups: List[tuple] = dataclasses.field(default_factory=list)  # (group index, params in it)

    @property
    def nbytes(self) -> int:
        return self.end - self.start


class _Slot:
    def __init__(self):
        self.buffer = None  # this chunk's region of the arena
        self.h2d_done = self.updated = self.d2h_done = None
        self.used = False  # a D2H out of it was enqueued: the next H2D into it waits for d2h_done


def problems(cfg) -> List[str]:
    """Configurations the streamed step cannot serve (each with its field and the fix)."""
    opt, ddp = getattr(cfg, "optimizer", None), getattr(cfg, "ddp", None)
    ckpt, log_cfg = getattr(cfg, "checkpoint", None), getattr(cfg, "logger", None)
    fix = "or use the one-window engine: chunk_mb=0 (bridge-fgo-run --chunk-mb 0, BRIDGE_FGO_CHUNK_MB=0)"
    out = []
    if getattr(opt, "reuse_grad_buf_for_mxfp8_param_ag", False):
        out.append("cfg.optimizer.reuse_grad_buf_for_mxfp8_param_ag=True: the MXFP8 param-buffer copy reads all "
                   f"master weights outside the optimizer step; set it to False, {fix}")
    for name in ("fp8_param_gather", "fp4_param_gather"):
        if getattr(ddp, name, False):
            out.append(f"cfg.ddp.{name}=True: quantizing master weights into parameters is one collective over all "
                       f"of them, which a chunked update cannot split; set it to False, {fix}")
    if getattr(opt, "use_precision_aware_optimizer", False):
        out.append("cfg.optimizer.use_precision_aware_optimizer=True: the optimizer keeps its own master weights "
                   f"and copies them itself; set it to False, {fix}")
    if log_cfg is not None and getattr(log_cfg, "log_params_norm", False):
        out.append("cfg.logger.log_params_norm=True: the parameter norm is computed on the GPU from the master "
                   f"weights, which live on the host between steps; set it to False, {fix}")
    if ckpt is not None:
        saves = getattr(ckpt, "save", None) and getattr(ckpt, "save_optim", True)
        loads = getattr(ckpt, "load", None) and getattr(ckpt, "load_optim", True)
        if saves and getattr(ckpt, "async_save", False):
            out.append("cfg.checkpoint.async_save=True while optimizer state is saved: a background writer would "
                       f"read host buffers that the next step rewrites; set async_save=False or save_optim=False, "
                       f"{fix}")
        if (saves or loads) and getattr(ckpt, "ckpt_format", "torch_dist") != "torch_dist":
            out.append(f"cfg.checkpoint.ckpt_format={ckpt.ckpt_format!r}: optimizer state on the host is saved and "
                       f"loaded per rank only by 'torch_dist'; set ckpt_format='torch_dist', {fix}")
        if (saves or loads) and getattr(ckpt, "dist_ckpt_optim_fully_reshardable", False):
            out.append("cfg.checkpoint.dist_ckpt_optim_fully_reshardable=True gathers optimizer state over the GPU "
                       f"network; set it to False (per-rank 'dp_reshardable' is the default), {fix}")
    return out


class StreamedEngine:
    def __init__(self, dist_optimizer, chunk_bytes: int):
        if chunk_bytes <= 0:
            raise ValueError(f"the streamed step needs a window of > 0 bytes, got {chunk_bytes}")
        self.opt = dist_optimizer
        self.inner = dist_optimizer.optimizer
        self.chunk_bytes = chunk_bytes
        self.entries: List[Entry] = []
        self.chunks: List[Chunk] = []
        self.buffer: Optional[PinnedBuffer] = None
        self.shells: Dict[int, object] = {}  # id(master) -> its GPU tensor without storage
        self.masters: Dict[int, object] = {}  # id(master) -> master
        self.model_of: Dict[int, tuple] = {}  # id(master) -> (group index, model param)
        self.skipped_shared = 0
        self.cuda = False
        self.device = None
        self.slots = [_Slot(), _Slot()]
        self.arena = None
        self.arena_bytes = 0
        self._planned: Optional[int] = None
        self.armed = False
        self._prefetched: Optional[int] = None  # chunk index whose H2D was started at reload()
        self._shadowed: List[tuple] = []
        self._copied_masters = False
        self._adopted: List[object] = []  # GPU tensors copied to the host, freed at release()
        self._d2h = self._h2d = None
        self.steps_streamed = 0

    # -- plan -------------------------------------------------------------------------------------
    def _state_entries(self, p, group) -> List[Entry]:
        """The states p has, or, before Adam's first step, the two moments it will have."""
        import torch

        state = self.inner.state.get(p) or {}
        out = []
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() and value.numel():
                out.append(Entry(p, key, tuple(value.shape), value.dtype, value.numel() * value.element_size()))
        if not state:
            keys = ["exp_avg", "exp_avg_sq"]
            if group.get("amsgrad"):
                keys.append("max_exp_avg_sq")
            out = [Entry(p, k, tuple(p.shape), p.dtype, p.numel() * p.element_size()) for k in keys]
        return out

    def plan(self) -> int:
        """Lay out every parameter's bundle (master, then states) and cut it into chunks."""
        tensors, self.skipped_shared = candidates(self.opt)
        moved = {id(t) for t in tensors}
        for gi, (models, masters) in enumerate(zip(getattr(self.opt, "model_float16_groups", None) or (),
                                                   getattr(self.opt, "shard_fp32_from_float16_groups", None) or ())):
            for model_param, master in zip(models, masters):
                self.model_of[id(master)] = (gi, model_param)
        entries, chunks = [], []
        offset, current = 0, None
        group_of = {id(p): gi for gi, g in enumerate(self.inner.param_groups) for p in g["params"]}
        for group in self.inner.param_groups:
            for p in group["params"]:
                bundle = []
                if id(p) in moved:
                    bundle.append(Entry(p, None, tuple(p.shape), p.dtype, p.numel() * p.element_size()))
                    self.masters[id(p)] = p
                state = self.inner.state.get(p) or {}
                bundle += [e for e in self._state_entries(p, group)
                           if e.key not in state or id(state[e.key]) in moved]
                if not bundle:
                    continue  # nothing of p moves: it is updated in place wherever it is
                size = sum(_align(e.nbytes) for e in bundle)
                if current is None or (current.params and current.nbytes + size > self.chunk_bytes):
                    current = Chunk([], [], offset, offset)
                    chunks.append(current)
                for e in bundle:
                    e.offset = offset
                    offset += _align(e.nbytes)
                current.params.append(p)
                current.entries += bundle
                current.end = offset
                entries += bundle
        for c in chunks:
            by_group: Dict[int, list] = {}
            for p in c.params:
                by_group.setdefault(group_of[id(p)], []).append(p)
            c.groups = sorted(by_group.items())
        self.entries, self.chunks = entries, chunks
        sizes = [c.nbytes for c in chunks]
        self.arena_bytes = max([a + b for a, b in zip(sizes, sizes[1:])] or sizes or [0])
        params = [p for g in self.inner.param_groups for p in g["params"]]
        self.cuda = any(p.is_cuda for p in params)
        self.device = params[0].device if params else None
        return offset

    def plan_bytes(self) -> int:
        """Plan what moves; the host bytes the buffer will need."""
        self._planned = self.plan()
        return self._planned

    def prepare(self) -> None:
        """Before the first step: allocate and pin the host buffer once, for the plan."""
        nbytes = self._planned if self._planned is not None else self.plan_bytes()
        self.buffer = PinnedBuffer(nbytes, self.cuda)
        for e in self.entries:
            e.host = self.buffer.tensor[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape)
        if self.cuda:
            import torch

            self._d2h, self._h2d = torch.cuda.Stream(), torch.cuda.Stream()
            for s in self.slots:
                s.h2d_done, s.updated, s.d2h_done = (torch.cuda.Event() for _ in range(3))
            if nbytes:  # one DMA pass, so the first step does not pay for first use of the pages
                scratch = torch.empty(min(nbytes, 256 * MIB), dtype=torch.uint8, device=self.device)
                with torch.cuda.stream(self._h2d):
                    for start in range(0, nbytes, scratch.numel()):
                        piece = self.buffer.tensor[start:start + scratch.numel()]
                        scratch[:piece.numel()].copy_(piece, non_blocking=True)
                self._h2d.synchronize()
                del scratch

    # -- bindings ---------------------------------------------------------------------------------
    def _current(self, e: Entry):
        if e.key is None:
            return e.param
        return (self.inner.state.get(e.param) or {}).get(e.key)

    def _bind(self, e: Entry, tensor) -> None:
        if e.key is None:
            e.param.data = tensor
        else:
            self.inner.state[e.param][e.key] = tensor

    @staticmethod
    def _same(a, b) -> bool:
        return a is not None and a.device == b.device and a.data_ptr() == b.data_ptr() and a.shape == b.shape

    def on_host(self) -> bool:
        """Every entry that exists is bound to its host view."""
        for e in self.entries:
            t = self._current(e)
            if t is not None and not self._same(t, e.host):
                return False
        return True

    # -- the three sites --------------------------------------------------------------------------
    def offload(self) -> int:
        """Make the host copy canonical: whatever is bound elsewhere (the first step; states a
        checkpoint load put on the GPU) is copied to its host view and rebound there."""
        if self.armed:
            self.settle()  # a rerun after finalization: the prefetched chunk goes back unused
        import torch

        pending = [(e, t) for e in self.entries for t in (self._current(e),)
                   if t is not None and not self._same(t, e.host)]
        if not pending:
            return self.bytes
        if self.cuda:
            self._d2h.wait_stream(torch.cuda.current_stream())
        with (torch.cuda.stream(self._d2h) if self.cuda else contextlib.nullcontext()):
            for e, t in pending:
                e.host.copy_(t.detach(), non_blocking=self.cuda)
        for e, t in pending:
            src = t if e.key is not None else e.param.data
            if e.key is None:
                self.shells[id(e.param)] = src  # keeps the GPU storage object: released below
            self._adopted.append(src)
            self._bind(e, e.host)
        if self.cuda:
            self._d2h.synchronize()  # once per adoption (the first step): the host copy is whole
        return self.bytes

    def release(self) -> None:
        """Free the GPU storage of what offload() adopted (after its copy, by record_stream)."""
        for t in self._adopted:
            if t.is_cuda:
                t.record_stream(self._d2h)
            t.untyped_storage().resize_(0)  # shared by anyone still holding the old tensor: freed for all
        self._adopted = []

    def reload(self, prefetch: bool = True) -> int:
        """Gradient finalization: arm the streamed update, bind masters to storage-less GPU tensors
        (Megatron-Core attaches their gradients next) and start the first chunk's H2D."""
        if self.armed or not self.chunks:
            return 0
        if not self.on_host():
            self.offload()
            self.release()
        for key, master in self.masters.items():
            master.data = self._shell(master)
        self._shadow(self.inner, "step", self._inner_step)
        self._shadow(self.opt, "_copy_main_params_to_model_params", self._copy_rest)
        self.armed = True
        self._copied_masters = False
        if prefetch:
            self._h2d_chunk(0)
            self._prefetched = 0
        return self.bytes

    def wait_reload(self) -> None:
        """Nothing to wait for before the step: each chunk waits for its own H2D."""

    def settle(self) -> None:
        """Whatever happened (a step, a skipped step, an exception, a rerun): every copy finished,
        every entry bound to its host view, the hooks removed, the slots freed."""
        self._unshadow()
        self.armed = False
        self._prefetched = None
        if self.buffer is None:  # never prepared (refused before pinning) or already closed: nothing moved
            return
        if self.cuda:  # the D2H tail (the last chunk) ends before any reader can look at the host copy
            self._d2h.synchronize()
        for e in self.entries:
            t = self._current(e)
            if t is not None and not self._same(t, e.host):
                if t.untyped_storage().nbytes():
                    # bound to a slot view (an exception inside a chunk's update): its data is newest
                    e.host.copy_(t.detach())
                self._bind(e, e.host)
        self._free_slots()

    def close(self) -> None:
        """Unpatch: states back on the GPU as ordinary tensors, the host buffer dropped."""
        import torch

        self.settle()
        if self.buffer is None:
            self.entries, self.chunks = [], []
            return
        for e in self.entries:
            t = self._current(e)
            if t is None:
                continue
            if e.key is None:
                shell = self.shells.pop(id(e.param), None)
                if shell is not None:
                    shell.untyped_storage().resize_(e.nbytes)
                    shell.copy_(e.host)
                    e.param.data = shell
                else:
                    e.param.data = e.host.to(self.device, copy=True)
            else:
                self._bind(e, e.host.to(self.device, copy=True))
        if self.cuda:
            torch.cuda.synchronize()
        for e in self.entries:
            e.host = None
        if self.buffer is not None:
            self.buffer.free()
            self.buffer = None
        self.entries, self.chunks = [], []

    # -- the streamed update ----------------------------------------------------------------------
    def _shell(self, master):
        shell = self.shells.get(id(master))
        if shell is None:  # every master is adopted (offload) before an update is armed
            raise BridgeFGOError(f"{rank_prefix()}internal: a master weight was never moved to the host")
        return shell

    def _slot_views(self, chunk: Chunk, slot: _Slot) -> List[tuple]:
        return [(e, slot.buffer[e.offset - chunk.start:e.offset - chunk.start + e.nbytes].view(e.dtype).view(e.shape))
                for e in chunk.entries]

    def _slot_for(self, index: int) -> _Slot:
        import torch

        if self.arena is None:  # allocated on the compute stream, so the allocator can hand it back later
            self.arena = torch.empty(self.arena_bytes, dtype=torch.uint8, device=self.device)
            for s in self.slots:
                s.used = False
        slot, n = self.slots[index % 2], self.chunks[index].nbytes
        # even chunks at the arena's start, odd ones at its end: two consecutive chunks never overlap
        slot.buffer = self.arena[:n] if index % 2 == 0 else self.arena[self.arena_bytes - n:]
        return slot

    def _h2d_chunk(self, index: int) -> None:
        import torch

        chunk, slot = self.chunks[index], self._slot_for(index)
        src = self.buffer.tensor[chunk.start:chunk.end]
        if not self.cuda:
            slot.buffer[:chunk.nbytes].copy_(src)
            return
        self._h2d.wait_stream(torch.cuda.current_stream())  # the slot's memory is free on the compute stream
        if slot.used:
            self._h2d.wait_event(slot.d2h_done)  # the previous chunk in this slot has left it
        with torch.cuda.stream(self._h2d):
            slot.buffer[:chunk.nbytes].copy_(src, non_blocking=True)
            slot.h2d_done.record()

    def _inner_step(self, *args, **kwargs):
        """The inner optimizer's step(), chunk by chunk through the slots."""
        if args or kwargs:  # Megatron-Core calls step() bare; a closure would re-run the model per chunk
            raise BridgeFGOError("the streamed step cannot run an optimizer step with a closure; use chunk_mb=0")
        if not self.armed:
            return type(self.inner).step(self.inner)
        import torch

        try:
            for i, chunk in enumerate(self.chunks):
                slot = self._slot_for(i)
                if self._prefetched != i:
                    self._h2d_chunk(i)
                self._prefetched = None
                if i + 1 < len(self.chunks):
                    self._h2d_chunk(i + 1)
                    self._prefetched = i + 1
                if self.cuda:
                    torch.cuda.current_stream().wait_event(slot.h2d_done)
                views = self._slot_views(chunk, slot)
                state = self.inner.state
                for e, view in views:
                    if e.key is None or e.key in (state.get(e.param) or {}):
                        self._bind(e, view)
                self._update(chunk)
                for e, view in views:
                    t = self._current(e)
                    if t is None:
                        raise BridgeFGOError(f"{rank_prefix()}the optimizer did not create the predicted state "
                                             f"{e.key!r}; use chunk_mb=0")
                    if not self._same(t, view):  # created by this first update: into the slot, then freed
                        if tuple(t.shape) != e.shape or t.dtype != e.dtype:
                            raise BridgeFGOError(
                                f"{rank_prefix()}optimizer state {e.key!r} is {t.dtype} {tuple(t.shape)}, not the "
                                f"predicted {e.dtype} {e.shape}; use chunk_mb=0")
                        view.copy_(t)
                self._d2h_chunk(chunk, slot)
                for e, _ in views:
                    self._bind(e, e.host)
                self._check_unexpected_states(chunk)
            self.steps_streamed += 1
        finally:
            self._prefetched = None
            self._free_slots()  # the next optimizer of a chain gets the memory (once the copies are done)
        return None

    def _update(self, chunk: Chunk) -> None:
        groups = self.inner.param_groups
        narrowed = []
        for gi, params in chunk.groups:
            g = dict(groups[gi])
            g["params"] = params
            narrowed.append((gi, g))
        self.inner.param_groups = [g for _, g in narrowed]
        try:
            type(self.inner).step(self.inner)
        finally:
            self.inner.param_groups = groups
        for gi, g in narrowed:  # group-level values must not depend on which parameters stepped
            changed = [k for k in g if k != "params" and g[k] is not groups[gi].get(k, _MISSING)]
            if changed:
                raise BridgeFGOError(f"the inner optimizer changes param-group fields {changed} inside step(); the "
                                     "streamed step cannot split it: use chunk_mb=0")
        masters = [p for p in chunk.params if id(p) in self.model_of]
        if masters:
            self._copy_masters(masters)

    def _copy_masters(self, masters) -> None:
        """Megatron-Core's own copy of masters into the model parameters, narrowed to these masters."""
        n_groups = len(self.opt.model_float16_groups)
        mains, models = [[] for _ in range(n_groups)], [[] for _ in range(n_groups)]
        for m in masters:
            gi, model_param = self.model_of[id(m)]
            mains[gi].append(m)
            models[gi].append(model_param)
        with _narrowed(self.opt, shard_fp32_from_float16_groups=mains, model_float16_groups=models,
                       shard_fp32_groups=[], model_fp32_groups=[]):
            type(self.opt)._copy_main_params_to_model_params(self.opt)
        self._copied_masters = True

    def _copy_rest(self, *args, **kwargs):
        """Megatron-Core's call after the inner step: the bf16/fp16 masters were copied chunk by
        chunk while on the GPU; the fp32 parameters (their own masters) are copied here."""
        copy = type(self.opt)._copy_main_params_to_model_params
        if not self._copied_masters:
            return copy(self.opt, *args, **kwargs)
        with _narrowed(self.opt, shard_fp32_from_float16_groups=[], model_float16_groups=[]):
            return copy(self.opt, *args, **kwargs)

    def _d2h_chunk(self, chunk: Chunk, slot: _Slot) -> None:
        import torch

        dst = self.buffer.tensor[chunk.start:chunk.end]
        if not self.cuda:
            dst.copy_(slot.buffer[:chunk.nbytes])
            return
        slot.updated.record()
        self._d2h.wait_event(slot.updated)
        with torch.cuda.stream(self._d2h):
            dst.copy_(slot.buffer[:chunk.nbytes], non_blocking=True)
            slot.d2h_done.record()
        slot.used = True

    def _check_unexpected_states(self, chunk: Chunk) -> None:
        import torch

        planned = {(id(e.param), e.key) for e in chunk.entries}
        for p in chunk.params:
            for key, value in (self.inner.state.get(p) or {}).items():
                if (isinstance(value, torch.Tensor) and value.dim() and value.numel()
                        and (id(p), key) not in planned and value.device == self.device):
                    raise BridgeFGOError(f"{rank_prefix()}optimizer state {key!r} was not predicted; use chunk_mb=0")

    def _free_slots(self) -> None:
        if self.arena is not None and self.cuda:  # reused only after the copies in flight read it
            self.arena.record_stream(self._h2d)
            self.arena.record_stream(self._d2h)
        self.arena = None
        for s in self.slots:
            s.buffer, s.used = None, False

    # -- hooks on the optimizer objects, only while armed -----------------------------------------
    def _shadow(self, obj, name: str, func) -> None:
        self._shadowed.append((obj, name, obj.__dict__.get(name, _MISSING)))
        setattr(obj, name, func)

    def _unshadow(self) -> None:
        while self._shadowed:
            obj, name, prior = self._shadowed.pop()
            if prior is _MISSING:
                obj.__dict__.pop(name, None)
            else:
                setattr(obj, name, prior)

    # -- figures ----------------------------------------------------------------------------------
    @property
    def bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    @property
    def pinned_bytes(self) -> int:
        return self.buffer.nbytes if self.buffer is not None else 0

    @property
    def master_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries if e.key is None)

    @property
    def tensors(self) -> int:
        return len(self.entries)

    @property
    def step_peak_bytes(self) -> int:
        """What the update can add on the GPU: the arena (the largest pair of consecutive chunks)."""
        return self.arena_bytes


@contextlib.contextmanager
def _narrowed(obj, **attrs):
    """Set instance attributes for the duration of a call to Megatron-Core's own method, then put
    back exactly what was there."""
    saved = {name: obj.__dict__.get(name, _MISSING) for name in attrs}
    try:
        for name, value in attrs.items():
            setattr(obj, name, value)
        yield
    finally:
        for name, value in saved.items():
            if value is _MISSING:
                obj.__dict__.pop(name, None)
            else:
                setattr(obj, name, value)
