"""The demo's daemon fault (harness/chaos.py DaemonKeeper, `--fault daemon@STEP`, in the goodput
bench's schedule): kill -9 of the real daemon mid-round, the same daemon started again; its
engines (protocol stand-ins, as in test_restart_faults.py) run on and are re-adopted, none
restarted, and the goodput accounting of the daemon's log finds no stop and no time below
target."""

from __future__ import annotations

import signal

from vime.harness.chaos import DaemonKeeper
from vime.harness.faults import Fault
from vime.harness.goodput import Run, account
from vime.harness.local_daemon import Daemon, free_port, kill_all, standin_config
from vime.harness.timeline import events_from_log
from vime.supervisor.client import SupervisorClient

from test_restart_faults import FAKE_PYTHON, model_dir, spawned  # noqa: E402  (the same stand-in)


def test_the_keeper_kills_the_daemon_mid_round_and_the_next_one_readopts_its_engines(tmp_path):
    fake = tmp_path / "fake-python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    model = model_dir(tmp_path / "model")
    cfg = standin_config(tmp_path, fake, [spawned(n, model, free_port()) for n in ("e0", "e1")])
    log = open(tmp_path / "daemon.log", "w")
    keeper = DaemonKeeper(lambda: Daemon(cfg, tee=log, own_group=True))
    first = keeper.daemon
    try:
        first.wait_for(lambda e: e.get("event") == "supervisor.ready", 60)
        client = SupervisorClient(first.sock)
        before = {e["name"]: (e["pid"], e["restarts"]) for e in client.status()["engines"]}
        client.start_round(1)

        keeper.kill_daemon()
        assert first.proc.returncode == -signal.SIGKILL and first.killed_by_us
        assert keeper.daemon is not first and keeper.daemons == [first, keeper.daemon]
        keeper.daemon.wait_for(lambda e: e.get("event") == "supervisor.ready", 60)
        status = client.status()
        assert {e["name"]: (e["pid"], e["restarts"]) for e in status["engines"]} == before  # re-adopted
        assert status["round_open"] and status["round"] == 1
        client.end_round(1)
        client.close()
        # The engines the first daemon spawned are the ones its successor stops.
        assert {pid for pid, _ in before.values()} <= set(keeper.spawned_pids())
        rc, left = keeper.daemon.stop_all(30.0, also=keeper.spawned_pids())
        assert rc == 0 and left == []
    finally:
        kill_all(keeper.daemons)
        log.close()

    events, lives = events_from_log((tmp_path / "daemon.log").read_text().splitlines())
    assert len(lives) == 2
    assert sorted(ev["engine"] for ev in events if ev.get("cause") == "restored") == ["e0", "e1"]
    killed = lives[0][1]  # the first daemon's last line
    row = account(Run("daemon", events, [Fault("daemon", 1, "daemon", fired_step=1, injected_at=killed)],
                      rounds=[], target=2, wall_s=1.0, useful_tokens=0))
    assert (row.faults, row.false_restarts, row.unmatched, row.engines) == (1, 0, [], 2)
    assert row.reduced_s == 0.0  # both served on through the daemon's restart
