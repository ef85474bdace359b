"""patch(), unpatch(), status(): registering the import hook, wrapping all targets or none,
and undoing it all."""
from __future__ import annotations

import logging
import sys
import threading
from typing import Dict, List, Optional, Tuple

import wrapt

from . import generations, log, options as options_mod, report as rpt, targets
from .errors import BridgeFGOError
from .log import logger


class _Target(wrapt.FunctionWrapper):
    """A bridge_fgo wrapper around one of Bridge's functions (its own type marks it as ours)."""


class _Patch:
    def __init__(self, options: options_mod.Options):
        self.options = options
        self.active = True
        self.outcome = rpt.PENDING
        self.reason: Optional[str] = None
        self.layout: Optional[targets.Layout] = None
        self.module = None
        self.callsites = None
        self.wrappers: Dict[str, Tuple[object, _Target]] = {}
        self.aliases: List[str] = []


_lock = threading.RLock()
_current: Optional[_Patch] = None
_hook_registered = False


def _bridge_version() -> str:
    return generations.version("megatron-bridge") or "unknown"


def _on_train_module(module) -> None:
    """wrapt post-import hook for megatron.bridge.training.train (runs at once if already imported)."""
    with _lock:
        p = _current
        if p is None or not p.active or p.module is not None:
            return
        _apply(p, module)


def _apply(p: _Patch, module) -> None:
    p.module = module
    p.layout = layout = targets.inspect_layout(module)
    if layout.native_wiring:
        p.outcome = rpt.STEPPED_ASIDE
        p.reason = (f"megatron-bridge {_bridge_version()} already calls {', '.join(layout.native_wiring)} in its "
                    "training loop; bridge_fgo steps aside so no offload call runs twice")
        log.once(("aside",), logging.INFO, "%s", p.reason)
        return
    if not layout.recognised:
        p.outcome = rpt.NOT_PATCHED
        p.reason = (f"megatron-bridge {_bridge_version()} has a training loop bridge_fgo does not recognise: "
                    f"{'; '.join(layout.problems)}. Nothing was patched. Fix: use a megatron-bridge this "
                    "bridge_fgo supports (see its README) or upgrade bridge_fgo")
        if p.options.strict:
            raise BridgeFGOError(p.reason)
        log.once(("layout",), logging.WARNING, "%s", p.reason)
        return
    from .callsites import CallSites

    cs = CallSites(p.options, layout)
    sites = {targets.TRAIN: cs.train, targets.TRAIN_STEP: cs.train_step, targets.COPY_HELPER: cs.copy_helper}
    # Build every wrapper first, then bind them all: all targets or none.
    built = {}
    for name, site in sites.items():
        original = getattr(module, name)
        if isinstance(original, _Target):  # a stale wrapper from an earlier patch: wrap what it wraps
            original = original.__wrapped__
        built[name] = (original, _Target(original, site))
    aliases = [(mod, key, name) for name, (orig, _) in built.items()
               for mod, key in targets.holders(orig) if mod is not module]
    for name, (_, wrapper) in built.items():
        setattr(module, name, wrapper)
    for mod, key, name in aliases:
        setattr(mod, key, built[name][1])
    p.callsites, p.wrappers = cs, built
    p.aliases = sorted(f"{mod.__name__}.{key}" for mod, key, _ in aliases)
    p.outcome = rpt.PATCHED
    log.once(("patched",), logging.INFO,
             "%spatched megatron-bridge %s (%s%s); offload mode=%s; megatron-core %s offload: %s",
             log.rank_prefix(), _bridge_version(), ", ".join(built), f"; aliases {', '.join(p.aliases)}" if p.aliases else "",
             p.options.offload, generations.megatron_core_version() or "unknown",
             generations.installed_if_loaded() or "unknown")


def _describe(opts: options_mod.Options) -> str:
    return f"offload={opts.offload!r}, strict={opts.strict}"


def patch(*, strict: Optional[bool] = None, offload: Optional[str] = None) -> rpt.Report:
    """Wire optimizer-state offload into Megatron-Bridge's training loop, now or when it is imported.

    strict: raise BridgeFGOError where bridge_fgo would otherwise warn and not act.
    offload: 'auto' (default), 'builtin' or 'off'. Unset arguments come from BRIDGE_FGO_* variables.
    """
    global _current, _hook_registered
    opts = options_mod.from_env(strict=strict, offload=offload)
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
                wrapt.register_post_import_hook(_on_train_module, targets.TRAIN_MODULE)
                _hook_registered = True
            elif targets.TRAIN_MODULE in sys.modules:  # the hook fired long ago: apply now
                _on_train_module(sys.modules[targets.TRAIN_MODULE])
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
            for original, wrapper in p.wrappers.values():
                # every binding of our wrapper, wherever it went (aliases bound after patching too)
                for mod, key in list(targets.holders(wrapper)):
                    setattr(mod, key, original)
            p.active = False
            p.outcome = rpt.UNPATCHED
            log.reset_once()
        logger.info("bridge_fgo unpatched")
        return status()


def is_patched() -> bool:
    p = _current
    return bool(p is not None and p.active and p.outcome == rpt.PATCHED)


def status(*, options=None, outcome=None, reason=None) -> rpt.Report:
    """The report at any time: what was patched, the mode, and why not if not."""
    p = _current
    if options is None and p is None:
        try:
            options = options_mod.from_env()
        except BridgeFGOError as err:  # status() reports, it never raises
            options, reason = options_mod.Options(), reason or f"patch() was not called; {err}"
    opts = options or p.options
    layout = p.layout if p is not None else None
    outcome = outcome or (p.outcome if p is not None else rpt.NOT_PATCHED)
    reason = reason if reason is not None else (p.reason if p is not None else "patch() was not called")
    sessions = [s.snapshot() for s in p.callsites.registry.sessions()] if p is not None and p.callsites else []
    return rpt.Report(
        patched=bool(p is not None and p.active and outcome == rpt.PATCHED),
        outcome=outcome,
        mode=opts.offload,
        strict=opts.strict,
        generation=generations.installed_if_loaded(),
        versions=generations.versions(),
        targets=dict(layout.found) if layout else {},
        aliases=list(p.aliases) if p is not None else [],
        native_wiring=list(layout.native_wiring) if layout else [],
        reason=reason,
        sessions=sessions,
    )
