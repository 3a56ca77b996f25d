"""nvsharectl as operators run it: a separate process against the real daemon."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from nvshare_py.paths import ENV_SOCKET_DIR, ENV_SYSTEM_SOCKET_DIR, connect_error
from nvshare_py.scheduler.views import user_name
from nvshare_py.testing.scheduler import CHILD_CWD, PATIENCE, child_env, nvsharectl_command, run_child, short_socket_dir, wait_for

GPU = "GPU-5151ad00-0000-4000-8000-000000000000"


@pytest.fixture
def busy(scheduler_factory):
    """A scheduler with one holder and one waiter on GPU, which stay so: the quantum (10 min)
    does not run out during a test however slow the machine."""
    scheduler = scheduler_factory(tq=600, gpus=1)  # the daemon measures the simulated 16 GiB GPU
    holder, waiter = scheduler.agent(), scheduler.agent()
    holder.send(f"announce {GPU} 17179869184 simulated GPU")
    holder.send(f"memory {GPU} 1073741824")
    holder.send(f"acquire {GPU}")
    holder.expect(f"granted {GPU}")
    waiter.send(f"acquire {GPU}")
    wait_for(lambda: scheduler.waiters(GPU) == [waiter.client_id], what="the waiter")
    return scheduler, holder, waiter


def test_status_table(busy):
    scheduler, holder, waiter = busy
    result = scheduler.ctl("status")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "GPU0" in out and GPU not in out  # the short name; the UUID only with -o wide
    user = user_name(os.geteuid())
    assert f"held by {holder.client_id} {user} (" in out  # with its quantum left, as someone waits
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split() and line.split()[0] in
            (holder.client_id, waiter.client_id)}
    assert rows[holder.client_id][1:5] == [user, "agent.py", str(holder.pid), "holding"]
    assert rows[waiter.client_id][1:5] == [user, "agent.py", str(waiter.pid), "waiting"]
    assert "1.0 GiB of 16.0 GiB" in out

    for wide in (scheduler.ctl("status", "--wide"), scheduler.ctl("status", "-o", "wide")):
        assert wide.returncode == 0, wide.stderr
        assert GPU in wide.stdout and "simulated GPU" in wide.stdout
        assert f"{holder.client_id} #" in wide.stdout  # holder with its grant


def on_a_terminal(argv: list[str], env: dict[str, str], columns: int = 80, rows: int = 24,
                  until=lambda text: False) -> str:
    """What `argv` draws on a terminal of columns x rows (a pty of that size): everything it
    wrote until it exits, or, with `until`, until that holds of the text (then Ctrl-C)."""
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    child = subprocess.Popen(argv, env={**env, "TERM": "xterm"}, cwd=CHILD_CWD, stdin=terminal, stdout=terminal,
                             stderr=terminal, start_new_session=True)
    os.close(terminal)
    seen = b""
    deadline = time.monotonic() + PATIENCE
    try:
        while not until(seen.decode(errors="replace")):
            assert time.monotonic() < deadline, f"{argv} drew only: {seen!r}"
            if select.select([controller], [], [], 1.0)[0]:
                try:
                    chunk = os.read(controller, 65536)
                except OSError:  # the child exited and closed the terminal
                    break
                if not chunk:
                    break
                seen += chunk
    finally:
        if child.poll() is None:
            child.send_signal(signal.SIGINT)
        child.wait(PATIENCE)
        os.close(controller)
    return seen.decode(errors="replace")


def screen_lines(text: str) -> list[str]:
    """The lines of a drawing, terminal control sequences taken out."""
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\r", "", text)
    return plain.split("\n")


def test_status_fits_an_80x24_terminal_and_watch_shows_the_holders_first(busy):
    scheduler, holder, waiter = busy
    idle = [scheduler.agent(env={"NVSHARE_PROGRAM": f"notebook-{n}.ipynb"}) for n in range(3)]
    for agent in idle:
        agent.send(f"announce {GPU} 17179869184 simulated GPU")
    wait_for(lambda: len(scheduler.clients()) == 5, what="five clients")
    lines = [line for line in screen_lines(on_a_terminal([*nvsharectl_command(), "status"], scheduler.env))
             if line.strip()]
    assert max(len(line) for line in lines) <= 80 and len(lines) <= 24, "\n".join(lines)
    text = "\n".join(lines)
    assert "…" not in text  # nothing cut short
    words = re.findall(r"[^\s,:;()]+", text)
    for whole in (holder.client_id, waiter.client_id, str(holder.pid), str(waiter.pid), "holding", "waiting", "GPU0",
                  str(scheduler.socket_dir), "notebook-2.ipynb"):
        assert whole in words, (whole, text)

    # --watch on a terminal of 8 lines: the holder and the waiter first, idle clients left out.
    drawn = on_a_terminal([*nvsharectl_command(), "status", "--watch", "--interval", "0.2"], scheduler.env, rows=8,
                          until=lambda text: text.count("GPU0  ") >= 2)
    first = screen_lines(drawn)[:7]  # the first drawing: it leaves the terminal's last line free
    assert first[1].startswith("GPU0  ") and "…" in first[-1], first
    order = [line.split()[0] for line in first if line.split()[0].startswith("c")]
    assert order[:2] == [holder.client_id, waiter.client_id], first
    assert any("idle client rows" in line for line in first), first


def test_status_says_no_clients(scheduler):
    result = scheduler.ctl("status")
    assert result.returncode == 0, result.stderr
    assert "no clients" in result.stdout and "Clients" not in result.stdout


def test_a_device_by_its_short_name(busy):
    scheduler, holder, waiter = busy
    assert scheduler.ctl("set-tq", "7", "--device", "GPU0").returncode == 0
    assert scheduler.device(GPU)["tq"] == 7
    result = scheduler.ctl("set-tq", "7", "--device", "GPU9")
    assert result.returncode == 1 and "no device GPU9" in result.stderr and "GPU0" in result.stderr


def test_a_gpu_no_program_has_used_yet_can_be_given_a_budget(scheduler, simcuda):
    """At boot, before any program: by UUID anywhere, by GPU<n> where NVML numbers the GPUs."""
    second = GPU[:-1] + "1"
    with_nvml = dict(scheduler.env, LD_LIBRARY_PATH=simcuda.env(devices=2)["LD_LIBRARY_PATH"], SIMCUDA_DEVICES="2")
    by_index = scheduler.ctl("set-budget", "4G", "--device", "GPU1", env=with_nvml)
    assert by_index.returncode == 0, by_index.stderr
    assert scheduler.device(second)["budget"] == 4 << 30
    by_uuid = scheduler.ctl("set-budget", "2G", "--device", GPU)
    assert by_uuid.returncode == 0, by_uuid.stderr
    assert scheduler.device(GPU)["budget"] == 2 << 30 and scheduler.device(GPU)["total"] == 0
    typo = scheduler.ctl("set-budget", "1G", "--device", "GPU-nobody")
    assert typo.returncode == 1 and "GPU UUID" in typo.stderr
    unknown_index = scheduler.ctl("set-budget", "1G", "--device", "GPU7", env=with_nvml)
    assert unknown_index.returncode == 1 and "nvidia-smi -L" in unknown_index.stderr


def test_absurd_settings_are_refused_with_the_allowed_range(busy):
    scheduler, holder, waiter = busy
    for value in ("1e12", "0.001"):
        result = scheduler.ctl("set-tq", value)
        assert result.returncode == 2, result.stderr
        assert "from 0.1 to 86400" in result.stderr, result.stderr
    result = scheduler.ctl("set-tq", "soon")
    assert result.returncode == 2 and "'soon' is not a number" in result.stderr
    assert "Input should be" not in result.stderr  # our words, not the parsing library's
    assert scheduler.device(GPU)["tq"] == 600  # unchanged

    result = scheduler.ctl("set-budget", "1T", "--device", GPU)  # the device has 16 GiB
    assert result.returncode == 2, result.stderr
    assert "more than the 16.0 GiB" in result.stderr
    assert scheduler.device(GPU)["budget"] == 16 << 30


def test_the_original_nvshare_spelling_works_and_says_the_new_one(busy):
    scheduler, holder, waiter = busy
    result = scheduler.ctl("-T", "9")
    assert result.returncode == 0, result.stderr
    assert "nvsharectl set-tq 9" in result.stderr
    assert scheduler.device(GPU)["tq"] == 9
    result = scheduler.ctl("-S", "off")
    assert result.returncode == 0, result.stderr
    assert "nvsharectl off" in result.stderr
    assert scheduler.device(GPU)["mode"] == "off"


def test_timeline_json_dash_writes_stdout(busy, tmp_path):
    scheduler, holder, waiter = busy
    result = subprocess.run([*nvsharectl_command(), "timeline", "--json", "-"], env=scheduler.env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)  # the JSON alone
    assert any(e["kind"] == "grant" for e in document["events"])
    assert not (tmp_path / "-").exists()


def test_timeline_in_an_ascii_terminal_is_one_warning_not_a_traceback(busy):
    scheduler, holder, waiter = busy
    result = scheduler.ctl("timeline", env={**scheduler.env, "PYTHONIOENCODING": "ascii"})
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    (warning,) = result.stderr.splitlines()
    assert "encoding (ascii)" in warning and "PYTHONIOENCODING=utf-8" in warning
    assert holder.client_id in result.stdout


def test_status_json(busy):
    scheduler, holder, waiter = busy
    result = scheduler.ctl("status", "--json")
    assert result.returncode == 0
    status = json.loads(result.stdout)
    (device,) = status["devices"]
    assert [h["client"] for h in device["holders"]] == [holder.client_id]
    assert [w["client"] for w in device["waiters"]] == [waiter.client_id]
    assert status["scheduler"]["pid"] == scheduler.pid


def test_settings_commands(busy):
    scheduler, holder, waiter = busy
    result = scheduler.ctl("set-tq", "12.5")
    assert result.returncode == 0 and "12.5 s" in result.stdout
    assert scheduler.device(GPU)["tq"] == 12.5
    assert scheduler.ctl("set-tq", "4", "--device", GPU).returncode == 0
    assert scheduler.device(GPU)["tq"] == 4

    assert scheduler.ctl("auto", "--device", GPU).returncode == 0
    assert scheduler.device(GPU)["mode"] == "auto"
    assert scheduler.status()["scheduler"]["defaults"]["mode"] == "on"
    result = scheduler.ctl("off")
    assert result.returncode == 0 and "every device: off" in result.stdout
    waiter.expect(f"granted {GPU}")  # mode off: everyone runs
    assert scheduler.ctl("on").returncode == 0
    assert scheduler.status()["scheduler"]["defaults"]["mode"] == "on"

    result = scheduler.ctl("set-budget", "8G", "--device", GPU)
    assert result.returncode == 0 and "8.0 GiB" in result.stdout
    assert scheduler.device(GPU)["budget"] == 8 << 30
    assert scheduler.ctl("set-budget", "512MiB", "--device", GPU).returncode == 0
    assert scheduler.device(GPU)["budget"] == 512 << 20
    assert scheduler.ctl("set-budget", "default", "--device", GPU).returncode == 0
    assert scheduler.device(GPU)["budget"] == 17179869184


def test_refusals_exit_1(busy):
    scheduler, _, _ = busy
    result = scheduler.ctl("on", "--device", "GPU-nobody")
    assert result.returncode == 1
    assert "unknown-device" in result.stderr
    result = scheduler.ctl("set-budget", "1G", "--device", "GPU-nobody")
    assert result.returncode == 1


def test_usage_errors_exit_2(scheduler):
    for argv in (["set-tq", "0"], ["set-tq", "soon"], ["set-tq", "inf"], ["set-budget", "8 apples", "--device", GPU],
                 ["set-budget", "9" * 400, "--device", GPU], ["set-budget", "8G"], ["frobnicate"],
                 ["events", "--since", "-1"], ["--timeout", "1e10", "status"]):
        result = scheduler.ctl(*argv)
        assert result.returncode == 2, (argv, result.stdout, result.stderr)
        assert "Traceback" not in result.stderr, argv


def test_events(busy):
    scheduler, holder, waiter = busy
    result = scheduler.ctl("events", "--json")
    assert result.returncode == 0
    answer = json.loads(result.stdout)
    kinds = [(e["kind"], e["client"]) for e in answer["events"]]
    assert ("grant", holder.client_id) in kinds and ("acquire", waiter.client_id) in kinds
    assert answer["next"] == answer["events"][-1]["seq"] + 1

    result = scheduler.ctl("events", "--since", str(answer["next"] - 1))
    assert result.returncode == 0
    (line,) = result.stdout.splitlines()
    assert line.split()[0] == str(answer["next"] - 1)
    assert f"client={waiter.client_id}" in line


def test_events_follow_prints_new_events(busy):
    scheduler, holder, waiter = busy
    start = scheduler.request("events", since=0, limit=1)["events"][0]["seq"]
    follower = subprocess.Popen(
        [*nvsharectl_command(), "events", "--follow", "--json", "--interval", "0.1", "--since", str(start)],
        env=scheduler.env, cwd=CHILD_CWD, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        holder.send(f"release {GPU}")
        waiter.expect(f"granted {GPU}")
        seen = []
        while not any(e["kind"] == "grant" and e["client"] == waiter.client_id for e in seen):
            line = follower.stdout.readline()
            assert line, follower.stderr.read()
            seen.append(json.loads(line))
    finally:
        follower.send_signal(signal.SIGINT)
        assert follower.wait(30) == 130  # interrupted, as a shell reports Ctrl-C


def test_status_watch_refreshes_until_interrupted(busy):
    scheduler, holder, waiter = busy
    watcher = subprocess.Popen(
        [*nvsharectl_command(), "status", "--watch", "--interval", "0.2"],
        env=scheduler.env, cwd=CHILD_CWD, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        renders = 0
        for line in watcher.stdout:  # each snapshot is flushed as it is drawn
            renders += line.startswith("GPU0  ")
            if renders == 2:
                break
        assert renders == 2, watcher.stderr.read()  # rendered more than once
    finally:
        watcher.send_signal(signal.SIGINT)
        _, err = watcher.communicate(timeout=30)
    assert watcher.returncode == 130, err


def test_not_running_exits_3(scheduler):
    empty = short_socket_dir()
    try:
        result = scheduler.ctl("--socket-dir", str(empty), "status")
        assert result.returncode == 3 and "no scheduler control socket" in result.stderr
    finally:
        os.rmdir(empty)
    scheduler.kill()  # the socket file stays; nothing listens
    result = scheduler.ctl("status")
    assert result.returncode == 3 and "not running" in result.stderr


def test_no_answer_within_timeout_exits_3(scheduler):
    os.kill(scheduler.pid, signal.SIGSTOP)
    try:
        result = scheduler.ctl("--timeout", "0.5", "status")
    finally:
        os.kill(scheduler.pid, signal.SIGCONT)
    assert result.returncode == 3
    assert "did not answer within 0.5 s" in result.stderr


def test_parse_size():
    from ctl.main import parse_size

    assert parse_size("8G") == 8 << 30
    assert parse_size("512M") == 512 << 20
    assert parse_size("1.5GiB") == 3 << 29
    assert parse_size("64k") == 64 << 10
    assert parse_size("1048576") == 1 << 20
    assert parse_size("9007199254740993") == 9007199254740993  # exact, where a float would round
    assert parse_size("8P") == 8 << 50
    for bad in ("", "G", "-1G", "0", "8X", "1e9", "8192P", "9" * 400):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_a_stopped_holder_shows_as_silent(scheduler_factory):
    """A SIGSTOPped holder sends no heartbeats but keeps its lock until the heartbeat timeout
    (here far away): status must say it has gone silent, so an operator sees why others wait."""
    scheduler = scheduler_factory(tq=600, heartbeat_interval=0.2, heartbeat_timeout=600)
    holder = scheduler.agent()
    holder.send(f"acquire {GPU}")
    holder.expect(f"granted {GPU}")
    os.kill(holder.pid, signal.SIGSTOP)
    try:
        def silent_holder():
            holders = [h for d in scheduler.status()["devices"] for h in d["holders"]]
            return holders and holders[0]["silent"] > 1.0
        wait_for(silent_holder, what="the stopped holder to be seen as silent")
        result = scheduler.ctl("status")
        assert result.returncode == 0, result.stderr
        holder_lines = [line for line in result.stdout.splitlines() if "holding" in line]
        assert holder_lines and all("silent" in line for line in holder_lines), result.stdout
    finally:
        os.kill(holder.pid, signal.SIGCONT)
    # Once it runs again its heartbeats resume and the note goes away.
    wait_for(lambda: all(h["silent"] < 1.0 for d in scheduler.status()["devices"] for h in d["holders"]),
             what="the resumed holder's heartbeats")


# --- the README's recipe -----------------------------------------------------------------------

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_block(heading: str) -> list[str]:
    """The command lines of the first sh block under `## heading` in the README."""
    section = README.read_text().split(f"## {heading}\n", 1)[1]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def test_the_readmes_recipe_without_a_gpu_runs_as_written(libnvshare, simcuda, tmp_path):
    """Each line as the README writes it, in bash, with the tools on PATH. Only two things differ
    from an installed nvshare_py: the tools run this checkout (small scripts on PATH), and
    `nvshare-run --print-simulated-driver` names the simulated driver the tests built (pip builds
    the installed copy). As root, the scheduler serves the system directory: a stand-in here."""
    system = short_socket_dir()
    tools = tmp_path / "bin"
    tools.mkdir()
    shims = {
        "nvshare-scheduler": f'exec "{sys.executable}" -m nvshare_py.scheduler "$@"',
        "nvsharectl": f'exec {shlex.join(nvsharectl_command())} "$@"',
        "nvshare-run": (f'if [ "$1" = --print-simulated-driver ]; then echo "{simcuda.lib_dir}"; exit 0; fi\n'
                        f'exec "{sys.executable}" -m nvshare_py.run "$@"'),
        "python": f'exec "{sys.executable}" "$@"',
    }
    for name, body in shims.items():
        (tools / name).write_text(f"#!/bin/sh\n{body}\n")
        (tools / name).chmod(0o755)
    env = child_env(extra={"PATH": f"{tools}:{os.environ['PATH']}", ENV_SYSTEM_SOCKET_DIR: str(system),
                           "NVSHARE_LIBRARY": str(libnvshare), "COLUMNS": "80"})
    env.pop(ENV_SOCKET_DIR, None)
    first, *rest = readme_block("Without a GPU")
    assert first.startswith("nvshare-scheduler &")
    daemon = subprocess.Popen(["bash", "-c", first.split("&")[0]], env=env, cwd=CHILD_CWD, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, start_new_session=True)
    try:
        wait_for(lambda: daemon.poll() is not None or connect_error(system / "client" / "scheduler.sock") is None,
                 what="the README's scheduler to serve")
        assert daemon.poll() is None, daemon.stderr.read().decode()
        results = [(line, run_child(["bash", "-c", line], env)) for line in rest]
        for line, result in results:
            assert result.returncode == 0, (line, result.stdout, result.stderr)
        shown = {line.split()[1] if line.startswith("nvsharectl") else line.split()[0]: result.stdout
                 for line, result in results}
        program = next(result.stdout for line, result in results if "nvshare-run python" in line)
        assert "2 s of GPU work on nvshare simulated GPU" in program
        assert "last GPU use: c1" in shown["status"] and "on GPU0" in shown["status"], shown["status"]
        assert "GPU0 (GPU-" in shown["timeline"] and "█" in shown["timeline"]
        assert shown["set-budget"].startswith("memory budget of GPU0 (GPU-") and "16.0 GiB" in shown["set-budget"]
    finally:
        os.killpg(daemon.pid, signal.SIGTERM)
        daemon.wait(PATIENCE)
        shutil.rmtree(system, ignore_errors=True)


def test_kubectl_habits_output_since_negative_numbers_and_gpu_numbers(busy):
    scheduler, holder, waiter = busy
    as_json = scheduler.ctl("status", "-o", "json")
    assert as_json.returncode == 0 and json.loads(as_json.stdout)["devices"][0]["device"] == GPU

    for argv in (["set-tq", "-5"], ["set-weight", "-1", "--client", holder.client_id], ["set-tq", "-0.5", "--device", "0"]):
        refused = scheduler.ctl(*argv)
        assert refused.returncode == 2 and "out of range" in refused.stderr, (argv, refused.stderr)
        assert "No such option" not in refused.stderr

    for name in ("0", "GPU0", GPU):  # nvidia-smi -i 0, status's name, the UUID
        done = scheduler.ctl("set-tq", "9", "--device", name)
        assert done.returncode == 0 and done.stdout.strip() == f"time quantum of GPU0 ({GPU}): 9 s", done.stdout

    lines = scheduler.ctl("events").stdout.splitlines()
    assert any(f"device=GPU0 client={holder.client_id}" in line for line in lines) and GPU not in "".join(lines)
    assert f"device=GPU0 ({GPU})" in scheduler.ctl("events", "-o", "wide").stdout
    registered = next(line for line in lines if f"register   client={holder.client_id}" in line)
    assert f"user={user_name(os.geteuid())} program=agent.py" in registered

    every = [e["seq"] for e in json.loads(scheduler.ctl("events", "-o", "json").stdout)["events"]]
    recent = [e["seq"] for e in json.loads(scheduler.ctl("events", "-o", "json", "--since", "10m").stdout)["events"]]
    # All of them happened in the last 10 minutes (the agent may have caused more since).
    assert recent[:len(every)] == every, (every, recent)
    last = every[-1]
    from_seq = [e["seq"] for e in json.loads(scheduler.ctl("events", "-o", "json", "--since", str(last)).stdout)["events"]]
    assert from_seq[0] == last and from_seq == sorted(from_seq), (last, from_seq)
    for bad in ("5x", "-3", "soon"):
        refused = scheduler.ctl("events", "--since", bad)
        assert refused.returncode == 2 and "sequence number" in refused.stderr, refused.stderr
    timeline = json.loads(scheduler.ctl("timeline", "-o", "json", "--since", "1h").stdout)
    assert timeline["device_names"] == {GPU: "GPU0"}

    # Typer detects the shell from the process tree unless told not to; CI's may have none it knows.
    shell = scheduler.ctl("--show-completion", "bash",
                          env={**scheduler.env, "_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"})
    assert shell.returncode == 0 and "_NVSHARECTL_COMPLETE" in shell.stdout


@pytest.mark.scheduler_options(admission_spill="auto")
def test_admission_spill_0_as_the_docs_write_it_and_back_to_auto_without_a_restart(scheduler):
    started_with = scheduler.status()["admission"]["spill"]  # --admission-spill auto: half of MemAvailable
    zero = scheduler.ctl("set-admission", "--spill", "0")
    assert zero.returncode == 0 and zero.stdout.startswith("admission: spill 0 B,"), zero.stderr
    assert scheduler.status()["admission"]["enabled"] and scheduler.status()["admission"]["spill"] == 0
    assert scheduler.ctl("set-admission", "--spill", "off").returncode == 0
    assert not scheduler.status()["admission"]["enabled"]
    back = scheduler.ctl("set-admission", "--spill", "auto")
    assert back.returncode == 0, back.stderr
    assert scheduler.status()["admission"]["spill"] == started_with


def test_reads_go_to_the_read_only_status_where_the_control_socket_is_closed(monkeypatch, tmp_path):
    """The fallback itself (tests/test_one_scheduler.py runs it as a second uid): permission
    denied on the control socket, or `forbidden` from the scheduler, sends reads to the
    read-only status socket; a scheduler without one leaves the permission problem as the news."""
    from ctl import reading
    from nvshare_py import control
    from nvshare_py.control import EXIT_NOT_RUNNING, EXIT_PERMISSION, ControlFailure
    from nvshare_py.paths import SocketPaths

    def denied(self):
        raise ControlFailure(EXIT_PERMISSION, "permission denied on /x/control/control.sock")

    asked = []
    monkeypatch.setattr(reading.Settings, "connect", denied)
    monkeypatch.setattr(control, "read_only_status",
                        lambda paths, op, timeout, **fields: asked.append((op, fields)) or {"op": op})
    settings = reading.Settings(SocketPaths(tmp_path), 1.0)
    with reading.Reader(settings) as reader:
        assert reader.read_only and reader.request("status") == {"op": "status"}
        assert reader.request("events", since=3, limit=10) == {"op": "events"}
    assert asked == [("status", {}), ("events", {"since": 3, "limit": 10})]

    def absent(paths, op, timeout, **fields):
        raise ControlFailure(EXIT_NOT_RUNNING, "no read-only status socket")

    monkeypatch.setattr(control, "read_only_status", absent)
    with reading.Reader(settings) as reader, pytest.raises(ControlFailure) as failure:
        reader.request("status")
    assert failure.value.exit_code == EXIT_PERMISSION and "permission denied" in str(failure.value)


def test_status_says_why_a_heavier_client_gets_less_a_higher_class_goes_first():
    """Weight 4 used to show "share 80 %" beside an achieved 21 %, and nothing said why."""
    from rich.console import Console

    from ctl.screens import render_status
    from nvshare_py.devicenames import DeviceNames

    usage = {"state": "waiting", "used": 1 << 30, "share": 0.0, "achieved": 0.21, "outranked_by": ["c4"]}
    status = {
        "scheduler": {"version": "x", "pid": 1, "socket_dir": "/run/nvshare", "defaults": {"mode": "on", "tq": 30}},
        "devices": [{"device": GPU, "mode": "on", "tq": 30, "used": 2 << 30, "budget": 16 << 30, "total": 16 << 30,
                     "holders": [{"client": "c4", "quantum_left": 0.5, "state": "holding", "since": 0.0}],
                     "waiters": [{"client": "c3", "since": 0.0}]}],
        "clients": [
            {"client": "c3", "user": "alice", "program": "train.py", "pid": 11, "weight": 4, "priority": 0,
             "devices": {GPU: usage}},
            {"client": "c4", "user": "bob", "program": "infer.py", "pid": 12, "weight": 1, "priority": 5,
             "devices": {GPU: {"state": "holding", "used": 1 << 30, "share": 1.0, "achieved": 0.79,
                               "outranked_by": []}}},
        ],
    }
    console = Console(width=80, record=True, highlight=False)
    console.print(render_status(status, DeviceNames([GPU]), now=10.0))
    text = " ".join(console.export_text().split())
    assert "c3 21 % (due 0 %, weight 4)" in text and "c4 79 % (due 100 %, class 5)" in text, text
    assert "c3 is due nothing while class 5 (c4) waits or holds: a higher class goes first" in text, text


def test_status_shows_a_gang_as_one_line_with_its_ranks_not_a_row_per_gpu():
    """Issue 31: a job's ranks were listed under each GPU like unrelated programs; the gang's
    line named only their ids. Now the compact view has one line per gang (its ranks, user,
    program, GPUs, memory, state), a GPU held by a gang says so, and `-o wide` groups each
    gang's ranks (pid, GPU, state) under it."""
    from rich.console import Console

    from ctl.screens import render_status, render_status_wide
    from nvshare_py.devicenames import DeviceNames

    gpu1 = "GPU-5151ad00-0000-4000-8000-000000000001"
    holding = {"state": "holding", "used": 4 << 30}
    status = {
        "scheduler": {"version": "x", "pid": 1, "socket_dir": "/run/nvshare", "defaults": {"mode": "on", "tq": 30}},
        "devices": [{"device": device, "mode": "on", "tq": 30, "used": 4 << 30, "budget": 16 << 30,
                     "total": 16 << 30, "holders": [{"client": rank, "quantum_left": 12.3, "state": "holding",
                                                     "since": 0.0}],
                     "waiters": [{"client": "c9", "since": 0.0}] if device == GPU else []}
                    for device, rank in ((GPU, "c3"), (gpu1, "c5"))],
        "clients": [
            {"client": "c3", "user": "alice", "program": "train.py", "pid": 11, "gang": "g1",
             "devices": {GPU: holding}},
            {"client": "c5", "user": "alice", "program": "train.py", "pid": 12, "gang": "g1",
             "devices": {gpu1: holding}},
            {"client": "c9", "user": "bob", "program": "infer.py", "pid": 13, "gang": None,
             "devices": {GPU: {"state": "waiting", "used": 1 << 30}}},
        ],
        "gangs": [{"gang": "g1", "name": "job", "size": 2, "members": ["c3", "c5"], "devices": [GPU, gpu1],
                   "state": "holding", "turn": 4, "since": 0.0, "quantum_left": 12.3, "turns": 2}],
    }
    names = DeviceNames([GPU, gpu1])
    console = Console(width=120, record=True, highlight=False)
    console.print(render_status(status, names, now=10.0))
    lines = console.export_text().splitlines()
    gang_lines = [line for line in lines if "g1" in line or "c3" in line or "c5" in line]
    assert gang_lines[:2] == ["GPU0  on, TQ 30 s, 4.0 GiB of 16.0 GiB, held by gang g1 'job' (12.3s left), 1 waiting",
                              "GPU1  on, TQ 30 s, 4.0 GiB of 16.0 GiB, held by gang g1 'job'"], lines
    (line,) = gang_lines[2:]
    assert line == ("gang g1 'job': 2 ranks (c3, c5) of alice, train.py, on GPU0 GPU1, 8.0 GiB; holds its devices, "
                    "12.3 s of its quantum left"), lines
    assert [row for row in lines if row.startswith("c9 ")], lines  # a single program is a row under its GPU
    console = Console(width=200, record=True, highlight=False)
    console.print(render_status_wide(status, names, now=10.0))
    wide = console.export_text()
    assert "c3 pid 11: GPU0 holding" in wide and "c5 pid 12: GPU1 holding" in wide, wide
