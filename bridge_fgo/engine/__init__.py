"""bridge_fgo's own optimizer-state offload engine, for Megatron-Core releases that have none.

    contracts.py   the inner optimizers (torch AdamW/Adam, TE and apex FusedAdam) and what each does
    tensors.py     which tensors move, and where each one is bound
    layout.py      the streamed step's plan: bundles, chunks, the window, what stays resident
    construction.py  Megatron-Core's fp32 masters made a batch at a time and moved to the host
    fsdp.py        Megatron-FSDP's part: its flat masters, DTensor states and own copy through the step
    fsdp_construction.py  Megatron-FSDP's main-weight buffers (the masters) made in host memory
    adoption.py    those masters guarded until a session adopts them; back on the GPU otherwise
    copies.py      host <-> GPU copies ordered by events (deferred on CPU), the GPU window
    budget.py      gpu_budget_gib: what may stay on the GPU, judged after the first step
    subset.py      the update of a subset: the inner step, group-level state, the master copy
    streamed/      StreamedEngine (chunk_mb > 0): states on the host between updates (plan,
                   transfers, update, readers)
    onewindow.py   OneWindowEngine (chunk_mb = 0): states back on the GPU for the whole update
    adapter.py     BuiltinAdapter: one engine per optimizer as train_step sees it (a chain included),
                   driven by the Session; build() makes it from Bridge's config and the options

Importing this package imports no torch.
"""
from __future__ import annotations

from .adapter import GIB, MIB, BuiltinAdapter, build

__all__ = ["BuiltinAdapter", "build", "GIB", "MIB"]
