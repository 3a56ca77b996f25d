"""Flood benchmark (issue 12): what hostile local clients cost a well-behaved one.

    python benchmarks/bench_floods.py [--seconds 60] [--output FILE]

For each flood (plain connections, HELLO-then-close loops, peer-chosen routing ids, invented
devices, reclaim loops, oversized and malformed traffic) the real daemon runs with its
defaults; one attacker process floods for `--seconds` while a well-behaved client
(nvshare_py.client, another process's thread) acquires and releases a device in a loop. The
targets of the issue:

- the daemon never exits;
- the well-behaved client's acquire() p99 < 10 ms during the flood and after it;
- the daemon's RSS after the flood within 20 % of its baseline;
- the daemon's log output < 1 MB per minute.

Prints JSON and writes benchmarks/results/floods-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import floodkit  # noqa: E402
from nvshare_py.paths import SocketPaths  # noqa: E402

GPU = "GPU-5151ad00-0000-4000-8000-000000000000"
FLOODS = ("connections", "hello-close", "routing-ids", "invented-devices", "reclaim", "malformed")
SETTLE = 5.0  # seconds measured before and after each flood


# --- attackers (each runs as its own process: `bench_floods.py attack KIND SOCKET SECONDS`) ---


def attack(kind: str, path: str, seconds: float) -> int:
    end = time.monotonic() + seconds
    rounds = 0
    held: list[socket.socket] = []
    while time.monotonic() < end:
        rounds += 1
        try:
            if kind == "connections":
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.setblocking(False)
                try:
                    sock.connect(path)
                except OSError:
                    pass
                held.append(sock)
                if len(held) >= 800:  # the attacker's own limit: drop them and start again
                    for sock in held:
                        sock.close()
                    held.clear()
            elif kind == "hello-close":
                peer = floodkit.RawClient(path)
                peer.hello(session=f"{rounds:016x}")
                peer.close()
            elif kind == "routing-ids":
                peer = floodkit.RawClient(path, identity=bytes([0]) + (0x6B8B4567 + rounds % 64).to_bytes(4, "big"))
                peer.hello(session=f"{rounds:016x}")
                peer.close()
            elif kind == "invented-devices":
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
        except (OSError, AssertionError):
            time.sleep(0.001)  # refused or cut off: the daemon's defence; go on
    for sock in held:
        sock.close()
    return rounds


# --- measurement -------------------------------------------------------------------------------


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


class Prober:
    """A well-behaved client: acquire/release in a loop, latencies by phase."""

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


def percentiles(samples: list[float]) -> dict:
    if len(samples) < 2:
        return {"n": len(samples)}
    ordered = sorted(samples)
    return {"n": len(ordered), "p50_ms": round(statistics.median(ordered) * 1000, 3),
            "p99_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000, 3),
            "max_ms": round(ordered[-1] * 1000, 3)}


def run_flood(kind: str, seconds: float) -> dict:
    socket_dir = Path(tempfile.mkdtemp(prefix="nvs-flood-", dir="/tmp"))
    paths = SocketPaths.resolve(socket_dir)
    log_path = socket_dir.parent / f"{socket_dir.name}.log"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    with open(log_path, "wb") as log_file:
        daemon = subprocess.Popen([sys.executable, "-m", "nvshare_py.scheduler", "--socket-dir", str(socket_dir)],
                                  stderr=log_file, env=env)
        try:
            deadline = time.monotonic() + 30
            while not paths.client_socket.exists():
                if time.monotonic() > deadline or daemon.poll() is not None:
                    raise RuntimeError(f"the daemon did not start: {log_path.read_text()[-2000:]}")
                time.sleep(0.05)
            prober = Prober(socket_dir)
            time.sleep(SETTLE)
            baseline_rss = rss_kib(daemon.pid)
            log_before = log_path.stat().st_size
            prober.phase = "during"
            attacker = subprocess.run([sys.executable, __file__, "attack", kind, str(paths.client_socket), str(seconds)],
                                      env=env, capture_output=True, text=True, timeout=seconds + 120)
            log_bytes = log_path.stat().st_size - log_before
            prober.phase = "after"
            time.sleep(SETTLE)
            alive = daemon.poll() is None
            after_rss = rss_kib(daemon.pid) if alive else 0
            prober.close()
        finally:
            daemon.terminate()
            daemon.wait(30)
    during, after = percentiles(prober.samples["during"]), percentiles(prober.samples["after"])
    result = {
        "flood": kind,
        "seconds": seconds,
        "attacker_rounds": int(attacker.stdout.strip() or 0),
        "daemon_alive": alive,
        "acquire_before": percentiles(prober.samples["before"]),
        "acquire_during": during,
        "acquire_after": after,
        "client_errors": prober.errors[:5],
        "rss_baseline_kib": baseline_rss,
        "rss_after_kib": after_rss,
        "rss_ratio": round(after_rss / baseline_rss, 3) if baseline_rss else None,
        "log_bytes_per_minute": round(log_bytes / seconds * 60),
    }
    result["targets_met"] = {
        "alive": alive,
        "p99_during_under_10ms": during.get("p99_ms", 1e9) < 10,
        "p99_after_under_10ms": after.get("p99_ms", 1e9) < 10,
        "rss_within_20pct": result["rss_ratio"] is not None and result["rss_ratio"] <= 1.2,
        "log_under_1MB_per_min": result["log_bytes_per_minute"] < 1_000_000,
    }
    return result


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "attack":
        print(attack(sys.argv[2], sys.argv[3], float(sys.argv[4])))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0, help="length of each flood")
    parser.add_argument("--floods", default=",".join(FLOODS))
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    results = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "load": os.getloadavg()},
        "floods": [run_flood(kind, args.seconds) for kind in args.floods.split(",")],
    }
    text = json.dumps(results, indent=2)
    print(text)
    output = args.output or REPO / "benchmarks" / "results" / f"floods-{datetime.date.today()}.json"
    output.write_text(text + "\n")


if __name__ == "__main__":
    main()
