"""What reading the lock timeline costs the other clients (issue 31, *Loose ends*: `events` in
pages), on the real daemon (a child process) with a full ring of 10 000 entries.

    python benchmarks/bench_events.py [--seconds 20] [--out benchmarks/results]

Prints one JSON document:

- `page`: in this process (thread CPU time), what one `events` answer costs the daemon's thread: a page of the
  full ring as the daemon makes it (eventring.EventRing.page, then control.fitted and the ZMTP
  frame), and for contrast the 10 000 entries encoded as one answer, as before pages (one step);
  microseconds, p50 and p99 of many;
- `round_trips`: per daemon and reader, the daemon's own steps (`daemon_steps`: each step is work
  between two of its awaits, during which no other client is served; in thread CPU time: how
  many, the 99.9th percentile, the longest, how many took 1 ms or more, the most `events` pages
  answered in one step and the longest step that answered any), and another user's client's QUERY round trip on the client socket (milliseconds,
  p50, p99, max, count; a process of its own, uid 1001 through setpriv when the benchmark runs as
  root) while nobody reads events (`quiet`), while a reader pages through the whole ring
  as `nvsharectl events` does, one request at a time (`follow`), and while a DEALER sends 16
  page requests in one write, again and again (`burst`); each against this tree's daemon and against one
  whose turns are not bounded by what they write (connections.TURN_OUTPUT unbounded: a burst's
  pages answered in one turn, as before), `bounded` and `unbounded`.

Timing is the benchmark's: the tests assert orderings (tests/test_connection_turns.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this tree's nvshare_py, without installing
sys.path.insert(0, str(REPO / "benchmarks"))

import zmq  # noqa: E402

import floodkit  # noqa: E402
from nvshare_py import protocol  # noqa: E402
from nvshare_py.scheduler import control, zmtp  # noqa: E402
from nvshare_py.scheduler.eventring import EventRing  # noqa: E402
from nvshare_py.testing.scheduler import DEFAULT_OPTIONS, SchedulerProcess, short_socket_dir  # noqa: E402

GPU = "GPU-5151ad00-0000-4000-8000-000000000000"
OTHER_UID = 1001
RING = protocol.CONTROL_EVENTS_MAX
BURST = 16
UNBOUNDED = 1 << 62


# The daemon, with connections.TURN_OUTPUT given (argv[1], 0: as in this tree) and every step of
# its Trio run timed in thread CPU time (what the step cost the daemon, not the time another
# process ran meanwhile on a busy machine), counted from SIGUSR1 on (after the ring is filled):
# at exit the steps' durations (milliseconds, a histogram of 0.1 ms bins and the longest) go to
# the file argv[2].
STEPPED = r"""
import atexit, json, signal, sys, time
import trio
from nvshare_py.scheduler import connections
turn_output, out = int(sys.argv.pop(1)), sys.argv.pop(1)
if turn_output:
    connections.TURN_OUTPUT = turn_output
from nvshare_py.scheduler.daemon import Daemon
bins, longest, paging = {}, [0.0], {"now": 0, "most": 0, "longest": 0.0}
def reset(signum, frame):
    bins.clear()
    longest[0] = 0.0
    paging.update(most=0, longest=0.0)
signal.signal(signal.SIGUSR1, reset)
events = Daemon.events
def counted(self, since, limit):
    paging["now"] += 1
    return events(self, since, limit)
Daemon.events = counted
class Steps(trio.abc.Instrument):
    def before_task_step(self, task):
        self.started = time.thread_time()
        paging["now"] = 0
    def after_task_step(self, task):
        ms = (time.thread_time() - self.started) * 1000
        bins[int(ms * 10)] = bins.get(int(ms * 10), 0) + 1
        longest[0] = max(longest[0], ms)
        if paging["now"]:
            paging["most"] = max(paging["most"], paging["now"])
            paging["longest"] = max(paging["longest"], ms)
run = trio.run
trio.run = lambda *args, **kwargs: run(*args, instruments=[Steps()], **kwargs)
atexit.register(lambda: open(out, "w").write(json.dumps({"bins": bins, "longest": longest[0], "paging": paging})))
from nvshare_py.scheduler.cli import main
main()
"""


class Daemon(SchedulerProcess):
    """The daemon with connections.TURN_OUTPUT set to `turn_output` (None: as in this tree), its
    steps timed (STEPPED) into `steps_file`."""

    def __init__(self, turn_output: int | None, steps_file: Path) -> None:
        super().__init__(short_socket_dir(), dict(DEFAULT_OPTIONS, log_level="warning"))
        self.turn_output = turn_output
        self.steps_file = steps_file

    def command(self) -> list[str]:
        argv = super().command()
        return [sys.executable, "-c", STEPPED, str(self.turn_output or 0), str(self.steps_file), *argv[3:]]


def step_summary(steps_file: Path) -> dict[str, Any]:
    """The daemon's steps (each a piece of work between two of its awaits: nothing else runs
    meanwhile) from STEPPED's histogram: how many, the 99.9th percentile and the longest (ms),
    and how many took a millisecond or more."""
    document = json.loads(steps_file.read_text())
    bins = sorted((int(tenths), count) for tenths, count in document["bins"].items())
    total = sum(count for _, count in bins)
    seen, p999 = 0, 0.0
    for tenths, count in bins:
        seen += count
        if seen >= total * 0.999:
            p999 = (tenths + 1) / 10
            break
    return {"steps": total, "p99_9_ms": p999, "longest_ms": round(document["longest"], 3),
            "steps_1ms_or_more": sum(count for tenths, count in bins if tenths >= 10),
            "most_pages_in_one_step": document["paging"]["most"],
            "longest_step_with_pages_ms": round(document["paging"]["longest"], 3)}


def percentiles(samples: list[float], scale: float) -> dict[str, float]:
    ordered = sorted(samples)
    return {"p50": round(ordered[len(ordered) // 2] * scale, 3), "p99": round(ordered[int(len(ordered) * 0.99)] * scale, 3),
            "max": round(ordered[-1] * scale, 3), "count": len(ordered)}


def page_costs(pages: int = 2000) -> dict[str, Any]:
    ring = EventRing()
    for n in range(RING):
        ring.record(1.7e9 + n / 1000, "GPU-5151ad00-0000-4000-8000-000000000000", f"c{n % 500}", "register", 0,
                    f'pid={n} user=alice program="train.py"')
    paged, whole = [], []
    for _ in range(pages):
        started = time.thread_time()
        page = ring.page(1, RING)
        zmtp.message([b"", control.fitted({"v": 1, "ok": True, "result": control.Encoded(page.json())})])
        paged.append(time.thread_time() - started)
    entries = ring.page(1, RING).entries
    everything = [json.loads(entry) for entry in ring._entries]  # what one answer held before pages
    for _ in range(max(1, pages // 50)):
        started = time.thread_time()
        json.dumps({"v": 1, "ok": True, "result": {"events": everything, "next": RING + 1}}, separators=(",", ":"))
        whole.append(time.thread_time() - started)
    return {"entries_per_page": len(entries), "page_us": percentiles(paged, 1e6),
            "whole_ring_as_one_answer_us": percentiles(whole, 1e6)}


def fill(daemon: Daemon) -> None:
    """A full ring: `tq` events from set-tq requests for one device (the default's changes are
    not lock events)."""
    context = zmq.Context.instance()
    sock = context.socket(zmq.REQ)
    sock.connect(f"ipc://{daemon.paths.control_socket}")
    for n in range(RING + 10):
        sock.send_json({"v": 1, "op": "set-tq", "seconds": 30 + n % 7, "device": GPU})
        assert sock.recv_json()["ok"]
    sock.send_json({"v": 1, "op": "events", "since": 1, "limit": RING})
    page = sock.recv_json()["result"]
    assert len(json.dumps(page["events"])) > 64 * 1024 and page["more"], "the ring was not filled"
    sock.close(linger=0)


def reader(daemon: Daemon, style: str, stop: threading.Event, pages: list[int]) -> None:
    """Pages through the whole ring again and again: one request at a time, as nvsharectl's REQ
    socket does (`follow`), or BURST requests in one write (so that they reach the daemon in
    one read), then their answers (`burst`, a raw ZMTP DEALER)."""
    request = json.dumps({"v": 1, "op": "events", "since": 1, "limit": RING}).encode()
    if style == "follow":
        sock = zmq.Context.instance().socket(zmq.REQ)
        sock.connect(f"ipc://{daemon.paths.control_socket}")
        while not stop.is_set():
            sock.send(request)
            sock.recv()
            pages[0] += 1
        sock.close(linger=0)
        return
    raw = floodkit.RawClient(daemon.paths.control_socket)
    while not stop.is_set():
        raw.send_raw(floodkit.frame(request) * BURST)
        for _ in range(BURST):
            raw._next_frame()
            pages[0] += 1
    raw.close()


def other_user() -> list[str]:
    """argv prefix that runs a command as uid OTHER_UID where the benchmark runs as root."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        return []
    return ["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups"]


def query_loop(path: str, seconds: float) -> None:
    """The other user's client (run as a process of its own): QUERY round trips for `seconds`,
    printed as JSON percentiles."""
    client = floodkit.RawClient(path)
    samples = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        started = time.perf_counter()
        client.send("NVSHARE/1 QUERY")
        client.expect("STATUS")
        samples.append(time.perf_counter() - started)
        time.sleep(0.002)
    client.close()
    print(json.dumps(percentiles(samples, 1e3)))


def round_trips(daemon: Daemon, seconds: float, style: str | None) -> dict[str, Any]:
    stop, pages = threading.Event(), [0]
    thread = None
    if style is not None:
        thread = threading.Thread(target=reader, args=(daemon, style, stop, pages), daemon=True)
        thread.start()
        time.sleep(0.5)
    measured = subprocess.run([*other_user(), sys.executable, __file__, "--query-loop", str(daemon.paths.client_socket),
                               "--seconds", str(seconds)], capture_output=True, text=True, timeout=seconds + 60)
    stop.set()
    if thread is not None:
        thread.join(10)
    if measured.returncode != 0:
        raise RuntimeError(f"the measuring client failed: {measured.stderr[-2000:]}")
    return {**json.loads(measured.stdout), "pages_read": pages[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="per measurement")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON to DIR/events-pages-<date>.json")
    parser.add_argument("--query-loop", metavar="SOCKET", help=argparse.SUPPRESS)  # the measuring client's part
    args = parser.parse_args()
    if args.query_loop:
        query_loop(args.query_loop, args.seconds)
        return
    document: dict[str, Any] = {
        "benchmark": "bench_events", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_average_before": os.getloadavg()},
        "seconds": args.seconds, "ring": RING, "burst": BURST, "measuring_client_uid": OTHER_UID if other_user() else os.getuid(),
        "page": page_costs(),
        "round_trips": {},
    }
    work = Path(tempfile.mkdtemp(prefix="bench-events-"))
    try:
        for name, turn_output in (("bounded", None), ("unbounded", UNBOUNDED)):
            results = document["round_trips"][name] = {}
            for style in (None, "follow", "burst"):
                steps_file = work / f"{name}-{style}.json"
                daemon = Daemon(turn_output, steps_file)
                os.chmod(daemon.socket_dir, 0o755)  # the other user reaches the client socket
                daemon.start()
                try:
                    fill(daemon)
                    os.kill(daemon.pid, signal.SIGUSR1)  # its steps count from here
                    result = round_trips(daemon, args.seconds, style)
                finally:
                    daemon.stop()
                    daemon.cleanup()
                results[style or "quiet"] = {**result, "daemon_steps": step_summary(steps_file)}
                print(f"{name} {style or 'quiet'}: {results[style or 'quiet']}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    document["machine"]["load_average_after"] = os.getloadavg()
    text = json.dumps(document, indent=2)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"events-pages-{datetime.date.today().isoformat()}.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
