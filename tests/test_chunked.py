"""Megatron-Core's chunked offload generation, driven through Bridge's real train_step.

The stand-in reproduces the API surface of Megatron-LM dev d48bd6be0a85cc0d6d3cc71e8750cf357cc6bdb1
(megatron/core/optimizer/optimizer.py: MegatronOptimizer / ChainedOptimizer; unchanged since
9050d4c5fb13e8933afec149cbcd34a5c29c85e6): the same method names and signatures, each recording
its call. The methods are given to the real MegatronOptimizer class too, which is how bridge_fgo
detects the generation.
"""
import inspect

import pytest

import bridge_fgo
from bridge_fgo import BridgeFGOConfigError
from support import harness


class ChunkedChainedOptimizer(harness.ChainedOptimizer):
    """ChainedOptimizer of the chunked line: every call forwards to the children there; here each
    is recorded once, at the top level, where Megatron-LM's train_step makes it."""

    requires_pre_forward_sync = False

    def offload_optimizer_state_for_forward(self, offload_master: bool = True) -> None:
        self.events.add(f"offload_optimizer_state_for_forward(offload_master={offload_master})")

    def prefetch_optimizer_state_for_step(self) -> None:
        self.events.add("prefetch_optimizer_state_for_step")

    def prefetch_optimizer_state_for_gradient_finalization(self) -> None:
        self.events.add("prefetch_optimizer_state_for_gradient_finalization")

    def prefetch_optimizer_master_weights_for_step(self) -> None:
        self.events.add("prefetch_optimizer_master_weights_for_step")

    def ensure_master_weights_for_param_sync(self) -> None:
        self.events.add("ensure_master_weights_for_param_sync")

    def ensure_master_weights_for_pre_forward_param_sync(self) -> None:
        self.events.add("ensure_master_weights_for_pre_forward_param_sync")

    def assert_master_weights_resident(self, operation: str) -> None:
        pass

    def synchronize_optimizer_state_for_checkpoint(self) -> None:
        self.events.add("synchronize_optimizer_state_for_checkpoint")

    def optimizer_state_offload_requires_pre_forward_param_sync(self) -> bool:
        return self.requires_pre_forward_sync

    def start_param_sync_for_bucket_group_subset(self, force_sync: bool = False) -> None:
        self.events.add(f"start_param_sync_for_bucket_group_subset(force_sync={force_sync})")


SURFACE = {name: inspect.signature(getattr(ChunkedChainedOptimizer, name)) for name in (
    "offload_optimizer_state_for_forward", "prefetch_optimizer_state_for_gradient_finalization",
    "optimizer_state_offload_requires_pre_forward_param_sync", "ensure_master_weights_for_pre_forward_param_sync",
    "start_param_sync_for_bucket_group_subset", "synchronize_optimizer_state_for_checkpoint")}


@pytest.fixture
def chunked(mocker):
    from megatron.core.optimizer.optimizer import MegatronOptimizer

    for name in SURFACE:
        mocker.patch.object(MegatronOptimizer, name, create=True, new=getattr(ChunkedChainedOptimizer, name))


def chunked_rig(delay=True, pre_forward_sync=False, **opt):
    # the chunked line's __post_init__ has turned the deprecated alias into this and reset the alias
    opt = {"chunked_optimizer_state_offload": True, "optimizer_state_offload_fraction": 1.0, **opt}
    cfg = harness.config_container(harness.optimizer_config(**opt))
    cfg.optimizer.reuse_grad_buf_for_mxfp8_param_ag = delay  # with overlap_param_gather: masters wait
    rig = harness.Rig(cfg=cfg)
    rig.optimizer = ChunkedChainedOptimizer([rig.dist_optimizer], rig.events)
    rig.optimizer.requires_pre_forward_sync = pre_forward_sync
    return rig


FIN = ["forward-backward", "prefetch_optimizer_state_for_gradient_finalization",
       "finalize(pg_collection=pg_collection)", "step", "scheduler.step"]


def test_order_with_master_offload_delayed_past_the_param_buffer_copy(chunked):
    report = bridge_fgo.patch()
    assert report.generation == "chunked"
    rig = chunked_rig(delay=True)
    harness.run_steps(rig, steps=2)
    one = ["zero_grad_buffer", "zero_grad", "offload_optimizer_state_for_forward(offload_master=False)",
           "param-buffer copy", "offload_optimizer_state_for_forward(offload_master=True)", *FIN]
    assert rig.events == one * 2
    assert bridge_fgo.status().sessions[0]["mode"] == "chunked"


def test_order_without_mxfp8_buffer_reuse(chunked):
    bridge_fgo.patch()
    rig = chunked_rig(delay=False)
    harness.run_steps(rig, steps=1)
    assert rig.events == ["zero_grad_buffer", "zero_grad",
                          "offload_optimizer_state_for_forward(offload_master=True)", *FIN]


def test_pre_forward_param_sync_comes_before_the_offload(chunked):
    bridge_fgo.patch()
    rig = chunked_rig(delay=False, pre_forward_sync=True)
    harness.run_steps(rig, steps=1)
    assert rig.events == ["zero_grad_buffer", "zero_grad", "ensure_master_weights_for_pre_forward_param_sync",
                          "start_param_sync_for_bucket_group_subset(force_sync=True)",
                          "offload_optimizer_state_for_forward(offload_master=True)", *FIN]


def test_finalize_wrapper_once_and_checkpoint_sync_left_to_megatron_core(chunked):
    bridge_fgo.patch()
    rig = chunked_rig()
    original = rig.model_config.finalize_model_grads_func
    harness.run_steps(rig, steps=3, reruns=2)
    assert rig.events.count("prefetch_optimizer_state_for_gradient_finalization") == 6
    assert rig.model_config.finalize_model_grads_func.__wrapped__ is original
    # the chunked line synchronises inside sharded_state_dict(); bridge_fgo never calls it itself
    assert "synchronize_optimizer_state_for_checkpoint" not in rig.events
    bridge_fgo.unpatch()
    assert rig.model_config.finalize_model_grads_func is original


def test_flag_unset_no_call(chunked):
    bridge_fgo.patch()
    rig = chunked_rig()
    rig.cfg.optimizer.chunked_optimizer_state_offload = False
    harness.run_steps(rig, steps=1)
    assert not any("offload" in e or "prefetch" in e for e in rig.events)


def test_fraction_zero_is_not_a_request(chunked):
    bridge_fgo.patch()
    rig = chunked_rig(optimizer_state_offload_fraction=0.0)
    harness.run_steps(rig, steps=1)
    assert not any("offload_optimizer_state" in e for e in rig.events)


@pytest.mark.parametrize("ckpt,needle", [
    ({"save": "/ckpt", "async_save": True}, "async_save=True"),
    ({"save": "/ckpt", "ckpt_format": "torch"}, "ckpt_format='torch'"),
    ({}, "optimizer_cpu_offload"),
])
def test_chunked_constraints_refused_before_first_step(chunked, ckpt, needle):
    import types

    bridge_fgo.patch()
    rig = chunked_rig(optimizer_cpu_offload=not ckpt)
    rig.cfg.checkpoint = types.SimpleNamespace(save=None, load=None, save_optim=True, load_optim=True,
                                               async_save=False, ckpt_format="torch_dist")
    for k, v in ckpt.items():
        setattr(rig.cfg.checkpoint, k, v)
    with pytest.raises(BridgeFGOConfigError, match=needle):
        harness.run_steps(rig, steps=1)
    assert rig.events == []


def test_builtin_with_chunked_flag_is_refused(chunked):
    bridge_fgo.patch(offload="builtin")
    with pytest.raises(BridgeFGOConfigError, match="two offloaders"):
        harness.run_steps(chunked_rig(), steps=1)


def test_bridge_wiring_chunked_itself_steps_aside(chunked, monkeypatch, train_module):
    real = train_module.train_step

    def train_step(*args, **kwargs):
        args[3].offload_optimizer_state_for_forward(offload_master=True)
        return real(*args, **kwargs)

    monkeypatch.setattr(train_module, "train_step", train_step)
    report = bridge_fgo.patch()
    assert report.outcome == "stepped-aside" and report.native_wiring == ["offload_optimizer_state_for_forward"]
