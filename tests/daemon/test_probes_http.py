"""The probe endpoints Kubernetes asks on the metrics listener (supervisor/healthz.py): /livez
answers while every engine is down, /startupz waits for the first fleet (the READY=1 rule),
/readyz follows min_healthy down and back up.

The engine is a PROTOCOL STAND-IN (tests/support/standin_group.py): "silent" keeps its /health
from answering, so its start cannot conclude; what is tested is the daemon's verdicts.
"""

from __future__ import annotations

import os
import signal
import urllib.error
import urllib.request

from vime.harness.local_daemon import Daemon, free_port, kill_all, standin_config, standin_model, standin_python
from vime.supervisor.client import SupervisorClient

from support.polling import wait_until
from support.standins import STANDIN_GROUP as STANDIN


def get(address: str, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://{address}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_live_while_every_engine_is_down_ready_with_the_floor_started_with_the_first_fleet(tmp_path):
    mode = tmp_path / "mode"
    mode.write_text("silent")  # /health never answers: the first start cannot conclude
    address = f"127.0.0.1:{free_port()}"
    cfg = standin_config(
        tmp_path, standin_python(tmp_path, STANDIN),
        [{"name": "e0", "model": str(standin_model(tmp_path / "model")), "port": free_port(),
          "env": {"STANDIN_MODE_FILE": str(mode)}}],
        supervisor={"metrics_address": address, "min_healthy": 1},
        health_check={"first_wait": 60.0, "interval": 0.3, "timeout": 0.3, "failure_threshold": 2})
    d = Daemon(cfg)
    try:
        d.wait_for(lambda e: e.get("event") == "metrics.listening", 30)
        # The first start under way: alive, not started, not ready.
        assert get(address, "/livez")[0] == 200
        code, text = get(address, "/startupz")
        assert code == 503 and "first start" in text, text
        assert get(address, "/readyz")[0] == 503

        mode.write_text("ok")
        d.wait_for(lambda e: e.get("event") == "supervisor.ready", 30)
        assert get(address, "/startupz") == (200, "ok: every engine's first start has concluded\n")
        wait_until(lambda: get(address, "/readyz")[0] == 200, 10, "ready once e0 is routable")
        assert get(address, "/readyz")[1] == "ok: 1 routable engines, min_healthy 1\n"

        # Every engine down (killed, and its restart cannot conclude): alive, not ready.
        client = SupervisorClient(str(tmp_path / "run" / "supervisor.sock"))
        pid = client.status()["engines"][0]["pid"]
        mode.write_text("silent")
        mark = d.mark()
        os.killpg(pid, signal.SIGKILL)
        d.transition("e0", "EXITED", 20, after=mark)
        wait_until(lambda: get(address, "/readyz")[0] == 503, 10, "not ready below the floor")
        assert get(address, "/readyz")[1] == "below min_healthy: 0 routable engines, min_healthy 1\n"
        d.transition("e0", "STARTING", 20, after=mark)
        for _ in range(5):
            code, text = get(address, "/livez")
            assert code == 200 and text.startswith("ok: the event loop answers"), text
            assert get(address, "/startupz")[0] == 200  # started once: a restart does not undo it
        assert client.status()["engines"][0]["state"] == "STARTING"

        # Back: ready again.
        mode.write_text("ok")
        wait_until(lambda: get(address, "/readyz")[0] == 200, 30, "ready again after the recovery")
        assert get(address, "/nothing")[0] == 404
    finally:
        mode.write_text("ok")
        kill_all([d])
