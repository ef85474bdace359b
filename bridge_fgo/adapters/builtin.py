"""bridge_fgo's builtin engine behind the Adapter interface: one Engine per DistributedOptimizer."""
from __future__ import annotations

import time
from typing import List

from ..engine import Engine
from ..log import logger, rank_prefix
from ..session import Adapter


class BuiltinAdapter(Adapter):
    name = "builtin"

    def __init__(self, dist_optimizers: List[object]):
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
