"""What bridge_fgo holds lives exactly as long as the training it serves: when train() returns (or
raises) nothing stays pinned (the streamed step parks its states in the same host memory, unpinned;
the one window closes), pinned memory is freed exactly once, nothing keeps an optimizer alive, and a
process that trains twice (sweeps, notebooks, evaluation then more training) trains exactly. Also one
window per chain of optimizers (mixture-of-experts models)."""
import gc
import weakref

import pytest

import bridge_fgo
from bridge_fgo import hostmem
from bridge_fgo.instrument import targets
from support import harness
from test_streamed import assert_same, rig, rig_snapshot


PINNED0 = 0  # what other tests left pinned (their buffers go with their engines): set per test below


@pytest.fixture(autouse=True)
def _pinned_before():
    import gc

    global PINNED0
    gc.collect()
    PINNED0 = hostmem.pinned_bytes()


def callsites():
    return bridge_fgo.instrument.patcher._current.callsites


def train(r, steps):
    """Bridge's train() as the patch sees it: bridge_fgo's wrapper around a loop of the real
    train_step (Bridge's own loop needs a cluster)."""
    loop = callsites().site(targets.target("train"))
    kwargs = {"model": r.model, "optimizer": r.optimizer, "global_state": r.global_state}
    return loop(lambda *a, **k: harness.run_steps(r, steps=steps), None, (), kwargs)


def _on_host(r):
    (session,) = callsites().registry.sessions()
    engine = session.adapter.engine
    return engine, engine.on_host()


def test_two_trainings_in_one_process_nothing_pinned_between_and_exact():
    base = rig()
    harness.run_steps(base, steps=6)
    bridge_fgo.patch(offload="builtin", chunk_mb=1)
    r = rig()
    train(r, 3)
    engine, parked_on_host = _on_host(r)
    # nothing locked between the trainings, and no GPU memory taken back: the states stay in the same
    # (now unpinned) host memory, the optimizer held only weakly
    assert hostmem.pinned_bytes() == PINNED0 and parked_on_host and engine.buffer.unpinned
    assert engine.copies.pending() == 0  # every copy done: readers between trainings see whole data
    assert bridge_fgo.status().sessions[0]["states_on"] == "host (parked, unpinned)"
    harness.run_steps(r, steps=1)  # a step outside train() pins the same buffer again, in place
    assert bridge_fgo.status().sessions[0]["states_on"] == "host" and not engine.buffer.unpinned
    train(r, 2)
    assert hostmem.pinned_bytes() == PINNED0
    assert_same(rig_snapshot(base), rig_snapshot(r))
    bridge_fgo.unpatch()  # the states back on the device as ordinary tensors, the buffer freed
    assert engine.buffer is None
    masters = r.dist_optimizer.shard_fp32_from_float16_groups[0]
    assert all(m.untyped_storage().nbytes() == m.numel() * 4 for m in masters)
    assert_same(rig_snapshot(base), rig_snapshot(r))


def test_between_trainings_a_reader_sees_the_states_of_the_first():
    base = rig()
    harness.run_steps(base, steps=3)
    bridge_fgo.patch(offload="builtin", chunk_mb=1)
    r = rig()
    train(r, 3)
    assert_same(rig_snapshot(base), rig_snapshot(r))  # no synchronize needed: train() waited


def test_the_one_window_engine_closes_at_the_end_of_training():
    bridge_fgo.patch(offload="builtin", chunk_mb=0)
    r = rig()
    train(r, 2)
    assert len(callsites().registry) == 0 and hostmem.pinned_bytes() == PINNED0
    train(r, 2)  # decided and pinned afresh
    assert len(callsites().registry) == 0 and hostmem.pinned_bytes() == PINNED0


def test_patch_train_unpatch_patch_train():
    base = rig()
    harness.run_steps(base, steps=4)
    r = rig()
    bridge_fgo.patch(offload="builtin", chunk_mb=1)
    train(r, 2)
    bridge_fgo.unpatch()
    assert hostmem.pinned_bytes() == PINNED0
    bridge_fgo.patch(offload="builtin", chunk_mb=1)
    train(r, 2)
    assert hostmem.pinned_bytes() == PINNED0
    assert_same(rig_snapshot(base), rig_snapshot(r))


def test_a_failed_training_leaves_nothing_pinned_too():
    bridge_fgo.patch(offload="builtin", chunk_mb=1)
    r = rig()

    def failing(*a, **k):
        harness.run_steps(r, steps=2)
        raise RuntimeError("loss spike")

    loop = callsites().site(targets.target("train"))
    with pytest.raises(RuntimeError, match="loss spike"):
        loop(failing, None, (), {"model": r.model, "optimizer": r.optimizer, "global_state": r.global_state})
    assert hostmem.pinned_bytes() == PINNED0
    engine, parked_on_host = _on_host(r)
    assert parked_on_host


def test_an_optimizer_dropped_without_train_returning_frees_its_session_and_pinned_memory():
    """A loop of its own (train_step only, no train()): when the optimizer goes, so does the session,
    and the pinned buffer's finalizer frees it."""
    bridge_fgo.patch(offload="builtin", chunk_mb=1)
    r = rig()
    harness.run_steps(r, steps=2)
    assert len(callsites().registry) == 1 and hostmem.pinned_bytes() > PINNED0
    ref = weakref.ref(r.dist_optimizer)
    del r
    gc.collect()
    assert ref() is None
    assert len(callsites().registry) == 0 and hostmem.pinned_bytes() == PINNED0


@pytest.mark.parametrize("mode", ["builtin", "chunked"])
def test_no_adapter_keeps_its_optimizer_alive(mode, mocker):
    if mode == "chunked":
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        for m in ("offload_optimizer_state_for_forward", "prefetch_optimizer_state_for_gradient_finalization"):
            mocker.patch.object(DistributedOptimizer, m, create=True, new=lambda self, *a, **k: None)
        mocker.patch.object(DistributedOptimizer, "optimizer_state_offload_requires_pre_forward_param_sync",
                            create=True, new=lambda self: False)
        cfg = harness.config_container(harness.optimizer_config(chunked_optimizer_state_offload=True,
                                                                optimizer_state_offload_fraction=1.0),
                                       mxfp8_copy=False)
        bridge_fgo.patch()
        r = harness.Rig(cfg=cfg, with_tensors=True)
        r.optimizer = r.dist_optimizer  # the optimizer train_step sees: the DistributedOptimizer itself
        r.dist_optimizer.step = lambda: (True, 1.0, 0)
    else:
        bridge_fgo.patch(offload="builtin", chunk_mb=1)
        r = rig()
    harness.run_steps(r, steps=1)
    assert len(callsites().registry) == 1
    ref = weakref.ref(r.dist_optimizer)
    del r
    gc.collect()
    assert ref() is None and len(callsites().registry) == 0


def test_a_chain_shares_one_window_and_stays_exact():
    """A mixture-of-experts model: Megatron-Core chains a dense and an expert DistributedOptimizer.
    One window serves both, in sequence, and the next optimizer's first chunk is prefetched during
    the previous one's last."""
    def chained():
        r = rig()
        experts = harness.make_distributed_optimizer(r.events, with_tensors=True, seed=3, shapes=((700, 300), (64,)))
        r.optimizer.chained_optimizers.append(experts)
        return r, experts

    base, base_experts = chained()
    harness.run_steps(base, steps=3)
    bridge_fgo.patch(offload="builtin", chunk_mb=1)
    r, experts = chained()
    windows = []

    def engine():
        (session,) = callsites().registry.sessions()
        return session.adapter.engine

    from test_streamed import on_each_pass

    with on_each_pass(lambda inner, groups: windows.append(engine().transfers.window)):
        harness.run_steps(r, steps=3)
    bridge_fgo.synchronize()
    e = engine()
    assert len(e.parts) == 2 and all(p.chunks for p in e.parts)
    assert len({id(w) for w in windows[:len(e.chunks)]}) == 1  # one window for the whole chain's update
    sizes = [c.nbytes for c in e.chunks]
    assert e.window_bytes == max(sizes[0::2]) + max(sizes[1::2])
    assert_same(rig_snapshot(base), rig_snapshot(r))
    from test_streamed import snapshot

    assert_same(snapshot(base_experts), snapshot(experts))
