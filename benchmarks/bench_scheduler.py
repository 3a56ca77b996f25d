"""Scheduler benchmark: lock handoff and acquire latency through the real daemon.

    python benchmarks/bench_scheduler.py [--quick] [--output FILE]
    python benchmarks/bench_scheduler.py --scrape 1 [--quick]   # metrics cost, see below

Each client is a separate process, of one of two kinds (`--client`): `c` is
benchmarks/c/lock_client.c, which speaks the protocol with libnvshare.so's own transport and
codec (what CUDA programs under nvshare use); `python` uses nvshare_py.client (libzmq on both
ends). The daemon is `python -m nvshare_py.scheduler` with its default settings. Measured:

- uncontended acquire: acquire() call -> Grant returned, while one client at a time works and
  the others stay connected (idle, heartbeating);
- handoff: every client loops acquire -> release on its device; for consecutive grants of a
  device where the next client was already waiting, the time from the previous holder's
  release() call to the next holder's acquire() returning. Reported with handoffs per second
  (all devices together);
- SIGKILL of a holder -> the waiting client's acquire() returns;
- the idle daemon's CPU use over 10 s (utime + stime from /proc/<pid>/stat), with no clients
  and with 32 idle clients.

With `--scrape SECONDS` it measures only what serving Prometheus metrics costs the lock path:
handoffs (C clients, 8 clients on one device, 1 ms holds) alternately on a daemon without
`--metrics` and on one with `--metrics` while a scraper GETs /metrics every SECONDS, several
rounds each; writes benchmarks/results/scheduler-scrape-<date>.json.

Timestamps are CLOCK_MONOTONIC (time.monotonic_ns), comparable across processes. Prints the
results as JSON and writes benchmarks/results/scheduler-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a source tree without installing

from nvshare_py.paths import SocketPaths  # noqa: E402

CLIENT_COUNTS = (1, 8, 32, 128)
DEVICE_COUNTS = (1, 8)
# Seconds each holder keeps the lock: 1 ms measures a handoff in an otherwise quiet system;
# 0 saturates the scheduler (every client releases and asks again at once): throughput.
HOLD_TIMES = (0.001, 0.0)


def device_name(index: int) -> str:
    return f"GPU-5151ad00-0000-4000-8000-{index:012x}"


# --- the daemon ------------------------------------------------------------------------------


class Daemon:
    def __init__(self, *extra_args: str) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="nvs-bench-", dir="/tmp"))
        self.paths = SocketPaths(self.directory)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        self.log = open(self.directory / "scheduler.log", "wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "nvshare_py.scheduler", "--socket-dir", str(self.directory), *extra_args],
            env=env, stdout=self.log, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 30
        while not self.paths.control_socket.exists() or not self._answers():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.process.kill()
                self.process.wait()
                raise RuntimeError((self.directory / "scheduler.log").read_text())
            time.sleep(0.05)

    def _answers(self) -> bool:
        try:
            self.request("status")
            return True
        except Exception:
            return False

    def request(self, op: str, **fields):
        import zmq

        context = zmq.Context()
        try:
            sock = context.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVTIMEO, 5000)
            sock.connect(self.paths.control_endpoint)
            sock.send_json({"v": 1, "op": op, **fields})
            reply = sock.recv_json()
        finally:
            context.destroy(linger=0)
        if not reply["ok"]:
            raise RuntimeError(reply)
        return reply["result"]

    def cpu_seconds(self) -> float:
        with open(f"/proc/{self.process.pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(30)
        self.log.close()
        shutil.rmtree(self.directory, ignore_errors=True)


# --- client processes ------------------------------------------------------------------------


def worker(socket_dir: str, device: str, commands, results) -> None:
    """Obeys ("uncontended", n), ("handoff", seconds, start_at), ("hold",), ("acquire-timed",),
    ("release",) and ("exit",)."""
    from nvshare_py.client import Client

    client = Client(socket_dir, connect_timeout=60)
    client.connect()
    results.send(("ready", os.getpid()))
    now = time.monotonic_ns
    while True:
        command = commands.recv()
        if command[0] == "uncontended":
            samples = []
            for _ in range(command[1]):
                start = now()
                client.acquire(device)
                samples.append(now() - start)
                client.release(device)
            results.send(samples)
        elif command[0] == "handoff":
            _, seconds, start_at, hold = command
            while now() < start_at:
                time.sleep(0.0005)
            end = start_at + int(seconds * 1e9)
            records = []
            while True:
                asked = now()
                client.acquire(device)
                granted = now()
                if hold:
                    time.sleep(hold)
                released = now()
                client.release(device)
                records.append((asked, granted, released))
                if released > end:
                    break
            results.send(records)
        elif command[0] == "hold":
            client.acquire(device)
            results.send("holding")
        elif command[0] == "acquire-timed":
            client.acquire(device)
            results.send(now())
        elif command[0] == "release":
            client.release(device)
            results.send("released")
        elif command[0] == "exit":
            client.close()
            return


class CClients:
    """N lock_client processes (benchmarks/c/lock_client.c), client i using device i % devices,
    driven through the same commands as the Python workers."""

    def __init__(self, binary: Path, daemon: Daemon, count: int, devices: int) -> None:
        self.processes = [
            subprocess.Popen([str(binary), str(daemon.paths.client_socket), device_name(index % devices)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            for index in range(count)
        ]
        for process in self.processes:
            if process.stdout.readline().strip() != "ready":
                raise RuntimeError("lock_client did not start")

    def send(self, index: int, command) -> None:
        if command[0] == "uncontended":
            line = f"uncontended {command[1]}"
        elif command[0] == "handoff":
            _, seconds, start_at, hold = command
            line = f"handoff {start_at} {seconds} {int(hold * 1e6)}"
        else:
            raise ValueError(f"lock_client has no command {command[0]}")
        self.processes[index].stdin.write(line + "\n")
        self.processes[index].stdin.flush()

    def receive(self, index: int):
        kind, *values = self.processes[index].stdout.readline().split()
        if kind == "samples":
            return [int(v) for v in values]
        return [tuple(int(x) for x in v.split(",")) for v in values]

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.stdin.write("exit\n")
                process.stdin.flush()
        for process in self.processes:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()


def build_lock_client(directory: Path) -> Path:
    binary = directory / "lock_client"
    sources = [REPO / "benchmarks/c/lock_client.c", REPO / "interceptor/transport.c", REPO / "interceptor/message.c"]
    subprocess.run(["cc", "-O2", "-iquote", str(REPO / 'interceptor'), "-o", str(binary), *map(str, sources)], check=True)
    return binary


class Clients:
    """N worker processes, client i using device i % devices."""

    def __init__(self, context, daemon: Daemon, count: int, devices: int) -> None:
        self.links = []
        self.processes = []
        for index in range(count):
            commands_out, commands_in = context.Pipe()
            results_out, results_in = context.Pipe()
            process = context.Process(
                target=worker, args=(str(daemon.directory), device_name(index % devices), commands_in, results_out),
                daemon=True,
            )
            process.start()
            self.links.append((commands_out, results_in))
            self.processes.append(process)
        for _, results in self.links:
            assert results.recv()[0] == "ready"

    def send(self, index: int, command) -> None:
        self.links[index][0].send(command)

    def receive(self, index: int):
        return self.links[index][1].recv()

    def close(self) -> None:
        for index, process in enumerate(self.processes):
            if process.is_alive():
                self.send(index, ("exit",))
        for process in self.processes:
            process.join(30)
            if process.is_alive():
                process.kill()


# --- measurements ----------------------------------------------------------------------------


def summary(nanoseconds: list[int]) -> dict:
    if not nanoseconds:
        return {"samples": 0}
    ordered = sorted(nanoseconds)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1000  # noqa: E731
    return {
        "samples": len(ordered),
        "p50_us": round(pick(0.50), 1),
        "p99_us": round(pick(0.99), 1),
        "max_us": round(ordered[-1] / 1000, 1),
        "mean_us": round(statistics.fmean(ordered) / 1000, 1),
    }


def wait_until_free(daemon: Daemon) -> None:
    """A release() returns before the scheduler has seen it; wait until nobody holds anything."""
    deadline = time.monotonic() + 10
    while any(d["holders"] for d in daemon.request("status")["devices"]):
        if time.monotonic() > deadline:
            raise RuntimeError("a device stays held")
        time.sleep(0.001)


def measure_uncontended(clients: Clients, daemon: Daemon, total: int) -> dict:
    count = len(clients.processes)
    per_client = max(5, total // count)
    samples: list[int] = []
    for index in range(count):
        clients.send(index, ("uncontended", per_client))
        samples += clients.receive(index)
        wait_until_free(daemon)
    return summary(samples)


def measure_handoff(clients: Clients, devices: int, seconds: float, hold: float) -> dict:
    count = len(clients.processes)
    start_at = time.monotonic_ns() + 300_000_000
    for index in range(count):
        clients.send(index, ("handoff", seconds, start_at, hold))
    per_device: dict[int, list[tuple]] = {}
    for index in range(count):
        per_device.setdefault(index % devices, []).extend(clients.receive(index))
    latencies = []
    first, last = None, None
    for records in per_device.values():
        records.sort(key=lambda record: record[1])
        for previous, following in zip(records, records[1:]):
            asked, granted, _ = following
            if asked < previous[2]:  # the next client was waiting when the holder released
                latencies.append(granted - previous[2])
                first = granted if first is None else min(first, granted)
                last = granted if last is None else max(last, granted)
    result = {"hold_ms": hold * 1000, **summary(latencies)}
    if latencies and last > first:
        result["handoffs_per_s"] = round(len(latencies) / ((last - first) / 1e9))
    return result


def measure_kill_to_grant(context, daemon: Daemon, rounds: int) -> dict:
    waiter = Clients(context, daemon, 1, 1)
    latencies = []
    try:
        for _ in range(rounds):
            holder = Clients(context, daemon, 1, 1)
            holder.send(0, ("hold",))
            assert holder.receive(0) == "holding"
            waiter.send(0, ("acquire-timed",))
            deadline = time.monotonic() + 10
            while not any(d["waiters"] for d in daemon.request("status")["devices"]):
                if time.monotonic() > deadline:
                    raise RuntimeError("the waiter never queued")
                time.sleep(0.001)
            killed = time.monotonic_ns()
            os.kill(holder.processes[0].pid, signal.SIGKILL)
            latencies.append(waiter.receive(0) - killed)
            holder.processes[0].join(10)
            waiter.send(0, ("release",))  # hand the lock back for the next round
            assert waiter.receive(0) == "released"
            wait_until_free(daemon)
    finally:
        waiter.close()
    return summary(latencies)


def measure_idle_cpu(daemon: Daemon, seconds: float) -> dict:
    before, started = daemon.cpu_seconds(), time.monotonic()
    time.sleep(seconds)
    used = daemon.cpu_seconds() - before
    elapsed = time.monotonic() - started
    return {"seconds": round(elapsed, 2), "cpu_seconds": round(used, 3), "cpu_percent": round(100 * used / elapsed, 3)}


class Scraper:
    """A thread that GETs the daemon's /metrics every `interval` seconds, as Prometheus would."""

    def __init__(self, daemon: Daemon, interval: float) -> None:
        import re
        import threading

        text = (daemon.directory / "scheduler.log").read_text()
        self.url = "http://" + re.search(r"serving metrics address=(\S+)", text).group(1) + "/metrics"
        self.interval = interval
        self.durations: list[int] = []
        self.bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import urllib.request

        while not self._stop.wait(self.interval):
            started = time.monotonic_ns()
            with urllib.request.urlopen(self.url, timeout=30) as answer:
                self.bytes = len(answer.read())
            self.durations.append(time.monotonic_ns() - started)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(60)
        return {"scrapes": len(self.durations), "last_bytes": self.bytes, **summary(self.durations)}


def measure_scrape_cost(interval: float, quick: bool) -> dict:
    """Handoff latency without metrics and with a scraper, alternating daemons round by round
    (the machine is shared: alternating spreads its background load over both)."""
    rounds = 2 if quick else 5
    seconds = 2.0 if quick else 5.0
    count, devices, hold = 8, 1, 0.001
    collected: dict[str, list] = {"off": [], "scraped": []}
    scrapes = []
    lock_client = None
    for _ in range(rounds):
        for variant in ("off", "scraped"):
            daemon = Daemon(*(("--metrics", "127.0.0.1:0") if variant == "scraped" else ()))
            scraper = None
            try:
                lock_client = lock_client or build_lock_client(Path(tempfile.mkdtemp(prefix="nvs-bench-bin-")))
                clients = CClients(lock_client, daemon, count, devices)
                try:
                    if variant == "scraped":
                        scraper = Scraper(daemon, interval)
                    collected[variant].append(measure_handoff(clients, devices, seconds, hold))
                finally:
                    clients.close()
                    if scraper is not None:
                        scrapes.append(scraper.stop())
            finally:
                daemon.stop()
            print(variant, json.dumps(collected[variant][-1]), file=sys.stderr)

    def pooled(runs: list[dict]) -> dict:
        return {
            "p50_us_median_of_rounds": statistics.median(run["p50_us"] for run in runs),
            "p99_us_median_of_rounds": statistics.median(run["p99_us"] for run in runs),
            "handoffs_per_s_median_of_rounds": statistics.median(run.get("handoffs_per_s", 0) for run in runs),
            "rounds": runs,
        }

    off, scraped = pooled(collected["off"]), pooled(collected["scraped"])
    return {
        "setup": f"{count} C clients, {devices} device, {hold * 1000:g} ms holds, {seconds:g} s per round, "
                 f"{rounds} rounds alternating; scraper every {interval:g} s",
        "without_metrics": off,
        "with_scraper": scraped,
        "scrape_duration": scrapes,
        "ratio_p50": round(scraped["p50_us_median_of_rounds"] / off["p50_us_median_of_rounds"], 3),
        "ratio_p99": round(scraped["p99_us_median_of_rounds"] / off["p99_us_median_of_rounds"], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples (a smoke run)")
    parser.add_argument("--clients", type=int, nargs="+", default=CLIENT_COUNTS, help="client counts to run")
    parser.add_argument("--devices", type=int, nargs="+", default=DEVICE_COUNTS, help="device counts to run")
    parser.add_argument("--client", choices=("c", "python"), nargs="+", default=("c", "python"),
                        help="client implementations to measure")
    parser.add_argument("--no-extras", action="store_true", help="skip the idle-CPU and SIGKILL measurements")
    parser.add_argument("--scrape", type=float, metavar="SECONDS",
                        help="only measure the cost of metrics: handoffs without --metrics vs with a scraper every SECONDS")
    parser.add_argument("--output", type=Path, help="where to write the JSON (default benchmarks/results/scheduler-<date>.json)")
    args = parser.parse_args()
    handoff_seconds = 1.0 if args.quick else 3.0
    if args.scrape is not None:
        result = {
            "benchmark": "scheduler-scrape",
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "kernel": platform.release()},
            **measure_scrape_cost(args.scrape, args.quick),
        }
        text = json.dumps(result, indent=2)
        print(text)
        output = args.output or REPO / "benchmarks" / "results" / f"scheduler-scrape-{datetime.date.today().isoformat()}.json"
        output.write_text(text + "\n")
        return
    uncontended_total = 200 if args.quick else 2000

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["nvshare_py.client", "zmq"])
    daemon = Daemon()
    results: dict = {
        "benchmark": "scheduler",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "kernel": platform.release(),
            "pyzmq": __import__("zmq").__version__,
            "libzmq": __import__("zmq").zmq_version(),
        },
        "daemon": "default options (tq 30 s, heartbeat 1 s / 5 s, log level info)",
        "uncontended_acquire": [],
        "handoff": [],
    }
    try:
        if not args.no_extras:
            results["idle_cpu_no_clients"] = measure_idle_cpu(daemon, 10.0)
        lock_client = build_lock_client(daemon.directory) if "c" in args.client else None
        for kind, devices, count in ((k, d, c) for k in args.client for d in args.devices for c in args.clients):
            if kind == "c":
                clients = CClients(lock_client, daemon, count, devices)
            else:
                clients = Clients(context, daemon, count, devices)
            try:
                entry = {"client": kind, "clients": count, "devices": devices}
                results["uncontended_acquire"].append({**entry, **measure_uncontended(clients, daemon, uncontended_total)})
                if count >= 2 * devices:
                    for hold in HOLD_TIMES:
                        results["handoff"].append({**entry, **measure_handoff(clients, devices, handoff_seconds, hold)})
                else:
                    results["handoff"].append({**entry, "skipped": "needs at least two clients per device"})
                if count == 32 and devices == 1 and kind == "python" and not args.no_extras:
                    wait_until_free(daemon)
                    results["idle_cpu_32_clients"] = measure_idle_cpu(daemon, 10.0)
            finally:
                clients.close()
            print(json.dumps(results["handoff"][-1]), file=sys.stderr)
        if not args.no_extras:
            results["sigkill_holder_to_next_grant"] = measure_kill_to_grant(context, daemon, 5 if args.quick else 20)
    finally:
        daemon.stop()

    text = json.dumps(results, indent=2)
    print(text)
    output = args.output or REPO / "benchmarks" / "results" / f"scheduler-{datetime.date.today().isoformat()}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text + "\n")


if __name__ == "__main__":
    main()
