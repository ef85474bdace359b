"""bridge_fgo's options and their BRIDGE_FGO_* environment variables.

The launcher turns each command-line option into its environment variable, so every rank that
torchrun or srun starts reads the same values here.
"""
from __future__ import annotations

import dataclasses
import os
from typing import List, Mapping, Optional, Tuple

from .errors import BridgeFGOOptionError

ENV_PREFIX = "BRIDGE_FGO_"

# auto: use Megatron-Core's own offloader when cfg.optimizer.offload_optimizer_states is set.
# builtin: bridge_fgo's own engine, on every run (no config flag needed).
# off: patch, but never offload (a baseline through the same code path).
OFFLOAD_MODES = ("auto", "builtin", "off")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def env_name(option: str) -> str:
    """`offload` -> `BRIDGE_FGO_OFFLOAD`."""
    return ENV_PREFIX + option.upper().replace("-", "_")


@dataclasses.dataclass(frozen=True)
class Options:
    offload: str = "auto"
    strict: bool = False
    disable: bool = False

    def __post_init__(self):
        check_offload(self.offload, source="offload")


def check_offload(value, source: str) -> str:
    if value not in OFFLOAD_MODES:
        raise BridgeFGOOptionError(
            f"{source}={value!r} is not an offload mode; allowed: {', '.join(OFFLOAD_MODES)}"
        )
    return value


def _env_bool(env: Mapping[str, str], option: str) -> Optional[bool]:
    name = env_name(option)
    raw = env.get(name)
    if raw is None:
        return None
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise BridgeFGOOptionError(
        f"{name}={raw!r} is not a boolean; allowed: {', '.join(_TRUE)} or {', '.join(v or repr(v) for v in _FALSE)}"
    )


def from_env(env: Optional[Mapping[str, str]] = None, **overrides) -> Options:
    """Options from BRIDGE_FGO_* variables; explicit keyword values (not None) win."""
    env = os.environ if env is None else env
    values = {}
    raw_offload = env.get(env_name("offload"))
    if raw_offload is not None:
        values["offload"] = check_offload(raw_offload.strip().lower(), source=env_name("offload"))
    for flag in ("strict", "disable"):
        parsed = _env_bool(env, flag)
        if parsed is not None:
            values[flag] = parsed
    for key, value in overrides.items():
        if value is not None:
            values[key] = value
    return Options(**values)


def known_env() -> Tuple[str, ...]:
    """Every BRIDGE_FGO_* variable an option reads."""
    return tuple(env_name(f.name) for f in dataclasses.fields(Options))


def unknown_env(env: Optional[Mapping[str, str]] = None) -> List[str]:
    """BRIDGE_FGO_* variables no option reads: a misspelt one would otherwise be ignored in silence."""
    env = os.environ if env is None else env
    known = known_env()
    return sorted(k for k in env if k.startswith(ENV_PREFIX) and k not in known)
