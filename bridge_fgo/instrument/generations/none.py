"""Generation `none` (no optimizer-state offload in Megatron-Core: every PyPI release up to 0.19.x,
and main), served by bridge_fgo's builtin engine (bridge_fgo/engine/).

offload=builtin runs this adapter whatever the generation; offload=auto on this generation has
nothing to call and says so.
"""
from __future__ import annotations

from typing import List

from ... import options as options_mod
from .. import refusals
from .base import Adapter, Generation

FIX = "use bridge_fgo's builtin engine: " + options_mod.how_to_set("offload", "builtin")


class _None(Generation):
    name = "none"
    mode = "builtin"
    meaning = "this Megatron-Core has no optimizer-state offload; bridge_fgo's builtin engine can provide it"
    who = "bridge_fgo's builtin engine"
    flag = "cfg.optimizer.offload_optimizer_states"
    has_offloader = False
    # Muon's states too (under the streamed step as well: refusals.streamed refuses nothing of Muon's)
    optimizers = refusals.ADAM + refusals.MUON

    def detect(self, cls) -> bool:
        return True  # what is left when no other generation matched

    def refusals(self, cfg, options, inner_optimizers) -> List[str]:
        if not options.chunk_mb:
            return []
        return refusals.streamed(cfg, inner_optimizers, options)

    def serves_megatron_fsdp(self, options) -> bool:
        return bool(options.chunk_mb)  # the streamed step (engine/fsdp.py); the one window does not

    def build(self, optimizer, cfg, dist_optimizers, options) -> Adapter:
        # imported here: the registry is read by `import bridge_fgo`, which must not load the engine
        # (nor torch) in processes that never train
        from ... import engine
        from .. import saves

        return engine.build(dist_optimizers, options, cfg, snapshot=saves.snapshot_route(cfg))

    def verdict(self) -> str:
        return ("offload will run (mode builtin): bridge_fgo's builtin engine offloads the distributed "
                "optimizer's states in every training run, no config flag needed (a configuration it cannot "
                "serve, e.g. use_distributed_optimizer=False, is refused before the first step)")

    def unavailable(self, mcore: str) -> str:
        """The run-time warning: the flag is set and Megatron-Core has nothing to call."""
        return (f"{self.flag} is set but megatron-core {mcore} has no optimizer-state offload (no released "
                f"megatron-core has it): nothing is offloaded. To offload, {FIX}")

    def unavailable_verdict(self, mcore: str) -> str:
        return (f"offload will not run in mode auto: megatron-core {mcore} has no optimizer-state offload (no "
                f"released megatron-core has it), so {self.flag} has nothing to call. To offload, {FIX}")


GENERATION = _None()
