"""Prometheus' GET /metrics over loopback TCP (supervisor.metrics_address), scraped by a real
Prometheus server; the families promtool accepts; every label set at 0 from the start; the
counters that follow a kill; an address off loopback refused; a port already taken.

The daemon supervises a spawned protocol stand-in (tests/support/standin_group.py); no vLLM
behaviour is tested here.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from vime.harness.local_daemon import Daemon, free_port, standin_python, write_config
from vime.supervisor import config
from vime.supervisor.client import SupervisorClient
from vime.supervisor.config import ConfigError
from vime.supervisor.metrics import DETECTION_KINDS, IDLE_CLOSE_S, RESTART_CAUSES
from vime.supervisor.engine.probes import PROBE_KINDS

from support.daemons import end_process
from support.standins import STANDIN_GROUP as STANDIN

from test_client_ctl import listening, wait_state

PROBE = {"first_wait": 15.0, "interval": 0.5, "timeout": 0.4, "failure_threshold": 2}
JOB = "vime-supervisor"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("metrics-tcp")
    model = root / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (root / "mode").write_text("ok")
    address = f"127.0.0.1:{free_port()}"
    cfg = write_config(
        root / "supervisor.toml",
        supervisor={"runtime_dir": str(root / "run"), "log_dir": str(root / "logs"), "stop_timeout": 2.0,
                    "python": str(standin_python(root, STANDIN))},
        health_check=PROBE,
        warmup={"requests": 0},
        engines=[{"name": "e0", "model": str(model), "port": free_port(),
                  "env": {"STANDIN_MODE_FILE": str(root / "mode")}}],
    )
    d = Daemon(cfg, "--metrics-address", address)  # the flag; the config key is the same setting
    try:
        listening(d)
        client = SupervisorClient(str(root / "run" / "supervisor.sock"))
        wait_state(client, "e0", {"RUNNING"}, timeout=30)
        yield SimpleNamespace(daemon=d, client=client, root=root, address=address)
    finally:
        try:
            assert d.terminate(30) == 0
        except Exception:
            d.kill()
            raise


def scrape(address: str) -> tuple[str, str]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        return r.headers["Content-Type"], r.read().decode()


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def value(text: str, name: str, **labels: str) -> float:
    return samples(text)[(name, frozenset(labels.items()))]


def test_scrape_has_the_process_and_every_label_set_at_zero(fleet):
    ctype, text = scrape(fleet.address)
    assert ctype == "text/plain; version=0.0.4; charset=utf-8"
    families = {f.name: f for f in text_string_to_metric_families(text)}
    # The daemon's own process, beside what the control socket's /v1/metrics serves.
    assert families["process_resident_memory_bytes"].samples[0].value > 0
    assert families["process_open_fds"].samples[0].value > 0
    assert families["process_cpu_seconds"].type == "counter"  # the family; its sample ends _total
    socket_text = fleet.client.metrics()
    assert {f.name for f in text_string_to_metric_families(socket_text)} <= set(families)
    # Every label set exists before anything happened: the first detection is an increase().
    for kind in DETECTION_KINDS:
        assert value(text, "vime_detections_total", engine="e0", kind=kind) == 0
    for cause in RESTART_CAUSES:
        assert value(text, "vime_engine_restarts_total", engine="e0", cause=cause) == 0
    for kind in PROBE_KINDS:
        assert ("vime_probes_total", frozenset({"engine": "e0", "outcome": kind}.items())) in samples(text)
    assert value(text, "vime_probes_total", engine="e0", outcome="ok") >= 1
    assert value(text, "vime_engine_state", engine="e0", state="RUNNING") == 1


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (Debian: apt-get install prometheus)")
def test_promtool_accepts_the_scrape(fleet, tmp_path):
    _, text = scrape(fleet.address)
    r = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), r.stdout + r.stderr


def test_a_kill_is_counted_as_a_detection_and_a_restart_by_cause(fleet):
    pid = wait_state(fleet.client, "e0", {"RUNNING"})["pid"]
    fleet.client.signal("e0", "KILL")
    deadline = time.monotonic() + 30
    # A new pid, not None: a dead process still shows RUNNING (pid None) until the daemon sees it.
    while wait_state(fleet.client, "e0", {"RUNNING"}, timeout=30)["pid"] in (pid, None):
        assert time.monotonic() < deadline, "e0 was not restarted"
        time.sleep(0.1)
    _, text = scrape(fleet.address)
    assert value(text, "vime_detections_total", engine="e0", kind="exit") == 1
    assert value(text, "vime_detections_total", engine="e0", kind="hang") == 0
    assert value(text, "vime_engine_restarts_total", engine="e0", cause="exit") == 1
    assert sum(value(text, "vime_engine_restarts_total", engine="e0", cause=c) for c in RESTART_CAUSES) == 1


def test_other_paths_are_not_found(fleet):
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"http://{fleet.address}/v1/status", timeout=10)
    assert e.value.code == 404


def prometheus_query(port: int, query: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.loads(r.read())["data"]["result"]
    except OSError:  # not listening yet
        return []


@pytest.mark.skipif(shutil.which("prometheus") is None,
                    reason="the prometheus server is not installed (Debian: apt-get install prometheus)")
def test_an_idle_connection_is_closed_and_scrapes_go_on(fleet):
    """A client that connects and sends nothing, or keeps a connection after its scrape, does not
    hold one of the daemon's descriptors for ever."""
    host, port = fleet.address.rsplit(":", 1)
    silent = socket.create_connection((host, int(port)), timeout=5)
    kept = socket.create_connection((host, int(port)), timeout=5)
    kept.sendall(f"GET /metrics HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    try:
        for conn in (silent, kept):
            conn.settimeout(IDLE_CLOSE_S + 10)
            started = time.monotonic()
            while conn.recv(65536):  # the answer (for `kept`), then the close: b""
                pass
            assert time.monotonic() - started < IDLE_CLOSE_S + 10
        assert scrape(fleet.address)[1]
    finally:
        silent.close()
        kept.close()


def test_a_real_prometheus_scrapes_the_daemon(fleet, tmp_path):
    port = free_port()
    (tmp_path / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
        f"scrape_configs:\n  - job_name: {JOB}\n    static_configs:\n      - targets: ['{fleet.address}']\n")
    log = open(tmp_path / "prometheus.log", "wb")
    prom = subprocess.Popen(["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        state = process = []
        deadline = time.monotonic() + 45  # Prometheus' start-up, then a scrape a second
        while time.monotonic() < deadline and not (state and process):
            assert prom.poll() is None, (tmp_path / "prometheus.log").read_text()[-3000:]
            state = prometheus_query(port, f'vime_engine_state{{job="{JOB}",engine="e0",state="RUNNING"}}')
            process = prometheus_query(port, f'process_resident_memory_bytes{{job="{JOB}"}}')
            time.sleep(0.5)
        targets = prometheus_query(port, f'up{{job="{JOB}"}}')
        assert state and process, (f"no samples from the daemon within 45 s; up: {targets}; prometheus log:\n"
                                   + (tmp_path / "prometheus.log").read_text()[-3000:])
        assert float(state[0]["value"][1]) == 1.0
        assert float(process[0]["value"][1]) > 0
        assert targets and targets[0]["value"][1] == "1"
    finally:
        end_process(prom, 15)
        log.close()


def test_an_address_off_loopback_is_refused_unless_allowed(tmp_path):
    cfg = write_config(tmp_path / "sup.toml", supervisor={"runtime_dir": str(tmp_path / "run")},
                       engines=[{"name": "a", "url": "http://127.0.0.1:9"}])
    r = subprocess.run([sys.executable, "-m", "vime.supervisor", "--config", str(cfg), "--check-config",
                        "--metrics-address", "192.0.2.7:9464"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert ("config error: supervisor.metrics_address: 192.0.2.7 is not a loopback address" in r.stderr
            and "metrics_allow_remote = true" in r.stderr), r.stderr
    raw = {"supervisor": {"runtime_dir": str(tmp_path / "run")}, "engines": [{"name": "a", "url": "http://127.0.0.1:9"}]}
    for bad, why in (("9464", "must be HOST:PORT"), ("prometheus-host:9464", "not a host name"),
                     ("::1:9464", "in brackets"), ("127.0.0.1:70000", "1..65535")):
        with pytest.raises(ConfigError) as e:
            config.build(raw, {"metrics_address": bad})
        assert len(e.value.problems) == 1 and why in e.value.problems[0], (bad, e.value.problems)
    for good, bound in (("[::1]:9464", ("::1", 9464)), ("localhost:9464", ("127.0.0.1", 9464))):
        assert config.parse_metrics_address(config.build(raw, {"metrics_address": good}).metrics_address) == bound
    # The opt-in: an address of this machine off loopback (the wildcard stands for one here).
    allowed = config.build({**raw, "supervisor": {**raw["supervisor"], "metrics_allow_remote": True}},
                           {"metrics_address": "0.0.0.0:9464"})
    assert allowed.metrics_address == "0.0.0.0:9464" and any("every address" in w for w in allowed.warnings)


def test_a_taken_port_is_one_error_line_and_supervision_goes_on(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        cfg = write_config(tmp_path / "sup.toml",
                           supervisor={"runtime_dir": str(tmp_path / "run"), "log_dir": str(tmp_path / "logs"),
                                       "metrics_address": address},
                           health_check=PROBE, engines=[{"name": "a", "url": f"http://127.0.0.1:{free_port()}"}])
        d = Daemon(cfg)
        try:
            err = d.wait_for(lambda e: e.get("event") == "metrics.unavailable", 20)
            assert err["level"] == "error" and err["address"] == address and "metrics_address" in err["action"]
            d.wait_for(lambda e: e.get("event") == "supervisor.started", 20)
            assert SupervisorClient(str(tmp_path / "run" / "supervisor.sock")).status()["engines"][0]["name"] == "a"
        finally:
            d.kill()
