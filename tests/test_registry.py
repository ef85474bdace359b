"""The generation registry and the target table drive the decisions, the patching and the status:
a generation or a target added to them is picked up everywhere without touching other modules."""
import sys

import pytest

import bridge_fgo
from bridge_fgo.instrument import diagnose as diagnose_mod, generations as adapters, targets
from bridge_fgo.instrument.generations import Adapter, Generation
from bridge_fgo.options import Options
from support import harness


class FourthAdapter(Adapter):
    def __init__(self, events):
        self.events = events

    def offload(self):
        self.events.add("fourth.offload")

    def release(self):
        self.events.add("fourth.release")

    def reload(self):
        self.events.add("fourth.reload")


class Fourth(Generation):
    """A made-up later Megatron-Core generation, declared as adapters/<generation>.py would."""

    name = mode = "fourth"
    meaning = "a fourth offload API"
    who = "the fourth offloader"
    flag = "cfg.optimizer.fourth_offload"
    native_wiring = ("fourth_offload_for_forward",)

    def detect(self, cls):
        return hasattr(cls, "fourth_offload_for_forward")

    def requested(self, cfg):
        return bool(getattr(cfg.optimizer, "fourth_offload", False))

    def refusals(self, cfg, options, inner_optimizers):
        return ["cfg.optimizer.lr=0.5: the fourth offloader refuses it"] if cfg.optimizer.lr == 0.5 else []

    def build(self, optimizer, cfg, dist_optimizers, options):
        return FourthAdapter(optimizer.events)

    def verdict(self):
        return "offload will run (mode auto) through the fourth offloader"


@pytest.fixture
def fourth(monkeypatch, mocker):
    from megatron.core.optimizer.optimizer import MegatronOptimizer

    monkeypatch.setattr(adapters, "GENERATIONS", (Fourth(), *adapters.GENERATIONS))
    mocker.patch.object(MegatronOptimizer, "fourth_offload_for_forward", create=True, new=lambda self: None)


def fourth_rig(**opt):
    return harness.Rig(cfg=harness.config_container(harness.optimizer_config(fourth_offload=True, **opt)))


def test_registry_order_and_names():
    assert [g.name for g in adapters.GENERATIONS] == ["chunked", "three-method", "none"]
    assert adapters.BUILTIN is adapters.GENERATIONS[-1] and adapters.BUILTIN.mode == "builtin"
    assert adapters.of_classes([object]) is adapters.BUILTIN  # nothing matched: none


def test_a_new_generation_is_detected_wired_and_reported(fourth):
    bridge_fgo.patch()
    rig = fourth_rig()
    harness.run_steps(rig, steps=1)
    assert rig.events == ["zero_grad_buffer", "zero_grad", "fourth.offload", "param-buffer copy", "fourth.release",
                          "forward-backward", "fourth.reload", "finalize(pg_collection=pg_collection)", "step",
                          "scheduler.step"]
    (s,) = bridge_fgo.status().sessions
    assert s["mode"] == "fourth"
    report = diagnose_mod.diagnose(Options())
    assert (report.generation, report.generation_meaning) == ("fourth", "a fourth offload API")
    assert report.offload_ready and report.verdict == "offload will run (mode auto) through the fourth offloader"


def test_a_new_generations_refusals_and_flag(fourth):
    bridge_fgo.patch()
    rig = fourth_rig(lr=0.5)
    with pytest.raises(bridge_fgo.BridgeFGOConfigError, match="the fourth offloader refuses it"):
        harness.run_steps(rig, steps=1)
    assert rig.events == []
    rig = harness.Rig()  # flag unset: left alone
    harness.run_steps(rig, steps=1)
    assert not any(e.startswith("fourth") for e in rig.events)


def test_a_new_generations_native_wiring_makes_bridgefgo_step_aside(fourth, monkeypatch, train_module):
    real = train_module.train_step

    def train_step(*args, **kwargs):
        args[3].fourth_offload_for_forward()
        return real(*args, **kwargs)

    monkeypatch.setattr(train_module, "train_step", train_step)
    assert bridge_fgo.patch().native_wiring == ["fourth_offload_for_forward"]


# -- the target table ---------------------------------------------------------------------------

def test_the_target_table():
    # pinned here by hand: everything else (patching, layout check, status, tests) derives from it
    assert [(t.name, t.module, t.role) for t in targets.TARGETS] == [
        ("train", "megatron.bridge.training.train", "loop"),
        ("train_step", "megatron.bridge.training.train", "step"),
        ("_handle_mxfp8_param_buffer_copy", "megatron.bridge.training.train", "release-site"),
        ("load_checkpoint", "megatron.bridge.training.checkpointing", "load"),
        ("calc_params_l2_norm", "megatron.bridge.training.train", "params-norm"),
        ("clip_qk", "megatron.bridge.training.train", "qk-clip"),
        ("save_checkpoint", "megatron.bridge.training.checkpointing", "save"),
        ("_build_model_and_main_param_groups", "megatron.core.optimizer.distrib_optimizer", "build"),
        ("__init__", "megatron.core.optimizer.optimizer", "build-whole"),
        ("DistributedOptimizer.__init__", "megatron.core.optimizer.distrib_optimizer", "adopt"),
        ("ParamAndGradBuffer.__init__", "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer",
         "fsdp-build"),
    ]
    assert [t.name for t in targets.TARGETS if t.optional] == ["ParamAndGradBuffer.__init__"]
    assert targets.target("__init__").qualname == (
        "megatron.core.optimizer.optimizer.Float16OptimizerWithFloat16Params.__init__")
    assert targets.target("_build_model_and_main_param_groups").qualname == (
        "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer._build_model_and_main_param_groups")
    # two classes' __init__: the key names the class, the attribute patched is __init__
    adopt = targets.target("DistributedOptimizer.__init__")
    assert adopt.attribute == "__init__" and adopt.qualname == (
        "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.__init__")
    assert [a.qualname for a in targets.ALIASES] == ["megatron.bridge.training.pretrain.train"]
    assert len({t.name for t in targets.TARGETS}) == len(targets.TARGETS)
    assert all(t.purpose for t in targets.TARGETS)


def test_problems_carry_their_target(monkeypatch, train_module):
    monkeypatch.delattr(train_module, "_handle_mxfp8_param_buffer_copy")
    layout = targets.inspect_layout({**{m: sys.modules[m] for m in targets.MODULES}, train_module.__name__: train_module})
    assert [(p.target, str(p)) for p in layout.problems] == [
        ("_handle_mxfp8_param_buffer_copy", "megatron.bridge.training.train._handle_mxfp8_param_buffer_copy is missing")]


def test_a_target_in_another_module_is_patched_all_or_none(monkeypatch, train_module):
    """A later target may live in another Bridge module with another role: the table is all it takes
    (here an existing role stands in for the new one)."""
    import megatron.bridge.training.checkpointing as ckpt

    extra = targets.Target("save_checkpoint", ckpt.__name__, targets.RELEASE_SITE, "a later target")
    monkeypatch.setattr(targets, "TARGETS", (*targets.TARGETS, extra))
    monkeypatch.setattr(targets, "MODULES", (*targets.MODULES, ckpt.__name__))
    original = ckpt.save_checkpoint
    report = bridge_fgo.patch()
    assert report.patched and report.targets["save_checkpoint"] is True
    assert ckpt.save_checkpoint is not original and ckpt.save_checkpoint.__wrapped__ is original
    assert diagnose_mod.diagnose(Options()).targets["save_checkpoint"] is True
    bridge_fgo.unpatch()
    assert ckpt.save_checkpoint is original
    # missing in its module: nothing at all is patched, and status names it
    monkeypatch.delattr(ckpt, "save_checkpoint")
    before = train_module.train_step
    report = bridge_fgo.patch()
    assert report.outcome == "not-patched" and train_module.train_step is before
    notes = diagnose_mod.diagnose(Options()).target_notes
    assert notes["save_checkpoint"] == f"not in {ckpt.__name__}"


def test_the_holders_of_an_object_are_its_top_level_bindings_found_by_identity(monkeypatch):
    """targets.holders_of, which patch() and unpatch() read for every target at once: for each object,
    every loaded module binding it at top level, in the order of sys.modules and of the module's names,
    as a scan of each module's names finds them; by identity alone (a wrapper that compares equal to
    another, as wrapt's proxies compare as what they wrap, is not it; a value whose == raises is passed by)."""
    import types

    import wrapt

    def f():
        pass

    def call(wrapped, instance, args, kwargs):
        return wrapped(*args, **kwargs)

    g, h = wrapt.FunctionWrapper(f, call), wrapt.FunctionWrapper(f, call)
    assert g == h and g is not h

    class Loud:
        __hash__ = object.__hash__

        def __eq__(self, other):
            raise AssertionError("compared")

    a, b = types.ModuleType("fgo_holders_a"), types.ModuleType("fgo_holders_b")
    a.f, a.g, a.loud, a.again = f, g, Loud(), f
    b.h, b.g = h, g
    for mod in (a, b):
        monkeypatch.setitem(sys.modules, mod.__name__, mod)

    def scanned(obj):
        out = []
        for mod in list(sys.modules.values()):
            try:
                ns = vars(mod)
            except TypeError:
                continue
            out += [(mod, key) for key, value in list(ns.items()) if value is obj]
        return out

    found = targets.holders_of([f, g, h])
    assert found == [scanned(f), scanned(g), scanned(h)]
    assert [[(m.__name__, key) for m, key in held] for held in found] == [
        [("fgo_holders_a", "f"), ("fgo_holders_a", "again")], [("fgo_holders_a", "g"), ("fgo_holders_b", "g")],
        [("fgo_holders_b", "h")]]
    assert list(targets.holders(g)) == found[1]
