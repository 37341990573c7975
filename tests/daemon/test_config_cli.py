"""Bad configs through the real `vime-supervisor` command: `--check-config` and a plain start
refuse each one with exit status 2 and one line that names the problem, no traceback, and
nothing started. What is accepted but costs something (slime's own settings) is a warning:
printed by --check-config, logged by the daemon it starts."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

PREFIX = "vime-supervisor: config error: "
WARNING = "vime-supervisor: config warning: "
COMMAND = Path(sys.executable).with_name("vime-supervisor")


def run(*argv: str, wrap: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "VIME_SUPERVISOR_CONFIG"}
    return subprocess.run([*wrap, str(COMMAND), *argv], env=env, capture_output=True, text=True, timeout=60)


@pytest.fixture
def base(tmp_path) -> str:
    """The [supervisor] table of every config here: its directories, which must stay uncreated."""
    assert COMMAND.exists(), f"{COMMAND}: the console script is not installed (pip install -e .)"
    return (f'[supervisor]\nruntime_dir = "{tmp_path / "run"}"\nlog_dir = "{tmp_path / "logs"}"\n'
            f'state_dir = "{tmp_path / "state"}"\n')


ENGINE = '[[engines]]\nname = "e0"\nurl = "http://127.0.0.1:9"\n'


def refused(tmp_path: Path, config: Path, *, wrap: tuple[str, ...] = ()) -> list[str]:
    """Both ways in refuse the file alike: exit 2, the same lines, nothing created. The lines."""
    outs = []
    for extra in (("--check-config",), ()):
        r = run("--config", str(config), *extra, wrap=wrap)
        assert "Traceback" not in r.stderr, r.stderr
        assert (r.returncode, r.stdout) == (2, ""), (r.returncode, r.stdout, r.stderr)
        outs.append(r.stderr.splitlines())
    assert outs[0] == outs[1]
    for d in ("run", "logs", "state"):
        assert not (tmp_path / d).exists(), f"{d} was created: something started"
    return outs[0]


def one_read_error(tmp_path: Path, config: Path, **kw) -> str:
    """A file that cannot be read as TOML: exactly one line."""
    (line,) = refused(tmp_path, config, **kw)
    assert line.startswith(PREFIX + str(config) + ": "), line
    return line.removeprefix(PREFIX + str(config) + ": ")


def one_problem(tmp_path: Path, config: Path) -> str:
    """A readable file with one problem: its line, then the count."""
    line, summary = refused(tmp_path, config)
    assert summary == f"vime-supervisor: 1 problem(s) in {config}; nothing was started"
    assert line.startswith(PREFIX), line
    return line.removeprefix(PREFIX)


# -- files that cannot be read as TOML ------------------------------------------------------


def test_a_directory(tmp_path):
    d = tmp_path / "etc"
    d.mkdir()
    assert one_read_error(tmp_path, d) == "is a directory, not a config file; give the path of the TOML file"


def test_a_missing_file(tmp_path):
    assert one_read_error(tmp_path, tmp_path / "nope.toml") == (
        "no such config file; give --config the path of a TOML file (or set VIME_SUPERVISOR_CONFIG)")


def test_an_unreadable_file(tmp_path, base):
    f = tmp_path / "config.toml"
    f.write_text(base + ENGINE)
    f.chmod(0o000)
    wrap: tuple[str, ...] = ()
    if os.geteuid() == 0:  # root reads any file: run it without the capabilities that allow it
        if not shutil.which("setpriv"):
            pytest.skip("running as root without setpriv to drop CAP_DAC_OVERRIDE")
        wrap = ("setpriv", "--bounding-set=-dac_override,-dac_read_search", "--")
    assert one_read_error(tmp_path, f, wrap=wrap) == (
        "cannot be read (Permission denied); the daemon's user needs read access to it")


def test_a_file_that_is_not_utf8(tmp_path, base):
    f = tmp_path / "config.toml"
    f.write_bytes((base + "# r\u00e9glages\n" + ENGINE).encode("latin-1"))
    assert one_read_error(tmp_path, f) == (
        "not UTF-8 text (byte 0xe9 on line 5); TOML files are UTF-8: convert it (iconv -t UTF-8)")


def test_invalid_toml(tmp_path, base):
    f = tmp_path / "config.toml"
    f.write_text(base + "[health_check]\ninterval = 10 s\n" + ENGINE)
    what = one_read_error(tmp_path, f)
    assert what.startswith("not valid TOML: ") and "line 6" in what, what


# -- numbers and names ----------------------------------------------------------------------


@pytest.mark.parametrize("table, line, says", [
    ("health_check", "interval = nan", "health_check.interval: must be a finite number, got nan"),
    ("health_check", "timeout = inf", "health_check.timeout: must be a finite number, got inf"),
    ("supervisor_extra", "stop_timeout = -inf", "supervisor.stop_timeout: must be a finite number, got -inf"),
    ("restart", "backoff_max = +inf", "restart.backoff_max: must be a finite number, got inf"),
    ("warmup", "temperature = nan", "warmup.temperature: must be a finite number, got nan"),
])
def test_nan_and_infinities(tmp_path, base, table, line, says):
    f = tmp_path / "config.toml"
    body = base + line + "\n" if table == "supervisor_extra" else f"{base}[{table}]\n{line}\n"
    f.write_text(body + ENGINE)
    assert one_problem(tmp_path, f) == says


@pytest.mark.parametrize("name, why", [
    ("a/b", "'/' is not allowed"),
    ("two words", "' ' is not allowed"),
    ("group:e0", "':' is not allowed"),
])
def test_engine_names(tmp_path, base, name, why):
    f = tmp_path / "config.toml"
    f.write_text(base + f'[[engines]]\nname = "{name}"\nurl = "http://127.0.0.1:9"\n')
    assert one_problem(tmp_path, f) == (
        f"engines[0] ({name!r}).name: use letters, digits, '.', '_' and '-' (64 at most, not starting with "
        f"'.' or '-'); {why}, got {name!r}")


# -- who can reach an engine ----------------------------------------------------------------


def test_a_wildcard_bind_and_a_missing_key_file(tmp_path, base):
    f = tmp_path / "config.toml"
    spawned = f'[[engines]]\nname = "e0"\nmodel = "{tmp_path}"\nport = 8001\n'
    (tmp_path / "config.json").write_text("{}")  # tmp_path stands in for a model directory
    f.write_text(base + '[engine_defaults]\nhost = "0.0.0.0"\n' + spawned)
    assert one_problem(tmp_path, f).startswith("engine_defaults.host: '0.0.0.0' listens on every address")
    f.write_text(base + '[engine_defaults]\napi_key_file = "engine.key"\n' + spawned)
    assert one_problem(tmp_path, f).startswith(
        f"engine_defaults.api_key_file: no such file: {tmp_path / 'engine.key'};")


# -- warnings -------------------------------------------------------------------------------


SLIME = "[health_check]\nfirst_wait = 0\ninterval = 10\ntimeout = 5\nfailure_threshold = 1\n"


def test_slimes_settings_are_accepted_with_warnings(tmp_path, base):
    f = tmp_path / "config.toml"
    f.write_text(base + SLIME + ENGINE)
    r = run("--config", str(f), "--check-config")
    assert (r.returncode, r.stdout) == (0, f"{f}: ok, 1 engine(s)\n"), r.stderr
    first_wait, interval = r.stderr.splitlines()
    assert first_wait.startswith(WARNING + "health_check.first_wait = 0: no startup deadline")
    assert interval.startswith(WARNING + "health_check: interval (10s) is not less than timeout x "
                                         "failure_threshold (5s x 1)")


def test_the_daemon_logs_its_config_warnings(tmp_path):
    run_dir = tempfile.mkdtemp(prefix="vime-cfg-", dir="/tmp")  # short: a socket path is <= 107 bytes
    f = tmp_path / "config.toml"
    f.write_text(f'[supervisor]\nruntime_dir = "{run_dir}"\nlog_dir = "{tmp_path / "logs"}"\n'
                 f'state_dir = "{tmp_path / "state"}"\n' + SLIME + ENGINE)
    log = tmp_path / "daemon.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(COMMAND), "--config", str(f)], stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        warnings: list[str] = []
        while len(warnings) < 2:
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "no config.warning lines:\n" + log.read_text()
            time.sleep(0.1)
            events = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
            warnings = [e["warning"] for e in events if e.get("event") == "config.warning"]
        assert warnings[0].startswith("health_check.first_wait = 0: no startup deadline")
        assert warnings[1].startswith("health_check: interval (10s) is not less than")
        assert all(e.get("level") == "warning" for e in events if e.get("event") == "config.warning")
        # Its signal handlers are in place once it serves its socket (a SIGTERM before that, on a
        # loaded host, ends it by the default action, -15).
        while not os.path.exists(os.path.join(run_dir, "supervisor.sock")):
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the control socket never appeared:\n" + log.read_text()
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        shutil.rmtree(run_dir, ignore_errors=True)
