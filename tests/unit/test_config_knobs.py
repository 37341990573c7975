"""Each setting is declared once (its dataclass field's knob, supervisor/settings.py): the key
tables, the flags, the simple bounds and docs/configuration.md's table are read from the
declarations (supervisor/config.py), and the hang bound is computed in one place. No engines."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import math
from pathlib import Path

import pytest

from vime.supervisor import config as config_mod
from vime.supervisor import knobs
from vime.supervisor.config import SECTIONS, SETTINGS, ConfigError, ProbePolicy, build
from vime.supervisor.engine.fsm import EngineFSM
from vime.supervisor.settings import PROGRESS_WINDOW

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "supervisor" / name for name in ("config.py", "settings.py")]
TYPES = {"float", "int", "bool", "str", "list", "dict"}


def every_setting() -> list[knobs.Setting]:
    return [s for declared in SETTINGS.values() for s in declared]


# -- the tables -----------------------------------------------------------------------------


def test_the_key_and_flag_tables_are_the_declarations():
    assert config_mod._TOP == set(SECTIONS)
    tables = {"supervisor": config_mod._SUPERVISOR, "health_check": config_mod._HEALTH,
              "warmup": config_mod._WARMUP, "restart": config_mod._RESTART, "weights": config_mod._WEIGHTS,
              "router": config_mod._ROUTER,
              "engine_defaults": config_mod._DEFAULTS, "engines": config_mod._ENGINE}
    assert set(tables) == set(SECTIONS)
    for name, cls in SECTIONS.items():
        assert tables[name] == knobs.schema(knobs.settings(name, cls)), name
    assert config_mod._FLAG_KEYS == {s.dest: (s.section, s.key) for s in every_setting() if s.knob.flag}
    # What the daemon reads the file into, besides its own settings, carries no knob.
    assert {f.name for f in dataclasses.fields(config_mod.Config) if not f.metadata} == {
        "engines", "probe", "restart", "engine_env", "engine_args", "warmup", "weights", "api_key", "router",
        "warnings"}


@pytest.mark.parametrize("path", SOURCES, ids=[p.name for p in SOURCES])
def test_no_table_is_written_by_hand(path):
    """A key table ({"interval": float, ...}), a flag table ({"dest": ("section", "key")}) or a
    literal add_argument("--flag") is a setting declared a second time (config.py's own main,
    which writes the docs, aside)."""
    tree = ast.parse(path.read_text())
    body = [n for n in tree.body if not (isinstance(n, ast.FunctionDef) and n.name == "main")]
    for node in ast.walk(ast.Module(body=body, type_ignores=[])):
        if isinstance(node, ast.Dict) and node.values:
            typed = [v for v in node.values if isinstance(v, ast.Name) and v.id in TYPES]
            pairs = [v for v in node.values if isinstance(v, ast.Tuple) and len(v.elts) == 2
                     and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in v.elts)]
            assert len(typed) < 2 and len(pairs) < 2, f"{path.name}:{node.lineno}: a table written by hand"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            flags = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            assert not any(f.startswith("--") for f in flags), f"{path.name}:{node.lineno}: a flag written by hand"


def test_every_declaration_is_whole():
    for s in every_setting():
        k = s.knob
        assert s.toml in (float, int, bool, str, list, dict), s.where
        assert k.doc and "|" not in k.doc.replace("\\|", ""), f"{s.where}: a docs text (no bare '|')"
        if k.flag:
            assert k.flag.startswith("--") and k.help, f"{s.where}: a flag needs its help"
        else:
            assert k.help is None and k.metavar is None, f"{s.where}: help or metavar without a flag"
        if k.bound is not None:
            assert s.toml in (int, float), s.where
            if s.default is not dataclasses.MISSING:
                assert k.bound.holds(s.default), f"{s.where}: the default breaks its own bound"
        if k.choices:
            assert s.toml is str and s.default in k.choices, s.where


# -- the flags ------------------------------------------------------------------------------


def test_each_declared_flag_is_parsed_as_declared():
    ap = argparse.ArgumentParser()
    config_mod.add_flags(ap)
    actions = {a.option_strings[0]: a for a in ap._actions if a.option_strings and a.dest != "help"}
    declared = {s.knob.flag: s for s in every_setting() if s.knob.flag}
    assert set(actions) == set(declared)
    for flag, s in declared.items():
        a = actions[flag]
        assert a.dest == s.dest and a.default is None, flag  # None: only a flag given overrides the file
        assert a.help == s.knob.help.format(default=knobs.shown(s.default)), flag
        if s.toml is bool:
            assert a.option_strings == [flag, "--no-" + flag[2:]]
        else:
            assert a.metavar == s.knob.metavar
            assert a.type is (s.toml if s.toml in (int, float) and not s.knob.choices else None), flag
            assert a.choices == (s.knob.choices if s.knob.flag_choices and s.knob.choices else None), flag


def test_a_flag_reaches_the_key_it_declares(tmp_path):
    """Each flag, given, lands in the config under its table and key."""
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    raw = {"engines": [{"name": "e", "model": str(model), "port": 8100}, {"name": "f", "url": "http://10.0.0.5:1"}]}
    given = {"bool": True, "int": 1, "float": 30.0, "str": None}
    strs = {"spares_sync": "publish", "restart_load": "dummy", "fingerprint_mismatch": "resync", "log_level": "debug",
            "metrics_address": "127.0.0.1:9464",
            "runtime_dir": str(tmp_path / "run"), "log_dir": str(tmp_path / "log"),
            "state_dir": str(tmp_path / "state"), "engine_cache_dir": str(tmp_path / "cache"),
            "router_url": "http://127.0.0.1:30000", "weights_mode": "async"}
    for s in every_setting():
        if not s.knob.flag:
            continue
        value = strs[s.dest] if s.toml is str else given[s.toml.__name__]
        overrides = {"router_url": strs["router_url"]} if s.section == "router" else {}
        cfg = build(raw, {**overrides, s.dest: value})
        assert getattr(holder(cfg, s.section), s.key) == value, s.dest


def holder(cfg, section: str):
    """The object of the built config that holds `section`'s keys."""
    return {"supervisor": cfg, "health_check": cfg.probe, "warmup": cfg.warmup, "restart": cfg.restart,
            "weights": cfg.weights, "router": cfg.router}[section]


# -- the bounds -----------------------------------------------------------------------------


def outside(bound: knobs.Bound, toml: type) -> list[float]:
    step = 1 if toml is int else 0.5
    out = [bound.low if bound.open_low else bound.low - step]
    if bound.high is not None:
        out.append(bound.high + step)
    return [toml(v) for v in out]


def inside(bound: knobs.Bound, toml: type) -> list[float]:
    out = [bound.low + (1 if bound.open_low else 0)]
    if bound.high is not None:
        out.append(bound.high)
    return [toml(v) for v in out]


@pytest.fixture
def good(tmp_path) -> dict:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return {"engines": [{"name": "e", "model": str(model), "port": 8100}]}


def with_value(good: dict, s: knobs.Setting, value) -> dict:
    table = {s.key: value}
    if s.section == "router":
        table["url"] = "http://127.0.0.1:30000"
    if s.section == "health_check" and s.key == "first_wait" and value > 0:
        table["timeout"] = min(5.0, value / 2)  # timeout must stay below first_wait
    if s.section == "restart" and s.key == "backoff_max":
        table["backoff_initial"] = 0.0  # backoff_max must stay above it
    return {**good, s.section: table}


BOUNDED = [s for s in every_setting() if s.knob.bound is not None]
CHOOSING = [s for s in every_setting() if s.knob.choices]


@pytest.mark.parametrize("s", BOUNDED, ids=[s.where for s in BOUNDED])
def test_each_bound_refuses_past_its_edge_and_takes_the_edge(good, s):
    for value in outside(s.knob.bound, s.toml):
        with pytest.raises(ConfigError) as ei:
            build(with_value(good, s, value))
        assert s.knob.bound.problem(s.where, value) in ei.value.problems
    for value in inside(s.knob.bound, s.toml):
        try:
            build(with_value(good, s, value))
        except ConfigError as e:
            assert not [p for p in e.problems if p.startswith(s.where + ":")], e.problems


@pytest.mark.parametrize("s", CHOOSING, ids=[s.where for s in CHOOSING])
def test_each_choice_is_taken_and_nothing_else(good, s):
    for value in s.knob.choices:
        assert getattr(holder(build(with_value(good, s, value)), s.section), s.key) == value
    with pytest.raises(ConfigError) as ei:
        build(with_value(good, s, "other"))
    assert ei.value.problems == [f"{s.where}: must be one of {', '.join(s.knob.choices)}, got 'other'"]


def test_the_messages_are_the_ones_operators_know(good):
    """The bounds' words, as --check-config has always said them."""
    assert "health_check.first_wait: must be >= 0 (0: no startup deadline), got -1" in problems_of(
        good, "health_check", "first_wait", -1.0)
    assert problems_of(good, "health_check", "max_busy", 0.0) == [
        "health_check.max_busy: must be a number of seconds > 0, got 0"]
    assert problems_of(good, "warmup", "requests", 257) == ["warmup.requests: must be in 0..256, got 257"]
    assert problems_of(good, "warmup", "top_p", 0.0) == ["warmup.top_p: must be in (0, 1], got 0"]
    assert problems_of(good, "supervisor", "log_keep", -1) == [
        "supervisor.log_keep: must be >= 0 (0: no limit), got -1"]
    assert problems_of(good, "supervisor", "sync_timeout", 0.0) == [
        "supervisor.sync_timeout: must be > 0 seconds, got 0; a push or reload gets this long before the engine "
        "counts as poisoned"]
    assert problems_of(good, "supervisor", "log_level", "loud") == [
        "supervisor.log_level: must be one of debug, error, info, warning, got 'loud'"]


def problems_of(good: dict, section: str, key: str, value) -> list[str]:
    with pytest.raises(ConfigError) as ei:
        build({**good, section: {key: value}})
    return ei.value.problems


# -- the docs -------------------------------------------------------------------------------


def test_the_docs_table_is_the_one_the_declarations_give():
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert page.count(config_mod.DOCS_BEGIN) == 1 and page.count(config_mod.DOCS_END) == 1
    assert config_mod.docs_with_table(page) == page, (
        "docs/configuration.md's table differs from the declarations in supervisor/config.py: "
        "python -m vime.supervisor.config --write-docs")


def test_the_docs_table_is_written_between_its_markers_only(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(f"# x\n\nbefore\n\n{config_mod.DOCS_BEGIN}\nOLD-TABLE\n{config_mod.DOCS_END}\n\nafter\n")
    assert config_mod.main(["--write-docs", str(page)]) == 0
    text = page.read_text()
    assert text.startswith("# x\n\nbefore\n\n") and text.endswith(f"{config_mod.DOCS_END}\n\nafter\n")
    assert "OLD-TABLE" not in text and config_mod.docs_table() in text
    with pytest.raises(ValueError, match="no"):
        config_mod.docs_with_table("no markers")


# -- the hang bound -------------------------------------------------------------------------


@pytest.mark.parametrize("policy", [ProbePolicy(), ProbePolicy(interval=10, timeout=5, failure_threshold=1),
                                    ProbePolicy(interval=1, timeout=2, failure_threshold=2)])
def test_one_hang_bound(policy):
    """interval + failure_threshold x (timeout + the late-probe judgement), used by the FSM and
    said by the config's warning."""
    assert policy.hang_bound() == policy.interval + policy.failure_threshold * (
        policy.timeout + PROGRESS_WINDOW)
    assert policy.hang_bound(probing_now=True) == policy.hang_bound() - policy.interval
    assert EngineFSM("e", policy, config_mod.RestartPolicy(), clock=lambda: 0.0).limit_bound() == policy.hang_bound()
    warnings: list[str] = []
    config_mod._check_probe(policy, [], warnings)
    if policy.interval >= policy.timeout * policy.failure_threshold:
        (w,) = [w for w in warnings if "bounds detection" in w]
        assert f"a hang is seen within {policy.hang_bound():g}s" in w


def test_the_hang_bound_is_computed_nowhere_else():
    """A product of timeout and failure_threshold outside ProbePolicy.hang_bound is a second
    hang bound (a comparison that judges the settings is not one)."""
    found = []
    for path in sorted((ROOT / "supervisor").rglob("*.py")):
        tree = ast.parse(path.read_text())
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.BinOp) or isinstance(parents.get(node), (ast.BinOp, ast.Compare)):
                continue
            names = {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
            if {"timeout", "failure_threshold"} <= names:
                fn = node
                while fn in parents and not isinstance(fn, ast.FunctionDef):
                    fn = parents[fn]
                if getattr(fn, "name", None) != "hang_bound":
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, f"a hang bound computed outside ProbePolicy.hang_bound: {found}"
    assert math.isfinite(ProbePolicy().hang_bound())
