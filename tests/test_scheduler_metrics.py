"""Prometheus metrics of the scheduler (docs/metrics.md): the observer on virtual time, and a
real daemon scraped over HTTP on loopback while client processes take turns."""

from __future__ import annotations

import os
import re
import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from nvshare_py.scheduler import events as ev
from nvshare_py.scheduler import metrics as m
from nvshare_py.scheduler import views
from nvshare_py.scheduler.admission import AdmissionConfig
from nvshare_py.scheduler.core import CoreConfig, SchedulerCore
from nvshare_py.scheduler.metrics import SchedulerMetrics
from nvshare_py.testing.scheduler import wait_for

GPU = "GPU-5151ad00-0000-4000-8000-000000000000"
DOCS = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"


def samples(text: str | bytes) -> dict[tuple[str, frozenset], float]:
    if isinstance(text, bytes):
        text = text.decode()
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return found


def value(found: dict, name: str, **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    assert key in found, f"{name}{labels} not among {sorted({n for n, _ in found})}"
    return found[key]


# --- the observer, on the core's virtual time ---------------------------------------------------


class Driven:
    """A SchedulerCore whose every answer goes to a SchedulerMetrics, as the daemon's pump does."""

    def __init__(self) -> None:
        self.core = SchedulerCore(CoreConfig(tq=10.0, grace=1.0, heartbeat_timeout=1e6, recovery=0.0), 0.0)
        self.metrics = SchedulerMetrics(restarted=False, started=1.0)

    def feed(self, event: ev.Event) -> list[ev.Action]:
        actions = self.core.handle(event)
        self.metrics.observe(event, actions)
        return actions

    def register(self, key: str, now: float, pod: str = "", namespace: str = "ns", program: str = "train",
                 user: str = "alice") -> None:
        info = ev.ClientInfo(pid=1, session=key, pod=pod or key, namespace=namespace, program=program, user=user)
        self.feed(ev.Register(now, key, info))

    def scrape(self, now: float) -> dict:
        return samples(self.metrics.render(views.status(self.core, now, lambda t: t)))


def test_waits_holds_and_handoffs_are_measured_on_the_cores_clock():
    d = Driven()
    d.register("a", 0.0)
    d.register("b", 0.0)
    d.feed(ev.AcquireRequest(1.0, "a", GPU))  # granted at once: a wait of 0
    d.feed(ev.AcquireRequest(2.0, "b", GPU))  # waits behind a
    d.feed(ev.Tick(11.0))  # a's quantum is over: DROP, the handoff clock starts
    d.feed(ev.ReleaseReport(11.25, "a", GPU, 1))  # b is granted at 11.25
    found = d.scrape(12.0)
    b = dict(device=GPU, pod="b", namespace="ns", program="train", user="alice")
    a = dict(b, pod="a")
    assert value(found, "nvshare_client_wait_seconds_sum", **b) == pytest.approx(9.25)
    assert value(found, "nvshare_client_wait_seconds_count", **a) == 1
    assert value(found, "nvshare_client_wait_seconds_sum", **a) == 0
    assert value(found, "nvshare_client_hold_seconds_sum", **a) == pytest.approx(10.25)
    assert value(found, "nvshare_scheduler_handoff_seconds_sum", device=GPU) == pytest.approx(0.25)
    assert value(found, "nvshare_device_handoffs_total", device=GPU) == 1
    assert value(found, "nvshare_device_drops_total", device=GPU, reason="quantum") == 1
    assert value(found, "nvshare_client_grants_total", **b) == 1
    assert value(found, "nvshare_client_holding", **b) == 1
    assert value(found, "nvshare_client_holding", **a) == 0
    assert value(found, "nvshare_device_holders", device=GPU) == 1
    assert value(found, "nvshare_device_waiters", device=GPU) == 0
    assert value(found, "nvshare_device_mode", device=GPU, mode="on") == 1
    assert value(found, "nvshare_device_mode", device=GPU, mode="auto") == 0
    assert value(found, "nvshare_device_time_quantum_seconds", device=GPU) == 10
    assert value(found, "nvshare_scheduler_clients") == 2


def test_a_holder_that_misses_its_grace_is_counted_as_a_revoke():
    d = Driven()
    d.register("a", 0.0)
    d.register("b", 0.0)
    d.feed(ev.AcquireRequest(0.0, "a", GPU))
    d.feed(ev.AcquireRequest(0.0, "b", GPU))
    d.feed(ev.Tick(10.0))  # DROP with 1 s of grace
    d.feed(ev.Tick(11.0))  # grace over: revoked, b granted
    found = d.scrape(11.0)
    assert value(found, "nvshare_device_revokes_total", device=GPU) == 1
    assert value(found, "nvshare_scheduler_handoff_seconds_sum", device=GPU) == pytest.approx(1.0)
    assert value(found, "nvshare_device_holders", device=GPU) == 2  # the revoked grant is not released yet


def test_memory_gauges_follow_the_reports_and_forget_clients_that_left():
    d = Driven()
    d.register("a", 0.0)
    d.register("b", 0.0)
    d.feed(ev.DeviceMeasured(0.0, GPU, 8000))
    d.feed(ev.DeviceInfo(0.0, "a", GPU, 8000))
    d.feed(ev.MemoryReport(0.0, "a", GPU, 3000))
    d.feed(ev.MemoryReport(0.0, "b", GPU, 500))
    d.feed(ev.AcquireRequest(0.0, "a", GPU))
    found = d.scrape(1.0)
    assert value(found, "nvshare_device_memory_total_bytes", device=GPU) == 8000
    assert value(found, "nvshare_device_memory_budget_bytes", device=GPU) == 8000
    assert value(found, "nvshare_device_memory_used_bytes", device=GPU) == 3500
    # b does not hold the lock, but nothing of it was swapped out: its memory is resident too.
    assert value(found, "nvshare_device_memory_resident_bytes", device=GPU) == 3500
    b = dict(device=GPU, pod="b", namespace="ns", program="train", user="alice")
    assert value(found, "nvshare_client_memory_used_bytes", **b) == 500
    assert value(found, "nvshare_client_memory_resident_bytes", **b) == 500
    assert value(found, "nvshare_client_memory_swapped_bytes", **b) == 0

    d.feed(ev.Unregister(2.0, "b", "bye"))
    found = d.scrape(2.0)
    assert ("nvshare_client_memory_used_bytes", frozenset(b.items())) not in found
    assert value(found, "nvshare_device_memory_used_bytes", device=GPU) == 3000


def test_swaps_asked_at_a_handoff_over_budget_are_counted_in_both_directions():
    d = Driven()
    d.register("a", 0.0)
    d.register("b", 0.0)
    for key in ("a", "b"):
        d.feed(ev.DeviceMeasured(0.0, GPU, 16000))
        d.feed(ev.DeviceInfo(0.0, key, GPU, 16000))
        d.feed(ev.MemoryReport(0.0, key, GPU, 12000, 0))
    d.feed(ev.AcquireRequest(0.0, "a", GPU))
    d.feed(ev.MemoryReport(0.0, "a", GPU, 12000, 12000))
    d.feed(ev.AcquireRequest(0.0, "b", GPU))
    d.feed(ev.Tick(10.0))  # DROP evict=8000 to a
    d.feed(ev.ReleaseReport(10.0, "a", GPU, 1, "drop", 4000))
    d.feed(ev.MemoryReport(10.0, "b", GPU, 12000, 12000))
    d.feed(ev.AcquireRequest(10.0, "a", GPU))
    d.feed(ev.Tick(20.0))  # DROP evict=8000 to b
    d.feed(ev.ReleaseReport(20.0, "b", GPU, 2, "drop", 4000))  # a is told to bring its 8000 back (PREFETCH)
    found = d.scrape(20.0)
    assert value(found, "nvshare_device_swap_requested_bytes_total", device=GPU, direction="out") == 16000
    assert value(found, "nvshare_device_swap_requested_bytes_total", device=GPU, direction="in") == 8000
    # a has not reported bringing its 8000 back yet: both halves are out until it does.
    assert value(found, "nvshare_device_memory_swapped_bytes", device=GPU) == 16000
    d.feed(ev.MemoryReport(21.5, "a", GPU, 12000, 12000))  # all back, ahead of its grant
    found = d.scrape(21.5)
    assert value(found, "nvshare_device_memory_swapped_bytes", device=GPU) == 8000
    # Its swap-in, from the PREFETCH to the report: what its request waited for its memory.
    assert value(found, "nvshare_device_swap_in_seconds_count", device=GPU) == 1
    assert value(found, "nvshare_device_swap_in_seconds_sum", device=GPU) == 1.5


def register(d: "Driven", key: str, now: float, pod: str, uid: int) -> None:
    d.feed(ev.Register(now, key, ev.ClientInfo(pid=1, session=key, uid=uid, pod=pod, namespace="ns", program="train",
                                                 user="alice")))


def client_pods(found: dict) -> set[str]:
    return {dict(labels).get("pod") for name, labels in found if name == "nvshare_client_memory_used_bytes"}


def test_client_series_are_bounded_per_uid_and_the_rest_is_counted_as_overflow():
    # Issue 23: one user's invented label sets took the series to hundreds of thousands.
    d = Driven()
    extra = 5
    for index in range(m.CLIENT_SERIES_PER_UID + extra):
        register(d, f"k{index}", 0.0, f"pod-{index}", uid=1000)
        d.feed(ev.AcquireRequest(0.0, f"k{index}", GPU))
    register(d, "other", 0.0, "elsewhere", uid=1001)  # another user still gets series of its own
    d.feed(ev.AcquireRequest(0.0, "other", GPU))
    found = d.scrape(0.0)
    pods = client_pods(found)
    assert len(pods) == m.CLIENT_SERIES_PER_UID + 2  # the uid's own, _other, and the other uid's
    assert m.OVERFLOW in pods and "elsewhere" in pods and f"pod-{m.CLIENT_SERIES_PER_UID}" not in pods
    assert value(found, "nvshare_client_holding", device=GPU, pod="pod-0", namespace="ns", program="train",
                 user="alice") == 1
    assert value(found, "nvshare_scheduler_label_overflows_total", label="client") == extra


def test_series_of_clients_that_left_make_room_for_new_ones():
    d = Driven()
    for index in range(m.CLIENT_SERIES_PER_UID):
        register(d, f"k{index}", 0.0, f"pod-{index}", uid=1000)
        d.feed(ev.AcquireRequest(0.0, f"k{index}", GPU))
    d.feed(ev.Unregister(1.0, "k1", "bye"))
    register(d, "new", 2.0, "pod-new", uid=1000)
    d.feed(ev.AcquireRequest(2.0, "new", GPU))
    pods = client_pods(d.scrape(2.0))
    # k0 held the lock and still does; k1 left: its series went to make room.
    assert "pod-new" in pods and "pod-1" not in pods and "pod-0" in pods and m.OVERFLOW not in pods


def test_device_labels_are_bounded_and_forgotten_devices_make_room():
    d = Driven()
    # One registration may use at most protocol.MAX_DEVICES devices: spread them over two.
    d.register("a", 0.0)
    d.register("b", 0.0)
    for index in range(m.DEVICE_LABELS + 3):
        d.feed(ev.AcquireRequest(0.0, "a" if index % 2 else "b", f"GPU-{index}"))
    found = d.scrape(0.0)
    devices = {dict(labels)["device"] for name, labels in found if name == "nvshare_device_holders"}
    assert len(devices) == m.DEVICE_LABELS + 1 and m.OVERFLOW in devices
    assert value(found, "nvshare_device_holders", device=m.OVERFLOW) == 3
    # Issue 23: per-device state was never freed. Once the core forgets the devices (their
    # clients left), new ones get series of their own and the old ones' series go.
    d.feed(ev.Unregister(1.0, "a", "bye"))
    d.feed(ev.Unregister(1.0, "b", "bye"))
    d.scrape(1.0)
    d.register("c", 2.0)
    d.feed(ev.AcquireRequest(2.0, "c", "GPU-new"))
    found = d.scrape(2.0)
    named = {dict(labels).get("device") for name, labels in found}
    assert "GPU-new" in named and "GPU-0" not in named


def test_counters_have_a_sample_from_the_start():
    """A panel over a counter reads 0 before anything happened, not "No data"."""
    d = Driven()
    found = d.scrape(0.0)
    assert value(found, "nvshare_scheduler_rejected_messages_total", code="malformed") == 0
    assert value(found, "nvshare_scheduler_label_overflows_total", label="client") == 0
    d.register("a", 0.0)
    d.feed(ev.AcquireRequest(0.0, "a", GPU))
    found = d.scrape(0.0)
    for name, labels in (("nvshare_device_handoffs_total", {}), ("nvshare_device_revokes_total", {}),
                         ("nvshare_device_drops_total", {"reason": "quantum"}),
                         ("nvshare_device_swap_requested_bytes_total", {"direction": "in"}),
                         ("nvshare_device_admission_refused_total", {"reason": "timeout"})):
        assert value(found, name, device=GPU, **labels) == 0


def test_time_held_and_waited_is_counted_per_user_while_it_goes_on():
    d = Driven()
    d.register("a", 0.0, user="alice")
    d.register("b", 0.0, user="bob", pod="b")
    d.feed(ev.AcquireRequest(1.0, "a", GPU))
    d.feed(ev.AcquireRequest(2.0, "b", GPU))
    d.feed(ev.Alive(5.0, "a"))  # any event moves the observer's clock: a heartbeat
    alice = dict(device=GPU, pod="a", namespace="ns", program="train", user="alice")
    bob = dict(device=GPU, pod="b", namespace="ns", program="train", user="bob")
    found = d.scrape(5.0)
    assert value(found, "nvshare_client_held_seconds_total", **alice) == pytest.approx(4.0)  # still holding
    assert value(found, "nvshare_client_waited_seconds_total", **bob) == pytest.approx(3.0)  # still waiting
    d.feed(ev.Tick(11.0))  # a's quantum is over: DROP
    d.feed(ev.ReleaseReport(11.5, "a", GPU, 1))  # b granted
    d.feed(ev.Alive(12.5, "b"))
    found = d.scrape(12.5)
    assert value(found, "nvshare_client_held_seconds_total", **alice) == pytest.approx(10.5)
    assert value(found, "nvshare_client_waited_seconds_total", **bob) == pytest.approx(9.5)
    assert value(found, "nvshare_client_held_seconds_total", **bob) == pytest.approx(1.0)
    # Counted once: a scrape between adds nothing twice.
    assert value(d.scrape(12.5), "nvshare_client_held_seconds_total", **alice) == pytest.approx(10.5)


def test_weights_priorities_and_admission_are_shown():
    d = Driven()
    d.register("a", 0.0)
    d.feed(ev.AcquireRequest(0.0, "a", GPU))
    d.feed(ev.SetWeight(0.0, 4, client="c1"))
    d.feed(ev.SetPriority(0.0, 2, client="c1"))
    labels = dict(device=GPU, pod="a", namespace="ns", program="train", user="alice")
    found = d.scrape(0.0)
    assert value(found, "nvshare_client_weight", **labels) == 4
    assert value(found, "nvshare_client_priority", **labels) == 2
    status = dict(views.status(d.core, 0.0, lambda t: t), admission=views.admission_status(d.core, 0.0, lambda t: t))
    found = samples(d.metrics.render(status))
    assert value(found, "nvshare_admission_enabled") == 0 and value(found, "nvshare_admission_waiters") == 0


def test_an_admission_wait_is_measured_and_a_refusal_counted():
    d = Driven()
    d.core = SchedulerCore(CoreConfig(tq=10.0, grace=1.0, heartbeat_timeout=1e6, recovery=0.0,
                                      admission=AdmissionConfig(spill=0, timeout=5.0)), 0.0)
    d.feed(ev.DeviceMeasured(0.0, GPU, 1000))  # the daemon's own measurement sizes the device
    d.register("a", 0.0)
    d.feed(ev.DeviceInfo(0.0, "a", GPU, 1000))
    d.feed(ev.AdmitRequest(1.0, "a", GPU, 1, 2000))  # more than the whole capacity: refused at once
    d.register("b", 1.0)
    d.feed(ev.DeviceInfo(1.0, "b", GPU, 1000))
    d.feed(ev.MemoryReport(1.0, "a", GPU, 900))
    d.feed(ev.AdmitRequest(2.0, "b", GPU, 1, 500))  # waits for room
    d.feed(ev.Tick(7.0))  # timeout: refused
    found = d.scrape(7.0)
    assert value(found, "nvshare_device_admission_refused_total", device=GPU, reason="too-large") == 1
    assert value(found, "nvshare_device_admission_refused_total", device=GPU, reason="timeout") == 1
    b = dict(device=GPU, pod="b", namespace="ns", program="train", user="alice")
    assert value(found, "nvshare_client_admission_wait_seconds_sum", **b) == pytest.approx(5.0)


def scrape_in_steps(metrics: SchedulerMetrics, status: dict, monkeypatch, counted: str) -> tuple[bytes, list[int]]:
    """render_in_steps(status) beside a stand-in for the pump, and how many calls of the metrics'
    method `counted` the scrape made between two runs of the pump."""
    import trio

    calls = 0
    real = getattr(metrics, counted)

    def counting(*args, **kwargs):
        nonlocal calls
        calls += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(metrics, counted, counting)
    between: list[int] = []

    async def scrape() -> bytes:
        body = b""
        async with trio.open_nursery() as nursery:
            async def pump() -> None:
                seen = 0  # what the scrape had done when the pump last ran
                while True:
                    between.append(calls - seen)
                    seen = calls
                    await trio.lowlevel.checkpoint()

            nursery.start_soon(pump)
            body = await metrics.render_in_steps(status)
            nursery.cancel_scope.cancel()
        return body

    body = trio.run(scrape)
    monkeypatch.undo()
    assert sum(between) == calls
    return body, between


def test_a_scrape_of_a_large_state_lets_the_pump_run_every_few_series_and_shows_the_same(monkeypatch):
    """Issue 23: a user's 8 registrations of 64 devices each (its quota, 512 pairs) made setting the
    gauges one step of tens of milliseconds, in front of every handoff. Now the pump gets a chance
    after every GAUGE_STEP series sets and every RENDER_STEP lines, and the text is as in one go."""
    d = Driven()
    for n in range(8):
        d.register(f"c{n}", 0.0, program=f"p{n}")
        for k in range(64):
            d.feed(ev.DeviceInfo(0.0, f"c{n}", f"GPU-{k:032x}", 1 << 30))
    status = views.status(d.core, 1.0, lambda t: t)
    whole = samples(d.metrics.render(status))
    body, between = scrape_in_steps(d.metrics, status, monkeypatch, "_client_labels")
    assert sum(between) >= 512
    # Trio runs each batch of ready tasks in a random order: the scrape may run twice between two
    # runs of the pump (last in one batch, first in the next).
    assert max(between) <= 2 * m.GAUGE_STEP, sorted(between)[-5:]
    assert samples(body) == whole


def test_a_scrape_under_a_churn_of_devices_lets_the_pump_run_after_each_label_set_it_evicts(monkeypatch):
    """Each device new to the metrics evicts one the core forgot, and each eviction scans every
    metric's series (bench_floods.py device-churn): the scrape yields after each."""
    d = Driven()
    for name, first in (("a", 0), ("b", 1000)):
        d.register(name, 0.0)
        for k in range(m.DEVICE_LABELS // 2):
            d.feed(ev.DeviceInfo(0.0, name, f"GPU-{first + k}", 1 << 30))
    d.scrape(0.0)  # the first 64 devices have their places
    for name, first in (("a", 2000), ("b", 3000)):
        d.feed(ev.Unregister(1.0, name, "bye"))
        d.register(name + "2", 1.0)
        for k in range(m.DEVICE_LABELS // 2):
            d.feed(ev.DeviceInfo(1.0, name + "2", f"GPU-{first + k}", 1 << 30))
    body, between = scrape_in_steps(d.metrics, views.status(d.core, 2.0, lambda t: t), monkeypatch, "_remove_series")
    assert sum(between) >= m.DEVICE_LABELS  # every new device evicted an old one
    # One pair's labels may evict a device and a client's label set; and as in the test above, the
    # scrape may run twice between two runs of the pump.
    assert max(between) <= 2 * 2, sorted(between)[-5:]
    named = {dict(labels).get("device") for name, labels in samples(body)}
    assert "GPU-2000" in named and "GPU-0" not in named


def test_every_metric_is_documented_and_every_documented_one_exists():
    exposed = set()
    for family in Driven().metrics.registry.collect():
        if family.name.startswith("nvshare_"):
            exposed.add(family.name + "_total" if family.type == "counter" else family.name)
    documented = set(re.findall(r"^\| `(nvshare_[a-z_]+)`", DOCS.read_text(), re.MULTILINE))
    assert exposed == documented


# --- a real daemon, scraped over HTTP ------------------------------------------------------------


def metrics_address(scheduler) -> str:
    line = wait_for(lambda: re.search(r"serving metrics address=(\S+)", scheduler.log_text()),
                    what="the daemon to log its metrics address")
    return line.group(1)


def scrape(address: str, path: str = "/metrics") -> str:
    with urllib.request.urlopen(f"http://{address}{path}", timeout=30) as answer:
        assert answer.headers["Content-Type"].startswith("text/plain; version=")
        return answer.read().decode()


def scraped(address: str, condition, what: str) -> dict:
    """A scrape whose samples satisfy `condition` (scrapes are served from a snapshot up to
    metrics_http.SNAPSHOT_INTERVAL old)."""
    return wait_for(lambda: (found := samples(scrape(address))) and condition(found) and found, what=what,
                    interval=0.2)


def test_a_scrape_shows_clients_taking_turns(scheduler_factory):
    scheduler = scheduler_factory(metrics="127.0.0.1:0")
    address = metrics_address(scheduler)
    before = samples(scrape(address))
    assert value(before, "nvshare_scheduler_clients") == 0
    assert value(before, "nvshare_scheduler_restarted") == 0

    env = dict(scheduler.env, NVSHARE_POD_NAME="trainer", NVSHARE_POD_NAMESPACE="team-a")
    first, second = scheduler.agent(env=env), scheduler.agent(env=dict(env, NVSHARE_POD_NAME="notebook"))
    for _ in range(2):  # two rounds: first -> second -> first -> second
        first.send(f"acquire {GPU}")
        first.expect(f"granted {GPU}")
        second.send(f"acquire {GPU}")
        wait_for(lambda: scheduler.waiters(GPU) == [second.client_id], what="the second client to wait")
        scraped(address, lambda found: found.get(("nvshare_device_waiters", frozenset({("device", GPU)}))) == 1,
                 "a scrape showing one waiter")
        first.send(f"release {GPU}")
        second.expect(f"granted {GPU}")
        second.send(f"release {GPU}")
        second.expect(f"released {GPU}")
        # release() returns before the daemon has seen the RELEASE: without this wait the next
        # round's ACQUIRE could arrive first and make that release a handoff too.
        wait_for(lambda: scheduler.holders(GPU) == [], what="the device to be free")

    after = scraped(address, lambda found: found.get(("nvshare_scheduler_clients", frozenset())) == 2
                    and found.get(("nvshare_device_holders", frozenset({("device", GPU)}))) == 0,
                    "a scrape after the last release")
    notebook = {"device": GPU, "pod": "notebook", "namespace": "team-a"}
    program = next(dict(labels)["program"] for name, labels in after
                   if name == "nvshare_client_grants_total" and dict(labels).get("pod") == "notebook")
    notebook["program"] = program
    assert next(dict(labels)["user"] for name, labels in after
               if name == "nvshare_client_grants_total" and dict(labels).get("pod") == "notebook") \
        == views.user_name(os.geteuid())  # the uid the kernel reported, by name
    notebook["user"] = views.user_name(os.geteuid())
    assert value(after, "nvshare_scheduler_clients") == 2
    assert value(after, "nvshare_client_grants_total", **notebook) == 2
    assert value(after, "nvshare_client_wait_seconds_count", **notebook) == 2
    assert value(after, "nvshare_client_wait_seconds_sum", **notebook) > 0
    assert value(after, "nvshare_device_handoffs_total", device=GPU) == 3  # f -> s -> f -> s
    assert value(after, "nvshare_scheduler_handoff_seconds_count", device=GPU) == 2
    assert value(after, "nvshare_device_holders", device=GPU) == 0

    # A message that is not the protocol is answered with ERROR and counted.
    import zmq

    context = zmq.Context()
    try:
        raw = context.socket(zmq.DEALER)
        raw.connect(f"ipc://{scheduler.paths.client_socket}")
        raw.send(b"not the protocol")
        assert raw.poll(30_000), "no answer to a malformed message"
        raw.recv()
        raw.close(linger=0)
    finally:
        context.term()
    scraped(address, lambda found: found.get(("nvshare_scheduler_rejected_messages_total",
                                              frozenset({("code", "malformed")}))) == 1, "the rejection counted")


def test_a_silent_scraper_does_not_hold_up_others_or_the_lock(scheduler_factory):
    scheduler = scheduler_factory(metrics="127.0.0.1:0")
    host, port = metrics_address(scheduler).rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as silent:
        silent.sendall(b"GET /metrics HTTP/1.1\r\n")  # and never finishes its request
        assert "nvshare_scheduler_clients" in scrape(f"{host}:{port}")
        agent = scheduler.agent()
        agent.send(f"acquire {GPU}")
        agent.expect(f"granted {GPU}")
    with pytest.raises(urllib.error.HTTPError) as answer:
        scrape(f"{host}:{port}", "/elsewhere")
    assert answer.value.code == 404


def test_metrics_are_off_by_default(scheduler):
    assert "serving metrics" not in scheduler.log_text()


def test_a_taken_port_or_a_bad_address_refuses_to_start_before_touching_the_socket_dir(scheduler_factory):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        port = taken.getsockname()[1]
        scheduler = scheduler_factory(start=False)
        result = scheduler.run_to_exit("--metrics", f"127.0.0.1:{port}")
        assert result.returncode == 1
        assert f"cannot serve metrics on 127.0.0.1:{port}" in result.stderr
        assert not scheduler.paths.client_socket.exists()
    finally:
        taken.close()
    result = scheduler.run_to_exit("--metrics", "9400")
    assert result.returncode == 2 and "HOST:PORT" in result.stderr


def test_gangs_are_counted_without_a_label_per_gang():
    d = Driven()
    for key, device in (("r0", GPU), ("r1", GPU.replace("0000000000", "0000000001"))):
        info = ev.ClientInfo(pid=1, session=key, uid=1000, program="train", user="alice")
        d.feed(ev.Register(0.0, key, info, gang="job", gang_size=2))
        d.feed(ev.DeviceInfo(0.0, key, device, 0))
    d.feed(ev.AcquireRequest(1.0, "r0", GPU))
    found = d.scrape(2.0)
    assert value(found, "nvshare_gangs", state="holding") == 1
    assert value(found, "nvshare_gangs", state="waiting") == 0
    assert value(found, "nvshare_gang_members", state="holding") == 2
    assert value(found, "nvshare_gang_turns_total") == 1
    d.feed(ev.Unregister(4.0, "r1", "exited"))  # the other rank is dropped (gang) and releases
    d.feed(ev.ReleaseReport(4.5, "r0", GPU, 1, "drop"))
    found = d.scrape(5.0)
    assert value(found, "nvshare_gang_turn_seconds_count") == 1
    assert value(found, "nvshare_gang_turn_seconds_sum") == pytest.approx(3.5)
    assert value(found, "nvshare_device_drops_total", device=GPU, reason="gang") == 1
