"""The shipped dashboard (deploy/grafana/vime-dashboard.json) and alert rules
(deploy/prometheus/vime-alerts.yml) against a live daemon, scraped every second by a real
Prometheus (Debian's, as in test_metrics_tcp.py) that also loads the rules: through a kill -9
of a serving engine and a hang (its EngineCore SIGSTOPped), every metric name each panel and
each rule reads is in the live scrape, no query hides a missing series behind a fallback, every
panel's query returns series, the rules evaluate without error, and the panels that should show
the faults change value across them. The panels' series are drawn (docs/dashboard.png when
VIME_DASHBOARD_PNG names it: `VIME_DASHBOARD_PNG=docs/dashboard.png pytest
tests/daemon/test_dashboard_live.py`).

The engines are PROTOCOL STAND-INS (tests/support/standin_group.py): the metrics are the
daemon's own. The router is the real vllm-router (harness/router_proc.py).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from vime.harness import dashboard
from vime.harness.local_daemon import Daemon, free_port, kill_all, standin_config, standin_model, standin_python
from vime.harness.router_proc import RouterProc
from vime.supervisor.client import SupervisorClient
from vime.supervisor.engine.activity import sample_group

from support.daemons import end_process
from support.polling import wait_until
from support.standins import STANDIN_GROUP as STANDIN

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "vime-alerts.yml"
JOB = "vime-supervisor"
RATE = "5s"  # $__rate_interval at a 1 s scrape (Grafana: 4 x the scrape interval, at least)
# Series Prometheus makes itself, not the daemon: read from Prometheus, not the scrape.
PROMETHEUS_OWN = {"up"}
HOLD = 3.0  # seconds a faulty engine is kept from coming back: several scrapes see it down

pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None,
                                reason="the prometheus server is not installed (Debian: apt-get install prometheus)")


def rule_exprs() -> dict[str, str]:
    doc = yaml.safe_load(RULES.read_text())
    return {r["alert"]: r["expr"] for g in doc["groups"] for r in g["rules"]}


def panel_queries() -> list[tuple[str, str, str]]:
    """(panel title, expr, legend format) of the installed JSON (what PANELS generates)."""
    doc = json.loads(dashboard.DASHBOARD_JSON.read_text())
    return [(p["title"], t["expr"], t["legendFormat"]) for p in doc["panels"] for t in p["targets"]]


def legend(fmt: str, labels: dict[str, str]) -> str:
    for k, v in labels.items():
        fmt = fmt.replace("{{" + k + "}}", v)
    return fmt


def api(port: int, path: str, **params: str) -> dict:
    url = f"http://127.0.0.1:{port}/api/v1/{path}?" + urllib.parse.urlencode(params)
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.loads(r.read())
    except urllib.error.HTTPError as e:  # a query Prometheus refuses: say which, and why
        raise AssertionError(f"{path} {params}: {e.code} {e.read().decode()[:500]}") from None
    assert body["status"] == "success", body
    return body["data"]


def series_of(port: int, expr: str, fmt: str, start: float, end: float) -> list[tuple[str, list[tuple[float, float]]]]:
    data = api(port, "query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step="1")
    return [(legend(fmt, s["metric"]), [(float(t), float(v)) for t, v in s["values"]]) for s in data["result"]]


def moves(points: list[tuple[float, float]]) -> bool:
    values = {("nan" if math.isnan(v) else v) for _, v in points}
    return len(values) > 1


def test_installed_dashboard_is_the_generated_one():
    assert dashboard.DASHBOARD_JSON.read_text() == dashboard.render(), "run python -m vime.harness.dashboard"


def test_metric_names_are_read_out_of_promql():
    # The live check below rests on this: a name it missed would never be checked.
    assert dashboard.metric_names(
        'histogram_quantile(0.9, sum by (le) (rate(a_bucket{job=~"$job",le!="x"}[5m]))) / on (job) b + c') == {
        "a_bucket", "b", "c"}
    assert dashboard.metric_names('max by (engine) (x{state=~"A|B"}) == 1 unless on (engine) y > 0') == {"x", "y"}
    assert dashboard.fallbacks("x or vector(0)") == ["or", "vector"] and dashboard.fallbacks('x{a="or"}') == []


def test_dashboard_and_rules_against_a_live_daemon_through_a_kill_and_a_hang(tmp_path):
    queries, rules = panel_queries(), rule_exprs()
    exprs = [(title, expr) for title, expr, _ in queries] + list(rules.items())
    for what, expr in exprs:
        assert not dashboard.fallbacks(expr), f"{what}: {expr} hides a missing series ({dashboard.fallbacks(expr)})"
    router = RouterProc(free_port(), tmp_path / "router.log").start()
    address = f"127.0.0.1:{free_port()}"
    names = ("e0", "e1")
    modes = {n: tmp_path / f"{n}.mode" for n in names}
    for f in modes.values():
        f.write_text("ok")
    model = standin_model(tmp_path / "model")
    cfg = standin_config(
        tmp_path, standin_python(tmp_path, STANDIN),
        [{"name": n, "model": str(model), "served_model_name": "tiny", "port": free_port(),
          "env": {"STANDIN_MODE_FILE": str(modes[n])}} for n in names],
        supervisor={"metrics_address": address, "min_healthy": 2},
        router={"url": router.url, "period": 0.5})
    # A watchdog as systemd would set it (WATCHDOG_USEC; nobody listens on NOTIFY_SOCKET): its
    # families are then the ones a unit under systemd exports.
    d = Daemon(cfg, env={"WATCHDOG_USEC": "20000000"})
    prom_port = free_port()
    (tmp_path / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n"
        f"rule_files: ['{RULES}']\n"
        f"scrape_configs:\n  - job_name: {JOB}\n    static_configs:\n      - targets: ['{address}']\n")
    log = open(tmp_path / "prometheus.log", "wb")
    prom = subprocess.Popen(["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    client = SupervisorClient(str(tmp_path / "run" / "supervisor.sock"))
    try:
        d.wait_for(lambda e: e.get("event") == "supervisor.ready", 60)

        def scraped() -> bool:
            assert prom.poll() is None, (tmp_path / "prometheus.log").read_text()[-3000:]
            try:
                return bool(api(prom_port, "query", query=f'vime_routable_engines{{job="{JOB}"}} == 2')["result"])
            except OSError:
                return False

        wait_until(scraped, 45, "Prometheus scraping the daemon, both engines routable", interval=0.3)
        wait_until(lambda: len(router.workers()) == 2, 20, "the router listing the two serving engines")
        start = time.time()
        time.sleep(3)
        marks = []

        # kill -9 of a serving engine: below min_healthy until it is back. Its restart is held
        # (its /health silent) for HOLD seconds: a stand-in restarts in under a scrape interval.
        serving = [e for e in client.status()["engines"] if e["state"] == "RUNNING"]
        victim = serving[0]
        mark = d.mark()
        modes[victim["name"]].write_text("silent")
        marks.append((time.time(), f"kill -9 {victim['name']}"))
        os.killpg(victim["pid"], signal.SIGKILL)
        d.transition(victim["name"], "EXITED", 20, after=mark)
        time.sleep(HOLD)
        modes[victim["name"]].write_text("ok")
        wait_until(lambda: len(client.routable_engines()["engines"]) == 2, 40, "both routable after the kill",
                   interval=0.2)
        time.sleep(3)

        # A hang: the EngineCore SIGSTOPped, completions hang.
        serving = [e for e in client.status()["engines"] if e["state"] == "RUNNING"]
        hung = serving[0]
        core = next(m.pid for m in sample_group(hung["pid"]).members if m.pid != hung["pid"])
        mark = d.mark()
        modes[hung["name"]].write_text("hang")
        marks.append((time.time(), f"hang {hung['name']}"))
        os.kill(core, signal.SIGSTOP)
        d.transition(hung["name"], "UNHEALTHY", 30, after=mark)
        modes[hung["name"]].write_text("silent")  # its restart held, as above
        time.sleep(HOLD)
        modes[hung["name"]].write_text("ok")
        wait_until(lambda: len(client.routable_engines()["engines"]) == 2, 40, "both routable after the hang",
                   interval=0.2)
        time.sleep(4)  # the recovered state scraped, and the rate windows past the faults
        end = time.time()

        # Every metric name read by a panel or a rule is in the live scrape.
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
            live = {s.name for f in text_string_to_metric_families(r.read().decode()) for s in f.samples}
        for what, expr in exprs:
            missing = dashboard.metric_names(expr) - live - PROMETHEUS_OWN
            assert not missing, f"{what}: {expr} reads {sorted(missing)}, not in the daemon's scrape"
        assert api(prom_port, "query", query=f'up{{job="{JOB}"}} == 1')["result"], "Prometheus' own up"

        # Every panel's query returns series; the fault panels moved across the kill and the hang.
        drawn: dict[str, list] = {}
        for title, expr, fmt in queries:
            got = series_of(prom_port, dashboard.for_prometheus(expr, JOB, RATE), fmt, start, end)
            assert got, f"{title}: {expr} returned no series"
            drawn.setdefault(title, []).extend(got)
        for panel in dashboard.PANELS:
            if panel.shows_faults:
                assert any(moves(pts) for _, pts in drawn[panel.title]), \
                    f"{panel.title} did not change across the kill and the hang: {drawn[panel.title]}"

        # The rules: loaded, evaluated without error; none fires on a fleet that recovered.
        loaded = {r["name"]: r for g in api(prom_port, "rules")["groups"] for r in g["rules"]}
        assert set(loaded) == set(rules), sorted(set(rules) ^ set(loaded))
        for name, r in loaded.items():
            assert r["health"] == "ok" and not r.get("lastError"), (name, r)
            api(prom_port, "query", query=rules[name])  # the expression itself answers
        firing = [a for a in api(prom_port, "alerts")["alerts"] if a["state"] == "firing"]
        assert firing == [], firing

        png = Path(os.environ.get("VIME_DASHBOARD_PNG") or tmp_path / "dashboard.png")
        dashboard.draw(drawn, png, marks, title="vime-supervisor's dashboard, drawn from a live scrape "
                                                   "(2 stand-in engines, min_healthy 2)")
        assert png.stat().st_size > 10_000
    finally:
        end_process(prom, 15)
        log.close()
        kill_all([d])
        router.kill()

