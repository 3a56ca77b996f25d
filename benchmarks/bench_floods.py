"""Flood benchmark (issues 12 and 23): what hostile local users cost the daemon and everyone else.

    python benchmarks/bench_floods.py [--seconds 60] [--attacks a b ...] [--output FILE] [--where TEXT]

For each attack the real daemon runs with its defaults and --metrics on loopback; an attacker
process runs the attack for `--seconds` as an unprivileged user (uid 1001, a second one as
1002, through setpriv when the benchmark runs as root; as the benchmark's own user otherwise),
while a well-behaved client of root (nvshare_py.client, a thread of this process) acquires and
releases a device in a loop. During and after the attack the benchmark also checks, once a
second, that root can read `status` on the control socket and scrape the metrics, and, once in
the middle and once after, that another uid (1003) can register and get the lock. The targets
(issue 23), each recorded per attack in `targets_met`:

- the daemon stays up; root and another uid can register, acquire and scrape;
- the well-behaved client's acquire() p99 < 10 ms during the attack and after it;
- the daemon's RSS within +20 % of its baseline, after the attack and at its peak during it;
- the daemon's log output < 1 MB per minute;
- no lock ever granted to two holders (replayed from the lock timeline).

Each attack also records the daemon's CPU time during it (`daemon_cpu_during`, in cores) and
the load average before and after it: on a machine shared with other work, latencies mean
little without the load. Prints JSON and writes benchmarks/results/floods-<date>.json (or
--output) with the machine (--where, its cores) and its load average before and after the
run. Attacks (python benchmarks/bench_floods.py --list):
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import floodkit  # noqa: E402
from nvshare_py.paths import SocketPaths  # noqa: E402

GPU = "GPU-5151ad00-0000-4000-8000-000000000000"
OTHER_GPU = "GPU-5151ad00-0000-4000-8000-000000000001"
SETTLE = 5.0  # seconds measured before and after each attack
ATTACKER, SECOND_ATTACKER, NEWCOMER = 1001, 1002, 1003


# --- attacks: each runs in its own process (`bench_floods.py attack KIND SOCKET METRICS SECONDS`) --


def _connect(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        sock.connect(path)
    except OSError:
        pass
    return sock


def _raw(path: str) -> floodkit.RawClient | None:
    try:
        return floodkit.RawClient(path)
    except (OSError, ConnectionError, AssertionError):
        return None


def _hold_many(path: str, end: float, make) -> int:
    """Open connections with `make` until refused or the time is up; keep them to the end."""
    held = []
    while time.monotonic() < end:
        peer = make(path)
        if peer is None:
            time.sleep(0.05)  # refused: the limits at work; try again later
            continue
        held.append(peer)
    for peer in held:
        peer.close()
    return len(held)


def _registered(path: str, devices: int = 0, program: str = "") -> floodkit.RawClient | None:
    peer = _raw(path)
    if peer is None:
        return None
    try:
        peer.send("\n".join(["NVSHARE/1 HELLO", "pid=1", f"session={os.urandom(8).hex()}",
                             *([f"program={program}"] if program else [])]))
        for n in range(devices):
            peer.send(f"NVSHARE/1 DEVICE\ndevice=GPU-{os.urandom(6).hex()}-{n:04d}\ntotal=1")
        return peer
    except OSError:
        return None


def _trickle(path: str, end: float, start: bytes) -> int:
    """Connections that send `start` (the beginning of a frame) and then a byte a second."""
    held = []
    while time.monotonic() < end:
        peer = _raw(path)
        if peer is None:
            time.sleep(0.05)
        else:
            peer.send_raw(start)
            held.append(peer)
        for peer in list(held):
            try:
                peer.sock.send(b"x", socket.MSG_DONTWAIT)
            except OSError:
                held.remove(peer)  # closed by the scheduler: its deadline
    for peer in held:
        peer.close()
    return len(held)


def attack(kind: str, path: str, metrics: str, seconds: float) -> int:
    end = time.monotonic() + seconds
    rounds = 0
    if kind == "connections":  # plain connections held, dropped and reopened (issue 12)
        held: list[socket.socket] = []
        while time.monotonic() < end:
            held.append(_connect(path))
            rounds += 1
            if len(held) >= 800:
                for sock in held:
                    sock.close()
                held.clear()
        for sock in held:
            sock.close()
        return rounds
    if kind in ("hold-hello", "two-users"):  # registrations held up to the limits
        return _hold_many(path, end, _registered)
    if kind == "registrations-64":  # registrations announcing 64 invented devices each
        return _hold_many(path, end, lambda p: _registered(p, devices=64))
    if kind == "label-sets":  # registrations with distinct programs, each acquiring
        def labelled(p: str) -> floodkit.RawClient | None:
            peer = _registered(p, program=f"prog-{os.urandom(4).hex()}")
            if peer is not None:
                try:
                    peer.send(f"NVSHARE/1 ACQUIRE\ndevice={OTHER_GPU}")  # not the prober's
                except OSError:
                    return None
            return peer
        return _hold_many(path, end, labelled)
    if kind == "idle":
        return _hold_many(path, end, _raw)
    if kind == "slowloris":  # a frame header announcing 12 KiB, then its body a byte a second
        return _trickle(path, end, bytes([0x02]) + struct.pack(">Q", 12 * 1024))
    if kind == "half-hello":
        return _trickle(path, end, floodkit.frame(b"NVSHARE/1 HELLO\npid=1\nsession=00000000000000a1")[:20])
    if kind in ("empty-more", "commands", "valid"):  # floods inside ZMTP on 20 connections
        return floodkit.flood(path, kind, 20, seconds)
    if kind == "backlog":  # bursts of 600 connections fed garbage and closed back to back
        while time.monotonic() < end:
            for _ in range(600):
                sock = _connect(path)
                try:
                    sock.send(b"garbage")
                except OSError:
                    pass
                sock.close()
                rounds += 1
            time.sleep(0.5)
        return rounds
    if kind == "metrics-hold":  # the metrics endpoint's connections held open
        host, port = metrics.rsplit(":", 1)
        held = []
        while time.monotonic() < end:
            try:
                sock = socket.create_connection((host, int(port)), timeout=5)
                sock.sendall(b"GET /metrics HTTP/1.1\r\n")
                held.append(sock)
                rounds += 1
            except OSError:
                time.sleep(0.05)
            if len(held) > 64:
                held.pop(0).close()
        for sock in held:
            sock.close()
        return rounds
    if kind == "scrape-large":  # state made large, then scraped as fast as possible
        peers = [peer for peer in (_registered(path, devices=64) for _ in range(40)) if peer is not None]
        host, port = metrics.rsplit(":", 1)
        while time.monotonic() < end:
            try:
                with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as answer:
                    answer.read()
                rounds += 1
            except OSError:
                time.sleep(0.01)
        for peer in peers:
            peer.close()
        return rounds
    while time.monotonic() < end:  # the short-lived kinds: one round per loop
        rounds += 1
        try:
            if kind == "hello-close":
                peer = floodkit.RawClient(path)
                peer.hello(session=f"{rounds:016x}")
                peer.close()
            elif kind == "routing-ids":
                peer = floodkit.RawClient(path, identity=bytes([0]) + (0x6B8B4567 + rounds % 64).to_bytes(4, "big"))
                peer.hello(session=f"{rounds:016x}")
                peer.close()
            elif kind == "device-churn":
                peer = floodkit.RawClient(path)
                peer.hello(session=f"{rounds:016x}")
                for n in range(100):
                    peer.send(f"NVSHARE/1 DEVICE\ndevice=GPU-{rounds:08d}-{n:04d}\ntotal=1")
                peer.close()
            elif kind == "reclaim":
                peer = floodkit.RawClient(path)
                peer.hello(session=f"{rounds:016x}", held=GPU + "," + ",".join(f"D{n}" for n in range(40)))
                peer.close()
            elif kind == "malformed":
                peer = floodkit.RawClient(path)
                peer.send_raw(floodkit.frame(b"NVSHARE/1 HELLO\npid=x"))
                peer.send_raw(floodkit.frame(b"A", more=True) + floodkit.frame(b"B"))
                peer.send_raw(floodkit.frame(b"x" * 70_000))
                peer.close()
            else:
                raise SystemExit(f"unknown attack {kind}")
        except (OSError, AssertionError, ConnectionError):
            time.sleep(0.001)  # refused or cut off: the daemon's defence; go on
    return rounds


ATTACKS = {
    "connections": "plain connections held (800 at a time)",
    "hello-close": "HELLO then close, as fast as possible",
    "hold-hello": "registered connections held up to the limits",
    "two-users": "two uids holding registered connections up to their limits",
    "slowloris": "frame headers whose bodies trickle a byte a second",
    "idle": "connections that greet and say nothing",
    "half-hello": "half a HELLO frame, then a byte a second",
    "empty-more": "zero-length MORE frames on 20 connections",
    "commands": "3-byte unknown ZMTP commands on 20 connections",
    "valid": "valid messages (QUERY) on 20 connections",
    "registrations-64": "registrations announcing 64 invented devices each, held",
    "device-churn": "registrations announcing 100 invented devices, then leaving",
    "routing-ids": "peer-chosen routing ids (libzmq's next automatic ones)",
    "reclaim": "HELLO held= claims of a busy device and 40 invented ones",
    "malformed": "malformed, multi-frame and oversized messages",
    "backlog": "bursts of 600 connections fed garbage and closed back to back",
    "metrics-hold": "the metrics endpoint's connections held open without a request",
    "label-sets": "registrations with distinct program names, each acquiring",
    "scrape-large": "40 registrations of 64 devices, then scrapes as fast as possible",
}


# --- measurement -------------------------------------------------------------------------------


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def cpu_seconds(pid: int) -> float:
    """The thread time process `pid` has used (user and system), in seconds."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def as_user(uid: int) -> list[str]:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        return []
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]


class Prober:
    """A well-behaved client of root: acquire/release in a loop, latencies by phase."""

    def __init__(self, socket_dir: Path) -> None:
        from nvshare_py.client import Client

        os.environ["NVSHARE_SOCKET_DIR"] = str(socket_dir)
        self.client = Client()
        self.client.connect()
        self.client.announce(GPU, 16 << 30, "bench")
        self.phase = "before"
        self.samples: dict[str, list[float]] = {"before": [], "during": [], "after": []}
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                start = time.perf_counter()
                self.client.acquire(GPU, timeout=30)
                self.samples[self.phase].append(time.perf_counter() - start)
                self.client.release(GPU)
            except Exception as exc:  # recorded: a failure is a result here
                self.errors.append(repr(exc))
                time.sleep(0.1)
            time.sleep(0.005)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(60)
        self.client.close()


class Watcher:
    """Once a second: root's `status` on the control socket, a scrape and the daemon's RSS;
    five times a second the lock timeline, replayed to check that no device ever had two
    holders. The daemon keeps the last 10 000 events: when an attack makes more than that
    between two reads, the replay starts afresh after the gap (counted in `timeline_gaps`)."""

    def __init__(self, paths: SocketPaths, metrics: str, pid: int) -> None:
        self.paths, self.metrics, self.pid = paths, metrics, pid
        self.status_failures = self.scrape_failures = self.checks = self.timeline_gaps = 0
        self.two_holders: list[dict] = []
        self.peak_rss = 0
        self._next = 0
        self._seen = 0  # the last sequence number replayed
        self._holding: dict[str, dict[int, str]] = {}  # device -> active grant -> client
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from nvshare_py.control import ControlConnection

        with ControlConnection(self.paths, timeout=10) as timeline:
            ticks = 0
            while not self._stop.wait(0.2):
                try:
                    events, self._next = timeline.events_since(self._next)
                    self._replay(events)
                except Exception:
                    self.status_failures += 1
                ticks += 1
                if ticks % 5 == 0:
                    self._check()

    def _check(self) -> None:
        from nvshare_py.control import ControlConnection

        self.checks += 1
        try:
            self.peak_rss = max(self.peak_rss, rss_kib(self.pid))
            with ControlConnection(self.paths, timeout=10) as control:
                control.request("status")
        except Exception:
            self.status_failures += 1
        try:
            with urllib.request.urlopen(f"http://{self.metrics}/metrics", timeout=10) as answer:
                answer.read()
        except Exception:
            self.scrape_failures += 1

    def _replay(self, events: list[dict]) -> None:
        if events and self._seen and events[0]["seq"] != self._seen + 1:
            self.timeline_gaps += 1
            self._holding.clear()  # who held what across the gap is unknown
        if events:
            self._seen = events[-1]["seq"]
        for event in events:
            active = self._holding.setdefault(event["device"] or "", {})
            if event["kind"] == "grant" and event["detail"] == "claimed":
                continue  # a client's own claim after a restart (HELLO held=), not a GRANT sent
            if event["kind"] == "grant":
                if active and event["client"] not in active.values():
                    self.two_holders.append(event)
                active[event["grant"]] = event["client"]
            elif event["kind"] in ("release", "revoke", "lost") or (event["kind"] == "unregister" and event["device"]):
                active.pop(event["grant"], None)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(60)


def another_user_registers(socket_dir: Path) -> bool:
    """Whether a client of another uid (NEWCOMER) registers and gets the lock."""
    program = ("import os, sys; sys.path.insert(0, sys.argv[1]); from nvshare_py.client import Client\n"
               "c = Client(); c.connect(); c.acquire(sys.argv[2], timeout=30); c.release(sys.argv[2]); c.close()")
    os.chmod(socket_dir, 0o755)
    try:
        result = subprocess.run([*as_user(NEWCOMER), sys.executable, "-c", program, str(REPO), GPU], cwd="/",
                                env=dict(os.environ, NVSHARE_SOCKET_DIR=str(socket_dir)),
                                capture_output=True, timeout=60)
        return result.returncode == 0
    except subprocess.TimeoutExpired:
        return False


def percentiles(samples: list[float]) -> dict:
    if len(samples) < 2:
        return {"n": len(samples)}
    ordered = sorted(samples)
    return {"n": len(ordered), "p50_ms": round(statistics.median(ordered) * 1000, 3),
            "p99_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000, 3),
            "max_ms": round(ordered[-1] * 1000, 3)}


def run_attack(kind: str, seconds: float) -> dict:
    socket_dir = Path(tempfile.mkdtemp(prefix="nvs-flood-", dir="/tmp"))
    os.chmod(socket_dir, 0o755)  # the attackers are other users
    paths = SocketPaths.resolve(socket_dir)
    log_path = socket_dir.parent / f"{socket_dir.name}.log"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    with open(log_path, "wb") as log_file:
        daemon = subprocess.Popen([sys.executable, "-m", "nvshare_py.scheduler", "--socket-dir", str(socket_dir),
                                   "--metrics", "127.0.0.1:0"], stderr=log_file, env=env, cwd="/")
        try:
            deadline = time.monotonic() + 30
            while not (found := re.search(r"serving metrics address=(\S+)", log_path.read_text())):
                if time.monotonic() > deadline or daemon.poll() is not None:
                    raise RuntimeError(f"the daemon did not start: {log_path.read_text()[-2000:]}")
                time.sleep(0.05)
            metrics = found.group(1)
            prober = Prober(socket_dir)
            time.sleep(SETTLE)
            baseline_rss = rss_kib(daemon.pid)
            log_before = log_path.stat().st_size
            load_before = os.getloadavg()
            cpu_before, attack_start = cpu_seconds(daemon.pid), time.monotonic()
            watcher = Watcher(paths, metrics, daemon.pid)
            prober.phase = "during"
            uids = [ATTACKER, SECOND_ATTACKER] if kind == "two-users" else [ATTACKER]
            attackers = [subprocess.Popen([*as_user(uid), sys.executable, __file__, "attack", kind,
                                           str(paths.client_socket), metrics, str(seconds)],
                                          env=env, stdout=subprocess.PIPE, text=True, cwd="/") for uid in uids]
            time.sleep(seconds / 2)
            newcomer_during = another_user_registers(socket_dir)
            rounds = sum(int(a.communicate(timeout=seconds + 120)[0].strip() or 0) for a in attackers)
            daemon_cpu = (cpu_seconds(daemon.pid) - cpu_before) / (time.monotonic() - attack_start)
            load_after = os.getloadavg()
            log_bytes = log_path.stat().st_size - log_before
            peak_rss = max(watcher.peak_rss, rss_kib(daemon.pid))
            prober.phase = "after"
            time.sleep(SETTLE)
            newcomer_after = another_user_registers(socket_dir)
            watcher.close()
            alive = daemon.poll() is None
            after_rss = rss_kib(daemon.pid) if alive else 0
            prober.close()
        finally:
            daemon.terminate()
            daemon.wait(30)
    during, after = percentiles(prober.samples["during"]), percentiles(prober.samples["after"])
    result = {
        "attack": kind,
        "what": ATTACKS[kind],
        "seconds": seconds,
        "attacker_uids": uids if as_user(ATTACKER) else [os.geteuid()],
        "attacker_rounds": rounds,
        "daemon_alive": alive,
        # The daemon's thread time during the attack, per second (1.0: a whole core); with the
        # other users' share (fairness.py) it bounds what the attack could take.
        "daemon_cpu_during": round(daemon_cpu, 3),
        "load_average": {"before": load_before, "after": load_after},
        "acquire_before": percentiles(prober.samples["before"]),
        "acquire_during": during,
        "acquire_after": after,
        "client_errors": prober.errors[:5],
        "another_uid_registers": {"during": newcomer_during, "after": newcomer_after},
        "root_status_failures": watcher.status_failures,
        "scrape_failures": watcher.scrape_failures,
        "checks": watcher.checks,
        "two_holders": watcher.two_holders[:5],
        "timeline_gaps": watcher.timeline_gaps,
        "rss_baseline_kib": baseline_rss,
        "rss_peak_kib": peak_rss,
        "rss_after_kib": after_rss,
        "rss_peak_ratio": round(peak_rss / baseline_rss, 3),
        "rss_after_ratio": round(after_rss / baseline_rss, 3) if baseline_rss else None,
        "log_bytes_per_minute": round(log_bytes / seconds * 60),
    }
    result["targets_met"] = {
        "alive": alive,
        "root_and_another_uid_served": (not prober.errors and newcomer_during and newcomer_after
                                        and watcher.status_failures == 0 and watcher.scrape_failures == 0),
        "p99_during_under_10ms": during.get("p99_ms", 1e9) < 10,
        "p99_after_under_10ms": after.get("p99_ms", 1e9) < 10,
        "rss_after_within_20pct": result["rss_after_ratio"] is not None and result["rss_after_ratio"] <= 1.2,
        "rss_peak_within_20pct": result["rss_peak_ratio"] <= 1.2,
        "log_under_1MB_per_min": result["log_bytes_per_minute"] < 1_000_000,
        "never_two_holders": not watcher.two_holders,
    }
    print(json.dumps({kind: result["targets_met"], "p99_during": during.get("p99_ms"), "daemon_cpu_during": result["daemon_cpu_during"],
                      "load": load_before[0]}), file=sys.stderr, flush=True)
    return result


def machine(where: str) -> dict:
    cpus = len(os.sched_getaffinity(0))
    return {"where": where, "cpus": os.cpu_count(), "cpus_usable": cpus, "python": platform.python_version(),
            "kernel": platform.release(), "load_before": os.getloadavg()}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "attack":
        print(attack(sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5])))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0, help="length of each attack")
    parser.add_argument("--attacks", nargs="+", default=list(ATTACKS), help="attacks to run (names, or name,name,...)")
    parser.add_argument("--list", action="store_true", help="list the attacks and exit")
    parser.add_argument("--output", type=Path)
    parser.add_argument("--where", default="", help="the machine, in words (recorded with its cores and load)")
    args = parser.parse_args()
    if args.list:
        for name, what in ATTACKS.items():
            print(f"{name:18} {what}")
        return
    results = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": machine(args.where),
        "attacks": [run_attack(kind, args.seconds) for kind in ",".join(args.attacks).split(",")],
    }
    results["host"]["load_after"] = os.getloadavg()
    results["all_targets_met"] = {attack["attack"]: all(attack["targets_met"].values()) for attack in results["attacks"]}
    text = json.dumps(results, indent=2)
    print(text)
    output = args.output or REPO / "benchmarks" / "results" / f"floods-{datetime.date.today()}.json"
    output.write_text(text + "\n")


if __name__ == "__main__":
    main()
