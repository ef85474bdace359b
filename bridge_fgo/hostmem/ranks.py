"""How many ranks of this node will pin: the launcher's local world size (torchrun, Slurm, Open MPI).

Read from the environment by hand: torch.distributed knows only the global world size before a
process group exists, and the check runs on every rank of the node before any of them pins.
"""
from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import List, Mapping, Optional, Tuple

from ..log import once, rank_prefix

_LOCAL_RANK_VARS = ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
                    "OMPI_COMM_WORLD_LOCAL_SIZE")


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
            once(("hostmem-local-ranks", var, raw), logging.WARNING,
                 "%sbridge_fgo cannot read %s=%r as a number of ranks on this node (%s); it is ignored "
                 "for the host-memory check", rank_prefix(), var, raw, exc)
            continue
        return LocalRanks(count, f"{var}={raw.strip()}{note}")
    return LocalRanks(1, "assumed: none of " + ", ".join(_LOCAL_RANK_VARS) + " is set to a usable value")
