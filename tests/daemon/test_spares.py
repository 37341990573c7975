"""Warm spares (STANDBY) through the daemon: engines beyond the routing target are kept up and
never routed; one takes a failed engine's place in the next round gap; the failed one comes
back as a spare.

The daemon spawns its engines as it always does, with `python` pointed at a script that serves
the protocol stand-in (harness/standin_engine.py; not vLLM), as test_restart_faults.py does.
The real-engine promotion, with a weight sync, is in tests/engine/test_spares_real.py.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from vime.supervisor.client import SupervisorClient
from vime.harness.local_daemon import (
    Daemon, EventStream, free_port, kill_all, standin_config, standin_model, standin_python)

from support.standins import STANDIN_GROUP

from test_restart_faults import FAKE_PYTHON, model_dir, spawned  # noqa: E402  (the same stand-in)

NAMES = ("e0", "e1", "e2")


@pytest.fixture
def fleet(tmp_path):
    fake = tmp_path / "fake-python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    model = model_dir(tmp_path / "model")
    cfg = standin_config(tmp_path, fake, [spawned(n, model, free_port()) for n in NAMES],
                         supervisor={"spares": 1, "min_healthy": 1})
    d = Daemon(cfg)
    f = type("Fleet", (), {})()
    f.daemon, f.sock = d, str(tmp_path / "run" / "supervisor.sock")
    try:
        d.wait_for(lambda e: e.get("event") == "supervisor.ready", 60)
        f.stream = EventStream(f.sock)
        f.initial = states(f.sock)  # settled: every first start has concluded
        yield f
    finally:
        kill_all([d])


def states(sock: str) -> dict[str, str]:
    return {e["name"]: e["state"] for e in SupervisorClient(sock).status()["engines"]}


def wait_states(sock: str, pred, timeout: float = 30) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while not pred(st := states(sock)):
        assert time.monotonic() < deadline, st
        time.sleep(0.05)
    return st


def never_routed_unless_serving(fleet) -> None:
    """Replayed in order from the settled fleet the stream began with: every membership lists
    only engines RUNNING or SUSPECT at that point."""
    state = dict(fleet.initial)
    for ev in list(fleet.stream.events):
        if ev["event"] == "transition":
            state[ev["engine"]] = ev["to_state"]
        elif ev["event"] == "membership":
            assert all(state.get(n) in ("RUNNING", "SUSPECT") for n in ev["routable"]), (ev, state)


def test_a_spare_takes_a_killed_engines_place_in_the_gap_and_the_killed_one_becomes_the_spare(fleet):
    d, sock = fleet.daemon, fleet.sock
    c = SupervisorClient(sock)
    st = states(sock)
    assert sorted(st.values()) == ["RUNNING", "RUNNING", "STANDBY"], st
    spare = next(n for n, s in st.items() if s == "STANDBY")
    victim = next(n for n, s in st.items() if s == "RUNNING")
    assert sorted(e["name"] for e in c.routable_engines()["engines"]) == sorted(set(NAMES) - {spare})
    status = c.status()
    assert status["spares"] == 1 and status["routable"] == 2
    c.start_round(1)
    mark = d.mark()
    os.kill(d.last_pid(victim), signal.SIGKILL)
    d.transition(victim, "EXITED", 10, after=mark)
    time.sleep(1.0)  # a round is open: neither a promotion nor a restart before its end
    assert states(sock)[spare] == "STANDBY" and states(sock)[victim] == "EXITED"
    assert len(c.routable_engines()["engines"]) == 1
    t_end = time.monotonic()
    c.end_round(1)
    promoted = d.transition(spare, "RUNNING", 10, after=mark)
    assert promoted["cause"] == "promoted" and promoted["reason"].startswith("promoted: 1/2 engines active")
    print(f"\npromoted {time.monotonic() - t_end:.2f}s after the round ended")
    assert sorted(e["name"] for e in c.routable_engines()["engines"]) == sorted(set(NAMES) - {victim})
    # The killed engine restarts in the gap and is the spare now.
    back = d.transition(victim, "STANDBY", 30, after=mark)
    assert back["cause"] == "spare" and "a spare: 2/2 engines serving" in back["reason"]
    assert len(c.routable_engines()["engines"]) == 2
    assert [ev["routable"] for ev in fleet.stream.events if ev["event"] == "membership"] == [
        sorted(set(NAMES) - {spare, victim}), sorted(set(NAMES) - {victim})]  # out at the kill, in at the gap
    never_routed_unless_serving(fleet)


def test_a_spare_that_dies_mid_round_is_restarted_at_once_as_a_spare_and_never_routed(fleet):
    d, sock = fleet.daemon, fleet.sock
    c = SupervisorClient(sock)
    spare = next(n for n, s in states(sock).items() if s == "STANDBY")
    routable = c.routable_engines()
    c.start_round(1)  # a spare serves nothing: its restart does not wait for the gap
    mark = d.mark()
    os.kill(d.last_pid(spare), signal.SIGKILL)
    d.transition(spare, "EXITED", 10, after=mark)
    restart = d.transition(spare, "STARTING", 30, after=mark)
    assert restart["cause"] == "restart"
    back = d.transition(spare, "STANDBY", 30, after=mark)
    assert back["cause"] == "spare"
    assert c.status()["round_open"] is True
    after = c.routable_engines()
    assert after["engines"] == routable["engines"] and after["epoch"] == routable["epoch"]  # nothing moved
    c.end_round(1)
    never_routed_unless_serving(fleet)


def test_an_operator_can_stop_and_start_a_spare(fleet):
    sock = fleet.sock
    spare = next(n for n, s in states(sock).items() if s == "STANDBY")
    c = SupervisorClient(sock)
    c.stop(spare)
    wait_states(sock, lambda st: st[spare] == "STOPPED")
    c.start(spare)
    wait_states(sock, lambda st: st[spare] == "STANDBY")
    assert len(c.routable_engines()["engines"]) == 2


def test_a_reload_and_a_daemon_restart_keep_the_spare_a_spare(fleet):
    d, sock = fleet.daemon, fleet.sock
    before = states(sock)
    pids = {e["name"]: e["pid"] for e in SupervisorClient(sock).status()["engines"]}
    mark = d.mark()
    d.proc.send_signal(signal.SIGHUP)
    d.wait_for(lambda e: e.get("event") == "supervisor.started" and e.get("generation") == 1, 30, after=mark)
    assert states(sock) == before, [(e.get("engine"), e.get("to_state"), e.get("reason")) for e in d.events[mark:]
                                    if e.get("event") == "engine.transition"]
    spare = next(n for n, s in before.items() if s == "STANDBY")
    assert "a spare before a reload" in next(
        e for e in SupervisorClient(sock).status()["engines"] if e["name"] == spare)["reason"]
    # kill -9 of the daemon: the next one re-adopts the same processes, the spare as a spare.
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait(10)
    second = Daemon(d.config)
    try:
        second.wait_for(lambda e: e.get("event") == "supervisor.ready", 30)
        assert states(sock) == before
        assert {e["name"]: e["pid"] for e in SupervisorClient(sock).status()["engines"]} == pids
        assert len(SupervisorClient(sock).routable_engines()["engines"]) == 2
    finally:
        second.terminate(30)


# -- roles across reloads and restarts, weights behind, reports -------------------------------
# The engines here are tests/support/standin_group.py (a protocol stand-in whose /weight_info
# answers what its mode file says, `version=X`), so a spare can be behind the current version.


def versioned_fleet(tmp_path, names=NAMES, mode="ok", **supervisor):
    python = standin_python(tmp_path, STANDIN_GROUP)
    model = standin_model(tmp_path / "model")
    modes = {n: tmp_path / f"mode-{n}" for n in names}
    for m in modes.values():
        m.write_text(mode)
    cfg = standin_config(
        tmp_path, python, [{"name": n, "model": str(model), "port": free_port(), "env": {"STANDIN_MODE_FILE": str(modes[n])}}
                           for n in names], supervisor={"spares": 1, **supervisor})
    daemons = [Daemon(cfg)]
    f = type("Versioned", (), {})()
    f.cfg, f.daemons, f.modes, f.sock = cfg, daemons, modes, str(tmp_path / "run" / "supervisor.sock")
    try:
        daemons[0].wait_for(lambda e: e.get("event") == "supervisor.ready", 60)
        yield f
    finally:
        kill_all(daemons)


@pytest.fixture
def versioned(tmp_path):
    yield from versioned_fleet(tmp_path)


def v1_but_the_spare(f) -> tuple[dict[str, str], str, list[str]]:
    """The serving engines get v1, published; the spare stays on base weights (promotion
    mode). Then round 1 opens. The states before, the spare, the serving engines."""
    before = states(f.sock)
    spare = next(n for n, s in before.items() if s == "STANDBY")
    serving = sorted(n for n, s in before.items() if s == "RUNNING")
    for n in serving:
        f.modes[n].write_text("version=1")
    c = SupervisorClient(f.sock)
    c.publish_weights(1)
    c.start_round(1)
    return before, spare, serving


def test_roles_hold_across_a_reload_and_a_restart_mid_round_with_the_spare_behind(versioned):
    f = versioned
    d = f.daemons[0]
    c = SupervisorClient(f.sock)
    before, spare, serving = v1_but_the_spare(f)
    routable = [e["name"] for e in c.routable_engines()["engines"]]
    assert routable == serving and states(f.sock) == before
    mark = d.mark()
    d.proc.send_signal(signal.SIGHUP)
    d.wait_for(lambda e: e.get("event") == "supervisor.started" and e.get("generation") == 1, 30, after=mark)
    assert states(f.sock) == before and [e["name"] for e in c.routable_engines()["engines"]] == routable
    c.end_round(1)
    # kill -9 of the daemon, and one serving engine dies while no daemon runs. The next daemon
    # re-adopts the other two in their roles; the dead one's place goes to the spare at once,
    # not after the dead one's reboot (held here: its stand-in does not answer /health).
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait(10)
    f.modes[serving[0]].write_text("silent")
    os.kill(d.last_pid(serving[0]), signal.SIGKILL)
    f.modes[spare].write_text("version=1")  # say the spare was kept current: it can serve at once
    second = Daemon(f.cfg)
    f.daemons.append(second)
    promoted = second.transition(spare, "RUNNING", 30)
    assert promoted["cause"] == "promoted", promoted
    assert states(f.sock)[serving[1]] == "RUNNING" and states(f.sock)[serving[0]] == "STARTING"
    assert sorted(e["name"] for e in c.routable_engines()["engines"]) == sorted([spare, serving[1]])
    f.modes[serving[0]].write_text("version=1")
    back = second.transition(serving[0], "STANDBY", 30)  # the dead one, rebooted, is the spare now
    assert back["cause"] == "spare"


def test_a_spare_behind_that_dies_mid_round_is_parked_again_inside_the_round(versioned):
    f = versioned
    d = f.daemons[0]
    c = SupervisorClient(f.sock)
    _, spare, _ = v1_but_the_spare(f)
    mark = d.mark()
    os.kill(d.last_pid(spare), signal.SIGKILL)
    d.transition(spare, "STARTING", 30, after=mark)  # at once, not after the round
    # Ready behind v1: parked as the spare inside the round, not held STALE until its end.
    back = d.transition(spare, "STANDBY", 30, after=mark)
    assert back["cause"] == "spare" and "synced when promoted" in back["reason"], back
    assert c.status()["round_open"] is True
    c.end_round(1)


def test_spares_kept_current_a_restarted_spare_behind_does_not_keep_a_current_one_out(tmp_path):
    """spares = 2, spares_sync = "publish", every engine at v1. Inside a round a spare and a
    serving engine die together. The spare restarts at once, on base weights: behind, and
    held for the gap (a place is empty). In the gap the other spare, current, is promoted
    in that place: it serves at once, where the one behind would need a sync first."""
    names = ("e0", "e1", "e2", "e3")
    for f in versioned_fleet(tmp_path, names, mode="version=1", spares=2, spares_sync="publish"):
        d, c = f.daemons[0], SupervisorClient(f.sock)
        c.publish_weights(1)
        st = states(f.sock)
        spares, serving = sorted(n for n in names if st[n] == "STANDBY"), sorted(n for n in names if st[n] == "RUNNING")
        assert len(spares) == 2 and len(serving) == 2, st
        c.start_round(1)
        mark = d.mark()
        for victim in (spares[0], serving[0]):
            f.modes[victim].write_text("ok")  # a reboot holds base weights
            os.kill(d.last_pid(victim), signal.SIGKILL)
        back = d.transition(spares[0], "STALE", 30, after=mark)  # restarted at once, behind
        assert "weights base, current v1" in back["reason"], back
        c.end_round(1)
        promoted = d.transition(spares[1], "RUNNING", 10, after=mark)
        assert promoted["cause"] == "promoted", promoted
        assert sorted(e["name"] for e in c.routable_engines()["engines"]) == sorted([serving[1], spares[1]])


def test_failures_reported_about_a_spare_are_not_counted(fleet):
    c = SupervisorClient(fleet.sock)
    spare = next(n for n, s in states(fleet.sock).items() if s == "STANDBY")
    for _ in range(3):
        answer = c.report_failure(spare, "a request failed")
        assert answer["counted"] is False and answer["state"] == "STANDBY", answer
    answer = c.report_failure(spare, "push failed midway", poisoned=True)
    assert answer["counted"] is False and states(fleet.sock)[spare] == "STANDBY"
