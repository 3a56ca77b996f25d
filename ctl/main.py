"""nvsharectl: steer and inspect a running nvshare-scheduler.

Reads (status, events, timeline) come from the control socket, or, for a user it is closed to,
the read-only status socket (reading.py); settings go to the control socket. What is drawn is
screens.py's.

Exit codes: 0 ok; 1 the scheduler refused the request (its message is shown); 2 usage error;
3 the scheduler is not running (no socket, connection refused, or no answer within --timeout);
4 permission denied (the socket is not accessible to you, or the scheduler said forbidden).
"""

from __future__ import annotations

import enum
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.live import Live

from nvshare_py import timeline as timelines
from nvshare_py.clikit import (
    APP_SETTINGS, TQ_MAX, TQ_MIN, VERSION_OPTION, NumbersAsValues, number_between, tolerate_narrow_encoding,
    whole_number,
)
from nvshare_py.control import EXIT_REFUSED, EXIT_USAGE, TIMEOUT_MAX, ControlFailure
from nvshare_py.devicenames import DeviceNames, looks_like_index, nvml_uuid
from nvshare_py.paths import ENV_SOCKET_DIR, SocketPaths, split_brain_warning
from nvshare_py.scheduler.fairshare import DEFAULT_WEIGHT, PRIORITY_MAX, PRIORITY_MIN, WEIGHT_MAX, WEIGHT_MIN
from nvshare_py.sizes import format_size, parse_size
from nvshare_py.vocabulary import ADMISSION_POLICY, MODE

from .reading import Reader, Settings, Since, parse_since
from .screens import event_line, known_devices, past_use, render_status, render_status_wide

SETTINGS = APP_SETTINGS.copy()
SETTINGS["add_completion"] = True  # nvsharectl --install-completion: people type its device and client names
app = typer.Typer(
    **SETTINGS,
    no_args_is_help=True,
    help="Steer and inspect nvshare-scheduler. Exit codes: 0 ok, 1 refused by the scheduler, "
    "2 usage error, 3 scheduler not running, 4 permission denied.",
)
# Piped output is not squeezed to 80 columns (`-o wide` device UUIDs alone take 40).
stdout = Console(highlight=False, width=None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 160)
EXIT_INTERRUPTED = 130


def _fail(failure: ControlFailure) -> typer.Exit:
    typer.echo(f"nvsharectl: {failure}", err=True)
    return typer.Exit(failure.exit_code)


def _call(ctx: typer.Context, op: str, **fields: Any) -> Any:
    """One request on the control socket (settings, and what they need to know)."""
    try:
        with ctx.obj.connect() as connection:
            return connection.request(op, **fields)
    except ControlFailure as failure:
        raise _fail(failure) from None


def _complete_socket_paths(ctx: typer.Context) -> Settings:
    """Settings for completion callbacks, which run before the callback fills ctx.obj."""
    root = ctx.find_root().params if ctx.find_root() is not None else {}
    return Settings(SocketPaths.resolve(root.get("socket_dir")), 1.0)


def _complete_devices(ctx: typer.Context, incomplete: str) -> list[str]:
    try:
        with Reader(_complete_socket_paths(ctx)) as reader:
            status = reader.request("status")
    except ControlFailure:
        return []
    names = DeviceNames(known_devices(status))
    return [name for name in (*names.by_uuid.values(), *names.by_uuid) if name.startswith(incomplete)]


def _complete_clients(ctx: typer.Context, incomplete: str) -> list[str]:
    try:
        with Reader(_complete_socket_paths(ctx)) as reader:
            status = reader.request("status")
    except ControlFailure:
        return []
    return [c["client"] for c in status.get("clients", []) if c["client"].startswith(incomplete)]


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


DEVICE_HELP = "A GPU: GPU<n> or n as status shows it (nvidia-smi's number), or its UUID"
DEVICE_OPTION = typer.Option(None, "--device", help=f"{DEVICE_HELP}; without it the default and every device change",
                             autocompletion=_complete_devices)


def resolve_device(ctx: typer.Context, device: str | None) -> tuple[str | None, DeviceNames]:
    """The UUID of a device named as people name it (`GPU0`, `0`, or its UUID, passed on as
    given), and the names of the GPUs the scheduler knows, for the reply."""
    status = _call(ctx, "status")
    names = DeviceNames(known_devices(status))
    if device is None:
        return None, names
    found = names.resolve(device)
    if found is None and looks_like_index(device):
        # Used before but not now (its events remember it), or never used: NVML numbers it.
        try:
            with ctx.obj.connect() as connection:
                events = connection.events_since(0)[0]
        except ControlFailure as failure:
            raise _fail(failure) from None
        names = DeviceNames(known_devices(status, events))
        found = names.resolve(device) or nvml_uuid(device)
        if found is None:
            typer.echo(f"nvsharectl: there is no device {device} (the scheduler knows: {names.shown()}; a GPU no "
                       "program has used yet is named by its UUID, as nvidia-smi -L prints it)", err=True)
            raise typer.Exit(EXIT_REFUSED)
        if found not in names.by_uuid:
            names = DeviceNames([*names.by_uuid, found])
    return found or device, names


def _where(device: str | None, names: DeviceNames) -> str:
    return "every device" if device is None else names.long(device)


@app.command("set-tq", cls=NumbersAsValues)
def set_tq(
    ctx: typer.Context,
    seconds: float = typer.Argument(..., parser=number_between(TQ_MIN, TQ_MAX), metavar="SECONDS",
                                    help=f"Time quantum in seconds, from {TQ_MIN:g} to {TQ_MAX:g} (a day)"),
    device: Optional[str] = DEVICE_OPTION,
) -> None:
    """Set the time quantum."""
    uuid, names = resolve_device(ctx, device)
    result = _call(ctx, "set-tq", seconds=seconds, device=uuid)
    typer.echo(f"time quantum of {_where(result['device'], names)}: {result['tq']:g} s")


def _set_mode(ctx: typer.Context, mode: str, device: str | None) -> None:
    uuid, names = resolve_device(ctx, device)
    result = _call(ctx, "set-mode", mode=mode, device=uuid)
    typer.echo(f"mode of {_where(result['device'], names)}: {result['mode']}")


def _mode_command(mode: str, meaning: str) -> None:
    """`nvsharectl <mode>` for each scheduling mode (nvshare_py/vocabulary.py defines them)."""

    def set_mode(ctx: typer.Context, device: Optional[str] = DEVICE_OPTION) -> None:
        _set_mode(ctx, mode, device)

    set_mode.__name__ = f"mode_{mode}"
    app.command(mode, help=f"{meaning[:1].upper()}{meaning[1:]}.")(set_mode)


for _mode, _meaning in MODE.meanings.items():
    _mode_command(_mode, _meaning)


def _size_argument(text: str, unset: str, hint: str) -> int | None:
    if text.strip().lower() == unset:
        return None
    try:
        return parse_size(text)
    except ValueError as exc:
        raise typer.BadParameter(f"{exc} (or {unset!r})", param_hint=hint) from None


@app.command("set-budget", cls=NumbersAsValues)
def set_budget(
    ctx: typer.Context,
    size_text: str = typer.Argument(..., metavar="BYTES|default",
                                    help="Memory budget, e.g. 60G, 512M, or 'default' for the device's total"),
    device: str = typer.Option(..., "--device", help=DEVICE_HELP, autocompletion=_complete_devices),
) -> None:
    """Set the memory the device's clients may keep resident at once (at most the device's memory):
    handoffs over it swap in bulk, and auto mode fits holders into it."""
    budget = _size_argument(size_text, "default", "BYTES")
    uuid, names = resolve_device(ctx, device)
    known = next((d for d in _call(ctx, "status")["devices"] if d["device"] == uuid), None)
    if budget is not None and known is not None and known.get("total") and budget > known["total"]:
        # A budget is a promise that the holders' memory fits the card; a larger one lets auto
        # mode run more programs side by side than fit, and they thrash.
        typer.echo(f"nvsharectl: {format_size(budget)} is more than the {format_size(known['total'])} of memory "
                   f"{names.short(uuid or device)} has: give at most {format_size(known['total'])}, or 'default' "
                   "for all of it", err=True)
        raise typer.Exit(EXIT_USAGE)
    result = _call(ctx, "set-budget", device=uuid, bytes=budget)
    shown = "the device's total" if result["budget"] is None else format_size(result["budget"])
    typer.echo(f"memory budget of {names.long(result['device'])}: {shown}")


def _spill(text: str) -> int | str | None:
    """--spill: a size (0 included), auto or off."""
    word = text.strip().lower()
    if word in ("off", "auto"):
        return None if word == "off" else "auto"
    if word.isdigit() and int(word) == 0:
        return 0
    try:
        return parse_size(text)
    except ValueError as exc:
        raise typer.BadParameter(f"{exc}, or 0, auto or off") from None


@app.command("set-admission", cls=NumbersAsValues)
def set_admission(
    ctx: typer.Context,
    spill: Optional[str] = typer.Option(
        None, metavar="BYTES|auto|off",
        help="Host memory allowed beyond the devices' budgets, e.g. 64G or 0; auto: as the scheduler chose at "
             "its start (half of MemAvailable); off: no admission"),
    policy: Optional[str] = typer.Option(None, help=f"{ADMISSION_POLICY.describe()}: who of the waiting allocations goes first"),
    timeout: Optional[float] = typer.Option(None, help="Seconds an allocation waits for admission before it fails"),
    share: Optional[float] = typer.Option(None, help="The part of the capacity one user (uid) or pod may hold, "
                                                     "above 0 and at most 1 (1: no bound)"),
) -> None:
    """Change admission: what the node's clients may hold (the devices' budgets plus a host
    spill), and how allocations past it wait (docs/scheduler.md, Admission)."""
    request: dict[str, Any] = {}
    if spill is not None:
        request["spill"] = _spill(spill)
    if policy is not None:
        request["policy"] = policy
    if timeout is not None:
        request["timeout"] = timeout
    if share is not None:
        request["share"] = share
    result = _call(ctx, "set-admission", **request)
    spill_shown = "off" if result["spill"] is None else format_size(result["spill"])
    typer.echo(f"admission: spill {spill_shown}, policy {result['policy']}, timeout {result['timeout']:g} s, "
               f"share {result.get('share', 1):g}")


# --- per-client settings -------------------------------------------------------------------

CLIENT_OPTION = typer.Option(None, "--client", metavar="cN", help="One client, by its id in status (c3)",
                             autocompletion=_complete_clients)
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


@app.command("set-weight", cls=NumbersAsValues)
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


@app.command("set-priority", cls=NumbersAsValues)
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


@app.command("set-limit", cls=NumbersAsValues)
def set_limit(
    ctx: typer.Context,
    size_text: str = typer.Argument(..., metavar="BYTES|none",
                                    help=f"Memory limit, e.g. 8G, 512M; '{UNSET}' removes the setting (no limit)"),
    client: Optional[str] = CLIENT_OPTION,
    pod_uid: Optional[str] = POD_UID_OPTION,
    device: Optional[str] = typer.Option(None, "--device", help=f"Only this GPU ({DEVICE_HELP}) [default: every GPU]",
                                         autocompletion=_complete_devices),
) -> None:
    """Set a memory limit: allocations past it fail with out-of-memory (it only lowers NVSHARE_MEMORY_LIMIT)."""
    limit = _size_argument(size_text, UNSET, "BYTES")
    target = _setting_target(client, pod_uid)
    uuid, names = resolve_device(ctx, device)
    result = _call(ctx, "set-limit", bytes=limit, device=uuid, **target)
    shown = UNSET if result["bytes"] is None else format_size(result["bytes"])
    typer.echo(f"memory limit of {_whom(result)} on {_where(result['device'], names)}: {shown}")


# --- reading -------------------------------------------------------------------------------


class Output(str, enum.Enum):
    json = "json"
    wide = "wide"


def _output(text: str) -> Output:
    try:
        return Output(text)
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not an output format: give json or wide") from None


OUTPUT_OPTION = typer.Option(None, "--output", "-o", metavar="json|wide", parser=_output,
                             help="json: the scheduler's document; wide: every detail (UUIDs, uids, shares)")
SINCE_HELP = ("From this long ago (30s, 5m, 1.5h, 2d) or from this event sequence number on (a whole number)")


def _interrupted() -> typer.Exit:
    """Ctrl-C ends --watch and --follow as it ends other commands: exit status 130."""
    return typer.Exit(EXIT_INTERRUPTED)


def _warn_split_brain(settings: Settings) -> None:
    warning = split_brain_warning(settings.paths.root)
    if warning is not None:
        typer.echo(f"nvsharectl: warning: {warning}", err=True)


class _Screen:
    """The status for a person: the names of the GPUs, kept across --watch refreshes."""

    def __init__(self, reader: Reader, wide: bool) -> None:
        self.reader = reader
        self.wide = wide

    def draw(self, height: int | None = None, width: int = 80) -> Any:
        status = self.reader.request("status")
        names = DeviceNames(known_devices(status))
        if self.wide:
            return render_status_wide(status, names, read_only=self.reader.read_only)
        screen = render_status(status, names, read_only=self.reader.read_only, height=height, width=width)
        if not status.get("clients") and height is None:
            events, _ = self.reader.events_since(0)
            remembered = past_use(events, DeviceNames(known_devices(status, events)))
            if remembered is not None:
                screen.renderables.append(remembered)
        return screen


@app.command("status")
def status_command(
    ctx: typer.Context,
    output: Optional[Output] = OUTPUT_OPTION,
    as_json: bool = typer.Option(False, "--json", help="The same as -o json"),
    wide: bool = typer.Option(False, "--wide", "-w", help="The same as -o wide"),
    watch: bool = typer.Option(False, "--watch", help="Refresh until interrupted (Ctrl-C exits 130)"),
    interval: float = typer.Option(1.0, "--interval", parser=number_between(0.05, 3600.0),
                                   help="Seconds between refreshes with --watch"),
) -> None:
    """Show who holds and who waits for each GPU, and the clients: users, programs, memory."""
    settings: Settings = ctx.obj
    as_json = as_json or output is Output.json
    wide = wide or output is Output.wide
    _warn_split_brain(settings)
    try:
        with Reader(settings) as reader:
            screen = _Screen(reader, wide)
            if not watch:
                if as_json:
                    typer.echo(json.dumps(reader.request("status"), indent=2))
                else:
                    stdout.print(screen.draw())
                return
            if as_json:
                while True:
                    typer.echo(json.dumps(reader.request("status")), nl=True)
                    time.sleep(interval)
            if not stdout.is_terminal:  # a log of snapshots rather than a redrawn screen
                while True:
                    stdout.print(screen.draw())
                    stdout.print()
                    time.sleep(interval)
            with Live(screen.draw(stdout.height - 1, stdout.width), console=stdout, auto_refresh=False,
                      screen=False, vertical_overflow="crop") as live:
                while True:
                    time.sleep(interval)
                    live.update(screen.draw(stdout.height - 1, stdout.width), refresh=True)
    except ControlFailure as failure:
        raise _fail(failure) from None
    except KeyboardInterrupt:
        raise _interrupted() from None


# --- events --------------------------------------------------------------------------------


@app.command("events")
def events_command(
    ctx: typer.Context,
    output: Optional[Output] = OUTPUT_OPTION,
    as_json: bool = typer.Option(False, "--json", help="The same as -o json: the whole answer, or one event per "
                                                       "line with --follow"),
    since: Since = typer.Option("0", "--since", metavar="DURATION|SEQ", parser=parse_since, help=SINCE_HELP),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new events until interrupted"),
    interval: float = typer.Option(0.5, "--interval", parser=number_between(0.05, 3600.0),
                                   help="Seconds between polls with --follow (Ctrl-C exits 130)"),
) -> None:
    """Show the scheduler's lock events (it keeps the last 10 000)."""
    settings: Settings = ctx.obj
    as_json = as_json or output is Output.json
    wide = output is Output.wide
    try:
        with Reader(settings) as reader:
            if since.seq is not None:
                events, following = reader.events_since(since.seq)
            else:
                stored, following = reader.events_since(0)
                events = since.select(stored, time.time())
            if as_json and not follow:
                typer.echo(json.dumps({"events": events, "next": following}, indent=2))
                return
            names = DeviceNames(known_devices(reader.request("status"), events)) if not as_json else None
            while True:
                for event in events:
                    typer.echo(json.dumps(event) if names is None else event_line(event, names, wide))
                if not follow:
                    return
                time.sleep(interval)
                events, following = reader.events_since(following)
                if names is not None and any(e.get("device") and e["device"] not in names.by_uuid for e in events):
                    names = DeviceNames([*names.by_uuid, *(e["device"] for e in events if e.get("device"))])
    except ControlFailure as failure:
        raise _fail(failure) from None
    except KeyboardInterrupt:
        raise _interrupted() from None


# --- timeline ------------------------------------------------------------------------------

DEFAULT_TIMELINE_SINCE = Since(seconds=300.0)


def _client_names(status: dict) -> dict[str, str]:
    """Row names for the clients still registered (their register event may be gone from the
    scheduler's ring)."""
    return {client["client"]: timelines.client_label(client["client"], {
        "pid": str(client.get("pid") or ""), "user": client.get("user") or "", "program": client.get("program") or "",
        "pod": f"{client.get('namespace') or '?'}/{client['pod']}" if client.get("pod") else ""})
        for client in status.get("clients", [])}


@app.command("timeline")
def timeline_command(
    ctx: typer.Context,
    device: Optional[str] = typer.Option(None, "--device", help=f"Only this GPU ({DEVICE_HELP})",
                                         autocompletion=_complete_devices),
    since: Optional[Since] = typer.Option(None, "--since", metavar="DURATION|SEQ", parser=parse_since,
                                          help=f"{SINCE_HELP} [default: 5m]"),
    show_all: bool = typer.Option(False, "--all", help="Show every event the scheduler keeps (the last 10 000)"),
    output: Optional[Output] = typer.Option(None, "--output", "-o", metavar="json", parser=_output,
                                            help="json: only the JSON document (holds, waits, summary, events), "
                                                 "to stdout"),
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
    if output is Output.wide:
        raise typer.BadParameter("timeline writes -o json only (the drawing is as wide as --width)",
                                 param_hint="--output")
    if png_path is not None and importlib.util.find_spec("matplotlib") is None:
        typer.echo(f"nvsharectl: --png needs matplotlib: {timelines.PLOT_EXTRA_HINT}", err=True)
        raise typer.Exit(EXIT_USAGE)
    if output is Output.json:
        json_path = Path("-")
    json_to_stdout = json_path is not None and str(json_path) == "-"
    if not json_to_stdout:
        tolerate_narrow_encoding("nvsharectl")
    settings: Settings = ctx.obj
    try:
        with Reader(settings) as reader:
            events, _ = reader.events_since(0)
            status = reader.request("status")
    except ControlFailure as failure:
        raise _fail(failure) from None
    now = time.time()
    names = DeviceNames(known_devices(status, events))
    whole = timelines.Timeline.from_events(events, now=now)
    whole.names = names
    whole.labels.update(_client_names(status))
    uuid = None
    if device is not None:
        uuid = names.resolve(device) or device
        if uuid not in names.by_uuid:
            typer.echo(f"nvsharectl: unknown-device: no client has used device {device} (the scheduler knows: "
                       f"{names.shown()})", err=True)
            raise typer.Exit(EXIT_REFUSED)
        whole = whole.only_device(uuid)
    start = whole.start if show_all else max(whole.start, (since or DEFAULT_TIMELINE_SINCE).start_time(events, now))
    shown = whole.window(start, now)
    console = stdout if width is None else Console(highlight=False, width=width)
    if not json_to_stdout:  # '-' makes stdout the JSON document alone, for pipes
        title = "GPU lock timeline" + (f" of {names.short(uuid)}" if uuid else "")
        console.print(timelines.render(shown, width=console.width, title=title))
        if shown.intervals:
            console.print(timelines.summary_table(timelines.summarise(shown)))
    try:
        if json_path is not None:
            document = timelines.to_json(shown)
            document["events"] = [e for e in events if e["t"] >= start and (uuid is None or e.get("device") in ("", uuid))]
            if json_to_stdout:
                typer.echo(json.dumps(document, indent=2))
            else:
                timelines.write_json(json_path, document)
                typer.echo(f"wrote {json_path}")
        if png_path is not None:
            timelines.write_png(png_path, shown,
                                title="GPU lock timeline" + (f" of {names.long(uuid)}" if uuid else ""))
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
