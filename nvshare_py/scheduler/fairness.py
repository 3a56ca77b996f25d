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

Everything a principal's connections cost the thread is its own: reading and handling their
messages, and also setting a connection up and ending it (for a registered client, the core's
Unregister), done in its turns too, accepting or refusing it (charged to its meter), and what
its task costs between turns (each step of a connection's task is measured: _StepMeter). A
principal's meter outlives its last connection while it is in debt, so that closing every
connection and opening new ones does not make the debt go away. The accept loop of each
listening socket takes turns as well, under a principal of its own (connections.Door): what
accepting costs before the daemon knows whose connection it is (accept(), the peer's
credentials and pod) is bounded by one share, whoever floods the listen backlog.

When nobody else waits, taking a turn costs a comparison and a clock read: no task switch.
"""

from __future__ import annotations

import collections
import heapq
import time
from collections.abc import Callable, Hashable

import trio

# The share of the daemon's thread one principal may use over time, and the burst it may
# take at once (seconds of thread time). A saturated legitimate user (1 800 handoffs/s in
# benchmarks/bench_scheduler.py) uses about 0.15 s per second. On a small machine the
# attacker's own processes take CPU from the daemon too: a quarter keeps room for both.
CPU_SHARE = 0.25
CPU_BURST = 0.05
# The most debt a principal carries (seconds of thread time): the longest it waits for a turn
# is DEBT_MAX / CPU_SHARE, even when it was charged for far more (refused connections).
DEBT_MAX = 1.0
# The shortest wait for a share (seconds).
THROTTLE_MIN = 0.001


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

    def spent(self) -> float:
        """Seconds of the thread this turn has taken so far."""
        return self.turns.clock() - self.started

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


class _StepMeter(trio.abc.Instrument):
    """Charges each step of a task that works for a principal (Turns.own) to the principal,
    less the turns taken in the step (charged when they end): what Trio itself spends on a
    connection (starting its task, cancelling, tearing down) is its principal's too."""

    def __init__(self, turns: "Turns") -> None:
        self.turns = turns
        self.started = 0.0
        self.run: trio.lowlevel.Task | None = None  # the root task of the run it is installed in

    def install(self) -> None:
        """Into the Trio run going on (once); the step running now is measured from now."""
        root = trio.lowlevel.current_root_task()
        if self.run is not root:
            self.run = root
            self.started = self.turns.clock()
            self.turns._in_turns = 0.0
            trio.lowlevel.add_instrument(self)

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.started = self.turns.clock()
        self.turns._in_turns = 0.0

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        principal = self.turns._owners.get(task)
        if principal is not None:
            self.turns.charge(principal, max(0.0, self.turns.clock() - self.started - self.turns._in_turns))


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
        # Principals without connections whose meter is kept until its debt is repaid:
        # (when it is repaid, a number, principal), earliest first.
        self._indebted: list[tuple[float, int, Hashable]] = []
        self._order = 0  # ties in _indebted are broken by this, never by the principals
        self._owners: dict[trio.lowlevel.Task, Hashable] = {}  # tasks that work for a principal
        self._in_turns = 0.0  # time of the turns that ended in the task step running
        self.step_meter = _StepMeter(self)  # installed in the Trio run by the first `own`

    # --- who is served ---------------------------------------------------------------------

    def join(self, principal: Hashable) -> None:
        """A connection of `principal` opened (its meter lives while it has any, and after
        that while it is in debt)."""
        self._forget_repaid()
        meter = self._meters.get(principal)
        if meter is None:
            meter = self._meters[principal] = _Meter(self.clock())
            meter.tokens = self.burst
        meter.connections += 1

    def leave(self, principal: Hashable) -> None:
        """A connection of `principal` ended. Its meter goes with its last connection, unless
        it is in debt: then it stays until the debt is repaid, and a connection opened
        meanwhile finds it."""
        meter = self._meters[principal]
        meter.connections -= 1
        self._forget_repaid()
        if meter.connections:
            return
        now = self.clock()
        self._refill(meter, now)
        if meter.tokens >= 0:
            del self._meters[principal]
        else:
            self._order += 1
            heapq.heappush(self._indebted, (now - meter.tokens / self.share, self._order, principal))

    def _forget_repaid(self) -> None:
        now = self.clock()
        while self._indebted and self._indebted[0][0] <= now:
            _, _, principal = heapq.heappop(self._indebted)
            meter = self._meters.get(principal)
            if meter is None or meter.connections:
                continue
            self._refill(meter, now)
            if meter.tokens >= 0:  # else it came back and left again: a later entry is due
                del self._meters[principal]

    def own(self, task: trio.lowlevel.Task, principal: Hashable) -> None:
        """`task` works for `principal` (a connection's): all its steps are charged to it, not
        only its turns, until `disown`."""
        self.step_meter.install()
        self._owners[task] = principal

    def disown(self, task: trio.lowlevel.Task) -> None:
        self._owners.pop(task, None)

    def charge(self, principal: Hashable, seconds: float) -> None:
        """Count `seconds` of the daemon's time spent for `principal` outside a turn (accepting
        or refusing its connections)."""
        meter = self._meters.get(principal)
        if meter is not None:
            meter.tokens = max(-DEBT_MAX, meter.tokens - seconds)

    def _refill(self, meter: _Meter, now: float) -> None:
        meter.tokens = min(self.burst, meter.tokens + (now - meter.stamp) * self.share)
        meter.stamp = now

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
        # A principal whose connections are all gone (and whose debt is repaid) may still have
        # work to do (a watched process's exit seen after its connection's end): it runs
        # with a fresh bucket, as a new connection of it would.
        meter = self._meters.get(turn.principal) or _Meter(self.clock())
        while True:
            self._refill(meter, self.clock())
            if meter.tokens < 0:
                meter.throttled += 1
                if self.on_throttled is not None:
                    self.on_throttled(turn.principal)
                # (at least THROTTLE_MIN: a debt of rounding errors would not advance the clock)
                await trio.sleep(max(-meter.tokens / self.share, THROTTLE_MIN))
                continue  # its other tasks may have spent meanwhile
            if not (self._busy or self._waiting):
                self._busy = True
                break
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
            self._refill(meter, self.clock())
            if meter.tokens >= 0:
                break
            # Its principal's other tasks spent its share while this one waited in the round:
            # the turn goes on, and this task waits for the share to come back.
            self._pass_on()
        turn.held = True
        turn.started = self.clock()

    def _end(self, turn: Turn) -> None:
        now = self.clock()
        meter = self._meters.get(turn.principal)
        self._in_turns += now - turn.started
        if meter is not None:
            self._refill(meter, now)
            meter.tokens = max(-DEBT_MAX, meter.tokens - (now - turn.started))
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
