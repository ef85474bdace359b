"""A checkpoint load's reads, straight into the host buffer (issue 43).

torch.distributed.checkpoint's FileSystemReader reads each tensor of a checkpoint with torch.load into fresh
memory, one after another, then copies it into its target. Under the streamed step the optimizer's states are
views of the pinned host buffer, so for a load the engine serves (callsites._load) each item whose target is
such a view is read from the file straight into it, from a few threads (hostmem.spread): no fresh memory, no
copy. That holds only where torch.load's own description of the item, read on the meta device (its dtype,
shape, strides and the offset of its bytes in the file: torch >= 2.7), says the bytes are the view's exactly,
in this host's byte order; otherwise the item is read as torch reads it. (torch.load checks no CRC-32 of a
tensor's bytes either: a flipped byte loads silently there too, torch 2.13, so no check is given up.) Everything
else goes through torch's own read_data, untouched: the model's weights and whatever lives on the GPU, BYTE_IO
items, transformed (compressed) items, files that are not this host's (an object store's), a planner that is no
DefaultLoadPlanner (Megatron-Core's MCoreLoadPlanner is one, so it is served).

Importing this module does not import torch.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import io
import os
import sys
import time
import zipfile
from typing import Dict, Iterator, List, Optional, Set

from .. import hostmem
from ..errors import BridgeFGOError
from ..log import rank_prefix


@dataclasses.dataclass
class Reads:
    """What one load read straight into the host buffer."""
    tensors: int = 0
    nbytes: int = 0
    seconds: float = 0.0  # the reads' own time, inside FileSystemReader.read_data
    threads: int = 0
    as_torch: int = 0  # items of the buffer read as torch reads them (their bytes are not the view's as stored)

    def describe(self) -> str:
        """For the load's per-rank line; empty where the load read nothing of the host buffer."""
        said = []
        if self.tensors:
            said.append(f"{self.tensors} tensor(s), {hostmem.fmt_bytes(self.nbytes)} read straight into the host "
                        f"buffer in {self.seconds:.2f} s ({self.threads} thread(s))")
        if self.as_torch:
            said.append(f"{self.as_torch} tensor(s) of the host buffer read as torch reads them")
        return "; ".join(said)


@contextlib.contextmanager
def straight_into(buffers) -> Iterator[Reads]:
    """For the block, FileSystemReader.read_data reads the items whose targets are views of `buffers`
    (hostmem.PinnedHost) straight into them, and the rest as before; yields their Reads. Nothing changes where
    torch's FileSystemReader has no read_data of its own to wrap."""
    reads = Reads()
    keys = {b.tensor.untyped_storage().data_ptr() for b in buffers if getattr(b, "tensor", None) is not None}
    cls = _reader_class() if keys else None
    prior = vars(cls).get("read_data") if cls is not None else None
    if prior is None:
        yield reads
        return

    def read_data(self, plan, planner):
        return _read_data(prior, self, plan, planner, keys, reads)

    cls.read_data = read_data
    try:
        yield reads
    finally:
        cls.read_data = prior


def _reader_class():
    try:
        from torch.distributed.checkpoint.filesystem import FileSystemReader
    except ImportError:  # a torch without distributed checkpoints: nothing reads one
        return None
    return FileSystemReader


def _read_data(prior, reader, plan, planner, keys: Set[int], reads: Reads):
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    if not isinstance(planner, DefaultLoadPlanner) or getattr(reader, "fs", None) is None:
        return prior(reader, plan, planner)
    files: Dict[str, Optional[str]] = {}
    ours = [req for req in plan.items if _ours(reader, planner, req, keys, files)]
    if not ours:
        return prior(reader, plan, planner)
    t0 = time.perf_counter()
    _read_straight(reader, planner, ours, keys, reads, files)
    reads.seconds += time.perf_counter() - t0
    taken = {id(req) for req in ours}
    return prior(reader, dataclasses.replace(plan, items=[r for r in plan.items if id(r) not in taken]), planner)


def _ours(reader, planner, req, keys: Set[int], files: Dict[str, Optional[str]]) -> bool:
    """A tensor item, stored untransformed in a file of this host, whose target (looked up as DefaultLoadPlanner
    resolves it, without its side effects) is a view of the host buffer."""
    import torch
    from torch.distributed.checkpoint.planner import LoadItemType

    if req.type != LoadItemType.TENSOR:
        return False
    md = reader.storage_data.get(req.storage_index)
    if md is None or getattr(md, "transform_descriptors", None):
        return False
    if md.relative_path not in files:
        files[md.relative_path] = _local_file(reader, md.relative_path)
    if files[md.relative_path] is None:
        return False
    try:
        t = planner.lookup_tensor(req.dest_index)
    except Exception:  # torch's own read_data resolves it, and raises what it raises
        return False
    return (isinstance(t, torch.Tensor) and t.device.type == "cpu"
            and t.untyped_storage().data_ptr() in keys)


def _local_file(reader, relative_path: str) -> Optional[str]:
    """The item's file as a path of this host's file system, or None: read by the reader's own file system. torch's
    FileSystem is this host's; another (Multi-Storage Client's, which Megatron-Core 0.17 uses whenever it is
    installed; fsspec's) only where its path is a local file, which it would open the same way."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    try:
        path = os.fspath(reader.fs.concat_path(reader.path, relative_path))
    except (TypeError, ValueError):  # an object store's path
        return None
    if not isinstance(path, str):
        return None
    if isinstance(reader.fs, FileSystem):
        return path
    return path if "://" not in path and os.path.isfile(path) else None


def _read_straight(reader, planner, reqs, keys: Set[int], reads: Reads, files: Dict[str, Optional[str]]) -> None:
    """Each request's target resolved once, as torch's read_data would; the bytes read into it by offset, from a
    few threads (file order within each file); committed once all are in."""
    by_file = {}
    for req in reqs:
        by_file.setdefault(reader.storage_data[req.storage_index].relative_path, []).append(req)
    done, work = [], []
    with contextlib.ExitStack() as opened:
        for relative_path, mine in by_file.items():
            f = opened.enter_context(open(files[relative_path], "rb", buffering=0))
            for req in sorted(mine, key=lambda r: reader.storage_data[r.storage_index].offset):
                md = reader.storage_data[req.storage_index]
                target = planner.resolve_tensor(req).detach()
                at = _where(f, md, req, target, keys)
                if at is None:
                    _read_as_torch(f, md, req, target)
                    reads.as_torch += 1
                else:
                    n = target.numel() * target.element_size()
                    pieces = hostmem.spread.pieces([(at, target.data_ptr(), n)])
                    work += [(f.fileno(), off, dst, k) for off, dst, k in pieces]
                    reads.tensors += 1
                    reads.nbytes += n
                done.append((req, target))
        reads.threads = max(reads.threads, hostmem.spread.run(_pread, work, "reads", hostmem.spread.rank_threads()))
    for req, target in done:
        planner.commit_tensor(req, target)


def _where(f, md, req, target, keys: Set[int]) -> Optional[int]:
    """Where in the file the target's bytes are, as stored; None where the item is not simply those bytes."""
    import torch

    if (type(target) is not torch.Tensor or target.device.type != "cpu" or not target.is_contiguous()
            or target.is_conj() or target.is_neg() or target.untyped_storage().data_ptr() not in keys):
        return None
    window = _Window(f, md.offset, md.length)
    try:
        if _byte_order(window) != sys.byteorder:
            return None
        window.seek(0)
        meta = torch.load(window, map_location="meta", weights_only=True)
    except Exception:  # not what this reads: torch.load reads it (and raises what it raises)
        return None
    if not isinstance(meta, torch.Tensor) or meta.device.type != "meta":
        return None
    base = getattr(meta.untyped_storage(), "_checkpoint_offset", None)  # torch >= 2.7
    if base is None:
        return None
    src = _narrowed(meta, req.storage_offsets, req.lengths)
    if src.dtype != target.dtype or src.size() != target.size() or not src.is_contiguous():
        return None
    start = base + src.storage_offset() * src.element_size()
    if start + src.numel() * src.element_size() > md.length:
        return None
    return md.offset + start


def _byte_order(window) -> Optional[str]:
    """The byte order torch.save recorded in the item (its zip's `<archive>/byteorder`), or None."""
    with zipfile.ZipFile(window) as z:
        names = [n for n in z.namelist() if n.rsplit("/", 1)[-1] == "byteorder"]
        return z.read(names[0]).decode() if len(names) == 1 else None


def _narrowed(t, offsets, lengths):
    for dim, (offset, length) in enumerate(zip(offsets, lengths)):
        if offset != 0 or length != t.size(dim):
            t = t.narrow(dim, offset, length)
    return t


def _read_as_torch(f, md, req, target) -> None:
    """One item as torch's read_data reads it: torch.load into fresh memory, narrowed, copied."""
    import torch

    tensor = _narrowed(torch.load(_Window(f, md.offset, md.length), map_location="cpu", weights_only=True),
                       req.storage_offsets, req.lengths)
    if target.size() != tensor.size():
        raise AssertionError(f"req {req.storage_index} mismatch sizes {target.size()} vs {tensor.size()}")
    target.copy_(tensor)


def _pread(fd: int, offset: int, address: int, nbytes: int) -> None:
    view = memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")
    got = 0
    while got < nbytes:
        n = os.preadv(fd, [view[got:]], offset + got)  # (drops the GIL)
        if n == 0:
            raise BridgeFGOError(f"{rank_prefix()}a checkpoint file ended {nbytes - got} byte(s) short of a tensor "
                                 f"at offset {offset}: the checkpoint is truncated")
        got += n


class _Window(io.RawIOBase):
    """Bytes [offset, offset + length) of an open file, as a file of their own (torch.load and zipfile seek and
    read in it); positional reads, so the file's own position is never moved."""

    def __init__(self, f, offset: int, length: int):
        super().__init__()
        self._fd, self._base, self._len, self._pos = f.fileno(), offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        self._pos = max(0, {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._len}[whence] + pos)
        return self._pos

    def readinto(self, b) -> int:
        view = memoryview(b).cast("B")
        n = max(0, min(len(view), self._len - self._pos))
        if n == 0:
            return 0
        got = os.preadv(self._fd, [view[:n]], self._base + self._pos)
        self._pos += got
        return got


__all__: List[str] = ["Reads", "straight_into"]
