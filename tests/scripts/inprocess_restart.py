"""In-process restart of a training under bridge_fgo's streamed step, in one CPU process
(tests/test_inprocess_restart.py runs it and reads its `RESULT {json}` line).

The wrapper is Megatron-Bridge's own: megatron.bridge.training.inprocess_restart.inprocess_restart()
builds nvidia-resiliency-ext's real inprocess.Wrapper (its monitor process, monitor thread, store,
rank assignment, abort, health checks, the async RankShouldRestart and the gc between attempts), with
Bridge's destroy_state() as finalize. One thing is swapped: nvidia-resiliency-ext's ThreadedFinalize
refuses to run without CUDA, so a CPU one (the same thread and timeout, no device) runs Bridge's
finalize functions.

The wrapped function stands for Bridge's _pretrain (same signature): its setup builds a new model
config binding and a new optimizer (Megatron-Core's real DistributedOptimizer, harness), loads the
last checkpoint through Megatron-Core's sharded_state_dict / load_state_dict (scripts/resume_fix.py
for torch AdamW), then trains through bridge_fgo's wrapper of train() around Bridge's real
train_step, saving a checkpoint after iteration 2. The first attempt faults in iteration 3: in
forward-backward (argv[1] == "backward"), inside the streamed optimizer step ("step": the states are
then torn), or on another rank while this one is inside the optimizer step ("peer": the interruption
recorded in the wrapper's store as a peer's wrapper records it; this rank's monitor thread then
raises RankShouldRestart asynchronously in the main thread, inside a pass). The second attempt
starts from the checkpoint and trains to iteration 5.

Printed: what the restarted attempt found when it started (pinned bytes, sessions, whether the failed
attempt's optimizer and engine are gone, the targets wrapped once, the finalize function), the
pinned bytes after it, and snapshots of the final states for the restarted run, a fresh resume from
the same checkpoint, and an uninterrupted run without offload.
"""
import contextlib
import copy
import faulthandler
import gc
import json
import logging
import os
import sys
import threading
import time
import weakref
from unittest import mock

TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
sys.path.insert(0, TESTS)
sys.path.insert(0, os.path.join(TESTS, os.pardir, "scripts"))
from support import ports, te_free  # noqa: E402

te_free.install()
# a hang (a collective or store waiting on nothing) prints every thread's stack and ends the run
faulthandler.dump_traceback_later(240, exit=True)

# Bridge's in-process restart opens MASTER_PORT + 1 (its store) and + 2 (nvidia-resiliency-ext's)
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports.free_ports(3)), WORLD_SIZE="1", RANK="0",
                  TORCH_CPP_LOG_LEVEL="error")
FAULT = sys.argv[1]
ITERATIONS, SAVE_AT, FAULT_AT = 5, 2, 3

import torch  # noqa: E402
from nvidia_resiliency_ext.inprocess import finalize as nvrx_finalize  # noqa: E402

import bridge_fgo  # noqa: E402
from bridge_fgo import hostmem  # noqa: E402
from bridge_fgo.engine import subset  # noqa: E402
from bridge_fgo.instrument import patcher, targets  # noqa: E402
from bridge_fgo.instrument.callsites import ReloadingFinalize  # noqa: E402

records = []
logging.getLogger("bridge_fgo").addHandler(type("Keep", (logging.Handler,), {"emit": lambda self, r: records.append(
    r.getMessage())})())
logging.getLogger("bridge_fgo").setLevel(logging.INFO)

bridge_fgo.patch(offload="builtin", chunk_mb=1)
import megatron.bridge.training.train as train_module  # noqa: E402  (the patch applies here)
from megatron.bridge.training import inprocess_restart as bridge_inprocess  # noqa: E402
from megatron.bridge.training.config import InProcessRestartConfig  # noqa: E402
from megatron.bridge.training.state import GlobalState  # noqa: E402

import resume_fix  # noqa: E402
from support import harness  # noqa: E402
from test_resume_fix import FORMAT, checkpoint_load, optimizer  # noqa: E402
from test_streamed import snapshot  # noqa: E402

resume_fix.install()


class CpuThreadedFinalize(nvrx_finalize.ThreadedFinalize):
    """nvidia-resiliency-ext's ThreadedFinalize without its CUDA checks: fn in a thread, with the timeout."""

    def __call__(self, state):
        thread = threading.Thread(target=self.fn, args=self.args, kwargs=self.kwargs, daemon=True)
        thread.start()
        thread.join(self.timeout.total_seconds())
        if thread.is_alive():
            raise TimeoutError("finalize timed out")
        return state


nvrx_finalize.ThreadedFinalize = CpuThreadedFinalize


def json_snapshot(opt):
    return {k: v.float().tolist() if isinstance(v, torch.Tensor) else v for k, v in snapshot(opt).items()}


def setup(model_config, checkpoint):
    """Bridge's setup, as far as bridge_fgo sees it: the finalize function bound afresh on the (same)
    model config, a new optimizer, the checkpoint loaded into it before training."""
    rig = harness.Rig(cfg=harness.config_container(mxfp8_copy=False))
    model_config.finalize_model_grads_func = harness.finalize_recorder(rig.events)
    rig.model_config, rig.model = model_config, [harness.ModelChunk(model_config, rig.events)]
    opt = optimizer()  # Megatron-Core's DistributedOptimizer (harness), readable by its checkpoint methods
    rig.dist_optimizer, rig.optimizer = opt, harness.ChainedOptimizer([opt], rig.events)
    start = 0
    if checkpoint is not None:
        start, saved, weights, gen = checkpoint
        opt.load_state_dict(checkpoint_load(saved, opt.sharded_state_dict({}, True, metadata=FORMAT)))
        opt.buffers[0].param_data.copy_(weights)
        opt._gen = gen
    return rig, start


def save(rig, iteration):
    opt = rig.dist_optimizer  # the last update's copies may be in flight: the reader waits for them
    return (iteration, copy.deepcopy(opt.sharded_state_dict({}, False, metadata=FORMAT)),
            opt.buffers[0].param_data.clone(), opt._gen)


def failing_pass(*args, **kwargs):
    raise RuntimeError("fault in iteration 3, inside the optimizer step")


def peer_fault_pass(*args, **kwargs):
    """Another rank faulted: its wrapper records the interruption in the store, and this rank's
    monitor thread raises RankShouldRestart in the main thread, wherever it is: here, inside a pass."""
    from nvidia_resiliency_ext.inprocess.attribution import Interruption, InterruptionRecord

    (monitor,) = [t for t in threading.enumerate() if type(t).__name__ == "MonitorThread"]
    monitor.store.record_interrupted([InterruptionRecord(0, Interruption.EXCEPTION)])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.01)
    raise SystemExit("no RankShouldRestart arrived")


def train(rig, start, fault, seen=None):
    """bridge_fgo's wrapper of Bridge's train() around a loop of Bridge's real train_step; `seen`: what
    this run holds while it trains."""
    loop = patcher._current.callsites.site(targets.target("train"))

    def iterations(*a, **k):
        for it in range(start + 1, ITERATIONS + 1):
            if it == FAULT_AT and fault == "backward":
                fault_in_backward = RuntimeError("fault in iteration 3")
                rig.forward_backward_func = harness.forward_backward_func(rig.events, fault_in_backward)
            injected = {"step": failing_pass, "peer": peer_fault_pass}.get(fault) if it == FAULT_AT else None
            with mock.patch.object(subset, "step_subset", injected) if injected else contextlib.nullcontext():
                harness.run_steps(rig, steps=1)
            if it == start + 1 and seen is not None:
                _, session = patcher._current.callsites.registry.lookup(rig.optimizer)
                func = rig.model_config.finalize_model_grads_func
                seen.update(pinned_during=hostmem.pinned_bytes(), live_buffers_during=hostmem.live_buffers(),
                            engine_pinned_bytes=session.adapter.engine.pinned_bytes,
                            finalize_wrapped_once=isinstance(func, ReloadingFinalize)
                            and not isinstance(func.__wrapped__, ReloadingFinalize))
            if it == SAVE_AT:
                checkpoints.append(save(rig, it))

    return loop(iterations, None, (), {"model": rig.model, "optimizer": rig.optimizer,
                                       "global_state": rig.global_state})


checkpoints, attempts, failed = [], [], {}
model_config = harness.Rig().model_config  # cfg.model: one object across restarts, as in Bridge
global_state = GlobalState()
global_state._cfg = harness.config_container(mxfp8_copy=False)
global_state._cfg.model = model_config


def wrapped_targets_once():
    return all(isinstance(t.raw(sys.modules[t.module]), patcher._Target)
               and not isinstance(t.raw(sys.modules[t.module]).__wrapped__, patcher._Target)
               for t in targets.TARGETS)


def _pretrain(state, forward_step_func, callback_manager=None, store=None, inprocess_call_wrapper=None):
    """Bridge's _pretrain, as bridge_fgo sees it."""
    gc.collect()
    seen = {"pinned_bytes": hostmem.pinned_bytes(), "live_buffers": hostmem.live_buffers(),
            "sessions": len(patcher._current.callsites.registry), "targets_wrapped_once": wrapped_targets_once(),
            "finalize_is_ours": isinstance(model_config.finalize_model_grads_func, ReloadingFinalize),
            "finalizers_held": len(patcher._current.callsites.finalizers)}
    if failed:
        seen["failed_optimizer_alive"] = failed["optimizer"]() is not None
        seen["failed_engine_alive"] = failed["engine"]() is not None
    attempts.append(seen)
    rig, start = setup(model_config, checkpoints[-1] if checkpoints else None)
    if len(attempts) == 1:
        failed["optimizer"] = weakref.ref(rig.dist_optimizer)
        try:
            train(rig, start, FAULT, seen)
        except BaseException as exc:
            _, session = patcher._current.callsites.registry.lookup(rig.optimizer)
            failed["engine"] = weakref.ref(session.adapter.engine)
            seen.update(error=f"{type(exc).__name__}: {exc}", torn=session.adapter.engine.torn,
                        pinned_after_failure=hostmem.pinned_bytes())
            raise
        raise SystemExit("the first attempt did not fault")
    train(rig, start, None, seen)
    seen.update(pinned_after=hostmem.pinned_bytes(), result=json_snapshot(rig.dist_optimizer),
                resumed_from=start)


config = InProcessRestartConfig(enabled=True, granularity="rank", active_world_size=1, soft_timeout=20,
                                hard_timeout=30, heartbeat_interval=2, heartbeat_timeout=15, barrier_timeout=60,
                                completion_timeout=60, monitor_process_interval=1, last_call_wait=1)
wrapped, store = bridge_inprocess.maybe_wrap_for_inprocess_restart(_pretrain, config, global_state)
wrapped(global_state, None, None, store=store)
store = None

# a fresh resume from the same checkpoint, in a run that never failed
fresh_config = harness.Rig().model_config
rig, start = setup(fresh_config, checkpoints[-1])
train(rig, start, None)
fresh = json_snapshot(rig.dist_optimizer)
# and the uninterrupted run, without offload
bridge_fgo.unpatch()
rig, _ = setup(harness.Rig().model_config, None)
harness.run_steps(rig, steps=ITERATIONS)
uninterrupted = json_snapshot(rig.dist_optimizer)

print("RESULT " + json.dumps({
    "attempts": attempts, "fresh": fresh, "uninterrupted": uninterrupted, "checkpoints": [c[0] for c in checkpoints],
    "offload_active_lines": sum("offload active" in m for m in records),
    "torn_error_lines": [m for m in records if "are torn" in m and "last checkpoint" in m],
    "ready_lines": sum("builtin engine ready" in m for m in records),
}), flush=True)
