"""The open-file limit against the fleet: `--check-config` refuses a hard limit below what the
engines need and warns about a low soft one; the daemon raises its soft limit to the hard one
at start. Real processes under real rlimits (set for the child with preexec_fn)."""

from __future__ import annotations

import resource
import subprocess
import sys

from vime.harness.local_daemon import Daemon, write_config
from vime.supervisor import limits


def fleet_config(tmp_path, n: int):
    return write_config(
        tmp_path / "sup.toml",
        supervisor={"runtime_dir": str(tmp_path / "run"), "log_dir": str(tmp_path / "logs"),
                    "state_dir": str(tmp_path / "state")},
        health_check={"first_wait": 30.0, "interval": 2.0, "timeout": 1.0},
        engines=[{"name": f"e{i}", "url": f"http://127.0.0.1:{20000 + i}"} for i in range(n)],
    )


def run_with_nofile(soft: int, hard: int, *args: str) -> subprocess.CompletedProcess:
    """The daemon under these limits (the shell's ulimit: lowering needs no privilege)."""
    cmd = 'ulimit -Sn "$2" && ulimit -Hn "$1" && shift 2 && exec "$@"'  # soft first: never above hard
    return subprocess.run(["sh", "-c", cmd, "sh", str(hard), str(soft), sys.executable, "-m", "vime.supervisor",
                           *args], capture_output=True, text=True, timeout=120)


def current_hard() -> int:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return 65536 if hard == resource.RLIM_INFINITY else hard


def test_check_config_refuses_a_hard_limit_below_the_fleets_need(tmp_path):
    cfg = fleet_config(tmp_path, 200)
    need = limits.nofile_needed(200)
    p = run_with_nofile(256, 1024, "--config", str(cfg), "--check-config")
    assert p.returncode == 2, p
    [line] = p.stderr.splitlines()
    assert line.startswith("vime-supervisor: config error: ") and str(need) in line and "LimitNOFILE" in line, line


def test_check_config_warns_about_a_low_soft_limit_only(tmp_path):
    cfg = fleet_config(tmp_path, 200)
    assert current_hard() >= limits.nofile_needed(200)  # what this test needs of the machine
    p = run_with_nofile(256, current_hard(), "--config", str(cfg), "--check-config")
    assert p.returncode == 0 and p.stdout.endswith("ok, 200 engine(s)\n"), p
    assert "config warning" in p.stderr and "256" in p.stderr, p.stderr


def test_the_daemon_raises_its_soft_limit_to_the_hard_one(tmp_path):
    cfg = fleet_config(tmp_path, 2)
    hard = min(current_hard(), 65536)
    old = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))  # inherited by the daemon
    try:
        d = Daemon(cfg)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, old)
    try:
        line = d.wait_for(lambda e: e.get("event") == "limits.nofile", 30)
        assert (line["soft"], line["hard"], line["engines"]) == (hard, hard, 2)
        with open(f"/proc/{d.proc.pid}/limits") as f:
            row = next(r for r in f if r.startswith("Max open files")).split()
        assert int(row[3]) == hard  # the soft limit of the running process
    finally:
        d.terminate(30)
