"""The one-window engine (chunk_mb=0) on CPU tensors: what moves and what never does, buffer sizing,
exactness with every inner optimizer Megatron-Core builds, the order of operations through Bridge's
real train_step, faults, unpatch mid-training. GPU behaviour (streams, pinned memory, overlap) is
proven by scripts/bench_offload.py, not here."""
import pytest
import torch

import bridge_fgo
from bridge_fgo.engine.onewindow import OneWindowEngine as Engine
from bridge_fgo.engine.tensors import ALIGN
from support import harness

ORDER = ["zero_grad_buffer", "zero_grad", "param-buffer copy", "forward-backward",
         "finalize(pg_collection=pg_collection)", "step", "scheduler.step"]


def ptrs(ts):
    return {t.untyped_storage().data_ptr() for t in ts}


def test_chooses_masters_and_states_never_model_tensors():
    opt = harness.make_distributed_optimizer(harness.Recorder(), with_tensors=True)
    e = Engine([opt])
    masters = opt.shard_fp32_from_float16_groups[0]
    assert ptrs(e._candidates()) == ptrs(masters)  # before the first step: masters only
    opt.step_states()
    chosen = e._candidates()
    states = [v for s in opt.optimizer.state.values() for v in s.values() if v.dim()]
    assert len(states) == 6  # exp_avg, exp_avg_sq for 3 params; the 0-dim step counters stay
    assert ptrs(chosen) == ptrs(masters) | ptrs(states)
    never = [*opt.model_float16_groups[0], *opt.model_fp32_groups[0], *opt.shard_fp32_groups[0],
             opt.buffers[0].param_data, opt.buffers[0].grad_data]
    assert not ptrs(chosen) & ptrs(never)


def test_tensor_sharing_storage_is_not_moved():
    opt = harness.make_distributed_optimizer(harness.Recorder(), with_tensors=True)
    opt.step_states()
    p = opt.shard_fp32_from_float16_groups[0][0]
    flat = torch.zeros(2 * p.numel())
    opt.optimizer.state[p]["exp_avg"] = flat[: p.numel()].view_as(p)  # a view of a larger storage
    e = Engine([opt])
    assert flat.untyped_storage().data_ptr() not in ptrs(e._candidates())
    assert e.shared == 1


def test_buffer_sized_once_for_predicted_states():
    opt = harness.make_distributed_optimizer(harness.Recorder(), with_tensors=True)
    e = Engine([opt])
    e.prepare()
    size = e.pinned_bytes
    expected = sum(2 * ((p.numel() * 4 + ALIGN - 1) // ALIGN * ALIGN) for p in opt.optimizer.param_groups[0]["params"])
    expected += sum((m.numel() * 4 + ALIGN - 1) // ALIGN * ALIGN for m in opt.shard_fp32_from_float16_groups[0])
    assert size == expected
    buf = e.buffer
    opt.step_states()
    e.offload()  # Adam's states appeared: replanned into the same buffer
    assert e.buffer is buf and len(e.plan) == 8
    assert e.bytes == sum(t.numel() * t.element_size() for t, _, _ in e.plan)


def test_release_frees_and_reload_restores_exactly():
    opt = harness.make_distributed_optimizer(harness.Recorder(), with_tensors=True)
    opt.step_states()
    e = Engine([opt])
    e.prepare()
    before = [t.clone() for t in e._candidates()]
    e.offload(); e.release()
    assert all(t.untyped_storage().nbytes() == 0 for t, _, _ in e.plan)
    assert e.offload() == 0  # released: nothing is read from freed storage
    e.reload(); e.wait_reload()
    assert all(torch.equal(a, b) for a, (b, _, _) in zip(before, e.plan))


def _train(steps, offload, **kw):
    opt = harness.make_distributed_optimizer(harness.Recorder(), with_tensors=True, seed=7, **kw)
    e = Engine([opt])
    e.prepare()
    for _ in range(steps):
        if offload:
            e.offload(); e.release(); e.reload(); e.wait_reload()
        opt.step_states()
    inner = opt.optimizer
    return [p.detach().clone() for g in inner.param_groups for p in g["params"]] + [
        v.detach().clone() for g in inner.param_groups for p in g["params"] for v in inner.state[p].values()]


@pytest.mark.parametrize("kw", [{}, dict(optimizer="apex"), dict(optimizer="te"),
                                dict(optimizer="te", precision_aware=True, exp_avg_dtype=torch.bfloat16,
                                     exp_avg_sq_dtype=torch.bfloat16)], ids=["torch", "apex", "te", "te-precision-aware"])
def test_training_is_bit_identical_with_offload(kw):
    a, b = _train(5, False, **kw), _train(5, True, **kw)
    assert len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


def builtin_rig(**kw):
    return harness.Rig(with_tensors=True, **kw)  # no config flag: offload=builtin asks for it


def test_builtin_order_through_real_train_step():
    bridge_fgo.patch(offload="builtin", chunk_mb=0)  # the one-window engine
    rig = builtin_rig()
    harness.run_steps(rig, steps=3)
    assert rig.events == ORDER * 3  # the stand-in step asserts it never saw released storage
    (s,) = bridge_fgo.status().sessions
    assert s["mode"] == "builtin" and s["calls"] == {"offload": 3, "release": 3, "reload": 3}
    assert s["tensors"] == 8 and s["state"] == "resident" and s["states_on"] == "GPU"
    masters, moments = (64 + 32) * 4, (64 + 32 + 16) * 4 * 2
    assert s["bytes_offloaded"] == masters + 2 * (masters + moments)  # step 1: masters only (no Adam state yet)


@pytest.mark.parametrize("kw", [{}, dict(optimizer="apex"), dict(optimizer="te", precision_aware=True,
                                                                  store_param_remainders=True)],
                         ids=["torch", "apex", "te-precision-aware-remainders"])
def test_builtin_matches_unpatched_run(kw):
    baseline = builtin_rig(**kw)
    harness.run_steps(baseline, steps=4)
    bridge_fgo.patch(offload="builtin", chunk_mb=0)  # the one-window engine
    patched = builtin_rig(**kw)
    harness.run_steps(patched, steps=4)
    a = [p for g in baseline.dist_optimizer.optimizer.param_groups for p in g["params"]]
    b = [p for g in patched.dist_optimizer.optimizer.param_groups for p in g["params"]]
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert torch.equal(baseline.dist_optimizer.buffers[0].param_data, patched.dist_optimizer.buffers[0].param_data)


def test_builtin_exception_after_release_recovers():
    bridge_fgo.patch(offload="builtin", chunk_mb=0)  # the one-window engine
    rig = builtin_rig()
    harness.run_steps(rig, steps=2)
    rig.forward_backward_func = harness.forward_backward_func(rig.events, RuntimeError("oom in backward"))
    with pytest.raises(RuntimeError, match="oom"):
        harness.run_steps(rig, steps=1)
    session = next(iter(bridge_fgo.instrument.patcher._current.callsites.registry.sessions()))
    assert session.state == "resident"
    assert all(t.untyped_storage().nbytes() > 0 for t, _, _ in session.adapter.engine.plan)
    rig.forward_backward_func = harness.forward_backward_func(rig.events)
    harness.run_steps(rig, steps=1)  # and training goes on


def test_builtin_unpatch_mid_training_leaves_states_resident():
    bridge_fgo.patch(offload="builtin", chunk_mb=0)  # the one-window engine
    rig = builtin_rig()
    harness.run_steps(rig, steps=2)
    session = next(iter(bridge_fgo.instrument.patcher._current.callsites.registry.sessions()))
    plan = list(session.adapter.engine.plan)
    bridge_fgo.unpatch()
    assert plan and all(t.untyped_storage().nbytes() > 0 for t, _, _ in plan)
    assert session.adapter.engine.buffer is None  # host memory given back
    del rig.events[:]
    harness.run_steps(rig, steps=1)
    assert rig.events == ORDER


def test_builtin_rejects_config_before_first_step():
    bridge_fgo.patch(offload="builtin")
    rig = harness.Rig(cfg=harness.config_container(harness.optimizer_config(optimizer_cpu_offload=True)),
                      with_tensors=True)
    with pytest.raises(bridge_fgo.BridgeFGOConfigError, match="optimizer_cpu_offload"):
        harness.run_steps(rig, steps=1)
    assert rig.events == []


def test_states_replaced_by_a_load_are_moved_not_the_ones_they_replaced():
    """torch's load_state_dict puts the loaded tensors in the optimizer's state, as many as before: the
    next offload moves those, and lets go of the ones they replaced."""
    opt = harness.make_distributed_optimizer(harness.Recorder(), with_tensors=True)
    e = Engine([opt])
    e.prepare()
    opt.step_states()
    e.offload(); e.release(); e.reload(); e.wait_reload()
    inner = opt.optimizer
    replaced = [t for t, _, _ in e.plan if not any(t is m for m in opt.shard_fp32_from_float16_groups[0])]
    saved = inner.state_dict()
    inner.load_state_dict({"state": {k: {n: v.clone() for n, v in s.items()} for k, s in saved["state"].items()},
                           "param_groups": saved["param_groups"]})
    loaded = [v for s in inner.state.values() for v in s.values() if v.dim()]
    assert not ptrs(loaded) & ptrs(replaced)
    e.offload(); e.release()
    assert all(t.untyped_storage().nbytes() == 0 for t in loaded)  # what the step will read was moved
    assert not any(t is r for t, _, _ in e.plan for r in replaced)
    e.reload(); e.wait_reload()
    assert all(t.untyped_storage().nbytes() > 0 for t in loaded)
