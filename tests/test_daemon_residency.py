"""Residency over the wire (docs/protocol.md, Residency): the daemon reads `resident=` from
MEMORY, RELEASE and EVICTED, sends DROP evict= / GRANT prefetch= / EVICT, and `status` shows what
each client keeps resident and what it has swapped out. Raw DEALER sockets stand in for the
interceptor, so each frame is the one a swapping client would send."""

from __future__ import annotations

import zmq

from nvshare_py import protocol
from nvshare_py.testing.scheduler import PATIENCE, wait_for

GPU = "GPU-5151ad00-0000-4000-8000-000000000000"
GiB = 1 << 30


class Wire:
    def __init__(self, context: zmq.Context, endpoint: str, session: str) -> None:
        self.sock = context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, int(PATIENCE * 1000))
        self.sock.connect(endpoint)
        self.send(protocol.Hello(pid=1, session=session))
        self.expect(protocol.Welcome)
        self.send(protocol.DeviceAnnouncement(device=GPU, total=80 * GiB))

    def send(self, message: protocol.Message) -> None:
        self.sock.send(message.encode())

    def expect(self, kind: type) -> protocol.Message:
        """The next message of `kind`, skipping notices (CONTENDED, MODE)."""
        seen = []
        while True:
            try:
                message = protocol.decode(self.sock.recv(), {**protocol.SCHEDULER_MESSAGES})
            except zmq.Again:
                raise AssertionError(f"no {kind.TYPE} within {PATIENCE} s; saw {seen}") from None
            if isinstance(message, kind):
                return message
            seen.append(message)


def test_a_handoff_over_budget_evicts_in_bulk_and_prefetches_back(scheduler_factory):
    # A 16 GiB budget on an 80 GiB card: two 12 GiB jobs do not fit together.
    # Raw sockets send no heartbeats: a long timeout keeps them registered on a slow machine.
    scheduler = scheduler_factory(tq=0.2, grace=60, heartbeat_timeout=600)
    context = zmq.Context()
    try:
        a = Wire(context, scheduler.paths.client_endpoint, "00000000000000a1")
        b = Wire(context, scheduler.paths.client_endpoint, "00000000000000b2")
        scheduler.request("set-budget", device=GPU, bytes=16 * GiB)
        # Their swap engines say they move memory fast enough for a TQ of 0.2 s (a through its
        # pinned area, b by the driver's prefetch, which status points out).
        a_engine = {"engine": "copy", "area": 12 * GiB, "out_bps": 10**13, "in_bps": 10**13}
        b_engine = {"engine": "migrate", "out_bps": 10**13, "in_bps": 10**13}
        a.send(protocol.Memory(device=GPU, used=12 * GiB, resident=0, **a_engine))
        a.send(protocol.Acquire(device=GPU))
        first = a.expect(protocol.Grant)
        assert first.prefetch == 0
        a.send(protocol.Memory(device=GPU, used=12 * GiB, resident=12 * GiB, **a_engine))
        b.send(protocol.Memory(device=GPU, used=12 * GiB, resident=0, **b_engine))
        # Two connections: make sure the daemon has read both reports before b asks.
        wait_for(lambda: scheduler.device(GPU)["used"] == 24 * GiB, what="both memory reports")
        b.send(protocol.Acquire(device=GPU))
        drop = a.expect(protocol.Drop)
        assert drop.evict == 8 * GiB  # b's 12 GiB need 8 of a's 12 to go
        a.send(protocol.Release(device=GPU, grant=first.grant, reason="drop", resident=4 * GiB))
        second = b.expect(protocol.Grant)
        b.send(protocol.Memory(device=GPU, used=12 * GiB, resident=12 * GiB, **b_engine))
        wait_for(lambda: scheduler.device(GPU)["swapped"] == 8 * GiB and scheduler.device(GPU)["resident"] == 16 * GiB,
                 what="b's report of its memory brought in")

        (client_a,) = [c for c in scheduler.status()["clients"] if c["client"] == "c1"]
        assert (client_a["devices"][GPU]["resident"], client_a["devices"][GPU]["swapped"]) == (4 * GiB, 8 * GiB)
        shown = scheduler.ctl("status", env={**scheduler.env, "COLUMNS": "200"})
        assert "12.0 GiB (8.0 GiB swapped out)" in shown.stdout, shown.stdout
        assert shown.stdout.count("swaps by prefetch") == 1, shown.stdout  # b's engine, not a's

        # b leaves without evicting: a's turn needs room, so EVICT goes to b, now idle.
        a.send(protocol.Acquire(device=GPU))
        b.expect(protocol.Drop)
        b.send(protocol.Release(device=GPU, grant=second.grant, reason="drop", resident=12 * GiB))
        evict = b.expect(protocol.Evict)
        assert evict.bytes == 8 * GiB
        b.send(protocol.Evicted(device=GPU, resident=4 * GiB))
        # All it had moved out fits again: it brings it back ahead of its grant, then is granted.
        assert a.expect(protocol.Prefetch).resident == 12 * GiB
        a.send(protocol.Memory(device=GPU, used=12 * GiB, resident=12 * GiB, **a_engine))
        third = a.expect(protocol.Grant)
        assert third.prefetch == 0
    finally:
        context.destroy(linger=0)
