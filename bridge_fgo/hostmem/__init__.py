"""Host memory for the pinned optimizer-state buffer: refuse what will not fit, pin it on the GPU's NUMA node.

- `check_fits(bytes_per_rank)` (check.py) compares what every rank of this node will pin (ranks.py)
  with the host memory available (available.py: MemAvailable and the cgroup limit's headroom) and
  raises BridgeFGOConfigError before anything is pinned when it does not fit; with an asynchronous
  checkpoint save of the host states, their writer's copy counts too (and in /dev/shm, when Bridge's
  persistent checkpoint worker receives it there). `room_for(bytes_per_rank)` asks the same of memory made
  while training runs (a second snapshot for a save that starts beside a pending one): why not, or None.
- `pin(nbytes)` (pinning.py) maps a pageable buffer (private, not inherited by a forked child, huge pages
  asked for), first-touches it (numa.py: from threads
  bound to the GPU's NUMA node when the host has several), registers it with cudaHostRegister, and
  falls back to torch.empty(pin_memory=True) with one WARNING when registration is refused. The
  PinnedHost it returns is released exactly once, by free() or, as a backstop, when collected;
  `pinned_bytes()` / `live_buffers()` count what is still held.
- `spread` (spread.py): copies between host tensors and first touches, from a few threads; torch's own threads
  raised to the rank's share of its cores for a checkpoint load (torch_threads).

Importing this package does not import torch. Every path under /proc and /sys is read below `root`
(default "/") so tests can fake the trees.
"""
from .available import CgroupLimit, HostMemory, available_bytes, host_memory, shm_free
from .check import (FIXES, RESERVE_FRACTION, RESERVE_MIN_BYTES, SHM_FIXES, HostFit, check_fits, reserve_for,
                    room_for)
from .common import GiB, fmt_bytes
from .numa import (NumaTarget, first_touch, format_cpulist, gpu_pci_address, node_cpus, node_target,
                   numa_nodes, numa_target, parse_cpulist)
from . import spread
from .pinning import PinnedHost, live_buffers, pin, pinned_bytes
from .ranks import LocalRanks, local_ranks

__all__ = [
    "GiB", "fmt_bytes",
    "CgroupLimit", "HostMemory", "host_memory", "available_bytes", "shm_free",
    "LocalRanks", "local_ranks",
    "HostFit", "check_fits", "room_for", "reserve_for", "FIXES", "SHM_FIXES", "RESERVE_MIN_BYTES",
    "RESERVE_FRACTION",
    "NumaTarget", "parse_cpulist", "format_cpulist", "numa_nodes", "node_cpus", "node_target", "numa_target",
    "gpu_pci_address", "first_touch",
    "PinnedHost", "pin", "pinned_bytes", "live_buffers", "spread",
]
