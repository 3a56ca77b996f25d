"""Every user of a machine reaches the same scheduler by default: the system one wherever it
serves, a per-user one only where none does (nvshare_py/paths.py and interceptor/config.c apply
the same rule). Tested with a real second uid: the notebook-sharing case (JupyterHub gives each
user a uid of their own)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from fixtures.scheduler import OTHER_UID, as_other_user
from nvshare_py.paths import ENV_SOCKET_DIR, ENV_SYSTEM_SOCKET_DIR, connect_error
from nvshare_py.testing.scheduler import (CHILD_CWD, PATIENCE, child_env, nvsharectl_command, run_child, short_socket_dir,
                                          wait_for)


@pytest.fixture
def system_scheduler(scheduler_factory):
    """A scheduler of root's in a directory that stands in for /var/run/nvshare (set through
    NVSHARE_SYSTEM_SOCKET_DIR, so that the machine's real one is never touched)."""
    directory = short_socket_dir()
    os.chmod(directory, 0o755)  # as /var/run/nvshare: other users reach client/ in it
    yield scheduler_factory(socket_dir=directory)
    shutil.rmtree(directory, ignore_errors=True)


def users_env(system_dir: Path) -> dict[str, str]:
    """Another user's login environment on this machine: no socket directory of their own chosen."""
    env = child_env(extra={ENV_SYSTEM_SOCKET_DIR: str(system_dir), "HOME": "/"})
    for name in (ENV_SOCKET_DIR, "XDG_RUNTIME_DIR", "LD_PRELOAD"):
        env.pop(name, None)
    return env


def test_two_users_programs_are_scheduled_by_one_scheduler(system_scheduler, libnvshare, simcuda):
    # CAP_DAC_READ_SEARCH only lets that uid read this test run's files wherever they are (CI
    # clones into a private temporary directory); it is still another user to the scheduler.
    other = as_other_user("dac_read_search")
    env = users_env(system_scheduler.socket_dir)

    # nvshare-run (and the Python client library, through the same rule) picks the system scheduler.
    chosen = run_child([*other, sys.executable, "-m", "nvshare_py.run", "--print-socket-dir"], env)
    assert chosen.returncode == 0, chosen.stderr
    assert chosen.stdout.strip() == f"{system_scheduler.socket_dir} (system scheduler)"

    # A CUDA program of that user under libnvshare.so registers with root's scheduler.
    program_env = {**env, "LD_PRELOAD": str(libnvshare), "LD_LIBRARY_PATH": str(simcuda.lib_dir), "NVSHARE_LOG": "info"}
    program = subprocess.Popen([*other, str(simcuda.simapp), "kernel:1000", "sync", "sleep:60000"],
                               env=program_env, cwd=CHILD_CWD, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    try:
        def others_client():
            return [c for c in system_scheduler.status()["clients"] if c.get("uid") == OTHER_UID]

        try:
            wait_for(others_client, timeout=60, what=f"a client of uid {OTHER_UID} in the system scheduler")
        except AssertionError:
            program.kill()
            raise AssertionError(f"the other user's program did not register:\n{program.communicate()[1]}") from None
        granted = [e for e in system_scheduler.events() if e["kind"] == "grant"]
        assert granted, "its kernel ran under the system scheduler's lock"
    finally:
        program.kill()
        program.wait(30)

    # That user starting a scheduler of their own is refused, with how to share (or --private).
    private = run_child([*other, sys.executable, "-m", "nvshare_py.scheduler"], env)
    assert private.returncode == 1, private.stderr
    (message,) = private.stderr.splitlines()
    assert f"a system scheduler already serves {system_scheduler.socket_dir}" in message and "--private" in message

    # Without a system scheduler, each user falls back to a directory of their own.
    system_scheduler.stop()
    chosen = run_child([*other, sys.executable, "-m", "nvshare_py.run", "--print-socket-dir"], env)
    assert chosen.returncode == 0, chosen.stderr
    assert chosen.stdout.startswith(f"/tmp/nvshare-{OTHER_UID} (per-user; no system scheduler serves "), chosen.stdout
    # ... and nvshare-run's advice is to start the one scheduler every user shares.
    alone = run_child([*other, sys.executable, "-m", "nvshare_py.run", "true"], {**env, "NVSHARE_LIBRARY": str(libnvshare)})
    assert alone.returncode == 3, alone.stderr
    assert "No scheduler serves this machine: start one as root" in alone.stderr


def test_a_user_scheduler_and_the_system_scheduler_say_loudly_when_both_serve(scheduler_factory):
    """Split brain across restarts (issue 22): a user started their own scheduler while root's was
    down; root's comes back. From then on new programs use root's while the user's keep running
    on theirs, on the same GPUs: both schedulers say so in their logs, and nvsharectl says so."""
    other = as_other_user("dac_read_search")
    system_dir = short_socket_dir()
    os.chmod(system_dir, 0o755)
    users_dir = Path(f"/tmp/nvshare-{OTHER_UID}")  # that user's default (no XDG_RUNTIME_DIR)
    shutil.rmtree(users_dir, ignore_errors=True)
    env = users_env(system_dir)
    own = subprocess.Popen([*other, sys.executable, "-m", "nvshare_py.scheduler"], env=env, cwd=CHILD_CWD,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    system = scheduler_factory(socket_dir=system_dir, start=False)
    system.env[ENV_SYSTEM_SOCKET_DIR] = str(system_dir)  # it is the machine's scheduler
    user_log: list[str] = []
    reader = threading.Thread(target=lambda: user_log.extend(own.stderr), daemon=True)
    reader.start()
    try:
        wait_for(lambda: own.poll() is not None or connect_error(users_dir / "client" / "scheduler.sock") is None,
                 what="the user's own scheduler to serve")
        assert own.poll() is None, "".join(user_log)

        system.start()  # root's scheduler comes back: it says so as it starts
        assert (f"users' own schedulers serve beside this system scheduler ({system_dir}): {users_dir} "
                f"(uid {OTHER_UID})") in system.log_text()
        wait_for(lambda: f"a system scheduler serves {system_dir} beside this one ({users_dir})" in "".join(user_log),
                 what="the user's scheduler's warning")
        shown = system.ctl("status", env={**system.env, ENV_SYSTEM_SOCKET_DIR: str(system_dir)})
        assert shown.returncode == 0 and f"warning: users' own schedulers serve beside" in shown.stderr

        system.stop()  # and the user's says when that is over
        wait_for(lambda: f"no other scheduler serves beside this one any more ({users_dir})" in "".join(user_log),
                 what="the user's scheduler to see the system one gone")
    finally:
        if own.poll() is None:
            own.kill()
            own.wait(PATIENCE)
        shutil.rmtree(users_dir, ignore_errors=True)
        shutil.rmtree(system_dir, ignore_errors=True)


def test_a_user_who_is_not_root_sees_who_holds_and_waits(system_scheduler):
    """As nvidia-smi: another user reads the status (status, status -o json, timeline) though the
    control socket is root's."""
    other = as_other_user("dac_read_search")
    env = users_env(system_scheduler.socket_dir)
    holder = system_scheduler.agent(env={"NVSHARE_PROGRAM": "train.py"})
    holder.send("acquire GPU-5151ad00-0000-4000-8000-000000000000")
    holder.expect("granted GPU-")
    ctl = [*other, *nvsharectl_command()]
    status = run_child([*ctl, "status"], env)
    assert status.returncode == 0, status.stderr
    assert "read-only view" in status.stdout and f"held by {holder.client_id}" in status.stdout
    assert run_child([*ctl, "status", "-o", "json"], env).returncode == 0
    timeline = run_child([*ctl, "timeline"], env)
    assert timeline.returncode == 0 and holder.client_id in timeline.stdout
    # Settings stay root's.
    refused = run_child([*ctl, "set-tq", "5"], env)
    assert refused.returncode == 4 and "permission denied" in refused.stderr
