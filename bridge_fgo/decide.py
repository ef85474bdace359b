"""What to do for one training run: offload or not, with which adapter, or why not.

Decided from the objects (the config and the optimizer in hand), at the first train()/train_step
call, so a refused configuration stops the run before its first step.
"""
from __future__ import annotations

import logging
from typing import List, Optional

from . import config_checks, generations
from .errors import BridgeFGOError
from .log import once, rank_prefix
from .options import Options, env_name
from .session import Session

FIX_BUILTIN = (
    f"use bridge_fgo's builtin engine: bridge_fgo.patch(offload='builtin'), {env_name('offload')}=builtin, "
    "or bridge-fgo-run --offload builtin"
)


def inner_optimizers(optimizer) -> List[object]:
    chain = getattr(optimizer, "chained_optimizers", None)
    return list(chain) if chain is not None else [optimizer]


def distributed_optimizers(optimizers: List[object]) -> List[object]:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return [o for o in optimizers if isinstance(o, DistributedOptimizer)]


def flag_requested(cfg) -> bool:
    """The config asks for offload. The chunked line's __post_init__ turns the deprecated
    offload_optimizer_states into chunked_optimizer_state_offload and resets it to False."""
    opt = getattr(cfg, "optimizer", None)
    if getattr(opt, "chunked_optimizer_state_offload", False):
        return getattr(opt, "optimizer_state_offload_fraction", 1.0) > 0.0
    return bool(getattr(opt, "offload_optimizer_states", False))


def _generation(optimizer, dist_opts) -> str:
    for obj in [*dist_opts, optimizer]:
        g = generations.of_object(obj)
        if g != generations.NONE:
            return g
    return generations.installed() or generations.NONE


def _not_acting(strict: bool, key, msg: str) -> None:
    if strict:
        raise BridgeFGOError(msg)
    once(key, logging.WARNING, "%s%s", rank_prefix(), msg)


def resolve(cfg, optimizer, options: Options) -> Optional[Session]:
    """A Session when offload will run for this optimizer; None (after saying why, where it matters)."""
    if options.offload == "off":
        once(("off",), logging.INFO, "%soffload=off: bridge_fgo is patched but moves nothing", rank_prefix())
        return None
    requested = flag_requested(cfg)
    if options.offload == "auto" and not requested:
        return None  # nothing asked for: stay quiet
    inner = inner_optimizers(optimizer)
    dist_opts = distributed_optimizers(inner)
    gen = _generation(optimizer, dist_opts)
    mcore = generations.megatron_core_version() or "unknown"

    if options.offload == "builtin":
        if gen == generations.CHUNKED and requested:
            from .errors import BridgeFGOConfigError

            raise BridgeFGOConfigError(
                "cfg.optimizer.offload_optimizer_states (chunked_optimizer_state_offload) is on and "
                "offload=builtin was chosen: two offloaders would move the same states. Set the config "
                "flag to False, or use offload=auto"
            )
        config_checks.check(cfg, inner, dist_opts, who="bridge_fgo's builtin engine")
        from .adapters.builtin import BuiltinAdapter

        return Session(optimizer, BuiltinAdapter(dist_opts), mode="builtin")

    # auto, with cfg.optimizer.offload_optimizer_states set
    if gen == generations.THREE_METHOD:
        config_checks.check(cfg, inner, dist_opts, who="Megatron-Core's optimizer-state offload")
        from .adapters.three_method import ThreeMethodAdapter

        return Session(optimizer, ThreeMethodAdapter(dist_opts), mode=generations.THREE_METHOD)
    if gen == generations.CHUNKED:
        config_checks.check(cfg, inner, dist_opts, who="Megatron-Core's chunked optimizer-state offload",
                            generation=gen)
        from .adapters.chunked import ChunkedAdapter

        return Session(optimizer, ChunkedAdapter(optimizer, cfg), mode=generations.CHUNKED)
    _not_acting(
        options.strict, ("no-fgo",),
        f"cfg.optimizer.offload_optimizer_states is set but megatron-core {mcore} has no optimizer-state "
        "offload (no released megatron-core has it): nothing is offloaded. To offload, " + FIX_BUILTIN,
    )
    return None
