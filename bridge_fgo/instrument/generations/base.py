"""What every way of moving optimizer states provides: the Adapter a Session drives, and the
Generation that declares one Megatron-Core offload generation to the rest of bridge_fgo.

Nothing here imports torch or Megatron.
"""
from __future__ import annotations

import contextlib
from typing import Dict, List, Optional, Tuple


class Adapter:
    """How one Megatron-Core generation (or the builtin engine, bridge_fgo/engine/) moves states.

    The Session drives it: check() on every rank, then (once every rank agreed) prepare(); per step
    offload() and release() around the param-buffer copy, reload() and wait_reload() around gradient
    finalization, settle() at train_step's exit; close() at the end of training or unpatch().
    Megatron-Core's own offloaders need only offload/release/reload."""

    def check(self) -> None:
        """Before anything is allocated: raise BridgeFGOConfigError for what this rank cannot serve
        (the builtin engine: host memory). Every rank's verdict is then shared (agree.py)."""

    def prepare(self) -> None:
        """Before the first step, once every rank passed check() (e.g. pin host buffers)."""

    def offload(self) -> Optional[int]:
        """Start copying states to the host; bytes moved if known."""
        raise NotImplementedError

    def release(self) -> None:
        """Free the GPU storage of offloaded states (after the device-to-host copy is ordered)."""
        raise NotImplementedError

    def reload(self) -> Optional[int]:
        """Start bringing states back (from released, or offloaded-but-not-released)."""
        raise NotImplementedError

    def wait_reload(self) -> None:
        """Make the current stream wait for the reload, so anything after reads whole states."""

    def settle(self) -> None:
        """train_step is over (done, skipped or failed): states whole where readers outside the step
        find them (copies still in flight are waited for by whatever reads them)."""

    def synchronize(self) -> None:
        """Every copy in flight has finished."""

    def before_load(self, loads_optimizer: bool) -> None:
        """A checkpoint load is about to run, before prepare(); `loads_optimizer`: it loads optimizer
        state (False: the model only, e.g. finetuning)."""

    def after_load(self) -> list:
        """A checkpoint load has run (prepare() ran before it): states it replaced go where they live. Returns
        (what, seconds) of what this took, for the load's per-rank line (none here)."""
        return []

    def defer_clip_qk(self, model, clip_qk) -> None:
        """Gradient finalization is over (every rank reaches it in the same order) and Bridge's train_step
        will call clip_qk(model) after optimizer.step(); `clip_qk` is Megatron-Core's own. Only an adapter
        that keeps masters off the GPU after the step needs to act (the streamed step)."""

    def finish_clip_qk(self, model) -> Optional[float]:
        """Bridge's clip_qk(model) after the step: the max attention logit, for what defer_clip_qk took on;
        None: nothing deferred, Megatron-Core's clip_qk runs as it is."""
        return None

    def params_norm(self, model):
        """A context manager around Bridge's calc_params_l2_norm(model, ...): the masters it reads where it
        can read them."""
        return contextlib.nullcontext()

    def end_training(self) -> bool:
        """train() returned or raised: let nothing of bridge_fgo's (pinned memory) outlive it. True if
        the adapter closed (the next train() decides afresh); False if it keeps what it needs."""
        return False

    def refuse_save(self) -> None:
        """A checkpoint save is about to run: raise BridgeFGOError where what it would write is not whole
        (the streamed step's torn states: model weights too, so a save of the model only as well)."""

    def host_buffers(self) -> List[object]:
        """The pinned host buffers (hostmem.PinnedHost) the states live in between steps, which a
        checkpoint writer may read; none where the states are on the GPU between steps."""
        return []

    def host_tensors(self) -> List[object]:
        """The tensors bound to views of those buffers (what a checkpoint writer is handed)."""
        return []

    def saving(self):
        """Around an asynchronous checkpoint save's call (a context manager): what the writer is handed."""
        import contextlib

        return contextlib.nullcontext()

    def describe(self) -> Dict[str, object]:
        return {}

    def window(self) -> str:
        """How much of the states the GPU holds at once while they move, in words ('' if nothing to say)."""
        return ""

    def close(self) -> None:
        """Drop host resources; states are resident when this is called."""


class Generation:
    """One Megatron-Core offload generation, declared once (generations/<generation>.py).

    decide, refusals, targets, diagnose and the patcher read these declarations and never
    branch on a generation's name, so a new generation is one new module listed in
    generations/__init__.py.
    """

    name: str = ""  # as `bridge-fgo status` shows it: none, three-method, chunked
    mode: str = ""  # the Session's mode (log lines, status) when this generation's adapter runs
    meaning: str = ""  # status: what this generation means for a run
    who: str = ""  # in configuration refusals: who cannot serve the configuration
    flag: str = ""  # the config field(s) asking for offload, in words
    # Methods whose presence in Bridge's loop means Bridge (or a fork) already wires offload itself.
    native_wiring: Tuple[str, ...] = ()
    # Its offloader moves states inside optimizer.step() once its flag is set, wired or not: the
    # builtin engine on top would move the same states twice.
    self_driven: bool = False
    # Megatron-Core has an offloader to call (False: the flag has nothing to call).
    has_offloader: bool = True
    # The cfg.optimizer.optimizer names it serves (Megatron-Core's own offloaders: Adam's distributed
    # optimizer only).
    optimizers: Tuple[str, ...] = ("adam",)

    def detect(self, cls) -> bool:
        """Whether this optimizer class (or Megatron-Core's base class) belongs to this generation."""
        raise NotImplementedError

    def requested(self, cfg) -> bool:
        """Whether the run's config (Bridge's ConfigContainer) asks Megatron-Core for offload."""
        return bool(getattr(getattr(cfg, "optimizer", None), "offload_optimizer_states", False))

    def refusals(self, cfg, options, inner_optimizers: List[object]) -> List[str]:
        """Configurations this generation (with these bridge_fgo options and inner optimizers) cannot
        serve beyond the shared ones (refusals.py)."""
        return []

    def serves_megatron_fsdp(self, options) -> bool:
        """Whether it offloads Megatron-FSDP's optimizer states (Megatron-Core's own offloaders refuse them)."""
        return False

    def build(self, optimizer, cfg, dist_optimizers: List[object], options) -> Adapter:
        raise NotImplementedError

    def verdict(self) -> str:
        """`bridge-fgo status` when this generation's adapter would run."""
        raise NotImplementedError

    # Only for a generation without an offloader (has_offloader False):
    def unavailable(self, mcore: str) -> str:
        """The run-time warning: the config asks for offload and Megatron-Core has nothing to call."""
        raise NotImplementedError

    def unavailable_verdict(self, mcore: str) -> str:
        """`bridge-fgo status` in mode auto: why offload will not run."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<generation {self.name}>"
