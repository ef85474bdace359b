"""bridge_fgo.hostmem on CPU: host memory read from faked /proc and /sys/fs/cgroup trees, the refusal,
local-rank counting, cpulist parsing, NUMA first touch from bound threads (a faked two-node sysfs),
pin()'s register / fallback / failure paths with torch.cuda faked, and PinnedHost released exactly
once (free() or the finalizer) with the live-buffer count following."""
import gc
import logging
import os
import subprocess
import sys
import threading
import time
import weakref

import pytest
import torch

from bridge_fgo import BridgeFGOConfigError, hostmem
from bridge_fgo import log as fgo_log

GiB = 2**30
V1_UNLIMITED = "9223372036854771712"


@pytest.fixture(autouse=True)
def _fresh_once():
    fgo_log.reset_once()
    gc.collect()  # buffers earlier tests left in reference cycles (a traceback holding an engine) go now, not mid-test
    yield
    fgo_log.reset_once()


def put(root, rel, text):
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def meminfo(root, avail_bytes):
    put(root, "proc/meminfo", f"MemTotal:       {4 * avail_bytes // 1024} kB\n"
                              f"MemFree:        1234 kB\nMemAvailable:   {avail_bytes // 1024} kB\n")


def cgroup_v2(root, path, levels, mountinfo=True):
    """levels: {relative cgroup dir: (memory.max, memory.current, inactive_file)}"""
    put(root, "proc/self/cgroup", f"0::{path}\n")
    if mountinfo:
        put(root, "proc/self/mountinfo",
            "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"
            "31 22 0:27 / /sys/fs/cgroup rw,nosuid shared:9 - cgroup2 cgroup2 rw,nsdelegate\n")
    for rel, (mx, cur, inactive) in levels.items():
        d = f"sys/fs/cgroup/{rel}".rstrip("/")
        put(root, f"{d}/memory.max", f"{mx}\n")
        put(root, f"{d}/memory.current", f"{cur}\n")
        put(root, f"{d}/memory.stat", f"anon 1\nfile 2\nactive_file 3\ninactive_file {inactive}\nslab 4\n")


# -- host memory available ---------------------------------------------------------------------------

def test_fmt_bytes_readable_and_exact():
    assert hostmem.fmt_bytes(12 * GiB) == "12.00 GiB (12884901888 bytes)"
    assert hostmem.fmt_bytes(1) == "0.00 GiB (1 bytes)"


def test_meminfo_only(tmp_path):
    meminfo(tmp_path, 100 * GiB)
    mem = hostmem.host_memory(str(tmp_path))
    assert (mem.bytes, mem.source, mem.cgroup) == (100 * GiB, "MemAvailable", None)
    assert hostmem.available_bytes(str(tmp_path)) == 100 * GiB


def test_cgroup_v2_headroom_counts_inactive_file_as_free(tmp_path):
    meminfo(tmp_path, 100 * GiB)
    cgroup_v2(tmp_path, "/job.slice/step", {"job.slice/step": (8 * GiB, 3 * GiB, 1 * GiB), "job.slice": ("max", 3 * GiB, 0)})
    mem = hostmem.host_memory(str(tmp_path))
    assert mem.source == "cgroup v2"
    assert mem.bytes == 8 * GiB - (3 * GiB - 1 * GiB)
    assert mem.cgroup.path == str(tmp_path / "sys/fs/cgroup/job.slice/step")
    assert mem.meminfo_available == 100 * GiB
    assert "memory.max 8.00 GiB (8589934592 bytes)" in mem.detail


def test_cgroup_v2_parent_limit_binds(tmp_path):
    meminfo(tmp_path, 100 * GiB)
    cgroup_v2(tmp_path, "/a/b", {"a/b": ("max", 1 * GiB, 0), "a": (5 * GiB, 2 * GiB, 0)})
    mem = hostmem.host_memory(str(tmp_path))
    assert mem.bytes == 3 * GiB and mem.cgroup.path.endswith("sys/fs/cgroup/a")


def test_cgroup_v2_no_limit_and_meminfo_smaller_wins(tmp_path):
    meminfo(tmp_path, 10 * GiB)
    cgroup_v2(tmp_path, "/a", {"a": ("max", 1 * GiB, 0)})
    assert hostmem.host_memory(str(tmp_path)).source == "MemAvailable"
    cgroup_v2(tmp_path, "/a", {"a": (64 * GiB, 1 * GiB, 0)})
    mem = hostmem.host_memory(str(tmp_path))
    assert (mem.bytes, mem.source) == (10 * GiB, "MemAvailable")
    assert "63.00 GiB" in mem.detail  # the cgroup's headroom is still shown


def test_cgroup_v2_without_mountinfo_uses_the_usual_mount(tmp_path):
    meminfo(tmp_path, 100 * GiB)
    cgroup_v2(tmp_path, "/", {"": (4 * GiB, 1 * GiB, 0)}, mountinfo=False)
    assert hostmem.available_bytes(str(tmp_path)) == 3 * GiB


def test_cgroup_v1_container_without_cgroup_namespace(tmp_path):
    """The container sees its host path /docker/abc, but only its own subtree is mounted."""
    meminfo(tmp_path, 100 * GiB)
    put(tmp_path, "proc/self/cgroup", "5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n")
    put(tmp_path, "proc/self/mountinfo",
        "40 31 0:35 /docker/abc /sys/fs/cgroup/memory ro,nosuid - cgroup cgroup rw,memory\n"
        "41 31 0:36 /docker/abc /sys/fs/cgroup/cpu,cpuacct ro - cgroup cgroup rw,cpu,cpuacct\n")
    d = "sys/fs/cgroup/memory"
    put(tmp_path, f"{d}/memory.limit_in_bytes", f"{16 * GiB}\n")
    put(tmp_path, f"{d}/memory.usage_in_bytes", f"{6 * GiB}\n")
    put(tmp_path, f"{d}/memory.stat", f"inactive_file 5\ntotal_inactive_file {2 * GiB}\n")
    mem = hostmem.host_memory(str(tmp_path))
    assert (mem.bytes, mem.source) == (12 * GiB, "cgroup v1")
    assert "memory.limit_in_bytes 16.00 GiB" in mem.detail


def test_cgroup_path_missing_under_the_mount_reads_the_mount(tmp_path):
    """A mount whose root does not show the path (the host path is not visible): read the mount itself."""
    meminfo(tmp_path, 100 * GiB)
    cgroup_v2(tmp_path, "/kubepods/pod1/c1", {"": (9 * GiB, 4 * GiB, 0)})
    mem = hostmem.host_memory(str(tmp_path))
    assert (mem.bytes, mem.cgroup.path) == (5 * GiB, str(tmp_path / "sys/fs/cgroup"))


def test_cgroup_v1_unlimited_is_no_limit(tmp_path):
    meminfo(tmp_path, 7 * GiB)
    put(tmp_path, "proc/self/cgroup", "4:memory:/x\n")
    put(tmp_path, "proc/self/mountinfo", "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n")
    for d in ("sys/fs/cgroup/memory", "sys/fs/cgroup/memory/x"):
        put(tmp_path, f"{d}/memory.limit_in_bytes", V1_UNLIMITED)
        put(tmp_path, f"{d}/memory.usage_in_bytes", str(5 * GiB))
    mem = hostmem.host_memory(str(tmp_path))
    assert (mem.bytes, mem.source, mem.cgroup) == (7 * GiB, "MemAvailable", None)


def test_nothing_readable(tmp_path):
    assert hostmem.host_memory(str(tmp_path)) is None
    assert hostmem.available_bytes(str(tmp_path)) is None


def test_this_host_is_readable():
    mem = hostmem.host_memory()
    assert mem is not None and mem.bytes > 0


# -- local ranks ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("env, count, source", [
    ({"LOCAL_WORLD_SIZE": "8", "SLURM_NTASKS_PER_NODE": "4"}, 8, "LOCAL_WORLD_SIZE=8"),
    ({"SLURM_NTASKS_PER_NODE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, 4, "SLURM_NTASKS_PER_NODE=4"),
    ({"SLURM_NTASKS_PER_NODE": "8(x2)"}, 8, "SLURM_NTASKS_PER_NODE=8(x2)"),
    ({"SLURM_TASKS_PER_NODE": "8(x2),4", "SLURM_NODEID": "2"}, 4, "entry 2, SLURM_NODEID=2"),
    ({"SLURM_TASKS_PER_NODE": "8(x2),4", "SLURM_NODEID": "1"}, 8, "entry 1"),
    ({"SLURM_TASKS_PER_NODE": "4,8(x2)"}, 8, "the largest entry"),
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "6"}, 6, "OMPI_COMM_WORLD_LOCAL_SIZE=6"),
    ({}, 1, "assumed: none of LOCAL_WORLD_SIZE"),
])
def test_local_ranks(env, count, source):
    got = hostmem.local_ranks(env)
    assert got.count == count and source in got.source


@pytest.mark.parametrize("bad", ["eight", "0", "-2", "8(x)", "4.5"])
def test_local_ranks_bad_value_warns_and_falls_through(bad, caplog):
    caplog.set_level(logging.WARNING, logger="bridge_fgo")
    got = hostmem.local_ranks({"LOCAL_WORLD_SIZE": bad, "OMPI_COMM_WORLD_LOCAL_SIZE": "3"})
    assert (got.count, got.source) == (3, "OMPI_COMM_WORLD_LOCAL_SIZE=3")
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(msgs) == 1 and f"LOCAL_WORLD_SIZE={bad!r}" in msgs[0]
    hostmem.local_ranks({"LOCAL_WORLD_SIZE": bad})
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1  # once per value


def test_local_ranks_reads_os_environ(monkeypatch):
    for var in ("SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "5")
    assert hostmem.local_ranks().count == 5


# -- the refusal ---------------------------------------------------------------------------------------

def test_refused_with_every_number_and_the_fixes(tmp_path):
    meminfo(tmp_path, 100 * GiB)
    with pytest.raises(BridgeFGOConfigError) as exc:
        hostmem.check_fits(12 * GiB, env={"LOCAL_WORLD_SIZE": "8"}, root=str(tmp_path))
    msg = str(exc.value)
    for part in ("12.00 GiB (12884901888 bytes) per rank", "x 8 local rank(s) (LOCAL_WORLD_SIZE=8)",
                 "= 96.00 GiB (103079215104 bytes)", "reserve of 5.00 GiB (5368709120 bytes)",
                 "101.00 GiB (108447924224 bytes)", "only 100.00 GiB (107374182400 bytes) is available",
                 "MemAvailable", "more data-parallel ranks", "chunk_mb", "does not reduce host bytes",
                 "more host memory", "memory limit", "OOM killer", "before anything was pinned"):
        assert part in msg, part


def test_refusal_names_the_cgroup(tmp_path):
    meminfo(tmp_path, 500 * GiB)
    cgroup_v2(tmp_path, "/job", {"job": (40 * GiB, 4 * GiB, 0)})
    with pytest.raises(BridgeFGOConfigError) as exc:
        hostmem.check_fits(5 * GiB, env={"SLURM_NTASKS_PER_NODE": "8(x4)"}, root=str(tmp_path))
    msg = str(exc.value)
    assert "36.00 GiB (38654705664 bytes) is available (cgroup v2" in msg
    assert str(tmp_path / "sys/fs/cgroup/job") in msg and "memory.max 40.00 GiB" in msg
    assert "SLURM_NTASKS_PER_NODE=8(x4)" in msg and "= 40.00 GiB" in msg


def test_fits_up_to_the_byte(tmp_path):
    meminfo(tmp_path, 100 * GiB)  # reserve: 5% = 5 GiB
    fit = hostmem.check_fits(19 * GiB, ranks=5, root=str(tmp_path))
    assert (fit.fits, fit.needed, fit.reserve, fit.available, fit.source) == \
        (True, 95 * GiB, 5 * GiB, 100 * GiB, "MemAvailable")
    assert fit.local_ranks == 5 and "given by the caller" in fit.local_ranks_source
    assert fit.as_dict()["needed"] == 95 * GiB and "fits" in fit.describe()
    with pytest.raises(BridgeFGOConfigError):
        hostmem.check_fits(19 * GiB + 1, ranks=5, root=str(tmp_path))


def test_reserve_has_a_floor(tmp_path):
    meminfo(tmp_path, 10 * GiB)  # 5% = 0.5 GiB < 2 GiB
    assert hostmem.check_fits(8 * GiB, ranks=1, root=str(tmp_path)).reserve == 2 * GiB
    with pytest.raises(BridgeFGOConfigError, match="reserve of 2.00 GiB"):
        hostmem.check_fits(8 * GiB + 1, ranks=1, root=str(tmp_path))


def test_unknown_memory_says_so_once_and_does_not_refuse(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="bridge_fgo")
    for _ in range(2):
        fit = hostmem.check_fits(10**15, env={"LOCAL_WORLD_SIZE": "8"}, root=str(tmp_path))
        assert fit.fits is None and fit.available is None and fit.needed == 8 * 10**15
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1
    assert "cannot read the host memory available" in msgs[0] and str(8 * 10**15) in msgs[0]
    assert "not checked" in fit.describe()


def test_an_asynchronous_saves_snapshot_counts_on_top_of_the_pinned_bytes(tmp_path):
    """With asynchronous checkpoint saves of the host states, their writer's copy (pageable, while a
    save is written) needs the memory too, on every local rank at once."""
    meminfo(tmp_path, 100 * GiB)  # reserve: 5 GiB
    fit = hostmem.check_fits(5 * GiB, snapshot_per_rank=5 * GiB, ranks=9, root=str(tmp_path))
    assert (fit.fits, fit.needed, fit.snapshot_per_rank, fit.shm_available) == (True, 90 * GiB, 5 * GiB, None)
    line = fit.describe()
    assert "5.00 GiB (5368709120 bytes) pinned per rank + 5.00 GiB (5368709120 bytes) per rank for " \
           "asynchronous checkpoint saves (the snapshot" in line and "= 90.00 GiB" in line and "/dev/shm" not in line
    with pytest.raises(BridgeFGOConfigError) as exc:
        hostmem.check_fits(5 * GiB, snapshot_per_rank=5 * GiB, ranks=10, root=str(tmp_path))
    msg = str(exc.value)
    assert "per rank + 5.00 GiB (5368709120 bytes) per rank that an asynchronous checkpoint save copies" in msg
    assert "async_save=False" in msg and "= 100.00 GiB" in msg
    assert hostmem.check_fits(5 * GiB, ranks=10, root=str(tmp_path)).fits  # the same pinned bytes alone fit


def test_the_states_a_load_makes_beside_the_buffer_count_on_top_of_the_pinned_bytes(tmp_path):
    """Under the streamed step a checkpoint load makes a parameter's states (pageable) before they go into
    the pinned buffer: one parameter's at a time, on every local rank at once."""
    meminfo(tmp_path, 100 * GiB)  # reserve: 5 GiB
    fit = hostmem.check_fits(9 * GiB, load_per_rank=1 * GiB, ranks=9, root=str(tmp_path))
    assert (fit.fits, fit.needed, fit.load_per_rank) == (True, 90 * GiB, 1 * GiB)
    assert "pinned per rank + 1.00 GiB (1073741824 bytes) per rank while a checkpoint load makes states" \
        in fit.describe()
    with pytest.raises(BridgeFGOConfigError, match="per rank that a checkpoint load makes beside it"):
        hostmem.check_fits(9 * GiB, load_per_rank=1 * GiB, ranks=10, root=str(tmp_path))
    assert hostmem.check_fits(9 * GiB, ranks=10, root=str(tmp_path)).fits  # the same pinned bytes alone fit


@pytest.fixture
def shm_free(monkeypatch):
    """/dev/shm with `free` bytes (statvfs faked), or unreadable (None)."""
    def fake(free):
        def statvfs(path):
            if free is None:
                raise FileNotFoundError(path)
            assert path.endswith("dev/shm")
            return type("St", (), {"f_bavail": free // 4096, "f_frsize": 4096})()

        monkeypatch.setattr(hostmem.available.os, "statvfs", statvfs)

    return fake


def test_snapshots_passing_through_dev_shm_must_fit_there(tmp_path, shm_free):
    """Bridge's persistent checkpoint worker receives the writer's copy through /dev/shm: every local
    rank's copy must fit in its free space (a container's default 64 MiB does not)."""
    meminfo(tmp_path, 1000 * GiB)
    shm_free(40 * GiB)
    fit = hostmem.check_fits(5 * GiB, snapshot_per_rank=5 * GiB, snapshot_in_shm=True, ranks=8, root=str(tmp_path))
    assert fit.shm_available == 40 * GiB and "/dev/shm" in fit.describe() and fit.describe().endswith("fits")
    shm_free(64 * 2**20)
    with pytest.raises(BridgeFGOConfigError) as exc:
        hostmem.check_fits(5 * GiB, snapshot_per_rank=5 * GiB, snapshot_in_shm=True, ranks=8, root=str(tmp_path))
    msg = str(exc.value)
    assert "would not fit in /dev/shm" in msg and "40.00 GiB (42949672960 bytes) over this node's local ranks" in msg
    assert "0.06 GiB (67108864 bytes) free" in msg and "CUDA IPC" in msg and "before anything was pinned" in msg
    assert "--shm-size" in msg and "async_save=False" in msg and "chunk_mb=0" in msg
    # not through /dev/shm (a forked worker reads the copy in place): only the memory is checked
    assert hostmem.check_fits(5 * GiB, snapshot_per_rank=5 * GiB, ranks=8, root=str(tmp_path)).shm_available is None
    shm_free(None)
    fit = hostmem.check_fits(5 * GiB, snapshot_per_rank=5 * GiB, snapshot_in_shm=True, ranks=8, root=str(tmp_path))
    assert fit.shm_available is None and "unreadable" in fit.describe() and "not checked" in fit.describe()


def test_room_for_memory_made_while_training_runs(tmp_path, shm_free):
    """room_for: the same sums as the check before the first step, for memory made later (a second snapshot for
    a save that starts beside a pending one), answered with why not instead of a refusal; unknown figures do not
    fit."""
    meminfo(tmp_path, 100 * GiB)  # reserve: 5 GiB
    env = {"LOCAL_WORLD_SIZE": "8"}
    assert hostmem.room_for(int(11.875 * GiB), env=env, root=str(tmp_path)) is None  # 95 GiB + 5 GiB
    why = hostmem.room_for(12 * GiB, env=env, root=str(tmp_path))
    assert "x 8 local rank(s) = 96.00 GiB" in why and "reserve of 5.00 GiB" in why and "100.00 GiB" in why
    shm_free(90 * GiB)
    assert hostmem.room_for(11 * GiB, env=env, root=str(tmp_path)) is None  # not through /dev/shm: not asked
    why = hostmem.room_for(int(11.5 * GiB), env=env, in_shm=True, root=str(tmp_path))  # 92 GiB: memory fits
    assert why is not None and "/dev/shm" in why and "90.00 GiB" in why
    assert hostmem.room_for(11 * GiB, env=env, in_shm=True, root=str(tmp_path)) is None
    shm_free(None)
    assert "unknown" in hostmem.room_for(1, env=env, in_shm=True, root=str(tmp_path))
    assert "unknown" in hostmem.room_for(1, env=env, root=str(tmp_path / "nothing"))


def test_zero_bytes_fit_and_bad_arguments(tmp_path):
    meminfo(tmp_path, 1 * GiB)  # less than the reserve: pinning nothing still fits
    assert hostmem.check_fits(0, ranks=8, root=str(tmp_path)).fits
    with pytest.raises(BridgeFGOConfigError):
        hostmem.check_fits(1, ranks=1, root=str(tmp_path))
    with pytest.raises(ValueError, match="got -1"):
        hostmem.check_fits(-1, root=str(tmp_path))
    with pytest.raises(ValueError, match="ranks must be >= 1, got 0"):
        hostmem.check_fits(1, ranks=0, root=str(tmp_path))


# -- cpulists and the NUMA target ---------------------------------------------------------------------

@pytest.mark.parametrize("text, cpus", [
    ("0-15,32-47\n", list(range(16)) + list(range(32, 48))),
    ("3", [3]), ("", []), ("\n", []), (" 1 , 3-4 \n", [1, 3, 4]), ("0-6:2", [0, 2, 4, 6]),
    ("5,1-2,2", [1, 2, 5]),
])
def test_parse_cpulist(text, cpus):
    assert hostmem.parse_cpulist(text) == cpus


@pytest.mark.parametrize("bad", ["a", "5-3", "1-", "-1", "0-4:0", "1,,x"])
def test_parse_cpulist_rejects(bad):
    with pytest.raises(ValueError, match="cpulist"):
        hostmem.parse_cpulist(bad)


def test_format_cpulist():
    assert hostmem.format_cpulist([0, 1, 2, 3, 8, 10, 11]) == "0-3,8,10-11"
    assert hostmem.format_cpulist([]) == ""


ADDR = "0000:17:00.0"


def two_nodes(root, gpu_node="1", cpus=("0-15,32-47", "16-31,48-63")):
    put(root, "sys/devices/system/node/online", "0-1\n")
    for i, c in enumerate(cpus):
        put(root, f"sys/devices/system/node/node{i}/cpulist", c + "\n")
    put(root, f"sys/bus/pci/devices/{ADDR}/numa_node", gpu_node + "\n")


def fake_pci(index):
    return ADDR, "a test"


def test_numa_target_two_nodes(tmp_path):
    two_nodes(tmp_path)
    t = hostmem.numa_target(0, root=str(tmp_path), pci_address=fake_pci)
    assert t.node == 1 and t.cpus == tuple(range(16, 32)) + tuple(range(48, 64))
    assert "NUMA node 1 of GPU 0 (PCI 0000:17:00.0" in t.reason and "16-31,48-63" in t.reason


def test_numa_target_nodes_from_directory_listing(tmp_path):
    two_nodes(tmp_path)
    (tmp_path / "sys/devices/system/node/online").unlink()
    assert hostmem.numa_nodes(str(tmp_path)) == [0, 1]
    assert hostmem.numa_target(0, root=str(tmp_path), pci_address=fake_pci).node == 1


@pytest.mark.parametrize("setup, reason", [
    (lambda r: put(r, "sys/devices/system/node/online", "0\n"), "single NUMA node"),
    (lambda r: None, "NUMA topology unknown"),
    (lambda r: two_nodes(r, gpu_node="-1"), "gives no node for GPU 0 (-1)"),
    (lambda r: two_nodes(r, cpus=("0-3", "")), "NUMA node 1 of GPU 0 (PCI 0000:17:00.0, from a test) lists no CPUs"),
])
def test_numa_target_no_placement(tmp_path, setup, reason):
    setup(tmp_path)
    t = hostmem.numa_target(0, root=str(tmp_path), pci_address=fake_pci)
    assert t.node is None and t.cpus == () and reason in t.reason


def test_numa_target_unknown_pci_address(tmp_path):
    two_nodes(tmp_path)
    t = hostmem.numa_target(3, root=str(tmp_path), pci_address=lambda i: (None, "nvidia-smi failed"))
    assert t.node is None and "GPU 3's PCI address is unknown (nvidia-smi failed)" in t.reason

    def boom(i):
        raise RuntimeError("no driver")
    t = hostmem.numa_target(3, root=str(tmp_path), pci_address=boom)
    assert t.node is None and "RuntimeError: no driver" in t.reason


# -- first touch from bound threads ---------------------------------------------------------------------

@pytest.fixture
def record_touch(monkeypatch):
    """What each first-touch call saw from inside its thread: (thread name, affinity, start, length)."""
    seen = []
    real = hostmem.numa._touch_range

    def spy(ptr, nbytes):
        seen.append((threading.current_thread().name, frozenset(os.sched_getaffinity(0)), ptr, nbytes))
        real(ptr, nbytes)
    monkeypatch.setattr(hostmem.numa, "_touch_range", spy)
    return seen


def one_cpu():
    return max(os.sched_getaffinity(0))  # the last CPU this process may use: a strict subset if > 1


def test_first_touch_from_a_thread_bound_to_the_node(tmp_path, record_touch):
    cpu = one_cpu()
    two_nodes(tmp_path, cpus=("0-1000", str(cpu)))
    target = hostmem.numa_target(0, root=str(tmp_path), pci_address=fake_pci)
    before = os.sched_getaffinity(0)
    t = torch.full((3 * 2**20 + 5,), 7, dtype=torch.uint8)
    node, how = hostmem.first_touch(t, target)
    assert node == 1 and f"bound to CPUs {cpu}" in how
    assert [(aff, ptr, n) for _, aff, ptr, n in record_touch] == [(frozenset({cpu}), t.data_ptr(), t.numel())]
    assert record_touch[0][0] != threading.current_thread().name
    assert os.sched_getaffinity(0) == before  # the caller's affinity is untouched
    assert int(t.count_nonzero()) == 0


def test_first_touch_slices_cover_the_buffer(record_touch, monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    cpu = one_cpu()
    target = hostmem.NumaTarget(1, (cpu,) * 3, "NUMA node 1 (test)")  # three workers, all on one CPU
    t = torch.full((5 * 2**20 + 123,), 9, dtype=torch.uint8)
    node, how = hostmem.first_touch(t, target)
    spans = sorted((ptr - t.data_ptr(), n) for _, _, ptr, n in record_touch)
    assert spans == [(0, 2 * 2**20), (2 * 2**20, 2 * 2**20), (4 * 2**20, 2**20 + 123)]
    assert len({tid for tid, _, _, _ in record_touch}) == 3 and "3 thread(s)" in how
    assert int(t.count_nonzero()) == 0


def test_first_touch_binding_refused(record_touch):
    target = hostmem.NumaTarget(1, (1 << 20,), "NUMA node 1 (test)")  # a CPU no host has
    t = torch.full((4096,), 1, dtype=torch.uint8)
    node, how = hostmem.first_touch(t, target)
    assert node is None and "binding failed in 1 of 1" in how and "OSError" in how
    assert int(t.count_nonzero()) == 0  # touched anyway


def test_first_touch_without_a_node_is_unbound_and_threaded(record_touch, monkeypatch):
    # one thread faults pages in at 1.3-3 GB/s, and under torchrun (OMP_NUM_THREADS=1) torch's zero_() is one
    # thread: without a node the pages are still touched from several threads, none bound
    monkeypatch.setattr(os, "cpu_count", lambda: 3)
    t = torch.full((5 * 2**20 + 123,), 1, dtype=torch.uint8)
    before = os.sched_getaffinity(0)
    node, how = hostmem.first_touch(t, hostmem.NumaTarget(None, (), "single NUMA node (0)"))
    assert (node, how) == (None, "single NUMA node (0) from 3 thread(s)")
    spans = sorted((ptr - t.data_ptr(), n) for _, _, ptr, n in record_touch)
    assert spans == [(0, 2 * 2**20), (2 * 2**20, 2 * 2**20), (4 * 2**20, 2**20 + 123)]
    assert {aff for _, aff, _, _ in record_touch} == {frozenset(before)}  # unbound
    assert threading.current_thread().name not in {name for name, _, _, _ in record_touch}
    assert int(t.count_nonzero()) == 0


# -- pin() ----------------------------------------------------------------------------------------------

class FakeErr:
    def __init__(self, value, name):
        self.value, self.name = value, name


class FakeCudart:
    def __init__(self, register_result=0):
        self.result = register_result
        self.unregister_result = FakeErr(0, "success")
        self.calls = []

    def cudaHostRegister(self, ptr, n, flags):
        self.calls.append(("register", ptr, n, flags, threading.get_ident(), FakeCuda.device.get(threading.get_ident())))
        return self.result

    def cudaHostUnregister(self, ptr):
        self.calls.append(("unregister", ptr, threading.get_ident(), FakeCuda.device.get(threading.get_ident())))
        return self.unregister_result

    def cudaGetErrorString(self, err):
        return "out of memory"


class FakeCuda:
    device = {}


@pytest.fixture
def fake_cuda(monkeypatch, tmp_path):
    """torch.cuda as on a two-node GPU host; the GPU sits on node 1, whose CPU is one this process may use."""
    FakeCuda.device = {}
    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: FakeCuda.device.__setitem__(threading.get_ident(), d))
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(hostmem.numa, "gpu_pci_address", fake_pci)
    two_nodes(tmp_path, cpus=("0-1000", str(one_cpu())))
    return cudart


def test_pin_registers_on_the_gpus_node(fake_cuda, tmp_path, record_touch, caplog):
    caplog.set_level(logging.INFO, logger="bridge_fgo")
    buf = hostmem.pin(3 * 2**20, root=str(tmp_path))
    assert (buf.registered, buf.method, buf.numa_node) == (True, "cudaHostRegister", 1)
    assert buf.tensor.dtype == torch.uint8 and buf.tensor.numel() == 3 * 2**20 and buf.tensor.device.type == "cpu"
    assert record_touch[0][1] == frozenset({one_cpu()})
    kind, ptr, n, flags, tid, dev = fake_cuda.calls[0]
    assert (kind, ptr, n, flags, dev) == ("register", buf.tensor.data_ptr(), 3 * 2**20, 0, 2)
    assert tid != threading.get_ident()  # registered from a throwaway thread, on the current device
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    buf.free()
    assert fake_cuda.calls[-1][:2] == ("unregister", ptr) and buf.tensor is None and not buf.registered
    buf.free()  # idempotent
    assert len(fake_cuda.calls) == 2


def test_pin_numa_off_and_explicit_device(fake_cuda, tmp_path, record_touch):
    buf = hostmem.pin(4096, device_index=5, numa=False, root=str(tmp_path))
    assert buf.registered and buf.numa_node is None and "not requested" in buf.placement
    assert {aff for _, aff, _, _ in record_touch} == {frozenset(os.sched_getaffinity(0))}  # touched, unbound
    assert fake_cuda.calls[0][-1] == 5


def test_pin_single_node_host(fake_cuda, tmp_path, record_touch):
    put(tmp_path, "sys/devices/system/node/online", "0\n")
    buf = hostmem.pin(4096, root=str(tmp_path))
    assert buf.registered and buf.numa_node is None and "single NUMA node" in buf.placement


def test_pin_register_refused_falls_back_with_one_warning(fake_cuda, tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="bridge_fgo")
    fake_cuda.result = FakeErr(2, "cudaErrorMemoryAllocation")
    pinned, pageable, pinned_refs = [], [], []
    real_touch = hostmem.numa.first_touch
    monkeypatch.setattr(hostmem.numa, "first_touch", lambda t, target: pageable.append(weakref.ref(t)) or real_touch(t, target))

    def empty_pinned(n):
        assert pageable[0]() is None, "the pageable buffer must be freed before pinning a second one"
        pinned.append(n)
        t = torch.zeros(n, dtype=torch.uint8)
        pinned_refs.append(weakref.ref(t))
        return t
    monkeypatch.setattr(hostmem.pinning, "_empty_pinned", empty_pinned)
    n = 3 * GiB // 1024  # 3 MiB: rounds up to 4 MiB in PyTorch's pinned allocator
    buf = hostmem.pin(n, root=str(tmp_path))
    assert (buf.registered, buf.method, buf.numa_node, pinned) == (False, "pin_memory=True", None, [n])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    msg = warnings[0]
    for part in ("cudaHostRegister", "CUDA error 2 (cudaErrorMemoryAllocation: out of memory)",
                 f"0.00 GiB ({n} bytes)", "RLIMIT_MEMLOCK soft", "container", "pin_memory=True",
                 f"up to 0.00 GiB ({4 * 2**20} bytes) is pinned"):
        assert part in msg, part
    emptied = []
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: emptied.append(pinned_refs[0]() is None),
                        raising=False)
    buf.free()
    assert [c[0] for c in fake_cuda.calls] == ["register"]  # nothing to unregister
    # PyTorch's cached pinned block is given back, after the buffer was dropped (else it stays cached)
    assert emptied == [True] and buf.tensor is None


def test_pin_both_refused_raises_with_the_numbers(fake_cuda, tmp_path, monkeypatch):
    fake_cuda.result = FakeErr(2, "cudaErrorMemoryAllocation")
    meminfo(tmp_path, 10 * GiB)

    def refuse(n):
        raise RuntimeError("CUDA error: out of memory")
    monkeypatch.setattr(hostmem.pinning, "_empty_pinned", refuse)
    with pytest.raises(BridgeFGOConfigError) as exc:
        hostmem.pin(5 * 2**20, root=str(tmp_path))
    msg = str(exc.value)
    for part in (f"{5 * 2**20} bytes", "GPU 2", "CUDA error 2", "RuntimeError: CUDA error: out of memory",
                 f"up to 0.01 GiB ({8 * 2**20} bytes)", "available now: 10.00 GiB", "MemAvailable",
                 "ulimit -l", "more data-parallel ranks"):
        assert part in msg, part


def test_pin_without_cuda_is_plain_and_silent(caplog, record_touch):
    if torch.cuda.is_available():
        pytest.skip("this checks the CPU-only path")
    caplog.set_level(logging.DEBUG, logger="bridge_fgo")
    buf = hostmem.pin(1000)
    assert (buf.registered, buf.numa_node, buf.tensor.numel(), buf.tensor.dtype) == (False, None, 1000, torch.uint8)
    assert "CUDA unavailable" in buf.method and caplog.records == [] and record_touch == []
    buf.free()
    assert buf.tensor is None


# -- released exactly once, counted while alive ---------------------------------------------------------

def live():
    return hostmem.pinned_bytes(), hostmem.live_buffers()


def test_free_twice_unregisters_once_and_the_count_follows(fake_cuda, tmp_path):
    bytes0, buffers0 = live()
    buf = hostmem.pin(3 * 2**20, root=str(tmp_path))
    assert live() == (bytes0 + 3 * 2**20, buffers0 + 1)
    ptr, tensor = buf.tensor.data_ptr(), weakref.ref(buf.tensor)
    buf.free()
    buf.free()
    unregisters = [c for c in fake_cuda.calls if c[0] == "unregister"]
    assert len(unregisters) == 1
    _, uptr, tid, dev = unregisters[0]
    # on the device it was registered for, from a throwaway thread
    assert (uptr, dev) == (ptr, 2) and tid != threading.get_ident()
    assert live() == (bytes0, buffers0) and tensor() is None and buf.freed and not buf.registered


def test_unpin_in_place_keeps_the_data_and_repin_pins_it_again(fake_cuda, tmp_path):
    """Between two trainings the states stay in the same memory, unpinned: nothing stays locked."""
    bytes0, buffers0 = live()
    buf = hostmem.pin(8192, root=str(tmp_path))
    buf.tensor[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    ptr = buf.tensor.data_ptr()
    assert buf.unpin() and buf.unpinned and not buf.registered
    assert live() == (bytes0, buffers0 + 1)  # not pinned any more, still alive
    assert buf.tensor.data_ptr() == ptr and buf.tensor[:4].tolist() == [1, 2, 3, 4]
    buf.repin()
    assert buf.registered and live() == (bytes0 + 8192, buffers0 + 1)
    buf.unpin()
    buf.free()  # released while unpinned: no second unregister
    assert [c[0] for c in fake_cuda.calls] == ["register", "unregister", "register", "unregister"]
    assert live() == (bytes0, buffers0)


def test_dropped_without_free_the_finalizer_releases_it(fake_cuda, tmp_path):
    """An owner caught in a reference cycle is freed only by the garbage collector: the buffer's
    finalizer then unregisters it, once, and the count returns to where it was."""
    class Owner:
        pass

    bytes0, buffers0 = live()
    gc.disable()  # no collection between the drop and the explicit one below
    try:
        owner = Owner()
        owner.me, owner.buf = owner, hostmem.pin(4096, root=str(tmp_path))
        ptr, tensor = owner.buf.tensor.data_ptr(), weakref.ref(owner.buf.tensor)
        del owner
        assert live() == (bytes0 + 4096, buffers0 + 1) and tensor() is not None  # not collected yet
        assert [c[0] for c in fake_cuda.calls] == ["register"]
        gc.collect()
    finally:
        gc.enable()
    assert [c[:2] for c in fake_cuda.calls if c[0] == "unregister"] == [("unregister", ptr)]
    assert live() == (bytes0, buffers0) and tensor() is None
    gc.collect()
    assert len([c for c in fake_cuda.calls if c[0] == "unregister"]) == 1


def test_unregister_failure_warns_and_still_releases(fake_cuda, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="bridge_fgo")
    bytes0, buffers0 = live()
    buf = hostmem.pin(4096, root=str(tmp_path))
    fake_cuda.unregister_result = FakeErr(1, "cudaErrorInvalidValue")
    buf.free()
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and "cudaHostUnregister of 0.00 GiB (4096 bytes) failed with CUDA error 1" in msgs[0]
    assert live() == (bytes0, buffers0) and buf.tensor is None


def test_cpu_buffers_count_the_same_way():
    bytes0, buffers0 = live()
    bufs = [hostmem.pin(1000), hostmem.pin(0)]
    assert live() == (bytes0 + 1000, buffers0 + 2)
    assert [b.method for b in bufs] == ["unpinned (CUDA unavailable)" if not torch.cuda.is_available()
                                        else "cudaHostRegister", "unpinned (empty)"]
    bufs[0].free()
    assert live() == (bytes0, buffers0 + 1)
    del bufs  # the empty one, never freed, goes with its owner
    assert live() == (bytes0, buffers0)


def test_import_does_not_import_torch():
    code = "import sys, bridge_fgo.hostmem; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.stdout.strip() == "False"


def test_bench_script_without_cuda_says_so():
    if torch.cuda.is_available():
        pytest.skip("this checks the CPU-only answer")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, os.path.join(root, "scripts", "bench_numa.py"), "--gib", "0.01"],
                         capture_output=True, text=True)
    assert out.returncode == 1 and '"error": "CUDA is not available"' in out.stdout


def test_bench_script_reads_page_placement():
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("bench_numa", os.path.join(root, "scripts", "bench_numa.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    t = torch.empty(16 * 2**20, dtype=torch.uint8)
    t.zero_()
    pages = bench.node_pages(t.data_ptr(), t.numel())
    assert sum(pages.values()) > 0
    assert set(pages) <= {str(n) for n in hostmem.numa_nodes()}


def test_the_pages_benchmark_maps_and_faults_in_each_variant_and_says_when_there_is_no_cuda():
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, "scripts", "bench_pages.py")
    if not torch.cuda.is_available():
        out = subprocess.run([sys.executable, path, "--gib", "0.01"], capture_output=True, text=True)
        assert out.returncode == 1 and '"error": "CUDA is not available"' in out.stdout
    spec = importlib.util.spec_from_file_location("bench_pages", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for mapping, how in bench.VARIANTS:
        t = bench.mapped(4 * 2**20, mapping)
        bench.fault_in(t, how, [])
        flags = _vm_flags(t.data_ptr())
        assert ("sh" in flags) == (mapping == "shared") and ("hg" in flags) == (mapping == "private-huge"), flags
        assert int(t.count_nonzero()) == 0 and bench.anon_huge_kib(t.data_ptr(), t.numel()) >= 0


def test_status_shows_the_host_memory_the_engine_may_pin(monkeypatch):
    from bridge_fgo.instrument import diagnose

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    line = diagnose.host_memory_line()
    assert "for 8 local rank(s) (LOCAL_WORLD_SIZE=8)" in line and "bytes)" in line  # GiB and exact bytes


@pytest.mark.parametrize("chunk_mb", [0, 1])
def test_refused_through_the_real_train_step_before_anything_is_pinned(monkeypatch, chunk_mb):
    """The builtin engine checks the node's memory for all its local ranks before its first pin:
    a run that would not fit stops before the first step, naming its numbers."""
    import bridge_fgo
    from support import harness

    available = hostmem.HostMemory(2**30, "MemAvailable", "MemAvailable 1.00 GiB (faked)", 2**30, None)
    monkeypatch.setattr(hostmem.available, "host_memory", lambda root=None: available)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    pinned = []
    monkeypatch.setattr(hostmem, "pin", lambda *a, **k: pinned.append(a))
    bridge_fgo.patch(offload="builtin", chunk_mb=chunk_mb)
    rig = harness.Rig(cfg=harness.config_container(mxfp8_copy=False), with_tensors=True)
    with pytest.raises(bridge_fgo.BridgeFGOConfigError) as err:
        harness.run_steps(rig, steps=1)
    msg = str(err.value)
    assert "per rank x 8 local rank(s) (LOCAL_WORLD_SIZE=8)" in msg and "1.00 GiB (1073741824 bytes) is available" in msg
    assert "Fix:" in msg and rig.events == [] and pinned == []


# -- a registration deferred beside a checkpoint load's reads ---------------------------------------------

def test_a_deferred_registration_runs_in_its_own_thread_until_waited_for(fake_cuda, tmp_path, monkeypatch,
                                                                         record_touch):
    gate = threading.Event()
    real = fake_cuda.cudaHostRegister

    def slow_register(ptr, n, flags):
        gate.wait(10)  # held until the caller has gone on
        return real(ptr, n, flags)
    monkeypatch.setattr(fake_cuda, "cudaHostRegister", slow_register)
    bytes0 = hostmem.pinned_bytes()
    buf = hostmem.pin(3 * 2**20, root=str(tmp_path), defer=True)
    assert buf.pending and fake_cuda.calls == []  # returned before the registration ran
    # the pages faulted in before pin() returned, from threads bound to the GPU's node (never beside the load's
    # writes into them); they read as zero until written
    assert record_touch and buf.zeroed and int(buf.tensor.count_nonzero()) == 0
    assert {seen[1] for seen in record_touch} == {frozenset({one_cpu()})} and sum(seen[3] for seen in record_touch) == 3 * 2**20
    assert buf.numa_node == 1 and "first touch from" in buf.placement
    buf.tensor[:5] = 7  # a load writes into the pages meanwhile
    gate.set()
    buf.wait()
    assert not buf.pending and buf.registered and buf.method == "cudaHostRegister" and buf.register_s >= 0
    kind, ptr, n, _, tid, dev = fake_cuda.calls[0]
    assert (kind, ptr, n, dev) == ("register", buf.tensor.data_ptr(), 3 * 2**20, 2) and tid != threading.get_ident()
    assert hostmem.pinned_bytes() == bytes0 + 3 * 2**20 and int(buf.tensor[:5].sum()) == 35
    buf.free()
    assert [c[0] for c in fake_cuda.calls] == ["register", "unregister"] and hostmem.pinned_bytes() == bytes0


def test_a_refused_deferred_registration_leaves_the_buffer_pageable_with_one_warning(fake_cuda, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="bridge_fgo")
    fake_cuda.result = FakeErr(2, "cudaErrorMemoryAllocation")
    bytes0 = hostmem.pinned_bytes()
    buf = hostmem.pin(4096, root=str(tmp_path), defer=True)
    buf.wait()
    assert not buf.registered and buf.method.startswith("pageable (cudaHostRegister failed with CUDA error 2")
    assert hostmem.pinned_bytes() == bytes0 and buf.tensor is not None
    (said,) = [r.getMessage() for r in caplog.records]
    assert "stays pageable" in said and "ulimit -l" in said and "RLIMIT_MEMLOCK" in said
    buf.repin()  # a next train(): nothing registered again, nothing raised
    buf.free()
    assert [c[0] for c in fake_cuda.calls] == ["register"] and hostmem.pinned_bytes() == bytes0


def test_a_held_back_registration_starts_when_told_or_when_waited_for(fake_cuda, tmp_path, record_touch):
    """pin(defer=True, start=False): the pages are faulted in at once, the registration waits for
    start_registration() (after a load's reads), or runs when wait() needs it."""
    buf = hostmem.pin(4096, root=str(tmp_path), defer=True, start=False)
    assert record_touch and buf.pending and buf.held_back and fake_cuda.calls == []
    time.sleep(0.05)
    assert fake_cuda.calls == []  # nothing started it
    buf.start_registration()
    buf.wait()
    assert not buf.pending and buf.registered and [c[0] for c in fake_cuda.calls] == ["register"]
    buf.start_registration()  # nothing held back any more: nothing happens
    buf.free()
    other = hostmem.pin(4096, root=str(tmp_path), defer=True, start=False)
    other.wait()  # never told to start: wait() runs it
    assert other.registered and [c[0] for c in fake_cuda.calls] == ["register", "unregister", "register"]
    other.free()
    started = hostmem.pin(4096, root=str(tmp_path), defer=True)
    assert not started.held_back
    started.free()


def test_a_held_back_registration_never_started_registers_nothing_when_the_buffer_goes(fake_cuda, tmp_path, caplog):
    """pin(defer=True, start=False) and then released before start_registration() (a preparation that raised before
    the load; the buffer dropped on an exception path): nothing registers, nothing unregisters, nothing is said,
    freed or collected alike."""
    caplog.set_level(logging.DEBUG, logger="bridge_fgo")
    bytes0, buffers0 = hostmem.pinned_bytes(), hostmem.live_buffers()
    buf = hostmem.pin(4096, root=str(tmp_path), defer=True, start=False)
    assert hostmem.pinned_bytes() == bytes0 + 4096
    buf.free()
    dropped = hostmem.pin(8192, root=str(tmp_path), defer=True, start=False)
    del dropped
    gc.collect()
    assert fake_cuda.calls == [] and buf.freed and not buf.registered
    assert (hostmem.pinned_bytes(), hostmem.live_buffers()) == (bytes0, buffers0)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_buffer_freed_before_its_deferred_registration_ends_is_unregistered_after_it(fake_cuda, tmp_path):
    buf = hostmem.pin(4096, root=str(tmp_path), defer=True)
    buf.free()  # joins the registration first
    assert [c[0] for c in fake_cuda.calls] == ["register", "unregister"] and buf.freed


def test_a_buffer_a_load_writes_first_is_not_touched_where_no_node_is_to_be_placed_on(fake_cuda, tmp_path, record_touch):
    """pin(touch=False), for a checkpoint load that writes every state before its registration (held back) runs:
    on a host of one NUMA node no first touch writes the pages before the load does; they read as zero, and the
    registration after the writes pins them. With a node to place them on, they are touched there as ever.
    Without a held-back registration the flag is refused: that registration would fault the pages in itself."""
    one = tmp_path / "one"
    put(one, "sys/devices/system/node/online", "0\n")
    buf = hostmem.pin(3 * 2**20, root=str(one), defer=True, start=False, touch=False)
    assert record_touch == [] and buf.zeroed and int(buf.tensor.count_nonzero()) == 0
    assert buf.numa_node is None and "single NUMA node" in buf.placement and "no first touch" in buf.placement
    buf.tensor[:5] = 7  # the load writes
    buf.start_registration()
    buf.wait()
    assert buf.registered and [c[0] for c in fake_cuda.calls] == ["register"] and int(buf.tensor[:5].sum()) == 35
    buf.free()
    placed = hostmem.pin(3 * 2**20, root=str(tmp_path), defer=True, start=False, touch=False)  # two nodes
    assert placed.numa_node == 1 and "first touch from" in placed.placement
    assert sum(seen[3] for seen in record_touch) == 3 * 2**20
    placed.free()
    for kw in (dict(), dict(defer=True), dict(defer=True, start=True)):
        with pytest.raises(ValueError, match="touch=False.*needs defer=True and start=False"):
            hostmem.pin(4096, root=str(one), touch=False, **kw)


# -- host-memory work spread over a few threads ----------------------------------------------------------

def test_spread_copies_and_touches_piece_by_piece_from_several_threads(monkeypatch):
    from bridge_fgo.hostmem import spread

    monkeypatch.setattr(spread, "PIECE", 4096)  # 40 KB and 4 KB tensors: eleven pieces
    seen = []
    real_run = spread.run
    monkeypatch.setattr(spread, "run", lambda fn, items, name, workers=spread.THREADS: seen.append(len(items))
                        or real_run(fn, items, name, workers))
    src = [torch.arange(10000, dtype=torch.float32), torch.arange(1024, dtype=torch.int32)]
    dst = [torch.empty_like(t) for t in src]
    ran = spread.copy(zip(dst, src))
    assert all(torch.equal(a, b) for a, b in zip(dst, src)) and seen == [11]
    assert ran == min(spread.THREADS, os.cpu_count() or 1, 11)
    spread.touch([d.view(torch.uint8) for d in dst])
    assert all(int(d.count_nonzero()) == 0 for d in dst)
    with pytest.raises(ValueError, match="same byte size"):  # refused before anything is copied
        spread.copy([(torch.empty(3), torch.ones(4))])
    with pytest.raises(ZeroDivisionError):  # an error in a thread is raised in the caller, after all stopped
        spread.run(lambda x: 1 // x, [(1,), (0,), (2,)], "test")


@pytest.mark.parametrize("cores,ranks,before,during", [(16, 2, 1, 8), (64, 1, 1, 8), (6, 4, 1, 1), (16, 2, 12, 12)])
def test_torch_threads_are_raised_to_the_ranks_share_of_its_cores_for_the_block_only(monkeypatch, cores, ranks,
                                                                                       before, during):
    """torchrun's one thread a rank is raised to the rank's share of the cores it may run on (at most
    spread.THREADS), never lowered, and restored after the block, an exception's too."""
    from bridge_fgo.hostmem import spread

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
    threads = torch.get_num_threads()
    torch.set_num_threads(before)
    try:
        with spread.torch_threads() as seen:
            assert seen == (before, during) and torch.get_num_threads() == during
        assert torch.get_num_threads() == before
        with pytest.raises(KeyError), spread.torch_threads():
            raise KeyError("the load failed")
        assert torch.get_num_threads() == before
    finally:
        torch.set_num_threads(threads)


# -- how the buffer is mapped ----------------------------------------------------------------------------

def _vm_flags(ptr: int) -> set:
    """The kernel's VmFlags of the mapping holding `ptr` (/proc/self/smaps)."""
    mapping = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                mapping = lo <= ptr < hi
            elif mapping and head == "VmFlags:":
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {ptr:#x}")


def test_the_buffer_is_private_memory_a_forked_child_does_not_inherit_with_huge_pages_asked_for(fake_cuda, tmp_path):
    # private pages fault in 2.4x faster than Python's default shared mapping, huge ones 5x (one H200's host); a
    # forked child (a data-loader worker, a forked checkpoint writer) must not inherit them: registered, they would
    # be copied at the fork, and otherwise copied page by page as the parent writes them
    buf = hostmem.pin(5 * 2**20, root=str(tmp_path))
    flags = _vm_flags(buf.tensor.data_ptr())
    assert "sh" not in flags and "dc" in flags and "hg" in flags, flags
    assert buf.zeroed and int(buf.tensor.count_nonzero()) == 0 and buf.registered
    buf.free()
    small = hostmem.pin(4096, root=str(tmp_path))  # below a huge page: no advice for one
    flags = _vm_flags(small.tensor.data_ptr())
    assert "dc" in flags and "hg" not in flags, flags
    small.free()


def test_a_kernel_refusing_the_fork_advice_gets_the_shared_mapping(fake_cuda, tmp_path, monkeypatch):
    import mmap

    monkeypatch.setattr(mmap, "MADV_DONTFORK", 12345, raising=False)  # madvise refuses an unknown advice (EINVAL)
    buf = hostmem.pin(5 * 2**20, root=str(tmp_path))
    flags = _vm_flags(buf.tensor.data_ptr())
    assert "sh" in flags and "dc" not in flags, flags  # shared: a child shares the pages, nothing is copied
    assert int(buf.tensor.count_nonzero()) == 0 and buf.registered
    buf.free()
