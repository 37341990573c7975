"""The open-file limit against the fleet: `--check-config` refuses a hard limit below what the
engines need and warns about a low soft one; the daemon raises its soft limit to the hard one
at start, refuses a fresh start the hard limit cannot hold (the same message, exit 2), and
starts anyway when it has engines to adopt. Real processes under real rlimits (the shell's
ulimit, or setrlimit before the daemon is started)."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time

from vime.harness.local_daemon import Daemon, free_port, kill_all, standin_config, standin_model, standin_python, write_config
from vime.supervisor import limits

from support.standins import STANDIN_GROUP as STANDIN



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
    need = limits.nofile_needed(0, attached=200)
    p = run_with_nofile(256, 512, "--config", str(cfg), "--check-config")
    assert p.returncode == 2, p
    [line] = p.stderr.splitlines()
    assert line.startswith("vime-supervisor: config error: ") and str(need) in line and "LimitNOFILE" in line, line
    assert "200 attached engine(s)" in line, line


def test_attached_engines_are_counted_at_what_they_hold(tmp_path):
    """300 attached engines under a hard limit of 1024: the spawned engines' warm-up figure
    (64 + 300 x 15) would refuse a fleet that fits (64 + 300 x 3)."""
    cfg = fleet_config(tmp_path, 300)
    assert limits.nofile_needed(0, attached=300) <= 1024 < limits.nofile_needed(300)
    p = run_with_nofile(1024, 1024, "--config", str(cfg), "--check-config")
    assert p.returncode == 0 and p.stdout.endswith("ok, 300 engine(s)\n"), p


def test_a_fresh_daemon_the_hard_limit_cannot_hold_refuses_to_start(tmp_path):
    """The same line as --check-config, exit 2 (the unit's RestartPreventExitStatus), and
    nothing started: no control socket."""
    cfg = fleet_config(tmp_path, 200)
    check = run_with_nofile(256, 512, "--config", str(cfg), "--check-config")
    t0 = time.monotonic()
    p = run_with_nofile(256, 512, "--config", str(cfg))
    assert p.returncode == 2, p
    assert time.monotonic() - t0 < 60  # it exits, it does not run on
    said = [ln for ln in p.stderr.splitlines() if ln.startswith("vime-supervisor: config error: ")]
    assert said == [check.stderr.strip() + "; nothing was started"], p.stderr
    assert not (tmp_path / "run" / "supervisor.sock").exists()


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


def test_a_daemon_with_engines_to_adopt_starts_under_a_low_hard_limit(tmp_path):
    """Killed with -9, a daemon leaves a spawned engine (a PROTOCOL STAND-IN group) running and
    journaled. Started again under a hard limit below its fleet's need, the next daemon does not
    refuse (that would orphan the engine): it adopts it and says what to raise."""
    python = standin_python(tmp_path, STANDIN)
    mode = tmp_path / "mode"
    mode.write_text("ok")
    engines = [{"name": "s0", "model": str(standin_model(tmp_path / "model")), "port": free_port(),
                "env": {"STANDIN_MODE_FILE": str(mode)}}]
    engines += [{"name": f"a{i}", "url": f"http://127.0.0.1:{free_port()}"} for i in range(100)]
    cfg = standin_config(tmp_path, python, engines, warmup={"requests": 0},
                         health_check={"first_wait": 20.0, "interval": 1.0, "timeout": 0.5})
    need = limits.nofile_needed(1, 0, attached=100)
    first = Daemon(cfg)
    groups: set[int] = set()
    out = tmp_path / "second.log"
    second = None
    try:
        first.transition("s0", "RUNNING", 60)
        [pid] = first.spawned_pids()
        groups.add(pid)
        journal = tmp_path / "state" / "journal.json"
        deadline = time.monotonic() + 30
        while f'"pid": {pid}' not in (journal.read_text() if journal.exists() else ""):
            assert time.monotonic() < deadline, "the engine's pid never reached the journal"
            time.sleep(0.1)
        first.kill()
        cmd = 'ulimit -Sn "$1" && ulimit -Hn "$1" && shift && exec "$@"'
        with open(out, "w") as log:
            second = subprocess.Popen(["sh", "-c", cmd, "sh", str(need - 1), sys.executable, "-m", "vime.supervisor",
                                       "--config", str(cfg)], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while '"engine.adopted"' not in out.read_text():
            assert second.poll() is None and time.monotonic() < deadline, out.read_text()[-3000:]
            time.sleep(0.2)
        text = out.read_text()
        assert '"limits.nofile_low"' in text and "adopt 1 running engine(s)" in text, text[-3000:]
        assert f"LimitNOFILE={need}" in text
        adopted = next(ln for ln in text.splitlines() if '"engine.adopted"' in ln)
        assert f'"pid": {pid}' in adopted, adopted
        os.kill(pid, 0)  # the engine it found is the one still running
    finally:
        if second is not None and second.poll() is None:
            second.send_signal(signal.SIGKILL)
            second.wait(10)
        kill_all([first], groups)


def starve(pid: int, hard: int) -> None:
    """The running process gets no new descriptor: a new one takes the lowest free number, and
    is refused at or above the soft limit, so the soft limit is set to the lowest free number
    (again while descriptors closing meanwhile, a control connection's, free lower ones)."""
    for _ in range(10):
        held = {int(fd) for fd in os.listdir(f"/proc/{pid}/fd")}
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (min(set(range(len(held) + 1)) - held), hard))
        time.sleep(0.05)


def test_an_engine_unobserved_for_want_of_descriptors_keeps_its_version_only_when_it_cannot_be_read(tmp_path):
    """A spawned engine (a PROTOCOL STAND-IN that closes every connection, so each probe needs a
    new descriptor) serves at v1; the running daemon's soft limit is lowered to what it holds
    (prlimit): its probes fail for want of descriptors, and past the hang bound the engine is
    UNHEALTHY (daemon_limit), out of routing. With descriptors again, the probe answers and
    /weight_info decides: unreadable (503), the process never stopped, so it is back RUNNING at
    the version it had; readable and at base weights, it is STALE, not routable at v1."""
    python = standin_python(tmp_path, STANDIN)
    mode = tmp_path / "mode"
    mode.write_text("version=1")
    engines = [{"name": "s0", "model": str(standin_model(tmp_path / "model")), "port": free_port(),
                "env": {"STANDIN_MODE_FILE": str(mode), "STANDIN_CONNECTION_CLOSE": "1"}}]
    cfg = standin_config(tmp_path, python, engines, warmup={"requests": 0})
    d = Daemon(cfg)
    try:
        d.transition("s0", "RUNNING", 60)
        from vime.supervisor.client import SupervisorClient
        with SupervisorClient(str(tmp_path / "run" / "supervisor.sock")) as c:
            c.publish_weights(1)
            assert [e["name"] for e in c.routable_engines()["engines"]] == ["s0"]
        soft, hard = resource.prlimit(d.proc.pid, resource.RLIMIT_NOFILE)
        for weights, back_to, version in (("weights_down", "RUNNING", 1), ("ok", "STALE", None)):
            mark = d.mark()
            starve(d.proc.pid, hard)
            try:
                out = d.transition("s0", "UNHEALTHY", 30, after=mark)
                assert out["cause"] == "daemon_limit", out
                mode.write_text(weights)
            finally:
                resource.prlimit(d.proc.pid, resource.RLIMIT_NOFILE, (soft, hard))
            back = d.transition("s0", back_to, 30, after=mark)
            with SupervisorClient(str(tmp_path / "run" / "supervisor.sock")) as c:
                [s0] = [e for e in c.status()["engines"] if e["name"] == "s0"]
                assert (s0["state"], s0["weight_version"]) == (back_to, version), (s0, back)
                routable = [e["name"] for e in c.routable_engines()["engines"]]
            assert routable == (["s0"] if back_to == "RUNNING" else []), routable
            mode.write_text("version=1")
            if back_to == "RUNNING":
                kept = d.wait_for(lambda e: e.get("event") == "engine.weight_version_kept", 5, after=mark)
                assert "503" in kept["why"], kept
    finally:
        kill_all([d])
