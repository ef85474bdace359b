"""The streamed step's plan: one bundle per parameter (its master, states and scales, with their real
dtypes and shapes, also before the optimizer created them), laid out in the host buffer in the
optimizer's parameter order; the chunks the update goes through; and the GPU window they need.

A parameter is never split: a chunk holds whole bundles (one larger than the chunk size is a chunk of
its own). A chunk is one or more contiguous host ranges (spans: several only where bundles in between
stay resident on the GPU under a memory budget), packed end to end in the GPU window.
"""
from __future__ import annotations

import dataclasses
from typing import Collection, Dict, List, Optional, Sequence, Tuple

from .contracts import Contract
from .fsdp import local
from .tensors import ALIGN, MASTER, SCALE, STATE, Entry, Movable, aligned, nbytes_like, nbytes_of


@dataclasses.dataclass(eq=False)
class Bundle:
    """Everything of one inner-optimizer parameter that moves."""

    part: int  # index of its DistributedOptimizer in the chain
    group: int  # its param group's index
    param: object
    entries: List[Entry]
    offset: int = 0  # host range [offset, end)
    end: int = 0
    resident: bool = False  # kept on the GPU under a memory budget: updated in place, never moved

    @property
    def nbytes(self) -> int:
        return self.end - self.offset


@dataclasses.dataclass(eq=False)
class Chunk:
    index: int  # in the chain's sequence of chunks
    part: int
    bundles: List[Bundle]
    spans: List[Tuple[int, int, int]] = dataclasses.field(default_factory=list)  # (host start, end, window start)
    nbytes: int = 0  # in the window
    window_offset: Dict[int, int] = dataclasses.field(default_factory=dict)  # id(entry) -> offset in the window

    def params_by_group(self) -> Dict[int, list]:
        out: Dict[int, list] = {}
        for b in self.bundles:
            out.setdefault(b.group, []).append(b.param)
        return out


def bundle_of(part: int, group_index: int, p, group, inner, contract: Contract, movable: Movable,
              moves_master: bool) -> Bundle:
    """p's master (when it moves), then every state it has or will have, then their scales. A state
    that exists is taken as it is (after a checkpoint load, or in a later plan); one that does not yet
    exist is predicted by the optimizer's contract."""
    entries = []
    lp = local(p)  # the memory of a DTensor parameter (Megatron-FSDP): its local tensor, the master itself
    if lp.numel() == 0:  # no elements on this rank (Megatron-FSDP shards each group's flat): nothing moves
        return Bundle(part, group_index, p, entries)
    if moves_master:
        entries.append(Entry(MASTER, lp, None, tuple(lp.shape), lp.dtype, nbytes_of(lp)))
    state = inner.state.get(p) or {}
    specs = {s.key: s for s in contract.states(inner, p, group)}
    keys = list(dict.fromkeys([*specs, *state]))
    for key in keys:
        t = local(state.get(key))
        if t is not None:
            if not movable.take(t):
                continue
            entries.append(Entry(STATE, p, key, tuple(t.shape), t.dtype, nbytes_of(t)))
        elif key in specs:
            entries.append(Entry(STATE, p, key, tuple(lp.shape), specs[key].dtype, nbytes_like(lp, specs[key].dtype)))
    for key in keys:
        spec = specs.get(key)
        if spec is None or not spec.scaled:
            continue
        t = contract.scale_of(inner, p, key)
        if t is not None and not movable.take(t):
            continue
        import torch

        entries.append(Entry(SCALE, p, key, (1,), torch.float32, 4))
    return Bundle(part, group_index, p, entries)


def place(bundles: Sequence[Bundle], start: int = 0) -> int:
    """Host offsets, bundle after bundle; returns the end."""
    offset = start
    for b in bundles:
        # bundles start and end on ALIGN, so packed into the window their entries keep the alignment
        b.offset = offset = aligned(offset, ALIGN)
        for e in b.entries:
            e.offset = offset = aligned(offset, e.nbytes)
            offset += e.nbytes
        b.end = offset = aligned(offset, ALIGN)
    return offset


def chunks_of(bundles: Sequence[Bundle], chunk_bytes: int, first_index: int = 0,
              kept: Collection[int] = (), in_order: bool = False) -> List[Chunk]:
    """Cut the streamed (non-resident) bundles of one DistributedOptimizer into chunks of at most
    chunk_bytes (a larger bundle alone), and pack each chunk's spans into the window. `kept`: ids of
    bundles to count as resident too (a budget's candidates, before they move). `in_order`: no chunk
    spans a resident bundle (the parameters step in their order: contracts.Contract.in_order)."""
    chunks: List[Chunk] = []
    current: Optional[Chunk] = None
    for b in bundles:
        if b.resident or not b.entries or id(b) in kept:
            if in_order:
                current = None
            continue
        if current is None or (current.bundles and current.nbytes + b.nbytes > chunk_bytes):
            current = Chunk(first_index + len(chunks), b.part, [])
            chunks.append(current)
        last = current.spans[-1] if current.spans else None
        if last is not None and last[1] == b.offset:
            current.spans[-1] = (last[0], b.end, last[2])
        else:
            current.spans.append((b.offset, b.end, current.nbytes))
        base = current.nbytes - b.offset
        for e in b.entries:
            current.window_offset[id(e)] = base + e.offset
        current.bundles.append(b)
        current.nbytes += b.nbytes
    return chunks


def window_sizes(chunks: Sequence[Chunk], slots: int = 2) -> List[int]:
    """The window's slots (chunk i goes to slot i % slots, of the whole chain): each as large as the
    largest chunk it takes. Two slots hold two consecutive chunks at once: what the update needs to
    overlap one chunk's copy with the next one's update; more let the first chunks come in earlier."""
    sizes = [0] * min(slots, len(chunks))
    for i, c in enumerate(chunks):
        sizes[i % slots] = max(sizes[i % slots], c.nbytes)
    return sizes


def keep_resident(bundles: Sequence[Bundle], room: int) -> List[Bundle]:
    """The bundles to keep on the GPU within `room` bytes: the largest first (each kept bundle saves
    its bytes both ways every step, and the largest ones also set the window)."""
    kept, left = [], room
    for b in sorted((b for b in bundles if b.entries and not b.resident), key=lambda b: -b.nbytes):
        if b.nbytes <= left:
            kept.append(b)
            left -= b.nbytes
    return kept
