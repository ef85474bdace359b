"""bridge_fgo's own optimizer-state offload engine, for Megatron-Core releases that have none.

One Engine per DistributedOptimizer. What moves: every per-parameter tensor in the inner optimizer's
state on the GPU (Adam moments; TE FusedAdam's master_param too) and the fp32 master copies of
bf16/fp16 parameters (shard_fp32_from_float16_groups). What never moves: model parameters, the
param and grad buffers, fp32 shards that alias model parameters, and any tensor that does not own
its whole storage (releasing that storage would free memory others use).

How: one pinned host buffer per optimizer, sized before the first step from the states that will
exist (Adam's two moments per parameter) and reused every step; device-to-host on its own stream,
ordered after the last optimizer step and overlapping the forward pass; GPU storage released with
the allocator told about the copy stream (so blocks are reused only after the copy read them);
host-to-device on its own stream started when gradient finalization begins; the compute stream
waits for it before the optimizer step. On CPU tensors (tests) the same bookkeeping runs with
plain synchronous copies.
"""
from __future__ import annotations

from typing import Iterable, List, Optional, Tuple

from .log import logger, rank_prefix

ALIGN = 512  # bytes: each slot starts aligned, so every copy is a clean DMA


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _storage_key(t) -> int:
    return t.untyped_storage().data_ptr()


def _owns_storage(t) -> bool:
    return (t.storage_offset() == 0 and t.is_contiguous()
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())


def _flat(groups) -> Iterable:
    for group in groups or ():
        for t in group:
            if t is not None:
                yield t


def _excluded_storages(opt) -> set:
    """Storages that never move: model parameters, fp32 shards that alias them, param/grad buffers."""
    keys = set()
    for name in ("model_float16_groups", "model_fp32_groups", "shard_fp32_groups", "shard_float16_groups"):
        keys.update(_storage_key(t) for t in _flat(getattr(opt, name, None)))
    for buf in getattr(opt, "buffers", None) or ():
        for attr in ("param_data", "grad_data"):
            t = getattr(buf, attr, None)
            if t is not None:
                keys.add(_storage_key(t))
    return keys


def candidates(opt) -> Tuple[List[object], int]:
    """The tensors of one DistributedOptimizer that move, in a stable order (master weights, then
    each parameter's state), and how many were skipped because they share their storage."""
    import torch

    excluded = _excluded_storages(opt)
    seen, out, skipped = set(), [], 0

    def take(t):
        nonlocal skipped
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.numel() == 0:
            return  # scalars such as Adam's step counter stay put
        if t.device.type not in ("cuda", "cpu") or (t.device.type == "cpu" and torch.cuda.is_available()):
            return  # already on the host
        if t.untyped_storage().nbytes() == 0:
            return  # released elsewhere; never copy from freed storage
        key = _storage_key(t)
        if key in excluded or key in seen:
            return
        if not _owns_storage(t):
            skipped += 1
            return
        seen.add(key)
        out.append(t)

    for t in _flat(getattr(opt, "shard_fp32_from_float16_groups", None)):
        take(t)
    inner = getattr(opt, "optimizer", None)
    state = getattr(inner, "state", None) or {}
    for group in getattr(inner, "param_groups", None) or ():
        for p in group["params"]:
            for value in (state.get(p) or {}).values():
                take(value)
    return out, skipped


class PinnedBuffer:
    """The host buffer: page-locked through hostmem.pin (first touch on the GPU's NUMA node, then
    cudaHostRegister, with a logged fallback) when the states are on a GPU; plain memory otherwise."""

    def __init__(self, nbytes: int, cuda: bool):
        import torch

        self.nbytes = nbytes
        self.host = None
        if cuda and nbytes:
            from . import hostmem

            self.host = hostmem.pin(nbytes)
            self.tensor, self.registered = self.host.tensor, self.host.registered
        else:
            self.tensor, self.registered = torch.empty(nbytes, dtype=torch.uint8), False

    def describe(self) -> str:
        return self.host.describe() if self.host is not None else f"{self.nbytes} bytes of unpinned host memory"

    def free(self) -> None:
        if self.host is not None:
            self.host.free()
        self.registered = False
        self.tensor = None


class Engine:
    def __init__(self, dist_optimizer):
        self.opt = dist_optimizer
        self.plan: List[Tuple[object, int, int]] = []  # (tensor, offset, nbytes)
        self.signature = None
        self.buffer: Optional[PinnedBuffer] = None
        self.released = False
        self._planned: Optional[int] = None
        self.skipped_shared = 0
        self.cuda = False
        self._d2h = self._h2d = None
        self._d2h_done = self._h2d_done = None

    # -- what moves -------------------------------------------------------------------------------
    def _inner(self):
        return getattr(self.opt, "optimizer", None)

    def _state_signature(self):
        inner = self._inner()
        state = getattr(inner, "state", None) or {}
        return len(state), sum(len(v) for v in state.values() if isinstance(v, dict))

    def candidates(self) -> List[object]:
        out, self.skipped_shared = candidates(self.opt)
        return out

    def predicted_bytes(self) -> int:
        """Bytes once every state exists: what the current plan moves, plus, for parameters without
        state yet, Adam's exp_avg and exp_avg_sq, each shaped and typed like the (master) parameter."""
        inner = self._inner()
        state = getattr(inner, "state", None) or {}
        total = sum(_align(n) for _, _, n in self.plan)
        for group in getattr(inner, "param_groups", None) or ():
            for p in group["params"]:
                if not state.get(p):
                    total += 2 * _align(p.numel() * p.element_size())
        return total

    def _replan(self) -> int:
        """Lay out the tensors to move in the host buffer; returns the bytes the layout needs."""
        tensors = self.candidates()
        offset, plan = 0, []
        for t in tensors:
            n = t.numel() * t.element_size()
            plan.append((t, offset, n))
            offset += _align(n)
        self.plan, self.signature = plan, self._state_signature()
        inner_params = [p for g in getattr(self._inner(), "param_groups", None) or () for p in g["params"]]
        self.cuda = any(t.is_cuda for t, _, _ in plan) or any(p.is_cuda for p in inner_params)
        return offset

    def _ensure_buffer(self, nbytes: int) -> None:
        if self.buffer is None or self.buffer.nbytes < nbytes:
            self._allocate(nbytes)

    def _allocate(self, nbytes: int) -> None:
        if self.buffer is not None:
            logger.info("%sbuilt-in offload: host buffer grows from %d to %d bytes (states appeared that were "
                        "not predicted)", rank_prefix(), self.buffer.nbytes, nbytes)
            self.buffer.free()
        self.buffer = PinnedBuffer(nbytes, self.cuda)
        if self.cuda and self._d2h is None:
            import torch

            self._d2h, self._h2d = torch.cuda.Stream(), torch.cuda.Stream()
            self._d2h_done, self._h2d_done = torch.cuda.Event(), torch.cuda.Event()

    # -- the engine's steps -----------------------------------------------------------------------
    def plan_bytes(self) -> int:
        """Plan what moves; the host bytes the buffer will need once Adam's moments exist."""
        self._planned = max(self._replan(), self.predicted_bytes())
        return self._planned

    def prepare(self) -> None:
        """Before the first step: allocate (and pin) the host buffer for the predicted size, and run
        one DMA pass over it so the first training step does not pay for first use of its pages."""
        self._ensure_buffer(self._planned if self._planned is not None else self.plan_bytes())
        if self.cuda and self.buffer.nbytes:
            import torch

            chunk = min(self.buffer.nbytes, 256 * 2**20)
            scratch = torch.empty(chunk, dtype=torch.uint8, device="cuda")
            with torch.cuda.stream(self._h2d):
                for start in range(0, self.buffer.nbytes, chunk):
                    piece = self.buffer.tensor[start:start + chunk]
                    scratch[: piece.numel()].copy_(piece, non_blocking=True)
            self._h2d.synchronize()
            del scratch

    def _slot(self, offset: int, t):
        n = t.numel()
        return self.buffer.tensor[offset:offset + n * t.element_size()].view(t.dtype)

    def offload(self) -> int:
        if self.released:
            return 0  # the host copy is current; never read released storage
        if self.signature != self._state_signature() or self.buffer is None:
            self._ensure_buffer(self._replan())  # states that appeared since (Adam's, after the first step)
        if not self.plan:
            return 0
        if not self.cuda:
            for t, off, _ in self.plan:
                self._slot(off, t).copy_(t.detach().view(-1))
            return self.bytes
        import torch

        self._d2h.wait_stream(torch.cuda.current_stream())  # the last optimizer step is done
        with torch.cuda.stream(self._d2h):
            for t, off, _ in self.plan:
                self._slot(off, t).copy_(t.detach().view(-1), non_blocking=True)
            self._d2h_done.record()
        return self.bytes

    def release(self) -> None:
        if self.released or not self.plan:
            return
        for t, _, _ in self.plan:
            if self.cuda:
                t.record_stream(self._d2h)  # the allocator reuses the block only after the copy read it
            t.untyped_storage().resize_(0)
        self.released = True

    def reload(self) -> int:
        if not self.released:
            return 0
        for t, _, n in self.plan:
            t.untyped_storage().resize_(n)  # on the current stream, where the step will use it
        if not self.cuda:
            for t, off, _ in self.plan:
                t.detach().view(-1).copy_(self._slot(off, t))
            self.released = False
            return self.bytes
        import torch

        self._h2d.wait_stream(torch.cuda.current_stream())
        self._h2d.wait_event(self._d2h_done)  # the host copy is complete
        with torch.cuda.stream(self._h2d):
            for t, off, _ in self.plan:
                t.detach().view(-1).copy_(self._slot(off, t), non_blocking=True)
            self._h2d_done.record()
        self.released = False
        return self.bytes

    def wait_reload(self) -> None:
        if self.cuda and self._h2d_done is not None:
            import torch

            torch.cuda.current_stream().wait_event(self._h2d_done)

    def close(self) -> None:
        if self.released:
            self.reload()
            self.wait_reload()
        if self.buffer is not None:
            if self.cuda:
                import torch

                torch.cuda.synchronize()  # no copy on either stream may still use the buffer
            self.buffer.free()
            self.buffer = None
        self.plan = []

    @property
    def bytes(self) -> int:
        return sum(n for _, _, n in self.plan)

    @property
    def pinned_bytes(self) -> int:
        return self.buffer.nbytes if self.buffer is not None else 0

    @property
    def tensors(self) -> int:
        return len(self.plan)

    @property
    def steady_bytes(self) -> int:
        """Bytes each step moves once Adam's moments exist (before the first step they do not)."""
        inner = self._inner()
        state = getattr(inner, "state", None) or {}
        missing = sum(2 * p.numel() * p.element_size() for g in getattr(inner, "param_groups", None) or ()
                      for p in g["params"] if not state.get(p))
        return self.bytes + missing
