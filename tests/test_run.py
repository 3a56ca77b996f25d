"""`nvshare-run`: runs a program in its own process with libnvshare.so first in LD_PRELOAD and
the scheduler's socket directory set, and refuses to when no scheduler answers (unless
--fail-open)."""

from __future__ import annotations

import json
import subprocess
import sys

from nvshare_py.testing.scheduler import CHILD_CWD, child_env, run_child

RUN = [sys.executable, "-m", "nvshare_py.run"]
SHOW = ("import os, json; print(json.dumps({'pid': os.getpid(), 'preload': os.environ.get('LD_PRELOAD', ''), "
        "'dir': os.environ['NVSHARE_SOCKET_DIR'], 'fail_mode': os.environ.get('NVSHARE_FAIL_MODE')}))")


def shown(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def test_runs_the_program_in_its_own_process_under_nvshare(scheduler, libnvshare, compile_c):
    other = compile_c("int nvshare_test_other;\n", "libother.so", shared=True)
    env = child_env(extra={"NVSHARE_LIBRARY": str(libnvshare), "LD_PRELOAD": f"{other}:{libnvshare}"})
    child = subprocess.Popen([*RUN, "--socket-dir", str(scheduler.socket_dir), "--", sys.executable, "-c", SHOW],
                             env=env, cwd=CHILD_CWD, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = child.communicate(timeout=60)
    assert child.returncode == 0, err
    assert shown(out) == {"pid": child.pid, "preload": f"{libnvshare}:{other}", "dir": str(scheduler.socket_dir),
                          "fail_mode": None}


def test_the_exit_status_is_the_programs(scheduler, libnvshare):
    env = child_env(scheduler.socket_dir, {"NVSHARE_LIBRARY": str(libnvshare)})
    done = run_child([*RUN, sys.executable, "-c", "raise SystemExit(7)"], env)
    assert done.returncode == 7, done.stderr


def test_without_a_scheduler_the_program_does_not_run(libnvshare, tmp_path):
    env = child_env(tmp_path / "none", {"NVSHARE_LIBRARY": str(libnvshare)})
    marker = tmp_path / "ran"
    done = run_child([*RUN, "touch", str(marker)], env)
    assert done.returncode == 3
    assert f"no nvshare scheduler at {tmp_path / 'none'}/client/scheduler.sock" in done.stderr
    assert f"Start nvshare-scheduler --socket-dir {tmp_path / 'none'}" in done.stderr  # the directory asked for
    assert "--fail-open" in done.stderr
    assert not marker.exists()


def test_fail_open_runs_unscheduled_until_a_scheduler_answers(libnvshare, tmp_path):
    env = child_env(tmp_path / "none", {"NVSHARE_LIBRARY": str(libnvshare), "LD_PRELOAD": ""})
    done = run_child([*RUN, "--fail-open", sys.executable, "-c", SHOW], env)
    assert done.returncode == 0, done.stderr
    assert shown(done.stdout)["preload"] == str(libnvshare) and shown(done.stdout)["fail_mode"] == "open"
    assert "running unscheduled" in done.stderr


def test_print_library_names_the_interceptor(libnvshare, tmp_path):
    done = run_child([*RUN, "--print-library"], child_env(tmp_path, {"NVSHARE_LIBRARY": str(libnvshare)}))
    assert done.returncode == 0 and done.stdout.strip() == str(libnvshare)


def test_usage_errors_and_commands_that_cannot_run(scheduler, libnvshare, tmp_path):
    env = child_env(scheduler.socket_dir, {"NVSHARE_LIBRARY": str(libnvshare)})
    no_command = run_child(RUN, env)
    assert no_command.returncode == 2 and "no command given" in no_command.stderr
    missing = run_child([*RUN, "/nonexistent/program"], env)
    assert missing.returncode == 127 and "/nonexistent/program: command not found" in missing.stderr
    not_executable = tmp_path / "data.txt"
    not_executable.write_text("not a program\n")
    refused = run_child([*RUN, str(not_executable)], env)
    assert refused.returncode == 126 and "Permission denied" in refused.stderr
    gone = run_child([*RUN, "--print-library"], child_env(tmp_path, {"NVSHARE_LIBRARY": str(tmp_path / "gone.so")}))
    assert gone.returncode == 2 and "does not name a file" in gone.stderr
