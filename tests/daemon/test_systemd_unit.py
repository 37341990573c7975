"""The systemd unit, its sysusers file, its ExecStopPost= reaper, and the open-file limit.

systemd itself judges the unit (`systemd-analyze verify` and `security --offline=yes`) and the
sysusers file (`systemd-sysusers --dry-run` in an empty root). The reaper runs as systemd runs
it, with $SERVICE_RESULT set, against engine groups a daemon spawned and left behind when it
was killed with -9: stand-in servers (not vLLM) started by the daemon's own spawn code.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vime.supervisor import limits
from vime.supervisor.sdnotify import Notifier
from vime.harness.local_daemon import Daemon, free_port, live_pids_in_groups, write_config

from support.polling import wait_until

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "systemd" / "vime-supervisor.service"
SYSUSERS = ROOT / "systemd" / "vime-supervisor.sysusers"
MAX_EXPOSURE = 4.0

needs_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                                   reason="systemd-analyze not installed (Debian: apt-get install systemd)")


def unit_settings(text: str) -> dict[str, list[str]]:
    """key -> every value it is given in the unit (comments and section headers left out)."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")) and "=" in line:
            key, value = line.split("=", 1)
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def unit_copy(tmp_path: Path) -> Path:
    """The unit with its /opt/vime paths pointed at this venv: verify wants every ExecX=
    binary to exist."""
    unit = UNIT.read_text()
    exe = Path(sys.executable).with_name("vime-supervisor")
    assert exe.exists()
    unit = unit.replace("/opt/vime/.venv/bin/vime-supervisor", str(exe))
    unit = unit.replace("/opt/vime/.venv/bin/python", str(Path(sys.executable).with_name("python")))
    assert "/opt/vime/.venv" not in unit
    path = tmp_path / "vime-supervisor.service"
    path.write_text(unit)
    return path


# -- the unit -------------------------------------------------------------------------------

@needs_analyze
def test_unit_file_verifies(tmp_path):
    path = unit_copy(tmp_path)
    r = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True)
    problems = [ln for ln in (r.stdout + r.stderr).splitlines() if "vime-supervisor.service" in ln]
    assert r.returncode == 0 and not problems, r.stdout + r.stderr


def test_unit_keeps_what_the_daemon_relies_on():
    s = unit_settings(UNIT.read_text())
    for key, value in {"Type": "notify", "NotifyAccess": "main", "Restart": "on-failure",
                       "KillMode": "process", "RuntimeDirectory": "vime-supervisor",
                       "RuntimeDirectoryMode": "0750", "RuntimeDirectoryPreserve": "restart",
                       "StateDirectory": "vime-supervisor", "User": "vime-supervisor",
                       "Group": "vime-supervisor", "ExecReload": "/bin/kill -HUP $MAINPID",
                       "DevicePolicy": "closed", "CapabilityBoundingSet": "",
                       "RestartPreventExitStatus": "2",  # 2: a config error, never looped on
                       "CPUWeight": "100"}.items():  # one scheduling group: no per-session autogroups
        assert s.get(key) == [value], (key, s.get(key))
    assert "WatchdogSec" in s and int(s["LimitNOFILE"][0]) >= limits.nofile_needed(1000)
    assert any("-m vime.supervisor.reap --config" in v for v in s["ExecStopPost"])
    # The reaper reads the daemon's config and flags: the same as ExecStart's.
    start_args = s["ExecStart"][0].split(" ", 1)[1]
    assert s["ExecStopPost"][0].endswith(start_args)
    assert "char-nvidia* rw" in s["DeviceAllow"]
    # Engines outlive a daemon that crashed: nothing may be emptied under them when it exits
    # (PrivateTmp, RemoveIPC), and their JIT compilers need W+X memory; /dev/nvidia* must stay.
    for key in ("PrivateTmp", "RemoveIPC", "MemoryDenyWriteExecute", "PrivateDevices", "ProcSubset",
                "PrivateUsers", "PrivateNetwork"):
        assert key not in s, f"{key}= breaks engines (see the unit's comments)"


def security_table(path: Path) -> tuple[float, str]:
    r = subprocess.run(["systemd-analyze", "security", "--offline=yes", "--no-pager", str(path)],
                       capture_output=True, text=True)
    out = r.stdout + r.stderr
    m = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?)", out)
    assert m, f"no exposure level in systemd-analyze's answer (rc {r.returncode}):\n{out}"
    return float(m.group(1)), out


@needs_analyze
def test_unit_exposure_is_at_most_4(tmp_path):
    exposure, table = security_table(unit_copy(tmp_path))
    assert exposure <= MAX_EXPOSURE, f"exposure {exposure} > {MAX_EXPOSURE}:\n{table}"


@needs_analyze
def test_the_exposure_check_can_fail(tmp_path):
    """The parse reads the real figure: the unit without its sandbox is rated far worse."""
    path = unit_copy(tmp_path)
    bare = [ln for ln in path.read_text().splitlines()
            if ln.startswith(("[", "Type=", "ExecStart=", "User=", "Group="))]
    path.write_text("\n".join(bare) + "\n")
    exposure, table = security_table(path)
    assert exposure > MAX_EXPOSURE, table


# -- the user and group ---------------------------------------------------------------------

def sysusers_lines() -> list[list[str]]:
    lines = []
    for line in SYSUSERS.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            # Fields are space-separated; a quoted GECOS holds spaces.
            lines.append(re.findall(r'"[^"]*"|\S+', line))
    return lines


def test_sysusers_file_makes_the_units_user_with_the_state_directory_as_home():
    lines = sysusers_lines()
    users = [f for f in lines if f[0] == "u"]
    assert len(users) == 1
    _, name, uid, _gecos, home = users[0][:5]
    s = unit_settings(UNIT.read_text())
    assert [name] == s["User"] == s["Group"] and uid == "-"
    assert home == f"/var/lib/{s['StateDirectory'][0]}"  # writable in the sandbox: what engines keep under ~
    assert {f[2] for f in lines if f[0] == "m" and f[1] == name} == {"video", "render"}


@pytest.mark.skipif(shutil.which("systemd-sysusers") is None, reason="systemd-sysusers not installed")
def test_sysusers_accepts_the_file(tmp_path):
    r = subprocess.run(["systemd-sysusers", f"--root={tmp_path}", "--dry-run", str(SYSUSERS)],
                       capture_output=True, text=True)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "Creating user 'vime-supervisor'" in out and "Creating group 'vime-supervisor'" in out, out
    assert not any(tmp_path.iterdir())  # a dry run: nothing written


# -- the reaper (ExecStopPost=) -------------------------------------------------------------

# Stands in for `python -m vllm.entrypoints.openai.api_server ... --port P`: the daemon spawns
# it as it spawns vLLM (its own process group, the engine module on its command line), and it forks
# a child into its process group as vLLM's EngineCore is. Tests only; not vLLM.
FAKE_PYTHON = f"""#!{sys.executable}
import asyncio, subprocess, sys
from vime.harness import standin_engine
port = int(sys.argv[sys.argv.index("--port") + 1])
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
async def main():
    await standin_engine.serve(port, 1)
    await asyncio.Event().wait()
asyncio.run(main())
"""
SYSTEMD_VARS = ("SERVICE_RESULT", "EXIT_CODE", "EXIT_STATUS")


def engines_config(tmp_path: Path, n: int, **sections) -> Path:
    fake = tmp_path / "fake-python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text('{"model_type": "standin"}')
    return write_config(
        tmp_path / "sup.toml",
        supervisor={"runtime_dir": str(tmp_path / "run"), "log_dir": str(tmp_path / "logs"),
                    "python": str(fake), "stop_timeout": 2.0},
        health_check={"first_wait": 60.0, "interval": 0.5, "timeout": 0.4, "failure_threshold": 2},
        engines=[{"name": f"e{i}", "model": str(model), "served_model_name": "tiny", "port": free_port()}
                 for i in range(n)],
        **sections,
    )


@pytest.fixture
def daemon_of(tmp_path):
    """Start a daemon on a config, its engines RUNNING; every group it spawned is SIGKILLed
    on the way out, whatever the test did."""
    started: list[Daemon] = []

    def start(cfg: Path) -> Daemon:
        d = Daemon(cfg)
        started.append(d)
        for name in ("e0", "e1"):
            d.transition(name, "RUNNING", 90)  # generous: a loaded CI machine
        journal = tmp_path / "state" / "journal.json"
        wait_until(lambda: journal.exists() and all(e.get("pid") for e in json.loads(journal.read_text())["engines"].values()),
                   5, "the journal names both engines' pids")
        return d

    yield start
    for d in started:
        d.kill()
        for pgid in d.spawned_pids():
            try:
                os.killpg(pgid, signal.SIGKILL)
            except OSError:
                pass


def reaper(cfg: Path, service_result: str | None, *flags: str, **systemd: str) -> list[dict]:
    """Run the reaper as ExecStopPost= does; its log lines. It must always exit 0."""
    env = {k: v for k, v in os.environ.items() if k not in SYSTEMD_VARS}
    if service_result is not None:
        env["SERVICE_RESULT"] = service_result
    env.update(systemd)
    r = subprocess.run([sys.executable, "-m", "vime.supervisor.reap", "--config", str(cfg), *flags],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    return [json.loads(ln) for ln in r.stderr.splitlines() if ln.startswith("{")]


def groups(d: Daemon) -> dict[int, list[int]]:
    """pgid -> live pids, for each engine group the daemon spawned."""
    pgids = set(d.spawned_pids())
    out: dict[int, list[int]] = {g: [] for g in pgids}
    for pid, pgid, _ in live_pids_in_groups(pgids):
        out[pgid].append(pid)
    return out


def test_reaper_leaves_engines_after_a_crash_and_stops_them_after_a_stop_timeout(tmp_path, daemon_of):
    cfg = engines_config(tmp_path, 2)
    d = daemon_of(cfg)
    pids = {name: d.last_pid(name) for name in ("e0", "e1")}
    # e1 named by no journal (as after a corrupt one): only its command line and port find it.
    journal = tmp_path / "state" / "journal.json"
    d.proc.send_signal(signal.SIGKILL)  # what systemd does to a daemon past TimeoutStopSec
    d.proc.wait(10)
    data = json.loads(journal.read_text())
    for key in ("pid", "start_time", "port", "log_path", "fingerprint"):
        data["engines"]["e1"].pop(key)
    journal.write_text(json.dumps(data))
    assert all(len(members) == 2 for members in groups(d).values())  # leader + "EngineCore" each

    # A crash that Restart=on-failure restarts: the next daemon re-adopts them; nothing is touched.
    for result, code, status in (("signal", "killed", "KILL"), ("exit-code", "exited", "1"),
                                 ("watchdog", "dumped", "ABRT"), ("core-dump", "dumped", "SEGV"),
                                 ("oom-kill", "killed", "KILL")):
        lines = reaper(cfg, result, EXIT_CODE=code, EXIT_STATUS=status)
        skipped = [ln for ln in lines if ln["event"] == "reap.skipped"]
        assert len(skipped) == 1 and f"SERVICE_RESULT={result}" in skipped[0]["why"], lines
        assert not any(ln["event"] == "reap.stopped" for ln in lines)
    lines = reaper(cfg, None)  # by hand, not by systemd: nothing without --force
    assert [ln["event"] for ln in lines] == ["reap.skipped"] and "--force" in lines[0]["why"]
    assert all(len(members) == 2 for members in groups(d).values())

    # The stop overran TimeoutStopSec: every group goes, the leftover child included.
    lines = reaper(cfg, "timeout", EXIT_CODE="killed", EXIT_STATUS="KILL")
    stopped = {ln["engine"]: ln for ln in lines if ln["event"] == "reap.stopped"}
    assert set(stopped) == {"e0", "e1"}, lines
    assert stopped["e0"]["found_by"] == "journal" and stopped["e1"]["found_by"] == "port scan"
    assert {stopped[n]["pid"] for n in stopped} == set(pids.values())
    assert all(ln["how"].startswith("SIGKILL") for ln in stopped.values())  # its graceful stop was spent
    assert all("SERVICE_RESULT=timeout" in ln["why"] for ln in stopped.values())
    assert [ln for ln in lines if ln["event"] == "reap.done"][0]["stopped"] == 2
    assert live_pids_in_groups(set(d.spawned_pids())) == []
    # Run again (systemd never does, but nothing must break): nothing left, nothing said.
    assert not any(ln["event"] == "reap.stopped" for ln in reaper(cfg, "timeout"))


def test_reaper_after_a_clean_end_stops_with_sigterm_and_reads_past_a_corrupt_journal(tmp_path, daemon_of):
    cfg = engines_config(tmp_path, 2)
    d = daemon_of(cfg)
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait(10)
    (tmp_path / "state" / "journal.json").write_text("{ not json")
    lines = reaper(cfg, "success", EXIT_CODE="exited", EXIT_STATUS="0")
    assert any(ln["event"] == "reap.journal_unusable" for ln in lines)
    stopped = [ln for ln in lines if ln["event"] == "reap.stopped"]
    assert sorted(ln["engine"] for ln in stopped) == ["e0", "e1"], lines
    assert all(ln["how"] == "SIGTERM" and ln["found_by"] == "port scan" for ln in stopped)
    assert live_pids_in_groups(set(d.spawned_pids())) == []


def test_reaper_never_touches_a_running_daemons_engines(tmp_path, daemon_of):
    cfg = engines_config(tmp_path, 2)
    d = daemon_of(cfg)
    lines = reaper(cfg, "success", "--force")
    assert [ln["event"] for ln in lines] == ["reap.skipped"] and str(d.proc.pid) in lines[0]["why"]
    assert d.proc.poll() is None and all(len(m) == 2 for m in groups(d).values())
    assert d.terminate(30) == 0


def test_reaper_exits_0_and_says_why_with_no_usable_config(tmp_path):
    missing = tmp_path / "nowhere.toml"
    lines = reaper(missing, "timeout")
    assert [ln["event"] for ln in lines] == ["reap.no_config"] and str(missing) in lines[0]["problem"]


# -- sd_notify: the start and reload messages the unit relies on ------------------------------

def test_notifier_extends_the_start_timeout_and_announces_a_reload(tmp_path):
    addr = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(addr)
        sock.settimeout(2)
        n = Notifier(env={"NOTIFY_SOCKET": addr})
        n.extend_timeout(90)
        n.extend_timeout(0.0000001)  # never 0: systemd reads 0 as "no time left"
        before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        n.reloading()
        n.ready("1/1 engines RUNNING, round 3, weights v2")
        msgs = [sock.recv(4096).decode() for _ in range(4)]
    assert msgs[:2] == ["EXTEND_TIMEOUT_USEC=90000000", "EXTEND_TIMEOUT_USEC=1"]
    reload_lines = dict(line.split("=", 1) for line in msgs[2].splitlines())
    assert reload_lines["RELOADING"] == "1" and int(reload_lines["MONOTONIC_USEC"]) >= before
    assert msgs[3].startswith("READY=1\n")
