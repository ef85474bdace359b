"""What this process may still allocate on the host: /proc/meminfo's MemAvailable, and the headroom
under the tightest cgroup (v1 or v2) memory limit of its own cgroup and every ancestor.

Read by hand from /proc and /sys: no standard-library call gives a cgroup's limit, and reading the
files needs nothing psutil would add (psutil reports MemAvailable but no cgroup limit).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from .common import fmt_bytes, read, under

# cgroup v1 reports "no limit" as PAGE_COUNTER_MAX pages (0x7FFFFFFFFFFFF000 on x86-64); any limit
# this large is no limit.
_NO_LIMIT = 2**60

# per version: the limit file, the usage file, memory.stat keys of reclaimable page cache (v1's
# total_* counts this level and its children; older kernels have only the plain key)
_FILES = {2: ("memory.max", "memory.current", ("inactive_file",)),
          1: ("memory.limit_in_bytes", "memory.usage_in_bytes", ("total_inactive_file", "inactive_file"))}


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
        lim, use, _ = _FILES[self.version]
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
    m = re.search(r"^MemAvailable:\s+(\d+)\s*kB", read(under(root, "proc/meminfo")) or "", re.MULTILINE)
    return int(m.group(1)) * 1024 if m else None


def _unescape_mount(s: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), s)


def _cgroup_mounts(root: Optional[str]) -> Dict[int, List[Tuple[str, str]]]:
    """{version: [(mount root inside the hierarchy, mount point)]} from /proc/self/mountinfo; the
    usual places when it cannot be read."""
    text = read(under(root, "proc/self/mountinfo"))
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
    for line in (read(under(root, "proc/self/cgroup")) or "").splitlines():
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
    """The file's integer; None when unreadable, not a number, or "max" (v2's no limit)."""
    try:
        return int((read(path) or "").strip())
    except ValueError:
        return None


def _stat_value(path: str, key: str) -> int:
    m = re.search(rf"^{key} (\d+)$", read(path) or "", re.MULTILINE)
    return int(m.group(1)) if m else 0


def _level_limit(version: int, directory: str) -> Optional[CgroupLimit]:
    limit_file, usage_file, stat_keys = _FILES[version]
    limit = _int_file(os.path.join(directory, limit_file))
    usage = _int_file(os.path.join(directory, usage_file))
    if limit is None or limit >= _NO_LIMIT or usage is None:
        return None
    stat = os.path.join(directory, "memory.stat")
    reclaim = min(next((v for v in (_stat_value(stat, k) for k in stat_keys) if v), 0), usage)
    return CgroupLimit(version, directory, limit, usage, reclaim, max(0, limit - (usage - reclaim)))


def _cgroup_limit(root: Optional[str]) -> Optional[CgroupLimit]:
    """The tightest limit among this process's cgroup and its ancestors (a parent's limit binds its
    children), for v2 and v1 alike; None if no level has a limit or nothing can be read."""
    own, mounts = _own_cgroups(root), _cgroup_mounts(root)
    found: List[CgroupLimit] = []
    for version, cg_path in own.items():
        for mount_root, mount_point in mounts.get(version, ()):
            base = os.path.normpath(under(root, mount_point))
            # Without a cgroup namespace a container sees its full host path in /proc/self/cgroup
            # but has only its own subtree mounted: strip the mount's root from the path.
            mr = mount_root.rstrip("/")
            rel = cg_path[len(mr):] if cg_path == mr or cg_path.startswith(mr + "/") else ""
            # Walk up to the mount: levels that do not exist here (a path this mount does not show)
            # read as no limit, and the mount's own level is always read.
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
    meminfo, cgroup = _meminfo_available(root), _cgroup_limit(root)
    if cgroup is not None and (meminfo is None or cgroup.headroom < meminfo):
        also = f"; MemAvailable {fmt_bytes(meminfo)}" if meminfo is not None else ""
        return HostMemory(cgroup.headroom, f"cgroup v{cgroup.version}", cgroup.describe() + also, meminfo, cgroup)
    if meminfo is None:
        return None
    also = f"; {cgroup.describe()} = {fmt_bytes(cgroup.headroom)}" if cgroup is not None else ""
    return HostMemory(meminfo, "MemAvailable", f"MemAvailable in {under(root, 'proc/meminfo')}{also}",
                      meminfo, cgroup)


def available_bytes(root: Optional[str] = None) -> Optional[int]:
    """min(MemAvailable, cgroup headroom) in bytes, or None if nothing can be read."""
    mem = host_memory(root)
    return None if mem is None else mem.bytes


def shm_free(root: Optional[str] = None) -> Optional[int]:
    """Bytes still free in /dev/shm (tmpfs: what shared-memory tensors handed to another process take),
    or None when it cannot be read."""
    try:
        st = os.statvfs(under(root, "dev/shm"))
    except OSError:
        return None
    return st.f_bavail * st.f_frsize
