"""BuiltinAdapter: the builtin engine behind a Session, one engine per optimizer as train_step sees it (a
chain included): the streamed step (chunk_mb > 0) or one window (chunk_mb = 0), the host-memory check
before it pins, and what the per-rank lines and `bridge-fgo status` say of it. `build` makes one from
Bridge's config and the options.
"""
from __future__ import annotations

import contextlib
import time
from typing import Dict, List, Optional

from .. import hostmem
from ..options import AUTO, first_chunk_mb
from ..log import logger, rank_prefix

MIB = 2**20
GIB = 2**30


class BuiltinAdapter:
    """The builtin engine behind a Session: the streamed step (chunk_mb > 0), or one window."""

    def __init__(self, dist_optimizers: List[object], chunk_mb: int, gpu_budget_gib: Optional[float] = None,
                 params_norm: bool = False, activation_offload: Optional[List[str]] = None,
                 snapshot: Optional[str] = None, keep_snapshot: bool = False):
        from .onewindow import OneWindowEngine
        from .streamed import StreamedEngine

        self.chunk_mb = chunk_mb
        if chunk_mb:  # masters made on the host for these optimizers are this session's to move
            from . import adoption

            adoption.adopted(dist_optimizers)
        budget = None if gpu_budget_gib is None else int(gpu_budget_gib * GIB)
        self.engine = (StreamedEngine(dist_optimizers, first_chunk_mb(chunk_mb) * MIB, budget, auto=chunk_mb == AUTO,
                                      norms_in_update=params_norm)
                       if chunk_mb else OneWindowEngine(dist_optimizers))
        self.fit: Optional[hostmem.HostFit] = None
        self.n_optimizers = len(dist_optimizers)
        # Megatron-Core's fine-grained activation offloading shares the host link: activations go out
        # during forward and come back during backward, on backward's critical path
        self.activation_offload = activation_offload
        if activation_offload is not None and chunk_mb:
            self.engine.head.yield_to("Megatron-Core's fine-grained activation offloading brings activations back "
                                      "during backward over the same link")
        # where an asynchronous checkpoint save's writer copies the host states (instrument/saves.py):
        # None (no such save), "memory" or "shm"; the one window's states are on the GPU between steps
        self.snapshot = snapshot if chunk_mb else None
        if self.snapshot and keep_snapshot:  # the writer gets whole host views: a kept snapshot (streamed/snapshot.py)
            self.engine.snapshot.route = self.snapshot

    # -- before the first step: check on every rank, agree, then pin (callsites) -----------------
    def check(self) -> None:
        """Plan, and refuse (BridgeFGOConfigError) host memory this node does not have: the pinned buffer,
        with asynchronous saves of it their writer's copy (the buffer's bytes, while a save is written), and
        what a load makes beside it (the streamed step: one parameter's states at a time, pageable)."""
        pinned = self.engine.plan_bytes()
        self.fit = hostmem.check_fits(pinned, snapshot_per_rank=pinned if self.snapshot else 0,
                                      snapshot_in_shm=self.snapshot == "shm",
                                      load_per_rank=self.engine.made_on_load if self.chunk_mb else 0)

    def prepare(self) -> None:
        t0 = time.perf_counter()
        if self.fit is None:
            self.check()
        logger.info("%s%s", rank_prefix(), self.fit.describe())
        if self.chunk_mb:
            from .fsdp import unverified

            for said in {unverified(part.fsdp.opt) for part in self.engine.parts if part.fsdp is not None} - {None}:
                logger.warning("%s%s", rank_prefix(), said)
        self.engine.prepare()
        laps = getattr(self.engine, "prepare_laps", None)
        logger.info("%sbuiltin engine ready before the first step: %s; %d bytes of %s host buffer in %.2f s%s; %s",
                    rank_prefix(), ", ".join(self.engine.optimizers()) or "no optimizer",
                    self.engine.pinned_bytes,
                    "pinned" if self.engine.device is not None and self.engine.device.type == "cuda" else "CPU",
                    time.perf_counter() - t0,
                    f" ({', '.join(f'{what} {s:.2f} s' for what, s in laps)})" if laps else "", self.window())

    # -- the call sites ---------------------------------------------------------------------------
    def offload(self) -> int:
        return self.engine.offload()

    def release(self) -> None:
        self.engine.release()

    def reload(self) -> int:
        return self.engine.reload()

    def wait_reload(self) -> None:
        self.engine.wait_reload()

    def settle(self) -> None:
        self.engine.settle()

    def synchronize(self) -> None:
        self.engine.synchronize()

    def before_load(self, loads_optimizer: bool) -> None:
        if self.chunk_mb:
            self.engine.defer_pinning = True  # the buffer's registration beside the load's reads
        if self.chunk_mb and not loads_optimizer:
            self.engine.states_after_load = True

    def after_load(self) -> list:
        return self.engine.after_load() if self.chunk_mb else []

    # -- what reads the masters after the step (the one window has them on the GPU then) ----------------
    def defer_clip_qk(self, model, clip_qk) -> None:
        if self.chunk_mb:
            self.engine.defer_clip_qk(model, clip_qk)

    def finish_clip_qk(self, model) -> Optional[float]:
        return self.engine.qk.finish(model) if self.chunk_mb else None

    def params_norm(self, model):
        return self.engine.norms.presented(model) if self.chunk_mb else contextlib.nullcontext()

    def close(self) -> None:
        self.engine.close()

    def refuse_save(self) -> None:
        if self.chunk_mb and self.engine.torn is not None:
            raise self.engine.readers.refusal("a checkpoint save (the model weights are torn too)")

    def host_buffers(self) -> List[object]:
        buf = self.engine.buffer if self.chunk_mb else None
        return [buf] if buf is not None else []

    def host_tensors(self) -> List[object]:
        return self.engine.host_tensors() if self.chunk_mb else []

    def saving(self):
        return self.engine.snapshot.saving() if self.chunk_mb else contextlib.nullcontext()

    def room_beside_a_pending_save(self) -> Optional[str]:
        """Why this rank cannot hold a second copy of the host states beside a save still being written (None: it
        can; a kept snapshot's second set is made for it then: streamed/snapshot.py, make_other)."""
        if not self.chunk_mb or self.engine.buffer is None:
            return None
        return self.engine.snapshot.make_other(self.engine.buffer.nbytes, in_shm=self.snapshot == "shm")

    def beside_a_pending_save(self, agreed: bool) -> None:
        """The ranks' answer to room_beside_a_pending_save(): the next save uses the snapshot's other set, or not."""
        if self.chunk_mb:
            self.engine.snapshot.alternate(agreed)

    def checkpoint_io(self):
        return self.engine.checkpoint_io() if self.chunk_mb else contextlib.nullcontext()

    def end_training(self) -> bool:
        """train() returned: nothing stays pinned. The streamed step parks (states in the unpinned
        host buffer, the session kept for a next train() or unpatch()); the one window's states are on
        the GPU after a step, so it closes. True if closed."""
        if self.chunk_mb:
            self.engine.park()
            return False
        self.engine.close()
        return True

    # -- what it says ---------------------------------------------------------------------------------
    def beside(self) -> str:
        """What else offloads on this rank, as the per-rank lines say it."""
        if self.activation_offload is None:
            return ""
        return ("; Megatron-Core's fine-grained activation offloading is active too (offload_modules "
                f"{','.join(self.activation_offload)})"
                + (": the optimizer states' copies keep out of backward" if self.chunk_mb else ""))

    def window(self) -> str:
        if not self.chunk_mb:
            return "window: one (chunk_mb=0: every state back on the GPU for the optimizer step)" + self.beside()
        e = self.engine
        size = (f"auto ({first_chunk_mb(AUTO)} MB chunks for the first step, then sized from it)" if e.auto
                else f"{self.chunk_mb} MB chunks")
        text = (f"window: {size}, {len(e.chunks)} chunk(s) through {len(e.transfers.window.slots)} slot(s), the step "
                f"adds at most {e.window_bytes} bytes on the GPU")
        if e.resident_bytes:
            text += f"; {e.resident_bytes} bytes stay resident (gpu_budget_gib)"
        if e.plan.quantized:
            text += (f"; {e.plan.quantized} FP8/FP4 parameter shard(s) quantized once after the last chunk, by "
                     "Megatron-Core's own call, from their updated masters kept in the model's dtype in their "
                     "gradients' storage")
        return text + self.beside()

    def describe(self) -> Dict[str, object]:
        e = self.engine
        out: Dict[str, object] = {
            "states_on": e.states_on(),
            "optimizers": self.n_optimizers,
            "inner_optimizers": e.optimizers(),
            "tensors": e.tensors,
            "bytes": e.bytes if self.chunk_mb else e.steady_bytes,
            "pinned_bytes": e.pinned_bytes,
            "skipped_shared_storage": e.shared if not self.chunk_mb else sum(p.shared for p in e.parts),
            "chunk_mb": self.chunk_mb,
            "setup_peak_bytes": e.setup_peak,
            "host_wait_s": round(e.host_wait.seconds, 4) if self.chunk_mb else None,
            "activation_offload": self.activation_offload,
        }
        if self.chunk_mb:
            exposed = e.copies.exposed_s if e.copies is not None else []
            out.update(chunks=len(e.chunks), chunk_bytes=e.plan.chunk_bytes, window=e.window_note,
                       first_window=e.fitting.first_note,
                       slots=len(e.transfers.window.slots) if e.transfers.window is not None else e.plan.slots,
                       prefetch=e.head.describe(),
                       prefetched_chunks=e.head.prefetched,
                       step_peak_bytes=e.window_bytes, master_bytes=e.master_bytes,
                       resident_bytes=e.resident_bytes, budget=e.budget_note, torn=e.torn,
                       quantized_params=e.plan.quantized,
                       exposed_copy_wait_s=sorted(exposed)[len(exposed) // 2] if exposed else None)
        return out


def build(dist_optimizers, options, cfg=None, snapshot: Optional[str] = None) -> BuiltinAdapter:
    """`cfg`: Bridge's ConfigContainer; with cfg.logger.log_params_norm the streamed step takes each master's
    norm in its pass, for the norm train() logs after every step; with the model's
    fine_grained_activation_offloading the engine leaves backward's link to the activations. `snapshot`: where
    an asynchronous checkpoint save's writer copies the host states (instrument/saves.py)."""
    log_params_norm = bool(getattr(getattr(cfg, "logger", None), "log_params_norm", False))
    model = getattr(cfg, "model", None)
    activations = (list(getattr(model, "offload_modules", None) or [])
                   if getattr(model, "fine_grained_activation_offloading", False) else None)
    # fully_reshardable hands the writer gathered copies, not the host views: no snapshot kept for it
    gathered = bool(getattr(getattr(cfg, "checkpoint", None), "dist_ckpt_optim_fully_reshardable", False))
    return BuiltinAdapter(dist_optimizers, chunk_mb=options.chunk_mb, gpu_budget_gib=options.gpu_budget_gib,
                          params_norm=log_params_norm, activation_offload=activations, snapshot=snapshot,
                          keep_snapshot=not gathered)

