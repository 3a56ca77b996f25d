"""Stateful property tests of the lock core.

Hypothesis drives a population of simulated client processes against one SchedulerCore, each
using one device (a process that uses several is a gang of one, which tests/test_core_gangs.py
drives): they register, announce devices, report memory, acquire, release (or ignore DROPs and keep the lock),
fall silent, die, reconnect under a new connection, and talk after they were removed; the
operator switches modes, time quanta and budgets; time advances the way the daemon advances it
(a Tick at every `next_deadline()`, heartbeats from the clients that are not silent).

The model below knows only what the core's actions told the clients (GRANT, DROP, REVOKE,
Forget, ...) and what the clients and the operator sent, and checks after every step:

1. Serialised devices never have two live grants. A grant is outstanding from its GRANT until
   the holder's RELEASE, its REVOKE or the holder's removal. In mode on, a GRANT is only sent
   when no grant is outstanding, and at most one outstanding grant is not under a DROP; in auto,
   a GRANT beside others is only sent when their memory plus the newcomer's fits the budget,
   and while the holders do not fit at most one of them is not under a DROP. A DROP'd grant is
   revoked exactly when its grace runs out, never before.
2. FCFS: every new GRANT goes to the head of the device's queue in ACQUIRE order.
3. Bounded waiting (derivation below).
4. A removed client holds nothing and waits for nothing (the core's status is compared with
   the model after every step), no message is ever sent to it again, and the lock does not sit
   idle while someone waits (the queue head is blocked by the rules at every moment).
5. Mode, quantum and budget switches happen between the other steps, so 1-4 hold across them.
6. CONTENDED (a notice) goes exactly to the holders whose quantum still runs while someone
   waits in a mode other than off, once per contention episode (first waiter until the queue
   is empty again), with the quantum they have left; again only to a reconnected process or
   after the quantum changed. After every step each such holder has been told.

Bound on waiting (property 3). Let waiter W start waiting at t0 with H grants outstanding and
Q waiters ahead of it in the queue. Let TQ be the largest quantum the device had since t0, G
the grace. Nobody can be granted ahead of W except those Q (FCFS; the simulated clients only
claim `held` devices that the core already knows they hold, so no claim creates a new grant).
Claims (`held=` in HELLO) are made only by the process that holds the grant, except by the
adversary (`hostile_claim`), whose claims outside the recovery window must be refused at once:
they are in no term of the bound. While W waits the device has a waiter, so every holder is DROP'd at the latest when its quantum
ends and revoked G later: a grant made at time g ends by g + TQ + G. The H grants were made
before t0, so they end by t0 + TQ + G. From then on the holders are queue entries that were
ahead of W; whenever there is no holder, the queue head is granted at once (in every mode), so
the k-th of the Q is granted by t0 + k(TQ + G) and gone by t0 + (k + 1)(TQ + G) when H > 0
(one round earlier when H = 0). Hence W is granted by t0 + (H + Q)(TQ + G). If W started
waiting inside the recovery window, grants only start at its end: add (recovery end - t0).
Alive timeouts need no slack here: removing a silent client only ends its grant or its
place in the queue earlier (removal happens at a Tick on the exact timeout instant, like every
other deadline).

(Some 700 lines: one state machine, `LockCoreMachine`: its model of what the clients were told,
its rules and its invariants all work on the machine's state, and the derivation above is what
`waiting_is_bounded` checks.)

Why one file of some 700 lines: one Hypothesis state machine, whose rules and invariants share
the model it keeps of the core; split, the invariants would no longer sit beside the rules that
must keep them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from nvshare_py import protocol, vocabulary
from nvshare_py.scheduler import residency, views
from nvshare_py.scheduler.core import CoreConfig, SchedulerCore
from nvshare_py.scheduler.events import (
    AcquireRequest,
    ClientInfo,
    DeviceInfo,
    DeviceMeasured,
    Forget,
    Alive,
    LockEvent,
    Log,
    MemoryReport,
    Register,
    ReleaseReport,
    Send,
    SetBudget,
    SetMode,
    SetQuantum,
    Tick,
    Unregister,
)

GiB = 1 << 30
DEVICES = ("GPU-5151ad00-0000-4000-8000-000000000000", "GPU-5151ad00-0000-4000-8000-000000000001")
TOTAL = 10 * GiB
HEARTBEAT = 1.0
HEARTBEAT_TIMEOUT = 4.0
MAX_PROCS = 5
EPS = 1e-9

pick = st.integers(min_value=0, max_value=1000)  # index into the live processes, modulo
device_choice = st.sampled_from((DEVICES[0], DEVICES[0], DEVICES[1]))  # contention on the first


def home_of(number: int) -> str:
    """The device process `number` uses: two of three use the first (contention there)."""
    return DEVICES[1] if number % 3 == 0 else DEVICES[0]


@dataclass(eq=False)
class Proc:
    """One simulated client process, as it sees itself."""

    session: str
    host_pid: int
    key: str
    home: str = DEVICES[0]  # the one device it uses
    cid: str = ""
    silent: bool = False
    last_sent: float = 0.0
    grants: dict = field(default_factory=dict)  # device -> grant id it may use (GRANT..RELEASE/REVOKE)
    revoked: dict = field(default_factory=dict)  # device -> set of revoked grants not yet released
    used: dict = field(default_factory=dict)  # device -> bytes it reported


@dataclass
class Outstanding:
    proc: Proc
    granted_at: float
    dropped_at: float | None = None
    told: bool = False
    grace: float | None = None  # None: the configured grace; 0 for a refused claim  # CONTENDED received in the device's current contention episode
    used_at_grant: int = 0  # what the holder had allocated on the device when granted
    told_idle_ms: int | None = None  # the idle window the last CONTENDED said


@dataclass
class Waiter:
    proc: Proc
    since: float
    ahead: int  # grants outstanding + waiters ahead, when it started waiting
    tq_max: float


@dataclass(eq=False)
class DeviceModel:
    id: str
    mode: str
    tq: float
    budget_override: int | None = None
    measured: bool = False  # the daemon measured it (TOTAL); clients' DEVICE never sizes it
    outstanding: dict = field(default_factory=dict)  # grant -> Outstanding
    overdue: dict = field(default_factory=dict)  # revoked grant -> Proc, until its RELEASE
    queue: list = field(default_factory=list)  # Waiter, in ACQUIRE order
    knowers: set = field(default_factory=set)  # procs that told the core about this device

    @property
    def total(self) -> int:
        """What the daemon measured (0: unknown)."""
        return TOTAL if self.measured else 0

    @property
    def budget(self) -> int:
        return self.total if self.budget_override is None else self.budget_override

    def over_budget(self, used: int) -> bool:
        """Auto mode: an unknown budget (0) fits nothing beside a holder."""
        return self.budget <= 0 or used > self.budget

    def unused(self, default_mode: str, default_tq: float) -> bool:
        """The core forgets such a device (issue 12: the table grew without limit)."""
        return (not self.knowers and not self.outstanding and not self.overdue and not self.queue
                and self.budget_override is None and not self.measured and self.mode == default_mode
                and self.tq == default_tq)

    @property
    def contended(self) -> bool:
        return bool(self.queue) and self.mode != "off"

    def held_used(self) -> int:
        return sum(o.proc.used.get(self.id, 0) for o in self.outstanding.values())

    def waiting(self, proc: Proc) -> bool:
        return any(w.proc is proc for w in self.queue)


class LockCoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.core: SchedulerCore | None = None

    # --- setup and plumbing --------------------------------------------------------------

    @initialize(
        mode=st.sampled_from(vocabulary.MODES),
        tq=st.sampled_from([1.0, 2.5]),
        grace=st.sampled_from([0.0, 0.5, 2.0]),
        recovery=st.sampled_from([0.0, 0.0, 1.5]),
        clients=st.integers(2, MAX_PROCS),
    )
    def start(self, mode, tq, grace, recovery, clients):
        self.config = CoreConfig(mode=mode, tq=tq, grace=grace, heartbeat_interval=HEARTBEAT,
                                 heartbeat_timeout=HEARTBEAT_TIMEOUT, recovery=recovery)
        self.now = 0.0
        self.core = SchedulerCore(self.config, self.now)
        self.recovery_end = recovery
        self.default_mode, self.default_tq = mode, tq
        self.devices: dict[str, DeviceModel] = {}
        self.live: dict[str, Proc] = {}  # key -> proc
        self.dead_keys: list[str] = []
        self.numbers = itertools.count(1)
        self.issued: set[int] = set()  # every grant id ever sent
        self.reconnecting: Proc | None = None
        self.claiming: Proc | None = None  # the adversary registering with a false held=
        self.confirmed: set[tuple[str, int]] = set()
        for _ in range(clients):
            self.register_one()

    def feed(self, event, expect_forgets=()):
        """Hand one event to the core and check its actions against the model."""
        self.forgets = []
        self.notices = []
        actions = self.core.handle(event)
        for action in actions:
            if isinstance(action, Send):
                self.on_send(action.client, action.message)
            elif isinstance(action, Forget):
                self.forgets.append((action.client, action.reason))
            elif isinstance(action, Log):
                assert views.describe(action), action  # every line the core names has its words
            else:
                assert isinstance(action, LockEvent), action
        assert sorted(self.forgets) == sorted(expect_forgets)
        for dev in self.devices.values():
            if not dev.contended:  # the episode is over: the next waiter starts a new one
                for held in dev.outstanding.values():
                    held.told = False
        deadline = self.core.next_deadline()
        if isinstance(event, Tick):  # everything due is done: another Tick now would spin the daemon
            assert deadline is None or deadline > self.now, f"deadline {deadline} is not after {self.now}"
        else:  # no event makes something due in the past
            assert deadline is None or deadline >= self.now, f"deadline {deadline} is before {self.now}"
        return actions

    def device(self, device_id: str) -> DeviceModel:
        if device_id not in self.devices:
            self.devices[device_id] = DeviceModel(device_id, self.default_mode, self.default_tq)
        return self.devices[device_id]

    def choose(self, index: int) -> Proc:
        procs = list(self.live.values())
        return procs[index % len(procs)]

    def sent_by(self, proc: Proc, device_id: str | None = None) -> None:
        proc.last_sent = self.now
        if device_id is not None:
            self.device(device_id).knowers.add(proc)

    def bury(self, proc: Proc) -> None:
        """The model's side of a client's removal: everything it had is gone, and so are the
        devices it used that nobody else uses or configured."""
        used = [dev for dev in self.devices.values() if proc in dev.knowers]
        for dev in self.devices.values():
            for grant in [g for g, o in dev.outstanding.items() if o.proc is proc]:
                del dev.outstanding[grant]
            for grant in [g for g, p in dev.overdue.items() if p is proc]:
                del dev.overdue[grant]
            dev.queue = [w for w in dev.queue if w.proc is not proc]
            dev.knowers.discard(proc)
        for dev in used:
            if dev.unused(self.default_mode, self.default_tq):
                del self.devices[dev.id]
        del self.live[proc.key]
        self.dead_keys.append(proc.key)

    def bound(self, waiter: Waiter) -> float:
        recovery_slack = max(0.0, self.recovery_end - waiter.since)
        return recovery_slack + waiter.ahead * (waiter.tq_max + self.config.grace)

    # --- what the core sends -------------------------------------------------------------

    def on_send(self, key, message) -> None:
        proc = self.live.get(key)
        assert proc is not None, f"{message} sent to {key}, which is not a live registration"
        if isinstance(message, protocol.Welcome):
            assert (message.heartbeat_ms, message.version) == (round(HEARTBEAT * 1000), protocol.VERSION)
            proc.cid = message.client
        elif isinstance(message, protocol.Grant):
            self.on_grant(proc, message)
        elif isinstance(message, protocol.Drop):
            self.on_drop(proc, message)
        elif isinstance(message, protocol.Revoke):
            self.on_revoke(proc, message)
        elif isinstance(message, protocol.Contended):
            self.on_contended(proc, message)
        elif isinstance(message, protocol.ModeNotice):
            dev = self.devices[message.device]
            assert (message.mode, message.quantum_ms) == (dev.mode, round(dev.tq * 1000))
            self.notices.append((message.device, proc))
        else:
            raise AssertionError(f"unexpected message {message}")

    def on_grant(self, proc: Proc, msg: protocol.Grant) -> None:
        dev = self.devices[msg.device]
        assert (msg.mode, msg.exclusive, msg.quantum_ms) == (dev.mode, dev.mode == "on", round(dev.tq * 1000))
        known = dev.outstanding.get(msg.grant)
        if known is not None:  # confirmation of a held lock to a reconnected process
            assert known.proc is proc is self.reconnecting
            self.confirmed.add((dev.id, msg.grant))
            return
        assert msg.grant not in self.issued, "grant ids must be unique"
        self.issued.add(msg.grant)
        assert self.now >= self.recovery_end, "only claims of held locks are granted during recovery"
        assert dev.queue, f"GRANT to {proc.cid}, which does not wait for {dev.id}"
        head = dev.queue[0]
        assert head.proc is proc, f"FCFS: {proc.cid} granted before {head.proc.cid}"
        assert self.now - head.since <= self.bound(head) + EPS
        assert dev.id not in proc.grants, "a process never holds two grants of one device"
        if dev.outstanding:
            assert dev.mode != "on", "second grant on a device in mode on"
            if dev.mode == "auto":
                assert not dev.over_budget(dev.held_used() + proc.used.get(dev.id, 0)), "auto grant beyond the budget"
        dev.queue.pop(0)
        dev.outstanding[msg.grant] = Outstanding(proc, self.now, used_at_grant=proc.used.get(dev.id, 0))
        proc.grants[dev.id] = msg.grant

    def on_drop(self, proc: Proc, msg: protocol.Drop) -> None:
        dev = self.devices[msg.device]
        if msg.reason == "conflict":  # a claim refused: dropped and revoked at once
            assert proc is self.claiming, "DROP conflict to a process that claimed nothing"
            assert msg.grace_ms == 0 and msg.grant not in self.issued
            self.issued.add(msg.grant)
            dev.outstanding[msg.grant] = Outstanding(proc, self.now, dropped_at=self.now, grace=0.0)
            proc.grants[dev.id] = msg.grant
            return
        held = dev.outstanding.get(msg.grant)
        assert held is not None and held.proc is proc, "DROP of a grant that is not outstanding"
        if held.dropped_at is not None:  # re-sent after a reconnection, with the time that is left
            assert proc is self.reconnecting
            assert msg.grace_ms == max(0, round((held.dropped_at + self.config.grace - self.now) * 1000))
            return
        assert msg.grace_ms == round(self.config.grace * 1000)
        if msg.reason == "quantum":
            assert dev.queue and dev.mode != "off", "quantum DROP while nobody waits"
            assert self.now >= held.granted_at + dev.tq, "quantum DROP before the quantum ended"
        elif msg.reason in ("mode", "memory"):
            if msg.reason == "mode":
                assert dev.mode == "on"
            else:
                assert dev.mode == "auto" and dev.over_budget(dev.held_used())
            assert msg.grant != min(dev.outstanding), "the holder granted first keeps the lock"
        else:
            raise AssertionError(f"unexpected DROP reason {msg.reason}")
        held.dropped_at = self.now

    def on_contended(self, proc: Proc, msg: protocol.Contended) -> None:
        dev = self.devices[msg.device]
        held = dev.outstanding.get(msg.grant)
        assert held is not None and held.proc is proc, "CONTENDED of a grant that is not outstanding"
        assert held.dropped_at is None, "CONTENDED to a holder already dropped"
        assert dev.contended, "CONTENDED while nobody waits, or in mode off"
        left = held.granted_at + dev.tq - self.now
        assert left > 0, "CONTENDED after the quantum ran out (a DROP is due instead)"
        assert msg.quantum_left_ms == round(left * 1000)
        # Once per contention episode, but for a holder that grew by a load's worth since its
        # grant: it is loading, and its idle window changes (residency.free_idle_ms).
        grew = proc.used.get(dev.id, 0) - held.used_at_grant >= residency.LOAD_GROWTH_BYTES
        assert not held.told or (grew and msg.idle_ms != held.told_idle_ms), "CONTENDED twice in one contention episode"
        held.told = True
        held.told_idle_ms = msg.idle_ms

    def on_revoke(self, proc: Proc, msg: protocol.Revoke) -> None:
        dev = self.devices[msg.device]
        held = dev.outstanding.pop(msg.grant, None)
        assert held is not None and held.proc is proc, "REVOKE of a grant that is not outstanding"
        assert msg.reason == "grace-expired"
        grace = self.config.grace if held.grace is None else held.grace
        assert held.dropped_at is not None and self.now >= held.dropped_at + grace, "revoked early"
        del proc.grants[dev.id]
        proc.revoked.setdefault(dev.id, set()).add(msg.grant)
        dev.overdue[msg.grant] = proc

    # --- clients -------------------------------------------------------------------------

    def register_one(self) -> None:
        number = next(self.numbers)
        proc = Proc(session=f"{number:016x}", host_pid=1000 + number, key=f"k{number}", home=home_of(number))
        self.live[proc.key] = proc
        self.sent_by(proc)
        self.feed(Register(self.now, proc.key, ClientInfo(pid=number, session=proc.session,
                                                          host_pid=proc.host_pid, uid=1000)))
        assert proc.cid

    @precondition(lambda self: len(self.live) < MAX_PROCS)
    @rule()
    def register(self):
        self.register_one()

    @precondition(lambda self: self.live)
    @rule(index=pick, gib=st.integers(0, 12), announce=st.booleans())
    def report(self, index, gib, announce):
        """DEVICE and MEMORY (its own use), as a client sends before ACQUIRE; `announce`: the
        daemon measured the device too (a client's DEVICE never sizes it)."""
        proc = self.choose(index)
        device = proc.home
        self.sent_by(proc, device)
        if announce:
            self.device(device).measured = True
            self.feed(DeviceMeasured(self.now, device, TOTAL, "simulated"))
        self.feed(DeviceInfo(self.now, proc.key, device, 1 << 60 if announce else 0, "simulated"))
        # A client has no more of a measured device than the device has: larger reports count as that.
        proc.used[device] = min(gib * GiB, TOTAL) if self.device(device).measured else gib * GiB
        self.feed(MemoryReport(self.now, proc.key, device, gib * GiB))

    @precondition(lambda self: self.live)
    @rule(index=pick)
    def acquire(self, index):
        proc = self.choose(index)
        device = proc.home
        self.sent_by(proc, device)
        dev = self.devices[device]
        grant = proc.grants.get(device)
        holding = grant is not None and dev.outstanding[grant].dropped_at is None
        if not holding and not dev.waiting(proc):
            ahead = len(dev.outstanding) + len(dev.queue)
            dev.queue.append(Waiter(proc, self.now, ahead, dev.tq))
        self.feed(AcquireRequest(self.now, proc.key, device))

    def release_grant(self, proc: Proc, device: str, reason: str) -> None:
        grant = proc.grants.pop(device)
        del self.devices[device].outstanding[grant]
        self.sent_by(proc)
        self.feed(ReleaseReport(self.now, proc.key, device, grant, reason))

    def release_stale(self, proc: Proc, device: str, grant: int) -> None:
        """A RELEASE the core must ignore: after a REVOKE, or of a grant that never existed."""
        if grant in proc.revoked.get(device, ()):
            proc.revoked[device].discard(grant)
            del self.devices[device].overdue[grant]
        self.sent_by(proc)
        actions = self.feed(ReleaseReport(self.now, proc.key, device, grant, "revoke"))
        assert all(isinstance(a, Log) and a.level == "debug" for a in actions)

    @precondition(lambda self: self.live)
    @rule(index=pick, reason=st.sampled_from(["idle", "user", "drop", "quantum", "stale"]))
    def release(self, index, reason):
        proc = self.choose(index)
        current = sorted(proc.grants)
        revoked = sorted((device, grant) for device, grants in proc.revoked.items() for grant in grants)
        if current and reason != "stale":
            self.release_grant(proc, current[index % len(current)], reason)
        elif revoked:
            self.release_stale(proc, *revoked[index % len(revoked)])
        else:
            self.release_stale(proc, DEVICES[index % len(DEVICES)], 10**9)

    @rule()
    def cooperative_clients_release_after_drop(self):
        for proc in list(self.live.values()):
            for device, grant in sorted(proc.grants.items()):
                if not proc.silent and self.devices[device].outstanding[grant].dropped_at is not None:
                    self.release_grant(proc, device, "drop")

    @precondition(lambda self: self.live)
    @rule(index=pick, what=st.sampled_from(["bye", "exited", "disconnected", "silent", "reconnect", "ghost"]))
    def lifecycle(self, index, what):
        """A client leaves (BYE, process exit, lost connection), hangs (falls silent: no
        heartbeats, no releases), reconnects, or a removed registration's connection talks."""
        proc = self.choose(index)
        if what == "silent":
            proc.silent = True
        elif what == "reconnect":
            self.reconnect(proc)
        elif what == "ghost":
            self.removed_client_speaks(index)
        else:
            self.bury(proc)
            self.feed(Unregister(self.now, proc.key, what), expect_forgets=[(proc.key, what)])

    def reconnect(self, proc: Proc) -> None:
        """The same process on a new connection, telling what it holds and waits for."""
        old_key = proc.key
        held = tuple(sorted(proc.grants))
        wanted = tuple(d.id for d in self.devices.values() if d.waiting(proc))
        del self.live[old_key]
        self.dead_keys.append(old_key)
        proc.key = f"k{next(self.numbers)}"
        self.live[proc.key] = proc
        proc.silent = False
        for device, grants in proc.revoked.items():  # the old registration's leftovers go with it
            for grant in grants:
                del self.devices[device].overdue[grant]
        proc.revoked = {}
        for device in held:  # a CONTENDED may have been lost with the old connection
            self.devices[device].outstanding[proc.grants[device]].told = False
        self.sent_by(proc)
        self.reconnecting, self.confirmed = proc, set()
        self.feed(Register(self.now, proc.key, ClientInfo(pid=1, session=proc.session, host_pid=proc.host_pid,
                                                          uid=1000), held, wanted),
                  expect_forgets=[(old_key, "replaced")])
        self.reconnecting = None
        assert self.confirmed == {(d, proc.grants[d]) for d in held}, "every held lock is confirmed"

    @precondition(lambda self: len(self.live) < MAX_PROCS and self.now >= self.recovery_end)
    @rule(device=device_choice, victim=pick, borrow=st.booleans())
    def hostile_claim(self, device, victim, borrow):
        """The adversary: a new connection of a process that holds nothing says it holds
        `device` (issue 12: one doing this every second starved the waiters), possibly under a
        live process's session (it cannot borrow that process's kernel-verified pid). The claim
        must be refused at once: the wait bound (property 3) has no room for it."""
        number = next(self.numbers)
        session = self.choose(victim).session if borrow and self.live else f"{number:016x}"
        proc = Proc(session=session, host_pid=1000 + number, key=f"k{number}", home=device)
        self.live[proc.key] = proc
        self.sent_by(proc, device)
        self.claiming = proc
        self.feed(Register(self.now, proc.key, ClientInfo(pid=number, session=session, host_pid=proc.host_pid,
                                                          uid=1000), (device,), ()))
        self.claiming = None
        assert proc.cid and device not in proc.grants, "a false claim is never honoured"
        assert proc.revoked.get(device), "a false claim is revoked at once"

    def removed_client_speaks(self, index: int) -> None:
        if not self.dead_keys:
            return
        key = self.dead_keys[index % len(self.dead_keys)]
        for event in (AcquireRequest(self.now, key, DEVICES[0]), MemoryReport(self.now, key, DEVICES[0], 1),
                      Alive(self.now, key)):
            actions = self.feed(event)
            assert [(type(a), a.level) for a in actions] == [(Log, "debug")]

    # --- time ----------------------------------------------------------------------------

    @rule(dt=st.sampled_from([0.1, 0.5, 1.0, 2.5, 6.0]))
    def advance(self, dt):
        target = self.now + dt
        for _ in range(10_000):
            deadline = self.core.next_deadline()
            beats = [p.last_sent + HEARTBEAT for p in self.live.values() if not p.silent]
            t = min([target, *beats] + ([deadline] if deadline is not None else []))
            assert t >= self.now
            self.now = t
            for proc in list(self.live.values()):
                if not proc.silent and proc.last_sent + HEARTBEAT <= t:
                    self.sent_by(proc)
                    self.feed(Alive(t, proc.key))
            expired = [p for p in self.live.values() if p.last_sent + HEARTBEAT_TIMEOUT <= t]
            for proc in expired:
                self.bury(proc)
            self.feed(Tick(t), expect_forgets=[(p.key, "heartbeat-timeout") for p in expired])
            if t >= target:
                return
        raise AssertionError("time does not advance")

    # --- the operator --------------------------------------------------------------------

    @rule(
        change=st.one_of(
            st.tuples(st.just("mode"), st.sampled_from(vocabulary.MODES)),
            st.tuples(st.just("tq"), st.sampled_from([0.5, 1.0, 3.0])),
            st.tuples(st.just("budget"), st.sampled_from([None, 3, 8, 20])),
        ),
        device=st.sampled_from((None,) + DEVICES),
    )
    def operator(self, change, device):
        """nvsharectl on|off|auto / set-tq / set-budget (GiB; None: back to the total)."""
        setting, value = change
        if setting == "budget":
            device = device or DEVICES[0]  # set-budget always names a device
            budget = None if value is None else value * GiB
            self.control(SetBudget(self.now, device, budget), device, lambda dev: self.set_budget(dev, budget))
        elif setting == "mode":
            if device is None:
                self.default_mode = value
            self.control(SetMode(self.now, value, device), device, lambda dev: self.set_mode(dev, value))
        else:
            if device is None:
                self.default_tq = value
            self.control(SetQuantum(self.now, value, device), device, lambda dev: self.set_tq(dev, value))

    @staticmethod
    def set_mode(dev: DeviceModel, mode: str) -> bool:
        changed, dev.mode = dev.mode != mode, mode
        return changed

    @staticmethod
    def set_tq(dev: DeviceModel, seconds: float) -> bool:
        changed, dev.tq = dev.tq != seconds, seconds
        for waiter in dev.queue:
            waiter.tq_max = max(waiter.tq_max, seconds)
        if changed:  # holders are told the quantum they have left again
            for held in dev.outstanding.values():
                held.told = False
        return changed

    @staticmethod
    def set_budget(dev: DeviceModel, budget: int | None) -> bool:
        dev.budget_override = budget
        return False  # a budget change sends no MODE notice

    def control(self, event, device: str | None, change) -> None:
        """Apply a control request to the model (`change(dev)` says whether it changed the
        device) and check the core's MODE notices went to exactly the devices' clients."""
        # A device nobody announced may be configured by its UUID (an operator prepares a GPU
        # before its programs start); it stays while configured, as one with clients does.
        targets = list(self.devices.values()) if device is None else [self.device(device)]
        changed = [dev for dev in targets if change(dev)]
        self.feed(event)
        if device is not None and targets[0].unused(self.default_mode, self.default_tq):
            del self.devices[device]
        notified = {}
        for device_id, proc in self.notices:
            notified.setdefault(device_id, set()).add(proc)
        assert notified == {dev.id: dev.knowers for dev in changed if dev.knowers}

    # --- invariants ----------------------------------------------------------------------

    @invariant()
    def status_matches_the_model(self):
        if self.core is None:
            return
        status = views.status(self.core, self.now, lambda t: t)
        assert sorted(c["client"] for c in status["clients"]) == sorted(p.cid for p in self.live.values())
        assert [d["device"] for d in status["devices"]] == sorted(self.devices)
        for doc in status["devices"]:
            dev = self.devices[doc["device"]]
            expected = [(g, o.proc.cid, "holding" if o.dropped_at is None else "draining")
                        for g, o in dev.outstanding.items()]
            expected += [(g, p.cid, "overdue") for g, p in dev.overdue.items()]
            assert [(h["grant"], h["client"], h["state"]) for h in doc["holders"]] == sorted(expected)
            assert [w["client"] for w in doc["waiters"]] == [w.proc.cid for w in dev.queue]
            assert (doc["mode"], doc["tq"], doc["budget"], doc["total"]) == (dev.mode, dev.tq, dev.budget, dev.total)
            assert doc["used"] == sum(p.used.get(dev.id, 0) for p in self.live.values())

    @invariant()
    def serialised_devices_never_run_two_grants(self):
        if self.core is None:
            return
        for dev in self.devices.values():
            live = [o for o in dev.outstanding.values() if o.dropped_at is None]
            if dev.mode == "on":
                assert len(live) <= 1, f"{len(live)} undropped grants on {dev.id} in mode on"
            if dev.mode == "auto" and dev.over_budget(dev.held_used()):
                assert len(live) <= 1, f"{len(live)} undropped grants on {dev.id} beyond its budget"
            for held in dev.outstanding.values():
                if held.dropped_at is not None:
                    assert self.now < held.dropped_at + self.config.grace, "grace over but not revoked"

    @invariant()
    def no_lock_sits_idle_while_someone_waits(self):
        if self.core is None or self.now < self.recovery_end:
            return
        for dev in self.devices.values():
            if not dev.queue:
                continue
            head = dev.queue[0].proc
            blocked_by_itself = dev.id in head.grants
            blocked_by_rules = bool(dev.outstanding) and (
                dev.mode == "on"
                or (dev.mode == "auto" and dev.over_budget(dev.held_used() + head.used.get(dev.id, 0)))
            )
            assert blocked_by_itself or blocked_by_rules, f"{head.cid} waits for {dev.id} though it could run"
            if dev.mode != "off":
                for held in dev.outstanding.values():
                    if held.dropped_at is None:
                        assert self.now < held.granted_at + dev.tq, "quantum over, someone waits, no DROP"

    @invariant()
    def contended_holders_have_been_told(self):
        if self.core is None:
            return
        for dev in self.devices.values():
            if dev.contended:
                for grant, held in dev.outstanding.items():
                    assert held.dropped_at is not None or held.told, (
                        f"{held.proc.cid} holds grant {grant} of {dev.id} while others wait, untold")

    @invariant()
    def waiting_is_bounded(self):
        if self.core is None:
            return
        for dev in self.devices.values():
            for waiter in dev.queue:
                assert self.now - waiter.since <= self.bound(waiter) + EPS, (
                    f"{waiter.proc.cid} waited {self.now - waiter.since:.3f} s for {dev.id}, "
                    f"bound {self.bound(waiter):.3f} s")

    @invariant()
    def silent_clients_are_removed_on_time(self):
        if self.core is None:
            return
        for proc in self.live.values():
            assert self.now < proc.last_sent + HEARTBEAT_TIMEOUT


LockCoreMachine.TestCase.settings = settings(
    max_examples=600,
    stateful_step_count=60,
    deadline=None,  # the shared CI / dev machines are loaded; correctness, not speed, is checked here
    suppress_health_check=[HealthCheck.too_slow],
)
test_lock_core_state_machine = LockCoreMachine.TestCase


def test_bound_is_not_vacuous():
    """The waiting bound must be tight enough to catch a core that forgets a quantum: with one
    holder ahead, a waiter has to be served within TQ + grace."""
    machine = LockCoreMachine()
    machine.start(mode="on", tq=1.0, grace=0.5, recovery=0.0, clients=2)
    machine.acquire(0)
    machine.acquire(1)
    (waiter,) = machine.devices[DEVICES[0]].queue
    assert machine.bound(waiter) == 1.5
    machine.advance(1.0)  # quantum over: the holder is dropped...
    machine.advance(0.5)  # ...and revoked; the waiter holds now
    assert machine.devices[DEVICES[0]].queue == []
    machine.waiting_is_bounded()
