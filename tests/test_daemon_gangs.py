"""Gangs through the real daemon: the ranks of a job say their gang in HELLO (raw protocol
peers, as the interceptor speaks it) and are granted their devices together, dropped together,
and shown as one gang in the status document and `nvsharectl status`."""

from __future__ import annotations

import json
import time

import pytest
import zmq

from nvshare_py.testing.scheduler import PATIENCE, wait_for
from nvshare_py import protocol

GPU0 = "GPU-5151ad00-0000-4000-8000-000000000000"
GPU1 = "GPU-5151ad00-0000-4000-8000-000000000001"


class Peer:
    """One client process's connection, speaking the wire protocol itself."""

    sessions = iter(range(0xA0, 0x1000))

    def __init__(self, scheduler, context: zmq.Context, gang: str = "", gang_size: int = 0) -> None:
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(scheduler.paths.client_endpoint)
        self.seen: list[protocol.Message] = []
        self.send(protocol.Hello(pid=1, session=f"{next(self.sessions):016x}", program="rank", gang=gang,
                                 gang_size=gang_size))
        self.client_id = self.expect(protocol.Welcome).client

    def send(self, message: protocol.Message) -> None:
        self.socket.send(message.encode())

    def expect(self, kind: type, device: str | None = None):
        """The next message of `kind` (for `device`); heartbeats meanwhile keep the peer alive."""
        deadline = time.monotonic() + PATIENCE
        while time.monotonic() < deadline:
            for message in self.seen:
                if isinstance(message, kind) and (device is None or message.device == device):
                    self.seen.remove(message)
                    return message
            if self.socket.poll(100):
                self.seen.append(protocol.decode(self.socket.recv(), protocol.SCHEDULER_MESSAGES))
            else:
                self.send(protocol.Heartbeat())
        raise AssertionError(f"no {kind.__name__} for {device} within {PATIENCE} s; saw {self.seen}")

    def nothing(self, kind: type, wait: float = 0.5) -> None:
        """No message of `kind` arrives (within a short look: the daemon answers at once)."""
        end = time.monotonic() + wait
        while time.monotonic() < end:
            if self.socket.poll(50):
                self.seen.append(protocol.decode(self.socket.recv(), protocol.SCHEDULER_MESSAGES))
        assert not [m for m in self.seen if isinstance(m, kind)], self.seen

    def close(self) -> None:
        self.socket.close(linger=0)


@pytest.fixture
def context():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def rank(scheduler, context, device: str, gang: str = "job", size: int = 2) -> Peer:
    peer = Peer(scheduler, context, gang, size)
    peer.send(protocol.DeviceAnnouncement(device=device, total=0))
    return peer


# The peers here heartbeat only while they wait for a message: a long timeout keeps a busy
# machine's slow nvsharectl runs from counting them gone.
@pytest.mark.scheduler_options(tq=2, heartbeat_timeout=120)
def test_a_two_rank_job_beside_a_single_gets_both_devices_at_once(scheduler, context):
    single = Peer(scheduler, context)
    single.send(protocol.DeviceAnnouncement(device=GPU0, total=0))
    single.send(protocol.Acquire(device=GPU0))
    held = single.expect(protocol.Grant, GPU0)
    r0, r1 = rank(scheduler, context, GPU0), rank(scheduler, context, GPU1)
    r1.send(protocol.Acquire(device=GPU1))  # GPU1 is free, but its partner's GPU0 is not
    r1.nothing(protocol.Grant)
    status = scheduler.status()
    (gang,) = status["gangs"]
    assert (gang["name"], gang["members"], gang["state"]) == ("job", [r0.client_id, r1.client_id], "waiting")

    single.expect(protocol.Drop, GPU0)  # its quantum ended while the gang waits
    single.send(protocol.Release(device=GPU0, grant=held.grant, reason="drop"))
    first, second = r0.expect(protocol.Grant, GPU0), r1.expect(protocol.Grant, GPU1)
    grants = [e for e in scheduler.events() if e["kind"] == "grant" and e["grant"] in (first.grant, second.grant)]
    assert {e["client"] for e in grants} == {r0.client_id, r1.client_id}
    assert len({e["seq"] for e in grants}) == 2 and len({e["t"] for e in grants}) == 1  # one batch
    assert scheduler.status()["gangs"][0]["state"] == "holding"

    compact = scheduler.ctl("status")
    assert compact.returncode == 0, compact.stderr
    assert f"gang g1 'job': 2 ranks ({r0.client_id}, {r1.client_id}) of" in compact.stdout, compact.stdout
    assert "holds its devices" in compact.stdout and "held by gang g1 'job'" in compact.stdout
    wide = scheduler.ctl("status", "--wide")
    assert wide.returncode == 0, wide.stderr
    assert "g1" in wide.stdout and "job" in wide.stdout
    as_json = json.loads(scheduler.ctl("status", "--json").stdout)
    assert as_json["gangs"][0]["devices"] == [GPU0, GPU1]
    for peer in (single, r0, r1):
        peer.close()


@pytest.mark.scheduler_options(heartbeat_timeout=120)
def test_a_rank_that_dies_ends_its_gangs_hold(scheduler, context):
    r0, r1 = rank(scheduler, context, GPU0), rank(scheduler, context, GPU1)
    r0.send(protocol.Acquire(device=GPU0))
    r0.expect(protocol.Grant, GPU0)
    r1.expect(protocol.Grant, GPU1)  # unasked: part of the gang's turn
    r0.close()  # its connection closes: the daemon counts it gone
    drop = r1.expect(protocol.Drop, GPU1)
    assert drop.reason == "gang"
    wait_for(lambda: len(scheduler.clients()) == 1, what="the dead rank to leave")
    r1.close()
