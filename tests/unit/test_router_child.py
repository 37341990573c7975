"""The spawned router's pure parts (supervisor/router/child.py): its command line, when it is
started again, whether a journal's router is adopted (the one verdict of engine/adoption.py);
and the [router] spawn keys' checks."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from vime.harness.local_daemon import free_port, standin_model
from vime.supervisor.client.cli import router_line
from vime.supervisor.config import ROUTER_ARGS, ConfigError, RestartPolicy, RouterConfig, build, find_binary
from vime.supervisor.engine.process import ProcStat
from vime.supervisor.journal import validate
from vime.supervisor.engine.adoption import ADOPT, GONE, LEAVE, STOP, router_unwanted, verdict
from vime.supervisor.router.child import Restarts, router_command, router_fingerprint


def test_the_command_takes_host_and_port_from_the_url_and_starts_with_no_workers():
    r = RouterConfig(url="http://127.0.0.1:30000")
    assert router_command(r, "/bin/vllm-router") == [
        "/bin/vllm-router", *ROUTER_ARGS, "--host", "127.0.0.1", "--port", "30000", "--worker-urls"]
    assert ROUTER_ARGS == ("--disable-circuit-breaker", "--request-timeout-secs", "14400")  # vime's
    mine = RouterConfig(url="http://[::1]:31000", args=("--policy", "round_robin"))
    assert router_command(mine, "r")[1:3] == ["--policy", "round_robin"]  # args are set whole
    # Ours last: argparse keeps the last value, so an abbreviation in args (--hos) cannot win.
    assert router_command(mine, "r")[3:] == ["--host", "::1", "--port", "31000", "--worker-urls"]


def test_the_fingerprint_follows_what_would_be_started():
    a = RouterConfig(url="http://127.0.0.1:30000")
    assert router_fingerprint(a) == router_fingerprint(RouterConfig(url="http://127.0.0.1:30000", period=9.0))
    for other in (RouterConfig(url="http://127.0.0.1:30001"), RouterConfig(url=a.url, args=()),
                  RouterConfig(url=a.url, binary="/opt/r/vllm-router")):
        assert router_fingerprint(other) != router_fingerprint(a)


def test_a_router_that_had_answered_restarts_at_once_one_that_never_did_backs_off():
    policy = RestartPolicy(backoff_initial=1.0, backoff_max=5.0)
    r = Restarts(policy, random.Random(0))
    assert r.ended(answered=True) == 0.0 and r.count == 1
    delays = [r.ended(answered=False) for _ in range(5)]
    # Jittered in [d/2, d], d doubling from backoff_initial, capped at backoff_max.
    for d, bound in zip(delays, (1.0, 2.0, 4.0, 5.0, 5.0)):
        assert bound / 2 <= d <= bound, delays
    assert r.failures == 5 and r.count == 6
    assert r.ended(answered=True) == 0.0 and r.failures == 0  # one that answered resets the backoff


def stat(pid: int = 4242, start_time: int = 777, pgrp: int | None = None, state: str = "S") -> ProcStat:
    return ProcStat(pid, "vllm::router", state, 1, pid if pgrp is None else pgrp, start_time)


ENTRY = {"pid": 4242, "start_time": 777, "fingerprint": "f1", "port": 30000, "log_path": "/var/log/vime/router.log"}


QUIET = "its process group does not listen on the journal's port 30000"


@pytest.mark.parametrize("same_boot, fingerprint, leader, alien, action, why", [
    (True, "f1", stat(), None, ADOPT, ""),
    (False, "f1", stat(), None, LEAVE, "another boot"),
    (True, "f1", None, None, GONE, "no longer running"),
    (True, "f1", stat(state="Z"), None, GONE, "no longer running"),
    (True, "f1", stat(start_time=778), None, GONE, "another process's now"),
    (True, "f1", stat(pgrp=1), None, LEAVE, "no longer leads its own process group"),
    (True, "f1", stat(), QUIET, LEAVE, QUIET),
    (True, "f2", stat(), None, STOP, "started under another config"),
    (True, None, stat(), None, STOP, "no longer spawns a router"),
])
def test_a_journaled_router_is_adopted_only_if_it_is_still_that_process_of_this_config(
        same_boot, fingerprint, leader, alien, action, why):
    # A group that is not the router's (it does not hold the journal's port) is never adopted
    # nor signalled, whatever the fingerprint says (a hand-edited journal naming another program).
    got = verdict(ENTRY["start_time"], same_boot=same_boot, leader=leader, alien=alien,
                  unwanted=router_unwanted(ENTRY, fingerprint))
    assert got.action == action and why in got.why, got
    if alien is None and action in (ADOPT, STOP):
        assert verdict(ENTRY["start_time"], same_boot=same_boot, leader=leader, alien=QUIET,
                       unwanted=router_unwanted(ENTRY, fingerprint)).action == LEAVE


def test_the_journal_checks_the_router_entry():
    base = {"format": 1, "engines": {}}
    assert validate({**base, "router": ENTRY}) == []
    bad = validate({**base, "router": {**ENTRY, "pid": "4242", "start_time": -1, "fingerprint": None}})
    assert [p.split(":")[0] for p in bad] == ["router.pid", "router.start_time", "router.fingerprint"], bad


def test_status_shows_the_spawned_routers_process():
    st = {"kind": "vllm-router", "url": "http://127.0.0.1:30000", "state": "in_sync", "workers": 2,
          "process": {"pid": 4242, "state": "running", "adopted": True, "restarts": 1, "error": None}}
    assert router_line(st).endswith("http://127.0.0.1:30000, 2 workers, spawned pid 4242 running (adopted), 1 restart")
    down = {**st, "state": "unreachable",
            "process": {"pid": None, "state": "backoff", "restarts": 3, "error": "port 30000 on 127.0.0.1 is taken"}}
    assert "spawned, backoff, 3 restarts, port 30000 on 127.0.0.1 is taken" in router_line(down)


# -- the [router] spawn keys --------------------------------------------------------------------


@pytest.fixture
def base(tmp_path) -> dict:
    return {"engines": [{"name": "e0", "model": str(standin_model(tmp_path / "tiny")), "port": 8001}]}


def spawning(base: dict, **table) -> dict:
    return {**base, "router": {"url": f"http://127.0.0.1:{free_port()}", "spawn": True, **table}}


def problems(raw: dict) -> list[str]:
    with pytest.raises(ConfigError) as ei:
        build(raw)
    return ei.value.problems


def test_a_spawned_router_with_defaults(base):
    r = build(spawning(base)).router
    assert r is not None and r.spawn and r.binary == "vllm-router" and r.args == ROUTER_ARGS


@pytest.mark.parametrize("table, message", [
    ({"binary": "/nonexistent/vllm-router"}, "router.binary: /nonexistent/vllm-router is not an executable file"),
    ({"binary": "no-such-router-here"}, "router.binary: no-such-router-here is not on PATH nor beside"),
    ({"args": ["--api-key", "k"]}, "router.args: do not pass --api-key: any local user can read a command line"),
    ({"args": ["--port=1"]}, "router.args: do not pass --port; the daemon sets it from router.url"),
    ({"args": ["--worker-urls", "http://x:1"]}, "router.args: do not pass --worker-urls"),
    # argparse takes any unambiguous prefix of a long flag: so does the check.
    ({"args": ["--hos", "0.0.0.0"]}, "router.args: do not pass --host; the daemon sets it from router.url"),
    ({"args": ["--api=s3cret"]}, "router.args: do not pass --api-key"),
    ({"args": ["--work", "http://x:1"]}, "router.args: do not pass --worker-urls"),
    ({"args": [1]}, "router.args: must be a list of strings"),
    ({"url": "http://0.0.0.0:30000"}, "router.url: 0.0.0.0 would make the router listen on every address"),
    ({"url": "http://192.0.2.1:30000"}, "router.url: a spawned router listens on the url's host, and cannot on 192.0.2.1"),
    ({"url": "https://127.0.0.1:30000"}, "router.url: a spawned router serves plain HTTP"),
    ({"url": "http://127.0.0.1"}, "router.url: give the port the spawned router listens on"),
])
def test_bad_spawn_settings_say_what_to_do(base, table, message):
    found = problems(spawning(base, **table))
    assert any(p.startswith(message) for p in found), found


def test_spawn_keys_without_spawn_are_warned_about(base):
    cfg = build({**base, "router": {"url": "http://h:1", "args": ["--policy", "random"]}})
    assert any("have no effect without router.spawn = true" in w for w in cfg.warnings), cfg.warnings


def test_the_binary_is_found_beside_the_daemons_interpreter_when_path_lacks_it(monkeypatch):
    beside = Path(sys.executable).parent / "vllm-router"
    if not beside.exists():
        pytest.skip("vllm-router is not installed beside this interpreter (the router extra)")
    monkeypatch.setenv("PATH", "/nonexistent")
    assert find_binary("vllm-router") == str(beside)
    assert find_binary(str(beside)) == str(beside) and find_binary("/nonexistent/vllm-router") is None
