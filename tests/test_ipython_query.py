"""QUERY / STATUS (docs/protocol.md, Queries): a process learns its own standing at the
scheduler, matched by its kernel-verified pid, without registering; the answer always fits one
message."""

from __future__ import annotations

import json
import os
import sys
import threading

import pytest
import zmq

from nvshare_py import protocol
from nvshare_py.client import Client
from nvshare_py.scheduler import views
from nvshare_py.scheduler.core import CoreConfig, SchedulerCore
from nvshare_py.scheduler.events import AcquireRequest, ClientInfo, DeviceInfo, DeviceMeasured, MemoryReport, Register, ReleaseReport, Send
from nvshare_py.scheduler.views import user_name
from nvshare_py.testing.scheduler import PATIENCE, run_child, wait_for

GPU0 = "GPU-5151ad00-0000-4000-8000-000000000000"
GPU1 = "GPU-5151ad00-0000-4000-8000-000000000001"


# --- the codec -------------------------------------------------------------------------------


def test_query_and_status_round_trip():
    assert protocol.decode(protocol.Query().encode()) == protocol.Query()
    status = protocol.Status.of({"pid": 7, "clients": ["c1"], "devices": []})
    decoded = protocol.decode(status.encode(), protocol.QUERY_REPLIES)
    assert decoded == status
    assert decoded.document() == {"pid": 7, "clients": ["c1"], "devices": []}


def test_status_may_fill_the_message_but_no_other_value_may_pass_1024_bytes():
    long_name = "é" * 1000  # 2000 bytes
    status = protocol.Status.of({"pid": 1, "clients": [], "devices": [], "note": long_name})
    assert protocol.decode(status.encode(), protocol.QUERY_REPLIES).document()["note"] == long_name
    with pytest.raises(protocol.ProtocolError) as refused:
        protocol.decode(b"NVSHARE/1 ERROR\ncode=malformed\ndetail=" + b"x" * 1025, protocol.QUERY_REPLIES)
    assert refused.value.code == "bad-field"
    with pytest.raises(protocol.ProtocolError) as refused:
        protocol.decode(b"NVSHARE/1 STATUS\njson=[1, 2]", protocol.QUERY_REPLIES)
    assert refused.value.code == "bad-field"


def test_status_is_not_a_message_registered_clients_accept():
    """Clients that never query (the interceptor, nvshare_py.client) never see STATUS and
    treat it as unknown."""
    status = protocol.Status.of({"pid": 1, "clients": [], "devices": []}).encode()
    with pytest.raises(protocol.ProtocolError) as refused:
        protocol.decode(status, protocol.SCHEDULER_MESSAGES)
    assert refused.value.code == "unknown-type"


def test_an_answer_too_large_for_one_message_leaves_devices_out_and_says_so():
    device = {"device": "GPU-" + "f" * 92, "name": "n" * 48, "holders": [{"client": "c1", "program": "p" * 48}] * 4}
    document = {"pid": 1, "clients": ["c1"], "devices": [dict(device, index=i) for i in range(20)]}
    encoded = protocol.Status.of(document).encode()
    assert len(encoded) <= protocol.MAX_MESSAGE
    shown = protocol.decode(encoded, protocol.QUERY_REPLIES).document()
    assert 0 < len(shown["devices"]) < 20
    assert shown["truncated"] == 20 - len(shown["devices"])
    assert [d["index"] for d in shown["devices"]] == list(range(len(shown["devices"])))  # the first kept


# --- the core --------------------------------------------------------------------------------


class Core:
    def __init__(self) -> None:
        self.now = 0.0
        self.core = SchedulerCore(CoreConfig(tq=30.0), 0.0)

    def feed(self, event):
        return self.core.handle(event)

    def register(self, key: str, host_pid: int, program: str = "python", pod: str = "") -> None:
        info = ClientInfo(pid=host_pid, session=f"{host_pid:016x}", host_pid=host_pid, uid=1000, program=program, pod=pod)
        self.feed(Register(self.now, key, info))
        self.feed(DeviceMeasured(self.now, GPU0, 16 << 30, "sim GPU"))
        self.feed(DeviceInfo(self.now, key, GPU0, 16 << 30, "sim GPU"))

    def grant_of(self, actions) -> int:
        return next(a.message.grant for a in actions if isinstance(a, Send) and isinstance(a.message, protocol.Grant))


def by_device(answer: dict) -> dict[str, dict]:
    return {entry["device"]: entry for entry in answer["devices"]}


def test_core_answers_about_the_asking_process_only():
    core = Core()
    core.register("a", host_pid=500, program="train", pod="nb-a")
    core.register("b", host_pid=600)
    core.feed(MemoryReport(0.0, "a", GPU0, 1000))
    core.feed(AcquireRequest(0.0, "a", GPU0))
    core.now = 2.0
    core.feed(AcquireRequest(2.0, "b", GPU0))

    mine = views.query(core.core, 600, now=5.0)
    assert mine["pid"] == 600 and mine["clients"] == ["c2"]
    (entry,) = mine["devices"]
    assert entry["state"] == "waiting" and entry["position"] == 1 and entry["waiters"] == 1
    assert entry["waiting_for"] == pytest.approx(3.0) and entry["wait_total"] == pytest.approx(3.0)
    # The holder, with its user and what is left of its quantum: what the waiting cell's note says.
    assert entry["holders"] == [{"client": "c1", "user": "", "program": "train", "pod": "nb-a", "namespace": "",
                                 "quantum_left": 25.0}]
    assert entry["used"] == 0 and entry["quantum_left"] is None and entry["last_wait"] is None
    assert entry["mode"] == "on" and entry["tq"] == 30.0 and entry["name"] == "sim GPU"

    holder = views.query(core.core, 500, now=5.0)["devices"][0]
    assert holder["state"] == "holding" and holder["used"] == 1000
    assert holder["quantum_left"] == pytest.approx(25.0) and holder["hold_total"] == pytest.approx(5.0)

    assert views.query(core.core, 700, now=5.0) == {"pid": 700, "clients": [], "devices": []}
    assert views.query(core.core, 0, now=5.0) == {"pid": 0, "clients": [], "devices": []}


def test_core_remembers_the_last_wait_and_who_was_ahead():
    core = Core()
    core.register("a", host_pid=500, program="first")
    core.register("b", host_pid=600, program="second")
    core.register("c", host_pid=700, program="third")
    grant = core.grant_of(core.feed(AcquireRequest(0.0, "a", GPU0)))
    core.feed(AcquireRequest(1.0, "b", GPU0))
    core.feed(AcquireRequest(2.0, "c", GPU0))
    assert by_device(views.query(core.core, 700, now=3.0))[GPU0]["position"] == 2
    grant_b = core.grant_of(core.feed(ReleaseReport(4.0, "a", GPU0, grant, "idle")))
    core.feed(ReleaseReport(6.5, "b", GPU0, grant_b, "idle"))

    third = views.query(core.core, 700, now=7.0)["devices"][0]
    assert third["state"] == "holding" and third["grants"] == 1
    assert third["last_wait"]["seconds"] == pytest.approx(4.5)
    assert [who["program"] for who in third["last_wait"]["held_by"]] == ["first", "second"]
    second = views.query(core.core, 600, now=7.0)["devices"][0]
    assert second["last_wait"]["seconds"] == pytest.approx(3.0)
    assert [who["client"] for who in second["last_wait"]["held_by"]] == ["c1"]


def test_core_lists_a_process_on_two_devices_holding_both():
    # A process that uses two GPUs is a gang of one (docs/scheduler.md, "Gangs"): asking for one
    # of them, it is granted both, and %nvshare shows both held.
    core = Core()
    core.register("a", host_pid=500)  # uses GPU0
    core.feed(DeviceInfo(0.0, "a", GPU1, 1 << 30, "other"))
    core.feed(AcquireRequest(0.0, "a", GPU1))
    answer = views.query(core.core, 500, now=1.0)
    assert [(d["device"], d["state"]) for d in answer["devices"]] == [(GPU0, "holding"), (GPU1, "holding")]


# --- the daemon ------------------------------------------------------------------------------


def ask(dealer: zmq.Socket) -> dict:
    dealer.send(protocol.Query().encode())
    assert dealer.poll(PATIENCE * 1000), "no answer to QUERY"
    message = protocol.decode(dealer.recv(), protocol.QUERY_REPLIES)
    assert isinstance(message, protocol.Status), message
    return message.document()


@pytest.fixture
def dealer(scheduler):
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(scheduler.paths.client_endpoint)
    yield sock
    sock.close()
    context.term()


def test_query_needs_no_registration_and_makes_none(scheduler, dealer):
    answer = ask(dealer)
    assert answer == {"pid": os.getpid(), "clients": [], "devices": []}
    assert scheduler.clients() == []
    # The same connection may still register afterwards.
    dealer.send(protocol.Hello(pid=os.getpid(), session="00000000000000aa").encode())
    assert isinstance(protocol.decode(dealer.recv(), protocol.SCHEDULER_MESSAGES), protocol.Welcome)
    assert len(scheduler.clients()) == 1


def test_query_reports_this_process_holding_then_waiting_behind_another(scheduler, dealer):
    other = scheduler.agent()
    with Client(socket_dir=scheduler.socket_dir) as client:
        client.announce(GPU0, 16 << 30, "sim GPU")
        client.report_memory(GPU0, 4096)
        with client.hold(GPU0):
            entry = by_device(ask(dealer))[GPU0]
            assert entry["state"] == "holding" and entry["client"] == client.client_id
            assert entry["used"] == 4096  # MEMORY is sent before ACQUIRE
            other.send(f"announce {GPU0} {16 << 30} sim GPU")
            other.send(f"acquire {GPU0}")
            entry = wait_for(lambda: (e := ask(dealer)["devices"][0])["waiters"] == 1 and e, what="the other waiting")
            assert entry["state"] == "holding" and entry["holders"][0]["client"] == client.client_id
        other.expect(f"granted {GPU0}")

        granted = threading.Event()
        threading.Thread(target=lambda: (client.acquire(GPU0), granted.set()), daemon=True).start()
        waiting = wait_for(lambda: (e := ask(dealer)["devices"][0])["state"] == "waiting" and e, what="waiting")
        assert waiting["position"] == 1
        (holder,) = waiting["holders"]
        assert holder.pop("quantum_left") > 0
        assert holder == {"client": other.client_id, "user": user_name(os.geteuid()), "program": "agent.py",
                          "pod": "", "namespace": ""}
        other.send(f"release {GPU0}")
        assert granted.wait(PATIENCE)
        entry = ask(dealer)["devices"][0]
        assert entry["state"] == "holding" and entry["grants"] == 2
        # The cause of the wait is the other process. Its length is whatever the machine made it
        # (it may round to 0 ms), but never shorter than the wait already reported while waiting.
        assert entry["last_wait"]["held_by"] == [holder]  # the same names, without the quantum
        assert entry["last_wait"]["seconds"] >= waiting["waiting_for"] >= 0
        client.release(GPU0)

        # Another process asking sees none of this.
        seen = json.loads(scheduler_query_from_child(scheduler))
        assert seen["devices"] == [] and seen["pid"] not in (0, os.getpid())


def scheduler_query_from_child(scheduler) -> str:
    code = ("import sys, json; from nvshare_py.ipython import query; "
            "print(json.dumps(query(socket_dir=sys.argv[1])))")
    run = run_child([sys.executable, "-c", code, str(scheduler.socket_dir)], scheduler.env)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip().splitlines()[-1]
