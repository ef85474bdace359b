"""What bridge_fgo would do in this environment, and why: `bridge-fgo status` and `bridge-fgo-run --check`.

Unlike status(), diagnose() imports Megatron-Bridge's train module (and with it torch and Megatron-Core):
it answers before a run whether offload will happen, so it looks at the real objects the patch would
wrap. It patches nothing itself; in a process that is patched (run under bridge-fgo-run) it reports
what the patch really did.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Dict, List, Optional, Tuple

from . import generations, patcher, report as rpt, targets
from .decide import FIX_BUILTIN
from .options import Options, env_name, from_env

PRETRAIN_ALIAS = f"{targets.PRETRAIN_MODULE}.{targets.TRAIN}"
BUILTIN_ENGINE = "bridge_fgo.adapters.builtin"


def _import(name: str) -> Tuple[Optional[object], Optional[str]]:
    try:
        return importlib.import_module(name), None
    except Exception as err:  # ImportError, but also whatever a half-broken install raises
        return None, f"{type(err).__name__}: {err}"


def _builtin_engine() -> bool:
    try:
        return importlib.util.find_spec(BUILTIN_ENGINE) is not None
    except (ImportError, ValueError):
        return False


def _target_notes(layout: targets.Layout) -> Dict[str, str]:
    """Each target's own problems (inspect_layout words every problem starting with its target)."""
    notes = {}
    for name in (targets.TRAIN, targets.TRAIN_STEP, targets.COPY_HELPER):
        own = [p for p in layout.problems
               if p.startswith((f"{targets.TRAIN_MODULE}.{name} ", f"{name} ", f"{name}() "))]
        if not layout.found[name]:
            notes[name] = f"not in {targets.TRAIN_MODULE}"
        elif own:
            notes[name] = "found, but " + "; ".join(own)
    return notes


def _pretrain_alias(train_module) -> Tuple[bool, str, bool]:
    """(bound to train.train, note, blocks): pretrain() is how Bridge's recipes start training."""
    module, err = _import(targets.PRETRAIN_MODULE)
    if module is None:
        return False, f"{targets.PRETRAIN_MODULE} cannot be imported ({err})", False
    bound = vars(module).get(targets.TRAIN)
    if bound is None:
        return False, (f"{targets.PRETRAIN_MODULE} binds no `train`; pretrain() reaches the loop some other "
                       "way (nothing to patch there)"), False
    if bound is vars(train_module).get(targets.TRAIN):
        return True, f"the same function as {targets.TRAIN_MODULE}.train: patched with it", False
    return False, (f"{PRETRAIN_ALIAS} is not {targets.TRAIN_MODULE}.train: runs started through pretrain() "
                   "(Bridge's recipes) would bypass the patch"), True


def _mcore_meaning(generation: Optional[str], mcore: Optional[str]) -> str:
    if generation is not None:
        return generations.MEANING[generation]
    if mcore is None:
        return "megatron-core is not installed"
    return f"megatron-core {mcore} is installed but its optimizer module cannot be imported"


def _mode_verdict(opts: Options, generation: Optional[str], mcore: str) -> Tuple[bool, str]:
    """The verdict once the patch is known to apply: does this mode offload?"""
    if opts.offload == "off":
        return False, ("offload will not run: offload=off patches but never offloads (a baseline through the "
                       "same code path). To offload, use --offload auto or builtin "
                       f"({env_name('offload')})")
    if opts.offload == "builtin":
        if not _builtin_engine():
            return False, (f"offload will not run: offload=builtin, but this bridge_fgo has no builtin engine "
                           f"({BUILTIN_ENGINE} is missing), so the first training step would fail. Use a "
                           "bridge_fgo release that has it, or offload=auto with a Megatron-Core that offloads")
        text = ("offload will run (mode builtin): bridge_fgo's builtin engine offloads the distributed "
                "optimizer's states in every training run, no config flag needed (a configuration it cannot "
                "serve, e.g. use_distributed_optimizer=False, is refused before the first step)")
        if generation == generations.CHUNKED:
            text += ("; keep cfg.optimizer.offload_optimizer_states False, or two offloaders would move the "
                     "same states (refused)")
        return True, text
    # auto
    if generation == generations.THREE_METHOD:
        return True, ("offload will run (mode auto) through Megatron-Core's three-method offloader, in runs "
                      "whose config sets cfg.optimizer.offload_optimizer_states=True; runs without the flag "
                      "are left alone")
    if generation == generations.CHUNKED:
        return True, ("offload will run (mode auto) through Megatron-Core's chunked offloader, in runs whose "
                      "config sets cfg.optimizer.chunked_optimizer_state_offload=True (or its deprecated alias "
                      "offload_optimizer_states); runs without it are left alone")
    if generation == generations.NONE:
        return False, (f"offload will not run in mode auto: megatron-core {mcore} has no optimizer-state "
                       "offload (no released megatron-core has it), so cfg.optimizer.offload_optimizer_states "
                       "has nothing to call. To offload, " + FIX_BUILTIN)
    return False, f"offload will not run: {_mcore_meaning(generation, mcore)}"


def diagnose(options: Optional[Options] = None) -> rpt.Report:
    """The status report for this environment, with its verdict. Imports Megatron-Bridge's train
    module; raises BridgeFGOOptionError for a bad BRIDGE_FGO_* value when `options` is not given."""
    opts = options if options is not None else from_env()
    versions = generations.versions()
    bridge, mcore = versions.get("megatron-bridge"), versions.get("megatron-core")
    generation = generations.installed()
    report = rpt.Report(
        patched=False, outcome=rpt.NOT_PATCHED, mode=opts.offload, strict=opts.strict, generation=generation,
        versions=versions, predicted=True, offload_ready=False, executable=sys.executable,
        generation_meaning=_mcore_meaning(generation, mcore),
    )
    problems: List[str] = []
    module, import_error = _import(targets.TRAIN_MODULE)
    if module is None:
        if bridge is None:
            report.reason = "megatron-bridge is not installed"
            report.verdict = (f"offload will not run: megatron-bridge is not installed in this Python "
                              f"({sys.executable}), so there is no training loop to patch. Install "
                              "megatron-bridge here, or run bridge-fgo with the Python that trains")
        else:
            report.reason = f"{targets.TRAIN_MODULE} cannot be imported ({import_error})"
            report.verdict = (f"offload will not run: megatron-bridge {bridge} is installed but "
                              f"{targets.TRAIN_MODULE} cannot be imported ({import_error}), so nothing can be "
                              "patched. Fix that import first: python -c 'import megatron.bridge.training.train'")
        report.problems = [report.reason]
        return report

    layout = targets.inspect_layout(module)
    problems += layout.problems
    found = dict(layout.found)
    notes = _target_notes(layout)
    alias_ok, alias_note, alias_blocks = _pretrain_alias(module)
    found[PRETRAIN_ALIAS] = alias_ok
    notes[PRETRAIN_ALIAS] = alias_note
    if alias_blocks:
        problems.append(alias_note)
    report.targets, report.target_notes, report.problems = found, notes, problems
    report.native_wiring = list(layout.native_wiring)

    # The process's own patch, when there is one (bridge-fgo status run under bridge-fgo-run).
    p = patcher._current
    live = p is not None and p.active and p.module is not None
    if live:
        now = patcher.status()
        report.predicted = False
        report.patched, report.outcome, report.reason = now.patched, now.outcome, now.reason
        report.aliases, report.sessions = now.aliases, now.sessions
    elif alias_ok:
        report.aliases = [PRETRAIN_ALIAS]

    bridge_v = bridge or "unknown"
    if opts.disable:
        if not live:
            report.outcome, report.reason = rpt.NOT_PATCHED, "disabled"
        report.verdict = (f"offload will not run: bridge_fgo is disabled ({env_name('disable')} or --disable), "
                          f"nothing is patched. To offload, unset {env_name('disable')} / drop --disable")
        return report
    if layout.native_wiring:
        if not live:
            report.outcome = rpt.STEPPED_ASIDE
            report.reason = (f"megatron-bridge {bridge_v} already calls {', '.join(layout.native_wiring)} in its "
                             "training loop; bridge_fgo steps aside")
        if opts.offload == "auto":
            report.offload_ready = True
            report.verdict = ("offload will run through megatron-bridge's own wiring when "
                              "cfg.optimizer.offload_optimizer_states is set; bridge_fgo steps aside so no "
                              "offload call runs twice")
        else:
            report.verdict = (f"offload={opts.offload} has no effect: megatron-bridge {bridge_v} wires offload "
                              "itself and bridge_fgo steps aside. Use offload=auto and set "
                              "cfg.optimizer.offload_optimizer_states=True")
        return report
    if problems:
        if not live:
            report.outcome = rpt.NOT_PATCHED
            report.reason = (f"megatron-bridge {bridge_v} has a training loop bridge_fgo does not recognise: "
                             f"{'; '.join(problems)}")
        report.verdict = (f"offload will not run: nothing would be patched, because {'; '.join(problems)}. "
                          "Fix: use a megatron-bridge this bridge_fgo supports (see its README) or upgrade "
                          "bridge_fgo")
        return report
    if not live:
        report.outcome, report.reason = rpt.PATCHED, None
    report.offload_ready, report.verdict = _mode_verdict(opts, generation, mcore or "unknown")
    return report


def exit_code(report: rpt.Report) -> int:
    """0 when offload will run in the chosen mode, 1 when it will not."""
    return 0 if report.offload_ready else 1
