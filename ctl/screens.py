"""What nvsharectl draws: the status screen (compact, for 80x24, or wide), event lines and the
words for durations and sizes. Reads documents (docs/protocol.md), never asks the scheduler.

The compact screen puts what matters first: per GPU one line (mode, quantum, memory, who holds
it and for how much longer, how many wait), then its clients, holders first, waiters in queue
order, idle ones last; weights and priority classes only where they are set. A gang (a
multi-GPU job, or one process on several GPUs) is one line of its own, its ranks named there
and not under each GPU; a GPU it holds says so. Given a height (`status --watch` on a
terminal), it leaves out idle clients first and says how many.
"""

from __future__ import annotations

import time
from datetime import datetime
from typing import Iterable

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from nvshare_py.devicenames import DeviceNames
from nvshare_py.scheduler.fairshare import DEFAULT_PRIORITY, DEFAULT_WEIGHT, SHARE_WINDOW
from nvshare_py.sizes import format_size
from nvshare_py.timeline import client_label, detail_fields, readable_detail


def size(value: int | None) -> str:
    """A size, or '-' where there is none."""
    return "-" if value is None else format_size(value)


def age(seconds: float) -> str:
    """A duration as in `kubectl get`: 7.2s, 3m05s, 1h02m, 2d03h."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    whole = int(seconds)
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"


def clock(unix: float) -> str:
    return datetime.fromtimestamp(unix).strftime("%H:%M:%S.%f")[:-3]


def percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{fraction * 100:.0f}"


def known_devices(status: dict, events: Iterable[dict] = ()) -> list[str]:
    """Every GPU UUID a status document and an event list mention."""
    uuids = {d["device"] for d in status.get("devices", [])}
    for client in status.get("clients", []):
        uuids.update(client.get("devices") or {})
    uuids.update(e["device"] for e in events if e.get("device"))
    return sorted(uuids)


def who(client: dict) -> str:
    """`alice` / `alice team-a/nb-0`: the user and the pod of a client entry."""
    parts = [client.get("user") or (str(client["uid"]) if client.get("uid") is not None else "")]
    if client.get("pod") or client.get("namespace"):
        parts.append(f"{client.get('namespace') or '?'}/{client.get('pod') or '?'}")
    return " ".join(part for part in parts if part) or "-"


def silence(entry: dict, defaults: dict) -> str:
    """", silent 3.1s" for a client that has missed at least two heartbeats (stopped, hung, or
    cut off): the scheduler counts it as holding or waiting until its heartbeat timeout."""
    silent = entry.get("silent", 0.0)
    return f", silent {age(silent)}" if silent > 2 * defaults.get("heartbeat_interval", 1.0) else ""


def header(status: dict, read_only: bool) -> Text:
    scheduler = status.get("scheduler", {})
    defaults = scheduler.get("defaults", {})
    text = Text(f"nvshare-scheduler {scheduler.get('version', '?')}, pid {scheduler.get('pid', '?')}, "
                f"{scheduler.get('socket_dir', '?')}: mode {defaults.get('mode', '?')}, "
                f"TQ {defaults.get('tq', 0):g} s", style="bold")
    if read_only:
        text.append("\nread-only view (the control socket is for root and the scheduler's user)", style="dim")
    return text


def ganged(status: dict) -> dict[str, dict]:
    """The gang entry of each client that is in one (docs/protocol.md, *Status document*)."""
    gangs = {gang["gang"]: gang for gang in status.get("gangs", [])}
    return {c["client"]: gangs[c["gang"]] for c in status.get("clients", []) if c.get("gang") in gangs}


def _gang_name(gang: dict) -> str:
    return f"{gang['gang']} {gang['name']!r}" if gang.get("name") else f"{gang['gang']} (one process)"


def _device_line(device: dict, names: DeviceNames, status: dict) -> Text:
    """`GPU0  on, TQ 30 s, 4.0 of 16.0 GiB, held by c3 alice (12.3s left), 2 waiting`; a gang's
    grant reads `held by gang g1 'job' (…)`."""
    clients = {c["client"]: c for c in status.get("clients", [])}
    gang_of = ganged(status)
    line = Text(names.short(device["device"]), style="bold")
    budget = device.get("budget")
    memory = f"{size(device.get('used'))} of {size(budget)}"
    if device.get("total") and budget != device.get("total"):
        memory += f" (card {size(device['total'])})"
    parts = [device.get("mode", "?"), f"TQ {device.get('tq', 0):g} s", memory]
    if device.get("swapped"):
        parts.append(f"{size(device['swapped'])} swapped out")
    if device.get("headroom"):
        parts.append(f"{size(device['headroom'])} kept free")
    holders = []
    for holder in device.get("holders", []):
        gang = gang_of.get(holder["client"])
        name = (f"gang {_gang_name(gang)}" if gang is not None
                else " ".join(filter(None, (holder["client"], clients.get(holder["client"], {}).get("user")))))
        if device.get("waiters"):  # a quantum ends only while others wait
            name += f" ({age(holder.get('quantum_left', 0.0))} left)"
        if name not in holders:
            holders.append(name)
    if holders:
        parts.append("held by " + ", ".join(holders))
    if device.get("waiters"):
        parts.append(f"{len(device['waiters'])} waiting")
    line.append("  " + ", ".join(parts))
    return line


def _state(usage: dict, client: dict, device: dict, defaults: dict, now: float) -> str:
    """`holding 12.3s`, `waiting 4.0s, silent 3.0s`, `idle 1m5s` (since it last ran), `idle`
    (never ran): the state and how long it lasts."""
    state = usage.get("state", "-")
    since = None
    if state in ("holding", "draining"):
        since = next((h.get("since") for h in device.get("holders", []) if h["client"] == client["client"]), None)
    elif state == "waiting":
        since = next((w.get("since") for w in device.get("waiters", []) if w["client"] == client["client"]), None)
    elif state == "idle":
        since = usage.get("last_ran")
    text = state if since is None else f"{state} {age(max(0.0, now - since))}"
    if state in ("holding", "draining", "waiting"):
        text += silence(client, defaults)
    return text


def _order(device: dict, client: dict) -> tuple[int, int]:
    """Holders first, then waiters in queue order, then the others."""
    name = client["client"]
    if any(h["client"] == name for h in device.get("holders", [])):
        return (0, 0)
    place = next((i for i, w in enumerate(device.get("waiters", [])) if w["client"] == name), None)
    return (1, place) if place is not None else (2, 0)


def _clients_table() -> Table:
    table = Table(box=None, pad_edge=False, padding=(0, 1), show_edge=False, header_style="bold")
    table.add_column("CLIENT", no_wrap=True)
    table.add_column("USER", overflow="fold")
    table.add_column("PROGRAM", overflow="fold", ratio=1)
    table.add_column("PID", no_wrap=True, justify="right")
    table.add_column("STATE", no_wrap=True)
    table.add_column("MEMORY", no_wrap=True, justify="right")
    return table


def _memory(usage: dict) -> str:
    """What a client allocated on a device, and how much of it is swapped out to the host
    (docs/scheduler.md, "Budgets and swapping") when any is."""
    text = size(usage.get("used"))
    if usage.get("swapped") and usage.get("resident") == 0:
        text += " (all swapped out)"
    elif usage.get("swapped"):
        text += f" ({size(usage['swapped'])} swapped out)"
    if usage.get("evicting"):
        text += f" (moving {size(usage['evicting'])} out)"
    if (usage.get("swap") or {}).get("engine") == "migrate":  # its driver lacks the pinned path
        text += " (swaps by prefetch: slow to the host)"
    return text


def _share_lines(device_id: str, members: list[dict]) -> list[Text]:
    """Where weights or classes are set on the device: what each client got of the GPU's lock
    time over the share window and what its settings entitle it to now, and who is served
    first when a higher class contends."""
    if all(c.get("weight", DEFAULT_WEIGHT) == DEFAULT_WEIGHT and c.get("priority", DEFAULT_PRIORITY) == DEFAULT_PRIORITY
           for c in members):
        return []
    parts = []
    notes = []
    for client in members:
        usage = client["devices"][device_id]
        due = [f"due {percent(usage['share'])} %"] if usage.get("share") is not None else []
        if client.get("weight", DEFAULT_WEIGHT) != DEFAULT_WEIGHT:
            due.append(f"weight {client['weight']}")
        if client.get("priority", DEFAULT_PRIORITY) != DEFAULT_PRIORITY:
            due.append(f"class {client['priority']}")
        parts.append(f"{client['client']} {percent(usage.get('achieved'))} %" + (f" ({', '.join(due)})" if due else ""))
        if usage.get("outranked_by"):
            notes.append(f"  {client['client']} is due nothing while class {_top_class(members, usage['outranked_by'])} "
                         f"({', '.join(usage['outranked_by'])}) waits or holds: a higher class goes first, weights "
                         "share the GPU within a class")
    lines = [Text(f"  Shares over {SHARE_WINDOW:g} s: " + ", ".join(parts), style="dim")]
    lines += [Text(note, style="yellow") for note in notes]
    return lines


def _top_class(members: list[dict], names: list[str]) -> int:
    return max((c.get("priority", DEFAULT_PRIORITY) for c in members if c["client"] in names), default=0)


def render_status(status: dict, names: DeviceNames, *, read_only: bool = False, height: int | None = None,
                  width: int = 80, now: float | None = None) -> Group:
    """The compact screen (see the module's docstring). `height`: leave out idle clients, the
    last GPUs' first, until it fits that many lines of `width` columns."""
    now = time.time() if now is None else now
    defaults = status.get("scheduler", {}).get("defaults", {})
    clients = status.get("clients", [])
    devices = {d["device"]: d for d in status.get("devices", [])}
    # GPUs that someone holds or waits for first.
    order = sorted(devices, key=lambda d: (not devices[d].get("holders") and not devices[d].get("waiters"),
                                           names.short(d)))
    gang_of = ganged(status)  # their ranks are on their gang's line, not under each GPU
    members = {device_id: sorted((c for c in clients if device_id in (c.get("devices") or {})
                                  and c["client"] not in gang_of),
                                 key=lambda c: _order(devices[device_id], c)) for device_id in order}

    top: list[RenderableType] = [header(status, read_only)]
    bottom: list[RenderableType] = []
    unplaced = [c for c in clients if not c.get("devices")]
    if unplaced:
        bottom.append(Text("registered, no GPU used yet: " + ", ".join(
            f"{client_label(c['client'], {'user': c.get('user', ''), 'program': c.get('program', '')})}"
            + (f" pid {c['pid']}" if c.get("pid") else "") for c in unplaced)))
    if not devices and not clients:
        bottom.append(Text("no clients: no program uses a GPU through this scheduler now"))
    bottom += [gang_line(gang, names, status) for gang in status.get("gangs", [])]
    bottom += [refused_line(entry) for entry in status.get("refused", [])]
    if status.get("admission"):
        bottom.append(admission_text(status["admission"], names))
    if status.get("truncated"):
        cut = status["truncated"]
        bottom.append(Text(f"the scheduler left out {cut.get('devices', 0)} devices and {cut.get('clients', 0)} "
                           "clients (its answer is limited in size)", style="yellow"))

    def lines(parts: list[RenderableType]) -> int:
        return sum(sum(max(1, -(-len(line) // width)) for line in part.plain.splitlines()) if isinstance(part, Text)
                   else part.row_count + 1 for part in parts if isinstance(part, (Text, Table)))

    idle = {device_id: [c for c in members[device_id] if _order(devices[device_id], c)[0] == 2] for device_id in order}
    left_out = 0
    if height is not None:
        spare = height - lines(top) - lines(bottom) - sum(
            lines([_device_line(devices[d], names, status), *_share_lines(d, members[d])])
            + (len(members[d]) + 1 if members[d] else 0) for d in order)
        if spare < 0:
            spare -= 1  # the line that says how many were left out
        for device_id in reversed(order):
            while spare < 0 and idle[device_id]:
                members[device_id].remove(idle[device_id].pop())
                left_out += 1
                spare += 1 + (not members[device_id])  # the table's heading goes with its last row
    parts = top
    for device_id in order:
        device = devices[device_id]
        parts.append(_device_line(device, names, status))
        if members[device_id]:
            table = _clients_table()
            for client in members[device_id]:
                usage = client["devices"][device_id]
                table.add_row(client["client"], who(client), client.get("program") or "-",
                              str(client.get("pid") or "-"), _state(usage, client, device, defaults, now),
                              _memory(usage))
            parts.append(table)
        parts += _share_lines(device_id, members[device_id])
    parts += bottom
    if left_out:
        parts.append(Text(f"… and {left_out} idle client row{'s' if left_out != 1 else ''} (a taller terminal "
                          "shows them)", style="dim"))
    return Group(*parts)


_GANG_STATES = {
    "holding": "holds its devices",
    "draining": "drains (its devices pass on when every member has released)",
    "waiting": "waits for all its devices",
    "members": "waits for its members",
    "idle": "idle",
}


# Ranks named on a gang's line, at most; the others are counted (`-o wide` lists them all).
GANG_RANKS_SHOWN = 4


def gang_line(gang: dict, names: DeviceNames, status: dict) -> Text:
    """One line per gang (a multi-GPU job, or a process on several GPUs): its ranks, whose and
    which program, on which GPUs with how much memory, and what its turn is doing:
    `gang g1 'job': 2 ranks (c3, c5) of alice, train.py, on GPU0 GPU1, 8.0 GiB; holds its
    devices, 12.3 s of its quantum left`."""
    clients = {c["client"]: c for c in status.get("clients", [])}
    ranks = gang.get("members", [])
    shown = ", ".join(ranks[:GANG_RANKS_SHOWN]) + (f", … {len(ranks) - GANG_RANKS_SHOWN} more"
                                                   if len(ranks) > GANG_RANKS_SHOWN else "")
    count = f"{len(ranks)} of {gang['size']}" if gang.get("size") and gang["size"] != len(ranks) else str(len(ranks))
    who_ = sorted({who(clients[rank]) for rank in ranks if rank in clients})
    programs = sorted({clients[rank].get("program") for rank in ranks if clients.get(rank, {}).get("program")})
    memory = sum(usage.get("used") or 0 for rank in ranks for usage in (clients.get(rank, {}).get("devices") or {}).values())
    gpus = " ".join(names.short(device) for device in gang.get("devices", []))
    state = _GANG_STATES.get(gang.get("state", ""), gang.get("state", ""))
    if gang.get("quantum_left") is not None and gang.get("state") == "holding":
        state += f", {gang['quantum_left']:.1f} s of its quantum left"
    whose = ", ".join(filter(None, (" ".join(who_), ", ".join(programs))))
    ranks_text = f"{count} rank{'s' if count != '1' else ''} ({shown})" if gang.get("name") else shown
    return Text(f"gang {_gang_name(gang)}: {ranks_text}{' of ' + whose if whose else ''}, on {gpus or 'no GPU yet'}"
                f"{', ' + size(memory) if memory else ''}; {state}")


def refused_line(entry: dict) -> Text:
    """Whose processes the scheduler has no connection for now, and why: they wait and connect
    again until a place frees (`nvshare-scheduler --max-clients-per-user` sets how many)."""
    pids = [str(pid) for pid in entry.get("pids", []) if pid]
    count = len(entry.get("pids", [])) or 1
    whom = entry.get("user") or f"uid {entry.get('uid')}"
    if entry.get("pod_uid"):
        whom += f" in pod {entry['pod_uid']}"
    shown = ", ".join(pids[:8]) + (f" and {len(pids) - 8} more" if len(pids) > 8 else "")
    return Text(f"no place for {count} process{'es' if count != 1 else ''} of {whom}"
                + (f" (pid {shown})" if shown else "") + f": {entry.get('reason', '?')} (--max-clients-per-user)",
                style="yellow")


def _wide_table(title: str, columns: list[str]) -> Table:
    table = Table(title=title, title_justify="left", expand=False, box=box.HEAVY_HEAD)
    for column in columns:
        table.add_column(column, overflow="fold")
    return table


def _identity(client: dict) -> str:
    parts = []
    if client.get("namespace") or client.get("pod"):
        parts.append(f"{client.get('namespace') or '?'}/{client.get('pod') or '?'}")
    if client.get("host"):
        parts.append(client["host"])
    if client.get("container"):
        parts.append(client["container"][:12])
    if client.get("program"):
        parts.append(client["program"])
    return " ".join(parts) or "-"


def render_status_wide(status: dict, names: DeviceNames, *, read_only: bool = False,
                       now: float | None = None) -> Group:
    """Every detail: device UUIDs and names, grants, host pids, uids and users, identities,
    totals of time waited and held, grant counts, weights, classes, limits and shares."""
    now = time.time() if now is None else now
    defaults = status.get("scheduler", {}).get("defaults", {})
    parts: list[RenderableType] = [header(status, read_only)]
    scheduler = status.get("scheduler", {})
    parts.append(Text(f"defaults: mode {defaults.get('mode', '?')}, TQ {defaults.get('tq', 0):g} s, "
                      f"grace {defaults.get('grace', 0):g} s, idle release {defaults.get('idle_release', 0):g} s, "
                      f"heartbeat timeout {defaults.get('heartbeat_timeout', 0):g} s"
                      + (", restarted over a previous scheduler's sockets" if scheduler.get("restarted") else "")))
    if status.get("devices"):
        devices = _wide_table("Devices", ["device", "mode", "TQ", "memory used / budget", "holders (time left, state)",
                                          "waiters (in order, waiting for)"])
        for device in status["devices"]:
            holders = [f"{h['client']} #{h.get('grant', '?')} {h.get('quantum_left', 0):.1f} s {h.get('state', '')}"
                       + silence(h, defaults) for h in device.get("holders", [])]
            waiters = [f"{w['client']} {age(max(0.0, now - w['since']))}" if w.get("since") else w["client"]
                       for w in device.get("waiters", [])]
            name = names.long(device["device"]) + (f"\n{device['name']}" if device.get("name") else "")
            budget = size(device.get("budget"))
            if device.get("total") and device.get("budget") != device.get("total"):
                budget += f" (of {size(device['total'])})"
            memory = f"{size(device.get('used'))} / {budget}"
            if device.get("swapped"):
                memory += f"\n{size(device['swapped'])} swapped out"
            if device.get("headroom"):
                memory += f"\n{size(device['headroom'])} kept free"
            if device.get("moved_out") or device.get("moved_in"):
                memory += f"\nmoved {size(device.get('moved_out', 0))} out, {size(device.get('moved_in', 0))} in"
            devices.add_row(name, device.get("mode", ""), f"{device.get('tq', 0):g} s", memory,
                            "\n".join(holders) or "-", "\n".join(waiters) or "-")
        parts.append(devices)
    if status.get("pools"):
        parts.append(Text("swap pools (pinned host memory a user's processes share): " + ", ".join(
            f"{pool['owner']} {size(pool['bytes'])}" for pool in status["pools"])))
    if status.get("clients"):
        clients = _wide_table("Clients", ["client", "gang", "pid", "host pid", "uid", "user", "identity", "device",
                                          "state", "memory", "waited", "held", "grants"])
        shares = _wide_table(f"Shares (achieved over the last {SHARE_WINDOW:g} s)",
                             ["client", "device", "weight", "class", "limit", "share", "achieved", "served first"])
        for client in status["clients"]:
            who_row = [client["client"], client.get("gang") or "-", str(client.get("pid") or "-"),
                       str(client.get("host_pid") or "-"),
                       str(client.get("uid", "-")), client.get("user") or "-", _identity(client)]
            for place, (device_id, usage) in enumerate((client.get("devices") or {"-": {}}).items()):
                row = who_row if place == 0 else [""] * len(who_row)
                ran = usage.get("last_ran") if usage.get("state") == "idle" else None
                clients.add_row(*row, names.short(device_id) if usage else "-",
                                usage.get("state", "-") + (silence(client, defaults) if usage else "")
                                + (f", ran {clock(ran)}" if ran else ""),
                                _memory(usage) if usage else "-",
                                f"{usage.get('wait_total', 0):.1f} s" if usage else "-",
                                f"{usage.get('hold_total', 0):.1f} s" if usage else "-",
                                str(usage.get("grants", "-")) if usage else "-")
                if usage:
                    shares.add_row(client["client"], names.short(device_id), str(client.get("weight", "-")),
                                   str(client.get("priority", "-")), size(usage.get("limit")),
                                   _percent(usage.get("share")), _percent(usage.get("achieved")),
                                   ", ".join(usage.get("outranked_by") or []) or "-")
        parts.append(clients)
        if shares.row_count:
            parts.append(shares)
    else:
        parts.append(Text("no clients: no program uses a GPU through this scheduler now"))
    if status.get("gangs"):
        gangs = _wide_table("Gangs", ["gang", "name", "size", "ranks (pid: GPU state)", "devices", "state", "turn",
                                      "quantum left", "turns"])
        by_id = {c["client"]: c for c in status.get("clients", [])}
        for gang in status["gangs"]:
            left = gang.get("quantum_left")
            ranks = [f"{rank} pid {by_id.get(rank, {}).get('pid') or '-'}: " + (", ".join(
                f"{names.short(device)} {usage.get('state', '-')}"
                for device, usage in (by_id.get(rank, {}).get("devices") or {}).items()) or "no GPU yet")
                for rank in gang.get("members", [])]
            gangs.add_row(gang["gang"], gang.get("name") or "-", str(gang.get("size") or "-"),
                          "\n".join(ranks) or "-",
                          "\n".join(names.long(device) for device in gang.get("devices", [])) or "-",
                          gang.get("state", "-"), str(gang.get("turn") or "-"),
                          "-" if left is None else f"{left:.1f} s", str(gang.get("turns", 0)))
        parts.append(gangs)
    parts += [refused_line(entry) for entry in status.get("refused", [])]
    if status.get("admission"):
        parts.append(admission_text(status["admission"], names, wide=True))
    return Group(*parts)


def _percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{fraction * 100:.1f} %"


def admission_text(admission: dict, names: DeviceNames, wide: bool = False) -> Text:
    """One line of admission figures (`wide`: with each user's or pod's share of the capacity),
    then who waits for how much, in the order they asked."""
    if not admission.get("enabled"):
        return Text("admission: off (allocations never wait)")
    lines = [f"admission: {size(admission.get('reserved'))} of {size(admission.get('capacity'))} reserved, "
             f"spill {size(admission.get('spill'))}, {admission.get('policy')}, timeout {admission.get('timeout', 0):g} s"
             + (f", share {admission.get('share', 1):g}" if wide else "")]
    for waiter in admission.get("waiters", []):
        lines.append(f"  {waiter['client']} waits {waiter['waiting_for']:.1f} s on {names.short(waiter['device'])} "
                     f"for {size(waiter['more'])} more (a total of {size(waiter['bytes'])})")
    return Text("\n".join(lines))


def past_use(events: list[dict], names: DeviceNames) -> Text | None:
    """For a status with no clients: the last GPU use the scheduler's events remember, so that
    "nothing now" is not read as "never"."""
    used = [e for e in events if e.get("device") and e.get("kind") in ("grant", "release", "acquire", "lost")]
    if not used:
        return None
    last = used[-1]
    registered = {e["client"]: e for e in events if e.get("kind") == "register"}
    facts = detail_fields(registered[last["client"]]["detail"]) if last["client"] in registered else {}
    whom = client_label(last["client"], facts)
    return Text(f"last GPU use: {whom} on {names.short(last['device'])} at {clock(last['t'])} "
                "(nvsharectl timeline shows it)", style="dim")


def event_line(event: dict, names: DeviceNames, wide: bool = False) -> str:
    """One event as `nvsharectl events` prints it: seq, time, kind, then its facts."""
    fields = [f"{event['seq']:>6}", clock(event["t"]), f"{event['kind']:<10}"]
    if event.get("device"):
        fields.append(f"device={names.long(event['device']) if wide else names.short(event['device'])}")
    if event.get("client"):
        fields.append(f"client={event['client']}")
    if event.get("grant"):
        fields.append(f"grant={event['grant']}")
    if event.get("detail"):
        fields.append(f"detail={readable_detail(event['kind'], event['detail'])}")
    return " ".join(fields)
