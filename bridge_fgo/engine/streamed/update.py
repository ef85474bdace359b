"""The streamed update: from gradient finalization (arm) to the end of train_step (disarm).

While armed, each inner optimizer's step() and each DistributedOptimizer's
_copy_main_params_to_model_params are instance attributes that run the update here: the parameters
kept on the GPU (gpu_budget_gib) in place, then every chunk through a window slot. A chunk's pass is
the inner optimizer's own step() over its parameters (engine/subset.py: every param group at its
index, group-level values as before the step, written back once), then Megatron-Core's own
master -> model copy narrowed to the chunk's masters, then the qk_clip of the layers whose masters are
in the chunk, over those masters (qkclip.py), the chunk's copy back to the host, and its masters' norms
(norms.py); the host-to-device copies of the next chunks (of the chain, as many as the window has other
slots) and the device-to-host copy of the one before overlap it. Both are per-parameter, so losses and parameters are
bit-identical to one update over everything.

A failure after a pass has begun writing leaves the states torn (part of them at the next step):
they are marked so (readers.py refuses steps and saves until a load) and the failure is raised.
"""
from __future__ import annotations

import functools
import logging
from typing import Dict, List, Optional

from ...errors import BridgeFGOError
from ...log import logger, once, rank_prefix
from .. import layout, quantized, subset
from ..tensors import MASTER, Bindings
from .norms import Norms
from .plan import Part, Plan
from .qkclip import QKClip
from .readers import TORN_FIX, Readers
from .transfers import Transfers, keep


class Update:
    def __init__(self, plan: Plan, transfers: Transfers, readers: Readers, synchronize, norms: Norms, qk: QKClip):
        self.plan, self.transfers, self.readers = plan, transfers, readers
        self.norms, self.qk = norms, qk
        self._synchronize = synchronize  # the engine's: the tail done, torn if that fails
        self.armed = False
        self._hooks = subset.Shadows()  # step hooks while armed
        self.copied_masters: set = set()  # part indices whose masters were copied chunk by chunk
        self.kept: Dict[int, quantized.Kept] = {}
        self.updated: List[tuple] = []  # (part, param) of every pass this update has begun
        self.done: set = set()  # part indices whose update went through
        self.rest_done: set = set()  # part indices whose master -> model copy after the update went through
        self.stepped = False
        self.where = ""  # the pass the update is in, for a failure's message

    def arm(self) -> None:
        """Gradient finalization: hooks on, streamed masters bound to their storage-less GPU shells
        (Megatron-Core attaches their gradients next), and the host-to-device copies of the first
        chunks started, one per window slot (they overlap the gradient reduction; some may have
        started during the last backward already: head.py)."""
        self.armed = True  # from here on settle() binds everything back, whatever fails
        self.copied_masters, self.stepped = set(), False
        self.updated, self.done, self.rest_done = [], set(), set()
        # FP8/FP4 parameters: their masters kept in the model's dtype until the one cast (quantized.py)
        self.kept = {part.index: quantized.Kept() for part in self.plan.parts if quantized.in_use(part.opt)}
        for part in self.plan.parts:
            for bundle in part.bundles:
                if bundle.resident:
                    continue
                for e in bundle.entries:
                    if e.kind == MASTER and not e.dropped:
                        e.param.data = self._shell(part, e.param)
            self._hooks.set(part.inner, "step", functools.partial(self._step, part))
            self._hooks.set(part.opt, "_copy_main_params_to_model_params", functools.partial(self._copy_rest, part))
        for i in range(min(self.plan.slots, len(self.plan.chunks))):
            self.transfers.h2d(i)

    def disarm(self) -> bool:
        """The hooks off; whether the update was armed."""
        self._hooks.restore()
        was_armed, self.armed = self.armed, False
        return was_armed

    def stopped_between_parts(self) -> bool:
        """The step stopped between the optimizers of a chain (outside their updates): some stepped."""
        return bool(self.updated) and any(p.bundles and p.index not in self.done for p in self.plan.parts)

    def stopped_before_copy(self) -> bool:
        """A part's update went through, but Megatron-Core's master -> model copy after it (the fp32
        parameters, the one FP8 cast) did not: masters at the next step, model weights at this one."""
        return bool(self.updated) and any(p.index in self.done and p.index not in self.rest_done
                                          for p in self.plan.parts)

    @staticmethod
    def _shell(part: Part, master):
        shell = part.shells.get(id(master))
        if shell is None:  # every master is adopted (offload) before an update is armed
            raise BridgeFGOError(f"{rank_prefix()}internal: a master weight was never moved to the host")
        return shell

    # -- the hooks --------------------------------------------------------------------------------
    def _step(self, part: Part, *args, **kwargs):
        """The inner optimizer's step(), hooked while armed: resident parameters in place, then the
        part's chunks through the window. torch's step hooks and profiler marker fire once around it all."""
        inner = part.inner
        if not self.armed:
            return type(inner).step(inner, *args, **kwargs)
        if subset.has_step_hooks(inner):  # they see the states as between steps: on the host, whole
            self._synchronize()
            for p, b, e, _ in list(self.plan.away()):
                if p is part:
                    b.set(e, e.host)  # a master off its storage-less GPU tensor; its chunk binds it again
        return subset.hooked_once(inner, functools.partial(self._update, part), *args, **kwargs)

    def _copy_rest(self, part: Part, *args, **kwargs):
        if part.fsdp is not None:  # Megatron-FSDP's own copy, once, over the masters kept by the passes
            out = part.fsdp.copy_rest(functools.partial(type(part.opt)._copy_main_params_to_model_params, part.opt),
                                      *args, **kwargs)
            self.rest_done.add(part.index)
            return out
        out = subset.copy_rest(part.opt, part.index in self.copied_masters, *args, kept=self.kept.get(part.index),
                               **kwargs)
        self.rest_done.add(part.index)
        return out

    def _update(self, part: Part, inner, *args, **kwargs):
        if args or kwargs:  # Megatron-Core calls step() bare; a closure would re-run the model per chunk
            raise BridgeFGOError("the streamed step cannot run an optimizer step with a closure; use chunk_mb=0")
        try:
            self._passes(part, inner)
        except BaseException as exc:
            if not self.updated:
                raise  # no pass began: nothing was written, settle() binds the states back as they were
            self.raise_torn(exc)
        self.done.add(part.index)
        self.stepped = True
        if part.chunks and part.chunks[-1].index == len(self.plan.chunks) - 1:
            self.transfers.close_window()  # the chain's last chunk is through: the memory goes back now
        if subset.has_step_hooks(inner):
            self._synchronize()  # post hooks read the states the update just wrote
        return None

    # -- the passes -------------------------------------------------------------------------------
    def _passes(self, part: Part, inner) -> None:
        state = subset.GroupState(inner)
        chain = f" of optimizer {part.index} of the chain" if len(self.plan.parts) > 1 else ""
        for run in part.passes(self.plan.chunk_bytes):
            if isinstance(run, layout.Chunk):
                self._chunk(part, inner, state, run, chain)
                continue
            # in place, in chunk-sized pieces (their scratch is a chunk's); overlaps the copies in flight
            self.where = f"in the pass over the parameters kept on the GPU (gpu_budget_gib){chain}"
            self._begin(part, run)
            subset.step_subset(inner, state, run)
            self._copy_masters(part, [p for ps in run.values() for p in ps])
        self.where = f"while writing back the param groups' values after the last chunk{chain}"
        state.commit()

    def _chunk(self, part: Part, inner, state, chunk, chain: str) -> None:
        b = part.bindings
        t = self.transfers
        slots = len(t.window.slots)
        self.where = f"in chunk {chunk.index + 1} of {len(self.plan.chunks)}{chain}"
        t.h2d(chunk.index)
        slot = t.window.slots[chunk.index % slots]
        t.copies.compute_wait(slot.h2d_done)
        views = t.views(chunk, slot)
        for e, view in views:
            if not e.dropped and b.get(e) is not None:
                b.set(e, view)
        by_group = chunk.params_by_group()
        self._begin(part, by_group)
        subset.step_subset(inner, state, by_group)
        for e, view in views:
            keep(part, b, e, view)
        self._copy_masters(part, [bd.param for bd in chunk.bundles])
        self.qk.in_pass(chunk.index)
        t.d2h(chunk, slot)
        self.norms.passed(views)  # on the compute stream: the slot is refilled only after it
        for e, view in views:
            if not e.dropped and b.get(e) is not None:
                b.set(e, e.host)
        t.h2d(chunk.index + slots)  # into this slot once the copy out has left it (the chain's next too)
        self._check_unplanned(part, b, chunk)

    def _copy_masters(self, part: Part, params) -> None:
        if part.fsdp is not None:  # each master kept in its model's dtype for Megatron-FSDP's one copy (fsdp.py)
            part.fsdp.keep(params)
            return
        masters = [p for p in params if id(p) in part.model_of]
        if masters:
            subset.copy_masters(part.opt, masters, part.model_of, self.kept.get(part.index))
            self.copied_masters.add(part.index)

    def _begin(self, part: Part, params_by_group: Dict[int, list]) -> None:
        """A pass is about to write: in place (resident states, step counters, parameters it steps that
        are not in the window) and, once through, into model weights and the host copy."""
        self.updated += [(part, p) for ps in params_by_group.values() for p in ps]

    @staticmethod
    def _check_unplanned(part: Part, b: Bindings, chunk) -> None:
        import torch

        planned = {(id(e.param), e.key) for bd in chunk.bundles for e in bd.entries}
        for bd in chunk.bundles:
            for key, value in (part.inner.state.get(bd.param) or {}).items():
                if (isinstance(value, torch.Tensor) and value.dim() and value.numel()
                        and (id(bd.param), key) not in planned):
                    once(("unplanned-key", part.index, key), logging.WARNING,
                         "%s%s created state %r, which the plan did not foresee: it stays on the GPU",
                         rank_prefix(), part.contract.name, key)

    # -- a failure in the middle of an update ------------------------------------------------------
    def failure(self, exc: Optional[BaseException] = None) -> str:
        shapes = ", ".join(str(part.shape(p)) for part, p in self.updated[:3])
        more = ", ..." if len(self.updated) > 3 else ""
        cause = f" ({type(exc).__name__}: {exc})" if exc is not None else ""
        return (f"the optimizer step failed {self.where}{cause} after it had begun updating "
                f"{len(self.updated)} parameter(s) (shapes {shapes}{more}), so the optimizer states and "
                "model weights are torn: part of them are at the next step, the rest at this one")

    def raise_torn(self, exc: BaseException, torn: Optional[str] = None):
        """Mark the states torn and raise: BridgeFGOError from `exc`; a BaseException that is not an
        Exception (KeyboardInterrupt, an in-process restart's RankShouldRestart) passes on as it is."""
        r = self.readers
        r.torn = torn or self.failure(exc)
        self.plan.writes += 1  # the masters' norms are stale
        if not self.armed:
            r.guard()  # else settle() does, once the update's hooks are gone
        if isinstance(exc, Exception):
            raise BridgeFGOError(f"{rank_prefix()}{r.torn}. bridge_fgo refuses optimizer steps and "
                                 f"checkpoint saves until a checkpoint is loaded. {TORN_FIX}") from exc
        logger.error("%s%s. %s", rank_prefix(), r.torn, TORN_FIX)
        raise exc
