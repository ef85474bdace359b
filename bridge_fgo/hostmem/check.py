"""The refusal: every rank of the node pins its bytes; refuse before anything is pinned when the node
does not have them. Pinned pages can be neither swapped nor reclaimed, so a shortfall goes straight
to the OOM killer, which picks a process on the node, not necessarily ours."""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Mapping, Optional

from ..errors import BridgeFGOConfigError
from ..log import once, rank_prefix
from . import available
from .common import GiB, fmt_bytes, under
from .ranks import LocalRanks, local_ranks

# The safety reserve kept free on top of what the ranks pin: max(RESERVE_MIN_BYTES, RESERVE_FRACTION x
# available). It absorbs host memory the run grows into after the check (data-loader workers, checkpoint
# staging, allocator caches, the CUDA driver's own host allocations), and the kernel's free-page
# watermarks (MemAvailable already excludes the low watermark, but reclaim starts stalling near it).
# 2 GiB covers those on a small host; 5% scales it on large ones (about 100 GiB on a 2 TiB node,
# where eight ranks' growth of a few GiB each is the realistic margin).
RESERVE_MIN_BYTES = 2 * GiB
RESERVE_FRACTION = 0.05

# What to change when the check refuses. The host buffer is sized before the first step for every state
# that may move: neither gpu_budget_gib (decided after the first step) nor the chunk size (chunk_mb,
# which only sizes the transfers) makes it smaller.
FIXES = ("reduce the bytes each rank pins: more data-parallel ranks (the distributed optimizer shards its "
         "states over them) or more tensor/pipeline parallelism (fewer parameters per rank); the "
         "transfer chunk size (chunk_mb) does not reduce host bytes, nor does gpu_budget_gib; or "
         "run fewer ranks on this node; or give it more host memory (a larger container/cgroup memory "
         "limit, e.g. memory.max, docker --memory, Slurm --mem, Kubernetes resources.limits.memory)")


# What a checkpoint load makes beside the pinned buffer (engine/streamed/readers.py, Plan.made_on_load)
LOAD = ("pageable: the largest parameter's states, made by Megatron-Core's init_state_fn one parameter at a time "
        "and copied into the pinned buffer")

# What to change when an asynchronous checkpoint save's snapshot does not fit in /dev/shm.
SHM_FIXES = ("a larger /dev/shm (docker run --shm-size, a Kubernetes emptyDir volume with medium: Memory and a "
             "sizeLimit mounted at /dev/shm), or cfg.checkpoint.async_save=False, or the one-window engine "
             "(chunk_mb=0: the states are on the GPU between steps and reach the worker through CUDA IPC)")


@dataclass(frozen=True)
class HostFit:
    """The host-memory check's figures: log `describe()`, show `as_dict()` in `bridge-fgo status`."""
    bytes_per_rank: int
    local_ranks: int
    local_ranks_source: str
    needed: int                    # (bytes_per_rank + snapshot_per_rank + load_per_rank) x local_ranks
    reserve: int                   # kept free on top (RESERVE_MIN_BYTES / RESERVE_FRACTION)
    available: Optional[int]       # None: nothing could be read, the check did not run
    source: Optional[str]          # "MemAvailable", "cgroup v1", "cgroup v2"
    detail: Optional[str]
    fits: Optional[bool]           # None when available is unknown
    # an asynchronous checkpoint save's copy of the host states (pageable, while the save is written)
    snapshot_per_rank: int = 0
    shm_available: Optional[int] = None  # /dev/shm's free bytes, when the snapshots pass through it
    shm_detail: Optional[str] = None
    # what a checkpoint load makes beside the pinned buffer (pageable, while it loads)
    load_per_rank: int = 0

    def describe(self) -> str:
        per_rank = f"{fmt_bytes(self.bytes_per_rank)} pinned per rank"
        if self.snapshot_per_rank:
            per_rank += (f" + {fmt_bytes(self.snapshot_per_rank)} per rank for asynchronous checkpoint saves (the "
                         "snapshot of the host states their writer is handed; kept for the run where the states are "
                         "saved dp_reshardable or fsdp_dtensor; a second one only where saves overlap and every local "
                         "rank has room for it then)")
        if self.load_per_rank:
            per_rank += f" + {fmt_bytes(self.load_per_rank)} per rank while a checkpoint load makes states ({LOAD})"
        head = (f"host memory: {per_rank} x {self.local_ranks} local rank(s) ({self.local_ranks_source}) = "
                f"{fmt_bytes(self.needed)}")
        if self.available is None:
            head += "; available host memory unknown, not checked"
        else:
            head += (f", plus a reserve of {fmt_bytes(self.reserve)}; available {fmt_bytes(self.available)} "
                     f"({self.source}: {self.detail}): {'fits' if self.fits else 'does NOT fit'}")
        if self.shm_detail is not None:
            head += f"; {self.shm_detail}"
        return head

    def as_dict(self) -> dict:
        return asdict(self)


def reserve_for(available_now: int) -> int:
    return max(RESERVE_MIN_BYTES, int(available_now * RESERVE_FRACTION))


def check_fits(bytes_per_rank: int, *, snapshot_per_rank: int = 0, snapshot_in_shm: bool = False,
               env: Optional[Mapping[str, str]] = None, root: Optional[str] = None,
               ranks: Optional[int] = None, load_per_rank: int = 0) -> HostFit:
    """Refuse, before anything is pinned, host memory the node does not have.

    `bytes_per_rank` is everything this rank will pin (the sum over every optimizer in the chain);
    `snapshot_per_rank` what an asynchronous checkpoint save copies of the host states besides, while
    it is written (pageable), and `snapshot_in_shm` whether that copy passes through /dev/shm (Bridge's
    persistent checkpoint worker receives it there), which must then hold every local rank's copy;
    `load_per_rank` what a checkpoint load makes beside the pinned buffer (pageable, while it loads;
    counted with the snapshot though the two never meet: it is one parameter's states).
    Call it on every rank before any rank of the node pins: MemAvailable drops as ranks pin, so a
    rank checking after its neighbours pinned would count their bytes twice. `ranks` overrides the
    local rank count read from `env`. Raises BridgeFGOConfigError when (bytes_per_rank +
    snapshot_per_rank + load_per_rank) x local ranks + reserve exceeds what is available, or the
    snapshots exceed /dev/shm's free space; returns the figures otherwise (fits=None, with one WARNING, when nothing
    could be read). The verdict is this rank's own: bridge_fgo.agree makes it every rank's."""
    if min(bytes_per_rank, snapshot_per_rank, load_per_rank) < 0:
        raise ValueError(f"bytes_per_rank, snapshot_per_rank and load_per_rank must be >= 0, got {bytes_per_rank}, "
                         f"{snapshot_per_rank}, {load_per_rank}")
    if ranks is not None and int(ranks) < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    lr = local_ranks(env) if ranks is None else LocalRanks(int(ranks), f"{int(ranks)} (given by the caller)")
    needed = (bytes_per_rank + snapshot_per_rank + load_per_rank) * lr.count
    mem = available.host_memory(root)
    if mem is None:
        once("hostmem-unknown", logging.WARNING,
             "%scannot read the host memory available (no MemAvailable in %s, no cgroup memory limit); "
             "%s per rank x %d local rank(s) = %s will be pinned without a check", rank_prefix(),
             under(root, "proc/meminfo"), fmt_bytes(bytes_per_rank), lr.count, fmt_bytes(bytes_per_rank * lr.count))
        return HostFit(bytes_per_rank, lr.count, lr.source, needed, 0, None, None, None, None, snapshot_per_rank,
                       *_shm(snapshot_per_rank * lr.count, snapshot_in_shm, root), load_per_rank)
    reserve = reserve_for(mem.bytes)
    fits = needed == 0 or needed + reserve <= mem.bytes  # pinning nothing cannot hurt
    if not fits:
        besides = (f" + {fmt_bytes(snapshot_per_rank)} per rank that an asynchronous checkpoint save copies of the "
                   "host states while it is written (cfg.checkpoint.async_save=False saves that)"
                   if snapshot_per_rank else "")
        besides += (f" + {fmt_bytes(load_per_rank)} per rank that a checkpoint load makes beside it ({LOAD})"
                    if load_per_rank else "")
        raise BridgeFGOConfigError(
            f"optimizer-state offload would pin more host memory than this node has: {fmt_bytes(bytes_per_rank)} "
            f"per rank{besides} x {lr.count} local rank(s) ({lr.source}) = {fmt_bytes(needed)}, plus a safety "
            f"reserve of {fmt_bytes(reserve)} (max({RESERVE_MIN_BYTES // GiB} GiB, {RESERVE_FRACTION:.0%} of "
            f"available)) = {fmt_bytes(needed + reserve)}, but only {fmt_bytes(mem.bytes)} is available "
            f"({mem.source}: {mem.detail}). Pinned pages cannot be swapped or reclaimed, so this would end in the "
            f"OOM killer; refused before anything was pinned. Fix: {FIXES}.")
    return HostFit(bytes_per_rank, lr.count, lr.source, needed, reserve, mem.bytes, mem.source, mem.detail, fits,
                   snapshot_per_rank, *_shm(snapshot_per_rank * lr.count, snapshot_in_shm, root), load_per_rank)


def _shm(total: int, in_shm: bool, root: Optional[str]):
    """(free bytes, what the line says) of /dev/shm for `total` snapshot bytes passing through it, or
    (None, None) when they do not; raises BridgeFGOConfigError when they do not fit."""
    if not (in_shm and total):
        return None, None
    path = under(root, "dev/shm")
    free = available.shm_free(root)
    if free is None:
        return None, f"/dev/shm ({path}) unreadable: the asynchronous saves' {fmt_bytes(total)} not checked there"
    if total > free:
        raise BridgeFGOConfigError(
            f"an asynchronous checkpoint save of optimizer state kept in host memory would not fit in /dev/shm: its "
            f"writer copies the host states ({fmt_bytes(total)} over this node's local ranks) and Bridge's "
            f"persistent checkpoint worker (cfg.checkpoint.use_persistent_ckpt_worker) receives the copy through "
            f"shared memory, but {path} has {fmt_bytes(free)} free (without offload the worker receives GPU "
            f"tensors through CUDA IPC instead). A full /dev/shm fails the save (SIGBUS or ENOSPC) hours into the "
            f"run; refused before anything was pinned. Fix: {SHM_FIXES}.")
    return free, f"/dev/shm ({path}): {fmt_bytes(total)} of asynchronous saves' copies, {fmt_bytes(free)} free: fits"


def room_for(bytes_per_rank: int, *, in_shm: bool = False, env: Optional[Mapping[str, str]] = None,
             root: Optional[str] = None) -> Optional[str]:
    """Why `bytes_per_rank` more on every local rank does not fit now (None: it fits), for memory made while
    training runs (a second snapshot of the host states for an asynchronous save that starts beside a pending
    one): what is available now, less the same reserve as the check before the first step, and /dev/shm's
    free bytes when `in_shm`. Unknown figures do not fit. Every local rank must ask before any of them makes it."""
    lr = local_ranks(env)
    total = bytes_per_rank * lr.count
    mem = available.host_memory(root)
    if mem is None:
        return f"the host memory available is unknown (no MemAvailable in {under(root, 'proc/meminfo')})"
    reserve = reserve_for(mem.bytes)
    if total + reserve > mem.bytes:
        return (f"{fmt_bytes(bytes_per_rank)} x {lr.count} local rank(s) = {fmt_bytes(total)} plus the reserve of "
                f"{fmt_bytes(reserve)} is more than the {fmt_bytes(mem.bytes)} available ({mem.source}: {mem.detail})")
    if in_shm:
        free = available.shm_free(root)
        if free is None or total > free:
            return (f"/dev/shm ({under(root, 'dev/shm')}) has "
                    f"{'an unknown amount' if free is None else fmt_bytes(free)} free for {fmt_bytes(total)}")
    return None
