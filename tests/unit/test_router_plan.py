"""The router's membership diff (supervisor/router/plan.py, pure), URL normalization and the
[router] table's validation; and the feed's retried removal, against the PROTOCOL STAND-IN of
vllm-router's /workers API (tests/support/standin_router.py; no engine runs: the runner's
state machine is moved by hand, as tests/unit/test_fleet_wiring.py does)."""

from __future__ import annotations

import asyncio
import os

import aiohttp
import pytest

from vime.harness.local_daemon import standin_model
from vime.supervisor.config import Config, ConfigError, EngineSpec, RouterConfig, build
from vime.supervisor.daemon import Supervisor, parse_args
from vime.supervisor.engine.runner import EngineRunner
from vime.supervisor.router import make_router, normalize_url
from vime.supervisor.router.feed import RouterFeed
from vime.supervisor.router.plan import plan

from support.polling import until
from support.standin_router import StandinRouter

A, B, C = "http://127.0.0.1:8001", "http://127.0.0.1:8002", "http://127.0.0.1:8003"
OTHER = "http://10.0.0.9:8001"  # another node's engine


@pytest.mark.parametrize("given, normal", [
    ("http://127.0.0.1:8001/", "http://127.0.0.1:8001"),
    ("HTTP://LocalHost:8001", "http://localhost:8001"),
    ("http://h", "http://h:80"),
    ("https://h/", "https://h:443"),
    ("http://[::1]:9000/", "http://[::1]:9000"),
    ("http://h:1/v1?x=1#f", "http://h:1/v1"),
])
def test_urls_compare_in_one_spelling(given, normal):
    assert normalize_url(given) == normal


def test_the_router_gains_the_routable_and_loses_ours_that_are_not():
    p = plan([A, B], [B + "/", C], own=[A, B, C])
    assert p.add == (A,)
    assert p.remove == (C,)  # ours, listed, not routable: out
    assert p.unknown == ()
    assert not p.in_sync


def test_in_sync_is_nothing_to_do_and_nothing_unknown():
    assert plan([A, B], [B, A], own=[A, B, C]).in_sync
    assert plan([], [], own=[A]).in_sync


def test_another_daemons_workers_are_reported_never_removed_unless_pruning():
    p = plan([A], [A, OTHER], own=[A, B])
    assert p.unknown == (OTHER,) and p.remove == () and p.add == ()
    assert not p.in_sync  # drift is shown
    pruned = plan([A], [A, OTHER], own=[A, B], prune_unknown=True)
    assert pruned.remove == (OTHER,)


def test_a_removal_names_the_url_as_the_router_spells_it():
    # The DELETE must carry the router's own key for the worker.
    p = plan([], ["HTTP://127.0.0.1:8001/"], own=[A])
    assert p.remove == ("HTTP://127.0.0.1:8001/",)


def test_the_plan_is_idempotent_once_applied():
    listed = [B, C, OTHER]
    p = plan([A, B], listed, own=[A, B, C])
    after = (set(listed) | set(p.add)) - set(p.remove)
    again = plan([A, B], after, own=[A, B, C])
    assert again.add == () and again.remove == () and again.unknown == (OTHER,)


# -- the [router] table ---------------------------------------------------------------------


@pytest.fixture
def base(tmp_path) -> dict:
    return {"engines": [{"name": "e0", "model": str(standin_model(tmp_path / "tiny")), "port": 8001}]}


def problems(raw: dict, overrides: dict | None = None) -> list[str]:
    with pytest.raises(ConfigError) as ei:
        build(raw, overrides)
    return ei.value.problems


def test_no_router_table_feeds_no_router(base):
    assert build(base).router is None


def test_a_router_table_with_defaults(base):
    r = build({**base, "router": {"url": "http://127.0.0.1:30000"}}).router
    assert r is not None
    assert (r.kind, r.worker_type, r.observe_only, r.prune_unknown) == ("vllm-router", "regular", False, False)
    assert r.remove_timeout <= 1.0 and r.token is None


def test_the_flags_alone_turn_the_router_on(base):
    args = parse_args(["--router-url", "http://127.0.0.1:30000", "--router-observe-only"])
    r = build(base, {k: getattr(args, k) for k in ("router_url", "router_observe_only", "router_prune_unknown")}).router
    assert r is not None and r.url == "http://127.0.0.1:30000" and r.observe_only


@pytest.mark.parametrize("table, message", [
    ({}, "router.url: missing"),
    ({"url": "127.0.0.1:30000"}, "router.url: must be http://HOST:PORT"),
    ({"url": "http://h:99999"}, "router.url: port must be a number in 1..65535"),
    ({"url": "http://h:1", "kind": "nginx"}, "router.kind: must be one of vllm-router"),
    ({"url": "http://h:1", "period": 0}, "router.period: must be a number of seconds in 0.1..600"),
    ({"url": "http://h:1", "remove_timeout": -1}, "router.remove_timeout: must be a number of seconds > 0"),
    ({"url": "http://h:1", "worker_type": "a b"}, "router.worker_type: must be a word"),
    ({"url": "http://h:1", "spawn": "yes"}, "router.spawn: must be true or false"),
    ({"url": "http://h:1/api?x=1#f"}, "router.url: must be the router's root"),
    ({"url": "http://admin:s3cret@h:1"}, "router.url: no user or password in the URL"),
])
def test_bad_router_tables_say_what_to_do(base, table, message):
    found = problems({**base, "router": table})
    assert any(p.startswith(message) for p in found), found


def test_the_token_file_must_be_the_daemons_users_alone(base, tmp_path):
    token = tmp_path / "router.token"
    token.write_text("s3cret\n")
    os.chmod(token, 0o644)
    (msg,) = problems({**base, "router": {"url": "http://h:1", "token_file": str(token)}})
    assert "must be owned by the daemon's user" in msg and "mode 0644" in msg and "s3cret" not in msg
    os.chmod(token, 0o600)
    r = build({**base, "router": {"url": "http://h:1", "token_file": str(token)}}).router
    assert r is not None and r.token == "s3cret" and "s3cret" not in repr(r)
    (msg,) = problems({**base, "router": {"url": "http://h:1", "token_file": str(tmp_path / "none")}})
    assert "no such file" in msg and "the router's admin token" in msg


def test_router_settings_that_do_nothing_or_outlast_the_stop_are_warned_about(base):
    cfg = build({**base, "router": {"url": "http://h:1/", "observe_only": True, "prune_unknown": True,
                                    "drain_timeout": 300.0}})
    assert cfg.router is not None
    assert any("prune_unknown has no effect" in w for w in cfg.warnings), cfg.warnings
    assert any("drain_timeout = 300s" in w and "TimeoutStopSec" in w for w in cfg.warnings), cfg.warnings
    assert not build({**base, "router": {"url": "http://h:1"}}).warnings
    # Each under the unit's stop timeout alone, but not the removal's attempts and the drain together.
    both = build({**base, "router": {"url": "http://h:1", "remove_timeout": 10.0, "drain_timeout": 30.0}})
    assert any("may wait up to 64s before SIGTERM" in w for w in both.warnings), both.warnings


async def test_a_retried_removal_is_not_sent_once_the_engine_is_routable_again(tmp_path):
    """An engine leaves the routable set: its DELETE fails (503) while the engine comes back and
    is routable again. The retry is not sent (it would land after the re-add and take a
    serving engine out of the router); a removal still meant is retried and lands."""
    fake = StandinRouter()
    url = "http://127.0.0.1:8001"
    cfg = Config(engines=(EngineSpec("e0", url=url),), state_dir=str(tmp_path), log_dir=str(tmp_path),
                 runtime_dir=str(tmp_path), min_healthy=0)
    sup = Supervisor(cfg)
    try:
        async with aiohttp.ClientSession() as session:
            e0 = EngineRunner(cfg.engines[0], cfg, sup.policy, sup.bus, session)
            sup.fleet.runners["e0"] = e0
            feed = RouterFeed(sup.fleet, RouterConfig(url=fake.url), make_router("vllm-router", fake.url, session))
            sup.bus.add_listener(feed)
            e0.fsm.begin_start("attach", restart=False)
            e0.fsm.became_ready(None, None)
            await feed.reconcile()
            assert fake.workers() == [url]
            # Out, and its DELETE held then failed; routable again before the retry.
            fake.fail_next_delete, fake.hold_deletes = True, True
            e0.fsm.exited("not answering")
            await until(lambda: fake.deletes, 10, "the DELETE")
            e0.fsm.recovered(None, None)
            assert [r.name for r in sup.fleet.routable()] == ["e0"]
            fake.hold_deletes = False
            await asyncio.wait_for(asyncio.gather(*feed._pending), 30)
            # no second DELETE: still listed
            assert [u for _, u in fake.deletes] == [url] and fake.workers() == [url]
            assert feed.calls[("remove", "ok")] == 0
            # Out for good: the failed DELETE is retried and lands.
            fake.deletes.clear()
            fake.fail_next_delete = True
            e0.fsm.exited("not answering")
            await asyncio.wait_for(asyncio.gather(*feed._pending), 30)
            assert [u for _, u in fake.deletes] == [url, url] and fake.workers() == []
            assert feed.calls[("remove", "ok")] == 1
            await feed.close()
    finally:
        fake.close()
