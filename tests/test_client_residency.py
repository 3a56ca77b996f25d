"""nvshare_py.client's part in residency (docs/protocol.md, Residency): it converts no memory,
so it answers EVICT at once with nothing resident and says resident=0 when it releases after a
DROP that asked for an eviction; a grant waiting on it never waits for the grace. A ROUTER
socket plays the scheduler, so each frame the client sends is seen as it is."""

from __future__ import annotations

import shutil
import threading

import pytest
import zmq

from nvshare_py import protocol
from nvshare_py.client import Client
from nvshare_py.paths import SocketPaths
from nvshare_py.testing.scheduler import PATIENCE, short_socket_dir

GPU = "GPU-5151ad00-0000-4000-8000-000000000000"


class FakeScheduler:
    def __init__(self, directory) -> None:
        self.paths = SocketPaths.resolve(directory)
        self.paths.client_socket.parent.mkdir(parents=True, exist_ok=True)
        self.context = zmq.Context()
        self.router = self.context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.RCVTIMEO, int(PATIENCE * 1000))
        self.router.bind(self.paths.client_endpoint)
        self.peer = b""

    def send(self, message: protocol.Message) -> None:
        self.router.send_multipart([self.peer, message.encode()])

    def expect(self, kind: type) -> protocol.Message:
        """The client's next message of `kind`, skipping heartbeats and memory reports."""
        seen = []
        while True:
            try:
                self.peer, frame = self.router.recv_multipart()
            except zmq.Again:
                raise AssertionError(f"no {kind.TYPE} within {PATIENCE} s; saw {seen}") from None
            message = protocol.decode(frame)
            if isinstance(message, kind):
                return message
            seen.append(message)


@pytest.fixture
def connected():
    directory = short_socket_dir()
    scheduler = FakeScheduler(directory)
    client = Client(directory, connect_timeout=PATIENCE)
    connecting = threading.Thread(target=client.connect)
    connecting.start()
    scheduler.expect(protocol.Hello)
    scheduler.send(protocol.Welcome(client="c1", heartbeat_ms=10_000, idle_release_ms=0))
    connecting.join(PATIENCE)
    assert not connecting.is_alive(), "connect() did not return after WELCOME"
    yield scheduler, client
    client.close()
    scheduler.context.destroy(linger=0)
    shutil.rmtree(directory, ignore_errors=True)


def test_evict_is_answered_at_once_with_nothing_resident(connected):
    scheduler, client = connected
    client.announce(GPU, 16 << 30)  # the scheduler asks only clients that use the device
    scheduler.send(protocol.Evict(device=GPU, bytes=1 << 30))
    assert scheduler.expect(protocol.Evicted) == protocol.Evicted(device=GPU, resident=0)


def test_release_after_an_evicting_drop_says_nothing_stays_resident(connected):
    scheduler, client = connected
    acquiring = threading.Thread(target=client.acquire, args=(GPU,))
    acquiring.start()
    scheduler.expect(protocol.Acquire)
    scheduler.send(protocol.Grant(device=GPU, grant=7, mode="on", exclusive=True, quantum_ms=1000))
    acquiring.join(PATIENCE)
    scheduler.send(protocol.Drop(device=GPU, grant=7, grace_ms=5000, reason="quantum", evict=1 << 30))
    release = scheduler.expect(protocol.Release)
    assert (release.grant, release.reason, release.resident) == (7, "drop", 0)


def test_release_after_a_drop_that_moves_nothing_reads_as_before(connected):
    scheduler, client = connected
    acquiring = threading.Thread(target=client.acquire, args=(GPU,))
    acquiring.start()
    scheduler.expect(protocol.Acquire)
    scheduler.send(protocol.Grant(device=GPU, grant=8, mode="on", exclusive=True, quantum_ms=1000))
    acquiring.join(PATIENCE)
    scheduler.send(protocol.Drop(device=GPU, grant=8, grace_ms=5000, reason="quantum"))
    release = scheduler.expect(protocol.Release)
    assert release.resident is None and b"resident" not in release.encode()
