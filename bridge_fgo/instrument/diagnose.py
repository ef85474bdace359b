"""What bridge_fgo would do in this environment, and why: `bridge-fgo status` and `bridge-fgo-run --check`.

Unlike status(), diagnose() imports Megatron-Bridge's target modules (and with them torch and
Megatron-Core): it answers before a run whether offload will happen, so it looks at the real objects
the patch would wrap. It patches nothing itself and decides with the functions the patch itself
uses (decide.py, targets.py, the generation registry); in a process that is patched (run under
bridge-fgo-run) it reports what the patch really did (patcher.applied()).
"""
from __future__ import annotations

import importlib
import sys
from typing import Dict, List, Optional, Tuple

from .. import report as rpt, versions as versions_mod
from . import decide, generations, patcher, targets
from .generations import Generation
from ..options import Options, env_name, flag_name, from_env


def _import(name: str) -> Tuple[Optional[object], Optional[str]]:
    try:
        return importlib.import_module(name), None
    except Exception as err:  # ImportError, but also whatever a half-broken install raises
        return None, f"{type(err).__name__}: {err}"


def _target_notes(layout: targets.Layout) -> Dict[str, str]:
    """Each target's own problems, by the target each problem names."""
    notes = {}
    for t in targets.TARGETS:
        own = [str(p) for p in layout.problems if p.target == t.name]
        if not layout.found[t.name] and t.optional and not own:
            notes[t.name] = f"{t.module} is not imported (it could not be): nothing to serve there"
        elif not layout.found[t.name]:
            notes[t.name] = f"not in {t.module}"
        elif own:
            notes[t.name] = "found, but " + "; ".join(own)
    return notes


def _alias(alias: targets.Alias, modules) -> Tuple[bool, str, bool]:
    """(bound to its target, note, blocks the patch)."""
    target = targets.target(alias.target)
    module, err = _import(alias.module)
    if module is None:
        return False, f"{alias.module} cannot be imported ({err})", False
    bound = vars(module).get(alias.name)
    if bound is None:
        return False, (f"{alias.module} binds no `{alias.name}`; {alias.callers} reach the loop some other "
                       "way (nothing to patch there)"), False
    if bound is vars(modules[target.module]).get(target.name):
        return True, f"the same function as {target.qualname}: patched with it", False
    return False, f"{alias.qualname} is not {target.qualname}: {alias.callers} would bypass the patch", True


def _mcore_meaning(generation: Optional[Generation], mcore: Optional[str]) -> str:
    if generation is not None:
        return generation.meaning
    if mcore is None:
        return "megatron-core is not installed"
    return f"megatron-core {mcore} is installed but its optimizer module cannot be imported"


def _mode_verdict(opts: Options, generation: Optional[Generation], mcore: str) -> Tuple[bool, str]:
    """The verdict once the patch is known to apply: does this mode offload?"""
    if opts.offload == "off":
        return False, ("offload will not run: offload=off patches but never offloads (a baseline through the "
                       f"same code path). To offload, use {flag_name('offload')} auto or builtin "
                       f"({env_name('offload')})")
    if generation is None and opts.offload == "auto":
        return False, f"offload will not run: {_mcore_meaning(generation, mcore)}"
    chosen = decide.way(opts, generation)
    if chosen is None:
        return False, generation.unavailable_verdict(mcore)
    text = chosen.verdict()
    if opts.offload == "builtin" and generation is not None and generation.self_driven:
        text += f"; keep {generation.flag} False, or two offloaders would move the same states (refused)"
    return True, text


def host_memory_line() -> str:
    """What the builtin engine may pin here. Its own need (the optimizer states' bytes per rank) is
    known only once the model exists: the engine checks it before pinning and logs it per rank."""
    from .. import hostmem

    mem, ranks = hostmem.host_memory(), hostmem.local_ranks()
    available = f"{hostmem.fmt_bytes(mem.bytes)} available ({mem.source})" if mem else "available memory unknown"
    return (f"{available} for {ranks.count} local rank(s) ({ranks.source}); each rank pins about 12 bytes per "
            "parameter of its data-parallel shard (checked and logged before the first step)")


def inner_optimizer_line() -> Optional[str]:
    """The Adam class Megatron-Core binds (megatron/core/optimizer/__init__.py: Transformer Engine's
    FusedAdam when it imports, else apex's, else torch's), read from the module once loaded, and
    whether the builtin engine's streamed step serves it."""
    from ..engine import contracts

    mo = sys.modules.get("megatron.core.optimizer")
    if mo is None:
        return None
    cls = vars(mo).get("Adam")
    if cls is None:
        return None
    if vars(mo).get("USING_PYTORCH_OPTIMIZER"):
        text = "torch AdamW (torch.optim.AdamW; torch.optim.Adam without decoupled weight decay)"
        known = True
    else:
        known = contracts.path_of(cls) in contracts.CONTRACTS
        text = contracts.describe_class(cls)
    return text + ("; the streamed step serves it" if known else
                   "; the streamed step does not know it (refused; chunk_mb=0 serves it)")


def diagnose(options: Optional[Options] = None) -> rpt.Report:
    """The status report for this environment, with its verdict. Imports Megatron-Bridge's target
    modules; raises BridgeFGOOptionError for a bad BRIDGE_FGO_* value when `options` is not given."""
    opts = options if options is not None else from_env()
    versions = versions_mod.versions()
    bridge, mcore = versions.get("megatron-bridge"), versions.get("megatron-core")
    generation = generations.installed()
    report = rpt.Report(
        patched=False, outcome=rpt.NOT_PATCHED, mode=opts.offload, strict=opts.strict, chunk_mb=opts.chunk_mb,
        gpu_budget_gib=opts.gpu_budget_gib,
        generation=generation.name if generation else None, versions=versions, predicted=True,
        offload_ready=False, executable=sys.executable, generation_meaning=_mcore_meaning(generation, mcore),
        host_memory=host_memory_line(),
    )
    modules = {}
    for name in targets.MODULES:
        modules[name], import_error = _import(name)
        if modules[name] is not None:
            continue
        if bridge is None:
            report.reason = "megatron-bridge is not installed"
            report.verdict = (f"offload will not run: megatron-bridge is not installed in this Python "
                              f"({sys.executable}), so there is no training loop to patch. Install "
                              "megatron-bridge here, or run bridge-fgo with the Python that trains")
        else:
            report.reason = f"{name} cannot be imported ({import_error})"
            report.verdict = (f"offload will not run: megatron-bridge {bridge} is installed but {name} cannot "
                              f"be imported ({import_error}), so nothing can be patched. Fix that import "
                              f"first: python -c 'import {name}'")
        report.problems = [report.reason]
        return report

    report.inner_optimizer = inner_optimizer_line()
    layout = targets.inspect_layout(modules)
    problems: List[targets.Problem] = list(layout.problems)
    found, notes = dict(layout.found), _target_notes(layout)
    bound_aliases = []
    for alias in targets.ALIASES:
        ok, note, blocks = _alias(alias, modules)
        found[alias.qualname], notes[alias.qualname] = ok, note
        if ok:
            bound_aliases.append(alias.qualname)
        if blocks:
            problems.append(targets.Problem(note, alias.qualname))
    report.targets, report.target_notes = found, notes
    report.problems = [str(p) for p in problems]
    report.native_wiring = list(layout.native_wiring)

    bridge_v = bridge or "unknown"
    live = patcher.applied()  # bridge-fgo status run inside a patched process: what really happened
    if live is not None:
        report.predicted = False
        report.patched, report.outcome, report.reason = live.patched, live.outcome, live.reason
        report.aliases, report.sessions = live.aliases, live.sessions
    else:
        report.aliases = bound_aliases
        report.outcome, report.reason = decide.patch_outcome(layout.native_wiring, problems, bridge_v)

    if opts.disable:
        if live is None:
            report.outcome, report.reason = rpt.NOT_PATCHED, "disabled"
        report.verdict = (f"offload will not run: bridge_fgo is disabled ({env_name('disable')} or "
                          f"{flag_name('disable')}), nothing is patched. To offload, unset {env_name('disable')} "
                          f"/ drop {flag_name('disable')}")
        return report
    if layout.native_wiring:
        wired = generations.of_wiring(layout.native_wiring)
        flag = wired.flag if wired is not None else "the offload flag"
        if opts.offload == "auto":
            report.offload_ready = True
            report.verdict = (f"offload will run through megatron-bridge's own wiring when {flag} is set; "
                              "bridge_fgo steps aside so no offload call runs twice")
        else:
            report.verdict = (f"offload={opts.offload} has no effect: megatron-bridge {bridge_v} wires offload "
                              f"itself and bridge_fgo steps aside. Use offload=auto and set {flag}=True")
        return report
    if problems:
        report.verdict = (f"offload will not run: nothing would be patched, because "
                          f"{'; '.join(map(str, problems))}. Fix: use a megatron-bridge this bridge_fgo supports "
                          "(see its README) or upgrade bridge_fgo")
        return report
    report.offload_ready, report.verdict = _mode_verdict(opts, generation, mcore or "unknown")
    return report


def exit_code(report: rpt.Report) -> int:
    """0 when offload will run in the chosen mode, 1 when it will not."""
    return 0 if report.offload_ready else 1
