"""Lock timelines: who held, and who waited for, which device when.

The scheduler keeps its recent lock events (docs/protocol.md, Events). This module turns a list
of them into intervals, one per hold and per wait of a client on a device, and shows them: as a
terminal timeline (rich), a summary table, a JSON document and a PNG picture (matplotlib, an
optional dependency imported only when a picture is asked for). `nvsharectl timeline` and
`nvshare-demo` both draw with it.

    timeline = Timeline.from_events(answer["events"], now=time.time())
    timeline.labels["c3"] = "training"            # optional names for the rows
    timeline.names = DeviceNames(uuids)           # optional: GPU0, ... (default: from the events)
    console.print(render(timeline, width=120))
    console.print(summary_table(summarise(timeline)))
    write_json(path, to_json(timeline))
    write_png(path, timeline, title="...")         # MissingMatplotlib if it is not installed

(Some 600 lines: the replay of events into intervals and its four views (summary table,
terminal, JSON, PNG), each under a hundred lines and all reading the one Timeline and Interval
model.)
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from .devicenames import DeviceNames
from .sizes import format_size

HOLD = "hold"
WAIT = "wait"
ADMISSION_WAIT = "admission"  # an allocation waits for memory (admission), admit-wait to admitted/refused

# How a hold or wait ended (Interval.ended_by), beyond the RELEASE reasons of the protocol
# (idle, drop, revoke, exit, user, replaced) and the removal reasons (bye, exited,
# heartbeat-timeout, disconnected, ...), which are kept as the scheduler wrote them.
ENDED_GRANTED = "granted"  # a wait that ended with a grant
ENDED_REVOKED = "revoked"  # the scheduler revoked the grant: the holder did not release in time
ENDED_RECONNECTED = "reconnected"  # the same process registered again; its next row goes on
ENDED_REGRANTED = "regranted"  # a new grant replaced a hold whose end was not in the events

PLOT_EXTRA_HINT = "pip install matplotlib (from a checkout of nvshare_py: pip install '.[plot]')"


class MissingMatplotlib(RuntimeError):
    """PNG export needs matplotlib, an optional dependency."""


@dataclass
class Interval:
    """One hold (grant to release) or wait (acquire to grant) of a client on a device.
    Times are wall-clock Unix seconds, as in the scheduler's events."""

    device: str
    client: str
    kind: str  # HOLD, WAIT or ADMISSION_WAIT
    start: float
    end: float | None = None  # None: still going on at the timeline's end
    grant: int = 0
    ended_by: str = ""
    drop_at: float | None = None  # holds: when the scheduler asked for the lock back (DROP)
    drop_reason: str = ""  # quantum, mode, memory, conflict
    known_start: bool = True  # False: it began before the oldest event available

    def end_or(self, now: float) -> float:
        return self.end if self.end is not None else now

    @property
    def tq_handoff(self) -> bool:
        """The hold ended because its time quantum ran out while someone waited: released after
        the DROP (or revoked), or drained ahead of the quantum's end (release reason quantum)."""
        if self.kind != HOLD or self.end is None:
            return False
        return self.ended_by == "quantum" or (self.drop_reason == "quantum" and self.ended_by in ("drop", ENDED_REVOKED))

    @property
    def early_release(self) -> bool:
        """The holder gave the lock back by itself because it had gone idle."""
        return self.kind == HOLD and self.ended_by == "idle"

    @property
    def end_mark(self) -> str | None:
        """How a finished hold ended, where a drawing marks it: "tq" (TQ handoff), "idle" (early
        release), "revoked", "gone" (its process went); None for a plain release, a handover
        after DROP that was not for the quantum, a reconnection, or a wait."""
        if self.kind == ADMISSION_WAIT and self.ended_by.startswith("refused"):
            return "refused"
        if self.kind != HOLD or self.end is None:
            return None
        if self.tq_handoff:
            return "tq"
        if self.early_release:
            return "idle"
        if self.ended_by == ENDED_REVOKED:
            return "revoked"
        if self.ended_by not in ("drop", "user", "replaced", ENDED_RECONNECTED, ENDED_REGRANTED):
            return "gone"
        return None


@dataclass
class Timeline:
    """Holds and waits between `start` and `end` (wall-clock seconds)."""

    start: float
    end: float
    intervals: list[Interval] = field(default_factory=list)
    settings: list[dict] = field(default_factory=list)  # mode/tq/budget events, as received
    who: dict[str, dict[str, str]] = field(default_factory=dict)  # client id -> its register event's facts
    labels: dict[str, str] = field(default_factory=dict)  # client id -> row name (optional)
    names: DeviceNames = field(default_factory=lambda: DeviceNames(()))  # GPU0, ... for the device UUIDs

    @classmethod
    def from_events(cls, events: Iterable[dict], now: float | None = None) -> Timeline:
        """Replay lock events (any order; sorted by `seq`). `now` ends the intervals still
        open; it defaults to the last event's time."""
        ordered = sorted(events, key=lambda event: event["seq"])
        first = ordered[0]["t"] if ordered else (now or 0.0)
        last = ordered[-1]["t"] if ordered else first
        replay = _Replay(first)
        for event in ordered:
            replay.apply(event)
        end = max(now if now is not None else last, last)
        names = DeviceNames(event.get("device") or "" for event in ordered)
        return cls(first, end, replay.intervals, replay.settings, replay.who, names=names)

    # --- names and rows ---

    @property
    def pids(self) -> dict[str, int]:
        """Client id -> the pid it registered with (its own pid namespace's)."""
        return {client: int(facts["pid"]) for client, facts in self.who.items() if facts.get("pid", "").isdigit()}

    def label(self, client: str) -> str:
        if client in self.labels:
            return self.labels[client]
        return client_label(client, self.who.get(client, {}))

    def devices(self) -> list[str]:
        return list(dict.fromkeys(interval.device for interval in self.intervals))

    def rows(self, device: str) -> list[str]:
        """Row names on `device`, in the order they first appear."""
        return list(dict.fromkeys(self.label(i.client) for i in self.intervals if i.device == device))

    # --- selections ---

    def window(self, start: float | None = None, end: float | None = None) -> Timeline:
        """The part between `start` and `end` (each defaulting to this timeline's own);
        intervals are cut at the edges."""
        start = self.start if start is None else start
        end = self.end if end is None else end
        kept = []
        for interval in self.intervals:
            if interval.start > end or interval.end_or(end) < start:
                continue
            cut = replace(interval)
            if cut.start < start:
                cut.start = start
            if cut.end is not None and cut.end > end:
                cut.end, cut.ended_by = None, ""
            if cut.drop_at is not None and cut.drop_at > end:  # asked for the lock back later
                cut.drop_at, cut.drop_reason = None, ""
            kept.append(cut)
        settings = [s for s in self.settings if start <= s["t"] <= end]
        return Timeline(start, end, kept, settings, dict(self.who), dict(self.labels), self.names)

    def only_device(self, device: str) -> Timeline:
        return Timeline(self.start, self.end, [i for i in self.intervals if i.device == device],
                        [s for s in self.settings if s["device"] == device], dict(self.who), dict(self.labels),
                        self.names)

    def overlapping_holds(self) -> list[tuple[Interval, Interval]]:
        """Pairs of holds of different rows on one device that overlap in time (touching ends
        do not count: a handover is recorded at one instant)."""
        found = []
        holds = sorted((i for i in self.intervals if i.kind == HOLD), key=lambda i: i.start)
        for index, first in enumerate(holds):
            first_end = first.end_or(self.end)
            for second in holds[index + 1:]:
                if second.start >= first_end:
                    break
                if second.device == first.device and self.label(second.client) != self.label(first.client) \
                        and second.end_or(self.end) > second.start:
                    found.append((first, second))
        return found


_FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S*)')


def detail_fields(detail: str) -> dict[str, str]:
    """The key=value pairs of an event's detail (JSON-quoted values unquoted); {} for a detail
    that is not in that form."""
    fields = {}
    for key, value in _FIELD.findall(detail or ""):
        if value.startswith('"'):
            try:
                value = json.loads(value)
            except ValueError:
                pass
        fields[key] = value
    return fields


def registered_pid(event: dict) -> int:
    """The pid a `register` event's client gave (its own pid namespace's), 0 if none."""
    pid = detail_fields(event.get("detail") or "").get("pid", "")
    return int(pid) if pid.isdigit() else 0


def client_label(client: str, facts: dict[str, str]) -> str:
    """How views name a client: its id, its gang, user, pod and program (`c3 alice train.py`,
    `c5 [g2] bob team-a/nb-0 python`); `c3 pid 42` where only the pid is known."""
    parts = [client, *([f"[{facts['gang']}]"] if facts.get("gang") else []),
             *(facts[key] for key in ("user", "pod", "program") if facts.get(key))]
    if not any(facts.get(key) for key in ("user", "pod", "program")) and facts.get("pid"):
        parts.append(f"pid {facts['pid']}")
    return " ".join(parts)


# Event details whose numbers are sizes in bytes: the kinds whose detail is one, and the
# key=value keys that are (docs/protocol.md, Events).
_SIZE_DETAILS = ("budget", "admit-wait", "admitted", "refused")
_SIZE_KEYS = ("bytes", "prefetch", "resident", "spill", "evict")


def readable_detail(kind: str, detail: str) -> str:
    """An event's detail with its byte counts as sizes (`budget 1.0 GiB`, `prefetch=512.0 MiB`)."""
    if not detail:
        return detail
    if kind in _SIZE_DETAILS:
        head, space, rest = detail.partition(" ")
        if head.isdigit():
            return f"{format_size(int(head))}{space}{rest}"
    return re.sub(r"\b(" + "|".join(_SIZE_KEYS) + r")=(\d+)\b",
                  lambda match: f"{match.group(1)}={format_size(int(match.group(2)))}", detail)


class _Replay:
    """Lock state per (device, client) while events are replayed in order."""

    def __init__(self, first_time: float) -> None:
        self.first_time = first_time
        self.intervals: list[Interval] = []
        self.settings: list[dict] = []
        self.who: dict[str, dict[str, str]] = {}
        self.holds: dict[tuple[str, str], Interval] = {}
        self.waits: dict[tuple[str, str], Interval] = {}
        self.admissions: dict[tuple[str, str], Interval] = {}
        self.last_registered = ""

    def apply(self, event: dict) -> None:
        kind = event.get("kind", "")
        device = event.get("device") or ""
        client = event.get("client") or ""
        t = float(event["t"])
        grant = int(event.get("grant") or 0)
        detail = event.get("detail") or ""
        key = (device, client)
        if kind == "register":
            self.who[client] = detail_fields(detail)
            self.last_registered = client
        elif kind == "gang-join":  # its rows name its gang (docs/scheduler.md, Gangs)
            self.who.setdefault(client, {})["gang"] = detail_fields(detail).get("gang", "")
        elif kind == "acquire":
            if key not in self.waits:
                self.waits[key] = self._open(Interval(device, client, WAIT, t))
        elif kind == "grant":
            self._close(self.waits, key, t, ENDED_GRANTED)
            self._close(self.holds, key, t, ENDED_REGRANTED)
            self.holds[key] = self._open(Interval(device, client, HOLD, t, grant=grant))
        elif kind == "drop":
            hold = self._current_hold(key, grant)
            hold.drop_at, hold.drop_reason = t, detail
        elif kind in ("release", "revoke"):
            self._current_hold(key, grant)
            self._close(self.holds, key, t, (detail or "user") if kind == "release" else ENDED_REVOKED)
        elif kind == "admit-wait":
            if key not in self.admissions:
                self.admissions[key] = self._open(Interval(device, client, ADMISSION_WAIT, t))
        elif kind in ("admitted", "refused"):
            # detail: "<bytes> after <s>s" or "<bytes> <reason>"
            ended_by = kind if kind == "admitted" else f"refused {detail.rpartition(' ')[2]}"
            self._close(self.admissions, key, t, ended_by)
        elif kind in ("lost", "unregister") and device:
            if grant:
                self._current_hold(key, grant)
            self._close(self.holds, key, t, detail or kind)
            self._close(self.waits, key, t, detail or kind)
            self._close(self.admissions, key, t, detail or kind)
        elif kind == "unregister":
            self._client_gone(client, t, detail)
        elif kind in ("mode", "tq", "budget"):
            self.settings.append(dict(event))
        # other kinds (newer daemons) carry nothing a timeline draws

    def _open(self, interval: Interval) -> Interval:
        self.intervals.append(interval)
        return interval

    def _close(self, table: dict, key: tuple[str, str], t: float, ended_by: str) -> Interval | None:
        interval = table.pop(key, None)
        if interval is not None:
            interval.end, interval.ended_by = t, ended_by
        return interval

    def _current_hold(self, key: tuple[str, str], grant: int) -> Interval:
        """The open hold of `key`; one that began before the oldest event is opened then."""
        hold = self.holds.get(key)
        if hold is None:
            hold = self.holds[key] = self._open(
                Interval(key[0], key[1], HOLD, self.first_time, grant=grant, known_start=False))
        return hold

    def _client_gone(self, client: str, t: float, reason: str) -> None:
        # A process that reconnects registers anew and then its old registration goes, with
        # "replaced": the new one carries on its holds (same grant) and its place in queues.
        successor = self.last_registered if reason == "replaced" and self.last_registered != client else ""
        for table in (self.holds, self.waits, self.admissions):
            for key in [key for key in table if key[1] == client]:
                old = self._close(table, key, t, ENDED_RECONNECTED if successor else reason)
                if successor and old is not None:
                    table[(key[0], successor)] = self._open(replace(
                        old, client=successor, start=t, end=None, ended_by="", known_start=True))


# --- summary ---------------------------------------------------------------------------------


@dataclass
class RowSummary:
    device: str
    row: str
    device_name: str = ""  # GPU0, ... (Timeline.names)
    holds: int = 0
    held: float = 0.0
    waits: int = 0
    waited: float = 0.0
    longest_wait: float = 0.0
    tq_handoffs: int = 0
    early_releases: int = 0
    revoked: int = 0
    memory_waited: float = 0.0  # allocations waiting for admission
    refused: int = 0  # allocations refused admission


def summarise(timeline: Timeline) -> list[RowSummary]:
    """Per device and row: holds and time held, waits, longest wait, TQ handoffs, early
    releases, revocations."""
    rows: dict[tuple[str, str], RowSummary] = {}
    for device in timeline.devices():
        for row in timeline.rows(device):
            rows[(device, row)] = RowSummary(device, row, timeline.names.short(device))
    for interval in timeline.intervals:
        summary = rows[(interval.device, timeline.label(interval.client))]
        length = max(0.0, interval.end_or(timeline.end) - interval.start)
        if interval.kind == HOLD:
            if interval.known_start and interval.ended_by != ENDED_RECONNECTED:
                summary.holds += 1  # a grant, counted once even across a reconnection
            summary.held += length
            summary.tq_handoffs += interval.tq_handoff
            summary.early_releases += interval.early_release
            summary.revoked += interval.ended_by == ENDED_REVOKED
        elif interval.kind == ADMISSION_WAIT:
            summary.memory_waited += length
            summary.refused += interval.end_mark == "refused"
        else:
            if interval.ended_by != ENDED_RECONNECTED:
                summary.waits += 1
            summary.waited += length
            summary.longest_wait = max(summary.longest_wait, length)
    return list(rows.values())


def summary_table(rows: list[RowSummary], title: str = "Summary") -> Table:
    """Per row: holds, time held and waited, handoffs. Numbers are never cut or folded: the
    program column folds instead, and headers take two lines, so that it fits 80 columns."""
    several_devices = len({row.device for row in rows}) > 1
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 0, 0, 1))
    table.add_column("GPU / program" if several_devices else "program", overflow="fold", ratio=1)
    admission = any(row.memory_waited or row.refused for row in rows)  # columns only where it happened
    columns = ["holds", "held", "waited", "longest\nwait", "TQ hand-\noffs", "early\nreleases", "revoked"]
    cells = []
    for row in rows:
        values = [str(row.holds), _seconds(row.held), _seconds(row.waited), _seconds(row.longest_wait),
                  str(row.tq_handoffs), str(row.early_releases), str(row.revoked)]
        if admission:
            values += [_seconds(row.memory_waited), str(row.refused)]
        cells.append(values)
    for place, column in enumerate(columns + (["waited for\nmemory", "refused"] if admission else [])):
        widest = max([len(values[place]) for values in cells] + [len(part) for part in column.split("\n")])
        table.add_column(column, justify="right", no_wrap=True, min_width=widest)
    for row, values in zip(rows, cells):
        name = f"{row.device_name or row.device} {row.row}" if several_devices else row.row
        table.add_row(name, *values)
    return table


def _seconds(seconds: float) -> str:
    return f"{seconds:.1f} s"


# --- terminal rendering ----------------------------------------------------------------------

ROW_COLOURS = ("cyan", "magenta", "green", "yellow", "blue", "red", "bright_cyan", "bright_magenta")
_NOTHING, _MEMORY, _WAITING, _DRAINING, _HOLDING = 0, 1, 2, 3, 4
_CELLS = {_NOTHING: " ", _MEMORY: "~", _WAITING: "░", _DRAINING: "▓", _HOLDING: "█"}
_MARKS = {"tq": "Q", "idle": "i", "revoked": "R", "gone": "x", "refused": "!"}
LEGEND = ("█ holds the lock   ▓ asked to hand it over (DROP), draining   ░ waits for it   "
          "~ an allocation waits for memory (admission)   "
          "Q handed over at the end of its time quantum   i released early (idle)   R revoked   x exited/gone   "
          "! allocation refused")
_TICK_STEPS = (0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 86400)


def render(timeline: Timeline, width: int = 100, title: str | None = None, legend: bool = True) -> Group:
    """The timeline as lines of at most `width` characters: per device a header and one row
    per client, and a time axis (seconds since the timeline's start)."""
    width = max(1, int(width))
    span = max(timeline.end - timeline.start, 1e-6)
    lines: list[Text] = []
    heading = f"{_clock(timeline.start)} → {_clock(timeline.end)}  ({span:.1f} s)"
    lines.append(Text(_fit(f"{title}  {heading}" if title else heading, width), style="bold", no_wrap=True))
    devices = timeline.devices()
    if not devices:
        lines.append(Text(_fit("no lock events in this period", width), style="dim", no_wrap=True))
        return Group(*lines)
    names = [row for device in devices for row in timeline.rows(device)]
    label_width = min(max(len(name) for name in names), max(0, (width - 3) // 3))
    bar_width = max(1, width - label_width - 2)
    colours = {name: ROW_COLOURS[index % len(ROW_COLOURS)] for index, name in enumerate(dict.fromkeys(names))}
    for device in devices:
        heading = timeline.names.long(device)
        lines.append(Text(_fit(heading if len(heading) <= width else timeline.names.short(device), width),
                          style="bold", no_wrap=True))
        for setting in timeline.settings:
            if setting["device"] == device:
                detail = readable_detail(setting["kind"], setting["detail"])
                change = f"  {setting['t'] - timeline.start:6.1f} s  {setting['kind']} {detail}"
                lines.append(Text(_fit(change, width), style="dim", no_wrap=True))
        for name in timeline.rows(device):
            intervals = [i for i in timeline.intervals if i.device == device and timeline.label(i.client) == name]
            line = Text(_fit(name, label_width).ljust(label_width) + " │", no_wrap=True, overflow="crop")
            line.append_text(_bar(intervals, timeline, bar_width, colours[name]))
            lines.append(line)
    lines.append(Text(" " * (label_width + 2) + _axis(span, bar_width), style="dim", no_wrap=True, overflow="crop"))
    if legend:
        lines.append(Text(LEGEND, style="dim", overflow="fold"))
    return Group(*lines)


def _bar(intervals: list[Interval], timeline: Timeline, cells: int, colour: str) -> Text:
    span = max(timeline.end - timeline.start, 1e-6)
    state = [_NOTHING] * cells
    marks: dict[int, str] = {}

    def cell_range(start: float, end: float) -> range:
        first = int((start - timeline.start) / span * cells)
        last = math.ceil((end - timeline.start) / span * cells)
        first = min(max(first, 0), cells - 1)
        return range(first, min(max(last, first + 1), cells))

    def cell_of(t: float) -> int:
        return min(max(int((t - timeline.start) / span * cells), 0), cells - 1)

    for interval in intervals:
        end = interval.end_or(timeline.end)
        if interval.kind in (WAIT, ADMISSION_WAIT):
            value = _WAITING if interval.kind == WAIT else _MEMORY
            painted = [(interval.start, end, value)] if end > interval.start else []
        elif interval.drop_at is not None and interval.drop_at > interval.start:
            painted = [(interval.start, interval.drop_at, _HOLDING), (interval.drop_at, end, _DRAINING)]
        elif interval.drop_at is not None:
            painted = [(interval.start, end, _DRAINING)]
        else:
            painted = [(interval.start, end, _HOLDING)]
        for start, stop, value in painted:
            for index in cell_range(start, stop):
                state[index] = max(state[index], value)
        if interval.end_mark is not None and interval.end is not None:
            marks[cell_of(interval.end)] = _MARKS[interval.end_mark]
    text = Text(no_wrap=True, overflow="crop")
    for index, value in enumerate(state):
        if index in marks:
            text.append(marks[index], style=f"bold reverse {colour}")
        else:
            text.append(_CELLS[value], style=colour if value not in (_WAITING, _MEMORY) else f"dim {colour}")
    return text


def _axis(span: float, cells: int) -> str:
    """Tick labels (seconds since the start) spaced at least ~10 characters apart."""
    step = next((s for s in _TICK_STEPS if s / span * cells >= 10), _TICK_STEPS[-1])
    axis = [" "] * cells
    tick = 0.0
    while tick <= span:
        position = int(tick / span * cells)
        label = f"{tick:g}s"
        if position + len(label) <= cells and all(c == " " for c in axis[max(0, position - 1):position + len(label)]):
            axis[position:position + len(label)] = label
        tick += step
    return "".join(axis)


def _fit(text: str, width: int) -> str:
    if len(text) <= width:
        return text
    return text[: max(0, width - 1)] + "…" if width > 0 else ""


def _clock(unix: float) -> str:
    return datetime.fromtimestamp(unix).strftime("%H:%M:%S")


# --- export ----------------------------------------------------------------------------------


def to_json(timeline: Timeline) -> dict[str, Any]:
    """A JSON-able document: the window, the rows, every interval (with its row name) and the
    summary. Open intervals have `"end": null`."""
    clients = sorted({i.client for i in timeline.intervals} | set(timeline.who))
    pids = timeline.pids
    return {
        "start": timeline.start,
        "end": timeline.end,
        "devices": timeline.devices(),
        "device_names": {device: timeline.names.short(device) for device in timeline.devices()},
        "clients": {c: {"pid": pids.get(c), "user": timeline.who.get(c, {}).get("user"), "row": timeline.label(c)}
                    for c in clients},
        "intervals": [{**asdict(i), "row": timeline.label(i.client)} for i in timeline.intervals],
        "settings": timeline.settings,
        "summary": [asdict(row) for row in summarise(timeline)],
    }


def write_json(path: str | os.PathLike, document: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(document, indent=2) + "\n")


_PNG_MARKERS = {"tq": "v", "idle": "o", "revoked": "X"}  # an exit is not marked in the picture


def picture_labels(timeline: Timeline, rows: list[tuple[str, str]]) -> list[str]:
    """The picture's name for each (device, row): the row, after its GPU's short name when there
    are several GPUs (never a cut UUID: two GPUs can share their first dozen characters)."""
    several_devices = len({device for device, _ in rows}) > 1
    return [f"{timeline.names.short(device)} {name}" if several_devices else name for device, name in rows]


def write_png(path: str | os.PathLike, timeline: Timeline, title: str = "") -> None:
    """Draw the timeline with matplotlib (holds solid, draining hatched, waits light; markers
    at TQ handoffs, early releases and revocations). Raises MissingMatplotlib without it."""
    try:
        from matplotlib.figure import Figure  # noqa: PLC0415 (optional dependency)
        from matplotlib.patches import Patch  # noqa: PLC0415
        from matplotlib.lines import Line2D  # noqa: PLC0415
    except ImportError:
        raise MissingMatplotlib(f"PNG export needs matplotlib: {PLOT_EXTRA_HINT}") from None
    rows = [(device, name) for device in timeline.devices() for name in timeline.rows(device)]
    palette = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive")
    colours = {name: palette[index % len(palette)] for index, name in enumerate(dict.fromkeys(n for _, n in rows))}
    figure = Figure(figsize=(11, 1.6 + 0.6 * max(1, len(rows))), layout="constrained")
    axes = figure.add_subplot()
    origin = timeline.start
    for position, (device, name) in enumerate(rows):
        y = len(rows) - 1 - position
        colour = colours[name]
        for interval in timeline.intervals:
            if interval.device != device or timeline.label(interval.client) != name:
                continue
            start, end = interval.start - origin, interval.end_or(timeline.end) - origin
            if interval.kind == WAIT:
                axes.broken_barh([(start, end - start)], (y - 0.15, 0.3), facecolors=colour, alpha=0.25)
                continue
            if interval.kind == ADMISSION_WAIT:  # a thin dotted band: an allocation waits for memory
                axes.broken_barh([(start, end - start)], (y - 0.05, 0.1), facecolors="none", edgecolors=colour,
                                 linestyle=":")
                continue
            drop = end if interval.drop_at is None else max(start, interval.drop_at - origin)
            axes.broken_barh([(start, drop - start)], (y - 0.35, 0.7), facecolors=colour)
            if drop < end:
                axes.broken_barh([(drop, end - drop)], (y - 0.35, 0.7), facecolors=colour, alpha=0.55, hatch="///")
            marker = _PNG_MARKERS.get(interval.end_mark or "")
            if marker is not None:
                axes.plot([end], [y + 0.5], marker=marker, color="black", markersize=7, linestyle="none")
    axes.set_yticks(range(len(rows)))
    axes.set_yticklabels(list(reversed(picture_labels(timeline, rows))))
    axes.set_ylim(-0.7, max(1, len(rows)) - 0.2)
    axes.set_xlim(0, max(timeline.end - origin, 1e-3))
    axes.set_xlabel(f"seconds since {datetime.fromtimestamp(origin).strftime('%Y-%m-%d %H:%M:%S')}")
    axes.grid(axis="x", alpha=0.3)
    axes.set_title(title or "GPU lock timeline")
    axes.legend(handles=[
        Patch(facecolor="grey", label="holds the lock"),
        Patch(facecolor="grey", alpha=0.55, hatch="///", label="draining after DROP"),
        Patch(facecolor="grey", alpha=0.25, label="waits"),
        *(Line2D([], [], marker=_PNG_MARKERS[mark], color="black", linestyle="none", label=label)
          for mark, label in (("tq", "TQ handoff"), ("idle", "early release (idle)"), ("revoked", "revoked"))),
    ], loc="upper center", bbox_to_anchor=(0.5, -0.35 if len(rows) < 3 else -0.15), ncol=6, fontsize="small",
        frameon=False)
    figure.savefig(os.fspath(path), dpi=120)
