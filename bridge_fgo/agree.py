"""Placeholder until the hostmem branch lands (a collective verdict)."""
from typing import Optional

from .errors import BridgeFGOConfigError


def agree(problem: Optional[str], what: str) -> None:
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        verdicts = [None] * dist.get_world_size()
        dist.all_gather_object(verdicts, problem)
        bad = [(r, v) for r, v in enumerate(verdicts) if v]
        if bad:
            raise BridgeFGOConfigError(f"{what}: refused on rank(s) {', '.join(str(r) for r, _ in bad)}: "
                                       + "; ".join(f"rank {r}: {v}" for r, v in bad))
        return
    if problem:
        raise BridgeFGOConfigError(problem)
