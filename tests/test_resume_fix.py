"""scripts/resume_fix.py against this release's real Megatron-Core DistributedOptimizer (CPU).

Without TE or apex, Megatron-Core cannot load torch AdamW state into a distributed optimizer that has
not stepped (an assertion), and once loaded all parameters share one step tensor. Both defects are
shown here on the real methods, then the fix: a resumed optimizer, with and without the streamed
engine, continues bit-identically to the uninterrupted one. The GPU run through Bridge's own
save and load is scripts/check_checkpoint.py --resume.
"""
import os
import sys

import pytest
import torch
from megatron.core.optimizer import distrib_optimizer
from megatron.core.optimizer.optimizer import param_group_identifier_keys

from bridge_fgo.streamed import StreamedEngine
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


def optimizer():
    opt = make()
    opt.init_state_fn, opt.grad_scaler, opt.config.fp16 = init_state_fn, None, False
    # load_state_dict pairs saved and current groups by these keys, which Megatron-Core's own param
    # groups always carry; releases before 0.19 raise on a missing one
    defaults = {"wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False}
    for group in opt.optimizer.param_groups:
        for key in param_group_identifier_keys:
            group.setdefault(key, defaults.get(key))
    return opt


@pytest.fixture
def fix():
    def install(**kw):
        resume_fix.install(**kw)

    yield install
    resume_fix.uninstall()
    assert "_resume_fix" not in vars(distrib_optimizer.DistributedOptimizer)


def resume(saved, source, **kw):
    """What Bridge's load does to a fresh optimizer: sharded_state_dict(is_loading=True) (which primes
    and loads the optimizer's own state dict), the checkpoint filling the state tensors in place,
    then load_state_dict with the saved param groups."""
    opt = optimizer()
    resume_fix.prime(opt)
    opt.load_state_dict(opt.state_dict())
    for p_src, p in zip(params(source), params(opt)):
        p.data.copy_(p_src.data)
        for k in ("exp_avg", "exp_avg_sq"):
            opt.optimizer.state[p][k].copy_(source.optimizer.state[p_src][k])
    opt.buffers[0].param_data.copy_(source.buffers[0].param_data)
    opt.load_state_dict(saved)
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


@pytest.mark.parametrize("unshare", [False, True])
def test_resumed_optimizer_continues_bit_identically_only_with_unshared_steps(fix, unshare):
    fix(unshare_step=unshare)
    uninterrupted = optimizer()
    for _ in range(2):
        step(uninterrupted)
    saved = uninterrupted.state_dict()
    resumed = resume(saved, uninterrupted)
    steps = [s["step"] for s in resumed.optimizer.state.values()]
    assert len({id(s) for s in steps}) == (len(steps) if unshare else 1)
    step(uninterrupted)
    step(resumed)
    if unshare:
        assert_same(snapshot(uninterrupted), snapshot(resumed))
    else:  # one tensor stepped once per parameter: the bias correction is not the uninterrupted run's
        assert float(steps[0]) == 2 + len(steps)
        assert not all(torch.equal(a, b) for a, b in zip(params(uninterrupted), params(resumed)))


def test_resumed_optimizer_under_the_streamed_engine_equals_the_uninterrupted_run(fix):
    """The first offload after a load adopts the loaded states, as it adopts any states on the GPU."""
    fix()
    uninterrupted = optimizer()
    for _ in range(2):
        step(uninterrupted)
    resumed = resume(uninterrupted.state_dict(), uninterrupted)
    engine = StreamedEngine(resumed, 2000)
    engine.prepare()
    for _ in range(3):
        step(uninterrupted)
        step(resumed, engine)
        assert_same(snapshot(uninterrupted), snapshot(resumed))


def test_install_is_idempotent_and_uninstall_restores_megatron_core(fix):
    cls = distrib_optimizer.DistributedOptimizer
    original = cls.load_state_dict, cls.sharded_state_dict
    fix()
    patched = cls.load_state_dict, cls.sharded_state_dict
    fix()
    assert (cls.load_state_dict, cls.sharded_state_dict) == patched != original
    resume_fix.uninstall()
    assert (cls.load_state_dict, cls.sharded_state_dict) == original


def test_harness_optimizer_is_the_real_class():
    assert isinstance(harness.make_distributed_optimizer(harness.Recorder()), distrib_optimizer.DistributedOptimizer)
