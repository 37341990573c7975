"""A Ray cluster of simulated nodes on one machine, each with its own loopback address
(127.0.0.2, 127.0.0.3, ...: nothing may rely on 127.0.0.1) and a vime-supervisor daemon of its
own (own runtime dir, socket and journal), for the cluster tests and bench/cluster.py. Ray's
own test cluster (ray.cluster_utils) runs one raylet per simulated node.

The head (the driver's node, no CPUs, no daemon) is 127.0.0.9, which node_address skips: Ray
rewrites 127.0.0.1 and localhost to the machine's outward address, which these tests must never use.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vime.harness.local_daemon import Daemon, write_config

HEAD = "127.0.0.9"
# The spawned PROTOCOL STAND-IN of the daemon tests (a source checkout's tests/ folder).
STANDIN = Path(__file__).resolve().parents[1] / "tests" / "support" / "standin_group.py"


def node_address(i: int) -> str:
    """Node i's address: 127.0.0.2, 127.0.0.3, ..., skipping the head's (127.0.0.9), since two
    Ray nodes at one address are one node to the cluster client."""
    n = i + 2
    return f"127.0.0.{n if n < 9 else n + 1}"


def free_port_on(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class Node:
    address: str
    root: Path
    config: Path
    run_dir: str
    ray_node: Any = None
    daemon: Daemon | None = None
    modes: dict[str, Path] = field(default_factory=dict)

    @property
    def sock(self) -> str:
        return os.path.join(self.run_dir, "supervisor.sock")

    def start_daemon(self, timeout: float = 30.0) -> Daemon:
        """The node's daemon; its log goes to <root>/daemon.log too (every start appends)."""
        tee = open(self.root / "daemon.log", "a")  # noqa: SIM115 - kept open for the daemon's life
        self.daemon = Daemon(self.config, own_group=True, tee=tee)
        deadline = time.monotonic() + timeout
        while not os.path.exists(self.sock):
            assert self.daemon.proc.poll() is None, "daemon exited:\n" + "\n".join(self.daemon.raw[-30:])
            assert time.monotonic() < deadline, "no socket:\n" + "\n".join(self.daemon.raw[-30:])
            time.sleep(0.05)
        return self.daemon

    def kill_daemon_and_engines(self) -> None:
        """What a node's loss does to the processes on it: the daemon and every engine group it
        spawned die at once (SIGKILL, no clean-up)."""
        import signal

        assert self.daemon is not None
        groups = set(self.daemon.spawned_pids())
        self.daemon.kill()
        for pgid in groups:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def standin_config(root: Path, address: str, engines: list[str], *, mode: str = "ok",
                   probe: dict | None = None, supervisor: dict | None = None) -> Node:
    """A node whose daemon spawns PROTOCOL STAND-IN engines (tests/support/standin_group.py)
    bound to the node's address."""
    root.mkdir(parents=True, exist_ok=True)
    python = root / "standin-python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{STANDIN}" "$@"\n')
    python.chmod(0o755)
    model = root / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    run_dir = tempfile.mkdtemp(prefix="vime-node-", dir="/tmp")
    modes = {}
    for name in engines:
        modes[name] = root / f"mode-{name}"
        modes[name].write_text(mode)
    cfg = write_config(
        root / "supervisor.toml",
        supervisor={"runtime_dir": run_dir, "log_dir": str(root / "logs"), "stop_timeout": 2.0,
                    "python": str(python), **(supervisor or {})},
        health_check=probe or {"first_wait": 20.0, "interval": 0.5, "timeout": 0.5},
        engines=[{"name": n, "model": str(model), "host": address, "port": free_port_on(address),
                  "env": {"STANDIN_MODE_FILE": str(modes[n])}} for n in engines],
    )
    return Node(address, root, cfg, run_dir, modes=modes)


class RayNodes:
    """ray.cluster_utils.Cluster with a head at HEAD and simulated nodes at given addresses."""

    def __init__(self) -> None:
        from ray.cluster_utils import Cluster

        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 0, "node_ip_address": HEAD, "include_dashboard": False})

    def add(self, address: str) -> Any:
        return self.cluster.add_node(num_cpus=1, node_ip_address=address, resources={"vime_supervisor": 1},
                                     include_dashboard=False)

    def remove(self, ray_node: Any) -> None:
        self.cluster.remove_node(ray_node, allow_graceful=False)

    def connect(self) -> None:
        import ray

        ray.init(address=self.cluster.address, _node_ip_address=HEAD, include_dashboard=False,
                 log_to_driver=False, configure_logging=False)

    def shutdown(self) -> None:
        import ray

        ray.shutdown()
        self.cluster.shutdown()


def cleanup(nodes: list[Node]) -> None:
    for n in nodes:
        if n.daemon is not None:
            try:
                n.daemon.stop_all(20)
            except Exception:
                n.daemon.kill()
        shutil.rmtree(n.run_dir, ignore_errors=True)
