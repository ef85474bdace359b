"""Muon (cfg.optimizer.optimizer 'dist_muon', 'muon'), as Bridge's recipes train it:
Megatron-Core's real optimizers, built by Bridge's real setup_optimizer (support/muon.py), stepped
through Bridge's real train_step under bridge_fgo.patch(offload="builtin", chunk_mb=0).

The one-window engine moves every Muon part's fp32 masters and momenta (and the scalar optimizer's
states, Adam or Lion) to the host for forward-backward and brings them all back for the step, which
runs untouched: the run is bit-identical to the one without offload. The streamed step refuses Muon
before the first step, naming chunk_mb=0; Megatron-Core's own offloaders refuse it by name.

One rank here, in this process; two data-parallel ranks (each its own matrices under dist_muon's
LayerWiseDistributedOptimizer) in spawned processes.
"""
import logging
import os
import re
import types

import pytest
import torch

import bridge_fgo
from bridge_fgo.engine.tensors import padded
from bridge_fgo.errors import BridgeFGOConfigError
from bridge_fgo.instrument import generations, refusals
from support import harness, muon

needs_muon = pytest.mark.skipif(not muon.have_emerging_optimizers(),
                                reason="emerging-optimizers is not installed (Megatron-Core builds Muon from it; "
                                       "it needs Python >= 3.12)")

STEPS = 3
CASES = [("dist_muon", "adam", False), ("dist_muon", "lion", False), ("muon", "adam", False),
         ("muon", "adam", True)]
IDS = ["dist_muon", "dist_muon-lion", "muon", "muon-distributed_optimizer"]


def _train(store_dir, name, scalar, distributed, offload, chunk_mb=0):
    """STEPS steps of Bridge's real train_step; what the run ends with, and what each forward-backward saw."""
    from test_resume_dp import one_rank

    with one_rank(store_dir):
        try:
            run = muon.Run(name, scalar, distributed)
        except Exception as exc:  # a name this Megatron-Core does not build (adaptive Muon before 0.19)
            if "not supported" not in str(exc):
                raise
            return {"error": f"{type(exc).__name__}: {exc}"}
        released = []

        def forward(model):
            # during forward-backward: how many states are on the GPU (storage not released)
            released.append([n for n, t in run.states() if t.untyped_storage().nbytes() > 0])
            run.grads()

        rig = harness.Rig(cfg=harness.config_container(optimizer_cfg=run.config, mxfp8_copy=False), forward=forward)
        rig.optimizer = run.optimizer
        if offload:
            bridge_fgo.patch(offload="builtin", chunk_mb=chunk_mb)
        try:
            results = harness.run_steps(rig, steps=STEPS)
            out = {"error": None, "results": results, "on_gpu_in_forward": released, "snapshot": run.snapshot(),
                   "classes": [type(p).__name__ + "/" + type(p.optimizer).__name__ for p in run.parts()],
                   "events": list(rig.events)}
            if offload:
                (session,) = bridge_fgo.status().sessions
                out["session"] = session
                sizes = [t.numel() * t.element_size() for _, t in run.states()]
                out["state_bytes"], out["padded_bytes"] = sum(sizes), sum(padded(n) for n in sizes)
        finally:
            bridge_fgo.unpatch()
        out["after_unpatch"] = run.snapshot()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cache = {}

    def get(case, offload):
        if (case, offload) not in cache:
            cache[case, offload] = _train(tmp_path_factory.mktemp("muon"), *case, offload)
        return cache[case, offload]

    return get


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@needs_muon
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_muon_with_one_window_is_bit_identical_and_away_from_the_gpu_in_forward_backward(runs, case, caplog):
    base, offloaded = runs(case, False), runs(case, True)
    if base["error"] is not None:  # Megatron-Core cannot build it at all, with or without offload
        assert offloaded["error"] == base["error"]
        pytest.skip(f"this Megatron-Core does not build {case[0]!r}: {base['error'][:160]}")
    assert offloaded["error"] is None
    assert any("Muon" in c for c in offloaded["classes"]), offloaded["classes"]
    # the same updates, losses (train_step's results) and grad norms, bit for bit
    assert offloaded["results"] == base["results"]
    _same(base["snapshot"], offloaded["snapshot"])
    _same(base["snapshot"], offloaded["after_unpatch"])
    # without offload every master (and, from step 2, every state) is on the GPU in forward-backward;
    # with it, none is
    assert all(base["on_gpu_in_forward"][1:]) and offloaded["on_gpu_in_forward"] == [[]] * STEPS
    s = offloaded["session"]
    assert s["mode"] == "builtin" and s["calls"] == {"offload": STEPS, "release": STEPS, "reload": STEPS}
    # every master and state moves, and the host buffer sized before step 1 held them (not grown)
    assert s["bytes"] == offloaded["state_bytes"] and s["pinned_bytes"] >= s["bytes"]
    assert any(o.startswith("Muon (megatron.core.optimizer.") and o.endswith(".TensorParallelMuon)")
               for o in s["inner_optimizers"]), s["inner_optimizers"]


@needs_muon
def test_the_host_buffer_is_sized_before_the_first_step_for_the_states_muon_makes(tmp_path, caplog):
    """The contracts predict Muon's momentum and Lion's moment: the buffer pinned before step 1 holds
    exactly what the steps make (each entry aligned), and is never grown."""
    with caplog.at_level(logging.INFO, logger="bridge_fgo"):
        out = _train(tmp_path, "dist_muon", "lion", False, True)
    assert out["error"] is None
    assert not [m for m in caplog.messages if "host buffer grows" in m]
    assert out["session"]["pinned_bytes"] == out["padded_bytes"]


def _refused(tmp_path, name, chunk_mb):
    from test_resume_dp import one_rank

    with one_rank(tmp_path):
        run = muon.Run(name)
        rig = harness.Rig(cfg=harness.config_container(optimizer_cfg=run.config, mxfp8_copy=False),
                          forward=lambda model: run.grads())
        rig.optimizer = run.optimizer
        before = run.snapshot()
        bridge_fgo.patch(offload="builtin", chunk_mb=chunk_mb)
        try:
            with pytest.raises(BridgeFGOConfigError) as err:
                harness.run_steps(rig, steps=1)
        finally:
            bridge_fgo.unpatch()
        _same(before, run.snapshot())
        return str(err.value), rig.events


@needs_muon
@pytest.mark.parametrize("name", ["dist_muon", "muon"])
def test_the_streamed_step_refuses_muon_before_anything_runs(tmp_path, name):
    msg, events = _refused(tmp_path, name, chunk_mb=1)
    assert re.search(r"the inner optimizer is Muon \(megatron\.core\.optimizer\.\w+\.TensorParallelMuon\): the "
                     "streamed step does not split its step", msg), msg
    assert "chunk_mb=0" in msg and "use_distributed_optimizer" not in msg
    assert "zero_grad_buffer" not in events  # Bridge's train_step never began


def test_megatron_cores_own_offloaders_refuse_muon_and_the_builtin_engine_names_what_it_serves():
    ns = types.SimpleNamespace
    cfg = ns(optimizer=ns(optimizer="dist_muon", use_distributed_optimizer=False), ddp=None, dist=None, model=None)
    builtin = generations.BUILTIN
    assert refusals.problems(cfg, [], [], builtin.who, served=builtin.optimizers) == []
    *_, found = refusals.problems(cfg, [], [], "Megatron-Core's offloader")  # Adam's distributed optimizer only
    assert found.startswith("cfg.optimizer.optimizer='dist_muon': Megatron-Core's offloader supports only 'adam'")
    assert "offload=builtin, chunk_mb=0" in found
    cfg.optimizer.optimizer, cfg.optimizer.use_distributed_optimizer = "dist_soap", True
    (found,) = refusals.problems(cfg, [], [], builtin.who, served=builtin.optimizers)
    assert "supports only 'adam', 'muon', 'dist_muon'" in found and "does not move those states yet" in found
    # Adam without the distributed optimizer is refused as before
    cfg.optimizer.optimizer, cfg.optimizer.use_distributed_optimizer = "adam", False
    (found,) = refusals.problems(cfg, [], [], builtin.who, served=builtin.optimizers)
    assert found.startswith("cfg.optimizer.use_distributed_optimizer=False")


# -- two data-parallel ranks: each its own matrices (dist_muon) ---------------------------------------

def _rank(rank, world, port, out_dir, offload):
    from support import te_free

    te_free.install()
    from test_agree import gloo_group
    from support import dp

    with gloo_group(rank, world, port), dp.gpu_on_cpu():
        dp.initialize()
        try:
            run = muon.Run("dist_muon", shapes=muon.EVEN)
            rig = harness.Rig(cfg=harness.config_container(optimizer_cfg=run.config, mxfp8_copy=False),
                              forward=lambda model: run.grads())
            rig.optimizer = run.optimizer
            if offload:
                bridge_fgo.patch(offload="builtin", chunk_mb=0)
            results = harness.run_steps(rig, steps=STEPS)
            session = bridge_fgo.status().sessions if offload else []
            bridge_fgo.unpatch()
            out = {"results": results, "snapshot": run.snapshot(), "sessions": session,
                   "owned": run.owned()}
        finally:
            dp.destroy()
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        f.write("{}")


@needs_muon
def test_two_data_parallel_ranks_each_move_their_own_matrices_bit_identically(tmp_path):
    from test_agree import run_ranks_with

    got = {}
    for offload in (False, True):
        d = tmp_path / str(offload)
        d.mkdir()
        run_ranks_with(_rank, d, offload, world=2)
        got[offload] = [torch.load(d / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for base, off in zip(got[False], got[True]):
        assert off["results"] == base["results"]
        _same(base["snapshot"], off["snapshot"])
        (s,) = off["sessions"]
        assert s["calls"]["offload"] == STEPS
    # the layer-wise optimizer splits the matrices between the ranks: each moves its own
    owned = [set(r["owned"]) for r in got[True]]
    assert owned[0] and owned[1] and not owned[0] & owned[1] and owned[0] | owned[1] == set(muon.EVEN)


def test_muon_is_read_from_the_optimizers_where_megatron_core_overwrote_the_name():
    """megatron-core 0.16 and 0.17 write muon_scalar_optimizer into cfg.optimizer.optimizer while they build
    Muon: the optimizers in hand say what was chosen."""
    ns = types.SimpleNamespace
    muon_class = type("TensorParallelMuon", (), {"__module__": "megatron.core.optimizer.muon"})
    part = ns(optimizer=muon_class())
    cfg = ns(optimizer=ns(optimizer="lion", use_distributed_optimizer=False), ddp=None, dist=None, model=None)
    builtin = generations.BUILTIN
    assert refusals.problems(cfg, [part], [part], builtin.who, served=builtin.optimizers) == []
    *_, found = refusals.problems(cfg, [part], [part], "Megatron-Core's offloader")
    assert found.startswith("cfg.optimizer.optimizer='muon': Megatron-Core's offloader supports only 'adam'")
    # without Muon among the optimizers, 'lion' is what it says
    *_, found = refusals.problems(cfg, [ns(optimizer=object())], [], builtin.who, served=builtin.optimizers)
    assert found.startswith("cfg.optimizer.optimizer='lion'")


def test_adam_is_refused_where_the_chain_holds_more_than_distributed_optimizers():
    """Adam's states move only out of DistributedOptimizers: a Float16OptimizerWithFloat16Params among
    them (now a part the engine knows, for Muon) is still refused for Adam."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    ns = types.SimpleNamespace
    cfg = ns(optimizer=ns(optimizer="adam", use_distributed_optimizer=True), ddp=None, dist=None, model=None)
    builtin = generations.BUILTIN
    dist = DistributedOptimizer.__new__(DistributedOptimizer)
    other = ns()
    assert refusals.problems(cfg, [dist], [dist], builtin.who, served=builtin.optimizers) == []
    (found,) = refusals.problems(cfg, [dist, other], [dist, other], builtin.who, served=builtin.optimizers)
    assert found.startswith("the optimizer holds SimpleNamespace beside its DistributedOptimizer: set ")
    (found,) = refusals.problems(cfg, [other], [other], builtin.who, served=builtin.optimizers)
    assert found.startswith("the optimizer holds no DistributedOptimizer (found SimpleNamespace): set ")


# -- a save and a resume (torch_dist, as Bridge's save and load build them) -----------------------------------

def _step(run, engine=None, seen=None):
    """One optimizer step with the one window's call sites where the patched train_step has them."""
    if engine is not None:
        engine.offload()
        engine.release()
        if seen is not None:
            seen.append([n for n, t in run.states() if t.untyped_storage().nbytes() > 0])
    run.grads()
    if engine is not None:
        engine.reload()
        engine.wait_reload()
    run.optimizer.step()
    if engine is not None:
        engine.settle()


@needs_muon
@pytest.mark.parametrize("fmt", ["dp_reshardable", "fully_reshardable"])
def test_a_resume_under_one_window_steps_bit_identically(tmp_path, fmt):
    """Trained 2 steps under the one window, saved (the layer-wise optimizer's own sharded state dict), resumed
    into another model and optimizer whose engine was prepared before the load (as the patched load_checkpoint
    does), 2 more steps: the same as the run never interrupted and as the resume without offload; the states
    the load put in place are the ones moved."""
    from bridge_fgo.engine.onewindow import OneWindowEngine
    from test_resume_dp import one_rank

    ckpt, seen = str(tmp_path / "ckpt"), []
    with one_rank(tmp_path):
        first = muon.Run()
        engine = OneWindowEngine(first.parts())
        engine.prepare()
        for i in range(4):
            _step(first, engine)
            if i == 1:
                first.save(ckpt, fmt)
        engine.close()
        resumed = {}
        for offload in (False, True):
            run = muon.Run(seed=7)  # other weights: the load must replace them all
            engine = OneWindowEngine(run.parts()) if offload else None
            if engine is not None:
                engine.prepare()  # planned and pinned before the load, as the patched load_checkpoint has it
            run.load(ckpt, fmt)
            run.generation = 2
            for _ in range(2):
                _step(run, engine, seen)
            resumed[offload] = run.snapshot()
            if engine is not None:
                engine.close()
    _same(first.snapshot(), resumed[False])
    _same(resumed[False], resumed[True])
    assert seen == [[], []]  # every master and state the resumed step reads was off the GPU in forward-backward
