"""Where the C libraries are: libnvshare.so, the interceptor, and libnvshare_core.so, its client
core alone (what nvshare_py.client drives through ctypes, nvshare_py/client_core.py).

An environment variable names a built copy explicitly (a development build, a library mounted
into a container): `NVSHARE_LIBRARY`, `NVSHARE_CORE_LIBRARY`; otherwise it is the copy
`pip install` built and placed inside this package.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_LIBRARY = "NVSHARE_LIBRARY"
ENV_CORE_LIBRARY = "NVSHARE_CORE_LIBRARY"
PACKAGED = Path(__file__).resolve().parent / "_lib" / "libnvshare.so"
PACKAGED_CORE = PACKAGED.with_name("libnvshare_core.so")


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
    return _find(ENV_CORE_LIBRARY, PACKAGED_CORE)
