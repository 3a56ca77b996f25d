"""The lock timeline the daemon keeps for `events` requests (docs/protocol.md, "Events"): the
last protocol.CONTROL_EVENTS_MAX entries, served in pages.

Sans-I/O. Why it is shaped so: a flood makes thousands of entries a second, and a follower
(`nvsharectl events --follow`, a monitoring script) asks for all of them. An answer is made in
one step of the daemon, which stalls every other client while it runs, so

- each entry is encoded as JSON once, when it is recorded (in the step of whoever caused it),
  and an answer is a join of encoded entries, not an encoding of thousands of objects;
- an answer holds at most PAGE_BYTES of entries, however many were asked for, and says
  `"more": true` when entries after it are stored already: the asker comes back for them (the
  paging helpers in nvshare_py/control.py do), and other clients are served in between.
"""

from __future__ import annotations

import collections
import itertools
import json
from dataclasses import dataclass

from .. import protocol

# The entries of one answer, at most (a page has one entry at least, whatever its size). About
# 700 entries of a flood's registrations; joined and sent in well under a millisecond.
PAGE_BYTES = 128 * 1024

_ENCODER = json.JSONEncoder(separators=(",", ":"))


@dataclass(frozen=True)
class Page:
    """Entries from `since` on (each one's JSON text), `next` the sequence number to ask from
    next, `more` whether entries from `next` on are stored already."""

    entries: list[str]
    next: int
    more: bool

    def json(self) -> str:
        """The `events` answer's result as JSON text: {"events": [...], "next": n, "more": b}."""
        return (f'{{"events":[{",".join(self.entries)}],"next":{self.next},'
                f'"more":{"true" if self.more else "false"}}}')


class EventRing:
    """The last `keep` lock events, numbered from 1 in the order they were recorded."""

    def __init__(self, keep: int = protocol.CONTROL_EVENTS_MAX, page_bytes: int = PAGE_BYTES) -> None:
        self._entries: collections.deque[str] = collections.deque(maxlen=keep)
        self.page_bytes = page_bytes
        self.next_seq = 1

    def record(self, t: float, device: str, client: str, kind: str, grant: int, detail: str) -> None:
        """One entry; `t` is wall-clock time (Unix seconds)."""
        self._entries.append(_ENCODER.encode({"seq": self.next_seq, "t": t, "device": device, "client": client,
                                              "kind": kind, "grant": grant, "detail": detail}))
        self.next_seq += 1

    def page(self, since: int, limit: int) -> Page:
        """At most `limit` entries with `seq >= since`, and at most `page_bytes` of them but one
        entry at least. Entries older than the ring's first are gone: the page starts at the first
        kept."""
        first = self.next_seq - len(self._entries)
        start = max(since, first) - first
        chosen: list[str] = []
        size = 1  # the array's brackets, less the comma its last entry does not need
        for entry in itertools.islice(self._entries, start, start + limit):
            size += len(entry) + 1
            if chosen and size > self.page_bytes:
                break
            chosen.append(entry)
        following = first + start + len(chosen) if chosen else max(since, first)
        return Page(chosen, following, following < self.next_seq)
