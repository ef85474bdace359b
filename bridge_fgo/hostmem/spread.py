"""Host-memory work spread over a few threads: copies between host tensors and first touches.

One thread moves or faults in host memory at about 1.3-4 GB/s, and torch's copy_ and zero_ run on one
thread under torchrun (OMP_NUM_THREADS=1). ctypes' memmove and memset drop the GIL and use no pool of
their own, so several threads of ours run them at once while Python goes on elsewhere.

Importing this module does not import torch (torch_threads does, when called).
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from typing import Callable, Iterable, Iterator, List, Sequence, Tuple

from .ranks import local_ranks

PIECE = 64 * 2**20    # one unit of work: large enough that a thread's start is nothing beside it
THREADS = 8           # memcpy and page faulting stop scaling beyond a few threads per rank


def rank_threads() -> int:
    """How many threads this rank's host-memory work may use: its share of the cores it may run on (the
    node's ranks share them), at most THREADS, at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(THREADS, cores // local_ranks().count))


@contextlib.contextmanager
def torch_threads() -> Iterator[Tuple[int, int]]:
    """torch's intra-op threads raised to rank_threads() for the block, never lowered, restored after it (an
    exception too); yields (before, during). Under torchrun a rank has one (OMP_NUM_THREADS=1), and torch's
    copy_ between host tensors runs on them: a checkpoint load into the host buffer, 1.27x the load without
    offload on data-parallel 2 with one, 1.10x with eight in both (2xH200, 2026-11-28)."""
    import torch

    before = torch.get_num_threads()
    during = max(before, rank_threads())
    if during != before:
        torch.set_num_threads(during)
    try:
        yield before, during
    finally:
        if during != before:
            torch.set_num_threads(before)


def pieces(spans: Iterable[Tuple[int, ...]]) -> List[Tuple[int, ...]]:
    """(address..., nbytes) spans cut into PIECE-sized ones: each address advanced by the offset."""
    out = []
    for span in spans:
        *ptrs, n = span
        out += [(*(p + a for p in ptrs), min(PIECE, n - a)) for a in range(0, n, PIECE)]
    return out


def run(fn: Callable, items: Sequence[tuple], name: str, workers: int = THREADS) -> int:
    """fn(*item) for every item, from up to `workers` threads (round robin); the first error is raised here
    once all have stopped. How many threads ran (0 for no items)."""
    if not items:
        return 0
    workers = max(1, min(workers, os.cpu_count() or 1, len(items)))
    errors: List[BaseException] = []

    def work(mine):
        try:
            for item in mine:
                fn(*item)
        except BaseException as exc:  # raised in the caller
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(items[i::workers],), name=f"bridge_fgo-{name}-{i}")
               for i in range(workers)]
    for t in threads:
        t.start()
    try:
        for t in threads:
            t.join()
    finally:  # never unwound (an interrupt in join) while a thread still works on the caller's addresses
        for t in threads:
            t.join()
    if errors:
        raise errors[0]
    return workers


def copy(pairs: Iterable[Tuple[object, object]], name: str = "copy") -> int:
    """Each (dst, src) pair of contiguous host tensors of the same byte size copied, from several threads;
    the caller keeps both alive meanwhile. How many threads ran."""
    spans = []
    for dst, src in pairs:
        n = dst.numel() * dst.element_size()
        if n != src.numel() * src.element_size() or not (dst.is_contiguous() and src.is_contiguous()):
            raise ValueError("spread.copy: a pair that is not two contiguous tensors of the same byte size")
        spans.append((dst.data_ptr(), src.data_ptr(), n))
    return run(ctypes.memmove, pieces(spans), name)


def touch(tensors: Iterable[object], name: str = "touch") -> int:
    """Every page of each host tensor written once (zeros), from several threads. How many threads ran."""
    spans = [(t.data_ptr(), n) for t in tensors if (n := t.numel() * t.element_size())]
    return run(lambda ptr, n: ctypes.memset(ptr, 0, n), pieces(spans), name)
