"""A killed engine server is a death, whatever reaches the daemon first: the trainer's failure
reports and the refused probes that follow the kill are not counted as a hang (seen in CI:
a report and one refused probe crossed failure_threshold 2 ten milliseconds before the
daemon handled the server's SIGCHLD, and the kill was named a hang).

The engine is a PROTOCOL STAND-IN (tests/support/standin_group.py, run as the daemon's
`python`); what is tested is the daemon's classification.
"""

from __future__ import annotations

import os
import signal
import threading

from vime.harness.local_daemon import Daemon, free_port, kill_all, standin_config, standin_model, standin_python
from vime.supervisor.client import SupervisorClient
from vime.supervisor.engine.process import proc_stat

from support.standins import STANDIN_GROUP as STANDIN



def test_a_kill_flooded_with_failure_reports_is_an_exit_not_a_hang(tmp_path):
    (tmp_path / "mode").write_text("ok")
    model = standin_model(tmp_path / "model")
    cfg = standin_config(
        tmp_path, standin_python(tmp_path, STANDIN),
        [{"name": "e0", "model": str(model), "port": free_port(), "env": {"STANDIN_MODE_FILE": str(tmp_path / "mode")}}],
        # One failure condemns: any report counted after the kill would make it a hang.
        health_check={"interval": 0.3, "failure_threshold": 1})
    d = Daemon(cfg)
    try:
        d.transition("e0", "RUNNING", 30)
        client = SupervisorClient(str(tmp_path / "run" / "supervisor.sock"))
        pid = d.last_pid("e0")
        answers: list[dict] = []
        go = threading.Event()

        def report() -> None:
            go.wait()
            for _ in range(20):
                answers.append(client.report_failure("e0", "rollout request died: connection reset"))

        reporters = [threading.Thread(target=report) for _ in range(3)]
        for t in reporters:
            t.start()
        mark = d.mark()
        os.kill(pid, signal.SIGKILL)
        while (st := proc_stat(pid)) is not None and st.state != "Z":  # dead, as the trainer saw it
            pass
        go.set()
        for t in reporters:
            t.join(30)
        exited = d.transition("e0", "EXITED", 10, after=mark)
        assert exited["from_state"] == "RUNNING" and exited["cause"] == "exit", exited
        assert "killed by SIGKILL" in exited["reason"]
        hangs = [e for e in d.events[mark:] if e.get("event") == "engine.transition"
                 and e.get("to_state") in ("SUSPECT", "UNHEALTHY")]
        assert hangs == [], hangs
        assert answers and not any(a["counted"] for a in answers), answers
    finally:
        kill_all([d])
