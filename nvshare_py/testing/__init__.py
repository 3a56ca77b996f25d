"""What the tests (tests/) and the benchmarks (benchmarks/) share, shipped with the package so
that a benchmark needs no test framework: `pip install .` and the checkout are enough.

- simcuda: the simulated CUDA driver (tests/simcuda), built from a checkout; environments and
  traces of the processes that run on it.
- interceptor: libnvshare.so built from a checkout.
- residency: reading the simulated driver's residency model out of its trace.
- scheduler: the real scheduler daemon as a child process, client agents, waiting helpers.
- agent: the client agent program (`python -m nvshare_py.testing.agent`).
- scripted: a scheduler played by a script (pyzmq).
- notebook: Jupyter kernels driven as a notebook front end drives them (needs the `jupyter` extra).

Nothing here imports pytest: the pytest fixtures wrapping these live in tests/fixtures/.
The C sources are built from a checkout (tests and benchmarks always run from one), so the
functions that build take the checkout's root; CHECKOUT_* name where its sources are.
"""

from __future__ import annotations

from pathlib import Path

import nvshare_py

# The directory holding the nvshare_py this process imports (a checkout, or site-packages when
# installed), put first on the children's PYTHONPATH so that they import the same one.
PACKAGE_PARENT = str(Path(nvshare_py.__file__).absolute().parent.parent)

# Where a checkout keeps the C sources these helpers build, relative to its root.
CHECKOUT_INTERCEPTOR = Path("interceptor")
CHECKOUT_SIMCUDA = Path("tests/simcuda")
