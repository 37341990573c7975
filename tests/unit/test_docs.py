"""The docs cannot drift from the code or break: the configuration page's table of keys, flags and
defaults is checked against the daemon's own tables (`supervisor/config.py`) and parser, the site
builds with `mkdocs build --strict` (broken links, missing anchors, pages left out of the nav),
and the README's links resolve."""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from vime.supervisor import config as config_mod
from vime.supervisor import daemon

ROOT = Path(__file__).resolve().parents[2]
CONFIG_PAGE = ROOT / "docs" / "configuration.md"
README = ROOT / "README.md"

# Each TOML table and the schema the daemon checks it against.
SCHEMAS = {
    "supervisor": config_mod._SUPERVISOR,
    "health_check": config_mod._HEALTH,
    "warmup": config_mod._WARMUP,
    "restart": config_mod._RESTART,
    "weights": config_mod._WEIGHTS,
    "engine_defaults": config_mod._DEFAULTS,
    "engines": config_mod._ENGINE,
    "router": config_mod._ROUTER,
}


def cells(line: str) -> list[str]:
    """A Markdown table row's cells; `\\|` inside a cell is a literal bar."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def code_spans(cell: str) -> list[str]:
    return re.findall(r"`([^`]*)`", cell)


def config_rows() -> list[dict[str, str]]:
    """The rows of the table under "## Every key and flag"."""
    text = CONFIG_PAGE.read_text()
    section = text.split("## Every key and flag", 1)[1].split("\n## ", 1)[0]
    lines = [ln for ln in section.splitlines() if ln.startswith("|")]
    header = cells(lines[0])
    assert header == ["key", "flag", "default", "meaning"], header
    return [dict(zip(header, cells(ln))) for ln in lines[2:]]


def row_key(row: dict[str, str]) -> tuple[str, str] | None:
    if not row["key"]:
        return None
    m = re.fullmatch(r"`\[{1,2}(\w+)\]{1,2} (\w+)`", row["key"])
    assert m, f"key cell {row['key']!r}: write it as `[table] key` or `[[engines]] key`"
    return m.group(1), m.group(2)


def row_flags(row: dict[str, str]) -> set[str]:
    """The option strings of a flag cell: the first word of each code span."""
    return {span.split()[0] for span in code_spans(row["flag"])}


@pytest.fixture
def parser(monkeypatch) -> argparse.ArgumentParser:
    """The daemon's own parser, as `vime-supervisor` builds it (caught as parse_args runs)."""
    caught: list[argparse.ArgumentParser] = []
    real = argparse.ArgumentParser.parse_args

    def catch(self, args=None, namespace=None):
        caught.append(self)
        return real(self, args, namespace)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    daemon.parse_args([])
    (ap,) = caught
    return ap


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> config_mod.Config:
    """The config of a file that sets nothing but one spawned engine."""
    model = tmp_path_factory.mktemp("model")
    (model / "config.json").write_text("{}")  # the daemon checks it is a model directory
    return config_mod.build({"engines": [{"name": "e", "model": str(model), "port": 8100}]})


def actual_default(cfg: config_mod.Config, section: str, key: str):
    """What the daemon holds for a key the file leaves out; None where there is no one value."""
    where = {"supervisor": cfg, "health_check": cfg.probe, "warmup": cfg.warmup, "restart": cfg.restart,
             "weights": cfg.weights}
    if section in where:
        return getattr(where[section], key)
    if section == "engine_defaults":
        return {"env": cfg.engine_env, "args": cfg.engine_args, "host": cfg.engines[0].host}.get(key)
    if section == "router" and key != "url":  # the table's defaults, with the one key it needs
        return getattr(config_mod.RouterConfig(url="http://127.0.0.1:30000"), key)
    return None


def test_the_table_lists_every_key_of_the_daemon():
    documented = [k for k in map(row_key, config_rows()) if k]
    assert len(documented) == len(set(documented)), "a key is listed twice"
    assert set(SCHEMAS) == config_mod._TOP
    expected = {(section, key) for section, schema in SCHEMAS.items() for key in schema}
    assert set(documented) == expected, (
        f"missing from docs/configuration.md: {sorted(expected - set(documented))}; "
        f"not keys of the daemon: {sorted(set(documented) - expected)}")


def test_each_flag_sits_on_the_row_of_the_key_it_sets(parser):
    flags_of: dict[tuple[str, str] | None, set[str]] = {}
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        key = config_mod._FLAG_KEYS.get(action.dest)
        flags_of.setdefault(key, set()).update(action.option_strings)
    documented: dict[tuple[str, str] | None, set[str]] = {}
    for row in config_rows():
        documented.setdefault(row_key(row), set()).update(row_flags(row))
    documented = {k: v for k, v in documented.items() if v}
    wrong = {k: (documented.get(k, set()), flags_of.get(k, set()))
             for k in set(documented) | set(flags_of) if documented.get(k) != flags_of.get(k)}
    assert not wrong, "key (None: no key): (flags on its row, the daemon's flags for it): " + repr(wrong)


def test_the_defaults_are_the_daemons(built):
    checked = 0
    for row in config_rows():
        key = row_key(row)
        if key is None:
            continue
        section, name = key
        actual = actual_default(built, section, name)
        spans = code_spans(row["default"])
        if actual is None:
            continue
        assert len(spans) == 1, f"{section}.{name}: give the default, {actual!r}, as one TOML value"
        value = tomllib.loads(f"v = {spans[0]}")["v"]
        assert isinstance(value, SCHEMAS[section][name]), f"{section}.{name}: {value!r}"
        if isinstance(actual, tuple):
            actual = list(actual)
        assert value == actual, f"{section}.{name}: the docs say {value!r}, the daemon {actual!r}"
        checked += 1
    assert checked >= 35  # every key of the five tables with one default value


def test_the_site_builds_in_strict_mode(tmp_path):
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.skip("mkdocs or mkdocs-material is not installed: pip install -e '.[check]'")
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(tmp_path / "site")],
        capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "site" / "configuration" / "index.html").is_file()


def readme_links() -> list[str]:
    text = re.sub(r"```.*?```", "", README.read_text(), flags=re.S)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    return re.findall(r"\]\(([^)\s]+)\)", text)


def test_the_readme_links_resolve_and_reach_every_page():
    links = readme_links()
    local = [link for link in links if "://" not in link and not link.startswith("mailto:")]
    assert local and all(not link.startswith("/") for link in local), "links must be relative"
    broken = [link for link in local if not (ROOT / link.split("#", 1)[0]).exists()]
    assert not broken, f"README links to files that do not exist: {broken}"
    pages = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
    unlinked = pages - {link.split("#", 1)[0] for link in local}
    assert not unlinked, f"README links to no {sorted(unlinked)}"


def test_the_readme_stays_an_introduction():
    text = README.read_text()
    for heading in ("## Two commands", "## Goodput under faults"):
        assert heading in text, f"README lost its {heading!r} section"
    size = len(text.encode())
    assert size <= 8192, f"README is {size} bytes: keep it an introduction; put the manual in docs/"
