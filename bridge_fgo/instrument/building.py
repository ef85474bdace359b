"""The call sites where Megatron-Core and Megatron-FSDP make the fp32 masters: with the builtin engine's streamed
step, each made in host memory as it is built (engine/construction.py, engine/fsdp_construction.py), and the
optimizer built over them guarded until a session adopts it (engine/adoption.py)."""
from __future__ import annotations

import sys
import time

from .. import peaks
from . import targets
from ..log import logger, rank_prefix
from ..options import first_chunk_mb


class Building:
    """The construction call sites of one CallSites (`sites`: its options, and whether it is enabled)."""

    def __init__(self, sites):
        self.sites = sites

    @property
    def on_host(self) -> bool:
        """The fp32 masters are made on the host at construction: the builtin engine's streamed step."""
        opts = self.sites.options
        return bool(self.sites.enabled and opts.offload == "builtin" and opts.chunk_mb)

    def masters(self, name, wrapped, instance, args, kwargs):
        """Megatron-Core makes the fp32 masters: with the streamed step, a batch at a time, each batch
        moved to host memory before the next (construction.py)."""
        if not self.on_host:
            return wrapped(*args, **kwargs)
        from ..engine import MIB, construction

        peaks.note("setup before the optimizer's construction (the model, its buffers)")
        built = construction.Built()
        chunk_bytes = first_chunk_mb(self.sites.options.chunk_mb) * MIB
        result = construction.build_on_host(wrapped, args, kwargs, chunk_bytes, built)
        peaks.note("optimizer construction")
        if built.masters:
            logger.info("%sfp32 masters made on the host: %s", rank_prefix(), built.describe())
        return result

    def whole_masters(self, name, wrapped, instance, args, kwargs):
        """Megatron-Core makes whole fp32 masters (Float16OptimizerWithFloat16Params: Muon's): with the
        streamed step, each moved to host memory as soon as it is made (construction.py)."""
        if not self.on_host:
            return wrapped(*args, **kwargs)
        from ..engine import adoption, construction

        built = construction.Built()
        result = construction.whole_on_host(wrapped, args, kwargs, built)
        if built.masters:
            logger.info("%sfp32 masters made on the host: %d whole master(s), %d bytes, one at a time on the GPU (at "
                        "most %d bytes)", rank_prefix(), built.masters, built.bytes, built.largest_batch)
        adoption.await_session(instance)
        return result

    def fsdp_masters(self, name, wrapped, instance, args, kwargs):
        """Megatron-FSDP builds its buffers: with the streamed step, its main-weight buffers (the fp32 masters) are
        made in host memory, one group's on the GPU at most (engine/fsdp_construction.py)."""
        if not self.on_host:
            return wrapped(*args, **kwargs)
        from ..engine import construction, fsdp_construction

        peaks.note("setup before Megatron-FSDP's buffers (the model)")
        built = construction.Built("parameter group(s)")
        module = sys.modules[targets.target(name).module]
        result = fsdp_construction.build_on_host(module, wrapped, instance, args, kwargs, built)
        peaks.note("Megatron-FSDP's buffers")
        if built.masters:
            logger.info("%sfp32 masters made on the host with Megatron-FSDP's main-weight buffers: %s", rank_prefix(),
                        built.describe())
        return result

    def await_session(self, name, wrapped, instance, args, kwargs):
        """A DistributedOptimizer built: its masters made on the host (masters) wait for a session, guarded
        (engine/adoption.py), as whole masters do above."""
        t0 = time.perf_counter()
        result = wrapped(*args, **kwargs)
        if self.on_host:
            from ..engine import adoption

            adoption.await_session(instance, built_s=time.perf_counter() - t0)
        return result
