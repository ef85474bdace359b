"""What bridge_fgo did, or would do, and why: one object for status(), patch()'s return value,
`bridge-fgo status` and `bridge-fgo-run --check`."""
from __future__ import annotations

import dataclasses
import json
import textwrap
from typing import Dict, List, Optional, Union

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
    chunk_mb: Union[int, str, None] = None  # the builtin engine's window: MB, or "auto" (the default)
    gpu_budget_gib: Optional[float] = None  # the builtin engine's GPU budget (None: offload everything)
    host_memory: Optional[str] = None  # what the builtin engine may pin on this node (diagnose only)
    inner_optimizer: Optional[str] = None  # the Adam class Megatron-Core builds here (diagnose only)
    targets: Dict[str, bool] = dataclasses.field(default_factory=dict)
    aliases: List[str] = dataclasses.field(default_factory=list)
    native_wiring: List[str] = dataclasses.field(default_factory=list)
    reason: Optional[str] = None
    verdict: Optional[str] = None
    sessions: List[Dict[str, object]] = dataclasses.field(default_factory=list)
    # Filled by diagnose() (bridge-fgo status, bridge-fgo-run --check); status() leaves the defaults.
    predicted: bool = False  # outcome/reason say what patch() would do here, not what this process did
    offload_ready: Optional[bool] = None  # the verdict as a yes/no: offload will run in this mode
    generation_meaning: Optional[str] = None
    target_notes: Dict[str, str] = dataclasses.field(default_factory=dict)  # why a target would not patch
    problems: List[str] = dataclasses.field(default_factory=list)  # everything that stops the patch
    executable: Optional[str] = None  # the Python that was inspected

    def to_dict(self) -> Dict[str, object]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def __str__(self) -> str:
        patched = "yes" if self.patched else "no"
        if self.predicted and not self.patched:
            patched += " (this process only inspects)"
        outcome = f"{self.outcome} (what patch() would do here)" if self.predicted else self.outcome
        rows = [("patched", patched), ("outcome", outcome), ("offload mode", self.mode),
                ("strict", "yes" if self.strict else "no")]
        if self.chunk_mb is not None:
            rows.append(("builtin engine window", "0 (one window)" if not self.chunk_mb else
                         self.chunk_mb if isinstance(self.chunk_mb, str) else f"{self.chunk_mb} MB"))
            rows.append(("builtin engine GPU budget", f"{self.gpu_budget_gib:g} GiB" if self.gpu_budget_gib
                         else "none (everything offloaded)"))
        if self.host_memory:
            rows.append(("host memory", self.host_memory))
        if self.inner_optimizer:
            rows.append(("inner optimizer", self.inner_optimizer))
        if self.executable:
            rows.append(("python executable", self.executable))
        rows += [(name, v or "not installed") for name, v in self.versions.items()]
        generation = self.generation or "unknown (megatron-core not loaded)"
        if self.generation_meaning:
            generation = f"{self.generation or 'unknown'}: {self.generation_meaning}"
        rows.append(("megatron-core offload", generation))
        rows.append(("bridge wires offload itself", ", ".join(self.native_wiring) if self.native_wiring else "no"))
        for name, ok in self.targets.items():
            note = self.target_notes.get(name)
            rows.append((f"target {name}", (note if ok else f"MISSING: {note}") if note else
                         ("found" if ok else "MISSING")))
        if self.aliases:
            rows.append(("aliases it would patch" if self.predicted else "aliases patched", ", ".join(self.aliases)))
        if self.reason:
            rows.append(("reason", self.reason))
        if self.verdict:
            rows.append(("verdict", self.verdict))
        for i, s in enumerate(self.sessions):
            rows.append((f"optimizer {i}", ", ".join(f"{k}={v}" for k, v in s.items())))
        width = max(len(k) for k, _ in rows)
        # long values wrap under their column, so the table stays readable in a terminal
        return "\n".join(
            textwrap.fill(str(v) or "-", width=max(120, width + 50), initial_indent=f"{k.ljust(width)}  ",
                          subsequent_indent=" " * (width + 2), break_on_hyphens=False, break_long_words=False)
            for k, v in rows
        )
