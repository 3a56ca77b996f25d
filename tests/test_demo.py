"""nvshare-demo end to end: the real scheduler, two programs under libnvshare.so on the simulated
driver, and the demo's own summary, checks, exit status and clean-up."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from nvshare_py.testing.scheduler import CHILD_CWD, child_env, wait_for

from nvshare_py import demo

GPU = "GPU-5151ad00-0000-4000-8000-000000000000"


def demo_command(*args: str) -> list[str]:
    """argv that runs nvshare-demo with this test run's nvshare_py (child_env's PYTHONPATH)."""
    return [sys.executable, "-m", "nvshare_py.demo", *args]


@pytest.fixture
def demo_env(simcuda, libnvshare) -> dict[str, str]:
    return child_env(extra={demo.ENV_SIMULATOR: str(simcuda.lib_dir), "NVSHARE_LIBRARY": str(libnvshare),
                            "COLUMNS": "120"})


def descendants(pid: int) -> set[int]:
    """Processes whose parent is `pid` (the demo starts its children directly)."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.add(int(entry))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_demo_on_the_simulated_driver(demo_env, tmp_path):
    summary = tmp_path / "demo.json"
    run = subprocess.run(demo_command("--simulated", "--no-live", "--duration", "10", "--tq", "1.5",
                                      "--json", str(summary)),
                         env=demo_env, cwd=CHILD_CWD, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}"
    assert run.stdout.count("nvshare demo on a SIMULATED GPU") == 1  # the banner, once
    document = json.loads(summary.read_text())
    assert document["ok"] and document["gpu"]["simulated"] and document["gpu"]["uuid"] == GPU
    assert "SIMULATED GPU" in document["gpu"]["label"]

    rows = {row["row"]: row for row in document["timeline"]["summary"]}
    assert set(rows) == {"training", "notebook"}
    assert rows["training"]["holds"] >= 1 and rows["notebook"]["holds"] >= 1
    assert sum(row["tq_handoffs"] for row in rows.values()) >= 1
    assert sum(row["early_releases"] for row in rows.values()) >= 1
    assert rows["notebook"]["waited"] > 0

    # Never at once, by the demo's own checks and by the holds in its JSON.
    checks = {check["name"]: check for check in document["checks"]}
    assert checks["exclusive"]["ok"] and checks["kernels-apart"]["ok"] and checks["finished"]["ok"]
    holds = sorted((i["start"], i["end"], i["row"]) for i in document["timeline"]["intervals"] if i["kind"] == "hold")
    for (_, end, row), (start, _, next_row) in zip(holds, holds[1:]):
        assert end is not None and (start >= end or row == next_row), holds

    # Every program finished by itself and is gone; the work directory was removed.
    for program in document["programs"].values():
        assert program["exit_status"] == 0 and program["done"]["verified"]
        assert not alive(program["pid"])
    assert "logs kept" not in run.stderr


def start_demo(env: dict[str, str], *args: str) -> subprocess.Popen:
    return subprocess.Popen(demo_command("--simulated", "--no-live", "--duration", "30", "--tq", "1", *args),
                            env=env, cwd=CHILD_CWD, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def demo_roles(pids: set[int]) -> dict[str, int]:
    """The demo programs among `pids` by role ("training", "notebook"). A child between its fork
    and its exec still shows the demo's own command line, so only what has become a worker counts."""
    roles = {}
    for pid in pids:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # gone meanwhile
        if b"nvshare_py.demo.worker" in argv[:-1]:
            roles[argv[argv.index(b"nvshare_py.demo.worker") + 1].decode()] = pid
    return roles


def wait_for_both_programs(process: subprocess.Popen) -> tuple[set[int], dict[str, int]]:
    """The demo's children once both programs run (scheduler, training, notebook), and the
    programs by role."""
    def both() -> tuple[set[int], dict[str, int]] | None:
        children = descendants(process.pid)
        roles = demo_roles(children)
        return (children, roles) if len(children) == 3 and set(roles) == {"training", "notebook"} else None

    return wait_for(both, timeout=60, what="the scheduler and both programs")


def test_ctrl_c_stops_every_process(demo_env):
    process = start_demo(demo_env)
    try:
        children, _ = wait_for_both_programs(process)
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == 130, err
    assert "interrupted" in err
    wait_for(lambda: not any(alive(pid) for pid in children), what="the demo's children to be gone")


def test_a_crashed_program_fails_the_demo(demo_env):
    process = start_demo(demo_env)
    try:
        children, roles = wait_for_both_programs(process)
        os.kill(roles["notebook"], signal.SIGKILL)
        out, err = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == 1
    assert "the notebook program failed" in err
    log_dir = Path(err.split("logs kept in ")[1].split(")")[0])
    assert (log_dir / "scheduler.log").exists()  # kept for the post-mortem
    wait_for(lambda: not any(alive(pid) for pid in children), what="the demo's children to be gone")
    shutil.rmtree(log_dir)


def test_without_a_gpu_in_an_ascii_terminal(demo_env, simcuda):
    """What a newcomer without a GPU sees: the simulated driver, named once, without advice on
    installing a driver; an output encoding that cannot draw the timeline is one warning."""
    if simcuda.real_gpu():
        pytest.skip("this machine has a GPU: the demo would use it")
    env = {**simcuda.real_env(), **{k: v for k, v in demo_env.items() if k != "LD_LIBRARY_PATH"},
           "PYTHONIOENCODING": "ascii"}
    run = subprocess.run(demo_command("--no-live", "--duration", "4", "--tq", "1"), env=env, cwd=CHILD_CWD,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}"
    assert "Traceback" not in run.stderr
    (warning,) = run.stderr.splitlines()
    assert "encoding (ascii)" in warning and "PYTHONIOENCODING=utf-8" in warning
    assert run.stdout.count("nvshare demo on a SIMULATED GPU (no NVIDIA GPU found)") == 1  # the banner, once
    assert "Install the NVIDIA driver" not in run.stdout and "LD_LIBRARY_PATH" not in run.stdout


def test_counts_read_as_english():
    assert [demo.counted(n, "cell") for n in (0, 1, 2)] == ["0 cells", "1 cell", "2 cells"]


def test_missing_simulator_is_a_clear_usage_error(tmp_path, libnvshare):
    env = child_env(extra={demo.ENV_SIMULATOR: str(tmp_path), "NVSHARE_LIBRARY": str(libnvshare)})
    run = subprocess.run(demo_command("--simulated", "--no-live"), env=env, cwd=CHILD_CWD, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 2
    assert f"simulated CUDA driver is not at {demo.ENV_SIMULATOR}={tmp_path}" in run.stderr


def test_kernel_overlaps_from_a_trace(tmp_path):
    trace = tmp_path / "trace.jsonl"
    ops = [
        {"pid": 1, "op": "kernel", "start": 0.0, "end": 1.0},
        {"pid": 2, "op": "kernel", "start": 1.0, "end": 2.0},  # touching: fine
        {"pid": 1, "op": "kernel", "start": 2.5, "end": 3.0},
        {"pid": 2, "op": "memcpy", "start": 2.6, "end": 2.7},  # not a kernel
        {"pid": 9, "op": "kernel", "start": 2.6, "end": 2.7},  # not a demo program
        {"pid": 2, "op": "kernel", "start": 2.9, "end": 3.5},  # overlaps pid 1
    ]
    trace.write_text("".join(json.dumps(op) + "\n" for op in ops))
    count, overlapping = demo.kernel_overlaps(trace, {1: "training", 2: "notebook"})
    assert count == 4
    assert [(a["start"], b["start"]) for a, b in overlapping] == [(2.5, 2.9)]


@pytest.mark.gpu
def test_demo_on_a_real_gpu(simcuda, libnvshare, tmp_path):
    """Without --simulated, on a machine with an NVIDIA GPU: the real driver, labelled as such
    (each program allocates 4 MiB)."""
    if not simcuda.real_gpu():
        pytest.skip("no real CUDA driver with a GPU here")
    env = simcuda.real_env()
    env.update(NVSHARE_LIBRARY=str(libnvshare), COLUMNS="120")
    summary = tmp_path / "demo.json"
    run = subprocess.run(demo_command("--no-live", "--duration", "12", "--tq", "2", "--json", str(summary)),
                         env=env, cwd=CHILD_CWD, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}"
    document = json.loads(summary.read_text())
    assert not document["gpu"]["simulated"] and "SIMULATED" not in run.stdout
    assert document["gpu"]["name"] in run.stdout
    checks = {check["name"]: check for check in document["checks"]}
    assert checks["exclusive"]["ok"] and checks["finished"]["ok"] and checks["both-held"]["ok"]
    assert checks["handoffs"]["ok"], checks["handoffs"]["text"]
