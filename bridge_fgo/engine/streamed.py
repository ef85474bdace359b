"""The streamed optimizer step (chunk_mb > 0): optimizer states live in pinned host memory between
updates and reach the GPU a bounded window at a time, during the update itself.

One StreamedEngine per optimizer as train_step sees it (a DistributedOptimizer, or Megatron-Core's
ChainedOptimizer of several): one host buffer and one GPU window for the whole chain, so the window
the per-rank line states is the bound for every engine of a mixture-of-experts chain too.

Where the data is:
- between updates (every reader outside the optimizer step: checkpoint save and load, logging,
  evaluation, reload_model_params, unpatch): masters bound to their host views
  (`master.data = view`), states and scales host views in the optimizer's dicts. The last chunks'
  device-to-host copies may still be in flight when train_step returns (they overlap the next
  forward): Megatron-Core's methods that read or write optimizer state (READERS) are guarded on the
  instances until those copies are done, and settle()/close() wait for them;
- from gradient finalization to the update: masters bound to GPU tensors without storage, so
  Megatron-Core can attach their fp32 gradients (PyTorch checks only device, dtype and shape);
- during the update: each chunk bound to views of a window slot; host-to-device of chunk N+1 (the
  next one in the chain, even of the next optimizer), the update of chunk N and device-to-host of
  chunk N-1 overlap, ordered by events;
- under a memory budget, the bundles kept resident are ordinary GPU tensors, updated in place.

The update of a chunk is the inner optimizer's own step() over the chunk's parameters (update.py:
every param group at its index, group-level values as before the step, written back once), then
Megatron-Core's own master -> model copy narrowed to the chunk's masters. Both are per-parameter,
so losses and parameters are bit-identical to one update over everything. The hooks that do this
are instance attributes set on the optimizer objects only while an update is armed.

The engine holds its optimizers through weak references: it never keeps one alive.
"""
from __future__ import annotations

import functools
import inspect
import logging
import weakref
from typing import Dict, List, Optional

from .. import hostmem
from ..errors import BridgeFGOError
from ..log import logger, once, rank_prefix
from . import budget, construction, contracts, copies as copies_mod, layout, update
from .tensors import (MASTER, Bindings, Entry, Movable, flat, inner_params, model_params_of_masters, owns_storage,
                      same)

GiB = 2**30
# Megatron-Core's DistributedOptimizer methods that read or write optimizer state or master weights
# from the host side: guarded while the last device-to-host copies of an update are in flight.
READERS = ("state_dict", "load_state_dict", "sharded_state_dict", "save_parameter_state",
           "load_parameter_state", "get_parameter_state_dp_reshardable", "get_parameter_state_dp_zero",
           "get_parameter_state_fs_bucket_space", "load_parameter_state_from_dp_reshardable",
           "load_parameter_state_from_dp_zero", "load_parameter_state_from_fs_bucket_space",
           "reload_model_params", "_copy_model_params_to_main_params", "offload_to_cpu", "restore_from_cpu",
           "get_parameters")
# Of those, what saves and what loads a checkpoint, for torn states. sharded_state_dict saves, or with
# is_loading builds what a load fills; Bridge's load then always calls load_state_dict
SAVES = ("state_dict", "save_parameter_state", "get_parameter_state_dp_reshardable", "get_parameter_state_dp_zero",
         "get_parameter_state_fs_bucket_space")
LOADS = ("load_state_dict", "load_parameter_state", "load_parameter_state_from_dp_reshardable",
         "load_parameter_state_from_dp_zero", "load_parameter_state_from_fs_bucket_space")
TORN_FIX = ("Fix: resume from the last checkpoint (restart the run from it, or load it into this optimizer: a "
            "checkpoint load clears this)")


def _is_loading(method, opt, args, kwargs) -> bool:
    """sharded_state_dict(..., is_loading=...) as called (ChainedOptimizer passes it by position)."""
    try:
        bound = inspect.signature(method).bind(opt, *args, **kwargs)
    except TypeError:
        return False
    bound.apply_defaults()
    return bool(bound.arguments.get("is_loading"))


def _hook(engine_ref, method: str, name: str, owner_ref, prior, *args, **kwargs):
    """An engine's hook on the optimizer method `name`: the engine's `method`, or, once the engine is
    gone, what was bound before it (the class's own method when nothing was)."""
    engine = engine_ref()
    if engine is not None:
        return getattr(engine, method)(owner_ref, prior, *args, **kwargs)
    if prior is not None:
        return prior(*args, **kwargs)
    owner = owner_ref()
    return getattr(type(owner), name)(owner, *args, **kwargs)


def _compute_device(parts):
    """Where the update runs: the model parameters' device (masters may live on the host already)."""
    for part in parts:
        opt = part.opt
        for name in ("model_float16_groups", "model_fp32_groups"):
            for t in flat(getattr(opt, name, None)):
                return t.device
    params = [p for part in parts for _, p in inner_params(part.inner)]
    return params[0].device if params else None


class _Part:
    """One DistributedOptimizer of the chain."""

    def __init__(self, index: int, opt):
        self.index = index
        self._opt = weakref.ref(opt)
        self._inner = weakref.ref(opt.optimizer)
        self.contract = contracts.of(opt.optimizer)
        self.bundles: List[layout.Bundle] = []
        self.chunks: List[layout.Chunk] = []
        self.model_of: Dict[int, tuple] = {}
        self.shells: Dict[int, object] = {}  # id(master) -> its GPU tensor, storage freed between steps
        self.shared = 0

    @property
    def opt(self):
        return self._alive(self._opt())

    @property
    def inner(self):
        return self._alive(self._inner())

    @staticmethod
    def _alive(obj):
        if obj is None:
            raise BridgeFGOError("internal: an optimizer the engine serves was garbage-collected")
        return obj

    @property
    def bindings(self) -> Bindings:
        return Bindings(self.inner, self.contract)

    def entries(self) -> List[Entry]:
        return [e for b in self.bundles for e in b.entries]

    def resident_params_by_group(self) -> Dict[int, list]:
        out: Dict[int, list] = {}
        for b in self.bundles:
            if b.resident or not b.entries:
                out.setdefault(b.group, []).append(b.param)
        return out


class StreamedEngine:
    def __init__(self, dist_optimizers, chunk_bytes: int, budget_bytes: Optional[int] = None):
        if chunk_bytes <= 0:
            raise ValueError(f"the streamed step needs a window of > 0 bytes, got {chunk_bytes}")
        self.parts = [_Part(i, o) for i, o in enumerate(dist_optimizers)]
        self.chunk_bytes = chunk_bytes
        self.budget_bytes = budget_bytes
        self.chunks: List[layout.Chunk] = []
        self.buffer = None
        self.device = None
        self.copies = None
        self.window: Optional[copies_mod.Window] = None
        self.armed = False
        self.tail = None  # the last device-to-host copy of the last update
        self.guards = update.Shadows()  # READERS wrapped while the tail is in flight
        self._hooks = update.Shadows()  # step hooks while armed
        self._loaders = update.Shadows()  # the inner optimizers' load_state_dict, from prepare() to close()
        # a load of the model only is coming: states made from the parameters (TE's master_param) must
        # be made from the loaded ones, after it
        self.states_after_load = False
        self._adopted: List[object] = []  # GPU tensors copied to the host, freed at release()
        self._started: set = set()  # chunk indices whose host-to-device copy was started this update
        self._copied_masters: set = set()  # part indices whose masters were copied chunk by chunk
        self._updated: List[tuple] = []  # (part, param) of every pass this update has begun
        self._done: set = set()  # part indices whose update went through
        self._where = ""  # the pass the update is in, for a failure's message
        # Why the states are torn (an update failed after it had begun writing): until a checkpoint is
        # loaded, no step and no checkpoint save
        self.torn: Optional[str] = None
        self._loading = False  # inside a load reader while torn: Megatron-Core's own nested calls pass
        self.steps_streamed = 0
        self._stepped = False
        self.budget_note: Optional[str] = None
        self.setup_peak: Optional[int] = None
        self._held_after_backward = 0  # bytes the allocator held right after the first backward (budget)
        self._planned = False
        self.host_wait = copies_mod.Stopwatch()

    # -- plan -------------------------------------------------------------------------------------
    def plan_bytes(self) -> int:
        """Lay out every bundle; the host bytes the buffer needs."""
        offset = 0
        for part in self.parts:
            opt, inner = part.opt, part.inner
            movable = Movable(opt)
            part.model_of = model_params_of_masters(opt)
            moved_masters = set()
            for t in (m for g in getattr(opt, "shard_fp32_from_float16_groups", None) or () for m in g):
                if t is not None and movable.take(t):
                    moved_masters.add(id(t))
            part.bundles = [layout.bundle_of(part.index, gi, p, inner.param_groups[gi], inner, part.contract,
                                             movable, id(p) in moved_masters)
                            for gi, p in inner_params(inner)]
            part.shared = movable.shared
            offset = layout.place(part.bundles, offset)
        self._cut()
        self.device = _compute_device(self.parts)
        self._planned = True
        return offset

    def _cut(self) -> None:
        self.chunks = []
        for part in self.parts:
            part.chunks = layout.chunks_of(part.bundles, self.chunk_bytes, first_index=len(self.chunks))
            self.chunks += part.chunks

    @property
    def window_bytes(self) -> int:
        return layout.window_bytes(self.chunks)

    def prepare(self) -> None:
        """Before the first step: pin the host buffer once, for the plan (after every rank's check).
        A training after a parked one pins the same buffer again, in place."""
        import torch

        if self.buffer is not None and self.buffer.unpinned:
            self.buffer.repin()
            self.setup_peak = torch.cuda.max_memory_allocated(self.device) if self.copies.device_copies else None
            return
        nbytes = self.plan_bytes() if not self._planned else max((b.end for p in self.parts for b in p.bundles),
                                                                  default=0)
        cuda = self.device is not None and self.device.type == "cuda"
        self.buffer = hostmem.pin(nbytes)
        for part in self.parts:
            for e in part.entries():
                e.host = self.buffer.tensor[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape)
        self.copies = copies_mod.copies_for(self.device)
        self.window = copies_mod.Window(self.copies, self.window_bytes, self.device)
        self._take_all()  # masters made on the host at construction, states a load put elsewhere
        if not self.states_after_load:
            self._materialize()
        for part in self.parts:
            inner = part.inner
            prior = inner.__dict__.get("load_state_dict")  # e.g. Bridge's memory-efficient loader
            # the optimizers hold these hooks, the hooks hold the engine and the optimizers weakly
            self._loaders.set(inner, "load_state_dict",
                              functools.partial(_hook, weakref.ref(self), "_inner_load", "load_state_dict",
                                                weakref.ref(inner), prior))
            opt = part.opt
            prior = opt.__dict__.get("reload_model_params")
            self._loaders.set(opt, "reload_model_params", functools.partial(
                _hook, weakref.ref(self), "_reload_model_params", "reload_model_params", weakref.ref(opt), prior))
        if cuda:
            self.setup_peak = torch.cuda.max_memory_allocated(self.device)
            if nbytes:  # one DMA pass, so the first step does not pay for first use of the pages
                scratch = torch.empty(min(nbytes, 32 * 2**20), dtype=torch.uint8, device=self.device)  # small: it adds to the setup peak
                after = [self.copies.compute_event()]  # the scratch was allocated on the compute stream
                for start in range(0, nbytes, scratch.numel()):
                    piece = self.buffer.tensor[start:start + scratch.numel()]
                    self.copies.copy("h2d", scratch[:piece.numel()], piece, after)
                self.copies.host_wait_all()
                del scratch

    # -- bindings ---------------------------------------------------------------------------------
    def _streamed_entries(self):
        for part in self.parts:
            b = part.bindings
            for bundle in part.bundles:
                if not bundle.resident:
                    for e in bundle.entries:
                        if not e.dropped:
                            yield part, b, e

    def _away(self):
        """(part, bindings, entry, tensor) of every streamed entry bound elsewhere than its host view."""
        for part, b, e in self._streamed_entries():
            t = b.get(e)
            if t is not None and not same(t, e.host):
                yield part, b, e, t

    def on_host(self) -> bool:
        """Every streamed entry that exists is bound to its host view."""
        return next(self._away(), None) is None

    # -- states into their host views, before the first step --------------------------------------
    def _take(self, part: _Part, b: Bindings, e: Entry, t) -> None:
        """Copy `t` (what `e` is bound to) into e's host view now and bind the view; free t's memory.
        A master keeps a storage-less tensor on the compute device as its shell (reload binds it)."""
        self._check_takeover(part, e, t)
        e.host.copy_(t.detach())
        old = t.data  # a master is rebound in place (`master.data = view`): keep what it was bound to
        on_device = old.device == self.device
        if e.kind == MASTER:
            part.shells[id(e.param)] = old if on_device else self._new_shell(e)
            construction.unstage(e.param)
        b.set(e, e.host)
        if on_device and (e.kind == MASTER or owns_storage(old)):
            old.untyped_storage().resize_(0)  # shared by anyone still holding the old tensor: freed for all

    def _new_shell(self, e: Entry):
        """A tensor on the compute device with e's shape and no storage: what reload() binds a master
        to so Megatron-Core can attach its fp32 gradient (for a master that never lived there)."""
        import torch

        shell = torch.empty(e.shape, dtype=e.dtype, device=self.device)
        shell.untyped_storage().resize_(0)
        return shell

    def _take_all(self) -> None:
        for part, b, e, t in list(self._away()):
            self._take(part, b, e, t)

    def _materialize(self) -> None:
        """Every planned state the optimizer has not created yet, created by the optimizer's own code
        (contracts.py), one parameter at a time, and taken into its host view: from here on a state
        is never whole on the GPU, and a checkpoint load writes into the host views.

        Only for the optimizers that keep their step count in the param group (TE's and apex's
        FusedAdam). torch AdamW keeps a step per parameter, and Megatron-Core loads it only into an
        optimizer that has not stepped, through a path that fails loudly without a fix
        (scripts/resume_fix.py); states made here would turn that failure into a resume with the wrong
        step. Its states are made by its first step, inside the window, or by the load (on the host,
        where its masters are) and taken into their host views at once (_inner_load)."""
        for part in self.parts:
            if not part.contract.group_step:
                continue
            inner, b = part.inner, part.bindings
            for bundle in part.bundles:
                if bundle.resident or not any(e.kind != MASTER for e in bundle.entries):
                    continue
                if inner.state.get(bundle.param):
                    continue  # created already (a load, an earlier step): taken by _take_all
                part.contract.create(inner, bundle.param, inner.param_groups[bundle.group], self.device)
                for e in bundle.entries:
                    t = b.get(e)
                    if e.kind == MASTER or e.dropped or t is None or same(t, e.host):
                        continue
                    if tuple(t.shape) != e.shape or t.dtype != e.dtype:
                        self._keep(part, b, e, e.host)  # unlike the plan: dropped, with the warning
                        b.set(e, t.to(self.device))  # and on the device, where the update reads it
                        continue
                    self._take(part, b, e, t)

    def _inner_load(self, inner_ref, prior, *args, **kwargs):  # through _hook
        """The inner optimizer's load_state_dict, then its states back in their host views at once.
        Transformer Engine's loader makes every state anew (where the parameter is: the host), and
        Megatron-Core builds the sharded tensors torch_dist fills right after its own round trip
        through it (sharded_state_dict with is_loading): so the load writes into the pinned buffer."""
        inner = inner_ref()
        result = prior(*args, **kwargs) if prior is not None else type(inner).load_state_dict(inner, *args, **kwargs)
        if self.buffer is not None:
            self._take_all()
        return result

    def _reload_model_params(self, opt_ref, prior, *args, **kwargs):  # through _hook
        """Megatron-Core's reload_model_params (Bridge calls it after a load without optimizer state:
        finetuning, a release or HF checkpoint): the masters it holds are refreshed from the loaded
        weights where they are, the host views; states the optimizer derives from the parameters and
        Megatron-Core does not reload (TE's master_param) are made again as its first step makes them."""
        opt = opt_ref()
        part = next(p for p in self.parts if p._opt() is opt)
        result = prior(*args, **kwargs) if prior is not None else type(opt).reload_model_params(opt, *args, **kwargs)
        inner = part.inner
        for bundle in part.bundles:
            if inner.state.get(bundle.param):
                part.contract.reload_from_param(inner, bundle.param)
        return result

    def after_load(self) -> None:
        """A checkpoint load ran: what it bound elsewhere than the host views (Transformer Engine's
        loader makes new tensors) is copied into them now, and its memory freed."""
        if self.buffer is None:
            return
        self.synchronize()
        self._take_all()
        if self.states_after_load:
            self.states_after_load = False
            self._materialize()

    # -- the call sites ---------------------------------------------------------------------------
    def offload(self) -> int:
        """Start of forward-backward: make the host copy canonical. Whatever is bound elsewhere (the
        first step; states a checkpoint load put on the GPU) is copied to its host view, rebound
        there, and its GPU storage freed at release()."""
        if self.armed:
            self.settle()  # a rerun after finalization: the prefetched chunks go back unused
        if self.buffer is None:
            return 0
        if self.torn is not None:
            raise self._refusal("an optimizer step")
        pending = list(self._away())
        if pending:
            for part, _, e, t in pending:
                self._check_takeover(part, e, t)
            after = [self.copies.compute_event(), self.tail]
            last = None
            for _, _, e, t in pending:
                last = self.copies.copy("d2h", e.host, t.detach(), after)
            with self.host_wait:  # once per adoption (the first step, a load): the host copy is whole
                self.copies.host_wait(last)
            for part, b, e, t in pending:  # bound to the host only once its copy is whole
                if e.kind == MASTER:
                    part.shells[id(e.param)] = e.param.data  # keeps the GPU tensor: its storage is freed below
                self._adopted.append(e.param.data if e.kind == MASTER else t)
                b.set(e, e.host)
        return self.bytes

    def _check_takeover(self, part: _Part, e: Entry, t) -> None:
        """release() frees the storage of whatever offload() takes over: a tensor unlike the plan is
        refused before anything is copied or freed."""
        if tuple(t.shape) != e.shape:
            why = f"has shape {tuple(t.shape)}, not {e.shape}"
        elif t.dtype != e.dtype:
            why = f"is {t.dtype}, not {e.dtype}"
        elif t.device != self.device and t.device.type != "cpu":
            why = f"is on {t.device}, not {self.device} or the host"
        elif not t.untyped_storage().nbytes():
            why = "has no storage (it was freed): there is nothing to copy"
        elif not owns_storage(t):
            why = ("does not own its storage (a view of a larger tensor): freeing it would free memory that "
                   "other tensors use")
        else:
            return
        raise BridgeFGOError(
            f"{rank_prefix()}bridge_fgo cannot take over the {e.name} of a parameter of shape "
            f"{self._shape(part, e.param)} ({part.contract.name}): the tensor bound there {why}. Nothing was "
            "copied or freed. Fix: bind only states this optimizer makes itself (e.g. load a checkpoint saved "
            "with this model and optimizer configuration), or use chunk_mb=0, whose one window moves whatever "
            "states exist")

    def release(self) -> None:
        """After the param-buffer copy: free the GPU storage of what offload() adopted."""
        adopted, self._adopted = self._adopted, []
        for t in adopted:
            self.copies.free_after(t, self.tail)
            t.untyped_storage().resize_(0)  # shared by anyone still holding the old tensor: freed for all
        if adopted and self.budget_bytes is not None and self.budget_note is None and self.copies.device_copies:
            import torch

            # The budget is judged by the memory the allocator holds through the first step: give back,
            # once, what setup left cached (the masters just freed), so that is not counted
            torch.cuda.empty_cache()

    def reload(self) -> int:
        """Gradient finalization: arm the update, bind the streamed masters to storage-less GPU tensors
        (Megatron-Core attaches their gradients next), open the window and start the first two chunks'
        host-to-device copies, which overlap the gradient reduction."""
        if self.armed or self.buffer is None:
            return 0
        self.copies.collect()
        if not self.on_host():
            self.offload()
            self.release()
        self._drop_guards()  # the update's own copies are ordered after the tail on the GPU
        self.armed = True  # from here on settle() binds everything back, whatever fails
        self._started, self._copied_masters, self._stepped = set(), set(), False
        self._updated, self._done = [], set()
        for part in self.parts:
            for bundle in part.bundles:
                if bundle.resident:
                    continue
                for e in bundle.entries:
                    if e.kind == MASTER and not e.dropped:
                        e.param.data = self._shell(part, e.param)
            self._hooks.set(part.inner, "step", functools.partial(self._step, part))
            self._hooks.set(part.opt, "_copy_main_params_to_model_params", functools.partial(self._copy_rest, part))
        if self.budget_bytes is not None and self.budget_note is None and self.copies.device_copies:
            import torch

            # right after backward: the caching allocator still holds the forward-backward peak's memory
            # (only empty_cache gives it back, and Megatron calls that after this point)
            self._held_after_backward = max(self._held_after_backward,
                                            torch.cuda.memory_reserved(self.device))
        if self.chunks:
            self.window.open()
            for i in range(min(2, len(self.chunks))):
                self._h2d(i)
        return self.bytes

    def wait_reload(self) -> None:
        """Nothing to wait for before the step: each chunk waits for its own copy."""

    def settle(self, wait: bool = False) -> None:
        """train_step is over (done, skipped, failed, or a rerun): the hooks removed, every entry bound
        to its host view, the window given back. The last device-to-host copies may still run
        (READERS are guarded until they end) unless `wait`."""
        self._hooks.restore()
        was_armed, self.armed = self.armed, False
        if self.buffer is None:
            return
        if was_armed and self._updated and self.torn is None and any(
                p.bundles and p.index not in self._done for p in self.parts):
            # the step stopped between the optimizers of a chain (outside their updates): some stepped
            self._where = "between the optimizers of the chain"
            self.torn = self._failure()
            logger.error("%s%s. %s", rank_prefix(), self.torn, TORN_FIX)
        loose = list(self._away())
        if loose:  # a skipped step (masters on their shells) or a failed one
            self.copies.host_wait_all()
            for _, b, e, _ in loose:
                # never the window's data: a failed pass's is partial. Before any pass the host copy is
                # the states as before the step; after one, the states are torn anyway
                b.set(e, e.host)
        self.window.close()
        self.copies.end_step()
        if self._stepped:
            self.steps_streamed += 1
            self._stepped = False
        if wait:
            self.synchronize()
        if self.torn is not None or (not wait and self.tail is not None and was_armed):
            self._guard_readers()
        if self.budget_bytes is not None and self.steps_streamed == 1 and self.budget_note is None:
            self._apply_budget()

    def synchronize(self) -> None:
        """The host copy is whole and current: wait for every copy in flight."""
        if self.copies is not None:
            try:
                with self.host_wait:
                    self.copies.host_wait_all()
            except BaseException as exc:
                if self.tail is None or self.torn is not None:
                    raise
                self._raise_torn(exc, (
                    f"waiting for the last update's device-to-host copies failed ({type(exc).__name__}: {exc}), so "
                    "the optimizer states are torn: their host copy is part of that step, part of the one before"))
        self.tail = None
        self._drop_guards()

    def states_on(self) -> str:
        """Where the optimizer states are between steps, for status."""
        if self.buffer is None or self.buffer.freed:
            return "GPU"
        where = "host (parked, unpinned)" if self.buffer.unpinned else "host"
        return where + (f"; {self.resident_bytes} bytes on the GPU (gpu_budget_gib)" if self.resident_bytes else "")

    def park(self) -> None:
        """train() is over: every copy finished, the states stay where they are between steps (host
        memory) and the buffer is unpinned in place, so nothing stays locked and no GPU memory is taken
        back; a next train() pins it again (prepare), unpatch() brings the states to the GPU (close)."""
        self.settle(wait=True)
        if self.buffer is not None:
            self.buffer.unpin()

    def close(self) -> None:
        """Unpatch: states back on the GPU as ordinary tensors, the host buffer freed (exactly once)."""
        if self.torn is not None:
            logger.warning("%sunpatch(): %s. They go back to the GPU as they are, and checkpoint saves and optimizer "
                           "steps of them stay refused until a checkpoint is loaded. %s", rank_prefix(), self.torn,
                           TORN_FIX)
        self.settle(wait=True)
        if self.buffer is None:
            return
        for part in self.parts:
            try:
                b = part.bindings
            except BridgeFGOError:  # the optimizer is gone: nothing left to give back
                continue
            for bundle in part.bundles:
                for e in bundle.entries:
                    if b.get(e) is not None and not bundle.resident and not e.dropped:
                        self._to_device(part, b, e)
        if self.device is not None and self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)
        self._loaders.restore()
        for part in self.parts:
            for e in part.entries():
                e.host = None
        self.buffer.free()
        self.buffer = None
        self.window = None

    # -- the update -------------------------------------------------------------------------------
    def _shell(self, part: _Part, master):
        shell = part.shells.get(id(master))
        if shell is None:  # every master is adopted (offload) before an update is armed
            raise BridgeFGOError(f"{rank_prefix()}internal: a master weight was never moved to the host")
        return shell

    def _h2d(self, index: int) -> None:
        if index in self._started or index >= len(self.chunks):
            return
        chunk = self.chunks[index]
        slot = self.window.slot(index, chunk.nbytes)
        # the slot's memory is free on the compute stream, the chunk that was in it has left it, and
        # the host data is whole (the previous update's last copies)
        after = [self.copies.compute_event(), slot.d2h_done, self.tail]
        for start, end, at in chunk.spans:
            done = self.copies.copy("h2d", slot.view[at:at + end - start], self.buffer.tensor[start:end], after)
        slot.h2d_done = done
        self._started.add(index)

    def _views(self, chunk, slot) -> List[tuple]:
        out = []
        for bundle in chunk.bundles:
            for e in bundle.entries:
                at = chunk.window_offset[id(e)]
                out.append((e, slot.view[at:at + e.nbytes].view(e.dtype).view(e.shape)))
        return out

    def _step(self, part: _Part, *args, **kwargs):
        """The inner optimizer's step(), hooked while armed: resident parameters in place, then the
        part's chunks through the window. torch's step hooks and profiler marker fire once around it all."""
        inner = part.inner
        if not self.armed:
            return type(inner).step(inner, *args, **kwargs)
        if update.has_step_hooks(inner):  # they see the states as between steps: on the host, whole
            self.synchronize()
            for p, b, e, _ in list(self._away()):
                if p is part:
                    b.set(e, e.host)  # a master off its storage-less GPU tensor; its chunk binds it again
        return update.hooked_once(inner, functools.partial(self._update, part), *args, **kwargs)

    def _update(self, part: _Part, inner, *args, **kwargs):
        if args or kwargs:  # Megatron-Core calls step() bare; a closure would re-run the model per chunk
            raise BridgeFGOError("the streamed step cannot run an optimizer step with a closure; use chunk_mb=0")
        try:
            self._passes(part, inner)
        except BaseException as exc:
            if not self._updated:
                raise  # no pass began: nothing was written, settle() binds the states back as they were
            self._raise_torn(exc)
        self._done.add(part.index)
        self._stepped = True
        if part.chunks and part.chunks[-1].index == len(self.chunks) - 1:
            self.window.close()  # the chain's last chunk is through: the memory goes back now
        if update.has_step_hooks(inner):
            self.synchronize()  # post hooks read the states the update just wrote
        return None

    def _passes(self, part: _Part, inner) -> None:
        state = update.GroupState(inner)
        chain = f" of optimizer {part.index} of the chain" if len(self.parts) > 1 else ""
        resident = part.resident_params_by_group()
        if resident:  # overlaps the host-to-device copies already in flight
            self._where = f"in the pass over the parameters kept on the GPU (gpu_budget_gib){chain}"
            self._begin(part, resident)
            update.step_subset(inner, state, resident)
            masters = [p for ps in resident.values() for p in ps if id(p) in part.model_of]
            if masters:
                update.copy_masters(part.opt, masters, part.model_of)
                self._copied_masters.add(part.index)
        b = part.bindings
        for chunk in part.chunks:
            self._where = f"in chunk {chunk.index + 1} of {len(self.chunks)}{chain}"
            self._h2d(chunk.index)
            self._h2d(chunk.index + 1)  # the next chunk of the chain, the next optimizer's too
            slot = self.window.slots[chunk.index % 2]
            self.copies.compute_wait(slot.h2d_done)
            views = self._views(chunk, slot)
            for e, view in views:
                if not e.dropped and b.get(e) is not None:
                    b.set(e, view)
            by_group = chunk.params_by_group()
            self._begin(part, by_group)
            update.step_subset(inner, state, by_group)
            for e, view in views:
                self._keep(part, b, e, view)
            masters = [bd.param for bd in chunk.bundles if id(bd.param) in part.model_of]
            if masters:
                update.copy_masters(part.opt, masters, part.model_of)
                self._copied_masters.add(part.index)
            after = [self.copies.compute_event()]
            for start, end, at in chunk.spans:
                done = self.copies.copy("d2h", self.buffer.tensor[start:end], slot.view[at:at + end - start], after)
            slot.d2h_done = self.tail = done
            for e, view in views:
                if not e.dropped and b.get(e) is not None:
                    b.set(e, e.host)
            self._check_unplanned(part, b, chunk)
        self._where = f"while writing back the param groups' values after the last chunk{chain}"
        state.commit()

    # -- a failure in the middle of an update ------------------------------------------------------
    def _begin(self, part: _Part, params_by_group: Dict[int, list]) -> None:
        """A pass is about to write: in place (resident states, step counters, parameters it steps that
        are not in the window) and, once through, into model weights and the host copy."""
        self._updated += [(part, p) for ps in params_by_group.values() for p in ps]

    def _shape(self, part: _Part, param) -> tuple:
        """A parameter as its model sees it (a master is a flat shard of its model parameter)."""
        model = part.model_of.get(id(param))
        return tuple((model[1] if model is not None else param).shape)

    def _failure(self, exc: Optional[BaseException] = None) -> str:
        shapes = ", ".join(str(self._shape(part, p)) for part, p in self._updated[:3])
        more = ", ..." if len(self._updated) > 3 else ""
        cause = f" ({type(exc).__name__}: {exc})" if exc is not None else ""
        return (f"the optimizer step failed {self._where}{cause} after it had begun updating "
                f"{len(self._updated)} parameter(s) (shapes {shapes}{more}), so the optimizer states and "
                "model weights are torn: part of them are at the next step, the rest at this one")

    def _raise_torn(self, exc: BaseException, torn: Optional[str] = None):
        """Mark the states torn and raise: BridgeFGOError from `exc`; a BaseException that is not an
        Exception (KeyboardInterrupt, an in-process restart's RankShouldRestart) passes on as it is."""
        self.torn = torn or self._failure(exc)
        if not self.armed:
            self._guard_readers()  # else settle() does, once the update's hooks are gone
        if isinstance(exc, Exception):
            raise BridgeFGOError(f"{rank_prefix()}{self.torn}. bridge_fgo refuses optimizer steps and "
                                 f"checkpoint saves until a checkpoint is loaded. {TORN_FIX}") from exc
        logger.error("%s%s. %s", rank_prefix(), self.torn, TORN_FIX)
        raise exc

    def _refusal(self, what: str) -> BridgeFGOError:
        return BridgeFGOError(f"{rank_prefix()}{what} refused: {self.torn}. {TORN_FIX}")

    def _keep(self, part: _Part, b: Bindings, e: Entry, view) -> None:
        """After a chunk's update: a state the optimizer created in this update (its first) is copied
        into the window; one unlike the plan stays where the optimizer put it, with a warning."""
        if e.dropped:
            return
        t = b.get(e)
        if t is None or same(t, view):
            return
        if tuple(t.shape) == e.shape and t.dtype == e.dtype and type(t).__name__ in ("Tensor", "Parameter"):
            view.copy_(t)
            return
        e.dropped = True
        once(("unplanned", part.index, e.kind, e.key), logging.WARNING,
             "%s%s made %s of a parameter as %s %s, not the planned %s %s: it stays on the GPU (%d bytes)",
             rank_prefix(), part.contract.name, e.name, t.dtype, tuple(t.shape), e.dtype, e.shape, e.nbytes)

    def _check_unplanned(self, part: _Part, b: Bindings, chunk) -> None:
        import torch

        planned = {(id(e.param), e.key) for bd in chunk.bundles for e in bd.entries}
        for bd in chunk.bundles:
            for key, value in (part.inner.state.get(bd.param) or {}).items():
                if (isinstance(value, torch.Tensor) and value.dim() and value.numel()
                        and (id(bd.param), key) not in planned):
                    once(("unplanned-key", part.index, key), logging.WARNING,
                         "%s%s created state %r, which the plan did not foresee: it stays on the GPU",
                         rank_prefix(), part.contract.name, key)

    def _copy_rest(self, part: _Part, *args, **kwargs):
        return update.copy_rest(part.opt, part.index in self._copied_masters, *args, **kwargs)

    # -- readers between steps --------------------------------------------------------------------
    def _guard_readers(self) -> None:
        """READERS wrapped on the instances while the tail is in flight or the states are torn (then the
        inner optimizers' step() too)."""
        if self.armed:
            return  # settle() guards, once the update's own hooks are gone
        self.guards.restore()
        for part in self.parts:
            opt = part.opt
            for name in READERS:
                method = getattr(type(opt), name, None)
                if callable(method):
                    # the optimizer holds the guard: the guard holds it weakly
                    self.guards.set(opt, name, functools.partial(self._guarded, weakref.ref(opt), name))
            if self.torn is not None:
                self.guards.set(part.inner, "step", self._torn_step)

    def _guarded(self, opt_ref, name, *args, **kwargs):
        opt = opt_ref()
        if self.torn is None:
            self.synchronize()  # drops every guard: later calls go straight to Megatron-Core
            return getattr(opt, name)(*args, **kwargs)
        method = getattr(type(opt), name)
        if self._loading:  # Megatron-Core's own calls inside a load (sharded_state_dict calls state_dict)
            return method(opt, *args, **kwargs)
        loads = name in LOADS or (name == "sharded_state_dict" and _is_loading(method, opt, args, kwargs))
        if not loads and (name in SAVES or name == "sharded_state_dict"):
            raise self._refusal(f"{type(opt).__name__}.{name}(), a checkpoint save of the optimizer states,")
        self.synchronize()
        if not loads:
            return method(opt, *args, **kwargs)
        self._loading = True
        try:
            out = method(opt, *args, **kwargs)
        finally:
            self._loading = False
        if name in LOADS:  # sharded_state_dict(is_loading=True) only builds what the load then fills
            self.torn = None
            self.guards.restore()
            logger.info("%s%s.%s() loaded a checkpoint: the optimizer states are whole again", rank_prefix(),
                        type(opt).__name__, name)
        return out

    def _torn_step(self, *args, **kwargs):
        raise self._refusal("an optimizer step")

    def _drop_guards(self) -> None:
        if self.torn is None:  # torn states keep their guards until a load
            self.guards.restore()

    # -- memory budget ----------------------------------------------------------------------------
    def _apply_budget(self) -> None:
        """After the first streamed step: keep resident as many bundles as fit under the budget."""
        peak, basis = budget.held(self.device, self._held_after_backward)
        kept = budget.choose([bd for part in self.parts for bd in part.bundles], self.budget_bytes, peak)
        if kept is None:
            self.budget_note = (f"gpu_budget_gib {self.budget_bytes / GiB:.2f} GiB cannot be met: the {basis} is "
                                f"{peak / GiB:.2f} GiB; everything stays offloaded")
            logger.warning("%s%s", rank_prefix(), self.budget_note)
            return
        self.synchronize()
        for bundle in kept:
            part = self.parts[bundle.part]
            b = part.bindings
            for e in bundle.entries:
                if not e.dropped and b.get(e) is not None:
                    self._to_device(part, b, e)
            bundle.resident = True
        self._cut()
        self.window = copies_mod.Window(self.copies, self.window_bytes, self.device)
        self.budget_note = (f"gpu_budget_gib {self.budget_bytes / GiB:.2f} GiB, {basis} {peak / GiB:.2f} GiB: "
                            f"{len(kept)} parameter(s) keep their states on the GPU "
                            f"({self.resident_bytes / GiB:.2f} GiB), {self.bytes / GiB:.2f} GiB move each way per "
                            f"step in {len(self.chunks)} chunk(s)")
        logger.info("%s%s", rank_prefix(), self.budget_note)

    def _to_device(self, part: _Part, b: Bindings, e: Entry) -> None:
        """An entry back on the GPU as an ordinary tensor (a master in its own GPU tensor again)."""
        if e.kind == MASTER:
            shell = part.shells.pop(id(e.param), None)
            if shell is not None:
                shell.untyped_storage().resize_(e.nbytes)
                shell.copy_(e.host)
                e.param.data = shell
            else:
                e.param.data = e.host.to(self.device, copy=True)
        else:
            b.set(e, e.host.to(self.device, copy=True))

    # -- figures ----------------------------------------------------------------------------------
    @property
    def bytes(self) -> int:
        """What moves each way per step."""
        return sum(e.nbytes for part in self.parts for bd in part.bundles if not bd.resident
                   for e in bd.entries if not e.dropped)

    @property
    def resident_bytes(self) -> int:
        """What a memory budget keeps on the GPU instead."""
        return sum(e.nbytes for part in self.parts for bd in part.bundles if bd.resident
                   for e in bd.entries if not e.dropped)

    @property
    def pinned_bytes(self) -> int:
        return self.buffer.nbytes if self.buffer is not None else 0

    @property
    def master_bytes(self) -> int:
        return sum(e.nbytes for part in self.parts for e in part.entries() if e.kind == MASTER)

    @property
    def tensors(self) -> int:
        return sum(len(part.entries()) for part in self.parts)

    def optimizers(self) -> List[str]:
        out = []
        for part in self.parts:
            inner = part._inner()
            if inner is not None:
                out.append(contracts.describe(inner))
        return out
