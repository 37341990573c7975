"""[router] period and watch refuse zero, negative and absurd values, through the daemon's own
`--check-config` (the command a unit's ExecStartPre runs) and its start with the same file: one
clear line per setting that says the range and what to set, exit 2, nothing started."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vime.supervisor.config import build

REPO = Path(__file__).resolve().parents[2]
PREFIX = "vime-supervisor: config error: "


def run(cfg: Path, *argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "VIME_SUPERVISOR_CONFIG"}
    return subprocess.run([sys.executable, "-m", "vime.supervisor", "--config", str(cfg), *argv], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=60)


def config(tmp: Path, router: str) -> Path:
    cfg = tmp / "sup.toml"
    cfg.write_text(f"""[supervisor]
runtime_dir = "{tmp / 'run'}"
log_dir = "{tmp / 'log'}"

[router]
url = "http://127.0.0.1:30000"
{router}

[[engines]]
name = "e0"
url = "http://127.0.0.1:8002"
""")
    return cfg


@pytest.mark.parametrize("router, want, starts", [
    ("period = 0\nwatch = -1", ["router.period: must be a number of seconds in 0.1..600, got 0; ",
                                "router.watch: must be a number of seconds in 0.05..60, got -1; "], True),
    ("period = 1e9\nwatch = 0.001", ["router.period: must be a number of seconds in 0.1..600, got 1e+09; ",
                                     "router.watch: must be a number of seconds in 0.05..60, got 0.001; "], False),
])
def test_period_and_watch_out_of_range_are_refused_with_what_to_set(tmp_path, router, want, starts):
    cfg = config(tmp_path, router)
    # Checked, and (once) started: the same refusal, nothing started.
    for argv in (("--check-config",), ()) if starts else (("--check-config",),):
        r = run(cfg, *argv)
        assert r.returncode == 2, (argv, r.stdout, r.stderr)
        lines = r.stderr.splitlines()
        for w in want:
            (line,) = [x for x in lines if x.startswith(PREFIX + w)]
            assert "suits most jobs" in line or "keep the default 1 s" in line, line  # what to set
        assert lines[-1].endswith("nothing was started"), lines
        assert not (tmp_path / "run").exists()


def test_the_ranges_ends_are_accepted(tmp_path):
    r = run(config(tmp_path, "period = 600\nwatch = 0.05"), "--check-config")
    assert (r.returncode, r.stderr) == (0, ""), r.stderr
    engines = [{"name": "e0", "url": "http://127.0.0.1:8002"}]
    cfg = build({"router": {"url": "http://127.0.0.1:30000", "period": 0.1, "watch": 60.0}, "engines": engines})
    assert cfg.router is not None and (cfg.router.period, cfg.router.watch) == (0.1, 60.0)
