"""The daemon's log lines: one operator-readable line per event, `key=value` fields after the
words (docs/scheduler.md, *Logs*), and the rate limits on lines that a peer can provoke."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

log = logging.getLogger("nvshare.scheduler")

# The lock core names its levels (events.Log.level); these are the logging module's.
LOG_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}


def format_fields(fields: dict[str, Any]) -> str:
    """`key=value` pairs; values with spaces, quotes or '=' are JSON-quoted."""
    parts = []
    for key, value in fields.items():
        text = str(value)
        if not text or any(c in text for c in ' "=\n\t'):
            text = json.dumps(text)
        parts.append(f"{key}={text}")
    return " ".join(parts)


def emit(level: int, text: str, **fields: Any) -> None:
    """One operator-readable log line: the event, then its fields."""
    if not log.isEnabledFor(level):
        return
    if fields:
        log.log(level, "%s %s", text, format_fields(fields))
    else:
        log.log(level, "%s", text)


class RateLimit:
    """A token bucket for log lines that a peer can provoke: at most `burst` lines at once,
    `rate` per second after that. It counts what it suppressed so the next line can say so."""

    def __init__(self, rate: float = 2.0, burst: float = 20.0) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.stamp = time.monotonic()
        self.suppressed = 0

    def take(self) -> int | None:
        """None: stay silent. Otherwise the number of lines suppressed since the last one."""
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens < 1.0:
            self.suppressed += 1
            return None
        self.tokens -= 1.0
        suppressed, self.suppressed = self.suppressed, 0
        return suppressed


def note(text: str, limit: RateLimit, level: int = logging.INFO, **fields: Any) -> None:
    """A log line that a peer can provoke at will: rate-limited by `limit`."""
    suppressed = limit.take()
    if suppressed is not None:
        emit(level, text, **fields, suppressed=suppressed)
