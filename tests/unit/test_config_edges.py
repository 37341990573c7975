"""Config edges: a file that cannot be read as TOML, numbers that are not finite or not 64-bit,
engine names, and what is a warning rather than an error. No engines."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vime.supervisor import config as config_mod
from vime.supervisor.config import ConfigError, ConfigReadError, build, load, load_file


def model_dir(root: Path) -> Path:
    d = root / "tiny"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text("{}")
    return d


@pytest.fixture
def good(tmp_path) -> dict:
    return {"engines": [{"name": "e0", "model": str(model_dir(tmp_path)), "port": 8001}]}


def problems(raw: dict, overrides: dict | None = None) -> list[str]:
    with pytest.raises(ConfigError) as ei:
        build(raw, overrides)
    return ei.value.problems


def read_error(path) -> str:
    with pytest.raises(ConfigReadError) as ei:
        load_file(path)
    (line,) = ei.value.problems
    return line


# -- reading the file -----------------------------------------------------------------------


def test_a_directory_is_not_a_config_file(tmp_path):
    assert read_error(tmp_path) == f"{tmp_path}: is a directory, not a config file; give the path of the TOML file"


def test_a_missing_file(tmp_path):
    assert read_error(tmp_path / "nope.toml").startswith(f"{tmp_path / 'nope.toml'}: no such config file;")
    assert read_error("").startswith("'': no such config file;")
    afile = tmp_path / "afile"
    afile.write_text("")
    assert read_error(afile / "x.toml") == f"{afile / 'x.toml'}: cannot be opened (Not a directory)"


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "config.toml"
    os.mkfifo(fifo)
    assert read_error(fifo) == (f"{fifo}: is not a regular file (a FIFO, socket or device); "
                                "give the path of a TOML file")


def test_a_file_that_is_not_utf8_says_where(tmp_path):
    f = tmp_path / "latin1.toml"
    f.write_bytes('[supervisor]\nlog_level = "info"\n# caf\u00e9\n'.encode("latin-1"))
    assert read_error(f) == (f"{f}: not UTF-8 text (byte 0xe9 on line 3); TOML files are UTF-8: "
                             "convert it (iconv -t UTF-8)")


def test_invalid_toml_says_where(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text("[health_check]\ninterval = 5\ninterval = 6\n")
    line = read_error(f)
    assert line.startswith(f"{f}: not valid TOML: ") and "line 3" in line


def test_toml_nested_too_deep_is_an_error_not_a_crash(tmp_path):
    f = tmp_path / "deep.toml"
    f.write_text("x = " + "[" * 100_000 + "]" * 100_000 + "\n")
    assert read_error(f) == f"{f}: not valid TOML: nested too deeply"


def test_a_file_too_large_to_be_a_config(tmp_path, monkeypatch):
    monkeypatch.setattr(config_mod, "MAX_CONFIG_BYTES", 1 << 20)
    f = tmp_path / "big.toml"
    f.write_text("# x\n" * (1 << 19))  # 2 MiB
    assert read_error(f) == f"{f}: is over 1 MiB: not a config file"


def test_problems_are_one_line_each_whatever_the_file_holds(good):
    (line,) = problems({**good, "supervisor": {"log\ndir": "x"}})
    assert "\n" not in line and line.startswith("supervisor.log\\ndir: unknown key")


# -- numbers --------------------------------------------------------------------------------


FLOAT_KEYS = [(section, key) for section, schema in (
    ("supervisor", config_mod._SUPERVISOR), ("health_check", config_mod._HEALTH),
    ("restart", config_mod._RESTART), ("warmup", config_mod._WARMUP)) for key, t in schema.items() if t is float]


def test_every_float_setting_is_covered():
    """Every float the daemon runs on comes from a key tested below (max_paused is sync_timeout)."""
    import dataclasses

    from vime.supervisor.config import Config
    from vime.supervisor.config import ProbePolicy, RestartPolicy, WarmupPolicy

    floats = {(section, f.name) for section, cls in (
        ("supervisor", Config), ("health_check", ProbePolicy), ("restart", RestartPolicy), ("warmup", WarmupPolicy))
        for f in dataclasses.fields(cls) if f.type in (float, "float")}
    assert floats - {("health_check", "max_paused")} == set(FLOAT_KEYS)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("section, key", FLOAT_KEYS, ids=[f"{s}.{k}" for s, k in FLOAT_KEYS])
def test_nan_and_infinities_are_refused_once_with_the_key_named(good, section, key, value):
    assert problems({**good, section: {key: value}}) == [f"{section}.{key}: must be a finite number, got {value}"]


def test_integers_beyond_64_bits_are_refused(good):
    """float() of a longer one raised (interval = 1e400 written as an integer), and so did
    timeout x failure_threshold."""
    assert problems({**good, "health_check": {"failure_threshold": 10**30, "interval": 10**400}}) == [
        f"health_check.failure_threshold: {10**30} is out of range (TOML integers are 64-bit)",
        f"health_check.interval: {10**400} is out of range (TOML integers are 64-bit)",
    ]


# -- engine names ---------------------------------------------------------------------------


@pytest.mark.parametrize("name, why", [
    ("a/b", "'/' is not allowed"),
    ("with space", "' ' is not allowed"),
    ("group:name", "':' is not allowed"),
    ("caf\u00e9", "'\u00e9' is not allowed"),
    ("new\nline", "'\\n' is not allowed"),
    (".hidden", "it starts with '.'"),
    ("-flag", "it starts with '-'"),
    ("x" * 65, "it is 65 characters long"),
])
def test_engine_names_follow_program_name_rules(tmp_path, name, why):
    """Names become log file names, Prometheus label values and supervisorctl arguments:
    supervisord refuses ' ', ':' and '/' in a program name; we keep to a narrower set."""
    (line,) = problems({"engines": [{"name": name, "model": str(model_dir(tmp_path)), "port": 8001}]})
    assert line == (f"engines[0] ({name!r}).name: use letters, digits, '.', '_' and '-' (64 at most, not "
                    f"starting with '.' or '-'); {why}, got {name!r}").replace("\n", "\\n")


def test_good_engine_names(tmp_path):
    m = str(model_dir(tmp_path))
    cfg = build({"engines": [{"name": n, "model": m, "port": 8001 + i}
                             for i, n in enumerate(["engine-0", "rollout_a.1", "x" * 64, "0"])]})
    assert [e.name for e in cfg.engines] == ["engine-0", "rollout_a.1", "x" * 64, "0"]


# -- warnings, not errors -------------------------------------------------------------------


def test_first_wait_zero_means_no_startup_deadline(good):
    cfg = build({**good, "health_check": {"first_wait": 0}})
    assert cfg.probe.first_wait == 0.0
    (w,) = cfg.warnings
    assert w.startswith("health_check.first_wait = 0: no startup deadline")


def test_warnings_do_not_hide_errors(good):
    assert problems({**good, "health_check": {"first_wait": 0, "interval": 30, "failure_threshold": 0}}) == [
        "health_check.failure_threshold: must be >= 1, got 0"]


def test_flags_can_give_slimes_settings(tmp_path):
    m = model_dir(tmp_path)
    f = tmp_path / "config.toml"
    f.write_text(f'[[engines]]\nname = "e0"\nmodel = "{m}"\nport = 8001\n')
    from vime.supervisor.daemon import parse_args

    args = parse_args(["--config", str(f), "--rollout-health-check-first-wait", "0",
                       "--rollout-health-check-failure-threshold", "1"])
    cfg = load(str(f), args)
    assert (cfg.probe.first_wait, cfg.probe.failure_threshold, cfg.probe.interval, cfg.probe.timeout) == (
        0.0, 1, 10.0, 5.0)
    assert len(cfg.warnings) == 2
