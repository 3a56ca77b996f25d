"""Shared fixtures live in tests/fixtures/, one module per component."""

import atexit
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from hypothesis import settings

# nvsharectl's command line is the checkout's top-level ./ctl (installed as nvshare_py.ctl); last
# on the path, so it never shadows the nvshare_py under test.
sys.path.append(str(Path(__file__).resolve().parents[1]))

# A test run started in the background of a non-interactive shell (`pytest &`, many CI runners)
# inherits SIGINT ignored, and so would every process the tests start: the tests that press
# Ctrl-C on a child would wait in vain. A handled signal is back to its default in a child.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# The tests never depend on what else serves on this machine: without this, a system scheduler
# running here (/var/run/nvshare) would be found by every tool and program that looks for one
# (nvshare_py/paths.py, interceptor/config.c). Tests that want a system scheduler stand one up
# in a directory of their own and point this variable at it (tests/test_one_scheduler.py).
# Its parent is an empty directory of its own: a user's scheduler watches the deepest part of
# that path that exists for the system one coming back (nvshare_py/scheduler/cli.py), and /tmp
# itself would wake it whenever a file is made there.
_QUIET = tempfile.mkdtemp(prefix="nvs-quiet-")
atexit.register(shutil.rmtree, _QUIET, True)
os.environ["NVSHARE_SYSTEM_SOCKET_DIR"] = os.path.join(_QUIET, "no-system-scheduler")

# Nor on another run's swap pool: the interceptor's pool is shared by every process of a user
# (/dev/shm/nvshare-pool-<uid>), so two test runs of one user at once (or a benchmark beside
# them) would share, resize and clean up each other's. Each run's processes get a pool
# directory of their own, in shared memory where there is some.
_POOLS = tempfile.mkdtemp(prefix="nvs-pools-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
os.chmod(_POOLS, 0o1777)  # as /dev/shm: the tests' other users make their pools in it too
atexit.register(shutil.rmtree, _POOLS, True)
os.environ.setdefault("NVSHARE_POOL_DIR", _POOLS)

# Hypothesis runs the same examples on every run (derandomized, no example database): the suite
# must not pass on one CI run and fail on the next. To hunt with fresh examples, run pytest with
# `--hypothesis-profile explore` (random examples, more of them where a test does not say).
settings.register_profile("repeatable", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False, max_examples=500)
settings.load_profile("repeatable")

# fixtures.interceptor first: the others import it (REPO_ROOT), and pytest rewrites a plugin's
# asserts only when it loads the plugin before anything imports it.
pytest_plugins = [
    "fixtures.interceptor",
    "fixtures.simcuda",
    "fixtures.scheduler",
    "fixtures.client_core",
]
