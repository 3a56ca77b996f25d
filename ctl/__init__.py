"""nvsharectl (installed as the package nvshare_py.ctl): see main.py."""
