"""The real scheduler daemon (`python -m nvshare_py.scheduler`) as a child process, and the
client agents that talk to it, for tests (through tests/fixtures/scheduler.py's fixtures) and
benchmarks.

    scheduler = SchedulerProcess(short_socket_dir(), {**DEFAULT_OPTIONS, "tq": 2}).start()
    scheduler.socket_dir                       # Path: a fresh short directory under /tmp
    scheduler.env                              # environment for child processes (sets
                                               #   NVSHARE_SOCKET_DIR, and PYTHONPATH so they
                                               #   import this nvshare_py)
    scheduler.status()                         # the status document (dict)
    scheduler.events()                         # the lock timeline (list of dicts)
    scheduler.request("set-mode", mode="off")  # any control op; raises ControlFailure
    scheduler.ctl("status", "--json")          # runs nvsharectl -> CompletedProcess (text)
    scheduler.restart()                        # SIGTERM, then start again on the same dir
    scheduler.restart(kill=True)               # the same after SIGKILL
    scheduler.run_to_exit("--tq", "0")         # the daemon's command line in the
                                               #   foreground (tests of refused starts)
    scheduler.kill(); scheduler.stop()         # SIGKILL / SIGTERM (returns the exit status)
    scheduler.start()                          # start again after kill()/stop()
    scheduler.log_text()                       # everything the daemon logged (all runs)
    scheduler.pid                              # the daemon's pid
    scheduler.device(uuid)                     # its entry of status()["devices"], or None
    scheduler.holders(uuid), .waiters(uuid)    # client ids ("c3"), waiters in queue order
    scheduler.clients()                        # ids of the registered clients
    scheduler.cleanup()                        # kills its agents, stops the daemon

Default timings (DEFAULT_OPTIONS) are chosen so that no test depends on the machine's speed:
tq=30, grace=10, heartbeat_interval=0.2, heartbeat_timeout=10, idle_release=0.3, recovery=5,
log_level="debug". On a busy 2-core machine a process can go unscheduled for a second or two, so
a quantum, grace, heartbeat timeout or recovery window that a test does not exercise is long
enough never to strike during it; a test that exercises one sets it itself, as short as it likes,
and then waits for the *effect* (an event, a line, a status change), never for a time.
Nor on its memory: the admission spill is a fixed 256 GiB (`admission_spill`), not `auto`'s half
of the host's MemAvailable, which on a small or busy machine left a test's few GiB of simulated
allocations waiting for admission; a test of admission sets its own.

`scheduler.agent()` starts a *client process* (nvshare_py/testing/agent.py, which says what it
obeys) and waits for it to register:

    agent = scheduler.agent(env={...})   # waits for "ready <client-id>"; agent.client_id
    agent.send("acquire GPU-x")          # one command line
    agent.expect("granted GPU-x")        # -> the line (waits; raises AssertionError on timeout)
    agent.pid; agent.kill(); agent.signal(signal.SIGSTOP); agent.lines (everything printed)

`pinned_for_swapping(status)` and `swap_pool_bytes()` say how much pinned host memory nvshare
holds for swapping (the swap areas of the status document, the node-wide pool's files).

`wait_for(predicate, timeout=..., what=...)` polls a condition (no timing asserts: a generous
timeout, then AssertionError naming `what` and the last value seen). `child_env()`,
`run_child()` and `nvsharectl_command()` help to run other processes the same way (from
CHILD_CWD, so that an installed nvshare_py is not shadowed by a checkout).
"""

from __future__ import annotations

import importlib.util
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

from nvshare_py.paths import ENV_SOCKET_DIR, SocketPaths
from nvshare_py.testing import PACKAGE_PARENT

DEFAULT_OPTIONS = {
    "mode": "on",
    "tq": 30.0,
    "grace": 10.0,
    "heartbeat_interval": 0.2,
    "heartbeat_timeout": 10.0,
    "idle_release": 0.3,
    "recovery": 5.0,
    "log_level": "debug",
    "admission_spill": 256 << 30,
}

# The program name agents register with (NVSHARE_PROGRAM), as a launcher names its programs.
AGENT_PROGRAM = "agent.py"

# The longest any test waits for something that must happen (an upper guard, never a measure):
# reached only when the awaited thing is broken, so it may be generous.
PATIENCE = 60.0


def nvsharectl_module() -> str:
    """The module that runs nvsharectl with this nvshare_py: an installed package's
    nvshare_py.ctl, or in a checkout its ./ctl, beside nvshare_py (child_env puts that directory
    on PYTHONPATH)."""
    return "nvshare_py.ctl" if importlib.util.find_spec("nvshare_py.ctl") is not None else "ctl"


def nvsharectl_command() -> list[str]:
    """argv prefix that runs nvsharectl (nvsharectl_module)."""
    return [sys.executable, "-m", nvsharectl_module()]


# Children start in a neutral directory: `python -m` and `-c` put the working directory first
# on sys.path, which from the repository root would shadow an installed nvshare_py with the
# source tree.
CHILD_CWD = "/"


def run_child(argv: list[str], env: dict[str, str], timeout: float = 60.0) -> subprocess.CompletedProcess:
    """Run a command to completion from CHILD_CWD, capturing its text output."""
    return subprocess.run(argv, env=env, cwd=CHILD_CWD, capture_output=True, text=True, timeout=timeout)


def child_env(socket_dir: Path | None = None, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_PARENT, env.get("PYTHONPATH", "")) if p)
    if socket_dir is not None:
        env[ENV_SOCKET_DIR] = str(socket_dir)
    env.update(extra or {})
    return env


def short_socket_dir() -> Path:
    """A fresh directory short enough for Unix socket paths (never pytest's tmp_path)."""
    return Path(tempfile.mkdtemp(prefix="nvs-", dir="/tmp"))


# The node-wide pinned swap pool of a user (issue 29): files segment-* in this folder of /dev/shm.
SWAP_POOL_DIR = "nvshare-pool-{uid}"


def swap_pool_bytes(uid: int | None = None, shm: Path = Path("/dev/shm")) -> int:
    """Bytes of the node-wide pinned swap pool of user `uid` (default: this process's): the sizes
    of its segment files, 0 while there are none."""
    folder = shm / SWAP_POOL_DIR.format(uid=os.getuid() if uid is None else uid)
    total = 0
    for segment in folder.glob("segment-*"):
        try:
            total += segment.stat().st_size
        except FileNotFoundError:  # given back while we looked
            pass
    return total


def pinned_for_swapping(status: dict, pool_bytes: int = 0) -> int:
    """Pinned host memory held for swapping: every client's swap area on every device, as the
    status document shows it (`swap` -> `area`), plus `pool_bytes` (swap_pool_bytes()). An area
    whose `swap` entry says `pool` (true) takes its room from the pool and is not counted twice."""
    areas = 0
    for client in status.get("clients", []):
        for pair in client.get("devices", {}).values():
            swap = pair.get("swap") or {}
            if not swap.get("pool"):
                areas += int(swap.get("area") or 0)
    return areas + pool_bytes


def wait_for(predicate: Callable[[], Any], timeout: float = PATIENCE, what: str = "condition", interval: float = 0.02) -> Any:
    """Poll until `predicate()` is truthy and return its value; AssertionError after `timeout`,
    saying what it waited for and what it saw last."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}; last saw {value!r}")
        time.sleep(interval)


class SchedulerProcess:
    """One scheduler daemon (possibly restarted) serving one socket directory."""

    def __init__(self, socket_dir: Path, options: dict[str, Any], nvml: dict[str, str] | None = None) -> None:
        self.socket_dir = socket_dir
        self.paths = SocketPaths(socket_dir)
        self.options = options
        self.env = child_env(socket_dir)
        # With `nvml`, the simulated NVML the daemon measures the GPUs with (its environment is
        # the clients' plus that, as `env` is when it starts: a test may change `env` first).
        self.nvml = nvml or {}
        self.log_path = socket_dir / "scheduler.log"
        self.process: subprocess.Popen | None = None
        self._agents: list[ClientAgent] = []

    # --- life cycle ---

    def daemon_env(self) -> dict[str, str]:
        return {**self.env, **self.nvml}

    def command(self) -> list[str]:
        argv = [sys.executable, "-m", "nvshare_py.scheduler", "--socket-dir", str(self.socket_dir)]
        for name, value in self.options.items():
            argv += [f"--{name.replace('_', '-')}", str(value)]
        return argv

    def start(self, timeout: float = PATIENCE) -> "SchedulerProcess":
        assert self.process is None or self.process.poll() is not None, "already running"
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.command(), env=self.daemon_env(), cwd=CHILD_CWD, stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"nvshare-scheduler exited with {self.process.returncode}:\n{self.log_text()}")
            try:
                self.request("status", timeout=1.0)
                return self
            except Exception:
                if time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError(f"nvshare-scheduler not ready after {timeout:g} s:\n{self.log_text()}") from None
                time.sleep(0.05)

    @property
    def pid(self) -> int:
        if self.process is None:
            raise RuntimeError("the scheduler was never started")
        return self.process.pid

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout: float = PATIENCE) -> int | None:
        """SIGTERM and wait; returns the exit status (None if it was not running)."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                raise AssertionError(f"nvshare-scheduler ignored SIGTERM for {timeout:g} s")
        return self.process.returncode

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def restart(self, kill: bool = False) -> "SchedulerProcess":
        self.kill() if kill else self.stop()
        return self.start()

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    # --- control socket ---

    def request(self, op: str, timeout: float = 10.0, **fields: Any) -> Any:
        from nvshare_py.control import request

        return request(self.paths, op, timeout=timeout, **fields)

    def status(self) -> dict:
        return self.request("status")

    def events(self, since: int = 0) -> list[dict]:
        return self.events_since(since)[0]

    def events_since(self, since: int = 0) -> tuple[list[dict], int]:
        """The stored lock events from `since` on (asked a page at a time), and the number to ask
        from next."""
        from nvshare_py.control import ControlConnection

        with ControlConnection(self.paths, timeout=10.0) as connection:
            return connection.events_since(since)

    def ctl(self, *args: str, timeout: float = 60.0, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        return run_child([*nvsharectl_command(), *args], env or self.env, timeout)

    def run_to_exit(self, *extra_args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
        """Run this daemon's command line (plus `extra_args`) in the foreground, for tests of
        refused starts; the running daemon, if any, is not touched."""
        return run_child([*self.command(), *extra_args], self.env, timeout)

    # --- helpers on the status document ---

    def device(self, device: str) -> dict | None:
        return next((d for d in self.status()["devices"] if d["device"] == device), None)

    def holders(self, device: str) -> list[str]:
        found = self.device(device)
        return [h["client"] for h in found["holders"]] if found else []

    def waiters(self, device: str) -> list[str]:
        found = self.device(device)
        return [w["client"] for w in found["waiters"]] if found else []

    def clients(self) -> list[str]:
        return [c["client"] for c in self.status()["clients"]]

    # --- client processes ---

    def agent(self, env: dict[str, str] | None = None, connect: bool = True) -> "ClientAgent":
        # Named, or every agent would show as "python3".
        agent = ClientAgent({**self.env, "NVSHARE_PROGRAM": AGENT_PROGRAM, **(env or {})})
        self._agents.append(agent)
        if connect:
            agent.expect("ready")
        return agent

    def cleanup(self) -> None:
        for agent in self._agents:
            agent.kill()
        self.stop()


class ClientAgent:
    """A client process (nvshare_py/testing/agent.py) driven line by line; see the module doc."""

    def __init__(self, env: dict[str, str]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "nvshare_py.testing.agent"],
            env=env,
            cwd=CHILD_CWD,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )
        assert self.process.stdin is not None and self.process.stdout is not None  # both are pipes
        self._stdin, self._stdout = self.process.stdin, self.process.stdout
        self.lines: list[str] = []
        self._unread: queue.Queue[str | None] = queue.Queue()
        self.client_id = ""
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self._stdout:
            line = line.rstrip("\n")
            self.lines.append(line)
            self._unread.put(line)
        self._unread.put(None)

    @property
    def pid(self) -> int:
        return self.process.pid

    def send(self, command: str) -> None:
        self._stdin.write(command + "\n")
        self._stdin.flush()

    def expect(self, prefix: str, timeout: float = PATIENCE) -> str:
        """The next line starting with `prefix` (earlier other lines are skipped)."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            try:
                line = self._unread.get(timeout=max(0.0, remaining))
            except queue.Empty:
                raise AssertionError(f"agent {self.pid} did not print {prefix!r} within {timeout:g} s; output: {self.lines}") from None
            if line is None:
                raise AssertionError(f"agent {self.pid} exited ({self.process.poll()}) before printing {prefix!r}; output: {self.lines}")
            if line.startswith(prefix):
                if prefix == "ready":
                    self.client_id = line.split()[1]
                return line

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()

    def wait(self, timeout: float = PATIENCE) -> int:
        return self.process.wait(timeout)
