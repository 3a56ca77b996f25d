"""Shared fixtures live in tests/fixtures/, one module per component."""

import signal
import sys
from pathlib import Path

# nvsharectl's command line is the checkout's top-level ./ctl (installed as nvshare_py.ctl); last
# on the path, so it never shadows the nvshare_py under test.
sys.path.append(str(Path(__file__).resolve().parents[1]))

# A test run started in the background of a non-interactive shell (`pytest &`, many CI runners)
# inherits SIGINT ignored, and so would every process the tests start: the tests that press
# Ctrl-C on a child would wait in vain. A handled signal is back to its default in a child.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

pytest_plugins = [
    "fixtures.simcuda",
    "fixtures.scheduler",
    "fixtures.interceptor",
    "fixtures.client_core",
]
