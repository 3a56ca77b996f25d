"""The nvshare scheduler: a sans-I/O lock core (core.py, lock.py, events.py) served by a Trio
daemon (daemon.py) that speaks ZMTP itself (zmtp.py; it does not use libzmq). Run it with `nvshare-scheduler` or `python -m nvshare_py.scheduler`."""
