"""Where the C libraries are: libnvshare.so, the interceptor, and libnvshare_core.so, its client
core alone (what nvshare_py.client drives through ctypes, nvshare_py/client_core.py).

An environment variable names a built copy explicitly (a development build, a library mounted
into a container): `NVSHARE_LIBRARY`, `NVSHARE_CORE_LIBRARY`; otherwise it is the copy
`pip install` built and placed inside this package. A source checkout used without an install
(tests, benchmarks) gets its client core built by make into interceptor/build on first use.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
from pathlib import Path

ENV_LIBRARY = "NVSHARE_LIBRARY"
ENV_CORE_LIBRARY = "NVSHARE_CORE_LIBRARY"
PACKAGED = Path(__file__).resolve().parent / "_lib" / "libnvshare.so"
PACKAGED_CORE = PACKAGED.with_name("libnvshare_core.so")
CHECKOUT_INTERCEPTOR = Path(__file__).resolve().parents[1] / "interceptor"


class LibraryNotFound(FileNotFoundError):
    """A library is neither named by its environment variable nor installed in the package."""


def _find(variable: str, packaged: Path) -> Path:
    override = os.environ.get(variable)
    if override:
        chosen = Path(override).absolute()
        if not chosen.is_file():
            raise LibraryNotFound(f"{variable}={override} does not name a file")
        return chosen
    if packaged.is_file():
        return packaged
    raise LibraryNotFound(
        f"{packaged.name} is not installed at {packaged}: install nvshare-py with pip (which builds it "
        f"with make; a C compiler is needed), or build it with `make -C interceptor BUILD=<dir>` and set "
        f"{variable}=<dir>/{packaged.name}"
    )


def path() -> Path:
    """The absolute path of libnvshare.so; LibraryNotFound (with what to do) if there is none."""
    return _find(ENV_LIBRARY, PACKAGED)


def core_path() -> Path:
    """The absolute path of libnvshare_core.so; LibraryNotFound (with what to do) if there is none."""
    try:
        return _find(ENV_CORE_LIBRARY, PACKAGED_CORE)
    except LibraryNotFound:
        if os.environ.get(ENV_CORE_LIBRARY) or not (CHECKOUT_INTERCEPTOR / "Makefile").is_file():
            raise
    return _build_in_checkout()


def _build_in_checkout() -> Path:
    """make builds the core into the checkout's interceptor/build (again only when a source
    changed), one process at a time."""
    build = CHECKOUT_INTERCEPTOR / "build"
    built = build / "libnvshare_core.so"
    try:
        build.mkdir(exist_ok=True)
        lock = open(build / ".core.lock", "a")
    except OSError:  # a checkout this user may not write to: what is built there, if anything
        if built.is_file():
            return built
        raise LibraryNotFound(f"{built} is not built, and {build} is not writable: build it with "
                              f"`make -C {CHECKOUT_INTERCEPTOR} core`") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        result = subprocess.run(["make", "-s", "-C", str(CHECKOUT_INTERCEPTOR), f"BUILD={build}", "core"],
                                capture_output=True, text=True)
    if result.returncode != 0:
        raise LibraryNotFound(f"building {built} failed (a C compiler and make are needed):\n{result.stderr}")
    return built
