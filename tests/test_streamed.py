"""The streamed optimizer step (bridge_fgo/engine/) on CPU: exactness against Megatron-Core's own update
without offload for every inner optimizer Megatron-Core builds (torch AdamW, Transformer Engine's and
apex's FusedAdam through their contract stand-ins, the precision-aware layouts), the window bound,
group-level state, a memory budget, and every reader between steps seeing whole, current data.

The optimizer is the harness's real DistributedOptimizer subclass: its update is Megatron-Core's
step_with_ready_grads (the inner step, then _copy_main_params_to_model_params into the param buffer).
On CPU the engine's copies are deferred until something waits for them (engine/copies.py), so a wait
the engine forgets shows here as stale data.
"""
import contextlib
import functools
import logging
import types
from unittest import mock

import pytest
import torch

import bridge_fgo
from bridge_fgo.engine import contracts, subset
from bridge_fgo.engine.streamed import StreamedEngine
from bridge_fgo.engine.streamed import readers as readers_mod
from bridge_fgo.engine.tensors import same
from bridge_fgo.instrument import refusals
from support import fused_adam, harness

SHAPES = ((8, 8), (4, 8), (16,), (3, 5), (2, 2, 3))
OPTIMIZERS = {
    "torch-foreach-default": dict(optimizer="torch"),
    "torch-foreach": dict(optimizer="torch", foreach=True),
    "torch-for-loop": dict(optimizer="torch", foreach=False),
    "apex": dict(optimizer="apex"),
    "apex-3-groups": dict(optimizer="apex", groups=3),
    "te": dict(optimizer="te"),
    "te-2-groups": dict(optimizer="te", groups=2),
    "te-precision-aware-bf16": dict(optimizer="te", precision_aware=True, exp_avg_dtype=torch.bfloat16,
                                    exp_avg_sq_dtype=torch.bfloat16),
    "te-precision-aware-fp16-scaled": dict(optimizer="te", precision_aware=True, exp_avg_dtype=torch.float16,
                                           exp_avg_sq_dtype=torch.float16, groups=2),
    "te-precision-aware-remainders": dict(optimizer="te", precision_aware=True, store_param_remainders=True),
}


def make(seed=0, **kw):
    opt = harness.make_distributed_optimizer(harness.Recorder(), with_tensors=True, seed=seed, shapes=SHAPES, **kw)
    opt.per_bucket_numel = opt.per_bucket_numel_unpadded = [{}]
    return opt


def engine_for(opt, chunk_bytes=2000, budget=None, auto=False):
    engine = StreamedEngine([opt], chunk_bytes, budget, auto=auto)
    engine.prepare()
    return engine


def measured(**figures):
    """A probe that reads the given allocated figures (firststep.FirstStep's fields), as a GPU would."""
    from bridge_fgo.engine import firststep

    class Given(firststep.Probe):
        def at_offload(self, device):
            if not self.done:
                self.first.before = figures["before"]

        def at_reload(self, device):
            if not self.done:
                self.first.backward, self.first.base = figures["backward"], figures["base"]

        def at_step_end(self, device, window, largest_chunk, scratch_per_byte):
            first = super().at_step_end(device, window, largest_chunk, scratch_per_byte)
            first.step = figures["step"]
            return first

    return Given()


step = harness.engine_step


@contextlib.contextmanager
def on_each_pass(record):
    """record(inner, groups) as each pass of a streamed update begins (a chunk, or the resident
    parameters), with the param groups the pass steps. torch's step hooks fire once per step, around
    all the passes, so they cannot see them."""
    real = subset.step_subset

    def spy(inner, state, params_by_group):
        record(inner, state.groups(params_by_group))
        return real(inner, state, params_by_group)

    with mock.patch.object(subset, "step_subset", spy):
        yield


def params(opt):
    return [p for g in opt.optimizer.param_groups for p in g["params"]]


def snapshot(opt):
    """Everything a reader can see, as plain clones: parameters, states, scales, the group-level step."""
    inner = opt.optimizer
    out = {"param_buffer": opt.buffers[0].param_data.clone()}
    for gi, g in enumerate(inner.param_groups):
        if contracts.of(inner).group_step and "step" in g:  # what the fused optimizers advance per group
            out[f"group{gi}.step"] = g["step"].clone() if isinstance(g["step"], torch.Tensor) else g["step"]
        for i, p in enumerate(g["params"]):
            out[f"group{gi}.param{i}"] = p.detach().clone()
            for k, v in inner.state.get(p, {}).items():
                out[f"group{gi}.param{i}.{k}"] = v.detach().clone()
            for k, v in getattr(inner, "_scales", {}).get(p, {}).items():
                out[f"group{gi}.param{i}.scale.{k}"] = v.clone()
    return out


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return a == b


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert _equal(a[k], b[k]), k


def entries(engine):
    return [(part.bindings, e) for part in engine.parts for e in part.entries()]


def assert_whole_on_host(engine):
    assert engine.on_host()
    for b, e in entries(engine):
        t = b.get(e)
        if t is not None:
            assert t.untyped_storage().nbytes() >= e.nbytes  # never released storage outside the update


@pytest.mark.parametrize("kind", OPTIMIZERS)
@pytest.mark.parametrize("chunk_bytes", [1, 2000, 10**9])  # one parameter per chunk, a few, one chunk
def test_bit_identical_to_megatron_core_without_offload(kind, chunk_bytes):
    base, opt = make(**OPTIMIZERS[kind]), make(**OPTIMIZERS[kind])
    engine = engine_for(opt, chunk_bytes)
    for _ in range(4):
        step(base)
        step(opt, engine)
        assert_whole_on_host(engine)
        assert_same(snapshot(base), snapshot(opt))
    assert engine.steps_streamed == 4
    assert engine.optimizers() == [contracts.describe(opt.optimizer)]


def test_plan_takes_every_state_with_its_real_dtype_before_step_one():
    """TE's precision-aware layouts, predicted before the optimizer created anything, equal what it
    creates: bf16 moments with their scales, fp32 masters; int16 remainders for bf16 parameters."""
    opt = make(**OPTIMIZERS["te-precision-aware-bf16"])
    engine = engine_for(opt)
    planned = {(id(e.param), e.kind, e.key): (e.dtype, e.shape) for _, e in entries(engine)}
    step(opt, engine)
    inner = opt.optimizer
    made = {}
    for p in params(opt):
        for k, v in inner.state[p].items():
            made[(id(p), "state", k)] = (v.dtype, tuple(v.shape))
        for k, v in inner._scales.get(p, {}).items():
            made[(id(p), "scale", k)] = (v.dtype, tuple(v.shape))
    assert planned == made
    assert {k[2]: v[0] for k, v in made.items() if k[1] == "state"} == {
        "exp_avg": torch.bfloat16, "exp_avg_sq": torch.bfloat16, "master_param": torch.float32}
    opt = make(**OPTIMIZERS["te-precision-aware-remainders"])
    engine = engine_for(opt)
    masters = {e.dtype for _, e in entries(engine) if e.key == "master_param"}
    assert masters == {torch.int16, torch.float32}  # remainders for bf16 shards; the fp32 param keeps fp32


@pytest.mark.parametrize("kind, capturable", [("te", False), ("te", True), ("apex", False)])
def test_group_step_advances_exactly_once_per_step(kind, capturable):
    """An int, or (capturable: apex's path for it is CUDA-only) a tensor advanced in place."""
    kw = dict(OPTIMIZERS[kind], groups=2)
    if capturable:
        kw["capturable"] = True
    opt = make(**kw)
    engine = engine_for(opt, 1)  # every parameter a chunk of its own: each group stepped in several passes
    step(opt, engine)
    held = [g.get("step") for g in opt.optimizer.param_groups]
    for _ in range(2):
        step(opt, engine)
    for g, before in zip(opt.optimizer.param_groups, held):
        assert int(g["step"]) == 3
        if capturable:
            assert g["step"] is before  # the same tensor, advanced in place: a captured graph holds it


def test_every_param_group_keeps_its_index_in_every_pass():
    opt = make(optimizer="apex", groups=3)
    engine = engine_for(opt, 1)
    seen = []

    def record(optimizer, groups):
        seen.append([len(g["params"]) for g in groups])
        # apex pairs param_groups with param_groups_master by position
        assert len(groups) == len(optimizer.param_groups_master)

    with on_each_pass(record):
        step(opt, engine)
    assert seen and all(len(s) == 3 for s in seen)
    assert all(sum(s) == 1 for s in seen)  # one parameter per pass; the other groups empty, in place


@pytest.mark.parametrize("slots", [2, 3])
def test_window_bound_and_parameters_never_split(slots):
    opt = make()
    chunk = 2000 if slots == 2 else 600  # a ring of three slots wraps: more chunks than slots
    engine = engine_for(opt, chunk)
    engine.plan.slots = slots
    engine.transfers.new_window()
    seen = []

    def record(optimizer, groups):
        ps = [p for g in groups for p in g["params"]]
        seen.append([id(p) for p in ps])
        # everything this update reads that moves is inside one slot of the window, nothing else
        spans = [(s.tensor.data_ptr(), s.tensor.data_ptr() + s.nbytes) for s in engine.transfers.window.slots
                 if s.tensor is not None]
        assert len(spans) <= slots
        for b, e in entries(engine):
            if any(e.param is p for p in ps):
                t = b.get(e)
                if t is not None:
                    assert any(lo <= t.data_ptr() and t.data_ptr() + e.nbytes <= hi for lo, hi in spans)

    with on_each_pass(record):
        for _ in range(3):
            step(opt, engine)
    assert len(engine.chunks) > slots
    sizes = [c.nbytes for c in engine.chunks]
    bundles = [b.nbytes for part in engine.parts for b in part.bundles]
    assert max(sizes) <= max(chunk, max(bundles))
    # chunk i goes to slot i % slots, each slot as large as the largest chunk it takes
    assert engine.window_bytes == sum(max(sizes[i::slots]) for i in range(slots)) <= slots * max(sizes)
    assert all(s.tensor is None for s in engine.transfers.window.slots)  # given back after the update
    per_step = len(engine.chunks)
    assert len(seen) == 3 * per_step
    for chunk, ids in zip(engine.chunks * 3, seen):
        assert ids == [id(b.param) for b in chunk.bundles]  # whole parameters, chunk by chunk
    stepped = [i for ids in seen[:per_step] for i in ids]
    assert sorted(stepped) == sorted(id(p) for p in params(opt))  # each parameter exactly once per step


def test_between_steps_masters_and_moments_live_on_the_host_and_gpu_storage_is_freed():
    opt = make()
    originals = [p.data for p in opt.shard_fp32_from_float16_groups[0]]
    engine = engine_for(opt)
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
    assert "_copy_main_params_to_model_params" not in opt.__dict__  # hooks only while armed
    assert "step" not in opt.optimizer.__dict__
    assert engine.bytes == sum(e.nbytes for _, e in entries(engine))
    assert engine.pinned_bytes >= engine.bytes


# -- readers between steps, with the last device-to-host copies still in flight ------------------------------
def _two_runs(kind="torch-foreach-default", steps=2):
    base, opt = make(**OPTIMIZERS.get(kind, {})), make(**OPTIMIZERS.get(kind, {}))
    engine = engine_for(opt)
    for _ in range(steps):
        step(base)
        step(opt, engine, wait=False)  # the next step's copies wait for the tail on their own
    assert engine.copies.pending() > 0 and engine.transfers.tail is not None  # the tail is in flight
    return base, opt, engine


@pytest.mark.parametrize("kind", ["torch-foreach-default", "te-precision-aware-fp16-scaled"])
def test_checkpoint_reader_waits_for_the_tail_and_sees_current_states(kind):
    """Megatron-Core's real dp_reshardable reader (the default of Bridge's torch_dist save) reads the
    host-bound tensors (for TE, through get_unscaled_state and the scales): every value equals the
    run without offload."""
    base, opt, engine = _two_runs(kind)
    got = opt.get_parameter_state_dp_reshardable()
    assert engine.copies.pending() == 0 and engine.transfers.tail is None and not engine.readers.guards
    want = base.get_parameter_state_dp_reshardable()
    for bucket_got, bucket_want in zip(got[0][torch.bfloat16], want[0][torch.bfloat16]):
        for a, b in zip(bucket_got, bucket_want):
            assert a.keys() == b.keys() and {"param", "exp_avg", "exp_avg_sq"} <= a.keys()
            for k in a:
                assert _equal(a[k], b[k]), k


def test_reload_model_params_waits_for_the_tail_then_writes_the_host_masters():
    base, opt, engine = _two_runs()
    for run in (base, opt):
        run.buffers[0].param_data.mul_(0.5)  # the model params change under the optimizer
        run._copy_model_params_to_main_params()  # what reload_model_params() does
    assert engine.copies.pending() == 0
    step(base)
    step(opt, engine)
    assert_same(snapshot(base), snapshot(opt))


def test_direct_readers_call_synchronize():
    base, opt, engine = _two_runs()
    engine.synchronize()
    assert engine.copies.pending() == 0 and not engine.readers.guards
    assert_same(snapshot(base), snapshot(opt))


def test_guards_are_instance_attributes_only_while_the_tail_is_in_flight():
    _, opt, engine = _two_runs()
    assert "sharded_state_dict" in opt.__dict__ and "state_dict" in opt.__dict__
    engine.synchronize()
    assert not any(name in opt.__dict__ for name in ("sharded_state_dict", "state_dict"))
    # what stays, from prepare() to close(), is the engine's own hook on reload_model_params (a load of
    # the model only remakes what the optimizer derives from the weights), never a reader's guard
    hook = opt.__dict__.get("reload_model_params")
    assert isinstance(hook, functools.partial) and hook.func is readers_mod._hook
    engine.close()
    assert "reload_model_params" not in opt.__dict__


def test_unwaited_steps_in_a_row_stay_exact():
    """Each update's host-to-device copies wait (on the copy queue, not the host) for the previous
    update's last device-to-host copies."""
    base, opt, engine = _two_runs(steps=4)
    engine.synchronize()
    assert_same(snapshot(base), snapshot(opt))


def test_skipped_step_and_rerun_leave_states_untouched_and_whole():
    opt = make()
    engine = engine_for(opt)
    step(opt, engine)
    before = snapshot(opt)
    engine.offload()
    engine.release()
    engine.reload()  # finalization armed the update and prefetched the first chunks...
    engine.offload()  # ...and the rerun state machine runs forward-backward again
    engine.reload()
    engine.settle()  # ...and the step was skipped (inf/nan gradients)
    engine.synchronize()
    assert_whole_on_host(engine)
    assert_same(before, snapshot(opt))
    step(opt, engine)  # and the next one streams as usual
    assert engine.steps_streamed == 2


@pytest.mark.parametrize("fail_at", [0, 2, 5])  # the first, a middle and the last of six chunks
def test_exception_inside_a_chunk_leaves_whole_storage_and_no_hooks(fail_at):
    """A pass that began may have written: the states are torn (tests/test_failures.py has the rest)."""
    opt = make()
    engine = engine_for(opt, 1)
    assert len(engine.chunks) == 6
    step(opt, engine)
    calls = {"n": 0}

    def boom(optimizer, groups):
        calls["n"] += 1
        if calls["n"] == fail_at + 1:
            raise RuntimeError("simulated failure in the update")

    with on_each_pass(boom), pytest.raises(bridge_fgo.BridgeFGOError, match=f"chunk {fail_at + 1} of 6") as err:
        step(opt, engine)
    assert isinstance(err.value.__cause__, RuntimeError) and engine.torn
    assert_whole_on_host(engine)
    assert "_copy_main_params_to_model_params" not in opt.__dict__
    assert all(len(g["params"]) for g in opt.optimizer.param_groups) and len(params(opt)) == len(SHAPES) + 1
    with pytest.raises(bridge_fgo.BridgeFGOError, match="optimizer step refused"):
        step(opt, engine)  # never stepped again while torn


@pytest.mark.parametrize("kind", ["torch-foreach-default", "te-precision-aware-bf16"])
def test_close_puts_every_state_back_on_the_device_as_ordinary_tensors(kind):
    base, opt = make(**OPTIMIZERS[kind]), make(**OPTIMIZERS[kind])
    engine = engine_for(opt)
    for _ in range(2):
        step(base)
        step(opt, engine, wait=False)
    engine.close()  # waits for the tail itself
    assert_same(snapshot(base), snapshot(opt))
    assert engine.buffer is None
    step(base)
    step(opt)  # Megatron-Core alone, as after unpatch()
    assert_same(snapshot(base), snapshot(opt))


def test_a_state_made_otherwise_than_planned_stays_where_it_is_and_nothing_fails(caplog):
    base, opt = make(), make()
    engine = StreamedEngine([opt], 2000)
    engine.plan_bytes()
    (e,) = [e for _, e in entries(engine) if e.key == "exp_avg"][:1]
    e.dtype, e.nbytes = torch.bfloat16, e.nbytes // 2  # pretend the plan expected another dtype
    engine.prepare()  # creates the states: this one unlike the plan
    with caplog.at_level(logging.WARNING, logger="bridge_fgo"):
        for _ in range(3):
            step(base)
            step(opt, engine)
    assert e.dropped and any("not the planned" in m for m in caplog.messages)
    assert_same(snapshot(base), snapshot(opt))  # that one state simply stayed on the device
    assert not same(opt.optimizer.state[e.param]["exp_avg"], e.host)


def test_memory_budget_keeps_the_largest_bundles_resident_and_stays_exact(caplog):
    """On CPU nothing is measured (peak 0), so the budget is the room: about half the bytes."""
    base, opt = make(), make()
    full = engine_for(make()).bytes
    with caplog.at_level(logging.INFO, logger="bridge_fgo"):
        engine = engine_for(opt, 600, budget=full // 2)
        for i in range(4):
            step(base)
            step(opt, engine)
            assert_same(snapshot(base), snapshot(opt))
    resident = [b for part in engine.parts for b in part.bundles if b.resident]
    assert resident and engine.resident_bytes <= full // 2 and engine.bytes == full - engine.resident_bytes
    # greedy, largest first: no bundle left out would still fit in the room the kept ones leave
    left = full // 2 - sum(b.nbytes for b in resident)
    assert all(b.nbytes > left for part in engine.parts for b in part.bundles if b.entries and not b.resident)
    for part in engine.parts:
        for b in part.bundles:
            for e in b.entries:
                on_host = same(part.bindings.get(e), e.host)
                assert on_host != b.resident, e.name
    assert "keep their states on the GPU" in engine.budget_note and "nothing measured (no GPU)" in engine.budget_note
    assert any(engine.budget_note in m for m in caplog.messages)


def test_zero_window_is_not_a_streamed_step():
    with pytest.raises(ValueError, match="window"):
        StreamedEngine([make()], 0)


def test_the_engine_never_keeps_its_optimizer_alive():
    import gc
    import weakref

    opt = make()
    engine = engine_for(opt)
    step(opt, engine, wait=False)
    ref = weakref.ref(opt)
    del opt
    gc.collect()
    assert ref() is None
    assert engine.optimizers() == []


# -- what the streamed step refuses before the first step ---------------------------------------------------
def cfg(**sections):
    ns = types.SimpleNamespace
    base = dict(optimizer=ns(), ddp=ns(), checkpoint=ns(save=None, load=None), logger=ns(), model=ns())
    base.update(sections)
    return ns(**base)


@pytest.mark.parametrize("section, fields, field", [
    ("optimizer", {"reuse_grad_buf_for_mxfp8_param_ag": True}, "cfg.optimizer.reuse_grad_buf_for_mxfp8_param_ag"),
    ("ddp", {"fp4_param_gather": True}, "cfg.ddp.fp4_param_gather"),
    ("checkpoint", {"save": "/ckpt", "ckpt_format": "torch"}, "cfg.checkpoint.ckpt_format"),
])
def test_configurations_the_streamed_step_cannot_serve_are_named_with_the_fix(section, fields, field):
    found = refusals.streamed(cfg(**{section: types.SimpleNamespace(**fields)}), [make().optimizer])
    assert len(found) == 1 and found[0].startswith(field) and "chunk_mb=0" in found[0]


def test_servable_configurations_and_optimizers_pass():
    ns = types.SimpleNamespace
    inners = [make(**kw).optimizer for kw in OPTIMIZERS.values()]
    assert refusals.streamed(cfg(), inners) == []
    assert refusals.streamed(cfg(optimizer=ns(use_precision_aware_optimizer=True)), inners) == []
    assert refusals.streamed(cfg(checkpoint=ns(save="/ckpt", async_save=True, save_optim=False)), inners) == []
    # an asynchronous save of optimizer state is served (tests/test_async_save.py)
    assert refusals.streamed(cfg(checkpoint=ns(save="/ckpt", async_save=True, ckpt_format="torch_dist")), inners) == []
    assert refusals.streamed(cfg(checkpoint=ns(save="/ckpt", ckpt_format="torch_dist")), inners) == []
    # served inside the streamed update (tests/test_normqk.py)
    assert refusals.streamed(cfg(model=ns(qk_clip=True), logger=ns(log_params_norm=True)), inners) == []
    # served: its save gathers copies of the host views, its load copies into them (test_resume_dp.py)
    assert refusals.streamed(cfg(checkpoint=ns(save="/ckpt", load="/ckpt", dist_ckpt_optim_fully_reshardable=True)),
                             inners) == []


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "blockwise", None])
def test_fp8_parameters_are_served_with_the_recipes_run_on_hopper(recipe):
    ns = types.SimpleNamespace
    model = ns(fp8_recipe=recipe) if recipe else ns()
    assert refusals.streamed(cfg(ddp=ns(fp8_param_gather=True), model=model), [make().optimizer]) == []
    if recipe not in ("delayed", None):  # the precision-aware optimizer with Megatron-Core keeping fp32 masters
        aware = ns(use_precision_aware_optimizer=True, main_params_dtype=torch.float32)
        assert refusals.streamed(cfg(ddp=ns(fp8_param_gather=True), model=model, optimizer=aware),
                                 [make().optimizer]) == []


@pytest.mark.parametrize("model, words", [
    (dict(fp8_recipe="mxfp8"), "fp8_recipe='mxfp8'"),
    (dict(fp8_recipe="custom"), "fp8_recipe='custom'"),
    (dict(fp8_recipe="tensorwise", qk_clip=True), "cfg.model.qk_clip=True"),
    (dict(fp8_recipe="delayed", precision_aware=True), "use_precision_aware_optimizer=True with FP8 parameters"),
    (dict(fp8_recipe="tensorwise", precision_aware=True, main_params_dtype=torch.float16),
     "main_params_dtype=torch.float16"),
])
def test_fp8_parameters_the_streamed_step_has_not_run_are_refused(model, words):
    ns = types.SimpleNamespace
    optimizer = ns()
    if model.pop("precision_aware", False):
        optimizer = ns(use_precision_aware_optimizer=True, main_params_dtype=model.pop("main_params_dtype", torch.float32))
    (found,) = refusals.streamed(cfg(ddp=ns(fp8_param_gather=True), model=ns(**model), optimizer=optimizer),
                                 [make().optimizer])
    assert words in found and "chunk_mb=0" in found and ("fp8_param_gather" in found or "FP8 parameters" in found)


@pytest.mark.parametrize("inner, words", [
    (lambda: torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1), "torch.optim.sgd.SGD"),
    (lambda: type("AdamW", (torch.optim.AdamW,), {})([torch.zeros(2, requires_grad=True)]), "AdamW"),
    (lambda: fused_adam.TEFusedAdam([torch.zeros(2, requires_grad=True)], exp_avg_dtype=torch.uint8), "FP8"),
    (lambda: fused_adam.ApexFusedAdam([torch.zeros(2, requires_grad=True)], master_weights=True),
     "param_groups_master"),
])
def test_optimizers_the_streamed_step_cannot_reproduce_are_refused_with_their_class(inner, words):
    (found,) = refusals.streamed(cfg(), [inner()])
    assert words in found and "chunk_mb=0" in found


# -- through Bridge's real train_step, patched by bridge_fgo.patch(offload="builtin", chunk_mb=...) ------------
# Bundles (master + two moments) of 1-7 MB: with chunk_mb=1 every parameter is a chunk of its own.
BIG = ((512, 1024), (600, 600), (1000,), (300, 700))


def rig(**kw):
    return harness.Rig(cfg=harness.config_container(mxfp8_copy=False), with_tensors=True, shapes=BIG, **kw)


def engine_of():
    (session,) = bridge_fgo.instrument.patcher._current.callsites.registry.sessions()
    return session, session.adapter.engine


def rig_snapshot(r):
    return snapshot(r.dist_optimizer)


@pytest.mark.parametrize("kind", ["torch-foreach-default", "apex", "te", "te-precision-aware-bf16",
                                  "te-precision-aware-remainders"])
def test_train_step_bit_identical_and_same_bridge_calls(kind):
    kw = OPTIMIZERS[kind]
    base = rig(**kw)
    harness.run_steps(base, steps=4)
    bridge_fgo.patch(offload="builtin", chunk_mb=1)
    patched = rig(**kw)
    harness.run_steps(patched, steps=4)
    bridge_fgo.synchronize()
    assert_same(rig_snapshot(base), rig_snapshot(patched))
    assert patched.events == base.events  # Bridge's own calls, in Bridge's order
    session, engine = engine_of()
    assert engine.steps_streamed == 4 and len(engine.chunks) == len(BIG) + 1
    assert_whole_on_host(engine)
    (s,) = bridge_fgo.status().sessions
    assert s["inner_optimizers"] == [contracts.describe(patched.dist_optimizer.optimizer)]


def test_train_step_window_bound_and_reporting(caplog_fgo):
    bridge_fgo.patch(offload="builtin", chunk_mb=1)
    r = rig()
    sizes = []

    def record(optimizer, groups):
        sizes.append(sum(p.numel() * p.element_size() * 3 for g in groups for p in g["params"]))

    with on_each_pass(record):
        harness.run_steps(r, steps=3)
    session, engine = engine_of()
    assert len(sizes) == 3 * len(engine.chunks)  # one chunk at a time
    assert max(a + b for a, b in zip(sizes, sizes[1:])) <= engine.window_bytes
    assert "step" not in r.dist_optimizer.optimizer.__dict__  # hooks only while an update is armed
    (s,) = bridge_fgo.status().sessions
    assert s["chunk_mb"] == 1 and s["chunks"] == len(engine.chunks)
    chunk_sizes = [c.nbytes for c in engine.chunks]
    assert s["step_peak_bytes"] == engine.window_bytes == max(chunk_sizes[0::2]) + max(chunk_sizes[1::2])
    steady = engine.bytes
    assert s["bytes"] == steady
    masters = sum(4 * torch.Size(shape).numel() for shape in BIG)
    assert s["master_bytes"] == masters and steady == 3 * masters + 2 * 16 * 4  # + the fp32 param's moments
    assert s["inner_optimizers"] == ["torch AdamW (torch.optim.adamw.AdamW)"]
    line = next(m for m in caplog_fgo.messages if "offload active" in m)
    # the first step's line gives the steady figure: Adam's moments did not exist before step 1
    assert f"{steady} bytes offloaded per step" in line and "torch AdamW" in line
    assert f"window: 1 MB chunks, {len(engine.chunks)} chunk(s) through 2 slot(s), the step adds at most {engine.window_bytes} bytes" in line


def test_train_step_exception_in_backward_leaves_whole_host_states():
    bridge_fgo.patch(offload="builtin", chunk_mb=1)
    r = rig()
    harness.run_steps(r, steps=2)
    bridge_fgo.synchronize()
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
    bridge_fgo.synchronize()
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
    harness.run_steps(r, steps=2)  # the last update's tail still in flight
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


def test_train_step_refuses_an_optimizer_it_cannot_split_before_the_first_step():
    bridge_fgo.patch(offload="builtin", chunk_mb=1)
    r = rig(optimizer="te", exp_avg_dtype=torch.uint8)
    with pytest.raises(bridge_fgo.BridgeFGOConfigError, match="FP8.*chunk_mb=0"):
        harness.run_steps(r, steps=1)
    assert r.events == []


def test_memory_budget_through_train_step_is_exact():
    base = rig()
    harness.run_steps(base, steps=4)
    bridge_fgo.patch(offload="builtin", chunk_mb=1, gpu_budget_gib=4 * 2**20 / 2**30)  # CPU: 4 MiB of room
    r = rig()
    harness.run_steps(r, steps=4)
    bridge_fgo.synchronize()
    assert_same(rig_snapshot(base), rig_snapshot(r))
    (s,) = bridge_fgo.status().sessions
    assert 0 < s["resident_bytes"] <= 4 * 2**20 and "keep their states on the GPU" in s["budget"]


def test_budget_needs_the_streamed_step():
    with pytest.raises(bridge_fgo.BridgeFGOOptionError, match="gpu_budget_gib.*chunk_mb"):
        bridge_fgo.patch(offload="builtin", chunk_mb=0, gpu_budget_gib=10)


def test_a_budget_below_the_offloaded_peak_keeps_everything_offloaded_and_says_so(caplog):
    """The first step measured a 1 GiB allocated peak with everything offloaded (a GPU's figures,
    given here): a 0.5 GiB budget cannot be met."""
    from bridge_fgo.engine import budget
    from bridge_fgo.engine.firststep import FirstStep

    assert budget.choose([], 2**30, FirstStep(backward=2 * 2**30, step=2 * 2**30)) is None
    assert budget.margin(12 * 2**30) == 12 * 2**30 // 100 and budget.margin(2**30) == 64 * 2**20
    base, opt = make(), make()
    with caplog.at_level(logging.WARNING, logger="bridge_fgo"):
        engine = engine_for(opt, 600, budget=2**29)
        engine.probe = measured(before=2**29, backward=2**30, base=2**28, step=2**30)
        for _ in range(3):
            step(base)
            step(opt, engine)
    assert engine.resident_bytes == 0 and engine.budget_note.startswith(
        "gpu_budget_gib 0.50 GiB cannot be met: the run's allocated peak with everything offloaded 1.00 GiB")
    assert sum("cannot be met" in m for m in caplog.messages) == 1  # said once
    assert_same(snapshot(base), snapshot(opt))


@pytest.mark.parametrize("name, layer_wise, words", [
    ("dist_muon", False, "in a LayerWiseDistributedOptimizer, whole matrices per data-parallel rank"),
    ("muon", True, "in a LayerWiseDistributedOptimizer"),
    ("muon", False, "every rank holding every matrix's states"),
    ("dist_soap", False, "builds 'soap' from emerging-optimizers"),
    ("adaptive_muon", False, "Float16OptimizerWithFloat16Params"),
    ("lion", False, "'lion''s states have no contract"),
])
def test_optimizers_other_than_adam_are_refused_by_name_with_what_megatron_core_builds(name, layer_wise, words):
    ns = types.SimpleNamespace
    opt = ns(optimizer=name, use_distributed_optimizer=True, use_layer_wise_distributed_optimizer=layer_wise)
    (found,) = refusals.problems(cfg(optimizer=opt), [], [], "builtin")
    assert found.startswith(f"cfg.optimizer.optimizer={name!r}: builtin supports only 'adam'") and words in found
    assert found.endswith("set optimizer='adam', or drop offload")
