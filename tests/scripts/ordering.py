"""One patch/import ordering in a fresh process; exits non-zero with a message if it went wrong.
Usage: ordering.py SCENARIO"""
import importlib
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))  # tests/: support
from support import te_free

te_free.install()
import bridge_fgo  # noqa: E402
from bridge_fgo.instrument.patcher import _Target  # noqa: E402
from bridge_fgo.instrument.targets import TARGETS  # noqa: E402

TRAIN, PRETRAIN = "megatron.bridge.training.train", "megatron.bridge.training.pretrain"


def wrapped_once(obj, name):
    assert isinstance(obj, _Target), f"{name} is not wrapped: {obj!r}"
    assert not isinstance(obj.__wrapped__, _Target), f"{name} is wrapped twice"


def check_patched():
    t = sys.modules[TRAIN]
    for target in TARGETS:
        wrapped_once(target.raw(sys.modules[target.module]), target.name)
    assert bridge_fgo.is_patched(), bridge_fgo.status()
    if PRETRAIN in sys.modules:
        assert sys.modules[PRETRAIN].train is t.train, "pretrain.train does not reach the wrapped train"


def check_unpatched():
    t = sys.modules[TRAIN]
    for target in TARGETS:
        assert not isinstance(target.raw(sys.modules[target.module]), _Target), \
            f"{target.name} still wrapped after unpatch"
    if PRETRAIN in sys.modules:
        assert sys.modules[PRETRAIN].train is t.train, "pretrain.train not restored"
        assert not isinstance(sys.modules[PRETRAIN].train, _Target)
    assert not bridge_fgo.is_patched()


scenario = sys.argv[1]
if scenario == "import-then-patch":
    importlib.import_module(TRAIN)
    bridge_fgo.patch()
    check_patched()
elif scenario == "patch-then-import":
    bridge_fgo.patch()
    assert TRAIN not in sys.modules and "torch" not in sys.modules
    assert bridge_fgo.status().outcome == "pending"
    importlib.import_module(TRAIN)
    check_patched()
elif scenario == "patch-twice":
    bridge_fgo.patch()
    importlib.import_module(TRAIN)
    bridge_fgo.patch()
    check_patched()
elif scenario == "patch-unpatch-patch":
    importlib.import_module(PRETRAIN)
    bridge_fgo.patch()
    check_patched()
    bridge_fgo.unpatch()
    check_unpatched()
    bridge_fgo.patch()
    check_patched()
    bridge_fgo.unpatch()
    check_unpatched()
elif scenario == "pretrain-imported-before-patch":
    importlib.import_module(PRETRAIN)
    report = bridge_fgo.patch()
    check_patched()
    assert "megatron.bridge.training.pretrain.train" in report.aliases, report.aliases
elif scenario == "pretrain-imported-after-patch":
    bridge_fgo.patch()
    importlib.import_module(TRAIN)
    importlib.import_module(PRETRAIN)
    check_patched()
    bridge_fgo.unpatch()  # an alias bound after patching is restored too
    check_unpatched()
else:
    sys.exit(f"unknown scenario {scenario}")
print("OK", scenario)
