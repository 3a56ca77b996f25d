"""Prometheus metrics of the scheduler (`nvshare-scheduler --metrics ADDRESS`, docs/metrics.md).

`SchedulerMetrics` is an observer. The pump hands it every event it fed the lock core together
with the actions the core returned; from the timeline entries (LockEvent) it keeps counters and
histograms (waits, holds, handoffs). Gauges (modes, quanta, memory, holders, waiters) are not
tracked at all: `render()` sets them from the daemon's status document when a snapshot is
taken. Serving the exposition over HTTP is metrics_http.py's.

`SchedulerMetrics` is an observer. The pump hands it every event it fed the lock core together
with the actions the core returned; from the timeline entries (LockEvent) it keeps counters and
histograms (waits, holds, handoffs, admission). Gauges (modes, quanta, memory, holders, waiters,
weights) are not tracked at all: `render()` sets them from the daemon's status document when a
snapshot is taken. Time held and waited (GPU-seconds per user and pod) are counted when a hold
or wait ends, and brought up to the latest event the observer saw (every client heartbeats, so
at most a heartbeat interval ago) at each snapshot. Every counter has a sample from the start,
at 0: for its known label values at once, for a device's when the device is first seen.
Serving the exposition over HTTP is metrics_http.py's.

Rendering runs on the pump's thread, between two of its steps, and needs no lock: it can never
observe, or hold up, a half-done update. It yields to the pump every GAUGE_STEP series sets (and
after each label set evicted) while it sets the gauges, all from one status document, and every
RENDER_STEP samples while it formats, so a large exposition delays a handoff by one such step,
not by the whole render
(benchmarks/bench_scheduler.py --scrape measures it). prometheus_client's own HTTP server would
run collection on a thread of its own, racing the pump for the core's state and for the GIL.

Label cardinality is bounded (labels.py): clients say who they are (pod, namespace, program)
and a client may lie, so at most CLIENT_SERIES (device, client labels) sets get series of their
own, CLIENT_SERIES_PER_UID of them for the clients of one uid, and DEVICE_LABELS device ids;
a set or device nobody uses any more makes room for a new one (its series go), anything past
that is counted under OVERFLOW. The user label is the daemon's name for the client's
kernel-verified uid (ClientInfo.user).
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Iterator

import trio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric

from .. import __version__, protocol
from ..vocabulary import DROP_REASON, ERROR_CODE, MODES, REFUSE_REASON
from . import events as ev
from .labels import Places

# Label value for everything past the bounds below. Kubernetes names cannot start with "_",
# so it never collides with a real pod or namespace.
OVERFLOW = "_other"
# Series sets of client metrics (a device and a client's labels), in all and per uid; each
# costs about 17 KiB of memory and 43 samples per scrape once it has grants (docs/metrics.md).
CLIENT_SERIES = 256
CLIENT_SERIES_PER_UID = 32
DEVICE_LABELS = 64
LABEL_VALUE_MAX = 128  # characters; a client's program name can be anything it likes

# Waits and holds span milliseconds (an idle GPU) to many quanta; handoffs are a drain + a message.
WAIT_HOLD_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, math.inf)
HANDOFF_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, math.inf)

CLIENT_LABELS = ("device", "pod", "namespace", "program", "user")

RENDER_STEP = 50  # samples formatted between two chances for the pump to run
GAUGE_STEP = 16  # (client, device) pairs or devices set between two chances for it

# The states of a gang's turn in the status document (views.gangs_status).
GANG_STATES = ("holding", "draining", "waiting", "members", "idle")


class SchedulerMetrics:
    """Counters and histograms from the core's actions; gauges from a status document."""

    def __init__(self, *, restarted: bool, started: float) -> None:
        # No ProcessCollector: it reads /proc on every scrape (about 10 ms on a busy 2-core
        # machine), and a render runs between two steps of the pump.
        self.registry = registry = CollectorRegistry(auto_describe=True)
        # --- per device ---
        self.device_mode = Gauge("nvshare_device_mode", "1 for the device's current scheduling mode, 0 for the others",
                                 ("device", "mode"), registry=registry)
        self.device_tq = Gauge("nvshare_device_time_quantum_seconds", "Time quantum of the device",
                               ("device",), registry=registry)
        self.device_total = Gauge("nvshare_device_memory_total_bytes",
                                  "Device memory as reported by its clients (0: not reported yet)",
                                  ("device",), registry=registry)
        self.device_budget = Gauge("nvshare_device_memory_budget_bytes",
                                   "Memory budget of the device: what auto mode lets its holders use together "
                                   "(0: unknown, unlimited)", ("device",), registry=registry)
        self.device_used = Gauge("nvshare_device_memory_used_bytes",
                                 "Device memory its clients report using, holders or not", ("device",), registry=registry)
        self.device_resident = Gauge("nvshare_device_memory_resident_bytes",
                                     "Device memory its clients keep resident, holders or not: what the budget "
                                     "holds (used less what was seen swapped out)", ("device",), registry=registry)
        self.device_holders = Gauge("nvshare_device_holders", "Clients holding the device's lock (revoked grants "
                                    "not yet released included)", ("device",), registry=registry)
        self.device_waiters = Gauge("nvshare_device_waiters", "Clients waiting for the device's lock",
                                    ("device",), registry=registry)
        self.handoffs = Counter("nvshare_device_handoffs_total",
                                "Grants of the device's lock to a different client than the previous grant's",
                                ("device",), registry=registry)
        self.revokes = Counter("nvshare_device_revokes_total",
                               "Grants revoked because the holder did not release within the grace period",
                               ("device",), registry=registry)
        self.drops = Counter("nvshare_device_drops_total", "DROP requests sent to holders, by reason",
                             ("device", "reason"), registry=registry)
        # Swapping (docs/scheduler.md, "Budgets and swapping"): what the scheduler asked to move.
        # How long the moves took is the clients' to measure (the interceptor's trace).
        self.swap_requested = Counter("nvshare_device_swap_requested_bytes_total",
                                      "Bytes the scheduler asked clients to move: out = DROP evict= and EVICT, "
                                      "in = GRANT prefetch= and PREFETCH (what it allows beyond what the client "
                                      "had resident or was allowed)", ("device", "direction"), registry=registry)
        # What moved, as the clients reported it, and how long a grant's swap-in stalled its
        # client (docs/scheduler.md, "Many tenants").
        self.swap_moved = Counter("nvshare_device_swap_moved_bytes_total",
                                  "Bytes the device's clients were seen moving to the host (out) and back (in)",
                                  ("device", "direction"), registry=registry)
        self.swap_in_seconds = Histogram("nvshare_device_swap_in_seconds",
                                         "Time from when a tenant's memory began to come back (the first PREFETCH "
                                         "of its wait, or a grant that still had memory to bring back) to its "
                                         "client's report that all of it is back: what a request to a swapped-out "
                                         "tenant waits for its memory", ("device",),
                                         buckets=HANDOFF_BUCKETS, registry=registry)
        self.device_swapped = Gauge("nvshare_device_memory_swapped_bytes",
                                    "Memory of the device's clients seen moved to the host and not brought back",
                                    ("device",), registry=registry)
        # --- per client ---
        self.wait_seconds = Histogram("nvshare_client_wait_seconds",
                                      "Time from a client's ACQUIRE to its GRANT", CLIENT_LABELS,
                                      buckets=WAIT_HOLD_BUCKETS, registry=registry)
        self.hold_seconds = Histogram("nvshare_client_hold_seconds",
                                      "Time from a GRANT to the end of that grant (release, revoke or the "
                                      "client's loss)", CLIENT_LABELS, buckets=WAIT_HOLD_BUCKETS, registry=registry)
        self.grants = Counter("nvshare_client_grants_total", "Grants given to clients", CLIENT_LABELS,
                              registry=registry)
        self.client_memory = Gauge("nvshare_client_memory_used_bytes",
                                   "Device memory the connected clients report using", CLIENT_LABELS,
                                   registry=registry)
        self.client_holding = Gauge("nvshare_client_holding",
                                    "Grants the connected clients hold (who holds each device)", CLIENT_LABELS,
                                    registry=registry)
        self.client_resident = Gauge("nvshare_client_memory_resident_bytes",
                                     "Device memory the connected clients keep resident (used less what was seen "
                                     "swapped out)", CLIENT_LABELS, registry=registry)
        self.client_swapped = Gauge("nvshare_client_memory_swapped_bytes",
                                    "Device memory of the connected clients seen moved to the host and not brought back",
                                    CLIENT_LABELS, registry=registry)
        self.held = Counter("nvshare_client_held_seconds",
                            "Seconds the clients held the device's lock (GPU-seconds; brought up to date at each "
                            "scrape)", CLIENT_LABELS, registry=registry)
        self.waited = Counter("nvshare_client_waited_seconds",
                              "Seconds the clients waited for the device's lock (brought up to date at each scrape)",
                              CLIENT_LABELS, registry=registry)
        self.client_weight = Gauge("nvshare_client_weight", "Weight of the connected clients (the largest where "
                                   "several share the labels)", CLIENT_LABELS, registry=registry)
        self.client_priority = Gauge("nvshare_client_priority", "Priority class of the connected clients (the highest "
                                     "where several share the labels)", CLIENT_LABELS, registry=registry)
        self.admission_wait = Histogram("nvshare_client_admission_wait_seconds",
                                        "Time an allocation waited for admission, until ADMITTED or REFUSED",
                                        CLIENT_LABELS, buckets=WAIT_HOLD_BUCKETS, registry=registry)
        self.admission_refused = Counter("nvshare_device_admission_refused_total",
                                         "Allocations refused admission, by reason", ("device", "reason"),
                                         registry=registry)
        # --- admission (docs/scheduler.md, "Admission") ---
        self.admission_enabled = Gauge("nvshare_admission_enabled", "1 while admission is on", registry=registry)
        self.admission_capacity = Gauge("nvshare_admission_capacity_bytes",
                                        "What the node's clients may hold: the devices' budgets plus the spill "
                                        "(0 while admission is off)", registry=registry)
        self.admission_reserved = Gauge("nvshare_admission_reserved_bytes",
                                        "What the node's clients hold or were admitted, whichever is larger",
                                        registry=registry)
        self.admission_spill = Gauge("nvshare_admission_spill_bytes",
                                     "Host memory allowed beyond the devices' budgets", registry=registry)
        self.admission_waiters = Gauge("nvshare_admission_waiters", "Allocations waiting for admission",
                                       registry=registry)
        # --- gangs (docs/scheduler.md, "Gangs"): no per-gang labels, whose ids only grow ---
        self.gangs = Gauge("nvshare_gangs", "Gangs (multi-GPU jobs, and processes on several devices) by the state "
                           "of their turn", ("state",), registry=registry)
        self.gang_members = Gauge("nvshare_gang_members", "Processes in gangs, by the state of their gang's turn",
                                  ("state",), registry=registry)
        self.gang_turns = Counter("nvshare_gang_turns_total", "Turns granted to gangs (every device of every member "
                                  "at once)", registry=registry)
        self.gang_incomplete = Counter("nvshare_gang_incomplete_total", "Gangs that ran without all their members "
                                       "after waiting --gang-wait for them", registry=registry)
        self.gang_turn_seconds = Histogram("nvshare_gang_turn_seconds", "Time from a gang's grants to the end of the "
                                           "last grant of its turn (the gang's quantum and drain)",
                                           buckets=WAIT_HOLD_BUCKETS, registry=registry)
        # --- scheduler ---
        self.handoff_seconds = Histogram(
            "nvshare_scheduler_handoff_seconds",
            "Time from asking a holder to let go (DROP), or from its own RELEASE, to the GRANT of a client "
            "that was waiting", ("device",), buckets=HANDOFF_BUCKETS, registry=registry)
        self.clients = Gauge("nvshare_scheduler_clients", "Registered clients", registry=registry)
        self.rejected = Counter("nvshare_scheduler_rejected_messages_total",
                                "Client messages answered with ERROR, by code", ("code",), registry=registry)
        self.overflowed = Counter("nvshare_scheduler_label_overflows_total",
                                  f"Clients or devices counted under the label value {OVERFLOW} because the "
                                  "label bounds were reached", ("label",), registry=registry)
        Gauge("nvshare_scheduler_start_time_seconds", "When this daemon started (Unix time); restarts show as "
              "changes", registry=registry).set(started)
        Gauge("nvshare_scheduler_restarted", "1 when this daemon started over a previous daemon's sockets, "
              "whose clients may reconnect", registry=registry).set(1 if restarted else 0)
        Gauge("nvshare_scheduler_info", "The scheduler's version", ("version",), registry=registry).labels(
            __version__).set(1)

        # Counters with fixed label values have their samples from the start.
        for code in ERROR_CODE.words:
            self.rejected.labels(code)
        for label in ("client", "device"):
            self.overflowed.labels(label)

        self._client_series = Places(CLIENT_SERIES, CLIENT_SERIES_PER_UID)
        self._device_ids = Places(DEVICE_LABELS, DEVICE_LABELS)
        self._who: dict[str, tuple[str, ...]] = {}  # client display id -> (pod, namespace, program, user)
        self._uid: dict[str, int | None] = {}  # client display id -> its kernel-verified uid
        self._overflowed: set[str] = set()  # clients counted under OVERFLOW (counted once each)
        # (client, device) -> (since, counted until) of a wait for the lock
        self._waiting: dict[tuple[str, str], tuple[float, float]] = {}
        # grant -> (since, counted until, client labels) of a hold
        self._holds: dict[int, tuple[float, float, tuple[str, ...]]] = {}
        self._admitting: dict[tuple[str, str], float] = {}  # (client, device) -> since, of an admission wait
        self._last_grantee: dict[str, str] = {}  # device -> client of its latest grant
        self._handoff_from: dict[str, float] = {}  # device -> when its holder was asked or let go
        self._restoring: dict[int, float] = {}  # grant -> its time, of a grant with memory to bring back
        # (client, device) -> the first PREFETCH of a wait: its memory began to come back then
        self._restoring_ahead: dict[tuple[str, str], float] = {}
        self._moved_seen: dict[tuple[str, str], int] = {}  # (device, direction) -> the status total counted
        self._latest = 0.0  # the time of the latest event observed (the core's clock)
        self._overflow_zeroed = False  # OVERFLOW's device counters are at 0 once it is used
        self._turns: dict[str, float] = {}  # gang id -> when its current turn began
        # Label sets whose series were removed so far: each removal scans every metric's series
        # (about 0.5 ms), so a scrape that evicts yields after each one (_set_gauges).
        self._removals = 0

    # --- labels ---------------------------------------------------------------------------

    def _device(self, device: str, counted: bool = True) -> str:
        """`device`, or OVERFLOW when DEVICE_LABELS devices in use have series already. A
        device seen in a lock event counts as in use until a snapshot no longer shows it."""
        new = device not in self._device_ids
        placed, evicted = self._device_ids.take(device, None, device)
        for gone in evicted:
            self._remove_series(device=str(gone))
            self._last_grantee.pop(str(gone), None)
            self._handoff_from.pop(str(gone), None)
        if placed:
            if new:
                self._zero_device_counters(device)
            return device
        if counted:
            self.overflowed.labels("device").inc()
        if not self._overflow_zeroed:
            self._overflow_zeroed = True
            self._zero_device_counters(OVERFLOW)
        return OVERFLOW

    def _zero_device_counters(self, device: str) -> None:
        """A device's counters, at 0 from when it is first seen (a panel reads 0, not "No data")."""
        self.handoffs.labels(device)
        self.revokes.labels(device)
        for reason in DROP_REASON.words:
            self.drops.labels(device, reason)
        for direction in ("out", "in"):
            self.swap_requested.labels(device, direction)
            self.swap_moved.labels(device, direction)
        for reason in REFUSE_REASON.words:
            self.admission_refused.labels(device, reason)

    def _client_labels(self, device: str, client: str, counted: bool = True) -> tuple[str, ...]:
        """The labels of a client metric of `client` on `device`; OVERFLOW for all of them
        when the client's uid, or everyone, has as many series sets as it may."""
        who = self._who.get(client)
        labels = (self._device(device, counted), *(who or ()))
        if who is not None and labels[0] != OVERFLOW:
            placed, evicted = self._client_series.take(labels, self._uid.get(client), client)
            for gone in evicted:
                self._remove_client_series(gone)
            if placed:
                return labels
            if client not in self._overflowed:
                self._overflowed.add(client)
                self.overflowed.labels("client").inc()
        return (OVERFLOW,) * len(CLIENT_LABELS)

    def _remove_client_series(self, labels: object) -> None:
        assert isinstance(labels, tuple)
        self._remove_series(**dict(zip(CLIENT_LABELS, labels)))

    def _remove_series(self, **labels: str) -> None:
        """Forget every series whose labels include `labels`, in every metric that has them."""
        self._removals += 1
        for metric in vars(self).values():
            if isinstance(metric, MetricWrapperBase):
                try:
                    metric.remove_by_labels(labels)
                except ValueError:
                    pass  # a metric without these labels

    # --- fed by the pump ------------------------------------------------------------------

    def observe(self, event: ev.Event, actions: Iterable[ev.Action]) -> None:
        """The core handled `event` and returned `actions`."""
        self._latest = max(self._latest, event.now)
        for action in actions:
            if type(action) is ev.LockEvent:
                self._on_lock_event(event, action)
            elif type(action) is ev.Send:
                self._on_message(action.message)

    def _on_message(self, message: protocol.Message) -> None:
        if isinstance(message, protocol.Drop) and message.evict:
            self.swap_requested.labels(self._device(message.device), "out").inc(message.evict)
        elif isinstance(message, protocol.Evict):
            self.swap_requested.labels(self._device(message.device), "out").inc(message.bytes)
        elif isinstance(message, protocol.Grant) and message.prefetch:
            self.swap_requested.labels(self._device(message.device), "in").inc(message.prefetch)

    def rejected_message(self, code: str) -> None:
        self.rejected.labels(code).inc()

    def _on_lock_event(self, event: ev.Event, entry: ev.LockEvent) -> None:
        kind, device, client, now = entry.kind, entry.device, entry.client, entry.now
        if kind == "register":
            if type(event) is ev.Register:
                info = event.info
                self._who[client] = tuple(value[:LABEL_VALUE_MAX]
                                          for value in (info.pod, info.namespace, info.program, info.user))
                self._uid[client] = info.uid
        elif kind == "acquire":
            self._waiting[(client, device)] = (now, now)
        elif kind == "admit-wait":
            self._admitting.setdefault((client, device), now)
        elif kind in ("admitted", "refused"):
            self._end_admission(client, device, now)
            if kind == "refused":
                self.admission_refused.labels(self._device(device), entry.detail.rpartition(" ")[2]).inc()
        elif kind == "prefetch":
            self._restoring_ahead.setdefault((client, device), now)
            more = dict(field.partition("=")[::2] for field in entry.detail.split()).get("bytes", "0")
            self.swap_requested.labels(self._device(device), "in").inc(int(more) if more.isdigit() else 0)
        elif kind == "grant":
            coming_back_since = self._restoring_ahead.pop((client, device), now)
            self._on_grant(entry)
            if "swapped=" in entry.detail:
                self._restoring[entry.grant] = coming_back_since
        elif kind == "restored":
            # A grant's memory back, or a waiter's ahead of its grant (grant 0).
            key = (client, device)
            began = self._restoring.pop(entry.grant, None) if entry.grant else self._restoring_ahead.pop(key, None)
            if began is not None:
                self.swap_in_seconds.labels(self._device(device)).observe(now - began)
        elif kind == "drop":
            self.drops.labels(self._device(device), entry.detail).inc()
            self._handoff_from.setdefault(device, now)
        elif kind in ("release", "revoke", "lost"):
            self._restoring.pop(entry.grant, None)
            if kind == "revoke":
                self.revokes.labels(self._device(device)).inc()
            self._end_hold(entry)
            self._end_wait(client, device, now)
            if kind == "lost":
                self._end_admission(client, device, now)
        elif kind == "gang-turn":
            self.gang_turns.inc()
            self._turns[_gang_of(entry.detail)] = now
        elif kind == "gang-end":
            began = self._turns.pop(_gang_of(entry.detail), None)
            if began is not None:
                self.gang_turn_seconds.observe(now - began)
        elif kind == "gang-incomplete":
            self.gang_incomplete.inc()
        elif kind == "unregister":
            if device:  # a BYE while holding or waiting
                self._end_hold(entry)
                self._end_wait(client, device, now)
                self._end_admission(client, device, now)
            else:
                self._who.pop(client, None)
                self._uid.pop(client, None)
                self._overflowed.discard(client)
                self._client_series.release(client)

    def _on_grant(self, entry: ev.LockEvent) -> None:
        device, client, now = entry.device, entry.client, entry.now
        labels = self._client_labels(device, client)
        self.grants.labels(*labels).inc()
        self._holds[entry.grant] = (now, now, labels)
        since = self._end_wait(client, device, now)
        if since is not None:
            self.wait_seconds.labels(*labels).observe(now - since)
            asked = self._handoff_from.pop(device, None)
            if asked is not None:
                self.handoff_seconds.labels(self._device(device)).observe(now - asked)
        previous = self._last_grantee.get(device)
        if previous is not None and previous != client:
            self.handoffs.labels(self._device(device)).inc()
        self._last_grantee[device] = client

    def _end_wait(self, client: str, device: str, now: float) -> float | None:
        """The wait is over: count its last part; its start, if there was one."""
        self._restoring_ahead.pop((client, device), None)
        waiting = self._waiting.pop((client, device), None)
        if waiting is None:
            return None
        since, counted = waiting
        self.waited.labels(*self._client_labels(device, client)).inc(max(0.0, now - counted))
        return since

    def _end_admission(self, client: str, device: str, now: float) -> None:
        since = self._admitting.pop((client, device), None)
        if since is not None:
            self.admission_wait.labels(*self._client_labels(device, client)).observe(now - since)

    def _count_time_so_far(self) -> None:
        """Bring the time held and waited up to the latest event: holds and waits still going on
        count too (a client alone on a GPU may hold it for hours)."""
        now = self._latest
        for grant, (since, counted, labels) in self._holds.items():
            if now > counted:
                self.held.labels(*labels).inc(now - counted)
                self._holds[grant] = (since, now, labels)
        for (client, device), (since, counted) in self._waiting.items():
            if now > counted:
                self.waited.labels(*self._client_labels(device, client)).inc(now - counted)
                self._waiting[(client, device)] = (since, now)

    def _end_hold(self, entry: ev.LockEvent) -> None:
        held = self._holds.pop(entry.grant, None)
        if held is None:
            return
        since, counted, labels = held
        self.hold_seconds.labels(*labels).observe(entry.now - since)
        self.held.labels(*labels).inc(max(0.0, entry.now - counted))
        device = entry.device
        if any(waiting_device == device for _, waiting_device in self._waiting):
            self._handoff_from.setdefault(device, entry.now)
        else:
            self._handoff_from.pop(device, None)

    # --- a scrape -------------------------------------------------------------------------

    def render(self, status: dict[str, Any]) -> bytes:
        """The exposition text, gauges set from `status` (the control protocol's status
        document, docs/protocol.md), in one go."""
        for _ in self._set_gauges(status):
            pass
        return b"".join(_pieces(self.registry))

    async def render_in_steps(self, status: dict[str, Any]) -> bytes:
        """As render(), letting the other tasks (the pump) run after every GAUGE_STEP series sets
        and every RENDER_STEP lines: setting the gauges of a user's 512 (client, device) pairs and
        formatting a few thousand series take tens of milliseconds each on a busy small machine,
        which must not sit in front of a handoff. What the pump changes meanwhile (counters, a
        label set evicted) shows in this scrape or the next."""
        for _ in self._set_gauges(status):
            await trio.lowlevel.checkpoint()
        pieces = []
        for piece in _pieces(self.registry):
            pieces.append(piece)
            await trio.lowlevel.checkpoint()
        return b"".join(pieces)

    def _set_gauges(self, status: dict[str, Any]) -> Iterator[None]:
        """Set the gauges from `status`, yielding after every GAUGE_STEP (client, device) pairs
        or devices, and after every label set evicted to make room for one (render_in_steps
        lets the pump run there): under a churn of devices or clients most of them evict one."""
        self._count_time_so_far()
        for gauge in (self.device_mode, self.device_tq, self.device_total, self.device_budget, self.device_used,
                      self.device_resident, self.device_swapped, self.device_holders, self.device_waiters,
                      self.client_memory, self.client_holding, self.client_resident, self.client_swapped,
                      self.client_weight, self.client_priority, self.gangs, self.gang_members):
            gauge.clear()  # devices and clients that are gone leave no stale series
        shown = {dev["device"] for dev in status["devices"]}
        for device in list(self._device_ids):
            if device not in shown:
                self._device_ids.unused(device)  # the core forgot it: its place may be taken
        weights: dict[tuple[str, ...], tuple[int, int]] = {}
        done, removals = 0, self._removals
        for client in status["clients"]:
            for device, pair in client["devices"].items():
                done += 1
                if done % GAUGE_STEP == 0 or self._removals != removals:
                    removals = self._removals
                    yield
                labels = self._client_labels(device, client["client"], counted=False)
                self.client_memory.labels(*labels).inc(pair["used"])
                self.client_holding.labels(*labels).inc(1 if pair["state"] in ("holding", "draining") else 0)
                self.client_resident.labels(*labels).inc(pair.get("resident", pair["used"]))
                self.client_swapped.labels(*labels).inc(pair.get("swapped", 0))
                weight, priority = weights.get(labels, (0, 0))
                weights[labels] = (max(weight, client.get("weight", 1)), max(priority, client.get("priority", 0)))
        for labels, (weight, priority) in weights.items():
            self.client_weight.labels(*labels).set(weight)
            self.client_priority.labels(*labels).set(priority)
        admission = status.get("admission")
        if admission is not None:
            self.admission_enabled.set(1 if admission["enabled"] else 0)
            self.admission_capacity.set(admission["capacity"] or 0)
            self.admission_reserved.set(admission["reserved"])
            self.admission_spill.set(admission["spill"] or 0)
            self.admission_waiters.set(len(admission["waiters"]))
        for dev in status["devices"]:
            done += 1
            if done % GAUGE_STEP == 0 or self._removals != removals:
                removals = self._removals
                yield
            device = self._device(dev["device"], counted=False)
            for mode in MODES:
                self.device_mode.labels(device, mode).set(1 if dev["mode"] == mode else 0)
            self.device_tq.labels(device).set(dev["tq"])
            self.device_total.labels(device).inc(dev["total"])
            self.device_budget.labels(device).inc(dev["budget"])
            self.device_used.labels(device).inc(dev["used"])
            self.device_resident.labels(device).inc(dev["resident"])
            self.device_swapped.labels(device).inc(dev["swapped"])
            self.device_holders.labels(device).inc(len(dev["holders"]))
            self.device_waiters.labels(device).inc(len(dev["waiters"]))
            for direction in ("out", "in"):
                # The core's totals since the device was first seen; a device it forgot and
                # knows again starts from 0, which is counted from there.
                total = dev.get(f"moved_{direction}", 0)
                seen = self._moved_seen.get((dev["device"], direction), 0)
                self.swap_moved.labels(device, direction).inc(total - seen if total >= seen else total)
                self._moved_seen[(dev["device"], direction)] = total
        for state in GANG_STATES:
            self.gangs.labels(state)
            self.gang_members.labels(state)
        for gang in status.get("gangs", []):
            state = gang["state"] if gang["state"] in GANG_STATES else OVERFLOW
            self.gangs.labels(state).inc()
            self.gang_members.labels(state).inc(len(gang["members"]))
        self.clients.set(len(status["clients"]))


def _gang_of(detail: str) -> str:
    """The gang id of a gang event's detail (its first field, `gang=g3`)."""
    return detail.split(" ", 1)[0].partition("=")[2]


class _Family:
    """A collector of one prepared metric family, for generate_latest."""

    def __init__(self, family: Metric) -> None:
        self.family = family

    def collect(self) -> list[Metric]:
        return [self.family]


def _pieces(registry: CollectorRegistry) -> Iterator[bytes]:
    """The exposition text in pieces of at most RENDER_STEP samples. `_created` samples are
    left out: they would double the output and Prometheus does not need them."""
    for family in registry.collect():
        samples = [sample for sample in family.samples if not sample.name.endswith("_created")]
        for start in range(0, max(1, len(samples)), RENDER_STEP):
            piece = Metric(family.name, family.documentation, family.type, family.unit)
            piece.samples = samples[start:start + RENDER_STEP]
            text = generate_latest(_Family(piece))
            if start:  # one family: its # HELP and # TYPE lines only once
                text = text.split(b"\n", 2)[2]
            yield text
