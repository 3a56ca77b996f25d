"""The lock core's settings (CoreConfig), checked when made, and the one conversion of its
seconds into the milliseconds the protocol carries. The daemon makes a CoreConfig from its own
settings (config.py); the core and the rules beside it read it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .. import protocol
from ..vocabulary import MODE
from . import eviction
from .admission import AdmissionConfig
from .events import Mode

__all__ = ["CoreConfig", "check_seconds", "ms"]


def ms(seconds: float) -> int:
    """Seconds as the protocol's milliseconds (WELCOME, GRANT, DROP, CONTENDED, ...)."""
    return round(seconds * 1000)


def check_seconds(name: str, value: float, *, allow_zero: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number of seconds, not {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'} seconds, not {value!r}")
    if ms(value) > protocol.MAX_INT:
        raise ValueError(f"{name} of {value!r} seconds is too large")


@dataclass(frozen=True)
class CoreConfig:
    mode: Mode = "on"
    tq: float = 30.0  # time quantum, seconds
    grace: float = 5.0  # seconds between DROP and REVOKE
    heartbeat_interval: float = 1.0  # sent to clients in WELCOME
    heartbeat_timeout: float = 5.0  # no message for this long -> the client is gone
    idle_release: float = 1.0  # sent to clients in WELCOME; 0: holders never release early
    # While others wait, the idle window of a holder whose release would move none of its
    # memory (CONTENDED idle_ms=, residency.idle_ms); 0: the holder's own window.
    idle_release_contended: float = 0.1
    recovery: float = 0.0  # > 0 only when restarting over a previous daemon's clients
    # Budgets move memory at handoffs (residency.py). False: nothing is ever asked to move, as
    # before issue 8 (the fault-driven baseline of benchmarks/bench_colocation.py).
    swapping: bool = True
    admission: AdmissionConfig = AdmissionConfig()  # off unless a spill is given
    # What `set-admission spill=auto` sets: the daemon's measurement of the host (a share of its
    # MemAvailable when it started); None: not measured, and `auto` is refused.
    auto_spill: int | None = None
    # Weights and priorities (fairshare.py): the shortest quantum a light or outranked holder
    # gets, and grants per class of ageing (0: none).
    min_quantum: float = 1.0
    ageing: int = 4
    # How long a gang that said its size waits for missing members after one of them asked
    # (gangs.py): then it runs with those present, and says so.
    gang_wait: float = 30.0
    # Bytes kept free on a device under memory pressure while nobody waits (eviction.py);
    # None: `auto`, the largest tenant that is out, at most a quarter of the budget.
    headroom: int | None = None
    # The order idle tenants are evicted in within a priority class (eviction.ORDERS): `lru2`,
    # the use before the last one, or `lru`, the last use.
    eviction_order: str = "lru2"

    def __post_init__(self) -> None:
        if self.mode not in MODE:
            raise ValueError(f"mode must be {MODE.describe()}, not {self.mode!r}")
        check_seconds("tq", self.tq, allow_zero=False)
        check_seconds("grace", self.grace, allow_zero=True)
        check_seconds("heartbeat_interval", self.heartbeat_interval, allow_zero=False)
        check_seconds("heartbeat_timeout", self.heartbeat_timeout, allow_zero=False)
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise ValueError("heartbeat_timeout must be longer than heartbeat_interval")
        check_seconds("idle_release", self.idle_release, allow_zero=True)
        check_seconds("idle_release_contended", self.idle_release_contended, allow_zero=True)
        check_seconds("recovery", self.recovery, allow_zero=True)
        check_seconds("min_quantum", self.min_quantum, allow_zero=False)
        check_seconds("gang_wait", self.gang_wait, allow_zero=True)
        if isinstance(self.ageing, bool) or not isinstance(self.ageing, int) or not 0 <= self.ageing <= 1_000_000:
            raise ValueError(f"ageing must be a whole number of grants from 0 to 1000000, not {self.ageing!r}")
        if self.eviction_order not in eviction.ORDERS:
            raise ValueError(f"eviction_order must be one of {', '.join(eviction.ORDERS)}, not {self.eviction_order!r}")
        if self.headroom is not None and (isinstance(self.headroom, bool) or not isinstance(self.headroom, int)
                                          or not 0 <= self.headroom <= protocol.MAX_INT):
            raise ValueError(f"headroom must be a number of bytes or None (auto), not {self.headroom!r}")
