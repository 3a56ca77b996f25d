"""nvshare_py: GPU sharing without memory-size limits."""

__version__ = "0.1.0"
