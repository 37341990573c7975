"""A real daemon over protocol stand-ins (STANDIN_GROUP, tests/support/standin_group.py; not
vLLM), each engine steered by a mode file of its own, for the tests that switch engines between
faults while one daemon runs (tests only)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterable, Iterator

from vime.harness.local_daemon import Daemon, free_port, standin_model, standin_python, write_config
from vime.supervisor.client import SupervisorClient

from support.polling import wait_until
from support.standins import STANDIN_GROUP


@contextlib.contextmanager
def mode_fleet(root: Path, modes: dict[str, str], running: Iterable[str], *, supervisor: dict[str, Any],
               **tables: Any) -> Iterator[SimpleNamespace]:
    """A daemon (run and log folders under `root`, `supervisor` its other keys, `tables` its
    other tables) spawning one engine per name in `modes`, which reads its mode from the file
    root/mode-<name> (written with `modes[name]` first). Yields once the engines `running` are
    RUNNING: daemon, client, sock, root, modes (name -> its mode file). On the way out every
    engine is set to "ok" again and the daemon must stop with 0."""
    python = standin_python(root, STANDIN_GROUP)
    model = standin_model(root / "model")
    files = {n: root / f"mode-{n}" for n in modes}
    for name, mode in modes.items():
        files[name].write_text(mode)
    cfg = write_config(
        root / "supervisor.toml",
        supervisor={"runtime_dir": str(root / "run"), "log_dir": str(root / "logs"), "stop_timeout": 2.0,
                    "python": str(python), **supervisor},
        engines=[{"name": n, "model": str(model), "port": free_port(), "env": {"STANDIN_MODE_FILE": str(files[n])}}
                 for n in modes],
        **tables,
    )
    d = Daemon(cfg)
    try:
        d.wait_for(lambda e: e.get("event") == "control.listening", 15)
        sock = str(root / "run" / "supervisor.sock")
        client = SupervisorClient(sock)
        for name in running:
            wait_until(lambda: _state(client, name) == "RUNNING", 30, f"{name} RUNNING")
        yield SimpleNamespace(daemon=d, client=client, sock=sock, root=root, modes=files)
    finally:
        for f in files.values():
            f.write_text("ok")
        try:
            assert d.terminate(30) == 0
        except Exception:
            d.kill()
            raise


def _state(client: SupervisorClient, name: str) -> str:
    return next(e["state"] for e in client.status()["engines"] if e["name"] == name)
