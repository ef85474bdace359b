"""Failure paths of the streamed step (bridge_fgo/engine/streamed/), on Megatron-Core's real
DistributedOptimizer (harness) with torch AdamW and the TE and apex FusedAdam stand-ins.

A failure before the update's first pass began leaves every state bit-identical to before the step
and passes the original exception on. One after leaves the states torn: BridgeFGOError from the
cause, naming where and what was updated; from then on optimizer steps and Megatron-Core's
checkpoint saves are refused (nothing is written), unpatch() warns, and a checkpoint load clears it.
Failures are injected where they happen on a GPU: the wait for a chunk's copy, inside a pass, the
device-to-host copy after it, a step hook, the wait for the tail, a guarded reader.
"""
import copy
import gc
import logging
import os
from unittest import mock

import pytest
import torch
from megatron.core.optimizer import distrib_optimizer

import bridge_fgo
from bridge_fgo.engine import subset
from support import harness
from test_streamed import (SHAPES, assert_same, assert_whole_on_host, engine_for, engine_of, make, on_each_pass,
                           params, rig, rig_snapshot, snapshot, step)

KINDS = {"torch": dict(optimizer="torch"), "te": dict(optimizer="te", groups=2), "apex": dict(optimizer="apex"),
         "te-precision-aware": dict(optimizer="te", precision_aware=True, exp_avg_dtype=torch.bfloat16,
                                    exp_avg_sq_dtype=torch.bfloat16)}


class Boom(RuntimeError):
    """The injected failure (an out-of-memory error, a CUDA error)."""


def full_bytes(kind):
    return engine_for(make(**KINDS[kind]), 1).bytes


def setup(kind, budget):
    """Two optimizers stepped alike, one through the engine (every parameter a chunk of its own; with
    a budget, about half the states resident after the first step: a resident pass, then chunks)."""
    base, opt = make(**KINDS[kind]), make(**KINDS[kind])
    engine = engine_for(opt, 1, None if budget is None else full_bytes(kind) // 2)
    for _ in range(2):
        step(base)
        step(opt, engine)
    if budget is not None:
        assert engine.resident_bytes and engine.parts[0].resident_pieces(2**40)
    return base, opt, engine


def checkpoint(opt):
    """What Bridge's torch_dist save keeps of Megatron-Core's dp_reshardable parameter state (copies),
    in its sharded form (ranges dropped, `padding` flags added), ready for
    load_parameter_state_from_dp_reshardable."""
    state = copy.deepcopy(opt.get_parameter_state_dp_reshardable())  # through the guard: whole, current
    for key, gbuf in state.items():
        if isinstance(key, int):
            for buckets in gbuf.values():
                for bucket in buckets:
                    for tensors in bucket:
                        tensors.pop("gbuf_local_start", None)
                        tensors.pop("gbuf_local_end", None)
                        tensors["padding"] = False
    return state


def saves(opt, tmp_path):
    """Megatron-Core's checkpoint save readers, each called as a save would: (name, call)."""
    return [("get_parameter_state_dp_reshardable", lambda: opt.get_parameter_state_dp_reshardable()),
            ("get_parameter_state_dp_zero", lambda: opt.get_parameter_state_dp_zero()),
            ("state_dict", lambda: opt.state_dict()),
            ("sharded_state_dict", lambda: opt.sharded_state_dict({}, False)),
            ("save_parameter_state", lambda: opt.save_parameter_state(str(tmp_path / "optim.pt")))]


def assert_torn_and_refused(opt, engine, tmp_path):
    assert engine.torn
    for name, call in saves(opt, tmp_path):
        with pytest.raises(bridge_fgo.BridgeFGOError,
                           match=f"{name}\\(\\), a checkpoint save .* refused: .*torn.*last checkpoint"):
            call()
    assert not os.listdir(tmp_path)  # nothing was written
    with pytest.raises(bridge_fgo.BridgeFGOError, match="an optimizer step refused: .*torn.*last checkpoint"):
        step(opt, engine)
    with pytest.raises(bridge_fgo.BridgeFGOError, match="an optimizer step refused"):
        opt.optimizer.step()  # the inner optimizer called directly, outside train_step, too
    assert engine.torn and "_copy_main_params_to_model_params" not in opt.__dict__
    assert_whole_on_host(engine)


def injected(where, index, engine):
    """A context manager injecting Boom at `where` of pass (in, in-after) or chunk (before, after) `index`:
    before: the compute stream's wait for the chunk's host-to-device copy (no pass of it began);
    in: inside the pass, before the optimizer's step runs; in-after: inside it, after the step ran
    (the window holds the chunk's new values); after: the chunk's device-to-host copy."""
    calls = {"n": 0}
    real_pass, real_wait, real_copy = subset.step_subset, engine.copies.compute_wait, engine.copies.copy

    def nth() -> bool:
        calls["n"] += 1
        return calls["n"] == index + 1

    def one_pass(inner, state, params_by_group):
        hit = nth()
        if hit and where == "in":
            raise Boom("injected in a pass")
        real_pass(inner, state, params_by_group)
        if hit and where == "in-after":
            raise Boom("injected in a pass, after its step")

    def wait(ev):
        if nth():
            raise Boom("injected in a chunk's copy wait")
        return real_wait(ev)

    def copy_(direction, dst, src, after=()):
        if engine.update.armed and direction == "d2h" and engine.update.where.startswith(f"in chunk {index + 1} of "):
            raise Boom("injected in a chunk's device-to-host copy")
        return real_copy(direction, dst, src, after)

    if where in ("in", "in-after"):
        return mock.patch.object(subset, "step_subset", one_pass)
    if where == "before":
        return mock.patch.object(engine.copies, "compute_wait", wait)
    return mock.patch.object(engine.copies, "copy", copy_)


@pytest.mark.parametrize("budget", [None, "half"], ids=["all-streamed", "resident-pass"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_failure_at_every_chunk_and_in_the_resident_pass(kind, budget, tmp_path):
    """Every pass and every chunk, each injection point: untouched states and the original exception
    (only before the first pass began), or the torn mark; no later save writes anything."""
    cases = []
    probe = setup(kind, budget)[2]
    resident = bool(probe.parts[0].resident_pieces(2**40))
    n_chunks, n_passes = len(probe.chunks), len(probe.chunks) + resident
    for k in range(n_chunks):
        cases += [("before", k), ("after", k)]
    for j in range(n_passes):
        cases += [("in", j), ("in-after", j)]
    untouched_seen = 0
    for where, index in cases:
        base, opt, engine = setup(kind, budget)
        before = snapshot(opt)
        weights_before = opt.buffers[0].param_data.clone()
        chunk = engine.chunks[index] if index < n_chunks else None
        host_before = {id(e): e.host.clone() for bd in chunk.bundles for e in bd.entries} if chunk else {}
        with injected(where, index, engine), pytest.raises(Exception) as err:
            step(opt, engine)
        case = f"{kind} {where} {index}"
        if where == "before" and index == 0 and not resident:  # no pass began
            assert type(err.value) is Boom and engine.torn is None, case  # the original exception, as it was
            assert_same(before, snapshot(opt))
            assert_whole_on_host(engine)
            opt._gen -= 1  # the harness made the failed step's gradients: the retry makes them again
            step(base)
            step(opt, engine)
            assert_same(snapshot(base), snapshot(opt))
            untouched_seen += 1
            continue
        assert isinstance(err.value, bridge_fgo.BridgeFGOError) and isinstance(err.value.__cause__, Boom), case
        counts_resident = resident and where in ("in", "in-after")  # passes: the resident one first
        where_named = ("the pass over the parameters kept on the GPU" if counts_resident and index == 0
                       else f"chunk {index + 1 - counts_resident} of {n_chunks}")
        assert f"failed in {where_named}" in str(err.value), (case, str(err.value))
        assert "parameter(s) (shapes (" in str(err.value) and "resume from the last checkpoint" in str(err.value)
        if where == "in-after" and not resident:
            # the chunk's new values stayed in the window: its host copy holds the values from before
            for bd in chunk.bundles:
                for e in bd.entries:
                    assert torch.equal(e.host, host_before[id(e)]), (case, e.name)
            if index:  # the chunks before it wrote their model weights: torn indeed
                assert not torch.equal(weights_before, opt.buffers[0].param_data)
        assert_torn_and_refused(opt, engine, tmp_path)
    assert len(cases) == 2 * (n_chunks + n_passes) and untouched_seen == (not resident)


@pytest.mark.parametrize("kind", KINDS)
def test_a_failing_step_pre_hook_changes_nothing_and_the_retry_is_exact(kind):
    base, opt, engine = setup(kind, "half")
    before = snapshot(opt)

    def boom(optimizer, args, kwargs):
        raise Boom("a step pre-hook")

    handle = opt.optimizer.register_step_pre_hook(boom)
    with pytest.raises(Boom):
        step(opt, engine)
    handle.remove()
    assert engine.torn is None
    assert_same(before, snapshot(opt))
    opt._gen -= 1  # the harness made the failed step's gradients: make them again
    step(base)
    step(opt, engine)
    assert_same(snapshot(base), snapshot(opt))


@pytest.mark.parametrize("kind", ["torch", "te", "apex"])
def test_a_checkpoint_load_clears_the_mark_and_training_goes_on_exactly(kind):
    """Megatron-Core's own dp_reshardable load (Bridge's default format), with the model weights
    loaded back as Bridge loads them: the retried step equals the uninterrupted run. (Not the
    precision-aware layout: megatron-core 0.16's own load of it hands set_scaled_state the `padding` flag.)"""
    base, opt, engine = setup(kind, None)
    saved = checkpoint(opt)
    weights = [buf.param_data.clone() for buf in opt.buffers]
    gen = opt._gen
    with injected("after", 3, engine), pytest.raises(bridge_fgo.BridgeFGOError):
        step(opt, engine)
    assert engine.torn
    opt.load_parameter_state_from_dp_reshardable(saved)
    for buf, w in zip(opt.buffers, weights):
        buf.param_data.copy_(w)
    opt._gen = gen
    assert engine.torn is None and "get_parameter_state_dp_reshardable" not in opt.__dict__
    for _ in range(2):
        step(base)
        step(opt, engine)
        assert_same(snapshot(base), snapshot(opt))


@pytest.mark.skipif(distrib_optimizer.HAVE_APEX_OR_TE, reason="scripts/resume_fix.py serves torch AdamW only")
def test_bridges_load_sequence_clears_the_mark_and_its_nested_reads_pass():
    """sharded_state_dict(is_loading=True) calls state_dict() and load_state_dict() itself: inside a
    load those pass; the load clears the mark when it returns. (test_resume_fix's Bridge sequence;
    torch AdamW there needs scripts/resume_fix.py. Injected before the first pass's step ran: with
    parameters at different steps Megatron-Core's own state_dict() asserts inside the load.)"""
    from test_resume_fix import FORMAT, checkpoint_load, optimizer, resume_fix

    resume_fix.install()
    try:
        base, opt = optimizer(), optimizer()
        engine = engine_for(opt, 1)
        for _ in range(2):
            step(base)
            step(opt, engine)
        saved = copy.deepcopy(opt.sharded_state_dict({}, False, metadata=FORMAT))
        with injected("in", 0, engine), pytest.raises(bridge_fgo.BridgeFGOError):
            step(opt, engine)  # in the first pass, before its step ran: torn all the same
        opt._gen -= 1
        with pytest.raises(bridge_fgo.BridgeFGOError, match="sharded_state_dict\\(\\), a checkpoint save"):
            opt.sharded_state_dict({}, False, metadata=FORMAT)
        loading = opt.sharded_state_dict({}, True, metadata=FORMAT)  # is_loading by position, as Chained does
        assert engine.torn  # a load is under way, not done
        opt.load_state_dict(checkpoint_load(saved, loading))
        assert engine.torn is None
        for _ in range(2):
            step(base)
            step(opt, engine)
            assert_same(snapshot(base), snapshot(opt))
    finally:
        resume_fix.uninstall()


def test_unpatch_of_a_torn_run_warns_and_saves_stay_refused_until_a_load(caplog, tmp_path):
    bridge_fgo.patch(offload="builtin", chunk_mb=1)
    r = readable_rig()
    harness.run_steps(r, steps=2)
    opt = r.dist_optimizer
    saved = checkpoint(opt)
    _, engine = engine_of()
    with injected("in", 2, engine), pytest.raises(bridge_fgo.BridgeFGOError, match="failed in chunk 3 of 5") as err:
        harness.run_steps(r, steps=1)
    assert isinstance(err.value.__cause__, Boom)
    (s,) = bridge_fgo.status().sessions
    assert s["torn"] == engine.torn and s["state"] == "resident"
    seen = len(r.events)
    with pytest.raises(bridge_fgo.BridgeFGOError, match="an optimizer step refused"):
        harness.run_steps(r, steps=1)  # the next train_step, refused before its forward-backward
    assert "forward-backward" not in r.events[seen:]
    with caplog.at_level(logging.WARNING, logger="bridge_fgo"):
        bridge_fgo.unpatch()
    assert any("unpatch(): the optimizer step failed in chunk 3 of 5" in m for m in caplog.messages)
    assert engine.buffer is None
    with pytest.raises(bridge_fgo.BridgeFGOError, match="state_dict\\(\\), a checkpoint save"):
        opt.state_dict()
    with pytest.raises(bridge_fgo.BridgeFGOError, match="an optimizer step refused"):
        opt.optimizer.step()
    opt.load_parameter_state_from_dp_reshardable(saved)  # a load, after unpatch too
    assert "state_dict" not in opt.__dict__ and "step" not in opt.optimizer.__dict__
    opt.get_parameter_state_dp_reshardable()


def test_a_save_of_the_model_only_is_refused_while_torn_and_served_after_a_load():
    """Torn states mean torn model weights (each chunk's pass copies its masters into the model): Bridge's
    save_checkpoint is refused before it writes anything, with save_optim=False too, until a load."""
    from bridge_fgo.instrument import patcher, targets

    bridge_fgo.patch(offload="builtin", chunk_mb=1)
    r = readable_rig()
    harness.run_steps(r, steps=2)
    saved = checkpoint(r.dist_optimizer)
    _, engine = engine_of()
    with injected("in", 2, engine), pytest.raises(bridge_fgo.BridgeFGOError, match="failed in chunk 3 of 5"):
        harness.run_steps(r, steps=1)
    site = patcher._current.callsites.site(targets.target("save_checkpoint"))
    written = []
    model_only = lambda state: written.append(state)  # noqa: E731 (Bridge's save, save_optim=False)
    with pytest.raises(bridge_fgo.BridgeFGOError, match="a checkpoint save .*refused: .*chunk 3 of 5.*resume from"):
        site(model_only, None, (r.global_state,), {})
    assert written == []
    r.dist_optimizer.load_parameter_state_from_dp_reshardable(saved)  # a load makes the states whole
    site(model_only, None, (r.global_state,), {})
    assert written == [r.global_state]


def test_the_guards_of_torn_states_need_no_engine():
    """A torn run's guards stay on the optimizer after unpatch(), and the engine may be gone by then:
    the guards' wait for copies (the engine's synchronize, held weakly) then does nothing."""
    from bridge_fgo.engine.streamed import engine as engine_mod

    class Held:
        calls = 0

        def synchronize(self):
            Held.calls += 1

    held = Held()
    call = engine_mod._weakly(held.synchronize)
    call()
    del held
    gc.collect()
    call()  # no engine: nothing to wait for, no error
    assert Held.calls == 1


# -- the device-to-host tail, and guarded readers --------------------------------------------------------------
def tail_in_flight(kind="torch"):
    base, opt = make(**KINDS[kind]), make(**KINDS[kind])
    engine = engine_for(opt, 1)
    for _ in range(2):
        step(base)
        step(opt, engine, wait=False)
    assert engine.transfers.tail is not None and engine.copies.pending()
    return base, opt, engine


def failing_copies(engine, after=1):
    """The `after`-th copy the queue runs fails (a CUDA error surfacing in the wait)."""
    real = type(engine.copies)._run
    runs = {"n": 0}

    def run(self, ev):
        if ev is not None and getattr(ev, "queue", None) == "d2h":
            runs["n"] += 1
            if runs["n"] == after:
                raise Boom("CUDA error: an illegal memory access was encountered")
        return real(self, ev)

    return mock.patch.object(type(engine.copies), "_run", run)


def test_a_failed_wait_for_the_tail_tears_the_states(tmp_path):
    _, opt, engine = tail_in_flight()
    with failing_copies(engine), pytest.raises(bridge_fgo.BridgeFGOError, match="device-to-host copies failed") as err:
        engine.synchronize()
    assert isinstance(err.value.__cause__, Boom) and "last checkpoint" in str(err.value)
    assert_torn_and_refused(opt, engine, tmp_path)


def test_a_failed_wait_inside_a_guarded_reader_tears_the_states_and_the_reader_does_not_run(tmp_path):
    _, opt, engine = tail_in_flight()
    with failing_copies(engine), pytest.raises(bridge_fgo.BridgeFGOError, match="device-to-host copies failed"):
        opt.save_parameter_state(str(tmp_path / "optim.pt"))
    assert_torn_and_refused(opt, engine, tmp_path)


def test_a_guarded_reader_that_fails_itself_leaves_the_states_whole():
    """The wait went through; Megatron-Core's reader then raised: its own exception, nothing torn."""
    base, opt, engine = tail_in_flight()
    with pytest.raises(KeyError):
        opt.load_parameter_state_from_dp_reshardable({})  # a checkpoint without this optimizer's buckets
    assert engine.torn is None and engine.transfers.tail is None and not engine.readers.guards
    assert_same(snapshot(base), snapshot(opt))
    step(base)
    step(opt, engine)
    assert_same(snapshot(base), snapshot(opt))


def test_a_failure_in_the_next_iteration_while_the_tail_is_in_flight_loses_nothing():
    """Bridge's real train_step: forward-backward raises while the last update's copies are in flight;
    the end of training (bridge_fgo's train wrapper) waits for them: whole, current, saved as usual."""
    base = rig()
    harness.run_steps(base, steps=2)
    bridge_fgo.patch(offload="builtin", chunk_mb=1)
    r = readable_rig()

    def failing(*a, **k):
        harness.run_steps(r, steps=2)
        _, engine = engine_of()
        assert engine.transfers.tail is not None and engine.copies.pending()
        r.forward_backward_func = harness.forward_backward_func(r.events, Boom("loss spike"))
        harness.run_steps(r, steps=1)

    with pytest.raises(Boom):
        train_wrapper()(failing, None, (), {"model": r.model, "optimizer": r.optimizer, "global_state": r.global_state})
    _, engine = engine_of()
    assert engine.torn is None and engine.copies.pending() == 0
    assert_same(rig_snapshot(base), rig_snapshot(r))
    assert r.dist_optimizer.get_parameter_state_dp_reshardable()


def readable_rig():
    """A rig whose optimizer Megatron-Core's dp_reshardable reader can read."""
    r = rig()
    r.dist_optimizer.per_bucket_numel = r.dist_optimizer.per_bucket_numel_unpadded = [{}]
    return r


def train_wrapper():
    """bridge_fgo's wrapper around Bridge's train() (Bridge's own loop needs a cluster)."""
    from bridge_fgo.instrument import targets

    return bridge_fgo.instrument.patcher._current.callsites.site(targets.target("train"))


# -- between the optimizers of a chain ---------------------------------------------------------------------------
def chained_rig(expert_shapes=((700, 300), (64,))):
    """A patched rig whose ChainedOptimizer holds a second DistributedOptimizer (the experts'), two steps
    in: (rig, experts)."""
    bridge_fgo.patch(offload="builtin", chunk_mb=1)
    r = readable_rig()
    experts = harness.make_distributed_optimizer(r.events, with_tensors=True, seed=3, shapes=expert_shapes)
    experts.per_bucket_numel = experts.per_bucket_numel_unpadded = [{}]
    r.optimizer.chained_optimizers.append(experts)
    harness.run_steps(r, steps=2)
    return r, experts


def test_a_failure_between_the_optimizers_of_a_chain_tears_the_states(caplog, tmp_path):
    """The dense optimizer stepped, the expert one never did: Megatron-Core's master copy after the
    first fails. The original exception passes on; the mark and an ERROR line say what happened."""
    r, experts = chained_rig()
    real = subset.copy_rest

    def copy_rest(opt, *a, **k):
        if opt is r.dist_optimizer:
            raise Boom("in Megatron-Core's master copy")
        return real(opt, *a, **k)

    with mock.patch.object(subset, "copy_rest", copy_rest), caplog.at_level(logging.ERROR, logger="bridge_fgo"), \
            pytest.raises(Boom):
        harness.run_steps(r, steps=1)
    _, engine = engine_of()
    assert "failed between the optimizers of the chain" in engine.torn
    assert any("between the optimizers of the chain" in m and "last checkpoint" in m for m in caplog.messages)
    for opt in (r.dist_optimizer, experts):
        assert_torn_and_refused(opt, engine, tmp_path)


# -- what offload() takes over ------------------------------------------------------------------------------------
@pytest.mark.parametrize("replace, words", [
    (lambda t: torch.zeros(t.numel() + 1, dtype=t.dtype), "has shape"),
    (lambda t: torch.zeros_like(t, dtype=torch.float64), "is torch.float64, not torch.float32"),
    (lambda t: torch.zeros(t.numel() * 2, dtype=t.dtype)[: t.numel()].view(t.shape), "does not own its storage"),
    (lambda t: _freed(t), "has no storage"),
    (lambda t: torch.zeros_like(t, device="meta"), "is on meta"),
])
def test_offload_refuses_to_take_over_a_tensor_unlike_the_plan_before_anything_is_freed(replace, words):
    opt = make()
    engine = engine_for(opt, 1)
    step(opt, engine)
    p = params(opt)[1]
    odd = replace(opt.optimizer.state[p]["exp_avg_sq"])
    opt.optimizer.state[p]["exp_avg_sq"] = odd

    def others():  # everything but the odd tensor, which may have no storage to read
        return {k: v for k, v in snapshot_without(opt, p, "exp_avg_sq").items()}

    before = others()
    storage = odd.untyped_storage().nbytes() if odd.device.type != "meta" else None
    with pytest.raises(bridge_fgo.BridgeFGOError, match=f"cannot take over the state 'exp_avg_sq' of a parameter of "
                                                         f"shape \\(4, 8\\).*{words}.*Nothing was copied or freed"):
        engine.offload()
    assert engine.transfers.adopted == [] and opt.optimizer.state[p]["exp_avg_sq"] is odd
    if storage is not None:
        assert odd.untyped_storage().nbytes() == storage
    assert_same(before, others())
    assert_whole_on_host_but(engine, p, "exp_avg_sq")


def test_states_a_load_bound_elsewhere_are_each_checked_before_any_is_copied_into_the_buffer():
    """take_all copies what is already on the host in one threaded copy: a tensor unlike the plan among them is
    refused before that copy, so no host view was written and nothing was rebound."""
    opt = make()
    engine = engine_for(opt, 1)
    step(opt, engine)
    a, b = params(opt)[0], params(opt)[1]
    view = opt.optimizer.state[a]["exp_avg"]  # bound to its host view between steps
    before = view.clone()
    fresh = view.clone() + 1  # what a load bound elsewhere, on the host: a candidate for the threaded copy
    opt.optimizer.state[a]["exp_avg"] = fresh
    opt.optimizer.state[b]["exp_avg_sq"] = torch.zeros(5)  # unlike the plan
    with pytest.raises(bridge_fgo.BridgeFGOError, match="has shape \\(5,\\).*Nothing was copied or freed"):
        engine.transfers.take_all()
    assert torch.equal(view, before) and opt.optimizer.state[a]["exp_avg"] is fresh


def snapshot_without(opt, param, key):
    saved = opt.optimizer.state[param].pop(key)
    try:
        return snapshot(opt)
    finally:
        opt.optimizer.state[param][key] = saved


def assert_whole_on_host_but(engine, param, key):
    for part in engine.parts:
        b = part.bindings
        for e in part.entries():
            if not (e.param is param and e.key == key):
                assert b.get(e) is None or (b.get(e).data_ptr() == e.host.data_ptr()), e.name


def _freed(t):
    out = torch.zeros_like(t)
    out.untyped_storage().resize_(0)
    return out


def test_offload_takes_over_a_tensor_like_the_plan_as_a_load_makes_it():
    base, opt = make(), make()
    engine = engine_for(opt, 1)
    step(base)
    step(opt, engine)
    for run in (base, opt):
        p = params(run)[1]
        run.optimizer.state[p]["exp_avg_sq"] = run.optimizer.state[p]["exp_avg_sq"].clone() * 0.5
    step(base)
    step(opt, engine)
    assert_same(snapshot(base), snapshot(opt))
    assert len(SHAPES) + 1 == len(params(opt))
