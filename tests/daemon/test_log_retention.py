"""Issue 26's retention of engine logs, through the daemon itself: a spawned stand-in engine
(harness/standin_engine.py behind the daemon's own spawn, as in test_restart_faults.py) is killed
with -9 and restarted, and an operator restarts it, until more incarnations have run than
`log_keep`; the oldest logs are gone from the disk and the live incarnation's is there, written to."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from vime.harness.local_daemon import Daemon, free_port, kill_all, standin_config, standin_model
from vime.supervisor.client import SupervisorClient

from support.polling import wait_until

# Stands in for `python -m vllm.entrypoints.openai.api_server ... --port P`; prints to its log.
FAKE_PYTHON = f"""#!{sys.executable}
import asyncio, sys
from vime.harness import standin_engine
port = int(sys.argv[sys.argv.index("--port") + 1])
async def main():
    await standin_engine.serve(port, 1)
    print("ready on", port, flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""


@pytest.fixture
def daemons():
    started: list[Daemon] = []
    yield started
    kill_all(started)


def test_old_engine_logs_are_removed_and_the_live_one_kept(tmp_path, daemons):
    fake = tmp_path / "fake-python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    model = standin_model(tmp_path / "model")
    logs = tmp_path / "logs"
    logs.mkdir()
    # Another engine's logs and a file that is not a log of ours: neither is touched.
    (logs / "e1.1.log").write_text("another engine")
    (logs / "e0.notes").write_text("an operator's")
    cfg = standin_config(tmp_path, fake, [{"name": "e0", "model": str(model), "served_model_name": "tiny",
                                           "port": free_port()}],
                         supervisor={"log_keep": 2, "log_keep_bytes": 0})
    d = Daemon(cfg)
    daemons.append(d)
    client = SupervisorClient(d.sock)
    d.transition("e0", "RUNNING", 30)
    for n in range(2, 5):  # incarnations 2, 3 (a death), 4 (an operator's restart), ...
        mark = d.mark()
        if n == 4:
            client.restart("e0")
        else:
            os.killpg(d.last_pid("e0"), signal.SIGKILL)
        d.transition("e0", "RUNNING", 30, after=mark)
        if n >= 3:  # from the third log on, the oldest goes when the new one is opened
            removed = d.wait_for(lambda e: e.get("event") == "retention.removed", 10, after=mark)
            assert removed["engine"] == "e0" and removed["files"] == [f"e0.{n - 2}.log"]
    live = logs / "e0.4.log"
    assert client.status()["engines"][0]["incarnation"] == 4
    assert sorted(p.name for p in logs.iterdir()) == ["e0.3.log", "e0.4.log", "e0.notes", "e1.1.log"]
    wait_until(lambda: "ready on" in live.read_text(), 10, "the live incarnation writes its log")
    assert d.terminate(30) == 0
    assert live.exists()


def test_an_incident_folder_written_removes_the_oldest_beyond_the_count(tmp_path, daemons):
    """A hung engine (SIGSTOP) gets a post-mortem before its stop; with incidents_keep = 1 the
    older folder goes (by the time stamp its name starts with), before the new one is written,
    and the new one stays."""
    fake = tmp_path / "fake-python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    model = standin_model(tmp_path / "model")
    root = tmp_path / "logs" / "incidents"
    old = root / "20200101T000000-e0-1"
    old.mkdir(parents=True)
    (old / "incident.json").write_text("{}")
    (root / "keep-me").mkdir()  # not a folder the daemon names: never touched
    cfg = standin_config(tmp_path, fake, [{"name": "e0", "model": str(model), "served_model_name": "tiny",
                                           "port": free_port()}],
                         supervisor={"incidents_keep": 1})
    d = Daemon(cfg)
    daemons.append(d)
    d.transition("e0", "RUNNING", 30)
    mark = d.mark()
    os.kill(d.last_pid("e0"), signal.SIGSTOP)
    d.transition("e0", "UNHEALTHY", 30, after=mark)
    saved = d.wait_for(lambda e: e.get("event") == "postmortem.saved", 30, after=mark)
    removed = d.wait_for(lambda e: e.get("event") == "retention.removed", 30, after=mark)
    assert removed["what"] == "incidents" and removed["folders"][0] == old.name
    # Room is made before the new one is written: incidents_keep holds at every moment.
    events = list(d.events)
    assert events.index(removed) < events.index(saved), (removed, saved)
    assert not old.exists() and (root / "keep-me").is_dir()
    wait_until(lambda: Path(saved["folder"]).is_dir(), 5, "the new incident folder is kept")
    assert d.terminate(30) == 0
