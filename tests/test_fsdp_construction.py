"""Megatron-FSDP's fp32 masters made in host memory while its own ParamAndGradBuffer is built
(engine/fsdp_construction.py), on its real constructor over CPU in a one-rank gloo world.

The stand-ins: torch.Tensor.cuda during the constructor (support/fsdp.py real_buffer), and the CPU standing in for
the GPU (`fsdp_construction._moves`: a tensor Megatron-FSDP made "on the device" is one on the CPU here); the
landing block is then unpinned host memory, and `make_fsdp_dtensor` gets a CPU copy of each host view. What a GPU
alone shows (the run's peak from process start) is measured by scripts/gpu/bench_fsdp.sh."""
import sys

import pytest
import torch

import bridge_fgo
from bridge_fgo.engine import adoption, construction, fsdp_construction
from bridge_fgo.engine.fsdp import local
from bridge_fgo.engine.streamed import StreamedEngine
from bridge_fgo.instrument import targets
from support import fsdp, harness
from test_fsdp import assert_same

pytest.importorskip("megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer")
KINDS = {"torch": dict(optimizer="torch"), "te": dict(optimizer="te")}


@pytest.fixture
def gloo():
    with harness.model_parallel():
        yield


@pytest.fixture
def cpu_is_the_device(monkeypatch):
    monkeypatch.setattr(fsdp_construction, "_moves", lambda t: t.device.type == "cpu")


def _module():
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer

    return param_and_grad_buffer


def _pair(kind="torch", **kw):
    ref = fsdp.make_optimizer_on_real_buffer(harness.Recorder(), **KINDS[kind], **kw)
    if ref is None:
        pytest.skip("this megatron-core's ParamAndGradBuffer takes no mixed_precision_policy (0.16.1)")
    built = construction.Built()
    opt = fsdp.make_optimizer_on_real_buffer(harness.Recorder(), on_host=built, **KINDS[kind], **kw)
    return ref, opt, built


def _params(opt):
    return [p for g in opt.optimizer.param_groups for p in g["params"]]


def test_the_main_weight_buffers_are_made_in_one_host_block_and_the_masters_are_views_of_it(gloo, cpu_is_the_device):
    mod = _module()
    make, init_data = vars(mod)["make_fsdp_dtensor"], vars(mod.DataParallelBuffer)["init_data"]
    ref, opt, built = _pair()
    pgb = opt.model_chunks[0].param_and_grad_buffer
    # what the constructor reached through is Megatron-FSDP's own again
    assert vars(mod)["make_fsdp_dtensor"] is make and vars(mod.DataParallelBuffer)["init_data"] is init_data
    blocks = {g.main_weight_buffer.data.untyped_storage().data_ptr() for g in pgb.parameter_groups}
    assert len(blocks) == 1  # every group's buffer a view of the one landing block
    block = blocks.pop()
    dists = pgb.dist_main_weight
    for (name, p), (_, q) in zip(pgb.optimizer_named_parameters,
                                 ref.model_chunks[0].param_and_grad_buffer.optimizer_named_parameters):
        lt = local(p)
        assert lt.untyped_storage().data_ptr() == block and construction.is_staged(lt)
        assert local(dists[name]).data_ptr() == lt.data_ptr()  # Megatron-FSDP's own DTensor over the same view
        assert lt.dtype == torch.float32 and torch.equal(lt, local(q))  # the masters as Megatron-FSDP makes them
        assert type(p).__name__ == "DTensor" and p.shape == q.shape
    assert built.masters == len(_params(opt)) and built.batches == len(pgb.parameter_groups)
    assert built.landing and built.landed >= built.bytes
    assert fsdp_construction.staged(opt) == [local(p) for _, p in pgb.optimizer_named_parameters]


def test_each_item_is_widened_where_it_is_before_it_crosses_to_the_host(gloo, cpu_is_the_device, monkeypatch):
    """torch converts the dtype of a copy between devices on the CPU (one thread under torchrun): each bf16 weight is
    widened to the main-weight buffer's fp32 first, where it is, one item at a time."""
    mod = _module()
    seen = []
    real = vars(mod.DataParallelBuffer)["set_item"]

    def set_item(buf, item_id, item_data, *a, **k):
        seen.append((buf.dtype, item_data.dtype))
        return real(buf, item_id, item_data, *a, **k)

    monkeypatch.setattr(mod.DataParallelBuffer, "set_item", set_item)
    ref = fsdp.make_optimizer_on_real_buffer(harness.Recorder())
    if ref is None:
        pytest.skip("this megatron-core's ParamAndGradBuffer takes no mixed_precision_policy (0.16.1)")
    assert (torch.float32, torch.bfloat16) in seen  # Megatron-FSDP's own: bf16 weights into its fp32 buffer
    seen.clear()
    opt = fsdp.make_optimizer_on_real_buffer(harness.Recorder(), on_host=construction.Built())
    assert vars(mod.DataParallelBuffer)["set_item"] is set_item  # put back as the constructor found it
    mains = [(b, d) for b, d in seen if b == torch.float32]
    assert mains and all(d == torch.float32 for _, d in mains)  # the main-weight buffers' items, widened
    assert any(d == torch.bfloat16 for b, d in seen if b == torch.bfloat16)  # the model weights' untouched
    for (_, p), (_, q) in zip(opt.model_chunks[0].param_and_grad_buffer.optimizer_named_parameters,
                              ref.model_chunks[0].param_and_grad_buffer.optimizer_named_parameters):
        assert torch.equal(local(p), local(q))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_streamed_step_over_host_made_masters_is_bit_identical(gloo, cpu_is_the_device, kind):
    ref, opt, _ = _pair(kind)
    engine = StreamedEngine([opt], 40_000)
    engine.prepare()
    layout = engine.plan.parts[0].fsdp
    assert layout is not None and all(f.on_host for f in layout.flats)
    assert not fsdp_construction.staged(opt)  # every master taken into the engine's pinned buffer
    for _ in range(3):
        harness.engine_step(ref)
        harness.engine_step(opt, engine)
        assert all(f.retired for f in layout.flats)
        assert_same(fsdp.snapshot(ref), fsdp.snapshot(opt))
    engine.close()  # unpatch: each buffer made again on the device Megatron-FSDP meant, the masters views of it
    pgb = opt.model_chunks[0].param_and_grad_buffer
    for f in layout.flats:
        assert not f.retired
        for _, p, offset, shape in f.items:
            assert local(p).data_ptr() == f.mbuf.data[offset:].data_ptr()
    assert_same(fsdp.snapshot(ref), fsdp.snapshot(opt))
    assert pgb.parameter_groups


def test_unadopted_the_buffers_go_back_to_the_device_and_the_step_is_megatron_fsdps(gloo, cpu_is_the_device,
                                                                                     caplog_fgo):
    """A loop of its own steps the optimizer before any session took it: each main-weight buffer is made again on
    the device Megatron-FSDP meant, its masters views of it, and said once."""
    ref, opt, _ = _pair()
    assert adoption.await_session(opt)
    pgb = opt.model_chunks[0].param_and_grad_buffer
    hosts = [g.main_weight_buffer.data for g in pgb.parameter_groups]
    for _ in range(2):
        ref.step_states()
        opt.step_states()  # guarded: step_with_ready_grads
    assert "went back to the device they were made on" in caplog_fgo.text
    assert not fsdp_construction.staged(opt)
    for g, host in zip(pgb.parameter_groups, hosts):
        assert g.main_weight_buffer.data is not host  # made again (on the CPU here, which stands in for the GPU)
    for g in pgb.parameter_groups:
        base = g.main_weight_buffer.data.untyped_storage().data_ptr()
        for item_id, orig in enumerate(g.params):
            p = next(q for _, q in pgb.optimizer_named_parameters if q.orig_param is orig)
            if local(p).numel():
                assert local(p).untyped_storage().data_ptr() == base
    assert_same(fsdp.snapshot(ref), fsdp.snapshot(opt))


def test_refused_by_the_host_memory_check_the_buffers_are_made_on_the_device(gloo, cpu_is_the_device, monkeypatch,
                                                                              caplog_fgo):
    from bridge_fgo import hostmem
    from bridge_fgo.errors import BridgeFGOConfigError

    def refuse(*a, **k):
        raise BridgeFGOConfigError("host memory: 1 GiB needed, 0 available (test)")

    monkeypatch.setattr(hostmem, "check_fits", refuse)
    ref, opt, built = _pair()
    assert built.masters == 0 and not fsdp_construction.staged(opt)
    assert "landing block" in caplog_fgo.text and "refused by the host-memory check" in caplog_fgo.text
    pgb = opt.model_chunks[0].param_and_grad_buffer
    for _, p in pgb.optimizer_named_parameters:
        assert not construction.is_staged(local(p))
    assert_same(fsdp.snapshot(ref), fsdp.snapshot(opt))


def test_an_unknown_constructor_is_said_and_runs_as_megatron_fsdps(gloo, cpu_is_the_device, monkeypatch, caplog_fgo):
    if fsdp.make_optimizer_on_real_buffer(harness.Recorder()) is None:
        pytest.skip("this megatron-core's ParamAndGradBuffer takes no mixed_precision_policy (0.16.1)")
    mod = _module()
    monkeypatch.delattr(mod, "make_fsdp_dtensor")
    assert fsdp_construction.missing(mod) == [f"{mod.__name__}.make_fsdp_dtensor"]
    built = construction.Built()
    with pytest.raises(NameError):  # Megatron-FSDP's own constructor, reaching what this test took away
        fsdp.make_optimizer_on_real_buffer(harness.Recorder(), on_host=built)
    assert "made on the GPU, as without offload" in caplog_fgo.text and built.masters == 0


@pytest.mark.parametrize("offload, made", [("builtin", True), ("off", False)])
def test_the_patch_wraps_megatron_fsdps_constructor(gloo, cpu_is_the_device, caplog_fgo, train_module, offload,
                                                    made):
    from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import ParamAndGradBuffer

    original = vars(ParamAndGradBuffer)["__init__"]
    report = bridge_fgo.patch(offload=offload)
    try:
        assert report.patched and report.targets["ParamAndGradBuffer.__init__"] is True
        assert vars(ParamAndGradBuffer)["__init__"] is not original
        opt = fsdp.make_optimizer_on_real_buffer(harness.Recorder())
        if opt is None:
            pytest.skip("this megatron-core's ParamAndGradBuffer takes no mixed_precision_policy (0.16.1)")
        assert bool(fsdp_construction.staged(opt)) is made
        assert ("made on the host with Megatron-FSDP's main-weight buffers" in caplog_fgo.text) is made
        assert ("parameter group(s) of at most" in caplog_fgo.text) is made
    finally:
        bridge_fgo.unpatch()
    assert vars(ParamAndGradBuffer)["__init__"] is original


def test_megatron_fsdps_module_absent_is_no_problem_and_not_waited_for(monkeypatch, train_module):
    """Megatron-Core imports Megatron-FSDP inside a try: where it cannot be imported, the rest is patched."""
    t = targets.target("ParamAndGradBuffer.__init__")
    assert t.optional and t.module in targets.OPTIONAL_MODULES and t.module not in targets.MODULES
    monkeypatch.delitem(sys.modules, t.module)
    layout = targets.inspect_layout({m: sys.modules[m] for m in targets.MODULES})
    assert layout.found[t.name] is False and layout.recognised
    report = bridge_fgo.patch()
    try:
        assert report.patched and report.targets[t.name] is False
    finally:
        bridge_fgo.unpatch()


def test_a_changed_constructor_is_a_problem_named(monkeypatch, train_module):
    from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import ParamAndGradBuffer

    def __init__(self, ddp_config, module):
        pass

    monkeypatch.setattr(ParamAndGradBuffer, "__init__", __init__)
    layout = targets.inspect_layout({m: sys.modules[m] for m in targets.MODULES})
    assert [str(p) for p in layout.problems if p.target == "ParamAndGradBuffer.__init__"] == [
        "ParamAndGradBuffer.__init__() no longer calls _init_each_parameter_group_buffers",
        "ParamAndGradBuffer.__init__() no longer calls _init_distributed_params",
        "ParamAndGradBuffer.__init__() no longer calls _init_optimizer_named_parameters"]

