"""What bridge_fgo did, or would do, and why: one object for status(), patch()'s return value,
`bridge-fgo status` and `bridge-fgo-run --check`."""
from __future__ import annotations

import dataclasses
import json
from typing import Dict, List, Optional

# outcome values
PENDING = "pending"  # hook registered; Bridge's train module not imported yet
PATCHED = "patched"
STEPPED_ASIDE = "stepped-aside"  # Bridge wires offload itself
NOT_PATCHED = "not-patched"  # unrecognised layout, or disabled
UNPATCHED = "unpatched"


@dataclasses.dataclass
class Report:
    patched: bool
    outcome: str
    mode: str
    strict: bool
    generation: Optional[str]
    versions: Dict[str, Optional[str]]
    targets: Dict[str, bool] = dataclasses.field(default_factory=dict)
    aliases: List[str] = dataclasses.field(default_factory=list)
    native_wiring: List[str] = dataclasses.field(default_factory=list)
    reason: Optional[str] = None
    verdict: Optional[str] = None
    sessions: List[Dict[str, object]] = dataclasses.field(default_factory=list)

    def to_dict(self) -> Dict[str, object]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def __str__(self) -> str:
        rows = [("patched", "yes" if self.patched else "no"), ("outcome", self.outcome), ("offload mode", self.mode),
                ("strict", "yes" if self.strict else "no")]
        rows += [(name, v or "not installed") for name, v in self.versions.items()]
        rows.append(("megatron-core offload", self.generation or "unknown (megatron-core not loaded)"))
        rows.append(("bridge wires offload itself", ", ".join(self.native_wiring) if self.native_wiring else "no"))
        rows += [(f"target {name}", "found" if ok else "MISSING") for name, ok in self.targets.items()]
        if self.aliases:
            rows.append(("aliases patched", ", ".join(self.aliases)))
        if self.reason:
            rows.append(("reason", self.reason))
        if self.verdict:
            rows.append(("verdict", self.verdict))
        for i, s in enumerate(self.sessions):
            rows.append((f"optimizer {i}", ", ".join(f"{k}={v}" for k, v in s.items())))
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)
