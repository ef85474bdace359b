"""The streamed step's plan: which tensors of which optimizer move, where each sits in the host
buffer, how they are cut into chunks, and the figures that follow from it. Holds no memory.

The engine holds its optimizers through weak references: it never keeps one alive.
"""
from __future__ import annotations

import weakref
from typing import Collection, Dict, Iterator, List, Optional, Tuple

from ...errors import BridgeFGOError
from .. import construction, contracts, fsdp, layout, quantized
from ..tensors import (MASTER, Bindings, Entry, Movable, flat, inner_params, kind_of, masters, model_params_of_masters,
                       same)


def compute_device(parts):
    """Where the update runs: the model parameters' device (masters may live on the host already)."""
    for part in parts:
        opt = part.opt
        for name in kind_of(opt).model_groups:
            for t in flat(getattr(opt, name, None)):
                return t.device
    params = [p for part in parts for _, p in inner_params(part.inner)]
    return params[0].device if params else None


class Part:
    """One optimizer of the chain whose states move: a DistributedOptimizer, or a
    Float16OptimizerWithFloat16Params (Muon's: tensors.Kind)."""

    def __init__(self, index: int, opt):
        self.index = index
        self._opt = weakref.ref(opt)
        self._inner = weakref.ref(opt.optimizer)
        self.contract = contracts.of(opt.optimizer)
        # Megatron-FSDP's layout (fsdp.py): masters views of its main-weight buffers, its own copy after the step
        self.fsdp = fsdp.Layout(opt) if fsdp.serves(opt) else None
        self.bundles: List[layout.Bundle] = []
        self.chunks: List[layout.Chunk] = []
        self.model_of: Dict[int, tuple] = {}
        self.shells: Dict[int, object] = {}  # id(master) -> its GPU tensor, storage freed between steps
        self.shared = 0

    @property
    def opt(self):
        return self._alive(self._opt())

    @property
    def inner(self):
        return self._alive(self._inner())

    def holds(self, opt) -> bool:
        return self._opt() is opt

    @staticmethod
    def _alive(obj):
        if obj is None:
            raise BridgeFGOError("internal: an optimizer the engine serves was garbage-collected")
        return obj

    @property
    def bindings(self) -> Bindings:
        return Bindings(self.inner, self.contract)

    def entries(self) -> List[Entry]:
        return [e for b in self.bundles for e in b.entries]

    def view_of(self):
        """view_of(param, key): the host view of a streamed state of this part (None where it has none: a
        resident bundle, a dropped entry, no buffer yet), for the optimizer's own code to make that state
        in (contracts.Contract.made_in)."""
        views = {(id(b.param), e.key): e for b in self.bundles if not b.resident for e in b.entries
                 if e.kind != MASTER and not e.dropped}

        def view(param, key):
            e = views.get((id(param), key))
            return None if e is None else e.host

        return view

    def flat_master(self, e) -> bool:
        """A master that is a view of Megatron-FSDP's flat buffer: never freed, nor kept as its own shell; the
        buffer is given up whole once none of its masters is bound to it (fsdp.Layout.retire, restore)."""
        return self.fsdp is not None and e.kind == MASTER

    @property
    def in_order(self) -> bool:
        """Whether its parameters step in the optimizer's order (contracts.Contract.in_order)."""
        return self.contract is not None and self.contract.in_order

    def passes(self, limit: int) -> list:
        """The update's passes over this part, in the order they step: pieces of the parameters updated
        in place (resident_pieces) and chunks. The pieces first, overlapping the first chunks' copies; in
        the optimizer's order of the parameters where the contract says so (neither spans the other)."""
        pieces = self._pieces(limit)
        if not self.in_order:
            return [piece for piece, _, _ in pieces] + list(self.chunks)
        at = {id(b): i for i, b in enumerate(self.bundles)}
        runs = [(first, piece) for piece, _, first in pieces] + [(at[id(c.bundles[0])], c) for c in self.chunks]
        return [run for _, run in sorted(runs, key=lambda r: r[0])]

    def resident_pieces(self, limit: int) -> List[Dict[int, list]]:
        """The parameters updated in place (kept on the GPU by a budget, or with nothing to move) by
        param group, in pieces of at most `limit` bytes of states (a larger parameter alone), each one
        inner step(): one step over all of them would allocate the optimizer's scratch for all at once
        (torch's foreach AdamW: a temporary as large as their masters; 1.59 GiB over a 14.16 GiB budget
        on an H100, 2026-11-26), where the window was sized for a chunk's."""
        return [piece for piece, _, _ in self._pieces(limit)]

    def largest_piece(self, limit: int, kept: Collection[int] = ()) -> int:
        """Bytes of states of the largest of resident_pieces(limit), were the bundles whose ids are in
        `kept` resident too."""
        return max((n for _, n, _ in self._pieces(limit, kept)), default=0)

    def _pieces(self, limit: int, kept: Collection[int] = ()) -> List[Tuple[Dict[int, list], int, int]]:
        """(piece, its bytes, the position of its first bundle); in order, a streamed bundle ends a piece."""
        pieces: List[Tuple[Dict[int, list], int, int]] = []
        after_streamed = False
        for i, b in enumerate(self.bundles):
            if b.entries and not b.resident and id(b) not in kept:
                after_streamed = True
                continue
            if (not pieces or (after_streamed and self.in_order)
                    or (pieces[-1][1] and pieces[-1][1] + b.nbytes > limit)):
                pieces.append(({}, 0, i))
            after_streamed = False
            piece, size, first = pieces[-1]
            piece.setdefault(b.group, []).append(b.param)
            pieces[-1] = (piece, size + b.nbytes, first)
        return pieces

    def shape(self, param) -> tuple:
        """A parameter as its model sees it (a master is a flat shard of its model parameter)."""
        model = self.model_of.get(id(param))
        return tuple((model[1] if model is not None else param).shape)


class Plan:
    """Every optimizer of the chain as Parts, their bundles laid out in one host buffer and cut into
    chunks of at most `chunk_bytes`, in the chain's order."""

    def __init__(self, dist_optimizers, chunk_bytes: int):
        if chunk_bytes <= 0:
            raise ValueError(f"the streamed step needs a window of > 0 bytes, got {chunk_bytes}")
        self.parts = [Part(i, o) for i, o in enumerate(dist_optimizers)]
        self.chunk_bytes = chunk_bytes
        self.slots = 2  # the window's slots (layout.window_sizes): more only where the run has room (sizing.py)
        self.chunks: List[layout.Chunk] = []
        self.device = None
        self.nbytes: Optional[int] = None  # the host buffer's size, once laid out
        # Counts the times the masters' host copy may have been written outside an update (a take-over, a
        # load, reload_model_params, a torn step): a norm taken before the last one is stale (norms.py)
        self.writes = 0

    def lay_out(self) -> int:
        """Lay out every bundle (once); the host bytes the buffer needs."""
        if self.nbytes is not None:
            return self.nbytes
        offset = 0
        for part in self.parts:
            opt, inner = part.opt, part.inner
            movable = Movable(opt, part.fsdp)
            part.model_of = {} if part.fsdp is not None else model_params_of_masters(opt)
            moved_masters = set()
            for t in masters(opt, part.fsdp):
                if movable.take(t):
                    moved_masters.add(id(t))
                elif construction.is_staged(t):  # made on the host for this engine: left out, Megatron-Core's own
                    # gradient copy would meet it there at the first step
                    raise BridgeFGOError(f"internal: an fp32 master made on the host at construction (shape "
                                         f"{tuple(t.shape)}) is not one the streamed step can take")
            part.bundles = [layout.bundle_of(part.index, gi, p, inner.param_groups[gi], inner, part.contract,
                                             movable, id(fsdp.local(p)) in moved_masters)
                            for gi, p in inner_params(inner)]
            part.shared = movable.shared
            offset = layout.place(part.bundles, offset)
        self.cut()
        self.device = compute_device(self.parts)
        self.nbytes = offset
        return offset

    def cut(self) -> None:
        """Chunks of what is not resident (again after a budget keeps bundles on the GPU)."""
        self.chunks = []
        for part in self.parts:
            part.chunks = layout.chunks_of(part.bundles, self.chunk_bytes, first_index=len(self.chunks),
                                           in_order=part.in_order)
            self.chunks += part.chunks

    def window_if(self, kept: Collection[int] = ()) -> Tuple[int, int]:
        """(window bytes, largest pass of the inner optimizer: a chunk, or a piece of the states updated
        in place) at the current chunk size and slots, were the bundles whose ids are in `kept` resident
        too: what a memory budget's choice leaves the step (none: the plan as cut)."""
        chunks = self.chunks
        if kept:
            chunks = []
            for part in self.parts:
                chunks += layout.chunks_of(part.bundles, self.chunk_bytes, len(chunks), kept, part.in_order)
        largest = max([c.nbytes for c in chunks] + [p.largest_piece(self.chunk_bytes, kept) for p in self.parts] + [0])
        return sum(layout.window_sizes(chunks, self.slots)), largest

    def part_of(self, opt) -> Part:
        return next(p for p in self.parts if p.holds(opt))

    # -- where the entries are bound --------------------------------------------------------------
    def streamed_entries(self) -> Iterator[Tuple[Part, Bindings, Entry]]:
        for part in self.parts:
            b = part.bindings
            for bundle in part.bundles:
                if not bundle.resident:
                    for e in bundle.entries:
                        if not e.dropped:
                            yield part, b, e

    def away(self) -> Iterator[tuple]:
        """(part, bindings, entry, tensor) of every streamed entry bound elsewhere than its host view."""
        for part, b, e in self.streamed_entries():
            t = b.get(e)
            if t is not None and not same(t, e.host):
                yield part, b, e, t

    def streamed_masters(self) -> Dict[int, Entry]:
        """id(master) -> its entry, for every master that moves (not kept on the GPU by a budget)."""
        return {id(e.param): e for _, _, e in self.streamed_entries() if e.kind == MASTER}

    def on_host(self) -> bool:
        """Every streamed entry that exists is bound to its host view."""
        return next(self.away(), None) is None

    # -- figures ----------------------------------------------------------------------------------
    @property
    def window_sizes(self) -> List[int]:
        return layout.window_sizes(self.chunks, self.slots)

    @property
    def window_bytes(self) -> int:
        return sum(self.window_sizes)

    @property
    def bytes(self) -> int:
        """What moves each way per step."""
        return sum(e.nbytes for part in self.parts for bd in part.bundles if not bd.resident
                   for e in bd.entries if not e.dropped)

    @property
    def resident_bytes(self) -> int:
        """What a memory budget keeps on the GPU instead."""
        return sum(e.nbytes for part in self.parts for bd in part.bundles if bd.resident
                   for e in bd.entries if not e.dropped)

    @property
    def made_on_load(self) -> int:
        """Pageable host memory a checkpoint load takes beside the buffer: the states of the one parameter
        at a time that Megatron-Core's init_state_fn makes (tensors.Kind.inits_on_load; readers.py), the
        largest parameter's."""
        return max((sum(e.nbytes for e in bd.entries if e.kind != MASTER) for part in self.parts
                    if kind_of(part.opt).inits_on_load for bd in part.bundles), default=0)

    @property
    def master_bytes(self) -> int:
        return sum(e.nbytes for part in self.parts for e in part.entries() if e.kind == MASTER)

    @property
    def quantized(self) -> int:
        """Masters of FP8/FP4 parameters, cast once after the last chunk from their kept copies (quantized.py)."""
        return sum(1 for part in self.parts if quantized.in_use(part.opt)
                   for _, model_param in part.model_of.values() if quantized.is_quantized(part.opt, model_param))

    @property
    def tensors(self) -> int:
        return sum(len(part.entries()) for part in self.parts)

    def optimizers(self) -> List[str]:
        out = []
        for part in self.parts:
            inner = part._inner()
            if inner is None:
                continue
            text = contracts.describe(inner)
            if part.fsdp is not None:  # which sharding was found, for the per-rank lines and status
                text += (f" under Megatron-FSDP, {fsdp.sharding(part._opt())} ({len(part.fsdp.flats)} main-weight "
                         "buffer(s))")
            out.append(text)
        return out
