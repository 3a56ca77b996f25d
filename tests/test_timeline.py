"""Lock timelines (nvshare_py.timeline): intervals from event lists, drawing, export, and
`nvsharectl timeline` against the real daemon."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest
from rich.console import Console

from fixtures.scheduler import wait_for
from nvshare_py import timeline as tl
from nvshare_py.scheduler.views import user_name

DEV = "GPU-5151ad00-0000-4000-8000-000000000000"
T0 = 1_763_725_200.0
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class Events:
    """Builds an event list as the daemon writes it (docs/protocol.md, Events)."""

    def __init__(self) -> None:
        self.list: list[dict] = []

    def add(self, t: float, kind: str, client: str = "", grant: int = 0, detail: str = "", device: str = DEV) -> "Events":
        self.list.append({"seq": len(self.list) + 100, "t": T0 + t, "device": device, "client": client, "kind": kind,
                          "grant": grant, "detail": detail})
        return self

    def register(self, t: float, client: str, pid: int) -> "Events":
        return self.add(t, "register", client, detail=f"pid={pid}", device="")

    def timeline(self, now: float | None = None) -> tl.Timeline:
        return tl.Timeline.from_events(self.list, now=None if now is None else T0 + now)


def handoff_and_early_release() -> Events:
    """c1 trains; c2 asks at 1.2 s, gets the GPU when c1's quantum ends (3.1 s), runs briefly and
    gives it back idle at 4.5 s; c1 waits for it meanwhile and gets it back."""
    return (Events().register(0, "c1", 11).add(0.1, "acquire", "c1").add(0.1, "grant", "c1", 1)
            .register(1.0, "c2", 12).add(1.2, "acquire", "c2")
            .add(3.1, "drop", "c1", 1, "quantum").add(3.15, "acquire", "c1")
            .add(3.3, "release", "c1", 1, "drop").add(3.3, "grant", "c2", 2)
            .add(4.5, "release", "c2", 2, "idle").add(4.5, "grant", "c1", 3)
            .add(6.0, "release", "c1", 3, "user"))


def spans(timeline: tl.Timeline, client: str, kind: str) -> list[tuple[float, float | None]]:
    return [(round(i.start - T0, 3), None if i.end is None else round(i.end - T0, 3))
            for i in timeline.intervals if i.client == client and i.kind == kind]


def by_row(timeline: tl.Timeline) -> dict[str, tl.RowSummary]:
    return {row.row: row for row in tl.summarise(timeline)}


# --- intervals from events ---------------------------------------------------------------------


def test_holds_waits_handoffs_and_early_releases():
    timeline = handoff_and_early_release().timeline()
    assert spans(timeline, "c1", tl.HOLD) == [(0.1, 3.3), (4.5, 6.0)]
    assert spans(timeline, "c1", tl.WAIT) == [(0.1, 0.1), (3.15, 4.5)]
    assert spans(timeline, "c2", tl.HOLD) == [(3.3, 4.5)]
    assert spans(timeline, "c2", tl.WAIT) == [(1.2, 3.3)]
    first = timeline.intervals[1]
    assert (first.drop_at - T0, first.drop_reason, first.ended_by) == (pytest.approx(3.1), "quantum", "drop")
    assert first.tq_handoff and not first.early_release
    assert timeline.overlapping_holds() == []

    rows = by_row(timeline)
    assert set(rows) == {"c1 pid 11", "c2 pid 12"}
    c1, c2 = rows["c1 pid 11"], rows["c2 pid 12"]
    assert (c1.holds, c1.tq_handoffs, c1.early_releases) == (2, 1, 0)
    assert c1.held == pytest.approx(3.2 + 1.5)
    assert c1.waited == pytest.approx(1.35) and c1.longest_wait == pytest.approx(1.35)
    assert (c2.holds, c2.tq_handoffs, c2.early_releases) == (1, 0, 1)
    assert c2.held == pytest.approx(1.2) and c2.longest_wait == pytest.approx(2.1)


def test_revoked_holder_and_the_next_grant():
    events = (Events().add(0, "grant", "c1", 1).add(1, "acquire", "c2").add(2, "drop", "c1", 1, "quantum")
              .add(7, "revoke", "c1", 1, "grace-expired").add(7, "grant", "c2", 2))
    timeline = events.timeline(now=9)
    (hold,) = [i for i in timeline.intervals if i.client == "c1"]
    assert (hold.end - T0, hold.ended_by) == (7, tl.ENDED_REVOKED)
    assert spans(timeline, "c2", tl.HOLD) == [(7, None)]  # still holding at `now`
    row = by_row(timeline)["c1"]
    assert (row.revoked, row.tq_handoffs, row.held) == (1, 1, 7)
    assert by_row(timeline)["c2"].held == pytest.approx(2)
    assert timeline.overlapping_holds() == []


def test_lost_holder_and_lost_waiter():
    events = (Events().add(0, "grant", "c1", 1).add(0.5, "acquire", "c2").add(0.6, "acquire", "c3")
              .add(2, "lost", "c1", 1, "exited").add(2, "grant", "c2", 2)
              .add(2.5, "lost", "c3", 0, "heartbeat-timeout").add(3, "unregister", "c2", 2, "bye"))
    timeline = events.timeline()
    assert [(i.client, i.kind, i.ended_by) for i in timeline.intervals] == [
        ("c1", tl.HOLD, "exited"), ("c2", tl.WAIT, tl.ENDED_GRANTED), ("c3", tl.WAIT, "heartbeat-timeout"),
        ("c2", tl.HOLD, "bye")]
    assert all(i.end is not None for i in timeline.intervals)


def test_mode_off_parallel_holders_are_reported_as_overlapping():
    events = (Events().add(0, "mode", detail="off").add(1, "grant", "c1", 1).add(1.5, "grant", "c2", 2)
              .add(3, "release", "c1", 1, "user").add(4, "release", "c2", 2, "user")
              .add(5, "grant", "c1", 3).add(6, "release", "c1", 3, "user"))
    timeline = events.timeline()
    assert [s["detail"] for s in timeline.settings] == ["off"]
    pairs = timeline.overlapping_holds()
    assert [(a.client, b.client) for a, b in pairs] == [("c1", "c2")]
    # One program under two names: not an overlap of two programs.
    timeline.labels.update({"c1": "job", "c2": "job"})
    assert timeline.overlapping_holds() == []


def test_handover_at_one_instant_is_no_overlap_but_a_late_release_is():
    touching = Events().add(0, "grant", "c1", 1).add(2, "release", "c1", 1, "drop").add(2, "grant", "c2", 2)
    assert touching.timeline(now=3).overlapping_holds() == []
    overlapping = Events().add(0, "grant", "c1", 1).add(1, "grant", "c2", 2).add(2, "release", "c1", 1, "drop")
    assert len(overlapping.timeline(now=3).overlapping_holds()) == 1


def test_reconnection_carries_the_hold_over_to_the_new_client():
    events = (Events().register(0, "c1", 11).add(0.1, "grant", "c1", 1).add(0.5, "acquire", "c2")
              .register(2, "c3", 11).add(2, "unregister", "c1", detail="replaced", device="")
              .add(3, "release", "c3", 1, "idle").add(3, "grant", "c2", 2))
    timeline = events.timeline(now=4)
    assert spans(timeline, "c1", tl.HOLD) == [(0.1, 2)]
    assert spans(timeline, "c3", tl.HOLD) == [(2, 3)]
    assert timeline.intervals[-2].grant == 1  # the same grant, carried over
    timeline.labels.update({"c1": "training", "c3": "training"})
    row = by_row(timeline)["training"]
    assert (row.holds, row.held, row.early_releases) == (1, pytest.approx(2.9), 1)


def test_holds_that_began_before_the_oldest_event():
    events = Events().add(10, "drop", "c1", 7, "quantum").add(10.5, "release", "c1", 7, "drop")
    events.add(10.5, "grant", "c2", 8)
    timeline = events.timeline(now=12)
    (hold,) = [i for i in timeline.intervals if i.client == "c1"]
    assert not hold.known_start and hold.start == T0 + 10 and hold.grant == 7
    assert by_row(timeline)["c1"].holds == 0  # its grant is not among the events
    assert by_row(timeline)["c2"].holds == 1


def test_window_cuts_intervals_at_its_edges():
    timeline = handoff_and_early_release().timeline()
    part = timeline.window(T0 + 2, T0 + 4)
    assert (part.start, part.end) == (T0 + 2, T0 + 4)
    assert spans(part, "c1", tl.HOLD) == [(2, 3.3)]
    assert spans(part, "c2", tl.HOLD) == [(3.3, None)]  # goes on past the window
    assert by_row(part)["c2 pid 12"].held == pytest.approx(0.7)
    assert by_row(part)["c2 pid 12"].early_releases == 0


def test_a_drop_after_the_window_is_not_in_it():
    timeline = handoff_and_early_release().timeline()
    part = timeline.window(T0 + 2, T0 + 3)  # c1 holds throughout; it is asked to hand over at 3.1 s
    (hold,) = [i for i in tl.to_json(part)["intervals"] if i["client"] == "c1" and i["kind"] == tl.HOLD]
    assert (hold["end"], hold["drop_at"], hold["drop_reason"]) == (None, None, "")


def test_unknown_event_kinds_are_ignored():
    events = Events().add(0, "grant", "c1", 1).add(1, "rebalance", "c1", 1, "future").add(2, "release", "c1", 1, "idle")
    assert spans(events.timeline(), "c1", tl.HOLD) == [(0, 2)]


# --- drawing -------------------------------------------------------------------------------------


def rendered_lines(timeline: tl.Timeline, width: int) -> list[str]:
    console = Console(width=5000, record=True, file=open("/dev/null", "w"), color_system=None)
    console.print(tl.render(timeline, width=width, legend=False))
    return console.export_text().splitlines()


def test_rows_show_holding_waiting_and_markers():
    timeline = handoff_and_early_release().timeline()
    timeline.labels.update({"c1": "training", "c2": "notebook"})
    lines = rendered_lines(timeline, 70)
    training = next(line for line in lines if line.startswith("training"))
    notebook = next(line for line in lines if line.startswith("notebook"))
    bar = training.split("│", 1)[1]
    assert bar.startswith("█") and "Q" in bar and "░" in bar
    assert bar.index("Q") < bar.index("░")  # handed over, then waits for it again
    nb = notebook.split("│", 1)[1]
    assert nb.index("░") < nb.index("█") < nb.index("i")  # waits, holds, releases early
    assert any("0s" in line for line in lines)
    assert DEV in lines[1]


@pytest.mark.parametrize("width", [1, 2, 3, 7, 13, 40, 81, 333, 1000])
def test_rendering_respects_odd_widths(width):
    timeline = handoff_and_early_release().timeline()
    timeline.labels["c1"] = "a training job with a very long name indeed"
    lines = rendered_lines(timeline, width)
    rows = [line for line in lines if "│" in line]
    assert len(rows) == 2
    if width >= 3:
        assert all(len(line) <= width for line in lines), lines


def test_rendering_an_empty_timeline():
    lines = rendered_lines(tl.Timeline.from_events([], now=T0), 80)
    assert "no lock events" in "\n".join(lines)


def test_rows_name_the_user_and_program_even_after_the_client_left():
    events = Events()
    events.add(0, "register", "c14", detail='pid=16135 user=alice program="my notebook.ipynb" pod=team-a/nb-0',
               device="")
    events.add(0.1, "acquire", "c14").add(0.1, "grant", "c14", 1).add(1.0, "release", "c14", 1, "user")
    events.add(1.5, "unregister", "c14", detail="bye", device="")
    timeline = events.timeline()
    assert timeline.label("c14") == "c14 alice team-a/nb-0 my notebook.ipynb"
    assert timeline.pids == {"c14": 16135}
    assert tl.detail_fields('a=1 b="x \\"y\\"" c=') == {"a": "1", "b": 'x "y"', "c": ""}


def test_rows_of_a_gangs_members_name_their_gang():
    events = Events()
    for client, pid in (("c1", 11), ("c2", 12)):
        events.add(0, "register", client, detail=f"pid={pid} user=alice program=train.py", device="")
        events.add(0, "gang-join", client, detail=f"gang=g1 name=job members={pid - 10} size=2", device="")
    events.add(0.1, "acquire", "c1").add(0.1, "grant", "c1", 1).add(0.1, "grant", "c2", 2, device="GPU-1")
    events.add(0.1, "gang-turn", detail="gang=g1 turn=1 members=c1,c2 devices=2", device="")
    timeline = events.timeline(now=1.0)
    assert timeline.label("c1") == "c1 [g1] alice train.py"
    assert timeline.rows("GPU-1") == ["c2 [g1] alice train.py"]


def test_the_summary_fits_80_columns_and_never_cuts_a_number():
    events = Events().register(0, "c1", 11).add(0, "acquire", "c1").add(0, "grant", "c1", 1)
    events.add(98765.4, "release", "c1", 1, "idle")
    timeline = events.timeline()
    timeline.labels["c1"] = "a notebook with a very long name indeed, as people name them"
    console = Console(width=80, record=True, highlight=False)
    console.print(tl.summary_table(tl.summarise(timeline)))
    text = console.export_text()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80, text
    assert "98765.4 s" in text and "longest" in text and "hand-" in text and "releases" in text, text


def test_sizes_in_events_read_as_sizes():
    assert tl.readable_detail("budget", "1073741824") == "1.0 GiB"
    assert tl.readable_detail("budget", "total") == "total"
    assert tl.readable_detail("admitted", "536870912 after 1.5s") == "512.0 MiB after 1.5s"
    assert tl.readable_detail("grant", "prefetch=8589934592") == "prefetch=8.0 GiB"
    assert tl.readable_detail("admission", "spill=0 policy=fifo timeout=300") == "spill=0 B policy=fifo timeout=300"
    timeline = Events().add(0, "budget", detail="1073741824").add(0, "acquire", "c1").timeline()
    assert any("budget 1.0 GiB" in line for line in rendered_lines(timeline, 80))


def test_two_gpus_that_share_a_uuid_prefix_keep_their_own_names_in_the_picture():
    other = DEV[:-1] + "1"
    events = Events().add(0, "acquire", "c1").add(0, "grant", "c1", 1)
    events.add(0, "acquire", "c2", device=other).add(0, "grant", "c2", 2, device=other)
    timeline = events.timeline()
    rows = [(device, name) for device in timeline.devices() for name in timeline.rows(device)]
    assert tl.picture_labels(timeline, rows) == ["GPU0 c1", "GPU1 c2"]


# --- export --------------------------------------------------------------------------------------


def test_json_export(tmp_path):
    timeline = handoff_and_early_release().timeline()
    path = tmp_path / "timeline.json"
    tl.write_json(path, tl.to_json(timeline))
    document = json.loads(path.read_text())
    assert document["devices"] == [DEV]
    assert document["clients"]["c1"] == {"pid": 11, "user": None, "row": "c1 pid 11"}
    assert document["device_names"] == {DEV: "GPU0"}
    holds = [i for i in document["intervals"] if i["kind"] == "hold"]
    assert [(h["client"], h["ended_by"]) for h in holds] == [("c1", "drop"), ("c2", "idle"), ("c1", "user")]
    assert {row["row"]: row["tq_handoffs"] for row in document["summary"]} == {"c1 pid 11": 1, "c2 pid 12": 0}


def test_png_export(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "timeline.png"
    tl.write_png(path, handoff_and_early_release().timeline(), title="two programs")
    assert path.read_bytes().startswith(PNG_SIGNATURE)


def test_png_export_without_matplotlib_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # makes the import fail
    with pytest.raises(tl.MissingMatplotlib, match="pip install"):
        tl.write_png(tmp_path / "x.png", handoff_and_early_release().timeline())
    assert not (tmp_path / "x.png").exists()


# --- nvsharectl timeline -------------------------------------------------------------------------


@pytest.fixture
def handed_over(scheduler_factory):
    """A real daemon (TQ 0.5 s) where one agent held the GPU, was dropped at the end of its
    quantum, and the other then held it and released it."""
    scheduler = scheduler_factory(tq=0.5)
    first, second = scheduler.agent(), scheduler.agent()
    first.send(f"acquire {DEV}")
    first.expect(f"granted {DEV}")
    second.send(f"acquire {DEV}")
    first.expect(f"drop {DEV}")
    second.expect(f"granted {DEV}")
    second.send(f"release {DEV}")
    second.expect(f"released {DEV}")
    wait_for(lambda: any(e["kind"] == "release" and e["client"] == second.client_id for e in scheduler.events()),
             what="the second release in the events")
    return scheduler, first, second


def test_ctl_timeline_draws_both_clients(handed_over):
    scheduler, first, second = handed_over
    result = scheduler.ctl("timeline", "--width", "100")
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line for line in result.stdout.splitlines() if re.match(r"c\d+ .*│", line)}
    assert set(rows) == {first.client_id, second.client_id}
    user = user_name(os.geteuid())
    assert rows[first.client_id].startswith(f"{first.client_id} {user} scheduler.py ")  # who, by name
    assert "Q" in rows[first.client_id].split("│")[1]  # handed over at the end of its quantum
    assert "█" in rows[second.client_id].split("│")[1]
    assert f"GPU0 ({DEV})" in result.stdout and "hand-" in result.stdout  # the summary table
    assert max(len(line) for line in rows.values()) <= 100


def test_ctl_timeline_exports(handed_over, tmp_path):
    pytest.importorskip("matplotlib")
    scheduler, first, second = handed_over
    result = scheduler.ctl("timeline", "--all", "--device", DEV, "--json", str(tmp_path / "t.json"),
                           "--png", str(tmp_path / "t.png"))
    assert result.returncode == 0, result.stderr
    document = json.loads((tmp_path / "t.json").read_text())
    summary = {row["row"].split()[0]: row for row in document["summary"]}
    assert summary[first.client_id]["tq_handoffs"] == 1 and summary[first.client_id]["holds"] == 1
    assert summary[second.client_id]["holds"] == 1 and summary[second.client_id]["waited"] > 0
    assert [e["kind"] for e in document["events"] if e["client"] == second.client_id][-2:] == ["grant", "release"]
    assert (tmp_path / "t.png").read_bytes().startswith(PNG_SIGNATURE)


def test_ctl_timeline_usage_and_refusals(handed_over):
    scheduler, _, _ = handed_over
    assert scheduler.ctl("timeline", "--since", "5", "--all").returncode == 2
    refused = scheduler.ctl("timeline", "--device", "GPU-nope")
    assert refused.returncode == 1 and "unknown-device" in refused.stderr
    recent = scheduler.ctl("timeline", "--since", "0.001s")
    assert recent.returncode == 0 and "│" not in recent.stdout  # nothing within the last millisecond


def test_admission_waits_show_as_their_own_intervals_and_in_the_summary():
    from nvshare_py.timeline import ADMISSION_WAIT, Timeline, render, summarise

    gpu = "GPU-5151ad00-0000-4000-8000-000000000000"
    events = [
        {"seq": 1, "t": 10.0, "kind": "register", "client": "c1", "detail": "pid=42"},
        {"seq": 2, "t": 11.0, "kind": "admit-wait", "device": gpu, "client": "c1", "detail": "1073741824"},
        {"seq": 3, "t": 14.0, "kind": "admitted", "device": gpu, "client": "c1", "detail": "1140850688 after 3.000s"},
        {"seq": 4, "t": 15.0, "kind": "admit-wait", "device": gpu, "client": "c1", "detail": "999"},
        {"seq": 5, "t": 20.0, "kind": "refused", "device": gpu, "client": "c1", "detail": "999 timeout"},
    ]
    timeline = Timeline.from_events(events)
    waits = [i for i in timeline.intervals if i.kind == ADMISSION_WAIT]
    assert [(w.start, w.end, w.ended_by) for w in waits] == [(11.0, 14.0, "admitted"), (15.0, 20.0, "refused timeout")]
    (row,) = summarise(timeline)
    assert row.memory_waited == 8.0 and row.refused == 1 and row.waits == 0 and row.holds == 0
    from rich.console import Console

    console = Console(width=60, record=True, color_system=None)
    console.print(render(timeline, width=60))
    drawn = console.export_text()
    assert "~" in drawn and "!" in drawn
