"""The BRIDGE_FGO_* names and the words a boolean variable accepts: shared by bridge_fgo.options
and the bootstrap (bootstrap/sitecustomize.py), which must read BRIDGE_FGO_STRICT and BRIDGE_FGO_DISABLE even in a Python
that cannot import bridge_fgo (it loads this file by its path).

Kept to plain syntax and the standard library, like the bootstrap.
"""

ENV_PREFIX = "BRIDGE_FGO_"
TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off", "")


def env_name(option):
    """`offload` -> `BRIDGE_FGO_OFFLOAD`."""
    return ENV_PREFIX + option.upper().replace("-", "_")


def is_set(env, option):
    """Whether a boolean option's variable says yes (a malformed value is not a yes)."""
    return (env.get(env_name(option)) or "").strip().lower() in TRUE
