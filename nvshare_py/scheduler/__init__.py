"""The nvshare scheduler: a sans-I/O lock core (core.py, events.py) served by a Trio + pyzmq
daemon (daemon.py). Run it with `nvshare-scheduler` or `python -m nvshare_py.scheduler`."""
