"""The IPython extension (nvshare_py.ipython) outside a kernel: its link to the scheduler keeps
answers and questions paired, the note after a cell tells how long the cell waited and for
whom, the status reads right, and nothing is asked where there is no scheduler.
(tests/test_jupyter_kernels.py runs it inside real kernels.)"""

from __future__ import annotations

import os
import shutil
import threading
import time
from types import SimpleNamespace

import pytest
import zmq
from IPython.core.events import EventManager, available_events

import nvshare_py
from nvshare_py import ipython, protocol
from nvshare_py.client import Client
from nvshare_py.devicenames import DeviceNames
from nvshare_py.testing.scheduler import PATIENCE, short_socket_dir, wait_for
from nvshare_py.ipython import (
    NOT_UNDER_NVSHARE,
    CellNote,
    Extension,
    KernelStatus,
    QueryFailed,
    SchedulerLink,
    WaitNote,
    cell_waits,
    query,
)
from nvshare_py.paths import SocketPaths
from nvshare_py.scheduler.views import user_name


def ipython_user() -> str:
    return user_name(os.geteuid())

GPU0 = "GPU-5151ad00-0000-4000-8000-000000000000"


class StubShell:
    """What the extension needs of an IPython shell, without starting one in pytest."""

    def __init__(self) -> None:
        self.events = EventManager(self, available_events)
        self.magics_manager = SimpleNamespace(registry={})

    def register_magics(self, magics) -> None:
        self.magics_manager.registry[type(magics).__name__] = magics


def status_document(**devices: str) -> dict:
    return {"pid": 1, "clients": ["c2"], "devices": [entry(device, state) for device, state in devices.items()]}


def entry(device: str, state: str, wait_total: float = 0.0, **extra) -> dict:
    base = {"device": device, "name": "sim", "client": "c2", "mode": "on", "tq": 30.0, "state": state,
            "position": 1 if state == "waiting" else 0, "waiters": 1 if state == "waiting" else 0,
            "waiting_for": 2.5 if state == "waiting" else 0.0, "wait_total": wait_total, "hold_total": 0.0,
            "grants": 0, "used": 3 << 20, "quantum_left": None,
            "holders": [{"client": "c1", "program": "<b>train</b>", "pod": "nb-0"}], "last_wait": None}
    return {**base, **extra}


# --- the link ------------------------------------------------------------------------------


class FakeScheduler:
    """A ROUTER at the client socket's path that answers QUERY when told to."""

    def __init__(self) -> None:
        self.root = short_socket_dir()
        self.paths = SocketPaths(self.root)
        self.paths.client_dir.mkdir()
        self.context = zmq.Context()
        self.router = self.context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(self.paths.client_endpoint)

    def receive(self, timeout: float = PATIENCE) -> bytes | None:
        """The routing id of the next QUERY, or None if none comes within `timeout`."""
        if not self.router.poll(round(timeout * 1000)):
            return None
        peer, body = self.router.recv_multipart()
        assert protocol.decode(body) == protocol.Query()
        return peer

    def answer(self, peer: bytes, message: protocol.Message) -> None:
        self.router.send_multipart([peer, message.encode()])

    def close(self) -> None:
        self.router.close()
        self.context.term()
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture
def fake():
    scheduler = FakeScheduler()
    yield scheduler
    scheduler.close()


def marked(number: int) -> protocol.Status:
    return protocol.Status.of({"pid": number, "clients": [], "devices": []})


def test_answers_go_to_their_own_questions_even_when_read_out_of_order(fake):
    link = SchedulerLink(fake.paths)
    first, second = link.send(), link.send()
    for number in (1, 2):
        fake.answer(fake.receive(), marked(number))
    deadline = time.monotonic() + PATIENCE
    assert link.result(second, deadline)["pid"] == 2
    assert link.result(first, deadline)["pid"] == 1
    link.close()


def test_a_late_answer_is_never_taken_for_the_next_question(fake):
    link = SchedulerLink(fake.paths)
    stale = link.send()
    late_peer = fake.receive()
    with pytest.raises(QueryFailed) as failed:
        link.result(stale, time.monotonic() + 0.1)
    assert failed.value.timed_out
    fake.answer(late_peer, marked(1))  # arrives after the question was given up
    fresh = link.send()
    fake.answer(fake.receive(), marked(2))
    assert link.result(fresh, time.monotonic() + PATIENCE)["pid"] == 2
    link.close()


def test_an_older_scheduler_is_named_as_the_reason(fake):
    link = SchedulerLink(fake.paths)
    ticket = link.send()
    fake.answer(fake.receive(), protocol.Error(code="unknown-type", detail="unknown message type QUERY", type="QUERY"))
    with pytest.raises(QueryFailed, match="older"):
        link.result(ticket, time.monotonic() + PATIENCE)
    link.close()


def test_without_a_scheduler_socket_nothing_is_asked_or_opened(capsys, tmp_path):
    extension = Extension(StubShell(), SocketPaths(tmp_path))
    extension.interceptor = "/pretend/libnvshare.so"
    extension._notice_due = False
    extension.pre_run_cell()
    extension.post_run_cell()
    assert extension.link._socket is None
    assert capsys.readouterr() == ("", "")
    with pytest.raises(QueryFailed, match="does not exist"):
        query(socket_dir=extension.paths.root)


def test_a_silent_scheduler_pauses_the_notes_instead_of_slowing_every_cell(fake, capsys):
    extension = Extension(StubShell(), fake.paths)
    extension.interceptor = "/pretend/libnvshare.so"
    extension._notice_due = False
    extension.pre_run_cell()
    assert fake.receive() is not None
    # Every wait at the cell's end is cut at CELL_QUERY_TIMEOUT: seen in the deadline each wait
    # is given (how long the cut then takes is the machine's business).
    allowed = []
    result = extension.link.result

    def result_recording_its_patience(ticket, deadline):
        allowed.append(deadline - time.monotonic())
        return result(ticket, deadline)

    extension.link.result = result_recording_its_patience
    extension.post_run_cell()
    assert allowed and max(allowed) <= ipython.CELL_QUERY_TIMEOUT
    assert "paused" in capsys.readouterr().err
    assert fake.receive(timeout=PATIENCE) is not None  # the cell's second query
    extension.pre_run_cell()
    extension.post_run_cell()
    assert fake.receive(timeout=0.3) is None  # nothing asked for the next cell


def test_a_cell_waiting_for_a_missing_scheduler_says_so_in_its_output(capsys, tmp_path, fake):
    extension = Extension(StubShell(), SocketPaths(tmp_path))  # nothing serves there
    extension.interceptor = "/pretend/libnvshare.so"
    extension._notice_due = False
    extension.watch.missing_after = 0.2
    seen = []

    def told() -> bool:
        seen.append(capsys.readouterr().err)
        return "its GPU calls wait for a scheduler, but none answers" in "".join(seen)

    try:
        extension.pre_run_cell()  # a cell that runs on (blocked in a GPU call)
        wait_for(told, timeout=30, what="the note about the missing scheduler")
        assert str(extension.paths.client_socket) in "".join(seen) and "Start nvshare-scheduler" in "".join(seen)
        extension.post_run_cell()
        assert "".join(seen).count("none answers") == 1  # once per cell

        # Where a scheduler answers, a long cell is simply waiting its turn: nothing is said.
        served = Extension(StubShell(), fake.paths)
        served.interceptor = "/pretend/libnvshare.so"
        served._notice_due = False
        served.watch.missing_after = 0.2
        served.watch.wait_after = None  # only the missing-scheduler check looks here
        served.pre_run_cell()
        fake.receive()
        wait_for(lambda: served.watch.looked == 1, timeout=30, what="the watch to look for the scheduler")
        served.watch.cell_ended()
        served.watch.stop()
        assert "none answers" not in capsys.readouterr().err
    finally:
        extension.unregister()


def test_a_kernel_not_under_nvshare_says_so_in_its_first_cell_only(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("NVSHARE_SOCKET_DIR", str(tmp_path))
    monkeypatch.setattr(ipython, "interceptor_path", lambda: None)
    shell = StubShell()
    nvshare_py.load_ipython_extension(shell)  # at kernel start: no cell to show it in yet
    for _ in range(2):
        shell.events.trigger("pre_run_cell", None)
    assert capsys.readouterr().err.count(NOT_UNDER_NVSHARE) == 1
    assert shell.events.callbacks["pre_run_cell"] == []


@pytest.mark.parametrize("interceptor", ["/pretend/libnvshare.so", None])
def test_unloading_removes_every_hook(capsys, monkeypatch, tmp_path, interceptor):
    monkeypatch.setenv("NVSHARE_SOCKET_DIR", str(tmp_path))
    monkeypatch.setattr(ipython, "interceptor_path", lambda: interceptor)
    shell = StubShell()
    nvshare_py.load_ipython_extension(shell)
    nvshare_py.unload_ipython_extension(shell)
    shell.events.trigger("pre_run_cell", None)
    shell.events.trigger("post_run_cell", None)
    assert shell.events.callbacks["pre_run_cell"] == shell.events.callbacks["post_run_cell"] == []
    assert capsys.readouterr() == ("", "")


# --- the note after a cell -----------------------------------------------------------------


def test_a_cell_that_waited_gets_a_note_naming_the_holder_and_others_get_none(scheduler, capsys, monkeypatch):
    # The cut of a cell's queries is another test's subject: here a busy machine's scheduler
    # may take its time to answer, and the note must still come.
    monkeypatch.setattr(ipython, "CELL_QUERY_TIMEOUT", PATIENCE)
    extension = Extension(StubShell(), SocketPaths(scheduler.socket_dir))
    extension.interceptor = "/pretend/libnvshare.so"  # this process registers through Client below
    extension._notice_due = False
    extension.note_seconds = 0.5
    holder = scheduler.agent()
    holder.send(f"announce {GPU0} {16 << 30} sim")
    holder.send(f"acquire {GPU0}")
    holder.expect(f"granted {GPU0}")
    with Client(socket_dir=scheduler.socket_dir) as client:
        client.announce(GPU0, 16 << 30, "sim")

        extension.pre_run_cell()  # the cell: wait for the GPU until the holder lets go
        granted = threading.Event()
        threading.Thread(target=lambda: (client.acquire(GPU0), granted.set()), daemon=True).start()
        wait_for(lambda: query(socket_dir=scheduler.socket_dir)["devices"][0]["waiting_for"] >= 0.6,
                 what="this process waiting 0.6 s")
        holder.send(f"release {GPU0}")
        assert granted.wait(PATIENCE)
        extension.post_run_cell()
        note = capsys.readouterr().out
        assert note.startswith("nvshare: this cell waited ")
        assert f"for the GPU held by {holder.client_id} ({ipython_user()}, agent.py)" in note
        assert note.endswith(")\n")  # one line, ended
        seconds = float(note.split("waited ")[1].split(" s")[0])
        assert seconds >= 0.6

        extension.pre_run_cell()  # a cell that uses the GPU it holds: no wait, no note
        client.release(GPU0)
        client.acquire(GPU0)
        extension.post_run_cell()
        assert capsys.readouterr().out == ""

        extension.note_seconds = None  # %nvshare note off
        extension.pre_run_cell()
        extension.post_run_cell()
        assert capsys.readouterr().out == ""


def test_waits_are_counted_per_device_and_a_new_registration_counts_from_zero():
    before = {"pid": 1, "clients": ["c2"], "devices": [entry("GPU-a", "holding", 5.0), entry("GPU-b", "idle", 9.0)]}
    after = {"pid": 1, "clients": ["c7"], "devices": [
        entry("GPU-a", "holding", 7.5, last_wait={"seconds": 2.5, "held_by": [{"client": "c1", "program": "p", "pod": ""}]}),
        entry("GPU-b", "idle", 1.0),  # re-registered: its totals started again
    ]}
    waits = {device: (seconds, ahead) for device, seconds, ahead in cell_waits(before, after)}
    assert waits["GPU-a"][0] == pytest.approx(2.5) and waits["GPU-a"][1][0]["client"] == "c1"
    assert waits["GPU-b"][0] == pytest.approx(1.0)
    note = CellNote([("GPU-a", 2.5, waits["GPU-a"][1]), ("GPU-b", 61.0, [])]).text().splitlines()
    assert note == ["nvshare: this cell waited 2.5 s for the GPU held by c1 (p) (GPU0)",
                    "nvshare: this cell waited 1 min 01 s for the GPU (GPU1)"]


def test_the_note_while_waiting_names_the_holder_its_quantum_left_and_the_place_in_line():
    holders = [{"client": "c1", "user": "alice", "program": "train.py", "pod": "", "quantum_left": 12.0}]
    waiting = entry(GPU0, "waiting", position=2, waiters=3, waiting_for=4.0, holders=holders)
    note = WaitNote([waiting], DeviceNames([GPU0], indices={GPU0: 3})).text()
    assert note == ("nvshare: this cell waits for GPU3, 4.0 s so far; held by c1 (alice, train.py), 12.0 s left of "
                    "its time quantum; 2nd in line of 3; expect about 42.0 s more at most\n")
    assert WaitNote([], DeviceNames(()), gone=True).text() == ""
    assert "&lt;" in WaitNote([entry(GPU0, "waiting")], DeviceNames([GPU0])) ._repr_html_()  # escaped


def test_a_waiting_cell_says_so_while_it_waits_and_the_note_goes_when_it_runs(scheduler, capsys):
    """Outside a kernel (a terminal) the note is one line on stderr; tests/test_jupyter_kernels.py
    sees it updated and removed in a real kernel."""
    extension = Extension(StubShell(), SocketPaths(scheduler.socket_dir))
    extension.interceptor = "/pretend/libnvshare.so"
    extension._notice_due = False
    extension.watch.every = 0.2
    extension.set_note(0.2)
    holder = scheduler.agent(env={"NVSHARE_PROGRAM": "train.py"})
    holder.send(f"announce {GPU0} {16 << 30} sim")
    holder.send(f"acquire {GPU0}")
    holder.expect(f"granted {GPU0}")
    seen = []
    try:
        with Client(socket_dir=scheduler.socket_dir) as client:
            client.announce(GPU0, 16 << 30, "sim")
            extension.pre_run_cell()
            granted = threading.Event()
            threading.Thread(target=lambda: (client.acquire(GPU0), granted.set()), daemon=True).start()

            def told() -> bool:
                seen.append(capsys.readouterr().err)
                return "this cell waits for GPU0" in "".join(seen)

            wait_for(told, what="the note while the cell waits")
            line = "".join(seen)
            assert f"held by {holder.client_id} ({ipython_user()}, train.py)" in line and "1st in line of 1" in line
            holder.send(f"release {GPU0}")
            assert granted.wait(PATIENCE)
            looked = extension.watch.wait_looks
            wait_for(lambda: extension.watch.wait_looks > looked, what="a look after the grant")
            extension.post_run_cell()
            assert "this cell waits" not in capsys.readouterr().err  # said once, in its own cell
    finally:
        extension.unregister()


# --- %nvshare --------------------------------------------------------------------------------


def test_status_text_and_html_describe_waiting_and_holding():
    waiting = KernelStatus(42, "/run/nvshare", "/lib/libnvshare.so", status_document(**{GPU0: "waiting"}))
    text = waiting.text()
    assert "kernel pid 42, client c2, scheduler at /run/nvshare" in text
    assert "waiting for the GPU, 1st in line, for 2.5 s" in text
    assert "held by    c1 (<b>train</b>, pod nb-0)" in text
    assert "3.0 MiB in use" in text and "mode on, time quantum 30.0 s" in text
    html_text = waiting._repr_html_()
    assert "&lt;b&gt;train&lt;/b&gt;" in html_text and "<b>train</b>" not in html_text

    holding = KernelStatus(42, "/run/nvshare", "/lib/libnvshare.so", {
        "pid": 42, "clients": ["c2"],
        "devices": [entry(GPU0, "holding", holders=[{"client": "c2", "program": "python", "pod": ""}],
                          waiters=2, quantum_left=12.0,
                          last_wait={"seconds": 3.0, "held_by": [{"client": "c1", "program": "train", "pod": ""}]})]})
    text = holding.text()
    assert "holds the GPU lock, 12.0 s left of its quantum" in text
    assert "held by" not in text  # the holder is this kernel itself
    assert "2 waiting" in text and "last wait  3.0 s behind c1 (train)" in text


def test_status_explains_what_is_missing():
    assert NOT_UNDER_NVSHARE in KernelStatus(1, "/d", None, status_document()).text()
    fresh = KernelStatus(1, "/d", "/lib/libnvshare.so", {"pid": 1, "clients": [], "devices": []}).text()
    assert "has not used a GPU yet" in fresh
    hidden = KernelStatus(1, "/d", "/lib/libnvshare.so", {"pid": 0, "clients": [], "devices": []}).text()
    assert "cannot see this kernel's process" in hidden


def test_status_through_the_real_scheduler(scheduler):
    extension = Extension(StubShell(), SocketPaths(scheduler.socket_dir))
    with Client(socket_dir=scheduler.socket_dir) as client:
        client.announce(GPU0, 16 << 30, "sim")
        with client.hold(GPU0):
            shown = extension.status()
    assert shown.problem == "" and shown.pid == os.getpid()
    assert shown.document["clients"] == [client.client_id]
    assert "holds the GPU lock" in shown.text()
    scheduler.stop()
    silent = extension.status()
    assert "no nvshare scheduler answers" in silent.problem or "did not answer" in silent.problem
