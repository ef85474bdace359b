"""Units and file reading shared by the host-memory modules. Every /proc and /sys path is read below
`root` (default "/") so tests can fake the trees."""
from __future__ import annotations

import os
from typing import Optional

GiB = 2**30


def fmt_bytes(n: int) -> str:
    """'12.00 GiB (12884901888 bytes)': readable and exact."""
    return f"{n / GiB:.2f} GiB ({n} bytes)"


def under(root: Optional[str], *parts: str) -> str:
    """`parts` (absolute or not) below `root`."""
    return os.path.join(root or "/", *(p.lstrip("/") for p in parts))


def read(path: str) -> Optional[str]:
    """The file's text, or None when it cannot be read: a missing or unreadable file means 'unknown'."""
    try:
        with open(path) as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None
