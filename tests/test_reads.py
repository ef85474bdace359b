"""A checkpoint load's reads straight into the host buffer (bridge_fgo/instrument/reads.py), through torch's real
torch.distributed.checkpoint save and load on this machine's files: what lands is what torch's own read_data
lands, bit for bit; only the buffer's views are read straight in, everything else is torch's own; torch's
read_data is back after the block, an exception too. The same reads under Megatron-Core's torch_dist (two ranks,
every format, reshards) and Megatron-FSDP's fsdp_dtensor: tests/test_resume_dp.py, tests/test_fsdp.py; through
the load's call site: tests/test_resume_host.py."""
import types

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from bridge_fgo.errors import BridgeFGOError
from bridge_fgo.instrument import reads

SHAPES = {"a": ((300,), torch.float32), "b": ((7, 11), torch.bfloat16), "c": ((64,), torch.int16),
          "d": ((5, 3, 2), torch.float32), "e": ((0,), torch.float32)}


def values(seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, (shape, dtype) in SHAPES.items():
        t = torch.randn(shape, generator=g) * 100
        out[k] = t.to(dtype)
    big = torch.randn(50, generator=g)
    out["view"] = big[10:30]  # a view of a larger storage: torch.save writes the whole storage
    return out


def buffer_views():
    """A flat uint8 buffer (as hostmem.pin makes it) and views of it shaped like values(), zeroed."""
    shapes = {k: (v.shape, v.dtype) for k, v in values().items()}
    sizes = {k: torch.Size(s).numel() * torch.empty(0, dtype=d).element_size() for k, (s, d) in shapes.items()}
    buf = torch.zeros(sum(-(-n // 64) * 64 for n in sizes.values()), dtype=torch.uint8)
    views, at = {}, 0
    for k, (shape, dtype) in shapes.items():
        views[k] = buf[at:at + sizes[k]].view(dtype).view(shape)
        at += -(-sizes[k] // 64) * 64
    return types.SimpleNamespace(tensor=buf), views


def saved(tmp_path, **extra):
    state = {**values(), "elsewhere": torch.arange(9.0), "obj": {"step": 3, "name": "x"}, **extra}
    dcp.save(state, checkpoint_id=tmp_path, no_dist=True)
    return state


def test_the_buffers_views_are_read_straight_in_and_the_rest_as_torch_reads_it(tmp_path):
    want = saved(tmp_path)
    buf, views = buffer_views()
    elsewhere = torch.zeros(9)
    prior = vars(FileSystemReader)["read_data"]
    got = {**views, "elsewhere": elsewhere, "obj": {"step": 0, "name": ""}}
    with reads.straight_into([buf]) as r:
        assert vars(FileSystemReader)["read_data"] is not prior
        dcp.load(got, checkpoint_id=tmp_path, no_dist=True)
    assert vars(FileSystemReader)["read_data"] is prior
    for k in values():
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    assert torch.equal(elsewhere, want["elsewhere"]) and got["obj"] == want["obj"]
    nonempty = [k for k, v in values().items() if v.numel()]
    assert (r.tensors, r.nbytes, r.as_torch) == (len(nonempty), sum(views[k].nbytes for k in nonempty), 0)
    assert r.threads >= 1 and r.describe().startswith(f"{len(nonempty)} tensor(s), ")


def test_without_a_buffer_nothing_is_wrapped(tmp_path):
    prior = vars(FileSystemReader)["read_data"]
    with reads.straight_into([]) as r:
        assert vars(FileSystemReader)["read_data"] is prior
    assert r.tensors == 0 and r.describe() == ""


def test_items_whose_stored_bytes_are_not_the_views_are_read_as_torch_reads_them(tmp_path, monkeypatch):
    """Where the item's own description does not say its bytes are the view's (here: another byte order), the item
    is read with torch.load and copied, into the same target, still bit for bit."""
    want = saved(tmp_path)
    buf, views = buffer_views()
    monkeypatch.setattr(reads, "_byte_order", lambda window: "big" if reads.sys.byteorder == "little" else "little")
    with reads.straight_into([buf]) as r:
        dcp.load(dict(views), checkpoint_id=tmp_path, no_dist=True)
    for k in values():
        assert torch.equal(views[k], want[k]), k
    assert r.tensors == 0 and r.as_torch == sum(1 for v in values().values() if v.numel())


def _one_item(tmp_path, key, target, storage_offsets, lengths):
    """torch's reader and a DefaultLoadPlanner over {key: target}, with one read of part of the saved `key`."""
    reader = FileSystemReader(tmp_path)
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, True)
    planner = DefaultLoadPlanner()
    planner.set_up_planner({key: target}, metadata, True)
    zeros = torch.Size([0] * target.dim())
    req = ReadItem(type=LoadItemType.TENSOR, storage_index=MetadataIndex(key, zeros, 0),
                   dest_index=MetadataIndex(key, zeros), storage_offsets=torch.Size(storage_offsets),
                   dest_offsets=zeros, lengths=torch.Size(lengths))
    return reader, planner, LoadPlan([req])


@pytest.mark.parametrize("key, start, lengths, straight", [
    ("a", (40,), (100,), True),             # part of a 1-D tensor: contiguous, read straight in
    ("d", (2, 0, 0), (3, 3, 2), True),      # along the first dimension: contiguous
    ("d", (0, 1, 0), (5, 2, 2), False),     # along another: strided in the file, read as torch reads it
    ("view", (5,), (10,), True),            # of a tensor saved as a view of a larger storage
])
def test_part_of_a_saved_tensor_lands_where_torch_puts_it(tmp_path, key, start, lengths, straight):
    """A reshard reads part of a saved tensor (storage_offsets, lengths) into a smaller target."""
    want = saved(tmp_path)[key]
    buf, views = buffer_views()
    part = want[tuple(slice(s, s + n) for s, n in zip(start, lengths))]
    target = views[key].reshape(-1)[:part.numel()].view(part.shape)
    reader, planner, plan = _one_item(tmp_path, key, target, start, lengths)
    with reads.straight_into([buf]) as r:
        reader.read_data(plan, planner).wait()
    assert torch.equal(target, part)
    assert (r.tensors, r.as_torch) == ((1, 0) if straight else (0, 1))


def test_a_planner_of_its_own_gets_torchs_own_read_data_untouched(tmp_path, monkeypatch):
    saved(tmp_path)
    buf, views = buffer_views()
    reader, planner, plan = _one_item(tmp_path, "a", views["a"], (0,), (300,))
    seen = []
    prior = vars(FileSystemReader)["read_data"]
    monkeypatch.setattr(FileSystemReader, "read_data", lambda self, p, pl: seen.append((p, pl)) or prior(self, p, pl))
    other = types.SimpleNamespace(resolve_tensor=planner.resolve_tensor, commit_tensor=planner.commit_tensor)
    with reads.straight_into([buf]) as r:
        reader.read_data(plan, other).wait()
    assert seen == [(plan, other)] and r.tensors == 0  # the plan itself, not a copy: nothing taken from it
    assert torch.equal(views["a"], values()["a"])


def test_read_data_is_put_back_when_the_load_raises(tmp_path, monkeypatch):
    saved(tmp_path)
    buf, views = buffer_views()
    prior = vars(FileSystemReader)["read_data"]
    with pytest.raises(CheckpointException, match="Size mismatch"):  # (a BaseException)
        with reads.straight_into([buf]):
            dcp.load({"a": torch.zeros(3)}, checkpoint_id=tmp_path, no_dist=True)  # a shape the checkpoint lacks
    assert vars(FileSystemReader)["read_data"] is prior

    def broken(*args):
        raise OSError("the disk went away")

    monkeypatch.setattr(reads, "_pread", broken)  # a read of its own failing
    with pytest.raises(CheckpointException, match="the disk went away"):
        with reads.straight_into([buf]):
            dcp.load(dict(views), checkpoint_id=tmp_path, no_dist=True)
    assert vars(FileSystemReader)["read_data"] is prior


def test_a_truncated_file_is_named_not_read_short(tmp_path):
    path = tmp_path / "short"
    path.write_bytes(b"x" * 100)
    out = torch.zeros(200, dtype=torch.uint8)
    with open(path, "rb") as f, pytest.raises(BridgeFGOError, match="100 byte.*truncated"):
        reads._pread(f.fileno(), 0, out.data_ptr(), 200)
    assert bytes(out[:100].tolist()) == b"x" * 100


class _LocalFs:
    """A file system of another kind over this host's files, as Multi-Storage Client's is over a local path (which
    megatron-core 0.17 takes whenever multistorageclient is installed): paths either local, or URL-like."""

    def __init__(self, url: bool):
        from torch.distributed.checkpoint.filesystem import FileSystem

        self._fs, self._url = FileSystem(), url

    def concat_path(self, path, suffix):
        joined = self._fs.concat_path(str(path).removeprefix("local://"), suffix)
        return f"local://{joined}" if self._url else joined

    def init_path(self, path):
        return f"local://{path}" if self._url else self._fs.init_path(path)

    def create_stream(self, path, mode):
        return self._fs.create_stream(str(path).removeprefix("local://"), mode)

    def __getattr__(self, name):  # the rest as torch's FileSystem does it, on the local path
        return lambda path, *a: getattr(self._fs, name)(str(path).removeprefix("local://"), *a)


@pytest.mark.parametrize("url, straight", [(False, True), (True, False)], ids=["local-path", "url"])
def test_another_file_system_is_read_straight_only_over_this_hosts_files(tmp_path, monkeypatch, url, straight):
    want = saved(tmp_path)
    buf, views = buffer_views()
    monkeypatch.setattr(FileSystemReader, "__init__", _with_fs(FileSystemReader.__init__, _LocalFs(url)))
    with reads.straight_into([buf]) as r:
        dcp.load(dict(views), checkpoint_id=tmp_path, no_dist=True)
    for k in values():
        assert torch.equal(views[k], want[k]), k
    assert (r.tensors > 0) is straight and r.as_torch == 0


def _with_fs(init, fs):
    def with_fs(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.fs = fs
    return with_fs
