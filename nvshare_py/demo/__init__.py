"""`nvshare-demo`: a scheduler and two programs sharing one GPU, their lock timeline shown live,
and a summary checked from the scheduler's events.

    nvshare-demo [--duration 20] [--tq 3] [--simulated] [--no-live] [--json FILE] [--png FILE]

It starts `nvshare-scheduler` in a fresh temporary socket directory (time quantum `--tq`, idle
window 0.5 s) and two programs (nvshare_py.demo.worker) under libnvshare.so: a "training" job that
keeps the GPU busy and is handed off at the end of each quantum, and a "notebook" that runs a
short cell now and then and gives the GPU back early when it idles. It polls the scheduler's
control socket ten times a second and draws the timeline (nvshare_py.timeline), then prints a
summary and checks, from the events, that the two never held the GPU at the same time (and, on
the simulated driver, from its trace, that their kernels never ran at the same time).

GPU: the real driver (libcuda.so.1) is asked for device 0. Without one, or with `--simulated`,
the programs run on the simulated driver shipped in the package (nvshare_py/_lib/simcuda;
NVSHARE_SIMCUDA_DIR names another build), and every output says so. Each program allocates
4 MiB.

Exit status: 0 all checks passed; 1 a check failed, a program crashed, something did not start
or --json/--png could not be written (the logs are kept and their directory named); 2 usage
error or a missing part of the installation; 130 interrupted (every process the demo started is
stopped).

(Some 700 lines: one command from start to exit status: finding a GPU, starting the scheduler
and the two programs, the live view, the checks and the report. Every part works on the one
`Demo` and its working directory; the drawing is nvshare_py.timeline's, the programs are
worker.py.)
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, Optional

import typer
from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from .. import library, timeline as tl
from ..clikit import APP_SETTINGS, TQ_MIN, VERSION_OPTION, number_between, tolerate_narrow_encoding
from ..control import ControlConnection, ControlFailure
from ..paths import ENV_SOCKET_DIR, SocketPaths
from ..run import SIMULATED_DRIVER_DIR, with_preload
from .worker import die_with_parent

ENV_SIMULATOR = "NVSHARE_SIMCUDA_DIR"
SIMULATED_NAME = "nvshare simulated GPU"
# The directory holding this nvshare_py: put first on the children's PYTHONPATH so that they
# import the same one (a source tree or an installed copy), wherever the demo was started from.
PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])

IDLE_RELEASE = 0.5  # seconds: the notebook's early release shows within a second
GRACE = 2.0
POLL_INTERVAL = 0.1
START_TIMEOUT = 30.0  # scheduler start, GPU probe, a program's first step (a loaded machine)
FINISH_MARGIN = 30.0  # past the end of the run, before the programs count as hung
FREE_MEMORY_NEEDED = 1 << 30  # two CUDA contexts and 8 MiB of buffers, with room to spare
ROLES = ("training", "notebook")

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class DemoFailure(Exception):
    def __init__(self, message: str, exit_code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.exit_code = exit_code


# --- which GPU -------------------------------------------------------------------------------


@dataclass(frozen=True)
class DemoGpu:
    """The GPU the demo's programs share: device 0 of the real driver, or the simulated one
    (and why) where there is none."""

    uuid: str
    name: str
    total: int
    free: int
    simulated_because: str = ""  # empty on a real GPU
    simulator: Path | None = None  # put first on LD_LIBRARY_PATH of the programs
    real_driver_said: str = ""  # why the real driver was not used, when it was asked

    @property
    def simulated(self) -> bool:
        return bool(self.simulated_because)

    @property
    def label(self) -> str:
        if self.simulated:
            return f"SIMULATED GPU ({self.simulated_because})"
        return f"{self.name} ({self.uuid})"


def simulator_dir() -> Path:
    """The simulated driver's directory: $NVSHARE_SIMCUDA_DIR, else the packaged build."""
    chosen = Path(os.environ.get(ENV_SIMULATOR) or SIMULATED_DRIVER_DIR)
    if not (chosen / "libcuda.so.1").is_file():
        where = f"{ENV_SIMULATOR}={chosen}" if os.environ.get(ENV_SIMULATOR) else str(chosen)
        raise DemoFailure(
            f"the simulated CUDA driver is not at {where}: install nvshare-py with pip (which builds it), or "
            f"build it with `make -C tests/simcuda BUILD=<dir>` and set {ENV_SIMULATOR}=<dir>",
            EXIT_USAGE,
        )
    return chosen


def base_env() -> dict[str, str]:
    """The environment of every child: this nvshare_py importable, no nvshare settings of the
    caller's that would change what the demo shows."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_PARENT, env.get("PYTHONPATH", "")) if p)
    for name in ("NVSHARE_IDLE_RELEASE_MS", "NVSHARE_FAIL_MODE", "NVSHARE_MANAGED", ENV_SOCKET_DIR):
        env.pop(name, None)
    return env


def simulator_env(env: dict[str, str], simulator: Path) -> dict[str, str]:
    env = dict(env)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(simulator), env.get("LD_LIBRARY_PATH", "")) if p)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.pop("SIMCUDA_DEVICES", None)
    return env


def _probe(env: dict[str, str]) -> tuple[dict | None, str]:
    """Device 0 as a fresh process without the interceptor sees it, or (None, why not)."""
    try:
        result = subprocess.run([sys.executable, "-m", "nvshare_py.demo.worker", "probe"], env=env, cwd="/",
                                capture_output=True, text=True, timeout=START_TIMEOUT)
    except subprocess.TimeoutExpired:
        return None, f"the CUDA driver did not answer within {START_TIMEOUT:g} s"
    if result.returncode != 0:
        lines = result.stderr.strip().splitlines()
        return None, lines[-1] if lines else f"the probe exited with status {result.returncode}"
    return json.loads(result.stdout.splitlines()[-1]), ""


def find_gpu(force_simulated: bool) -> DemoGpu:
    env = base_env()
    real_driver_said = ""
    if not force_simulated:
        found, real_driver_said = _probe(env)
        if found is not None:
            if found["name"] == SIMULATED_NAME:
                return DemoGpu(found["uuid"], found["name"], found["total"], found["free"],
                           simulated_because="the simulated driver is on LD_LIBRARY_PATH")
            if found["free"] < FREE_MEMORY_NEEDED:
                raise DemoFailure(f"{found['name']} has only {found['free'] >> 20} MiB free; the demo needs about "
                                  f"{FREE_MEMORY_NEEDED >> 20} MiB (two CUDA contexts and 8 MiB of buffers)")
            return DemoGpu(found["uuid"], found["name"], found["total"], found["free"])
    simulator = simulator_dir()
    found, why = _probe(simulator_env(env, simulator))
    if found is None:
        raise DemoFailure(f"the simulated CUDA driver in {simulator} does not work: {why}")
    because = "--simulated given" if force_simulated else "no NVIDIA GPU found"
    return DemoGpu(found["uuid"], found["name"], found["total"], found["free"], because, simulator, real_driver_said)


# --- processes -------------------------------------------------------------------------------


@dataclass
class Program:
    """One demo program (nvshare_py.demo.worker) and what it reported so far."""

    role: str
    process: subprocess.Popen
    stdout: Path
    stderr: Path
    records: list[dict] = field(default_factory=list)
    _offset: int = 0

    @property
    def pid(self) -> int:
        return self.process.pid

    def read_progress(self) -> list[dict]:
        """Records printed since the last call (complete lines only)."""
        with open(self.stdout, "rb") as stream:
            stream.seek(self._offset)
            data = stream.read()
        complete = data[: data.rfind(b"\n") + 1]
        self._offset += len(complete)
        fresh = [json.loads(line) for line in complete.decode().splitlines() if line.strip()]
        self.records.extend(fresh)
        return fresh

    def last(self, event: str) -> dict | None:
        return next((r for r in reversed(self.records) if r["event"] == event), None)

    def stderr_tail(self, lines: int = 15) -> str:
        return "\n".join(self.stderr.read_text(errors="replace").splitlines()[-lines:])


def _stop(process: subprocess.Popen, timeout: float) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class Demo:
    """The scheduler, the programs and their working directory (sockets, logs, trace)."""

    def __init__(self, gpu: DemoGpu, duration: float, tq: float) -> None:
        self.gpu = gpu
        self.duration = duration
        self.tq = tq
        self.workdir = Path(tempfile.mkdtemp(prefix="nvs-demo-", dir="/tmp"))
        self.paths = SocketPaths(self.workdir)
        self.trace = self.workdir / "simcuda-trace.jsonl"
        self.scheduler: subprocess.Popen | None = None
        self.control: ControlConnection | None = None
        self.programs: dict[str, Program] = {}
        self.events: list[dict] = []
        self.roles: dict[str, str] = {}  # client id -> role, from the programs' registrations
        self.status: dict = {}
        self.next_seq = 0
        self.started = 0.0  # wall clock, once the scheduler answers
        self.until = 0.0

    # --- start and stop ---

    def start_scheduler(self) -> None:
        command = [sys.executable, "-m", "nvshare_py.scheduler", "--socket-dir", str(self.paths.root),
                   "--tq", f"{self.tq:g}", "--idle-release", f"{IDLE_RELEASE:g}", "--grace", f"{GRACE:g}",
                   "--log-level", "info"]
        # preexec_fn is safe here: the demo has no other thread when it starts the scheduler.
        with open(self.workdir / "scheduler.log", "wb") as log:
            self.scheduler = subprocess.Popen(command, env=base_env(), cwd="/", stdout=log, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, start_new_session=True,
                                              preexec_fn=functools.partial(die_with_parent, os.getpid()))
        deadline = time.monotonic() + START_TIMEOUT
        while self.control is None:
            if self.scheduler.poll() is not None:
                raise DemoFailure(f"nvshare-scheduler exited with status {self.scheduler.returncode}:\n"
                                  f"{self.log_tail('scheduler.log')}")
            try:
                connection = ControlConnection(self.paths, timeout=5.0)
            except ControlFailure:
                connection = None
            if connection is not None:
                try:
                    self.status = connection.request("status")
                    self.control = connection
                    break
                except ControlFailure:
                    connection.close()
            if time.monotonic() > deadline:
                raise DemoFailure(f"nvshare-scheduler did not answer within {START_TIMEOUT:g} s:\n"
                                  f"{self.log_tail('scheduler.log')}")
            time.sleep(0.05)
        self.started = time.time()
        self.until = self.started + self.duration

    def start_program(self, role: str) -> Program:
        env = base_env()
        env[ENV_SOCKET_DIR] = str(self.paths.root)
        env["LD_PRELOAD"] = with_preload(env.get("LD_PRELOAD"), library.path())
        if self.gpu.simulator is not None:
            env = simulator_env(env, self.gpu.simulator)
        if self.gpu.simulated:
            env["SIMCUDA_TRACE"] = str(self.trace)
        stdout, stderr = self.workdir / f"{role}.out", self.workdir / f"{role}.err"
        command = [sys.executable, "-m", "nvshare_py.demo.worker", role, "--until", f"{self.until:.3f}",
                   "--tq", f"{self.tq:g}", "--parent", str(os.getpid())]
        with open(stdout, "wb") as out, open(stderr, "wb") as err:
            process = subprocess.Popen(command, env=env, cwd="/", stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                       start_new_session=True)
        program = self.programs[role] = Program(role, process, stdout, stderr)
        return program

    def stop(self) -> None:
        """Every process the demo started, programs first, then the scheduler (clean shutdown)."""
        for program in self.programs.values():
            _stop(program.process, 3.0)
        if self.control is not None:
            self.control.close()
            self.control = None
        if self.scheduler is not None:
            _stop(self.scheduler, 5.0)

    @property
    def roles_by_pid(self) -> dict[int, str]:
        return {program.pid: role for role, program in self.programs.items()}

    def finished(self) -> bool:
        """Whether both programs were started and have exited."""
        return len(self.programs) == len(ROLES) and all(p.process.poll() is not None for p in self.programs.values())

    def remove_workdir(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)

    def log_tail(self, name: str, lines: int = 20) -> str:
        path = self.workdir / name
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    # --- observing ---

    def poll(self) -> list[dict]:
        """New lock events (also kept in self.events) and a fresh status document."""
        assert self.control is not None, "poll() before start()"
        fresh, self.next_seq = self.control.events_since(self.next_seq)
        self.events.extend(fresh)
        roles = self.roles_by_pid
        for event in fresh:
            if event["kind"] == "register" and tl.registered_pid(event) in roles:
                self.roles[event["client"]] = roles[tl.registered_pid(event)]
        self.status = self.control.request("status")
        return fresh

    def name(self, client: str) -> str:
        return self.roles.get(client, client)

    def timeline(self, now: float | None = None) -> tl.Timeline:
        now = time.time() if now is None else now
        whole = tl.Timeline.from_events(self.events, now=now)
        whole.labels.update(self.roles)
        if self.gpu.uuid in whole.devices():
            whole = whole.only_device(self.gpu.uuid)
        return whole.window(self.started, max(now, self.started))

    def programs_gone_from_scheduler(self) -> bool:
        """Whether the scheduler has removed every program's registration (their last events)."""
        pids = {program.pid for program in self.programs.values()}
        return not any(client.get("pid") in pids for client in self.status.get("clients", []))


# --- the run ---------------------------------------------------------------------------------


def run_demo(demo: Demo, output: LiveOutput | LogOutput) -> None:
    """Start everything and follow it until both programs have finished."""
    demo.start_scheduler()
    training = demo.start_program("training")
    deadline = demo.until + FINISH_MARGIN
    while True:
        records = [(p.role, record) for p in demo.programs.values() for record in p.read_progress()]
        # The notebook starts once the training works on the GPU, so that it has to wait for it.
        if "notebook" not in demo.programs and (training.records or time.time() > demo.started + START_TIMEOUT):
            if not training.records:
                raise DemoFailure(f"the training program did no GPU work within {START_TIMEOUT:g} s:\n"
                                  f"{training.stderr_tail()}")
            demo.start_program("notebook")
        output.show(demo, demo.poll(), records)
        crashed = [p for p in demo.programs.values() if p.process.poll() not in (None, 0)]
        if crashed:
            program = crashed[0]
            raise DemoFailure(f"the {program.role} program failed ({_how_it_ended(program.process.returncode)}):\n"
                              f"{program.stderr_tail()}")
        if demo.finished():  # each with status 0: a failed one was raised above
            break
        if time.time() > deadline:
            raise DemoFailure(f"the programs did not finish within {FINISH_MARGIN:g} s of the end of the run")
        time.sleep(POLL_INTERVAL)
    # Their exits reach the scheduler through pidfds at once; give it a moment on a busy machine.
    settle = time.monotonic() + 5.0
    while not demo.programs_gone_from_scheduler() and time.monotonic() < settle:
        time.sleep(POLL_INTERVAL)
        output.show(demo, demo.poll(), [])
    output.show(demo, [], [(program.role, record) for program in demo.programs.values()
                           for record in program.read_progress()])


def _how_it_ended(returncode: int) -> str:
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exit status {returncode}"


class LiveOutput:
    """The timeline redrawn in place on a terminal, with the current holder and queue."""

    def __init__(self, console: Console) -> None:
        self.live = Live(console=console, auto_refresh=False, transient=False)

    def __enter__(self) -> LiveOutput:
        self.live.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.live.stop()

    def show(self, demo: Demo, events: list[dict], records: list[tuple[str, dict]]) -> None:
        self.live.update(self.view(demo), refresh=True)

    def view(self, demo: Demo) -> Group:
        now = time.time()
        parts: list[Any] = [
            _banner(demo.gpu, why=True),
            Text(f"scheduler: mode on, TQ {demo.tq:g} s, idle release {IDLE_RELEASE:g} s   "
                 f"{min(now, demo.until) - demo.started:4.1f} s of {demo.duration:g} s", style="dim"),
            AtConsoleWidth(demo.timeline(now)),
        ]
        if not demo.finished():
            parts.append(_now_line(demo))
        parts.append(_progress_line(demo))
        return Group(*parts)


class LogOutput:
    """--no-live (and output that is not a terminal): one line per lock event and per notebook
    cell, in time order; the timeline is drawn once at the end."""

    def __init__(self, console: Console) -> None:
        self.console = console

    def __enter__(self) -> LogOutput:
        return self

    def __exit__(self, *exc_info) -> None:
        pass

    def show(self, demo: Demo, events: list[dict], records: list[tuple[str, dict]]) -> None:
        lines = [(event["t"], *_narration(demo, event)) for event in events
                 if not event.get("device") or event["device"] == demo.gpu.uuid]
        lines += [(record["t"], role, f"ran cell {record['n']} ({record['gpu_s'] / record['n']:.1f} s of GPU work) "
                                      f"in {record['took']:.1f} s")
                  for role, record in records if record["event"] == "cell"]
        for t, who, text in sorted(lines, key=lambda line: line[0]):
            self.console.print(f"{t - demo.started:7.2f} s  {who:<9} {text}", soft_wrap=True)


def _narration(demo: Demo, event: dict) -> tuple[str, str]:
    """Who, and what happened, in words."""
    kind, detail, client = event["kind"], event.get("detail") or "", event.get("client") or ""
    texts = {
        "register": f"connects to the scheduler as client {client}",
        "acquire": "asks for the GPU",
        "grant": f"gets the GPU (grant {event.get('grant')})",
        "drop": (f"is asked to hand the GPU over: its {demo.tq:g} s quantum is up and the other program waits"
                 if detail == "quantum" else f"is asked to hand the GPU over ({detail})"),
        "release": {"idle": f"gives the GPU back early: idle for {IDLE_RELEASE:g} s",
                    "drop": "hands the GPU over",
                    "quantum": "hands the GPU over as its time quantum ends (drained ahead)"}.get(
                        detail, f"releases the GPU ({detail})"),
        "revoke": f"is REVOKED: it did not release the GPU within the {GRACE:g} s grace period",
        "lost": f"is gone ({detail})" + (", so it loses the GPU" if event.get("grant") else ""),
        "unregister": f"leaves the scheduler ({detail})",
    }
    return demo.name(client) if client else "scheduler", texts.get(kind, f"{kind} {detail}".strip())


class AtConsoleWidth:
    """A timeline drawn at the width of whatever it is printed on (a resized terminal too)."""

    def __init__(self, timeline: tl.Timeline) -> None:
        self.timeline = timeline

    def __rich_console__(self, console, options):
        yield tl.render(self.timeline, width=options.max_width)


def _banner(gpu: DemoGpu, why: bool = False) -> Text:
    if gpu.simulated:
        banner = Text(f" nvshare demo on a {gpu.label} ", style="bold black on yellow", no_wrap=True,
                      overflow="ellipsis")
        if why and gpu.real_driver_said:
            # Its first sentence, what went wrong: the driver's advice on installing one or on
            # using the simulated driver does not apply to a demo that already does.
            said = gpu.real_driver_said.split(". ")[0].rstrip(".")
            banner.append(f"\n real driver: {said}", style="dim")
        return banner
    return Text(f" nvshare demo on {gpu.label} ", style="bold white on green")


def _now_line(demo: Demo) -> Text:
    device = next((d for d in demo.status.get("devices", []) if d["device"] == demo.gpu.uuid), None)
    if device is None:
        return Text("now: no program has used the GPU yet")
    holders = [f"{demo.name(h['client'])} holds the GPU ({h['state']}, "
               f"{max(0.0, h['quantum_left']):.1f} s of its quantum left)" for h in device.get("holders", [])]
    waiters = [demo.name(w["client"]) for w in device.get("waiters", [])]
    text = "; ".join(holders) or "nobody holds the GPU"
    return Text(f"now: {text}; waiting: {', '.join(waiters) or 'nobody'}")


def counted(n: int, noun: str) -> str:
    """"1 cell", "2 cells"."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _progress_line(demo: Demo) -> Text:
    parts = []
    for role in ROLES:
        program = demo.programs.get(role)
        if program is None:
            parts.append(f"{role}: not started yet")
            continue
        unit = "step" if role == "training" else "cell"
        latest = program.last(unit)
        done = program.last("done")
        if latest is None:
            parts.append(f"{role}: 0 {unit}s")
        else:
            parts.append(f"{role}: {counted(latest['n'], unit)} ({latest['gpu_s']:.1f} s of GPU work)")
        if done is not None:
            parts[-1] += ", finished" + ("" if done["verified"] else " (WRONG RESULT)")
    return Text("   ".join(parts))


# --- checks and report -----------------------------------------------------------------------


@dataclass
class Check:
    name: str
    text: str
    ok: bool
    required: bool = True  # a failed required check fails the demo; others are notes

    def to_json(self) -> dict:
        return {"name": self.name, "text": self.text, "ok": self.ok, "required": self.required}


def kernel_overlaps(trace: Path, roles: dict[int, str]) -> tuple[int, list[tuple[dict, dict]]]:
    """From the simulated driver's trace: how many kernels the programs ran, and pairs of two
    programs' kernels that ran at the same time."""
    kernels = []
    if trace.exists():
        for line in trace.read_text().splitlines():
            op = json.loads(line)
            if op.get("op") == "kernel" and op.get("pid") in roles:
                kernels.append(op)
    kernels.sort(key=lambda op: op["start"])
    overlapping = []
    for index, first in enumerate(kernels):
        for second in kernels[index + 1:]:
            if second["start"] >= first["end"]:
                break
            if second["pid"] != first["pid"]:
                overlapping.append((first, second))
    return len(kernels), overlapping


def checks(demo: Demo, timeline: tl.Timeline) -> list[Check]:
    found = []
    wrong = [p.role for p in demo.programs.values() if (p.last("done") or {}).get("verified") is not True]
    found.append(Check("finished", f"{' and '.join(wrong)} did not finish with the right result" if wrong
                       else "both programs finished, and their results read back right", not wrong))

    summary = {row.row: row for row in tl.summarise(timeline)}
    held = [role for role in ROLES if role in summary and summary[role].holds > 0]
    found.append(Check("both-held", "both programs held the GPU" if len(held) == len(ROLES)
                       else f"only {', '.join(held) or 'neither program'} held the GPU", len(held) == len(ROLES)))

    overlaps = timeline.overlapping_holds()
    if overlaps:
        first, second = overlaps[0]
        found.append(Check("exclusive", f"{timeline.label(first.client)} and {timeline.label(second.client)} held "
                                        f"the GPU at the same time, from {second.start - timeline.start:.2f} s on",
                           False))
    else:
        grants = sum(row.holds for row in summary.values())
        found.append(Check("exclusive", f"the two programs never held the GPU at the same time "
                                        f"({grants} grants checked)", True))

    if demo.gpu.simulated:
        roles = demo.roles_by_pid
        count, overlapping = kernel_overlaps(demo.trace, roles)
        if overlapping:
            kernel, other = overlapping[0]
            text = f"the simulated GPU ran kernels of {roles[kernel['pid']]} and {roles[other['pid']]} at once"
        else:
            text = f"the simulated GPU never ran their kernels at the same time ({count} kernels)"
        found.append(Check("kernels-apart", text, count > 0 and not overlapping))

    handoffs = sum(row.tq_handoffs for row in summary.values())
    early = sum(row.early_releases for row in summary.values())
    found.append(Check("handoffs", f"{handoffs} TQ handoff{'s' * (handoffs != 1)} and {early} early "
                                   f"release{'s' * (early != 1)}"
                                   + ("" if handoffs and early else " (a longer --duration shows both)"),
                       bool(handoffs and early), required=False))
    revoked = sum(row.revoked for row in summary.values())
    if revoked:
        found.append(Check("revoked", f"{revoked} grant{'s' * (revoked != 1)} revoked: a drain took longer than the "
                                      f"{GRACE:g} s grace period (a very busy machine?)", False, required=False))
    return found


def report(demo: Demo, console: Console, live: bool, json_path: Path | None, png_path: Path | None) -> bool:
    """Summary table and checks; the JSON and PNG files. Returns whether every required check
    passed."""
    timeline = demo.timeline(demo.events[-1]["t"] if demo.events else time.time())
    if not live:  # the banner was printed at the start
        console.print()
        console.print(AtConsoleWidth(timeline))
    console.print()
    console.print(tl.summary_table(tl.summarise(timeline), title=f"Summary — {demo.gpu.label}"))
    found = checks(demo, timeline)
    for check in found:
        mark, style = ("✔", "green") if check.ok else ("✘", "bold red") if check.required else ("!", "yellow")
        console.print(Text(f"{mark} {check.text}", style=style))
    ok = all(check.ok for check in found if check.required)
    try:
        if json_path is not None:
            tl.write_json(json_path, {
                "ok": ok,
                "gpu": {"uuid": demo.gpu.uuid, "name": demo.gpu.name, "total": demo.gpu.total,
                        "simulated": demo.gpu.simulated, "label": demo.gpu.label},
                "settings": {"duration": demo.duration, "tq": demo.tq, "idle_release": IDLE_RELEASE, "grace": GRACE},
                "programs": {role: {"pid": p.pid, "exit_status": p.process.returncode, "done": p.last("done"),
                                    "clients": sorted(c for c, row in demo.roles.items() if row == role)}
                             for role, p in demo.programs.items()},
                "checks": [check.to_json() for check in found],
                "timeline": tl.to_json(timeline),
                "events": demo.events,
            })
            console.print(f"wrote {json_path}")
        if png_path is not None:
            tl.write_png(png_path, timeline, title=f"nvshare demo on {demo.gpu.label}")
            console.print(f"wrote {png_path}")
    except OSError as error:
        raise DemoFailure(f"cannot write {error.filename}: {error.strerror}") from None
    return ok


# --- command line ----------------------------------------------------------------------------

app = typer.Typer(**APP_SETTINGS)


def _interrupted(signum, frame) -> None:
    raise KeyboardInterrupt  # SIGTERM cleans up as Ctrl-C does


@app.command()
def demo(
    duration: float = typer.Option(20.0, parser=number_between(1, 3600), help="Seconds the two programs run"),
    tq: float = typer.Option(3.0, parser=number_between(TQ_MIN, 600), help="The scheduler's time quantum, seconds"),
    simulated: bool = typer.Option(False, "--simulated", help="Use the simulated driver even where there is a GPU"),
    live: bool = typer.Option(True, "--live/--no-live", help="Redraw the timeline in place (on a terminal), or "
                              "print one line per event (for logs and CI)"),
    json_path: Optional[Path] = typer.Option(None, "--json", metavar="FILE",
                                             help="Write the summary, checks, intervals and events as JSON"),
    png_path: Optional[Path] = typer.Option(None, "--png", metavar="FILE",
                                            help="Draw the timeline into a PNG (needs matplotlib)"),
    version: bool = VERSION_OPTION,
) -> None:
    """Run a scheduler and two programs that share one GPU, and show who holds it when."""
    tolerate_narrow_encoding("nvshare-demo")
    console = Console(highlight=False, width=None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 100)
    if png_path is not None and importlib.util.find_spec("matplotlib") is None:
        _exit(f"--png needs matplotlib: {tl.PLOT_EXTRA_HINT}", EXIT_USAGE)
    try:
        library.path()
    except library.LibraryNotFound as error:
        _exit(str(error), EXIT_USAGE)
    live = live and console.is_terminal
    signal.signal(signal.SIGTERM, _interrupted)
    running: Demo | None = None
    try:
        gpu = find_gpu(simulated)
        running = Demo(gpu, duration, tq)
        if not live:  # the live view shows the banner at its top
            console.print(_banner(gpu, why=True))
            console.print(f"scheduler: mode on, TQ {tq:g} s, idle release {IDLE_RELEASE:g} s; two programs for "
                          f"{duration:g} s (training keeps the GPU busy; notebook runs a short cell now and then)")
        with LiveOutput(console) if live else LogOutput(console) as output:
            run_demo(running, output)
        running.stop()
        if not report(running, console, live, json_path, png_path):
            _exit(f"a check failed (logs kept in {running.workdir})", EXIT_FAILED)
        running.remove_workdir()
    except DemoFailure as failure:
        kept = f"\n(logs kept in {running.workdir})" if running is not None else ""
        _exit(f"{failure}{kept}", failure.exit_code)
    except ControlFailure as failure:
        assert running is not None  # only a started demo talks to the scheduler
        _exit(f"lost the scheduler: {failure}\n{running.log_tail('scheduler.log')}\n"
              f"(logs kept in {running.workdir})", EXIT_FAILED)
    except KeyboardInterrupt:
        if running is not None:
            running.stop()
            running.remove_workdir()
        _exit("interrupted; every process the demo started has been stopped", EXIT_INTERRUPTED)
    finally:
        if running is not None:
            running.stop()  # however it ended, no process of the demo's outlives it


def _exit(message: str, code: int) -> NoReturn:
    typer.echo(f"nvshare-demo: {message}", err=True)
    raise typer.Exit(code)


def main() -> None:
    app(prog_name="nvshare-demo")

