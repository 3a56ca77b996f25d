"""`%load_ext nvshare_py`: what nvshare does for this IPython/Jupyter kernel.

- `%nvshare` shows this kernel's standing at the scheduler, per GPU it uses: whether it holds
  the GPU lock or waits for it (its place in the queue, for how long), who holds it, the memory
  it uses, the device's mode and time quantum. HTML in notebooks, text in a terminal.
- While a cell waits for the GPU, a note in its output says so, updated every second: for
  whom (client, user, program or notebook), how long so far, the holder's quantum left and the
  cell's place in line; it is removed when the cell gets the GPU. After a cell that waited at
  least a second, a one-line note says how long and for whom. `%nvshare note off`,
  `%nvshare note on`, `%nvshare note 5` (seconds) set both.
- `%nvshare json` returns the scheduler's answer as a dict; `query()` does the same in code.
- A cell that has run for 10 s while no scheduler answers says so in its own output (its GPU
  calls wait for one; the interceptor's own warnings go to the Jupyter server's log).

Where the data comes from: the kernel's connection to the scheduler belongs to libnvshare.so,
which exports nothing but its hooks, and the scheduler's control socket is not reachable from
containers. So the extension asks the scheduler itself, on a DEALER socket of its own, with
the client protocol's `QUERY` (docs/protocol.md): the scheduler answers about the
registrations of the asking *process*, which it identifies by the kernel-verified peer pid.
Asking registers nothing.

What it costs: with notes on, a cell pays one non-blocking send before it runs and, after it,
one more query and the two answers (0.33 ms at the median on the 2-core development VM,
benchmarks/bench_notebook_cells.py; the wait is cut at 200 ms, and a scheduler that does not
answer pauses the notes for 30 s). A cell that runs longer than a second is asked about once a
second, from a thread of the extension's own (on a socket of its own), to say that it waits.
Nothing at all where the scheduler's
socket does not exist or libnvshare.so is not loaded in the kernel (then there is nothing to
share, and no hooks are installed).

(Some 800 lines: the link that asks QUERY, the words and the three displays (the wait note,
`%nvshare`'s status, the note after a cell), the thread that watches a running cell, and the
IPython hooks and magic. One extension, loaded by this name: every part serves what a cell
shows, and no other module of the package uses them.)
"""

from __future__ import annotations

import html
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import zmq
from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.display import display

from . import protocol
from .devicenames import DeviceNames
from .paths import SocketPaths, connect_error
from .sizes import format_size

__all__ = ["QueryFailed", "load_ipython_extension", "query", "unload_ipython_extension"]

CELL_QUERY_TIMEOUT = 0.2  # seconds a cell's end may wait for the two answers
STATUS_TIMEOUT = 2.0  # seconds %nvshare waits for its answer
DEFAULT_NOTE_SECONDS = 1.0
NOTE_PAUSE = 30.0  # seconds without notes after the scheduler failed to answer a cell's query
# Seconds a cell runs before it is checked for a missing scheduler: as the interceptor's own
# warning, which goes to the server's log, not to the cell.
MISSING_SCHEDULER_AFTER = 10.0
# Seconds between two looks at whether the running cell waits for the GPU (the first comes
# after the shortest wait a note is shown for).
WAIT_LOOK_EVERY = 1.0
_QUERY = protocol.Query().encode()
_UNCLAIMED_KEPT = 16  # answers nobody asked for any more (an interrupted hook) are dropped past this


class QueryFailed(Exception):
    """The scheduler could not be asked, or did not answer in time (`timed_out`)."""

    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


def interceptor_path() -> str | None:
    """The path of the libnvshare.so mapped into this process, or None when there is none."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(None, 5)
                if len(fields) == 6 and os.path.basename(fields[5].strip()).startswith("libnvshare"):
                    return fields[5].strip()
    except OSError:
        pass
    return None


class SchedulerLink:
    """QUERY and its STATUS answer on a DEALER socket of this process's own.

    A query is sent at once and answered later: `send()` returns a ticket, `result(ticket,
    deadline)` the answer. The scheduler answers one connection's queries in order, so the
    n-th answer read belongs to the n-th ticket. An answer that does not come in time voids
    the socket and every ticket still open (a late answer must not be taken for the next
    one); the next query connects afresh. Thread-safe: a kernel may run cells on several
    threads."""

    def __init__(self, paths: SocketPaths) -> None:
        self.paths = paths
        self._lock = threading.Lock()
        self._socket: zmq.Socket | None = None
        self._owner_pid = 0  # the process that opened _socket: a forked child opens its own
        self._next_ticket = 0
        self._next_answered = 0  # the ticket the next answer read belongs to
        self._answers: dict[int, bytes] = {}

    def scheduler_present(self) -> bool:
        return os.path.exists(self.paths.client_socket)

    def send(self) -> int:
        """Send one QUERY; its ticket. QueryFailed when the scheduler's socket does not exist."""
        with self._lock:
            if not self.scheduler_present():
                self._close()
                raise QueryFailed(f"no nvshare scheduler: {self.paths.client_socket} does not exist")
            sock = self._connected()
            try:
                sock.send(_QUERY, zmq.NOBLOCK)
            except zmq.ZMQError as error:
                self._close()
                raise QueryFailed(f"cannot send to the scheduler at {self.paths.client_socket}: {error}") from None
            ticket = self._next_ticket
            self._next_ticket += 1
            return ticket

    def result(self, ticket: int, deadline: float) -> dict:
        """The answer to `ticket` (the STATUS document); waits until `deadline` (monotonic)."""
        with self._lock:
            while ticket not in self._answers:
                if ticket < self._next_answered or self._socket is None:
                    raise QueryFailed("the answer to this query was given up (an earlier one timed out)",
                                      timed_out=True)
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._socket.poll(max(1, round(remaining * 1000))):
                    self._close()
                    raise QueryFailed(f"the scheduler at {self.paths.client_socket} did not answer in time",
                                      timed_out=True)
                self._answers[self._next_answered] = self._socket.recv(zmq.NOBLOCK)
                self._next_answered += 1
                while len(self._answers) > _UNCLAIMED_KEPT:
                    del self._answers[min(self._answers)]
            data = self._answers.pop(ticket)
        return _document(data)

    def forget(self, ticket: int) -> None:
        """The answer to `ticket` is no longer wanted."""
        with self._lock:
            self._answers.pop(ticket, None)

    def ask(self, timeout: float) -> dict:
        return self.result(self.send(), time.monotonic() + timeout)

    def close(self) -> None:
        with self._lock:
            self._close()

    def _connected(self) -> zmq.Socket:
        if self._socket is not None and self._owner_pid == os.getpid():
            return self._socket
        # After a fork the parent's socket is left alone: closing it here could disturb the
        # parent's libzmq state that the child inherited.
        self._socket = zmq.Context.instance().socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(self.paths.client_endpoint)
        self._owner_pid = os.getpid()
        return self._socket

    def _close(self) -> None:
        if self._socket is not None and self._owner_pid == os.getpid():
            self._socket.close(linger=0)
        self._socket = None
        self._next_answered = self._next_ticket  # every open ticket is void
        self._answers.clear()


def _document(data: bytes) -> dict:
    try:
        message = protocol.decode(data, protocol.QUERY_REPLIES)
    except protocol.ProtocolError as error:
        raise QueryFailed(f"the scheduler's answer is not understood: {error}") from None
    if isinstance(message, protocol.Error):
        if message.code == "unknown-type":
            raise QueryFailed("the scheduler is older than this nvshare_py and cannot answer QUERY; update it")
        raise QueryFailed(f"the scheduler refused the query: {message.code} {message.detail}")
    if not isinstance(message, protocol.Status):  # decode returns only the replies it was given
        raise QueryFailed(f"the scheduler answered QUERY with {message.TYPE}")
    return message.document()


def query(timeout: float = STATUS_TIMEOUT, socket_dir: str | os.PathLike | None = None) -> dict:
    """What the scheduler knows of this process (the STATUS document of docs/protocol.md).
    Raises QueryFailed."""
    link = SchedulerLink(SocketPaths.resolve(socket_dir))
    try:
        return link.ask(timeout)
    finally:
        link.close()


# --- words ---------------------------------------------------------------------------------


def format_seconds(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def describe_client(named: dict) -> str:
    """'c3 (alice, analysis.ipynb, pod team-a/nb-0)' from a QUERY entry naming a client."""
    pod = named.get("pod", "")
    if pod and named.get("namespace"):
        pod = f"{named['namespace']}/{pod}"
    details = [text for text in (named.get("user", ""), named.get("program", ""), pod and f"pod {pod}") if text]
    return f"{named['client']} ({', '.join(details)})" if details else named["client"]


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _device_label(entry: dict, names: DeviceNames) -> str:
    label = names.long(entry["device"])
    return f"{label}, {entry['name']}" if entry.get("name") else label


def _device_rows(entry: dict, own: set[str]) -> list[tuple[str, str]]:
    """(label, text) lines describing one device entry of a STATUS document."""
    state = entry["state"]
    if state == "waiting":
        where = f"{_ordinal(entry['position'])} in line" if entry.get("position") else "in line"
        standing = f"waiting for the GPU, {where}, for {format_seconds(entry['waiting_for'])}"
    elif state in ("holding", "draining"):
        standing = "holds the GPU lock"
        if state == "draining":
            standing += ", handing it back (its time quantum is over and others wait)"
        elif entry.get("quantum_left") is not None and entry.get("waiters"):
            standing += f", {format_seconds(entry['quantum_left'])} left of its quantum"
    elif state == "overdue":
        standing = "lost the GPU lock (it did not hand it back in time)"
    else:
        standing = "idle: does not hold the GPU lock and does not wait for it"
    rows = [("state", standing)]
    holders = [h for h in entry.get("holders", []) if h["client"] not in own]
    if holders:
        rows.append(("held by", ", ".join(describe_client(h) for h in holders)))
    if entry.get("waiters"):
        rows.append(("queue", f"{entry['waiters']} waiting"))
    rows.append(("memory", f"{format_size(entry['used'])} in use by this kernel"))
    rows.append(("scheduler", f"mode {entry['mode']}, time quantum {format_seconds(entry['tq'])}"))
    rows.append((
        "totals",
        f"waited {format_seconds(entry['wait_total'])}, held {format_seconds(entry['hold_total'])}, "
        f"{entry['grants']} grant{'s' if entry['grants'] != 1 else ''}",
    ))
    last = entry.get("last_wait")
    if last and last["seconds"] > 0 and state != "waiting":
        text = f"{format_seconds(last['seconds'])}"
        if last.get("held_by"):
            text += f" behind {', '.join(describe_client(h) for h in last['held_by'])}"
        rows.append(("last wait", text))
    return rows


# --- what is displayed ---------------------------------------------------------------------


@dataclass
class WaitNote:
    """The note in a cell's output while it waits for the GPU (entries of a STATUS document in
    state `waiting`); empty once the cell runs (`gone`)."""

    waiting: list[dict]
    names: DeviceNames
    gone: bool = False

    def text(self) -> str:
        if self.gone:
            return ""
        lines = []
        for entry in self.waiting:
            line = f"nvshare: this cell waits for {self.names.short(entry['device'])}, {format_seconds(entry['waiting_for'])} so far"
            holders = entry.get("holders") or []
            if holders:
                line += f"; held by {', '.join(describe_client(h) for h in holders)}"
                left = [h["quantum_left"] for h in holders if h.get("quantum_left") is not None]
                if left:
                    line += f", {format_seconds(max(left))} left of its time quantum"
            if entry.get("position"):
                line += f"; {_ordinal(entry['position'])} in line of {entry['waiters']}"
            expected = expected_wait(entry)
            if expected is not None:
                line += f"; expect about {format_seconds(expected)} more at most"
            lines.append(line)
        return "\n".join(lines) + "\n"  # text/plain ends its line, as a stream's output does

    def __str__(self) -> str:  # print() (display outside IPython) ends the line itself
        return self.text().rstrip("\n")

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(self.text())

    def _repr_html_(self) -> str:
        if self.gone:
            return ""
        return f"<div style='color:#a15c00'>{html.escape(self.text()).strip().replace(chr(10), '<br>')}</div>"


def expected_wait(entry: dict) -> float | None:
    """A waiter's longest wait from now as the scheduler's rules bound it: the holders' quantum
    left, then a full quantum for each waiter ahead (less where they are done sooner: an idle
    holder gives the GPU back early). None when the holders' quantum is not known."""
    left = [h["quantum_left"] for h in entry.get("holders") or [] if h.get("quantum_left") is not None]
    if not left:
        return None
    return max(left) + max(0, entry.get("position", 1) - 1) * entry.get("tq", 0.0)


class CellWatch:
    """Looks after the running cell from one thread, owned by the extension: started with the
    first cell, ended by `stop()`. A cell pays a lock and a notify at its start and end.

    - While the cell waits for the GPU (its process's registration is `waiting`, asked with
      QUERY on a link of its own every `every` seconds once the cell has run `wait_after`
      seconds, and at least `every`), a WaitNote in the cell's output says for whom and how
      long, updated; it is removed when the wait ends, at the latest when the cell does (by
      the cell's own thread, so before the cell's end is reported).
    - When the cell has run `missing_after` seconds and no scheduler answers, it says so once
      (stderr written from this thread goes to the running cell)."""

    def __init__(self, paths: SocketPaths, shell: Any, missing_after: float = MISSING_SCHEDULER_AFTER,
                 wait_after: float | None = None, every: float = WAIT_LOOK_EVERY) -> None:
        self.paths = paths
        self.shell = shell
        self.missing_after = missing_after
        self.wait_after = wait_after  # None: no notes while waiting (%nvshare note off)
        self.every = every
        self.look_for_missing = True  # only where GPU calls wait for a missing scheduler
        self._link = SchedulerLink(paths)
        self._changed = threading.Condition()
        self._cell_started: float | None = None  # monotonic start of the running cell
        self._cell = 0  # counts cells, so that what is seen for one cell is never shown in the next
        self._parent: Any = None  # the running cell's message header, for output from this thread
        self._note: _LiveNote | None = None  # the running cell's note about waiting, once looked
        self._stopped = False
        self._thread: threading.Thread | None = None
        self.looked = 0  # cells checked for a scheduler so far
        self.wait_looks = 0  # answers about waiting seen so far

    def cell_started(self) -> None:
        publisher = getattr(self.shell, "display_pub", None)
        with self._changed:
            self._cell += 1
            self._cell_started = time.monotonic()
            self._parent = getattr(publisher, "parent_header", None)
            self._note = None
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="nvshare-cell-watch", daemon=True)
                self._thread.start()
            self._changed.notify()

    def cell_ended(self) -> None:
        with self._changed:
            self._cell_started = None
            note, self._note = self._note, None
            self._changed.notify()
        if note is not None:
            note.remove()

    def stop(self) -> None:
        with self._changed:
            self._stopped = True
            self._changed.notify()
            thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        self._link.close()

    def _watch(self) -> None:
        missing_told = 0  # the cell last told about a missing scheduler
        next_look = 0.0  # when to ask next whether the running cell waits
        with self._changed:
            while not self._stopped:
                if self._cell_started is None:
                    self._changed.wait()
                    continue
                cell, started, now = self._cell, self._cell_started, time.monotonic()
                if self._note is None:
                    next_look = started + max(self.wait_after or 0.0, self.every)  # never a query per cell
                due = [started + self.missing_after] if self.look_for_missing and missing_told != cell else []
                if self.wait_after is not None:
                    due.append(next_look)
                if not due or min(due) > now:
                    self._changed.wait(None if not due else min(due) - now)
                    continue
                if self.look_for_missing and missing_told != cell and now >= started + self.missing_after:
                    missing_told = cell
                    self._unlocked(self._tell_if_missing, cell)
                if self.wait_after is not None and now >= next_look:
                    if self._note is None:
                        self._note = _LiveNote(self.shell, self._parent)
                    next_look = now + self.every
                    self._unlocked(self._look_for_waiting, cell, self._note)

    def _unlocked(self, action: Any, *args: Any) -> None:
        """Run `action` without the lock: no I/O under it, cells must not wait for it."""
        self._changed.release()
        try:
            action(*args)
        finally:
            self._changed.acquire()

    def _tell_if_missing(self, cell: int) -> None:
        error = connect_error(self.paths.client_socket)
        with self._changed:
            self.looked += 1
            current = self._cell == cell and self._cell_started is not None
        if error is not None and current:
            _in_cell(self.shell, self._parent)
            print(f"nvshare: this cell has run for {self.missing_after:g} s and its GPU calls wait for a "
                  f"scheduler, but none answers at {self.paths.client_socket} "
                  f"({error.strerror or error}). Start nvshare-scheduler (or point NVSHARE_SOCKET_DIR "
                  f"for the kernel at the directory one serves); the cell goes on once one answers.",
                  file=sys.stderr, flush=True)

    def _look_for_waiting(self, cell: int, note: "_LiveNote") -> None:
        try:
            document = self._link.ask(CELL_QUERY_TIMEOUT * 5)
        except QueryFailed:
            return  # no scheduler (the missing-scheduler notice covers it) or a slow one: next time
        with self._changed:
            self.wait_looks += 1
        waiting = [entry for entry in document["devices"] if entry["state"] == "waiting"]
        if waiting:
            note.show(WaitNote(waiting, DeviceNames(entry["device"] for entry in document["devices"])))
        else:
            note.remove(closing=False)  # the wait is over; the cell may wait again


class _LiveNote:
    """One note in a cell's output that can be changed and removed: in a kernel, a display with
    an id (each change an update_display_data); elsewhere (a terminal), a line on stderr,
    written once. Once removed by the cell's end (`closed`), nothing shows it again."""

    def __init__(self, shell: Any, parent: Any) -> None:
        self.shell = shell
        self.parent = parent
        self._lock = threading.Lock()  # a show and the cell's end removing it, one after the other
        self._handle: Any = None
        self._printed = False
        self._closed = False

    def show(self, note: WaitNote) -> None:
        with self._lock:
            if self._closed:
                return
            if getattr(self.shell, "kernel", None) is None:
                if not self._printed:
                    print(note.text(), end="", file=sys.stderr, flush=True)
                    self._printed = True
                return
            _in_cell(self.shell, self.parent)
            if self._handle is None:
                self._handle = display(note, display_id=True)
            else:
                self._handle.update(note)

    def remove(self, closing: bool = True) -> None:
        """Empty the note; `closing` (the cell ended) also stops any later show."""
        with self._lock:
            self._closed = self._closed or closing
            if self._handle is not None:
                _in_cell(self.shell, self.parent)
                self._handle.update(WaitNote([], DeviceNames(()), gone=True))
                self._handle = None


def _in_cell(shell: Any, parent: Any) -> None:
    """Make this thread's output go to the cell whose message header is `parent` (ipykernel
    keeps one per thread; without one, output goes to the cell that runs now)."""
    if not parent:
        return
    for publisher in (getattr(shell, "display_pub", None), sys.stdout, sys.stderr):
        setter = getattr(publisher, "set_thread_parent", None)
        if setter is not None:
            setter(parent)


@dataclass
class KernelStatus:
    """The output of %nvshare: a STATUS document (or why there is none) and this kernel's
    facts. Rendered as HTML in notebooks and as text elsewhere."""

    pid: int
    socket_dir: str
    interceptor: str | None
    document: dict | None = None
    problem: str = ""

    def _headline(self) -> str:
        clients = ", ".join(self.document["clients"]) if self.document and self.document["clients"] else ""
        return (f"nvshare: kernel pid {self.pid}" + (f", client {clients}" if clients else "")
                + f", scheduler at {self.socket_dir}")

    def _notices(self) -> list[str]:
        notices = []
        if self.interceptor is None:
            notices.append(NOT_UNDER_NVSHARE)
        if self.problem:
            notices.append(self.problem)
        elif self.document is not None:
            if not self.document["pid"]:
                notices.append("The scheduler cannot see this kernel's process (it runs in another pid "
                               "namespace; run the scheduler with the host's pid namespace), so it cannot "
                               "tell which registration is this kernel's.")
            elif not self.document["devices"]:
                notices.append("This kernel has not used a GPU yet: it registers with the scheduler on its "
                               "first GPU call.")
            if self.document.get("truncated"):
                notices.append(f"{self.document['truncated']} more device(s) not shown (the answer is limited "
                               "to one message).")
        return notices

    def _devices(self) -> list[tuple[str, list[tuple[str, str]]]]:
        if self.document is None:
            return []
        own = set(self.document["clients"])
        names = DeviceNames(entry["device"] for entry in self.document["devices"])
        return [(_device_label(entry, names), _device_rows(entry, own)) for entry in self.document["devices"]]

    def text(self) -> str:
        lines = [self._headline()]
        lines += [f"  {notice}" for notice in self._notices()]
        for label, rows in self._devices():
            lines.append(label)
            lines += [f"  {name:<10} {value}" for name, value in rows]
        return "\n".join(lines)

    __str__ = text  # what display() prints outside IPython

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(self.text())

    def _repr_html_(self) -> str:
        parts = [f"<div class='nvshare-status'><b>{html.escape(self._headline())}</b>"]
        parts += [f"<p style='color:#a15c00'>{html.escape(notice)}</p>" for notice in self._notices()]
        for label, rows in self._devices():
            parts.append(f"<table><caption style='text-align:left'><code>{html.escape(label)}</code></caption>")
            parts += [f"<tr><th style='text-align:left'>{html.escape(name)}</th>"
                      f"<td style='text-align:left'>{html.escape(value)}</td></tr>" for name, value in rows]
            parts.append("</table>")
        parts.append("</div>")
        return "".join(parts)


@dataclass
class CellNote:
    """The line shown after a cell that waited for the GPU."""

    waits: list[tuple[str, float, list[dict]]]  # (device, seconds waited in the cell, who was ahead)

    def text(self) -> str:
        lines = []
        names = DeviceNames(device for device, _, _ in self.waits)
        for device, seconds, ahead in self.waits:
            line = f"nvshare: this cell waited {format_seconds(seconds)} for the GPU"
            if ahead:
                line += f" held by {', '.join(describe_client(h) for h in ahead)}"
            if len(self.waits) > 1:
                line += f" ({names.short(device)})"
            lines.append(line)
        return "\n".join(lines) + "\n"  # text/plain ends its line, as a stream's output does

    def __str__(self) -> str:  # print() (display outside IPython) ends the line itself
        return self.text().rstrip("\n")

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(self.text())

    def _repr_html_(self) -> str:
        return (f"<div style='color:#666;font-size:smaller'>"
                f"{html.escape(self.text()).strip().replace(chr(10), '<br>')}</div>")


NOT_UNDER_NVSHARE = (
    "libnvshare.so is not loaded in this kernel, so its GPU work is not scheduled by nvshare. Start the "
    "kernel from the 'Python 3 (nvshare)' kernelspec (nvshare-jupyter install), or run it under nvshare-run."
)


def cell_waits(before: dict, after: dict) -> list[tuple[str, float, list[dict]]]:
    """Per device, how long the process waited for the GPU between two STATUS documents, and
    who was ahead in its last wait. A registration that is new since `before` (the scheduler
    restarted, or forgot a silent client) counts from zero."""

    def totals(document: dict) -> dict[str, float]:
        summed: dict[str, float] = {}
        for entry in document["devices"]:
            summed[entry["device"]] = summed.get(entry["device"], 0.0) + entry["wait_total"]
        return summed

    earlier, later = totals(before), totals(after)
    waits = []
    for device, total in later.items():
        waited = total - earlier.get(device, 0.0)
        if waited < 0:
            waited = total
        ahead: list[dict] = []
        for entry in after["devices"]:
            if entry["device"] == device and entry.get("last_wait"):
                ahead = entry["last_wait"]["held_by"]
        waits.append((device, waited, ahead))
    return waits


# --- the extension -------------------------------------------------------------------------


class Extension:
    """One loaded extension: the link to the scheduler, the cell hooks and the settings."""

    def __init__(self, shell: Any, paths: SocketPaths | None = None) -> None:
        self.shell = shell
        self.paths = paths or SocketPaths.resolve()
        self.link = SchedulerLink(self.paths)
        self.interceptor = interceptor_path()
        self.note_seconds: float | None = DEFAULT_NOTE_SECONDS
        self._pending: int | None = None  # the ticket of the query sent before the running cell
        self._paused_until = 0.0
        self._notice_due = True  # problems are shown once, in a cell's output
        self._hooks: list[tuple[str, Any]] = []  # (event, callback) registered with the shell
        self.watch = CellWatch(self.paths, shell, wait_after=self.note_seconds)
        # Only where GPU calls wait for a missing scheduler (fail mode closed, the default).
        self.watch.look_for_missing = os.environ.get("NVSHARE_FAIL_MODE", "closed") != "open"

    # hooks ---------------------------------------------------------------------------------

    def register(self) -> None:
        if self.interceptor is not None:
            self._hooks = [("pre_run_cell", self.pre_run_cell), ("post_run_cell", self.post_run_cell)]
        elif self._notice_due:
            # No hooks that would cost cells anything: only the first cell says why nothing is shared.
            self._hooks = [("pre_run_cell", self._first_cell_notice)]
        for name, hook in self._hooks:
            self.shell.events.register(name, hook)

    def unregister(self) -> None:
        hooks, self._hooks = self._hooks, []
        for name, hook in hooks:
            self.shell.events.unregister(name, hook)
        self.link.close()
        self.watch.stop()

    def _first_cell_notice(self, info: Any = None) -> None:
        self.unregister()
        self.show_problems()

    def pre_run_cell(self, info: Any = None) -> None:
        if self._notice_due:
            self.show_problems()
        self.watch.cell_started()
        if self._pending is not None:  # a cell whose post_run_cell never came (interrupted)
            self.link.forget(self._pending)
            self._pending = None
        if self.interceptor is None or self.note_seconds is None or time.monotonic() < self._paused_until:
            return
        try:
            self._pending = self.link.send()
        except QueryFailed:
            pass  # no scheduler: nothing can have waited for it

    def post_run_cell(self, result: Any = None) -> None:
        self.watch.cell_ended()
        before, self._pending = self._pending, None
        if before is None:
            return
        if self.note_seconds is None:  # turned off during the cell
            self.link.forget(before)
            return
        deadline = time.monotonic() + CELL_QUERY_TIMEOUT
        try:
            after = self.link.send()
            first = self.link.result(before, deadline)
            last = self.link.result(after, deadline)
        except QueryFailed as failure:
            self.link.forget(before)
            if failure.timed_out:
                self._paused_until = time.monotonic() + NOTE_PAUSE
                print(f"nvshare: {failure}; notes after cells are paused for {NOTE_PAUSE:g} s", file=sys.stderr)
            return
        waits = [wait for wait in cell_waits(first, last) if wait[1] >= self.note_seconds]
        if waits:
            display(CellNote(waits))

    def show_problems(self) -> None:
        """Say once, in a cell's output, why this kernel's GPU work is not shared as it should."""
        self._notice_due = False
        problems = []
        if self.interceptor is None:
            problems.append(NOT_UNDER_NVSHARE)
        elif not self.link.scheduler_present():
            fail_open = os.environ.get("NVSHARE_FAIL_MODE", "closed") == "open"
            problems.append(
                f"No nvshare scheduler at {self.paths.client_socket}: until one is started there, this kernel's "
                + ("GPU work runs unscheduled (NVSHARE_FAIL_MODE=open)." if fail_open
                   else "GPU calls wait (NVSHARE_FAIL_MODE=closed). Start nvshare-scheduler, or set "
                        "NVSHARE_SOCKET_DIR for the kernel to the directory it serves.")
            )
        for problem in problems:
            print(f"nvshare: {problem}", file=sys.stderr)

    def set_note(self, seconds: float | None) -> None:
        """The shortest wait a note is shown for; None: no notes. Lifts a pause after a silence."""
        self.note_seconds = seconds
        self.watch.wait_after = seconds
        self._paused_until = 0.0

    # %nvshare --------------------------------------------------------------------------------

    def status(self) -> KernelStatus:
        shown = KernelStatus(os.getpid(), self.paths.describe(), self.interceptor)
        try:
            shown.document = self.link.ask(STATUS_TIMEOUT)
        except QueryFailed as failure:
            shown.problem = str(failure)
            if failure.timed_out:
                from .run import scheduler_unreachable  # only here: it imports typer

                reason = scheduler_unreachable(self.paths)
                if reason is not None:
                    shown.problem = f"no nvshare scheduler answers at {self.paths.client_socket} ({reason})"
        return shown


@magics_class
class NvshareMagics(Magics):
    def __init__(self, shell: Any, extension: Extension) -> None:
        super().__init__(shell)
        self.extension = extension

    @line_magic
    def nvshare(self, line: str) -> Any:
        """%nvshare: this kernel's standing at the nvshare scheduler.

        %nvshare                   status: holds the GPU or waits (and where), memory, mode, TQ
        %nvshare json              the scheduler's answer as a dict
        %nvshare note on|off|SECS  the note after cells that waited for the GPU (default: 1 s)
        """
        words = line.split()
        extension = self.extension
        if not words:
            display(extension.status())
            return None
        if words == ["json"]:
            return extension.link.ask(STATUS_TIMEOUT)
        if words[0] == "note" and len(words) <= 2:
            if len(words) == 2:
                extension.set_note(_note_setting(words[1]))
            seconds = extension.note_seconds
            print("nvshare: notes after cells are off" if seconds is None else
                  f"nvshare: a note follows every cell that waited at least {seconds:g} s for the GPU")
            return None
        raise UsageError("usage: %nvshare [json | note on|off|SECONDS]")


def _note_setting(word: str) -> float | None:
    if word == "off":
        return None
    if word == "on":
        return DEFAULT_NOTE_SECONDS
    try:
        seconds = float(word)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise UsageError(f"%nvshare note: {word!r} is not on, off or a number of seconds >= 0")
    return seconds


def load_ipython_extension(shell: Any) -> None:
    extension = Extension(shell)
    shell.register_magics(NvshareMagics(shell, extension))
    # Loaded by `%load_ext` in a cell, problems can be shown in its output at once. Loaded when
    # the kernel starts (the nvshare kernelspec), output has no cell to go to yet: the first
    # cell shows them.
    if sys.displayhook is getattr(shell, "displayhook", None):
        extension.show_problems()
    extension.register()


def unload_ipython_extension(shell: Any) -> None:
    magics = shell.magics_manager.registry.get("NvshareMagics")
    if magics is not None:
        magics.extension.unregister()
