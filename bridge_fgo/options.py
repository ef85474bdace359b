"""bridge_fgo's options, defined once: each one's default, its values, its BRIDGE_FGO_* variable,
its command-line flag and its parsing all come from OPTIONS below.

The launcher turns each command-line option into its environment variable, so every rank that
torchrun or srun starts reads the same values here.
"""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Callable, List, Mapping, Optional, Tuple

from .envflags import ENV_PREFIX, FALSE, TRUE, env_name
from .errors import BridgeFGOOptionError

# auto: use Megatron-Core's own offloader when cfg.optimizer.offload_optimizer_states is set.
# builtin: bridge_fgo's own engine, on every run (no config flag needed).
# off: patch, but never offload (a baseline through the same code path).
OFFLOAD_MODES = ("auto", "builtin", "off")
# The builtin engine's window: how many MB of states it moves at a time (0 = all in one window).
# auto: the first step runs with FIRST_CHUNK_MB, then the window is sized from what that step measured
# (engine/sizing.py), never below FIRST_CHUNK_MB.
AUTO = "auto"
DEFAULT_CHUNK_MB = AUTO
FIRST_CHUNK_MB = 256

__all__ = ["ENV_PREFIX", "OFFLOAD_MODES", "AUTO", "DEFAULT_CHUNK_MB", "FIRST_CHUNK_MB", "Option", "OPTIONS",
           "Options", "env_name", "flag_name", "from_env", "known_env", "unknown_env", "how_to_set", "option",
           "first_chunk_mb"]


def first_chunk_mb(chunk_mb) -> int:
    """The window (MB) a chunk_mb value starts with: itself, or auto's first step's."""
    return FIRST_CHUNK_MB if chunk_mb == AUTO else chunk_mb


def flag_name(name: str) -> str:
    """`chunk_mb` -> `--chunk-mb`."""
    return "--" + name.replace("_", "-")


def _choice(opt: "Option", value, source: str):
    if value not in opt.choices:
        raise BridgeFGOOptionError(f"{source}={value!r} is not {opt.what}; allowed: {', '.join(opt.choices)}")
    return value


def _choice_text(opt: "Option", raw: str, source: str):
    return _choice(opt, raw.strip().lower(), source)


def _bool_text(opt: "Option", raw: str, source: str) -> bool:
    value = raw.strip().lower()
    if value in TRUE:
        return True
    if value in FALSE:
        return False
    raise BridgeFGOOptionError(
        f"{source}={raw!r} is not {opt.what}; allowed: {', '.join(TRUE)} or {', '.join(v or repr(v) for v in FALSE)}"
    )


def _chunk(opt: "Option", value, source: str):
    if value == AUTO:
        return AUTO
    # bool is an int to Python, and 1.0 would be silently truncated: only a true int is a size
    if type(value) is not int or value < 0:
        raise BridgeFGOOptionError(f"{source}={value!r} is not {opt.what}; allowed: {AUTO!r} (sized from the "
                                   "run), or an integer >= 0 (0 = one window)")
    return value


def _chunk_text(opt: "Option", raw: str, source: str):
    text = raw.strip()
    if text.lower() == AUTO:
        return AUTO
    value = int(text) if re.fullmatch(r"[+-]?[0-9]+", text) else raw
    return _chunk(opt, value, source)


def _gib(opt: "Option", value, source: str):
    if value is None:
        return None
    # bool is a number to Python; a budget is a size
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < float("inf")):
        raise BridgeFGOOptionError(f"{source}={value!r} is not {opt.what}; allowed: a number of GiB > 0 "
                                   "(unset: offload everything)")
    return float(value)


def _gib_text(opt: "Option", raw: str, source: str):
    text = raw.strip()
    value = float(text) if re.fullmatch(r"[0-9]*\.?[0-9]+(e[+-]?[0-9]+)?", text, re.I) else raw
    return _gib(opt, value, source)


def _as_is(opt: "Option", value, source: str):
    return value


@dataclasses.dataclass(frozen=True)
class Option:
    name: str  # patch()'s keyword and the Options field; the flag and the variable derive from it
    default: Any
    help: str  # for the command-line flag
    what: str  # "an offload mode": the value's kind, in error messages
    check: Callable  # (option, value from Python, source) -> value, or BridgeFGOOptionError
    parse: Callable  # (option, value from the environment or the command line, source) -> value
    choices: Tuple[str, ...] = ()
    metavar: Optional[str] = None
    is_flag: bool = False  # a command-line switch without a value; its variable is set to 1
    in_status: bool = True  # `bridge-fgo status` takes it to judge with

    @property
    def env(self) -> str:
        return env_name(self.name)

    @property
    def flag(self) -> str:
        return flag_name(self.name)

    def to_env(self, value) -> str:
        return "1" if self.is_flag else str(value)


OPTIONS: Tuple[Option, ...] = (
    Option("offload", "auto", what="an offload mode", check=_choice, parse=_choice_text, choices=OFFLOAD_MODES,
           help="auto: Megatron-Core's own offloader when cfg.optimizer.offload_optimizer_states is "
                "set; builtin: bridge_fgo's engine on every run; off: patch, never offload"),
    Option("strict", False, what="a boolean", check=_as_is, parse=_bool_text, is_flag=True,
           help="an unrecognised layout, or offload requested but impossible, stops the run with an error "
                "instead of a warning"),
    Option("disable", False, what="a boolean", check=_as_is, parse=_bool_text, is_flag=True, in_status=False,
           help="patch nothing (escape hatch); the command still runs"),
    Option("chunk_mb", DEFAULT_CHUNK_MB, what="a window size in MB", check=_chunk, parse=_chunk_text, metavar="N",
           help=f"the builtin engine's window: MB of optimizer states moved at a time (0 = one window); auto: "
                f"{FIRST_CHUNK_MB} for the first step, then as large as the memory that step measured allows "
                "without raising the run's peak"),
    Option("gpu_budget_gib", None, what="a GPU memory budget", check=_gib, parse=_gib_text, metavar="GIB",
           help="the builtin engine keeps as many parameters' optimizer states on the GPU as fit under this "
                "peak (GiB, per rank, planned from the run's allocated peak through the first step) and streams "
                "only the rest; unset: everything is offloaded. Needs the streamed step (chunk_mb auto or > 0)"),
)
_BY_NAME = {o.name: o for o in OPTIONS}


def option(name: str) -> Option:
    return _BY_NAME[name]


def _validate(self) -> None:
    for opt in OPTIONS:
        opt.check(opt, getattr(self, opt.name), opt.name)
    if self.gpu_budget_gib is not None and self.chunk_mb == 0:
        raise BridgeFGOOptionError(f"gpu_budget_gib={self.gpu_budget_gib!r} needs the streamed step: chunk_mb=0 "
                                   "(one window) brings every state back for the optimizer step; drop the budget "
                                   f"or set chunk_mb to {AUTO!r} (the default) or > 0")


Options = dataclasses.make_dataclass(
    "Options", [(o.name, Any, dataclasses.field(default=o.default)) for o in OPTIONS],
    frozen=True, namespace={"__post_init__": _validate, "__module__": __name__,
                            "__doc__": "One value per option in OPTIONS; invalid values raise BridgeFGOOptionError."},
)


def from_env(env: Optional[Mapping[str, str]] = None, **overrides) -> "Options":
    """Options from BRIDGE_FGO_* variables; explicit keyword values (not None) win."""
    env = os.environ if env is None else env
    values = {}
    for opt in OPTIONS:
        raw = env.get(opt.env)
        if raw is not None:
            values[opt.name] = opt.parse(opt, raw, opt.env)
    for key, value in overrides.items():
        if value is not None:
            values[key] = value
    return Options(**values)


def how_to_set(name: str, value) -> str:
    """The three ways to set an option, for messages that name the fix."""
    opt = option(name)
    shown = "1" if opt.is_flag else value
    flag = opt.flag if opt.is_flag else f"{opt.flag} {value}"
    return f"bridge_fgo.patch({name}={value!r}), {opt.env}={shown}, or bridge-fgo-run {flag}"


def known_env() -> Tuple[str, ...]:
    """Every BRIDGE_FGO_* variable an option reads."""
    return tuple(o.env for o in OPTIONS)


def unknown_env(env: Optional[Mapping[str, str]] = None) -> List[str]:
    """BRIDGE_FGO_* variables no option reads: a misspelt one would otherwise be ignored in silence."""
    env = os.environ if env is None else env
    known = known_env()
    return sorted(k for k in env if k.startswith(ENV_PREFIX) and k not in known)
