"""Traces of a training job's rollouts and of the daemon, in one Chrome trace-event file
(Perfetto opens it): `Tracer`, `DaemonEventRecorder` (the daemon's events, in a thread), and
`long_tail_summary` / `format_summary` (each round's latency percentiles and slowest requests).

The tracks and what each span carries are in docs/rollout.md (Traces).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

from vime.supervisor.protocol import Event

from .dumps import first_field

__all__ = ["Tracer", "DaemonEventRecorder", "long_tail_summary", "format_summary", "save_summary",
           "percentile", "TRAINER_PID", "DAEMON_PID"]

TRAINER_PID = 1
DAEMON_PID = 2
_MONOTONIC_BELOW = 1e9  # seconds: no wall clock reads this low after 2001


def _num(v: Any) -> float | None:
    if v is None or isinstance(v, bool):
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _jsonable(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else repr(v)
    if isinstance(v, Mapping):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple, set)):
        return [_jsonable(x) for x in v]
    return repr(v)


# -- requests as plain records ------------------------------------------------------------


@dataclass
class _Attempt:
    engine: str | None
    sent: float | None
    finished: float | None
    outcome: str | None  # "ok", "refused", "died", ..., or an error text


@dataclass
class _Request:
    index: int
    engine: str
    sent: float | None
    attempt_sent: float | None  # when the attempt that answered was sent (None: = sent)
    first_token: float | None
    finished: float | None
    tokens: int | None
    attempts: int
    attempt_spans: list[_Attempt]
    finish_reason: str | None
    error: str | None
    round: Any
    name: str | None
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def latency(self) -> float | None:
        if self.sent is None or self.finished is None:
            return None
        return self.finished - self.sent

    @property
    def ttft(self) -> float | None:
        """From the send of the attempt that answered to its first token."""
        start = self.attempt_sent if self.attempt_sent is not None else self.sent
        if start is None or self.first_token is None:
            return None
        return self.first_token - start


def _request(result: Any, index: int, wall: Callable[[Any], float | None], *, round: Any = None,
             name: str | None = None, args: Mapping[str, Any] | None = None) -> _Request:
    """A rollout result (vime.trainer.rollout.RolloutResult, a dict, anything with these names) as a
    record: engine; sent/attempt_sent/first_token/finished in `timings` (mapping or object) or
    at the top level; tokens as n_tokens/num_tokens/completion_tokens or len(token_ids);
    attempts an int or a list of attempt records (engine, outcome or error, and optionally
    their own sent/finished)."""
    timings = first_field(result, "timings", default=result)
    sent = wall(first_field(timings, "sent"))
    attempt_sent = wall(first_field(timings, "attempt_sent"))
    first = wall(first_field(timings, "first_token"))
    finished = wall(first_field(timings, "finished"))
    tokens = first_field(result, "n_tokens", "num_tokens", "completion_tokens", "tokens")
    if not isinstance(tokens, int) or isinstance(tokens, bool):
        ids = first_field(result, "token_ids", "output_token_ids")
        tokens = len(ids) if ids is not None else None
    raw_attempts = first_field(result, "attempts", default=1)
    spans: list[_Attempt] = []
    if isinstance(raw_attempts, int) and not isinstance(raw_attempts, bool):
        n_attempts = raw_attempts
    else:
        raw_list = list(raw_attempts)
        n_attempts = len(raw_list)
        for a in raw_list:
            at = first_field(a, "timings", default=a)
            err = first_field(a, "error", "detail", "status", "outcome")
            spans.append(_Attempt(first_field(a, "engine"), wall(first_field(at, "sent")), wall(first_field(at, "finished")),
                                  None if err is None else str(err)))
    err = first_field(result, "error")
    return _Request(index=index, engine=str(first_field(result, "engine", default="unknown")), sent=sent,
                    attempt_sent=attempt_sent, first_token=first, finished=finished, tokens=tokens, attempts=n_attempts,
                    attempt_spans=spans, finish_reason=first_field(result, "finish_reason"),
                    error=None if err is None else str(err), round=round, name=name,
                    args=dict(args or {}))


# -- percentiles and the long-tail summary ------------------------------------------------


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between order statistics (numpy's default)."""
    s = sorted(values)
    if not s:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    k = (len(s) - 1) * q / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _stats(xs: list[float]) -> dict[str, float | None]:
    return {"p50": percentile(xs, 50), "p90": percentile(xs, 90), "p99": percentile(xs, 99),
            "max": max(xs) if xs else None, "min": min(xs) if xs else None,
            "mean": sum(xs) / len(xs) if xs else None}


def _summary(reqs: list[_Request], top: int, round: Any) -> dict[str, Any]:
    done = [r for r in reqs if r.latency is not None]
    lat = [r.latency for r in done if r.latency is not None]  # all of done
    ttft = [r.ttft for r in done if r.ttft is not None]
    stats = _stats(lat)
    slowest = sorted(done, key=lambda r: (-(r.latency or 0.0), r.index))[:top]
    per_engine: dict[str, dict[str, Any]] = {}
    for eng in sorted({r.engine for r in reqs}):
        mine = [r.latency for r in done if r.engine == eng and r.latency is not None]
        per_engine[eng] = {"count": sum(1 for r in reqs if r.engine == eng), "completed": len(mine),
                           "p50": percentile(mine, 50), "max": max(mine) if mine else None}
    return {
        "round": round,
        "count": len(reqs),
        "completed": len(done),
        "failed": len(reqs) - len(done),
        "latency_s": stats,
        "ttft_s": _stats(ttft),
        "tail_ratio_p99_p50": (stats["p99"] / stats["p50"]) if stats["p50"] and stats["p99"] is not None else None,
        "slowest": [{"index": r.index, "name": r.name, "engine": r.engine, "latency_s": r.latency,
                     "ttft_s": r.ttft, "tokens": r.tokens, "attempts": r.attempts,
                     "finish_reason": r.finish_reason} for r in slowest],
        "per_engine": per_engine,
    }


def long_tail_summary(results: Iterable[Any], *, top: int = 5, round: Any = None) -> dict[str, Any]:
    """One round's long tail from its rollout results (dicts or objects with engine and
    timings sent/first_token/finished): count, completed, failed (no finish time),
    latency_s and ttft_s {p50, p90, p99, max, min, mean} in seconds, tail_ratio_p99_p50, the
    `top` slowest requests {index (position in results), name, engine, latency_s, ttft_s, tokens,
    attempts, finish_reason}, and per_engine {count, completed, p50, max}."""
    wall = _WallClock()
    return _summary([_request(r, i, wall) for i, r in enumerate(results)], top, round)


def _fmt_s(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}s"


def format_summary(summary: Mapping[str, Any] | Iterable[Mapping[str, Any]]) -> str:
    """A text table of one summary from long_tail_summary, or of a list of them."""
    if isinstance(summary, Mapping):
        summaries = [summary]
    else:
        summaries = list(summary)
    out: list[str] = []
    for s in summaries:
        title = "round ?" if s.get("round") is None else f"round {s['round']}"
        out.append(f"{title}: {s['count']} requests ({s['completed']} completed, {s['failed']} failed)")
        for label, key in (("latency", "latency_s"), ("ttft", "ttft_s")):
            st = s[key]
            out.append(f"  {label:<8} p50 {_fmt_s(st['p50']):>9}  p90 {_fmt_s(st['p90']):>9}  "
                       f"p99 {_fmt_s(st['p99']):>9}  max {_fmt_s(st['max']):>9}")
        if s.get("tail_ratio_p99_p50"):
            out.append(f"  p99/p50  {s['tail_ratio_p99_p50']:.2f}x")
        if s["slowest"]:
            out.append(f"  slowest {len(s['slowest'])}:")
            out.append(f"    {'#':>2}  {'index':>5}  {'engine':<16} {'latency':>9} {'ttft':>9} {'tokens':>6} "
                       f"{'attempts':>8}  finish")
            for k, r in enumerate(s["slowest"], 1):
                tokens = "-" if r["tokens"] is None else r["tokens"]
                out.append(f"    {k:>2}  {r['index']:>5}  {r['engine']:<16} {_fmt_s(r['latency_s']):>9} "
                           f"{_fmt_s(r['ttft_s']):>9} {tokens:>6} {r['attempts']:>8}  {r['finish_reason'] or '-'}")
        if s["per_engine"]:
            out.append(f"  {'engine':<16} {'count':>5} {'done':>5} {'p50':>9} {'max':>9}")
            for eng, e in s["per_engine"].items():
                out.append(f"  {eng:<16} {e['count']:>5} {e['completed']:>5} {_fmt_s(e['p50']):>9} "
                           f"{_fmt_s(e['max']):>9}")
    return "\n".join(out) + "\n"


def save_summary(summary: Mapping[str, Any] | Iterable[Mapping[str, Any]], path: str | os.PathLike[str]) -> Path:
    """Write a summary (or a list of them): the text table if path ends in .txt, else JSON
    ({"rounds": [...]})."""
    p = Path(path)
    summaries = [summary] if isinstance(summary, Mapping) else list(summary)
    p.parent.mkdir(parents=True, exist_ok=True)
    if p.suffix == ".txt":
        p.write_text(format_summary(summaries), encoding="utf-8")
    else:
        p.write_text(json.dumps({"rounds": _jsonable(summaries)}, indent=1, ensure_ascii=False) + "\n",
                     encoding="utf-8")
    return p


# -- the tracer ---------------------------------------------------------------------------


class _WallClock:
    """Times as wall-clock seconds: a reading below 1e9 is monotonic, shifted by the offset."""

    def __init__(self) -> None:
        self.offset = time.time() - time.monotonic()

    def __call__(self, t: Any) -> float | None:
        v = _num(t)
        if v is None:
            return None
        return v + self.offset if v < _MONOTONIC_BELOW else v


@dataclass
class _Span:
    name: str
    start: float
    end: float
    args: dict[str, Any] = field(default_factory=dict)
    children: list["_Span"] = field(default_factory=list)
    cat: str = "trainer"


def _nest(parent: _Span) -> _Span:
    """Clamp children into the parent and make siblings disjoint (a child that starts before
    its elder sibling ended starts where it ended), recursively."""
    kids = sorted(parent.children, key=lambda c: (c.start, -c.end))
    cursor = parent.start
    fixed = []
    for c in kids:
        start = min(max(c.start, cursor), parent.end)
        end = min(max(c.end, start), parent.end)
        c.start, c.end = start, end
        cursor = end
        fixed.append(_nest(c))
    parent.children = fixed
    return parent


class Tracer:
    """Collects request, round, generic and daemon spans/events (thread-safe) and writes them
    as one Chrome trace-event file. See the module docstring for the tracks."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wall = _WallClock()
        self._requests: list[_Request] = []
        self._rounds: list[tuple[Any, float, float, dict[str, Any]]] = []
        self._spans: list[tuple[str, _Span]] = []
        self._daemon: list[dict[str, Any]] = []
        self._current_round: Any = None
        self._origin: float | None = None

    # -- recording ------------------------------------------------------------------------

    def add_request(self, result: Any, *, round: Any = None, name: str | None = None, **args: Any) -> None:
        """One rollout request (a RolloutResult or a dict; see long_tail_summary for the names
        read). `round` defaults to the round open in `with tracer.round(n)`."""
        with self._lock:
            rnd = self._current_round if round is None else round
            self._requests.append(_request(result, len(self._requests), self._wall, round=rnd, name=name,
                                           args=args))

    def add_round(self, n: Any, start: float, end: float, **args: Any) -> None:
        """A round span from start to end (seconds)."""
        s, e = self._wall(start), self._wall(end)
        if s is None or e is None:
            raise ValueError(f"round {n}: start and end must be times, got {start!r}, {end!r}")
        with self._lock:
            self._rounds.append((n, s, max(s, e), args))

    @contextlib.contextmanager
    def round(self, n: Any, **args: Any) -> Iterator[None]:
        """`with tracer.round(n):` records a round span; requests added inside default to round n."""
        start = time.time()
        with self._lock:
            prev, self._current_round = self._current_round, n
        try:
            yield
        finally:
            with self._lock:
                self._current_round = prev
            self.add_round(n, start, time.time(), **args)

    def add_span(self, name: str, start: float, end: float, *, track: str = "trainer", **args: Any) -> None:
        """Any trainer-side span (a train step, a weight push) on its own named track of pid 1."""
        s, e = self._wall(start), self._wall(end)
        if s is None or e is None:
            raise ValueError(f"span {name!r}: start and end must be times, got {start!r}, {end!r}")
        with self._lock:
            self._spans.append((track, _Span(name, s, max(s, e), dict(args))))

    @contextlib.contextmanager
    def span(self, name: str, *, track: str = "trainer", **args: Any) -> Iterator[None]:
        start = time.time()
        try:
            yield
        finally:
            self.add_span(name, start, time.time(), track=track, **args)

    def add_daemon_event(self, event: Mapping[str, Any]) -> None:
        """One event of the daemon's stream (SupervisorClient.events()). One without a "ts"
        (hello, overflow) is stamped with the time it is added."""
        if not isinstance(event, Mapping) or not event.get("event"):
            return
        ev = dict(event)
        ts = self._wall(ev.get("ts"))
        ev["ts"] = time.time() if ts is None else ts
        if ev["event"] == Event.KEEPALIVE:
            return
        with self._lock:
            self._daemon.append(ev)

    # -- reading back ---------------------------------------------------------------------

    @property
    def daemon_events(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._daemon)

    def summaries(self, *, top: int = 5) -> list[dict[str, Any]]:
        """long_tail_summary of the requests of each round, in order of first appearance."""
        with self._lock:
            reqs = list(self._requests)
        by_round: dict[Any, list[_Request]] = {}
        for r in reqs:
            by_round.setdefault(_key(r.round), []).append(r)
        return [_summary(rs, top, rs[0].round) for rs in by_round.values()]

    def save_summary(self, path: str | os.PathLike[str], *, top: int = 5) -> Path:
        return save_summary(self.summaries(top=top), path)

    # -- the trace file ---------------------------------------------------------------------

    def _request_tree(self, r: _Request) -> _Span | None:
        times = [t for t in (r.sent, r.first_token, r.finished) if t is not None]
        times += [t for a in r.attempt_spans for t in (a.sent, a.finished) if t is not None]
        if not times:
            return None
        start = r.sent if r.sent is not None else min(times)
        end = r.finished if r.finished is not None else max(times)
        end = max(end, start)
        args = {"engine": r.engine, "tokens": r.tokens, "attempts": r.attempts, "finish_reason": r.finish_reason,
                "round": r.round, "index": r.index, "latency_s": r.latency, "ttft_s": r.ttft, **r.args}
        if r.error is not None:
            args["error"] = r.error
        if r.finished is None:
            args["unfinished"] = True
        if r.attempt_spans:
            args["attempt_outcomes"] = [f"{a.engine or '?'}: {a.outcome or '?'}" for a in r.attempt_spans]
        name = r.name or f"request {r.index}" + ("" if r.round is None else f" (round {r.round})")
        root = _Span(name, start, end, {k: v for k, v in args.items() if v is not None})
        phase_parent = root
        timed = [a for a in r.attempt_spans if a.sent is not None]
        for k, a in enumerate(timed, 1):
            nxt = timed[k].sent if k < len(timed) else None
            a_end = a.finished if a.finished is not None else (nxt if nxt is not None else end)
            assert a.sent is not None  # timed: the attempts with a send time
            span = _Span(f"attempt {k}" + (f" ({a.engine})" if a.engine else ""), a.sent, a_end,
                         {x: y for x, y in (("engine", a.engine), ("outcome", a.outcome)) if y is not None})
            root.children.append(span)
            phase_parent = span
        if not timed and r.attempt_sent is not None and r.attempt_sent > start:
            # Re-sent, with only the answering attempt's send time (RolloutResult): the earlier
            # attempts as one span, then the answering one.
            earlier = [f"{a.engine or '?'}: {a.outcome or '?'}" for a in r.attempt_spans[:-1]]
            n = max(r.attempts, 2)
            root.children.append(_Span(f"attempts 1-{n - 1} (re-sent)" if n > 2 else "attempt 1 (re-sent)",
                                       start, r.attempt_sent, {"attempts": earlier} if earlier else {}))
            phase_parent = _Span(f"attempt {n} ({r.engine})", r.attempt_sent, end, {"engine": r.engine})
            root.children.append(phase_parent)
        if r.first_token is not None:
            p0 = phase_parent.start if phase_parent is not root or r.sent is None else r.sent
            phase_parent.children.append(_Span("queue+prefill", p0, r.first_token))
            if r.finished is not None:
                phase_parent.children.append(_Span("decode", r.first_token, r.finished,
                                                   {} if r.tokens is None else {"tokens": r.tokens}))
        return _nest(root)

    def _state_spans(self, evs: list[dict[str, Any]], end_of_trace: float) -> list[_Span]:
        trans = [e for e in evs if e["event"] == Event.TRANSITION and e.get("to_state")]
        out = []
        for k, e in enumerate(trans):
            until = trans[k + 1]["ts"] if k + 1 < len(trans) else end_of_trace
            out.append(_Span(str(e["to_state"]), e["ts"], max(e["ts"], until),
                             {x: e.get(x) for x in ("reason", "incarnation", "from_state") if e.get(x) is not None},
                             cat="daemon.state"))
        return out

    def trace_events(self) -> list[dict[str, Any]]:
        """The trace's events (what write() puts under "traceEvents")."""
        with self._lock:
            reqs = list(self._requests)
            rounds = list(self._rounds)
            spans = list(self._spans)
            daemon = sorted(self._daemon, key=lambda e: e["ts"])
        # Build the span trees (fresh objects each call: _nest edits them).
        trees: dict[str, list[_Span]] = {}
        for n, s, t_end, args in sorted(rounds, key=lambda x: x[1]):
            trees.setdefault("rounds", []).append(_Span(f"round {n}", s, t_end, {"round": n, **args}, cat="round"))
        for r in reqs:
            tree = self._request_tree(r)
            if tree is not None:
                trees.setdefault(f"requests {r.engine}", []).append(tree)
        for track, sp in spans:
            trees.setdefault(track, []).append(_Span(sp.name, sp.start, sp.end, dict(sp.args)))

        all_times = [t for ts in trees.values() for sp in ts for t in (sp.start, sp.end)]
        all_times += [e["ts"] for e in daemon]
        if not all_times:
            all_times = [time.time()]
        origin, end_of_trace = min(all_times), max(all_times)

        def us(t: float) -> int:
            return int(round((t - origin) * 1e6))

        events: list[dict[str, Any]] = []
        meta: list[dict[str, Any]] = []

        def name_process(pid: int, name: str) -> None:
            meta.append({"name": "process_name", "ph": "M", "ts": 0, "pid": pid, "tid": 0, "args": {"name": name}})
            meta.append({"name": "process_sort_index", "ph": "M", "ts": 0, "pid": pid, "tid": 0,
                         "args": {"sort_index": pid}})

        def name_thread(pid: int, tid: int, name: str) -> None:
            meta.append({"name": "thread_name", "ph": "M", "ts": 0, "pid": pid, "tid": tid, "args": {"name": name}})
            meta.append({"name": "thread_sort_index", "ph": "M", "ts": 0, "pid": pid, "tid": tid,
                         "args": {"sort_index": tid}})

        def emit_tree(sp: _Span, pid: int, tid: int) -> None:
            s, e = us(sp.start), us(sp.end)
            events.append({"name": sp.name, "cat": sp.cat, "ph": "X", "ts": s, "dur": e - s, "pid": pid,
                           "tid": tid, "args": _jsonable(sp.args)})
            for c in sp.children:
                emit_tree(c, pid, tid)

        # pid 1: the trainer. Tracks in a fixed order: rounds, requests per engine, the rest.
        name_process(TRAINER_PID, "trainer")
        order = (["rounds"] if "rounds" in trees else []) + \
            sorted(k for k in trees if k.startswith("requests ")) + \
            sorted(k for k in trees if k != "rounds" and not k.startswith("requests "))
        tid = 0
        for track in order:
            lanes: list[float] = []  # the end of the last tree in each lane
            lane_tids: list[int] = []
            for tree in sorted(trees[track], key=lambda t: (t.start, -t.end)):
                lane = next((i for i, last in enumerate(lanes) if us(last) <= us(tree.start)), None)
                if lane is None:
                    lanes.append(tree.end)
                    tid += 1
                    lane_tids.append(tid)
                    lane = len(lanes) - 1
                    name_thread(TRAINER_PID, tid, track if lane == 0 else f"{track} [{lane + 1}]")
                lanes[lane] = max(lanes[lane], tree.end)
                emit_tree(tree, TRAINER_PID, lane_tids[lane])

        # pid 2: the daemon. tid 1 "fleet", then one per engine.
        name_process(DAEMON_PID, "vime-supervisor daemon")
        engines = sorted({str(e["engine"]) for e in daemon if e.get("engine") is not None})
        tids: dict[str | None, int] = {None: 1, **{eng: i for i, eng in enumerate(engines, 2)}}
        if daemon:
            name_thread(DAEMON_PID, 1, "fleet")
        for eng in engines:
            name_thread(DAEMON_PID, tids[eng], eng)
        for e in daemon:
            who = None if e.get("engine") is None else str(e["engine"])
            events.append({"name": _daemon_event_name(e), "cat": "daemon", "ph": "i", "s": "t", "ts": us(e["ts"]),
                           "pid": DAEMON_PID, "tid": tids[who],
                           "args": _jsonable({k: v for k, v in e.items() if k != "ts"})})
        for eng in engines:
            for sp in self._state_spans([e for e in daemon if e.get("engine") == eng], end_of_trace):
                emit_tree(sp, DAEMON_PID, tids[eng])
        self._origin = origin
        return meta + sorted(events, key=lambda ev: (ev["pid"], ev["tid"], ev["ts"], -ev.get("dur", 0)))

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Write the Chrome trace JSON (atomically) and return its path."""
        events = self.trace_events()
        doc = {"traceEvents": events, "displayTimeUnit": "ms",
               "otherData": {"origin_unix_s": self._origin, "generator": "vime-supervisor vime.trainer.trace"}}
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.tmp")
        tmp.write_text(json.dumps(doc, ensure_ascii=False), encoding="utf-8")
        os.replace(tmp, p)
        return p


def _key(v: Any) -> Any:
    try:
        hash(v)
        return v
    except TypeError:
        return repr(v)


def _daemon_event_name(e: Mapping[str, Any]) -> str:
    kind = str(e["event"])
    if kind == Event.TRANSITION:
        return f"{e.get('from_state')} -> {e.get('to_state')}"
    if kind == Event.DETECTION:
        return f"detection: {e.get('kind')}"
    if kind in (Event.ROUND_START, Event.ROUND_END):
        return f"{kind} {e.get('round')}"
    if kind == Event.MEMBERSHIP:
        return f"membership epoch {e.get('epoch')}"
    return kind


# -- the daemon's event stream into a tracer -----------------------------------------------


class DaemonEventRecorder:
    """Reads the daemon's event stream in a thread and adds each event to a Tracer.

        with DaemonEventRecorder(client, tracer) as rec:   # or rec.start() ... rec.stop()
            ...
        rec.events   # every event received, in order

    It reads through its own SupervisorClient on the client's socket (so stop() ends only its
    own stream, not, say, a ResyncAgent's on `client`); it reconnects when the daemon restarts (a
    "reconnected" event, then a new "hello", both recorded). If the daemon stays unreachable
    the thread ends and `error` holds the exception.
    """

    def __init__(self, client: Any, tracer: Tracer | None = None) -> None:
        from vime.supervisor.client import SupervisorClient

        self.tracer = tracer if tracer is not None else Tracer()
        socket_path = getattr(client, "socket_path", None)
        if socket_path is not None:  # a SupervisorClient or an AsyncSupervisorClient: read with our own
            self.client: Any = SupervisorClient(socket_path,
                                                connect_timeout=getattr(client, "connect_timeout", 10.0),
                                                timeout=getattr(client, "timeout", 60.0),
                                                read_timeout=getattr(client, "read_timeout", 30.0))
        else:  # anything with SupervisorClient's events(keepalives=...) and close()
            self.client = client
        self.events: list[dict[str, Any]] = []
        self.error: BaseException | None = None
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False

    def start(self, wait: float = 10.0) -> "DaemonEventRecorder":
        """Start reading; wait up to `wait` s for the first event (the daemon's hello)."""
        self._thread = threading.Thread(target=self._run, name="vime-trace-events", daemon=True)
        self._thread.start()
        self.wait_for(lambda e: True, wait, raise_on_timeout=False)
        return self

    def _run(self) -> None:
        try:
            # keepalives (every 10 s of silence) let the thread see stop() even when close()
            # came before the stream was open
            for ev in self.client.events(keepalives=True):
                if self._stopping:
                    return
                if ev.get("event") == Event.KEEPALIVE:
                    continue
                if "ts" not in ev:
                    ev = {**ev, "ts": time.time()}
                self.tracer.add_daemon_event(ev)
                with self._cv:
                    self.events.append(ev)
                    self._cv.notify_all()
        except BaseException as e:  # the daemon unreachable for good, or a bug: keep it for the caller
            if not self._stopping:
                self.error = e
        finally:
            with self._cv:
                self._cv.notify_all()

    def wait_for(self, pred: Callable[[dict[str, Any]], bool], timeout: float, *,
                 raise_on_timeout: bool = True) -> dict[str, Any] | None:
        """The first recorded event matching pred, waiting up to timeout s."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                for ev in self.events:
                    if pred(ev):
                        return ev
                left = deadline - time.monotonic()
                alive = self._thread is not None and self._thread.is_alive()
                if left <= 0 or not alive:
                    if raise_on_timeout:
                        raise TimeoutError(f"no matching daemon event within {timeout}s "
                                           f"({len(self.events)} received; error: {self.error!r})")
                    return None
                self._cv.wait(min(left, 0.5))

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping = True
        close = getattr(self.client, "close", None)
        if close is not None:
            close()
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> "DaemonEventRecorder":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
