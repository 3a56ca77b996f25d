"""The scheduler daemon end to end: real daemon process, real client processes, real sockets."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import stat
import sys
import time

import pytest
import trio
import trio.testing
import zmq

from nvshare_py import protocol
from nvshare_py import protocol_table as table
from nvshare_py.scheduler import events as ev
from nvshare_py.scheduler.core import SchedulerCore
from nvshare_py.scheduler.daemon import CoreFailure, Daemon, DaemonConfig
from nvshare_py.testing.scheduler import PATIENCE, SchedulerProcess, short_socket_dir, wait_for

GPU = "GPU-5151ad00-0000-4000-8000-000000000000"


def said_hello(context: zmq.Context, endpoint: str, timeout_ms: int) -> tuple[zmq.Socket, str]:
    """A bare client socket (no interceptor) connected to the daemon that has said HELLO, and
    the WELCOME it got."""
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVTIMEO, timeout_ms)
    dealer.connect(endpoint)
    dealer.send(b"NVSHARE/1 HELLO\npid=1\nsession=00000000000000aa")
    return dealer, dealer.recv().decode()


def granted_lines(agent) -> list[str]:
    return [line for line in agent.lines if line.startswith("granted")]


def test_handoff_between_two_client_processes(scheduler):
    first, second = scheduler.agent(), scheduler.agent()
    first.send(f"acquire {GPU}")
    first.expect(f"granted {GPU}")
    second.send(f"acquire {GPU}")
    wait_for(lambda: scheduler.waiters(GPU) == [second.client_id], what="the second client to wait")
    assert scheduler.holders(GPU) == [first.client_id]
    assert granted_lines(second) == []  # the lock is exclusive in mode on

    first.send(f"release {GPU}")
    line = second.expect(f"granted {GPU}")
    assert line.endswith(" on 1")  # mode on, exclusive
    assert scheduler.holders(GPU) == [second.client_id]
    kinds = [(e["kind"], e["client"]) for e in scheduler.events() if e["device"] == GPU]
    assert kinds.index(("release", first.client_id)) < kinds.index(("grant", second.client_id))


def test_sigkill_of_the_holder_passes_the_lock_on(scheduler):
    holder, waiter = scheduler.agent(), scheduler.agent()
    holder.send(f"acquire {GPU}")
    holder.expect(f"granted {GPU}")
    waiter.send(f"acquire {GPU}")
    wait_for(lambda: scheduler.waiters(GPU) == [waiter.client_id], what="the waiter to queue")

    holder.kill()  # SIGKILL: no BYE, no RELEASE; the daemon sees the process exit (pidfd) or
    # its connection close, whichever the kernel reports first
    waiter.expect(f"granted {GPU}")
    status = scheduler.status()
    assert holder.client_id not in [c["client"] for c in status["clients"]]
    lost = [e for e in scheduler.events() if e["kind"] == "lost" and e["client"] == holder.client_id]
    assert lost and lost[0]["detail"] in ("exited", "disconnected")


def test_sigkill_of_a_waiter_removes_it_from_the_queue(scheduler):
    holder, doomed, patient = scheduler.agent(), scheduler.agent(), scheduler.agent()
    holder.send(f"acquire {GPU}")
    holder.expect(f"granted {GPU}")
    doomed.send(f"acquire {GPU}")
    wait_for(lambda: scheduler.waiters(GPU) == [doomed.client_id], what="first waiter")
    patient.send(f"acquire {GPU}")
    wait_for(lambda: scheduler.waiters(GPU) == [doomed.client_id, patient.client_id], what="second waiter")

    doomed.kill()
    wait_for(lambda: scheduler.waiters(GPU) == [patient.client_id], what="the killed waiter to leave the queue")
    holder.send(f"release {GPU}")
    patient.expect(f"granted {GPU}")


@pytest.mark.scheduler_options(heartbeat_timeout=2)
def test_a_stopped_holder_times_out_and_recovers_when_resumed(scheduler):
    holder, waiter = scheduler.agent(), scheduler.agent()
    holder.send(f"acquire {GPU}")
    holder.expect(f"granted {GPU}")
    waiter.send(f"acquire {GPU}")
    wait_for(lambda: scheduler.waiters(GPU) == [waiter.client_id], what="the waiter to queue")

    holder.signal(signal.SIGSTOP)  # alive (pidfd silent) but mute: only heartbeats tell
    try:
        waiter.expect(f"granted {GPU}")
        assert holder.client_id not in scheduler.clients()
    finally:
        holder.signal(signal.SIGCONT)
    # Resumed, the client learns that its registration and its grant are gone ...
    holder.expect(f"revoked {GPU}")
    holder.send(f"grant {GPU}")
    assert holder.expect(f"grant {GPU}") == f"grant {GPU} none"
    # ... registers again and can queue for the device like anyone else.
    wait_for(lambda: len(scheduler.clients()) == 2, what="the resumed client to register again")
    holder.send(f"acquire {GPU}")
    waiter.send(f"release {GPU}")
    holder.expect(f"granted {GPU}")
    assert holder.process.poll() is None and waiter.process.poll() is None


def test_restart_keeps_the_holder_and_the_waiter(scheduler):
    holder, waiter = scheduler.agent(), scheduler.agent()
    holder.send(f"announce {GPU} 17179869184 simulated")
    holder.send(f"acquire {GPU}")
    holder.expect(f"granted {GPU}")
    waiter.send(f"acquire {GPU}")
    wait_for(lambda: scheduler.waiters(GPU) == [waiter.client_id], what="the waiter to queue")

    scheduler.restart()
    # HELLO (claiming the device) and DEVICE (naming it) are two messages: wait for both.
    status = wait_for(
        lambda: (s := scheduler.status())["devices"] and len(s["clients"]) == 2 and s["devices"][0]["name"] and s,
        what="both clients to re-register and the holder to name its device again",
    )
    assert status["scheduler"]["restarted"] is True
    (device,) = status["devices"]
    assert len(device["holders"]) == 1 and len(device["waiters"]) == 1
    assert device["name"] == "simulated"  # DEVICE repeated after the reconnection
    holder_id, waiter_id = device["holders"][0]["client"], device["waiters"][0]["client"]
    pids = {c["client"]: c["host_pid"] for c in status["clients"]}
    assert pids[holder_id] == holder.pid and pids[waiter_id] == waiter.pid

    holder.send(f"grant {GPU}")
    assert holder.expect(f"grant {GPU}") != f"grant {GPU} none"  # the holder kept its lock
    assert granted_lines(waiter) == []
    holder.send(f"release {GPU}")
    waiter.expect(f"granted {GPU}")
    assert holder.process.poll() is None and waiter.process.poll() is None


def test_restart_after_sigkill_of_the_daemon(scheduler):
    holder = scheduler.agent()
    holder.send(f"acquire {GPU}")
    holder.expect(f"granted {GPU}")
    scheduler.restart(kill=True)
    wait_for(lambda: scheduler.holders(GPU), what="the holder to reclaim its lock")
    other = scheduler.agent()
    other.send(f"acquire {GPU}")
    wait_for(lambda: scheduler.waiters(GPU) == [other.client_id], what="the new client to wait")
    holder.send(f"release {GPU}")
    other.expect(f"granted {GPU}")


def test_a_forked_child_cannot_keep_the_dead_parents_registration(scheduler):
    parent, waiter = scheduler.agent(), scheduler.agent()
    parent.send(f"acquire {GPU}")
    parent.expect(f"granted {GPU}")
    parent.send("fork")
    child_pid = int(parent.expect("forked").split()[1])
    try:
        # The child inherited the connection but may not use the parent's client. (Its line and
        # the parent's "forked" line come in either order.)
        wait_for(lambda: any(line.startswith("child") for line in parent.lines), what="the child to report")
        assert [line for line in parent.lines if line.startswith("child")] == ["child refused RuntimeError"]
        waiter.send(f"acquire {GPU}")
        wait_for(lambda: scheduler.waiters(GPU) == [waiter.client_id], what="the waiter to queue")
        parent.kill()  # the child lives on, holding the inherited socket open
        os.kill(child_pid, 0)
        waiter.expect(f"granted {GPU}")
        assert parent.client_id not in scheduler.clients()
    finally:
        os.kill(child_pid, signal.SIGKILL)


def test_socket_directory_permissions(scheduler):
    paths = scheduler.paths
    assert stat.S_IMODE(os.stat(paths.client_dir).st_mode) == 0o755
    assert stat.S_IMODE(os.stat(paths.control_dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(paths.client_socket).st_mode) == 0o666
    assert stat.S_IMODE(os.stat(paths.control_socket).st_mode) == 0o600
    assert stat.S_ISSOCK(os.stat(paths.client_socket).st_mode)


def test_stop_is_clean_and_leaves_the_socket_files(scheduler):
    assert scheduler.stop() == 0
    assert stat.S_ISSOCK(os.lstat(scheduler.paths.client_socket).st_mode)
    assert "stopped" in scheduler.log_text()
    scheduler.start()  # the lock file was released
    assert scheduler.status()["scheduler"]["restarted"] is True


def test_a_second_daemon_on_the_same_directory_is_refused(scheduler):
    second = SchedulerProcess(scheduler.socket_dir, dict(scheduler.options))
    result = second.run_to_exit()
    assert result.returncode == 1
    assert f"another nvshare-scheduler (pid {scheduler.pid})" in result.stderr
    assert scheduler.status()["scheduler"]["pid"] == scheduler.pid  # the first one is unharmed


def test_socket_paths_over_107_bytes_are_refused():
    base = short_socket_dir()
    try:
        long_dir = base / ("d" * (107 - len(str(base)) - len("/control/control.sock") + 5))
        process = SchedulerProcess(long_dir, {})
        result = process.run_to_exit()
        assert result.returncode == 1
        assert "limited to 107 bytes" in result.stderr
        assert not long_dir.exists()
    finally:
        os.rmdir(base)


def test_idle_daemon_does_not_wake_up(scheduler):
    def thread_switches() -> int:
        """The daemon's threads' voluntary context switches: each time one of them blocked
        again after waking. Involuntary ones are other processes taking the CPU from a
        thread that runs (CPU hogs beside the suite), not the daemon waking up."""
        total = 0
        for tid in os.listdir(f"/proc/{scheduler.pid}/task"):
            with open(f"/proc/{scheduler.pid}/task/{tid}/status") as status:
                fields = dict(line.split(":", 1) for line in status)
            total += int(fields["voluntary_ctxt_switches"])
        return total

    def quiet_for_half_a_second() -> bool:
        before = thread_switches()
        time.sleep(0.5)
        return thread_switches() == before

    # The fixture's readiness request (a control connection) winds down first, however long a
    # busy machine makes that take; a daemon that polls never gets quiet and fails here.
    wait_for(quiet_for_half_a_second, what="the daemon to settle")
    before = thread_switches()
    time.sleep(2.0)
    # No clients, no deadlines: nothing may wake any of the daemon's threads (a polling loop
    # would show hundreds of context switches; a few are left for a worker thread of Trio's
    # cache that ends while we look).
    assert thread_switches() - before <= 4


def test_a_failing_core_stops_the_daemon_and_leaves_its_sockets_for_recovery(monkeypatch):
    # In-process: the core raising on a client event may have left its lock table half
    # updated. The daemon must not serve on from it (it did, logging the error): it stops with
    # CoreFailure and leaves the client socket in place, so the next daemon runs recovery.
    directory = short_socket_dir()
    daemon = Daemon(DaemonConfig(socket_dir=directory))
    real_handle = SchedulerCore.handle

    def handle(core, event):
        if isinstance(event, ev.AcquireRequest):
            raise RuntimeError("a bug in the core")
        return real_handle(core, event)

    monkeypatch.setattr(SchedulerCore, "handle", handle)

    def client() -> str:
        context = zmq.Context()
        try:
            dealer, welcome = said_hello(context, daemon.paths.client_endpoint, 30_000)
            dealer.send(f"NVSHARE/1 ACQUIRE\ndevice={GPU}".encode())
            return welcome
        finally:
            context.destroy(linger=0)

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(daemon.serve)
            assert "WELCOME" in await trio.to_thread.run_sync(client)
            await trio.sleep_forever()  # serve() must end the nursery by raising

    daemon.open()
    try:
        with pytest.raises(BaseException) as caught:
            trio.run(main)
        failures, _ = caught.value.split(CoreFailure) if isinstance(caught.value, BaseExceptionGroup) \
            else ((caught.value,), None)
        assert failures, caught.value
    finally:
        daemon.close()
    try:
        assert stat.S_ISSOCK(os.lstat(daemon.paths.client_socket).st_mode)
    finally:
        shutil.rmtree(directory)


def test_a_new_client_message_reaches_the_core_as_it_came_and_one_it_cannot_use_is_ignored(monkeypatch):
    # docs/architecture.md's recipe for a message from the client: its row in the table (here
    # added at test time, with the class protocol_gen would write), the client's sender, the
    # core's handler. The daemon needs no change: it feeds the message as a ClientMessage, and
    # a core without the handler ignores it; the connection is served on, no ERROR sent.
    row = table.Message("LAPSE", "Lapse", table.CLIENT, (table.required("silent_ms", table.UINT),), "test")
    monkeypatch.setitem(table.BY_TYPE, "LAPSE", row)

    @dataclasses.dataclass(frozen=True, slots=True)
    class Lapse(protocol.Message):
        TYPE = "LAPSE"
        silent_ms: int

    monkeypatch.setitem(protocol.CLIENT_MESSAGES, "LAPSE", Lapse)
    fed: list[ev.Event] = []
    real_handle = SchedulerCore.handle

    def handle(core, event):
        fed.append(event)
        return real_handle(core, event)

    monkeypatch.setattr(SchedulerCore, "handle", handle)
    directory = short_socket_dir()
    daemon = Daemon(DaemonConfig(socket_dir=directory))

    def client() -> list[str]:
        context = zmq.Context()
        try:
            dealer, welcome = said_hello(context, daemon.paths.client_endpoint, int(PATIENCE * 1000))
            replies = [welcome]
            dealer.send(b"NVSHARE/1 LAPSE\nsilent_ms=1500")
            dealer.send(f"NVSHARE/1 EVICTED\ndevice={GPU}\nresident=0".encode())  # for no device of its: ignored
            dealer.send(b"NVSHARE/1 QUERY")
            replies.append(dealer.recv().decode())  # an ERROR for either would come first
            return replies
        finally:
            context.destroy(linger=0)

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(daemon.serve)
            replies = await trio.to_thread.run_sync(client)
            nursery.cancel_scope.cancel()
        return replies

    daemon.open()
    try:
        welcome, status = trio.run(main)
    finally:
        daemon.close()
        shutil.rmtree(directory)
    assert welcome.startswith("NVSHARE/1 WELCOME") and status.startswith("NVSHARE/1 STATUS"), (welcome, status)
    as_they_came = [event.message for event in fed if isinstance(event, ev.ClientMessage)]
    assert as_they_came == [Lapse(silent_ms=1500), protocol.Evicted(device=GPU, resident=0)], fed


def test_sigint_stops_the_daemon_cleanly(scheduler):
    scheduler.process.send_signal(signal.SIGINT)
    assert scheduler.process.wait(PATIENCE) == 0
    assert "stopping signal=SIGINT" in scheduler.log_text()


def test_options_reach_the_clients(scheduler_factory):
    scheduler = scheduler_factory(heartbeat_interval=0.25, idle_release=0.75, tq=3)
    context = zmq.Context()
    try:
        dealer, welcome = said_hello(context, scheduler.paths.client_endpoint, 10_000)
        assert "heartbeat_ms=250" in welcome and "idle_release_ms=750" in welcome
        dealer.send(f"NVSHARE/1 ACQUIRE\ndevice={GPU}".encode())
        grant = dealer.recv().decode()
        assert "quantum_ms=3000" in grant and "exclusive=1" in grant
    finally:
        context.destroy(linger=0)


def test_invalid_options_are_usage_errors():
    directory = short_socket_dir()
    try:
        for bad in (["--tq", "0"], ["--heartbeat-timeout", "0.5", "--heartbeat-interval", "1"], ["--mode", "sometimes"],
                    ["--tq", "inf"], ["--grace", "1e300"], ["--recovery", "inf"]):
            process = SchedulerProcess(directory, {})
            result = process.run_to_exit(*bad)
            assert result.returncode == 2, (bad, result.stderr)
            assert "Traceback" not in result.stderr
    finally:
        os.rmdir(directory)  # refused before anything was created in it


def test_a_socket_directory_of_another_user_is_refused():
    if os.geteuid() != 0:
        pytest.skip("giving a directory to another uid needs root")
    directory = short_socket_dir()
    try:
        # E.g. another user created the /tmp default first: they could swap the sockets.
        os.chown(directory, 1001, 1001)
        result = SchedulerProcess(directory, {}).run_to_exit()
        assert result.returncode == 1
        assert f"{directory} belongs to uid 1001" in result.stderr
        assert os.listdir(directory) == []
    finally:
        os.rmdir(directory)


def test_a_world_writable_socket_directory_without_sticky_bit_is_refused():
    # Issue 12: a root-owned 0777 directory was accepted; another user renamed client/ and
    # control/ and put their own sockets there.
    directory = short_socket_dir()
    try:
        os.chmod(directory, 0o777)
        result = SchedulerProcess(directory, {}).run_to_exit()
        assert result.returncode == 1
        assert "writable by others (mode 777) without the sticky bit" in result.stderr
        assert os.listdir(directory) == []
        os.chmod(directory, 0o1777)  # sticky, as /tmp: nobody may rename what is not theirs
        process = SchedulerProcess(directory, {})
        process.start()
        assert process.stop() == 0
    finally:
        shutil.rmtree(directory)


def test_auto_mode_shares_while_memory_fits(scheduler_factory):
    scheduler = scheduler_factory(mode="auto", tq=30, gpus=1)  # the daemon measures 16 GiB
    gib = 1 << 30
    first, second, third = scheduler.agent(), scheduler.agent(), scheduler.agent()
    for agent in (first, second, third):
        agent.send(f"announce {GPU} {16 * gib}")
    first.send(f"memory {GPU} {6 * gib}")
    second.send(f"memory {GPU} {6 * gib}")
    third.send(f"memory {GPU} {12 * gib}")
    for agent in (first, second, third):
        agent.expect("reported")
    wait_for(lambda: (d := scheduler.device(GPU)) and d["used"] == 24 * gib, what="the memory reports")

    first.send(f"acquire {GPU}")
    assert first.expect(f"granted {GPU}").endswith(" auto 0")
    second.send(f"acquire {GPU}")
    second.expect(f"granted {GPU}")  # 6 + 6 GiB fit in 16 GiB: both run
    third.send(f"acquire {GPU}")
    wait_for(lambda: scheduler.waiters(GPU) == [third.client_id], what="the third client to wait (24 GiB > 16 GiB)")
    assert sorted(scheduler.holders(GPU)) == sorted([first.client_id, second.client_id])

    # Memory grows past the budget: the later holder is dropped (and releases), the first keeps it.
    second.send(f"memory {GPU} {12 * gib}")
    assert second.expect("drop").startswith(f"drop {GPU}")
    wait_for(lambda: scheduler.holders(GPU) == [first.client_id], what="the later holder to give way")
    # 6 + 12 GiB do not fit either: the third waits until the first holder leaves.
    assert scheduler.waiters(GPU) == [third.client_id]
    first.send(f"release {GPU}")
    third.expect(f"granted {GPU}")

    # The budget is the operator's: below the measured total, fewer processes fit beside
    # each other; `null` returns to the device's total.
    assert scheduler.request("set-budget", device=GPU, bytes=4 * gib) == {"device": GPU, "budget": 4 * gib}
    assert scheduler.device(GPU)["budget"] == 4 * gib
    scheduler.request("set-budget", device=GPU, bytes=None)
    assert scheduler.device(GPU)["budget"] == 16 * gib


def test_a_status_too_large_for_one_reply_is_cut_and_says_so():
    # Issue 12: `nvsharectl status` failed ("too-large: reply of 21107997 bytes") once clients
    # had made the device table large; status must always answer.
    from nvshare_py.scheduler.control import fitted

    devices = [{"device": f"GPU-{n:08d}", "name": "x" * 100, "holders": [], "waiters": []} for n in range(40_000)]
    clients = [{"client": f"c{n}", "program": "y" * 100, "devices": {}} for n in range(40_000)]
    reply = {"v": 1, "ok": True, "result": {"scheduler": {}, "devices": devices, "clients": clients}}
    data = fitted(reply)
    assert len(data) <= protocol.CONTROL_REPLY_MAX
    result = json.loads(data)["result"]
    shown_devices, shown_clients = len(result["devices"]), len(result["clients"])
    assert shown_devices > 0 and shown_clients > 0
    assert result["truncated"] == {"devices": 40_000 - shown_devices, "clients": 40_000 - shown_clients}
    # Gangs (one per client at most) are cut with the clients.
    gangs = [{"gang": f"g{n}", "name": "z" * 100, "members": [f"c{n}"]} for n in range(40_000)]
    with_gangs = json.loads(fitted(dict(reply, result=dict(reply["result"], gangs=gangs))))["result"]
    assert with_gangs["truncated"]["gangs"] == 40_000 - len(with_gangs["gangs"]) > 0
    assert result["devices"] == devices[:shown_devices]


class FailingCoreScheduler(SchedulerProcess):
    """The daemon's command line with a lock core that raises on events of one type."""

    PATCH = """
import sys
from nvshare_py.scheduler import events
from nvshare_py.scheduler.core import SchedulerCore
failing = getattr(events, sys.argv.pop(1))
real_handle = SchedulerCore.handle
def handle(core, event):
    if isinstance(event, failing):
        raise RuntimeError("a bug in the core")
    return real_handle(core, event)
SchedulerCore.handle = handle
from nvshare_py.scheduler.cli import main
main()
"""

    def __init__(self, failing: str) -> None:
        super().__init__(short_socket_dir(), {"heartbeat_timeout": 300})
        self.failing = failing

    def command(self) -> list[str]:
        return [sys.executable, "-c", self.PATCH, self.failing, *super().command()[3:]]


@pytest.mark.parametrize("failing", ["SetQuantum", "AcquireRequest"])
def test_a_core_failure_on_any_path_ends_the_daemon_with_status_70(failing):
    # Issue 20: the control request's broad `except Exception` caught CoreFailure and served
    # on from a possibly half-updated lock table, and the daemon exited 1, not the documented 70.
    scheduler = FailingCoreScheduler(failing)
    scheduler.start()
    try:
        agent = scheduler.agent()
        if failing == "SetQuantum":
            try:
                scheduler.request("set-tq", seconds=5, timeout=5)
            except Exception:
                pass  # no answer: the daemon is gone
        else:
            agent.send(f"acquire {GPU}")
        assert scheduler.process.wait(PATIENCE) == 70, scheduler.log_text()[-3000:]
        assert f"CRITICAL the lock core failed on {failing}" in scheduler.log_text()
        # The socket stays for the next daemon, which recovers the clients' locks.
        assert stat.S_ISSOCK(os.lstat(scheduler.paths.client_socket).st_mode)
        agent.kill()
        scheduler.start()
        assert scheduler.status()["scheduler"]["restarted"] is True
    finally:
        scheduler.cleanup()
        shutil.rmtree(scheduler.socket_dir, ignore_errors=True)
