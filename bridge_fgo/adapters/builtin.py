"""Generation `none` (no optimizer-state offload in Megatron-Core: every PyPI release up to 0.19.x,
and main) and its adapter: bridge_fgo's builtin engine, one Engine per DistributedOptimizer.

offload=builtin runs this adapter whatever the generation; offload=auto on this generation has
nothing to call and says so.
"""
from __future__ import annotations

import time
from typing import List

from .. import options as options_mod
from ..log import logger, rank_prefix
from .base import Adapter, Generation

FIX = "use bridge_fgo's builtin engine: " + options_mod.how_to_set("offload", "builtin")


class BuiltinAdapter(Adapter):
    def __init__(self, dist_optimizers: List[object], chunk_mb: int = options_mod.DEFAULT_CHUNK_MB):
        # imported here, not at the top: the registry is read by `import bridge_fgo`, which must
        # not load the engine (and whatever it imports) in processes that never train
        from ..engine import Engine

        self.chunk_mb = chunk_mb
        self.engines = [Engine(o) for o in dist_optimizers]

    def prepare(self) -> None:
        t0 = time.perf_counter()
        for e in self.engines:
            e.prepare()
        logger.info("%sbuiltin engine ready before the first step: %d optimizer(s), %d bytes of %s host "
                    "buffer in %.2f s", rank_prefix(), len(self.engines), sum(e.pinned_bytes for e in self.engines),
                    "pinned" if any(e.cuda for e in self.engines) else "CPU", time.perf_counter() - t0)

    def offload(self) -> int:
        return sum(e.offload() for e in self.engines)

    def release(self) -> None:
        for e in self.engines:
            e.release()

    def reload(self) -> int:
        return sum(e.reload() for e in self.engines)

    def wait_reload(self) -> None:
        for e in self.engines:
            e.wait_reload()

    def describe(self):
        return {
            "optimizers": len(self.engines),
            "tensors": sum(len(e.plan) for e in self.engines),
            "bytes": sum(e.bytes for e in self.engines),
            "pinned_bytes": sum(e.pinned_bytes for e in self.engines),
            "skipped_shared_storage": sum(e.skipped_shared for e in self.engines),
        }

    def close(self) -> None:
        for e in self.engines:
            e.close()


class _None(Generation):
    name = "none"
    mode = "builtin"
    meaning = "this Megatron-Core has no optimizer-state offload; bridge_fgo's builtin engine can provide it"
    who = "bridge_fgo's builtin engine"
    flag = "cfg.optimizer.offload_optimizer_states"
    has_offloader = False

    def detect(self, cls) -> bool:
        return True  # what is left when no other generation matched

    def build(self, optimizer, cfg, dist_optimizers, options) -> Adapter:
        return BuiltinAdapter(dist_optimizers, chunk_mb=options.chunk_mb)

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
