"""The Grafana dashboard the project ships (deploy/grafana/vime-dashboard.json), generated from
PANELS, a small table of titles and PromQL, so a reviewer reads the queries here and not in
Grafana's schema; and its picture drawn from a real Prometheus (docs/dashboard.png,
docs/operations.md).

    python -m vime.harness.dashboard           write deploy/grafana/vime-dashboard.json
    python -m vime.harness.dashboard --check   exit 1 if the file differs from PANELS

No query hides a missing series behind a fallback: a misspelt metric shows "No data", and
tests/daemon/test_dashboard_live.py fails.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD_JSON = ROOT / "deploy" / "grafana" / "vime-dashboard.json"
UID = "vime-supervisor"
SEL = '{job=~"$job",instance=~"$instance"}'  # every selector's filter
RATE = "$__rate_interval"


def m(name: str, matchers: str = "") -> str:
    """A selector of `name` with the dashboard's filter (and `matchers`, e.g. 'state="FATAL"')."""
    return name + SEL[:-1] + ("," + matchers if matchers else "") + "}"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    queries: tuple[Query, ...]
    unit: str = "short"
    description: str = ""
    stacked: bool = False
    # Moves when an engine is killed or hangs: the live test checks that it does.
    shows_faults: bool = False
    extra: Mapping[str, Any] = field(default_factory=dict)


def q(expr: str, legend: str) -> Query:
    return Query(expr, legend)


PANELS: tuple[Panel, ...] = (
    Panel("Engines by state", (q(f"sum by (state) ({m('vime_engine_state')})", "{{state}}"),),
          description="How many engines are in each state (supervisord's words, plus STALE, SYNCING, STANDBY)",
          stacked=True, shows_faults=True),
    Panel("Serving against target", (
        q(m("vime_routable_engines"), "routable"),
        q(m("vime_routable_target"), "target (engines less spares)"),
        q(m("vime_min_healthy"), "min_healthy")),
        description="Routable engines against full strength and the floor", shows_faults=True),
    Panel("Detections by cause", (
        q(f"sum by (kind) (increase({m('vime_detections_total')}[{RATE}]))", "{{kind}}"),),
        description="Failures detected: exit, hang, poisoned, reported", shows_faults=True),
    Panel("Restarts by cause", (
        q(f"sum by (engine, cause) (increase({m('vime_engine_restarts_total')}[{RATE}]))", "{{engine}} {{cause}}"),),
        description="Restarts, by why the incarnation before ended", shows_faults=True),
    Panel("Time to recover", (
        q(f"histogram_quantile(0.9, sum by (le) (rate({m('vime_detection_to_routable_seconds_bucket')}[{RATE}])))",
          "p90 detection to routable"),
        q(f"sum(increase({m('vime_detection_to_routable_seconds_count')}[{RATE}]))", "recoveries")),
        unit="s", description="From a detected failure to the engine routable again", shows_faults=True),
    Panel("Heartbeats by outcome", (
        q(f"sum by (outcome) (rate({m('vime_probes_total')}[{RATE}]))", "{{outcome}}"),),
        unit="reqps", description="late_busy and paused are excused, stopped/timeout/refused count toward a hang",
        stacked=True, shows_faults=True),
    Panel("Router membership", (
        q(m("vime_router_workers"), "router lists"),
        q(m("vime_routable_engines"), "routable"),
        q(m("vime_router_missing_workers"), "missing from the router"),
        q(m("vime_router_unknown_workers"), "not ours"),
        q(m("vime_router_up"), "router up")),
        description="The router's worker list against the routable set", shows_faults=True),
    Panel("Spares", (
        q(m("vime_spares"), "configured"),
        q(m("vime_spares_ready"), "ready (STANDBY)")),
        description="Warm spares: promoted in a round gap when an engine fails"),
    Panel("Weight push durations", (
        q(f"histogram_quantile(0.5, sum by (le) (rate({m('vime_push_seconds_bucket')}[{RATE}])))", "p50"),
        q(f"histogram_quantile(0.9, sum by (le) (rate({m('vime_push_seconds_bucket')}[{RATE}])))", "p90"),
        q(f"histogram_quantile(0.9, sum by (le) (rate({m('vime_sync_duration_seconds_bucket')}[{RATE}])))",
          "p90 restarted engine's sync")),
        unit="s", description="Announced pushes, from announcement to end; syncs of restarted engines"),
    Panel("Weight pushes and failures", (
        q(f"sum by (outcome) (increase({m('vime_pushes_total')}[{RATE}]))", "pushes {{outcome}}"),
        q(f"sum by (cause) (increase({m('vime_push_receiver_failures_total')}[{RATE}]))", "receivers lost: {{cause}}"),
        q(f"sum by (outcome) (increase({m('vime_syncs_total')}[{RATE}]))", "syncs {{outcome}}")),
        description="Pushes by how they ended; receivers condemned by a push"),
    Panel("Round and weight version", (
        q(m("vime_round"), "round"),
        q(m("vime_weight_version"), "weight version"),
        q(m("vime_round_open"), "round open")),
        description="The trainer's round and published weight version (-1: none)"),
    Panel("Daemon event loop and watchdog", (
        q(m("vime_event_loop_lag_max_seconds"), "loop lag, max over 1 min"),
        q(f"histogram_quantile(0.99, sum by (le) (rate({m('vime_event_loop_lag_seconds_bucket')}[{RATE}])))",
          "loop lag p99"),
        q(m("vime_watchdog_lateness_seconds"), "watchdog ping lateness"),
        q(f"{m('vime_watchdog_timeout_seconds')} / 2", "watchdog: systemd kills past this lateness")),
        unit="s", description="How late the daemon's loop runs (a blocked or starved loop answers everything late)"),
    Panel("Daemon CPU", (
        q(f"rate({m('process_cpu_seconds_total')}[{RATE}])", "CPU (cores)"),),
        unit="short", description="The daemon's own process"),
    Panel("Daemon memory", (
        q(m("process_resident_memory_bytes"), "resident"),),
        unit="bytes", description="Resident memory of the daemon's process"),
    Panel("Daemon descriptors", (
        q(m("process_open_fds"), "open"),
        q(m("process_max_fds"), "limit")),
        description="Open descriptors of the daemon's process against its limit (a probe holds one per engine)"),
)


def _panel_json(p: Panel, i: int) -> dict[str, Any]:
    return {
        "id": i + 1,
        "type": "timeseries",
        "title": p.title,
        "description": p.description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
        "fieldConfig": {
            "defaults": {
                "unit": p.unit,
                "custom": {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 20 if p.stacked else 0,
                           "stacking": {"mode": "normal" if p.stacked else "none", "group": "A"}},
            },
            "overrides": [],
        },
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "none"}},
        "targets": [{"refId": chr(ord("A") + k), "datasource": {"type": "prometheus", "uid": "${datasource}"},
                     "expr": t.expr, "legendFormat": t.legend, "range": True}
                    for k, t in enumerate(p.queries)],
    }


def _variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {"name": name, "label": label, "type": "query", "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "query": {"query": query, "refId": name}, "definition": query, "refresh": 2, "includeAll": True,
            "multi": True, "allValue": ".*", "current": {"selected": True, "text": "All", "value": "$__all"}}


def dashboard() -> dict[str, Any]:
    return {
        "uid": UID,
        "title": "vime-supervisor",
        "description": "The rollout fleet under vime-supervisor: engines, faults, recovery, pushes, router, the daemon",
        "tags": ["vime-supervisor", "vllm"],
        "editable": True,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "timezone": "",
        "links": [],
        "annotations": {"list": []},
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0},
            _variable("job", "job", "label_values(vime_engine_state, job)"),
            _variable("instance", "instance", 'label_values(vime_engine_state{job=~"$job"}, instance)'),
        ]},
        "panels": [_panel_json(p, i) for i, p in enumerate(PANELS)],
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2, sort_keys=False) + "\n"


# -- what the live test reads off the queries ---------------------------------------------------

_KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
                       "bool", "offset", "inf", "nan"})


def metric_names(expr: str) -> set[str]:
    """The metric names an expression's selectors read: every identifier that is not a
    function, a keyword, a label name in a matcher or a grouping, a string or a number."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings
    s = re.sub(r"\{[^}]*\}", " ", s)  # matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)  # ranges
    s = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)  # groupings
    out = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", s):
        word, rest = match.group(0), s[match.end():].lstrip()
        if rest.startswith("(") or word.lower() in _KEYWORDS:
            continue
        if re.fullmatch(r"\d+(?:e\d+)?", word):
            continue
        out.add(word)
    return out


def for_prometheus(expr: str, job: str, rate_interval: str) -> str:
    """A panel's query as Grafana would send it, with the variables set (`job`: a plain name)."""
    return (expr.replace("$job", job).replace("$instance", ".*")
            .replace("$__rate_interval", rate_interval))


def fallbacks(expr: str) -> list[str]:
    """Constructs that would hide a missing series: `or` (as in `or vector(0)`), vector(), absent()."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    return [w for w in ("or", "vector", "absent", "absent_over_time") if re.search(rf"\b{w}\b", s)]


# -- the picture ---------------------------------------------------------------------------------

def draw(series: Mapping[str, Sequence[tuple[str, Sequence[tuple[float, float]]]]], path: Path,
         marks: Sequence[tuple[float, str]] = (), title: str = "") -> None:
    """One small plot per panel: `series[title]` is [(legend, [(unix time, value)])]; `marks`
    are vertical lines (the faults), at unix times."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = [p.title for p in PANELS if p.title in series]
    cols = 2
    rows = (len(titles) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(13, 2.3 * rows), squeeze=False)
    t0 = min((pts[0][0] for t in titles for _, pts in series[t] if pts), default=0.0)
    t1 = max((pts[-1][0] for t in titles for _, pts in series[t] if pts), default=1.0)
    for ax, t in zip(axes.flat, titles):
        # A series at 0 (or without a value) throughout is left out of the picture, not of the
        # panel: a restart cause that never happened, say. If none is left, the first is drawn.
        shown = [(legend, pts) for legend, pts in series[t]
                 if any(y == y and y != 0 for _, y in pts)] or list(series[t][:1])
        for legend, pts in shown:
            ax.plot([x - t0 for x, _ in pts], [y for _, y in pts], label=legend, linewidth=1.2)
        ax.set_xlim(0, t1 - t0)
        for at, what in marks:
            ax.axvline(at - t0, color="grey", linestyle="--", linewidth=0.8)
            ax.annotate(what, (at - t0, 1.0), xycoords=("data", "axes fraction"), fontsize=7, color="grey",
                        ha="left", va="top")
        ax.set_title(t, fontsize=9)
        ax.tick_params(labelsize=7)
        if shown:
            ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    for ax in list(axes.flat)[len(titles):]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("seconds", fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.985) if title else None)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vime.harness.dashboard", description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the JSON file differs from PANELS")
    args = ap.parse_args(argv)
    if args.check:
        same = DASHBOARD_JSON.exists() and DASHBOARD_JSON.read_text() == render()
        print(f"{DASHBOARD_JSON}: {'up to date' if same else 'differs: run python -m vime.harness.dashboard'}")
        return 0 if same else 1
    DASHBOARD_JSON.parent.mkdir(parents=True, exist_ok=True)
    DASHBOARD_JSON.write_text(render())
    print(f"wrote {DASHBOARD_JSON} ({len(PANELS)} panels)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
