"""The systemd unit, its sysusers file, its ExecStopPost= reaper, and the open-file limit.

systemd itself judges the unit (`systemd-analyze verify` and `security --offline=yes`) and the
sysusers file (`systemd-sysusers --dry-run` in an empty root). The reaper runs as systemd runs
it, with $SERVICE_RESULT set, against engine groups a daemon spawned and left behind when it
was killed with -9: stand-in servers (not vLLM) started by the daemon's own spawn code.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from vime.supervisor import limits

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
                       "DevicePolicy": "closed", "CapabilityBoundingSet": ""}.items():
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
