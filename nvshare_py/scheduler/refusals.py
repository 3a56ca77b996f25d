"""The connections a server refused for want of places (connections.ConnectionLimits), kept a
little while so that status can say whose processes wait for a connection and why: beyond its
user's or pod's places a client used to wait for ever without a word (issue 31). Bounded in
time and size, whatever refused peers do.
"""

from __future__ import annotations

import collections

# A principal's refusals are remembered for this long after its last one (a refused client
# connects again at least every second), for at most this many principals and processes of
# each.
REFUSED_MEMORY = 10.0
REFUSED_PRINCIPALS = 32
REFUSED_PIDS = 64

# Whom a refusal counts against: a uid and the Kubernetes pod ("" outside one), as in
# connections.py.
Principal = tuple[int | None, str]


class Refused:
    """A principal's connections refused for want of places: how many, when, why the last one
    was, and the processes (kernel-verified pids, 0: not visible) that tried, with when each
    last did."""

    __slots__ = ("uid", "pod_uid", "count", "first", "last", "reason", "pids")

    def __init__(self, principal: Principal, now: float) -> None:
        self.uid, self.pod_uid = principal
        self.count = 0
        self.first = self.last = now
        self.reason = ""
        self.pids: collections.OrderedDict[int, float] = collections.OrderedDict()


class Refusals:
    """The connections a server refused lately, by principal, so that status can say whose
    processes wait for a place and why (they used to wait without a word). Bounded: the
    principals and processes not refused for REFUSED_MEMORY seconds are forgotten, and at most
    REFUSED_PRINCIPALS principals of REFUSED_PIDS processes each are kept."""

    def __init__(self) -> None:
        self._by_principal: collections.OrderedDict[Principal, Refused] = collections.OrderedDict()

    def note(self, principal: Principal, pid: int, reason: str, now: float) -> None:
        entry = self._by_principal.pop(principal, None)
        if entry is None or entry.last + REFUSED_MEMORY < now:
            entry = Refused(principal, now)
        self._by_principal[principal] = entry  # the most recently refused last
        if len(self._by_principal) > REFUSED_PRINCIPALS:
            self._by_principal.popitem(last=False)
        entry.count += 1
        entry.last = now
        entry.reason = reason
        entry.pids.pop(pid, None)
        entry.pids[pid] = now
        if len(entry.pids) > REFUSED_PIDS:
            entry.pids.popitem(last=False)

    def current(self, now: float) -> list[Refused]:
        """The principals refused within REFUSED_MEMORY seconds, each with the processes that
        were, the most recently refused first."""
        since = now - REFUSED_MEMORY
        for principal in [p for p, entry in self._by_principal.items() if entry.last < since]:
            del self._by_principal[principal]
        for entry in self._by_principal.values():
            for pid in [pid for pid, last in entry.pids.items() if last < since]:
                del entry.pids[pid]
        return list(reversed(self._by_principal.values()))
