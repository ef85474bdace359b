"""Host memory for the pinned optimizer-state buffer: refuse what will not fit, pin it on the GPU's NUMA node.

- `check_fits(bytes_per_rank)` compares what every rank of this node will pin with the host memory
  available (MemAvailable, and the cgroup limit's headroom) and raises BridgeFGOConfigError before
  anything is pinned when it does not fit: pinned pages can be neither swapped nor reclaimed, so a
  shortfall goes straight to the OOM killer, which picks a process on the node, not necessarily ours.
- `pin(nbytes)` allocates a pageable buffer, first-touches it (from threads bound to the GPU's NUMA
  node when the host has several), registers it with cudaHostRegister, and falls back to
  torch.empty(pin_memory=True) with one WARNING when registration is refused.

Importing this module does not import torch. Every path under /proc and /sys is read below `root`
(default "/") so tests can fake the trees.
"""
from __future__ import annotations

import ctypes
import logging
import os
import re
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from . import log as _log
from .errors import BridgeFGOConfigError
from .log import logger, rank_prefix

GiB = 2**30

# The safety reserve kept free on top of what the ranks pin: max(RESERVE_MIN_BYTES, RESERVE_FRACTION x
# available). It absorbs host memory the run grows into after the check (data-loader workers, checkpoint
# staging, allocator caches, the CUDA driver's own host allocations), and the kernel's free-page
# watermarks (MemAvailable already excludes the low watermark, but reclaim starts stalling near it).
# 2 GiB covers those on a small host; 5% scales it on large ones (about 100 GiB on a 2 TiB node,
# where eight ranks' growth of a few GiB each is the realistic margin).
RESERVE_MIN_BYTES = 2 * GiB
RESERVE_FRACTION = 0.05

# cgroup v1 reports "no limit" as PAGE_COUNTER_MAX pages (0x7FFFFFFFFFFFF000 on x86-64); any limit
# this large is no limit.
_NO_LIMIT = 2**60

# What to change when the check refuses. bridge_fgo offloads all of the optimizer's states or none: it
# has no partial-offload option, and an engine's chunk size (chunk_mb, where one exists) only sizes
# the transfers; the host buffer holds every offloaded byte either way.
FIXES = ("reduce the bytes each rank pins: more data-parallel ranks (the distributed optimizer shards its "
         "states over them) or more tensor/pipeline parallelism (fewer parameters per rank); bridge_fgo has "
         "no partial-offload option, and the transfer chunk size (chunk_mb) does not reduce host bytes; or "
         "run fewer ranks on this node; or give it more host memory (a larger container/cgroup memory "
         "limit, e.g. memory.max, docker --memory, Slurm --mem, Kubernetes resources.limits.memory)")

_LOCAL_RANK_VARS = ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
                    "OMPI_COMM_WORLD_LOCAL_SIZE")

_TOUCH_THREADS = 8             # bound first-touch threads: page faulting stops scaling beyond a few
_TOUCH_ALIGN = 2 * 2**20       # slices on 2 MiB boundaries, so a transparent huge page has one toucher
_PIN_MEMORY_SECONDS_NOTE = "1.2-2.5 s for cudaHostRegister vs 9-10 s for pin_memory=True, measured for 10 GB"


def fmt_bytes(n: int) -> str:
    """'12.00 GiB (12884901888 bytes)': readable and exact."""
    return f"{n / GiB:.2f} GiB ({n} bytes)"


def _path(root: Optional[str], *parts: str) -> str:
    return os.path.join(root or "/", *(p.lstrip("/") for p in parts))


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


# -- host memory available --------------------------------------------------------------------------

@dataclass(frozen=True)
class CgroupLimit:
    """The cgroup level whose limit leaves the least room: headroom = limit - (usage - inactive_file)."""
    version: int
    path: str          # the cgroup directory read (under root)
    limit: int
    usage: int
    reclaimable: int   # inactive file pages: page cache the kernel drops before it OOM-kills
    headroom: int

    def describe(self) -> str:
        lim, use = (("memory.max", "memory.current") if self.version == 2
                    else ("memory.limit_in_bytes", "memory.usage_in_bytes"))
        return (f"cgroup v{self.version} {self.path}: {lim} {fmt_bytes(self.limit)} - ({use} "
                f"{fmt_bytes(self.usage)} - inactive file cache {fmt_bytes(self.reclaimable)})")


@dataclass(frozen=True)
class HostMemory:
    """What this process may still allocate on the host: the smaller of MemAvailable and the cgroup
    headroom; `source` says which one it is."""
    bytes: int
    source: str                       # "MemAvailable" or "cgroup v1" / "cgroup v2"
    detail: str                       # the figures behind it
    meminfo_available: Optional[int]  # /proc/meminfo MemAvailable, None if unreadable
    cgroup: Optional[CgroupLimit]     # the binding cgroup level, None if no limit was found


def _meminfo_available(root: Optional[str]) -> Optional[int]:
    text = _read(_path(root, "proc/meminfo"))
    m = re.search(r"^MemAvailable:\s+(\d+)\s*kB", text or "", re.MULTILINE)
    return int(m.group(1)) * 1024 if m else None


def _unescape_mount(s: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), s)


def _cgroup_mounts(root: Optional[str]) -> Dict[int, List[Tuple[str, str]]]:
    """{version: [(mount root inside the hierarchy, mount point)]} from /proc/self/mountinfo; the
    usual places when it cannot be read."""
    text = _read(_path(root, "proc/self/mountinfo"))
    if text is None:
        return {2: [("/", "/sys/fs/cgroup")], 1: [("/", "/sys/fs/cgroup/memory")]}
    out: Dict[int, List[Tuple[str, str]]] = {1: [], 2: []}
    for line in text.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        sep = fields.index("-")
        if len(fields) < sep + 4 or sep < 5:
            continue
        fstype, opts = fields[sep + 1], fields[sep + 3].split(",")
        entry = (_unescape_mount(fields[3]), _unescape_mount(fields[4]))
        if fstype == "cgroup2":
            out[2].append(entry)
        elif fstype == "cgroup" and "memory" in opts:
            out[1].append(entry)
    return out


def _own_cgroups(root: Optional[str]) -> Dict[int, str]:
    """{version: this process's cgroup path} from /proc/self/cgroup (v1: the memory controller's)."""
    out: Dict[int, str] = {}
    for line in (_read(_path(root, "proc/self/cgroup")) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hier, controllers, path = parts
        if hier == "0" and controllers == "":
            out[2] = path
        elif "memory" in controllers.split(","):
            out[1] = path
    return out


def _int_file(path: str) -> Optional[int]:
    text = _read(path)
    if text is None:
        return None
    text = text.strip()
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _stat_value(path: str, key: str) -> int:
    m = re.search(rf"^{key} (\d+)$", _read(path) or "", re.MULTILINE)
    return int(m.group(1)) if m else 0


def _level_limit(version: int, directory: str) -> Optional[CgroupLimit]:
    if version == 2:
        limit = _int_file(os.path.join(directory, "memory.max"))
        usage = _int_file(os.path.join(directory, "memory.current"))
        reclaim = _stat_value(os.path.join(directory, "memory.stat"), "inactive_file")
    else:
        limit = _int_file(os.path.join(directory, "memory.limit_in_bytes"))
        usage = _int_file(os.path.join(directory, "memory.usage_in_bytes"))
        stat = os.path.join(directory, "memory.stat")  # total_*: this level and its children
        reclaim = _stat_value(stat, "total_inactive_file") or _stat_value(stat, "inactive_file")
    if limit is None or limit >= _NO_LIMIT or usage is None:
        return None
    reclaim = min(reclaim, usage)
    return CgroupLimit(version, directory, limit, usage, reclaim, max(0, limit - (usage - reclaim)))


def _cgroup_limit(root: Optional[str]) -> Optional[CgroupLimit]:
    """The tightest limit among this process's cgroup and its ancestors (a parent's limit binds its
    children), for v2 and v1 alike; None if no level has a limit or nothing can be read."""
    own, mounts = _own_cgroups(root), _cgroup_mounts(root)
    found: List[CgroupLimit] = []
    for version, cg_path in own.items():
        for mount_root, mount_point in mounts.get(version, ()):
            base = _path(root, mount_point)
            # Without a cgroup namespace a container sees its full host path in /proc/self/cgroup
            # but has only its own subtree mounted: strip the mount's root from the path.
            mr = mount_root.rstrip("/")
            rel = cg_path[len(mr):] if cg_path == mr or cg_path.startswith(mr + "/") else ""
            # Walk up to the mount: levels that do not exist here (a path this mount does not show)
            # read as no limit, and the mount's own level is always read.
            base = os.path.normpath(base)
            directory = os.path.normpath(os.path.join(base, rel.lstrip("/")))
            while True:
                level = _level_limit(version, directory)
                if level is not None:
                    found.append(level)
                if directory == base or os.path.dirname(directory) == directory:
                    break
                directory = os.path.dirname(directory)
    return min(found, key=lambda c: c.headroom) if found else None


def host_memory(root: Optional[str] = None) -> Optional[HostMemory]:
    """The host memory this process can still use, and where the figure comes from; None when
    neither /proc/meminfo's MemAvailable nor a cgroup memory limit can be read."""
    meminfo = _meminfo_available(root)
    cgroup = _cgroup_limit(root)
    if cgroup is not None and (meminfo is None or cgroup.headroom < meminfo):
        detail = cgroup.describe()
        if meminfo is not None:
            detail += f"; MemAvailable {fmt_bytes(meminfo)}"
        return HostMemory(cgroup.headroom, f"cgroup v{cgroup.version}", detail, meminfo, cgroup)
    if meminfo is not None:
        detail = f"MemAvailable in {_path(root, 'proc/meminfo')}"
        if cgroup is not None:
            detail += f"; {cgroup.describe()} = {fmt_bytes(cgroup.headroom)}"
        return HostMemory(meminfo, "MemAvailable", detail, meminfo, cgroup)
    return None


def available_bytes(root: Optional[str] = None) -> Optional[int]:
    """min(MemAvailable, cgroup headroom) in bytes, or None if nothing can be read."""
    mem = host_memory(root)
    return None if mem is None else mem.bytes


# -- ranks of this node that will pin ---------------------------------------------------------------

@dataclass(frozen=True)
class LocalRanks:
    count: int
    source: str   # e.g. "LOCAL_WORLD_SIZE=8", or why the default of 1 was taken


def _slurm_tasks(value: str, node_id: Optional[str]) -> Tuple[int, str]:
    """'8', '8(x2)', '8(x2),4' -> this node's count: by SLURM_NODEID when it indexes the expanded
    list, else the largest (an over-estimate refuses early rather than letting the OOM killer pick)."""
    counts: List[int] = []
    for part in value.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise ValueError(f"{part!r} is not N or N(xK)")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    if node_id is not None and node_id.strip().isdigit() and int(node_id) < len(counts):
        return counts[int(node_id)], f" (entry {int(node_id)}, SLURM_NODEID={node_id.strip()})"
    if len(set(counts)) == 1:
        return counts[0], ""
    return max(counts), " (the largest entry: SLURM_NODEID does not say which is this node's)"


def local_ranks(env: Optional[Mapping[str, str]] = None) -> LocalRanks:
    """How many ranks of this node will pin: LOCAL_WORLD_SIZE (torchrun), else SLURM_NTASKS_PER_NODE,
    else SLURM_TASKS_PER_NODE, else OMPI_COMM_WORLD_LOCAL_SIZE, else 1. A malformed value gets one
    WARNING naming it and the next source is tried."""
    env = os.environ if env is None else env
    for var in _LOCAL_RANK_VARS:
        raw = env.get(var)
        if raw is None or raw.strip() == "":
            continue
        try:
            if var.startswith("SLURM_"):
                count, note = _slurm_tasks(raw, env.get("SLURM_NODEID"))
            else:
                count, note = int(raw.strip()), ""
            if count < 1:
                raise ValueError("it must be at least 1")
        except ValueError as exc:
            _log.once(("hostmem-local-ranks", var, raw), logging.WARNING,
                      "%sbridge_fgo cannot read %s=%r as a number of ranks on this node (%s); it is ignored "
                      "for the host-memory check", rank_prefix(), var, raw, exc)
            continue
        return LocalRanks(count, f"{var}={raw.strip()}{note}")
    return LocalRanks(1, "assumed: none of " + ", ".join(_LOCAL_RANK_VARS) + " is set to a usable value")


# -- the refusal ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class HostFit:
    """The host-memory check's figures: log `describe()`, show `as_dict()` in `bridge-fgo status`."""
    bytes_per_rank: int
    local_ranks: int
    local_ranks_source: str
    needed: int                    # bytes_per_rank x local_ranks
    reserve: int                   # kept free on top (RESERVE_MIN_BYTES / RESERVE_FRACTION)
    available: Optional[int]       # None: nothing could be read, the check did not run
    source: Optional[str]          # "MemAvailable", "cgroup v1", "cgroup v2"
    detail: Optional[str]
    fits: Optional[bool]           # None when available is unknown

    def describe(self) -> str:
        head = (f"host memory: {fmt_bytes(self.bytes_per_rank)} pinned per rank x {self.local_ranks} local "
                f"rank(s) ({self.local_ranks_source}) = {fmt_bytes(self.needed)}")
        if self.available is None:
            return head + "; available host memory unknown, not checked"
        return (head + f", plus a reserve of {fmt_bytes(self.reserve)}; available {fmt_bytes(self.available)} "
                f"({self.source}: {self.detail}): {'fits' if self.fits else 'does NOT fit'}")

    def as_dict(self) -> dict:
        return asdict(self)


def reserve_for(available: int) -> int:
    return max(RESERVE_MIN_BYTES, int(available * RESERVE_FRACTION))


def check_fits(bytes_per_rank: int, *, env: Optional[Mapping[str, str]] = None, root: Optional[str] = None,
               ranks: Optional[int] = None) -> HostFit:
    """Refuse, before anything is pinned, host memory the node does not have.

    `bytes_per_rank` is everything this rank will pin (the sum over every optimizer in the chain).
    Call it on every rank before any rank of the node pins: MemAvailable drops as ranks pin, so a
    rank checking after its neighbours pinned would count their bytes twice. `ranks` overrides the
    local rank count read from `env`. Raises BridgeFGOConfigError when bytes_per_rank x local ranks +
    reserve exceeds what is available; returns the figures otherwise (fits=None, with one WARNING,
    when nothing could be read)."""
    if bytes_per_rank < 0:
        raise ValueError(f"bytes_per_rank must be >= 0, got {bytes_per_rank}")
    if ranks is not None and int(ranks) < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    lr = local_ranks(env) if ranks is None else LocalRanks(int(ranks), f"{int(ranks)} (given by the caller)")
    needed = bytes_per_rank * lr.count
    mem = host_memory(root)
    if mem is None:
        _log.once("hostmem-unknown", logging.WARNING,
                  "%scannot read the host memory available (no MemAvailable in %s, no cgroup memory limit); "
                  "%s per rank x %d local rank(s) = %s will be pinned without a check", rank_prefix(),
                  _path(root, "proc/meminfo"), fmt_bytes(bytes_per_rank), lr.count, fmt_bytes(needed))
        return HostFit(bytes_per_rank, lr.count, lr.source, needed, 0, None, None, None, None)
    reserve = reserve_for(mem.bytes)
    fit = HostFit(bytes_per_rank, lr.count, lr.source, needed, reserve, mem.bytes, mem.source, mem.detail,
                  needed == 0 or needed + reserve <= mem.bytes)  # pinning nothing cannot hurt
    if not fit.fits:
        raise BridgeFGOConfigError(
            f"optimizer-state offload would pin more host memory than this node has: {fmt_bytes(bytes_per_rank)} "
            f"per rank x {lr.count} local rank(s) ({lr.source}) = {fmt_bytes(needed)}, plus a safety reserve of "
            f"{fmt_bytes(reserve)} (max({RESERVE_MIN_BYTES // GiB} GiB, {RESERVE_FRACTION:.0%} of available)) = "
            f"{fmt_bytes(needed + reserve)}, but only {fmt_bytes(mem.bytes)} is available ({mem.source}: "
            f"{mem.detail}). Pinned pages cannot be swapped or reclaimed, so this would end in the OOM killer; "
            f"refused before anything was pinned. Fix: {FIXES}.")
    return fit


# -- NUMA placement ---------------------------------------------------------------------------------

def parse_cpulist(text: str) -> List[int]:
    """Kernel cpulist format: '0-15,32-47', '3', '0-6:2' (stride), '' -> sorted CPU ids."""
    cpus = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        m = re.fullmatch(r"(\d+)(?:-(\d+)(?::(\d+))?)?", part)
        if not m:
            raise ValueError(f"bad cpulist entry {part!r} in {text.strip()!r}")
        lo, hi, stride = int(m.group(1)), int(m.group(2) or m.group(1)), int(m.group(3) or 1)
        if hi < lo or stride < 1:
            raise ValueError(f"bad cpulist range {part!r} in {text.strip()!r}")
        cpus.update(range(lo, hi + 1, stride))
    return sorted(cpus)


def format_cpulist(cpus: Sequence[int]) -> str:
    out, run = [], []
    for c in sorted(set(cpus)):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def numa_nodes(root: Optional[str] = None) -> Optional[List[int]]:
    """The host's online NUMA nodes, or None if sysfs does not say."""
    text = _read(_path(root, "sys/devices/system/node/online"))
    if text is not None:
        try:
            return parse_cpulist(text)
        except ValueError:
            pass
    try:
        names = os.listdir(_path(root, "sys/devices/system/node"))
    except OSError:
        return None
    nodes = sorted(int(n[4:]) for n in names if re.fullmatch(r"node\d+", n))
    return nodes or None


def node_cpus(node: int, root: Optional[str] = None) -> List[int]:
    text = _read(_path(root, f"sys/devices/system/node/node{node}/cpulist"))
    return parse_cpulist(text) if text is not None else []


def gpu_pci_address(device_index: int) -> Tuple[Optional[str], str]:
    """('0000:17:00.0', how it was found) for the CUDA device, or (None, why not). Reads the PCI ids
    torch exposes in its device properties (torch >= 2.6), else asks nvidia-smi by the device's UUID
    (nvidia-smi numbers GPUs ignoring CUDA_VISIBLE_DEVICES, the UUID does not)."""
    import torch

    props = torch.cuda.get_device_properties(device_index)
    ids = [getattr(props, a, None) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    if all(isinstance(v, int) for v in ids):
        return f"{ids[0]:04x}:{ids[1]:02x}:{ids[2]:02x}.0", "torch device properties"
    uuid = str(getattr(props, "uuid", "") or "").lower().removeprefix("gpu-")
    if not uuid:
        return None, "torch exposes neither PCI ids nor the UUID of the device"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=uuid,pci.bus_id", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"nvidia-smi failed ({type(exc).__name__}: {exc})"
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].lower().removeprefix("gpu-") == uuid:
            m = re.fullmatch(r"([0-9a-fA-F]+):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.(\d)", parts[1])
            if m:  # nvidia-smi prints an 8-digit domain, sysfs a 4-digit one
                return f"{int(m.group(1), 16):04x}:{m.group(2).lower()}:{m.group(3).lower()}.0", "nvidia-smi"
    return None, f"nvidia-smi lists no GPU with UUID {uuid}"


@dataclass(frozen=True)
class NumaTarget:
    """Where to first-touch: `node` None means no placement (single node or unknown; `reason` says)."""
    node: Optional[int]
    cpus: Tuple[int, ...]
    reason: str


def node_target(node: int, root: Optional[str] = None, why: str = "") -> NumaTarget:
    """Bind first touch to `node`'s CPUs (no placement if the node has none, e.g. a memory-only node)."""
    cpus = tuple(node_cpus(node, root))
    if not cpus:
        return NumaTarget(None, (), f"NUMA node {node}{why} lists no CPUs to bind to: plain first touch")
    return NumaTarget(node, cpus, f"NUMA node {node}{why}, CPUs {format_cpulist(cpus)}")


def numa_target(device_index: int, *, root: Optional[str] = None,
                pci_address: Optional[Callable[[int], Tuple[Optional[str], str]]] = None) -> NumaTarget:
    """The GPU's NUMA node and its CPUs, when the host has more than one node and the kernel knows
    the GPU's node; otherwise node None and the reason."""
    nodes = numa_nodes(root)
    if nodes is None:
        return NumaTarget(None, (), "NUMA topology unknown (no /sys/devices/system/node): plain first touch")
    if len(nodes) <= 1:
        return NumaTarget(None, (), f"single NUMA node ({format_cpulist(nodes)}): plain first touch")
    try:
        addr, how = (pci_address or gpu_pci_address)(device_index)
    except Exception as exc:  # a broken query must not stop the run: placement is an optimisation
        addr, how = None, f"{type(exc).__name__}: {exc}"
    if addr is None:
        return NumaTarget(None, (), f"{len(nodes)} NUMA nodes, but GPU {device_index}'s PCI address is "
                                    f"unknown ({how}): plain first touch")
    node_file = _path(root, f"sys/bus/pci/devices/{addr}/numa_node")
    text = _read(node_file)
    try:
        node = int((text or "").strip())
    except ValueError:
        node = -1
    if node < 0:
        return NumaTarget(None, (), f"{len(nodes)} NUMA nodes, but {node_file} gives no node for GPU "
                                    f"{device_index} ({(text or 'unreadable').strip()}): plain first touch")
    return node_target(node, root, why=f" of GPU {device_index} (PCI {addr}, from {how})")


def _touch_range(ptr: int, nbytes: int) -> None:
    """Write every page once. ctypes.memset drops the GIL and runs in the calling thread; torch's
    zero_() would hand the work to an OpenMP pool whose threads are not bound to the node."""
    ctypes.memset(ptr, 0, nbytes)


def first_touch(tensor, target: NumaTarget) -> Tuple[Optional[int], str]:
    """Fault in every page of `tensor`'s storage. With a target node, from threads bound to that node's
    CPUs (the kernel's default policy puts a page on the faulting CPU's node; only the worker threads
    are bound, the caller's affinity is left alone). Returns (the node the pages were touched on, or
    None; how it was done)."""
    nbytes = tensor.numel() * tensor.element_size()
    if target.node is None or nbytes == 0:
        tensor.zero_()
        return None, target.reason
    ptr = tensor.data_ptr()
    workers = max(1, min(_TOUCH_THREADS, len(target.cpus), os.cpu_count() or 1))
    step = -(-nbytes // workers)
    step = -(-step // _TOUCH_ALIGN) * _TOUCH_ALIGN
    errors: List[str] = []
    bound: List[str] = []

    def work(start: int, length: int) -> None:
        try:
            os.sched_setaffinity(0, target.cpus)  # pid 0: the calling thread only, on Linux
            bound.append(format_cpulist(sorted(os.sched_getaffinity(0))))
        except OSError as exc:  # e.g. a cpuset that excludes every CPU of the node
            errors.append(f"{type(exc).__name__}: {exc}")
        _touch_range(ptr + start, length)

    threads = [threading.Thread(target=work, args=(s, min(step, nbytes - s)), name=f"bridge_fgo-touch-{i}")
               for i, s in enumerate(range(0, nbytes, step))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        return None, (f"{target.reason}: binding failed in {len(errors)} of {len(threads)} first-touch "
                      f"thread(s) ({errors[0]}), so no placement: pages went where the default policy put them")
    return target.node, (f"{target.reason}: first touch from {len(threads)} thread(s) bound to CPUs "
                         f"{', '.join(sorted(set(bound)))}")


# -- pinning ----------------------------------------------------------------------------------------

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
        root: Optional[str] = None, target: Optional[NumaTarget] = None) -> PinnedHost:
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
        target = (numa_target(device, root=root) if numa
                  else NumaTarget(None, (), "NUMA placement not requested: plain first touch"))
    tensor = torch.empty(nbytes, dtype=torch.uint8)
    node, placement = first_touch(tensor, target)  # registering then pins pages already present

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
        mem = host_memory(root)
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
