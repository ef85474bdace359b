"""bridge_fgo: make Megatron-Core's optimizer-state offload happen inside Megatron-Bridge training.

    import bridge_fgo
    bridge_fgo.patch()          # before or after Megatron-Bridge is imported

Importing this package imports neither torch nor Megatron.
"""
from .errors import BridgeFGOConfigError, BridgeFGOError, BridgeFGOOptionError
from .instrument.patcher import is_patched, patch, status, synchronize, unpatch
from .report import Report

__version__ = "0.1.0"
__all__ = [
    "patch", "unpatch", "status", "is_patched", "synchronize", "Report",
    "BridgeFGOError", "BridgeFGOConfigError", "BridgeFGOOptionError", "__version__",
]
