"""Tests run against the real, installed megatron-bridge / megatron-core on CPU: 0.6.2 / 0.19.2 in
`.venv`, and each release of requirements/releases.conf in its own environment
(scripts/test_releases.sh). Tests name versions through BRIDGE / MCORE below, never as literals.

Transformer Engine cannot be installed here; the one Bridge module that imports it at module level
is loaded with that import neutralised (tests/support/te_free.py), nothing else is faked.
"""
import gc
import importlib.metadata
import logging
import os
import subprocess
import sys

import pytest

from support import te_free

te_free.install()

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "scripts")
BRIDGE = importlib.metadata.version("megatron-bridge")  # what messages must name, e.g. "0.6.2"
MCORE = importlib.metadata.version("megatron-core")


def pythonpath(*entries):
    """PYTHONPATH for a test's subprocess: the entries the test needs, then this checkout, so the
    subprocess (and the venv's console scripts) import the bridge_fgo under test even where the
    venv's editable install points at another checkout (a git worktree)."""
    return os.pathsep.join([*entries, ROOT])


_last_module = [None]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """At the first test of each test file that this process runs, before its fixtures: what lives then
    (the imported modules, torch's, Megatron's and Bridge's included, 0.7 M objects) is set aside from
    garbage collection (gc.freeze), after one collection of what earlier tests left. A collection then
    walks only what tests make since: 0.3 s less for each gc.collect() of a test, of Megatron-Core's
    checkpoint code and of bridge_fgo's saves. Only at a file's start, where the earlier file's
    module-scoped fixtures are torn down and this one's not yet made, so nothing a test makes is set
    aside (nor while pytest keeps the frames of a test that just failed, sys.last_value); re-done
    there after a test's own gc.unfreeze() (test_resume_dp.py)."""
    module = item.nodeid.split("::")[0]
    if module != _last_module[0]:
        _last_module[0] = module
        if getattr(sys, "last_value", None) is None:
            gc.collect()
            gc.freeze()


@pytest.fixture(autouse=True)
def _clean_patch(monkeypatch):
    """Every test starts and ends unpatched, with no BRIDGE_FGO_* variables."""
    for key in list(os.environ):
        if key.startswith("BRIDGE_FGO_"):
            monkeypatch.delenv(key)
    _unpatch()
    yield
    _unpatch()


def _unpatch():
    """bridge_fgo.unpatch() where a patch is live. Where none is, it would only log that it does nothing
    and report status(), whose versions are read from the installed packages' metadata (7 ms)."""
    import bridge_fgo
    from bridge_fgo.instrument import patcher

    if patcher._current is not None and patcher._current.active:
        bridge_fgo.unpatch()


@pytest.fixture(autouse=True)
def _checked_passes():
    """Every pass of a streamed update reads only whole storage (support/harness.py)."""
    from support import harness

    with harness.checked_passes():
        yield


@pytest.fixture
def train_module():
    import megatron.bridge.training.train as train_module

    return train_module


@pytest.fixture
def three_method(mocker, train_module):
    """Megatron-Core as on the dev line of 2026-01..08: the real DistributedOptimizer gains the three
    methods (each records its call on the stand-in optimizer's event list)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for method, event in (("offload_states", "offload"), ("release_offloaded_gpu_states", "release"),
                          ("reload_offloaded_states", "reload")):
        mocker.patch.object(DistributedOptimizer, method, create=True,
                            new=(lambda ev: lambda self: self.events.add(ev))(event))
    return DistributedOptimizer


@pytest.fixture
def caplog_fgo(caplog):
    caplog.set_level(logging.INFO, logger="bridge_fgo")
    return caplog


def run_python(code_or_args, env=None, timeout=300, cwd=None):
    """Run a fresh interpreter (the venv's), returning the CompletedProcess."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("BRIDGE_FGO_")}
    full_env["PYTHONPATH"] = pythonpath()
    full_env.update(env or {})
    full_env.setdefault("PYTHONWARNINGS", "ignore")
    args = code_or_args if isinstance(code_or_args, list) else ["-c", code_or_args]
    return subprocess.run([sys.executable, *args], env=full_env, capture_output=True, text=True,
                          timeout=timeout, cwd=cwd or ROOT)
