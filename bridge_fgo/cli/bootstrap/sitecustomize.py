"""bridge-fgo-run's bootstrap: Python's `site` imports this at the start of every process whose
PYTHONPATH holds this directory (torchrun's agent and each worker alike).

It chains to the sitecustomize Python would have imported without bridge-fgo-run, then calls
bridge_fgo.patch(), which reads the BRIDGE_FGO_* variables and registers a post-import hook for
Megatron-Bridge's train module, nothing else. It imports neither torch nor Megatron, so a process
that never imports Megatron-Bridge pays only for bridge_fgo's and wrapt's small modules.

Kept to plain syntax: any Python that inherits the PYTHONPATH imports it, whatever its version.
"""
import importlib
import importlib.util
import logging
import os
import sys

# On `sys`, not in this module: it survives reload() and a second import under another name.
_MARK = "_bridge_fgo_bootstrapped"
_HERE = os.path.dirname(os.path.realpath(__file__))
_FORMAT = "bridge_fgo %(levelname)s: %(message)s"

_log = logging.getLogger("bridge_fgo")


def _is_here(entry, here):
    try:
        return os.path.realpath(entry or os.curdir) == here
    except (TypeError, ValueError):  # sys.path may hold anything
        return False


def _chain(here):
    """Import the sitecustomize that Python would have found without us (as ddtrace's bootstrap does):
    with our module out of sys.modules and our directory off sys.path while it is looked for.
    Returns the error message when it failed (logged once our handler is in place)."""
    ours = sys.modules.pop("sitecustomize", None)
    removed = [(i, p) for i, p in enumerate(sys.path) if _is_here(p, here)]
    for i, _ in reversed(removed):
        del sys.path[i]
    try:
        try:
            spec = importlib.util.find_spec("sitecustomize")
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            return None
        try:
            importlib.import_module("sitecustomize")
        except Exception as err:  # what site.py does for a failing sitecustomize: say so, go on
            import traceback

            detail = traceback.format_exc() if sys.flags.verbose else "%s: %s" % (type(err).__name__, err)
            return "error in sitecustomize %s: %s" % (getattr(spec, "origin", "?"), detail)
        return None
    finally:
        if "sitecustomize" not in sys.modules and ours is not None:
            sys.modules["sitecustomize"] = ours
        # back where they were, for anyone reading sys.path; imports are not affected
        for i, p in removed:
            sys.path.insert(min(i, len(sys.path)), p)


class _UnlessTheUserLogs(logging.StreamHandler):
    """Prints bridge_fgo's lines on stderr only while the root logger has no handler. Once the user
    (or Megatron, Bridge, a job's logging config) configures one, the lines reach it by propagation
    and this handler steps back, so each line is printed once, where the user's lines go."""

    def emit(self, record):
        if not logging.getLogger().handlers:
            super().emit(record)


def _handler():
    """Per-rank INFO lines must be visible under the launcher; a logger the user configured is kept."""
    if _log.handlers:
        return
    handler = _UnlessTheUserLogs()
    handler.setFormatter(logging.Formatter(_FORMAT))
    _log.addHandler(handler)
    if _log.level == logging.NOTSET:
        _log.setLevel(logging.INFO)


def _envflags():
    """bridge_fgo's variable names and boolean words, from bridge_fgo/envflags.py by its path: readable
    even where bridge_fgo itself cannot be imported (and never importable from PYTHONPATH as `envflags`)."""
    path = os.path.join(os.path.dirname(os.path.dirname(_HERE)), "envflags.py")
    spec = importlib.util.spec_from_file_location("_bridge_fgo_envflags", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _failed(msg, *args, **kwargs):
    """Not patched: an error line, and with BRIDGE_FGO_STRICT the process stops (exit status 2).
    Without it, processes that never train (tools, the launcher's agent) must keep working.
    BRIDGE_FGO_DISABLE wins over strict: disabled, nothing was to be patched, so nothing failed."""
    flags = _envflags()
    if flags.is_set(os.environ, "disable"):
        _log.info("%s is set: nothing patched; " + msg, flags.env_name("disable"), *args)
        return
    _log.error(msg, *args, **kwargs)
    if flags.is_set(os.environ, "strict"):
        _log.error("%s is set: stopping (exit status 2)", flags.env_name("strict"))
        for h in _log.handlers:
            h.flush()
        sys.stderr.flush()
        os._exit(2)  # SystemExit raised from sitecustomize is a fatal startup error, not an exit


def _patch():
    try:
        import bridge_fgo
    except Exception as err:  # another interpreter than the one bridge_fgo is installed in
        _failed("bridge_fgo cannot be imported by %s (%s: %s): this process is not patched",
                sys.executable, type(err).__name__, err)
        return
    try:
        bridge_fgo.patch()
    except bridge_fgo.BridgeFGOOptionError as err:
        _failed("%s: this process is not patched", err)
    except Exception as err:
        _failed("bridge_fgo.patch() failed (%s: %s): this process is not patched", type(err).__name__, err,
                exc_info=True)


def _main():
    if getattr(sys, _MARK, False):
        return
    setattr(sys, _MARK, True)
    chain_error = _chain(_HERE)
    _handler()
    if chain_error:
        _log.error("%s", chain_error)
    _patch()


_main()
