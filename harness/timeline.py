"""The picture of a run: timeline.png, one lane per engine, drawn from what the run recorded
(daemon.log, else trace.json; summary.json or soak.json for the faults and the outcome).

    python -m vime.harness.timeline RUN_DIR             # (re)draws RUN_DIR/timeline.png

`build()` turns events into a `Timeline` (pure); `draw()` imports matplotlib (the `timeline`
extra) and writes the PNG. The demo and the soak draw it at their end, failed or not
(docs/testing.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, NamedTuple

from vime.supervisor.protocol import Cause, Event, State

HINT = "pip install vime-supervisor[timeline] to get timeline.png"
NAME = "timeline.png"

# The daemon's log events that the stream carries too, as the stream names them.
LOG_EVENTS = {
    "engine.transition": Event.TRANSITION,
    "round.start": Event.ROUND_START,
    "round.end": Event.ROUND_END,
    "weights.published": Event.WEIGHTS_PUBLISHED,
    "sync.requested": Event.SYNC_REQUEST,
    "sync.verified": Event.SYNC_VERIFIED,
    "sync.poisoned": Event.SYNC_FAILED,
    "engine.poisoned_reported": Event.FAILURE_REPORTED,
}
STARTED, STOPPED = "supervisor.started", "supervisor.stopped"
# A daemon logs these on its way up, before supervisor.started: its life begins at the first.
STARTUP_PREFIXES = ("journal.", "control.")

# supervisord's palette, roughly: green up, blue/yellow on the way, orange/red trouble, black FATAL.
STATE_COLOURS: dict[State, str] = {
    State.STOPPED: "#bdbdbd",
    State.STARTING: "#90caf9",
    State.STALE: "#fff176",
    State.SYNCING: "#4dd0e1",
    State.RUNNING: "#43a047",
    State.STANDBY: "#a5d6a7",  # a paler green: up and verified, not serving
    State.SUSPECT: "#ffa726",
    State.UNHEALTHY: "#e53935",
    State.STOPPING: "#8d6e63",
    State.EXITED: "#b71c1c",
    State.BACKOFF: "#ab47bc",
    State.FATAL: "#212121",
}
UNKNOWN_COLOUR = "#ff80ab"

# What each fault of harness/faults.py is, in a few words for a label on its lane (the engine's,
# the daemon's, or the rounds' for the trainer's own).
FAULT_LABELS = {"kill": "kill -9", "hang": "SIGSTOP", "push": "push fails midway", "kill-gap": "kill -9 (gap)",
                "crash-start": "kill -9, start crashes", "poison-reload": "kill -9, bad checkpoint",
                "disconnect": "trainer disconnects", "daemon": "kill -9"}


# -- what the picture shows ------------------------------------------------------------------


@dataclass(frozen=True)
class Interval:
    start: float  # seconds from the run's start
    end: float
    state: str    # a State (a daemon's lifetime: "pid N")


@dataclass(frozen=True)
class Mark:
    t: float
    lane: str     # an engine, "daemon" or "rounds"
    label: str
    kind: str = ""  # a fault's kind, a detection's kind (exit, hang, poisoned, reported)


@dataclass(frozen=True)
class Round:
    n: int
    start: float
    end: float


@dataclass
class Timeline:
    origin: float  # wall clock (time.time()) of t = 0
    end: float     # seconds
    engines: list[str]
    states: dict[str, list[Interval]]
    daemons: list[Interval] = field(default_factory=list)    # each daemon's life (from daemon.log)
    rounds: list[Round] = field(default_factory=list)
    published: list[tuple[float, int]] = field(default_factory=list)  # (t, version)
    reached: list[Mark] = field(default_factory=list)        # an engine verified at a version
    detections: list[Mark] = field(default_factory=list)
    faults: list[Mark] = field(default_factory=list)
    title: str = ""

    @property
    def lanes(self) -> list[str]:
        """Top to bottom."""
        lanes = ["rounds"] if self.rounds or any(m.lane == "rounds" for m in self.faults) else []
        lanes += ["weights"] if self.published else []
        # One daemon all along says nothing the engines' lanes do not: its lane shows restarts.
        lanes += ["daemon"] if len(self.daemons) > 1 or any(m.lane == "daemon" for m in self.faults) else []
        return lanes + self.engines

    @property
    def unsupervised(self) -> list[tuple[float, float]]:
        """The gaps between one daemon's end and the next one's start."""
        return [(a.end, b.start) for a, b in zip(self.daemons, self.daemons[1:]) if b.start > a.end]


class NothingToDraw(Exception):
    """The folder holds no record of a run."""


class NoMatplotlib(Exception):
    """matplotlib (the `timeline` extra) is not installed."""


# -- reading what a run recorded ---------------------------------------------------------------


def _wall(stamp: Any) -> float | None:
    """A structlog ISO timestamp ("2026-11-22T20:53:38.063370Z") as time.time() seconds."""
    if not isinstance(stamp, str):
        return None
    try:
        dt = datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except ValueError:
        return None
    return (dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)).timestamp()


def events_from_log(lines: Iterable[str], since: float | None = None) -> tuple[list[dict], list[tuple[float, float, int | None]]]:
    """The daemon's JSON log lines as stream events ({"event", "ts", ...fields}) and each
    daemon's life (start, end, pid): from its first start-up line to supervisor.stopped, or,
    killed, to its last line. Lines that are not JSON (a traceback) and lines before `since`
    (wall clock) are skipped."""
    rows = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        ts = _wall(rec.get("timestamp")) if isinstance(rec, dict) else None
        if ts is None or (since is not None and ts < since):
            continue
        rows.append((ts, rec))
    events: list[dict] = []
    daemons: list[tuple[float, float, int | None]] = []
    alive: list[Any] | None = None  # [start, pid] of the daemon that is up
    block_at: float | None = None  # the first of the start-up lines just read
    last_ts: float | None = None
    before_block: float | None = None  # the line before them: the previous daemon's last
    for ts, rec in rows:
        name = str(rec.get("event"))
        if name.startswith(STARTUP_PREFIXES):
            if block_at is None:
                block_at, before_block = ts, last_ts
        elif name == STARTED:
            if alive is not None:  # the one before was killed: it ended with its last line
                end = before_block if block_at is not None else last_ts
                assert end is not None  # its own start line was read
                daemons.append((alive[0], end, alive[1]))
            alive = [block_at if block_at is not None else ts, rec.get("pid")]
            block_at = None
        else:
            block_at = None
        if name == STOPPED and alive is not None:
            daemons.append((alive[0], ts, alive[1]))
            alive = None
        kind = LOG_EVENTS.get(name)
        if kind is not None:
            events.append({**{k: v for k, v in rec.items() if k not in ("event", "level", "timestamp")},
                           "event": kind.value, "ts": ts})
        last_ts = ts
    if alive is not None and last_ts is not None:
        daemons.append((alive[0], last_ts, alive[1]))
    return events, daemons


def events_from_trace(doc: Mapping[str, Any]) -> list[dict]:
    """The daemon's events a Perfetto trace (trainer/trace.py) recorded, with wall-clock ts."""
    from vime.trainer.trace import DAEMON_PID

    origin = float((doc.get("otherData") or {}).get("origin_unix_s") or 0.0)
    out = []
    for e in doc.get("traceEvents") or []:
        args = e.get("args") or {}
        if e.get("pid") == DAEMON_PID and e.get("ph") == "i" and args.get("event"):
            out.append({**args, "ts": origin + float(e.get("ts", 0)) / 1e6})
    return out


# -- the pure part: events into lanes ----------------------------------------------------------


def _natural(name: str) -> list:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def detection(ev: Mapping[str, Any]) -> str | None:
    """The daemon's own rule (supervisor/metrics.py detection_kind) on a transition event: exit,
    hang, poisoned or reported; None when the transition is no detection."""
    from vime.supervisor.states import Transition
    from vime.supervisor.metrics import detection_kind

    try:
        t = Transition(str(ev.get("engine")), State(ev.get("from_state", "")), State(ev.get("to_state", "")),
                       str(ev.get("reason", "")), float(ev.get("ts", 0.0)), int(ev.get("incarnation") or 0),
                       Cause(ev.get("cause", "")))
    except ValueError:  # a state or cause this version does not know
        return None
    return detection_kind(t)


def fault_label(f: Mapping[str, Any]) -> str:
    kind = str(f.get("kind"))
    label = FAULT_LABELS.get(kind, kind)
    note = str(f.get("note") or "")
    if kind == "daemon":  # the soak's gap restarts run as this kind; their note says which
        if note.startswith("SIGTERM then start"):
            label = "SIGTERM + start"
        elif "journal torn" in note:
            label = "kill -9, journal torn"
    if f.get("resynced_after_s") is None:
        label += " (not recovered)" if f.get("detected_after_s") is not None else " (not detected)"
    return label


def build(events: Iterable[Mapping[str, Any]], *, faults: Iterable[Mapping[str, Any]] = (),
          steps: Iterable[Mapping[str, Any]] = (), daemons: Iterable[tuple[float, float, int | None]] = (),
          title: str = "") -> Timeline:
    """A Timeline from the daemon's events (stream vocabulary, wall-clock ts), the daemons' lives
    (events_from_log), and the loop's faults and steps (Fault.as_dict(), its report's steps)."""
    evs = sorted((dict(e) for e in events if isinstance(e.get("ts"), (int, float))), key=lambda e: e["ts"])
    lives = sorted(daemons, key=lambda d: d[0])
    times = [e["ts"] for e in evs] + [t for d in lives for t in d[:2]]
    if not times:
        raise NothingToDraw("no daemon events and no daemon lifetimes: nothing to draw")
    origin = min(times)

    def rel(t: float) -> float:
        return t - origin

    end = rel(max(times))
    engines = sorted({str(e["engine"]) for e in evs if e.get("event") == Event.TRANSITION and e.get("engine")},
                     key=_natural)
    tl = Timeline(origin=origin, end=end, engines=engines, states={n: [] for n in engines}, title=title,
                  daemons=[Interval(rel(a), rel(b), f"pid {pid}" if pid else "daemon") for a, b, pid in lives])

    # States: each transition opens an interval; a daemon's end closes them all (no one knows an
    # engine's state while no daemon watches it; the next daemon's transitions say it again).
    current: dict[str, tuple[float, str]] = {}

    def close_all(at: float) -> None:
        for name, (start, state) in current.items():
            tl.states[name].append(Interval(start, max(start, at), state))
        current.clear()

    ends = [d.end for d in tl.daemons[:-1]]
    opened: dict[int, float] = {}
    for e in evs:
        t = rel(e["ts"])
        while ends and ends[0] < t:
            close_all(ends.pop(0))
        kind = e.get("event")
        if kind == Event.TRANSITION and e.get("engine"):
            name = str(e["engine"])
            if name in current:
                start, state = current[name]
                tl.states[name].append(Interval(start, t, state))
            current[name] = (t, str(e.get("to_state")))
            det = detection(e)
            if det:
                tl.detections.append(Mark(t, name, det, det))
        elif kind == Event.ROUND_START and isinstance(e.get("round"), int):
            opened.setdefault(e["round"], t)  # a restarted daemon's round is the same round
        elif kind == Event.ROUND_END and e.get("round") in opened:
            tl.rounds.append(Round(e["round"], opened.pop(e["round"]), t))
        elif kind == Event.WEIGHTS_PUBLISHED and isinstance(e.get("version"), int):
            tl.published.append((t, e["version"]))
        elif kind == Event.SYNC_VERIFIED and e.get("engine") in tl.states and isinstance(e.get("version"), int):
            tl.reached.append(Mark(t, str(e["engine"]), f"v{e['version']}", "verified"))
    close_all(tl.daemons[-1].end if tl.daemons else end)
    for n, start in opened.items():  # never ended (the run stopped inside it)
        later = [r.start for r in tl.rounds if r.start > start]
        tl.rounds.append(Round(n, start, min(later, default=end)))
    tl.rounds.sort(key=lambda r: r.start)
    tl.faults = _place_faults(tl, list(faults), list(steps), evs, rel)
    return tl


def _place_faults(tl: Timeline, faults: list[Mapping[str, Any]], steps: list[Mapping[str, Any]],
                  evs: list[dict], rel: Callable[[float], float]) -> list[Mark]:
    """Each injected fault at its injection time: `injected_at` when the record has it, else
    its detection (found after its step's rounds began) less its detected_after_s."""
    round_of = {s.get("step"): s.get("round") for s in steps}
    round_start: dict[int | None, float] = {r.n: r.start for r in tl.rounds}

    def step_start(step: Any) -> float | None:
        return round_start.get(round_of.get(step)) if isinstance(step, int) else None

    # A daemon fault's detected_after_s runs to the restarted daemon's hello on the stream (when
    # the trace is there), else to the next daemon's start in its log.
    hellos = sorted(rel(e["ts"]) for e in evs if e.get("event") == Event.HELLO)
    restarts = hellos or [d.start for d in tl.daemons[1:]]
    marks, prev = [], 0.0
    for f in faults:
        step = f.get("fired_step")
        if step is None:
            continue  # never injected
        kind, engine = str(f.get("kind")), f.get("engine")
        lane = engine if engine in tl.states else "daemon" if kind == "daemon" else "rounds"
        t: float | None = None
        if isinstance(f.get("injected_at"), (int, float)):
            t = rel(float(f["injected_at"]))
        elif step_start(step) is not None:  # a fault of this run (not of an older one in the folder)
            anchor = max(prev, step_start(step - 1) or 0.0)
            if kind == "disconnect":  # the step's round opened once the trainer was back
                seen = step_start(step)
            elif kind == "daemon":
                seen = next((x for x in restarts if x > anchor), None)
            else:
                seen = next((m.t for m in tl.detections if m.lane == engine and m.t >= anchor - 0.01), None)
            after = f.get("detected_after_s")
            t = seen - after if seen is not None and isinstance(after, (int, float)) else step_start(step)
        if t is None:
            continue
        prev = t
        marks.append(Mark(t, lane, fault_label(f), kind))
    return marks


def stagger(spans: list[tuple[float, float]], levels: int = 2) -> list[int]:
    """Text levels for labels (center, width) along one line, so that neighbours do not overlap:
    each takes the lowest level free at its left edge (or, none free, the one freed first)."""
    right = [-math.inf] * levels
    out = []
    for center, width in spans:
        left = center - width / 2
        free = [i for i in range(levels) if right[i] <= left]
        lvl = free[0] if free else min(range(levels), key=lambda i: right[i])
        right[lvl] = center + width / 2
        out.append(lvl)
    return out


def thin(times: list[float], min_dx: float) -> list[int]:
    """Indices of the items to label so that labels lie at least min_dx apart (the last kept)."""
    keep: list[int] = []
    for i, t in enumerate(times):
        if not keep or t - times[keep[-1]] >= min_dx:
            keep.append(i)
    if times and keep[-1] != len(times) - 1:
        if len(keep) > 1 and times[-1] - times[keep[-1]] < min_dx:
            keep.pop()
        keep.append(len(times) - 1)
    return keep


# -- a run folder ------------------------------------------------------------------------------


def _first(run_dir: Path, *names: str) -> Path | None:
    for name in names:
        for p in (run_dir / name, run_dir / "out" / name):
            if p.is_file():
                return p
    return None


def _json(path: Path | None) -> dict:
    if path is None:
        return {}
    try:
        doc = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _title(run_dir: Path, origin: float, end: float, fresh: Callable[[Path | None], bool]) -> str:
    demo, soak = run_dir / "demo.json", run_dir / "soak.json"
    what = f"{run_dir.name}"
    if fresh(demo) and "ok" in (d := _json(demo)):
        problems = d.get("problems") or []
        what += (": demo, all good" if d["ok"] else
                 f": demo WENT WRONG: {problems[0] if problems else 'exit status ' + str(d.get('exit_status'))}"
                 + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""))
    elif fresh(soak) and (checks := _json(soak).get("checks")):
        failed = [k for k, c in checks.items() if not (c or {}).get("ok")]
        what += f": soak, all {len(checks)} checks ok" if not failed else f": soak FAILED: {', '.join(failed)}"
    when = datetime.fromtimestamp(origin, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    what = what if len(what) <= 150 else what[:147] + "..."
    return f"{what}\n{when}, {end:.0f} s" if end >= 10 else f"{what}\n{when}, {end:.1f} s"


def _titled(tl: Timeline, title: str) -> str:
    n = len(tl.faults)
    return title + (f", {n} fault{'s' if n != 1 else ''} injected" if n else "")


def load_run(run_dir: str | os.PathLike[str], since: float | None = None) -> Timeline:
    """The Timeline of a run folder (see the module's docstring for what it reads). `since`
    (wall clock) drops log lines from before it: the soak appends to one daemon.log."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise NothingToDraw(f"{run_dir} is not a folder: give the folder a demo or soak run wrote (demo-run/)")
    log = run_dir / "daemon.log"
    lives: list = []
    trace = _first(run_dir, "trace.json")
    traced = [e for e in events_from_trace(_json(trace)) if since is None or e["ts"] >= since] if trace else []
    if log.is_file():
        events, lives = events_from_log(log.read_text(encoding="utf-8", errors="replace").splitlines(), since)
        if events or lives:  # the stream's hellos: when a restarted daemon answered the trainer
            events += [e for e in traced if e["event"] == Event.HELLO and e["ts"] >= min(
                [x["ts"] for x in events] + [d[0] for d in lives])]
    elif trace is not None:
        events = traced
    else:
        raise NothingToDraw(f"no daemon.log or trace.json in {run_dir}: give the folder a demo or soak run wrote")
    if not events and not lives:
        raise NothingToDraw(f"{run_dir}: the daemon's log holds no events to draw")
    first = min([e["ts"] for e in events] + [d[0] for d in lives])

    def fresh(p: Path | None) -> bool:  # written by this run, not left by an older one in the folder
        return p is not None and p.is_file() and p.stat().st_mtime >= first

    summary = _first(run_dir, "summary.json")
    loop = _json(summary) if fresh(summary) else {}
    faults = loop.get("faults") or (_json(run_dir / "soak.json").get("faults") if fresh(run_dir / "soak.json") else None)
    tl = build(events, faults=faults or [], steps=loop.get("steps") or [], daemons=lives)
    tl.title = _titled(tl, _title(run_dir, tl.origin, tl.end, fresh))
    return tl


# -- the drawing part --------------------------------------------------------------------------

_CHAR_PX = 5.6   # pixels a label character takes at fontsize 7 and 100 dpi
_LANE_IN = 0.72  # inches per lane
_ROUND = "#e3ecf7"


def _colour(state: str) -> str:
    return STATE_COLOURS[State(state)] if state in State.__members__ else UNKNOWN_COLOUR


def _legend(tl: Timeline, Patch, Line2D) -> list:
    present = {iv.state for ivs in tl.states.values() for iv in ivs}
    states = [s.value for s in State if s.value in present] + sorted(present - set(State.__members__))
    handles = [Patch(facecolor=_colour(s), label=s) for s in states]
    if tl.rounds:
        handles.append(Patch(facecolor=_ROUND, label="round open"))
    if tl.unsupervised:
        handles.append(Patch(facecolor="white", edgecolor="#9e9e9e", hatch="////", lw=0, label="no daemon"))
    if tl.faults:
        handles.append(Line2D([], [], ls="", marker="v", color="black", label="fault injected"))
    if tl.detections:
        handles.append(Line2D([], [], ls="", marker="X", color="#d50000", label="detected (cause)"))
    if tl.reached:
        handles.append(Line2D([], [], ls="", marker="D", color="#0d47a1", markersize=5,
                              label="engine synced to version"))
    return handles


class _Frame(NamedTuple):
    """Where draw's steps draw: the axes, each lane's y, the x padding (s), s per label character."""
    ax: Any
    y: dict[str, int]
    pad: float
    per_char: float


def _draw_rounds(f: _Frame, tl: Timeline) -> None:
    """Rounds: shaded across every lane, and numbered bars on their own lane."""
    ax, y = f.ax, f.y
    for r in tl.rounds:
        ax.axvspan(r.start, max(r.end, r.start + f.pad / 4), color=_ROUND, zorder=0, lw=0)
    if "rounds" in y:
        yr = y["rounds"]
        ax.broken_barh([(r.start, max(r.end - r.start, f.pad / 4)) for r in tl.rounds], (yr - 0.15, 0.3),
                       facecolors="#7b9cc4", zorder=2)
        for i in thin([r.start for r in tl.rounds], 5 * f.per_char):
            r = tl.rounds[i]
            ax.text((r.start + r.end) / 2, yr - 0.21, str(r.n), ha="center", va="top", fontsize=7, color="#34495e")


def _draw_weights(f: _Frame, tl: Timeline) -> None:
    """Weights: a tick per publication, its version under it (thinned)."""
    if "weights" in f.y:
        yw = f.y["weights"]
        ts = [t for t, _ in tl.published]
        f.ax.vlines(ts, yw - 0.15, yw + 0.15, color="#5d4037", lw=1.0, zorder=3)
        for i in thin(ts, 5 * f.per_char):
            f.ax.text(ts[i], yw - 0.21, f"v{tl.published[i][1]}", ha="center", va="top", fontsize=7, color="#5d4037")


def _draw_daemons(f: _Frame, tl: Timeline) -> None:
    """The daemons' lives; the gaps between them hatched over the engines' lanes."""
    ax, y = f.ax, f.y
    if "daemon" in y:
        yd = y["daemon"]
        ax.broken_barh([(d.start, max(d.end - d.start, f.pad / 4)) for d in tl.daemons], (yd - 0.15, 0.3),
                       facecolors="#607d8b", zorder=2)
        for d in tl.daemons:
            if d.end - d.start > (len(d.state) + 2) * f.per_char:
                ax.text((d.start + d.end) / 2, yd - 0.21, d.state, ha="center", va="top", fontsize=7, color="#37474f")
    for a, b in tl.unsupervised:
        ax.broken_barh([(a, b - a)], (min(y[n] for n in tl.engines) - 0.18, max(y[n] for n in tl.engines) - min(
            y[n] for n in tl.engines) + 0.36) if tl.engines else (0, 0), facecolors="white", edgecolors="#9e9e9e",
            hatch="////", lw=0, zorder=1)


def _draw_engines(f: _Frame, tl: Timeline) -> None:
    """The engines' states."""
    for name in tl.engines:
        by_state: dict[str, list[tuple[float, float]]] = {}
        for iv in tl.states[name]:
            by_state.setdefault(iv.state, []).append((iv.start, max(iv.end - iv.start, f.pad / 8)))
        for state, spans in by_state.items():
            f.ax.broken_barh(spans, (f.y[name] - 0.18, 0.36), facecolors=_colour(state), zorder=2, lw=0)


def _draw_marks(f: _Frame, tl: Timeline) -> None:
    """Marks: faults above their lane; detections and versions reached on it, labelled below."""
    ax, y = f.ax, f.y

    def label(marks: list[Mark], above: bool, colour: Callable[[Mark], str]) -> None:
        for lane in tl.lanes:
            mine = sorted((m for m in marks if m.lane == lane), key=lambda m: m.t)
            levels = stagger([(m.t, (len(m.label) + 1) * f.per_char) for m in mine])
            for m, lvl in zip(mine, levels):
                off = 0.25 + 0.15 * lvl
                ax.text(m.t, y[lane] + off if above else y[lane] - off, m.label, ha="center",
                        va="bottom" if above else "top", fontsize=7, color=colour(m), zorder=6)

    if tl.faults:
        ax.scatter([m.t for m in tl.faults], [y[m.lane] + 0.22 for m in tl.faults], marker="v", s=38,
                   color="black", zorder=6)
        label(tl.faults, True, lambda m: "black")
    if tl.detections:
        ax.scatter([m.t for m in tl.detections], [y[m.lane] for m in tl.detections], marker="X", s=46,
                   color="#d50000", edgecolors="white", linewidths=0.6, zorder=7)
    if tl.reached:
        ax.scatter([m.t for m in tl.reached], [y[m.lane] for m in tl.reached], marker="D", s=16,
                   color="#0d47a1", edgecolors="white", linewidths=0.5, zorder=7)
    detected = set(map(id, tl.detections))
    label(tl.detections + tl.reached, False, lambda m: "#b71c1c" if id(m) in detected else "#0d47a1")


def _style_axes(ax: Any, lanes: list[str], y: dict[str, int]) -> None:
    ax.set_yticks([y[lane] for lane in lanes], lanes, fontsize=9)
    ax.tick_params(axis="y", length=0)
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(axis="x", color="#cfd8dc", lw=0.5)
    ax.set_axisbelow(True)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.set_xlabel("seconds from the run's start", fontsize=9)


def draw(tl: Timeline, path: str | os.PathLike[str], *, width: float = 15.0, dpi: int = 100) -> Path:
    """Write the picture (PNG) of a Timeline; raises NoMatplotlib without matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
    except ImportError as e:
        raise NoMatplotlib(HINT) from e

    lanes = tl.lanes
    y = {lane: len(lanes) - 1 - i for i, lane in enumerate(lanes)}
    handles = _legend(tl, Patch, Line2D)
    ncol = min(len(handles), 10)
    # Inches, top to bottom: title, lanes, tick labels and axis label, legend.
    top, axes_h, bottom = 0.7, (len(lanes) + 0.2) * _LANE_IN, 0.75 + 0.22 * math.ceil(len(handles) / max(ncol, 1))
    height = top + axes_h + bottom
    fig = Figure(figsize=(width, height), dpi=dpi)
    FigureCanvasAgg(fig)
    left, right = 0.8, 0.25
    ax = fig.add_axes((left / width, bottom / height, 1 - (left + right) / width, axes_h / height))
    x_end = max(tl.end, 0.5)
    pad = x_end * 0.006
    ax.set_xlim(-pad, x_end + pad)
    ax.set_ylim(-0.62, len(lanes) - 0.42)
    per_char = _CHAR_PX / ((width - left - right) * dpi / (x_end + 2 * pad))  # seconds per label character

    frame = _Frame(ax, y, pad, per_char)
    for step in (_draw_rounds, _draw_weights, _draw_daemons, _draw_engines, _draw_marks):
        step(frame, tl)
    _style_axes(ax, lanes, y)
    fig.text(left / width, 1 - 0.12 / height, tl.title, ha="left", va="top", fontsize=10)
    fig.legend(handles=handles, loc="lower center", ncol=ncol, fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, 0.04 / height), handlelength=1.4, columnspacing=1.4)
    p = Path(path)
    tmp = p.with_name(f".{p.name}.tmp")
    fig.savefig(tmp, format="png", dpi=dpi)
    os.replace(tmp, p)
    return p


def png_size(path: str | os.PathLike[str]) -> tuple[int, int]:
    """The width and height of a PNG file; ValueError when it is not one."""
    head = Path(path).read_bytes()[:24]
    if head[:8] != b"\x89PNG\r\n\x1a\n" or head[12:16] != b"IHDR":
        raise ValueError(f"{path} is not a PNG file")
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


def write_for_run(run_dir: str | os.PathLike[str], *, since: float | None = None,
                  say: Callable[[str], None] = print) -> Path | None:
    """The demo's and the soak's hook: draw RUN_DIR/timeline.png and say where it is. Never
    raises for the picture: without matplotlib it says HINT, on any other trouble one line."""
    try:
        path = draw(load_run(run_dir, since), Path(run_dir) / NAME)
    except NoMatplotlib:
        say(HINT)
        return None
    except Exception as e:  # noqa: BLE001 - a missing picture must not fail the run it shows
        say(f"timeline.png not drawn: {type(e).__name__}: {e}")
        return None
    say(f"timeline.png (the picture of the run): {path}")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vime.harness.timeline", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a folder a demo or soak run wrote")
    ap.add_argument("--out", type=Path, default=None, help=f"the PNG to write (default RUN_DIR/{NAME})")
    args = ap.parse_args(argv)
    try:
        path = draw(load_run(args.run_dir), args.out or args.run_dir / NAME)
    except NoMatplotlib:
        print(HINT, file=sys.stderr)
        return 1
    except (NothingToDraw, OSError) as e:
        print(f"timeline: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
