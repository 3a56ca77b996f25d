"""Sizes in bytes as people write them: one grammar for nvsharectl, the device plugin's
annotations and (in C, interceptor/config.c) NVSHARE_MEMORY_LIMIT."""

from __future__ import annotations

import re
from fractions import Fraction

from .protocol import MAX_INT

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgtp]?)(?:i?b)?\s*\Z", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from '8G', '512M', '1.5GiB', '1048576' (binary units: 1K = 1024 bytes)."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"{text!r} is not a size (examples: 8G, 512M, 1.5GiB, 1048576)")
    # Exact arithmetic: a float would round large byte counts and overflow on absurd ones.
    size = int(Fraction(match.group(1)) * _UNITS[match.group(2).lower()])
    if not 0 < size <= MAX_INT:
        raise ValueError(f"the size must be greater than 0 and at most {MAX_INT} bytes")
    return size


def format_size(size: int) -> str:
    """Bytes as people read them, in the binary units parse_size takes: '512 B', '1.5 KiB',
    '16.0 GiB' (one decimal: every view shows sizes so)."""
    for unit, scale in (("PiB", 1 << 50), ("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(size) >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"
