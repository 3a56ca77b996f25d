"""Admission: waiting instead of out-of-memory (sans-I/O; docs/scheduler.md, "Admission").

Converted (managed) memory that does not fit the devices lives in host RAM, which is finite.
The scheduler keeps the memory its clients may hold within the node's *capacity*: the sum of
the devices' budgets (the daemon's own measurements, or the operator's settings) plus an
allowed host *spill*. A client asks before its total on a device crosses what it was admitted
(ADMIT); the answer is ADMITTED once the new total fits, REFUSED `too-large` at once when it
could never fit (more than the whole capacity), `limit` when it is more than its user may ever
hold (the share below), `timeout` when it waited longer than the configured timeout.

Words used below:
- a pair's *reservation* is what the capacity counts for it: the larger of its admitted total
  (ADMITTED, lowered by the client's own give-back) and its last reported use (MEMORY, which
  the core bounds by the device's size, and counts as 0 on a device nobody sized), since memory allocated before the client registered,
  or before admission was on, is real too;
- a *principal* is whoever a limit on reservations is for: a Kubernetes pod (its verified UID),
  else a user (the kernel-verified uid); the core says which (records.Client.principal). Its
  *holding* is the sum of its pairs' reservations;
- a principal's *quota* is `share` of the capacity: the most it may hold. What a principal
  holds beyond it (use it reported, e.g. allocated before it registered) is not counted, so
  that no one user's claims, true or not, can take more of the capacity than that;
- a *waiter* is a pair with an unanswered ADMIT; one per pair (a client asks again only after
  an answer).

Jams: a waiter that does not fit *holds the line* (nobody overtakes it, so a large question is
not starved by small ones), but only against its own principal's waiters and those whose
principal would then hold at least as much as its own would: a user who asks for more than
the free memory cannot keep others, who hold less, from the memory they ask for. A waiter that
would take its principal past the quota waits for its own principal's frees and holds no line.

Cost: every total is kept incrementally (a report or an answer changes a few sums, whatever
the number of pairs), and the queue is only looked at when something could be admitted now
(memory freed, capacity grew, a new question) or a deadline passed.

This module decides; the core owns the pairs, and its admitting.py turns the decisions into
messages, timeline events and log lines. Nothing here reads a clock or touches a socket.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass
from typing import Generic, Hashable, TypeVar

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
# The default quota of one principal (user or pod): three quarters of the capacity, as for
# connections (docs/scheduler.md): one user alone can use most of the node, and whatever one
# user claims, a quarter stays for everyone else. 1 lifts the bound.
DEFAULT_SHARE = 0.75

Pair = TypeVar("Pair", bound=Hashable)  # the core's (client, device) pair
Principal = Hashable


def headroom(total: int) -> int:
    """Extra bytes granted above an asked `total` while nobody else waits. The client gives
    admission back once its admitted total has been more than this above its use for a while,
    down to half of this above it: a use that then moves by less than half a chunk either way
    neither asks nor gives back again (interceptor/client_core.c, run_admission)."""
    return max(CHUNK_MIN, total // CHUNK_FRACTION)


@dataclass(frozen=True)
class AdmissionConfig:
    """`spill`: host bytes allowed beyond the devices' budgets (None: admission off, every ADMIT
    is answered at once with what was asked). `timeout`: seconds a waiter waits before REFUSED
    timeout. `share`: the part of the capacity one principal may hold (0 < share <= 1).
    `seed`: of the random policy's choices, so that runs are reproducible."""

    spill: int | None = None
    policy: str = "fifo"
    timeout: float = DEFAULT_TIMEOUT
    share: float = DEFAULT_SHARE
    seed: int = 0

    def __post_init__(self) -> None:
        check(self.spill, self.policy, self.timeout, self.share)

    @property
    def enabled(self) -> bool:
        return self.spill is not None


def check(spill: object, policy: object, timeout: object, share: object = DEFAULT_SHARE) -> None:
    """ValueError naming what is wrong with a setting."""
    if spill is not None and (isinstance(spill, bool) or not isinstance(spill, int) or spill < 0):
        raise ValueError(f"spill must be a number of bytes >= 0 or null, not {spill!r}")
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, not {policy!r}")
    if (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout)
            or timeout <= 0):
        raise ValueError(f"timeout must be a positive number of seconds, not {timeout!r}")
    if (isinstance(share, bool) or not isinstance(share, (int, float)) or not math.isfinite(share)
            or not 0 < share <= 1):
        raise ValueError(f"share must be a fraction of the capacity above 0 and at most 1, not {share!r}")


class Waiter(Generic[Pair]):
    """One unanswered ADMIT: the pair wants its total to reach `bytes` (`request` is the
    client's number for the question, echoed in the answer)."""

    __slots__ = ("pair", "request", "bytes", "since", "order")

    def __init__(self, pair: Pair, request: int, total: int, since: float, order: int) -> None:
        self.pair = pair
        self.request = request
        self.bytes = total
        self.since = since
        self.order = order


@dataclass(frozen=True)
class Admit(Generic[Pair]):
    waiter: Waiter[Pair]
    total: int  # the admitted total to tell the client (>= waiter.bytes)


@dataclass(frozen=True)
class Refuse(Generic[Pair]):
    waiter: Waiter[Pair]
    reason: str


Decision = Admit[Pair] | Refuse[Pair]


class AdmissionBook(Generic[Pair]):
    """Admitted totals, reported uses, holdings and waiters of every pair. The core tells it
    each pair's principal with every report and question, and the capacity when it changes."""

    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        self._admitted: dict[Pair, int] = {}
        self._used: dict[Pair, int] = {}
        self._principal: dict[Pair, Principal] = {}
        self._holding: dict[Principal, int] = {}
        self._capacity = 0
        self._quota = 0
        self._reserved = 0  # sum over principals of min(holding, quota)
        self.waiters: dict[Pair, Waiter[Pair]] = {}  # arrival order, so also order of `since`
        self._queues: dict[Principal, dict[Pair, Waiter[Pair]]] = {}  # the same, by principal
        self._orders = 0
        self._random = random.Random(config.seed)
        # Something happened that may let a waiter in or change who holds the line (memory freed,
        # capacity changed, a waiter left, new settings): settle walks the queue only then. New
        # questions since the last walk (`_fresh`) come after every waiter under fifo: they are
        # weighed alone against the line the walk found (`_line`, `_blocking`). A walk under fifo
        # visits each principal's first waiter (and the next only after an answer), so it costs
        # in the number of users waiting, not of questions.
        self._changed = False
        self._fresh: list[Waiter[Pair]] = []
        self._line: int | None = None
        self._blocking: set[Principal] = set()
        self._line_holders: set[Pair] = set()  # the waiters that set the two above
        # Memory was freed since the last walk; it lets someone in only once the free memory
        # reaches the least any waiter still needs (`_least_need`, from the walk): a stream of
        # small frees then costs no walk each (a principal blocked by its quota walks at once).
        self._freed = False
        self._least_need = 0

    # --- what the core asks --------------------------------------------------------------

    def admitted(self, pair: Pair) -> int:
        return self._admitted.get(pair, 0)

    def reservation(self, pair: Pair) -> int:
        return max(self._admitted.get(pair, 0), self._used.get(pair, 0))

    def holding(self, principal: Principal) -> int:
        return self._holding.get(principal, 0)

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def quota(self) -> int:
        return self._quota

    @property
    def reserved(self) -> int:
        """What the capacity counts as taken: every principal's holding, up to its quota."""
        return self._reserved

    def next_deadline(self) -> float | None:
        if not self.waiters or not self.config.enabled:
            return None
        return next(iter(self.waiters.values())).since + self.config.timeout

    # --- changes -------------------------------------------------------------------------

    def reconfigure(self, config: AdmissionConfig) -> None:
        self.config = config
        self._random = random.Random(config.seed)
        self._set_quota()
        self._changed = True

    def set_capacity(self, capacity: int) -> None:
        if capacity == self._capacity:
            return
        self._capacity = capacity
        self._set_quota()
        self._changed = True

    def report(self, pair: Pair, principal: Principal, used: int) -> None:
        """The pair's use (MEMORY, already bounded by the device's size)."""
        self._update(pair, principal, used=used)

    def ask(self, pair: Pair, principal: Principal, request: int, total: int, now: float) -> Waiter[Pair] | None:
        """An ADMIT. Request 0 gives admission back down to `total` (no answer: None).
        Otherwise the pair waits (a second question replaces the first) until settle answers."""
        if request == 0:
            self._update(pair, principal, admitted=min(total, self.admitted(pair)))
            return None
        self._leave(pair)
        self._principal[pair] = principal
        self._orders += 1
        waiter = Waiter(pair, request, total, now, self._orders)
        self.waiters[pair] = waiter
        self._queues.setdefault(principal, {})[pair] = waiter
        if self.config.policy != "fifo":
            self._changed = True  # the new question's place is not simply last
        else:
            self._fresh.append(waiter)
        return waiter

    def _leave(self, pair: Pair) -> None:
        """The pair's question is gone (answered elsewhere, replaced, its client left): the
        queue needs a new walk only if it held the line for others."""
        if self._remove(pair) and pair in self._line_holders:
            self._changed = True

    def _remove(self, pair: Pair) -> bool:
        """Take the pair's question out of the queues; whether it had one."""
        if self.waiters.pop(pair, None) is None:
            return False
        principal = self._principal.get(pair)
        queue = self._queues[principal]
        del queue[pair]
        if not queue:
            del self._queues[principal]
        return True

    def forget(self, pair: Pair) -> None:
        """The pair is gone (its client left): its reservation and question with it."""
        self._leave(pair)
        self._update(pair, self._principal.get(pair), admitted=0, used=0)
        self._principal.pop(pair, None)

    def reset(self, pair: Pair) -> None:
        """A new registration took the pair over: the client starts again from nothing
        admitted (its use still counts) and asks its question again if it still waits; an
        answer to the old connection's question would admit what the new one never learns."""
        self._update(pair, self._principal.get(pair), admitted=0)
        self._leave(pair)

    def settle(self, now: float) -> list[Decision[Pair]]:
        """Answer what can be answered: timeouts, questions that can never be admitted, and
        waiters that fit now, in the policy's order (see the module's "Jams"). The queue is
        walked only when memory was freed, the capacity or the settings changed, or a waiter
        left; a new question alone (under fifo, where it comes last) is weighed by itself."""
        if not self.waiters:
            return []
        config = self.config
        out: list[Decision[Pair]] = []
        due = self.next_deadline()
        if due is not None and now >= due:
            for waiter in list(self.waiters.values()):  # oldest first: stop at the first in time
                if now < waiter.since + config.timeout:
                    break
                out.append(self._refuse(waiter, "timeout"))
            self._changed = True  # the line they held is gone
        if not config.enabled:
            for waiter in list(self.waiters.values()):
                out.append(self._admit(waiter, waiter.bytes + headroom(waiter.bytes)))
            return out
        fresh = [waiter for waiter in self._fresh if self.waiters.get(waiter.pair) is waiter]
        self._fresh.clear()
        for waiter in fresh:  # what no wait can cure is answered at once, wherever it queues
            reason = self._refusal(waiter)
            if reason is not None:
                out.append(self._refuse(waiter, reason))
        lone = len(self.waiters) == 1
        if self._changed or (self._freed and self._capacity - self._reserved >= self._least_need):
            self._changed = self._freed = False
            self._line, self._blocking, self._line_holders = None, set(), set()
            self._least_need = self._capacity + 1
            out += self._walk(lone)
        else:
            self._freed = False
            for waiter in fresh:
                if self.waiters.get(waiter.pair) is waiter:
                    out += self._weigh(waiter, lone)
        return out

    def _walk(self, lone: bool) -> list[Decision[Pair]]:
        """Every waiter that may go, in the policy's order. Under fifo only each principal's
        first waiter is looked at, and its next one once it was answered."""
        out: list[Decision[Pair]] = []
        if self.config.policy != "fifo":
            for waiter in self._order():
                out += self._weigh(waiter, lone)
            return out
        heads = [(next(iter(queue.values())).order, principal) for principal, queue in self._queues.items()]
        heapq.heapify(heads)
        while heads:
            _, principal = heapq.heappop(heads)
            queue = self._queues[principal]
            decisions = self._weigh(next(iter(queue.values())), lone)
            out += decisions
            if decisions and principal in self._queues:
                heapq.heappush(heads, (next(iter(self._queues[principal].values())).order, principal))
        return out

    def _weigh(self, waiter: Waiter[Pair], lone: bool) -> list[Decision[Pair]]:
        """The waiter's decision, or none (then the least need waiting is kept)."""
        decision = self._consider(waiter, lone)
        if decision is None:
            self._least_need = min(self._least_need, waiter.bytes - self.reservation(waiter.pair))
            return []
        return [decision]

    def _refusal(self, waiter: Waiter[Pair]) -> str | None:
        if waiter.bytes > self._capacity:
            return "too-large"
        if waiter.bytes > self._quota:
            return "limit"  # more than its principal may ever hold
        return None

    def _consider(self, waiter: Waiter[Pair], lone: bool) -> Decision[Pair] | None:
        """One waiter in its turn: refused, admitted, or left waiting (then it may hold the
        line for those after it: self._line, self._blocking)."""
        reason = self._refusal(waiter)
        if reason is not None:
            return self._refuse(waiter, reason)
        pair = waiter.pair
        principal = self._principal.get(pair)
        if principal in self._blocking:
            return None  # behind its own principal's first waiter
        need = max(0, waiter.bytes - self.reservation(pair))
        after = self.holding(principal) + need
        if self._line is not None and after >= self._line:
            self._blocking.add(principal)  # may not overtake; its principal's later ones neither
            self._line_holders.add(pair)
            return None
        if after > self._quota:
            self._blocking.add(principal)  # waits for its own principal's frees, ahead of its others
            self._line_holders.add(pair)
            return None
        free = self._capacity - self._reserved
        if need > 0 and need > free:
            self._line = after if self._line is None else min(self._line, after)
            self._blocking.add(principal)
            self._line_holders.add(pair)
            return None
        # Generous only when nobody else waits (a chunk taken from a waiter would make it wait
        # for memory that nobody uses), with at most half of what stays free (the last of the
        # capacity is never all promised to one client ahead of its use), and never past the
        # principal's quota.
        extra = min(headroom(waiter.bytes), max(0, free - need) // 2, self._quota - after) if lone else 0
        return self._admit(waiter, waiter.bytes + extra)

    # --- rules ---------------------------------------------------------------------------

    def _order(self) -> list[Waiter[Pair]]:
        """The waiters in the order the policy serves them."""
        waiters = list(self.waiters.values())
        policy = self.config.policy
        if policy == "recent":
            waiters.reverse()
        elif policy == "random":
            self._random.shuffle(waiters)
        elif policy == "best-fit":
            # ConVGPU's best fit: the waiter whose need comes closest to the free memory without
            # passing it first; those that do not fit after them, least need first (the first
            # of them holds the line).
            free = self._capacity - self._reserved

            def key(waiter: Waiter[Pair]) -> tuple[int, int, int]:
                need = waiter.bytes - self.reservation(waiter.pair)
                return (0, -need, waiter.order) if need <= free else (1, need, waiter.order)

            waiters.sort(key=key)
        return waiters

    def _admit(self, waiter: Waiter[Pair], total: int) -> Admit[Pair]:
        self._remove(waiter.pair)
        self._update(waiter.pair, self._principal.get(waiter.pair), admitted=total)
        return Admit(waiter, total)

    def _refuse(self, waiter: Waiter[Pair], reason: str) -> Refuse[Pair]:
        self._remove(waiter.pair)
        return Refuse(waiter, reason)

    def _update(self, pair: Pair, principal: Principal, *, admitted: int | None = None,
                used: int | None = None) -> None:
        """Change a pair's admitted total and/or use and keep every sum in step."""
        before = self.reservation(pair)
        old_principal = self._principal.get(pair, principal)
        if admitted is not None:
            if admitted:
                self._admitted[pair] = admitted
            else:
                self._admitted.pop(pair, None)
        if used is not None:
            if used:
                self._used[pair] = used
            else:
                self._used.pop(pair, None)
        self._principal[pair] = principal
        after = self.reservation(pair)
        if old_principal != principal:
            self._add(old_principal, -before)
            self._add(principal, after)
        elif after != before:
            self._add(principal, after - before)

    def _add(self, principal: Principal, delta: int) -> None:
        if not delta:
            return
        old = self._holding.get(principal, 0)
        new = old + delta
        if new:
            self._holding[principal] = new
        else:
            self._holding.pop(principal, None)
        self._reserved += min(new, self._quota) - min(old, self._quota)
        if delta < 0:
            if principal in self._blocking:
                self._changed = True  # what waits for its own principal's frees
            else:
                self._freed = True

    def _set_quota(self) -> None:
        self._quota = int(self._capacity * self.config.share)
        self._reserved = sum(min(held, self._quota) for held in self._holding.values())
