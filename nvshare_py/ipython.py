"""`%load_ext nvshare_py`: what nvshare does for this IPython/Jupyter kernel.

- `%nvshare` shows this kernel's standing at the scheduler, per GPU it uses: whether it holds
  the GPU lock or waits for it (its place in the queue, for how long), who holds it, the memory
  it uses, the device's mode and time quantum. HTML in notebooks, text in a terminal.
- After a cell that waited for the GPU for at least a second, a one-line note says how long
  and for whom. `%nvshare note off`, `%nvshare note on`, `%nvshare note 5` (seconds).
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
answer pauses the notes for 30 s). Nothing at all where the scheduler's
socket does not exist or libnvshare.so is not loaded in the kernel (then there is nothing to
share, and no hooks are installed).
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
from .paths import SocketPaths, connect_error

__all__ = ["QueryFailed", "load_ipython_extension", "query", "unload_ipython_extension"]

CELL_QUERY_TIMEOUT = 0.2  # seconds a cell's end may wait for the two answers
STATUS_TIMEOUT = 2.0  # seconds %nvshare waits for its answer
DEFAULT_NOTE_SECONDS = 1.0
NOTE_PAUSE = 30.0  # seconds without notes after the scheduler failed to answer a cell's query
# Seconds a cell runs before it is checked for a missing scheduler: as the interceptor's own
# warning, which goes to the server's log, not to the cell.
MISSING_SCHEDULER_AFTER = 10.0
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


def format_bytes(count: int) -> str:
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def describe_client(named: dict) -> str:
    """'c3 (python, pod nb-0)' from a QUERY entry naming a client."""
    details = [text for text in (named.get("program", ""), named.get("pod", "") and f"pod {named['pod']}") if text]
    return f"{named['client']} ({', '.join(details)})" if details else named["client"]


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _device_label(entry: dict) -> str:
    return f"{entry['device']} ({entry['name']})" if entry.get("name") else entry["device"]


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
    rows.append(("memory", f"{format_bytes(entry['used'])} in use by this kernel"))
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


class MissingSchedulerWatch:
    """While a cell runs for longer than `after` seconds and no scheduler answers, says so once
    in that cell's output (stderr written from this thread goes to the running cell). One
    thread for the extension's life, owned by it: started with the first cell, ended by
    `stop()`. A cell pays a lock and a notify at its start and end."""

    def __init__(self, paths: SocketPaths, after: float = MISSING_SCHEDULER_AFTER) -> None:
        self.paths = paths
        self.after = after
        self._changed = threading.Condition()
        self._cell_started: float | None = None  # monotonic start of the running cell
        self._cell = 0  # counts cells, so that a check for one cell is never shown in the next
        self._stopped = False
        self._thread: threading.Thread | None = None
        self.looked = 0  # cells checked for a scheduler so far

    def cell_started(self) -> None:
        with self._changed:
            self._cell += 1
            self._cell_started = time.monotonic()
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="nvshare-missing-scheduler", daemon=True)
                self._thread.start()
            self._changed.notify()

    def cell_ended(self) -> None:
        with self._changed:
            self._cell_started = None
            self._changed.notify()

    def stop(self) -> None:
        with self._changed:
            self._stopped = True
            self._changed.notify()
            thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _watch(self) -> None:
        told = 0  # the cell last told about
        with self._changed:
            while not self._stopped:
                if self._cell_started is None or told == self._cell:
                    self._changed.wait()
                    continue
                remaining = self._cell_started + self.after - time.monotonic()
                if remaining > 0:
                    self._changed.wait(remaining)
                    continue
                cell = told = self._cell
                self._changed.release()  # no I/O under the lock: cells must not wait for it
                try:
                    error = connect_error(self.paths.client_socket)
                finally:
                    self._changed.acquire()
                self.looked += 1
                if error is not None and self._cell == cell and self._cell_started is not None:
                    print(f"nvshare: this cell has run for {self.after:g} s and its GPU calls wait for a "
                          f"scheduler, but none answers at {self.paths.client_socket} "
                          f"({error.strerror or error}). Start nvshare-scheduler (or point NVSHARE_SOCKET_DIR "
                          f"for the kernel at the directory one serves); the cell goes on once one answers.",
                          file=sys.stderr, flush=True)


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
        return [(_device_label(entry), _device_rows(entry, own)) for entry in self.document["devices"]]

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
        for device, seconds, ahead in self.waits:
            line = f"nvshare: this cell waited {format_seconds(seconds)} for the GPU"
            if ahead:
                line += f" held by {', '.join(describe_client(h) for h in ahead)}"
            if len(self.waits) > 1:
                line += f" ({device})"
            lines.append(line)
        return "\n".join(lines)

    __str__ = text

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(self.text())

    def _repr_html_(self) -> str:
        return f"<div style='color:#666;font-size:smaller'>{html.escape(self.text()).replace(chr(10), '<br>')}</div>"


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
        # Only where GPU calls wait for a missing scheduler (fail mode closed, the default).
        self.watch = (MissingSchedulerWatch(self.paths) if os.environ.get("NVSHARE_FAIL_MODE", "closed") != "open"
                      else None)

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
        if self.watch is not None:
            self.watch.stop()

    def _first_cell_notice(self, info: Any = None) -> None:
        self.unregister()
        self.show_problems()

    def pre_run_cell(self, info: Any = None) -> None:
        if self._notice_due:
            self.show_problems()
        if self.watch is not None:
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
        if self.watch is not None:
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
