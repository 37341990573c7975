"""Which live processes a daemon takes for its own (engine/adoption.py): with no journal for
them (spawned_leader, engine_leader_port), real processes whose command line names the engine
module and a port; and whether a configured engine a journal names is still wanted."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vime.supervisor.engine.adoption import engine_leader_port, engine_unwanted
from vime.supervisor.engine.process import ENGINE_MODULE, SPAWN_MARK, proc_stat

PORT = 4321


def sleeper(*, marked: bool, how: str) -> subprocess.Popen:
    """`python -c sleep -m ENGINE_MODULE --port PORT`: /proc shows the engine's command line."""
    env = {k: v for k, v in os.environ.items() if k != SPAWN_MARK}
    if marked:
        env[SPAWN_MARK] = "1"
    kw = {"group": {"process_group": 0}, "session": {"start_new_session": True}, "ours": {}}[how]
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "-m", ENGINE_MODULE,
                             "--port", str(PORT)], env=env, **kw)


@pytest.mark.parametrize("marked, how, ours", [
    (True, "group", True),  # as ChildProcess.spawn starts one
    (False, "group", False),  # a server started by hand from a shell: a job leads its own group
    (False, "session", True),  # as older daemons started engines (setsid)
    (True, "ours", False),  # marked, but in our own process group: not a group leader
])
def test_a_group_leader_is_ours_only_if_marked_or_leading_its_session(marked, how, ours):
    p = sleeper(marked=marked, how=how)
    try:
        deadline = time.monotonic() + 10
        while (st := proc_stat(p.pid)) is None or b"-m" not in Path(f"/proc/{p.pid}/cmdline").read_bytes():
            assert time.monotonic() < deadline, "the sleeper did not start"
            time.sleep(0.02)
        assert engine_leader_port(st) == (PORT if ours else None)
    finally:
        p.kill()
        p.wait()


@pytest.mark.parametrize("configured, spawned, retired, entry, why", [
    (True, True, False, {"fingerprint": "f1", "state": "RUNNING"}, None),
    (True, True, False, {"fingerprint": "f1", "state": "STANDBY"}, None),
    (False, False, False, {"fingerprint": "f1", "state": "RUNNING"}, "no longer in the config"),
    (True, False, False, {"state": "RUNNING"}, "now attached by url, no longer spawned"),
    (True, True, True, {"fingerprint": "f1", "state": "RUNNING"}, "retired"),
    (True, True, False, {"fingerprint": "f2", "state": "RUNNING"}, "started under another config"),
    (True, True, False, {"state": "RUNNING"}, "no config fingerprint in the journal"),
    (True, True, False, {"fingerprint": "f1", "state": "UNHEALTHY"}, "it was UNHEALTHY, not a state worth keeping"),
])
def test_a_journaled_engine_is_wanted_only_as_this_config_would_start_and_keep_it(
        configured, spawned, retired, entry, why):
    got = engine_unwanted(entry, configured=configured, spawned=spawned, retired=retired, fingerprint="f1")
    assert got == why if why is None else got is not None and got.startswith(why), got
