"""The control socket: who may use it, what each op does, and the events ring."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import zmq

from fixtures.scheduler import OTHER_UID, as_other_user, can_run
from nvshare_py import protocol
from nvshare_py.scheduler.podcgroup import pod_uid_from_cgroup
from nvshare_py.testing.scheduler import nvsharectl_command, run_child, wait_for

GPU = "GPU-5151ad00-0000-4000-8000-000000000000"


def raw_request(scheduler, frames: list[bytes], socket_type: int = zmq.DEALER) -> dict:
    """Send frames on a fresh socket and return the decoded reply."""
    context = zmq.Context()
    try:
        sock = context.socket(socket_type)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 10_000)
        sock.connect(scheduler.paths.control_endpoint)
        sock.send_multipart(frames)
        return json.loads(sock.recv_multipart()[-1])
    finally:
        context.destroy(linger=0)


def registered_dealer(context, scheduler, session: str) -> zmq.Socket:
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVTIMEO, 10_000)
    dealer.connect(scheduler.paths.client_endpoint)
    dealer.send(protocol.Hello(pid=os.getpid(), session=session).encode())
    assert isinstance(protocol.decode(dealer.recv(), protocol.SCHEDULER_MESSAGES), protocol.Welcome)
    return dealer


# --- who may use it --------------------------------------------------------------------------


def test_a_peer_in_another_pid_namespace_is_refused(scheduler):
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")
    wrapper = ["unshare", "--pid", "--fork", "--mount-proc"]
    if os.geteuid() != 0:
        wrapper = ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc"]
    if not can_run(*wrapper):
        pytest.skip(f"cannot create a pid namespace here ({' '.join(wrapper)} failed)")
    result = run_child([*wrapper, *nvsharectl_command(), "status"], scheduler.env)
    assert result.returncode == 4, result.stderr
    assert "forbidden" in result.stderr and "pid namespace" in result.stderr
    # The same request from our own namespace is served.
    assert scheduler.ctl("status", "--json").returncode == 0


def test_another_user_cannot_reach_the_control_socket(scheduler):
    result = run_child([*as_other_user(), *nvsharectl_command(), "off"], scheduler.env)
    assert result.returncode == 4, result.stderr
    assert "permission denied" in result.stderr
    assert scheduler.status()["scheduler"]["defaults"]["mode"] == "on"


def test_another_user_past_the_file_modes_is_still_refused(scheduler):
    # CAP_DAC_OVERRIDE gets it through the 0700/0600 modes, as a root-in-a-container process
    # with the directory mounted would; the daemon's own check must refuse it.
    argv = as_other_user("dac_override")
    result = run_child([*argv, *nvsharectl_command(), "off"], scheduler.env)
    assert result.returncode == 4, result.stderr
    assert "forbidden" in result.stderr and f"uid {OTHER_UID}" in result.stderr
    assert scheduler.status()["scheduler"]["defaults"]["mode"] == "on"
    assert "control request refused" in scheduler.log_text()


def test_the_daemon_serves_the_control_socket_without_libzmq(scheduler):
    # Issue 23: the control socket was a libzmq ROUTER, whose listener aborted the whole daemon
    # when accept() ran out of descriptors (`Too many open files (ipc_listener.cpp)`). The
    # daemon's own connection server serves it now; libzmq is not even loaded.
    maps = open(f"/proc/{scheduler.pid}/maps").read()
    assert "libzmq" not in maps
    assert scheduler.ctl("status", "--json").returncode == 0  # nvsharectl's REQ socket is served


def test_the_client_directory_holds_no_way_to_control_the_scheduler(scheduler):
    # Containers get <socket-dir>/client only.
    assert sorted(os.listdir(scheduler.paths.client_dir)) == ["scheduler.sock"]


# --- ops ---------------------------------------------------------------------------------------


def test_malformed_requests_are_answered_with_codes(scheduler):
    def code(frames: list[bytes], socket_type: int = zmq.DEALER) -> str:
        reply = raw_request(scheduler, frames, socket_type)
        assert reply["v"] == 1 and reply["ok"] is False
        return reply["error"]["code"]

    assert code([b"not json"]) == "bad-request"
    assert code([b"[1, 2]"]) == "bad-request"
    assert code([json.dumps({"op": "status"}).encode()]) == "bad-request"  # no "v"
    assert code([json.dumps({"v": 1, "op": "reboot"}).encode()]) == "unknown-op"
    assert code([json.dumps({"v": 1, "op": "set-tq", "seconds": -1}).encode()]) == "bad-request"
    assert code([json.dumps({"v": 1, "op": "set-tq", "seconds": True}).encode()]) == "bad-request"
    assert code([json.dumps({"v": 1, "op": "set-tq", "seconds": "5"}).encode()]) == "bad-request"
    assert code([json.dumps({"v": 1, "op": "set-tq", "seconds": 1e300}).encode()]) == "bad-request"
    assert code([json.dumps({"v": 1, "op": "set-tq", "seconds": 10**400}).encode()]) == "bad-request"
    assert code([json.dumps({"v": 1, "op": "set-mode", "mode": "sometimes"}).encode()]) == "bad-request"
    assert code([json.dumps({"v": 1, "op": "set-mode", "mode": "off", "device": "GPU-nobody"}).encode()]) == "unknown-device"
    assert code([json.dumps({"v": 1, "op": "set-budget", "bytes": 1}).encode()]) == "bad-request"  # no device
    assert code([json.dumps({"v": 1, "op": "events", "limit": 10_001}).encode()]) == "bad-request"
    assert code([json.dumps({"v": 1, "op": "status", "pad": "x" * 70_000}).encode()]) == "too-large"
    assert code([b"{}", b"{}"]) == "bad-request"  # two frames
    assert code([b"", b"not json"], zmq.DEALER) == "bad-request"  # REQ-style envelope by hand
    # And a good one over REQ, the way nvsharectl asks.
    reply = raw_request(scheduler, [json.dumps({"v": 1, "op": "status"}).encode()], zmq.REQ)
    assert reply["ok"] is True and reply["result"]["scheduler"]["pid"] == scheduler.pid


@pytest.mark.scheduler_options(gpus=1, gpu_memory="1000")  # the daemon measures a GPU of 1000 bytes
def test_settings_changes_reach_clients_and_status(scheduler):
    agent = scheduler.agent()
    agent.send(f"announce {GPU} 1000 simulated")
    agent.expect("announced")
    wait_for(lambda: scheduler.device(GPU), what="the device to be known")

    assert scheduler.request("set-tq", seconds=7.5, device=GPU) == {"device": GPU, "tq": 7.5}
    assert agent.expect(f"mode {GPU}") == f"mode {GPU} on 7.5"
    assert scheduler.request("set-mode", mode="off") == {"device": None, "mode": "off"}
    assert agent.expect(f"mode {GPU}") == f"mode {GPU} off 7.5"
    status = scheduler.status()
    assert status["scheduler"]["defaults"]["mode"] == "off"
    assert status["devices"][0]["mode"] == "off" and status["devices"][0]["tq"] == 7.5
    assert scheduler.request("set-budget", device=GPU, bytes=600) == {"device": GPU, "budget": 600}
    assert scheduler.device(GPU)["budget"] == 600
    assert scheduler.request("set-budget", device=GPU, bytes=None)["budget"] is None
    assert scheduler.device(GPU)["budget"] == 1000
    kinds = [e["kind"] for e in scheduler.events()]
    assert {"tq", "mode", "budget"} <= set(kinds)


def test_status_shows_who_the_clients_are(scheduler):
    agent = scheduler.agent(env={"NVSHARE_POD_NAME": "nb-0", "NVSHARE_POD_NAMESPACE": "team-a"})
    agent.send(f"memory {GPU} 4096")
    agent.send(f"acquire {GPU}")
    agent.expect(f"granted {GPU}")
    status = wait_for(lambda: (s := scheduler.status())["devices"] and s["devices"][0]["used"] == 4096 and s,
                      what="the memory report")
    scheduler_block = status["scheduler"]
    assert scheduler_block["socket_dir"] == str(scheduler.socket_dir)
    assert scheduler_block["defaults"] == {
        **{option: scheduler.options[option] for option in
           ("mode", "tq", "grace", "heartbeat_interval", "heartbeat_timeout", "idle_release")},
        "swapping": True,  # the daemon's default (--swapping on)
        "min_quantum": 1.0, "ageing": 4,  # the daemon's own defaults for weights and priorities
    }
    (client,) = status["clients"]
    assert client["client"] == agent.client_id
    assert client["pid"] == agent.pid and client["host_pid"] == agent.pid and client["uid"] == os.geteuid()
    assert (client["pod"], client["namespace"], client["program"]) == ("nb-0", "team-a", "agent.py")
    # The pod UID comes from the process's cgroup, whatever pod it names itself ("" here,
    # unless the suite itself runs in a pod).
    assert client["pod_uid"] == pod_uid_from_cgroup(Path(f"/proc/{agent.pid}/cgroup").read_text())
    assert client["devices"][GPU]["state"] == "holding" and client["devices"][GPU]["grants"] == 1
    (holder,) = status["devices"][0]["holders"]
    assert holder["client"] == agent.client_id and holder["state"] == "holding"
    assert 0 <= holder["quantum_left"] <= scheduler.options["tq"]


def test_the_events_ring_keeps_the_last_10000_with_sequence_numbers(scheduler_factory):
    # A heartbeat timeout that cannot strike during the test: removing the silent client
    # below would add events.
    scheduler = scheduler_factory(heartbeat_timeout=300)
    context = zmq.Context()
    try:
        dealer = registered_dealer(context, scheduler, "00000000000000e1")
        # Each cycle adds acquire, grant and release: 3 400 cycles overflow the ring.
        for _ in range(3400):
            dealer.send(protocol.Acquire(device=GPU).encode())
            grant = protocol.decode(dealer.recv(), protocol.SCHEDULER_MESSAGES)
            dealer.send(protocol.Release(device=GPU, grant=grant.grant, reason="user").encode())
        last_grant = grant.grant
        # Answered only after everything sent before it on this connection: the last release is in.
        dealer.send(protocol.Query().encode())
        assert isinstance(protocol.decode(dealer.recv(), protocol.QUERY_REPLIES), protocol.Status)
        # Still connected: closing first would add the unregistration to the ring.
        kept, total = scheduler.events_since(0)  # asked a page at a time
        sequence = [e["seq"] for e in kept]
        assert sequence[0] > 1  # the oldest were dropped ...
        assert sequence == list(range(sequence[0], sequence[0] + 10_000))  # ... and the last 10 000 kept
        assert total == sequence[-1] + 1
        page = scheduler.request("events", since=total - 3, limit=10)
        assert [e["seq"] for e in page["events"]] == [total - 3, total - 2, total - 1]
        assert page["next"] == total
        assert page["events"][-1]["kind"] == "release" and page["events"][-1]["grant"] == last_grant
        assert scheduler.request("events", since=total)["events"] == []
        entry = page["events"][-1]
        assert set(entry) == {"seq", "t", "device", "client", "kind", "grant", "detail"}
        assert entry["detail"] == "user" and entry["device"] == GPU
        # Timelines rely on it: the wall-clock times never run backwards along the sequence.
        times = [e["t"] for e in kept]
        assert times == sorted(times)
    finally:
        context.destroy(linger=0)


def test_an_events_answer_over_a_large_backlog_is_one_bounded_page_and_a_follower_still_gets_every_entry(
        scheduler_factory):
    """An `events` answer is made in one step of the daemon, which holds up every other client:
    however many are asked for, one answer holds at most eventring.PAGE_BYTES of entries and says
    `more` while more are stored; other clients are served between the pages, and paging through
    (control.events_pages) gets every entry in order."""
    from nvshare_py.scheduler.eventring import PAGE_BYTES

    scheduler = scheduler_factory(heartbeat_timeout=300)
    context = zmq.Context()
    try:
        dealer = registered_dealer(context, scheduler, "00000000000000e3")
        for _ in range(1000):  # acquire, grant, release: 3 000 entries, several pages' worth
            dealer.send(protocol.Acquire(device=GPU).encode())
            grant = protocol.decode(dealer.recv(), protocol.SCHEDULER_MESSAGES)
            dealer.send(protocol.Release(device=GPU, grant=grant.grant, reason="user").encode())
        dealer.send(protocol.Query().encode())
        assert isinstance(protocol.decode(dealer.recv(), protocol.QUERY_REPLIES), protocol.Status)
        first = raw_request(scheduler, [json.dumps({"v": 1, "op": "events", "since": 0, "limit": 10_000}).encode()])
        page = first["result"]
        assert first["ok"] and page["more"] is True, {k: v for k, v in page.items() if k != "events"}
        assert 0 < len(page["events"]) < 3000
        assert len(json.dumps(page["events"], separators=(",", ":"))) <= PAGE_BYTES
        assert page["next"] == page["events"][-1]["seq"] + 1

        other = registered_dealer(context, scheduler, "00000000000000e4")  # served between two pages
        other.send(protocol.Acquire(device=GPU).encode())
        granted = protocol.decode(other.recv(), protocol.SCHEDULER_MESSAGES)
        assert isinstance(granted, protocol.Grant), granted

        rest, following = scheduler.events_since(page["next"])
        every = page["events"] + rest
        sequence = [e["seq"] for e in every]
        assert sequence == list(range(1, following)), (sequence[:5], sequence[-5:], following)
        assert [(e["kind"], e["grant"]) for e in every[-2:]] == [("acquire", 0), ("grant", granted.grant)]
        assert scheduler.request("events", since=following) == {"events": [], "next": following, "more": False}
    finally:
        context.destroy(linger=0)


def test_events_pages_asks_until_the_daemon_says_no_more_or_an_older_daemon_gives_a_short_page():
    from nvshare_py.control import events_pages
    from nvshare_py.protocol import CONTROL_EVENTS_MAX
    from nvshare_py.scheduler.eventring import EventRing

    ring = EventRing(page_bytes=2_000)
    for n in range(500):
        ring.record(1000.0 + n, GPU, f"c{n}", "acquire", 0, "")
    asked = []

    def newer(op, since, limit):
        asked.append(since)
        return json.loads(ring.page(since, limit).json())

    events, following = events_pages(newer, 1)
    assert [e["seq"] for e in events] == list(range(1, 501)) and following == 501
    assert len(asked) > 10  # a page of 2 000 bytes holds about 20 of these

    def older(op, since, limit):  # no "more": a page as long as asked for means "ask again"
        page = json.loads(ring.page(since, limit).json())
        del page["more"]
        return page

    ring = EventRing(keep=2 * CONTROL_EVENTS_MAX, page_bytes=10**9)
    for n in range(CONTROL_EVENTS_MAX + 5):
        ring.record(1000.0, GPU, "c1", "acquire", 0, "")
    events, following = events_pages(older, 1)
    assert len(events) == CONTROL_EVENTS_MAX  # as many as the daemon keeps: the rest next time
    events, following = events_pages(older, following)
    assert [e["seq"] for e in events] == list(range(CONTROL_EVENTS_MAX + 1, CONTROL_EVENTS_MAX + 6))


def test_the_events_ring_pages_by_bytes_keeps_the_newest_and_tells_where_to_go_on():
    from nvshare_py.scheduler.eventring import EventRing

    ring = EventRing(keep=100, page_bytes=1_000)
    for n in range(150):
        ring.record(1000.0 + n, GPU, "c1", "grant", n, "x" * (n % 7))
    page = ring.page(0, 10_000)  # the first 50 are gone: the page starts at the oldest kept
    entries = [json.loads(e) for e in page.entries]
    assert entries[0]["seq"] == 51 and page.more and page.next == entries[-1]["seq"] + 1
    assert len(f"[{','.join(page.entries)}]") <= 1_000  # the answer's "events" array, brackets and all
    assert [e["seq"] for e in json.loads(ring.page(140, 3).json())["events"]] == [140, 141, 142]
    assert json.loads(ring.page(151, 10).json()) == {"events": [], "next": 151, "more": False}
    # Entries that fill a page to its last byte with their commas: the brackets must fit too (a
    # fresh-clone CI run under load got an answer of PAGE_BYTES + 1).
    exact = EventRing(keep=10)
    for n in range(4):
        exact.record(1000.0, GPU, "c1", "grant", n, "")
    encoded = exact.page(1, 10).entries
    exact.page_bytes = sum(len(e) + 1 for e in encoded[:3])
    fitted = exact.page(1, 10).entries
    assert len(f"[{','.join(fitted)}]") <= exact.page_bytes and fitted == encoded[:2]
    huge = EventRing(page_bytes=10)
    huge.record(1000.0, GPU, "c1", "register", 0, "program=" + "p" * 500)
    assert len(huge.page(1, 10).entries) == 1  # one entry at least, whatever its size


def test_control_client_library_reports_a_missing_daemon(scheduler):
    from nvshare_py.control import ControlFailure

    scheduler.stop()
    with pytest.raises(ControlFailure) as failure:
        scheduler.request("status", timeout=2)
    assert failure.value.exit_code == 3


def test_a_release_with_a_reason_the_scheduler_does_not_know_counts_as_user(scheduler):
    """docs/protocol.md, "Unknown words": a newer client's RELEASE reason is read, and the lock
    is given back all the same (recorded as `user`); a message type it does not know is answered
    `ERROR unknown-type`, and the connection stays registered."""
    context = zmq.Context()
    try:
        dealer = registered_dealer(context, scheduler, "00000000000000e2")
        dealer.send(protocol.Acquire(device=GPU).encode())
        grant = protocol.decode(dealer.recv(), protocol.SCHEDULER_MESSAGES)
        dealer.send(f"NVSHARE/1 RELEASE\ndevice={GPU}\ngrant={grant.grant}\nreason=preempted".encode())
        dealer.send(b"NVSHARE/1 TELEPORT\ndevice=" + GPU.encode())
        refused = protocol.decode(dealer.recv(), protocol.SCHEDULER_MESSAGES)
        assert (refused.code, refused.type) == ("unknown-type", "TELEPORT")
        released = [e for e in scheduler.request("events")["events"] if e["kind"] == "release"]
        assert [(e["grant"], e["detail"]) for e in released] == [(grant.grant, "user")]
        dealer.send(protocol.Acquire(device=GPU).encode())  # still registered, and the lock is free
        assert isinstance(protocol.decode(dealer.recv(), protocol.SCHEDULER_MESSAGES), protocol.Grant)
    finally:
        context.destroy(linger=0)


# --- the status socket: read-only status for every local user (issue 22) ------------------------

READ = """
import json, sys
from nvshare_py.control import ControlConnection, ControlFailure, read_only_status
from nvshare_py.paths import SocketPaths
paths = SocketPaths.resolve()
print(json.dumps({"status": read_only_status(paths, "status"),
                  "events": read_only_status(paths, "events")["events"]}))
try:
    with ControlConnection(paths, read_only=True) as connection:
        connection.request("set-tq", seconds=5)
except ControlFailure as failure:
    print(json.dumps({"code": failure.code, "exit": failure.exit_code}))
"""


def test_every_local_user_reads_who_holds_and_waits_and_sees_its_own_clients_in_full(scheduler):
    # Was: `nvsharectl status` exited 4 (permission denied) for every user but root, where
    # nvidia-smi answers everyone.
    as_other = as_other_user()
    os.chmod(scheduler.socket_dir, 0o755)  # mkdtemp's 0700 would keep other users out of all sockets
    holder = scheduler.agent(env={"NVSHARE_POD_NAME": "secret-pod"})
    holder.send(f"acquire {GPU}")
    holder.expect(f"granted {GPU}")
    own = subprocess.Popen(
        [*as_other, sys.executable, str(Path(__file__).resolve().parent.parent / "benchmarks" / "floodkit.py"),
         "hold", str(scheduler.paths.client_socket), "1", "--hello"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert own.stdout.readline().strip() == "1"
        result = run_child([*as_other, sys.executable, "-c", READ], scheduler.env)
        assert result.returncode == 0, result.stderr
        read, refused = (json.loads(line) for line in result.stdout.splitlines())
    finally:
        own.stdin.close()
        own.wait(60)
    status = read["status"]
    assert status["viewer"]["uid"] == OTHER_UID
    (holding,) = status["devices"][0]["holders"]
    assert holding["client"] == holder.client_id and holding["user"] == "root"
    assert holding["program"] == "agent.py" and holding["host_pid"] == holder.pid
    assert holding["since"] > 0 and holding["quantum_left"] > 0
    clients = {client["client"]: client for client in status["clients"]}
    root_client = clients[holder.client_id]
    assert root_client["devices"][GPU]["state"] == "holding"
    # Where another user's client runs and its settings are not for others to read ...
    assert not {"pod", "namespace", "host", "container", "pod_uid", "weight", "priority"} & set(root_client)
    assert "secret-pod" not in json.dumps(status)
    # ... but one's own clients are shown in full.
    (mine,) = [client for client in status["clients"] if client["uid"] == OTHER_UID]
    assert {"pod", "namespace", "host", "weight", "priority"} <= set(mine)
    assert "settings" not in status["scheduler"]
    assert any(event["kind"] == "grant" for event in read["events"])
    # Nothing changes state there.
    assert refused == {"code": "forbidden", "exit": 4}
    assert scheduler.status()["scheduler"]["defaults"]["tq"] == scheduler.options["tq"]


def test_the_status_socket_is_outside_what_containers_get(scheduler):
    # Containers get <socket-dir>/client mounted: the node's status (other pods' programs and
    # users) stays out of them; the status socket is in a directory of its own.
    assert scheduler.paths.status_socket.parent != scheduler.paths.client_dir
    assert stat.S_IMODE(os.stat(scheduler.paths.status_dir).st_mode) == 0o755
    assert stat.S_IMODE(os.stat(scheduler.paths.status_socket).st_mode) == 0o666
