"""FP8 and FP4 parameters (cfg.ddp.fp8_param_gather, fp4_param_gather) under the streamed step, on CPU:
Megatron-Core's own cast (_copy_main_params_to_model_params -> quantize_param_shard /
quantize_nvfp4_param_shard) runs once per step over every quantized parameter, after the last chunk,
from the updated masters kept in the model's dtype (engine/quantized.py); the FP8 bytes, scales and amaxes
equal Megatron-Core's step without offload. Transformer Engine's cast is the stand-in of
support/quantized.py (its delayed and current scaling, and NVFP4 through Megatron-Core's entry point).
"""
from unittest import mock

import pytest
import torch

from bridge_fgo.engine import quantized as engine_quantized
from support import quantized

from test_streamed import OPTIMIZERS, assert_same, engine_for, make, snapshot, step

# Bridge's FP8 recipes with the precision-aware optimizer: bf16 moments in TE's FusedAdam, fp32 masters kept by
# Megatron-Core (use_precision_aware_optimizer_no_fp8_or_ds_fp8 is False for tensorwise and blockwise)
OPTIMIZERS = dict(OPTIMIZERS, **{"te-bf16-moments": dict(optimizer="te", exp_avg_dtype=torch.bfloat16,
                                                          exp_avg_sq_dtype=torch.bfloat16)})


def _pair(kind, optimizer, seed=0):
    from megatron.core.optimizer import distrib_optimizer

    if kind == "nvfp4" and not hasattr(distrib_optimizer, "quantize_nvfp4_param_shard"):
        pytest.skip("this megatron-core has no NVFP4 parameters (fp4_param_gather came in 0.17)")
    kw = OPTIMIZERS[optimizer]
    return make(seed=seed, quantized=kind, **kw), make(seed=seed, quantized=kind, **kw)


def _all(opt):
    return {**snapshot(opt), **{f"q.{k}": v for k, v in quantized.snapshot(opt).items()}}


@pytest.mark.parametrize("kind", quantized.KINDS)
@pytest.mark.parametrize("optimizer", ["torch-foreach-default", "te", "apex-3-groups", "te-bf16-moments"])
@pytest.mark.parametrize("chunk_bytes", [1, 2000, 10**9])  # one parameter per chunk, a few, one chunk
def test_quantized_parameters_cast_once_per_step_bit_identical(kind, optimizer, chunk_bytes):
    base, opt = _pair(kind, optimizer)
    with quantized.installed(type(base)), quantized.installed(type(opt)) as cast:
        engine = engine_for(opt, chunk_bytes)
        for n in range(3):
            step(base)
            step(opt, engine)
            assert_same(_all(base), _all(opt))
            assert quantized.snapshot(opt)  # there are quantized parameters, and they moved
            # one call a step for each optimizer, over every quantized parameter with every master given,
            # each with its one reduction: the run without offload's and the streamed step's alike
            entry = "nvfp4" if kind == "nvfp4" else "fp8"
            assert cast.calls == [(entry, 3, 3, 1)] * (2 * (n + 1))
        assert engine.steps_streamed == 3
    assert any(not torch.equal(v, torch.zeros_like(v)) for k, v in quantized.snapshot(opt).items() if k.endswith("data"))


@pytest.mark.parametrize("kind", quantized.FP8_KINDS)
def test_a_budget_keeps_quantized_masters_resident_and_stays_exact(kind):
    base, opt = _pair(kind, "te")
    with quantized.installed(type(base)), quantized.installed(type(opt)) as cast:
        engine = engine_for(opt, 2000, budget=0)
        engine.plan.lay_out()
        kept = max((b for part in engine.parts for b in part.bundles), key=lambda b: b.nbytes)
        kept.resident = True  # as a budget keeps the largest bundle on the GPU
        engine.plan.cut()
        for _ in range(2):
            step(base)
            step(opt, engine)
            assert_same(_all(base), _all(opt))
        assert len(cast.calls) == 4


def test_no_cast_within_a_pass_and_the_masters_kept_are_the_updated_ones():
    """The copy of a chunk's masters never runs the cast (it would reduce over every parameter with the
    rest missing); what the one cast reads is each master after its update, rounded to bf16."""
    base, opt = _pair("tensorwise", "torch-foreach-default")
    seen = []
    real = engine_quantized.Kept.groups

    def spy(self, o):
        mains, models = real(self, o)
        seen.append([m.clone() for g in mains for m in g])
        return mains, models

    with quantized.installed(type(base)), quantized.installed(type(opt)) as cast:
        engine = engine_for(opt, 1)
        step(base)
        with mock.patch.object(engine_quantized.Kept, "groups", spy):
            step(opt, engine)
        assert [c[0] for c in cast.calls] == ["fp8", "fp8"]
    masters = [m for m, p in zip(base.shard_fp32_from_float16_groups[0], base.model_float16_groups[0])
               if quantized.kind_of(p)]
    assert len(seen) == 1 and len(seen[0]) == len(masters)
    for kept, master in zip(seen[0], masters):
        assert kept.dtype == torch.bfloat16 and torch.equal(kept, master.to(torch.bfloat16))


def test_the_kept_copy_lives_in_the_consumed_gradient():
    master = torch.randn(10)
    master.grad = torch.randn(10)
    model_param = torch.zeros(10, dtype=torch.bfloat16)
    kept = engine_quantized.Kept()
    kept.keep(master, model_param)
    copy = kept.copies[id(master)]
    assert copy.untyped_storage().data_ptr() == master.grad.untyped_storage().data_ptr()
    assert torch.equal(copy, master.to(torch.bfloat16))
    master.grad = None  # no gradient: a copy of its own
    kept.keep(master, model_param)
    assert torch.equal(kept.copies[id(master)], master.to(torch.bfloat16))


def test_without_quantized_parameters_the_copy_is_unchanged():
    opt = make()
    assert not engine_quantized.in_use(opt)
    opt.ddp_config.fp8_param_gather = True
    assert engine_quantized.in_use(opt)
    opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = True  # TE's kernel writes FP8 itself
    assert not engine_quantized.in_use(opt)


def test_the_per_rank_line_says_how_many_quantized_parameters_are_cast_at_the_end():
    from bridge_fgo.engine import BuiltinAdapter

    opt = make(quantized="tensorwise")
    with quantized.installed(type(opt)):
        adapter = BuiltinAdapter([opt], chunk_mb=1)
        adapter.prepare()
        assert adapter.engine.plan.quantized == 3
        assert "3 FP8/FP4 parameter shard(s) quantized once after the last chunk" in adapter.window()
    assert make().ddp_config.fp8_param_gather is False
    other = make()  # the engine holds its optimizer weakly
    plain = BuiltinAdapter([other], chunk_mb=1)
    plain.prepare()
    assert plain.engine.plan.quantized == 0 and "FP8" not in plain.window()


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "blockwise"])
def test_through_bridges_train_step_with_fp8_param_gather(recipe):
    """bridge_fgo.patch() accepts Bridge's FP8 configuration (cfg.ddp.fp8_param_gather, the model's fp8_recipe)
    and its real train_step runs the streamed step: one cast a step, bit-identical to the run without it."""
    import bridge_fgo
    from support import harness

    from test_streamed import BIG, assert_whole_on_host, engine_of

    def rig():
        cfg = harness.config_container(mxfp8_copy=False)
        cfg.ddp.fp8_param_gather, cfg.model.fp8_recipe = True, recipe
        return harness.Rig(cfg=cfg, with_tensors=True, shapes=BIG, quantized=recipe)

    base = rig()
    with quantized.installed(type(base.dist_optimizer)) as without:
        harness.run_steps(base, steps=3)
    bridge_fgo.patch(offload="builtin", chunk_mb=1)
    patched = rig()
    with quantized.installed(type(patched.dist_optimizer)) as cast:
        harness.run_steps(patched, steps=3)
        bridge_fgo.synchronize()
        _, engine = engine_of()
        assert engine.steps_streamed == 3 and engine.plan.quantized == 2
    assert without.calls == cast.calls == [("fp8", 2, 2, 1)] * 3
    assert_same(_all(base.dist_optimizer), _all(patched.dist_optimizer))
    assert_whole_on_host(engine)


def test_mxfp8_parameters_are_refused_before_the_first_step_with_the_fix():
    """The MXFP8 cast goes through the same call (tested above with the stand-in), but no Blackwell GPU has
    run it: Bridge's real train_step is never reached."""
    import bridge_fgo
    from bridge_fgo.errors import BridgeFGOConfigError
    from support import harness

    from test_streamed import BIG

    cfg = harness.config_container(mxfp8_copy=False)
    cfg.ddp.fp8_param_gather, cfg.model.fp8_recipe = True, "mxfp8"
    bridge_fgo.patch(offload="builtin", chunk_mb=1)
    r = harness.Rig(cfg=cfg, with_tensors=True, shapes=BIG, quantized="mxfp8")
    with quantized.installed(type(r.dist_optimizer)) as cast, \
            pytest.raises(BridgeFGOConfigError, match="fp8_recipe='mxfp8'.*chunk_mb=0"):
        harness.run_steps(r, steps=1)
    assert cast.calls == [] and "zero_grad_buffer" not in r.events


def test_a_failure_in_the_one_cast_after_the_update_tears_the_states(caplog):
    """The masters went through (at the next step) but the FP8 cast after the last chunk raised (the weights
    at this one): the original exception passes on, as without offload; the states are marked torn, steps
    refused until a load."""
    import logging

    import bridge_fgo

    opt = make(quantized="tensorwise")

    class Boom(RuntimeError):
        pass

    with quantized.installed(type(opt)) as cast:
        engine = engine_for(opt, 1)
        step(opt, engine)
        real = type(cast).__call__

        def failing(self, entry, model_params, *a, **k):
            if model_params:  # megatron-core 0.16 calls it in every chunk's copy too, with none (returns at once)
                raise Boom("in the FP8 cast")

        with mock.patch.object(type(cast), "__call__", failing), caplog.at_level(logging.ERROR, logger="bridge_fgo"), \
                pytest.raises(Boom):
            step(opt, engine)
        assert "master -> model copy after the update" in engine.torn
        assert any("master -> model copy" in m for m in caplog.messages)
        with pytest.raises(bridge_fgo.BridgeFGOError, match="torn"):
            step(opt, engine)
        assert real is type(cast).__call__
