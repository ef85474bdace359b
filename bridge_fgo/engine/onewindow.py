"""The one-window engine (chunk_mb=0): states leave the GPU for forward-backward and all come back
for the optimizer step, which runs untouched over everything.

It lowers only the forward-backward peak, but serves any inner optimizer: it moves whatever tensor
states exist (the inner tensors of a wrapper such as Transformer Engine's Float8Tensor included),
in place. One pinned host buffer for the chain, sized before the first step for the states the
optimizers' contracts predict (grown once, with a message, if others appear); device-to-host on its
own stream, ordered after the last optimizer step and overlapping the forward pass; GPU storage
released with the allocator told about the copy stream; host-to-device started when gradient
finalization begins, and the compute stream waits for it before the step.
"""
from __future__ import annotations

import weakref
from typing import List, Optional, Tuple

from .. import hostmem
from ..log import logger, rank_prefix
from . import contracts, copies as copies_mod
from .tensors import Movable, aligned, inner_params, inner_tensors, masters, nbytes_like, nbytes_of, padded


class OneWindowEngine:
    def __init__(self, dist_optimizers):
        self._opts = [weakref.ref(o) for o in dist_optimizers]
        self.plan: List[Tuple[object, int, int]] = []  # (tensor, offset, nbytes)
        self.signature = None
        self.buffer = None
        self.released = False
        self.shared = 0
        self.device = None
        self.copies = None
        self._d2h_done = self._h2d_done = None
        self.setup_peak: Optional[int] = None

    def _alive(self):
        return [o for o in (r() for r in self._opts) if o is not None]

    # -- what moves -------------------------------------------------------------------------------
    def _candidates(self) -> List[object]:
        out = []
        self.shared = 0
        for opt in self._alive():
            movable = Movable(opt)
            for t in masters(opt):
                if movable.take(t):
                    out.append(t)
            inner = opt.optimizer
            for _, p in inner_params(inner):
                for value in (inner.state.get(p) or {}).values():
                    for t in inner_tensors(value) if hasattr(value, "dim") else ():
                        if movable.take(t):
                            out.append(t)
            self.shared += movable.shared
        return out

    def _signature(self):
        """The state tensors each optimizer holds now, by identity: states that appeared (Adam's, after
        the first step) and states a load put in place of others (torch's load_state_dict) replan."""
        return tuple(tuple(id(t) for s in o.optimizer.state.values() if isinstance(s, dict) for t in s.values())
                     for o in self._alive())

    def _missing_bytes(self) -> int:
        """States the contracts predict for parameters that have none yet (before step 1)."""
        total = 0
        for opt in self._alive():
            inner = opt.optimizer
            contract = contracts.of(inner) or contracts.CONTRACTS[contracts.TORCH_ADAMW]
            for gi, p in inner_params(inner):
                if not inner.state.get(p):
                    for spec in contract.states(inner, p, inner.param_groups[gi]):
                        total += padded(nbytes_like(p, spec.dtype))
        return total

    def _replan(self) -> int:
        offset, plan = 0, []
        for t in self._candidates():
            n = nbytes_of(t)
            offset = aligned(offset, n)
            plan.append((t, offset, n))
            offset += n
        self.plan, self.signature = plan, self._signature()
        params = [p for o in self._alive() for _, p in inner_params(o.optimizer)]
        self.device = params[0].device if params else (plan[0][0].device if plan else None)
        return offset

    def plan_bytes(self) -> int:
        self._replan()
        return sum(padded(n) for _, _, n in self.plan) + self._missing_bytes()

    def prepare(self) -> None:
        import torch

        nbytes = self.plan_bytes()
        self.copies = copies_mod.copies_for(self.device)
        self._ensure(nbytes)
        if self.device is not None and self.device.type == "cuda":
            self.setup_peak = torch.cuda.max_memory_allocated(self.device)

    def _ensure(self, nbytes: int) -> None:
        if self.buffer is not None and self.buffer.nbytes >= nbytes:
            return
        if self.buffer is not None:
            logger.info("%sone-window engine: host buffer grows from %d to %d bytes (states appeared that were "
                        "not predicted)", rank_prefix(), self.buffer.nbytes, nbytes)
            self.copies.host_wait_all()
            self.buffer.free()
        self.buffer = hostmem.pin(nbytes)

    def _slot(self, offset: int, t):
        return self.buffer.tensor[offset:offset + nbytes_of(t)].view(t.dtype)

    # -- the call sites ---------------------------------------------------------------------------
    def offload(self) -> int:
        if self.released or self.buffer is None:
            return 0  # the host copy is current; never read released storage
        if self.signature != self._signature():
            self._ensure(self._replan())  # states that appeared since (Adam's, after the first step)
        if not self.plan:
            return 0
        after = [self.copies.compute_event()]  # the last optimizer step is done
        for t, off, _ in self.plan:
            self._d2h_done = self.copies.copy("d2h", self._slot(off, t), t.detach().view(-1), after)
        return self.bytes

    def release(self) -> None:
        if self.released or not self.plan:
            return
        for t, _, _ in self.plan:
            self.copies.free_after(t, self._d2h_done)  # the memory is reused only after the copy read it
            t.untyped_storage().resize_(0)
        self.released = True

    def reload(self) -> int:
        if not self.released:
            return 0
        for t, _, n in self.plan:
            t.untyped_storage().resize_(n)  # on the current stream, where the step will use it
        after = [self.copies.compute_event(), self._d2h_done]  # the host copy is complete
        for t, off, _ in self.plan:
            self._h2d_done = self.copies.copy("h2d", t.detach().view(-1), self._slot(off, t), after)
        self.released = False
        return self.bytes

    def wait_reload(self) -> None:
        if self._h2d_done is not None:
            self.copies.compute_wait(self._h2d_done)

    def settle(self, wait: bool = False) -> None:
        if wait and self.copies is not None:
            self.copies.host_wait_all()

    def synchronize(self) -> None:
        self.settle(wait=True)

    def states_on(self) -> str:
        """Where the optimizer states are now, for status: on the host only from release to reload."""
        return "host" if self.released else "GPU"

    def close(self) -> None:
        if self.released:
            self.reload()
            self.wait_reload()
        if self.buffer is not None:
            self.copies.host_wait_all()  # no copy may still use the buffer
            self.buffer.free()
            self.buffer = None
        self.plan = []

    # -- figures ----------------------------------------------------------------------------------
    @property
    def bytes(self) -> int:
        return sum(n for _, _, n in self.plan)

    @property
    def steady_bytes(self) -> int:
        """Bytes each step moves once the optimizers' states exist (before the first step they do not)."""
        return self.bytes + self._missing_bytes()

    @property
    def pinned_bytes(self) -> int:
        return self.buffer.nbytes if self.buffer is not None else 0

    @property
    def tensors(self) -> int:
        return len(self.plan)

    def optimizers(self) -> List[str]:
        return [contracts.describe(o.optimizer) for o in self._alive()]
