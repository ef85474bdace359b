"""The parameter norm Bridge logs (log_params_norm) and qk_clip, served by the streamed step
(bridge_fgo/engine/streamed/norms.py, qkclip.py), against the same runs without offload.

The norm is Bridge's own calc_params_l2_norm, with Megatron-Core's local multi_tensor_l2norm (no TE, no
apex here) and Megatron-Core's process groups over one gloo rank; its device="cuda" buffers are made on
the CPU (harness.cuda_buffers_on_cpu). clip_qk is Megatron-Core's own, over real SelfAttention modules
(support/attention.py) whose max logits a stand-in forward sets, as TE's attention does. Released
Megatron-Core cannot clip the distributed optimizer's flat masters (qkclip.py): its error is checked to
come unchanged, and the clipping itself is compared with a SelfAttention that can
(attention.flat_master_attention).
"""
import contextlib
import types
from unittest import mock

import pytest
import torch

import bridge_fgo
from bridge_fgo.engine.streamed import StreamedEngine
from bridge_fgo.engine.streamed import transfers as transfers_mod
from support import attention, harness
from test_resume_fix import checkpoint_load, optimizer as loadable
from test_resume_host import megatron_core_for  # noqa: F401 - a fixture
from test_streamed import BIG, OPTIMIZERS, assert_same, engine_of, make, rig_snapshot, snapshot, step

KINDS = ["torch-foreach-default", "apex", "te", "te-precision-aware-bf16"]
CONFIG = types.SimpleNamespace(bf16=True)  # the model config calc_params_l2_norm reads


@pytest.fixture(autouse=True)
def groups():
    with harness.model_parallel():
        yield


@pytest.fixture(autouse=True, scope="module")
def bridge_imported():
    """Bridge's train module imported before any test holds an engine: importing it the first time keeps the
    importer's frames for good (pulp's copt_api, imported on the way, stores the TypeError of a failed load with
    its traceback), so a first import inside calc() would keep that test's engine and its pinned buffer alive, and
    a later test of the same process that counts pinned bytes (test_async_save.py) would find them."""
    import megatron.bridge.training.train  # noqa: F401


class Params(torch.nn.Module):
    """A model chunk as calc_params_l2_norm reads it (its parameters) over the harness optimizer's bf16
    model params, which carry main_param as Megatron-Core sets it."""

    def __init__(self, opt):
        super().__init__()
        self.held = list(opt.model_float16_groups[0])

    def parameters(self, recurse=True):
        return iter(self.held)


def calc(model, config=CONFIG):
    """Bridge's calc_params_l2_norm as train() calls it (through the patch, when patched)."""
    import megatron.bridge.training.train as train_module

    with harness.cuda_buffers_on_cpu():
        return train_module.calc_params_l2_norm(model, config)


@contextlib.contextmanager
def norm_inputs():
    """What Megatron-Core's multi_tensor_l2norm is given, list by list."""
    from megatron.bridge.training.utils import train_utils

    seen, real = [], train_utils.multi_tensor_applier

    def spy(op, flag, lists, *args):
        seen.append([t for ts in lists for t in ts])
        return real(op, flag, lists, *args)

    with mock.patch.object(train_utils, "multi_tensor_applier", spy):
        yield seen


@contextlib.contextmanager
def fills():
    """The sizes of what each on-demand fill brought to the GPU (Transfers.on_device without write-back)."""
    sizes, real = [], transfers_mod.Transfers.on_device

    def spy(self, entries, **kw):
        if not kw.get("write_back"):
            sizes.append([e.nbytes for e in entries])
        return real(self, entries, **kw)

    with mock.patch.object(transfers_mod.Transfers, "on_device", spy):
        yield sizes


def engine_with_norms(opt, chunk_bytes, in_update=True, budget=None):
    engine = StreamedEngine([opt], chunk_bytes, budget, norms_in_update=in_update)
    engine.prepare()
    return engine


def presented_norm(engine, opt):
    with engine.norms.presented([Params(opt)]):
        return calc([Params(opt)])


# -- the norm, in the engine -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("chunk_bytes", [1, 2000, 10**9])  # one parameter per chunk, a few, one chunk
def test_norm_taken_in_the_update_is_bit_identical_and_waits_for_nothing(kind, chunk_bytes):
    base, opt = make(**OPTIMIZERS[kind]), make(**OPTIMIZERS[kind])
    engine = engine_with_norms(opt, chunk_bytes)
    masters = [p.main_param for p in Params(opt).parameters() if p.main_param is not None]
    assert len(masters) == (0 if OPTIMIZERS[kind].get("precision_aware") else len(opt.model_float16_groups[0]))
    with fills() as filled:
        assert presented_norm(engine, opt) == calc([Params(base)])  # before any update: taken on demand
    assert bool(filled) == bool(masters)
    for _ in range(3):
        step(base)
        step(opt, engine, wait=False)
        assert engine.copies.pending() > 0  # the last device-to-host copies are in flight...
        with norm_inputs() as seen, fills() as filled:
            got = presented_norm(engine, opt)
        assert got == calc([Params(base)])
        assert engine.copies.pending() > 0 and not filled  # ...and the norm did not wait for them
        # Megatron-Core read no master: each one as a 1-element tensor, its norm
        read = [t for ts in seen for t in ts]
        assert all(t.numel() == 1 for t in read) and sum(t.numel() for t in read) >= len(masters)
        assert all(p.main_param is m for p, m in zip(Params(opt).parameters(), masters))  # given back
    engine.synchronize()
    assert_same(snapshot(base), snapshot(opt))


@pytest.mark.parametrize("kind", ["torch-foreach-default", "te"])
def test_norms_after_writes_outside_the_update_are_taken_on_demand_a_chunk_at_a_time(kind):
    """reload_model_params (Megatron-Core's, through the engine's hook) writes the masters between
    updates; a skipped step writes nothing; without log_params_norm nothing is taken in the update."""
    chunk_bytes = 200  # the masters: 556 bytes
    base, opt = make(**OPTIMIZERS[kind]), make(**OPTIMIZERS[kind])
    engine = engine_with_norms(opt, chunk_bytes)
    for _ in range(2):
        step(base)
        step(opt, engine, wait=False)
    for run in (base, opt):
        run.buffers[0].param_data.mul_(0.5)
        run.reload_model_params()
    with fills() as filled:
        assert presented_norm(engine, opt) == calc([Params(base)])
    largest = max(e.nbytes for e in engine.plan.streamed_masters().values())
    assert len(filled) > 1 and all(sum(f) <= max(chunk_bytes, largest) for f in filled)
    with fills() as filled:
        assert presented_norm(engine, opt) == calc([Params(base)])
    assert not filled  # kept until the next write
    engine.offload(), engine.release(), engine.reload(), engine.settle()  # a skipped step (inf/nan)
    with fills() as filled:
        assert presented_norm(engine, opt) == calc([Params(base)]) and not filled
    engine.norms.in_update = False  # log_params_norm off: nothing in the update, all on demand
    step(base)
    step(opt, engine, wait=False)
    with fills() as filled:
        assert presented_norm(engine, opt) == calc([Params(base)])
    assert filled


@pytest.mark.parametrize("case", ["apex", "te"])
def test_norms_after_a_checkpoint_load_are_the_loaded_masters(megatron_core_for, case):  # noqa: F811
    """Megatron-Core's load path (tests/test_resume_host.py) into an engine that has stepped: what it
    wrote into the host masters is what the norm reads next."""
    megatron_core_for(case)
    metadata = {"distrib_optim_sharding_type": "dp_reshardable"}
    source = loadable(**OPTIMIZERS[case], seed=1)
    for _ in range(2):
        step(source)
    saved = source.sharded_state_dict({}, False, metadata=metadata)
    opt = loadable(**OPTIMIZERS[case])
    engine = engine_with_norms(opt, 600)
    step(opt, engine)
    before = presented_norm(engine, opt)
    opt.load_state_dict(checkpoint_load(saved, opt.sharded_state_dict({}, True, metadata=metadata)))
    engine.after_load()
    with fills() as filled:
        assert presented_norm(engine, opt) == calc([Params(source)]) != before
    assert filled


# -- through Bridge's real train_step and calc_params_l2_norm, patched -----------------------------------------
def rig(log_norm=True, qk=False, **kw):
    cfg = harness.config_container(mxfp8_copy=False, logger=types.SimpleNamespace(log_params_norm=log_norm))
    cfg.model.qk_clip = qk
    return harness.Rig(cfg=cfg, with_tensors=True, **kw)


def params_norm(r):
    return calc(r.model if isinstance(r.model[0], attention.Chunk) else [Params(r.dist_optimizer)], r.model_config)


@pytest.mark.parametrize("kind", ["torch-foreach-default", "apex", "te"])
@pytest.mark.parametrize("budget", [None, 4 * 2**20 / 2**30])  # CPU: 4 MiB of room
def test_train_logs_the_same_norm_through_the_patch(kind, budget):
    steps = [(True, 1.0, 0), (False, None, None), (True, 1.0, 0), (True, 1.0, 0)]  # the second one skipped
    base = rig(shapes=BIG, **OPTIMIZERS[kind])
    want = []
    for result in steps:
        base.optimizer.step_result = result
        harness.run_steps(base, steps=1)
        want.append(params_norm(base))
    bridge_fgo.patch(offload="builtin", chunk_mb=1, gpu_budget_gib=budget)
    r = rig(shapes=BIG, **OPTIMIZERS[kind])
    got = []
    for result in steps:
        r.optimizer.step_result = result
        harness.run_steps(r, steps=1)
        with fills() as filled:
            got.append(params_norm(r))
        assert not filled  # taken in the update (the skipped step kept them)
    assert got == want
    _, engine = engine_of()
    assert engine.norms.in_update and len(engine.chunks) > 1 and bool(engine.resident_bytes) == bool(budget)
    bridge_fgo.synchronize()
    assert_same(rig_snapshot(base), rig_snapshot(r))


# -- qk_clip ---------------------------------------------------------------------------------------------------
def fires(n, layer):
    """Per-head max logits: over attention.THRESHOLD in some layers at some steps, never in others."""
    if (n + layer) % 2:
        return [1.0, 2.0, 3.0, 4.0 + n]
    return [3.0 + n, attention.THRESHOLD + 2.0 + layer, 1.0, 30.0 - n]


def qk_rig(kind, attn=None, pattern=fires, **kw):
    return rig(qk=True, model=attention.model(attention=attn), forward=attention.logits(pattern),
               **OPTIMIZERS[kind], **kw)


def run(r, results):
    """One train_step per step result; what each returned as the max attention logit, and the norm."""
    out = []
    for result in results:
        r.optimizer.step_result = result
        (returned,) = harness.run_steps(r, steps=1, reruns=r.reruns)
        out.append((returned[-1], params_norm(r)))
    return out


@contextlib.contextmanager
def clip_places(cls):
    """For each attention's clip_qk, what it read as linear_qkv's weight: "whole" (the weight with its master,
    both scaled, as Megatron-Core clips without offload), "pass" (the master in the update's window, standing
    in for the weight), "weight" (the weight alone: its master was clipped in a pass)."""
    places, real = [], cls.clip_qk

    def spy(self):
        w = self.linear_qkv.weight
        slots = engine_of()[1].transfers.window.slots if bridge_fgo.is_patched() else []
        ptr = w.data_ptr()
        in_window = any(s.tensor is not None and s.tensor.data_ptr() <= ptr < s.tensor.data_ptr() + s.nbytes
                        for s in slots)
        places.append("whole" if hasattr(w, "main_param") else "pass" if in_window
                      else "weight" if w.dtype == torch.bfloat16 else "a master outside the window")
        return real(self)

    with mock.patch.object(cls, "clip_qk", spy):
        yield places


SCENARIOS = {
    "steps": dict(chunk_mb=1, results=[(True, 1.0, 0)] * 3),
    "one-chunk": dict(chunk_mb=64, results=[(True, 1.0, 0)] * 3),
    "skipped-step": dict(chunk_mb=1, results=[(True, 1.0, 0), (False, None, None), (True, 1.0, 0)]),
    "budget": dict(chunk_mb=1, results=[(True, 1.0, 0)] * 3, gpu_budget_gib=2 * 2**20 / 2**30),
    "rerun": dict(chunk_mb=1, results=[(True, 1.0, 0)] * 2, reruns=2),
}


@pytest.mark.parametrize("kind", ["torch-foreach-default", "apex", "te"])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_qk_clip_in_the_update_is_bit_identical(kind, scenario):
    s = SCENARIOS[scenario]
    cls = attention.flat_master_attention()
    base = qk_rig(kind, cls)
    base.reruns = s.get("reruns", 1)
    with clip_places(cls) as places:
        want = run(base, s["results"])
    assert set(places) == {"whole"}
    bridge_fgo.patch(offload="builtin", chunk_mb=s["chunk_mb"], gpu_budget_gib=s.get("gpu_budget_gib"))
    r = qk_rig(kind, cls)
    r.reruns = base.reruns
    with clip_places(cls) as places:
        got = run(r, s["results"])
    assert got == want  # the max logit Bridge logs, the parameter norm after the clip
    assert all(hasattr(a, "qk_clip_balancing_eta") for a in base.model[0].attentions())  # clips did fire
    assert all(a.core_attention.current_max_attn_logits is None for a in r.model[0].attentions())
    bridge_fgo.synchronize()
    assert_same(rig_snapshot(base), rig_snapshot(r))
    for a, b in zip(base.model[0].attentions(), r.model[0].attentions()):
        assert torch.equal(a.linear_qkv.weight, b.linear_qkv.weight)
    _, engine = engine_of()
    # every layer once per step: whole, or its master in its pass and its weight after the step
    assert places.count("whole") + places.count("pass") == 2 * len(s["results"])
    assert places.count("pass") == places.count("weight")
    each = ["pass", "pass", "weight", "weight"]
    if scenario in ("steps", "one-chunk", "rerun"):
        assert places == each * len(s["results"])
    elif scenario == "budget":  # the layer whose master stays on the GPU after the update: whole, in place
        assert engine.resident_bytes and "whole" in places and "pass" in places
    else:  # the skipped step's layers, after it, their masters brought to the GPU and back
        assert places == each + ["whole", "whole"] + each


@pytest.mark.parametrize("kind", ["torch-foreach-default", "te-precision-aware-bf16"])
def test_where_megatron_core_cannot_clip_the_same_error_comes_from_clip_qk(kind):
    """Released Megatron-Core cannot write the distributed optimizer's flat master (RuntimeError, part
    of it already scaled), nor a master that is None (the precision-aware optimizer: AttributeError):
    the same exception, from Bridge's clip_qk call, after a complete step, as without offload."""
    def once(n, layer):  # the first step stays under the threshold; in the second, layer 1 fires
        return [1.0, 2.0, 3.0, 4.0] if n == 0 or layer == 0 else [1.0, attention.THRESHOLD + 5.0, 1.0, 1.0]

    def failing(r):
        harness.run_steps(r, steps=1)
        with pytest.raises((RuntimeError, AttributeError)) as err:
            harness.run_steps(r, steps=1)
        return err

    base = qk_rig(kind, pattern=once)
    want = failing(base)
    bridge_fgo.patch(offload="builtin", chunk_mb=1)
    r = qk_rig(kind, pattern=once)
    got = failing(r)
    assert type(got.value) is type(want.value) and str(got.value) == str(want.value)
    assert any(f.name == "clip_qk" for f in got.traceback)
    _, engine = engine_of()
    assert engine.torn is None and engine.steps_streamed == 2  # the step completed, as Megatron-Core's
    bridge_fgo.synchronize()
    assert_same(rig_snapshot(base), rig_snapshot(r))  # the master Megatron-Core scaled before failing too
