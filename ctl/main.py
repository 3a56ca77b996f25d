"""nvsharectl: steer and inspect a running nvshare-scheduler through its control socket.

Exit codes: 0 ok; 1 the scheduler refused the request (its message is shown); 2 usage error;
3 the scheduler is not running (no socket, connection refused, or no answer within --timeout);
4 permission denied (the socket is not accessible to you, or the scheduler said forbidden).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

import typer
from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from nvshare_py import timeline as timelines
from nvshare_py.clikit import (
    APP_SETTINGS, TQ_MAX, TQ_MIN, VERSION_OPTION, number_between, tolerate_narrow_encoding, whole_number,
)
from nvshare_py.control import EXIT_REFUSED, EXIT_USAGE, TIMEOUT_MAX, ControlConnection, ControlFailure
from nvshare_py.paths import ENV_SOCKET_DIR, SocketPaths
from nvshare_py.protocol import CONTROL_EVENTS_MAX
from nvshare_py.scheduler.fairshare import (
    DEFAULT_WEIGHT, PRIORITY_MAX, PRIORITY_MIN, SHARE_WINDOW, WEIGHT_MAX, WEIGHT_MIN,
)
from nvshare_py.sizes import parse_size

app = typer.Typer(
    **APP_SETTINGS,
    no_args_is_help=True,
    help="Steer and inspect nvshare-scheduler. Exit codes: 0 ok, 1 refused by the scheduler, "
    "2 usage error, 3 scheduler not running, 4 permission denied.",
)
# Piped output is not squeezed to 80 columns (`--wide` device UUIDs alone take 40).
stdout = Console(highlight=False, width=None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 160)
EXIT_INTERRUPTED = 130

# The scheduler's ring holds the last 10 000 events, and that is also its largest page.


def format_bytes(size: int | None) -> str:
    if not size:
        return "-" if size is None else "0"
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


def format_time(unix: float) -> str:
    return datetime.fromtimestamp(unix).strftime("%H:%M:%S.%f")[:-3]


@dataclass
class Settings:
    paths: SocketPaths
    timeout: float

    def connect(self) -> ControlConnection:
        return ControlConnection(self.paths, self.timeout)


def _fail(failure: ControlFailure) -> None:
    typer.echo(f"nvsharectl: {failure}", err=True)
    raise typer.Exit(failure.exit_code)


def _call(ctx: typer.Context, op: str, **fields: Any) -> Any:
    try:
        with ctx.obj.connect() as connection:
            return connection.request(op, **fields)
    except ControlFailure as failure:
        _fail(failure)


@app.callback()
def options(
    ctx: typer.Context,
    socket_dir: Optional[Path] = typer.Option(
        None, envvar=ENV_SOCKET_DIR, readable=False, help="The scheduler's socket directory [default: as nvshare-scheduler]"
    ),
    timeout: float = typer.Option(5.0, parser=number_between(0.001, TIMEOUT_MAX),
                                  help="Seconds to wait for the scheduler's answer"),
    version: bool = VERSION_OPTION,
) -> None:
    ctx.obj = Settings(SocketPaths.resolve(socket_dir), timeout)


DEVICE_OPTION = typer.Option(
    None, "--device", help="A device: GPU<n> as status shows it, or its UUID; without it the default and every device change"
)


def resolve_device(ctx: typer.Context, device: str | None) -> str | None:
    """The UUID of a device given as status names it (GPU0) or by UUID (passed on as given)."""
    if device is None or not re.fullmatch(r"GPU\d+", device):
        return device
    labels = device_labels(_call(ctx, "status"))
    found = [uuid for uuid, label in labels.items() if label == device]
    if not found:
        # A GPU no program has used yet (a budget set at boot): this machine's NVML numbers it.
        found = [uuid for uuid, index in _nvml_indices().items() if f"GPU{index}" == device]
    if not found:
        shown = ", ".join(sorted(labels.values())) or "none yet"
        typer.echo(f"nvsharectl: there is no device {device} (the scheduler knows: {shown}; a GPU no program "
                   f"has used yet is named by its UUID, as nvidia-smi -L prints it)", err=True)
        raise typer.Exit(EXIT_REFUSED)
    return found[0]


@app.command("set-tq")
def set_tq(
    ctx: typer.Context,
    seconds: float = typer.Argument(..., parser=number_between(TQ_MIN, TQ_MAX), metavar="SECONDS",
                                    help=f"Time quantum in seconds, from {TQ_MIN:g} to {TQ_MAX:g} (a day)"),
    device: Optional[str] = DEVICE_OPTION,
) -> None:
    """Set the time quantum."""
    result = _call(ctx, "set-tq", seconds=seconds, device=resolve_device(ctx, device))
    typer.echo(f"time quantum of {result['device'] or 'every device'}: {result['tq']:g} s")


def _set_mode(ctx: typer.Context, mode: str, device: str | None) -> None:
    result = _call(ctx, "set-mode", mode=mode, device=resolve_device(ctx, device))
    typer.echo(f"mode of {result['device'] or 'every device'}: {result['mode']}")


@app.command("on")
def mode_on(ctx: typer.Context, device: Optional[str] = DEVICE_OPTION) -> None:
    """Serialise: one process holds a GPU at a time."""
    _set_mode(ctx, "on", device)


@app.command("off")
def mode_off(ctx: typer.Context, device: Optional[str] = DEVICE_OPTION) -> None:
    """Stop scheduling: every process runs at once."""
    _set_mode(ctx, "off", device)


@app.command("auto")
def mode_auto(ctx: typer.Context, device: Optional[str] = DEVICE_OPTION) -> None:
    """Run processes side by side while their memory fits the device's budget."""
    _set_mode(ctx, "auto", device)


@app.command("set-budget")
def set_budget(
    ctx: typer.Context,
    size: str = typer.Argument(..., metavar="BYTES|default", help="Memory budget, e.g. 60G, 512M, or 'default' for the device's total"),
    device: str = typer.Option(..., "--device", help="The device: GPU<n> as status shows it, or its UUID"),
) -> None:
    """Set the memory the device's clients may keep resident at once (at most the device's memory):
    handoffs over it swap in bulk, and auto mode fits holders into it."""
    if size.strip().lower() == "default":
        budget = None
    else:
        try:
            budget = parse_size(size)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="BYTES") from None
    uuid = resolve_device(ctx, device)
    known = next((d for d in _call(ctx, "status")["devices"] if d["device"] == uuid), None)
    if budget is not None and known is not None and known.get("total") and budget > known["total"]:
        # A budget is a promise that the holders' memory fits the card; a larger one lets auto
        # mode run more programs side by side than fit, and they thrash.
        typer.echo(f"nvsharectl: {format_bytes(budget)} is more than the {format_bytes(known['total'])} of memory "
                   f"{device} has: give at most {format_bytes(known['total'])}, or 'default' for all of it", err=True)
        raise typer.Exit(EXIT_USAGE)
    result = _call(ctx, "set-budget", device=uuid, bytes=budget)
    shown = "the device's total" if result["budget"] is None else format_bytes(result["budget"])
    typer.echo(f"memory budget of {result['device']}: {shown}")


@app.command("set-admission")
def set_admission(
    ctx: typer.Context,
    spill: Optional[str] = typer.Option(None, metavar="BYTES|off",
                                        help="Host memory allowed beyond the devices' budgets, e.g. 64G; off: no admission"),
    policy: Optional[str] = typer.Option(None, help="fifo, best-fit, recent or random: who of the waiting allocations goes first"),
    timeout: Optional[float] = typer.Option(None, help="Seconds an allocation waits for admission before it fails"),
) -> None:
    """Change admission: what the node's clients may hold (the devices' budgets plus a host
    spill), and how allocations past it wait (docs/scheduler.md, Admission)."""
    request: dict[str, Any] = {}
    if spill is not None:
        try:
            request["spill"] = None if spill.strip().lower() == "off" else parse_size(spill)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--spill") from None
    if policy is not None:
        request["policy"] = policy
    if timeout is not None:
        request["timeout"] = timeout
    result = _call(ctx, "set-admission", **request)
    spill_shown = "off" if result["spill"] is None else format_bytes(result["spill"])
    typer.echo(f"admission: spill {spill_shown}, policy {result['policy']}, timeout {result['timeout']:g} s")


# --- per-client settings -------------------------------------------------------------------

CLIENT_OPTION = typer.Option(None, "--client", metavar="cN", help="One client, by its id in status (c3)")
POD_UID_OPTION = typer.Option(None, "--pod-uid", metavar="UID",
                              help="Every client of the Kubernetes pod with this UID, now and later")
UNSET = "none"


def _setting_target(client: str | None, pod_uid: str | None) -> dict:
    if client is not None and pod_uid is not None:
        raise typer.BadParameter("give --client or --pod-uid, not both", param_hint="--client")
    return {"client": client, "pod_uid": pod_uid}


def _whom(result: dict) -> str:
    if result.get("client"):
        return f"client {result['client']}"
    if result.get("pod_uid"):
        return f"pod {result['pod_uid']}"
    return "the default"


def _setting_value(text: str, low: int, high: int, name: str) -> int | None:
    if text.strip().lower() == UNSET:
        return None
    try:
        return whole_number(low, high, name)(text)
    except typer.BadParameter as exc:
        raise typer.BadParameter(f"{exc} (or {UNSET!r} to remove the setting)", param_hint=name.upper()) from None


@app.command("set-weight")
def set_weight(
    ctx: typer.Context,
    weight: str = typer.Argument(..., metavar="WEIGHT|none",
                                 help=f"Share of GPU time relative to the others, {WEIGHT_MIN} to {WEIGHT_MAX}; "
                                      f"'{UNSET}' removes a client's or pod's setting (the default goes back to "
                                      f"{DEFAULT_WEIGHT})"),
    client: Optional[str] = CLIENT_OPTION,
    pod_uid: Optional[str] = POD_UID_OPTION,
) -> None:
    """Set the weight: busy clients share a GPU's time in proportion to their weights."""
    value = _setting_value(weight, WEIGHT_MIN, WEIGHT_MAX, "weight")
    result = _call(ctx, "set-weight", weight=value, **_setting_target(client, pod_uid))
    typer.echo(f"weight of {_whom(result)}: {UNSET if result['weight'] is None else result['weight']}")


@app.command("set-priority")
def set_priority(
    ctx: typer.Context,
    priority: str = typer.Argument(..., metavar="PRIORITY|none",
                                   help=f"Priority class, {PRIORITY_MIN} to {PRIORITY_MAX}, higher served first; "
                                        f"'{UNSET}' removes a client's or pod's setting"),
    client: Optional[str] = CLIENT_OPTION,
    pod_uid: Optional[str] = POD_UID_OPTION,
) -> None:
    """Set the priority class: a waiting higher class is served first and cuts a lower holder's quantum short."""
    value = _setting_value(priority, PRIORITY_MIN, PRIORITY_MAX, "priority")
    result = _call(ctx, "set-priority", priority=value, **_setting_target(client, pod_uid))
    typer.echo(f"priority class of {_whom(result)}: {UNSET if result['priority'] is None else result['priority']}")


@app.command("set-limit")
def set_limit(
    ctx: typer.Context,
    size: str = typer.Argument(..., metavar="BYTES|none",
                               help=f"Memory limit, e.g. 8G, 512M; '{UNSET}' removes the setting (no limit)"),
    client: Optional[str] = CLIENT_OPTION,
    pod_uid: Optional[str] = POD_UID_OPTION,
    device: Optional[str] = typer.Option(None, "--device", help="Only this device (GPU<n> or UUID) [default: every device]"),
) -> None:
    """Set a memory limit: allocations past it fail with out-of-memory (it only lowers NVSHARE_MEMORY_LIMIT)."""
    if size.strip().lower() == UNSET:
        limit = None
    else:
        try:
            limit = parse_size(size)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="BYTES") from None
    target = _setting_target(client, pod_uid)
    result = _call(ctx, "set-limit", bytes=limit, device=resolve_device(ctx, device), **target)
    where = result["device"] or "every device"
    typer.echo(f"memory limit of {_whom(result)} on {where}: {UNSET if result['bytes'] is None else format_bytes(result['bytes'])}")


# --- status --------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _nvml_indices() -> dict[str, int]:
    """UUID -> NVML index of this machine's GPUs (the numbers nvidia-smi shows); empty where
    NVML cannot be loaded (no driver, or nvsharectl runs on another machine than its GPUs)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            indices = {}
            for index in range(pynvml.nvmlDeviceGetCount()):
                uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(index))
                indices[uuid.decode() if isinstance(uuid, bytes) else uuid] = index
            return indices
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # pynvml.NVMLError and its library-not-found kin: no indices, not a failure
        return {}


def device_labels(status: dict) -> dict[str, str]:
    """Short names for the devices of a status document: GPU<n>, n being the GPU's NVML index
    (as nvidia-smi numbers them) where this machine's NVML knows every device, else its place
    among the devices sorted by UUID. `--device` accepts them; `--wide` shows the UUIDs."""
    uuids = {d["device"] for d in status.get("devices", [])}
    for client in status.get("clients", []):
        uuids.update(client.get("devices") or {})
    ordered = sorted(uuids)
    indices = _nvml_indices()
    if not all(uuid in indices for uuid in ordered):
        indices = {uuid: place for place, uuid in enumerate(ordered)}
    return {uuid: f"GPU{indices[uuid]}" for uuid in ordered}


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


def _table(title: str, columns: list[str], wide: bool) -> Table:
    # Cells fold rather than end in "…": a cut client id or pid is useless.
    table = Table(title=title, title_justify="left", expand=False, box=box.HEAVY_HEAD if wide else box.SIMPLE_HEAD,
                  pad_edge=wide)
    for column in columns:
        table.add_column(column, overflow="fold")
    return table


def silence_note(entry: dict, defaults: dict) -> str:
    """" silent N s" for a client that has missed at least two heartbeats (stopped, hung, or cut
    off): the scheduler still counts it as holding or waiting until its heartbeat timeout."""
    silent = entry.get("silent", 0.0)
    return f" silent {silent:.1f} s" if silent > 2 * defaults.get("heartbeat_interval", 1.0) else ""


def render_status(status: dict, wide: bool = False) -> Group:
    """The status document for a person: at most 80 columns by default (short device names,
    fewer columns); `wide` adds UUIDs, host pids, uids, identities and grant counts."""
    scheduler = status.get("scheduler", {})
    defaults = scheduler.get("defaults", {})
    labels = device_labels(status)
    header = Text(
        f"nvshare-scheduler {scheduler.get('version', '?')}, pid {scheduler.get('pid', '?')}, "
        f"socket directory {scheduler.get('socket_dir', '?')}\n"
        f"defaults: mode {defaults.get('mode', '?')}, TQ {defaults.get('tq', 0):g} s, grace {defaults.get('grace', 0):g} s"
    )
    parts: list[Any] = [header]

    if not status.get("devices"):
        parts.append(Text("no devices: no program has used a GPU through this scheduler yet"))
    else:
        devices = _table("Devices", ["device", "mode", "TQ", "memory used / budget", "holders (time left, state)",
                                     "waiters (in order)"], wide)
        for device in status["devices"]:
            holders = [" ".join([h["client"], *([f"#{h['grant']}"] if wide else []), f"{h['quantum_left']:.1f} s",
                                 h["state"]]) + silence_note(h, defaults) for h in device.get("holders", [])]
            name = labels[device["device"]]
            if wide:
                name += f"\n{device['device']}" + (f"\n{device['name']}" if device.get("name") else "")
            budget = format_bytes(device.get("budget"))
            if device.get("total") and device.get("budget") != device.get("total"):
                budget += f" (of {format_bytes(device['total'])})"
            devices.add_row(name, device.get("mode", ""), f"{device.get('tq', 0):g} s",
                            f"{format_bytes(device.get('used'))} / {budget}", "\n".join(holders) or "-",
                            ", ".join(w["client"] for w in device.get("waiters", [])) or "-")
        parts.append(devices)

    admission = status.get("admission")
    if admission:
        parts.append(_admission_text(admission, labels))

    if not status.get("clients"):
        parts.append(Text("no clients"))
        return Group(*parts)
    columns = ["client", "pid", "program", "device", "state", "memory", "waited", "held"]
    if wide:
        columns = ["client", "pid", "host pid", "uid", "identity", "device", "state", "memory", "waited", "held",
                   "grants"]
    clients = _table("Clients", columns, wide)
    for client in status["clients"]:
        if wide:
            who = [client["client"], str(client.get("pid", "")), str(client.get("host_pid") or "-"),
                   str(client.get("uid", "-")), _identity(client)]
        else:
            program = client.get("program") or "-"
            if client.get("pod"):
                program += f" ({client.get('namespace') or '?'}/{client['pod']})"
            who = [client["client"], str(client.get("pid", "")), program]
        for place, (device, usage) in enumerate((client.get("devices") or {"-": {}}).items()):
            row = who if place == 0 else [""] * len(who)
            cells = [
                (device if wide else labels.get(device, device)),
                usage.get("state", "-") + silence_note(client, defaults),
                _memory_cell(usage),
                f"{usage.get('wait_total', 0):.1f} s" if usage else "-",
                f"{usage.get('hold_total', 0):.1f} s" if usage else "-",
            ]
            if wide:
                cells.append(str(usage.get("grants", "-")))
            clients.add_row(*row, *cells)
    parts.append(clients)
    shares = _table(f"Shares (achieved over the last {SHARE_WINDOW:g} s)",
                    ["client", "device", "weight", "class", "limit", "share", "achieved"], wide)
    for client in status["clients"]:
        for device, usage in (client.get("devices") or {}).items():
            shares.add_row(client["client"], device if wide else labels.get(device, device),
                           str(client.get("weight", "-")), str(client.get("priority", "-")),
                           format_bytes(usage.get("limit")) if usage.get("limit") else "-",
                           _percent(usage.get("share")), _percent(usage.get("achieved")))
    if shares.row_count:
        parts.append(shares)
    return Group(*parts)


def _memory_cell(usage: dict) -> str:
    """A client's memory on a device: what it allocated, and how much of it is swapped out to
    the host (docs/scheduler.md, "Budgets and swapping") when any is."""
    text = format_bytes(usage.get("used"))
    if usage.get("swapped"):
        text += f" ({format_bytes(usage['swapped'])} swapped out)"
    if (usage.get("swap") or {}).get("engine") == "migrate":  # its driver lacks the pinned path
        text += " (swaps by prefetch: slow to the host)"
    return text


def _admission_text(admission: dict, labels: dict) -> Text:
    """One line of admission figures, then who waits for how much, in the order they asked."""
    if not admission.get("enabled"):
        return Text("admission: off (allocations never wait)")
    lines = [f"admission: {format_bytes(admission.get('reserved'))} of {format_bytes(admission.get('capacity'))} "
             f"reserved (spill {format_bytes(admission.get('spill'))}), policy {admission.get('policy')}, "
             f"timeout {admission.get('timeout', 0):g} s"]
    for waiter in admission.get("waiters", []):
        lines.append(f"  {waiter['client']} waits {waiter['waiting_for']:.1f} s on "
                     f"{labels.get(waiter['device'], waiter['device'])} for {format_bytes(waiter['more'])} more "
                     f"(a total of {format_bytes(waiter['bytes'])})")
    return Text("\n".join(lines))


def _percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{fraction * 100:.1f} %"


def _interrupted() -> typer.Exit:
    """Ctrl-C ends --watch and --follow as it ends other commands: exit status 130."""
    return typer.Exit(EXIT_INTERRUPTED)


@app.command("status")
def status_command(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="Print the status document as JSON (device UUIDs, every field)"),
    wide: bool = typer.Option(False, "--wide", "-w", help="Also device UUIDs, host pids, uids, identities, grants"),
    watch: bool = typer.Option(False, "--watch", help="Refresh until interrupted (Ctrl-C exits 130)"),
    interval: float = typer.Option(1.0, "--interval", parser=number_between(0.05, 3600.0),
                                   help="Seconds between refreshes with --watch"),
) -> None:
    """Show devices, lock holders, waiters and clients."""
    settings: Settings = ctx.obj
    try:
        with settings.connect() as connection:
            if not watch:
                status = connection.request("status")
                if as_json:
                    typer.echo(json.dumps(status, indent=2))
                else:
                    stdout.print(render_status(status, wide))
                return
            if as_json:
                while True:
                    typer.echo(json.dumps(connection.request("status")), nl=True)
                    time.sleep(interval)
            if not stdout.is_terminal:  # a log of snapshots rather than a redrawn screen
                while True:
                    stdout.print(render_status(connection.request("status"), wide))
                    time.sleep(interval)
            with Live(render_status(connection.request("status"), wide), console=stdout, auto_refresh=False) as live:
                while True:
                    time.sleep(interval)
                    live.update(render_status(connection.request("status"), wide), refresh=True)
    except ControlFailure as failure:
        _fail(failure)
    except KeyboardInterrupt:
        raise _interrupted() from None


# --- events --------------------------------------------------------------------------------


def format_event(event: dict) -> str:
    fields = [f"{event['seq']:>6}", format_time(event["t"]), f"{event['kind']:<10}"]
    for key in ("device", "client"):
        if event.get(key):
            fields.append(f"{key}={event[key]}")
    if event.get("grant"):
        fields.append(f"grant={event['grant']}")
    if event.get("detail"):
        fields.append(f"detail={event['detail']}")
    return " ".join(fields)


@app.command("events")
def events_command(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="JSON: the whole answer, or one event per line with --follow"),
    since: int = typer.Option(0, "--since", parser=whole_number(0), help="First sequence number to show"),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new events until interrupted"),
    interval: float = typer.Option(0.5, "--interval", parser=number_between(0.05, 3600.0),
                                   help="Seconds between polls with --follow (Ctrl-C exits 130)"),
) -> None:
    """Show the scheduler's lock timeline (the last 10 000 events)."""
    settings: Settings = ctx.obj
    try:
        with settings.connect() as connection:
            answer = connection.request("events", since=since, limit=CONTROL_EVENTS_MAX)
            if as_json and not follow:
                typer.echo(json.dumps(answer, indent=2))
                return
            while True:
                for event in answer["events"]:
                    typer.echo(json.dumps(event) if as_json else format_event(event))
                if not follow:
                    return
                time.sleep(interval)
                answer = connection.request("events", since=answer["next"], limit=CONTROL_EVENTS_MAX)
    except ControlFailure as failure:
        _fail(failure)
    except KeyboardInterrupt:
        raise _interrupted() from None


# --- timeline ------------------------------------------------------------------------------

DEFAULT_TIMELINE_SECONDS = 300.0


def _client_names(status: dict) -> dict[str, str]:
    """Row names for the clients still registered: id, program and pid."""
    names = {}
    for client in status.get("clients", []):
        parts = [client["client"], client.get("program") or "", f"pid {client['pid']}" if client.get("pid") else ""]
        names[client["client"]] = " ".join(part for part in parts if part)
    return names


@app.command("timeline")
def timeline_command(
    ctx: typer.Context,
    device: Optional[str] = typer.Option(None, "--device", help="Only this device (GPU<n> or UUID)"),
    since: Optional[float] = typer.Option(
        None, "--since", metavar="SECONDS_AGO", parser=number_between(0.001, 1e9),
        help=f"Show the last SECONDS_AGO seconds [default: {DEFAULT_TIMELINE_SECONDS:g}]",
    ),
    show_all: bool = typer.Option(False, "--all", help="Show every event the scheduler keeps (the last 10 000)"),
    json_path: Optional[Path] = typer.Option(
        None, "--json", metavar="FILE", help="Also write the holds, waits, summary and events as JSON ('-': only that, to stdout)"
    ),
    png_path: Optional[Path] = typer.Option(
        None, "--png", metavar="FILE", help="Also draw the timeline into a PNG (needs matplotlib)"
    ),
    width: Optional[int] = typer.Option(
        None, "--width", parser=whole_number(20, 10000), help="Width of the drawing in characters [default: the terminal's]"
    ),
) -> None:
    """Show who held and who waited for each GPU when, as a timeline; export it as JSON or PNG."""
    if show_all and since is not None:
        raise typer.BadParameter("give --since or --all, not both", param_hint="--since")
    if png_path is not None and importlib.util.find_spec("matplotlib") is None:
        typer.echo(f"nvsharectl: --png needs matplotlib: {timelines.PLOT_EXTRA_HINT}", err=True)
        raise typer.Exit(EXIT_USAGE)
    json_to_stdout = json_path is not None and str(json_path) == "-"
    if not json_to_stdout:
        tolerate_narrow_encoding("nvsharectl")
    settings: Settings = ctx.obj
    try:
        with settings.connect() as connection:
            events, _ = connection.events_since(0)
            status = connection.request("status")
    except ControlFailure as failure:
        _fail(failure)
    now = time.time()
    whole = timelines.Timeline.from_events(events, now=now)
    whole.labels.update(_client_names(status))
    device = resolve_device(ctx, device)
    if device is not None:
        if device not in whole.devices() and device not in {d["device"] for d in status.get("devices", [])}:
            typer.echo(f"nvsharectl: unknown-device: no client has announced device {device}", err=True)
            raise typer.Exit(EXIT_REFUSED)
        whole = whole.only_device(device)
    start = whole.start if show_all else max(whole.start, now - (since or DEFAULT_TIMELINE_SECONDS))
    shown = whole.window(start, now)
    console = stdout if width is None else Console(highlight=False, width=width)
    if not json_to_stdout:  # '-' makes stdout the JSON document alone, for pipes
        console.print(timelines.render(shown, width=console.width, title="GPU lock timeline"))
        if shown.intervals:
            console.print(timelines.summary_table(timelines.summarise(shown)))
    try:
        if json_path is not None:
            document = timelines.to_json(shown)
            document["events"] = [
                e for e in events if e["t"] >= start and (device is None or e.get("device") in ("", device))
            ]
            if json_to_stdout:
                typer.echo(json.dumps(document, indent=2))
            else:
                timelines.write_json(json_path, document)
                typer.echo(f"wrote {json_path}")
        if png_path is not None:
            timelines.write_png(png_path, shown, title="GPU lock timeline" + (f" of {device}" if device else ""))
            typer.echo(f"wrote {png_path}")
    except OSError as error:
        typer.echo(f"nvsharectl: cannot write {error.filename}: {error.strerror}", err=True)
        raise typer.Exit(EXIT_USAGE) from None


# The original nvshare's nvsharectl spelled its two settings as options.
_ORIGINAL_SPELLINGS = {"-T": "set-tq", "--set-tq": "set-tq", "-S": None, "--anti-thrash": None}


def translate_original_spelling(argv: list[str]) -> list[str]:
    """`nvsharectl -T 30` and `nvsharectl -S on|off` (the original nvshare's) as this tool's
    commands, saying on stderr how they are spelled here."""
    if not argv or argv[0] not in _ORIGINAL_SPELLINGS:
        return argv
    option, rest = argv[0], argv[1:]
    if _ORIGINAL_SPELLINGS[option] == "set-tq":
        translated = ["set-tq", *rest]
    elif rest and rest[0] in ("on", "off"):
        translated = [rest[0], *rest[1:]]
    else:
        typer.echo(f"nvsharectl: {option} takes on or off; here that is `nvsharectl on` or `nvsharectl off`", err=True)
        raise SystemExit(EXIT_USAGE)
    typer.echo(f"nvsharectl: {option} is the original nvshare's spelling; here it is `nvsharectl {' '.join(translated)}`",
               err=True)
    return translated


def main() -> None:
    app(args=translate_original_spelling(sys.argv[1:]), prog_name="nvsharectl")

