"""The streamed step's memory and every copy between host and GPU: the pinned host buffer with each
entry's host view, the GPU window, the chunks' copies (ordered by events, copies.py), and states
taken into their host views (at construction, after a load, at the first step) or given back to
the GPU (a memory budget, unpatch).

The tail: the last chunks' device-to-host copies may still be in flight when train_step returns (they
overlap the next forward). `tail` is the last of them until someone waits (wait_all).
"""
from __future__ import annotations

import contextlib
import logging
from typing import List

from ... import hostmem
from ...errors import BridgeFGOError
from ...hostmem.common import fmt_bytes
from ...log import logger, once, rank_prefix
from .. import construction, copies as copies_mod
from ..tensors import MASTER, Bindings, Entry, aligned, owns_storage, same
from ..uninterrupted import each
from .plan import Part, Plan

WARM_BYTES = 32 * 2**20  # the first DMA pass's GPU scratch: small, it adds to the setup peak


class Transfers:
    def __init__(self, plan: Plan):
        self.plan = plan
        self.buffer = None
        self.copies = None
        self.window = None
        self.tail = None  # the last device-to-host copy of the last update
        self.adopted: List[object] = []  # GPU tensors copied to the host, freed at release()
        self.started: set = set()  # chunk indices whose host-to-device copy was started this update
        self.host_wait = copies_mod.Stopwatch()

    @property
    def device(self):
        return self.plan.device

    # -- the host buffer --------------------------------------------------------------------------
    def pin(self, defer: bool = False, start: bool = True, touch: bool = True) -> None:
        """The host buffer pinned once, for the plan; each entry's host view in it; the window. `defer`, `start`,
        `touch`: hostmem.pin's (registered beside a load's reads, or after them; its writes fault the pages in)."""
        self.buffer = hostmem.pin(self.plan.lay_out(), defer=defer, start=start, touch=touch)
        for part in self.plan.parts:
            for e in part.entries():
                e.host = self.buffer.tensor[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape)
        self.copies = copies_mod.copies_for(self.device)
        self.new_window()

    def ready(self) -> None:
        """The buffer's deferred registration finished (hostmem.pin(defer=True)): before any copy between it
        and the GPU."""
        if self.buffer is not None and self.buffer.pending:
            self.buffer.wait()
            if self.buffer.registered:
                logger.info("%sthe %s host buffer's cudaHostRegister ran beside %s: %.2f s, of which %.2f s were "
                            "waited for", rank_prefix(), fmt_bytes(self.buffer.nbytes), "what followed the checkpoint "
                            "load" if self.buffer.held_back else "the checkpoint load", self.buffer.register_s,
                            self.buffer.waited_s)

    def new_window(self) -> None:
        self.window = copies_mod.Window(self.copies, self.plan.window_sizes, self.device)

    def warm(self, wait: bool = True) -> None:
        """One DMA pass over the buffer, so the first step does not pay for first use of the pages. Not `wait`:
        queued on the copy stream, which the first step's copies follow (after a checkpoint load, whose end
        would wait 0.07 s for 3.8 GB); every wait for the copies in flight (synchronize: park, close) waits
        for it too."""
        import torch

        self.ready()
        nbytes = self.buffer.nbytes
        if not nbytes:
            return
        scratch = torch.empty(min(nbytes, WARM_BYTES), dtype=torch.uint8, device=self.device)
        after = [self.copies.compute_event()]  # the scratch was allocated on the compute stream
        for start in range(0, nbytes, scratch.numel()):
            piece = self.buffer.tensor[start:start + scratch.numel()]
            self.copies.copy("h2d", scratch[:piece.numel()], piece, after)
        if wait:
            self.copies.host_wait_all()
        else:
            self.copies.retire(scratch)  # the allocator reuses it only once the copy streams are past it
        del scratch

    def free(self) -> None:
        for part in self.plan.parts:
            for e in part.entries():
                e.host = None
        self.buffer.free()
        self.buffer = None
        self.window = None

    # -- states into their host views -------------------------------------------------------------
    def take(self, part: Part, b: Bindings, e: Entry, t, free: bool = True, copied: bool = False) -> None:
        """Copy `t` (what `e` is bound to) into e's host view now (unless `copied`) and bind the view; free t's
        memory if it is on the compute device and `free` (not a loaded tensor: the load's or its caller's own).
        A master keeps a storage-less tensor on the compute device as its shell (reload binds it)."""
        stays = _stays(part, e)
        self.check_takeover(part, e, t, frees=free and not stays)
        if t.device.type != "cpu":
            self.ready()
        if not copied:
            e.host.copy_(t.detach())
        if e.kind == MASTER:
            self.plan.writes += 1
        old = t.data  # a master is rebound in place (`master.data = view`): keep what it was bound to
        on_device = old.device == self.device
        if e.kind == MASTER:
            part.shells[id(e.param)] = old if on_device and not stays else self.new_shell(e)
            construction.unstage(e.param)
        b.set(e, e.host)
        if free and on_device and not stays and (e.kind == MASTER or owns_storage(old)):
            old.untyped_storage().resize_(0)  # shared by anyone still holding the old tensor: freed for all

    def new_shell(self, e: Entry):
        """A tensor on the compute device with e's shape and no storage: what reload() binds a master
        to so Megatron-Core can attach its fp32 gradient (for a master that never lived there)."""
        import torch

        shell = torch.empty(e.shape, dtype=e.dtype, device=self.device)
        shell.untyped_storage().resize_(0)
        return shell

    def take_all(self, free: bool = True) -> None:
        away = list(self.plan.away())
        for part, _, e, t in away:  # every one checked before anything is copied or freed
            self.check_takeover(part, e, t, frees=free and not _stays(part, e))
        copied = _copy_host_ones(away)
        for part, b, e, t in away:
            self.take(part, b, e, t, free, copied=id(e) in copied)
        self.retire_flats()

    def retire_flats(self) -> None:
        """Megatron-FSDP's main-weight buffers none of whose masters is bound to them any more: given up."""
        for part in self.plan.parts:
            if part.fsdp is not None:
                part.fsdp.retire()

    def materialize(self, zeroed: bool = False) -> None:
        """Every planned state the optimizer has not created yet, created by the optimizer's own code
        (contracts.py), one parameter at a time, and taken into its host view: from here on a state
        is never whole on the GPU, and a checkpoint load writes into the host views.

        Only for the optimizers that keep their step count in the param group (TE's and apex's
        FusedAdam). torch AdamW keeps a step per parameter, and Megatron-Core loads it only into an
        optimizer that has not stepped, through a path that fails loudly without a fix
        (scripts/resume_fix.py); states made here would turn that failure into a resume with the wrong
        step. Its states are made by its first step, inside the window, or by the load (on the host,
        where its masters are) and taken into their host views at once (readers.py). `zeroed`: the views
        of the states not made yet read as zero (the buffer as the kernel handed it out, prepare())."""
        for part in self.plan.parts:
            if not part.contract.group_step:
                continue
            inner, b = part.inner, part.bindings
            with part.contract.made_in(inner, part.view_of(), zeroed):  # in the host views where it allows
                self._materialize(part, inner, b)

    def _materialize(self, part: Part, inner, b: Bindings) -> None:
        for bundle in part.bundles:
            if bundle.resident or not any(e.kind != MASTER for e in bundle.entries):
                continue
            if inner.state.get(bundle.param):
                continue  # created already (a load, an earlier step): taken by take_all
            part.contract.create(inner, bundle.param, inner.param_groups[bundle.group], self.device)
            for e in bundle.entries:
                t = b.get(e)
                if e.kind == MASTER or e.dropped or t is None or same(t, e.host):
                    continue
                if tuple(t.shape) != e.shape or t.dtype != e.dtype:
                    keep(part, b, e, e.host)  # unlike the plan: dropped, with the warning
                    b.set(e, t.to(self.device))  # and on the device, where the update reads it
                    continue
                self.take(part, b, e, t)

    def check_takeover(self, part: Part, e: Entry, t, frees: bool = True) -> None:
        """A tensor unlike the plan is refused before anything is copied or freed; one whose storage
        would be freed (`frees`: taken over on the compute device) must own all of it."""
        why = _unlike(e, t, self.device, frees)
        if why is None:
            return
        raise BridgeFGOError(
            f"{rank_prefix()}bridge_fgo cannot take over the {e.name} of a parameter of shape "
            f"{part.shape(e.param)} ({part.contract.name}): the tensor bound there {why}. Nothing was "
            "copied or freed. Fix: bind only states this optimizer makes itself (e.g. load a checkpoint saved "
            "with this model and optimizer configuration), or use chunk_mb=0, whose one window moves whatever "
            "states exist")

    def adopt(self) -> None:
        """Whatever is bound elsewhere than its host view (the first step; states a checkpoint load put
        on the GPU) copied to the view and bound there once whole; its GPU storage freed at release()."""
        pending = list(self.plan.away())
        if not pending:
            return
        self.ready()
        for part, _, e, t in pending:
            self.check_takeover(part, e, t)  # (frees only what is on the compute device)
        if any(e.kind == MASTER for _, _, e, _ in pending):
            self.plan.writes += 1
        after = [self.copies.compute_event(), self.tail]
        last = None
        for _, _, e, t in pending:
            last = self.copies.copy("d2h", e.host, t.detach(), after)
        with self.host_wait:  # once per adoption (the first step, a load): the host copy is whole
            self.copies.host_wait(last)
        for part, b, e, t in pending:  # bound to the host only once its copy is whole
            on_device = t.device == self.device
            flat = part.flat_master(e)
            if e.kind == MASTER:  # keeps the GPU tensor as its shell: its storage is freed at release()
                part.shells[id(e.param)] = e.param.data if on_device and not flat else self.new_shell(e)
            if on_device and not flat:  # host memory bridge_fgo did not pin is never emptied: dropped, not freed
                self.adopted.append(e.param.data if e.kind == MASTER else t)
            b.set(e, e.host)
        self.retire_flats()

    def release(self) -> bool:
        """Free the GPU storage of what adopt() took over; whether there was any."""
        adopted, self.adopted = self.adopted, []
        for t in adopted:
            self.copies.free_after(t, self.tail)
            t.untyped_storage().resize_(0)  # shared by anyone still holding the old tensor: freed for all
        return bool(adopted)

    def to_device(self, part: Part, b: Bindings, e: Entry) -> None:
        """An entry back on the GPU as an ordinary tensor (a master in its own GPU tensor again)."""
        self.ready()
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

    # -- the chunks' copies -----------------------------------------------------------------------
    def h2d(self, index: int) -> None:
        """Start chunk `index`'s host-to-device copy into its window slot (once per update; `started`
        is emptied when the window closes)."""
        chunks = self.plan.chunks
        if index in self.started or index >= len(chunks):
            return
        self.ready()
        chunk = chunks[index]
        slot = self.window.slot(index, chunk.nbytes)
        # the slot's memory is free on the compute stream, the chunk that was in it has left it, and
        # the host data is whole (the previous update's last copies)
        after = [self.copies.compute_event(), slot.d2h_done, self.tail]
        for start, end, at in chunk.spans:
            done = self.copies.copy("h2d", slot.view[at:at + end - start], self.buffer.tensor[start:end], after)
        slot.h2d_done = done
        self.started.add(index)

    def d2h(self, chunk, slot) -> None:
        """Chunk's device-to-host copy, after what the compute stream has done to its slot: the tail."""
        after = [self.copies.compute_event()]
        for start, end, at in chunk.spans:
            done = self.copies.copy("d2h", self.buffer.tensor[start:end], slot.view[at:at + end - start], after)
        slot.d2h_done = self.tail = done

    def close_window(self) -> None:
        """The update is over (or never came): every slot given back, no chunk started."""
        self.window.close()
        self.started = set()

    @contextlib.contextmanager
    def on_device(self, entries: List[Entry], write_back: bool = False):
        """These entries' host copies in one GPU scratch tensor, brought after every copy in flight and
        yielded as (entry, view) pairs (outside an update: a master's norm, a qk_clip). With write_back
        (masters only) each master is bound to its view meanwhile, then copied back into its host copy
        (the new tail, which readers and the next update's copies wait for) and bound as it was."""
        import torch

        self.ready()
        at, end = [], 0
        for e in entries:
            at.append(aligned(end, e.nbytes))
            end = at[-1] + e.nbytes
        scratch = torch.empty(end, dtype=torch.uint8, device=self.device)
        views, priors = [], []
        try:  # from here the scratch may have copies queued: retired (never freed under them) in any case
            after = [self.copies.compute_event(), self.tail]
            done = None
            for e, start in zip(entries, at):
                view = scratch[start:start + e.nbytes].view(e.dtype).view(e.shape)
                done = self.copies.copy("h2d", view, e.host, after)
                views.append((e, view))
            self.copies.compute_wait(done, timed=False)  # between steps: no update's exposed wait
            if write_back:
                for e, view in views:
                    priors.append(e.param.data)
                    e.param.data = view
            yield views
        finally:
            try:
                if write_back and priors:
                    after = [self.copies.compute_event()]
                    for (e, view), prior in zip(views, priors):
                        self.tail = self.copies.copy("d2h", e.host, view, after)
                    # every master off the scratch, which is retired next, an interrupt included
                    each(list(zip(views, priors)), _bind_prior)
            finally:
                self.copies.retire(scratch)  # reused only after the copies that read or wrote it

    @staticmethod
    def views(chunk, slot) -> List[tuple]:
        """(entry, its view in the window slot) of every entry of the chunk."""
        out = []
        for bundle in chunk.bundles:
            for e in bundle.entries:
                at = chunk.window_offset[id(e)]
                out.append((e, slot.view[at:at + e.nbytes].view(e.dtype).view(e.shape)))
        return out

    def wait_all(self) -> None:
        """Every copy in flight done (the tail included); may raise what a copy raised."""
        if self.copies is not None:
            with self.host_wait:
                self.copies.host_wait_all()
        self.tail = None


def _unlike(e: Entry, t, device, frees: bool):
    """Why `t` cannot be taken into e's host view (None: it can)."""
    if tuple(t.shape) != e.shape:
        return f"has shape {tuple(t.shape)}, not {e.shape}"
    if t.dtype != e.dtype:
        return f"is {t.dtype}, not {e.dtype}"
    if t.device != device and t.device.type != "cpu":
        return f"is on {t.device}, not {device} or the host"
    if not t.untyped_storage().nbytes():
        return "has no storage (it was freed): there is nothing to copy"
    if frees and t.device == device and not owns_storage(t):
        return ("does not own its storage (a view of a larger tensor): freeing it would free memory that other "
                "tensors use")
    return None


def _stays(part: Part, e: Entry) -> bool:
    """Never freed when taken: a view of Megatron-FSDP's flat buffer, or a master made on the host at
    construction (a view of its landing block, which goes once the last master is taken from it)."""
    return part.flat_master(e) or (e.kind == MASTER and construction.is_staged(e.param))


def _copy_host_ones(away) -> set:
    """What is already on the host (masters made there at construction) copied into its host views from several
    threads at once; their entries' ids. torch's copy_ runs on one thread under torchrun: 0.15-0.17 s of a load
    for 640 MB (2xH200, 2026-11-28)."""
    bulk = [(e, t) for _, _, e, t in away if _host_to_host(e, t)]
    hostmem.spread.copy((e.host, t) for e, t in bulk)
    return {id(e) for e, _ in bulk}


def _host_to_host(e: Entry, t) -> bool:
    """t can be copied into e's host view as bytes: both contiguous host tensors of e's dtype and shape."""
    return (t.device.type == "cpu" and e.host is not None and e.host.device.type == "cpu" and t.dtype == e.dtype
            and tuple(t.shape) == e.shape and t.is_contiguous() and e.host.is_contiguous()
            and t.untyped_storage().nbytes() > 0)


def _bind_prior(pair) -> None:
    (e, _), prior = pair
    e.param.data = prior


def keep(part: Part, b: Bindings, e: Entry, view) -> None:
    """After an update (or a creation): a state the optimizer created as planned is copied into
    `view` and bound to it, so the one it made goes now, not at the pass's end (nothing whole beyond
    the window while the chunk's masters are copied and clipped); one unlike the plan stays where the
    optimizer put it, with a warning."""
    if e.dropped:
        return
    t = b.get(e)
    if t is None or same(t, view):
        return
    if tuple(t.shape) == e.shape and t.dtype == e.dtype and type(t).__name__ in ("Tensor", "Parameter"):
        view.copy_(t)
        b.set(e, view)
        return
    e.dropped = True
    once(("unplanned", part.index, e.kind, e.key), logging.WARNING,
         "%s%s made %s of a parameter as %s %s, not the planned %s %s: it stays on the GPU (%d bytes)",
         rank_prefix(), part.contract.name, e.name, t.dtype, tuple(t.shape), e.dtype, e.shape, e.nbytes)
