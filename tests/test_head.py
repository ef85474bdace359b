"""The head of the streamed update (engine/streamed/head.py): chunks' copies in started during the last
backward, by the allocation curve the first streamed step measured. The curve is read from an
allocator event trace as the CUDA caching allocator writes it; the figures a GPU gives at each hook are
given here (the head reads allocated memory through one function). The update itself is the engine's
own, against Megatron-Core's real DistributedOptimizer step (the rig of test_streamed.py), so what the
head copies in early must leave the results bit-identical, with every optimizer."""
from __future__ import annotations

import logging
import re

import pytest
import torch

from bridge_fgo.engine.firststep import margin
from bridge_fgo.engine.streamed import head as head_mod
from bridge_fgo.engine.streamed.head import MARKS, Curve, read_curve
from support import harness
from test_streamed import OPTIMIZERS, assert_same, engine_for, make, snapshot, step

MIB = 2**20


def alloc(addr, size):
    return {"action": "alloc", "addr": addr, "size": size}


def free(addr, size):
    return {"action": "free_requested", "addr": addr, "size": size}


def mark(addr):
    # the allocator may note other things between the two marker allocations
    return [alloc(addr, MARKS[0]), {"action": "free_completed", "addr": 7, "size": 512}, alloc(addr + 1, MARKS[1]),
            free(addr, MARKS[0]), free(addr + 1, MARKS[1])]


def test_the_curve_of_the_last_backward_is_read_from_the_allocators_trace():
    # two microbatches of: forward (+300 blocks), backward (three hooks, activations freed 100 blocks at
    # a time, a 50-block spike inside the second layer's backward). The trace gives requested sizes
    # (in 512-byte blocks here); the allocator's own figures at the hooks run 2 KiB higher (blocks it
    # handed out larger): the curve takes the allocator's figure at each hook, the trace's rise after it
    kb = 512
    trace = []
    for mb in range(2):
        trace += [alloc(10 + mb, 300 * kb)]
        trace += mark(100 + 10 * mb) + [free(10 + mb, 300 * kb), alloc(20 + mb, 200 * kb)]
        trace += mark(200 + 10 * mb) + [alloc(30 + mb, 50 * kb - 7), free(30 + mb, 50 * kb - 7),
                                         free(20 + mb, 200 * kb), alloc(40 + mb, 100 * kb)]
        trace += mark(300 + 10 * mb) + [free(40 + mb, 100 * kb), alloc(50 + mb, 4)]
    trace += [{"action": "segment_alloc", "addr": 1, "size": 10**9}, {"action": "free_completed", "addr": 2, "size": 5}]
    base, extra = 1000 * kb, 4 * kb
    samples = [base + extra + 300 * kb, base + extra + 200 * kb, base + extra + 100 * kb,
               base + extra + kb + 300 * kb, base + extra + kb + 200 * kb, base + extra + kb + 100 * kb]
    end = base + extra + 2 * kb
    curve, why = read_curve(trace, samples, end, microbatches=2)
    assert why == "" and curve.hooks == 6 and curve.first == 3 and curve.microbatches == 2
    assert curve.at == samples[3:]  # the allocator's figure at each hook of the last backward
    # the most allocated from each hook on: the spike after the second hook counts (+50 blocks)
    assert curve.ahead == [samples[3], samples[4] + 50 * kb, samples[5]]


def test_a_curve_that_cannot_be_read_is_refused():
    trace = [alloc(1, 2048)] + mark(5) + [free(1, 2048)]
    assert read_curve(trace, [2048], 0, 1)[0] is not None
    curve, why = read_curve(trace, [2048, 2048], 0, 1)  # a hook's marker is missing: the trace lost events
    assert curve is None and "holds 1 of the 2 hooks' markers" in why
    curve, why = read_curve(mark(5) + mark(6) + mark(7), [0, 0, 0], 0, 2)  # three hooks in two backwards
    assert curve is None and "not the same number in every backward" in why


def fake_memory(value):
    box = {"now": value}
    return box, lambda: box["now"]


def armed_head(engine, curve, limit):
    box, read = fake_memory(curve.at[0])
    engine.head._allocated = read
    engine.head.curve, engine.head.state = curve, "measured"
    engine.head.enable(limit)
    return box


def fire(engine, box, at, held):
    box["now"] = at + held()
    engine.head._fired()


@pytest.mark.parametrize("kind", ["torch-foreach-default", "te", "te-precision-aware-bf16", "apex"])
def test_chunks_come_in_during_the_last_backward_within_the_curve_and_stay_exact(kind, monkeypatch):
    monkeypatch.setattr(head_mod, "_microbatches", lambda: 2)
    base, opt = make(**OPTIMIZERS[kind]), make(**OPTIMIZERS[kind])
    engine = engine_for(opt, 600)
    engine.fitting.window_at(600, 4)
    sizes = [s.nbytes for s in engine.transfers.window.slots]
    assert len(engine.chunks) > 4 and len(sizes) == 4
    # hooks per backward: 3. Memory frees as the last backward goes on; the curve leaves room for one
    # slot at its first hook, two at its second, all four at its last
    limit = 100_000
    at = [90_000, 80_000, 60_000]
    ahead = [limit - sizes[0], limit - sizes[0] - sizes[1], limit - sum(sizes)]
    curve = Curve(at=at, ahead=ahead, first=3, hooks=6, microbatches=2)
    for _ in range(3):
        step(base)
        box = armed_head(engine, curve, limit)
        engine.offload()
        engine.release()
        held = lambda: engine.transfers.window.held
        started = []
        for k in range(6):
            fire(engine, box, at[k - 3] if k >= 3 else 95_000, held)
            started.append(len(engine.transfers.started))
            # never more than the curve allows: the head plus what lies ahead within the limit
            if k >= 3:
                assert held() + ahead[k - 3] <= limit
        assert started == [0, 0, 0, 1, 2, 4]  # nothing in the earlier backward, then slot by slot
        harness.finish_step(opt, engine)
        assert_same(snapshot(base), snapshot(opt))
    assert engine.head.prefetched == 4 and engine.head.state == "on"
    assert "the last step: 4 chunk(s), room up to" in engine.head.describe()


def test_a_step_off_the_curve_prefetches_no_more(monkeypatch):
    monkeypatch.setattr(head_mod, "_microbatches", lambda: 1)
    opt = make()
    engine = engine_for(opt, 600)
    engine.fitting.window_at(600, 4)
    curve = Curve(at=[50_000, 40_000], ahead=[0, 0], first=0, hooks=2, microbatches=1)
    box = armed_head(engine, curve, 10**9)
    engine.offload()
    engine.release()
    box["now"] = 50_000 + margin(10**9) + 1  # more allocated than the first step had at this hook
    engine.head._fired()
    assert not engine.transfers.started and engine.head.stopped
    box["now"] = 40_000
    engine.head._fired()
    assert not engine.transfers.started  # stopped for the rest of this step
    engine.reload()
    opt.step_states()
    engine.settle()
    assert engine.head.state == "on"  # the next step tries again
    assert "the last step: 0 chunk(s), off the curve at hook 1" in engine.head.describe()


def test_a_different_hook_count_turns_the_head_off_and_says_so(monkeypatch, caplog):
    monkeypatch.setattr(head_mod, "_microbatches", lambda: 1)
    opt = make()
    engine = engine_for(opt, 600)
    engine.fitting.window_at(600, 4)
    armed_head(engine, Curve(at=[0, 0], ahead=[0, 0], first=0, hooks=2, microbatches=1), 10**9)
    engine.offload()
    engine.release()
    engine.head._fired()  # one hook where the first step had two
    with caplog.at_level(logging.INFO, logger="bridge_fgo"):
        engine.reload()
        opt.step_states()
        engine.settle()
    assert engine.head.state == "off" and "fired the gradient hooks 1 times, the first step 2" in caplog.text


def test_chunks_copied_in_for_a_step_that_never_came_are_dropped(monkeypatch):
    """A backward prefetched, then the step failed before gradient finalization: the next
    forward-backward gives the slots back, and the states are exactly as before."""
    monkeypatch.setattr(head_mod, "_microbatches", lambda: 1)
    base, opt = make(), make()
    engine = engine_for(opt, 600)
    engine.fitting.window_at(600, 4)
    curve = Curve(at=[0], ahead=[0], first=0, hooks=1, microbatches=1)
    armed_head(engine, curve, 10**9)
    engine.offload()
    engine.release()
    engine.head._fired()
    assert engine.transfers.started and engine.transfers.window.held
    # no reload: the step ended in backward. The next one:
    step(opt, engine)
    step(base)
    assert_same(snapshot(base), snapshot(opt))
    assert engine.transfers.window.held == 0


def test_the_hooks_fire_in_a_real_backward_and_only_inside_a_step():
    opt = make()
    engine = engine_for(opt, 600)
    params = [p for g in opt.model_fp32_groups for p in g]
    assert engine.head.attached and len(engine.head._handles) == len(params)
    engine.head.in_step = True
    sum(p.float().sum() for p in params).backward()
    assert engine.head.hook == len(params)
    engine.head.in_step = False
    sum(p.float().sum() for p in params).backward()
    assert engine.head.hook == len(params)  # a backward outside train_step is not counted
    engine.close()
    assert not engine.head.attached


def test_without_a_gpu_nothing_is_measured_and_nothing_prefetched():
    opt = make()
    engine = engine_for(opt, 600)
    for _ in range(2):
        step(opt, engine)
    assert engine.head.state == "off" and engine.head.why_off is None and engine.head.prefetched is None
    assert torch.cuda.is_available() or engine.head.describe() == "no prefetch during backward"


def test_a_failing_prefetch_never_fails_backward(monkeypatch, caplog):
    monkeypatch.setattr(head_mod, "_microbatches", lambda: 1)
    base, opt = make(), make()
    engine = engine_for(opt, 600)
    engine.fitting.window_at(600, 4)
    armed_head(engine, Curve(at=[0], ahead=[0], first=0, hooks=1, microbatches=1), 10**9)

    def no_memory(*a, **k):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (a stand-in)")

    monkeypatch.setattr(engine.transfers.window, "slot", no_memory)
    engine.offload()
    engine.release()
    with caplog.at_level(logging.WARNING, logger="bridge_fgo"):
        engine.head._fired()  # raises nothing
    assert "prefetch during backward failed (OutOfMemoryError" in caplog.text and engine.head.state == "off"
    monkeypatch.undo()
    engine.reload()
    opt.step_states()
    engine.settle()
    engine.synchronize()
    step(base)
    assert_same(snapshot(base), snapshot(opt))


def test_with_activation_offloading_the_head_keeps_out_of_backward_and_the_line_says_so(caplog):
    """Megatron-Core's fine-grained activation offloading brings activations back during backward, on
    backward's critical path, over the same link: the engine starts no copy there, and each rank's
    lines say both offloads are active."""
    import bridge_fgo
    from test_streamed import BIG, rig_snapshot

    cfg = harness.config_container(mxfp8_copy=False)
    cfg.model.fine_grained_activation_offloading = True
    cfg.model.offload_modules = ["core_attn", "attn_proj"]
    base = harness.Rig(cfg=harness.config_container(mxfp8_copy=False), with_tensors=True, shapes=BIG)
    harness.run_steps(base, steps=3)
    bridge_fgo.patch(offload="builtin", chunk_mb=1)
    with caplog.at_level(logging.INFO, logger="bridge_fgo"):
        r = harness.Rig(cfg=cfg, with_tensors=True, shapes=BIG)
        harness.run_steps(r, steps=3)
    bridge_fgo.synchronize()
    assert_same(rig_snapshot(base), rig_snapshot(r))
    both = "Megatron-Core's fine-grained activation offloading is active too (offload_modules core_attn,attn_proj)"
    assert any(both in m and "builtin engine ready" in m for m in caplog.messages)
    # where the preparation's time went (it runs inside a checkpoint load's time): each part, in order
    (ready,) = [m for m in caplog.messages if "builtin engine ready" in m]
    assert re.search(r"host buffer in [\d.]+ s \(the buffer [\d.]+ s, taking what exists [\d.]+ s, making the states "
                     r"[\d.]+ s, the snapshot [\d.]+ s\)", ready), ready
    # the first streamed step's own work (the first iteration after a load is that step): once per rank
    (first,) = [m for m in caplog.messages if "the first streamed step's own work" in m]
    assert re.search(r"took [\d.]+ s: reading backward's memory curve [\d.]+ s, the first window [\d.]+ s, "
                     r"fitting the window and the head [\d.]+ s$", first), first
    assert any(both in m and "offload active" in m for m in caplog.messages)
    (s,) = bridge_fgo.status().sessions
    assert s["activation_offload"] == ["core_attn", "attn_proj"]
    assert s["prefetch"].startswith("no prefetch during backward: Megatron-Core's fine-grained activation offloading")


class FakeRecorder:
    """torch.cuda.memory's event recording, as the head drives it (a CPU has none)."""

    def __init__(self, monkeypatch, snapshot=None):
        self.calls = []
        monkeypatch.setattr(torch.cuda.memory, "_record_memory_history",
                            lambda enabled=None, **k: self.calls.append(enabled))
        monkeypatch.setattr(torch.cuda.memory, "_snapshot", snapshot or (lambda: {"device_traces": []}))


def test_a_failing_measurement_ends_the_recording_and_never_fails_backward(monkeypatch, caplog):
    rec = FakeRecorder(monkeypatch)
    monkeypatch.setattr(head_mod, "_microbatches", lambda: 1)
    engine = engine_for(make(), 600)
    engine.head.begin_step(measure=True)
    assert engine.head.state == "armed" and rec.calls == []  # one microbatch: the recording starts at its first hook

    def no_memory():
        raise RuntimeError("a stand-in failure")

    engine.head._allocated = no_memory
    with caplog.at_level(logging.WARNING, logger="bridge_fgo"):
        engine.head._fired()  # raises nothing
    assert "measuring backward's memory failed (RuntimeError: a stand-in failure)" in caplog.text
    assert engine.head.state == "off" and rec.calls == ["all", None]  # the recording ended with it


def test_a_measured_step_that_never_finished_is_measured_again(monkeypatch):
    rec = FakeRecorder(monkeypatch)
    monkeypatch.setattr(head_mod, "_microbatches", lambda: 1)
    engine = engine_for(make(), 600)
    engine.head._allocated = lambda: 0
    engine.head.begin_step(measure=True)
    engine.head._start_trace()  # (as its first hook does)
    engine.head._samples = [1, 2, 3]  # a backward that failed before gradient finalization
    engine.head.begin_step(measure=True)  # the next step measures from scratch
    assert rec.calls == ["all", None] and engine.head._samples == [] and engine.head.state == "armed"
    engine.head._start_trace()
    engine.head.detach()  # close() while measuring: the recording ends too
    assert rec.calls == ["all", None, "all", None] and engine.head.state == "off"


def test_a_trace_that_cannot_be_read_turns_the_head_off_without_failing_the_step(monkeypatch, caplog):
    def broken():
        raise RuntimeError("no snapshot (a stand-in)")

    rec = FakeRecorder(monkeypatch)
    monkeypatch.setattr(head_mod, "_microbatches", lambda: 1)
    engine = engine_for(make(), 600)
    engine.head._allocated = lambda: 0
    engine.head.begin_step(measure=True)
    engine.head._start_trace()  # (as its first hook does)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", broken)
    with caplog.at_level(logging.INFO, logger="bridge_fgo"):
        assert engine.head.end_step() is None
    assert engine.head.state == "off" and rec.calls == ["all", None]
    assert "no prefetch during backward: reading the allocator's trace failed (RuntimeError" in caplog.text


def test_a_step_of_another_microbatch_count_prefetches_nothing_and_says_so_once(monkeypatch, caplog):
    count = {"n": 2}
    monkeypatch.setattr(head_mod, "_microbatches", lambda: count["n"])
    base, opt = make(), make()
    engine = engine_for(opt, 600)
    engine.fitting.window_at(600, 4)
    armed_head(engine, Curve(at=[0], ahead=[0], first=0, hooks=1, microbatches=1), 10**9)
    with caplog.at_level(logging.INFO, logger="bridge_fgo"):
        for n in (2, 2, 1):  # a ramp: two steps of 2 microbatches, then the measured shape again
            count["n"] = n
            engine.offload()
            engine.release()
            for _ in range(n):
                engine.head._fired()
            assert bool(engine.transfers.started) == (n == 1)
            engine.reload()
            opt.step_states()
            engine.settle()
            engine.synchronize()
            step(base)
            if n == 2:
                assert "(a step of 2 microbatch(es), not the measured 1)" in engine.head.describe()
    said = [m for m in caplog.messages if "no prefetch during backward in steps of 2 microbatch(es)" in m]
    assert len(said) == 1 and engine.head.state == "on" and engine.head.prefetched > 0
    assert_same(snapshot(base), snapshot(opt))


def test_a_curve_read_at_a_failed_steps_exit_is_never_enabled(monkeypatch):
    """Forward-backward raised in the measured step: train_step's exit still reaches gradient
    finalization's site, which reads a curve of part of a backward. No update followed, so the next
    step drops it and measures anew."""
    rec = FakeRecorder(monkeypatch)
    monkeypatch.setattr(head_mod, "_microbatches", lambda: 1)
    engine = engine_for(make(), 600)
    engine.head.curve, engine.head.state = Curve(at=[0], ahead=[0], first=0, hooks=1, microbatches=1), "measured"
    engine.head.begin_step(measure=True)
    assert engine.head.curve is None and engine.head.state == "armed" and rec.calls == []
    engine.head.enable(10**9)
    assert engine.head.state == "armed"  # nothing to enable


class StepRecorder(FakeRecorder):
    """The allocator's recording over a measured step on a CPU: while it records, each hook's two marker
    allocations (the head's own torch.empty calls) are noted as the CUDA allocator would note them, and the
    hooks' figures run down by 100 bytes a hook; the snapshot hands back what was noted."""

    def __init__(self, monkeypatch, head):
        super().__init__(monkeypatch, snapshot=lambda: {"device_traces": [list(self.trace)] if self.on else []})
        self.trace, self.on, self.now = [], False, 10_000
        self.fired = []  # after each hook: the recording's calls so far
        monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", self.record)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        head._allocated = self.memory
        real_empty = torch.empty

        def empty(size, *a, **k):
            if self.on and size in MARKS:
                self.trace.append(alloc(len(self.trace), size))
            return real_empty(size, *a, **k)

        monkeypatch.setattr(torch, "empty", empty)

    def record(self, enabled=None, **k):
        self.calls.append(enabled)
        self.on = self.on or enabled is not None  # (the snapshot after the end still holds the trace)

    def memory(self):
        self.now -= 100
        return self.now


def measured_step(monkeypatch, order, microbatches):
    """One measured step whose hooks fire for the parameters in `order` (indices): (head, recorder)."""
    monkeypatch.setattr(head_mod, "_microbatches", lambda: microbatches)
    engine = engine_for(make(), 600)
    head = engine.head
    rec = StepRecorder(monkeypatch, head)
    params = [object() for _ in range(max(order) + 1)]
    head.begin_step(measure=True)
    for i in order:
        head._fired(params[i])
        rec.fired.append(list(rec.calls))
    head.end_step()
    return head, rec


@pytest.mark.parametrize("microbatches", [1, 2, 3])
def test_the_recording_starts_where_the_last_backward_begins(monkeypatch, microbatches):
    """Four parameters, each hook once a backward: nothing is recorded until the last backward's first hook
    (found when a parameter fires again), and the curve of the last backward is read from there."""
    head, rec = measured_step(monkeypatch, list(range(4)) * microbatches, microbatches)
    starts = 4 * (microbatches - 1)
    assert [len(calls) for calls in rec.fired] == [0] * starts + [1] * 4  # the recording began at that hook
    c = head.curve
    assert head.state == "measured" and rec.calls == ["all", None]
    assert (c.first, c.hooks, c.microbatches, c.recorded_from) == (starts, 4 * microbatches, microbatches, starts)
    assert c.at == [9_900, 9_800, 9_700, 9_600] and len(rec.trace) == 8  # four hooks' markers, no more


def test_where_backwards_interleave_the_recording_starts_early_never_late(monkeypatch):
    """Two model chunks (virtual pipeline stages) whose backwards interleave: parameter 0 fires again before
    parameters 2 and 3 fired once. The recording starts at (microbatches - 1) x 2 = hook 4, before the last
    backward's first (hook 8), and the curve is still the last four hooks'."""
    head, rec = measured_step(monkeypatch, [0, 1, 0, 1, 2, 3, 2, 3, 0, 1, 2, 3], 3)
    c = head.curve
    assert (c.recorded_from, c.first, c.hooks) == (4, 8, 12) and len(c.at) == 4 and len(rec.trace) == 16
    assert "recorded from hook 5 of 12" in (head.enable(10**9) or head.describe())


def test_a_step_whose_parameters_never_fire_twice_turns_the_head_off(monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="bridge_fgo"):
        head, rec = measured_step(monkeypatch, [0, 1, 2, 3], 2)  # two microbatches, four different parameters
    assert head.state == "off" and rec.calls == [] and head.curve is None
    assert "the gradient hooks fired 4 times in 2 microbatch(es), no parameter's twice: not the same number in " \
           "every backward" in caplog.text


def test_the_head_may_fill_up_to_the_runs_peak_where_the_step_set_it(monkeypatch):
    """Full recomputation: the first step's peak (its window) is above forward-backward's. The head's
    bound is the run's peak through the first step, so backward may bring slots in up to it: the step
    allocates the same slots at that peak anyway."""
    from bridge_fgo.engine.firststep import margin
    from test_streamed import measured

    monkeypatch.setattr(head_mod, "_microbatches", lambda: 1)
    opt = make()
    engine = engine_for(opt, 600)
    engine.probe = measured(before=0, backward=2**30, base=2**29, step=2**30 + 2**28)
    def end_step():  # the first step's curve as gradient finalization reads it (a GPU's trace)
        engine.head.curve = head_mod.Curve(at=[1], ahead=[1], first=0, hooks=1, microbatches=1)
        engine.head.state = "measured"

    monkeypatch.setattr(engine.head, "end_step", end_step)
    step(opt, engine)
    peak = 2**30 + 2**28
    assert engine.head.state == "on" and engine.head.limit == peak - margin(peak) > 2**30 - margin(2**30)
