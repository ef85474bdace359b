"""Torn states and the loads that make them whole again, on Megatron-Core's real DistributedOptimizer
(harness) and ChainedOptimizer: the mark goes only once every part of a chain has loaded; every way
into an optimizer step is refused until then, after train() has ended too; a load's own tensors (or its
caller's) are never emptied; the parameters presented on the host during a load get their storage back
whatever interrupts the restore.
"""
import copy
from unittest import mock

import pytest
import torch

import bridge_fgo
from bridge_fgo.engine import subset
from bridge_fgo.engine.streamed import StreamedEngine
from bridge_fgo.engine.streamed import readers as readers_mod
from support import harness
from test_failures import Boom, assert_torn_and_refused, chained_rig, checkpoint, train_wrapper
from test_resume_host import remainders_engine
from test_streamed import assert_same, engine_of, make, snapshot, step


def torn_chain():
    """A patched rig whose ChainedOptimizer holds two DistributedOptimizers, torn between them (the dense
    one stepped, the expert one did not), with each part's checkpoint from before the failed step."""
    r, experts = chained_rig(((70, 30), (64,)))
    saved = [checkpoint(r.dist_optimizer), checkpoint(experts)]
    weights = [[buf.param_data.clone() for buf in opt.buffers] for opt in (r.dist_optimizer, experts)]
    real = subset.copy_rest

    def copy_rest(opt, *a, **k):
        if opt is r.dist_optimizer:
            raise Boom("in Megatron-Core's master copy")
        return real(opt, *a, **k)

    with mock.patch.object(subset, "copy_rest", copy_rest), pytest.raises(Boom):
        harness.run_steps(r, steps=1)
    _, engine = engine_of()
    assert engine.torn
    return r, experts, engine, saved, weights


def corrupt(state):
    """A checkpoint Megatron-Core's load raises on part-way (a bucket's tensors gone)."""
    bad = copy.deepcopy(state)
    for key, gbuf in bad.items():
        if isinstance(key, int):
            for buckets in gbuf.values():
                buckets[0][-1].pop("exp_avg_sq", None)
    return bad


def assert_every_step_refused(r, experts):
    for opt in (r.dist_optimizer, experts):
        for call in (opt.step, opt.prepare_grads, opt.step_with_ready_grads, opt.optimizer.step):
            with pytest.raises(bridge_fgo.BridgeFGOError, match="an optimizer step refused: .*torn.*last checkpoint"):
                call()
    with pytest.raises(bridge_fgo.BridgeFGOError, match="an optimizer step refused"):
        r.optimizer.step()  # Megatron-Core's ChainedOptimizer, as Bridge's train_step calls it


def test_a_chain_stays_torn_until_every_part_has_loaded(tmp_path):
    r, experts, engine, saved, _ = torn_chain()
    r.dist_optimizer.load_parameter_state_from_dp_reshardable(saved[0])  # the first part loads
    assert engine.torn
    with pytest.raises(KeyError):
        experts.load_parameter_state_from_dp_reshardable(corrupt(saved[1]))  # the second raises half-way
    assert engine.torn
    for opt in (r.dist_optimizer, experts):
        assert_torn_and_refused(opt, engine, tmp_path)
    assert_every_step_refused(r, experts)
    experts.load_parameter_state_from_dp_reshardable(saved[1])  # the retry: every part has loaded now
    assert engine.torn is None
    for opt in (r.dist_optimizer, experts):
        assert "state_dict" not in opt.__dict__ and "step" not in opt.__dict__ and "step" not in opt.optimizer.__dict__
        opt.get_parameter_state_dp_reshardable()


def test_a_load_after_a_new_tear_counts_again():
    """Parts loaded before a later tear do not count for it."""
    r, experts, engine, saved, weights = torn_chain()
    for opt, state in zip((r.dist_optimizer, experts), saved):
        opt.load_parameter_state_from_dp_reshardable(state)
    assert engine.torn is None
    engine.readers.torn = "torn again (a stand-in)"
    engine.readers.guard()
    experts.load_parameter_state_from_dp_reshardable(saved[1])
    assert engine.torn == "torn again (a stand-in)"
    r.dist_optimizer.load_parameter_state_from_dp_reshardable(saved[0])
    assert engine.torn is None


def test_after_train_ended_on_torn_states_every_entry_point_refuses(tmp_path):
    """pretrain() raised with the states torn and train() closed its session (parked): a direct step of
    any kind, the chain's too, is bridge_fgo's refusal, not torch's device error."""
    r, experts, engine, saved, weights = torn_chain()

    def failing(*args, **kwargs):
        raise Boom("the training loop ends")

    with pytest.raises(Boom):
        train_wrapper()(failing, None, (), {"model": r.model, "optimizer": r.optimizer, "global_state": r.global_state})
    assert engine.buffer.unpinned and engine.torn
    assert_every_step_refused(r, experts)
    bridge_fgo.unpatch()
    assert_every_step_refused(r, experts)
    for opt, state in zip((r.dist_optimizer, experts), saved):
        opt.load_parameter_state_from_dp_reshardable(state)
    for opt in (r.dist_optimizer, experts):
        assert "step" not in opt.__dict__ and "prepare_grads" not in opt.__dict__


def test_an_interrupt_in_the_restore_after_a_load_leaves_no_parameter_on_the_host():
    """Each parameter presented on the host during the inner load gets its own storage back, even when a
    KeyboardInterrupt lands between two of them (before or after one's rebinding); the interrupt then
    passes on."""
    for when in ("before", "after"):
        opt, engine, params, before = remainders_engine()
        inner = opt.optimizer
        saved = copy.deepcopy(inner.state_dict())
        calls = {"n": 0}
        real = readers_mod._bind_back

        def bind_back(pair):
            calls["n"] += 1
            if calls["n"] == 2 and when == "before":
                raise KeyboardInterrupt
            real(pair)
            if calls["n"] == 2 and when == "after":
                raise KeyboardInterrupt

        try:
            with mock.patch.object(readers_mod, "_bind_back", bind_back), pytest.raises(KeyboardInterrupt):
                inner.load_state_dict(saved)
            assert calls["n"] > len(params)  # the interrupted one was done again
            assert all(p.data_ptr() == ptr and p.equal(value) for p, (ptr, value) in zip(params, before)), when
        finally:
            engine.close()


@pytest.mark.parametrize("fails", [False, True], ids=["load", "load-raises"])
def test_a_direct_load_never_empties_the_callers_tensors(fails):
    """torch's load keeps a state dict's tensor that needs no cast (the host, fp32): the optimizer's state
    is then the caller's own tensor. The load's states are copied into the host views, whether the load
    returns or raises, and no later release frees the caller's memory."""
    base, opt = make(), make()
    engine = StreamedEngine([opt], 2000)
    engine.prepare()
    for _ in range(2):
        step(base)
        step(opt, engine)
    inner = opt.optimizer
    mine = copy.deepcopy(inner.state_dict())
    kept = {(i, k): (v, v.clone()) for i, s in mine["state"].items() for k, v in s.items()
            if isinstance(v, torch.Tensor) and v.dim()}
    assert kept
    cls = type(inner)
    original = cls.load_state_dict

    def raising(self, state_dict):
        original(self, state_dict)
        raise RuntimeError("a load that fails after it bound the states (a stand-in)")

    try:
        if fails:
            with mock.patch.object(cls, "load_state_dict", raising), pytest.raises(RuntimeError, match="stand-in"):
                inner.load_state_dict(mine)
        else:
            inner.load_state_dict(mine)
        assert engine.on_host()
        for _ in range(2):
            step(base)
            step(opt, engine)
        for t, value in kept.values():
            assert t.untyped_storage().nbytes() and t.equal(value)
        assert_same(snapshot(base), snapshot(opt))  # the load put back what was there: the run goes on exactly
    finally:
        engine.close()


def test_an_interrupt_while_masters_leave_their_gpu_scratch_binds_every_one_back():
    """on_device(write_back=True) (qk_clip outside the update, a norm) binds masters to a scratch it then
    retires: every master is back on its host view even when a KeyboardInterrupt lands between two."""
    from bridge_fgo.engine.streamed import transfers as transfers_mod

    opt = make()
    engine = StreamedEngine([opt], 2000)
    engine.prepare()
    step(opt, engine)
    entries = list(engine.plan.streamed_masters().values())
    assert len(entries) > 2
    calls = {"n": 0}
    real = transfers_mod._bind_prior

    def bind_prior(pair):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        real(pair)

    try:
        with mock.patch.object(transfers_mod, "_bind_prior", bind_prior), pytest.raises(KeyboardInterrupt):
            with engine.transfers.on_device(entries, write_back=True):
                pass
        engine.synchronize()
        assert all(e.param.data_ptr() == e.host.data_ptr() for e in entries)
    finally:
        engine.close()
