"""An announced weight push (POST /v1/pushes) through a real daemon process and its control
socket, with protocol stand-ins (tests/support/standin_group.py) that a mode file holds paused
(completions hang, /is_paused true), as a vLLM engine is between /pause and /resume:

- a receiver still paused past the push's deadline is condemned (cause paused, the push named),
  while an engine outside the push, paused as long, keeps sync_timeout and is kept;
- a bad announcement or end is refused with a 4xx that says what to do, and changes nothing;
- a SIGHUP while a push is in flight waits for it to end before the reload.

The pure decision is tested in tests/unit/test_push_excuse.py.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import pytest

from vime.supervisor.client import SupervisorClient
from vime.supervisor.engine.probes import PROGRESS_WINDOW
from vime.supervisor.sync import PUSH_GRACE
from vime.harness.local_daemon import Daemon

from support.mode_fleet import mode_fleet

from test_client_ctl import engines_by_name, wait_state

PROBE = {"first_wait": 15.0, "interval": 1.0, "timeout": 2.0, "failure_threshold": 2, "max_busy": 10.0}
SYNC_TIMEOUT = 60.0  # the excuse of a paused engine in no push: far longer than these tests
DEADLINE = 4.0  # the announced push's
# A paused probe is judged once it is late (timeout) and /is_paused was read (the window);
# the first one past the deadline comes at most an interval after it.
JUDGED = PROBE["interval"] + PROBE["timeout"] + PROGRESS_WINDOW + 1.0
ENGINES = ("a", "b")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    with mode_fleet(tmp_path_factory.mktemp("push-announce"), dict.fromkeys(ENGINES, "ok"), ENGINES,
                    supervisor={"sync_timeout": SYNC_TIMEOUT}, health_check=PROBE,
                    restart={"start_retries": 3, "backoff_initial": 0.2}) as world:
        yield world


def call(sock: str, method: str, path: str, body: bytes = b"") -> tuple[int, Any]:
    """One raw call (any body, even a wrong one): (status, parsed JSON answer)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(sock)
        s.sendall(f"{method} {path} HTTP/1.1\r\nHost: vime\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        buf = bytearray()
        while chunk := s.recv(65536):
            buf += chunk
    head, _, answer = bytes(buf).partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(answer)


def transitions(d: Daemon, engine: str, after: int) -> list[dict]:
    return [e for e in d.events[after:] if e.get("event") == "engine.transition" and e.get("engine") == engine]


def metric(text: str, line: str) -> float:
    m = re.search(rf"^{re.escape(line)} (\S+)$", text, re.M)
    assert m, f"{line} not in the metrics"
    return float(m.group(1))


def snapshot(client: SupervisorClient) -> tuple:
    st = client.status()
    return st["epoch"], st["weight_version"], {e["name"]: (e["state"], e["incarnation"]) for e in st["engines"]}


def test_bad_announcements_and_ends_are_refused_and_change_nothing(fleet):
    c, sock = fleet.client, fleet.sock
    before = snapshot(c)
    good = {"version": 1, "engines": ["a"], "bytes": 10, "deadline_s": 5}
    bad: list[tuple[dict | bytes, int, str, str]] = [
        ({**good, "engines": ["a", "nope"]}, 404, "unknown_engine", "no engine named 'nope'; known: a, b"),
        ({**good, "engines": []}, 400, "bad_request", "at least one engine"),
        ({**good, "engines": ["a", "a"]}, 400, "bad_request", "names a more than once"),
        ({**good, "engines": [1]}, 400, "bad_request", "list of engine names"),
        ({**good, "bytes": -1}, 400, "bad_request", "bytes must be >= 0"),
        ({**good, "deadline_s": 0}, 400, "bad_request", "deadline_s must be a number of seconds > 0"),
        ({**good, "deadline_s": "5"}, 400, "bad_request", "field 'deadline_s' must be int or float, got str"),
        ({**good, "deadline_s": 10**400}, 400, "bad_request", "deadline_s must be a number of seconds > 0"),
        ({k: v for k, v in good.items() if k != "bytes"}, 400, "bad_request", "missing field 'bytes'"),
        ({**good, "extra": 1}, 400, "bad_request", "unknown field 'extra'"),
        ({**good, "version": -1}, 400, "bad_request", "version must be >= 0"),
        (b"{not json", 400, "bad_json", "body is not valid JSON"),
    ]
    for body, status, code, message in bad:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        got, answer = call(sock, "POST", "/v1/pushes", raw)
        assert (got, answer["error"]["code"]) == (status, code), (body, answer)
        assert message in answer["error"]["message"], (body, answer)
    got, answer = call(sock, "POST", "/v1/pushes/nosuch/end", b'{"ok": true}')
    assert (got, answer["error"]["code"]) == (404, "unknown_push")
    assert "GET /v1/pushes lists those in flight" in answer["error"]["message"]
    assert c.pushes() == [] and snapshot(c) == before
    # A push in flight: an end that contradicts it is refused and it stays in flight.
    push = c.push_begin(1, ["a"], 10, 30.0)
    held = {e["name"]: e["push"] for e in c.status()["engines"]}
    assert held["b"] is None and held["a"]["id"] == push and 0 < held["a"]["remaining_s"] <= 30, held
    for body, message in ((b'{"ok": true, "failed": {"b": "x"}}', "failed names b, not receivers of push"),
                          (b'{"ok": true, "failed": {"a": "x"}}', "ok is true but failed names a"),
                          (b'{"ok": false, "failed": {"a": 1}}', "failed must map engine names to why"),
                          (b'{"failed": {}}', "missing field 'ok'")):
        got, answer = call(sock, "POST", f"/v1/pushes/{push}/end", body)
        assert got == 400 and message in answer["error"]["message"], answer
    got, answer = call(sock, "POST", "/v1/pushes", json.dumps({**good, "engines": ["b", "a"]}).encode())
    assert got == 409 and f"a already receives push {push}" in answer["error"]["message"], answer
    assert [p["push"] for p in c.pushes()] == [push]
    ctl = subprocess.run([sys.executable, "-m", "vime.supervisor.client.cli", "--socket", sock, "pushes"],
                         capture_output=True, text=True, timeout=60)
    assert ctl.returncode == 0 and re.match(rf"{push} +v1 +1 engines, 10 bytes, \d+s old, \d+s to its deadline "
                                            r"\(30s\): a$", ctl.stdout), (ctl.stdout, ctl.stderr)
    summary = c.push_end(push, False, {"a": "timed out in the collective"})
    assert summary["outcome"] == "failed" and summary["condemned"] == {} and not summary["late"], summary
    assert summary["failed"] == {"a": "timed out in the collective"}
    # Reported, not condemned: the daemon restarts an engine on its own evidence only.
    assert c.pushes() == [] and snapshot(c) == before
    scrape = c.metrics()
    assert metric(scrape, 'vime_pushes_total{outcome="failed"}') == 1
    assert metric(scrape, 'vime_push_receiver_failures_total{cause="reported"}') == 1
    push = c.push_begin(1, ["a", "b"], 1000, 30.0)
    assert c.push_end(push, True)["outcome"] == "ok"
    scrape = c.metrics()
    assert metric(scrape, 'vime_pushes_total{outcome="ok"}') == 1 and metric(scrape, "vime_push_bytes_total") == 1000
    assert metric(scrape, "vime_push_receivers") == 2 and metric(scrape, "vime_push_seconds_count") == 2


def test_a_receiver_paused_past_the_deadline_is_condemned_and_one_outside_is_kept(fleet):
    d, c = fleet.daemon, fleet.client
    mark = d.mark()
    scrape = c.metrics()
    failures_before = metric(scrape, 'vime_push_receiver_failures_total{cause="deadline"}')
    incarnation = engines_by_name(c.status())["a"]["incarnation"]
    for name in ENGINES:
        fleet.modes[name].write_text("paused")
    t0 = time.monotonic()
    push = c.push_begin(2, ["a"], 1 << 20, DEADLINE)
    try:
        assert [p["engines"] for p in c.pushes()] == [["a"]]
        assert re.fullmatch(r"vime_push_receivers 1\.0", next(
            line for line in c.metrics().splitlines() if line.startswith("vime_push_receivers ")))
        down = d.transition("a", "UNHEALTHY", DEADLINE + JUDGED + 5, after=mark)
        took = time.monotonic() - t0
        fleet.modes["a"].write_text("ok")
        assert DEADLINE <= took <= DEADLINE + JUDGED, f"condemned {took:.1f}s after the announcement"
        assert down["cause"] == "paused", down
        assert f"past the deadline of push {push} ({DEADLINE:g}s after it was announced)" in down["reason"], down
        # b: paused as long and longer, but in no push: sync_timeout (60 s) is its excuse.
        time.sleep(JUDGED)
        assert transitions(d, "b", mark) == []
        e = engines_by_name(c.status())["b"]
        assert e["state"] == "RUNNING" and e["last_probe"]["detail"].startswith("paused"), e
    finally:
        for m in fleet.modes.values():
            m.write_text("ok")
    # Never ended (as by a trainer that died mid-push): it expires past its deadline and the
    # grace, naming the receiver the daemon condemned.
    expired = d.wait_for(lambda e: e.get("event") == "push.expired", DEADLINE + PUSH_GRACE + 5, after=mark)
    assert expired["push"] == push and expired["condemned"] == {"a": down["reason"]}, expired
    assert c.pushes() == []
    a = wait_state(c, "a", {"RUNNING"}, timeout=30)  # restarted as after any paused-too-long
    assert a["incarnation"] == incarnation + 1
    scrape = c.metrics()
    assert metric(scrape, 'vime_push_receiver_failures_total{cause="deadline"}') == failures_before + 1
    assert metric(scrape, 'vime_pushes_total{outcome="expired"}') == 1
    wait_state(c, "b", {"RUNNING"})
    assert transitions(d, "b", mark) == []


def test_sighup_waits_for_an_announced_push_in_flight(fleet):
    d, c = fleet.daemon, fleet.client
    push = c.push_begin(3, ["a", "b"], 0, 30.0)
    mark = d.mark()
    d.proc.send_signal(signal.SIGHUP)
    waits = d.wait_for(lambda e: e.get("event") == "supervisor.reload_waits", 10, after=mark)
    assert waits["pushes"] == [push], waits
    time.sleep(2.0)  # the push goes on: no exec while it is in flight
    assert not [e for e in d.events[mark:] if e.get("event") in ("supervisor.detaching", "supervisor.reexec")]
    ended = time.monotonic()
    assert c.push_end(push, True)["outcome"] == "ok"
    d.wait_for(lambda e: e.get("event") == "supervisor.reexec", 30, after=mark)
    d.wait_for(lambda e: e.get("event") == "supervisor.started" and e.get("generation") == 1, 30, after=mark)
    assert time.monotonic() - ended < 25
    st = c.status()
    assert st["daemon"]["reloads"] == 1 and c.pushes() == []
    assert {e["name"]: e["state"] for e in st["engines"]} == {"a": "RUNNING", "b": "RUNNING"}


async def test_an_inflight_update_announces_each_wave_and_names_its_failed_engine(fleet):
    """trainer/inflight.py's waves, each an announced push (the daemon's events): [a] ended ok,
    [b], whose push failed, ended not ok naming b; each answered after the re-read."""
    import aiohttp

    from vime.supervisor.client import AsyncSupervisorClient
    from vime.trainer.inflight import InFlightUpdate
    from vime.trainer.rollout import RolloutClient

    d, c = fleet.daemon, fleet.client
    for name in ENGINES:
        wait_state(c, name, {"RUNNING"}, timeout=30)
    version = max(3, c.status()["weight_version"] or 0) + 1  # past the pushes announced above

    async def push(engine, v: int) -> None:
        if engine.name == "b":
            raise RuntimeError("collective timed out")
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{engine.url}/update_weight_version", json={"new_version": str(v)}) as r:
                assert r.status == 200

    mark = d.mark()
    sup = AsyncSupervisorClient(fleet.sock)
    async with RolloutClient(sup, follow_events=False) as rollout:
        report = await InFlightUpdate([rollout], push=push, serving_fraction=0.5, timeout=10.0, nbytes=4096).run(
            version, supervisor=sup, publish=False)
    begun = [e for e in d.events[mark:] if e.get("event") == "push.begin"]
    ended = [e for e in d.events[mark:] if e.get("event") == "push.end"]
    assert [(e["engines"], e["version"], e["bytes"]) for e in begun] == [(["a"], version, 4096), (["b"], version, 4096)]
    assert [(e["push"], e["outcome"], e["failed"]) for e in ended] == [
        (begun[0]["push"], "ok", {}), (begun[1]["push"], "failed", {"b": "RuntimeError: collective timed out"})]
    assert [sorted(a["weight_versions"]) for a in report.pushes] == [["a"], ["b"]] and c.pushes() == []
    assert report.failed == {"b": "RuntimeError: collective timed out"}
