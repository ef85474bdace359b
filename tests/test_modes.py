"""When the patch acts, and when it must not."""
import logging

import pytest

import bridge_fgo
from bridge_fgo import BridgeFGOConfigError, BridgeFGOError, BridgeFGOOptionError
from conftest import BRIDGE, MCORE
from support import harness

CALLS = ("offload", "release", "reload")


def flagged(**opt):
    return harness.Rig(cfg=harness.config_container(harness.optimizer_config(offload_optimizer_states=True, **opt)))


def warnings_of(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "bridge_fgo" and r.levelno == logging.WARNING]


def test_no_fgo_megatron_core_warns_once(caplog_fgo):
    # the real, released megatron-core: no offload methods anywhere
    bridge_fgo.patch()
    rig = flagged()
    harness.run_steps(rig, steps=3)
    harness.run_steps(flagged(), steps=1)  # a second run in the process: still one warning
    (msg,) = warnings_of(caplog_fgo)
    assert f"megatron-core {MCORE} has no optimizer-state offload" in msg
    assert "offload='builtin'" in msg and "BRIDGE_FGO_OFFLOAD=builtin" in msg
    assert not any(c in rig.events for c in CALLS)


def test_no_fgo_and_flag_unset_is_quiet(caplog_fgo):
    bridge_fgo.patch()
    harness.run_steps(harness.Rig(), steps=2)
    assert warnings_of(caplog_fgo) == []


def test_no_fgo_strict_raises_before_first_step():
    bridge_fgo.patch(strict=True)
    rig = flagged()
    with pytest.raises(BridgeFGOError, match="no optimizer-state offload"):
        harness.run_steps(rig, steps=1)
    assert rig.events == []


def test_offload_off_never_acts(three_method):
    bridge_fgo.patch(offload="off")
    rig = flagged()
    harness.run_steps(rig, steps=1)
    assert not any(c in rig.events for c in CALLS)


def test_native_wiring_steps_aside(monkeypatch, train_module, caplog_fgo):
    real_train_step = train_module.train_step

    def train_step(*args, **kwargs):  # a Bridge that wires offload itself (PR #4217 merged, or a fork)
        for opt in args[3].chained_optimizers:
            opt.offload_states()
        return real_train_step(*args, **kwargs)

    monkeypatch.setattr(train_module, "train_step", train_step)
    report = bridge_fgo.patch()
    assert report.outcome == "stepped-aside" and not report.patched
    assert report.native_wiring == ["offload_states"]
    assert train_module.train_step is train_step
    assert "steps aside" in report.reason


def test_unrecognised_layout_patches_nothing(monkeypatch, train_module, caplog_fgo):
    monkeypatch.delattr(train_module, "_handle_mxfp8_param_buffer_copy")
    before = (train_module.train, train_module.train_step)
    report = bridge_fgo.patch()
    assert not report.patched and report.outcome == "not-patched"
    assert (train_module.train, train_module.train_step) == before
    (msg,) = warnings_of(caplog_fgo)
    assert f"megatron-bridge {BRIDGE} " in msg and "_handle_mxfp8_param_buffer_copy is missing" in msg
    bridge_fgo.unpatch()
    with pytest.raises(BridgeFGOError, match="_handle_mxfp8_param_buffer_copy is missing"):
        bridge_fgo.patch(strict=True)
    assert (train_module.train, train_module.train_step) == before


REJECTED = [
    ({"use_distributed_optimizer": False}, None, "cfg.optimizer.use_distributed_optimizer=False"),
    ({"optimizer": "sgd"}, None, "cfg.optimizer.optimizer='sgd'"),
    ({"optimizer_cpu_offload": True}, None, "cfg.optimizer.optimizer_cpu_offload=True"),
    ({"optimizer_cuda_graph": True}, None, "cfg.optimizer.optimizer_cuda_graph=True"),
    ({}, ("ddp", "use_megatron_fsdp"), "use_megatron_fsdp"),
    ({}, ("model", "cuda_graph_scope"), "full_iteration"),
]


@pytest.mark.parametrize("opt,section,needle", REJECTED, ids=[r[2] for r in REJECTED])
def test_rejected_configurations(three_method, opt, section, needle):
    bridge_fgo.patch()
    rig = flagged(**opt)
    if section == ("ddp", "use_megatron_fsdp"):
        rig.cfg.ddp.use_megatron_fsdp = True
    elif section == ("model", "cuda_graph_scope"):
        rig.cfg.model.cuda_graph_impl, rig.cfg.model.cuda_graph_scope = "local", ["full_iteration"]
    with pytest.raises(BridgeFGOConfigError) as err:
        harness.run_steps(rig, steps=1)
    assert needle in str(err.value)
    assert rig.events == []  # refused before the first step touched anything


def test_not_a_distributed_optimizer_is_rejected(three_method):
    bridge_fgo.patch()
    rig = flagged()
    rig.optimizer.chained_optimizers = [object()]
    with pytest.raises(BridgeFGOConfigError, match="no DistributedOptimizer"):
        harness.run_steps(rig, steps=1)


def test_patch_twice_logs_and_does_nothing(three_method, train_module, caplog_fgo):
    bridge_fgo.patch()
    wrapped = train_module.train_step
    bridge_fgo.patch()
    assert train_module.train_step is wrapped
    assert any("already patched" in r.getMessage() for r in caplog_fgo.records)
    rig = flagged()
    harness.run_steps(rig, steps=1)
    assert rig.events.count("offload") == 1


def test_bad_offload_value():
    with pytest.raises(BridgeFGOOptionError, match=r"offload='sometimes'.*auto, builtin, off"):
        bridge_fgo.patch(offload="sometimes")
    assert not bridge_fgo.is_patched()


def test_bad_environment_value(monkeypatch):
    monkeypatch.setenv("BRIDGE_FGO_STRICT", "perhaps")
    with pytest.raises(BridgeFGOOptionError, match="BRIDGE_FGO_STRICT='perhaps'"):
        bridge_fgo.patch()


def test_environment_sets_options(monkeypatch):
    monkeypatch.setenv("BRIDGE_FGO_OFFLOAD", "off")
    monkeypatch.setenv("BRIDGE_FGO_STRICT", "1")
    report = bridge_fgo.patch()
    assert (report.mode, report.strict) == ("off", True)


def test_disable(monkeypatch, train_module):
    monkeypatch.setenv("BRIDGE_FGO_DISABLE", "1")
    before = train_module.train_step
    report = bridge_fgo.patch()
    assert not report.patched and report.reason == "disabled" and train_module.train_step is before


def test_second_patch_with_other_options_warns(caplog_fgo):
    bridge_fgo.patch()
    report = bridge_fgo.patch(offload="builtin")
    assert report.mode == "auto"
    assert any("already patched with offload='auto'" in m and "ignored" in m for m in warnings_of(caplog_fgo))


def test_status_reports_disabled_and_never_raises(monkeypatch):
    monkeypatch.setenv("BRIDGE_FGO_DISABLE", "yes")
    bridge_fgo.patch()
    assert bridge_fgo.status().reason == "disabled"
    bridge_fgo.unpatch()
    monkeypatch.setenv("BRIDGE_FGO_OFFLOAD", "sometimes")
    bridge_fgo.instrument.patcher._current = None
    assert "BRIDGE_FGO_OFFLOAD='sometimes'" in bridge_fgo.status().reason


def test_megatron_core_version_names_a_shadowing_source_tree(monkeypatch):
    import megatron.core

    from bridge_fgo import versions

    assert versions.megatron_core_version() == MCORE  # the wheel's X.Y.Z+<build> is the same release
    monkeypatch.setattr(megatron.core, "__version__", "0.99.0")  # another source tree on PYTHONPATH
    assert versions.megatron_core_version().startswith("0.99.0 (loaded from ")
