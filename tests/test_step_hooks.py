"""One optimizer step is one step: under the streamed engine torch's step hooks (global and
per-instance, pre and post) and the profiler's step marker fire once per optimizer step whatever the
number of chunks, and see the states whole (pre: as before the step; post: as after it), as without
offload. Also: parameters whose masters all stay on the GPU (gpu_budget_gib) are copied to the model
once per step, not twice."""
import pytest
import torch
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from torch.optim import optimizer as torch_optimizer

import bridge_fgo
from support import harness
from test_streamed import OPTIMIZERS, assert_same, engine_for, engine_of, make, params, rig, snapshot, step

KINDS = ("torch-foreach-default", "te-2-groups", "apex", "te-precision-aware-bf16")


class Hooks:
    """The four kinds of step hooks on one inner optimizer, counting calls and keeping what each saw."""

    def __init__(self, inner):
        self.inner, self.calls, self.seen = inner, [], []
        self.handles = [
            torch_optimizer.register_optimizer_step_pre_hook(self.hook("global-pre")),
            torch_optimizer.register_optimizer_step_post_hook(self.hook("global-post")),
            inner.register_step_pre_hook(self.hook("pre")),
            inner.register_step_post_hook(self.hook("post")),
        ]

    def hook(self, name):
        def record(optimizer, args, kwargs):
            if optimizer is not self.inner:
                return
            self.calls.append(name)
            if name in ("pre", "post"):  # what a hook reads: every parameter and state, whole
                self.seen.append((name, [p.detach().clone() for g in optimizer.param_groups for p in g["params"]],
                                  [v.detach().clone() for g in optimizer.param_groups for p in g["params"]
                                   for v in optimizer.state.get(p, {}).values()]))

        return record

    def remove(self):
        for h in self.handles:
            h.remove()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("chunk_bytes, budget", [(1, None), (2000, None), (10**9, None), (1, "half")],
                         ids=["chunk-per-param", "some-chunks", "one-chunk", "resident-pass"])
def test_hooks_fire_once_per_step_and_see_whole_states(kind, chunk_bytes, budget):
    base, opt = make(**OPTIMIZERS[kind]), make(**OPTIMIZERS[kind])
    engine = engine_for(opt, chunk_bytes, None if budget is None else engine_for(make(**OPTIMIZERS[kind]), 1).bytes // 2)
    on_base, on_opt = Hooks(base.optimizer), Hooks(opt.optimizer)
    try:
        for _ in range(3):
            step(base)
            step(opt, engine)
    finally:
        on_base.remove()
        on_opt.remove()
    assert engine.steps_streamed == 3 and (budget is None or engine.resident_bytes)
    assert len(engine.chunks) > 1 or chunk_bytes == 10**9
    assert on_opt.calls == on_base.calls == ["global-pre", "pre", "post", "global-post"] * 3
    assert len(on_opt.seen) == len(on_base.seen) == 6
    for i, ((name, ps_base, states_base), (_, ps_opt, states_opt)) in enumerate(zip(on_base.seen, on_opt.seen)):
        if i == 0:  # before step 1 the engine has created the states (in their host views, as the
            # optimizer's first step would); the optimizer alone has none yet (tests/test_resume_host.py)
            assert not states_base  # (TE's and apex's are there already for the engine, torch's not)
            states_opt = []
        assert len(ps_base) == len(ps_opt) and len(states_base) == len(states_opt), name
        for a, b in zip(ps_base + states_base, ps_opt + states_opt):
            assert a.dtype == b.dtype and torch.equal(a, b), name
    assert_same(snapshot(base), snapshot(opt))


def test_the_profilers_step_marker_once_per_step():
    opt = make()
    engine = engine_for(opt, 1)
    step(opt, engine)
    assert len(engine.chunks) == 6
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            step(opt, engine)
    assert [e.name for e in prof.events() if e.name.startswith("Optimizer.step#")] == ["Optimizer.step#AdamW.step"] * 2


def test_through_bridges_train_step_hooks_fire_once_per_iteration():
    base = rig()
    on_base = Hooks(base.dist_optimizer.optimizer)
    harness.run_steps(base, steps=3)
    on_base.remove()
    bridge_fgo.patch(offload="builtin", chunk_mb=1)
    r = rig()
    on_r = Hooks(r.dist_optimizer.optimizer)
    harness.run_steps(r, steps=3)
    on_r.remove()
    _, engine = engine_of()
    assert len(engine.chunks) == 5 and engine.steps_streamed == 3
    assert on_r.calls == on_base.calls == ["global-pre", "pre", "post", "global-post"] * 3
    bridge_fgo.synchronize()
    assert_same(snapshot(base.dist_optimizer), snapshot(r.dist_optimizer))


def test_masters_all_resident_are_copied_to_the_model_once_per_step(monkeypatch):
    """Megatron-Core's _copy_main_params_to_model_params, counted by the masters it copies: each
    bf16 parameter's master once per step, with every bundle resident and with none."""
    copied = []
    real = DistributedOptimizer._copy_main_params_to_model_params

    def counting(self, *args, **kwargs):
        copied.append(sum(m is not None for g in self.shard_fp32_from_float16_groups for m in g))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(DistributedOptimizer, "_copy_main_params_to_model_params", counting)
    for budget in (None, 10**9):
        base, opt = make(), make()
        engine = engine_for(opt, 1, budget)
        n_masters = len(opt.shard_fp32_from_float16_groups[0])
        for i in range(3):
            step(base)
            del copied[:]
            step(opt, engine)
            assert sum(copied) == n_masters, (budget, i, copied)
        assert budget is None or (engine.bytes == 0 and engine.resident_bytes and not engine.chunks)
        assert_same(snapshot(base), snapshot(opt))
    assert len(params(opt)) == n_masters + 1
