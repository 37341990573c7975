"""What deploy/ ships to operators: the alert rules (promtool check and unit tests), the
Kubernetes manifests (the official schemas, offline, through kubernetes-validate; the config they
embed accepted by the daemon's own check; probe timings that follow from the heartbeat's
bounds) and the runbook links (each alert's section in docs/operations.md)."""

from __future__ import annotations

import math
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from vime.supervisor import config, healthz

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
RULES = DEPLOY / "prometheus" / "vime-alerts.yml"
MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
PROMTOOL = pytest.mark.skipif(shutil.which("promtool") is None,
                              reason="promtool not installed (Debian: apt-get install prometheus; make test-tools)")


def rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


@PROMTOOL
def test_promtool_checks_the_rules():
    r = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and f"SUCCESS: {len(rules())} rules found" in r.stdout, r.stdout + r.stderr


@PROMTOOL
def test_promtool_unit_tests_the_rules():
    r = subprocess.run(["promtool", "test", "rules", "vime-alerts.test.yml"], cwd=RULES.parent,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


def test_every_rule_is_unit_tested_both_ways():
    """Each alert has a case where it fires and one where it must not."""
    tests = yaml.safe_load((RULES.parent / "vime-alerts.test.yml").read_text())["tests"]
    cases = [c for t in tests for c in t["alert_rule_test"]]
    for r in rules():
        mine = [c for c in cases if c["alertname"] == r["alert"]]
        assert any(c.get("exp_alerts") for c in mine), f"{r['alert']}: no case where it fires"
        assert any(not c.get("exp_alerts") for c in mine), f"{r['alert']}: no case where it must not fire"


def slug(heading: str) -> str:
    """The anchor mkdocs (Python-Markdown's toc) gives a heading."""
    s = re.sub(r"[^\w\s-]", "", heading.strip().lower())
    return re.sub(r"[-\s]+", "-", s).strip("-")


def test_each_alert_says_what_to_do_and_links_its_section_of_the_docs():
    anchors = {slug(line.lstrip("#")) for line in (ROOT / "docs" / "operations.md").read_text().splitlines()
               if line.startswith("#")}
    for r in rules():
        url = r["annotations"]["runbook_url"]
        assert url == f"docs/operations.md#{r['alert'].lower()}", url
        assert url.split("#")[1] in anchors, f"{r['alert']}: no section {url} in docs/operations.md"
        assert r["annotations"]["summary"].endswith("see " + url), r["annotations"]["summary"]
        assert r["labels"]["severity"] in ("page", "warning")


def test_manifests_are_valid_against_the_official_schemas():
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (the test extra)")
    assert MANIFESTS
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            kv.validate(doc, kv.latest_version(), strict=True)  # raises ValidationError with the path


def daemon_container(path: Path, models: Path) -> tuple[dict, dict, config.Config]:
    """The daemon's container, its pod spec, and the config its ConfigMap holds (built by the
    daemon's own checks, with the models' directory made to exist)."""
    docs = list(yaml.safe_load_all(path.read_text()))
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    workload = next(d for d in docs if d["kind"] != "ConfigMap")
    spec = workload["spec"]["template"]["spec"]
    container = next(c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == "vime-supervisor")
    (models / "config.json").write_text("{}")
    raw = tomllib.loads(cm["data"]["config.toml"].replace("/models/policy", str(models)))
    return container, spec, config.build(raw, {})


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_probe_timings_follow_from_the_heartbeats_bounds(path, tmp_path):
    c, spec, cfg = daemon_container(path, tmp_path)
    start, live, ready = c["startupProbe"], c["livenessProbe"], c["readinessProbe"]
    assert [p["httpGet"]["path"] for p in (start, live, ready)] == [healthz.STARTUPZ, healthz.LIVEZ, healthz.READYZ]
    port = next(p for p in c["ports"] if p["name"] == "metrics")["containerPort"]
    assert config.parse_metrics_address(cfg.metrics_address)[1] == port and cfg.metrics_allow_remote
    # Started within first_wait (every first start concludes by then), with a margin.
    assert start["periodSeconds"] * start["failureThreshold"] >= cfg.probe.first_wait + 60
    # Alive: as long unanswered as systemd's watchdog allows the unit.
    unit = (ROOT / "systemd" / "vime-supervisor.service").read_text()
    watchdog = int(re.search(r"^WatchdogSec=(\d+)$", unit, re.M).group(1))
    assert live["periodSeconds"] * live["failureThreshold"] == watchdog
    # Ready follows the daemon's verdict once per heartbeat: no second threshold on top of it.
    assert ready["periodSeconds"] == math.ceil(cfg.probe.interval) and ready["failureThreshold"] == 1
    # Never a 1 s timeout (llm-d-benchmark #1734): the heartbeat's own timeout at least.
    for p in (start, live, ready):
        assert p["timeoutSeconds"] >= max(cfg.probe.timeout, 2)
    # The stop (SIGTERM to every engine, SIGKILL after stop_timeout) fits the grace period.
    assert spec["terminationGracePeriodSeconds"] > cfg.stop_timeout + 10
