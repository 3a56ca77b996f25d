"""nvshare_py: GPU sharing without memory-size limits."""

__version__ = "0.1.0"


def load_ipython_extension(shell) -> None:
    """`%load_ext nvshare_py` (the kernel side is in nvshare_py.ipython, imported only here so
    that importing nvshare_py stays cheap)."""
    from .ipython import load_ipython_extension as load

    load(shell)


def unload_ipython_extension(shell) -> None:
    from .ipython import unload_ipython_extension as unload

    unload(shell)
