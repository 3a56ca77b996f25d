"""The daemon's settings (`nvshare-scheduler`'s options, docs/scheduler.md): checked before
anything is created, and turned into the lock core's CoreConfig."""

from __future__ import annotations

import os
from dataclasses import dataclass

from . import admission
from . import events as ev
from .admission import AdmissionConfig
from .core_config import CoreConfig
from .logs import log
from .metrics_http import parse_address
from .runtime import CLIENT_CONNECTIONS_MAX


# The most client processes per user or pod that can be asked: the largest connection table,
# of which a user gets an eighth at most anyway.
MAX_CLIENTS_PER_USER = CLIENT_CONNECTIONS_MAX


@dataclass(frozen=True)
class DaemonConfig:
    socket_dir: "str | os.PathLike[str] | None" = None  # None: $NVSHARE_SOCKET_DIR or the default
    mode: ev.Mode = "on"
    tq: float = 30.0
    grace: float = 5.0
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 5.0
    idle_release: float = 1.0
    idle_release_contended: float = 0.1  # a waiter behind a holder whose release moves nothing of its own
    recovery: float = 2.0  # only used when a previous daemon's client socket is found
    swapping: bool = True  # budgets move memory at handoffs (docs/scheduler.md, "Budgets and swapping")
    headroom: int | None = None  # bytes kept free under memory pressure; None: auto (eviction.py)
    eviction_order: str = "lru2"  # idle tenants' eviction order within a priority class (eviction.ORDERS)
    min_quantum: float = 1.0  # the shortest quantum of a light or outranked holder (fairshare.py)
    ageing: int = 4  # grants waited per priority class a waiter rises; 0: no ageing
    gang_wait: float = 30.0  # seconds a gang waits for missing members once one asks (gangs.py)
    # Client processes (connections) one user may have outside pods, and one pod, at once
    # (docs/scheduler.md, security model): more GPU processes than one user runs on a node as a
    # rule, and a sixty-fourth of the largest connection table, so that a few users cannot take
    # it all. At most an eighth of the table is served whatever is asked.
    max_clients_per_user: int = 64
    metrics: str | None = None  # HOST:PORT or :PORT to serve Prometheus metrics on; None: off
    # Admission (docs/scheduler.md): host bytes allowed beyond the devices' budgets; "auto":
    # admission.DEFAULT_SPILL_FRACTION of the host's MemAvailable when the daemon starts; None: off.
    admission_spill: int | str | None = "auto"
    admission_policy: str = "fifo"
    admission_timeout: float = admission.DEFAULT_TIMEOUT
    admission_share: float = admission.DEFAULT_SHARE  # of the capacity, one user or pod at most

    def __post_init__(self) -> None:
        # Refuse values the lock core does not accept now, before any directory or socket is
        # touched (a socket left behind would make the next daemon believe it restarted).
        self.core_config(restarted=True)
        if (isinstance(self.max_clients_per_user, bool) or not isinstance(self.max_clients_per_user, int)
                or not 1 <= self.max_clients_per_user <= MAX_CLIENTS_PER_USER):
            raise ValueError(f"max clients per user must be a whole number from 1 to {MAX_CLIENTS_PER_USER}, "
                             f"not {self.max_clients_per_user!r}")
        if self.metrics is not None:
            parse_address(self.metrics)

    def core_config(self, restarted: bool) -> CoreConfig:
        """The lock core's settings; raises ValueError for a value it does not accept."""
        if isinstance(self.admission_spill, str) and self.admission_spill != "auto":
            raise ValueError(f"admission spill {self.admission_spill!r}: give bytes, 'auto' or None")
        auto_spill = host_spill()
        return CoreConfig(
            mode=self.mode,
            tq=self.tq,
            grace=self.grace,
            heartbeat_interval=self.heartbeat_interval,
            heartbeat_timeout=self.heartbeat_timeout,
            idle_release=self.idle_release,
            idle_release_contended=self.idle_release_contended,
            recovery=self.recovery if restarted else 0.0,
            swapping=self.swapping,
            headroom=self.headroom,
            eviction_order=self.eviction_order,
            admission=AdmissionConfig(
                spill=auto_spill if isinstance(self.admission_spill, str) else self.admission_spill,  # "auto"
                policy=self.admission_policy,
                timeout=self.admission_timeout,
                share=self.admission_share,
            ),
            auto_spill=auto_spill,
            min_quantum=self.min_quantum,
            ageing=self.ageing,
            gang_wait=self.gang_wait,
        )


def host_spill(meminfo: str = "/proc/meminfo") -> int:
    """The default host spill: a fraction of the memory the kernel says is available for new
    work without swapping (MemAvailable). 0 when it cannot be read: admission then holds the
    clients to the devices' budgets, which is safe, and the log says so."""
    try:
        with open(meminfo, encoding="ascii") as file:
            for line in file:
                name, _, rest = line.partition(":")
                if name == "MemAvailable":
                    return int(int(rest.split()[0]) * 1024 * admission.DEFAULT_SPILL_FRACTION)
    except (OSError, ValueError, IndexError):
        pass
    log.warning("cannot read MemAvailable from %s: admission spill 0 (set --admission-spill)", meminfo)
    return 0
