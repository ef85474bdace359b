"""Muon (cfg.optimizer.optimizer 'dist_muon', 'muon'), as Bridge's recipes train it:
Megatron-Core's real optimizers, built by Bridge's real setup_optimizer (support/muon.py), stepped
through Bridge's real train_step under bridge_fgo.patch(offload="builtin").

The streamed step takes every Muon part's fp32 masters and momenta (and the scalar optimizer's states,
Adam or Lion) through the window chunk by chunk, whole matrices; the one window moves them all for
forward-backward and brings them back for the step. Either way the run is bit-identical to the one
without offload, saved and resumed too, and the masters are made on the host under the streamed step.
MuonClip (qk_clip beside Muon) and log_params_norm are served inside the streamed passes, over real
SelfAttention layers (support/attention.py) whose clips really fire. What the streamed step has not
checked beside Muon is refused before the first step, naming chunk_mb=0;
Megatron-Core's own offloaders refuse Muon by name.

One rank here, in this process; two data-parallel ranks (each its own matrices under dist_muon's
LayerWiseDistributedOptimizer) in spawned processes.
"""
import functools
import logging
import os
import re
import types
from unittest import mock

import pytest
import torch

import bridge_fgo
from bridge_fgo.engine import firststep
from bridge_fgo.engine.tensors import padded
from bridge_fgo.instrument import generations, refusals
from support import attention, harness, muon

needs_muon = pytest.mark.skipif(not muon.have_emerging_optimizers(),
                                reason="emerging-optimizers is not installed (Megatron-Core builds Muon from it; "
                                       "it needs Python >= 3.12)")

STEPS = 3
CASES = [("dist_muon", "adam", False), ("dist_muon", "lion", False), ("muon", "adam", False),
         ("muon", "adam", True)]
IDS = ["dist_muon", "dist_muon-lion", "muon", "muon-distributed_optimizer"]


def on_gpu(run, engine=None):
    """The names of the run's masters and states that are on the GPU: neither released (the one window,
    forward-backward) nor views of the engine's host buffer (the streamed step, between updates)."""
    if engine is None:
        sessions = bridge_fgo.instrument.patcher._current.callsites.registry.sessions() if bridge_fgo.is_patched() else []
        engine = sessions[0].adapter.engine if sessions else None
    buffer = getattr(engine, "buffer", None)
    host = buffer.tensor.untyped_storage().data_ptr() if buffer is not None and getattr(engine, "chunks", None) else None
    return [n for n, t in run.states() if t.untyped_storage().nbytes() > 0 and t.untyped_storage().data_ptr() != host]


def _train(store_dir, name, scalar, distributed, offload, chunk_mb=0, shapes=None):
    """STEPS steps of Bridge's real train_step; what the run ends with, and what each forward-backward saw."""
    from test_resume_dp import one_rank

    with one_rank(store_dir):
        try:
            run = muon.Run(name, scalar, distributed, **({"shapes": shapes} if shapes else {}))
        except Exception as exc:  # a name this Megatron-Core does not build (adaptive Muon before 0.19)
            if "not supported" not in str(exc):
                raise
            return {"error": f"{type(exc).__name__}: {exc}"}
        released = []

        def forward(model):
            # during forward-backward: which states are on the GPU (neither released nor in the host buffer)
            released.append(on_gpu(run))
            run.grads()

        rig = harness.Rig(cfg=harness.config_container(optimizer_cfg=run.config, mxfp8_copy=False), forward=forward)
        rig.optimizer = run.optimizer
        if offload:
            bridge_fgo.patch(offload="builtin", chunk_mb=chunk_mb)
        try:
            results = harness.run_steps(rig, steps=STEPS)
            bridge_fgo.synchronize()  # the last update's copies to the host: before reading states directly
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

    def get(case, chunk_mb=None):
        """None: without offload."""
        if (case, chunk_mb) not in cache:
            cache[case, chunk_mb] = _train(tmp_path_factory.mktemp("muon"), *case, chunk_mb is not None, chunk_mb or 0)
        return cache[case, chunk_mb]

    return get


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@needs_muon
@pytest.mark.parametrize("chunk_mb", [0, 1], ids=["one-window", "streamed"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_muon_is_bit_identical_and_away_from_the_gpu_in_forward_backward(runs, case, chunk_mb):
    base, offloaded = runs(case), runs(case, chunk_mb)
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
    assert s["chunk_mb"] == chunk_mb and s["torn"] is None if chunk_mb else s["chunk_mb"] == 0
    # every master and state moves, and the host buffer sized before step 1 held them (not grown)
    assert s["bytes"] == offloaded["state_bytes"] and s["pinned_bytes"] >= s["bytes"]
    assert any(o.startswith("Muon (megatron.core.optimizer.") and o.endswith(".TensorParallelMuon)")
               for o in s["inner_optimizers"]), s["inner_optimizers"]


@needs_muon
def test_the_streamed_step_takes_muons_matrices_through_several_chunks_bit_identically(tmp_path):
    """Matrices large enough for several 1 MB chunks: each chunk's pass steps its matrices and copies just
    their masters to the model (Megatron-Core's own copy, narrowed), as one step over everything."""
    big = {"a": (256,), "b": (256, 256), "c": (256,), "d": (256, 256), "e": (256, 256), "f": (512, 256)}
    (tmp_path / "base").mkdir()
    (tmp_path / "streamed").mkdir()
    base = _train(tmp_path / "base", "dist_muon", "adam", False, False, shapes=big)
    streamed = _train(tmp_path / "streamed", "dist_muon", "adam", False, True, chunk_mb=1, shapes=big)
    assert streamed["session"]["chunks"] >= 3, streamed["session"]
    assert streamed["results"] == base["results"] and streamed["on_gpu_in_forward"] == [[]] * STEPS
    _same(base["snapshot"], streamed["snapshot"])


@needs_muon
def test_the_host_buffer_is_sized_before_the_first_step_for_the_states_muon_makes(tmp_path, caplog):
    """The contracts predict Muon's momentum and Lion's moment: the buffer pinned before step 1 holds
    exactly what the steps make (each entry aligned), and is never grown."""
    with caplog.at_level(logging.INFO, logger="bridge_fgo"):
        out = _train(tmp_path, "dist_muon", "lion", False, True)
    assert out["error"] is None
    assert not [m for m in caplog.messages if "host buffer grows" in m]
    assert out["session"]["pinned_bytes"] == out["padded_bytes"]


# -- qk_clip (MuonClip) and the parameter norm, inside the streamed passes ------------------------------------

def _window(engine):
    """The storages of the engine's window slots (their data pointers)."""
    return {s.tensor.untyped_storage().data_ptr() for s in engine.transfers.window.slots if s.tensor is not None}


def _clipping_rig(run, qk_clip=True):
    """Bridge's train_step over `run`'s attention layers (support/attention.py; muon.Run over
    attention.megatron_module), their max logits over the threshold in some layers at each step
    (test_normqk.fires), with log_params_norm."""
    from test_normqk import fires

    logits = attention.logits(fires)

    def forward(model):
        logits(model)
        run.grads()

    cfg = harness.config_container(optimizer_cfg=run.config, mxfp8_copy=False,
                                   logger=types.SimpleNamespace(log_params_norm=True))
    cfg.model.qk_clip = qk_clip
    rig = harness.Rig(cfg=cfg, forward=forward)
    rig.model = [attention.Chunk(rig.model_config, rig.events, _attentions(run))]
    rig.optimizer = run.optimizer
    return rig


def _attentions(run):
    return [layer.self_attention for layer in run.model.module.module.decoder.layers]


def _fired(out) -> bool:
    """Every layer's clip scaled some heads at some step (its last eta < 1)."""
    return all(eta is not None and bool((eta < 1).any()) for eta in out["etas"])


def _clipped_steps(rig, run):
    """STEPS steps: train_step's results, the parameter norm Bridge's calc_params_l2_norm gives after each
    (patched, each master's taken in the update: none brought back for it, each read as its norm; the
    model's other parameters, whose masters another rank holds, as they are), and each layer's last eta."""
    from bridge_fgo.engine.tensors import masters
    from test_normqk import calc, fills, norm_inputs

    out = {"results": [], "norms": []}
    held = [m for part in run.parts() for m in masters(part)]
    for _ in range(STEPS):
        out["results"] += harness.run_steps(rig, steps=1)
        with fills() as filled, norm_inputs() as seen:
            out["norms"].append(calc(rig.model))
        if bridge_fgo.is_patched():
            read = [t for ts in seen for t in ts]
            assert not filled and sum(t.numel() == 1 for t in read) == len(held) > 0
    out["etas"] = [getattr(a, "qk_clip_balancing_eta", None) for a in _attentions(run)]
    return out


def _clipped(store_dir, name, scalar, offload, qk_clip=True, chunk_mb=1):
    """_clipped_steps with Muon on one rank; with them, for each clip_qk() (patched) what it read as its
    linear_qkv weight (its master in the window, or the model's weight) and whether that had a master too,
    and which masters and states were on the GPU outside the window and the host buffer."""
    from megatron.core.transformer.attention import SelfAttention
    from test_resume_dp import one_rank
    from test_streamed import engine_of

    with one_rank(store_dir):
        run = muon.Run(name, scalar, model=attention.megatron_module)
        rig = _clipping_rig(run, qk_clip)
        if offload:
            bridge_fgo.patch(offload="builtin", chunk_mb=chunk_mb)
        clips, real = [], SelfAttention.clip_qk
        weights = {id(a): a.linear_qkv.weight.untyped_storage().data_ptr() for a in _attentions(run)}

        @functools.wraps(real)  # (the engine reads which weights it clips from the code: the real one's)
        def clip_qk(self):
            if offload:
                engine, w = engine_of()[1], self.linear_qkv.weight
                window, host = _window(engine), engine.buffer.tensor.untyped_storage().data_ptr()
                ptr = w.untyped_storage().data_ptr()
                clips.append(("master in the window" if ptr in window else "weight" if ptr == weights[id(self)]
                              else "elsewhere", hasattr(w, "main_param"),
                              [n for n, t in run.states() if t.untyped_storage().nbytes()
                               and t.untyped_storage().data_ptr() not in window | {host}]))
            return real(self)

        try:
            with mock.patch.object(SelfAttention, "clip_qk", clip_qk):
                out = _clipped_steps(rig, run)
            bridge_fgo.synchronize()
            out.update(clips=clips, snapshot=run.snapshot(), on_gpu=on_gpu(run))
            if offload:
                out["chunks"] = len(engine_of()[1].chunks)
        finally:
            bridge_fgo.unpatch()
    return out


@needs_muon
@pytest.mark.parametrize("case", CASES[::2], ids=IDS[::2])
def test_qk_clip_and_the_parameter_norm_beside_muon_are_served_inside_the_passes(tmp_path, case):
    """MuonClip (qk_clip with Muon, the Kimi-K2 way) and log_params_norm under the streamed step, several 1 MB
    chunks: each layer's master clipped in the pass over it (nothing else of Muon's on the GPU then), its weight
    after the step, and the run bit-identical to the one without offload: losses, the max logit, the norms,
    parameters, masters, states."""
    name, scalar, _ = case
    runs = {}
    for key, offload, qk_clip in (("unclipped", False, False), ("base", False, True), ("streamed", True, True)):
        (tmp_path / key).mkdir()
        runs[key] = _clipped(tmp_path / key, name, scalar, offload, qk_clip)
    base, streamed = runs["base"], runs["streamed"]
    # the clip really happens: some heads' eta < 1, and the query/key masters differ from the run without it
    assert _fired(base)
    qkv = [k for k in base["snapshot"] if "master" in k and base["snapshot"][k].shape == (512, 256)]
    assert qkv and all(not torch.equal(base["snapshot"][k], runs["unclipped"]["snapshot"][k]) for k in qkv)
    assert streamed["results"] == base["results"] and streamed["norms"] == base["norms"]
    _same(base["snapshot"], streamed["snapshot"])
    assert streamed["chunks"] >= 3
    # each layer's master clipped in the pass over it (nothing else of Muon's on the GPU then), its weight after
    # the step, where Megatron-Core clips it; between steps nothing of Muon's on the GPU
    pass_then_step = [("master in the window", False, [])] * 2 + [("weight", False, [])] * 2
    assert streamed["clips"] == pass_then_step * STEPS and streamed["on_gpu"] == []


def test_megatron_cores_own_offloaders_refuse_muon_and_the_builtin_engine_names_what_it_serves():
    ns = types.SimpleNamespace
    cfg = ns(optimizer=ns(optimizer="dist_muon", use_distributed_optimizer=False), ddp=None, dist=None, model=None)
    builtin = generations.BUILTIN
    assert refusals.problems(cfg, [], [], builtin.who, served=builtin.optimizers) == []
    *_, found = refusals.problems(cfg, [], [], "Megatron-Core's offloader")  # Adam's distributed optimizer only
    assert found.startswith("cfg.optimizer.optimizer='dist_muon': Megatron-Core's offloader supports only 'adam'")
    assert "bridge_fgo's builtin engine moves those states: offload=builtin" in found
    cfg.optimizer.optimizer, cfg.optimizer.use_distributed_optimizer = "dist_soap", True
    (found,) = refusals.problems(cfg, [], [], builtin.who, served=builtin.optimizers)
    assert "supports only 'adam', 'muon', 'dist_muon'" in found and "does not move those states yet" in found
    # Adam without the distributed optimizer is refused as before
    cfg.optimizer.optimizer, cfg.optimizer.use_distributed_optimizer = "adam", False
    (found,) = refusals.problems(cfg, [], [], builtin.who, served=builtin.optimizers)
    assert found.startswith("cfg.optimizer.use_distributed_optimizer=False")


# -- two data-parallel ranks: each its own matrices (dist_muon) ---------------------------------------

# What each rank below imports before bridge_fgo acts (test_agree.run_ranks_with): its module, and Bridge's
# optimizer setup (loadable without TE), which builds the Run before the first patch() or engine.
PRELOAD = ("test_agree", "test_muon", "support.te_free_installed", "megatron.bridge.training.config",
           "megatron.bridge.training.optim")


def _rank(rank, world, port, out_dir, runs, clipping=False):
    """Each of `runs` ((offload, chunk_mb) pairs) in turn, in one gloo group: the same steps, a fresh optimizer
    each. `clipping`: _clipped_steps over attention layers (the layer-wise optimizer gives each rank whole
    matrices of the same numel)."""
    from support import te_free

    te_free.install()
    from test_agree import gloo_group
    from support import dp

    outs = []
    with gloo_group(rank, world, port), dp.gpu_on_cpu():
        dp.initialize()
        try:
            for offload, chunk_mb in runs:
                if clipping:
                    run = muon.Run("dist_muon", model=attention.megatron_module)
                    rig = _clipping_rig(run)
                else:
                    run = muon.Run("dist_muon", shapes=muon.EVEN)
                    rig = harness.Rig(cfg=harness.config_container(optimizer_cfg=run.config, mxfp8_copy=False),
                                      forward=lambda model, run=run: run.grads())
                    rig.optimizer = run.optimizer
                if offload:
                    bridge_fgo.patch(offload="builtin", chunk_mb=chunk_mb)
                out = _clipped_steps(rig, run) if clipping else {"results": harness.run_steps(rig, steps=STEPS)}
                bridge_fgo.synchronize()
                session = bridge_fgo.status().sessions if offload else []
                bridge_fgo.unpatch()
                out.update(snapshot=run.snapshot(), sessions=session, owned=run.owned())
                outs.append(out)
        finally:
            dp.destroy()
    torch.save(outs, os.path.join(out_dir, f"rank{rank}.pt"))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        f.write("{}")


def _two_ranks(tmp_path, chunk_mbs, clipping=False):
    """Each rank's record without offload, then with it at each of `chunk_mbs`, from one pair of processes
    (their start-up is most of a run's time): {None: without, chunk_mb: with}."""
    from test_agree import run_ranks_with

    runs = [(False, 0)] + [(True, c) for c in chunk_mbs]
    run_ranks_with(_rank, tmp_path, runs, clipping, world=2, preload=PRELOAD)
    per_rank = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    got = {None if not offload else c: [outs[i] for outs in per_rank] for i, (offload, c) in enumerate(runs)}
    for chunk_mb in chunk_mbs:
        for base, off in zip(got[None], got[chunk_mb]):
            assert off["results"] == base["results"]
            _same(base["snapshot"], off["snapshot"])
            (s,) = off["sessions"]
            assert s["calls"]["offload"] == STEPS and s["chunk_mb"] == chunk_mb
        # the layer-wise optimizer splits the matrices between the ranks: each moves its own
        owned = [set(r["owned"]) for r in got[chunk_mb]]
        assert owned[0] and owned[1] and not owned[0] & owned[1]
    return got, owned


@needs_muon
def test_two_data_parallel_ranks_each_move_their_own_matrices_bit_identically(tmp_path):
    """The one window (chunk_mb=0) and the streamed step (chunk_mb=1), each against the run without offload."""
    _, owned = _two_ranks(tmp_path, [0, 1])
    assert owned[0] | owned[1] == set(muon.EVEN)


@needs_muon
def test_two_data_parallel_ranks_clip_and_take_the_norm_bit_identically(tmp_path):
    """qk_clip and log_params_norm under the streamed step over two ranks of dist_muon, each the owner of one
    layer's query/key/value matrix: each clips its own master in its pass, and both weights after the step, as
    the layer-wise optimizer's all-gather leaves them, as without offload (a weight clipped in the pass would
    reach the other rank clipped, and be clipped there again)."""
    got, owned = _two_ranks(tmp_path, [1], clipping=True)
    assert all(sum(".linear_qkv.weight" in n for n in o) == 1 for o in owned)
    for base, off in zip(got[None], got[1]):
        assert _fired(base) and off["norms"] == base["norms"]


# -- a memory budget on two tensor-parallel ranks, Newton-Schulz gathering each matrix over them ----------------

# d the largest matrix: the budget keeps it first where it fits, out of its place in the order
TP_SHAPES = {"a": (64,), "b": (8, 8), "c": (64,), "d": (16, 8), "e": (8, 8), "f": (8, 8)}
TP_ROOM = (1100, 600)  # bytes under the budget each rank's own memory leaves: d's states fit, or b's only


def _tp_rank(rank, world, port, out_dir):
    """Muon's steps without offload, then under the streamed step with a budget, each rank measuring its own
    memory (TP_ROOM): the order Newton-Schulz saw the matrices in, what stayed resident, the states."""
    from support import te_free

    te_free.install()
    try:
        from megatron.core.optimizer import emerging_optimizers as mcore_muon
    except ImportError:  # megatron-core 0.17 keeps TensorParallelMuon in optimizer/muon.py
        from megatron.core.optimizer import muon as mcore_muon
    from support import dp
    from test_agree import gloo_group
    from test_streamed import measured

    seen = []
    orthogonalize = mcore_muon.TensorParallelMuon.orthogonalize

    def recorded(self, p, grad, **kwargs):
        seen.append(tuple(p.shape))  # (each rank's shard: d's is twice the others')
        return orthogonalize(self, p, grad, **kwargs)

    mcore_muon.TensorParallelMuon.orthogonalize = recorded
    out = {}
    with gloo_group(rank, world, port), dp.gpu_on_cpu():
        dp.initialize(tp=world)
        try:
            for offload in (False, True):
                run, engine = muon.Run(shapes=TP_SHAPES, tp=True), None
                if offload:
                    engine = _engine(run, True, chunk=4096, budget=2**30)
                    peak = 2**30 - firststep.margin(2**30) - TP_ROOM[rank]
                    engine.probe = measured(before=0, backward=peak, base=1024, step=peak)
                    engine.prepare()
                del seen[:]
                for _ in range(STEPS):
                    _step(run, engine)
                out[offload] = {"order": list(seen), "snapshot": run.snapshot(),
                                "resident": engine.resident_bytes if engine else 0}
                if engine is not None:
                    engine.close()
        finally:
            dp.destroy()
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        f.write("{}")


@needs_muon
def test_tensor_parallel_ranks_keeping_other_matrices_resident_step_them_in_one_order(tmp_path):
    """gpu_budget_gib: each rank keeps resident what its own memory allows, so tensor-parallel peers keep other
    matrices (here d on rank 0, b on rank 1). Their Newton-Schulz gathers each matrix over the peers inside
    step(): every rank steps the matrices in the optimizer's order, whatever stays resident, and the run is
    bit-identical to the one without offload (stepped out of order, peers gather different matrices: gloo
    aborts on the sizes, same-shaped matrices would be mixed silently)."""
    from test_agree import run_ranks_with

    run_ranks_with(_tp_rank, tmp_path, world=2, preload=PRELOAD)
    got = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert [r[True]["resident"] for r in got] == [1024, 512]  # d's master and momentum; b's
    for r in got:
        assert r[True]["order"] == r[False]["order"] == got[0][False]["order"]
        _same(r[False]["snapshot"], r[True]["snapshot"])


def test_the_streamed_step_refuses_nothing_beside_muon_that_it_serves_beside_adam():
    """qk_clip and log_params_norm are served inside the passes, a budget with tensor parallelism in the
    optimizer's order on every rank: refusals.streamed names none of them beside Muon."""
    ns = types.SimpleNamespace
    cfg = ns(model=ns(tensor_model_parallel_size=2, qk_clip=True), logger=ns(log_params_norm=True))
    muon_class = type("TensorParallelMuon", (), {"__module__": "megatron.core.optimizer.emerging_optimizers"})
    assert refusals.streamed(cfg, [muon_class()], ns(gpu_budget_gib=1.0)) == []


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
    """One optimizer step with the engine's call sites where the patched train_step has them."""
    if engine is not None:
        engine.offload()
        engine.release()
        if seen is not None:
            seen.append(on_gpu(run, engine))
    run.grads()
    if engine is not None:
        engine.reload()
        engine.wait_reload()
    run.optimizer.step()
    if engine is not None:
        engine.settle()
        engine.synchronize()


def _engine(run, streamed, chunk=None, budget=None):
    from bridge_fgo.engine.onewindow import OneWindowEngine
    from bridge_fgo.engine.streamed import StreamedEngine

    return StreamedEngine(run.parts(), chunk or CHUNK, budget) if streamed else OneWindowEngine(run.parts())


CHUNK = 300  # bytes: several chunks, a matrix's states alone in some


@needs_muon
@pytest.mark.parametrize("streamed", [False, True], ids=["one-window", "streamed"])
@pytest.mark.parametrize("fmt", ["dp_reshardable", "fully_reshardable"])
def test_a_resume_steps_bit_identically(tmp_path, fmt, streamed):
    """Trained 2 steps, saved (the layer-wise optimizer's own sharded state dict), resumed into another
    model and optimizer whose engine was prepared before the load (as the patched load_checkpoint does),
    2 more steps: the same as the run never interrupted and as the resume without offload; what the
    resumed steps read was off the GPU in forward-backward (the streamed step: loaded into its host buffer)."""
    from test_resume_dp import one_rank

    from test_resume_dp import _sharded_tensors

    ckpt, seen, into = str(tmp_path / "ckpt"), [], {}
    with one_rank(tmp_path) as gpu:
        first = muon.Run()
        engine = _engine(first, streamed)
        engine.prepare()
        for i in range(4):
            _step(first, engine)
            if i == 1:
                first.save(ckpt, fmt)
        uninterrupted = first.snapshot()
        engine.close()
        resumed = {}
        for offload in (False, True):
            run = muon.Run(seed=7)  # other weights: the load must replace them all
            engine = _engine(run, streamed) if offload else None
            # planned and pinned before the load, as the patched load_checkpoint has it (support/dp.py's load
            # prepares the engine it is given, and tells it after)
            if engine is not None and not streamed:
                engine.prepare()
            def filled(loading, engine=engine):
                """Where torch_dist is about to write each master and state: in the host buffer, or not."""
                if engine is not None and streamed:
                    low = engine.buffer.tensor.data_ptr()
                    high = low + engine.buffer.tensor.numel()
                    into[offload] = [(t.key, low <= t.data.data_ptr() < high) for t, _ in _sharded_tensors(loading["optimizer"])
                                     if t.data is not None and t.data.numel()]

            run.load(ckpt, fmt, engine if streamed else None, gpu, filled)
            if streamed and engine is not None:
                seen.append(on_gpu(run, engine))  # loaded into the host buffer

            run.generation = 2
            for _ in range(2):
                _step(run, engine, seen)
            resumed[offload] = run.snapshot()
            if engine is not None:
                assert not streamed or len(engine.chunks) > 2
                engine.close()
    _same(uninterrupted, resumed[False])
    _same(resumed[False], resumed[True])
    assert seen == [[]] * (3 if streamed else 2)
    if streamed:
        # torch_dist writes every master and every state straight into the pinned buffer: Megatron-Core's
        # init_state_fn made the states (Muon's momenta, Adam's moments) one parameter at a time, each taken
        # into its host view before the next
        keys = {key.split(".")[-2] for key, _ in into[True]}
        assert {"fp32_param", "momentum_buffer", "exp_avg", "exp_avg_sq"} <= keys, keys
        assert all(inside for _, inside in into[True]), into


@needs_muon
def test_the_host_memory_check_counts_the_states_a_load_makes_beside_the_buffer(tmp_path, monkeypatch):
    """Under the streamed step a load makes the states of Muon's parts one parameter at a time (pageable) and
    takes each into the pinned buffer (the resume above): the check before anything is pinned counts the
    largest parameter's. The one window loads onto the GPU."""
    from bridge_fgo import hostmem

    checked = []
    real = hostmem.check_fits
    monkeypatch.setattr(hostmem, "check_fits", lambda *a, **k: checked.append(k) or real(*a, **k))
    for chunk_mb in (1, 0):
        (tmp_path / str(chunk_mb)).mkdir()
        _train(tmp_path / str(chunk_mb), "dist_muon", "adam", False, True, chunk_mb=chunk_mb)
    # c (150,): Adam's two fp32 moments, 1200 bytes (e (10, 15): Muon's momentum, 600)
    assert [k["load_per_rank"] for k in checked] == [1200, 0]


@needs_muon
def test_under_the_streamed_step_muons_masters_are_made_on_the_host_one_at_a_time(tmp_path, caplog):
    """Megatron-Core's Float16OptimizerWithFloat16Params makes each whole master on the GPU: patched, each goes
    to the host as soon as it is made (construction.py), and the run then steps bit-identically."""
    from bridge_fgo.engine import construction, tensors
    from test_resume_dp import one_rank

    with one_rank(tmp_path):
        base = muon.Run()
        bridge_fgo.patch(offload="builtin", chunk_mb=1)
        import megatron.bridge.training.train  # noqa: F401  (Bridge's pretrain imports it before its setup: patched)
        try:
            assert bridge_fgo.status().outcome == "patched"
            with caplog.at_level(logging.INFO, logger="bridge_fgo"):
                run = muon.Run()
            masters = [m for part in run.parts() for m in tensors.masters(part)]
            assert masters and all(construction.is_staged(m) for m in masters)
            assert not any(construction.is_staged(m) for part in base.parts() for m in tensors.masters(part))
            lines = [m for m in caplog.messages if "whole master(s)" in m]  # one per optimizer of the layer-wise chain
            made = [re.search(r"fp32 masters made on the host: (\d+) whole master\(s\)", m) for m in lines]
            assert len(lines) == len(run.parts()) and sum(int(m.group(1)) for m in made) == len(masters), lines
            for r in (base, run):
                rig = harness.Rig(cfg=harness.config_container(optimizer_cfg=r.config, mxfp8_copy=False),
                                  forward=lambda model, r=r: r.grads())
                rig.optimizer = r.optimizer
                harness.run_steps(rig, steps=2)
            bridge_fgo.synchronize()
            _same(base.snapshot(), run.snapshot())
        finally:
            bridge_fgo.unpatch()
