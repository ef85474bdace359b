"""The streamed optimizer step (bridge_fgo/streamed.py) on CPU: exactness against Megatron-Core's own
update without offload, the window bound, and every reader between steps seeing whole, current data.

The optimizer is the harness's real DistributedOptimizer subclass: its update is Megatron-Core's
step_with_ready_grads (torch AdamW, then _copy_main_params_to_model_params into the param buffer).
"""
import types

import pytest
import torch

import bridge_fgo
from support import harness

from bridge_fgo.errors import BridgeFGOError
from bridge_fgo.streamed import StreamedEngine, problems

SHAPES = ((8, 8), (4, 8), (16,), (3, 5), (2, 2, 3))


def make(seed=0, foreach=None):
    opt = harness.make_distributed_optimizer(harness.Recorder(), with_tensors=True, seed=seed, shapes=SHAPES,
                                             foreach=foreach)
    # what DistributedOptimizer.__init__ builds for its checkpoint readers
    opt.model_param_group_index_map = {}
    for i, p in enumerate(opt.model_float16_groups[0]):
        opt.model_param_group_index_map[p] = (0, i)
    opt.model_param_group_index_map[opt.model_fp32_groups[0][0]] = (0, len(SHAPES))
    opt.per_bucket_numel = opt.per_bucket_numel_unpadded = [{}]
    return opt


def step(opt, engine=None):
    """One optimizer step through the engine's sites, as the patched train_step drives them."""
    if engine is not None:
        engine.offload()
        engine.release()
        engine.reload()
    try:
        opt.step_states()
    finally:
        if engine is not None:
            engine.settle()


def params(opt):
    return [p for g in opt.optimizer.param_groups for p in g["params"]]


def snapshot(opt):
    """Everything a reader can see, as plain clones."""
    out = {"param_buffer": opt.buffers[0].param_data.clone()}
    for i, p in enumerate(params(opt)):
        out[f"param{i}"] = p.detach().clone()
        for k, v in opt.optimizer.state.get(p, {}).items():
            out[f"param{i}.{k}"] = v.detach().clone()
    return out


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def assert_whole_on_host(engine):
    assert engine.on_host()
    for e in engine.entries:
        t = engine._current(e)
        assert t.untyped_storage().nbytes() >= e.nbytes  # never released storage outside the update


@pytest.mark.parametrize("foreach", [None, True, False])
@pytest.mark.parametrize("chunk_bytes", [1, 2000, 10**9])  # one parameter per chunk, a few, one chunk
def test_bit_identical_to_megatron_core_without_offload(foreach, chunk_bytes):
    base, opt = make(foreach=foreach), make(foreach=foreach)
    engine = StreamedEngine(opt, chunk_bytes)
    engine.prepare()
    for _ in range(4):
        step(base)
        step(opt, engine)
        assert_whole_on_host(engine)
        assert_same(snapshot(base), snapshot(opt))
    assert engine.steps_streamed == 4


def test_window_bound_and_parameters_never_split():
    opt = make()
    engine = StreamedEngine(opt, 2000)
    engine.prepare()
    seen = []

    def record(optimizer, args, kwargs):
        ps = [p for g in optimizer.param_groups for p in g["params"]]
        seen.append([id(p) for p in ps])
        # everything this update reads that moves is inside the arena: the window, nothing else
        lo = engine.arena.data_ptr()
        for p in ps:
            moved = [t for e in engine.entries if e.param is p for t in (engine._current(e),) if t is not None]
            for t in moved:
                assert lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= lo + engine.arena_bytes

    opt.optimizer.register_step_pre_hook(record)
    for _ in range(3):
        step(opt, engine)
    bundles = {}
    for e in engine.entries:
        bundles.setdefault(id(e.param), 0)
        bundles[id(e.param)] += -(-e.nbytes // 512) * 512
    assert len(engine.chunks) > 1
    sizes = [c.nbytes for c in engine.chunks]
    assert max(sizes) <= max(2000, max(bundles.values()))
    # the arena holds the largest pair of consecutive chunks, less than two of the largest
    assert engine.step_peak_bytes == engine.arena_bytes == max(a + b for a, b in zip(sizes, sizes[1:]))
    assert engine.arena is None  # given back after the update
    per_step = len(engine.chunks)
    assert len(seen) == 3 * per_step
    for chunk, ids in zip(engine.chunks * 3, seen):
        assert ids == [id(p) for _, ps in chunk.groups for p in ps]  # whole parameters, chunk by chunk
    stepped = [i for ids in seen[:per_step] for i in ids]
    assert sorted(stepped) == sorted(id(p) for p in params(opt))  # each parameter exactly once per step


def test_between_steps_masters_and_moments_live_on_the_host_and_gpu_storage_is_freed():
    opt = make()
    originals = [p.data for p in opt.shard_fp32_from_float16_groups[0]]
    engine = StreamedEngine(opt, 2000)
    engine.prepare()
    step(opt, engine)
    host = engine.buffer.tensor
    lo, hi = host.data_ptr(), host.data_ptr() + host.numel()
    for p in opt.shard_fp32_from_float16_groups[0]:
        assert lo <= p.data_ptr() < hi
    for p in params(opt):
        for k, v in opt.optimizer.state[p].items():
            if v.dim():
                assert lo <= v.data_ptr() < hi, k
    assert all(t.untyped_storage().nbytes() == 0 for t in originals)  # the old storage went back
    assert opt.__dict__.get("_copy_main_params_to_model_params") is None  # hooks only while armed
    assert "step" not in opt.optimizer.__dict__
    assert engine.bytes == sum(e.nbytes for e in engine.entries)
    assert engine.pinned_bytes >= engine.bytes


def test_checkpoint_reader_between_steps_sees_current_states():
    """Megatron-Core's real dp_reshardable reader (the default of Bridge's torch_dist save) reads the
    host-bound tensors; every value equals the run without offload."""
    base, opt = make(), make()
    engine = StreamedEngine(opt, 2000)
    engine.prepare()
    for _ in range(2):
        step(base)
        step(opt, engine)
    got, want = opt.get_parameter_state_dp_reshardable(), base.get_parameter_state_dp_reshardable()
    for bucket_got, bucket_want in zip(got[0][torch.bfloat16], want[0][torch.bfloat16]):
        for a, b in zip(bucket_got, bucket_want):
            assert a.keys() == b.keys() and {"param", "exp_avg", "exp_avg_sq"} <= a.keys()
            for k in ("param", "exp_avg", "exp_avg_sq"):
                assert torch.equal(a[k], b[k]), k


def test_reload_model_params_writes_the_host_masters_and_training_goes_on_identically():
    base, opt = make(), make()
    engine = StreamedEngine(opt, 2000)
    engine.prepare()
    for run, eng in ((base, None), (opt, engine)):
        step(run, eng)
        run.buffers[0].param_data.mul_(0.5)  # the model params change under the optimizer
        run._copy_model_params_to_main_params()  # what reload_model_params() does
        step(run, eng)
    assert_same(snapshot(base), snapshot(opt))
    assert_whole_on_host(engine)


def test_skipped_step_and_rerun_leave_states_untouched_and_whole():
    opt = make()
    engine = StreamedEngine(opt, 2000)
    engine.prepare()
    step(opt, engine)
    before = snapshot(opt)
    engine.offload()
    engine.release()
    engine.reload()  # finalization armed the update and prefetched the first chunk...
    engine.offload()  # ...and the rerun state machine runs forward-backward again
    engine.reload()
    engine.settle()  # ...and the step was skipped (inf/nan gradients)
    assert_whole_on_host(engine)
    assert_same(before, snapshot(opt))
    step(opt, engine)  # and the next one streams as usual
    assert engine.steps_streamed == 2


@pytest.mark.parametrize("fail_at", [0, 1, 3])
def test_exception_inside_a_chunk_leaves_whole_storage_and_no_hooks(fail_at):
    opt = make()
    engine = StreamedEngine(opt, 2000)
    engine.prepare()
    step(opt, engine)
    calls = {"n": 0}

    def boom(optimizer, args, kwargs):
        calls["n"] += 1
        if calls["n"] == fail_at + 1:
            raise RuntimeError("simulated failure in the update")

    handle = opt.optimizer.register_step_pre_hook(boom)
    with pytest.raises(RuntimeError, match="simulated"):
        step(opt, engine)
    handle.remove()
    assert_whole_on_host(engine)
    assert "step" not in opt.optimizer.__dict__ and "_copy_main_params_to_model_params" not in opt.__dict__
    assert all(len(g["params"]) for g in opt.optimizer.param_groups) and len(params(opt)) == len(SHAPES) + 1
    step(opt, engine)  # training can go on (a restarted iteration)


def test_close_puts_every_state_back_on_the_device_as_ordinary_tensors():
    base, opt = make(), make()
    engine = StreamedEngine(opt, 2000)
    engine.prepare()
    for _ in range(2):
        step(base)
        step(opt, engine)
    engine.close()
    assert_same(snapshot(base), snapshot(opt))
    assert engine.buffer is None and not engine.entries
    step(base)
    step(opt)  # Megatron-Core alone, as after unpatch()
    assert_same(snapshot(base), snapshot(opt))


def test_unpredicted_state_is_refused_clearly():
    opt = make()
    engine = StreamedEngine(opt, 2000)
    engine.prepare()
    for e in engine.entries:  # pretend the plan expected another dtype for the first moment
        if e.key == "exp_avg":
            e.dtype, e.nbytes = torch.bfloat16, e.nbytes // 2
            break
    with pytest.raises(BridgeFGOError, match="not the predicted"):
        step(opt, engine)
    assert "step" not in opt.optimizer.__dict__


def test_zero_window_is_not_a_streamed_step():
    with pytest.raises(ValueError, match="window"):
        StreamedEngine(make(), 0)


def cfg(**sections):
    ns = types.SimpleNamespace
    base = dict(optimizer=ns(), ddp=ns(), checkpoint=ns(save=None, load=None), logger=ns())
    base.update(sections)
    return ns(**base)


@pytest.mark.parametrize("section, fields, field", [
    ("optimizer", {"reuse_grad_buf_for_mxfp8_param_ag": True}, "cfg.optimizer.reuse_grad_buf_for_mxfp8_param_ag"),
    ("ddp", {"fp8_param_gather": True}, "cfg.ddp.fp8_param_gather"),
    ("ddp", {"fp4_param_gather": True}, "cfg.ddp.fp4_param_gather"),
    ("optimizer", {"use_precision_aware_optimizer": True}, "cfg.optimizer.use_precision_aware_optimizer"),
    ("logger", {"log_params_norm": True}, "cfg.logger.log_params_norm"),
    ("checkpoint", {"save": "/ckpt", "async_save": True}, "cfg.checkpoint.async_save"),
    ("checkpoint", {"save": "/ckpt", "ckpt_format": "torch"}, "cfg.checkpoint.ckpt_format"),
    ("checkpoint", {"load": "/ckpt", "dist_ckpt_optim_fully_reshardable": True},
     "cfg.checkpoint.dist_ckpt_optim_fully_reshardable"),
])
def test_configurations_the_streamed_step_cannot_serve_are_named_with_the_fix(section, fields, field):
    found = problems(cfg(**{section: types.SimpleNamespace(**fields)}))
    assert len(found) == 1 and found[0].startswith(field) and "chunk_mb=0" in found[0]


def test_servable_configurations_pass():
    ns = types.SimpleNamespace
    assert problems(cfg()) == []
    assert problems(cfg(checkpoint=ns(save="/ckpt", async_save=True, save_optim=False))) == []
    assert problems(cfg(checkpoint=ns(save="/ckpt", ckpt_format="torch_dist"))) == []


# -- through Bridge's real train_step, patched by bridge_fgo.patch(offload="builtin", chunk_mb=...) ------------
# Bundles (master + two moments) of 1-7 MB: with chunk_mb=1 every parameter is a chunk of its own.
BIG = ((512, 1024), (600, 600), (1000,), (300, 700))


def rig(**kw):
    return harness.Rig(cfg=harness.config_container(mxfp8_copy=False), with_tensors=True, shapes=BIG, **kw)


def engine_of():
    (session,) = bridge_fgo.instrument.patcher._current.callsites.registry.sessions()
    (engine,) = session.adapter.engines
    return session, engine


def rig_snapshot(r):
    return snapshot(r.dist_optimizer)


def test_train_step_bit_identical_and_same_bridge_calls():
    base = rig()
    harness.run_steps(base, steps=4)
    bridge_fgo.patch(offload="builtin", chunk_mb=1)
    patched = rig()
    harness.run_steps(patched, steps=4)
    assert_same(rig_snapshot(base), rig_snapshot(patched))
    assert patched.events == base.events  # Bridge's own calls, in Bridge's order
    session, engine = engine_of()
    assert engine.steps_streamed == 4 and len(engine.chunks) == len(BIG) + 1
    assert_whole_on_host(engine)


def test_train_step_window_bound_and_reporting(caplog_fgo):
    bridge_fgo.patch(offload="builtin", chunk_mb=1)
    r = rig()
    sizes = []

    def record(optimizer, args, kwargs):
        sizes.append(sum(p.numel() * p.element_size() * 3 for g in optimizer.param_groups for p in g["params"]))

    r.dist_optimizer.optimizer.register_step_pre_hook(record)
    harness.run_steps(r, steps=3)
    session, engine = engine_of()
    assert len(sizes) == 3 * len(engine.chunks)  # one chunk at a time
    assert max(a + b for a, b in zip(sizes, sizes[1:])) <= engine.arena_bytes
    assert "step" not in r.dist_optimizer.optimizer.__dict__  # hooks only while an update is armed
    (s,) = bridge_fgo.status().sessions
    assert s["chunk_mb"] == 1 and s["chunks"] == len(engine.chunks)
    chunk_sizes = [c.nbytes for c in engine.chunks]
    assert s["step_peak_bytes"] == engine.arena_bytes == max(a + b for a, b in zip(chunk_sizes, chunk_sizes[1:]))
    steady = engine.bytes
    assert s["bytes"] == s["per_optimizer_bytes"][0] == steady
    masters = sum(4 * torch.Size(shape).numel() for shape in BIG)
    assert s["master_bytes"] == masters and steady == 3 * masters + 2 * 16 * 4  # + the fp32 param's moments
    line = next(m for m in caplog_fgo.messages if "offload active" in m)
    # the first step's line gives the steady figure: Adam's moments did not exist before step 1
    assert f"{steady} bytes offloaded per step" in line
    assert f"window: 1 MB chunks, {len(engine.chunks)} chunk(s), the step adds at most {engine.arena_bytes} bytes" in line


def test_train_step_exception_in_backward_leaves_whole_host_states():
    bridge_fgo.patch(offload="builtin", chunk_mb=1)
    r = rig()
    harness.run_steps(r, steps=2)
    before = rig_snapshot(r)
    r.forward_backward_func = harness.forward_backward_func(r.events, RuntimeError("oom in backward"))
    with pytest.raises(RuntimeError, match="oom"):
        harness.run_steps(r, steps=1)
    session, engine = engine_of()
    assert session.state == "resident"
    assert_whole_on_host(engine)
    assert_same(before, rig_snapshot(r))
    r.forward_backward_func = harness.forward_backward_func(r.events)
    harness.run_steps(r, steps=1)


def test_train_step_skipped_update_and_checkpoint_and_exit_see_current_states():
    bridge_fgo.patch(offload="builtin", chunk_mb=1)
    r = rig()
    harness.run_steps(r, steps=2)
    before = rig_snapshot(r)
    r.optimizer.step_result = (False, None, None)  # inf/nan gradients: Megatron-Core skips the update
    harness.run_steps(r, steps=1)
    _, engine = engine_of()
    assert_whole_on_host(engine)
    assert_same(before, rig_snapshot(r))
    # the rerun state machine asks for a checkpoint and exit: train_step returns before the step and
    # train() saves; the reader sees the host copy, whole
    out = harness.run_steps(r, steps=1, checkpoint_and_exit=(True, True, 0))
    assert out[0][2:4] == (True, True)
    assert_whole_on_host(engine)
    assert_same(before, rig_snapshot(r))


def test_unpatch_between_steps_then_megatron_core_alone_goes_on_identically():
    base = rig()
    harness.run_steps(base, steps=4)
    bridge_fgo.patch(offload="builtin", chunk_mb=1)
    r = rig()
    harness.run_steps(r, steps=2)
    _, engine = engine_of()
    bridge_fgo.unpatch()
    assert engine.buffer is None
    harness.run_steps(r, steps=2)
    assert_same(rig_snapshot(base), rig_snapshot(r))


def test_train_step_refuses_what_the_streamed_step_cannot_serve_before_the_first_step():
    bridge_fgo.patch(offload="builtin")  # the default window
    r = harness.Rig(with_tensors=True)  # the harness's default config takes the MXFP8 param-buffer copy
    with pytest.raises(bridge_fgo.BridgeFGOConfigError, match="reuse_grad_buf_for_mxfp8_param_ag.*chunk_mb=0"):
        harness.run_steps(r, steps=1)
    assert r.events == []
