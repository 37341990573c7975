"""harness/timeline.py: the picture of a run. The pure part (the daemon's log into lanes of state
intervals, daemons' lives, rounds, versions and marks) on synthetic event lists; the drawing
part writes a real PNG from a small recorded run folder; without matplotlib the run says one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest

from vime.harness.timeline import (
    HINT, Interval, Mark, NothingToDraw, build, events_from_log, fault_label, load_run, main, png_size,
    stagger, thin, write_for_run,
)
from vime.supervisor.protocol import State

T0 = 1_795_380_000.0  # a wall-clock start


def line(t: float, event: str, **fields) -> str:
    """One line of the daemon's JSON log (structlog's shape), `t` seconds after T0."""
    stamp = datetime.fromtimestamp(T0 + t, timezone.utc).isoformat().replace("+00:00", "Z")
    return json.dumps({**fields, "event": event, "level": "info", "timestamp": stamp})


def tr(t: float, engine: str, frm: str, to: str, cause: str, reason: str = "") -> str:
    return line(t, "engine.transition", engine=engine, from_state=frm, to_state=to, cause=cause,
                reason=reason or cause, incarnation=1)


def ev(t: float, kind: str, **fields) -> dict:
    return {"event": kind, "ts": T0 + t, **fields}


def tev(t: float, engine: str, frm: str, to: str, cause: str) -> dict:
    return ev(t, "transition", engine=engine, from_state=frm, to_state=to, cause=cause, reason=cause, incarnation=1)


# A demo-like run: two engines boot, rounds, a kill -9 of engine-0 (detected, restarted, synced),
# then the daemon is killed and a second one adopts the engines and is stopped cleanly.
LOG = [
    line(0.0, "journal.none", action="clean start"),
    line(0.1, "journal.restored", round=None),
    line(0.2, "control.listening", socket="s"),
    line(0.3, "supervisor.started", pid=101, engines=["engine-0", "engine-1"]),
    tr(0.3, "engine-0", "STOPPED", "STARTING", "start"),
    tr(0.4, "engine-1", "STOPPED", "STARTING", "start"),
    "Traceback (most recent call last): not JSON, skipped",
    tr(40.0, "engine-0", "STARTING", "RUNNING", "ready"),
    tr(41.0, "engine-1", "STARTING", "RUNNING", "ready"),
    line(42.0, "round.start", round=1, routable=2),
    line(44.0, "round.end", round=1),
    line(45.0, "weights.published", version=1, checkpoint=None, stale=[]),
    line(46.0, "round.start", round=2, routable=2),
    tr(46.5, "engine-0", "RUNNING", "EXITED", "exit", "exited unexpectedly (killed by SIGKILL)"),
    line(48.0, "round.end", round=2),
    line(49.0, "weights.published", version=2, checkpoint=None, stale=[]),
    tr(50.0, "engine-0", "EXITED", "STARTING", "restart"),
    tr(80.0, "engine-0", "STARTING", "STALE", "ready"),
    line(80.0, "sync.requested", engine="engine-0", version=2),
    tr(80.1, "engine-0", "STALE", "SYNCING", "sync"),
    tr(81.0, "engine-0", "SYNCING", "RUNNING", "verified"),
    line(81.0, "sync.verified", engine="engine-0", version=2, how="pushed by the trainer agent"),
    line(82.0, "round.start", round=3, routable=2),
    # kill -9 of the daemon (pid 101) mid-round: its last line is at 82 s
    line(84.0, "journal.restored", round=3, round_open=True, adopted=["engine-0", "engine-1"]),
    line(84.1, "control.listening", socket="s"),
    line(84.2, "supervisor.started", pid=202, engines=["engine-0", "engine-1"]),
    tr(84.2, "engine-0", "STOPPED", "STARTING", "restored"),
    tr(84.2, "engine-1", "STOPPED", "STARTING", "restored"),
    tr(84.4, "engine-0", "STARTING", "RUNNING", "ready"),
    tr(84.4, "engine-1", "STARTING", "RUNNING", "ready"),
    line(85.0, "round.end", round=3),
    tr(86.0, "engine-1", "RUNNING", "SUSPECT", "probe"),
    tr(88.0, "engine-1", "SUSPECT", "UNHEALTHY", "hang"),
    tr(88.1, "engine-1", "UNHEALTHY", "STOPPING", "hang"),
    tr(90.0, "engine-1", "STOPPING", "EXITED", "hang"),  # after STOPPING: not a second detection
    line(91.0, "supervisor.stop_requested", why="SIGTERM"),
    tr(91.0, "engine-0", "RUNNING", "STOPPING", "shutdown"),
    tr(91.5, "engine-0", "STOPPING", "STOPPED", "shutdown"),
    line(92.0, "supervisor.stopped"),
]

STEPS = [{"step": 1, "round": 1}, {"step": 2, "round": 2}, {"step": 3, "round": 3}]
KILL = {"kind": "kill", "engine": "engine-0", "step": 2, "fired_step": 2, "detected_after_s": 0.3,
        "resynced_after_s": 34.8, "note": ""}
DAEMON_KILL = {"kind": "daemon", "engine": "daemon", "step": 3, "fired_step": 3, "detected_after_s": 2.5,
               "resynced_after_s": 2.5, "note": "pids before: engine-0=1, engine-1=2"}


def rel(tl, intervals):
    return [(round(i.start, 3), round(i.end, 3), i.state) for i in intervals]


# -- the daemon's log --------------------------------------------------------------------------


def test_the_log_becomes_stream_events_and_each_daemons_life():
    events, lives = events_from_log(LOG)
    kinds = [e["event"] for e in events]
    assert kinds.count("transition") == 19 and kinds.count("round_start") == 3 and kinds.count("round_end") == 3
    assert kinds.count("weights_published") == 2 and kinds.count("sync_verified") == 1
    assert all("timestamp" not in e and "level" not in e for e in events)
    first = events[0]
    assert first["ts"] == pytest.approx(T0 + 0.3) and first["to_state"] == "STARTING" and first["cause"] == "start"
    # The first from its first start-up line to its last line (killed); the second to supervisor.stopped.
    assert [(round(a - T0, 3), round(b - T0, 3), pid) for a, b, pid in lives] == [(0.0, 82.0, 101), (84.0, 92.0, 202)]


def test_lines_before_since_are_left_out():
    events, lives = events_from_log(LOG, since=T0 + 83.0)
    assert [(round(a - T0, 3), pid) for a, _, pid in lives] == [(84.0, 202)]
    assert min(e["ts"] for e in events) >= T0 + 83.0


# -- states, rounds, versions, detections --------------------------------------------------------


def test_states_are_intervals_closed_by_the_next_transition_and_by_the_daemons_end():
    events, lives = events_from_log(LOG)
    tl = build(events, daemons=lives)
    assert tl.origin == pytest.approx(T0) and tl.end == pytest.approx(92.0)
    assert tl.engines == ["engine-0", "engine-1"]
    assert rel(tl, tl.states["engine-0"]) == [
        (0.3, 40.0, "STARTING"), (40.0, 46.5, "RUNNING"), (46.5, 50.0, "EXITED"), (50.0, 80.0, "STARTING"),
        (80.0, 80.1, "STALE"), (80.1, 81.0, "SYNCING"),
        (81.0, 82.0, "RUNNING"),  # the killed daemon's last line: after it no one knew
        (84.2, 84.4, "STARTING"), (84.4, 91.0, "RUNNING"), (91.0, 91.5, "STOPPING"), (91.5, 92.0, "STOPPED")]
    assert rel(tl, tl.states["engine-1"]) == [
        (0.4, 41.0, "STARTING"), (41.0, 82.0, "RUNNING"), (84.2, 84.4, "STARTING"), (84.4, 86.0, "RUNNING"),
        (86.0, 88.0, "SUSPECT"), (88.0, 88.1, "UNHEALTHY"), (88.1, 90.0, "STOPPING"), (90.0, 92.0, "EXITED")]
    assert [(round(d.start, 3), round(d.end, 3), d.state) for d in tl.daemons] == [(0.0, 82.0, "pid 101"),
                                                                                   (84.0, 92.0, "pid 202")]
    assert [tuple(round(x, 3) for x in gap) for gap in tl.unsupervised] == [(82.0, 84.0)]
    assert tl.lanes == ["rounds", "weights", "daemon", "engine-0", "engine-1"]


def test_rounds_pair_start_and_end_across_a_daemon_restart():
    events, lives = events_from_log(LOG)
    tl = build(events, daemons=lives)
    # round 3 was opened by the first daemon and ended by the second
    assert [(r.n, round(r.start, 3), round(r.end, 3)) for r in tl.rounds] == [(1, 42.0, 44.0), (2, 46.0, 48.0),
                                                                             (3, 82.0, 85.0)]


def test_a_round_never_ended_lasts_until_the_next_or_the_end():
    tl = build([ev(0, "round_start", round=1), ev(5, "round_start", round=2), ev(6, "round_end", round=2),
                ev(9, "round_start", round=3), tev(10, "engine-0", "RUNNING", "STOPPING", "shutdown")])
    assert [(r.n, r.start, r.end) for r in tl.rounds] == [(1, 0, 5), (2, 5, 6), (3, 9, 10)]


def test_versions_published_and_reached():
    events, lives = events_from_log(LOG)
    tl = build(events, daemons=lives)
    assert [(round(t, 3), v) for t, v in tl.published] == [(45.0, 1), (49.0, 2)]
    assert tl.reached == [Mark(pytest.approx(81.0), "engine-0", "v2", "verified")]


def test_detections_follow_the_daemons_rule_with_their_cause():
    tl = build([
        tev(1, "engine-0", "RUNNING", "EXITED", "exit"),
        tev(2, "engine-1", "RUNNING", "UNHEALTHY", "hang"),
        tev(3, "engine-1", "UNHEALTHY", "STOPPING", "hang"),
        tev(4, "engine-1", "STOPPING", "EXITED", "hang"),            # the stop it asked for: no detection
        tev(5, "engine-2", "SYNCING", "UNHEALTHY", "sync_failed"),   # a failed sync poisons
        tev(6, "engine-10", "RUNNING", "UNHEALTHY", "reported"),
        tev(7, "engine-2", "RUNNING", "UNHEALTHY", "poisoned"),
        tev(8, "engine-0", "RUNNING", "SUSPECT", "probe"),           # below the threshold: no detection
        tev(9, "engine-0", "RUNNING", "UNHEALTHY", "no-such-cause"),  # a cause this version does not know
    ])
    assert [(m.t + 1, m.lane, m.label) for m in tl.detections] == [  # t: from the first event
        (1, "engine-0", "exit"), (2, "engine-1", "hang"), (5, "engine-2", "poisoned"), (6, "engine-10", "reported"),
        (7, "engine-2", "poisoned")]
    assert tl.engines == ["engine-0", "engine-1", "engine-2", "engine-10"]  # natural order


def test_without_daemon_lives_states_run_to_the_end_and_there_is_no_daemon_lane():
    tl = build([tev(0, "engine-0", "STOPPED", "STARTING", "start"), tev(3, "engine-0", "STARTING", "BACKOFF",
                                                                        "start_failed"),
                ev(7, "keepalive")])
    assert tl.states["engine-0"] == [Interval(0, 3, "STARTING"), Interval(3, 7, "BACKOFF")]
    assert tl.lanes == ["engine-0"] and tl.daemons == [] and tl.unsupervised == []


def test_nothing_to_build_from_no_events():
    with pytest.raises(NothingToDraw):
        build([])


# -- faults --------------------------------------------------------------------------------------


def test_faults_are_placed_at_their_detection_less_the_time_it_took():
    events, lives = events_from_log(LOG)
    disconnect = {"kind": "disconnect", "engine": "disconnect", "fired_step": 3, "detected_after_s": 1.5,
                  "resynced_after_s": 2.0}
    never = {"kind": "hang", "engine": None, "step": 9, "fired_step": None, "note": "run too short"}
    tl = build(events, daemons=lives, steps=STEPS, faults=[KILL, never, DAEMON_KILL, disconnect])
    assert [(round(m.t, 3), m.lane, m.label, m.kind) for m in tl.faults] == [
        (46.2, "engine-0", "kill -9", "kill"),               # detected (EXITED) at 46.5, 0.3 s after
        (81.5, "daemon", "kill -9", "daemon"),               # the next daemon's start (84.0) less 2.5 s
        (80.5, "rounds", "trainer disconnects", "disconnect"),  # its step's round (82.0) less 1.5 s
    ]


def test_a_daemon_fault_is_measured_to_the_streams_hello_when_it_was_recorded():
    events, lives = events_from_log(LOG)
    tl = build(events + [ev(41.5, "hello"), ev(85.0, "hello")], daemons=lives, steps=STEPS, faults=[DAEMON_KILL])
    assert [round(m.t, 3) for m in tl.faults] == [82.5]


def test_a_recorded_injection_time_wins_and_a_fault_of_another_run_is_left_out():
    events, lives = events_from_log(LOG)
    exact = {**KILL, "injected_at": T0 + 46.25}
    older = {**KILL, "fired_step": 7}  # no round of this run for its step: from an older run in the folder
    tl = build(events, daemons=lives, steps=STEPS, faults=[exact, older])
    assert [(m.t, m.lane) for m in tl.faults] == [(pytest.approx(46.25), "engine-0")]


def test_fault_labels_say_what_happened_and_what_did_not():
    assert fault_label(KILL) == "kill -9"
    assert fault_label({**KILL, "resynced_after_s": None}) == "kill -9 (not recovered)"
    assert fault_label({**KILL, "detected_after_s": None, "resynced_after_s": None}) == "kill -9 (not detected)"
    assert fault_label({**DAEMON_KILL, "note": "SIGTERM then start (clean restart): exit 0"}) == "SIGTERM + start"
    assert fault_label({**DAEMON_KILL, "note": "kill -9, journal torn, then start: exit None"}) == \
        "kill -9, journal torn"


# -- labels --------------------------------------------------------------------------------------


def test_stagger_lifts_a_label_that_would_overlap_its_neighbour():
    assert stagger([(0, 10), (20, 10), (24, 10), (28, 10), (100, 10)]) == [0, 0, 1, 0, 0]
    assert stagger([]) == []


def test_thin_keeps_labels_apart_and_always_the_last():
    assert thin([0, 1, 2, 10, 11, 20], 5) == [0, 3, 5]
    assert thin([0, 1, 2, 3], 5) == [0, 3]
    assert thin([], 5) == []


def test_every_state_has_its_own_colour():
    from vime.harness.timeline import STATE_COLOURS

    assert set(STATE_COLOURS) == set(State)
    assert len(set(STATE_COLOURS.values())) == len(State)


# -- a run folder, drawn ---------------------------------------------------------------------------


def recorded_run(folder: Path) -> Path:
    folder.mkdir()
    (folder / "daemon.log").write_text("\n".join(LOG) + "\n")
    (folder / "summary.json").write_text(json.dumps({"steps": STEPS, "faults": [KILL, DAEMON_KILL]}))
    (folder / "demo.json").write_text(json.dumps({"ok": False, "problems": ["engine-1 ends EXITED on v2"],
                                                  "exit_status": 1}))
    return folder


def assert_png(path: Path, min_width: int = 600) -> tuple[int, int]:
    w, h = png_size(path)
    assert min_width <= w <= 4000 and 150 <= h <= 3000, (w, h)
    assert path.stat().st_size > 10_000  # lanes, labels and a legend, not an empty canvas
    return w, h


def test_a_recorded_run_is_drawn_as_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    run = recorded_run(tmp_path / "run")
    tl = load_run(run)
    assert tl.title.startswith("run: demo WENT WRONG: engine-1 ends EXITED on v2\n2026-")
    assert tl.title.endswith(", 92 s, 2 faults injected")
    assert [m.kind for m in tl.faults] == ["kill", "daemon"]
    said = []
    path = write_for_run(run, say=said.append)
    assert path == run / "timeline.png" and said == [f"timeline.png (the picture of the run): {path}"]
    w, h = assert_png(path)
    assert w == 1500  # 15 inches at 100 dpi
    assert not list(run.glob(".*.tmp"))


def test_a_summary_left_by_an_older_run_is_not_drawn(tmp_path):
    run = recorded_run(tmp_path / "run")
    old = T0 - 3600
    os.utime(run / "summary.json", (old, old))
    assert load_run(run).faults == []


def test_the_command_line_redraws_and_refuses_a_folder_without_a_run(tmp_path):
    pytest.importorskip("matplotlib")
    run = recorded_run(tmp_path / "run")
    out = tmp_path / "elsewhere.png"
    assert main([str(run), "--out", str(out)]) == 0
    assert_png(out)
    empty = tmp_path / "empty"
    empty.mkdir()
    cmd = [sys.executable, "-m", "vime.harness.timeline", str(empty)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.strip() == f"timeline: no daemon.log or trace.json in {empty}: give the folder a demo or " \
                                 "soak run wrote"


def test_without_matplotlib_the_run_says_one_line_and_goes_on(tmp_path, monkeypatch):
    run = recorded_run(tmp_path / "run")
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    said = []
    assert write_for_run(run, say=said.append) is None
    assert said == [HINT] and HINT == "pip install vime-supervisor[timeline] to get timeline.png"
    assert main([str(run)]) == 1
    assert not (run / "timeline.png").exists()


def test_a_broken_record_is_one_line_not_an_error(tmp_path):
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    run.mkdir()
    (run / "daemon.log").write_text("not json\n")
    said = []
    assert write_for_run(run, say=said.append) is None
    assert said == [f"timeline.png not drawn: NothingToDraw: {run}: the daemon's log holds no events to draw"]
