"""What the daemon shows of the lock core: the status document of `nvsharectl status`, the
answer to QUERY (docs/protocol.md) and the words of its log lines. Presentation lives here, not
in the core: the core keeps the lock state and names what happened (`Log.what` with its
fields), this module reads the state (never changes it) and decides what is shown, how it is
rounded and worded, and what a QUERY may reveal of other clients.
"""

from __future__ import annotations

import functools
import itertools
import math
import pwd
from typing import Any, Callable, Iterable

from ..sizes import format_size
from . import fairshare, residency
from .core import SchedulerCore
from .lock import AHEAD_REMEMBERED
from .records import Client, Device, Hold, Pair
from .events import Log, LogKind
from .refusals import Refused

# QUERY answers must fit one message: they name at most this many clients per list, and cut
# the texts that clients chose themselves.
QUERY_NAMES_SHOWN = AHEAD_REMEMBERED
QUERY_TEXT_MAX = 48


def status(core: SchedulerCore, now: float, wall: Callable[[float], float]) -> dict[str, Any]:
    """The "devices" and "clients" parts of the status document (docs/protocol.md)."""
    devices = []
    for dev in core.devices():
        holds = [(grant, pair, pair.hold) for grant, pair in dev.holders.items() if pair.hold is not None]
        holds += [(grant, pair, pair.overdue[grant]) for grant, pair in dev.overdue.items()]
        holds.sort(key=lambda item: item[0])
        devices.append({
            "device": dev.id,
            "name": dev.name,
            "total": dev.total,
            "budget": dev.budget,
            "mode": dev.mode,
            "tq": dev.tq,
            "used": dev.used,
            # What the budget holds now (docs/scheduler.md, "Budgets and swapping").
            "resident": sum(residency.footprint(pair) for pair in dev.pairs),
            "swapped": sum(pair.swapped for pair in dev.pairs),
            # Room kept free under memory pressure, and what its clients moved each way so far
            # (docs/scheduler.md, "Many tenants").
            "headroom": dev.headroom,
            "moved_out": dev.moved_out,
            "moved_in": dev.moved_in,
            "holders": [
                {
                    "client": pair.client.cid,
                    "grant": grant,
                    "since": wall(hold.since),
                    "quantum_left": max(0.0, _quantum_end(core, pair, hold) - now),
                    "state": hold.state,
                    # A stopped or hung holder shows here long before its heartbeat timeout.
                    "silent": round(now - pair.client.last_seen, 3),
                }
                for grant, pair, hold in holds
            ],
            "waiters": [{"client": pair.client.cid, "since": wall(pair.waiting_since)} for pair in dev.queue
                        if pair.waiting_since is not None],
        })
    shares = {dev.id: _shares(core, dev, now) for dev in core.devices()}
    clients = []
    for client in core.clients():  # registration order: c1, c2, ...
        info = client.info
        clients.append({
            "client": client.cid,
            "pid": info.pid,
            "host_pid": info.host_pid,
            "uid": info.uid,
            "user": info.user,
            "host": info.host,
            "container": info.container,
            "pod": info.pod,
            "namespace": info.namespace,
            "program": info.program,
            "connected": wall(client.connected),
            "last_seen": wall(client.last_seen),
            "silent": round(now - client.last_seen, 3),
            "pod_uid": info.pod_uid,
            "weight": core.weight(client),
            "priority": core.priority(client),
            "devices": {device_id: dict(_pair_status(pair, now), **_residency_status(pair, wall),
                                        limit=core.limit(pair), **shares[device_id].get(pair, _NO_SHARE))
                        for device_id, pair in client.pairs.items()},
            # Its gang's id (the "gangs" list), None when it is a unit of its own on one device.
            "gang": client.gang.display if client.gang.ganged else None,
        })
    by_key = {client.key: client.cid for client in core.clients()}
    pools = [{"owner": _owner(owner, by_key), "bytes": size} for owner, size in core.pool_sizes().items()]
    return {"devices": devices, "clients": clients, "gangs": gangs_status(core, now, wall), "pools": pools}


def _owner(principal: Any, clients: dict[Any, str]) -> str:
    """A swap pool's owner as status names it: `uid 1000`, `pod <uid>`, or a client's id (a
    client whose uid the daemon cannot see has a pool of its own)."""
    kind, value = principal
    return clients.get(value, "?") if kind == "client" else f"{kind} {value}"


def gangs_status(core: SchedulerCore, now: float, wall: Callable[[float], float]) -> list[dict[str, Any]]:
    """The "gangs" part of the status document: each named gang and each process that is a
    gang of one (it uses several devices), with its members, its devices and its turn."""
    shown = []
    for gang in core.gang_units():
        turn = gang.turn
        live = core.live_grants(turn) if turn is not None else []
        if turn is None:
            waiting = any(pair.gang_queued for pair in gang.pairs())
            state = "waiting" if waiting else "members" if gang.asked_at is not None else "idle"
        else:
            state = "draining" if turn.ending else "holding"
        shown.append({
            "gang": gang.display,
            "name": gang.name,
            "size": gang.size,
            "members": [member.cid for member in gang.members],
            "devices": sorted({pair.device.id for pair in gang.pairs()}),
            "state": state,
            "turn": turn.number if turn is not None else None,
            "since": wall(turn.since) if turn is not None else None,
            "quantum_left": round(max(0.0, core.quantum_end(live[0]) - now), 3) if live else None,
            "turns": gang.turns,
        })
    return shown


def admission_status(core: SchedulerCore, now: float, wall: Callable[[float], float]) -> dict[str, Any]:
    """The "admission" part of the status document: the node's capacity, what is reserved of
    it, and who waits for how much (in the order they asked)."""
    config = core.admission
    return {
        "enabled": config.enabled,
        "policy": config.policy,
        "timeout": config.timeout,
        "spill": config.spill,
        "share": config.share,
        "capacity": core.admission_capacity() if config.enabled else None,
        "reserved": core.admission_reserved(),
        "waiters": [
            {
                "client": waiter.pair.client.cid,
                "device": waiter.pair.device.id,
                "bytes": waiter.bytes,
                "more": max(0, waiter.bytes - core.admission_reservation(waiter.pair)),
                "since": wall(waiter.since),
                "waiting_for": round(now - waiter.since, 3),
            }
            for waiter in core.admission_waiters()
        ],
    }


_NO_SHARE: dict[str, Any] = {"share": None, "achieved": None, "outranked_by": []}


def refused_status(refused: Iterable[Refused], wall: Callable[[float], float]) -> list[dict[str, Any]]:
    """The "refused" part of the status document: whose client processes the daemon has no
    connection for now (connections.ConnectionLimits), how many tried, and why."""
    return [
        {
            "uid": entry.uid,
            "user": user_name(entry.uid),
            "pod_uid": entry.pod_uid,
            "refused": entry.count,
            "since": wall(entry.first),
            "last": wall(entry.last),
            "pids": list(entry.pids),
            "reason": entry.reason,
        }
        for entry in refused
    ]


def _quantum_end(core: SchedulerCore, pair: Pair, hold: Hold) -> float:
    """The current grant's weighted quantum end; a revoked grant's plain one."""
    return core.quantum_end(pair) if pair.hold is hold else hold.since + pair.device.tq


def _shares(core: SchedulerCore, dev: Device, now: float) -> dict[Pair, dict[str, Any]]:
    """Per pair of the device: `share`, the part of the lock time its weight entitles it to
    among those holding or waiting now (None when it does neither), `achieved`, its part of the
    time the device was held in the last SHARE_WINDOW seconds (None when nobody held it then),
    and `outranked_by`, the contenders of a higher priority class, which are served first
    (weights share the time within a class; a lower class gets turns only through ageing), so
    its `share` is 0 while they contend."""
    start = now - fairshare.SHARE_WINDOW
    held = {}
    for pair in dev.pairs:
        holds = list(pair.recent)
        if pair.hold is not None:
            holds.append((pair.hold.since, now))
        held[pair] = fairshare.held_within(holds, start, now)
    total = sum(held.values())
    contenders = set(itertools.chain(dev.holders.values(), dev.queue))
    top = max((core.priority(pair.client) for pair in contenders), default=0)
    served = {pair: core.weight(pair.client) for pair in contenders if core.priority(pair.client) == top}
    configured = fairshare.configured_shares(served)
    first = [pair.client.cid for pair in served]
    shares = {}
    for pair in dev.pairs:
        outranked = pair in contenders and pair not in served
        shares[pair] = {
            "share": 0.0 if outranked else _rounded(configured.get(pair)),
            "achieved": _rounded(held[pair] / total if total > 0 else None),
            "outranked_by": first if outranked else [],
        }
    return shares


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def query(core: SchedulerCore, host_pid: int, now: float) -> dict[str, Any]:
    """The answer to QUERY (docs/protocol.md): the devices of every registration whose
    kernel-verified host pid is `host_pid` (0: not visible, nothing to match), those the
    process holds or waits for first."""
    if not host_pid:
        return {"pid": 0, "clients": [], "devices": []}
    clients = [client for client in core.clients() if client.info.host_pid == host_pid]
    pairs = [pair for client in clients for pair in client.pairs.values()]
    pairs.sort(key=lambda pair: (pair.hold is None and pair.waiting_since is None, pair.device.id))
    return {
        "pid": host_pid,
        "clients": [client.cid for client in clients],
        "devices": [_pair_query(core, pair, now) for pair in pairs],
    }

def _pair_query(core: SchedulerCore, pair: Pair, now: float) -> dict[str, Any]:
    dev = pair.device
    status = _pair_status(pair, now)
    waiting = pair.waiting_since is not None
    last_wait = None
    if pair.last_wait is not None:
        seconds, ahead = pair.last_wait
        last_wait = {"seconds": round(seconds, 3), "held_by": [_named(client) for client in ahead]}
    return {
        "device": dev.id,
        "name": dev.name[:QUERY_TEXT_MAX],
        "client": pair.client.cid,
        "mode": dev.mode,
        "tq": dev.tq,
        "state": status["state"],
        "position": next(i for i, waiter in enumerate(dev.queue, 1) if waiter is pair) if waiting else 0,
        "waiters": len(dev.queue),
        "waiting_for": round(now - pair.waiting_since, 3) if pair.waiting_since is not None else 0.0,
        "wait_total": round(status["wait_total"], 3),
        "hold_total": round(status["hold_total"], 3),
        "grants": status["grants"],
        "used": status["used"],
        "quantum_left": round(max(0.0, core.quantum_end(pair) - now), 3) if pair.hold is not None else None,
        "holders": [dict(_named(holder.client), quantum_left=round(max(0.0, core.quantum_end(holder) - now), 3))
                    for holder in itertools.islice(dev.holders.values(), QUERY_NAMES_SHOWN)],
        "last_wait": last_wait,
    }

def _residency_status(pair: Pair, wall: Callable[[float], float]) -> dict[str, Any]:
    """When the pair last ran (None: it holds a grant now, or never held one), what the
    eviction order reads (least recently used first), and what it was asked to move out and
    has not yet (docs/scheduler.md, "Many tenants")."""
    ran = wall(pair.last_held) if pair.hold is None and pair.last_held > -math.inf else None
    return {"last_ran": ran, "evicting": pair.swap.leaving}


def _pair_status(pair: Pair, now: float) -> dict[str, Any]:
    waiting = pair.waiting_since is not None
    if pair.hold is not None:
        state = pair.hold.state
    elif waiting:
        state = "waiting"
    elif pair.overdue:
        state = "overdue"
    else:
        state = "idle"
    return {
        "used": pair.used,
        "resident": residency.footprint(pair),
        "swapped": pair.swapped,
        "state": state,
        "wait_total": pair.wait_total + (now - pair.waiting_since if pair.waiting_since is not None else 0.0),
        "hold_total": pair.hold_total + (now - pair.hold.since if pair.hold is not None else 0.0),
        "grants": pair.grants,
        # Its swap engine as it reported it (docs/interceptor.md, "Swapping"); None: it did not.
        "swap": {"engine": pair.swap.engine, "area": pair.swap.area, "out_bps": pair.swap.out_bps,
                 "in_bps": pair.swap.in_bps, "pool": pair.swap.pool} if pair.swap.engine else None,
    }


def _named(client: Client) -> dict[str, Any]:
    """How QUERY names another client: its display id, its user (from the kernel's uid) and
    what it says it is."""
    info = client.info
    return {"client": client.cid, "user": info.user[:QUERY_TEXT_MAX], "program": info.program[:QUERY_TEXT_MAX],
            "pod": info.pod[:QUERY_TEXT_MAX], "namespace": info.namespace[:QUERY_TEXT_MAX]}


@functools.lru_cache(maxsize=1024)
def user_name(uid: int | None) -> str:
    """The name of `uid` in the daemon's user database, else the uid as a number; "" for an
    unknown uid (not visible). Cached: the daemon looks a uid up once, not at every
    registration (a lookup may ask a directory service)."""
    if uid is None:
        return ""
    try:
        return pwd.getpwuid(uid).pw_name
    except (KeyError, OverflowError):
        return str(uid)


def _size(value: object) -> str:
    """A size field of a log line in words: bytes as '16.0 GiB'; anything else (total, off,
    None: none) as it is."""
    if isinstance(value, int) and not isinstance(value, bool):
        return format_size(value)
    if isinstance(value, str) and value.isdigit():
        return format_size(int(value))
    return "none" if value is None else str(value)


def _target(fields: dict[str, Any]) -> str:
    return fields["device"] or "every device"


# One sentence per `Log.what` of the core; the fields follow each line as key=value.
WORDING: dict[LogKind, Callable[[dict[str, Any]], str]] = {
    "from-unregistered": lambda f: f"{f['type']} from an unregistered client ignored",
    "unhandled-message": lambda f: f"{f['type']} from {f['client']} ignored: this scheduler has no use for it",
    "second-registration": lambda f: "second registration on one connection ignored",
    "registered": lambda f: f"client {f['client']} registered (pid {f['pid']}, {f['program'] or '?'})",
    "grant-passes": lambda f: f"grant {f['grant']} on {f['device']} passes from {f['predecessor']} to {f['client']}",
    "replaced": lambda f: f"client {f['client']} replaced by {f['successor']} (same process reconnected)",
    "claim-kept": lambda f: f"{f['client']} keeps {f['device']} (grant {f['grant']}) after the restart",
    "claim-refused": lambda f: f"{f['client']} claims {f['device']}, which it does not hold: dropping its claim",
    "device-measured": lambda f: f"{f['device']} has {f['total']} bytes (measured)",
    "released": lambda f: f"{f['client']} released grant {f['grant']} on {f['device']} ({f['reason']})",
    "released-revoked": lambda f: f"{f['client']} released revoked grant {f['grant']} on {f['device']}",
    "released-stale": lambda f: f"{f['client']} released grant {f['grant']} on {f['device']}, which is not current",
    "silent-removed": lambda f: f"client {f['client']} silent for {f['timeout']:g} s: removed",
    "unregistered": lambda f: f"client {f['client']} unregistered ({f['reason']})",
    "recovered": lambda f: "recovery window over: granting locks normally",
    "mode-set": lambda f: f"mode {f['mode']} on {_target(f)}",
    "tq-set": lambda f: f"time quantum {f['seconds']:g} s on {_target(f)}",
    "budget-set": lambda f: f"memory budget of {f['device']}: {_size(f['budget'])}",
    "evict-asked": lambda f: f"{f['client']} asked to evict {_size(f['bytes'])} of {f['device']} ({f['why']})",
    "evict-timeout": lambda f: (f"{f['device']}: no room for {f['client']} after the grace "
                                f"(EVICTED not received from {f['silent'] or 'nobody'}, or what moved was not enough): "
                                "granting anyway, the driver's faults share the memory"),
    "evict-taken-back": lambda f: (f"{f['client']} asked for {f['device']} while its memory moved out: the EVICT is "
                                   f"taken back, it keeps {f['resident']} bytes resident"),
    "evicted-stale": lambda f: f"{f['client']} answered EVICT for {f['device']}, which it does not use",
    "fenced-stale": lambda f: f"FENCED of {f['client']} for grant {f['grant']} on {f['device']} ignored: no fence awaits it",
    "prepare": lambda f: f"{f['client']} told to keep a swap area of {f['bytes']} bytes ready for {f['device']}",
    "pool": lambda f: (f"{f['client']} told that its user's swap pool holds {_size(f['bytes'])}"
                       + (f", to register for {_size(f['need'])} of its own" if f.get("need") is not None else "")),
    "lent": lambda f: (f"{f['client']} granted {f['device']} ahead of {f['ahead_of']}, which brings its memory "
                       "back meanwhile; dropped when that one is back"),
    "prefetch-ahead": lambda f: (f"{f['client']} may bring memory of {f['device']} back ahead of its grant, up to "
                                 f"{f['resident']} bytes resident"),
    "weight-set": lambda f: f"weight of {f['target']}: {f['weight']}",
    "priority-set": lambda f: f"priority class of {f['target']}: {f['priority']}",
    "limit-set": lambda f: f"memory limit of {f['target']} on {f['device'] or 'every device'}: {_size(f['bytes'])}",
    "limit-sent": lambda f: (f"{f['client']} told its memory limit on {f['device'] or 'every device'}: "
                             f"{_size(f['bytes'] or None)}"),
    "revoked": lambda f: f"{f['client']} did not release grant {f['grant']} on {f['device']} in time: revoked",
    "contended": lambda f: (f"{f['client']} told that others wait for {f['device']} "
                            f"({f['quantum_left_ms']} ms of its quantum left)"),
    "granted": lambda f: f"grant {f['grant']} on {f['device']} to {f['client']}",
    "admission-waits": lambda f: (f"{f['client']} waits for admission of {_size(f['bytes'])} on {f['device']} "
                                  f"(node capacity {_size(f['capacity'])})"),
    "admission-refused": lambda f: (f"{f['client']} refused admission of {_size(f['bytes'])} on {f['device']} "
                                    f"({f['reason']}; node capacity {_size(f['capacity'])})"),
    "admission-set": lambda f: (f"admission: spill {_size(f['spill'])}, policy {f['policy']}, timeout {f['timeout']:g} s, "
                                f"share {f['share']:g}"),
    "dropped": lambda f: f"drop grant {f['grant']} of {f['client']} on {f['device']} ({f['reason']})",
    "gang-refused": lambda f: f"{f['client']} registered without its gang {f['gang']!r}: {f['why']}",
    "gang-size-differs": lambda f: (f"{f['client']} says gang {f['gang']} has {f['size']} members; "
                                    f"kept the first member's {f['kept']}"),
    "gang-joined": lambda f: (f"{f['client']} joined gang {f['gang']} ({f['name']!r}, "
                              f"{f['members']} of {f['size'] or 'unsaid'} members)"),
    "gang-waits": lambda f: (f"gang {f['gang']} asked by {f['client']} waits for its members "
                             f"({f['members']} of {f['size']} here)"),
    "gang-incomplete": lambda f: (f"gang {f['gang']} ({f['name']!r}) runs with {f['members']} of its {f['size']} "
                                  f"members: the others did not come within {f['waited']:g} s (--gang-wait)"),
    "turn-granted": lambda f: (f"gang {f['gang']} granted its turn {f['turn']}: {f['devices']} devices "
                               f"for {f['members']} members at once"),
}


def describe(log: Log) -> str:
    """The log line's sentence (its fields are written after it)."""
    return WORDING[log.what](log.fields)
