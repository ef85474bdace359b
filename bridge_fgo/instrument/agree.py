"""One verdict for every rank: a refusal on any rank stops every rank, with the same message.

A check that refuses on one rank only (one node short of host memory) would let that rank raise
while the others go on into training's next collective and wait there for it, until NCCL's timeout
or forever. agree() makes the local verdicts one: every rank raises the same BridgeFGOConfigError,
or none does. The engine checks on every rank, agrees, and only then pins.

Every rank must call agree() exactly once per decision, and the ranks must make their decisions in
the same order: it is a collective (all_gather_object on the default process group), and a rank
that skips it, or calls it once more, leaves the others waiting. For an NCCL group the current CUDA
device must be set on each rank (Megatron sets it); gloo needs nothing.
"""
from __future__ import annotations

import sys
from typing import Dict, List, Optional, Sequence

from ..errors import BridgeFGOConfigError
from ..hostmem.numa import format_cpulist


def agree(problem: Optional[str], what: str) -> None:
    """Raise BridgeFGOConfigError on every rank if any rank's `problem` is not None; return on every
    rank otherwise. `problem` is this rank's refusal message (None: fine); `what` names the decision
    in the joint message. Without an initialized process group of more than one rank, the local
    problem is raised as it is."""
    if _distributed() is None:
        if problem is not None:
            raise BridgeFGOConfigError(problem)
        return
    # a str, whatever was passed: a verdict that failed to pickle would raise on this rank only,
    # before the exchange, and leave the others waiting in it
    message = refusal(what, gather(None if problem is None else str(problem)))
    if message is not None:
        raise BridgeFGOConfigError(message)


def gather(verdict: Optional[str]) -> List[Optional[str]]:
    """Every rank's `verdict` (None or a str), indexed by rank; [verdict] without a process group of
    more than one rank. A collective, like agree()."""
    dist = _distributed()
    if dist is None:
        return [verdict]
    verdicts: List[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, verdict)
    return verdicts


def refusal(what: str, verdicts: Sequence[Optional[str]]) -> Optional[str]:
    """The joint message for the ranks' verdicts (indexed by rank), or None when every one is None:
    '{what}: refused on rank(s) 1, 3 (of 8) before anything was pinned: ranks 1, 3: <message>', each
    distinct message once, with the ranks that gave it, in rank order."""
    by_message: Dict[str, List[int]] = {}
    for rank, verdict in enumerate(verdicts):
        if verdict is not None:
            by_message.setdefault(verdict or "(no message)", []).append(rank)
    if not by_message:
        return None
    refused = sorted(r for ranks in by_message.values() for r in ranks)
    each = " | ".join(f"{'rank' if len(ranks) == 1 else 'ranks'} {_ranks(ranks)}: {message}"
                      for message, ranks in by_message.items())
    return (f"{what}: refused on rank(s) {_ranks(refused)} (of {len(verdicts)}) before anything was "
            f"pinned: {each}")


def _ranks(ranks: Sequence[int]) -> str:
    # the kernel's cpulist form keeps 512 refusing ranks to '0-511'
    return format_cpulist(ranks).replace(",", ", ")


def _distributed():
    """torch.distributed when a process group of more than one rank is up, else None. Without torch
    imported no group can exist, so torch is not imported to ask."""
    if "torch" not in sys.modules:
        return None
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist
    return None
