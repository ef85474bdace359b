"""The snapshot an asynchronous checkpoint save hands its writer: one tensor per host entry, each owning
exactly its storage, made once and reused by every save of the run.

Without it, both writers (Megatron-Core's and nvidia-resiliency-ext's FileSystemWriterAsync) clone every
host state inside the save call (a view of the pinned buffer: its storage is larger than the tensor), and
pickling the clones for Bridge's persistent worker moves each into fresh /dev/shm pages: two copies and
fresh pages at every save, 1.65-1.71x the stall without offload on data-parallel 2 (4xH100, 2026-11-27).

With it (read in nvidia-resiliency-ext 0.6.0 and Megatron-Core 0.19.2):
- a CPU tensor whose storage is exactly the tensor is not cloned (prepare_write_data's test:
  untyped_storage().size() == numel * itemsize), and one whose storage is already shared memory is pickled
  by handle (torch's reductions move a storage into shared memory only when it is not there yet);
- the persistent worker drops what a request handed it once the request is written (`del item`,
  gc.collect(); only GPU tensors are cached there), so keeping the snapshot holds no second copy;
- so a save copies the host states once, at memcpy speed, from several threads, into pages faulted in long
  before (by a thread started at prepare()), or, at the first save after a checkpoint load, just before.

One snapshot, reused, and a second one where saves overlap: a save that starts while the previous one is
still being written (Bridge starts it: "Starting a checkpoint save before previous has finished") gets a second
set of tensors, made then, once, where every local rank has the room for it now (hostmem.room_for), and the
saves alternate between the two from then on, as without offload each pending save holds its own copy. Where
there is no room, or two saves are pending, the save_checkpoint call site finishes the pending ones first
(instrument/saves.py, finish_pending). So no writer still reads a set when a save rewrites it, and the next
optimizer steps write the pinned buffer, never a snapshot. Only the states
handed to the writer as whole host views are served this way (dp_reshardable, Bridge's default, and
Megatron-FSDP's fsdp_dtensor, whose DTensors are presented over the snapshot for the save: stand_in);
fully_reshardable hands it gathered copies, which it clones as without offload, and so is a part of a view
(Megatron-FSDP's SwiGLU split).

Route "shm" (the persistent worker): shared storages, /dev/shm checked for them before the first step;
"memory" (Megatron-Core's forked worker reads this process's pages): ordinary tensors. Both are counted
by the host-memory check (snapshot_per_rank); a second set by hostmem.room_for, when it is made.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Dict, List, Optional, Tuple

from ...hostmem import spread
from ...hostmem.common import fmt_bytes
from ...log import logger, once, rank_prefix
from .plan import Plan

SHM, MEMORY = "shm", "memory"
FD_MARGIN = 256       # file descriptors left to everything else when each shared storage keeps one open


class Snapshot:
    def __init__(self, plan: Plan):
        self.plan = plan
        self.route: Optional[str] = None  # set by the adapter: keep a snapshot for this run's saves
        self.tensors: Dict[int, Tuple[object, object]] = {}  # id(entry) -> (entry, its snapshot tensor)
        self._other: Dict[int, Tuple[object, object]] = {}  # the second set, where saves overlap (make_other)
        self._other_new = False  # made for the save being decided (let go if the ranks finish the pending one)
        self.nbytes = 0
        self._faulting: Optional[threading.Thread] = None
        self.fault_s = 0.0    # the background fault-in's own time
        self.copy_s: List[float] = []  # each save's copy into the snapshot
        self.served = 0       # tensors handed to the writer from the snapshot, last save
        self._unfaulted = False  # allocated, its fault-in not started yet
        self._later = False   # beside a load: made and faulted in at the first save
        self._taken = False   # copied for the save in progress
        self._by_ptr: Optional[Dict[int, Tuple[object, object]]] = None  # host view's address -> (entry, snapshot)
        self.active = False   # inside saving() with a snapshot: checkpoint_io hands Megatron-FSDP's writer its tensors

    @property
    def kept(self) -> bool:
        self._ready()
        return bool(self.tensors)

    # -- made once ---------------------------------------------------------------------------------
    def allocate(self, fault: bool = True) -> None:
        """One tensor per streamed entry (route shm: its own shared storage), faulted in by a background
        thread; nothing when no route is set. Not `fault` (beside a checkpoint load): nothing now, the snapshot
        is made and faulted in at the first save (saving()). Not by a thread after the load: making it holds
        the GIL throughout (torch's `_new_shared` allocates the pages: 0.19 s a GiB with the main thread's Python
        stalled up to 0.1 s at a time, 2-core host, 2026-11-28), which the load's end and the first iterations
        would wait on. A snapshot that cannot be made is said once, and the writers' own copies serve the saves
        as before."""
        if self.route is None or self.tensors or self._later:
            return
        if not fault:
            self._later = True
            return
        self._make()
        self._unfaulted = bool(self.tensors)
        self.fault_in()

    def _make(self) -> None:
        made, why = self._build()
        if why is not None:
            once(("snapshot-unmade",), logging.WARNING,
                 "%scfg.checkpoint.async_save: the snapshot of the optimizer states kept for asynchronous saves "
                 "could not be made (%s); every such save copies them as the checkpoint writer does (twice, into "
                 "fresh pages: a longer stall)", rank_prefix(), why)
            return
        self.tensors = made
        self.nbytes = sum(e.nbytes for e, _ in self.tensors.values())
        logger.info("%sasynchronous checkpoint saves: a snapshot of the host states kept for the run, %d tensor(s), "
                    "%s in %s, its pages faulted in from several threads; each save copies the states into it "
                    "once and hands it to the writer, which neither clones nor moves it", rank_prefix(),
                    len(self.tensors), fmt_bytes(self.nbytes), self._where())

    def _where(self) -> str:
        return "/dev/shm (shared memory)" if self.route == SHM else "this process's memory"

    def _build(self) -> Tuple[Dict[int, Tuple[object, object]], Optional[str]]:
        """One tensor per streamed entry with host bytes ({} and why not, where they cannot be made)."""
        import torch

        entries = [e for _, _, e in self.plan.streamed_entries() if e.nbytes and e.host is not None]
        why = self._fd_room(len(entries)) if self.route == SHM else None
        if why is not None:
            return {}, why
        made = {}
        try:
            for e in entries:  # (a shared storage is allocated whole here: posix_fallocate in /dev/shm)
                if self.route == SHM:
                    t = torch.empty(0, dtype=e.dtype).set_(torch.UntypedStorage._new_shared(e.nbytes), 0, e.shape)
                else:
                    t = torch.empty(e.shape, dtype=e.dtype)
                made[id(e)] = (e, t)
        except (RuntimeError, OSError) as exc:
            return {}, f"{type(exc).__name__}: {exc}"
        return made, None

    # -- a second set, where saves overlap ------------------------------------------------------------
    def make_other(self, nbytes: int, in_shm: bool) -> Optional[str]:
        """Before a save that starts while the previous one is still being written (its writer reads the current
        set): why this rank cannot hold a second copy of the host states beside it now (None: it can). With a
        snapshot, the second set exists or is made here (its pages faulted in by the save's copy into it), after
        hostmem.room_for; without one, the writer copies `nbytes` itself, checked the same way (`in_shm`: through
        /dev/shm, the persistent worker's route). Every rank asks before the ranks agree (instrument/saves.py); then alternate()."""
        from ... import hostmem

        self._ready()
        if self._other:
            return None
        why = hostmem.room_for(self.nbytes or nbytes, in_shm=in_shm)
        if why is not None or not self.tensors:
            return why
        made, why = self._build()
        if why is not None:
            return f"the second snapshot could not be made ({why})"
        self._other, self._other_new = made, True
        logger.info("%sasynchronous checkpoint saves: a save started while the previous one was still being written "
                    "from the snapshot, so a second snapshot was made for it (%d tensor(s), %s in %s, room checked "
                    "on every local rank); the saves alternate between the two from now on, as without offload each "
                    "pending save holds its own copy", rank_prefix(), len(made), fmt_bytes(self.nbytes), self._where())
        return None

    def alternate(self, agreed: bool) -> None:
        """After make_other() on every rank: `agreed` (every rank has the room), the next save uses the other set
        and the pending one goes on reading this one; otherwise a set made for this save is let go (the pending
        save is finished instead, and the next save rewrites this set)."""
        if agreed and self._other:
            self.tensors, self._other = self._other, self.tensors
        elif self._other_new:
            self._other = {}
        self._other_new = False

    def fault_in(self) -> None:
        """The snapshot's pages faulted in by a background thread, once; made there first where allocate()
        left it for later. Never a second thread while one runs: its zeros would land on a save's copy."""
        if self._faulting is not None:
            return
        if self._later:
            self._later = False
            self._faulting = threading.Thread(target=self._make_and_fault, name="bridge_fgo-snapshot", daemon=True)
            self._faulting.start()
            return
        if not self.tensors or not self._unfaulted:
            return
        self._unfaulted = False
        storages = [t for _, t in self.tensors.values()]
        self._faulting = threading.Thread(target=self._fault_in, args=(storages,), name="bridge_fgo-snapshot",
                                          daemon=True)
        self._faulting.start()

    def _make_and_fault(self) -> None:
        self._make()
        if self.tensors:
            self._fault_in([t for _, t in self.tensors.values()])

    def _ready(self) -> None:
        """The background thread's work done (made, faulted in): before the snapshot is read or dropped."""
        if self._faulting is not None:
            self._faulting.join()
            self._faulting = None

    def _fault_in(self, tensors) -> None:
        t0 = time.perf_counter()
        spread.touch(tensors, "snapshot-touch")  # a few threads, done sooner; training goes on meanwhile
        self.fault_s = time.perf_counter() - t0

    @staticmethod
    def _fd_room(n: int) -> Optional[str]:
        """Each shared storage keeps a file descriptor open (torch's file_descriptor strategy): raise the soft
        limit where the hard one allows; why not, otherwise."""
        import torch.multiprocessing as tmp

        if tmp.get_sharing_strategy() != "file_descriptor":
            return None
        try:
            import resource

            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            need = n + FD_MARGIN + len(os.listdir("/proc/self/fd"))
            if soft != resource.RLIM_INFINITY and soft < need:
                if hard != resource.RLIM_INFINITY and hard < need:
                    return (f"{n} shared tensors keep {n} file descriptors open, and RLIMIT_NOFILE is {soft} (hard "
                            f"{hard}); fix: ulimit -n {need}")
                resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
        except (ImportError, OSError, ValueError) as exc:
            return f"RLIMIT_NOFILE: {type(exc).__name__}: {exc}"
        return None

    def drop(self) -> None:
        """Let the snapshot go (the end of training, close): a save still writing it holds its own references."""
        self._ready()
        self.tensors, self.nbytes, self._taken, self._unfaulted, self._later = {}, 0, False, False, False
        self._other, self._other_new = {}, False

    # -- each save -----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def saving(self):
        """Around one asynchronous save call: each DistributedOptimizer's sharded_state_dict, when built for
        saving, hands the writer the snapshot (the states copied into it at the first such call) instead of
        views of the pinned buffer, and so do Megatron-FSDP's DTensors presented for the call (`active`: the
        engine's checkpoint_io). Nothing changes without a snapshot."""
        self.fault_in()  # (what a load left for later is made here, at the first save)
        self._ready()
        if not self.tensors:
            yield
            return
        import functools
        import weakref

        from .. import subset

        self._taken, self.served, self._by_ptr, self.active = False, 0, None, True
        hooks = subset.Shadows()
        for part in self.plan.parts:
            opt = part.opt
            if callable(getattr(type(opt), "sharded_state_dict", None)):
                prior = opt.__dict__.get("sharded_state_dict")  # a guard of the readers, when one is set
                hooks.set(opt, "sharded_state_dict", functools.partial(self._sharded, weakref.ref(opt), prior))
        try:
            yield
        finally:
            hooks.restore()
            self._taken, self._by_ptr, self.active = False, None, False

    def _sharded(self, opt_ref, prior, *args, **kwargs):
        from .readers import _is_loading

        opt = opt_ref()
        method = type(opt).sharded_state_dict
        out = prior(*args, **kwargs) if prior is not None else method(opt, *args, **kwargs)
        if out is not None and not _is_loading(method, opt, args, kwargs):
            self.substitute(out)
        return out

    def take(self) -> None:
        """The host states copied into the snapshot (once per save): after the fault-in, from several threads.
        The last update's copies were waited for before (the save's readers' guards)."""
        if self._taken or not self.tensors:
            return  # (made and faulted in: saving() waited for the background thread before any save)
        t0 = time.perf_counter()
        workers = spread.copy(((snap, e.host) for e, snap in self.tensors.values()), "snapshot")
        self.copy_s.append(time.perf_counter() - t0)
        self._taken = True
        logger.debug("%ssnapshot: %s copied in %.3f s from %d thread(s)", rank_prefix(), fmt_bytes(self.nbytes),
                     self.copy_s[-1], workers)

    def substitute(self, sharded_state_dict) -> None:
        """In a sharded state dict built for saving: each ShardedTensor whose data is a whole host view gets
        that entry's snapshot instead (the same values: taken just before)."""
        if not self.tensors:
            return
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        stack = [sharded_state_dict]
        while stack:
            x = stack.pop()
            if isinstance(x, dict):
                stack.extend(x.values())
            elif isinstance(x, (list, tuple)):
                stack.extend(x)
            elif isinstance(x, ShardedTensor):
                x.data = self.stand_in(x.data)

    def stand_in(self, t):
        """What a save hands its writer for host tensor `t`: the snapshot's tensor of the entry `t` is the whole
        host view of (the same values: taken just before), else `t` itself (a part of a view, anything else: left
        to the writer's own copy). Megatron-FSDP's DTensors take theirs through fsdp.Layout.checkpoint_io."""
        if not self.tensors or getattr(t, "device", None) is None or t.device.type != "cpu":
            return t
        if self._by_ptr is None:
            self._by_ptr = {e.host.data_ptr(): (e, snap) for e, snap in self.tensors.values()}
        hit = self._by_ptr.get(t.data_ptr())
        if hit is None:
            return t
        e, snap = hit
        if t.dtype != e.dtype or t.numel() * t.element_size() != e.nbytes or not t.is_contiguous():
            return t
        self.take()
        self.served += 1
        return snap.view(t.shape)
