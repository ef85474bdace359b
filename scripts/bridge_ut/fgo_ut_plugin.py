"""pytest plugin for scripts/bridge_unit_tests.sh: Megatron-Bridge's own unit tests, under bridge_fgo.

Loaded with `-p fgo_ut_plugin` (scripts/bridge_ut/ on PYTHONPATH) in the controller and in every xdist worker:

- on import: tests/support/te_free.py's import hook (Transformer Engine is absent here), before Bridge's
  conftest imports megatron.bridge;
- before the initial conftests load (so before any Bridge module or test is imported):
  bridge_fgo.patch(offload=MODE) where FGO_UT_MODE is off, auto or builtin; nothing when it is `none`;
- at session start: imports bridge_fgo's target modules and refuses to run if bridge_fgo is not this
  checkout's, if a patched way is not patched, or if megatron.bridge is not the installed package (it
  must not come from the source tree under test);
- FGO_UT_TIMEOUT seconds (default 300) per test: a test still running then dumps its stack and ends
  its xdist worker (faulthandler), which pytest-xdist reports as a failure and replaces. pytest-timeout
  is not in the environment: its `timeout` marker (tests/unit_tests/training/test_tokenizer.py) is
  registered, inert, so that the file collects.
"""
from __future__ import annotations

import faulthandler
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _te_free():
    """tests/support/te_free.py, loaded by path: Bridge's tests are a package named `tests` too."""
    spec = importlib.util.spec_from_file_location("fgo_ut_te_free", os.path.join(ROOT, "tests", "support", "te_free.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_te_free().install()

MODE = os.environ.get("FGO_UT_MODE", "none")
TIMEOUT = float(os.environ.get("FGO_UT_TIMEOUT", "300"))
if MODE not in ("none", "off", "auto", "builtin"):
    raise pytest.UsageError(f"FGO_UT_MODE={MODE!r}: expected none, off, auto or builtin")


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args):
    if MODE != "none":
        import bridge_fgo

        bridge_fgo.patch(offload=MODE)


def pytest_configure(config):
    config.addinivalue_line("markers", "timeout(seconds): pytest-timeout's marker, inert here (FGO_UT_TIMEOUT applies)")


def _where():
    import importlib

    import bridge_fgo
    import megatron.bridge
    from bridge_fgo.instrument import targets

    for name in targets.MODULES:  # the patch applies once all of them are imported
        importlib.import_module(name)
    return os.path.abspath(bridge_fgo.__file__), os.path.abspath(megatron.bridge.__file__)


def pytest_sessionstart(session):
    fgo, bridge = _where()
    if not fgo.startswith(ROOT + os.sep):
        raise pytest.UsageError(f"bridge_fgo imported from {fgo}, not from {ROOT}")
    if bridge.startswith(str(session.config.rootpath) + os.sep):
        raise pytest.UsageError(f"megatron.bridge imported from the source tree ({bridge}), not the installed one")
    import bridge_fgo

    if MODE != "none" and not bridge_fgo.is_patched():
        raise pytest.UsageError(f"bridge_fgo.patch(offload={MODE!r}) did not patch: {bridge_fgo.status()}")


def pytest_report_header(config):
    import bridge_fgo

    fgo, bridge = _where()
    patched = f"patch(offload={MODE!r}): {bridge_fgo.status().outcome}" if MODE != "none" else "unpatched"
    return [f"bridge_fgo: {fgo} ({patched})", f"megatron.bridge: {bridge}"]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if TIMEOUT > 0:
        faulthandler.dump_traceback_later(TIMEOUT, exit=True)
    try:
        yield
    finally:
        if TIMEOUT > 0:
            faulthandler.cancel_dump_traceback_later()
