"""What a run does: whether the patch applies to Bridge's layout, and per optimizer whether offload
runs, through which generation's adapter, or why not.

patch() uses these at run time (patcher.py, callsites.py) and `bridge-fgo status` uses the same
functions for its prediction (diagnose.py). Per-optimizer decisions are made from the objects (the
config and the optimizer in hand) at the first train()/train_step call, so a refused configuration
stops the run before its first step.
"""
from __future__ import annotations

import logging
from typing import List, Optional, Sequence, Tuple

from .. import report as rpt, versions
from . import generations, refusals
from .generations import Generation
from ..errors import BridgeFGOConfigError, BridgeFGOError
from ..log import once, rank_prefix
from ..options import Options
from .session import Session


def patch_outcome(native_wiring: Sequence[str], problems: Sequence[object], bridge: str) -> Tuple[str, Optional[str]]:
    """(outcome, reason) for Bridge's layout: stepped aside, not patched, or patched."""
    if native_wiring:
        return rpt.STEPPED_ASIDE, (f"megatron-bridge {bridge} already calls {', '.join(native_wiring)} in its "
                                   "training loop; bridge_fgo steps aside so no offload call runs twice")
    if problems:
        return rpt.NOT_PATCHED, (f"megatron-bridge {bridge} has a training loop bridge_fgo does not recognise: "
                                 f"{'; '.join(map(str, problems))}. bridge_fgo patches nothing. Fix: use a "
                                 "megatron-bridge this bridge_fgo supports (see its README) or upgrade bridge_fgo")
    return rpt.PATCHED, None


def way(options: Options, generation: Optional[Generation]) -> Optional[Generation]:
    """The generation whose adapter moves the states in this mode; None: offload=off, or auto on a
    generation whose Megatron-Core has nothing to call (or no Megatron-Core)."""
    if options.offload == "off":
        return None
    if options.offload == "builtin":
        return generations.BUILTIN
    return generation if generation is not None and generation.has_offloader else None


def double_offload(generation: Generation) -> str:
    return (f"{generation.flag} is on and offload=builtin was chosen: two offloaders would move the same "
            "states. Set the config flag to False, or use offload=auto")


def inert(options: Options) -> bool:
    """Whether no optimizer can have a Session in this mode, whatever it is: offload=off, or auto where the
    installed Megatron-Core has no offloader to call. The wrappers then call through without looking at
    their arguments (say_inert() at train() and train_step() is all they do)."""
    if options.offload == "off":
        return True
    if options.offload == "auto":
        installed = generations.installed()
        return installed is None or not installed.has_offloader
    return False


def say_inert(cfg, options: Options) -> None:
    """The once-only line of an inert patch, from the run's config alone."""
    if options.offload == "off":
        once(("off",), logging.INFO, "%soffload=off: bridge_fgo is patched but moves nothing", rank_prefix())
        return
    generation = generations.installed() or generations.BUILTIN
    if generation.requested(cfg):
        _not_acting(options.strict, ("no-fgo",), generation.unavailable(versions.megatron_core_version() or "unknown"))


def inner_optimizers(optimizer) -> List[object]:
    """The optimizers of a chain, in its order, nested chains walked (Muon's LayerWiseDistributedOptimizer
    is a ChainedOptimizer inside the outer one). A chain is a list or tuple, nothing else (a Mock's
    attribute is not one)."""
    chain = getattr(optimizer, "chained_optimizers", None)
    if not isinstance(chain, (list, tuple)):
        return [optimizer]
    return [o for part in chain for o in inner_optimizers(part)]


def distributed_optimizers(optimizers: List[object]) -> List[object]:
    """The parts whose states the engine moves: each DistributedOptimizer, and each
    Float16OptimizerWithFloat16Params (Megatron-Core's for Muon; refusals.py says where it is served)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    return [o for o in optimizers if isinstance(o, (DistributedOptimizer, Float16OptimizerWithFloat16Params))]


def generation_of(optimizer, dist_opts) -> Generation:
    """From the optimizers in hand; the installed Megatron-Core's when they show none."""
    found = generations.of_objects([*dist_opts, optimizer])
    if found.has_offloader:
        return found
    return generations.installed() or found


def _not_acting(strict: bool, key, msg: str) -> None:
    if strict:
        raise BridgeFGOError(msg)
    once(key, logging.WARNING, "%s%s", rank_prefix(), msg)


def acts(cfg, optimizer, options: Options) -> bool:
    """Whether offload will be set up for this optimizer (a Session, or a refusal): the same answer
    on every rank, from the options, the config and the optimizer's class only, so every rank knows
    whether the others take part in agreeing on it."""
    if options.offload == "off":
        return False
    if options.offload == "builtin":
        return True
    generation = generation_of(optimizer, distributed_optimizers(inner_optimizers(optimizer)))
    return generation.requested(cfg) and generation.has_offloader


def resolve(cfg, optimizer, options: Options) -> Optional[Session]:
    """A Session when offload will run for this optimizer; None (after saying why, where it matters)."""
    if options.offload == "off":
        say_inert(cfg, options)
        return None
    inner = inner_optimizers(optimizer)
    dist_opts = distributed_optimizers(inner)
    generation = generation_of(optimizer, dist_opts)
    requested = generation.requested(cfg)
    if options.offload == "auto" and not requested:
        return None  # nothing asked for: stay quiet
    if options.offload == "builtin" and requested and generation.self_driven:
        raise BridgeFGOConfigError(double_offload(generation))
    chosen = way(options, generation)
    if chosen is None:
        _not_acting(options.strict, ("no-fgo",),
                    generation.unavailable(versions.megatron_core_version() or "unknown"))
        return None
    adams = [getattr(o, "optimizer", o) for o in dist_opts]  # the optimizers each one wraps
    refusals.check(cfg, inner, dist_opts, who=chosen.who, extra=chosen.refusals(cfg, options, adams),
                   served=chosen.optimizers, fsdp=chosen.serves_megatron_fsdp(options))
    return Session(optimizer, chosen.build(optimizer, cfg, dist_opts, options), mode=chosen.mode)
