"""Exceptions bridge_fgo raises. All derive from BridgeFGOError so one except clause catches them."""


class BridgeFGOError(RuntimeError):
    """The patch cannot apply, or offload was requested and cannot run (strict mode raises it)."""


class BridgeFGOConfigError(BridgeFGOError, ValueError):
    """A training configuration that optimizer-state offload cannot serve. The message names the
    field and the fix; it is raised before the first training step."""


class BridgeFGOOptionError(BridgeFGOError, ValueError):
    """A bad bridge_fgo option or BRIDGE_FGO_* environment value."""
