"""Shared fixtures live in tests/fixtures/, one module per component."""

import sys
from pathlib import Path

# nvsharectl's command line is the checkout's top-level ./ctl (installed as nvshare_py.ctl); last
# on the path, so it never shadows the nvshare_py under test.
sys.path.append(str(Path(__file__).resolve().parents[1]))

pytest_plugins = [
    "fixtures.simcuda",
    "fixtures.scheduler",
    "fixtures.interceptor",
    "fixtures.client_core",
]
