"""libnvshare.so, the interceptor, built from a checkout's sources (interceptor/).

    library = build_interceptor(checkout, build_dir)          # Path of libnvshare.so
    library = build_interceptor(checkout, build_dir, cflags="-O0 -g")
    library = benchmark_library(checkout, build_dir)          # $NVSHARE_LIBRARY, or the build
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from nvshare_py.library import ENV_LIBRARY
from nvshare_py.testing import CHECKOUT_INTERCEPTOR


def build_interceptor(checkout: Path, build_dir: Path, cflags: str | None = None, ldflags: str | None = None) -> Path:
    """Build libnvshare.so into `build_dir` exactly as `pip install .` does (or with other
    CFLAGS/LDFLAGS, as a packager or a developer might)."""
    variables = [f"BUILD={build_dir}"]
    if cflags is not None:
        variables.append(f"CFLAGS={cflags}")
    if ldflags is not None:
        variables.append(f"LDFLAGS={ldflags}")
    result = subprocess.run(["make", "-s", "-C", str(checkout / CHECKOUT_INTERCEPTOR), *variables],
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"building libnvshare.so failed:\n{result.stdout}\n{result.stderr}")
    return build_dir / "libnvshare.so"


def benchmark_library(checkout: Path, build_dir: Path) -> Path:
    """The libnvshare.so a benchmark measures: $NVSHARE_LIBRARY when set (a build made
    elsewhere, e.g. the one a package installed), else the checkout's, built into `build_dir`."""
    if os.environ.get(ENV_LIBRARY):
        return Path(os.environ[ENV_LIBRARY])
    return build_interceptor(checkout, build_dir)
