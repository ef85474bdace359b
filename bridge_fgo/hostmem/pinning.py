"""The pinned host buffer: allocate (fresh anonymous pages: it reads as zero), first-touch on the GPU's NUMA
node, cudaHostRegister (with torch.empty(pin_memory=True) as the logged fallback), and release exactly once.

A PinnedHost is released by free(), or, when its owner drops it without free(), by a finalizer when
it is garbage-collected; either way cudaHostUnregister runs once and the bytes leave the process-wide
count that pinned_bytes() / live_buffers() report.
"""
from __future__ import annotations

import threading
import time
import weakref
from typing import Dict, Optional

from ..errors import BridgeFGOConfigError
from ..log import logger, rank_prefix
from . import available
from . import numa as _numa
from .check import FIXES
from .common import fmt_bytes

_HUGE_PAGE = 2**21  # a transparent huge page on x86-64: smaller buffers are not advised to use them
_PIN_MEMORY_SECONDS_NOTE = "1.2-2.5 s for cudaHostRegister vs 9-10 s for pin_memory=True, measured for 10 GB"

# Live PinnedHost buffers of this process. Re-entrant: the finalizer runs wherever the garbage
# collector does, which may be a thread inside a `with _lock` block.
_lock = threading.RLock()
_live = {"bytes": 0, "buffers": 0}


def pinned_bytes() -> int:
    """Bytes of PinnedHost buffers pinned now: not released, not unpin()ned (the CPU-only buffers of a
    process without CUDA count too, so lifetimes can be checked anywhere)."""
    with _lock:
        return _live["bytes"]


def live_buffers() -> int:
    """PinnedHost buffers not yet released."""
    with _lock:
        return _live["buffers"]


def _count(nbytes: int, buffers: int) -> None:
    with _lock:
        _live["bytes"] += nbytes
        _live["buffers"] += buffers


def _zero_pages(nbytes: int):
    """`nbytes` of fresh anonymous memory as a 1-D uint8 tensor: zero, as the kernel hands out pages, and
    faulted in only where first touched (torch.empty's pages may be recycled ones: its allocator decides).
    The tensor keeps the mapping alive; the last view dropped unmaps it.

    Private, not inherited by a forked child, transparent huge pages asked for. Python's default anonymous
    mapping is shared (shmem): its pages faulted in at 5.0 GB/s from 8 threads, private ones at 11.9 GB/s and
    private huge pages at 25.8 GB/s (one H200's host, 2026-11-28, scripts/bench_pages.py). A forked child (a
    data-loader worker; Megatron-Core's temporal checkpoint writer, handed copies made in the parent; Bridge's
    persistent writer is spawned) does not see it, as it does not see CUDA's own pinned memory: a private
    mapping it inherited would be copied at the fork once registered, or copied page by page as the parent
    writes it. Where the kernel refuses the advice on forking, the shared mapping; where it refuses huge
    pages, ordinary ones."""
    import mmap

    import torch

    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(mmap.MADV_DONTFORK)
    except (AttributeError, OSError, ValueError):
        m.close()
        m = mmap.mmap(-1, nbytes)
    else:
        if nbytes >= _HUGE_PAGE:
            try:
                m.madvise(mmap.MADV_HUGEPAGE)
            except (AttributeError, OSError, ValueError):  # no THP in this kernel: ordinary pages
                pass
    return torch.frombuffer(m, dtype=torch.uint8)


def _register(tensor, device: int, nbytes: int):
    """cudaHostRegister of the tensor's pages for `device`; the CUDA error (0: success)."""
    import torch

    def register():
        torch.cuda.set_device(device)  # a new thread starts on device 0
        return torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, 0)

    return _in_thread(register)


def _unregister(tensor, device: int, nbytes: int) -> None:
    import torch

    def unregister():
        # on the device it was registered for: a new thread starts on device 0 and would create a
        # context there; in a throwaway thread so a failure does not stay behind as this thread's last
        # CUDA error
        torch.cuda.set_device(device)
        return torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())

    err = _in_thread(unregister)
    if _code(err) != 0:
        logger.warning("%scudaHostUnregister of %s failed with %s; the pages stay locked until the "
                       "process exits", rank_prefix(), fmt_bytes(nbytes), _err_name(err))


def _release(held: Dict[str, object], device: Optional[int], nbytes: int, method: str) -> None:
    """Unregister (when registered for `device`, and not unpinned since) and drop the buffer. The
    PinnedHost's weakref.finalize calls it, so it runs once: from free(), or when the PinnedHost is
    collected."""
    pending = held.pop("pending", None)
    if pending is not None and pending.ident is None:  # held back and never started: nothing was registered
        held["unpinned"] = True
        _count(-nbytes, 0)
    elif pending is not None:  # a deferred registration still running: it finishes before anything is undone
        pending.join()
        _settle(held, nbytes)
    tensor = held.pop("tensor")
    how = held.get("by", "the garbage collector (free() was not called)")
    unpinned = held.get("unpinned", False)
    try:
        if device is not None and not unpinned:
            _unregister(tensor, device, nbytes)
        del tensor  # the last reference bridge_fgo held: the pages go now, unless a caller kept a view
        if method == "pin_memory=True":  # PyTorch caches freed pinned blocks; give this one back
            import torch

            empty = getattr(torch._C, "_host_emptyCache", None)
            if empty is not None:
                empty()
    except Exception as exc:  # a finalizer cannot raise to anyone: say it
        logger.warning("%sreleasing the %s host buffer failed: %s: %s", rank_prefix(), fmt_bytes(nbytes),
                       type(exc).__name__, exc)
    finally:
        _count(0 if unpinned else -nbytes, -1)
        logger.debug("%s%s host buffer (%s) released by %s", rank_prefix(), fmt_bytes(nbytes), method, how)


class PinnedHost:
    """A host buffer for the offloaded states. `tensor` is a 1-D uint8 CPU tensor of `nbytes`, None
    once released. Release it with free(); one dropped without free() is released when collected."""

    def __init__(self, tensor, nbytes: int, method: str, *, device: Optional[int] = None,
                 numa_node: Optional[int] = None, placement: str = "", seconds: float = 0.0, zeroed: bool = False):
        self.nbytes = nbytes
        self.zeroed = zeroed        # every byte read as zero when it was handed out (fresh anonymous pages)
        self.method = method        # "cudaHostRegister", "pin_memory=True", or "unpinned (...)"
        self.device = device        # the CUDA device it is registered for; None: not registered
        self.numa_node = numa_node  # the node it was first-touched on; None: no placement
        self.placement = placement  # how the first touch was done, or why without placement
        self.seconds = seconds      # allocation + first touch + pinning (deferred: without the registration)
        self.register_s = 0.0       # a deferred registration's own time, once waited for (wait())
        self.held_back = False      # a deferred registration that waited for start_registration()
        self.waited_s = 0.0         # how long wait() blocked for it
        # the only reference bridge_fgo keeps to the tensor, shared with the finalizer, which keeps
        # the memory alive until it runs and then drops it
        self._held: Dict[str, object] = {"tensor": tensor}
        self._data_ptr = tensor.data_ptr()  # where the pages are (moved(): somebody replaced them)
        _count(nbytes, 1)
        self._finalizer = weakref.finalize(self, _release, self._held, device, nbytes, method)
        # at exit the process's memory goes anyway, and CUDA may already be shutting down
        self._finalizer.atexit = False

    @property
    def tensor(self):
        return self._held.get("tensor")

    @property
    def pending(self) -> bool:
        """True while a deferred cudaHostRegister (pin(defer=True)) may still be running."""
        return self._held.get("pending") is not None

    def wait(self) -> None:
        """A deferred registration finished (nothing to do otherwise): registered, or, refused, the buffer
        stays pageable with one WARNING (copies to and from it still work, slower). `register_s` says how
        long the registration took, off the caller's path until this wait."""
        pending = self._held.pop("pending", None)
        if pending is None:
            return
        t0 = time.perf_counter()
        if pending.ident is None:  # held back (pin(defer=True, start=False)) and never started: now
            pending.start()
        pending.join()
        self.waited_s = time.perf_counter() - t0
        self.register_s = self._held.get("register_s", 0.0)
        if not _settle(self._held, self.nbytes):
            self.method = f"pageable (cudaHostRegister failed with {self._held['register_error']})"

    def start_registration(self) -> None:
        """A registration held back by pin(defer=True, start=False) starts in its thread now (nothing otherwise)."""
        pending = self._held.get("pending")
        if pending is not None and pending.ident is None:
            pending.start()

    @property
    def registered(self) -> bool:
        """True while cudaHostRegister pins it (until unpinned or released)."""
        return self.device is not None and self._finalizer.alive and not self._held.get("unpinned")

    @property
    def unpinned(self) -> bool:
        return bool(self._held.get("unpinned"))

    def unpin(self) -> bool:
        """Unregister in place: the same memory, pageable again, still holding its data (the states of
        a finished training). It leaves pinned_bytes(). False where that cannot be done in place
        (PyTorch's pinned allocator, the fallback): the buffer stays pinned."""
        self.wait()
        if self.freed or self.unpinned or self.method == "pin_memory=True":
            return self.unpinned
        if self.device is not None:
            _unregister(self._held["tensor"], self.device, self.nbytes)
        self._held["unpinned"] = True
        _count(-self.nbytes, 0)
        return True

    def repin(self) -> None:
        """Register the same memory again (after unpin()), data untouched; not one whose deferred
        registration was refused (it stays pageable, said once)."""
        self.wait()
        if self.freed or not self.unpinned or self._held.get("register_error"):
            return
        if self.device is not None:
            err = _register(self._held["tensor"], self.device, self.nbytes)
            if _code(err) != 0:
                raise BridgeFGOConfigError(
                    f"cannot pin the {fmt_bytes(self.nbytes)} optimizer-state host buffer again: cudaHostRegister "
                    f"failed with {_err_name(err)}; {_memlock_limits()}. Fix: raise the locked-memory limit "
                    f"(ulimit -l unlimited), or {FIXES}.")
        self._held["unpinned"] = False
        _count(self.nbytes, 0)

    @property
    def freed(self) -> bool:
        return not self._finalizer.alive

    def holders(self) -> Optional[int]:
        """How many tensors share the buffer's storage now: every view anyone holds (the states bound
        to it, a checkpoint writer's) keeps it alive, so the memory is never freed under a reader; this
        says whether one is still there. None once released (or on a torch that cannot count)."""
        import torch

        count = getattr(torch._C, "_storage_Use_Count", None)
        tensor = self._held.get("tensor")
        if tensor is None or count is None:
            return None
        return int(count(tensor.untyped_storage()._cdata))

    def moved(self) -> bool:
        """True when the storage's pages are no longer the ones allocated (and pinned) here: pickling a
        CPU tensor for another process (torch.multiprocessing) moves its whole storage into shared memory."""
        tensor = self._held.get("tensor")
        return tensor is not None and tensor.untyped_storage().data_ptr() != self._data_ptr

    def free(self) -> None:
        """Unregister and drop the buffer; later calls do nothing. A deferred registration is settled by the
        release itself: joined when it started, dropped unstarted when held back."""
        if self._finalizer.alive:
            self._held["by"] = "free()"
            self._finalizer()

    def describe(self) -> str:
        return (f"{fmt_bytes(self.nbytes)} host buffer, {self.method}, in {self.seconds:.2f} s; "
                f"{self.placement}")

    def __repr__(self) -> str:
        return f"PinnedHost({self.nbytes} bytes, {self.method}{', freed' if self.freed else ''})"


def _start_register(held: Dict[str, object], tensor, device: int, nbytes: int, start: bool = True) -> None:
    """cudaHostRegister of pages already faulted in, in a thread of its own (pin(defer=True)); wait() or the
    release joins it. Not `start`: the thread waits for PinnedHost.start_registration() (or wait())."""
    import torch

    def register():
        t0 = time.perf_counter()
        try:
            torch.cuda.set_device(device)
            held["register_result"] = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, 0)
        except BaseException as exc:  # said by _settle, in the caller's thread
            held["register_result"] = exc
        held["register_s"] = time.perf_counter() - t0

    thread = threading.Thread(target=register, name="bridge_fgo-pin-deferred")
    held["pending"] = thread
    if start:
        thread.start()


def _settle(held: Dict[str, object], nbytes: int) -> bool:
    """After a deferred registration joined: True if it pinned; otherwise the buffer is marked unpinned
    (nothing to unregister), leaves the pinned count, and one WARNING names the error."""
    err = held.pop("register_result", 0)
    if not isinstance(err, BaseException) and _code(err) == 0:
        return True
    name = f"{type(err).__name__}: {err}" if isinstance(err, BaseException) else _err_name(err)
    held["register_error"], held["unpinned"] = name, True
    _count(-nbytes, 0)
    logger.warning("%scudaHostRegister of the %s optimizer-state host buffer (run in its own thread beside or "
                   "after a checkpoint load) failed with %s; %s. The buffer stays pageable: every copy to and from the "
                   "GPU still works, slower. Fix: raise the locked-memory limit (ulimit -l unlimited; docker --ulimit "
                   "memlock=-1), or %s", rank_prefix(), fmt_bytes(nbytes), name, _memlock_limits(), FIXES)
    return False


def _code(err) -> int:
    return int(getattr(err, "value", err))


def _err_name(err) -> str:
    """'CUDA error 2 (cudaErrorMemoryAllocation: out of memory)'."""
    name = getattr(err, "name", None)
    try:
        import torch

        text = torch.cuda.cudart().cudaGetErrorString(err)
    except Exception:
        text = None
    about = ": ".join(str(x) for x in (name, text) if x)
    return f"CUDA error {_code(err)}" + (f" ({about})" if about else "")


def _in_thread(fn):
    """Run fn in a short-lived thread and return its result. cudaHostRegister leaves a failure as the
    CUDA runtime's last error of the calling thread, and PyTorch checks cudaGetLastError after kernel
    launches: registering from a throwaway thread keeps a refused registration from surfacing as an
    unrelated error at the training loop's next kernel."""
    box: Dict[str, object] = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # re-raised in the caller
            box["error"] = exc

    t = threading.Thread(target=run, name="bridge_fgo-pin")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]


def _empty_pinned(nbytes: int):
    import torch

    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _memlock_limits() -> str:
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    except (ImportError, OSError, ValueError):
        return "RLIMIT_MEMLOCK unknown"
    show = lambda v: "unlimited" if v == resource.RLIM_INFINITY else fmt_bytes(v)  # noqa: E731
    return f"RLIMIT_MEMLOCK soft {show(soft)}, hard {show(hard)}"


def pin(nbytes: int, *, device_index: Optional[int] = None, numa: bool = True,
        root: Optional[str] = None, target: Optional[_numa.NumaTarget] = None, defer: bool = False,
        start: bool = True, touch: bool = True) -> PinnedHost:
    """Allocate `nbytes` of page-locked host memory for device `device_index` (default: the current one).

    A pageable tensor is first-touched (on the GPU's NUMA node when `numa` and the host has several)
    and registered with cudaHostRegister: 1.2-2.5 s for 10 GB where torch.empty(pin_memory=True) took
    9-10 s. If registration is refused, one WARNING names the error and the fallback, the pageable
    pages are freed and pin_memory=True is tried; if that fails too, BridgeFGOConfigError. Without
    CUDA, or for 0 bytes: an unpinned, untouched tensor (registered False) and no message; it counts
    in pinned_bytes() like the others. `target` replaces the lookup of the GPU's node (a benchmark
    placing the buffer on another node). `defer`: the pages are faulted in here and cudaHostRegister runs
    in a thread of its own (a checkpoint load reads from disk meanwhile, writing into the pages);
    PinnedHost.wait() joins it before any copy to or from the GPU, and a refusal there leaves the buffer
    pageable with one WARNING instead of the pin_memory=True fallback; with `start` False the registration
    waits for PinnedHost.start_registration() (after the load's reads, not beside them), or for wait(). The
    buffer reads as zero when handed out (`zeroed`), but for the pin_memory=True fallback's. Not `touch` (with
    `defer` and not `start` only): the caller's own writes fault the pages in before the registration starts (a
    checkpoint load that writes every state), so no first touch writes them before, where no NUMA node is to be
    placed on; with a node to place them on they are touched there as ever."""
    import torch

    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if not touch and not (defer and not start):  # the registration would fault the pages in, on one thread
        raise ValueError("pin(touch=False) needs defer=True and start=False: the caller's writes fault the pages in "
                         "before the registration starts")
    t0 = time.perf_counter()
    if nbytes == 0 or not torch.cuda.is_available():
        why = "CUDA unavailable" if nbytes else "empty"
        return PinnedHost(_zero_pages(nbytes) if nbytes else torch.empty(0, dtype=torch.uint8), nbytes,
                          f"unpinned ({why})", placement=f"no placement: {why}", seconds=time.perf_counter() - t0,
                          zeroed=True)
    device = torch.cuda.current_device() if device_index is None else int(device_index)
    if target is None:
        target = (_numa.numa_target(device, root=root) if numa
                  else _numa.NumaTarget(None, (), "NUMA placement not requested: plain first touch"))
    tensor = _zero_pages(nbytes)
    if touch or target.node is not None:
        node, placement = _numa.first_touch(tensor, target)  # registering then pins pages already present
    else:
        # the kernel zeroes each page as the caller's writes fault it in; a touch before would write it twice
        # (one H200, 2026-11-29: the preparation before a load 0.10-0.12 s against 0.19-0.24 s, Bridge's load no
        # slower; docs/benchmarks.md#gpu-2026-11-29l)
        node, placement = None, f"{target.reason}: no first touch, the pages faulted in by their first writes"
    if defer:
        # the pages are faulted in before the registration starts: touched above, from several threads, or (not
        # `touch`) by the caller's writes, never by a touch beside those writes (it would race with them). Left to
        # the registration's thread, 1.9 GB took it 0.87-0.93 s, and the masters' copy on the loading thread took
        # as long, faulting the same pages (2xH200, 2026-11-28)
        buf = PinnedHost(tensor, nbytes, "cudaHostRegister", device=device, numa_node=node, placement=placement,
                         seconds=time.perf_counter() - t0, zeroed=True)
        buf.held_back = not start
        _start_register(buf._held, tensor, device, nbytes, start)
        logger.debug("%s%s; registration deferred", rank_prefix(), buf.describe())
        return buf
    err = _register(tensor, device, nbytes)
    if _code(err) == 0:
        buf = PinnedHost(tensor, nbytes, "cudaHostRegister", device=device, numa_node=node,
                         placement=placement, seconds=time.perf_counter() - t0, zeroed=True)
    else:
        rounded = 1 << (nbytes - 1).bit_length()
        logger.warning(
            "%scudaHostRegister of the %s optimizer-state host buffer failed with %s. Likely causes: the "
            "locked-memory limit (%s; see ulimit -l) or a container/cgroup memory limit or runtime that refuses "
            "to lock this much host memory. Falling back to torch.empty(..., pin_memory=True): slower to "
            "allocate (%s), not placed on a NUMA node, and PyTorch's pinned allocator rounds it up to a power "
            "of two, so up to %s is pinned", rank_prefix(), fmt_bytes(nbytes), _err_name(err), _memlock_limits(),
            _PIN_MEMORY_SECONDS_NOTE, fmt_bytes(rounded))
        del tensor  # free the pageable pages before pinning a second copy of the same size
        try:
            pinned = _empty_pinned(nbytes)
        except Exception as exc:
            mem = available.host_memory(root)
            avail = f"{fmt_bytes(mem.bytes)} ({mem.source}: {mem.detail})" if mem is not None else "unknown"
            raise BridgeFGOConfigError(
                f"cannot pin the {fmt_bytes(nbytes)} optimizer-state host buffer on GPU {device}: "
                f"cudaHostRegister failed with {_err_name(err)}, and torch.empty(pin_memory=True) (up to "
                f"{fmt_bytes(rounded)} after PyTorch's power-of-two rounding) raised {type(exc).__name__}: {exc}. "
                f"Host memory available now: {avail}; {_memlock_limits()}. Fix: raise the locked-memory limit "
                f"(ulimit -l unlimited; docker --ulimit memlock=-1), or {FIXES}.") from exc
        buf = PinnedHost(pinned, nbytes, "pin_memory=True",
                         placement="no placement: PyTorch's pinned allocator touched the pages",
                         seconds=time.perf_counter() - t0)
    logger.debug("%s%s", rank_prefix(), buf.describe())
    return buf
