"""Config validation (vime.supervisor.config) and the real CLI refusing bad files. No engines."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vime.supervisor.config import ConfigError, ConfigReadError, build, load
from vime.supervisor.daemon import parse_args
from vime.supervisor.config import ProbePolicy, RestartPolicy

REPO = Path(__file__).resolve().parents[2]
PREFIX = "vime-supervisor: config error: "


def model_dir(root: Path, name: str = "tiny") -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    return d


def engine(name: str, model: Path, port: int, **kw) -> dict:
    return {"name": name, "model": str(model), "port": port, **kw}


def problems(raw: dict, overrides: dict | None = None, **kw) -> list[str]:
    with pytest.raises(ConfigError) as ei:
        build(raw, overrides, **kw)
    err = ei.value
    assert str(err) == "\n".join(err.problems)
    return err.problems


@pytest.fixture
def model(tmp_path) -> Path:
    return model_dir(tmp_path)


@pytest.fixture
def good(model) -> dict:
    return {"engines": [engine("e0", model, 8001)]}


# -- a good config --------------------------------------------------------------------------


def test_good_config_gets_slimes_defaults(model):
    cfg = build({"engines": [engine("e0", model, 8001)]})
    assert cfg.probe == ProbePolicy()
    assert (cfg.probe.first_wait, cfg.probe.interval, cfg.probe.timeout) == (300.0, 10.0, 5.0)
    assert (cfg.probe.failure_threshold, cfg.probe.success_threshold) == (3, 1)
    assert cfg.restart == RestartPolicy()
    assert cfg.use_fault_tolerance is True
    assert cfg.stop_timeout == 10.0
    assert cfg.min_healthy == 1
    assert cfg.restart_immediately is False
    assert cfg.log_level == "info"
    assert cfg.engine_args == () and cfg.engine_env == {} and cfg.allowed_uids == ()
    (e,) = cfg.engines
    assert (e.name, e.model, e.port, e.host) == ("e0", str(model), 8001, "127.0.0.1")
    assert e.spawned and e.base_url == "http://127.0.0.1:8001"
    assert e.model_name == str(model)
    assert e.args == () and e.env == {}


def test_good_config_with_every_section(tmp_path):
    m1, m2 = model_dir(tmp_path, "a"), model_dir(tmp_path, "b")
    cfg = build({
        "supervisor": {"use_fault_tolerance": False, "stop_timeout": 3, "min_healthy": 2,
                       "log_level": "debug", "allowed_uids": [1000], "runtime_dir": "/tmp/r"},
        "health_check": {"first_wait": 60, "interval": 2, "timeout": 1.5, "failure_threshold": 2},
        "restart": {"start_retries": 5, "backoff_initial": 0.5, "backoff_max": 8, "flapping_window": 60,
                    "flapping_max_restarts": 4},
        "engine_defaults": {"args": ["--dtype", "float32"], "env": {"VLLM_CPU_KVCACHE_SPACE": "1"}},
        "engines": [
            engine("a", m1, 8001, served_model_name="tiny", args=["--max-model-len", "256"], env={"X": "1"}),
            engine("b", m2, 8002),
            {"name": "remote", "url": "http://10.0.0.5:8000/"},
        ],
    })
    assert cfg.use_fault_tolerance is False and cfg.min_healthy == 2 and cfg.allowed_uids == (1000,)
    assert cfg.stop_timeout == 3.0 and isinstance(cfg.stop_timeout, float)
    assert cfg.probe == ProbePolicy(first_wait=60.0, interval=2.0, timeout=1.5, failure_threshold=2)
    assert isinstance(cfg.probe.interval, float)
    assert cfg.restart == RestartPolicy(5, 0.5, 8.0, 60.0, 4)
    assert cfg.engine_args == ("--dtype", "float32")
    assert cfg.engine_env == {"VLLM_CPU_KVCACHE_SPACE": "1"}
    a, b, remote = cfg.engines
    assert a.model_name == "tiny" and a.args == ("--max-model-len", "256") and a.env == {"X": "1"}
    assert not remote.spawned and remote.base_url == "http://10.0.0.5:8000"
    assert cfg.socket_path == "/tmp/r/supervisor.sock"


# -- one problem each -----------------------------------------------------------------------


def test_unknown_top_level_key(good):
    assert problems({**good, "healthcheck": {}}) == [
        "healthcheck: unknown key (known: engine_defaults, engines, health_check, restart, router, supervisor, warmup, weights)"]


def test_unknown_key_in_health_check(good):
    assert problems({**good, "health_check": {"intervall": 5}}) == [
        "health_check.intervall: unknown key "
        "(known: failure_threshold, first_wait, interval, max_busy, success_threshold, timeout)"]


@pytest.mark.parametrize(
    "section, key, value, message",
    [
        ("health_check", "interval", "ten", "health_check.interval: must be a number, got 'ten'"),
        ("health_check", "failure_threshold", 2.5, "health_check.failure_threshold: must be an integer, got 2.5"),
        ("health_check", "failure_threshold", True, "health_check.failure_threshold: must be an integer, got True"),
        ("health_check", "timeout", False, "health_check.timeout: must be a number, got False"),
        ("supervisor", "use_fault_tolerance", "yes", "supervisor.use_fault_tolerance: must be true or false, got 'yes'"),
        ("supervisor", "use_fault_tolerance", 1, "supervisor.use_fault_tolerance: must be true or false, got 1"),
        ("restart", "start_retries", "3", "restart.start_retries: must be an integer, got '3'"),
        ("supervisor", "log_dir", 7, "supervisor.log_dir: must be a string, got 7"),
    ],
)
def test_wrong_type(good, section, key, value, message):
    assert problems({**good, section: {key: value}}) == [message]


def test_section_that_is_not_a_table(good):
    assert problems({**good, "health_check": 5}) == ["health_check: must be a table"]


def test_interval_not_below_timeout_times_failure_threshold_is_a_warning(good):
    msg = ("health_check: interval (15s) is not less than timeout x failure_threshold (5s x 3): the wait "
           "between heartbeats, not the probes, bounds detection; a hang is seen within 31.5s of when it "
           "begins. Lower interval to see it sooner")
    cfg = build({**good, "health_check": {"interval": 15}})
    assert cfg.probe.interval == 15.0 and cfg.warnings == (msg,)
    assert build({**good, "health_check": {"interval": 14.9}}).warnings == ()


def test_slimes_own_settings_are_accepted_with_warnings(good):
    """slime: first_wait 0 (no grace period) and one failed probe kills (threshold 1,
    interval 10, timeout 5). Accepted; what they cost is said, not refused."""
    cfg = build({**good, "health_check": {"first_wait": 0, "interval": 10, "timeout": 5, "failure_threshold": 1}})
    assert (cfg.probe.first_wait, cfg.probe.interval, cfg.probe.timeout, cfg.probe.failure_threshold) == (
        0.0, 10.0, 5.0, 1)
    first_wait, interval = cfg.warnings
    assert first_wait.startswith("health_check.first_wait = 0: no startup deadline")
    assert interval.startswith("health_check: interval (10s) is not less than timeout x failure_threshold (5s x 1)")
    assert "within 15.5s" in interval


@pytest.mark.parametrize(
    "health, message",
    [
        ({"timeout": 0}, "health_check.timeout: must be > 0, got 0"),
        ({"failure_threshold": 0, "interval": 1}, "health_check.failure_threshold: must be >= 1, got 0"),
        ({"first_wait": 5}, "health_check: timeout (5s) must be less than first_wait (5s)"),
        ({"first_wait": -1}, "health_check.first_wait: must be >= 0 (0: no startup deadline), got -1"),
        ({"interval": -1}, "health_check.interval: must be > 0, got -1"),
    ],
)
def test_health_check_ranges(good, health, message):
    assert message in problems({**good, "health_check": health})


def test_duplicate_engine_name(tmp_path):
    m = model_dir(tmp_path)
    assert problems({"engines": [engine("e0", m, 8001), engine("e0", m, 8002)]}) == [
        "engines[1] (e0): duplicate name (also engines[0])"]


def test_duplicate_port(tmp_path):
    m = model_dir(tmp_path)
    assert problems({"engines": [engine("e0", m, 8001), engine("e1", m, 8002), engine("e2", m, 8001)]}) == [
        "engines[2] (e2).port: duplicate port 8001 (also used by e0)"]


def test_port_out_of_range(model):
    assert problems({"engines": [engine("e0", model, 70000)]}) == ["engines[0] (e0).port: must be 1..65535, got 70000"]


def test_missing_model_directory(tmp_path):
    gone = tmp_path / "no-such-model"
    assert problems({"engines": [engine("e0", gone, 8001)]}) == [
        f"engines[0] (e0).model: no such directory: {gone}"]


def test_directory_without_config_json(tmp_path):
    d = tmp_path / "not-a-model"
    d.mkdir()
    (d / "weights.bin").write_bytes(b"")
    assert problems({"engines": [engine("e0", d, 8001)]}) == [
        f"engines[0] (e0).model: {d} has no config.json; is it a model directory?"]


def test_model_that_is_a_file(tmp_path):
    f = tmp_path / "config.json"
    f.write_text("{}")
    assert problems({"engines": [engine("e0", f, 8001)]}) == [f"engines[0] (e0).model: no such directory: {f}"]


def test_engine_with_url_and_model(model):
    assert problems({"engines": [{"name": "e0", "url": "http://127.0.0.1:8001", "model": str(model)}]}) == [
        "engines[0] (e0): give either url (attach) or model and port (spawn), not both"]


def test_engine_with_neither_url_nor_model():
    assert problems({"engines": [{"name": "e0", "port": 8001}]}) == [
        "engines[0] (e0): needs model (a directory) and port to spawn, or url to attach"]
    assert problems({"engines": [{"name": "e0"}]}) == [
        "engines[0] (e0): needs model (a directory) and port to spawn, or url to attach",
        "engines[0] (e0): needs a port",
    ]


def test_engine_without_name(model):
    assert problems({"engines": [{"model": str(model), "port": 8001}]}) == ["engines[0]: needs a name"]


@pytest.mark.parametrize("url", ["localhost:8000", "ftp://host:8000", "http://", "10.0.0.5:8000"])
def test_bad_url(url):
    assert problems({"engines": [{"name": "e0", "url": url}]}) == [
        f"engines[0] (e0).url: must be http://HOST:PORT, got {url!r}"]


@pytest.mark.parametrize("args, flag", [
    (["--port", "9000"], "--port"),
    (["--dtype", "float32", "--port=9000"], "--port"),
    (["--host", "0.0.0.0"], "--host"),
    (["--model=/other"], "--model"),
    (["--ho", "0.0.0.0"], "--host"),  # argparse takes an unambiguous prefix
])
def test_port_host_model_inside_engine_args(model, args, flag):
    assert problems({"engines": [engine("e0", model, 8001, args=args)]}) == [
        f"engines[0] (e0).args: do not pass {flag}; set the engine's own key instead"]


def test_port_inside_engine_defaults_args(good):
    assert problems({**good, "engine_defaults": {"args": ["--port=9000"]}}) == [
        "engine_defaults.args: do not pass --port; set the engine's own key instead"]


def test_lookalike_flags_are_fine(model):
    cfg = build({"engines": [engine("e0", model, 8001, args=["--portable", "--model-impl", "vllm"])]})
    assert cfg.engines[0].args == ("--portable", "--model-impl", "vllm")


def test_engine_args_and_env_must_be_strings(model):
    assert problems({"engines": [engine("e0", model, 8001, args=["--max-model-len", 256], env={"A": 1})]}) == [
        "engines[0] (e0).args: must be a list of strings",
        "engines[0] (e0).env: every value must be a string",
    ]


def test_engine_defaults_args_and_env_must_be_strings(good):
    # These are reported, not silently dropped.
    assert problems({**good, "engine_defaults": {"args": ["--max-model-len", 256], "env": {"A": 1}}}) == [
        "engine_defaults.env: every value must be a string",
        "engine_defaults.args: must be a list of strings",
    ]


def test_min_healthy_more_than_engines(tmp_path):
    m = model_dir(tmp_path)
    assert problems({"supervisor": {"min_healthy": 3},
                     "engines": [engine("e0", m, 8001), engine("e1", m, 8002)]}) == [
        "supervisor.min_healthy: 3 is more than the 2 configured engines"]
    assert build({"supervisor": {"min_healthy": 2},
                  "engines": [engine("e0", m, 8001), engine("e1", m, 8002)]}).min_healthy == 2


def test_no_engines():
    assert problems({}) == ["engines: at least one [[engines]] table is needed"]
    assert problems({"engines": []}) == ["engines: at least one [[engines]] table is needed"]


def test_bad_log_level(good):
    assert problems({**good, "supervisor": {"log_level": "loud"}}) == [
        "supervisor.log_level: must be one of debug, error, info, warning, got 'loud'"]


def test_several_problems_are_all_reported_together(tmp_path):
    m = model_dir(tmp_path)
    gone = tmp_path / "gone"
    raw = {
        "extra": 1,
        "supervisor": {"use_fault_tolerance": "yes", "min_healthy": 9},
        "health_check": {"interval": "ten", "intervall": 3},
        "engines": [
            engine("e0", m, 8001),
            engine("e1", gone, 8001, args=["--port", "1"]),
            engine("e0", m, 8003),
            {"name": "r", "url": "nope"},
        ],
    }
    assert problems(raw) == [
        "extra: unknown key (known: engine_defaults, engines, health_check, restart, router, supervisor, warmup, weights)",
        "supervisor.use_fault_tolerance: must be true or false, got 'yes'",
        "health_check.interval: must be a number, got 'ten'",
        "health_check.intervall: unknown key "
        "(known: failure_threshold, first_wait, interval, max_busy, success_threshold, timeout)",
        f"engines[1] (e1).model: no such directory: {gone}",
        "engines[1] (e1).port: duplicate port 8001 (also used by e0)",
        "engines[1] (e1).args: do not pass --port; set the engine's own key instead",
        "engines[2] (e0): duplicate name (also engines[0])",
        "engines[3] (r).url: must be http://HOST:PORT, got 'nope'",
        "supervisor.min_healthy: 9 is more than the 4 configured engines",
    ]


# -- load: a file, relative paths, flags over the file --------------------------------------


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_relative_model_paths_resolve_against_the_config_files_directory(tmp_path, monkeypatch):
    etc = tmp_path / "etc"
    rel = model_dir(etc / "models", "tiny")
    absolute = model_dir(tmp_path / "elsewhere", "abs")
    cfg_file = write(etc / "config.toml", f"""
[[engines]]
name = "rel"
model = "models/tiny"
port = 8001

[[engines]]
name = "abs"
model = "{absolute}"
port = 8002
""")
    monkeypatch.chdir(tmp_path / "elsewhere")  # not the config's directory
    cfg = load(str(cfg_file))
    assert cfg.engines[0].model == str(rel)
    assert Path(cfg.engines[0].model).is_absolute()
    assert cfg.engines[1].model == str(absolute)
    # And a relative path that does not exist is reported with where it was looked for.
    write(cfg_file, '[[engines]]\nname = "rel"\nmodel = "models/missing"\nport = 8001\n')
    with pytest.raises(ConfigError) as ei:
        load(str(cfg_file))
    assert ei.value.problems == [f"engines[0] (rel).model: no such directory: {etc / 'models' / 'missing'}"]


def _flag_file(tmp_path: Path) -> Path:
    m = model_dir(tmp_path)
    return write(tmp_path / "config.toml", f"""
[supervisor]
use_fault_tolerance = true
min_healthy = 1
stop_timeout = 20

[health_check]
first_wait = 120
interval = 8
timeout = 4
failure_threshold = 3

[restart]
start_retries = 2

[[engines]]
name = "e0"
model = "{m}"
port = 8001

[[engines]]
name = "e1"
model = "{m}"
port = 8002
""")


def test_flags_override_the_file(tmp_path):
    f = _flag_file(tmp_path)
    cfg = load(str(f), parse_args(["--config", str(f)]))  # no flags: the file as written
    assert (cfg.probe.first_wait, cfg.probe.interval, cfg.probe.timeout) == (120.0, 8.0, 4.0)
    assert cfg.use_fault_tolerance is True and cfg.restart.start_retries == 2 and cfg.stop_timeout == 20.0

    args = parse_args([
        "--config", str(f),
        "--rollout-health-check-interval", "2",
        "--rollout-health-check-timeout", "1.5",
        "--rollout-health-check-failure-threshold", "5",
        "--rollout-health-check-success-threshold", "2",
        "--no-use-fault-tolerance",
        "--start-retries", "7",
        "--backoff-max", "30",
        "--min-healthy", "2",
        "--restart-immediately",
        "--log-level", "debug",
    ])
    cfg = load(args.config, args)
    assert cfg.probe == ProbePolicy(first_wait=120.0, interval=2.0, timeout=1.5,
                                    failure_threshold=5, success_threshold=2)
    assert cfg.use_fault_tolerance is False
    assert cfg.restart.start_retries == 7 and cfg.restart.backoff_max == 30.0
    assert cfg.restart.backoff_initial == RestartPolicy().backoff_initial
    assert cfg.min_healthy == 2 and cfg.restart_immediately is True and cfg.log_level == "debug"
    assert cfg.stop_timeout == 20.0  # not given as a flag: the file's value


def test_flags_are_validated_like_the_file(tmp_path):
    f = _flag_file(tmp_path)
    args = parse_args(["--config", str(f), "--rollout-health-check-timeout", "0", "--min-healthy", "5"])
    with pytest.raises(ConfigError) as ei:
        load(args.config, args)
    assert ei.value.problems == [
        "health_check.timeout: must be > 0, got 0",
        "supervisor.min_healthy: 5 is more than the 2 configured engines",
    ]


def test_load_missing_file_and_bad_toml(tmp_path):
    with pytest.raises(ConfigReadError) as ei:
        load(str(tmp_path / "nope.toml"))
    assert ei.value.problems == [f"{tmp_path / 'nope.toml'}: no such config file; give --config the path of "
                                 "a TOML file (or set VIME_SUPERVISOR_CONFIG)"]
    bad = write(tmp_path / "bad.toml", "[health_check]\ninterval = \n")
    with pytest.raises(ConfigReadError) as ei:
        load(str(bad))
    (p,) = ei.value.problems
    assert p.startswith(f"{bad}: not valid TOML: ") and "line 2" in p


# -- the real CLI ---------------------------------------------------------------------------


def run_cli(*argv: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "VIME_SUPERVISOR_CONFIG"}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "vime.supervisor", *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.fixture
def spawn_trap(tmp_path):
    """A stand-in `python` for engines: if anything were spawned, the marker would appear."""
    marker = tmp_path / "SPAWNED"
    trap = tmp_path / "trap-python"
    trap.write_text(f"#!/bin/sh\ntouch '{marker}'\nsleep 30\n")
    trap.chmod(0o755)
    return trap, marker


def _cli_config(tmp_path: Path, trap: Path, body: str) -> Path:
    return write(tmp_path / "cfg" / "config.toml", f"""
[supervisor]
python = "{trap}"
runtime_dir = "{tmp_path / 'run'}"
log_dir = "{tmp_path / 'log'}"
{body}
""")


def test_cli_bad_config_exits_2_with_one_line_per_problem(tmp_path, spawn_trap):
    trap, marker = spawn_trap
    m = model_dir(tmp_path)
    bad = _cli_config(tmp_path, trap, f"""
[health_check]
interval = "ten"
failure_threshold = 2.5

[[engines]]
name = "e0"
model = "{m}"
port = 8001

[[engines]]
name = "e1"
model = "{m}"
port = 8001
""")
    r = run_cli("--config", str(bad))
    assert r.returncode == 2
    assert r.stdout == ""
    assert r.stderr.splitlines() == [
        PREFIX + "health_check.interval: must be a number, got 'ten'",
        PREFIX + "health_check.failure_threshold: must be an integer, got 2.5",
        PREFIX + "engines[1] (e1).port: duplicate port 8001 (also used by e0)",
        f"vime-supervisor: 3 problem(s) in {bad}; nothing was started",
    ]
    assert not marker.exists()
    assert not (tmp_path / "run").exists() and not (tmp_path / "log").exists()


def test_cli_check_config_on_a_good_file(tmp_path, spawn_trap):
    trap, marker = spawn_trap
    m = model_dir(tmp_path)
    good = _cli_config(tmp_path, trap, f"""
[[engines]]
name = "e0"
model = "{m}"
port = 8001

[[engines]]
name = "e1"
url = "http://127.0.0.1:8002"
""")
    r = run_cli("--config", str(good), "--check-config")
    assert (r.returncode, r.stdout, r.stderr) == (0, f"{good}: ok, 2 engine(s)\n", "")
    assert not marker.exists()
    assert not (tmp_path / "run").exists() and not (tmp_path / "log").exists()
    # A flag that breaks the good file is caught by --check-config too.
    r = run_cli("--config", str(good), "--check-config", "--rollout-health-check-timeout", "-1")
    assert r.returncode == 2
    assert r.stderr.splitlines()[0] == PREFIX + "health_check.timeout: must be > 0, got -1"
    # What is accepted but costs something is a warning: printed, exit 0.
    r = run_cli("--config", str(good), "--check-config", "--rollout-health-check-interval", "60")
    assert (r.returncode, r.stdout) == (0, f"{good}: ok, 2 engine(s)\n")
    (line,) = r.stderr.splitlines()
    assert line.startswith("vime-supervisor: config warning: health_check: interval (60s) is not less than")


def test_cli_missing_config_file(tmp_path):
    missing = tmp_path / "nope.toml"
    r = run_cli("--config", str(missing))
    assert r.returncode == 2
    assert r.stderr == (f"{PREFIX}{missing}: no such config file; give --config the path of a TOML file "
                        "(or set VIME_SUPERVISOR_CONFIG)\n")
    # The default comes from $VIME_SUPERVISOR_CONFIG.
    r = run_cli(env_extra={"VIME_SUPERVISOR_CONFIG": str(missing)})
    assert r.returncode == 2
    assert r.stderr.splitlines()[0].startswith(f"{PREFIX}{missing}: no such config file;")


def test_cli_toml_syntax_error(tmp_path):
    bad = write(tmp_path / "bad.toml", '[[engines]]\nname = "e0"\nport = 80 01\n')
    r = run_cli("--config", str(bad))
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    (line,) = r.stderr.splitlines()
    assert line.startswith(f"{PREFIX}{bad}: not valid TOML: ") and "line 3" in line


def test_each_engine_has_its_own_compiler_caches_under_the_state_dir(tmp_path):
    """Engines never share a compile lock, and a restart reuses its first incarnation's caches;
    the config's env still has the last word."""
    from vime.supervisor.engine.process import CACHE_VARS, engine_env

    m, other = model_dir(tmp_path), model_dir(tmp_path / "other")
    cfg = build({"supervisor": {"state_dir": str(tmp_path / "state")},
                 "engines": [engine("e0", m, 8001), engine("e1", m, 8002), engine("e2", other, 8003,
                                                                                 env={"VLLM_CACHE_ROOT": "/x"})]})
    env0, env1, env2 = (engine_env(spec, cfg) for spec in cfg.engines)
    for var in CACHE_VARS:
        assert env0[var].startswith(str(tmp_path / "state" / "engine-cache" / "e0"))
        assert env0[var] != env1[var]
    assert env0 == engine_env(cfg.engines[0], cfg)  # the same folders for every incarnation
    assert env2["VLLM_CACHE_ROOT"] == "/x"


def test_engine_cache_dir_moves_the_caches_and_must_be_a_directory(tmp_path):
    from vime.supervisor.engine.process import engine_env

    m = model_dir(tmp_path)
    cfg = build({"supervisor": {"state_dir": str(tmp_path / "state"), "engine_cache_dir": str(tmp_path / "c")},
                 "engines": [engine("e0", m, 8001)]})
    assert engine_env(cfg.engines[0], cfg)["VLLM_CACHE_ROOT"].startswith(str(tmp_path / "c" / "e0" / ""))
    (tmp_path / "file").write_text("")
    assert problems({"supervisor": {"engine_cache_dir": str(tmp_path / "file")},
                     "engines": [engine("e0", m, 8001)]}) == [
        f"supervisor.engine_cache_dir: {tmp_path / 'file'} is not a directory"]
    (relative,) = problems({"supervisor": {"engine_cache_dir": "cache"}, "engines": [engine("e0", m, 8001)]})
    assert relative.startswith("supervisor.engine_cache_dir: 'cache' is not an absolute path")


def test_an_engine_cache_that_cannot_be_created_fails_the_start_with_its_reason(tmp_path):
    from vime.supervisor.engine.process import engine_env, make_engine_caches

    m = model_dir(tmp_path)
    cfg = build({"supervisor": {"state_dir": str(tmp_path / "state"), "engine_cache_dir": str(tmp_path / "later")},
                 "engines": [engine("e0", m, 8001)]})
    (tmp_path / "later").write_text("")  # the folder became a file after the config was checked
    spec = cfg.engines[0]
    problem = make_engine_caches(spec, cfg, engine_env(spec, cfg))
    assert problem is not None and problem.startswith(f"cannot create the engine's compiler cache {tmp_path / 'later'}")
    ok = build({"supervisor": {"state_dir": str(tmp_path / "state")}, "engines": [engine("e0", m, 8001)]})
    assert make_engine_caches(ok.engines[0], ok, engine_env(ok.engines[0], ok)) is None
    assert (tmp_path / "state" / "engine-cache" / "e0").is_dir()


def test_warmup_and_max_busy_are_checked_once_each(good):
    assert problems({**good, "health_check": {"max_busy": float("nan")},
                     "warmup": {"temperature": float("nan"), "top_p": 1.5, "requests": -1}}) == [
        "health_check.max_busy: must be a finite number, got nan",
        "warmup.temperature: must be a finite number, got nan",
        "warmup.requests: must be in 0..256, got -1",
        "warmup.top_p: must be in (0, 1], got 1.5",
    ]


@pytest.mark.parametrize("name", ["../../escaped/x", "a/b", "with space", ".hidden", "-flag", "x" * 65])
def test_engine_names_that_are_not_safe_file_names_are_refused(tmp_path, name):
    """Review: name = "../../e5-escaped/x" put the engine's log outside log_dir."""
    out = problems({"engines": [engine(name, model_dir(tmp_path), 8001)]})
    assert len(out) == 1 and out[0].endswith(f"got {name!r}") and ".name: use letters" in out[0]


# -- retention of engine logs and incident folders ------------------------------------------


def test_retention_defaults_bound_the_log_dir_and_each_key_is_checked(good, model, tmp_path, spawn_trap):
    cfg = build(good)
    assert (cfg.log_keep, cfg.log_keep_bytes) == (10, 1 << 30)
    assert (cfg.incidents_keep, cfg.incidents_keep_bytes) == (100, 256 << 20)
    cfg = build({**good, "supervisor": {"log_keep": 0, "log_keep_bytes": 5, "incidents_keep": 1,
                                        "incidents_keep_bytes": 0}})
    assert (cfg.log_keep, cfg.log_keep_bytes, cfg.incidents_keep, cfg.incidents_keep_bytes) == (0, 5, 1, 0)
    assert problems({**good, "supervisor": {"log_keep": -1, "log_keep_bytes": "1G", "incidents_keep": 2.5,
                                            "incidents_keep_bytes": -4096}}) == [
        "supervisor.log_keep_bytes: must be an integer, got '1G'",
        "supervisor.incidents_keep: must be an integer, got 2.5",
        "supervisor.log_keep: must be >= 0 (0: no limit), got -1",
        "supervisor.incidents_keep_bytes: must be >= 0 (0: no limit), got -4096",
    ]
    # The flags set them and are checked the same way, by --check-config too.
    trap, _ = spawn_trap
    f = _cli_config(tmp_path, trap, f'log_keep = 3\n\n[[engines]]\nname = "e0"\nmodel = "{model}"\n'
                                    "port = 8001\n")
    args = parse_args(["--config", str(f), "--log-keep-bytes", "4096", "--incidents-keep", "7",
                       "--incidents-keep-bytes", "0"])
    cfg = load(args.config, args)
    assert (cfg.log_keep, cfg.log_keep_bytes, cfg.incidents_keep, cfg.incidents_keep_bytes) == (3, 4096, 7, 0)
    r = run_cli("--config", str(f), "--check-config", "--log-keep", "-2")
    assert r.returncode == 2
    assert r.stderr.splitlines()[0] == PREFIX + "supervisor.log_keep: must be >= 0 (0: no limit), got -2"


def test_idle_spin_bound_must_be_seconds(model, good):
    """VIME_VLLM_IDLE_SPIN_S is read by our plugin inside the engine, where a bad value could only
    be printed to the engine's log: the daemon refuses it up front."""
    assert problems({**good, "engine_defaults": {"env": {"VIME_VLLM_IDLE_SPIN_S": "fast"}}}) == [
        "engine_defaults.env: VIME_VLLM_IDLE_SPIN_S='fast': give the seconds vLLM's queues spin before they "
        "sleep, a number from 0 to 1 (vLLM's own), or leave it unset"]
    assert problems({"engines": [engine("e0", model, 8001, env={"VIME_VLLM_IDLE_SPIN_S": "-1"})]})[0].startswith(
        "engines[0] (e0).env: VIME_VLLM_IDLE_SPIN_S='-1'")
    cfg = build({**good, "engine_defaults": {"env": {"VIME_VLLM_IDLE_SPIN_S": "0.05"}}})
    assert cfg.engine_env == {"VIME_VLLM_IDLE_SPIN_S": "0.05"}


def test_idle_spin_bound_in_the_daemons_own_environment_is_checked(good, monkeypatch):
    """Spawned engines inherit it (a unit's Environment=): refused there too."""
    monkeypatch.setenv("VIME_VLLM_IDLE_SPIN_S", "2")
    assert problems(good)[0].startswith("the daemon's environment: VIME_VLLM_IDLE_SPIN_S='2'")
