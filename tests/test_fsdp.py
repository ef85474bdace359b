"""Megatron-FSDP under the streamed step (bridge_fgo/engine/fsdp.py), on CPU: the layout as megatron-core
0.19.2 builds it (tests/support/fsdp.py says which parts are real and which are stand-ins), stepped through
Megatron-Core's own DistributedOptimizer FSDP branches, against the same optimizer without offload.
On GPUs: scripts/gpu/bench_fsdp.sh."""
import pytest
import torch

pytest.importorskip("megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer",
                    reason="this megatron-core has no megatron_fsdp package")

import bridge_fgo
from bridge_fgo.engine import fsdp as engine_fsdp
from bridge_fgo.engine.streamed import StreamedEngine
from bridge_fgo.errors import BridgeFGOConfigError
from bridge_fgo.instrument import reads
from support import fsdp, fused_adam, harness

OPTIMIZERS = {"torch": dict(optimizer="torch"), "torch-for-loop": dict(optimizer="torch", foreach=False),
              "te": dict(optimizer="te")}


@pytest.fixture
def gloo():
    with harness.model_parallel():
        yield


step = harness.engine_step


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        elif isinstance(a[k], dict):
            assert_same(a[k], b[k])
        else:
            assert a[k] == b[k], k


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
@pytest.mark.parametrize("chunk_bytes", [40_000, 1 << 30])
def test_bit_identical_to_megatron_fsdp_without_offload(gloo, kind, chunk_bytes):
    # with a parameter that has no elements on this rank: 2026-11-27 on two H200s, rank 1 of the 887M model
    ref = fsdp.make_optimizer(harness.Recorder(), shapes=fsdp.EMPTY_SHAPES, **OPTIMIZERS[kind])
    opt = fsdp.make_optimizer(harness.Recorder(), shapes=fsdp.EMPTY_SHAPES, **OPTIMIZERS[kind])
    engine = StreamedEngine([opt], chunk_bytes)
    engine.prepare()
    assert engine.plan.parts[0].fsdp is not None
    empty = [b for b in engine.plan.parts[0].bundles if b.param._local_tensor.numel() == 0]
    assert len(empty) == 1 and empty[0].entries == []  # nothing of it moves (no zero-byte takeovers)
    if chunk_bytes < 1 << 20:
        assert len(engine.chunks) > 2  # several passes, each its own parameters
    for _ in range(3):
        step(ref)
        step(opt, engine)
        assert_same(fsdp.snapshot(ref), fsdp.snapshot(opt))
    engine.close()
    assert_same(fsdp.snapshot(ref), fsdp.snapshot(opt))


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_bit_identical_on_megatron_fsdps_own_buffer_constructed_on_cpu(gloo, kind):
    """The layout as Megatron-FSDP's own ParamAndGradBuffer constructs it, not built by hand: its parameter
    groups, flat main-weight buffers, main-weight DTensors and optimizer parameters (support/fsdp.py real_buffer;
    the one stand-in there is Tensor.cuda during the constructor)."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import ParamAndGradBuffer

    ref = fsdp.make_optimizer_on_real_buffer(harness.Recorder(), **OPTIMIZERS[kind])
    if ref is None:
        pytest.skip("this megatron-core's ParamAndGradBuffer takes no mixed_precision_policy (0.16.1)")
    opt = fsdp.make_optimizer_on_real_buffer(harness.Recorder(), **OPTIMIZERS[kind])
    pgb = opt.model_chunks[0].param_and_grad_buffer
    assert type(pgb) is ParamAndGradBuffer and len(pgb.parameter_groups) >= 1
    engine = StreamedEngine([opt], 40_000)
    engine.prepare()
    layout = engine.plan.parts[0].fsdp
    assert layout is not None and len(layout.flats) == len(pgb.parameter_groups)
    assert len(layout.model_params) == 4 and len(engine.chunks) > 1  # two layers' weights and biases
    for _ in range(3):
        step(ref)
        step(opt, engine)
        assert all(f.retired and f.mbuf.data.device.type == "meta" for f in layout.flats)  # given up between steps
        assert_same(fsdp.snapshot(ref), fsdp.snapshot(opt))
    engine.close()
    assert_same(fsdp.snapshot(ref), fsdp.snapshot(opt))


def _hsdp_rank(rank, world, port, out_dir, outer, kind):
    """One rank of HSDP: Megatron-FSDP's own buffer over a (dp_outer, dp_shard=1, tp=1) mesh of every rank,
    stepped with and without the streamed engine; what it found goes to out_dir/rank<N>.json."""
    import json
    import os

    from test_agree import gloo_group

    with gloo_group(rank, world, port):
        ref = fsdp.make_optimizer_on_real_buffer(harness.Recorder(), outer=outer, **OPTIMIZERS[kind])
        opt = fsdp.make_optimizer_on_real_buffer(harness.Recorder(), outer=outer, **OPTIMIZERS[kind])
        for o in (ref, opt):  # as Megatron-Core's config says HSDP
            o.ddp_config.num_distributed_optimizer_instances = world
            o.ddp_config.outer_dp_sharding_strategy = outer
        pgb = opt.model_chunks[0].param_and_grad_buffer
        mbufs = [g.main_weight_buffer for g in pgb.parameter_groups]
        result = {"problems": engine_fsdp.problems(opt),
                  "helpers": sum(g.hfsdp_helper_wbuf is not None for g in pgb.parameter_groups),
                  "sharded_over": sorted({m.data_parallel_group.size() for m in mbufs if m.is_data_distributed}),
                  "mesh": list(next(iter(pgb.optimizer_named_parameters))[1].device_mesh.mesh_dim_names),
                  "master_elements": sum(p._local_tensor.numel() for _, p in pgb.optimizer_named_parameters)}
        engine = StreamedEngine([opt], 40_000)
        engine.prepare()
        layout = engine.plan.parts[0].fsdp
        result["flats"], result["chunks"] = len(layout.flats), len(engine.chunks)
        result["said"] = engine.optimizers()
        same = []
        for _ in range(3):
            step(ref)
            step(opt, engine)
            assert all(f.retired for f in layout.flats)
            a, b = fsdp.snapshot(ref), fsdp.snapshot(opt)
            try:
                assert_same(a, b)
                same.append(True)
            except AssertionError as exc:
                same.append(f"{exc}")
        engine.close()
        assert_same(fsdp.snapshot(ref), fsdp.snapshot(opt))
        result["same"] = same
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)


@pytest.mark.parametrize("outer,kind", [("optim", "torch"), ("optim", "te"), ("no_shard", "torch")])
def test_hsdp_bit_identical_on_megatron_fsdps_own_buffers_over_two_ranks(tmp_path, outer, kind):
    """HSDP (num_distributed_optimizer_instances > 1): two gloo ranks, each Megatron-FSDP's own buffer with its
    outer dimension over both; "optim" (Megatron-Bridge's Nemotron recipes) shards the masters over both ranks
    through its helper buffers, "no_shard" replicates them. The streamed step is bit-identical to no offload on
    every rank, and nothing is refused."""
    import inspect

    from megatron.core.distributed.fsdp.src import megatron_fsdp
    from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import ParamAndGradBuffer

    if "mixed_precision_policy" not in inspect.signature(ParamAndGradBuffer).parameters:
        pytest.skip("this megatron-core's ParamAndGradBuffer takes no mixed_precision_policy (0.16.1)")
    if "outer_dp_sharding_strategy" not in inspect.signature(megatron_fsdp.DistributedDataParallelConfig).parameters:
        pytest.skip("this megatron-core's Megatron-FSDP has no outer_dp_sharding_strategy")
    from test_agree import run_ranks_with

    # (preloaded: the rank's module, which imports Megatron-FSDP's buffer and bridge_fgo first thing)
    results = run_ranks_with(_hsdp_rank, tmp_path, outer, kind, world=2, preload=["test_agree", "test_fsdp"])
    for r in results:
        assert r["problems"] == [] and r["same"] == [True, True, True], r
        assert r["mesh"] == ["dp_outer", "dp_shard"] and r["chunks"] > 1
        assert any(f"under Megatron-FSDP, optim_grads_params, HSDP: 2 optimizer instances, outer {outer} (1 "
                   "main-weight buffer(s))" in said for said in r["said"]), r["said"]
    if outer == "optim":  # each rank holds its part of the masters, the two parts the whole
        assert all(r["helpers"] >= 1 and r["sharded_over"] == [2] for r in results)
        assert results[0]["master_elements"] + results[1]["master_elements"] == 64 * 96 + 96 + 96 * 32 + 32
    else:  # replicated: each rank holds every master
        assert all(r["helpers"] == 0 and r["master_elements"] == 64 * 96 + 96 + 96 * 32 + 32 for r in results)


def test_between_steps_the_flat_masters_are_given_up_and_everything_is_on_the_host(gloo):
    opt = fsdp.make_optimizer(harness.Recorder())
    pgb = opt.model_chunks[0].param_and_grad_buffer
    flats = [g.main_weight_buffer.data for g in pgb.parameter_groups]
    before = {id(p): p._local_tensor.clone() for g in opt.optimizer.param_groups for p in g["params"]}
    engine = StreamedEngine([opt], 40_000)
    engine.prepare()
    step(opt, engine)
    buf = engine.buffer.tensor
    lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel()
    for g in pgb.parameter_groups:
        assert g.main_weight_buffer.data.device.type == "meta"  # a read fails loudly
    for name, dist in pgb.dist_main_weight.items():  # Megatron-FSDP's own DTensors share the rebinding
        assert dist._local_tensor is dict(pgb.optimizer_named_parameters)[name]._local_tensor
    for g in opt.optimizer.param_groups:
        for p in g["params"]:
            assert lo <= p._local_tensor.data_ptr() < hi
            for value in opt.optimizer.state[p].values():
                if isinstance(value, torch.Tensor) and value.dim():
                    assert type(value).__name__ == "DTensor"  # the DTensor stays, its local is the host view
                    assert lo <= value._local_tensor.data_ptr() < hi
    del flats
    engine.close()  # unpatch: the buffers made again, the masters views of them as Megatron-FSDP laid them out
    for g in pgb.parameter_groups:
        data = g.main_weight_buffer.data
        assert data.device.type == "cpu"
        for item_id, orig in enumerate(g.params):
            p = next(q for _, q in pgb.optimizer_named_parameters if q.orig_param is orig)
            assert p._local_tensor.data_ptr() == g.main_weight_buffer.get_item(item_id).data_ptr()
            assert not torch.equal(p._local_tensor, before[id(p)])  # the step's values, not the old ones


def test_megatron_fsdp_copy_runs_once_after_the_last_chunk(gloo, mocker):
    from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import ParamAndGradBuffer

    opt = fsdp.make_optimizer(harness.Recorder())
    pgb = opt.model_chunks[0].param_and_grad_buffer
    calls = []
    real = ParamAndGradBuffer.copy_main_weights_to_model_weights

    def counted(self):
        calls.append([type(g.main_weight_buffer).__name__ for g in self.parameter_groups])
        return real(self)

    mocker.patch.object(type(pgb), "copy_main_weights_to_model_weights", counted)
    engine = StreamedEngine([opt], 40_000)
    engine.prepare()
    step(opt, engine)
    assert len(engine.chunks) > 2 and len(calls) == 1  # one call for every chunk
    assert set(calls[0]) == {"_Presented"}  # each group's buffer presented by the kept copies
    assert all(type(g.main_weight_buffer).__name__ == "DataParallelBuffer" for g in pgb.parameter_groups)
    assert opt.events.count("start_param_sync") == 1


def test_the_head_hooks_the_modules_own_parameters_and_its_prefetch_stays_exact(gloo, monkeypatch):
    """The head's gradient hooks (streamed/head.py) under Megatron-FSDP: on the module's own parameters,
    those Megatron-FSDP's `_grad_acc` hooks take the gradients of (the optimizer's DTensors take none in
    backward), after those hooks; chunks copied in during a real backward leave the steps bit-identical."""
    from bridge_fgo.engine.streamed import head as head_mod
    from bridge_fgo.engine.streamed.head import Curve

    monkeypatch.setattr(head_mod, "_microbatches", lambda: 1)
    ref = fsdp.make_optimizer(harness.Recorder(), shapes=fsdp.EMPTY_SHAPES, optimizer="te")
    opt = fsdp.make_optimizer(harness.Recorder(), shapes=fsdp.EMPTY_SHAPES, optimizer="te")
    origs = [p for g in opt.model_chunks[0].param_and_grad_buffer.parameter_groups for p in g.params]
    order = []
    for p in origs:  # Megatron-FSDP's own hook, registered when it wraps the module (before any optimizer)
        p.register_post_accumulate_grad_hook(lambda q: order.append("fsdp"))
    engine = StreamedEngine([opt], 40_000)
    engine.prepare()
    head = engine.head
    assert head.attached and len(head._handles) == len(origs)  # the one with no element here included
    monkeypatch.setattr(head, "_fired", lambda param=None, real=head._fired: (order.append("head"), real(param))[1])
    engine.fitting.window_at(40_000, 2)
    slots = [s.nbytes for s in engine.transfers.window.slots]
    assert len(engine.chunks) > 2 and len(slots) == 2
    limit, hooks = 10**9, len(origs)
    # room for one slot more at each hook: the head fills the window slot by slot
    ahead = [limit - sum(slots[:min(k + 1, 2)]) for k in range(hooks)]
    head._allocated = lambda: engine.transfers.window.held
    head.curve, head.state = Curve(at=[0] * hooks, ahead=ahead, first=0, hooks=hooks, microbatches=1), "measured"
    head.enable(limit)
    for _ in range(3):
        step(ref)
        engine.offload()
        engine.release()
        order.clear()
        sum(p.float().sum() for p in origs).backward()  # the last backward, through the module's parameters
        assert order == ["fsdp", "head"] * hooks
        assert len(engine.transfers.started) == 2  # the whole window in before gradient finalization
        harness.finish_step(opt, engine)
        assert_same(fsdp.snapshot(ref), fsdp.snapshot(opt))
    assert head.state == "on" and head.prefetched == 2
    engine.close()
    assert not head.attached


def test_problems_name_the_field(gloo):
    opt = fsdp.make_optimizer(harness.Recorder(), strategy="no_shard")
    (p,) = engine_fsdp.problems(opt)
    assert "data_parallel_sharding_strategy='no_shard'" in p
    opt = fsdp.make_optimizer(harness.Recorder())
    opt.config.use_precision_aware_optimizer = True
    (p,) = engine_fsdp.problems(opt)
    assert "use_precision_aware_optimizer=True" in p
    # a layout this engine does not know: a master that is not a view of its group's buffer
    opt = fsdp.make_optimizer(harness.Recorder())
    p0 = opt.optimizer.param_groups[0]["params"][0]
    p0._local_tensor = p0._local_tensor.clone()
    (p,) = engine_fsdp.problems(opt)
    assert "is not a view of its group's main-weight buffer" in p and "Nothing was moved" in p


@pytest.mark.parametrize("kind", ["torch", "te"])
def test_a_load_writes_into_the_host_views_and_no_dummy_step_runs(gloo, kind):
    """What an fsdp_dtensor resume does to the optimizer: Megatron-Core's _init_optimizer_states_with_dummy_values
    (served by making the states in their host views, never by a step on the host), the masters and the
    model weights written in place, the inner load_state_dict; then the run goes on as the saved one did."""
    ref = fsdp.make_optimizer(harness.Recorder(), **OPTIMIZERS[kind])
    for _ in range(2):
        step(ref)
    saved = {"state": ref.optimizer.state_dict(), **fsdp.snapshot(ref)}
    saved["state"] = {"state": {k: {n: (v.clone() if isinstance(v, torch.Tensor) else v)  # DTensors, as DCP loads
                                    for n, v in s.items()} for k, s in saved["state"]["state"].items()},
                      "param_groups": saved["state"]["param_groups"]}
    opt = fsdp.make_optimizer(harness.Recorder(), seed=1, **OPTIMIZERS[kind])
    engine = StreamedEngine([opt], 40_000)
    engine.prepare()
    masters = [p._local_tensor.clone() for g in opt.optimizer.param_groups for p in g["params"]]
    opt._init_optimizer_states_with_dummy_values()
    after = [p._local_tensor for g in opt.optimizer.param_groups for p in g["params"]]
    assert all(torch.equal(a, b) for a, b in zip(masters, after))  # no step over zero gradients moved them
    buf = engine.buffer.tensor
    lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel()
    for g in opt.optimizer.param_groups:
        for p in g["params"]:
            assert {k for k, v in opt.optimizer.state[p].items() if getattr(v, "dim", lambda: 0)()} >= {"exp_avg",
                                                                                                       "exp_avg_sq"}
            assert all(lo <= v._local_tensor.data_ptr() < hi for v in opt.optimizer.state[p].values()
                       if type(v).__name__ == "DTensor")
    # the load: masters and weights in place, then the optimizer's own load_state_dict
    for gi, g in enumerate(opt.optimizer.param_groups):
        for pi, p in enumerate(g["params"]):
            p._local_tensor.copy_(saved[f"master{gi}.{pi}"])
    for gi, g in enumerate(opt.model_chunks[0].param_and_grad_buffer.parameter_groups):
        g.model_weight_buffer.data.copy_(saved[f"weights{gi}"])
    opt.optimizer.load_state_dict(saved["state"])
    engine.after_load()
    opt._gen = ref._gen  # the data goes on where the saved run was
    assert engine.plan.on_host()
    for _ in range(2):
        step(ref)
        step(opt, engine)
        assert_same(fsdp.snapshot(ref), fsdp.snapshot(opt))
    engine.close()


def fsdp_rig(**kw):
    cfg = harness.config_container(mxfp8_copy=False)
    cfg.ddp.use_megatron_fsdp = True
    cfg.ddp.data_parallel_sharding_strategy = kw.pop("strategy", "optim_grads_params")
    rig = harness.Rig(cfg=cfg)
    opt = fsdp.make_optimizer(rig.events, strategy=cfg.ddp.data_parallel_sharding_strategy, **kw)
    rig.dist_optimizer = opt
    rig.optimizer = harness.ChainedOptimizer([opt], rig.events)
    rig.model = opt.model_chunks
    rig.model[0].config = rig.model_config
    return rig


def test_through_bridges_train_step_bit_identical_and_said(gloo, caplog_fgo):
    ref = fsdp_rig()
    harness.run_steps(ref, steps=3)
    bridge_fgo.patch(offload="builtin", chunk_mb=1)
    rig = fsdp_rig()
    harness.run_steps(rig, steps=3)
    bridge_fgo.synchronize()  # a direct reader: the last update's device-to-host copies done first
    assert_same(fsdp.snapshot(ref.dist_optimizer), fsdp.snapshot(rig.dist_optimizer))
    (session,) = bridge_fgo.status().sessions
    assert session["steps"] == 3 and session["states_on"] == "host"
    assert any("under Megatron-FSDP, optim_grads_params (2 main-weight buffer(s))" in i
               for i in session["inner_optimizers"])
    assert any("offload active" in r.getMessage() and "under Megatron-FSDP, optim_grads_params" in r.getMessage()
               for r in caplog_fgo.records)
    # optim_grads_params ran on GPUs: nothing to warn of
    assert not [r for r in caplog_fgo.records if r.levelname == "WARNING" and r.name == "bridge_fgo"]
    bridge_fgo.unpatch()
    assert_same(fsdp.snapshot(ref.dist_optimizer), fsdp.snapshot(rig.dist_optimizer))



@pytest.mark.parametrize("strategy", ["optim", "optim_grads"])
def test_the_other_strategies_run_bit_identical_without_a_warning(gloo, caplog_fgo, strategy):
    # all three ran on two H200s, bit-identical (docs/benchmarks.md#gpu-2026-11-28e): nothing left to warn of
    ref = fsdp_rig(strategy=strategy)
    harness.run_steps(ref, steps=2)
    bridge_fgo.patch(offload="builtin", chunk_mb=1)
    rig = fsdp_rig(strategy=strategy)
    harness.run_steps(rig, steps=2)
    bridge_fgo.synchronize()
    assert_same(fsdp.snapshot(ref.dist_optimizer), fsdp.snapshot(rig.dist_optimizer))
    assert any(f"under Megatron-FSDP, {strategy} " in r.getMessage() for r in caplog_fgo.records)
    assert not [r for r in caplog_fgo.records if r.levelname == "WARNING" and r.name == "bridge_fgo"]
    bridge_fgo.unpatch()


@pytest.mark.parametrize("outer,fp8,said", [
    ("optim", False, None),
    ("no_shard", False, "outer_dp_sharding_strategy='no_shard' (checked on CPU"),
    ("optim", True, "FP8 parameters (cfg.ddp.fp8_param_gather=True: not run under HSDP)"),
])
def test_hsdp_not_yet_run_on_a_gpu_is_said_once_per_rank(gloo, caplog_fgo, outer, fp8, said):
    # the HSDP settings only, on the one-rank rig: what the WARNING reads is the configuration
    bridge_fgo.patch(offload="builtin", chunk_mb=1)
    rig = fsdp_rig()
    ddp = rig.dist_optimizer.ddp_config
    ddp.num_distributed_optimizer_instances, ddp.outer_dp_sharding_strategy = 2, outer
    ddp.fp8_param_gather = fp8
    harness.run_steps(rig, steps=2)
    warned = [r.getMessage() for r in caplog_fgo.records if r.levelname == "WARNING" and r.name == "bridge_fgo"]
    if said is None:
        assert warned == [] and engine_fsdp.unverified(rig.dist_optimizer) is None
    else:
        assert warned == ["[rank 0] " + engine_fsdp.unverified(rig.dist_optimizer)] and said in warned[0]
        assert "has run on GPUs with outer_dp_sharding_strategy='optim' and bf16 parameters" in warned[0]
    bridge_fgo.unpatch()


REFUSED = [
    (dict(chunk_mb=0), {}, "offload='builtin' with chunk_mb > 0"),
    ({}, {"logger.log_params_norm": True}, "cfg.logger.log_params_norm=True with Megatron-FSDP"),
    ({}, {"model.qk_clip": True}, "cfg.model.qk_clip=True with Megatron-FSDP"),
    ({}, {"strategy": "no_shard"}, "data_parallel_sharding_strategy='no_shard'"),
    ({}, {"precision_aware": True}, "use_precision_aware_optimizer=True with Megatron-FSDP"),
]


@pytest.mark.parametrize("options,change,needle", REFUSED, ids=[r[2][:40] for r in REFUSED])
def test_what_the_streamed_step_cannot_serve_is_refused_before_the_first_step(gloo, options, change, needle):
    import types

    rig = fsdp_rig(strategy=change.get("strategy", "optim_grads_params"))
    if change.get("precision_aware"):
        rig.cfg.optimizer.use_precision_aware_optimizer = True
        rig.dist_optimizer.config.use_precision_aware_optimizer = True
    if change.get("logger.log_params_norm"):
        rig.cfg.logger = types.SimpleNamespace(log_params_norm=True)
    if change.get("model.qk_clip"):
        rig.cfg.model.qk_clip = True
    bridge_fgo.patch(offload="builtin", **options)
    before = fsdp.snapshot(rig.dist_optimizer)
    with pytest.raises(BridgeFGOConfigError) as err:
        harness.run_steps(rig, steps=1)
    assert needle in str(err.value)
    assert rig.events == []  # nothing touched
    assert_same(before, fsdp.snapshot(rig.dist_optimizer))


@pytest.mark.parametrize("async_save", [False, True])
def test_fsdp_dtensor_checkpoints_are_not_refused(gloo, async_save):
    import types

    rig = fsdp_rig()
    rig.cfg.checkpoint = types.SimpleNamespace(save="/tmp/x", save_optim=True, async_save=async_save,
                                               ckpt_format="fsdp_dtensor", load=None)
    bridge_fgo.patch(offload="builtin", chunk_mb=1)
    harness.run_steps(rig, steps=1)
    assert bridge_fgo.status().sessions[0]["steps"] == 1


def test_megatron_fsdp_copy_outside_an_update_reads_the_host_masters(gloo):
    """After a load, or from a conversion tool: copy_main_weights_to_model_weights with the buffers given up
    reads each master where it is, in its model's dtype: the same weights as from the buffer itself."""
    ref = fsdp.make_optimizer(harness.Recorder())
    opt = fsdp.make_optimizer(harness.Recorder())
    engine = StreamedEngine([opt], 40_000)
    engine.prepare()
    for o in (ref, opt):
        for g in o.optimizer.param_groups:
            for p in g["params"]:
                p._local_tensor.mul_(1.5)  # what a load writes into the masters
        o.model_chunks[0].param_and_grad_buffer.copy_main_weights_to_model_weights()
    assert_same(fsdp.snapshot(ref), fsdp.snapshot(opt))
    pgb = opt.model_chunks[0].param_and_grad_buffer
    hooked = pgb.copy_main_weights_to_model_weights
    engine.close()
    assert pgb.copy_main_weights_to_model_weights is not hooked  # put back as it was


def _loaded_from(opt, ref):
    """(opt's params, ref's params, the state dict) of what an fsdp_dtensor load hands `opt`'s inner optimizer:
    its own states (DTensors over the host views) written in place by DCP with `ref`'s values, keyed by position
    as Megatron-Core's FSDP branch of load_state_dict passes them."""
    params = [p for g in opt.optimizer.param_groups for p in g["params"]]
    ref_params = [p for g in ref.optimizer.param_groups for p in g["params"]]
    for p, q in zip(params, ref_params):
        for name, value in opt.optimizer.state[p].items():
            value._local_tensor.copy_(ref.optimizer.state[q][name]._local_tensor)
    saved = {"state": {i: dict(opt.optimizer.state[p]) for i, p in enumerate(params)},
             "param_groups": opt.optimizer.state_dict()["param_groups"]}
    return params, ref_params, saved


def test_an_inner_load_holds_one_state_at_a_time_off_the_host(gloo):
    """Transformer Engine's load_state_dict remakes every state (DTensor.from_local moves a host local to the
    mesh's device) and torch's casts each loaded state to its parameter's device (the GPU, for Megatron-FSDP's
    DTensors): each state TE sets is taken into its host view at once, and a loaded DTensor state on the host
    keeps its device through torch's cast."""
    from torch.optim import Optimizer

    ref = fsdp.make_optimizer(harness.Recorder(), optimizer="te")
    step(ref)
    opt = fsdp.make_optimizer(harness.Recorder(), optimizer="te")
    engine = StreamedEngine([opt], 40_000)
    engine.prepare()  # the states made in their host views before the load
    params, ref_params, saved = _loaded_from(opt, ref)
    part = engine.plan.parts[0]
    b = part.bindings
    off_host, real = [], type(opt.optimizer).set_scaled_state

    def counted(self, param, name, unscaled):
        off_host.append(sum(1 for bd in part.bundles for e in bd.entries if e.kind != "master"
                            and b.get(e) is not None and not (b.get(e).data_ptr() == e.host.data_ptr())))
        return real(self, param, name, unscaled)

    cast = Optimizer.__dict__["_process_value_according_to_param_policy"]
    type(opt.optimizer).set_scaled_state = counted
    try:
        with engine.readers._fsdp_states_on_host(opt.optimizer):
            assert Optimizer.__dict__["_process_value_according_to_param_policy"] is not cast
            p = opt.optimizer.param_groups[0]["params"][0]
            host_state = opt.optimizer.state[p]["exp_avg"]
            assert Optimizer._process_value_according_to_param_policy(
                p, host_state, 0, opt.optimizer.param_groups, "exp_avg") is host_state
        assert Optimizer.__dict__["_process_value_according_to_param_policy"] is cast
        opt.optimizer.load_state_dict(saved)  # through the engine's load hook
    finally:
        type(opt.optimizer).set_scaled_state = real
    assert off_host and max(off_host) == 0  # each state taken as soon as it was set
    assert Optimizer.__dict__["_process_value_according_to_param_policy"] is cast
    engine.after_load()
    assert engine.plan.on_host()
    for p, q in zip(params, ref_params):  # the loaded values, in the host views
        for name, value in opt.optimizer.state[p].items():
            assert torch.equal(value._local_tensor, ref.optimizer.state[q][name]._local_tensor)
    engine.close()


def _dtensors(tree):
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _dtensors(v)
    elif engine_fsdp.is_dtensor(tree):
        yield tree


def _dcp_contents(path, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / (path.name + ".pt")
    dcp_to_torch_save(path, out)
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("kind", ["torch", "te"])
def test_fsdp_dtensor_save_and_load_read_and_write_the_host_views(gloo, kind, tmp_path):
    """A real DCP save and load of what Bridge hands it under Megatron-FSDP (support/fsdp.checkpoint_state),
    on a mesh made to say it is on the GPU: on two H200s the module's state_dict failed on the optimizer's
    DTensors, GPU DTensors over host views ('Attempted to set the storage of a tensor on device "cpu" to a
    storage on different device "cuda:0"', 2026-11-27), and DTensor.from_local moves a host view to the
    mesh's device. Inside checkpoint_io the writer gets DTensors on the host over the pinned buffer (no GPU
    copy; this torch has no GPU, so a move raises), the checkpoint equals the one saved without offload, the
    module is back as it was, and a run loaded from it goes on bit-identical."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor, Shard

    ref = fsdp.make_optimizer(harness.Recorder(), **OPTIMIZERS[kind])
    opt = fsdp.make_optimizer(harness.Recorder(), **OPTIMIZERS[kind])
    engine = StreamedEngine([opt], 40_000)
    engine.prepare()
    for _ in range(2):
        step(ref)
        step(opt, engine)
    dcp.save(fsdp.checkpoint_state(ref), checkpoint_id=tmp_path / "ref")

    buf = engine.buffer.tensor
    key = buf.untyped_storage().data_ptr()
    mod = opt.model_chunks[0].module
    before = dict(mod.module.named_parameters())
    opt._mesh._device_type = "cuda"  # what from_local moves a local tensor to
    try:
        view = buf[:8].view(torch.float32)
        with pytest.raises(Exception):
            DTensor.from_local(view, opt._mesh, [Shard(0)], shape=view.shape, stride=view.stride())
        with engine.checkpoint_io():
            kept = DTensor.from_local(view, opt._mesh, [Shard(0)], shape=view.shape, stride=view.stride())
            assert kept.device.type == "cpu" and kept._local_tensor.data_ptr() == view.data_ptr()
            sd = fsdp.checkpoint_state(opt)
            written = list(_dtensors(sd))
            assert len(written) > 10
            for t in written:  # on the host, over the pinned buffer, no copy
                assert t.device.type == "cpu"
                assert t._local_tensor.numel() == 0 or t._local_tensor.untyped_storage().data_ptr() == key
            dcp.save(sd, checkpoint_id=tmp_path / "fgo")
        assert all(before[n] is p for n, p in mod.module.named_parameters())  # the module as it was
        assert_same(_dcp_contents(tmp_path / "ref", tmp_path), _dcp_contents(tmp_path / "fgo", tmp_path))

        # a run loaded from it (Bridge's load_fsdp_dtensor_checkpoint, then the module's and the optimizer's loads)
        new = fsdp.make_optimizer(harness.Recorder(), seed=1, **OPTIMIZERS[kind])
        new._mesh._device_type = "cuda"
        engine2 = StreamedEngine([new], 40_000)
        engine2.prepare()
        key2 = engine2.buffer.tensor.untyped_storage().data_ptr()
        with engine2.checkpoint_io():
            sd = fsdp.checkpoint_state(new, loading=True)
            with reads.straight_into([engine2.buffer]) as straight:
                dcp.load(sd, checkpoint_id=tmp_path / "fgo")
            # each DTensor over the host views (states, and the masters the module's twins show) read straight
            # into it from the file (instrument/reads.py)
            assert straight.tensors == sum(1 for t in _dtensors(sd) if t._local_tensor.numel()
                                           and t._local_tensor.untyped_storage().data_ptr() == key2) > 10
            assert straight.as_torch == 0
            new.model_chunks[0].module.module.load_state_dict(sd["model"])
            new.model_chunks[0].param_and_grad_buffer.copy_main_weights_to_model_weights()
            new.load_state_dict(sd["optimizer"])
        engine2.after_load()
        for st in new.optimizer.state.values():  # the optimizer's own DTensors again, over the host views
            for v in st.values():
                if engine_fsdp.is_dtensor(v) and v._local_tensor.numel():
                    assert v._local_tensor.untyped_storage().data_ptr() == engine2.buffer.tensor.untyped_storage(
                    ).data_ptr()
    finally:
        opt._mesh._device_type = "cpu"
    new._mesh._device_type = "cpu"
    new._gen = ref._gen
    for _ in range(2):
        step(ref)
        step(new, engine2)
        assert_same(fsdp.snapshot(ref), fsdp.snapshot(new))
    engine.close()
    engine2.close()


@pytest.mark.parametrize("route", ["memory", "shm"])
def test_an_asynchronous_fsdp_dtensor_save_hands_the_writer_the_snapshot(gloo, route, tmp_path, monkeypatch):
    """Bridge's asynchronous fsdp_dtensor save (checkpointing.py: nvidia-resiliency-ext's FileSystemWriterAsync
    and save_state_dict_async_plan inside the save call; the request's preload and write later, in its worker):
    inside the call the writer is handed DTensors over the snapshot kept for the run, each local tensor owning its
    whole storage (the writer neither clones it nor reads the pinned buffer); the next step rewrites the buffer
    before the write runs, and the checkpoint is still the iteration's, equal to a synchronous save without
    offload."""
    saver = pytest.importorskip("nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver")
    from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import FileSystemWriterAsync
    import torch.distributed.checkpoint as dcp

    # the writer's D2H fence and the finalize's device for its done-flag: nothing is on a GPU here
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda *a, **k: "cpu")
    ref = fsdp.make_optimizer(harness.Recorder(), **OPTIMIZERS["te"])
    opt = fsdp.make_optimizer(harness.Recorder(), **OPTIMIZERS["te"])
    engine = StreamedEngine([opt], 40_000)
    engine.snapshot.route = route  # (the adapter sets it from cfg.checkpoint: saves.snapshot_route)
    engine.prepare()
    for _ in range(2):
        step(ref)
        step(opt, engine)
    dcp.save(fsdp.checkpoint_state(ref), checkpoint_id=tmp_path / "ref")
    key = engine.buffer.tensor.untyped_storage().data_ptr()
    mod = opt.model_chunks[0].module
    before = dict(mod.module.named_parameters())
    opt._mesh._device_type = "cuda"  # a host view handed to DTensor.from_local would move (and fail here)
    try:
        with engine.snapshot.saving(), engine.checkpoint_io():
            sd = fsdp.checkpoint_state(opt)
            written = [t._local_tensor for t in _dtensors(sd) if t._local_tensor.numel()]
            assert len(written) > 10 and engine.snapshot.served >= len(written)
            for lt in written:  # the snapshot's own tensors: not the buffer, not a view the writer would clone
                assert lt.device.type == "cpu" and lt.untyped_storage().data_ptr() != key
                assert lt.untyped_storage().nbytes() == lt.numel() * lt.element_size()
                assert lt.untyped_storage().is_shared() == (route == "shm")
            writer = FileSystemWriterAsync(str(tmp_path / "fgo"), thread_count=1)
            planned = saver.save_state_dict_async_plan(sd, writer, None, 0, planner=dcp.DefaultSavePlanner())
            write, preload, args = writer.get_save_function_and_args()
        assert all(before[n] is p for n, p in mod.module.named_parameters())  # the module as it was
        del sd, written
    finally:
        opt._mesh._device_type = "cpu"
    step(opt, engine)  # the next update rewrites the pinned buffer before the writer runs
    args[1] = preload()
    write(*args)
    saver.save_state_dict_async_finalize(*planned)
    assert_same(_dcp_contents(tmp_path / "ref", tmp_path), _dcp_contents(tmp_path / "fgo", tmp_path))
    step(ref)
    assert_same(fsdp.snapshot(ref), fsdp.snapshot(opt))  # and training went on as without offload
    engine.close()


def _bridge_fsdp_async_save(state, opt, path):
    """What Bridge's save_checkpoint does with an fsdp_dtensor checkpoint when async_save is set
    (checkpointing.py): the state dict, nvidia-resiliency-ext's plan inside the call, the request (its preload,
    write and finalize) scheduled on the run's queue."""
    from nvidia_resiliency_ext.checkpointing.async_ckpt import state_dict_saver as saver
    from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import FileSystemWriterAsync
    import torch.distributed.checkpoint as dcp

    writer = FileSystemWriterAsync(str(path), thread_count=1)
    planned = saver.save_state_dict_async_plan(fsdp.checkpoint_state(opt), writer, None, 0,
                                               planner=dcp.DefaultSavePlanner())
    write, preload, args = writer.get_save_function_and_args()

    def request():
        args[1] = preload()
        write(*args)
        saver.save_state_dict_async_finalize(*planned)

    state.async_calls_queue.schedule_async_request(request)


def _te_fsdp_rig():
    """Megatron-FSDP's optimizer with TE's FusedAdam (what users run: its step lives in the param group; torch
    AdamW's per-parameter step is, in this harness, a CPU tensor of its own, which an asynchronous writer is handed
    live and the next steps rewrite)."""
    rig = fsdp_rig(**OPTIMIZERS["te"])
    rig.model_config.num_moe_experts = None  # (what Megatron-Core's optimizer state dict reads of the model)
    return rig


def _patched_async_fsdp_rig(tmp_path, persistent):
    """Under the patch, a TE rig saving fsdp_dtensor asynchronously through Bridge's queue (harness.LaterQueue: each
    request written when the queue is finalized blocking); its save_checkpoint call site."""
    import types

    from bridge_fgo.instrument import patcher, targets

    bridge_fgo.patch(offload="builtin", chunk_mb=1)
    rig = _te_fsdp_rig()
    rig.cfg.checkpoint = types.SimpleNamespace(save=str(tmp_path), load=None, save_optim=True, async_save=True,
                                               ckpt_format="fsdp_dtensor", use_persistent_ckpt_worker=persistent,
                                               dist_ckpt_optim_fully_reshardable=False)
    rig.global_state.async_calls_queue = harness.LaterQueue()
    return rig, patcher._current.callsites.site(targets.target("save_checkpoint"))


@pytest.mark.parametrize("persistent", [False, True])
def test_an_asynchronous_fsdp_dtensor_save_through_the_call_site_is_not_waited_for(gloo, persistent, tmp_path,
                                                                                  monkeypatch, caplog_fgo):
    """Bridge's save_checkpoint as the patch wraps it, with an asynchronous fsdp_dtensor save under Megatron-FSDP
    and Bridge's real train_step: the snapshot kept for the run (in /dev/shm for the persistent worker) is what the
    writer holds, so the save is not finished inside the call; two more steps run before it is written, and the
    checkpoint is its iteration's, equal to a synchronous save without offload."""
    pytest.importorskip("nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver")
    import torch.distributed.checkpoint as dcp

    from bridge_fgo.instrument import patcher

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda *a, **k: "cpu")
    ref = _te_fsdp_rig()
    harness.run_steps(ref, steps=2)
    dcp.save(fsdp.checkpoint_state(ref.dist_optimizer), checkpoint_id=tmp_path / "ref")
    rig, site = _patched_async_fsdp_rig(tmp_path, persistent)
    queue = rig.global_state.async_calls_queue
    harness.run_steps(rig, steps=2)
    site(_bridge_fsdp_async_save, None, (rig.global_state, rig.dist_optimizer, tmp_path / "fgo"), {})
    (session,) = patcher._current.callsites.registry.sessions()
    snap = session.adapter.engine.snapshot
    assert queue.get_num_unfinalized_calls() == 1 and snap.served > 0  # not finished inside the call
    assert snap.route == ("shm" if persistent else "memory")
    harness.run_steps(rig, steps=2)
    queue.maybe_finalize_async_calls(blocking=True)
    assert_same(_dcp_contents(tmp_path / "ref", tmp_path), _dcp_contents(tmp_path / "fgo", tmp_path))
    assert not [r for r in caplog_fgo.records if r.levelname == "WARNING" and r.name == "bridge_fgo"]
    harness.run_steps(ref, steps=2)
    bridge_fgo.synchronize()
    assert_same(fsdp.snapshot(ref.dist_optimizer), fsdp.snapshot(rig.dist_optimizer))
    bridge_fgo.unpatch()


def test_two_pending_fsdp_dtensor_saves_each_write_their_own_iteration(gloo, tmp_path, monkeypatch, caplog_fgo):
    """Two asynchronous fsdp_dtensor saves pending at once (Bridge starts the second before the first is written),
    both written only after the next step: the second is handed the snapshot's second set (made for it, room
    checked), so each checkpoint equals a synchronous save of its iteration without offload."""
    pytest.importorskip("nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver")
    import torch.distributed.checkpoint as dcp

    caplog_fgo.set_level("INFO", logger="bridge_fgo")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda *a, **k: "cpu")
    ref = _te_fsdp_rig()
    harness.run_steps(ref, steps=2)
    dcp.save(fsdp.checkpoint_state(ref.dist_optimizer), checkpoint_id=tmp_path / "ref2")
    harness.run_steps(ref, steps=1)
    dcp.save(fsdp.checkpoint_state(ref.dist_optimizer), checkpoint_id=tmp_path / "ref3")
    rig, site = _patched_async_fsdp_rig(tmp_path, persistent=True)
    queue = rig.global_state.async_calls_queue
    harness.run_steps(rig, steps=2)
    site(_bridge_fsdp_async_save, None, (rig.global_state, rig.dist_optimizer, tmp_path / "fgo2"), {})
    harness.run_steps(rig, steps=1)
    site(_bridge_fsdp_async_save, None, (rig.global_state, rig.dist_optimizer, tmp_path / "fgo3"), {})
    harness.run_steps(rig, steps=1)
    assert queue.get_num_unfinalized_calls() == 2  # neither written yet
    queue.maybe_finalize_async_calls(blocking=True)
    for it in (2, 3):
        assert_same(_dcp_contents(tmp_path / f"ref{it}", tmp_path), _dcp_contents(tmp_path / f"fgo{it}", tmp_path))
    assert [r for r in caplog_fgo.records if "a second snapshot was made" in r.getMessage()]
    bridge_fgo.unpatch()


@pytest.mark.parametrize("kind", ["torch", "te"])
def test_before_a_load_every_rank_has_the_states_the_dummy_step_makes(gloo, kind):
    """Megatron-Core's dummy step before an fsdp_dtensor load, served without stepping: the same parameters get
    states as with the real dummy step (TE's makes the empty states of a parameter with no elements on this
    rank; torch AdamW none), and the param groups the same step count. On two H200s a resume hung when the
    empty ones were missing: the load's per-DTensor collectives paired up across ranks with different state
    dicts (2026-11-27)."""
    ref = fsdp.make_optimizer(harness.Recorder(), shapes=fsdp.EMPTY_SHAPES, **OPTIMIZERS[kind])
    opt = fsdp.make_optimizer(harness.Recorder(), shapes=fsdp.EMPTY_SHAPES, **OPTIMIZERS[kind])
    engine = StreamedEngine([opt], 40_000)
    engine.prepare()
    ref._init_optimizer_states_with_dummy_values()
    opt._init_optimizer_states_with_dummy_values()

    def made(o):
        return [(gi, pi, sorted(k for k in o.optimizer.state.get(p, {}) if k != "step"))
                for gi, g in enumerate(o.optimizer.param_groups) for pi, p in enumerate(g["params"])]

    assert made(opt) == made(ref)
    assert [g.get("step") for g in opt.optimizer.param_groups] == [g.get("step") for g in ref.optimizer.param_groups]
    engine.close()


def test_te_makes_its_states_as_dtensors_over_the_host_views_before_and_during_a_load(gloo, monkeypatch):
    """Under Megatron-FSDP too, TE's own _initialize_state (host memory, then DTensor.from_local to the mesh's
    device, then a copy back) does not run for its fp32 states: before the first step and in its loader each is
    made as a DTensor over its host view (contracts.Contract.made_in), and the loaded values land there."""
    ref = fsdp.make_optimizer(harness.Recorder(), optimizer="te")
    step(ref)
    opt = fsdp.make_optimizer(harness.Recorder(), optimizer="te")
    made = fused_adam.count_own_states(monkeypatch, opt.optimizer)
    engine = StreamedEngine([opt], 40_000)
    engine.prepare()
    params = [p for g in opt.optimizer.param_groups for p in g["params"]]
    moved = [p for p in params if p._local_tensor.numel()]
    assert moved and not made  # (a parameter with no local elements has no entries: TE's own code makes it)
    buf = engine.buffer.tensor
    lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel()

    def on_host_views():
        for p in moved:
            for value in opt.optimizer.state[p].values():
                if isinstance(value, torch.Tensor) and value.dim():
                    assert type(value).__name__ == "DTensor" and lo <= value._local_tensor.data_ptr() < hi

    on_host_views()
    _, ref_params, saved = _loaded_from(opt, ref)
    opt.optimizer.load_state_dict(saved)  # TE's loader makes every state anew: in the host views
    engine.after_load()
    assert not [m for m in made if m in ("exp_avg", "exp_avg_sq")], made
    on_host_views()
    for p, q in zip(moved, [q for p, q in zip(params, ref_params) if p._local_tensor.numel()]):
        for name, value in opt.optimizer.state[p].items():
            if isinstance(value, torch.Tensor) and value.dim():
                assert torch.equal(value._local_tensor, ref.optimizer.state[q][name]._local_tensor)
    engine.close()
