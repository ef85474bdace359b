"""The fp32 masters created in host memory, a few at a time, while Megatron-Core builds the optimizer.

Megatron-Core's DistributedOptimizer creates every fp32 master on the GPU in its constructor
(`_build_model_and_main_param_groups`: `shard_model_param.clone().float()` for each bf16/fp16
parameter shard), so setup alone needs all of them at once: under full recomputation that was the
run's peak. build_on_host() runs Megatron-Core's own classmethod over a few parameters at a time (at
most `chunk_bytes` of masters) and moves each batch's masters to host memory before the next batch is
made; the GPU holds one batch at most. The results are the original's, assembled in its order:

- each of the five group lists is the concatenation of the batches' lists;
- the inner optimizer's params (`orig_group["params"]`) are `[*fp32 shards, *the rest]` as the
  original writes them for the whole group, rebuilt from each batch's `[*fp32 shards, *the rest]`.

At the speed of a copy: the masters of one construction land in one host block (Landing), its pages
touched from several threads and registered with cudaHostRegister once (the pinning, timed apart), each
batch's device-to-host copies queued without waiting (batches in flight, on the current stream, so a
batch's freed GPU memory is reused only after its copy); one wait at the end, then the block is
unregistered and stays as the masters' pageable memory until the engine takes them into its buffer. The
block is counted by the host-memory check before it is pinned; where it does not fit, one WARNING per
rank names it and each master is copied into pageable memory of its own, as before.

The masters keep their objects (`master.data` is rebound), so `model_param.main_param` and the
optimizer's param groups still hold them. The engine takes them from their staging tensors into its
pinned buffer when it prepares (streamed/transfers.py); until then they are ordinary pageable host tensors,
which Megatron-Core's readers (reload_model_params after a model-only load) read and write as any
tensor.
"""
from __future__ import annotations

import logging
import math
import time
import weakref
from typing import Dict, List, Optional, Tuple

from .. import hostmem
from ..errors import BridgeFGOConfigError, BridgeFGOError
from ..log import once, rank_prefix

# id(master) -> (a weak reference to it, the device Megatron-Core made it on): masters created on the
# host by build_on_host() and whole_on_host(). Not a WeakSet: it compares tensors with ==, elementwise.
_staged: Dict[int, Tuple["weakref.ref", object]] = {}


def stage(t, device) -> None:
    """Mark `t` a master made on the host for the streamed step, `device` the one it was meant for."""
    key = id(t)
    ref = weakref.ref(t, lambda ref, key=key: _staged.get(key, (None,))[0] is ref and _staged.pop(key, None))
    _staged[key] = (ref, device)


def is_staged(t) -> bool:
    """A master this module created in host memory (not yet taken into a pinned buffer)."""
    ref = _staged.get(id(t), (None,))[0]
    return ref is not None and ref() is t


def unstage(t) -> None:
    if is_staged(t):
        del _staged[id(t)]


def restore(t) -> None:
    """A staged master back on the device Megatron-Core made it on (no session took it), unstaged."""
    if is_staged(t):
        device = _staged.pop(id(t))[1]
        if t.device != device:
            t.data = t.data.to(device)


class Built:
    """What one construction did, for the per-rank line."""

    def __init__(self, units: str = "batch(es)"):
        self.units = units  # what is on the GPU at most at a time, for the line
        self.masters = 0
        self.bytes = 0
        self.batches = 0
        self.largest_batch = 0
        self.pin_s = 0.0     # the landing block: allocated, touched, registered (the pinning)
        self.copy_s = 0.0    # the wait for its copies at the end (what they took beyond Megatron-Core's own work)
        self.release_s = 0.0  # the block's unregistration at the end (cudaHostUnregister: the pinning's undoing)
        self.landed = 0      # bytes of masters that landed in the block
        self.landing: Optional[str] = None  # how the masters came to the host, for the line
        self.total_s = 0.0   # the whole construction of the masters (Megatron-Core's own work among it): issue 43's setup

    def describe(self) -> str:
        how = (f"{self.landed} bytes copied into {self.landing} (pinning {self.pin_s:.2f} s, the last copies waited "
               f"for {self.copy_s:.2f} s, unpinning {self.release_s:.2f} s)" if self.landing
               else "each copied into pageable memory of its own")
        return (f"{self.masters} master(s), {self.bytes} bytes, in {self.batches} {self.units} of at most "
                f"{self.largest_batch} bytes on the GPU, in {self.total_s:.2f} s; {how}")


ALIGN = 256  # a master's offset in the landing block: any dtype's view of it is aligned


def _moves(m) -> bool:
    """A master made on the GPU: it moves to the host (on CPU, in the tests, they already are host tensors)."""
    return m.device.type == "cuda"


class Landing:
    """One host block for every master of a construction, pinned once; each master copied into its place
    without waiting. `upper` bounds the bytes (the block is made at the first master that moves)."""

    def __init__(self, upper: int):
        self.upper = upper
        self.block = None     # hostmem.PinnedHost, or None: not made (yet), or refused
        self.refused = False
        self.used = 0

    def place(self, m, built: Built):
        """A host tensor holding m's values once finish() returned (None: no room, or the block refused)."""
        host = self.slot(tuple(m.shape), m.dtype, built)
        if host is not None:
            host.copy_(m, non_blocking=True)
        return host

    def slot(self, shape, dtype, built: Built):
        """A view of the block for a tensor of `shape` and `dtype`, at an aligned offset (None: no room, or the
        block refused)."""
        if self.refused:
            return None
        if self.block is None and not self._make(built):
            return None
        nbytes = math.prod(shape) * dtype.itemsize
        at = -(-self.used // ALIGN) * ALIGN
        if at + nbytes > self.block.nbytes:
            return None
        self.used = at + nbytes
        built.landed += nbytes
        return self.block.tensor[at:at + nbytes].view(dtype).view(shape)

    @property
    def storage(self) -> Optional[int]:
        """The block's storage (its data pointer), while it is made."""
        return self.block.tensor.untyped_storage().data_ptr() if self.block is not None else None

    def _make(self, built: Built) -> bool:
        t0 = time.perf_counter()
        try:
            hostmem.check_fits(self.upper)
        except BridgeFGOConfigError as exc:
            self.refused = True
            once(("landing-refused",), logging.WARNING,
                 "%sthe fp32 masters' landing block (%d bytes, pinned while the optimizer is built, so the masters "
                 "come to the host at the link's speed) is refused by the host-memory check, so each master is "
                 "copied into pageable memory of its own, slower: %s", rank_prefix(), self.upper, exc)
            return False
        self.block = hostmem.pin(self.upper)
        built.pin_s += time.perf_counter() - t0
        built.landing = f"one {'pinned' if self.block.registered else 'host'} block of {self.upper} bytes"
        return True

    def finish(self, built: Built) -> None:
        """Every copy into the block done; the block unregistered (the masters' views keep its memory)."""
        if self.block is None:
            return
        t0 = time.perf_counter()
        if self.block.registered:
            import torch

            torch.cuda.current_stream().synchronize()
        built.copy_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        self.block.free()  # unpinned now; the memory goes when the engine has taken the last master from it
        built.release_s += time.perf_counter() - t0
        self.block = None


def _upper_bytes(opt_group_ranges, param_gbuf_map, gbuf_ranges) -> int:
    """At most what the masters of this construction take in the landing block: an fp32 master per
    parameter that is not fp32 itself, each at an aligned offset."""
    import torch

    total = 0
    for group_range in opt_group_ranges:
        for p in group_range["params"]:
            if p.dtype == torch.float32:
                continue
            gbuf_index, dtype, bucket_index = param_gbuf_map[p]
            numel = gbuf_ranges[gbuf_index][dtype][bucket_index]["param_map"][p]["param"].size
            total += -(-4 * numel // ALIGN) * ALIGN
    return total


def _batches(params, param_gbuf_map, gbuf_ranges, chunk_bytes: int) -> List[list]:
    """Parameters in order, cut where the next one's fp32 master would pass chunk_bytes (never split)."""
    out, current, size = [], [], 0
    for p in params:
        gbuf_index, dtype, bucket_index = param_gbuf_map[p]
        numel = gbuf_ranges[gbuf_index][dtype][bucket_index]["param_map"][p]["param"].size
        nbytes = 4 * numel
        if current and size + nbytes > chunk_bytes:
            out.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        out.append(current)
    return out


def _to_host(masters, built: Built, batch_bytes: int, landing: Optional[Landing] = None) -> None:
    import torch

    devices = [None if m is None else m.device for m in masters]
    for m in masters:
        if m is None or not _moves(m):
            continue  # precision-aware: the optimizer holds them; on CPU (tests) they already are host tensors
        host = landing.place(m, built) if landing is not None else None
        if host is None:
            host = torch.empty(m.shape, dtype=m.dtype, device="cpu")
            host.copy_(m)  # synchronous: the GPU copy is freed as soon as the last reference goes below
        m.data = host  # in the landing block: the copy is queued, and the GPU memory reused only after it
    for m, device in zip(masters, devices):
        if m is not None:
            stage(m, device)
            built.masters += 1
            built.bytes += m.numel() * m.element_size()
    built.batches += 1
    built.largest_batch = max(built.largest_batch, batch_bytes)


def build_on_host(wrapped, args, kwargs, chunk_bytes: int, built: Optional[Built] = None):
    """Megatron-Core's `_build_model_and_main_param_groups(gbuf_ranges, param_gbuf_map,
    opt_group_ranges, config)`, batch by batch, masters on the host."""
    built = built if built is not None else Built()
    names = ("gbuf_ranges", "param_gbuf_map", "opt_group_ranges", "config")
    bound = dict(zip(names, args))
    bound.update({k: v for k, v in kwargs.items() if k in names})
    if set(bound) != set(names) or len(args) + len(kwargs) != len(names):
        raise BridgeFGOError("internal: _build_model_and_main_param_groups called with arguments bridge_fgo "
                             f"does not know ({len(args)} positional, keywords {sorted(kwargs)})")
    gbuf_ranges, param_gbuf_map, config = bound["gbuf_ranges"], bound["param_gbuf_map"], bound["config"]
    t0 = time.perf_counter()
    landing = Landing(_upper_bytes(bound["opt_group_ranges"], param_gbuf_map, gbuf_ranges))
    try:
        return _build(wrapped, bound, gbuf_ranges, param_gbuf_map, config, chunk_bytes, built, landing)
    finally:
        landing.finish(built)
        built.total_s = time.perf_counter() - t0


def _build(wrapped, bound, gbuf_ranges, param_gbuf_map, config, chunk_bytes, built, landing):
    results: List[list] = [[] for _ in range(5)]
    for group_range in bound["opt_group_ranges"]:
        lists: List[list] = [[] for _ in range(5)]
        fp32_shards, rest = [], []
        for batch in _batches(group_range["params"], param_gbuf_map, gbuf_ranges, chunk_bytes):
            orig_group = {}
            out = wrapped(gbuf_ranges, param_gbuf_map, [dict(group_range, params=batch, orig_group=orig_group)],
                          config)
            if len(out) != 5 or any(len(x) != 1 for x in out):
                raise BridgeFGOError("internal: _build_model_and_main_param_groups returned "
                                     f"{len(out)} lists, not the five group lists bridge_fgo knows")
            for acc, one in zip(lists, out):
                acc += one[0]
            head = out[3][0]  # the fp32 shards come first in the inner optimizer's params
            params = orig_group.get("params", [])
            if [id(t) for t in params[:len(head)]] != [id(t) for t in head]:
                raise BridgeFGOError("internal: Megatron-Core no longer lists a group's fp32 shards first in the "
                                     "inner optimizer's params")
            fp32_shards += params[:len(head)]
            rest += params[len(head):]
            _to_host(out[4][0], built, sum(4 * (m.numel() if m is not None else 0) for m in out[4][0]), landing)
        group_range["orig_group"]["params"] = [*fp32_shards, *rest]
        for acc, one in zip(results, lists):
            acc.append(one)
    return tuple(results)


def whole_on_host(wrapped, args, kwargs, built: Optional[Built] = None):
    """Megatron-Core's Float16OptimizerWithFloat16Params.__init__ (what it builds for Muon), each fp32 master
    moved to the host as soon as it is made. The constructor makes one (`param.detach().clone().float()`)
    and at once copies the tensor-parallel attributes onto it (tensor_parallel.
    copy_tensor_model_parallel_attributes(main_param, param), megatron-core 0.16 to 0.19; the patch checks
    the name is in its code): there the master goes to the host, so the GPU holds one at a time."""
    from megatron.core import tensor_parallel

    built = built if built is not None else Built()
    name = "copy_tensor_model_parallel_attributes"
    copy_attributes = vars(tensor_parallel)[name]

    def copy_then_host(main_param, param, *a, **k):
        out = copy_attributes(main_param, param, *a, **k)
        _to_host([main_param], built, 4 * main_param.numel())
        return out

    setattr(tensor_parallel, name, copy_then_host)
    try:
        return wrapped(*args, **kwargs)
    finally:
        setattr(tensor_parallel, name, copy_attributes)
