"""Copies between the host buffer and the GPU, ordered by events, and the GPU window they pass through.

DeviceCopies: two CUDA streams (host-to-device, device-to-host) beside the compute stream; every
copy waits for the events it is given and records its own; the allocator is told about both copy
streams before memory a copy used is given back (record_stream), so it is reused only after them.

DeferredCopies (CPU, no GPU: the tests): the same calls, but a copy runs only when something waits
for it (or for a later copy of its queue), after whatever it was told to wait for. A missing wait
in the engine therefore shows on CPU as stale or unfinished data, as it would on a GPU.
"""
from __future__ import annotations

import time
from typing import Dict, List, Sequence


class _Done:
    """An event that has already happened (CPU compute is synchronous)."""


DONE = _Done()


class DeviceCopies:
    device_copies = True

    def __init__(self, device):
        import torch

        self.torch = torch
        self.device = device
        self.h2d_stream = torch.cuda.Stream(device)
        self.d2h_stream = torch.cuda.Stream(device)
        self._stalls: List[tuple] = []  # (before, after) timing events around compute-stream waits
        self.exposed_s: List[float] = []  # per step: time the compute stream waited for copies

    def compute_event(self):
        ev = self.torch.cuda.Event()
        ev.record()  # on the current (compute) stream
        return ev

    def copy(self, direction: str, dst, src, after: Sequence = ()):
        stream = self.h2d_stream if direction == "h2d" else self.d2h_stream
        with self.torch.cuda.stream(stream):
            for ev in after:
                if ev is not None and ev is not DONE:
                    stream.wait_event(ev)
            dst.copy_(src, non_blocking=True)
            done = self.torch.cuda.Event()
            done.record(stream)
        return done

    def compute_wait(self, ev, timed: bool = True) -> None:
        """The compute stream waits for `ev`; how long it stalled is measured (timing events) when
        `timed`: an update's waits are its exposed copy time, a reader's between steps are not."""
        if not timed:
            self.torch.cuda.current_stream().wait_event(ev)
            return
        before = self.torch.cuda.Event(enable_timing=True)
        after = self.torch.cuda.Event(enable_timing=True)
        before.record()
        self.torch.cuda.current_stream().wait_event(ev)
        after.record()
        self._stalls.append((before, after))

    def host_wait(self, ev) -> None:
        if ev is not None and ev is not DONE:
            ev.synchronize()

    def host_wait_all(self) -> None:
        self.d2h_stream.synchronize()
        self.h2d_stream.synchronize()

    def retire(self, tensor) -> None:
        tensor.record_stream(self.h2d_stream)
        tensor.record_stream(self.d2h_stream)

    def free_after(self, tensor, ev) -> None:
        """`tensor`'s storage is about to be freed: the allocator waits for the copy streams."""
        if tensor.device.type == "cuda":
            self.retire(tensor)

    def end_step(self) -> None:
        """Close the step's stall measurement (read later, once its events are surely done)."""
        if self._stalls:
            self._pending_stalls, self._stalls = self._stalls, []

    def collect(self) -> None:
        pending = getattr(self, "_pending_stalls", None)
        if pending and all(b.query() for _, b in pending):
            self.exposed_s.append(sum(a.elapsed_time(b) for a, b in pending) / 1e3)
            self._pending_stalls = None


class _Deferred:
    def __init__(self, queue: str, index: int):
        self.queue, self.index = queue, index


class DeferredCopies:
    device_copies = False

    def __init__(self, device=None):
        self.device = device
        self._ops: Dict[str, list] = {"h2d": [], "d2h": []}
        self._next: Dict[str, int] = {"h2d": 0, "d2h": 0}
        self.exposed_s: List[float] = []

    def compute_event(self):
        return DONE

    def copy(self, direction: str, dst, src, after: Sequence = ()):
        self._ops[direction].append((dst, src, [a for a in after if a is not None and a is not DONE]))
        return _Deferred(direction, len(self._ops[direction]) - 1)

    def _run(self, ev) -> None:
        if ev is None or ev is DONE:
            return
        ops = self._ops[ev.queue]
        while self._next[ev.queue] <= ev.index:
            dst, src, after = ops[self._next[ev.queue]]
            for a in after:
                self._run(a)
            dst.copy_(src)
            ops[self._next[ev.queue]] = None  # done: drop the references
            self._next[ev.queue] += 1

    host_wait = _run

    def compute_wait(self, ev, timed: bool = True) -> None:
        self._run(ev)

    def host_wait_all(self) -> None:
        for q, ops in self._ops.items():
            if self._next[q] < len(ops):
                self._run(_Deferred(q, len(ops) - 1))

    def pending(self) -> int:
        return sum(len(ops) - self._next[q] for q, ops in self._ops.items())

    def retire(self, tensor) -> None:
        pass  # a queued copy holds its tensors until it runs

    def free_after(self, tensor, ev) -> None:
        """`tensor`'s storage is about to be freed (resized to 0 in place): run the copy reading it."""
        self._run(ev)

    def end_step(self) -> None:
        pass

    def collect(self) -> None:
        pass


def copies_for(device):
    return DeviceCopies(device) if device is not None and device.type == "cuda" else DeferredCopies(device)


class _Slot:
    def __init__(self, nbytes: int):
        self.nbytes = nbytes  # the largest chunk it takes
        self.tensor = None  # allocated when its first chunk comes in, given back when the window closes
        self.view = None
        self.h2d_done = None  # the chunk in it has arrived
        self.d2h_done = None  # the chunk that was in it has left


class Window:
    """The GPU memory the update streams through, shared by every engine of one chain: a ring of slots,
    chunk i in slot i % len(slots), each slot as large as the largest chunk it takes
    (layout.window_sizes). A slot is allocated when its first chunk's copy starts (at gradient
    finalization, or earlier, during the last backward: head.py) and every slot is given back when
    the update is over."""

    def __init__(self, copies, sizes, device):
        self.copies, self.device = copies, device
        self.slots = [_Slot(n) for n in sizes]

    @property
    def held(self) -> int:
        """Bytes allocated now."""
        return sum(s.nbytes for s in self.slots if s.tensor is not None)

    def slot(self, index: int, nbytes: int) -> _Slot:
        s = self.slots[index % len(self.slots)]
        if s.tensor is None:
            import torch

            # on the compute stream, so the allocator can hand it back to the model later
            s.tensor = torch.empty(s.nbytes, dtype=torch.uint8, device=self.device)
        s.view = s.tensor[:nbytes]
        return s

    def close(self) -> None:
        for s in self.slots:
            if s.tensor is not None:
                self.copies.retire(s.tensor)  # reused only after the copies in flight have read it
            s.tensor = s.view = s.h2d_done = s.d2h_done = None


class Stopwatch:
    """Host time spent waiting for copies (the first step's adoption, readers between steps)."""

    def __init__(self):
        self.seconds = 0.0

    def __enter__(self):
        self._t = time.perf_counter()

    def __exit__(self, *exc):
        self.seconds += time.perf_counter() - self._t
