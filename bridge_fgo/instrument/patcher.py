"""patch(), unpatch(), status(): registering the import hook, wrapping all targets or none,
and undoing it all."""
from __future__ import annotations

import logging
import sys
import threading
from typing import Dict, List, Optional, Tuple

import wrapt

from .. import log, options as options_mod, report as rpt, versions
from . import decide, generations, targets
from ..errors import BridgeFGOError
from ..log import logger


class _Target(wrapt.FunctionWrapper):
    """A bridge_fgo wrapper around one of Bridge's functions (its own type marks it as ours)."""


class _Patch:
    def __init__(self, options: options_mod.Options):
        self.options = options
        self.active = True
        self.outcome = rpt.PENDING
        self.reason: Optional[str] = None
        self.layout: Optional[targets.Layout] = None
        self.modules: Optional[Dict[str, object]] = None  # Bridge's target modules, once all are loaded
        self.callsites = None
        # target name -> (original, wrapper, holder, the attribute bound there)
        self.wrappers: Dict[str, Tuple[object, _Target, object, str]] = {}
        self.aliases: List[str] = []


_lock = threading.RLock()
_current: Optional[_Patch] = None
_hook_registered = False


def _bridge_version() -> str:
    return versions.version("megatron-bridge") or "unknown"


def _on_target_module(_module) -> None:
    """wrapt post-import hook for each module in targets.MODULES (runs at once if already imported).
    The patch applies when the last of them has been imported: all targets or none."""
    with _lock:
        p = _current
        if p is None or not p.active or p.modules is not None:
            return
        modules = {name: sys.modules.get(name) for name in targets.MODULES}
        # a module one of them imports fires its hook while that one is still being executed: wait for
        # that one's own hook (importlib marks a module being executed with __spec__._initializing;
        # the module whose hook fires is done, though still marked)
        if all(m is not None and (m is _module or not getattr(getattr(m, "__spec__", None), "_initializing", False))
               for m in modules.values()):
            _apply(p, modules)


def _apply(p: _Patch, modules) -> None:
    p.modules = modules
    p.layout = layout = targets.inspect_layout(modules)
    outcome, reason = decide.patch_outcome(layout.native_wiring, layout.problems, _bridge_version())
    if outcome == rpt.STEPPED_ASIDE:
        p.outcome, p.reason = outcome, reason
        log.once(("aside",), logging.INFO, "%s", p.reason)
        return
    if outcome == rpt.NOT_PATCHED:
        p.outcome, p.reason = outcome, reason
        if p.options.strict:
            raise BridgeFGOError(p.reason)
        log.once(("layout",), logging.WARNING, "%s", p.reason)
        return
    from .callsites import CallSites

    cs = CallSites(p.options, layout)
    # Build every wrapper first, then bind them all: all targets or none.
    built = {}
    modules = targets.loaded(modules)
    for t in targets.TARGETS:
        if not layout.found[t.name]:  # an optional target whose module is absent (inspect_layout)
            continue
        holder = t.holder(modules[t.module])
        original = t.raw(modules[t.module])  # as stored: a classmethod stays one, wrapt binds it
        if isinstance(original, _Target):  # a stale wrapper from an earlier patch: wrap what it wraps
            original = original.__wrapped__
        built[t.name] = (holder, original, _Target(original, cs.site(t)), t.owner is None, t.attribute)
        cs.originals[t.name] = original
    # module-level targets only: `from module import name` elsewhere binds the same function
    at_module = [(name, holder, orig) for name, (holder, orig, _, module_level, _) in built.items() if module_level]
    aliases = [(mod, key, name) for (name, holder, _), held in zip(at_module, targets.holders_of(
               [orig for _, _, orig in at_module])) for mod, key in held if mod is not holder]
    for holder, _, wrapper, _, attribute in built.values():
        setattr(holder, attribute, wrapper)
    for mod, key, name in aliases:
        setattr(mod, key, built[name][2])
    p.callsites = cs
    if p.options.offload != "off":
        # the engine's modules imported now, beside Megatron's, not at their first use inside Bridge's timed setup
        # (about 0.1 s on a 2-core host); none imports more than torch, already loaded with Megatron here
        from ..engine import (adoption, construction, contracts, fsdp, fsdp_construction,  # noqa: F401
                              onewindow, streamed)
    p.wrappers = {name: (orig, wrapper, holder, attribute) for name, (holder, orig, wrapper, _, attribute) in built.items()}
    p.aliases = sorted(f"{mod.__name__}.{key}" for mod, key, _ in aliases)
    p.outcome = outcome
    log.once(("patched",), logging.INFO,
             "%spatched megatron-bridge %s (%s%s); offload mode=%s; megatron-core %s offload: %s",
             log.rank_prefix(), _bridge_version(), ", ".join(built), f"; aliases {', '.join(p.aliases)}" if p.aliases else "",
             p.options.offload, versions.megatron_core_version() or "unknown", _generation_name() or "unknown")


def _generation_name() -> Optional[str]:
    g = generations.installed_if_loaded()
    return g.name if g is not None else None


def _describe(opts: options_mod.Options) -> str:
    return ", ".join(f"{o.name}={getattr(opts, o.name)!r}" for o in options_mod.OPTIONS if o.name != "disable")


def patch(*, strict: Optional[bool] = None, offload: Optional[str] = None,
          chunk_mb: Optional[int] = None, gpu_budget_gib: Optional[float] = None) -> rpt.Report:
    """Wire optimizer-state offload into Megatron-Bridge's training loop, now or when it is imported.

    strict: raise BridgeFGOError where bridge_fgo would otherwise warn and not act.
    offload: 'auto' (default), 'builtin' or 'off'.
    chunk_mb: the builtin engine's window in MB, an int >= 0 (0 = one window; default
    options.DEFAULT_CHUNK_MB).
    gpu_budget_gib: the builtin engine keeps as many parameters' states on the GPU as fit under this
    per-rank peak (GiB) and streams the rest; None (default): everything is offloaded.
    Unset arguments come from BRIDGE_FGO_* variables (options.OPTIONS); a bad value raises
    BridgeFGOOptionError (a ValueError).
    """
    global _current, _hook_registered
    opts = options_mod.from_env(strict=strict, offload=offload, chunk_mb=chunk_mb, gpu_budget_gib=gpu_budget_gib)
    with _lock:
        if _current is not None and _current.active:
            if opts != _current.options:  # e.g. a script's own patch(offload=...) under bridge-fgo-run
                logger.warning("bridge_fgo.patch(%s): already patched with %s; the new options are ignored "
                               "(unpatch() first to change them)", _describe(opts), _describe(_current.options))
            else:
                logger.info("bridge_fgo.patch(): already patched; nothing done")
            return status()
        _current = _Patch(opts)
        if opts.disable:
            _current.outcome, _current.reason = rpt.NOT_PATCHED, "disabled"
            log.once(("disabled",), logging.INFO, "bridge_fgo disabled by %s: nothing patched",
                     options_mod.env_name("disable"))
            return status()
        try:
            if not _hook_registered:
                for name in targets.MODULES:
                    wrapt.register_post_import_hook(_on_target_module, name)
                _hook_registered = True
            else:  # the hooks fired long ago: apply now if every module is there
                _on_target_module(None)
        except BaseException:
            _current.active = False
            raise
        return status()


def unpatch() -> rpt.Report:
    """Restore every original object (aliases and finalize functions too); states end resident."""
    with _lock:
        p = _current
        if p is None or not p.active:
            logger.info("bridge_fgo.unpatch(): not patched; nothing done")
            return status()
        try:
            if p.callsites is not None:
                p.callsites.close()
        finally:
            # every binding of our wrappers, wherever they went (aliases bound after patching too)
            bound = targets.holders_of([wrapper for _, wrapper, _, _ in p.wrappers.values()])
            for (original, wrapper, holder, attribute), held in zip(p.wrappers.values(), bound):
                if vars(holder).get(attribute) is wrapper:  # a class attribute is bound in one place only
                    setattr(holder, attribute, original)
                for mod, key in held:
                    setattr(mod, key, original)
            p.active = False
            p.outcome = rpt.UNPATCHED
            log.reset_once()
        logger.info("bridge_fgo unpatched")
        return status()


def synchronize() -> None:
    """Wait for every copy bridge_fgo has in flight. The builtin engine's last device-to-host copies
    of an update overlap the next forward pass; Megatron-Core's methods that read optimizer state
    (state_dict, sharded_state_dict, ...) wait for them by themselves. Call this before reading
    `optimizer.optimizer.state` or the master weights directly between steps."""
    p = _current
    if p is not None and p.callsites is not None:
        p.callsites.synchronize()


def is_patched() -> bool:
    p = _current
    return bool(p is not None and p.active and p.outcome == rpt.PATCHED)


def applied() -> Optional[rpt.Report]:
    """This process's live patch once it has looked at Bridge (patched, stepped aside or refused its
    layout), as status() reports it; None when patch() was not called, is disabled, undone, or still
    waiting for Bridge to be imported. `bridge-fgo status` reads it instead of predicting."""
    p = _current
    if p is None or not p.active or p.modules is None:
        return None
    return status()


def status() -> rpt.Report:
    """The report at any time: what was patched, the mode, and why not if not."""
    p = _current
    reason = p.reason if p is not None else "patch() was not called"
    if p is not None:
        opts = p.options
    else:
        try:
            opts = options_mod.from_env()
        except BridgeFGOError as err:  # status() reports, it never raises
            opts, reason = options_mod.Options(), f"patch() was not called; {err}"
    layout = p.layout if p is not None else None
    outcome = p.outcome if p is not None else rpt.NOT_PATCHED
    sessions = [s.snapshot() for s in p.callsites.registry.sessions()] if p is not None and p.callsites else []
    return rpt.Report(
        patched=bool(p is not None and p.active and outcome == rpt.PATCHED),
        outcome=outcome,
        mode=opts.offload,
        strict=opts.strict,
        chunk_mb=opts.chunk_mb,
        gpu_budget_gib=opts.gpu_budget_gib,
        generation=_generation_name(),
        versions=versions.versions(),
        targets=dict(layout.found) if layout else {},
        aliases=list(p.aliases) if p is not None else [],
        native_wiring=list(layout.native_wiring) if layout else [],
        reason=reason,
        sessions=sessions,
    )
