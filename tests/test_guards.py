"""States are never read from released or half-copied storage: offload twice, skipped step,
exception mid-step, checkpoint save, unpatch."""
import pytest

import bridge_fgo
from bridge_fgo.instrument.session import RELEASED, RESIDENT, Adapter, Session
from support import harness


class Offloader:
    """Stands for the dev line's OptimizerStateOffloader: only sync_before_step is reached."""

    def __init__(self, events):
        self.events = events

    def sync_before_step(self):
        self.events.add("sync")


def rig_with_offloader(**kw):
    rig = harness.Rig(cfg=harness.config_container(harness.optimizer_config(offload_optimizer_states=True)), **kw)
    rig.dist_optimizer._state_offloader = Offloader(rig.events)
    return rig


class RecordingAdapter(Adapter):
    def __init__(self):
        self.calls = []

    def offload(self):
        self.calls.append("offload")
        return 10

    def release(self):
        self.calls.append("release")

    def reload(self):
        self.calls.append("reload")
        return 10

    def wait_reload(self):
        self.calls.append("wait")


def test_session_never_offloads_twice_without_reload():
    adapter, opt = RecordingAdapter(), object.__new__(type("Opt", (), {}))
    s = Session(opt, adapter, mode="test")
    s.offload(); s.release()
    s.offload(); s.release()  # second pass before any reload: host copy still current
    assert adapter.calls == ["offload", "release"] and s.state == RELEASED
    s.reload_begin(); s.reload_end()
    assert adapter.calls[-2:] == ["reload", "wait"] and s.state == RESIDENT
    s.offload()  # after a reload, offload again is a real copy (after waiting for the reload)
    assert adapter.calls[-1] == "offload"


def test_session_offload_while_reloading_waits_first():
    adapter, opt = RecordingAdapter(), object.__new__(type("Opt", (), {}))
    s = Session(opt, adapter, mode="test")
    s.offload(); s.release(); s.reload_begin()
    s.offload()
    assert adapter.calls == ["offload", "release", "reload", "wait", "offload"]


def test_reload_is_waited_for_before_the_step(three_method):
    bridge_fgo.patch()
    rig = rig_with_offloader()
    harness.run_steps(rig, steps=1)
    assert rig.events[5:] == ["forward-backward", "reload", "finalize(pg_collection=pg_collection)", "sync",
                              "step", "scheduler.step"]


def test_skipped_step_leaves_states_resident(three_method):
    bridge_fgo.patch()
    rig = rig_with_offloader(step_result=(False, None, None))  # inf/nan grads: step() returns early
    out = harness.run_steps(rig, steps=2)
    assert [r[1] for r in out] == [1, 1]  # Bridge saw skipped iterations
    assert rig.events.count("sync") == 2  # the copy back was waited for although step() skipped it
    assert bridge_fgo.status().sessions[0]["state"] == RESIDENT


def test_exception_after_release_brings_states_back(three_method):
    bridge_fgo.patch()
    rig = rig_with_offloader(fail=RuntimeError("boom in forward-backward"))
    with pytest.raises(RuntimeError, match="boom"):
        harness.run_steps(rig, steps=1)
    assert rig.events[-4:] == ["release", "forward-backward", "reload", "sync"]
    assert bridge_fgo.status().sessions[0]["state"] == RESIDENT
    # the next step offloads from whole, resident storage
    rig.forward_backward_func = harness.forward_backward_func(rig.events)
    del rig.events[:]
    harness.run_steps(rig, steps=1)
    assert rig.events[:5] == ["zero_grad_buffer", "zero_grad", "offload", "param-buffer copy", "release"]


def test_checkpoint_and_exit_path_sees_resident_states(three_method):
    # The rerun state machine asks for a checkpoint and exit: train_step returns before the step, and
    # train() then saves. States must be whole and the copy back complete by then.
    bridge_fgo.patch()
    rig = rig_with_offloader()
    out = harness.run_steps(rig, steps=1, checkpoint_and_exit=(True, True, 0))
    assert out[0][2:4] == (True, True)
    assert "step" not in rig.events and rig.events[-1] == "sync"
    assert bridge_fgo.status().sessions[0]["state"] == RESIDENT


def test_unpatch_between_steps(three_method, train_module):
    bridge_fgo.patch()
    rig = rig_with_offloader()
    original = rig.model_config.finalize_model_grads_func
    harness.run_steps(rig, steps=1)
    bridge_fgo.unpatch()
    assert rig.model_config.finalize_model_grads_func is original
    del rig.events[:]
    harness.run_steps(rig, steps=1)
    assert "offload" not in rig.events and "reload" not in rig.events
