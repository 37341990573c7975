"""A config setting declared once: the dataclass field carries its TOML key, flag, bounds, help
and docs text (`knob(...)`), and the TOML type tables, the flags, the simple bounds checks and
the docs' table are read from the fields (as vLLM derives its flags from its config classes).

Generic: what the daemon's settings are is in config.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable

_META = "vime.knob"


@dataclass(frozen=True)
class Bound:
    """A number's range: `low` (refused too with `open_low`) up to `high`. Said as
    "{where}: must be {prefix}{rule}{note}, got {value}{why}"; a float is judged only when
    finite (non-finite values are refused before, once)."""

    low: float
    high: float | None = None
    open_low: bool = False
    prefix: str = ""  # "a number of seconds "
    note: str = ""  # " (0: no limit)"
    why: str = ""  # "; a push or reload gets this long ..."

    def rule(self) -> str:
        if self.high is None:
            return f"{'>' if self.open_low else '>='} {self.low:g}"
        if self.open_low:
            return f"in ({self.low:g}, {self.high:g}]"
        return f"in {self.low:g}..{self.high:g}"

    def holds(self, value: float) -> bool:
        above = value > self.low if self.open_low else value >= self.low
        return above and (self.high is None or value <= self.high)

    def problem(self, where: str, value: float) -> str:
        return f"{where}: must be {self.prefix}{self.rule()}{self.note}, got {shown(value)}{self.why}"


def gt(low: float, *, prefix: str = "", note: str = "", why: str = "") -> Bound:
    """Above `low`."""
    return Bound(low, open_low=True, prefix=prefix, note=note, why=why)


def ge(low: float, *, prefix: str = "", note: str = "", why: str = "") -> Bound:
    """At least `low`."""
    return Bound(low, prefix=prefix, note=note, why=why)


@dataclass(frozen=True)
class Knob:
    """What a config field is besides its name, type and default."""

    doc: str  # the docs table's meaning (Markdown)
    flag: str | None = None  # its long option; None: set in the file only
    help: str | None = None  # the option's help; "{default}" is the field's default
    metavar: str | None = None
    bound: Bound | None = None
    choices: tuple[str, ...] = ()  # the values it takes, said in this order when another is given
    flag_choices: bool = True  # False: argparse takes any string; the config check refuses it
    doc_default: str | None = None  # the docs' default cell when it is no TOML value


def knob(default: Any = dataclasses.MISSING, *, doc: str, factory: Callable[[], Any] | None = None,
         flag: str | None = None, help: str | None = None, metavar: str | None = None,
         bound: Bound | None = None, choices: tuple[str, ...] = (), flag_choices: bool = True,
         doc_default: str | None = None) -> Any:
    """A dataclass field declared as a config setting: its TOML key is the field's name, its
    type the field's (a tuple is a TOML list), its default `default` (or `factory()`)."""
    meta = {_META: Knob(doc, flag, help, metavar, bound, choices, flag_choices, doc_default)}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclass(frozen=True)
class Setting:
    """One declared field, resolved: its TOML key and type, its default, its Knob."""

    section: str
    key: str
    toml: type  # float, int, bool, str, list or dict
    default: Any  # dataclasses.MISSING: none
    knob: Knob

    @property
    def where(self) -> str:
        return f"{self.section}.{self.key}"

    @property
    def dest(self) -> str | None:
        """The argparse dest of its flag."""
        return self.knob.flag[2:].replace("-", "_") if self.knob.flag else None


def _toml_type(hint: Any) -> type:
    """The TOML type of a field's annotation: `str | None` is a string, a tuple a list."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
    origin = typing.get_origin(hint) or hint
    return {tuple: list}.get(origin, origin)


def settings(section: str, cls: type) -> list[Setting]:
    """The declared settings of dataclass `cls` (its knob fields), in field order."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        k = f.metadata.get(_META)
        if k is None:
            continue
        default = (f.default if f.default is not dataclasses.MISSING else
                   f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING)
        out.append(Setting(section, f.name, _toml_type(hints[f.name]), default, k))
    return out


def schema(declared: list[Setting]) -> dict[str, type]:
    """{key: TOML type}: what a table may hold."""
    return {s.key: s.toml for s in declared}


def shown(value: Any) -> str:
    """A value as help and messages show it: 300.0 as 300."""
    if isinstance(value, float):  # exact in a message: 600.0001 is not "600"
        return f"{value:g}" if float(f"{value:g}") == value else repr(value)
    return str(value)


# -- checks ---------------------------------------------------------------------------------


def check(declared: list[Setting], values: dict[str, Any], problems: list[str]) -> set[str]:
    """The simple rules of the keys given in `values` (bounds, choices), in declaration order;
    the keys that broke one (a rule across fields judges only the others)."""
    bad = set()
    for s in declared:
        if s.key not in values:
            continue
        value, k = values[s.key], s.knob
        if k.bound is not None and not (isinstance(value, float) and not math.isfinite(value)):
            if not k.bound.holds(value):
                problems.append(k.bound.problem(s.where, value))
                bad.add(s.key)
        if k.choices and value not in k.choices:
            problems.append(f"{s.where}: must be one of {', '.join(k.choices)}, got {value!r}")
            bad.add(s.key)
    return bad


# -- flags ----------------------------------------------------------------------------------


def add_flag(group: argparse._ArgumentGroup, s: Setting) -> None:
    """The option of a setting that has one: its default stays None, so that only a flag
    given overrides the file."""
    k = s.knob
    assert k.flag is not None
    kw: dict[str, Any] = {"help": k.help.format(default=shown(s.default)) if k.help else None}
    if s.toml is bool:
        kw.update(action=argparse.BooleanOptionalAction, default=None)
    elif k.choices and k.flag_choices:
        kw["choices"] = k.choices
    elif s.toml in (int, float):
        kw["type"] = s.toml
    if k.metavar:
        kw["metavar"] = k.metavar
    group.add_argument(k.flag, **kw)


# -- the docs' table ------------------------------------------------------------------------


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"no TOML value for {value!r}")


def flag_cell(s: Setting) -> str:
    """The flag as `--help` names it, its choices joined by a bar (escaped for the table)."""
    k = s.knob
    if not k.flag:
        return ""
    if s.toml is bool:
        return f"`{k.flag}`, `--no-{k.flag[2:]}`"
    if k.choices and k.flag_choices and not k.metavar:
        bar = "\\|"  # a bar inside a table cell
        return f"`{k.flag} {bar.join(k.choices)}`"
    return f"`{k.flag} {k.metavar or (s.dest or '').upper()}`"


def table_row(s: Setting, key_cell: str) -> str:
    k = s.knob
    if k.doc_default is not None:
        default = k.doc_default
    elif s.default is dataclasses.MISSING or s.default is None:
        default = ""
    else:
        default = f"`{toml_value(s.default)}`"
    return f"| `{key_cell}` | {flag_cell(s)} | {default} | {k.doc} |"
