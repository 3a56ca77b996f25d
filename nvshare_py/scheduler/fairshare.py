"""Who gets how much GPU time: per-client settings (weight, priority class, memory limit) and
the pure rules the lock core applies with them (lock.py, queue_order.py). No clock, no I/O, no
lock state: the core asks, this module answers (docs/scheduler.md, "Weights and priorities").

Settings are given per client registration ("c3"), per Kubernetes pod (its verified UID,
ClientInfo.pod_uid: every client of the pod, present and future) or as the default; the most
specific one that exists applies (client > pod > default).

Weighted quanta: while clients contend for a device, a holder's quantum is
`tq * weight / heaviest`, `heaviest` being the largest weight among the device's holders and
waiters, and never shorter than the floor `min(min_quantum, tq)`. Contenders are served in turn
(FCFS within a priority class), so over a round each continuously busy client holds the lock
in proportion to its weight, and no quantum is longer than `tq`: the bounded wait of plain
FCFS still holds.

Priority classes 0..7, higher first, with ageing: a waiter's effective class is its class plus
one for every `ageing` grants made on the device while it waited (at most 7), so a low class is
served at the latest after `ageing * 7` grants plus those to waiters that aged before it.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any, Generic, Hashable, Iterable, TypeVar

WEIGHT_MIN, WEIGHT_MAX, DEFAULT_WEIGHT = 1, 1000, 1
PRIORITY_MIN, PRIORITY_MAX, DEFAULT_PRIORITY = 0, 7, 0
# The window over which status reports each client's achieved share of lock time (seconds).
SHARE_WINDOW = 60.0
# Finished holds a pair remembers for its achieved share: a bound, so that a client that
# acquires and releases very often costs no more (its oldest holds then fall out early).
RECENT_HOLDS_MAX = 1024
# Processes whose per-client settings are kept after their registration ended (Settings.park):
# a bound, so that clients registering and leaving cannot grow the daemon's memory.
PARKED_MAX = 4096

V = TypeVar("V")


@dataclass(frozen=True)
class Target:
    """Whom a setting is for: one registration (`client`), every client of a pod (`pod_uid`),
    or neither: the default."""

    client: str | None = None
    pod_uid: str | None = None

    def __post_init__(self) -> None:
        if self.client is not None and self.pod_uid is not None:
            raise ValueError("a setting is for a client or for a pod, not both")

    @property
    def is_default(self) -> bool:
        return self.client is None and self.pod_uid is None

    def describe(self) -> str:
        if self.client is not None:
            return f"client {self.client}"
        if self.pod_uid is not None:
            return f"pod {self.pod_uid}"
        return "the default"


@dataclass
class Layered(Generic[V]):
    """One setting at its three levels. `None` at a client or pod level means "not set there"."""

    default: V
    by_client: dict[str, V] = field(default_factory=dict)
    by_pod: dict[str, V] = field(default_factory=dict)

    def resolve(self, client: str, pod_uid: str) -> V:
        if client in self.by_client:
            return self.by_client[client]
        if pod_uid and pod_uid in self.by_pod:
            return self.by_pod[pod_uid]
        return self.default

    def set(self, target: Target, value: V | None, fallback: V) -> None:
        """`value` None removes a client or pod setting; for the default it restores `fallback`."""
        if target.client is not None:
            _put(self.by_client, target.client, value)
        elif target.pod_uid is not None:
            _put(self.by_pod, target.pod_uid, value)
        else:
            self.default = fallback if value is None else value

    def forget_client(self, client: str) -> None:
        self.by_client.pop(client, None)

    def rename_client(self, old: str, new: str) -> None:
        """A reconnected process (a new registration) keeps what was set for its old one."""
        if old in self.by_client:
            self.by_client.setdefault(new, self.by_client.pop(old))


def _put(table: dict[str, V], key: str, value: V | None) -> None:
    if value is None:
        table.pop(key, None)
    else:
        table[key] = value


class Settings:
    """Every per-client setting. Memory limits are kept per device id (None: every device);
    on one level a device's own limit wins over the one for every device.

    A client's own settings end with its registration, except where its process may come back:
    they are *parked* under the process's kernel-verified identity (uid, host pid, start time)
    and given to the process's next registration (a BYE and a fresh HELLO cannot shed a limit).
    At most PARKED_MAX processes are remembered, the oldest forgotten first."""

    def __init__(self) -> None:
        self.weight: Layered[int] = Layered(DEFAULT_WEIGHT)
        self.priority: Layered[int] = Layered(DEFAULT_PRIORITY)
        self.limits: dict[str | None, Layered[int | None]] = {}
        self._parked: collections.OrderedDict[Hashable, dict[str, Any]] = collections.OrderedDict()

    def set_limit(self, target: Target, device: str | None, value: int | None) -> None:
        self.limits.setdefault(device, Layered(None)).set(target, value, None)
        self._prune_limits()

    def _prune_limits(self) -> None:
        """Devices without any limit left are no longer listed."""
        for device, layered in list(self.limits.items()):
            if layered.default is None and not layered.by_client and not layered.by_pod:
                del self.limits[device]

    def limit(self, client: str, pod_uid: str, device: str) -> int | None:
        """The client's memory limit on the device in bytes; None: none."""
        return self._resolve_limit(client, pod_uid, self.limits.get(device))

    def limit_every(self, client: str, pod_uid: str) -> int | None:
        """The client's memory limit on a device that has no limits of its own."""
        return self._resolve_limit(client, pod_uid, None)

    def limit_devices(self) -> list[str]:
        """The devices that have limits of their own (at any level)."""
        return sorted(device for device in self.limits if device is not None)

    def _resolve_limit(self, client: str, pod_uid: str, own: Layered[int | None] | None) -> int | None:
        every = self.limits.get(None)
        for level in ("client", "pod", "default"):
            for layered in (own, every):
                if layered is None:
                    continue
                if level == "client" and client in layered.by_client:
                    return layered.by_client[client]
                if level == "pod" and pod_uid and pod_uid in layered.by_pod:
                    return layered.by_pod[pod_uid]
                if level == "default" and layered.default is not None:
                    return layered.default
        return None

    def forget_client(self, client: str) -> None:
        for layered in self._layers():
            layered.forget_client(client)
        self._prune_limits()

    def rename_client(self, old: str, new: str) -> None:
        for layered in self._layers():
            layered.rename_client(old, new)

    def park(self, client: str, process: Hashable) -> None:
        """The registration `client` ended while its process may live on: keep its settings for
        the process's next registration (restore)."""
        own: dict[str, Any] = {}
        if client in self.weight.by_client:
            own["weight"] = self.weight.by_client[client]
        if client in self.priority.by_client:
            own["priority"] = self.priority.by_client[client]
        limits = {device: layered.by_client[client] for device, layered in self.limits.items()
                  if client in layered.by_client}
        if limits:
            own["limits"] = limits
        self.forget_client(client)
        if own:
            self._parked[process] = own
            self._parked.move_to_end(process)
            while len(self._parked) > PARKED_MAX:
                self._parked.popitem(last=False)

    def restore(self, process: Hashable, client: str) -> None:
        """A process whose settings were parked registered again as `client`."""
        own = self._parked.pop(process, None)
        if own is None:
            return
        if "weight" in own:
            self.weight.by_client[client] = own["weight"]
        if "priority" in own:
            self.priority.by_client[client] = own["priority"]
        for device, value in own.get("limits", {}).items():
            self.limits.setdefault(device, Layered(None)).by_client[client] = value

    def forget_process(self, process: Hashable) -> None:
        """The process is gone: its parked settings with it."""
        self._parked.pop(process, None)

    def _layers(self) -> Iterable[Layered[Any]]:
        yield self.weight
        yield self.priority
        yield from list(self.limits.values())

    def document(self) -> dict[str, Any]:
        """The settings as the status document shows them (docs/protocol.md)."""
        limits = {device or "*": {"default": layered.default, "pods": dict(layered.by_pod),
                                  "clients": dict(layered.by_client)}
                  for device, layered in self.limits.items()}
        return {
            "weight": {"default": self.weight.default, "pods": dict(self.weight.by_pod),
                       "clients": dict(self.weight.by_client)},
            "priority": {"default": self.priority.default, "pods": dict(self.priority.by_pod),
                         "clients": dict(self.priority.by_client)},
            "limit": limits,
        }


def check_weight(value: object) -> int | None:
    if value is None or (type(value) is int and WEIGHT_MIN <= value <= WEIGHT_MAX):
        return value
    raise ValueError(f"weight must be an integer from {WEIGHT_MIN} to {WEIGHT_MAX}, or null, not {value!r}")


def check_priority(value: object) -> int | None:
    if value is None or (type(value) is int and PRIORITY_MIN <= value <= PRIORITY_MAX):
        return value
    raise ValueError(f"priority must be an integer from {PRIORITY_MIN} to {PRIORITY_MAX}, or null, not {value!r}")


def check_limit(value: object, largest: int) -> int | None:
    if value is None or (type(value) is int and 0 < value <= largest):
        return value
    raise ValueError(f"bytes must be an integer from 1 to {largest}, or null for no limit, not {value!r}")


# --- the rules ---------------------------------------------------------------------------------


def quantum(tq: float, weight: int, heaviest: int, min_quantum: float) -> float:
    """A holder's quantum while others contend: its weight's part of `tq` relative to the
    heaviest contender, at least the floor min(min_quantum, tq)."""
    floor = min(min_quantum, tq)
    return max(floor, tq * weight / max(weight, heaviest))


def effective_class(priority: int, grants_waited: int, ageing: int) -> int:
    """A waiter's class after ageing: one class up per `ageing` grants made while it waited
    (0: no ageing), never above PRIORITY_MAX."""
    if ageing <= 0:
        return priority
    return min(PRIORITY_MAX, priority + grants_waited // ageing)


K = TypeVar("K", bound=Hashable)


def configured_shares(weights: dict[K, int]) -> dict[K, float]:
    """Each contender's share of lock time its weight entitles it to (weights by anything)."""
    total = sum(weights.values())
    return {key: weight / total for key, weight in weights.items()} if total else {}


def held_within(holds: Iterable[tuple[float, float]], start: float, end: float) -> float:
    """Seconds of the (since, until) holds that fall inside [start, end]."""
    return sum(max(0.0, min(until, end) - max(since, start)) for since, until in holds)


Holds = collections.deque[tuple[float, float]]


def remember_hold(recent: Holds, since: float, until: float, now: float) -> None:
    """Add a finished hold and forget those wholly before the share window."""
    recent.append((since, until))
    horizon = now - SHARE_WINDOW
    while recent and recent[0][1] <= horizon:
        recent.popleft()


def new_recent() -> Holds:
    return collections.deque(maxlen=RECENT_HOLDS_MAX)
