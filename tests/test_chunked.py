"""Megatron-Core's chunked offload generation, driven through Bridge's real train_step.

The stand-ins reproduce the API surface of Megatron-LM dev d48bd6be0a85cc0d6d3cc71e8750cf357cc6bdb1
(megatron/core/optimizer/optimizer.py: MegatronOptimizer / ChainedOptimizer; unchanged since
9050d4c5fb13e8933afec149cbcd34a5c29c85e6), each method recording its call; DEV_SIGNATURES below is
that surface as read there, and test_stand_ins_match_the_dev_line compares them. The methods are
given to the real MegatronOptimizer class too, which is how bridge_fgo detects the generation.
"""
import inspect
import logging

import pytest
import torch

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


class PlanStandIn:
    """ChunkedOptimizerStateOffloader's plan (cpu_offloading/chunked_optimizer_state_offload.py), as
    far as bridge_fgo reads it: the selected parameters, each one's tensor states (one per state
    dtype) and its master, and the bytes of that bundle, computed as the dev line computes them."""

    def __init__(self, params, state_dtypes):
        self._selected_params = tuple(params)
        self.state_dtypes = tuple(state_dtypes)
        self._chunks = (tuple(params),)

    @property
    def selected_params(self):
        return self._selected_params

    @property
    def chunks(self):
        return self._chunks

    def _param_has_master(self, param: torch.Tensor) -> bool:
        return True  # DistributedOptimizer hands in its fp32 shards of bf16 parameters as masters

    def _estimated_bundle_bytes(self, param: torch.Tensor) -> int:
        state = param.numel() * sum(d.itemsize for d in self.state_dtypes)
        return state + param.numel() * param.element_size()


# What Megatron-LM dev d48bd6be0a85cc0d6d3cc71e8750cf357cc6bdb1 declares, read there by hand
# (git show d48bd6be:megatron/core/optimizer/optimizer.py, class ChainedOptimizer, and
# .../cpu_offloading/chunked_optimizer_state_offload.py, class ChunkedOptimizerStateOffloader).
DEV_COMMIT = "d48bd6be0a85cc0d6d3cc71e8750cf357cc6bdb1"
DEV_SIGNATURES = {
    ChunkedChainedOptimizer: {
        "offload_optimizer_state_for_forward": "(self, offload_master: bool = True) -> None",
        "prefetch_optimizer_state_for_step": "(self) -> None",
        "prefetch_optimizer_state_for_gradient_finalization": "(self) -> None",
        "prefetch_optimizer_master_weights_for_step": "(self) -> None",
        "ensure_master_weights_for_param_sync": "(self) -> None",
        "ensure_master_weights_for_pre_forward_param_sync": "(self) -> None",
        "assert_master_weights_resident": "(self, operation: str) -> None",
        "synchronize_optimizer_state_for_checkpoint": "(self) -> None",
        "optimizer_state_offload_requires_pre_forward_param_sync": "(self) -> bool",
        "start_param_sync_for_bucket_group_subset": "(self, force_sync: bool = False) -> None",
    },
    PlanStandIn: {
        "_param_has_master": "(self, param: torch.Tensor) -> bool",
        "_estimated_bundle_bytes": "(self, param: torch.Tensor) -> int",
    },
}
DEV_PROPERTIES = {PlanStandIn: ("selected_params", "chunks")}  # @property there too
SURFACE = tuple(DEV_SIGNATURES[ChunkedChainedOptimizer])


def test_stand_ins_match_the_dev_line():
    for cls, methods in DEV_SIGNATURES.items():
        got = {name: str(inspect.signature(getattr(cls, name))) for name in methods}
        assert got == methods, f"{cls.__name__} differs from Megatron-LM dev {DEV_COMMIT}"
    for cls, names in DEV_PROPERTIES.items():
        assert all(isinstance(inspect.getattr_static(cls, n), property) for n in names)
    # the stand-in chain defines nothing the dev line does not have
    own = {n for n, v in vars(ChunkedChainedOptimizer).items() if callable(v) and not n.startswith("__")}
    assert own == set(DEV_SIGNATURES[ChunkedChainedOptimizer])


@pytest.fixture
def chunked(mocker):
    from megatron.core.optimizer.optimizer import MegatronOptimizer

    for name in SURFACE:
        mocker.patch.object(MegatronOptimizer, name, create=True, new=getattr(ChunkedChainedOptimizer, name))


def chunked_rig(delay=True, pre_forward_sync=False, plan=None, **opt):
    # the chunked line's __post_init__ has turned the deprecated alias into this and reset the alias
    opt = {"chunked_optimizer_state_offload": True, "optimizer_state_offload_fraction": 1.0, **opt}
    cfg = harness.config_container(harness.optimizer_config(**opt))
    cfg.optimizer.reuse_grad_buf_for_mxfp8_param_ag = delay  # with overlap_param_gather: masters wait
    rig = harness.Rig(cfg=cfg)
    rig.optimizer = ChunkedChainedOptimizer([rig.dist_optimizer], rig.events)
    rig.optimizer.requires_pre_forward_sync = pre_forward_sync
    if plan is not None:  # where Megatron-Core keeps it: MegatronOptimizer._optimizer_state_offloader
        rig.dist_optimizer._optimizer_state_offloader = plan
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


def test_per_rank_lines_carry_the_plan_figures(chunked, caplog):
    caplog.set_level(logging.INFO, logger="bridge_fgo")
    bridge_fgo.patch()
    plan = PlanStandIn([torch.zeros(8, 8), torch.zeros(32)], state_dtypes=(torch.float32, torch.float32))
    rig = chunked_rig(plan=plan)
    loop = bridge_fgo.instrument.patcher._current.callsites.site(bridge_fgo.instrument.targets.target("train"))
    loop(lambda **kw: harness.run_steps(rig, steps=2), None, (),
         {"model": rig.model, "optimizer": rig.optimizer, "global_state": rig.global_state})
    lines = [r.getMessage() for r in caplog.records if "offload active" in r.getMessage()
             or "offload summary" in r.getMessage()]
    # 96 parameters' elements: exp_avg + exp_avg_sq (8 bytes) + fp32 master (4 bytes) each; 3 tensors a parameter
    assert lines == [
        "[rank 0] offload active: mode=chunked, 1 optimizer(s), 6 tensor(s), 1152 bytes offloaded per step",
        "[rank 0] offload summary: mode=chunked, steps=2, offload=2 release=2 reload=2 calls, "
        "2304 bytes offloaded, 2304 bytes reloaded",
    ]


def test_figures_unknown_when_the_plan_does_not_say(chunked, monkeypatch):
    bridge_fgo.patch()
    monkeypatch.delattr(PlanStandIn, "_estimated_bundle_bytes")  # another Megatron-Core revision
    rig = chunked_rig(plan=PlanStandIn([torch.zeros(4)], state_dtypes=(torch.float32,)))
    harness.run_steps(rig, steps=1)
    (s,) = bridge_fgo.status().sessions
    assert "bytes" not in s and s["bytes_offloaded"] is None
