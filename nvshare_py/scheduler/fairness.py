"""Fair turns on the daemon's one thread: how much of it one user's traffic may take.

Every connection's task does its work in *turns*: it takes a turn before it reads, handles
at most a bounded batch (connections.FRAMES_PER_TURN frames) and gives the turn back. Turns
go round-robin by *principal* (a uid, and within it a Kubernetes pod: connections.principal),
not by connection: while others wait, a principal with twenty busy connections gets one batch
per round, like a principal with one. And each principal's time is metered: a token bucket of
CPU seconds refilled at CPU_SHARE per second (up to CPU_BURST); a principal that has spent more
waits, before its next turn, until its bucket is back to zero. So a flood of well-formed or
malformed frames from one user costs the daemon at most CPU_SHARE of its thread, and the other
users' messages (a RELEASE on a handoff path, an ACQUIRE) wait at most one batch of each other
busy principal.

When nobody else waits, taking a turn costs a comparison and a clock read: no task switch.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Hashable

import trio

# The share of the daemon's thread one principal may use over time, and the burst it may
# take at once (seconds of thread time). A saturated legitimate user (1 800 handoffs/s in
# benchmarks/bench_scheduler.py) uses about 0.15 s per second. On a small machine the
# attacker's own processes take CPU from the daemon too: a quarter keeps room for both.
CPU_SHARE = 0.25
CPU_BURST = 0.05


class _Meter:
    """A principal's token bucket of thread time, and how many connections it has open."""

    __slots__ = ("tokens", "stamp", "connections", "throttled")

    def __init__(self, now: float) -> None:
        self.tokens = CPU_BURST
        self.stamp = now
        self.connections = 0
        self.throttled = 0  # turns it had to wait for its share


class Turn:
    """One principal's right to run; `release` is idempotent."""

    __slots__ = ("turns", "principal", "started", "held")

    def __init__(self, turns: "Turns", principal: Hashable) -> None:
        self.turns = turns
        self.principal = principal
        self.started = 0.0
        self.held = False

    def release(self) -> None:
        if self.held:
            self.held = False
            self.turns._end(self)

    async def pause(self) -> None:
        """Let the other principals' work go first, then carry on. The checkpoint matters:
        tasks that became ready meanwhile (another user's connection turned readable) only
        ask for their turn once Trio has run them."""
        self.release()
        await trio.lowlevel.checkpoint()
        await self.turns._begin(self)


class Turns:
    def __init__(self, share: float = CPU_SHARE, burst: float = CPU_BURST,
                 clock: Callable[[], float] = time.perf_counter,
                 on_throttled: Callable[[Hashable], None] | None = None) -> None:
        self.share = share
        self.burst = burst
        self.clock = clock
        self.on_throttled = on_throttled  # told each time a principal waits for its share
        self._busy = False  # a turn is running, or granted to a task that has not run yet
        self._waiting: collections.OrderedDict[Hashable, collections.deque[trio.Event]] = collections.OrderedDict()
        self._meters: dict[Hashable, _Meter] = {}

    # --- who is served ---------------------------------------------------------------------

    def join(self, principal: Hashable) -> None:
        """A connection of `principal` opened (its meter lives while it has any)."""
        meter = self._meters.get(principal)
        if meter is None:
            meter = self._meters[principal] = _Meter(self.clock())
            meter.tokens = self.burst
        meter.connections += 1

    def leave(self, principal: Hashable) -> None:
        meter = self._meters[principal]
        meter.connections -= 1
        if not meter.connections:
            del self._meters[principal]

    def charge(self, principal: Hashable, seconds: float) -> None:
        """Count `seconds` of the daemon's time spent for `principal` outside a turn (accepting
        or refusing its connections)."""
        meter = self._meters.get(principal)
        if meter is not None:
            meter.tokens -= seconds

    def throttled(self, principal: Hashable) -> int:
        """How many turns of `principal` waited for its CPU share (0 when unknown)."""
        meter = self._meters.get(principal)
        return meter.throttled if meter is not None else 0

    # --- turns -----------------------------------------------------------------------------

    async def take(self, principal: Hashable) -> Turn:
        """Wait for `principal`'s turn. Returns it held; `release` it when the batch is done."""
        turn = Turn(self, principal)
        await self._begin(turn)
        return turn

    async def _begin(self, turn: Turn) -> None:
        meter = self._meters[turn.principal]
        now = self.clock()
        meter.tokens = min(self.burst, meter.tokens + (now - meter.stamp) * self.share)
        meter.stamp = now
        if meter.tokens < 0:
            meter.throttled += 1
            if self.on_throttled is not None:
                self.on_throttled(turn.principal)
            await trio.sleep(-meter.tokens / self.share)
        if self._busy or self._waiting:
            granted = trio.Event()
            self._waiting.setdefault(turn.principal, collections.deque()).append(granted)
            try:
                await granted.wait()
            except BaseException:
                if granted.is_set():
                    self._pass_on()  # granted, but cancelled before it could run
                else:
                    self._withdraw(turn.principal, granted)
                raise
        else:
            self._busy = True
        turn.held = True
        turn.started = self.clock()

    def _end(self, turn: Turn) -> None:
        now = self.clock()
        meter = self._meters.get(turn.principal)
        if meter is not None:
            meter.tokens = min(self.burst, meter.tokens + (now - meter.stamp) * self.share) - (now - turn.started)
            meter.stamp = now
        self._pass_on()

    def _pass_on(self) -> None:
        """The next principal in the round gets the turn (its first waiting task)."""
        while self._waiting:
            principal, queue = next(iter(self._waiting.items()))
            granted = queue.popleft()
            if queue:
                self._waiting.move_to_end(principal)
            else:
                del self._waiting[principal]
            granted.set()
            return  # _busy stays True: the turn is the granted task's now
        self._busy = False

    def _withdraw(self, principal: Hashable, granted: trio.Event) -> None:
        queue = self._waiting.get(principal)
        if queue is not None:
            queue.remove(granted)
            if not queue:
                del self._waiting[principal]
