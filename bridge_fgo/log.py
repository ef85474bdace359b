"""The `bridge_fgo` logger, once-only messages, and the rank prefix for per-rank lines."""
from __future__ import annotations

import logging
import os
import sys
import threading

logger = logging.getLogger("bridge_fgo")


class _Filters(list):
    """The bridge_fgo logger's filters, less the one Megatron's setup_logging adds to every logger under
    Bridge's default cfg.logger.filter_warnings=True (megatron/training/utils/log_utils.py, warning_filter):
    it drops every WARNING, and ours say where offload does not act or a figure is off. A logger's level (or a
    filter of the user's own) still silences them."""

    def append(self, f) -> None:
        if getattr(f, "__name__", None) == "warning_filter" and str(getattr(f, "__module__", "")).startswith(
                "megatron."):
            return
        super().append(f)


logger.filters = _Filters(logger.filters)

_once_lock = threading.Lock()
_once_keys: set = set()


def rank() -> int:
    """This process's global rank: torch.distributed's when it is up, else the launcher's RANK."""
    dist = sys.modules.get("torch.distributed")  # never import torch just to ask
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except Exception:  # a half-initialised process group must not break logging
        pass
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def rank_prefix() -> str:
    return f"[rank {rank()}] "


def once(key, level: int, msg: str, *args) -> bool:
    """Log `msg` the first time `key` is seen in this process; True if it was logged."""
    with _once_lock:
        if key in _once_keys:
            return False
        _once_keys.add(key)
    logger.log(level, msg, *args)
    return True


def reset_once() -> None:
    """Forget once-only keys (unpatch, then patch again, says things again)."""
    with _once_lock:
        _once_keys.clear()
