"""A resume loads into host memory: with the streamed step prepared before the load (as the patched
load_checkpoint does), Megatron-Core's real load path (DistributedOptimizer.sharded_state_dict with
is_loading=True, which first runs load_state_dict(state_dict()); torch_dist filling the sharded
tensors in place; load_state_dict with the parameter state) finds every optimizer state in its host
view, creates nothing, and writes the checkpoint's values straight into the pinned buffer. The
resumed optimizer then steps bit-identically to the same resume without offload.

torch AdamW needs scripts/resume_fix.py for any resume (a Megatron-Core defect, with or without
offload). For TE's and apex's FusedAdam (the stand-ins) Megatron-Core's module flags say what they
say when TE or apex is installed.
"""
import copy
import os
import re
import sys
import time

import pytest
from packaging.version import Version
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.optimizer import distrib_optimizer

from bridge_fgo.engine import contracts, tensors
from conftest import MCORE
from bridge_fgo.engine.streamed import StreamedEngine
from test_resume_fix import FORMAT, checkpoint_load, optimizer
from test_streamed import OPTIMIZERS as CASES, assert_same, make, snapshot, step
from support import fused_adam

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import resume_fix  # noqa: E402

@pytest.fixture
def megatron_core_for(monkeypatch):
    """Megatron-Core's module flags as they are with this optimizer installed, and the resume fix for
    torch AdamW (removed afterwards)."""
    def setup(kind):
        if kind == "torch":
            resume_fix.install()
        else:
            monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", True)
            monkeypatch.setattr(distrib_optimizer, "USING_TE_OPTIMIZER", kind == "te", raising=False)
            monkeypatch.setattr(distrib_optimizer, "USING_APEX_OPTIMIZER", kind == "apex", raising=False)

    yield setup
    resume_fix.uninstall()


def skip_old_precision_aware_load(case):
    if CASES.get(case, {}).get("precision_aware") and Version(MCORE) < Version("0.17"):
        pytest.skip(f"megatron-core {MCORE} passes dp_reshardable's non-tensor 'padding' entry to TE's "
                    "set_scaled_state: a precision-aware load fails there with or without offload")


def fresh(case):
    return optimizer(**({} if case == "torch" else CASES[case]))


def sharded_tensors(tree):
    if isinstance(tree, dict):
        tree = list(tree.values())
    if isinstance(tree, (list, tuple)):
        return [t for x in tree for t in sharded_tensors(x)]
    return [tree] if isinstance(tree, ShardedTensor) else []


def host_ranges(engine):
    buf = engine.buffer.tensor
    return buf.data_ptr(), buf.data_ptr() + buf.numel()


@pytest.mark.parametrize("case", ["torch", "apex", "te", "te-precision-aware-bf16"])
@pytest.mark.parametrize("fmt", ["dp_reshardable"])
def test_resume_writes_into_the_host_buffer_and_continues_bit_identically(megatron_core_for, case, fmt):
    skip_old_precision_aware_load(case)
    megatron_core_for("torch" if case == "torch" else case.split("-")[0])
    metadata = {"distrib_optim_sharding_type": fmt}
    source = fresh(case)
    source_engine = StreamedEngine([source], 2000)
    source_engine.prepare()
    for _ in range(2):
        step(source, source_engine)
    saved = copy.deepcopy(source.sharded_state_dict({}, False, metadata=metadata))  # saved under offload

    def resume(with_offload):
        opt = fresh(case)
        engine = None
        if not with_offload:  # Megatron-Core would create them with torch.empty on the GPU; here on CPU
            inner = opt.optimizer
            for group in inner.param_groups:
                for p in group["params"]:
                    contracts.of(inner).create(inner, p, group, p.device)
        if with_offload:
            engine = StreamedEngine([opt], 2000)
            engine.prepare()  # what the patched load_checkpoint does before Megatron-Core's load
            before = {id(e): e.host.data_ptr() for p in engine.parts for e in p.entries()}
        loading = opt.sharded_state_dict({}, True, metadata=metadata)
        if with_offload and not CASES.get(case, {}).get("precision_aware"):
            # (precision-aware: Megatron-Core loads into unscaled fp32 copies that TE's get_unscaled_state
            # makes where the states are, the host, then set_scaled_state writes them into the host views)
            low, high = host_ranges(engine)
            # every tensor torch_dist fills is a host view of the pinned buffer (the load writes there),
            # but for the fp32 parameters' own shards, which are the model's (they never move)
            model = {b.param_data.untyped_storage().data_ptr() for b in opt.buffers}
            filled = [t.data for t in sharded_tensors(loading) if t.data.numel()]
            assert all(low <= t.data_ptr() < high or t.untyped_storage().data_ptr() in model for t in filled)
            assert sum(low <= t.data_ptr() < high for t in filled) == sum(len(p.entries()) for p in engine.parts)
        opt.load_state_dict(checkpoint_load(saved, loading))
        opt.buffers[0].param_data.copy_(source.buffers[0].param_data)  # the model's own weights load apart
        opt._gen = source._gen
        if with_offload:
            engine.after_load()
            assert engine.on_host()
            assert {id(e): e.host.data_ptr() for p in engine.parts for e in p.entries()} == before
        return opt, engine

    plain, _ = resume(False)
    offloaded, engine = resume(True)
    for _ in range(3):
        step(plain)
        step(offloaded, engine)
        assert_same(snapshot(plain), snapshot(offloaded))


@pytest.mark.parametrize("case", ["apex", "te", "te-precision-aware-bf16"])
def test_states_exist_in_their_host_views_before_the_first_step(case):
    opt = make(**CASES[case])
    engine = StreamedEngine([opt], 2000)
    engine.prepare()
    assert engine.on_host()
    assert all(len(opt.optimizer.state[p]) for g in opt.optimizer.param_groups for p in g["params"])
    low, high = host_ranges(engine)
    for part in engine.parts:
        for e in part.entries():
            assert low <= part.bindings.get(e).data_ptr() < high
    assert engine.offload() == engine.bytes and not engine.transfers.adopted  # the first offload moves nothing


def test_torch_adamw_states_are_left_to_its_first_step_or_a_load():
    """Megatron-Core loads torch AdamW's per-parameter step only into an optimizer that has not
    stepped, failing loudly otherwise (scripts/resume_fix.py): the engine creates nothing for it."""
    from megatron.core.optimizer import distrib_optimizer as m

    opt = optimizer()
    StreamedEngine([opt], 2000).prepare()
    assert len(opt.optimizer.state) == 0
    if not m.HAVE_APEX_OR_TE:
        with pytest.raises(AssertionError):
            opt.sharded_state_dict({}, True, metadata=FORMAT)  # as without offload


@pytest.mark.parametrize("case", ["torch", "apex", "te", "te-precision-aware-bf16", "te-precision-aware-remainders"])
def test_created_states_equal_the_optimizers_own_first_step(case):
    kw = {} if case == "torch" else CASES[case]
    base, opt = make(**kw), make(**kw)
    engine = StreamedEngine([opt], 2000)
    engine.prepare()
    for _ in range(2):
        step(base)
        step(opt, engine)
        assert_same(snapshot(base), snapshot(opt))


@pytest.mark.parametrize("after", [True, False], ids=["states-after-the-load", "states-before-the-load"])
@pytest.mark.parametrize("case", ["te-precision-aware-bf16", "te-precision-aware-remainders", "te", "apex"])
def test_a_model_only_load_leaves_no_stale_state(case, after):
    """Finetuning from a checkpoint of the model only: the load writes the model's weights, then
    Megatron-Core's reload_model_params copies them into its masters (host views); with TE holding the
    masters it does nothing, and TE makes master_param from the parameter: the engine creates such
    states after the load, from the loaded weights, as the optimizer's first step would."""
    kw = CASES[case]
    base, opt = make(**kw), make(**kw)
    engine = StreamedEngine([opt], 2000)
    # what the load call site says before a model-only load; when it cannot know (a release or HF
    # checkpoint), Megatron-Core's reload_model_params, which Bridge then calls, remakes them
    engine.states_after_load = after
    engine.prepare()
    loaded = make(seed=7, **kw).buffers[0].param_data  # the checkpoint's weights
    for o in (base, opt):
        o.buffers[0].param_data.copy_(loaded)
        o.reload_model_params()  # Megatron-Core's own, as Bridge calls it after a model-only load
    engine.after_load()
    assert engine.on_host()
    for _ in range(2):
        step(base)
        step(opt, engine)
        assert_same(snapshot(base), snapshot(opt))


@pytest.mark.parametrize("load_optim", [True, False])
def test_the_load_call_site_prepares_the_engine_before_bridges_load(train_module, load_optim, caplog_fgo,
                                                                    monkeypatch, tmp_path):
    """Bridge's load_checkpoint as the patch wraps it: the session is decided and its engine prepared
    before the load runs (states in their host views, or, for a load of the model only, made after
    it), and what the load bound elsewhere is taken back into the host views when it returns."""
    import types

    import torch
    import torch.distributed.checkpoint as dcp

    import bridge_fgo
    from bridge_fgo.instrument import targets
    from test_streamed import rig

    from bridge_fgo.engine.streamed import StreamedEngine

    bridge_fgo.patch(offload="builtin", chunk_mb=1)
    r = rig(optimizer="te")
    r.cfg.checkpoint = types.SimpleNamespace(load_optim=load_optim, finetune=False, save=None, load="ck")
    prepare = StreamedEngine.prepare

    def slow_prepare(engine):  # the preparation takes a known time: the load's line must count it
        time.sleep(0.2)
        prepare(engine)
    monkeypatch.setattr(StreamedEngine, "prepare", slow_prepare)
    cs = bridge_fgo.instrument.patcher._current.callsites
    site = cs.site(targets.target("load_checkpoint"))
    inner = r.dist_optimizer.optimizer
    seen = {}

    def load(state, model, optimizer, scheduler):  # stands in for Bridge's load: one state made anew, one read
        seen["states"] = sum(len(inner.state[p]) for g in inner.param_groups for p in g["params"])
        seen["threads"] = torch.get_num_threads()
        p = inner.param_groups[0]["params"][0]
        if inner.state[p]:
            # a real torch.distributed.checkpoint load into a host view, as torch_dist's: read straight into it
            view = inner.state[p]["exp_avg_sq"]
            seen["read"] = view + 2
            dcp.save({"v": seen["read"]}, checkpoint_id=tmp_path / "ck", no_dist=True)
            dcp.load({"v": view}, checkpoint_id=tmp_path / "ck", no_dist=True)
            inner.state[p]["exp_avg"] = inner.state[p]["exp_avg"].clone() + 1
        return 0, 0

    # torchrun's one thread a rank, 16 cores and 2 ranks on the node: 8 threads for the load, then 1 again
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert site(load, None, (types.SimpleNamespace(cfg=r.cfg), r.model, r.optimizer, None), {}) == (0, 0)
        assert (seen["threads"], torch.get_num_threads()) == (8, 1)
    finally:
        torch.set_num_threads(threads)
    (session,) = cs.registry.sessions()
    engine = session.adapter.engine
    assert (seen["states"] > 0) == load_optim  # a model-only load: made after it, from the loaded weights
    assert engine.on_host() and all(len(inner.state[p]) for g in inner.param_groups for p in g["params"])
    if load_optim:  # what the load read is in the host view it read into
        assert torch.equal(inner.state[inner.param_groups[0]["params"][0]]["exp_avg_sq"], seen["read"])
    # where the load's time went, in one line per rank: before it, Bridge's own, and each part after it
    (said,) = [r.getMessage() for r in caplog_fgo.records if "the checkpoint load took" in r.getMessage()]
    straight = (fr"; 1 tensor\(s\), [\d.]+ GiB \({seen['read'].numel() * 4} bytes\) read straight into the host "
                r"buffer in [\d.]+ s \(1 thread\(s\)\)") if load_optim else ""
    found = re.search(r"took ([\d.]+) s here: bridge_fgo's preparation before it ([\d.]+) s, Megatron-Bridge's "
                      fr"load [\d.]+ s \(torch's threads 1 -> 8 for it{straight}\), bridge_fgo's work after it "
                      r"[\d.]+ s \(waiting for the registration [\d.]+ s, taking what the load bound elsewhere "
                      r"[\d.]+ s\)$", said)
    assert found and float(found[1]) >= float(found[2]) >= 0.2, said  # the session's preparation counted
    bridge_fgo.unpatch()


def remainders_engine():
    """TE holding the masters as int16 remainders, under a prepared engine: (optimizer, engine, the inner
    optimizer's parameters, each one's (data_ptr, value) before)."""
    opt = make(**CASES["te-precision-aware-remainders"])
    engine = StreamedEngine([opt], 2000)
    engine.prepare()
    params = [p for g in opt.optimizer.param_groups for p in g["params"]]
    return opt, engine, params, [(p.data_ptr(), p.clone()) for p in params]


def test_a_load_makes_the_states_of_parameters_that_stay_on_the_gpu_on_the_host():
    """TE holding the masters (int16 remainders here) steps the model's own bf16 shard, which stays on
    the GPU: its load_state_dict makes every state anew where that parameter is, and torch's casts the
    loaded states there first. During the load each such parameter is presented as an untouched host
    tensor of its shape, so both are made on the host; its own storage is back when the load returns,
    and when it raises."""
    opt, engine, params, before = remainders_engine()
    inner = opt.optimizer
    buffer = engine.buffer.tensor
    low, high = buffer.data_ptr(), buffer.data_ptr() + buffer.numel() * buffer.element_size()
    assert not any(low <= ptr < high for ptr, _ in before)  # the model's shards: not in the pinned buffer
    seen = []
    cls = type(inner)
    original = cls.load_state_dict

    def spy(self, state_dict, fail=False):
        seen.append([p.data_ptr() for p in params])
        original(self, state_dict)
        seen.append([id(s) for p in params for s in self.state[p].values()])
        if fail:
            raise RuntimeError("a load that fails (a stand-in)")

    saved = copy.deepcopy(inner.state_dict())
    cls.load_state_dict = spy
    try:
        inner.load_state_dict(saved)
        assert not set(seen[0]) & {ptr for ptr, _ in before}  # presented elsewhere during the load
        assert all(p.data_ptr() == ptr and p.equal(value) for p, (ptr, value) in zip(params, before))
        assert engine.on_host()  # every new state taken into its host view
        with pytest.raises(RuntimeError, match="a stand-in"):
            inner.load_state_dict(saved, fail=True)
        assert all(p.data_ptr() == ptr for p, (ptr, _) in zip(params, before))
    finally:
        cls.load_state_dict = original
        engine.close()


@pytest.mark.parametrize("after, load_optim", [(True, True), (False, True), (True, False)])
def test_the_buffers_registration_runs_after_or_beside_the_load_and_is_waited_for_before_a_copy(train_module,
                                                                                                 monkeypatch, after,
                                                                                                 load_optim):
    """At the load call site the host buffer is allocated before Bridge's load, its cudaHostRegister deferred: by
    default held back until the load's reads are done, then started beside what follows the load, and waited for
    at the buffer's first use (register_after_load); or running beside the load's reads, which write into the
    pages, and waited for when the load returns. Either way before any copy to the GPU; a fresh run's first step
    pins as before. The pages are touched first unless the load brings the states and registers after them
    (its writes fault them in: hostmem.pin(touch=False)); a load without them leaves them to the touch."""
    import threading
    import types

    import bridge_fgo
    from bridge_fgo import hostmem
    from bridge_fgo.engine.streamed.engine import StreamedEngine
    from bridge_fgo.hostmem import pinning
    from bridge_fgo.instrument import targets
    from test_streamed import rig

    assert StreamedEngine.register_after_load  # the default (one H200, 2026-11-29: the load's least cost)
    monkeypatch.setattr(StreamedEngine, "register_after_load", after)
    pins, waits, real = [], [], hostmem.pin

    def pin(n, **k):  # CPU: nothing registers; a deferred one is stood in by a thread that does nothing
        buf = real(n, **k)
        pins.append((k.get("defer", False), k.get("start", True), k.get("touch", True)))
        if k.get("defer"):
            thread = threading.Thread(target=lambda: None)
            thread.start() if k.get("start", True) else None
            buf._held.update(pending=thread, register_result=0)
            buf.held_back = not k.get("start", True)
        return buf
    monkeypatch.setattr(hostmem, "pin", pin)
    real_wait = pinning.PinnedHost.wait
    monkeypatch.setattr(pinning.PinnedHost, "wait", lambda self: waits.append(self.pending) or real_wait(self))
    bridge_fgo.patch(offload="builtin", chunk_mb=1)
    r = rig(optimizer="te")
    r.cfg.checkpoint = types.SimpleNamespace(load_optim=load_optim, finetune=False, save=None, load="ck")
    site = bridge_fgo.instrument.patcher._current.callsites.site(targets.target("load_checkpoint"))
    during = []

    def load(state, model, optimizer, scheduler):
        (session,) = bridge_fgo.instrument.patcher._current.callsites.registry.sessions()
        buf = session.adapter.engine.buffer
        during.append((buf.pending, buf._held["pending"].ident is not None, [w for w in waits if w]))
        return 0, 0

    site(load, None, (types.SimpleNamespace(cfg=r.cfg), r.model, r.optimizer, None), {})
    (session,) = bridge_fgo.instrument.patcher._current.callsites.registry.sessions()
    buf = session.adapter.engine.buffer
    # registering beside the reads, or not; touched first unless the load writes the states before the registration
    assert pins == [(True, not after, not (after and load_optim))] and during == [(True, not after, [])]
    if after:
        assert buf.pending and buf._held["pending"].ident is not None and waits == []  # started, not waited for
        session.adapter.engine.transfers.ready()  # the buffer's first use (the warm pass, a copy)
    assert True in waits and not buf.pending  # waited for when the load returned, or at the first use
    bridge_fgo.unpatch()
    bridge_fgo.patch(offload="builtin", chunk_mb=1)
    pins.clear()
    from support import harness

    harness.run_steps(rig(optimizer="te"), steps=1)
    assert pins == [(False, True, True)]


@pytest.mark.parametrize("case", ["te", "te-precision-aware-bf16"])
def test_te_makes_its_fp32_states_in_their_host_views_before_and_during_a_load(megatron_core_for, monkeypatch, case):
    """TE's fp32 states are made in their host views by its own _initialize_state, shadowed during the engine's
    materialization and TE's loader (which makes every state anew): no fresh host pages, no second copy into the
    buffer. States with a scale (bf16 moments) are still made by TE's own code. The resume stays bit-identical
    (test_resume_writes_into_the_host_buffer_and_continues_bit_identically)."""
    skip_old_precision_aware_load(case)
    megatron_core_for("te")
    metadata = {"distrib_optim_sharding_type": "dp_reshardable"}
    source = fresh(case)
    source_engine = StreamedEngine([source], 2000)
    source_engine.prepare()
    step(source, source_engine)
    saved = copy.deepcopy(source.sharded_state_dict({}, False, metadata=metadata))

    opt = fresh(case)
    made = fused_adam.count_own_states(monkeypatch, opt.optimizer)  # the states TE's own code makes
    engine = StreamedEngine([opt], 2000)
    engine.prepare()
    scaled = CASES[case].get("precision_aware")
    assert set(made) == ({"exp_avg", "exp_avg_sq"} if scaled else set()), made  # TE's own code: the scaled ones
    made.clear()
    loading = opt.sharded_state_dict({}, True, metadata=metadata)
    opt.load_state_dict(checkpoint_load(saved, loading))
    engine.after_load()
    assert set(made) == ({"exp_avg", "exp_avg_sq"} if scaled else set()), made
    assert "_initialize_state" not in vars(opt.optimizer)  # the shadow is gone
    for part in engine.parts:
        b = part.bindings
        assert all(tensors.same(b.get(e), e.host) for e in part.entries())
    engine.close()


@pytest.mark.parametrize("zeroed", [True, False])
def test_states_made_in_a_buffer_fresh_from_the_kernel_are_not_zeroed_again(megatron_core_for, monkeypatch, zeroed):
    """The host buffer as the kernel hands it out reads as zero (hostmem.pin: fresh anonymous pages): TE's fp32
    states made in their views there are not written again (the zeros would only fault the pages in, inside a
    checkpoint load's time). A buffer that may hold anything (the pin_memory=True fallback) is zeroed where TE
    zeroes. Either way the states read as TE makes them: zero."""
    import torch

    from bridge_fgo import hostmem

    megatron_core_for("te")
    real_pin = hostmem.pin

    def pin(nbytes, **kw):
        buf = real_pin(nbytes, **kw)
        assert buf.zeroed and int(buf.tensor.count_nonzero()) == 0
        if not zeroed:  # as the fallback may hand it out: old bytes
            buf.tensor.fill_(0x7F)
            buf.zeroed = False
        return buf

    monkeypatch.setattr(hostmem, "pin", pin)
    opt = fresh("te")
    engine = StreamedEngine([opt], 2000)
    into_buffer = []
    real_zero = torch.Tensor.zero_

    def zero_(t):
        buf = engine.transfers.buffer
        if buf is not None and buf.tensor.data_ptr() <= t.data_ptr() < buf.tensor.data_ptr() + buf.nbytes:
            into_buffer.append(tuple(t.shape))
        return real_zero(t)

    monkeypatch.setattr(torch.Tensor, "zero_", zero_)
    engine.prepare()
    monkeypatch.setattr(torch.Tensor, "zero_", real_zero)
    states = [v for s in opt.optimizer.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]
    assert states and all(int(v.count_nonzero()) == 0 for v in states)
    assert bool(into_buffer) is not zeroed, into_buffer
    engine.close()


def test_the_warm_pass_after_a_load_is_queued_and_its_scratch_retired_not_waited_for():
    """After a checkpoint load the one DMA pass over the buffer is queued on the copy stream (the first step's
    copies follow it there) and its GPU scratch handed to the allocator for after the copy streams; before
    the first step it is waited for."""
    import types

    import torch

    from bridge_fgo.engine.streamed.transfers import WARM_BYTES, Transfers

    calls = []

    class Copies:  # a recording stand-in for the device copies (engine/copies.py)
        def compute_event(self):
            return None

        def copy(self, direction, dst, src, after):
            calls.append(("copy", direction, dst.numel(), src.data_ptr() - buffer.data_ptr()))

        def host_wait_all(self):
            calls.append(("wait",))

        def retire(self, tensor):
            calls.append(("retire", tensor.numel()))

    buffer = torch.zeros(WARM_BYTES + 5, dtype=torch.uint8)
    fake = types.SimpleNamespace(buffer=types.SimpleNamespace(nbytes=buffer.numel(), tensor=buffer),
                                 device=torch.device("cpu"), copies=Copies(), ready=lambda: calls.append(("ready",)))
    Transfers.warm(fake, wait=False)
    assert calls == [("ready",), ("copy", "h2d", WARM_BYTES, 0), ("copy", "h2d", 5, WARM_BYTES), ("retire", WARM_BYTES)]
    calls.clear()
    Transfers.warm(fake)
    assert calls == [("ready",), ("copy", "h2d", WARM_BYTES, 0), ("copy", "h2d", 5, WARM_BYTES), ("wait",)]


def test_after_a_load_the_warm_pass_is_queued_after_the_states_are_taken(monkeypatch):
    """The states a load bound elsewhere are taken first (that waits for every copy in flight), then the warm pass
    is queued without a wait: the load's end does not wait for it (0.07 s for 3.8 GB on one H200)."""
    opt = make(**CASES["te"])
    engine = StreamedEngine([opt], 2000)
    engine.defer_pinning = True
    engine.prepare()
    seen = []
    taking = engine.readers.after_load
    monkeypatch.setattr(engine.readers, "after_load", lambda: (seen.append("take"), taking()))
    monkeypatch.setattr(engine.transfers, "warm", lambda wait=True: seen.append(("warm", wait)))
    engine._warm_pending = True  # as a prepare beside a load with device copies leaves it
    laps = engine.after_load()
    assert seen == ["take", ("warm", False)] and not engine._warm_pending
    assert [what for what, _ in laps] == ["waiting for the registration", "taking what the load bound elsewhere",
                                          "the warm pass queued"]
    engine.close()


def test_a_registration_held_back_after_a_load_starts_then_and_the_warm_pass_waits_for_the_first_step(monkeypatch):
    """register_after_load (issue 43's measurement of where a load's registration costs least): the registration
    starts after the load's reads, nothing waits for it then, and the warm pass (which waits for it) is queued
    by the first step's offload instead of the load's end."""
    import threading

    from bridge_fgo.engine.streamed.transfers import Transfers

    opt = make(**CASES["te"])
    engine = StreamedEngine([opt], 2000)
    engine.register_after_load = True
    engine.defer_pinning = True
    pins = []
    monkeypatch.setattr(engine.transfers, "pin", lambda defer=False, start=True, touch=True: (
        pins.append((defer, start, touch)), Transfers.pin(engine.transfers, defer, start, touch)))
    engine.prepare()
    assert pins == [(True, False, False)]  # registered later; the load's writes fault the pages in, no touch first
    seen = []
    registration = threading.Thread(target=lambda: seen.append("registered"))
    engine.transfers.buffer._held["pending"] = registration  # a GPU's registration, held back (CPU: none)
    engine._warm_pending = True  # as a prepare beside a load with device copies leaves it
    monkeypatch.setattr(engine.transfers, "warm", lambda wait=True: seen.append(("warm", wait)))
    laps = engine.after_load()
    registration.join()
    assert [what for what, _ in laps] == ["the registration started", "taking what the load bound elsewhere"]
    assert seen == ["registered"] and engine._warm_pending and engine.transfers.buffer.pending
    engine.offload()  # the first step
    assert seen == ["registered", ("warm", False)] and not engine._warm_pending
    engine.close()
