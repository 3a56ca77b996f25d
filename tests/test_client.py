"""nvshare_py.client against the real daemon."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from nvshare_py.client import Client, Grant, SchedulerUnavailable, container_id, default_identity
from nvshare_py.testing.scheduler import PATIENCE, short_socket_dir, wait_for

GPU = "GPU-5151ad00-0000-4000-8000-000000000000"
GPU2 = "GPU-5151ad00-0000-4000-8000-000000000001"


@pytest.fixture
def clients(scheduler):
    """Make connected clients of the test's scheduler; all are closed afterwards."""
    made: list[Client] = []

    def make(**kwargs) -> Client:
        client = Client(scheduler.socket_dir, **kwargs)
        client.connect()
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


def acquire_in_thread(client: Client, device: str, timeout: float | None = None) -> dict:
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["grant"] = client.acquire(device, timeout)
        except BaseException as exc:  # handed to the test
            outcome["error"] = exc

    outcome["thread"] = threading.Thread(target=run, daemon=True)
    outcome["thread"].start()
    return outcome


# --- connecting ------------------------------------------------------------------------------


def test_no_scheduler_is_a_clear_error():
    directory = short_socket_dir()
    try:
        with pytest.raises(SchedulerUnavailable, match="no scheduler socket at .*scheduler.sock"):
            Client(directory).connect()
    finally:
        os.rmdir(directory)


def test_a_dead_schedulers_socket_is_a_clear_error(scheduler):
    scheduler.kill()
    with pytest.raises(SchedulerUnavailable, match="not running"):
        Client(scheduler.socket_dir).connect()


def test_a_hung_scheduler_is_a_clear_error(scheduler):
    os.kill(scheduler.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(SchedulerUnavailable, match="did not answer within 0.5 s"):
            Client(scheduler.socket_dir, connect_timeout=0.5).connect()
        assert time.monotonic() - started < 30  # it gives up rather than hanging
    finally:
        os.kill(scheduler.pid, signal.SIGCONT)


def test_connect_registers_with_identity(scheduler, clients):
    client = clients(info={"program": "trainer", "pod": "nb-1", "namespace": "team-b"})
    assert client.client_id.startswith("c")
    assert client.heartbeat_interval == 0.2 and client.idle_release == 0.3
    (entry,) = scheduler.status()["clients"]
    assert entry["client"] == client.client_id
    assert (entry["program"], entry["pod"], entry["namespace"], entry["host_pid"]) == ("trainer", "nb-1", "team-b", os.getpid())


def test_identity_follows_the_interceptors_rules(monkeypatch):
    # interceptor/client.c: the last run of exactly 64 hex digits in /proc/self/cgroup ...
    docker = "a" * 64
    containerd = "b" * 64
    assert container_id(f"0::/system.slice/docker-{docker}.scope\n") == docker
    assert container_id(f"1:cpu:/kubepods/pod1/{docker}\n0::/kubepods/pod1/cri-containerd-{containerd}.scope\n") == containerd
    assert container_id("0::/user.slice/" + "c" * 65 + "\n") == ""  # 65 digits are not a container id
    assert container_id("0::/\n") == ""
    # ... and $NVSHARE_PROGRAM, else the kernel's name for the process.
    monkeypatch.setenv("NVSHARE_PROGRAM", "analysis.ipynb")
    assert default_identity()["program"] == "analysis.ipynb"
    monkeypatch.delenv("NVSHARE_PROGRAM")
    assert default_identity()["program"] == Path("/proc/self/comm").read_text().strip()


@pytest.mark.scheduler_options(heartbeat_interval=0.2, heartbeat_timeout=2.5)
def test_heartbeats_keep_an_idle_client_registered(scheduler, clients):
    client = clients()
    # Over twice the heartbeat timeout without a word from the program: only the client's own
    # heartbeats (every 0.2 s, twelve to a timeout, so a busy machine can delay several of
    # them) keep it registered.
    time.sleep(5.5)
    assert scheduler.clients() == [client.client_id]
    assert not [e for e in scheduler.events() if e["kind"] == "unregister"]


def test_close_says_bye_and_disables_the_client(scheduler, clients):
    client = clients()
    client.acquire(GPU)
    client.close()
    wait_for(lambda: scheduler.clients() == [], what="the client to unregister")
    assert any(e["kind"] == "unregister" and e["detail"] == "bye" for e in scheduler.events())
    assert scheduler.holders(GPU) == []
    with pytest.raises(RuntimeError, match="closed"):
        client.acquire(GPU)
    client.close()  # idempotent


# --- the lock --------------------------------------------------------------------------------


def test_acquire_release_and_hold(scheduler, clients):
    first, second = clients(), clients()
    grant = first.acquire(GPU)
    assert isinstance(grant, Grant)
    assert (grant.device, grant.mode, grant.exclusive, grant.quantum) == (GPU, "on", True, scheduler.options["tq"])
    assert first.acquire(GPU) == grant  # idempotent while holding
    assert first.grant(GPU) == grant
    waiting = acquire_in_thread(second, GPU)
    wait_for(lambda: scheduler.waiters(GPU) == [second.client_id], what="the second client to queue")
    assert first.release(GPU) is True
    assert first.release(GPU) is False  # nothing left to release
    waiting["thread"].join(PATIENCE)
    assert waiting["grant"].id > grant.id
    second.release(GPU)
    with first.hold(GPU) as held:
        assert scheduler.holders(GPU) == [first.client_id]
        assert held == first.grant(GPU)
    assert first.grant(GPU) is None
    wait_for(lambda: scheduler.holders(GPU) == [], what="the release of the hold")


def test_one_client_can_hold_several_devices(scheduler, clients):
    client = clients()
    client.announce(GPU, 16 << 30, "first")
    client.announce(GPU2, 16 << 30, "second")
    client.acquire(GPU)
    client.acquire(GPU2)
    assert scheduler.holders(GPU) == [client.client_id] and scheduler.holders(GPU2) == [client.client_id]
    names = {d["device"]: d["name"] for d in scheduler.status()["devices"]}
    assert names == {GPU: "first", GPU2: "second"}


def test_a_timed_out_acquire_gives_a_late_grant_back(scheduler, clients):
    holder, impatient, third = clients(), clients(), clients()
    holder.acquire(GPU)
    with pytest.raises(TimeoutError):
        impatient.acquire(GPU, timeout=0.2)
    waiting = acquire_in_thread(third, GPU)
    wait_for(lambda: scheduler.waiters(GPU) == [impatient.client_id, third.client_id], what="both waiters")
    holder.release(GPU)
    # The impatient client's turn comes first; nobody wants it any more, so it passes on.
    waiting["thread"].join(PATIENCE)
    assert "grant" in waiting
    assert impatient.grant(GPU) is None


@pytest.mark.scheduler_options(tq=2)
def test_a_drop_is_answered_by_releasing(scheduler, clients):
    holder, waiter = clients(), clients()
    holder.acquire(GPU)
    waiting = acquire_in_thread(waiter, GPU)
    # The quantum (2 s) runs out while someone waits: DROP, and the default on_drop releases.
    waiting["thread"].join(PATIENCE)
    assert "grant" in waiting
    assert holder.grant(GPU) is None
    releases = [e for e in scheduler.events() if e["kind"] == "release" and e["client"] == holder.client_id]
    assert releases[-1]["detail"] == "drop"


def test_a_contention_notice_lets_the_holder_hand_over_before_its_quantum_ends(scheduler, clients):
    notices = []

    def on_contended(device, grant, quantum_left):
        notices.append((device, grant, quantum_left))
        holder.release(device, reason="quantum")

    holder, waiter = clients(on_contended=on_contended), clients()
    grant = holder.acquire(GPU)
    waiting = acquire_in_thread(waiter, GPU)
    waiting["thread"].join(PATIENCE)
    assert "grant" in waiting
    ((device, told, quantum_left),) = notices
    assert (device, told) == (GPU, grant) and 0 < quantum_left <= scheduler.options["tq"]
    # Handed over in answer to the notice: the quantum never ran out, so no DROP was needed.
    history = [(e["kind"], e["detail"]) for e in scheduler.events() if e["grant"] == grant.id]
    assert history == [("grant", ""), ("release", "quantum")]


@pytest.mark.scheduler_options(tq=2, grace=1)
def test_an_ignored_drop_ends_in_a_revoke(scheduler, clients):
    drops, revokes = [], []
    holder = clients(on_drop=lambda device, grant: drops.append(grant),
                     on_revoke=lambda device, grant, reason: revokes.append((grant, reason)))
    waiter = clients()
    grant = holder.acquire(GPU)
    waiting = acquire_in_thread(waiter, GPU)
    waiting["thread"].join(PATIENCE)  # after TQ (2 s) + grace (1 s)
    assert "grant" in waiting
    # The REVOKE reaches the holder's process independently of the waiter's GRANT.
    wait_for(lambda: revokes, what="the holder hears of the revoke")
    assert drops == [grant] and revokes == [(grant, "grace-expired")]
    assert holder.grant(GPU) is None
    assert holder.release(GPU) is False


def test_mode_changes_are_reported(scheduler, clients):
    modes = []
    client = clients(on_mode=lambda device, mode, quantum: modes.append((device, mode, quantum)))
    client.announce(GPU, 1 << 30)
    wait_for(lambda: scheduler.device(GPU), what="the device")
    scheduler.request("set-mode", mode="off", device=GPU)
    wait_for(lambda: modes, what="the MODE notice")
    assert modes == [(GPU, "off", scheduler.options["tq"])]
    grant = client.acquire(GPU)
    assert (grant.mode, grant.exclusive) == ("off", False)


def test_memory_reports_reach_the_scheduler(scheduler, clients):
    client = clients()
    client.announce(GPU, 16 << 30)
    for used in range(0, 5 << 20, 1 << 20):  # a burst is coalesced; the last figure counts
        client.report_memory(GPU, used)
    wait_for(lambda: (d := scheduler.device(GPU)) and d["used"] == 4 << 20, what="the last memory figure")
    client.report_memory(GPU, 7)
    client.acquire(GPU)  # the figure is sent before the ACQUIRE
    assert scheduler.device(GPU)["used"] == 7


# --- restarts and forks ----------------------------------------------------------------------


def test_clients_survive_a_scheduler_restart(scheduler, clients):
    holder, waiter = clients(), clients()
    holder.announce(GPU, 8 << 30, "sim")
    holder.acquire(GPU)
    waiting = acquire_in_thread(waiter, GPU)
    wait_for(lambda: scheduler.waiters(GPU) == [waiter.client_id], what="the waiter")
    scheduler.restart()
    # HELLO (claiming the device) and DEVICE (naming it) are two messages: wait for both.
    wait_for(lambda: len(scheduler.clients()) == 2 and scheduler.holders(GPU) and scheduler.device(GPU)["name"],
             what="re-registration, the holder naming its device again")
    assert holder.grant(GPU) is not None  # still holding
    assert scheduler.device(GPU)["name"] == "sim"  # DEVICE came again
    holder.release(GPU)
    waiting["thread"].join(PATIENCE)
    assert "grant" in waiting
    assert scheduler.holders(GPU) == [waiter.client_id]


def wait_for_exit(pid: int, what: str) -> int:
    """The exit status of child `pid`; after PATIENCE it is killed and the test fails."""
    try:
        return wait_for(lambda: (done := os.waitpid(pid, os.WNOHANG))[0] == pid and os.waitstatus_to_exitcode(done[1]) + 1,
                        what=what) - 1
    except AssertionError:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise


def test_a_child_forked_while_another_thread_holds_the_clients_lock_is_refused_not_stuck(scheduler, clients):
    """The client's I/O thread takes the client's lock many times a second; a fork in that
    moment leaves the lock held for ever in the child, where no I/O thread exists."""
    client = clients()
    locked, unlock = threading.Event(), threading.Event()

    def hold_the_lock() -> None:
        with client._cond:  # what the I/O thread does for every message and heartbeat
            locked.set()
            unlock.wait(PATIENCE)

    holder = threading.Thread(target=hold_the_lock)
    holder.start()
    assert locked.wait(PATIENCE)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            client.acquire(GPU, timeout=1)
        except RuntimeError:
            code = 0
        os._exit(code)
    unlock.set()
    holder.join()
    assert wait_for_exit(pid, "the forked child to give up on the parent's client") == 0


def test_a_forked_child_cannot_use_or_close_the_parents_client(scheduler, clients):
    client = clients()
    client.acquire(GPU)
    pid = os.fork()
    if pid == 0:  # the child: must fail loudly, and its close() must not say BYE for the parent
        code = 1
        try:
            client.acquire(GPU2, timeout=1)
        except RuntimeError:
            code = 0
        client.close()
        os._exit(code)
    assert wait_for_exit(pid, "the forked child") == 0
    # A round trip on the same connection: a BYE the child had sent would have come before it.
    client.acquire(GPU2, timeout=PATIENCE)
    assert scheduler.clients() == [client.client_id]
    assert scheduler.holders(GPU) == [client.client_id]


def test_limits_set_by_the_operator_are_kept_for_the_program(scheduler, clients):
    client = clients()
    client.announce(GPU, 16 << 30)
    wait_for(lambda: any(GPU in c["devices"] for c in scheduler.status()["clients"]), what="the announcement")
    scheduler.request("set-limit", client=client.client_id, bytes=8 << 30)
    wait_for(lambda: client.limit(GPU) == 8 << 30, what="the LIMIT", timeout=PATIENCE)
    scheduler.request("set-limit", client=client.client_id, bytes=None)
    wait_for(lambda: client.limit(GPU) is None, what="the limit removed", timeout=PATIENCE)


def test_a_limit_set_before_the_program_starts_is_known_when_it_has_registered(scheduler, clients):
    # Issue 20: limits came only once a device was named; they now come before WELCOME.
    scheduler.request("set-limit", bytes=1 << 30)
    scheduler.request("set-limit", bytes=2 << 30, device=GPU2)
    client = clients()  # connect() returns once registered
    assert (client.limit(GPU), client.limit(GPU2)) == (1 << 30, 2 << 30)
