"""An asynchronous checkpoint save (cfg.checkpoint.async_save) with the streamed step: what its writer
copies, what that costs in host memory, and the watch around Bridge's save_checkpoint that keeps any
writer from reading the pinned host buffer after the save call returns.

Both writers Bridge uses, Megatron-Core's and nvidia-resiliency-ext's FileSystemWriterAsync
(prepare_write_data), clone every CPU tensor whose storage is larger than the tensor, synchronously,
in the training process, inside the save call. The streamed step's states are views of one pinned
buffer, so the writer takes a pageable copy of them (the snapshot: the buffer's bytes, until the save
is finalized) and never reads the buffer again; the readers' guards made the save wait for the last
update's device-to-host copies first, so the copy is whole and of one iteration. Bridge's persistent
checkpoint worker then receives that copy through /dev/shm (torch.multiprocessing moves a CPU
tensor's storage into shared memory when it is pickled): host memory and /dev/shm are checked for it
before the first step (snapshot_route, hostmem.check_fits).

The buffer always holds more than one tensor (Adam's two moments at least), so each is a view smaller
than its storage, the writers' test for copying.

Correctness does not rest silently on the writers' copy. Around each asynchronous save the call site
counts, before and after the save call, the tensors that share the pinned buffer's storage and the
references to the tensors bound to it (the states and masters the save is handed) (Watch): more
after it, still more after a garbage collection, means the save left them behind, a writer that has
not copied them. Every rank then finishes the save (Bridge's queue,
finalized blocking) before training goes on, and says so once; the ranks agree first, since
finalizing is collective. A save that moved the buffer's storage (a view pickled for a worker
process) is refused on every rank with BridgeFGOError.
"""
from __future__ import annotations

import gc
import logging
import sys
from typing import List, Optional

from . import agree
from ..errors import BridgeFGOError
from ..hostmem.common import fmt_bytes
from ..log import logger, once, rank_prefix
from ..options import Options
from .refusals import saves_optimizer_async

MEMORY, SHM = "memory", "shm"
HELD = "held"
FIX = ("Fix: a writer that copies CPU tensors inside the save call (Megatron-Core's and nvidia-resiliency-ext's "
       "FileSystemWriterAsync do), or cfg.checkpoint.async_save=False, or chunk_mb=0 (states on the GPU between "
       "steps)")


def snapshot_route(cfg) -> Optional[str]:
    """Where an asynchronous save's writer keeps its copy of the host states: None (no asynchronous save
    of optimizer state), MEMORY (this process's pageable memory; a forked worker reads it there), or SHM
    (Bridge's persistent checkpoint worker receives it through /dev/shm)."""
    if not saves_optimizer_async(cfg):
        return None
    return SHM if getattr(cfg.checkpoint, "use_persistent_ckpt_worker", False) else MEMORY


def watched(cfg, options: Options) -> bool:
    """Whether Bridge's save_checkpoint is watched: an asynchronous save of optimizer state under the
    builtin engine's streamed step. The same on every rank (options and config only): the watch exchanges
    one verdict per save."""
    return options.offload == "builtin" and bool(options.chunk_mb) and snapshot_route(cfg) is not None


def finish_pending(state, sessions, nbytes: int) -> None:
    """Before an asynchronous save of the streamed step's states, on every rank. A save still being written
    holds its writer's copy of the host states (`nbytes` per rank; a kept snapshot: one of its two sets), and
    Bridge starts the next save anyway ("Starting a checkpoint save before previous has finished"), which holds
    a second copy beside the first, as it does without offload. The host-memory check before the first step
    planned one copy; the second is checked now on every rank (each session's room_beside_a_pending_save: every
    local rank's share, with the same reserve), and made there once for a kept snapshot. Where a rank has no room
    for it, or two saves are pending, the pending saves are finished first, said once (without that, an 887M
    model saved every 4 iterations of 0.8 s held 19.8 GiB of /dev/shm for a 9.9 GiB snapshot, H100,
    2026-11-26). The ranks agree first: finalizing is collective."""
    queue = getattr(state, "async_calls_queue", None)
    pending = queue.get_num_unfinalized_calls() if queue is not None else 0
    why = None
    if pending == 1:
        why = next((w for w in (s.adapter.room_beside_a_pending_save() for s in sessions) if w is not None), None)
    elif pending > 1:
        why = f"{pending} saves are still being written, each from its own copy"
    # per rank: None (nothing pending), "" (one pending, room for a second copy), or why not
    verdicts = agree.gather(None if not pending else (why or ""))
    if all(v is None for v in verdicts):
        return
    agreed = not any(verdicts)
    for session in sessions:
        session.adapter.beside_a_pending_save(agreed)
    if agreed:
        return
    reason = why or "; ".join(f"rank {r}: {v}" for r, v in enumerate(verdicts) if v)
    once(("async-save-overlap",), logging.WARNING,
         "%scfg.checkpoint.async_save: a checkpoint save started while the previous one was still being written, "
         "and a second copy of the optimizer states in host memory (%s per rank) cannot be held beside the first "
         "(%s), so the previous save is finished before the next one starts (on every rank, every such save). "
         "Fix: a cfg.checkpoint.save_interval longer than a save takes to write, or more host memory",
         rank_prefix(), fmt_bytes(nbytes), reason)
    _finish(state, "an asynchronous checkpoint save is in flight on another rank")


def _finish(state, what: str) -> None:
    """Bridge's queue finalized, blocking (what Bridge's blocking finalize calls), on every rank: finishing
    is collective. `what` needs it, and is refused where the state has no queue to finish it with."""
    queue = getattr(state, "async_calls_queue", None)
    if queue is None:
        raise BridgeFGOError(f"{rank_prefix()}{what} and Bridge's state has no async_calls_queue to finish it. {FIX}")
    queue.maybe_finalize_async_calls(blocking=True)


class Watch:
    """One asynchronous save: what holds the pinned buffers and the tensors bound to them, counted
    before the save call."""

    def __init__(self, buffers: List[object], tensors: List[object]):
        self.buffers = [b for b in buffers if not b.freed]
        self.tensors = tensors
        self.count = self._count()

    def _count(self) -> Optional[int]:
        """The tensors sharing the buffers' storage plus the references to the bound tensors; None when
        the storage's holders cannot be counted."""
        holders = [b.holders() for b in self.buffers]
        if None in holders:
            return None
        return sum(holders) + sum(sys.getrefcount(t) for t in self.tensors)

    def _held(self) -> int:
        """How much more holds the buffers now than before the save (-1: cannot be counted)."""
        now = self._count()
        return -1 if now is None or self.count is None else max(0, now - self.count)

    def verdict(self) -> Optional[str]:
        """None: nothing of the save holds the buffers; HELD; or why the buffers moved."""
        moved = [b for b in self.buffers if b.moved()]
        if moved:
            return (f"{rank_prefix()}the asynchronous checkpoint save moved the {moved[0].nbytes}-byte pinned buffer "
                    "of the optimizer states to other memory (a view of it was pickled for a checkpoint worker "
                    "process, which moves the whole storage into shared memory): its pages are no longer pinned "
                    f"and the engine cannot unregister them. {FIX}")
        if self.count is None:
            return HELD  # cannot be counted: finished as if held (said once in after())
        if not self._held():
            return None
        gc.collect()  # views left in reference cycles by the save hold nothing anyone reads
        return HELD if self._held() else None

    def after(self, state) -> None:
        """After Bridge's save call returned, on every rank: refuse a moved buffer; finish the save
        before training goes on where a writer still holds views of the buffers."""
        verdicts = agree.gather(self.verdict())
        moved = [v for v in verdicts if v not in (None, HELD)]
        if moved:
            raise BridgeFGOError(moved[0] if len(moved) == 1 else f"{moved[0]} (and on {len(moved) - 1} more rank(s))")
        if HELD not in verdicts:
            return
        held = self._held()
        if held < 0:
            once(("async-save-uncounted",), logging.WARNING,
                 "%scfg.checkpoint.async_save: this torch cannot count what holds the optimizer states' pinned host "
                 "buffer (torch._C._storage_Use_Count), so whether the writer still reads it after Bridge's "
                 "save_checkpoint returns is unknown: every such save is finished before training goes on, as a "
                 "synchronous one would be (on every rank). %s", rank_prefix(), FIX)
        else:
            once(("async-save-held",), logging.WARNING,
                 "%scfg.checkpoint.async_save: after Bridge's save_checkpoint returned, %s still held the optimizer "
                 "states' pinned host buffer%s, so the next optimizer step would rewrite what the writer may not have "
                 "written yet: the save is finished before training goes on, as a synchronous one would be (on every "
                 "rank, every such save). %s", rank_prefix(), "this rank's save" if held else "another rank's save",
                 f" ({held} more reference(s) to it or its tensors than before)" if held else "", FIX)
        _finish(state, "an asynchronous checkpoint save still holds the optimizer states' host buffer")
        left = self._held()
        if left > 0:
            logger.warning("%s%s reference(s) to the optimizer states' host buffer or its tensors are still held "
                           "after the save was finished: not by the save; whoever holds them sees the next optimizer "
                           "step's values", rank_prefix(), left)
