"""The streamed optimizer step (chunk_mb > 0): optimizer states live in pinned host memory between
updates and reach the GPU a bounded window at a time, during the update itself.

    plan.py       which tensors move, their place in the host buffer, the chunks; the figures
    transfers.py  the host buffer, the GPU window and every copy between them
    update.py     the update while armed: the inner step over each chunk, torn states on failure
    readers.py    what reads the states between updates: guards, torn refusals, loads into host views
    norms.py      the parameter norm Bridge logs: each master's norm taken in its pass
    qkclip.py     qk_clip: deferred at gradient finalization, masters clipped in their pass, weights after
    head.py       the head: the first chunks' copies in started during the last backward
    engine.py     StreamedEngine: the call sites (prepare, offload, release, reload, settle, close)
"""
from .engine import StreamedEngine
from .readers import LOADS, READERS, SAVES, TORN_FIX

__all__ = ["StreamedEngine", "READERS", "SAVES", "LOADS", "TORN_FIX"]
