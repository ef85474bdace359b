"""The pinned host buffer: allocate, first-touch on the GPU's NUMA node, cudaHostRegister (with
torch.empty(pin_memory=True) as the logged fallback)."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Dict, Optional

from ..errors import BridgeFGOConfigError
from ..log import logger, rank_prefix
from . import available
from . import numa as _numa
from .check import FIXES
from .common import fmt_bytes

_PIN_MEMORY_SECONDS_NOTE = "1.2-2.5 s for cudaHostRegister vs 9-10 s for pin_memory=True, measured for 10 GB"

@dataclass
class PinnedHost:
    """A host buffer for the offloaded states. `tensor` is a 1-D uint8 CPU tensor of `nbytes`."""
    tensor: object = field(repr=False)
    nbytes: int
    registered: bool          # True: cudaHostRegister pinned it and free() unregisters it
    method: str               # "cudaHostRegister", "pin_memory=True", or "unpinned (...)"
    numa_node: Optional[int]  # the node it was first-touched on; None: no placement
    placement: str            # how the first touch was done, or why without placement
    seconds: float            # allocation + first touch + pinning

    def free(self) -> None:
        if self.tensor is None:
            return
        if self.registered:
            import torch

            err = torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            if _code(err) != 0:
                logger.warning("%scudaHostUnregister of %s failed with %s; the pages stay locked until the "
                               "process exits", rank_prefix(), fmt_bytes(self.nbytes), _err_name(err))
            self.registered = False
            self.tensor = None
            return
        pinned_by_torch = self.method == "pin_memory=True"
        self.tensor = None
        if pinned_by_torch:  # PyTorch caches freed pinned blocks; give this (power-of-two) one back
            import torch

            empty = getattr(torch._C, "_host_emptyCache", None)
            if empty is not None:
                empty()

    def describe(self) -> str:
        return (f"{fmt_bytes(self.nbytes)} host buffer, {self.method}, in {self.seconds:.2f} s; "
                f"{self.placement}")


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
        root: Optional[str] = None, target: Optional[_numa.NumaTarget] = None) -> PinnedHost:
    """Allocate `nbytes` of page-locked host memory for device `device_index` (default: the current one).

    A pageable tensor is first-touched (on the GPU's NUMA node when `numa` and the host has several)
    and registered with cudaHostRegister: 1.2-2.5 s for 10 GB where torch.empty(pin_memory=True) took
    9-10 s. If registration is refused, one WARNING names the error and the fallback, the pageable
    pages are freed and pin_memory=True is tried; if that fails too, BridgeFGOConfigError. Without
    CUDA: an unpinned, untouched tensor (registered=False) and no message. `target` replaces the
    lookup of the GPU's node (a benchmark placing the buffer on another node)."""
    import torch

    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    t0 = time.perf_counter()
    if nbytes == 0 or not torch.cuda.is_available():
        why = "unpinned (CUDA unavailable)" if nbytes else "unpinned (empty)"
        return PinnedHost(torch.empty(nbytes, dtype=torch.uint8), nbytes, False, why, None,
                          "no placement: " + why[len("unpinned ("):-1], time.perf_counter() - t0)
    device = torch.cuda.current_device() if device_index is None else int(device_index)
    if target is None:
        target = (_numa.numa_target(device, root=root) if numa
                  else _numa.NumaTarget(None, (), "NUMA placement not requested: plain first touch"))
    tensor = torch.empty(nbytes, dtype=torch.uint8)
    node, placement = _numa.first_touch(tensor, target)  # registering then pins pages already present

    def register():
        torch.cuda.set_device(device)  # a new thread starts on device 0
        return torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, 0)

    err = _in_thread(register)
    if _code(err) == 0:
        buf = PinnedHost(tensor, nbytes, True, "cudaHostRegister", node, placement, time.perf_counter() - t0)
        logger.debug("%s%s", rank_prefix(), buf.describe())
        return buf
    rounded = 1 << (nbytes - 1).bit_length()
    logger.warning(
        "%scudaHostRegister of the %s optimizer-state host buffer failed with %s. Likely causes: the "
        "locked-memory limit (%s; see ulimit -l) or a container/cgroup memory limit or runtime that refuses "
        "to lock this much host memory. Falling back to torch.empty(..., pin_memory=True): slower to "
        "allocate (%s), not placed on a NUMA node, and PyTorch's pinned allocator rounds it up to a power of "
        "two, so up to %s is pinned", rank_prefix(), fmt_bytes(nbytes), _err_name(err), _memlock_limits(),
        _PIN_MEMORY_SECONDS_NOTE, fmt_bytes(rounded))
    del tensor  # free the pageable pages before pinning a second copy of the same size
    try:
        pinned = _empty_pinned(nbytes)
    except Exception as exc:
        mem = available.host_memory(root)
        avail = (f"{fmt_bytes(mem.bytes)} ({mem.source}: {mem.detail})" if mem is not None
                 else "unknown")
        raise BridgeFGOConfigError(
            f"cannot pin the {fmt_bytes(nbytes)} optimizer-state host buffer on GPU {device}: "
            f"cudaHostRegister failed with {_err_name(err)}, and torch.empty(pin_memory=True) (up to "
            f"{fmt_bytes(rounded)} after PyTorch's power-of-two rounding) raised {type(exc).__name__}: {exc}. "
            f"Host memory available now: {avail}; {_memlock_limits()}. Fix: raise the locked-memory limit "
            f"(ulimit -l unlimited; docker --ulimit memlock=-1), or {FIXES}.") from exc
    buf = PinnedHost(pinned, nbytes, False, "pin_memory=True", None,
                     "no placement: PyTorch's pinned allocator touched the pages", time.perf_counter() - t0)
    logger.debug("%s%s", rank_prefix(), buf.describe())
    return buf
