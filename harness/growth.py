"""The long soak's growth report: from the samples the soak took every minute, does any of the
daemon's resources grow? (docs/testing.md, The long run.)

Per quantity, a least-squares slope per hour after a warm-up, its standard error, and the
slopes of each half (a leak grows in both; a step at one fault does not); the daemon's own
quantities get an intercept per daemon incarnation. Logs and post-mortems are checked against
the retention rules exactly. The bounds are fixed here, before any run: a quantity fails when
its slope is above its bound and more than twice its standard error above zero. Pure but
`load_samples`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

MIB = 1 << 20

# The warm-up skipped at the run's start (and, for the daemon's own process, after each of its
# starts): the daemon's bounded buffers (probe history, events, the executor's threads) fill,
# the allocator reaches its working set, the engines compile and warm their caches. Ten
# minutes covers the first faults of every kind at the default pace; a run shorter than 40
# minutes skips its first quarter instead, so a short run still has samples to fit.
WARMUP_S = 600.0
WARMUP_SHARE = 0.25


def warmup_for(duration_s: float) -> float:
    return min(WARMUP_S, WARMUP_SHARE * duration_s)


@dataclass(frozen=True)
class Quantity:
    key: str          # the sample's field
    label: str
    unit: str         # the report's unit: the field's value / scale
    scale: float
    bound: float      # the largest slope allowed, in unit per hour
    per_daemon: bool  # of the daemon's process: starts again when the daemon restarts
    why: str          # what the bound means over a week-long job


# The bounds, set before any run. A leak per fault (one every 5 minutes: 12 an hour) or per
# request (the fuzzer's 20 a second) is far above each.
QUANTITIES: tuple[Quantity, ...] = (
    Quantity("daemon_rss", "daemon RSS", "MiB", MIB, 4.0, True,
             "under 672 MiB over a week; a leak of 350 KiB per fault is 4 MiB/h"),
    Quantity("daemon_fds", "daemon open fds, pools aside", "fds", 1, 2.0, True,
             "one descriptor leaked per fault is 12/h; the HTTP pools' live connections, which follow "
             "the probes' phase, are left out (a leaked one counts once its peer closes it); the least "
             "of three reads 0.25 s apart, so a descriptor held for a moment (a spawn's pipes, a "
             "connection being made) is not counted and a leaked one, open at every read, is"),
    Quantity("daemon_threads", "daemon threads", "threads", 1, 0.5, True,
             "the thread count is flat once the executor has its threads; one per fault is 12/h"),
    Quantity("loop_lag_ms", "loop lag (status round trip)", "ms", 1, 10.0, True,
             "a round trip that lengthens means work that accumulates on the event loop"),
    Quantity("journal_bytes", "journal on disk", "KiB", 1024, 4.0, False,
             "the journal holds the engines' current state only: its size must not follow the run"),
    Quantity("daemon_log_bytes", "daemon.log", "MiB", MIB, 32.0, False,
             "stderr (journald's to rotate under systemd): a rate, linear in requests and events; "
             "the bound catches a line repeated in a loop"),
    Quantity("engines_rss", "engines' RSS (all)", "MiB", MIB, 256.0, False,
             "vLLM's processes, restarted by the faults: only a growth across restarts shows here"),
)

# Reported beside, not judged by a slope: the engines' logs and post-mortems (checked against
# the retention rules) and everything together (the disk the run used).
REPORTED: tuple[Quantity, ...] = (
    Quantity("engine_logs_bytes", "engines' logs", "MiB", MIB, math.inf, False, "retention rules"),
    Quantity("incidents_bytes", "incidents", "MiB", MIB, math.inf, False, "retention rules"),
    Quantity("log_bytes", "log volume (all)", "MiB", MIB, math.inf, False, "daemon.log + engines' logs + incidents"),
    Quantity("daemon_fds_all", "daemon open fds (all)", "fds", 1, math.inf, True, "the pools' connections too"),
    Quantity("daemon_fds_max", "daemon fds, most of 3 reads", "fds", 1, math.inf, True,
             "the judged count's reads: what the daemon held for a moment shows here"),
    Quantity("daemon_tcp_out", "daemon's pooled connections", "conns", 1, math.inf, True,
             "live outbound TCP connections: the probes', the warm-up's and the router's HTTP pools; "
             "one taken and never given back still counts against its pool's limit, so such a leak "
             "is bounded and stalls the pool's calls rather than growing"),
    Quantity("daemon_tcp_out_per_peer_max", "pooled conns to one peer, most", "conns", 1, math.inf, True,
             "the probes' pool holds at most 4 per engine (limit_per_host), the warm-up's its "
             "requests, the router's 8"),
)

# (sample field, config key, what): each sample's value must stay within the key's limit (0: none).
RETENTION: tuple[tuple[str, str, str], ...] = (
    ("engine_log_files_max", "log_keep", "log files of one engine"),
    ("engine_old_logs_bytes_max", "log_keep_bytes", "bytes of one engine's logs but its live one"),
    ("incident_dirs", "incidents_keep", "post-mortem folders"),
    ("incidents_bytes", "incidents_keep_bytes", "bytes of post-mortems"),
)


@dataclass
class Fit:
    slope: float              # per hour, in the field's own unit
    se: float | None          # its standard error (None: too few samples for one)
    n: int                    # samples used
    incarnations: int         # daemon incarnations (segments) they came from
    first_half: float | None  # the slope over the first half of the used samples' time
    second_half: float | None


def _segments(samples: Sequence[dict[str, Any]], key: str, *, warmup_s: float, per_daemon: bool,
              start: float) -> list[list[tuple[float, float]]]:
    """(hours, value) of the usable samples, by segment: one per daemon incarnation (per_daemon),
    else one; the warm-up after the segment's start dropped, and samples without a value."""
    out: dict[Any, list[tuple[float, float]]] = {}
    for s in samples:
        v = s.get(key)
        if v is None:
            continue
        # A daemon started before the run (the first one) warms up with the run.
        seg_key, seg_start = ((s.get("daemon_pid"), max(start, s.get("daemon_started", start))) if per_daemon
                              else (0, start))
        if s["t"] - seg_start < warmup_s:
            continue
        out.setdefault(seg_key, []).append((s["t"] / 3600.0, float(v)))
    return list(out.values())


def _pooled(segs: list[list[tuple[float, float]]]) -> tuple[float, float | None, int] | None:
    """One slope, an intercept per segment: (slope, its standard error, samples)."""
    sxx = sxy = 0.0
    n = used = 0
    centred: list[list[tuple[float, float]]] = []
    for seg in segs:
        if len(seg) < 2:
            continue  # a lone sample says nothing about a slope inside its segment
        mt = sum(t for t, _ in seg) / len(seg)
        my = sum(y for _, y in seg) / len(seg)
        c = [(t - mt, y - my) for t, y in seg]
        sxx += sum(dt * dt for dt, _ in c)
        sxy += sum(dt * dy for dt, dy in c)
        centred.append(c)
        n += len(seg)
        used += 1
    if n < 3 or sxx <= 0:
        return None
    slope = sxy / sxx
    dof = n - used - 1
    if dof < 1:
        return slope, None, n
    rss = sum((dy - slope * dt) ** 2 for c in centred for dt, dy in c)
    return slope, math.sqrt(rss / dof / sxx), n


def fit(samples: Sequence[dict[str, Any]], key: str, *, warmup_s: float, per_daemon: bool = False,
        start: float | None = None) -> Fit | None:
    """The slope per hour of `key` (None: fewer than 3 usable samples). `start`: the run's
    start (default: the first sample's time)."""
    if not samples:
        return None
    start = samples[0]["t"] if start is None else start
    segs = _segments(samples, key, warmup_s=warmup_s, per_daemon=per_daemon, start=start)
    whole = _pooled(segs)
    if whole is None:
        return None
    ts = [t for seg in segs for t, _ in seg]
    mid = (min(ts) + max(ts)) / 2
    halves = [_pooled([[p for p in seg if (p[0] <= mid) == first] for seg in segs]) for first in (True, False)]
    return Fit(whole[0], whole[1], whole[2], len([s for s in segs if len(s) >= 2]),
               halves[0][0] if halves[0] else None, halves[1][0] if halves[1] else None)


def judge(q: Quantity, f: Fit | None) -> tuple[bool, str]:
    """(ok, verdict) of one quantity against its bound."""
    if f is None:
        return False, "too few samples after the warm-up"
    slope = f.slope / q.scale
    se = None if f.se is None else f.se / q.scale
    if slope > q.bound and (se is None or slope > 2 * se):
        return False, f"GROWS: {slope:+.3g} {q.unit}/h > {q.bound:g}"
    if se is not None and 2 * se > q.bound:
        return True, f"ok (spread {se:.3g} wider than half the bound: a longer run tells more)"
    return True, "ok"


def retention(samples: Iterable[dict[str, Any]], limits: dict[str, int]) -> list[dict[str, Any]]:
    """Each retention rule against the largest value any sample saw."""
    rows = []
    samples = list(samples)
    for field, key, what in RETENTION:
        seen = [s[field] for s in samples if s.get(field) is not None]
        limit = limits.get(key, 0)
        worst = max(seen) if seen else None
        ok = worst is not None and (limit == 0 or worst <= limit)
        rows.append({"rule": key, "what": what, "limit": limit, "max seen": worst, "ok": ok})
    return rows


def report(samples: Sequence[dict[str, Any]], *, warmup_s: float, limits: dict[str, int],
           start: float | None = None) -> dict[str, Any]:
    """The whole report, JSON-ready: per quantity its fit and verdict, the retention rules,
    the daemon's restarts, and `ok`."""
    start = (samples[0]["t"] if samples else 0.0) if start is None else start
    rows = []
    for q in (*QUANTITIES, *REPORTED):
        f = fit(samples, q.key, warmup_s=warmup_s, per_daemon=q.per_daemon, start=start)
        judged = q.bound != math.inf
        ok, verdict = judge(q, f) if judged else (True, "reported")
        values = [s[q.key] / q.scale for s in samples if s.get(q.key) is not None]

        def per_h(v: float | None) -> float | None:
            return None if v is None else v / q.scale

        rows.append({"key": q.key, "label": q.label, "unit": q.unit, "bound per h": q.bound if judged else None,
                     "first": values[0] if values else None, "last": values[-1] if values else None,
                     "slope per h": per_h(f.slope) if f else None, "se per h": per_h(f.se) if f else None,
                     "first half per h": per_h(f.first_half) if f else None,
                     "second half per h": per_h(f.second_half) if f else None,
                     "samples used": f.n if f else 0, "daemon incarnations": f.incarnations if f else 0,
                     "ok": ok, "verdict": verdict, "why": q.why})
    kept = retention(samples, limits)
    pids = [s.get("daemon_pid") for s in samples if s.get("daemon_pid")]
    restarts = [s["t"] - start for s in samples if s.get("daemon_restarted")]
    return {"ok": all(r["ok"] for r in rows) and all(r["ok"] for r in kept),
            "samples": len(samples), "seconds": (samples[-1]["t"] - start) if samples else 0.0,
            "warmup_s": warmup_s, "daemon pids": list(dict.fromkeys(pids)),
            "daemon restarts at s": [round(x, 1) for x in restarts],
            "quantities": rows, "retention": kept}


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:+.3g}" if v else "0"


def format_report(rep: dict[str, Any]) -> str:
    lines = ["", f"growth ({rep['samples']} samples over {rep['seconds'] / 60:.1f} min, warm-up "
                 f"{rep['warmup_s'] / 60:.1f} min skipped; daemon pids {rep['daemon pids']}, restarts at "
                 f"{rep['daemon restarts at s'] or 'none'} s)",
             f"  {'quantity':<30}{'unit':>8}{'first':>10}{'last':>10}{'slope/h':>10}{'± se':>9}"
             f"{'1st half':>10}{'2nd half':>10}{'bound/h':>9}  verdict"]
    for r in rep["quantities"]:
        first = "-" if r["first"] is None else f"{r['first']:.4g}"
        last = "-" if r["last"] is None else f"{r['last']:.4g}"
        se = "-" if r["se per h"] is None else f"{r['se per h']:.2g}"
        bound = "-" if r["bound per h"] is None else f"{r['bound per h']:g}"
        lines.append(f"  {r['label']:<30}{r['unit']:>8}{first:>10}{last:>10}{_num(r['slope per h']):>10}{se:>9}"
                     f"{_num(r['first half per h']):>10}{_num(r['second half per h']):>10}{bound:>9}  {r['verdict']}")
    lines += ["", "retention (largest value seen at any sample; 0: no limit)"]
    for r in rep["retention"]:
        lines.append(f"  {'ok  ' if r['ok'] else 'FAIL'} {r['rule']:<22}{r['what']:<46} max {r['max seen']}, "
                     f"limit {r['limit']}")
    lines.append(f"\ngrowth verdict: {'ok, nothing grows beyond its bound' if rep['ok'] else 'FAIL'}")
    return "\n".join(lines)


def load_samples(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
