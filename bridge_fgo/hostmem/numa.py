"""NUMA placement of the host buffer: the host's nodes and their CPUs, the GPU's node, and the first
touch of every page from threads bound to that node's CPUs (the kernel's default policy puts a page
on the node of the CPU that faults it in).

Read by hand from sysfs: the GPU's node is /sys/bus/pci/devices/<PCI address>/numa_node, which
neither the standard library nor torch reports, and libnuma's Python bindings would be a new
dependency for two small files.
"""
from __future__ import annotations

import ctypes
import itertools
import os
import re
import subprocess
import threading
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

from .common import read, under

_TOUCH_THREADS = 8             # bound first-touch threads: page faulting stops scaling beyond a few
_TOUCH_ALIGN = 2 * 2**20       # slices on 2 MiB boundaries, so a transparent huge page has one toucher


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
    """[0, 1, 2, 3, 8] -> '0-3,8'."""
    out = []
    # consecutive ids share cpu - position, so each group is one run
    for _, run in itertools.groupby(enumerate(sorted(set(cpus))), lambda ic: ic[1] - ic[0]):
        ids = [c for _, c in run]
        out.append(f"{ids[0]}-{ids[-1]}" if len(ids) > 1 else str(ids[0]))
    return ",".join(out)


def numa_nodes(root: Optional[str] = None) -> Optional[List[int]]:
    """The host's online NUMA nodes, or None if sysfs does not say."""
    text = read(under(root, "sys/devices/system/node/online"))
    if text is not None:
        try:
            return parse_cpulist(text)
        except ValueError:
            pass
    try:
        names = os.listdir(under(root, "sys/devices/system/node"))
    except OSError:
        return None
    nodes = sorted(int(n[4:]) for n in names if re.fullmatch(r"node\d+", n))
    return nodes or None


def node_cpus(node: int, root: Optional[str] = None) -> List[int]:
    text = read(under(root, f"sys/devices/system/node/node{node}/cpulist"))
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


def _nowhere(reason: str) -> NumaTarget:
    return NumaTarget(None, (), reason + ": plain first touch")


def node_target(node: int, root: Optional[str] = None, why: str = "") -> NumaTarget:
    """Bind first touch to `node`'s CPUs (no placement if the node has none, e.g. a memory-only node)."""
    cpus = tuple(node_cpus(node, root))
    if not cpus:
        return _nowhere(f"NUMA node {node}{why} lists no CPUs to bind to")
    return NumaTarget(node, cpus, f"NUMA node {node}{why}, CPUs {format_cpulist(cpus)}")


def numa_target(device_index: int, *, root: Optional[str] = None,
                pci_address: Optional[Callable[[int], Tuple[Optional[str], str]]] = None) -> NumaTarget:
    """The GPU's NUMA node and its CPUs, when the host has more than one node and the kernel knows
    the GPU's node; otherwise node None and the reason."""
    nodes = numa_nodes(root)
    if nodes is None:
        return _nowhere("NUMA topology unknown (no /sys/devices/system/node)")
    if len(nodes) <= 1:
        return _nowhere(f"single NUMA node ({format_cpulist(nodes)})")
    try:
        addr, how = (pci_address or gpu_pci_address)(device_index)
    except Exception as exc:  # a broken query must not stop the run: placement is an optimisation
        addr, how = None, f"{type(exc).__name__}: {exc}"
    if addr is None:
        return _nowhere(f"{len(nodes)} NUMA nodes, but GPU {device_index}'s PCI address is unknown ({how})")
    node_file = under(root, f"sys/bus/pci/devices/{addr}/numa_node")
    text = read(node_file)
    try:
        node = int((text or "").strip())
    except ValueError:
        node = -1
    if node < 0:
        return _nowhere(f"{len(nodes)} NUMA nodes, but {node_file} gives no node for GPU {device_index} "
                        f"({(text or 'unreadable').strip()})")
    return node_target(node, root, why=f" of GPU {device_index} (PCI {addr}, from {how})")


def _touch_range(ptr: int, nbytes: int) -> None:
    """Write every page once. ctypes.memset drops the GIL and runs in the calling thread; torch's
    zero_() would hand the work to an OpenMP pool whose threads are not bound to the node."""
    ctypes.memset(ptr, 0, nbytes)


def _touch_in_threads(ptr: int, nbytes: int, workers: int) -> int:
    """Write every page of [ptr, ptr + nbytes) once, from `workers` unbound threads on 2 MiB-aligned
    slices; how many threads ran."""
    step = -(-nbytes // workers)
    step = -(-step // _TOUCH_ALIGN) * _TOUCH_ALIGN
    threads = [threading.Thread(target=_touch_range, args=(ptr + s, min(step, nbytes - s)),
                                name=f"bridge_fgo-touch-{i}") for i, s in enumerate(range(0, nbytes, step))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return len(threads)


def first_touch(tensor, target: NumaTarget) -> Tuple[Optional[int], str]:
    """Fault in every page of `tensor`'s storage. With a target node, from threads bound to that node's
    CPUs (only the worker threads are bound, the caller's affinity is left alone). Returns (the node
    the pages were touched on, or None; how it was done)."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return None, target.reason
    if target.node is None:
        # no placement: still from several threads, since one faults pages in at about 1.3-3 GB/s and
        # torch's zero_() runs on one thread under torchrun (OMP_NUM_THREADS=1)
        threads = _touch_in_threads(tensor.data_ptr(), nbytes, max(1, min(_TOUCH_THREADS, os.cpu_count() or 1)))
        return None, f"{target.reason} from {threads} thread(s)"
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
