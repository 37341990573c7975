"""Which live processes a daemon with no journal for them takes for its own (spawned_leader,
engine_leader_port): real processes whose command line names the engine module and a port."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vime.supervisor.engine.process import ENGINE_MODULE, SPAWN_MARK, engine_leader_port, proc_stat

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
    (True, "group", True),  # as EngineProcess.spawn starts one
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
