"""[router] period and watch refuse zero, negative and absurd values: through the daemon's own
`--check-config` (the command a unit's ExecStartPre runs) and its start with the same file, one
clear line per setting that says the range and what to set, exit 2, nothing started; the far
ends of both ranges through the config's build."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vime.supervisor.config import ConfigError, build

REPO = Path(__file__).resolve().parents[2]
PREFIX = "vime-supervisor: config error: "
ENGINES = [{"name": "e0", "url": "http://127.0.0.1:8002"}]


def run(cfg: Path, *argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "VIME_SUPERVISOR_CONFIG"}
    return subprocess.run([sys.executable, "-m", "vime.supervisor", "--config", str(cfg), *argv], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=60)


def test_period_zero_and_watch_negative_are_refused_by_check_and_start(tmp_path):
    cfg = tmp_path / "sup.toml"
    cfg.write_text(f"""[supervisor]
runtime_dir = "{tmp_path / 'run'}"
log_dir = "{tmp_path / 'log'}"

[router]
url = "http://127.0.0.1:30000"
period = 0
watch = -1

[[engines]]
name = "e0"
url = "http://127.0.0.1:8002"
""")
    for argv in (("--check-config",), ()):  # checked, and started: the same refusal, nothing started
        r = run(cfg, *argv)
        assert r.returncode == 2, (argv, r.stdout, r.stderr)
        lines = r.stderr.splitlines()
        (period,) = [x for x in lines if x.startswith(PREFIX + "router.period: ")]
        assert period.startswith(PREFIX + "router.period: must be a number of seconds in 0.1..600, got 0; ")
        assert period.endswith("1 to 10 s suits most jobs"), period  # what to set
        (watch,) = [x for x in lines if x.startswith(PREFIX + "router.watch: ")]
        assert watch.startswith(PREFIX + "router.watch: must be a number of seconds in 0.05..60, got -1; ")
        assert "keep the default 1 s" in watch, watch
        assert lines[-1].endswith("nothing was started"), lines
        assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("period, watch, accepted", [
    (1e9, 0.001, False), (600.1, 60.5, False), (0.09, 0.049, False),
    (600.0, 0.05, True), (0.1, 60.0, True), (2.0, 1.0, True)])
def test_the_ranges_edges(period, watch, accepted):
    raw = {"router": {"url": "http://127.0.0.1:30000", "period": period, "watch": watch}, "engines": ENGINES}
    if accepted:
        r = build(raw).router
        assert r is not None and (r.period, r.watch) == (period, watch)
        return
    with pytest.raises(ConfigError) as ei:
        build(raw)
    assert [p.split(",")[0] for p in ei.value.problems] == [
        "router.period: must be a number of seconds in 0.1..600", "router.watch: must be a number of seconds in 0.05..60"]


def test_a_value_just_past_an_end_is_shown_as_given_and_a_watch_past_the_period_is_warned():
    raw = {"router": {"url": "http://127.0.0.1:30000", "period": 600.0001, "watch": 60.000001}, "engines": ENGINES}
    with pytest.raises(ConfigError) as ei:
        build(raw)
    assert [p.split("; ")[0].rsplit(", ", 1)[1] for p in ei.value.problems] == ["got 600.0001", "got 60.000001"]
    cfg = build({"router": {"url": "http://127.0.0.1:30000", "period": 1.0, "watch": 5.0}, "engines": ENGINES})
    assert any(w.startswith("router.watch = 5.0s is longer than router.period = 1.0s") for w in cfg.warnings), \
        cfg.warnings
    quiet = build({"router": {"url": "http://127.0.0.1:30000", "period": 2.0, "watch": 1.0}, "engines": ENGINES})
    assert not any("router.watch" in w for w in quiet.warnings)
