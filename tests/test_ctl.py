"""nvsharectl as operators run it: a separate process against the real daemon."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from fixtures.scheduler import CHILD_CWD, nvsharectl_command, short_socket_dir, wait_for

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
    assert "GPU0" in out and GPU not in out  # the short name; the UUID only with --wide
    assert holder.client_id in out and "holding" in out
    assert waiter.client_id in out
    assert "1.0 GiB / 16.0 GiB" in out
    assert str(holder.pid) in out and "scheduler.py" in out

    wide = scheduler.ctl("status", "--wide")
    assert wide.returncode == 0, wide.stderr
    assert GPU in wide.stdout and "simulated GPU" in wide.stdout
    assert f"{holder.client_id} #" in wide.stdout  # holder with its grant


def test_status_fits_80_columns(busy):
    scheduler, holder, waiter = busy
    result = scheduler.ctl("status", env={**scheduler.env, "COLUMNS": "80"})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80, result.stdout
    assert "…" not in result.stdout, result.stdout  # nothing cut short
    words = result.stdout.split()
    for whole in (holder.client_id, waiter.client_id, str(holder.pid), str(waiter.pid), "holding", "waiting", "GPU0",
                  str(scheduler.socket_dir)):
        assert whole in words, (whole, result.stdout)


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
            renders += "Devices" in line
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
