"""Admission: waiting instead of out-of-memory (sans-I/O; docs/scheduler.md, "Admission").

Converted (managed) memory that does not fit the devices lives in host RAM, which is finite.
The scheduler keeps the memory its clients may hold within the node's *capacity*: the sum of
the devices' budgets plus an allowed host *spill*. A client asks before its total on a device
crosses what it was admitted (ADMIT); the answer is ADMITTED once the new total fits, REFUSED
`too-large` at once when it could never fit (more than the whole capacity), REFUSED `timeout`
when it waited longer than the configured timeout.

Words used below:
- a pair's *reservation* is what the capacity counts for it: the larger of its admitted total
  (ADMITTED, lowered by the client's own give-back) and its last reported use (MEMORY), since
  memory allocated before the client registered, or before admission was on, is real too;
- a *waiter* is a pair with an unanswered ADMIT; one per pair (a client asks again only after
  an answer).

This module decides; nvshare_py/scheduler/core.py owns the pairs and turns the decisions into
messages, timeline events and log lines. Nothing here reads a clock or touches a socket.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Hashable

from ..vocabulary import ADMISSION_POLICY

POLICIES = ADMISSION_POLICY.words

# Chunks (see headroom): an allocation-heavy program pays one round trip per chunk, not per
# allocation (a round trip cost 2.6 ms median on a loaded 2-core machine, an allocation within
# the chunk nothing measurable: benchmarks/results/admission-2026-11-23.json). 64 MiB is a
# small part of any host and covers PyTorch's cached blocks (2 MiB small, 20 MiB large
# segments); a quarter of the total makes the number of round trips grow with log(total) once
# totals are past 256 MiB (each grant is 1.25 times the last): 10 GiB in 1 MiB pieces asks
# 21 times.
CHUNK_MIN = 64 << 20
CHUNK_FRACTION = 4
# The daemon's default spill: this fraction of the host's MemAvailable at start (the rest is
# left to the processes' own host memory, page cache and the daemon).
DEFAULT_SPILL_FRACTION = 0.5
DEFAULT_TIMEOUT = 300.0


def headroom(total: int) -> int:
    """Extra bytes granted above an asked `total` while nobody else waits. The client gives
    admission back once its admitted total is more than this above its use, down to half of
    this above it: a use that then moves by less than half a chunk either way neither asks nor
    gives back again (interceptor/client_core.c, run_admission)."""
    return max(CHUNK_MIN, total // CHUNK_FRACTION)


@dataclass(frozen=True)
class AdmissionConfig:
    """`spill`: host bytes allowed beyond the devices' budgets (None: admission off, every ADMIT
    is answered at once with what was asked). `timeout`: seconds a waiter waits before REFUSED
    timeout. `seed`: of the random policy's choices, so that runs are reproducible."""

    spill: int | None = None
    policy: str = "fifo"
    timeout: float = DEFAULT_TIMEOUT
    seed: int = 0

    def __post_init__(self) -> None:
        check(self.spill, self.policy, self.timeout)

    @property
    def enabled(self) -> bool:
        return self.spill is not None


def check(spill: object, policy: object, timeout: object) -> None:
    """ValueError naming what is wrong with a setting."""
    if spill is not None and (isinstance(spill, bool) or not isinstance(spill, int) or spill < 0):
        raise ValueError(f"spill must be a number of bytes >= 0 or null, not {spill!r}")
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, not {policy!r}")
    if (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout)
            or timeout <= 0):
        raise ValueError(f"timeout must be a positive number of seconds, not {timeout!r}")


class Waiter:
    """One unanswered ADMIT: the pair wants its total to reach `bytes` (`request` is the
    client's number for the question, echoed in the answer)."""

    __slots__ = ("pair", "request", "bytes", "since", "order")

    def __init__(self, pair: Hashable, request: int, total: int, since: float, order: int) -> None:
        self.pair = pair
        self.request = request
        self.bytes = total
        self.since = since
        self.order = order


@dataclass(frozen=True)
class Admit:
    waiter: Waiter
    total: int  # the admitted total to tell the client (>= waiter.bytes)


@dataclass(frozen=True)
class Refuse:
    waiter: Waiter
    reason: str


Decision = Admit | Refuse


class AdmissionBook:
    """Admitted totals and waiters of every pair. `used(pair)` must give the pair's last
    reported use; the caller says when it changes by calling `settle`."""

    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        self._admitted: dict[Hashable, int] = {}
        self.waiters: dict[Hashable, Waiter] = {}  # arrival order
        self._orders = 0
        self._random = random.Random(config.seed)

    # --- what the core asks --------------------------------------------------------------

    def admitted(self, pair: Hashable) -> int:
        return self._admitted.get(pair, 0)

    def reserved(self, used: dict[Hashable, int]) -> int:
        """The sum of every pair's reservation; `used` maps each known pair to its use."""
        pairs = set(used) | set(self._admitted)
        return sum(max(self._admitted.get(pair, 0), used.get(pair, 0)) for pair in pairs)

    def next_deadline(self) -> float | None:
        if not self.waiters or not self.config.enabled:
            return None
        return min(waiter.since for waiter in self.waiters.values()) + self.config.timeout

    # --- changes -------------------------------------------------------------------------

    def reconfigure(self, config: AdmissionConfig) -> None:
        self.config = config
        self._random = random.Random(config.seed)

    def ask(self, pair: Hashable, request: int, total: int, now: float) -> Waiter | None:
        """An ADMIT. A total at or below the admitted one gives admission back (request 0, no
        answer: None). Otherwise the pair waits (a second question replaces the first)."""
        if total <= self.admitted(pair) and request == 0:
            self._set(pair, total)
            return None
        self._orders += 1
        waiter = Waiter(pair, request, total, now, self._orders)
        self.waiters.pop(pair, None)
        self.waiters[pair] = waiter
        return waiter

    def forget(self, pair: Hashable) -> None:
        """The pair is gone (its client left): its reservation and question with it."""
        self._admitted.pop(pair, None)
        self.waiters.pop(pair, None)

    def reset(self, pair: Hashable) -> None:
        """A new registration took the pair over: the client starts again from nothing
        admitted (its use still counts) and asks its question again if it still waits; an
        answer to the old connection's question would admit what the new one never learns."""
        self._admitted.pop(pair, None)
        self.waiters.pop(pair, None)

    def settle(self, capacity: int, used: dict[Hashable, int], now: float) -> list[Decision]:
        """Answer what can be answered: timeouts, waiters that can never fit, and waiters that
        fit now, in the policy's order. `used` maps every known pair to its reported use."""
        out: list[Decision] = []
        config = self.config
        if not config.enabled:
            for waiter in list(self.waiters.values()):
                out.append(self._admit(waiter, waiter.bytes + headroom(waiter.bytes)))
            return out
        for waiter in list(self.waiters.values()):
            if waiter.bytes > capacity:
                del self.waiters[waiter.pair]
                out.append(Refuse(waiter, "too-large"))
            elif now >= waiter.since + config.timeout:
                del self.waiters[waiter.pair]
                out.append(Refuse(waiter, "timeout"))
        while self.waiters:
            free = capacity - self.reserved(used)
            waiter = self._choose(free, used)
            if waiter is None:
                break
            need = waiter.bytes - max(self.admitted(waiter.pair), used.get(waiter.pair, 0))
            if need > 0 and need > free:
                break  # the chosen one holds the line: nobody overtakes it
            # Generous only when nobody else waits (a chunk taken from a waiter would make it
            # wait for memory that nobody uses), and with at most half of what stays free: the
            # last of the capacity is never all promised to one client ahead of its use.
            extra = 0 if len(self.waiters) > 1 else min(headroom(waiter.bytes), max(0, free - need) // 2)
            out.append(self._admit(waiter, waiter.bytes + extra))
        return out

    # --- rules ---------------------------------------------------------------------------

    def _choose(self, free: int, used: dict[Hashable, int]) -> Waiter | None:
        """The next waiter the policy serves (it may not fit yet), None when none may go."""
        waiters = list(self.waiters.values())
        policy = self.config.policy
        if policy == "fifo":
            return waiters[0]
        if policy == "recent":
            return waiters[-1]
        if policy == "random":
            return self._random.choice(waiters)
        # best-fit (ConVGPU): the waiter whose need comes closest to the free memory without
        # passing it; when none fits, the one that needs least (it is served first).
        def need(waiter: Waiter) -> int:
            return waiter.bytes - max(self.admitted(waiter.pair), used.get(waiter.pair, 0))
        fitting = [waiter for waiter in waiters if need(waiter) <= free]
        if fitting:
            return max(fitting, key=lambda waiter: (need(waiter), -waiter.order))
        return min(waiters, key=lambda waiter: (need(waiter), waiter.order))

    def _admit(self, waiter: Waiter, total: int) -> Admit:
        del self.waiters[waiter.pair]
        self._set(waiter.pair, total)
        return Admit(waiter, total)

    def _set(self, pair: Hashable, total: int) -> None:
        if total:
            self._admitted[pair] = total
        else:
            self._admitted.pop(pair, None)
