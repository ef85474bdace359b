"""Generation `none` (no optimizer-state offload in Megatron-Core: every PyPI release up to 0.19.x,
and main) and its adapter: bridge_fgo's builtin engine, one Engine per DistributedOptimizer.

offload=builtin runs this adapter whatever the generation; offload=auto on this generation has
nothing to call and says so.
"""
from __future__ import annotations

import time
from typing import List

from ... import options as options_mod
from ...log import logger, rank_prefix
from .base import Adapter, Generation

FIX = "use bridge_fgo's builtin engine: " + options_mod.how_to_set("offload", "builtin")


class BuiltinAdapter(Adapter):
    """chunk_mb > 0: the streamed step (streamed.py), states on the host between updates;
    chunk_mb == 0: one window (engine.py), states back on the GPU for the whole update."""

    def __init__(self, dist_optimizers: List[object], chunk_mb: int = options_mod.DEFAULT_CHUNK_MB):
        # imported here, not at the top: the registry is read by `import bridge_fgo`, which must
        # not load the engine (and whatever it imports) in processes that never train
        from ...engine import Engine
        from ...streamed import MIB, StreamedEngine

        self.chunk_mb = chunk_mb
        self.engines = [StreamedEngine(o, chunk_mb * MIB) if chunk_mb else Engine(o) for o in dist_optimizers]

    def prepare(self) -> None:
        from ... import hostmem

        t0 = time.perf_counter()
        # every rank of the node pins its share: refused here, before any of it, if the node lacks it
        fit = hostmem.check_fits(sum(e.plan_bytes() for e in self.engines))
        logger.info("%s%s", rank_prefix(), fit.describe())
        for e in self.engines:
            e.prepare()
        logger.info("%sbuiltin engine ready before the first step: %d optimizer(s), %d bytes of %s host "
                    "buffer in %.2f s; %s", rank_prefix(), len(self.engines),
                    sum(e.pinned_bytes for e in self.engines),
                    "pinned" if any(e.cuda for e in self.engines) else "CPU", time.perf_counter() - t0, self.window())

    def window(self) -> str:
        if not self.chunk_mb:
            return "window: one (chunk_mb=0: every state back on the GPU for the optimizer step)"
        peak = max((e.step_peak_bytes for e in self.engines), default=0)
        return (f"window: {self.chunk_mb} MB chunks, {sum(len(e.chunks) for e in self.engines)} chunk(s), the step "
                f"adds at most {peak} bytes on the GPU")

    def offload(self) -> int:
        return sum(e.offload() for e in self.engines)

    def release(self) -> None:
        for e in self.engines:
            e.release()

    def reload(self) -> int:
        # the streamed step prefetches only the first optimizer's first chunk: one slot in flight
        return sum(e.reload(prefetch=i == 0) if self.chunk_mb else e.reload() for i, e in enumerate(self.engines))

    def wait_reload(self) -> None:
        for e in self.engines:
            e.wait_reload()

    def settle(self) -> None:
        if self.chunk_mb:
            for e in self.engines:
                e.settle()

    def describe(self):
        streamed = bool(self.chunk_mb)
        out = {
            "optimizers": len(self.engines),
            "tensors": sum(e.tensors for e in self.engines),
            "bytes": sum(e.bytes if streamed else e.steady_bytes for e in self.engines),
            "pinned_bytes": sum(e.pinned_bytes for e in self.engines),
            "skipped_shared_storage": sum(e.skipped_shared for e in self.engines),
            "per_optimizer_bytes": [e.bytes if streamed else e.steady_bytes for e in self.engines],
            "chunk_mb": self.chunk_mb,
        }
        if streamed:
            out.update(chunks=sum(len(e.chunks) for e in self.engines),
                       step_peak_bytes=max((e.step_peak_bytes for e in self.engines), default=0),
                       master_bytes=sum(e.master_bytes for e in self.engines))
        return out

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

    def refusals(self, cfg, options) -> List[str]:
        if not options.chunk_mb:
            return []
        from ...streamed import problems  # the streamed step's own limits

        return problems(cfg)

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
