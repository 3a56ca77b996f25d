"""Hostile and careless clients (issue 12), short enough for CI: the daemon never exits and a
well-behaved client still gets the lock. Each test names the defect it reproduced. The 60 s
versions with latency, memory and log targets are benchmarks/bench_floods.py.

The floods come from raw ZMTP peers (floodkit.py speaks the client side by hand), which can
do what no library client does: announce a routing id of their choosing, stop after the
greeting, send oversized frames.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest

from fixtures.scheduler import SchedulerProcess, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import floodkit  # noqa: E402

GPU = "GPU-5151ad00-0000-4000-8000-000000000000"
LOW_NOFILE = 256  # the daemon's descriptor limit in the descriptor tests


class LimitedScheduler(SchedulerProcess):
    """The daemon under a hard descriptor limit (it lifts its soft limit to the hard one)."""

    def command(self) -> list[str]:
        return floodkit.with_nofile(LOW_NOFILE, super().command())


@pytest.fixture
def limited_scheduler(scheduler_factory):
    from fixtures.scheduler import DEFAULT_OPTIONS, short_socket_dir

    process = LimitedScheduler(short_socket_dir(), dict(DEFAULT_OPTIONS, heartbeat_timeout=300))
    process.start()
    yield process
    process.cleanup()


def open_descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def assert_serves(scheduler, holder=None) -> None:
    """The daemon is alive and a well-behaved client gets the lock."""
    assert scheduler.running, scheduler.log_text()[-3000:]
    agent = holder or scheduler.agent()
    agent.send(f"acquire {GPU}")
    agent.expect(f"granted {GPU}", timeout=30)
    agent.send(f"release {GPU}")
    agent.expect(f"released {GPU}", timeout=30)


def test_peer_chosen_routing_ids_neither_abort_the_daemon_nor_impersonate(scheduler_factory):
    scheduler = scheduler_factory(heartbeat_timeout=300)  # the raw victim sends no heartbeats
    # Was: a peer announcing libzmq's next automatic routing id (00 6b8b4567, the same in every
    # process) was accepted, and the next ordinary client aborted the daemon
    # (socket_base.cpp:2113); a peer could also take a dropped connection's id.
    victim = floodkit.RawClient(scheduler.paths.client_socket)
    victim.hello(session="00000000000000a1")
    victim.send(f"NVSHARE/1 ACQUIRE\ndevice={GPU}")
    grant = floodkit.field(victim.expect("GRANT"), "grant")
    impostors = []
    for n in range(8):
        impostor = floodkit.RawClient(scheduler.paths.client_socket,
                                      identity=bytes([0]) + (0x6B8B4567 + n).to_bytes(4, "big"))
        impostor.hello(session=f"{0xb0 + n:016x}")
        # Whoever it pretends to be, its RELEASE is its own: it holds nothing.
        impostor.send(f"NVSHARE/1 RELEASE\ndevice={GPU}\ngrant={grant}")
        impostors.append(impostor)
    waiter = scheduler.agent()  # an ordinary client, which libzmq would have numbered next
    waiter.send(f"acquire {GPU}")
    wait_for(lambda: scheduler.waiters(GPU) == [waiter.client_id], what="the waiter to queue")
    assert scheduler.holders(GPU) == ["c1"], "an impostor released the victim's grant"
    victim.send(f"NVSHARE/1 RELEASE\ndevice={GPU}\ngrant={grant}")
    waiter.expect(f"granted {GPU}", timeout=30)
    assert scheduler.running
    for peer in (victim, *impostors):
        peer.close()


def test_plain_connections_beyond_the_descriptor_limit_are_refused_not_fatal(limited_scheduler):
    # Was: about 250 plain connections at RLIMIT_NOFILE 256 ended in `Too many open files
    # (ipc_listener.cpp)` and an abort.
    scheduler = limited_scheduler
    holder = scheduler.agent()  # registered before the flood: it must keep being served
    sockets = []
    try:
        for _ in range(3 * LOW_NOFILE):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                sock.connect(str(scheduler.paths.client_socket))
            except (BlockingIOError, ConnectionRefusedError, OSError):
                pass  # a full backlog: also what a flood looks like
            sockets.append(sock)
        wait_for(lambda: "client connection refused" in scheduler.log_text(), timeout=30,
                 what="the daemon to refuse connections beyond its limit")
        assert open_descriptors(scheduler.pid) < LOW_NOFILE
        assert_serves(scheduler, holder)
        assert scheduler.status()["scheduler"]["pid"] == scheduler.pid  # control still answers
    finally:
        for sock in sockets:
            sock.close()
    assert_serves(scheduler)  # a newcomer connects once the flood is gone


def test_hello_then_close_loops_do_not_pile_up_descriptors(limited_scheduler):
    # Was: every registration kept a pidfd open until its heartbeat timeout after its
    # connection closed; HELLO-then-close in a loop exhausted the descriptors and aborted the
    # daemon though the attacker held one connection at a time.
    scheduler = limited_scheduler  # heartbeat timeout 300 s: only a prompt close frees them
    baseline = open_descriptors(scheduler.pid)
    for n in range(4 * LOW_NOFILE):
        peer = floodkit.RawClient(scheduler.paths.client_socket)
        peer.hello(session=f"{n:016x}")
        peer.close()
    wait_for(lambda: open_descriptors(scheduler.pid) <= baseline + 4, timeout=30,
             what=f"the daemon's descriptors back near {baseline} (now {open_descriptors(scheduler.pid)})")
    wait_for(lambda: scheduler.clients() == [], what="every closed registration to be gone")
    assert_serves(scheduler)


def test_reclaim_loops_do_not_block_grants(scheduler):
    # Was: a client opening a new connection every second with `HELLO held=DEV` turned each
    # claim into a draining holder that blocked the next grant; the waiter starved.
    holder, waiter = scheduler.agent(), scheduler.agent()
    holder.send(f"acquire {GPU}")
    holder.expect(f"granted {GPU}")
    waiter.send(f"acquire {GPU}")
    wait_for(lambda: scheduler.waiters(GPU) == [waiter.client_id], what="the waiter to queue")
    claims = []
    for n in range(5):
        claims.append(floodkit.RawClient(scheduler.paths.client_socket))
        claims[-1].hello(session=f"{0xc0 + n:016x}", held=GPU)
        assert floodkit.field(claims[-1].expect("REVOKE"), "reason") == "grace-expired"
    holder.send(f"release {GPU}")
    waiter.expect(f"granted {GPU}", timeout=30)  # the claims block nothing ...
    claims.append(floodkit.RawClient(scheduler.paths.client_socket))
    claims[-1].hello(session=f"{0xcf:016x}", held=GPU)
    claims[-1].expect("REVOKE")
    active = [h["client"] for h in scheduler.device(GPU)["holders"] if h["state"] != "overdue"]
    assert active == [waiter.client_id]  # ... and take nothing over
    for claim in claims:
        claim.close()


def test_invented_devices_are_bounded_and_forgotten(scheduler):
    # Was: 100 000 invented device ids from one client cost memory never returned, and status
    # failed ("too-large") until a restart.
    peer = floodkit.RawClient(scheduler.paths.client_socket)
    peer.hello(session="00000000000000d1")
    for n in range(200):
        peer.send(f"NVSHARE/1 DEVICE\ndevice=GPU-{n:08d}\ntotal=1")
    answer = peer.expect("ERROR")
    assert "at most 64 devices" in answer
    wait_for(lambda: len(scheduler.status()["devices"]) == 64, what="64 devices, no more")
    peer.close()
    wait_for(lambda: scheduler.status()["devices"] == [], what="the unused devices to be forgotten")
    assert_serves(scheduler)


def test_hello_naming_many_devices_is_refused_and_logs_stay_small(scheduler):
    # Was: ten seconds of `HELLO held=<100 devices>` wrote 70 MB of logs and kept the daemon
    # busy for minutes.
    devices = ",".join(f"D{n}" for n in range(100))
    before = len(scheduler.log_text())
    peer = floodkit.RawClient(scheduler.paths.client_socket)
    peer.send(f"NVSHARE/1 HELLO\npid=1\nsession=00000000000000e1\nheld={devices}")
    assert "more than 64 devices" in peer.expect("ERROR")
    peer.close()
    few = ",".join(f"D{n}" for n in range(40))
    for n in range(300):
        peer = floodkit.RawClient(scheduler.paths.client_socket)
        peer.hello(session=f"{0xe100 + n:016x}", held=few)
        peer.close()
    assert_serves(scheduler)
    lines = scheduler.log_text()[before:].count("\n")
    # 300 registrations claiming 40 devices each: over 12 000 lines unlimited.
    assert lines < 3000, f"{lines} log lines"


@pytest.mark.parametrize("junk", [
    b"\x00\x05hello",                       # a message before the handshake
    floodkit.frame(b"x" * (70 * 1024)),     # one message over the wire limit (after the handshake)
    floodkit.frame(b"NVSHARE/1 ACQUIRE", more=True) + floodkit.frame(b"device=x"),  # two frames
    floodkit.frame(b"\xff\xfe not utf-8"),
    floodkit.frame(b"NVSHARE/1 HELLO\npid=x\nsession=1"),
])
def test_oversized_and_malformed_traffic_leaves_the_daemon_serving(scheduler, junk):
    for _ in range(50):
        peer = floodkit.RawClient(scheduler.paths.client_socket, handshake=not junk.startswith(b"\x00\x05"))
        peer.send_raw(junk)
        peer.close()
    assert_serves(scheduler)
