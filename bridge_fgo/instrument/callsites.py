"""The three call sites, as wrapt wrappers around Bridge's functions.

- train / train_step: decide once per optimizer (refusing bad configurations before the first step),
  install the finalize wrapper, and make the Session current while the step runs.
- the param-buffer copy helper (_handle_mxfp8_param_buffer_copy, called once per forward-backward
  pass inside train_step's rerun loop): offload before it, release after it. The copy reads the fp32
  master weights, so release must come after; forward_backward_func follows right away.
- model_config.finalize_model_grads_func: reload, overlapping gradient finalization, then wait for
  it before anything (the optimizer step) can read the states; with cfg.model.qk_clip, clip_qk is
  deferred there (every rank reaches finalization in the same order).
- clip_qk (train_step, after optimizer.step()) and calc_params_l2_norm (train(), log_params_norm):
  served by the adapter where the masters are not on the GPU after the step (the streamed step).

Every wrapper passes its arguments through untouched: Bridge's signatures drift between versions.
After unpatch() a wrapper still referenced somewhere (a running train(), a user's variable) is
transparent.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import time
from typing import Dict, Optional, Tuple

import wrapt

from .. import hostmem, peaks
from . import agree, decide, reads, saves, targets
from ..errors import BridgeFGOConfigError
from ..log import logger, rank_prefix
from ..options import Options
from .building import Building
from .session import Registry, Session
from .targets import Layout, argument


@contextlib.contextmanager
def checkpoint_io(sessions):
    """Each session's checkpoint presentation (engine/fsdp.py) for a save's or a load's call."""
    with contextlib.ExitStack() as stack:
        for session in sessions:
            stack.enter_context(session.adapter.checkpoint_io())
        yield


def _load(session, wrapped, args, kwargs, start: float):
    """A checkpoint load under `session`: prepared before it, what it bound elsewhere taken after it, and where
    its time went said, from `start` (before the session was decided: a new one is prepared then)."""
    times = [start]
    session.prepare()
    times.append(time.perf_counter())
    threads = straight = None
    try:  # what the load reads for the host buffer goes straight into it (reads.py); the rest of what it copies
        # between host tensors runs on torch's threads
        with (checkpoint_io([session]), hostmem.spread.torch_threads() as threads,
              reads.straight_into(session.adapter.host_buffers()) as straight):
            result = wrapped(*args, **kwargs)
    finally:
        times.append(time.perf_counter())
        laps = session.adapter.after_load()
        peaks.note("checkpoint load")
    _say_load(times + [time.perf_counter()], laps, threads, straight)
    return result


def _say_load(times, laps, threads=None, straight=None) -> None:
    """Where a checkpoint load's time went on this rank, `times` its four moments (issue 43: the load with
    offload against without); `threads`: torch's (before, during) the load; `straight`: its reads.Reads."""
    start, prepared, loaded, end = times
    parts = f" ({', '.join(f'{what} {s:.2f} s' for what, s in laps)})" if laps else ""
    notes = [f"torch's threads {threads[0]} -> {threads[1]} for it"] if threads and threads[0] != threads[1] else []
    if straight is not None and (read := straight.describe()):
        notes.append(read)
    said = f" ({'; '.join(notes)})" if notes else ""
    logger.info("%sthe checkpoint load took %.2f s here: bridge_fgo's preparation before it %.2f s, Megatron-Bridge's "
                "load %.2f s%s, bridge_fgo's work after it %.2f s%s", rank_prefix(), end - start, prepared - start,
                loaded - prepared, said, end - loaded, parts)


class ReloadingFinalize(wrapt.FunctionWrapper):
    """The finalize wrapper's own type: how bridge_fgo recognises it and never wraps it twice."""


def _reaches(func, target, depth: int = 8) -> bool:
    """Whether calling `func` can reach `target`: through __wrapped__ (wrapt, functools.wraps),
    partial.func, or a closure cell (a plain wrapper that captured the function it calls)."""
    stack, seen = [(func, 0)], set()
    while stack:
        f, d = stack.pop()
        if f is target:
            return True
        if d >= depth or id(f) in seen or f is None:
            continue
        seen.add(id(f))
        for attr in ("__wrapped__", "func"):
            inner = getattr(f, attr, None) if not isinstance(f, type) else None
            if callable(inner):
                stack.append((inner, d + 1))
        for cell in getattr(f, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if callable(value):
                stack.append((value, d + 1))
    return False


def is_reloading_finalize(func, owner=None) -> bool:
    """True for bridge_fgo's finalize wrapper (installed by `owner`, when given)."""
    if not isinstance(func, ReloadingFinalize):
        return False
    return owner is None or getattr(func._self_wrapper, "__self__", None) is owner


class CallSites:
    def __init__(self, options: Options, layout: Layout):
        self.options = options
        self.index = layout.param_index
        self.registry = Registry()
        self.enabled = True
        # id(model config) -> (the config, the wrapper installed there): restored by close()
        self.finalizers: Dict[int, Tuple[object, ReloadingFinalize]] = {}
        self._current: contextvars.ContextVar = contextvars.ContextVar("bridge_fgo_session", default=None)
        # while train_step runs: (its model, whether Bridge will call clip_qk(model) after the step)
        self._step: contextvars.ContextVar = contextvars.ContextVar("bridge_fgo_step", default=None)
        self.originals: Dict[str, object] = {}  # target name -> the function the patch wraps (patcher)
        self.building = Building(self)

    def site(self, target: targets.Target):
        """The wrapt wrapper for a target, chosen by its role."""
        method = {targets.LOOP: self.train, targets.STEP: self.train_step,
                  targets.RELEASE_SITE: self.copy_helper, targets.BUILD: self.building.masters,
                  targets.BUILD_WHOLE: self.building.whole_masters, targets.ADOPT: self.building.await_session,
                  targets.FSDP_BUILD: self.building.fsdp_masters,
                  targets.LOAD: self.load_checkpoint, targets.PARAMS_NORM: self.params_norm,
                  targets.QK_CLIP: self.clip_qk, targets.SAVE: self.save_checkpoint}[target.role]
        return functools.partial(method, target.name)

    # -- deciding ---------------------------------------------------------------------------------
    def _session(self, which: str, args, kwargs) -> Optional[Session]:
        """The optimizer's Session, decided at its first train()/train_step() call.

        A refusal must stop every rank, not one rank while the others wait in their next collective
        until a timeout: each rank decides and checks (its configuration, its host memory) without
        allocating anything, then all ranks share their verdicts (agree.py) and raise together, and
        only then does any rank pin."""
        state = argument(self.index[which], "global_state" if which != "load_checkpoint" else "state", args, kwargs)
        if self.inert:  # nothing can act: the optimizer is not looked at, no collective runs
            if which != "load_checkpoint":
                decide.say_inert(getattr(state, "cfg", None), self.options)
            return None
        optimizer = argument(self.index[which], "optimizer", args, kwargs)
        cfg = getattr(state, "cfg", None)
        loading = None
        if which == "load_checkpoint":
            ckpt = getattr(cfg, "checkpoint", None)
            loading = bool(getattr(ckpt, "load_optim", True) and not getattr(ckpt, "finetune", False))
        return self._decide(optimizer, cfg, loading)

    @functools.cached_property
    def inert(self) -> bool:
        """No optimizer can have a Session (decide.inert); asked at the first call, Megatron-Core loaded."""
        return decide.inert(self.options)

    def _decide(self, optimizer, cfg, loads_optimizer: Optional[bool] = None) -> Optional[Session]:
        if optimizer is None:
            return None
        known, session = self.registry.lookup(optimizer)
        if known:
            return session
        collective = decide.acts(cfg, optimizer, self.options)
        problem = None
        try:
            session = decide.resolve(cfg, optimizer, self.options)
            if session is not None:
                session.check()
        except BridgeFGOConfigError as err:
            if not collective:
                raise
            problem = str(err)
        if collective:
            agree.agree(problem, "optimizer-state offload")
        self.registry.add(optimizer, session)
        if session is not None:
            if loads_optimizer is not None:
                session.adapter.before_load(loads_optimizer)
            session.prepare()
        return session

    def _install_finalize(self, model):
        """Our wrapper on the model config's finalize function; returns the config."""
        from megatron.core.utils import get_model_config

        config = get_model_config(model[0])
        func = config.finalize_model_grads_func
        mine = self.finalizers.get(id(config), (None, None))[1]
        # Installed once per config. Something may wrap our wrapper afterwards (a profiler, a user's
        # hook): still reached, still fine. If it was replaced outright, install again, or the
        # optimizer step would read released storage.
        if mine is not None and (func is mine or _reaches(func, mine)):
            return config
        if func is None:
            raise BridgeFGOConfigError(
                "model_config.finalize_model_grads_func is None: optimizer states are brought back from "
                "gradient finalization, so it must be set (Bridge's setup binds finalize_model_grads)"
            )
        wrapper = ReloadingFinalize(func, self._finalize)
        config.finalize_model_grads_func = wrapper
        self.finalizers[id(config)] = (config, wrapper)
        return config

    def _uninstall_finalize(self, config) -> None:
        """train() is over: the finalize function as it was, and nothing of this training held (an
        in-process restart binds a new one, with the new run's process groups, on the same config)."""
        entry = self.finalizers.get(id(config))
        if entry is not None and entry[0] is config and config.finalize_model_grads_func is entry[1]:
            config.finalize_model_grads_func = entry[1].__wrapped__
            del self.finalizers[id(config)]

    # -- wrappers ---------------------------------------------------------------------------------
    def train(self, name, wrapped, instance, args, kwargs):
        session = self._session(name, args, kwargs) if self.enabled else None
        if session is None:
            return wrapped(*args, **kwargs)
        optimizer = argument(self.index[name], "optimizer", args, kwargs)
        session.prepare()  # a training after one that parked its states pins them again
        config = self._install_finalize(argument(self.index[name], "model", args, kwargs))
        ok = False
        try:
            result = wrapped(*args, **kwargs)
            ok = True
            return result
        finally:
            # the training is over: nothing it pinned or wrapped outlives it
            try:
                self._uninstall_finalize(config)
                if session.end_training():
                    self.registry.remove(optimizer)
                session.summary(strict=self.options.strict and ok)
            except Exception:
                if ok:
                    raise
                logger.exception("%sbridge_fgo could not close its session after train() failed",
                                 rank_prefix())  # never mask the training exception

    def train_step(self, name, wrapped, instance, args, kwargs):
        session = self._session(name, args, kwargs) if self.enabled else None
        if session is None:
            return wrapped(*args, **kwargs)
        session.prepare()
        model = argument(self.index[name], "model", args, kwargs)
        self._install_finalize(model)
        cfg = getattr(argument(self.index[name], "global_state", args, kwargs), "cfg", None)
        clips = bool(getattr(getattr(cfg, "model", None), "qk_clip", False))  # Bridge's own condition
        token, step = self._current.set(session), self._step.set((model, clips))
        try:
            result = wrapped(*args, **kwargs)
        finally:
            self._step.reset(step)
            self._current.reset(token)
            session.ensure_resident()
        session.steps += 1
        peaks.note(f"iteration {session.steps}")
        session.announce_first_step()
        return result

    def copy_helper(self, name, wrapped, instance, args, kwargs):
        session = self._current.get() if self.enabled else None
        if session is None:
            return wrapped(*args, **kwargs)
        session.offload()
        result = wrapped(*args, **kwargs)
        session.release()
        return result

    def load_checkpoint(self, name, wrapped, instance, args, kwargs):
        """A checkpoint load (setup): the session is decided and prepared first, so every optimizer
        state already lives in its host view and the load writes there; states that loading replaced
        are taken back into their host views after it."""
        start = time.perf_counter()
        session = self._session(name, args, kwargs) if self.enabled else None
        if session is None:
            return wrapped(*args, **kwargs)
        return _load(session, wrapped, args, kwargs, start)

    def save_checkpoint(self, name, wrapped, instance, args, kwargs):
        """A checkpoint save: refused while the streamed step's states are torn (the model's weights too,
        so a save of the model only as well); an asynchronous one under the streamed step is watched, so
        that no writer reads the pinned host buffer once the save call has returned (saves.py)."""
        sessions = self.registry.sessions() if self.enabled else []
        if not sessions:  # no optimizer of this process is offloaded: nothing to refuse or watch, no collective
            return wrapped(*args, **kwargs)
        for session in sessions:  # torn states: no save, of the optimizer or of the model only (its weights are torn)
            session.adapter.refuse_save()
        state = argument(self.index[name], "state", args, kwargs)
        if not saves.watched(getattr(state, "cfg", None), self.options):
            with checkpoint_io(sessions):
                return wrapped(*args, **kwargs)
        # the save waits for the last update's copies anyway; waiting first keeps the queued copies' views of
        # the buffer out of the count taken before it
        self.synchronize()
        buffers = [b for s in sessions for b in s.adapter.host_buffers()]
        # a save still being written: a second copy beside it where every rank has room, else it is finished first
        saves.finish_pending(state, sessions, sum(b.nbytes for b in buffers if not b.freed))
        watch = saves.Watch(buffers, [t for s in sessions for t in s.adapter.host_tensors()])
        with contextlib.ExitStack() as stack:  # the writer handed each session's kept snapshot, where it has one
            for session in sessions:
                stack.enter_context(session.adapter.saving())
                stack.enter_context(session.adapter.checkpoint_io())
            result = wrapped(*args, **kwargs)
        watch.after(state)
        return result

    def _finalize(self, wrapped, instance, args, kwargs):
        session = self._current.get() if self.enabled else None
        if session is None:
            return wrapped(*args, **kwargs)
        session.reload_begin()
        try:
            result = wrapped(*args, **kwargs)
        finally:
            session.reload_end()
        step, clip_qk = self._step.get(), self.originals.get("clip_qk")
        if step is not None and step[1] and clip_qk is not None:
            session.adapter.defer_clip_qk(step[0], clip_qk)
        return result

    def clip_qk(self, name, wrapped, instance, args, kwargs):
        """Bridge's clip_qk(model), right after optimizer.step(): what the adapter deferred at gradient
        finalization is finished, and the max attention logit returned; otherwise Megatron-Core's own."""
        session = self._current.get() if self.enabled else None
        if session is not None:
            served = session.adapter.finish_clip_qk(argument(self.index[name], "model", args, kwargs))
            if served is not None:
                return served
        return wrapped(*args, **kwargs)

    def params_norm(self, name, wrapped, instance, args, kwargs):
        """Bridge's calc_params_l2_norm(model, ...) (train() after a step, with log_params_norm): Megatron-Core
        and Bridge compute it as they do, reading each master where every adapter can present it."""
        sessions = self.registry.sessions() if self.enabled else []
        if not sessions:
            return wrapped(*args, **kwargs)
        model = argument(self.index[name], "model", args, kwargs)
        with contextlib.ExitStack() as stack:
            for session in sessions:
                stack.enter_context(session.adapter.params_norm(model))
            return wrapped(*args, **kwargs)

    # -- undoing ----------------------------------------------------------------------------------
    def synchronize(self) -> None:
        for session in self.registry.sessions():
            session.adapter.synchronize()

    def close(self) -> None:
        """States resident, host buffers dropped, finalize functions restored, wrappers transparent."""
        for session in self.registry.clear():
            session.close()
        for config, _ in self.finalizers.values():
            func = getattr(config, "finalize_model_grads_func", None)
            if is_reloading_finalize(func, owner=self):
                config.finalize_model_grads_func = func.__wrapped__
        self.finalizers.clear()
        self.enabled = False
