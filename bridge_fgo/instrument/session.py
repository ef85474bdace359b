"""One optimizer's offload across a training run: the guards every generation shares, and counters.

The call sites only ever talk to a Session. It keeps the invariant that makes offload safe whatever
happens (skipped step, exception, checkpoint save, unpatch): outside train_step, and from gradient
finalization on, the optimizer states are whole where readers find them. `state` is that call-site
phase ("resident": whole, readable): on the GPU for Megatron-Core's offloaders and the one window,
bound to the host buffer for the streamed step (the builtin engine's `states_on` says which).
"""
from __future__ import annotations

import threading
import weakref
from typing import Dict, List, Optional, Tuple

from .. import peaks
from .generations.base import Adapter
from ..log import logger, rank_prefix

RESIDENT, OFFLOADED, RELEASED, RELOADING = "resident", "offloaded", "released", "reloading"


class Session:
    def __init__(self, optimizer, adapter: Adapter, mode: str):
        self.optimizer_ref = weakref.ref(optimizer)
        self.adapter = adapter
        self.mode = mode
        self.state = RESIDENT
        self.counts = {"offload": 0, "release": 0, "reload": 0}
        self.bytes_offloaded = 0
        self.bytes_reloaded = 0
        self.bytes_known = True  # False where the adapter (Megatron-Core's offloader) does not say
        self.steps = 0
        self.announced = False
        self.prepared = False
        self.closed = False

    # -- the three call sites ------------------------------------------------------------------
    def offload(self) -> None:
        if self.state in (OFFLOADED, RELEASED):
            # The host copy is already current (no optimizer step since): copying again would read
            # released storage, the dev-line offloader's illegal-memory-access defect.
            return
        if self.state == RELOADING:
            self.adapter.wait_reload()
        moved = self.adapter.offload()
        self.state = OFFLOADED
        self.counts["offload"] += 1
        self.bytes_known &= moved is not None
        self.bytes_offloaded += moved or 0

    def release(self) -> None:
        if self.state != OFFLOADED:
            return
        self.adapter.release()
        self.state = RELEASED
        self.counts["release"] += 1

    def reload_begin(self) -> None:
        if self.state not in (OFFLOADED, RELEASED):
            return
        moved = self.adapter.reload()
        self.state = RELOADING
        self.counts["reload"] += 1
        self.bytes_reloaded += moved or 0

    def reload_end(self) -> None:
        if self.state == RELOADING:
            self.adapter.wait_reload()
            self.state = RESIDENT

    def ensure_resident(self) -> None:
        """Whatever happened, leave states whole where readers find them (train_step exit, train end,
        unpatch): on the GPU, or, for the streamed step, bound to the host buffer (copies still in
        flight are waited for by what reads them)."""
        self.reload_begin()
        self.reload_end()
        self.adapter.settle()

    # -- lifetime -------------------------------------------------------------------------------
    def check(self) -> None:
        """What this rank cannot serve, before anything is allocated (BridgeFGOConfigError)."""
        self.adapter.check()

    def prepare(self) -> None:
        if not self.prepared:
            self.adapter.prepare()
            self.prepared = True

    def end_training(self) -> bool:
        """train() returned (or raised): nothing pinned outlives the training. True if the session
        closed, so the next train() with this optimizer decides afresh."""
        self.ensure_resident()
        self.adapter.synchronize()
        self.closed = self.adapter.end_training()
        self.prepared = False  # a next train() prepares again (the builtin engine pins its buffer again)
        return self.closed

    def snapshot(self) -> Dict[str, object]:
        return {
            "mode": self.mode,
            "state": self.state,
            "steps": self.steps,
            "calls": dict(self.counts),
            "bytes_offloaded": self.bytes_offloaded if self.bytes_known else None,
            "bytes_reloaded": self.bytes_reloaded if self.bytes_known else None,
            "run_peak_bytes": peaks.peak()[0] or None,
            "run_peak_phase": peaks.peak()[1],
            **self.adapter.describe(),
        }

    def announce_first_step(self) -> None:
        """One line at the first step that really offloaded."""
        if self.announced or not self.counts["offload"]:
            return
        self.announced = True
        d = self.adapter.describe()
        # the steady figure: Adam's moments do not exist before the first step, the plan counts them
        inner = d.get("inner_optimizers")
        logger.info(
            "%soffload active: mode=%s, %s optimizer(s)%s, %s tensor(s), %s bytes offloaded per step%s",
            rank_prefix(), self.mode, d.get("optimizers", "?"), f" ({', '.join(inner)})" if inner else "",
            d.get("tensors", "?"),
            d.get("bytes", self.bytes_offloaded if self.bytes_known else "?"),
            f"; {self.adapter.window()}" if self.adapter.window() else "",
        )

    def summary(self, strict: bool) -> None:
        c = self.counts
        logger.info(
            "%soffload summary: mode=%s, steps=%d, offload=%d release=%d reload=%d calls, "
            "%s bytes offloaded, %s bytes reloaded",
            rank_prefix(), self.mode, self.steps, c["offload"], c["release"], c["reload"],
            self.bytes_offloaded if self.bytes_known else "unknown",
            self.bytes_reloaded if self.bytes_known else "unknown",
        )
        if peaks.describe():
            logger.info("%s%s", rank_prefix(), peaks.describe())
        # a Session exists only where offload was asked for (a flag, or offload=builtin)
        if self.steps and c["offload"] == 0:
            msg = (f"{rank_prefix()}offload was requested (mode={self.mode}) but no offload happened in "
                   f"{self.steps} training step(s)")
            if strict:
                from ..errors import BridgeFGOError

                raise BridgeFGOError(msg)
            logger.warning(msg)

    def close(self) -> None:
        if self.closed:
            return
        self.ensure_resident()
        self.adapter.synchronize()
        self.adapter.close()
        self.closed = True


class Registry:
    """What was decided per optimizer (a Session, or None for "not offloading"), without keeping
    optimizers alive."""

    def __init__(self):
        self._by_id: Dict[int, tuple] = {}
        self._lock = threading.Lock()

    def lookup(self, optimizer) -> Tuple[bool, Optional[Session]]:
        entry = self._by_id.get(id(optimizer))
        if entry is not None and entry[0]() is optimizer:
            return True, entry[1]
        return False, None

    def add(self, optimizer, session: Optional[Session]) -> Optional[Session]:
        with self._lock:
            key = id(optimizer)
            # drop the entry when the optimizer goes away, so a reused id never matches; its session
            # goes with it (the engine's pinned buffer has a finalizer of its own)
            ref = weakref.ref(optimizer, lambda r, key=key: self._forget(key, r))
            self._by_id[key] = (ref, session)
        return session

    def _forget(self, key: int, ref) -> None:
        with self._lock:
            entry = self._by_id.get(key)
            if entry is not None and entry[0] is ref:
                del self._by_id[key]

    def remove(self, optimizer) -> None:
        """Forget the decision: the next train() with this optimizer decides (and pins) afresh."""
        with self._lock:
            entry = self._by_id.get(id(optimizer))
            if entry is not None and entry[0]() is optimizer:
                del self._by_id[id(optimizer)]

    def __len__(self) -> int:
        return sum(1 for ref, _ in list(self._by_id.values()) if ref() is not None)

    def sessions(self) -> List[Session]:
        return [e[1] for e in list(self._by_id.values()) if e[1] is not None and e[0]() is not None]

    def clear(self) -> List[Session]:
        with self._lock:
            sessions, self._by_id = self.sessions(), {}
        return sessions
