"""Where libnvshare.so, the interceptor, is.

`NVSHARE_LIBRARY` names a built copy explicitly (a development build, a library mounted into a
container); otherwise it is the copy `pip install` built and placed inside this package.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_LIBRARY = "NVSHARE_LIBRARY"
PACKAGED = Path(__file__).resolve().parent / "_lib" / "libnvshare.so"


class LibraryNotFound(FileNotFoundError):
    """libnvshare.so is neither named by NVSHARE_LIBRARY nor installed in the package."""


def path() -> Path:
    """The absolute path of libnvshare.so; LibraryNotFound (with what to do) if there is none."""
    override = os.environ.get(ENV_LIBRARY)
    if override:
        chosen = Path(override).absolute()
        if not chosen.is_file():
            raise LibraryNotFound(f"{ENV_LIBRARY}={override} does not name a file")
        return chosen
    if PACKAGED.is_file():
        return PACKAGED
    raise LibraryNotFound(
        f"libnvshare.so is not installed at {PACKAGED}: install nvshare-py with pip (which builds it "
        f"with make; a C compiler is needed), or build it with `make -C interceptor BUILD=<dir>` and set "
        f"{ENV_LIBRARY}=<dir>/libnvshare.so"
    )
