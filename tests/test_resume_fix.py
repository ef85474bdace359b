"""scripts/resume_fix.py against this release's real Megatron-Core DistributedOptimizer (CPU).

Without TE or apex, Megatron-Core cannot load torch AdamW state into a distributed optimizer that has
not stepped (an assertion); once that is fixed, a load through the dp_reshardable format (Bridge's
default) leaves every parameter one shared step tensor holding the step from before the load, not the
checkpoint's. The defects are shown here on the real methods, with Bridge's load sequence (the real
sharded_state_dict on both sides, the checkpoint's tensors copied in, load_state_dict), then the fix:
a resumed optimizer, with and without the streamed engine, continues bit-identically to the
uninterrupted one. The GPU run through Bridge's own save and load is scripts/check_checkpoint.py --resume.
"""
import copy
import os
import sys
import types

import pytest
import torch
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedObject, ShardedTensor
from megatron.core.optimizer import distrib_optimizer
from megatron.core.optimizer.optimizer import param_group_identifier_keys

from bridge_fgo.engine.streamed import StreamedEngine
from support import harness
from test_streamed import assert_same, make, params, snapshot, step

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import resume_fix  # noqa: E402

pytestmark = pytest.mark.skipif(distrib_optimizer.HAVE_APEX_OR_TE, reason="the defect exists only without TE/apex")


def init_state_fn(opt, config=None):
    """Megatron-Core's Adam init_state_fn (built inside get_megatron_optimizer), for torch AdamW."""
    for group in opt.param_groups:
        for p in group["params"]:
            if len(opt.state[p]) == 0:
                opt.state[p]["exp_avg"] = torch.zeros_like(p.data)
                opt.state[p]["exp_avg_sq"] = torch.zeros_like(p.data)


def optimizer(**kw):
    """The harness's optimizer (torch AdamW unless `kw` says otherwise) with what a load reads."""
    opt = make(**kw)
    opt.init_state_fn, opt.grad_scaler, opt.config.fp16, opt.config.optimizer = init_state_fn, None, False, "adam"
    # load_state_dict pairs saved and current groups by these keys, which Megatron-Core's own param
    # groups always carry; releases before 0.19 raise on a missing one
    defaults = {"wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False}
    for group in opt.optimizer.param_groups:
        for key in param_group_identifier_keys:
            group.setdefault(key, defaults.get(key))
    # what sharded_state_dict reads, for one data-parallel rank
    opt.data_parallel_group = types.SimpleNamespace(rank=lambda: 0, size=lambda: 1)
    opt.data_parallel_group_idx = opt.distributed_optimizer_instance_id = 0
    for buffer in opt.buffers:
        for bucket in buffer.buckets:
            bucket.numel_unpadded, bucket.grad_data = bucket.param_data.numel(), buffer.grad_data
    return opt


@pytest.fixture
def fix():
    def install(**kw):
        resume_fix.install(**kw)

    yield install
    resume_fix.uninstall()
    assert "_resume_fix" not in vars(distrib_optimizer.DistributedOptimizer)


FORMAT = {"distrib_optim_sharding_type": "dp_reshardable"}  # Bridge's default


def checkpoint_load(saved, loading):
    """What torch_dist does with a sharded state dict built for loading: each ShardedTensor filled in
    place from the saved one, each ShardedObject replaced by the saved object, each
    LocalNonpersistentObject unwrapped (it was never saved)."""
    if isinstance(loading, dict):
        return {k: checkpoint_load(saved[k], v) for k, v in loading.items()}
    if isinstance(loading, list):
        assert len(saved) == len(loading)
        return [checkpoint_load(a, b) for a, b in zip(saved, loading)]
    if isinstance(loading, ShardedTensor):
        return loading.data.copy_(saved.data)
    if isinstance(loading, ShardedObject):
        return copy.deepcopy(saved.data)
    if isinstance(loading, LocalNonpersistentObject):
        return loading.unwrap()
    return loading


def resume(source):
    """Bridge's resume of `source` into a fresh optimizer: the sharded state dict saved from the
    source, the one built for loading into the fresh optimizer, torch_dist's load, then
    optimizer.load_state_dict(state_dict["optimizer"]). The model's own params load separately."""
    saved = copy.deepcopy(source.sharded_state_dict({}, False, metadata=FORMAT))
    opt = optimizer()
    opt.load_state_dict(checkpoint_load(saved, opt.sharded_state_dict({}, True, metadata=FORMAT)))
    opt.buffers[0].param_data.copy_(source.buffers[0].param_data)
    opt._gen = source._gen
    return opt


def test_without_the_fix_no_checkpoint_can_be_loaded_before_the_first_step():
    with pytest.raises(AssertionError):
        optimizer().state_dict()  # what sharded_state_dict(is_loading=True) calls first


def test_prime_is_called_only_for_a_load_and_only_on_an_empty_optimizer(fix):
    fix()
    opt = optimizer()
    with pytest.raises(Exception) as not_loading:
        opt.sharded_state_dict({}, False)  # a save before any step: still Megatron-Core's own assertion
    assert isinstance(not_loading.value, AssertionError)
    assert len(opt.optimizer.state) == 0
    with pytest.raises(Exception):  # the rest of the load needs the model's sharded state dict
        opt.sharded_state_dict({}, True)  # is_loading passed positionally, as ChainedOptimizer does
    assert len(opt.optimizer.state) == len(params(opt))
    assert {float(s["step"]) for s in opt.optimizer.state.values()} == {0.0}


@pytest.mark.parametrize("restore", [False, True])
def test_resumed_optimizer_continues_bit_identically_only_with_the_step_restored(fix, restore):
    fix(restore_step=restore)
    uninterrupted = optimizer()
    for _ in range(2):
        step(uninterrupted)
    resumed = resume(uninterrupted)
    steps = [s["step"] for s in resumed.optimizer.state.values()]
    if restore:
        assert len({id(s) for s in steps}) == len(steps) and {float(s) for s in steps} == {2.0}
    else:  # one shared tensor, and the step from before the load, not the checkpoint's 2
        assert len({id(s) for s in steps}) == 1 and float(steps[0]) == 0.0
    step(uninterrupted)
    step(resumed)
    if restore:
        assert_same(snapshot(uninterrupted), snapshot(resumed))
    else:  # stepped once per parameter from 0: the bias correction is not the uninterrupted run's
        assert float(steps[0]) == len(steps)
        assert not all(torch.equal(a, b) for a, b in zip(params(uninterrupted), params(resumed)))


def test_resumed_optimizer_under_the_streamed_engine_equals_the_uninterrupted_run(fix):
    """The first offload after a load adopts the loaded states, as it adopts any states on the GPU."""
    fix()
    uninterrupted = optimizer()
    for _ in range(2):
        step(uninterrupted)
    resumed = resume(uninterrupted)
    engine = StreamedEngine([resumed], 2000)
    engine.prepare()
    for _ in range(3):
        step(uninterrupted)
        step(resumed, engine)
        assert_same(snapshot(uninterrupted), snapshot(resumed))


@pytest.mark.parametrize("with_fix", [False, True])
def test_a_checkpoint_without_steps_sets_the_states_and_leaves_the_step(fix, with_fix):
    """fully_reshardable and dp_zero_gather_scatter load through _set_main_param_and_optimizer_states
    with the master and the moments only; Megatron-Core looks the step up there too."""
    if with_fix:
        fix()
    opt = optimizer()
    step(opt)
    model = opt.model_float16_groups[0][0]
    loaded = {k: torch.full_like(v, 3.0) for k, v in opt._get_main_param_and_optimizer_states(model).items()
              if k != "step"}
    if not with_fix:
        with pytest.raises(KeyError, match="step"):
            opt._set_main_param_and_optimizer_states(model, loaded)
        return
    before = resume_fix.main_state(opt, model)["step"]
    opt._set_main_param_and_optimizer_states(model, loaded)
    after = opt._get_main_param_and_optimizer_states(model)
    assert after.pop("step") is before and float(before) == 1.0
    assert all(torch.equal(v, loaded[k]) for k, v in after.items())


def test_install_is_idempotent_and_uninstall_restores_megatron_core(fix):
    cls = distrib_optimizer.DistributedOptimizer
    names = ("load_state_dict", "sharded_state_dict", "_set_main_param_and_optimizer_states")
    original = [vars(cls)[n] for n in names]
    fix()
    patched = [vars(cls)[n] for n in names]
    fix()
    assert [vars(cls)[n] for n in names] == patched and all(a is not b for a, b in zip(patched, original))
    resume_fix.uninstall()
    assert [vars(cls)[n] for n in names] == original


def test_harness_optimizer_is_the_real_class():
    assert isinstance(harness.make_distributed_optimizer(harness.Recorder()), distrib_optimizer.DistributedOptimizer)
