"""Configuration: a TOML file, then command-line flags over it, validated before anything starts
(docs/configuration.md; every key in systemd/vime-supervisor.example.toml).

What can be set is declared once, in settings.py; the key tables, the flags, the simple bounds
and the docs' table (`python -m vime.supervisor.config --write-docs`) are read from there. The
rules across keys, and those that look outside the file, are written out here. Every problem is
collected into one report (`ConfigError.problems`), so a bad file is fixed in one pass.
"""

from __future__ import annotations

import argparse
import errno
import grp
import ipaddress
import math
import os
import re
import shutil
import socket
import stat
import sys
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from vime.weight_sync.idle_spin import SPIN_ENV, spin_seconds  # read by our plugin in each engine

from . import knobs
# The settings are the config's names too: the engine modules and the tests import them from here.
from .settings import (MAX_REQUESTS, RESTART_LOAD, ROUTER_ARGS, SECTIONS, SETTINGS, SPARES_SYNC,
                       Config, EngineDefaults, EngineSpec, ProbePolicy, RestartPolicy, RouterConfig, WarmupPolicy,
                       WeightsPolicy)
from .states import WeightsMode

# sockaddr_un.sun_path is 108 bytes, the terminating NUL included.
MAX_SOCKET_PATH = 107


class ConfigError(Exception):
    def __init__(self, problems: list[str]):
        # One line each, whatever the file held (a quoted key or a name may carry a newline).
        problems = [_one_line(p) for p in problems]
        super().__init__("\n".join(problems))
        self.problems = problems


class ConfigReadError(ConfigError):
    """The file could not be read as TOML at all: one problem, nothing else was checked."""


def _one_line(text: str) -> str:
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


# Flags a spawned router's args may not carry: the daemon sets them, or they would put a secret
# on a command line any local user reads (/proc/PID/cmdline).
_ROUTER_OWN_FLAGS = ("--host", "--port", "--worker-urls")
# Table -> {key: TOML type}. Everything else in the file is an error.
_SCHEMAS = {name: knobs.schema(declared) for name, declared in SETTINGS.items()}
_TOP = set(_SCHEMAS)
_SUPERVISOR, _HEALTH, _WARMUP, _RESTART, _WEIGHTS = (_SCHEMAS[n] for n in ("supervisor", "health_check", "warmup",
                                                                          "restart", "weights"))
_ROUTER, _DEFAULTS, _ENGINE = (_SCHEMAS[n] for n in ("router", "engine_defaults", "engines"))
# flag dest -> (section, key). slime's names where they exist.
_FLAG_KEYS = {s.dest: (s.section, s.key) for declared in SETTINGS.values() for s in declared if s.dest}
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")


def _typename(t: type) -> str:
    return {float: "a number", int: "an integer", bool: "true or false", str: "a string", list: "a list", dict: "a table"}[t]


def _check_table(where: str, table: Any, schema: dict[str, type], problems: list[str]) -> dict[str, Any]:
    """Keep the well-typed keys of `table`; report unknown keys and wrong types."""
    if not isinstance(table, dict):
        problems.append(f"{where}: must be a table")
        return {}
    ok: dict[str, Any] = {}
    for key, value in table.items():
        if key not in schema:
            problems.append(f"{where}.{key}: unknown key (known: {', '.join(sorted(schema))})")
            continue
        want = schema[key]
        good = (
            isinstance(value, (int, float)) and not isinstance(value, bool)
            if want is float
            else isinstance(value, int) and not isinstance(value, bool)
            if want is int
            else isinstance(value, want)
        )
        if not good:
            problems.append(f"{where}.{key}: must be {_typename(want)}, got {value!r}")
            continue
        if want in (int, float) and isinstance(value, int) and not -2**63 <= value < 2**63:
            # TOML's integers are 64-bit; Python's are not, and float() of a longer one raises.
            problems.append(f"{where}.{key}: {value} is out of range (TOML integers are 64-bit)")
            continue
        ok[key] = float(value) if want is float else value
    return ok


def _strs(where: str, value: Any, problems: list[str]) -> tuple[str, ...]:
    if not all(isinstance(v, str) for v in value):
        problems.append(f"{where}: must be a list of strings")
        return ()
    return tuple(value)


def names_flag(arg: str, flag: str) -> bool:
    """`arg` sets the long option `flag`: itself, `flag=value`, or any prefix argparse would
    take for it (`--hos` for `--host`, `--api=k` for `--api-key`)."""
    name = arg.split("=", 1)[0]
    return len(name) > 2 and name.startswith("--") and flag.startswith(name)


def _forbidden_flags(where: str, args: tuple[str, ...], problems: list[str]) -> None:
    for flag in ("--port", "--host", "--model"):
        if any(names_flag(a, flag) for a in args):
            problems.append(f"{where}: do not pass {flag}; set the engine's own key instead")
    if any(names_flag(a, "--api-key") for a in args):
        problems.append(f"{where}: do not pass --api-key: any local user can read a command line "
                        "(/proc/PID/cmdline); put the key in a file and set engine_defaults.api_key_file")


def _env(where: str, value: Any, problems: list[str]) -> dict[str, str]:
    if not all(isinstance(v, str) for v in value.values()):
        problems.append(f"{where}: every value must be a string")
        return {}
    try:
        spin_seconds(value.get(SPIN_ENV, ""))
    except ValueError as e:
        problems.append(f"{where}: {e}")
    return dict(value)


def _read_fd(fd: int, limit: int) -> bytes:
    """Up to `limit` bytes of a regular file."""
    chunks, size = [], 0
    while size < limit:
        chunk = os.read(fd, min(1 << 20, limit - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


# A config of a thousand engines is a few hundred KB; anything this large is not a config.
MAX_CONFIG_BYTES = 16 << 20


def load_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The parsed TOML, or ConfigReadError with one line that says what is wrong with the file."""
    shown = os.fspath(path) or "''"

    def fail(what: str) -> ConfigReadError:
        return ConfigReadError([f"{shown}: {what}"])

    try:
        # O_NONBLOCK: opening a FIFO with no writer must not hang --check-config.
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise fail("no such config file; give --config the path of a TOML file "
                   "(or set VIME_SUPERVISOR_CONFIG)") from None
    except PermissionError as e:
        raise fail(f"cannot be read ({e.strerror}); the daemon's user needs read access to it") from None
    except OSError as e:
        raise fail(f"cannot be opened ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise fail("is a directory, not a config file; give the path of the TOML file")
        if not stat.S_ISREG(st.st_mode):
            raise fail("is not a regular file (a FIFO, socket or device); give the path of a TOML file")
        try:
            raw = _read_fd(fd, MAX_CONFIG_BYTES + 1)
        except OSError as e:
            raise fail(f"cannot be read ({e.strerror})") from None
    finally:
        os.close(fd)
    if len(raw) > MAX_CONFIG_BYTES:
        raise fail(f"is over {MAX_CONFIG_BYTES >> 20} MiB: not a config file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise fail(f"not UTF-8 text (byte 0x{raw[e.start]:02x} on line {line}); "
                   "TOML files are UTF-8: convert it (iconv -t UTF-8)") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise fail(f"not valid TOML: {e}") from None
    except RecursionError:  # arrays or tables nested thousands deep
        raise fail("not valid TOML: nested too deeply") from None


def build(raw: dict[str, Any], overrides: dict[str, Any] | None = None, *, base_dir: str | None = None) -> Config:
    """Validate a parsed TOML document (plus flag overrides); raise ConfigError with every problem."""
    problems: list[str] = []
    warnings: list[str] = []
    tables, router_given = _read_tables(raw, overrides or {}, problems)
    sup = tables["supervisor"]
    probe, warmup, rpolicy = _policies(tables, problems, warnings)
    sup_bad = _check_supervisor(sup, problems, warnings)
    uids = _allowed_uids(sup.pop("allowed_uids", []), problems)
    engine_env, engine_args, api_key, engines = _engine_tables(raw, tables["engine_defaults"], base_dir, problems,
                                                               warnings)
    _check_counts(sup, sup_bad, engines, problems)
    router = _router(tables["router"], base_dir, problems, warnings) if router_given else None
    weights = _weights(tables["weights"], problems, warnings)
    _spares_sync_default(sup, weights, warnings)
    if problems:
        raise ConfigError(problems)
    return Config(
        engines=tuple(engines),
        probe=probe,
        restart=rpolicy,
        allowed_uids=uids,
        engine_env=engine_env,
        engine_args=engine_args,
        warmup=warmup,
        api_key=api_key,
        warnings=tuple(_one_line(w) for w in warnings),
        router=router,
        weights=weights,
        **sup,
    )


def _read_tables(raw: dict[str, Any], overrides: dict[str, Any],
                 problems: list[str]) -> tuple[dict[str, dict[str, Any]], bool]:
    """Each table's well-typed keys, the flags over them, every float finite; and whether there
    is a [router] (a table in the file, or --router-* flags)."""
    for key in raw:
        if key not in _TOP:
            problems.append(f"{key}: unknown key (known: {', '.join(sorted(_TOP))})")
    tables = {name: _check_table(name, raw.get(name, {}), _SCHEMAS[name], problems)
              for name in ("supervisor", "health_check", "restart", "engine_defaults", "warmup", "weights", "router")}
    router_given = "router" in raw
    for section, key, value in _apply_overrides(overrides):
        tables[section][key] = value
        router_given |= section == "router"
    # NaN passes every `<= 0` test and inf never fires: refused first, and each rule below
    # judges only finite values, so a non-finite one is reported once.
    _check_finite({name: tables[name] for name in ("supervisor", "health_check", "restart", "warmup", "router")},
                  problems)
    return tables, router_given


def _policies(tables: dict[str, dict[str, Any]], problems: list[str],
              warnings: list[str]) -> tuple[ProbePolicy, WarmupPolicy, RestartPolicy]:
    """[warmup], [health_check] and [restart]: each key's bounds, then the rules across keys."""
    knobs.check(SETTINGS["warmup"], tables["warmup"], problems)
    knobs.check(SETTINGS["health_check"], tables["health_check"], problems)
    # A paused engine is excused for as long as a weight push may take.
    probe = ProbePolicy(**tables["health_check"],
                        max_paused=tables["supervisor"].get("sync_timeout", Config.sync_timeout))
    _check_probe(probe, problems, warnings)
    knobs.check(SETTINGS["restart"], tables["restart"], problems)
    rpolicy = RestartPolicy(**tables["restart"])
    if _finite(rpolicy.backoff_max, rpolicy.backoff_initial) and rpolicy.backoff_max < rpolicy.backoff_initial:
        problems.append("restart.backoff_max: must be >= backoff_initial")
    return probe, WarmupPolicy(**tables["warmup"]), rpolicy


def _weights(table: dict[str, Any], problems: list[str], warnings: list[str]) -> WeightsPolicy:
    """[weights]: its keys' bounds; a bound given for sync mode, which never reads it, is warned."""
    if "max_staleness" in table and table.get("mode", WeightsPolicy.mode) == "sync":
        warnings.append("weights.max_staleness is read only in async mode (weights.mode = \"async\"); in sync mode "
                        "only the current version serves")
    bad = knobs.check(SETTINGS["weights"], table, problems)
    return WeightsPolicy(**{k: v for k, v in table.items() if k not in bad})


def _spares_sync_default(sup: dict[str, Any], weights: WeightsPolicy, warnings: list[str]) -> None:
    """spares_sync not given: "publish" in async mode, where a promotion must not wait for a
    sync (docs/concepts.md#warm-spares); "promotion" in sync mode. Given as "promotion" in
    async mode with spares: warned (a promoted spare outside the bound serves only once synced)."""
    if weights.mode != WeightsMode.ASYNC.value:
        return
    if "spares_sync" not in sup:
        sup["spares_sync"] = "publish"
    elif sup["spares_sync"] == "promotion" and sup.get("spares"):
        warnings.append("spares_sync = \"promotion\" in async mode: a spare more than max_staleness versions behind "
                        "is synced when it is promoted, so a failed engine's place is filled only after a sync; "
                        "leave spares_sync unset (async mode's default, \"publish\") to keep spares within the bound")


def _check_supervisor(sup: dict[str, Any], problems: list[str], warnings: list[str]) -> set[str]:
    """[supervisor]'s directories, metrics address and each key's bounds; the keys out of bounds."""
    _check_startup(sup, problems)
    _check_metrics_address(sup, problems, warnings)
    return knobs.check(SETTINGS["supervisor"], sup, problems)


def _allowed_uids(uids: Any, problems: list[str]) -> tuple[int, ...]:
    if not all(isinstance(u, int) and not isinstance(u, bool) and u >= 0 for u in uids):
        problems.append("supervisor.allowed_uids: must be a list of non-negative integers")
        return ()
    return tuple(uids)


def _engine_tables(raw: dict[str, Any], defaults: dict[str, Any], base_dir: str | None, problems: list[str],
                   warnings: list[str]) -> tuple[dict[str, str], tuple[str, ...], str | None, list[EngineSpec]]:
    """[engine_defaults] and [[engines]]: the engines' environment, arguments, API key and specs."""
    # Spawned engines inherit the daemon's own environment (a unit's Environment=) under theirs.
    _env("the daemon's environment", {k: v for k, v in os.environ.items() if k == SPIN_ENV}, problems)
    engine_env = _env("engine_defaults.env", defaults.get("env", {}), problems)
    engine_args = _strs("engine_defaults.args", defaults.get("args", []), problems)
    _forbidden_flags("engine_defaults.args", engine_args, problems)
    hosts = _Hosts(defaults.get("allow_wildcard_bind", EngineDefaults.allow_wildcard_bind))
    default_host = defaults.get("host", EngineDefaults.host)
    hosts.check("engine_defaults.host", default_host, problems)
    api_key = None
    if "api_key_file" in defaults:
        api_key = _read_api_key(defaults["api_key_file"], base_dir, problems, warnings)
    engines = _engines(raw.get("engines", []), problems, base_dir, default_host, hosts)
    if "api_key_file" in defaults:
        for where, env in [("engine_defaults.env", engine_env)] + [
                (f"engines[{i}] ({e.name}).env", e.env) for i, e in enumerate(engines)]:
            if "VLLM_API_KEY" in env:
                problems.append(f"{where}: VLLM_API_KEY and engine_defaults.api_key_file both give the "
                                "engines' key; keep one (the file: it stays out of the config)")
    return engine_env, engine_args, api_key, engines


def _check_counts(sup: dict[str, Any], bad: set[str], engines: list[EngineSpec], problems: list[str]) -> None:
    """min_healthy and spares against the engines configured (each already >= 0 unless in `bad`)."""
    min_healthy = sup.get("min_healthy", Config.min_healthy)
    if "min_healthy" not in bad and engines and min_healthy > len(engines):
        problems.append(f"supervisor.min_healthy: {min_healthy} is more than the {len(engines)} configured engines")
    spares = sup.get("spares", Config.spares)
    if "spares" in bad or not spares:
        return
    if spares >= len(engines):
        problems.append(f"supervisor.spares: {spares} spare(s) leave none of the {len(engines)} configured "
                        "engines to serve; configure more engines than spares")
    elif engines and min_healthy > len(engines) - spares:
        problems.append(f"supervisor.min_healthy: {min_healthy} is more than the {len(engines) - spares} engines "
                        f"that serve ({len(engines)} configured, {spares} spare(s))")


def _router(rtr: dict[str, Any], base_dir: str | None, problems: list[str],
            warnings: list[str]) -> RouterConfig | None:
    """[router]: a URL the daemon can reach the router's admin API at, bounds > 0, the token
    file (if any) the daemon's user's alone."""
    from .router import KINDS

    n = len(problems)
    if not rtr.get("url"):
        problems.append("router.url: missing; the router's admin URL, e.g. url = \"http://127.0.0.1:30000\" "
                        "(or --router-url)")
    else:
        _check_url("router", rtr["url"], problems)
        u = urlparse(rtr["url"]) if isinstance(rtr["url"], str) else None
        if u is not None and (u.path.strip("/") or u.query or u.fragment or u.params):
            # The admin routes are appended to it: /workers must be the router's own.
            problems.append(f"router.url: must be the router's root, http://HOST:PORT, with no path, query or "
                            f"fragment; got {rtr['url']!r}")
        if u is not None and (u.username or u.password):
            # The URL is logged and shown in status: a password in it would be too.
            problems.append("router.url: no user or password in the URL (it is logged and shown by status); "
                            "put the router's admin token in router.token_file")
    if rtr.get("observe_only") and rtr.get("prune_unknown"):
        warnings.append("router.prune_unknown has no effect with router.observe_only = true: nothing is removed")
    watch, period = rtr.get("watch", 1.0), rtr.get("period", 2.0)
    if _finite(watch) and _finite(period) and watch > period > 0:
        warnings.append(f"router.watch = {watch!r}s is longer than router.period = {period!r}s: every reconcile "
                        "reads the router's list anyway, so the watch never runs between two; set watch below "
                        "period (default 1 s)")
    drain, remove = rtr.get("drain_timeout", 30.0), rtr.get("remove_timeout", 1.0)
    if _finite(drain) and _finite(remove) and drain > 0 and remove > 0:
        # The removal's three attempts (a router down or hung costs each its whole bound, plus
        # up to 2 s of backoff between them), then the pause.
        worst = 3 * remove + 4.0 + drain
        if worst > 55:
            warnings.append(f"router.drain_timeout = {drain:g}s with remove_timeout = {remove:g}s: a planned stop "
                            f"may wait up to {worst:g}s before SIGTERM (3 removal attempts against a router that "
                            "hangs, then the drain); keep it below the unit's TimeoutStopSec (60 s in "
                            "systemd/vime-supervisor.service) and the client's call timeout (60 s)")
    if rtr.get("kind", "vllm-router") not in KINDS:
        problems.append(f"router.kind: must be one of {', '.join(KINDS)}, got {rtr['kind']!r}")
    if not re.fullmatch(r"[a-z_]{1,32}", rtr.get("worker_type", "regular")):
        problems.append(f"router.worker_type: must be a word such as regular, got {rtr['worker_type']!r}")
    knobs.check(SETTINGS["router"], rtr, problems)
    if "args" in rtr:
        rtr["args"] = _strs("router.args", rtr["args"], problems)
    if rtr.get("spawn"):
        if rtr.get("kind") == "smg":  # SMG's binary and flags, unless given
            from .router.smg import SPAWN_ARGS
            rtr.setdefault("binary", "smg")
            rtr.setdefault("args", SPAWN_ARGS)
        _check_spawned_router(rtr, problems, warnings)
    elif any(k in rtr for k in ("args", "binary", "silent_timeout")):
        warnings.append("router.args, router.binary and router.silent_timeout have no effect without router.spawn = true: "
                        "the daemon drives a router someone else runs")
    token = None
    if rtr.get("token_file"):
        path = rtr["token_file"]
        if base_dir and not os.path.isabs(path):
            path = rtr["token_file"] = os.path.join(base_dir, path)
        token = _read_secret("router.token_file", path, problems, owner_only=True, what="the router's admin token")
    if len(problems) > n:
        return None
    return RouterConfig(token=token, **rtr)


def find_binary(name: str) -> str | None:
    """The executable `name` names, as the daemon runs it: a path (with a slash) as given;
    otherwise the one on PATH, else the one beside the daemon's interpreter (a venv's bin,
    which a unit's PATH lacks). None if there is none."""
    def executable(path: str) -> bool:
        return os.path.isfile(path) and os.access(path, os.X_OK)

    if "/" in name:
        return name if executable(name) else None
    found = shutil.which(name)
    if found:
        return found
    beside = os.path.join(os.path.dirname(sys.executable), name)
    return beside if executable(beside) else None


def _check_spawned_router(rtr: dict[str, Any], problems: list[str], warnings: list[str]) -> None:
    """spawn = true: a binary to run, args that leave the daemon's flags alone, and a url the
    router can listen on here (plain HTTP, a port, an address of this machine, not every one)."""
    secrets = ("--api-key", "--control-plane-api-keys")  # the latter SMG's admin keys
    for flag in (*_ROUTER_OWN_FLAGS, *secrets):
        if any(names_flag(a, flag) for a in rtr.get("args", ())):
            problems.append(
                f"router.args: do not pass {flag}: any local user can read a command line (/proc/PID/cmdline); "
                "vllm-router forwards each client's own Authorization header to the engines, and an SMG with admin "
                "keys is one you run yourself (spawn = false; docs/router.md)"
                if flag in secrets else
                f"router.args: do not pass {flag}; the daemon sets it"
                + (" from router.url" if flag != "--worker-urls" else " empty and adds the routable engines"))
    binary = rtr.get("binary", RouterConfig.binary)
    if not binary or not binary.isprintable():
        problems.append(f"router.binary: must name the router's executable, got {binary!r}")
    elif find_binary(binary) is None:
        problems.append(
            f"router.binary: {binary} is not an executable file" if "/" in binary else
            f"router.binary: {binary} is not on PATH nor beside {sys.executable}; "
            "pip install 'vime-supervisor[router]', or give the binary's absolute path")
    url = rtr.get("url")
    if not isinstance(url, str) or not url:
        return
    try:
        u = urlparse(url)
        host, port = u.hostname, u.port
    except ValueError:
        return  # _check_url said so
    if u.scheme != "http":
        problems.append(f"router.url: a spawned router serves plain HTTP: use http://HOST:PORT, got {url!r}")
    if port is None:
        problems.append(f"router.url: give the port the spawned router listens on, http://HOST:PORT, got {url!r}")
    if not host:
        return
    if _Hosts.wildcard(host):
        problems.append(f"router.url: {host} would make the router listen on every address of this machine, and "
                        "its admin routes take no key: give 127.0.0.1 or a private address of this machine")
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((host, 0))  # what the router will do, on a port nobody needs
    except OSError as e:
        why = ("it is not an address of this machine (ip -brief address)"
               if getattr(e, "errno", None) == errno.EADDRNOTAVAIL else str(e.strerror or e))
        problems.append(f"router.url: a spawned router listens on the url's host, and cannot on {host}: {why}")
        return
    if rtr.get("observe_only"):
        warnings.append("router.spawn with router.observe_only: the daemon runs a router it never feeds")


def _finite(*values: float) -> bool:
    return all(math.isfinite(v) for v in values)


def _check_probe(probe: ProbePolicy, problems: list[str], warnings: list[str]) -> None:
    """The heartbeat's timings together (each key's own bounds are its knob's). slime's own
    settings pass: first_wait = 0 (no grace period) and one failed probe that stops the engine
    (failure_threshold 1, interval 10, timeout 5); what they cost is a warning, not an error."""
    if not _finite(probe.interval, probe.timeout, probe.first_wait) or probe.timeout <= 0 or probe.interval <= 0:
        return
    if probe.first_wait == 0:
        warnings.append("health_check.first_wait = 0: no startup deadline, as slime's 0 (no grace period): "
                        "an incarnation stays STARTING until it answers or exits, so one that hangs while "
                        "booting is never stopped. Give the longest boot you expect (seconds) to bound it")
    elif probe.timeout >= probe.first_wait:
        problems.append(f"health_check: timeout ({probe.timeout:g}s) must be less than first_wait ({probe.first_wait:g}s)")
    if probe.failure_threshold >= 1 and probe.interval >= probe.timeout * probe.failure_threshold:
        bound = probe.hang_bound()
        warnings.append(
            f"health_check: interval ({probe.interval:g}s) is not less than timeout x failure_threshold "
            f"({probe.timeout:g}s x {probe.failure_threshold}): the wait between heartbeats, not the probes, "
            f"bounds detection; a hang is seen within {bound:g}s of when it begins. Lower interval to see it sooner")


def _check_finite(sections: dict[str, dict[str, Any]], problems: list[str]) -> None:
    """NaN passes every `<= 0` test and then breaks the loops that sleep on it (interval = nan
    killed the supervision task); inf never fires. Flags come here too (float("nan") is valid)."""
    for name, table in sections.items():
        for key, value in table.items():
            if isinstance(value, float) and not math.isfinite(value):
                problems.append(f"{name}.{key}: must be a finite number, got {value}")


def parse_metrics_address(text: str) -> tuple[str, int]:
    """("127.0.0.1", 9464) from "127.0.0.1:9464" ("[::1]:9464", "localhost:9464"); ValueError
    says what is wrong."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port:
        raise ValueError(f"must be HOST:PORT, e.g. 127.0.0.1:9464, got {text!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"put an IPv6 address in brackets ([::1]:9464), got {text!r}")
    if not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
        raise ValueError(f"the port must be a number in 1..65535, got {text!r}")
    if host == "localhost":
        host = "127.0.0.1"
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"give an IP address (127.0.0.1:{port}), not a host name, got {text!r}") from None
    return host, int(port)


def _check_metrics_address(sup: dict[str, Any], problems: list[str], warnings: list[str]) -> None:
    """The metrics listener's address: loopback unless the operator opts in, since the metrics
    name every engine and its URL (and a scrape costs the daemon CPU)."""
    text = sup.get("metrics_address", "")
    if not text:
        if sup.get("metrics_allow_remote"):
            warnings.append("supervisor.metrics_allow_remote = true has no effect without metrics_address")
        return
    where = "supervisor.metrics_address"
    try:
        host, port = parse_metrics_address(text)
    except ValueError as e:
        problems.append(f"{where}: {e}")
        return
    ip = ipaddress.ip_address(host)
    if not ip.is_loopback:
        if not sup.get("metrics_allow_remote"):
            problems.append(f"{where}: {host} is not a loopback address, and the metrics name every engine and "
                            f"its URL: use 127.0.0.1:{port} (a Prometheus on this host, or an SSH tunnel, reads it "
                            "there), or set supervisor.metrics_allow_remote = true if you mean it (then firewall "
                            "the port)")
            return
        if ip.is_unspecified:
            warnings.append(f"{where}: {text} listens on every address of this machine; firewall port {port}")
    if not ip.is_unspecified:
        # What the listener will do: bind (host, port). Here with port 0, so nothing is taken.
        try:
            with socket.socket(socket.AF_INET6 if ip.version == 6 else socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((host, 0))
        except OSError as e:
            why = ("it is not an address of this machine (ip -brief address)" if e.errno == errno.EADDRNOTAVAIL
                   else e.strerror)
            problems.append(f"{where}: cannot listen on {host}: {why}")


def _check_url(where: str, url: str, problems: list[str]) -> None:
    """An attached engine's url: http(s)://HOST:PORT, with a host and a port in 1..65535."""
    try:
        u = urlparse(url)
        host = u.hostname
    except ValueError as e:  # "http://[::1": urlparse raises
        problems.append(f"{where}.url: must be http://HOST:PORT (an IPv6 host in brackets: "
                        f"http://[::1]:8000), got {url!r} ({e})")
        return
    if u.scheme not in ("http", "https") or not u.netloc or not host:
        problems.append(f"{where}.url: must be http://HOST:PORT, got {url!r}")
        return
    try:
        port = u.port  # ValueError for "80a" or a port over 65535
    except ValueError:
        port = -1
    if port is not None and not 1 <= port <= 65535:
        problems.append(f"{where}.url: port must be a number in 1..65535, got {url!r}")


def _check_startup(sup: dict[str, Any], problems: list[str]) -> None:
    """What start-up would otherwise fail on with a traceback: a socket path over the Unix limit,
    an unknown socket_group, a directory that is a file; and a runtime_dir others could write
    to (they could replace the socket the trainer talks to)."""
    runtime_dir = sup.get("runtime_dir", Config.runtime_dir)
    sock = os.path.join(runtime_dir, "supervisor.sock")
    if len(os.fsencode(sock)) > MAX_SOCKET_PATH:
        problems.append(f"supervisor.runtime_dir: the socket path {sock} is {len(os.fsencode(sock))} bytes, too "
                        f"long for a Unix socket (at most {MAX_SOCKET_PATH}); choose a shorter runtime_dir")
    for key in ("runtime_dir", "log_dir", "state_dir", "engine_cache_dir"):
        path = sup.get(key, getattr(Config, key))
        if not path:  # engine_cache_dir "": under state_dir
            continue
        if key == "engine_cache_dir" and not os.path.isabs(path):
            problems.append(f"supervisor.engine_cache_dir: {path!r} is not an absolute path (under systemd the "
                            "daemon's working directory is /); give an absolute one, or leave it out for "
                            "<state_dir>/engine-cache")
            continue
        try:
            _check_dir(path, owner_only=key == "runtime_dir")
        except ValueError as e:
            problems.append(f"supervisor.{key}: {e}")
    group = sup.get("socket_group", "")
    if group and not group.isdigit():
        try:
            grp.getgrnam(group)
        except KeyError:
            problems.append(f"supervisor.socket_group: no group named {group!r}; give an existing group "
                            "(getent group) or a numeric gid")


def _check_dir(path: str, *, owner_only: bool) -> None:
    """The directory (or the nearest ancestor that exists) must be a directory; with owner_only,
    an existing one must be ours (or root's) and writable by nobody else."""
    p = os.path.abspath(path)
    probe = p
    while True:
        try:
            st = os.stat(probe)
            break
        except FileNotFoundError:
            parent = os.path.dirname(probe)
            if parent == probe:
                return
            probe = parent
        except OSError as e:  # ENAMETOOLONG, ENOTDIR, EACCES: start-up would fail the same way
            raise ValueError(f"{path} cannot be used: {e.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{probe} is not a directory" + ("" if probe == p else f" (in {path})"))
    if owner_only and probe == p:
        if st.st_uid not in (0, os.geteuid()):
            raise ValueError(f"{path} is owned by uid {st.st_uid}, not by us (uid {os.geteuid()}) or root; "
                             "whoever owns it could replace the socket. Use a directory of our own")
        if st.st_mode & 0o022:
            raise ValueError(f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}): "
                             f"they could replace the socket. chmod go-w {path}, or choose another runtime_dir")


def _name_problem(name: str) -> str | None:
    """Why `name` cannot be an engine's name, or None. Names become file names (logs, caches),
    Prometheus label values and supervisorctl arguments: supervisord refuses ' ', ':' and '/'
    in a program's name, and we keep to a narrower set ("../x" once escaped log_dir)."""
    if _NAME.fullmatch(name):
        return None
    if len(name) > 64:
        return f"it is {len(name)} characters long"
    if name[0] in ".-":
        return f"it starts with {name[0]!r}"
    bad = next(c for c in name if not (c.isascii() and (c.isalnum() or c in "._-")))
    return f"{bad!r} is not allowed"


def _engines(raw: Any, problems: list[str], base_dir: str | None, default_host: str = EngineSpec.host,
             hosts: "_Hosts | None" = None) -> list[EngineSpec]:
    if not isinstance(raw, list) or not raw:
        problems.append("engines: at least one [[engines]] table is needed")
        return []
    hosts = hosts or _Hosts(False)
    out: list[EngineSpec] = []
    names: dict[str, int] = {}
    ports: dict[int, list[tuple[str, str]]] = {}  # port -> [(host, engine name)]
    for i, table in enumerate(raw):
        where = f"engines[{i}]"
        e = _check_table(where, table, _ENGINE, problems)
        name = e.get("name")
        if not name:
            problems.append(f"{where}: needs a name")
            continue
        bad_name = _name_problem(name)
        where = f"engines[{i}] ({name!r})" if bad_name else f"engines[{i}] ({name})"
        if bad_name:
            problems.append(f"{where}.name: use letters, digits, '.', '_' and '-' (64 at most, not "
                            f"starting with '.' or '-'); {bad_name}, got {name!r}")
        if name in names:
            problems.append(f"{where}: duplicate name (also engines[{names[name]}])")
        names[name] = i
        if "url" in e:
            if "model" in e or "port" in e:
                problems.append(f"{where}: give either url (attach) or model and port (spawn), not both")
            _check_url(where, e["url"], problems)
        else:
            host = e.setdefault("host", default_host)
            if host != default_host:
                hosts.check(f"{where}.host", host, problems)
            if "model" not in e:
                problems.append(f"{where}: needs model (a directory) and port to spawn, or url to attach")
            else:
                model = e["model"]
                if base_dir and not os.path.isabs(model):
                    model = os.path.join(base_dir, model)
                    e["model"] = model
                if not Path(model).is_dir():
                    problems.append(f"{where}.model: no such directory: {model}")
                elif not (Path(model) / "config.json").exists():
                    problems.append(f"{where}.model: {model} has no config.json; is it a model directory?")
            port = e.get("port")
            if port is None:
                problems.append(f"{where}: needs a port")
            elif not 1 <= port <= 65535:
                problems.append(f"{where}.port: must be 1..65535, got {port}")
            else:
                # A wildcard bind takes the port on every address of the machine.
                clash = next((other for h, other in ports.get(port, ())
                              if h == host or hosts.wildcard(h) or hosts.wildcard(host)), None)
                if clash is not None:
                    problems.append(f"{where}.port: duplicate port {port} (also used by {clash})")
                ports.setdefault(port, []).append((host, name))
        args = _strs(f"{where}.args", e.get("args", []), problems)
        _forbidden_flags(f"{where}.args", args, problems)
        env = _env(f"{where}.env", e.get("env", {}), problems)
        out.append(EngineSpec(**{**e, "args": args, "env": env}))
    return out


class _Hosts:
    """Where spawned engines may listen: an address of this machine, never every address
    (0.0.0.0, ::) unless allow_wildcard_bind says the operator means it. vLLM's dev-mode routes
    (/pause, the weight-transfer routes, /collective_rpc) take no API key."""

    def __init__(self, allow_wildcard: bool):
        self.allow_wildcard = allow_wildcard
        self._checked: dict[str, str | None] = {}  # host -> its problem (the bind is tried once)

    @staticmethod
    def wildcard(host: str) -> bool:
        if host == "*":
            return True
        try:
            return ipaddress.ip_address(host).is_unspecified
        except ValueError:
            pass
        try:  # "0", "0.0", "0x0": the resolver reads these as 0.0.0.0 too
            return socket.inet_aton(host) == b"\0\0\0\0"
        except OSError:
            return False

    def check(self, where: str, host: str, problems: list[str]) -> None:
        if host not in self._checked:
            self._checked[host] = self._problem(host)
        if self._checked[host]:
            problems.append(f"{where}: {self._checked[host]}")

    def _problem(self, host: str) -> str | None:
        if not host or not host.isprintable() or any(c.isspace() for c in host):
            return f"must be an address or host name of this machine, got {host!r}"
        if self.wildcard(host):
            if self.allow_wildcard:
                return None
            return (f"{host!r} listens on every address of this machine, and vLLM's dev-mode routes "
                    "(/pause, weight transfer, /collective_rpc) take no API key: give this node's cluster "
                    "address, or set engine_defaults.allow_wildcard_bind = true if you mean it (then "
                    "firewall the engine ports)")
        if host.startswith("["):
            return f"give an IPv6 address without brackets, got {host!r}"
        # What vLLM will do: bind (host, port). Here with port 0, so nothing is taken.
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((host, 0))
        except socket.gaierror as e:
            return f"cannot resolve {host!r} ({e.strerror})"
        except OSError as e:
            if e.errno == errno.EADDRNOTAVAIL:
                return (f"{host} is not an address of this machine, so an engine cannot listen on it; "
                        "give one of its own (ip -brief address)")
            return f"cannot listen on {host} ({e.strerror})"
        return None


# vLLM's Authorization: Bearer value; a header carries visible ASCII only.
_KEY = re.compile(r"[\x21-\x7e]{1,4096}")


def _read_api_key(path: str, base_dir: str | None, problems: list[str], warnings: list[str]) -> str | None:
    """The engines' API key from engine_defaults.api_key_file. Its contents are never echoed."""
    if base_dir and not os.path.isabs(path):
        path = os.path.join(base_dir, path)
    return _read_secret("engine_defaults.api_key_file", path, problems, warnings)


def _read_secret(where: str, path: str, problems: list[str], warnings: list[str] | None = None, *,
                 owner_only: bool = False, what: str = "the engines' API key") -> str | None:
    """A key or token from a file: one line of visible ASCII. `owner_only`: the file must be the
    daemon's user's, mode 0600 (a problem otherwise); else a file others can read is a warning."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        problems.append(f"{where}: no such file: {path}; write {what} into it (one line, "
                        "mode 0600)")
        return None
    except OSError as e:
        problems.append(f"{where}: {path} cannot be read ({e.strerror}); the daemon's user must be able "
                        "to read it")
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            problems.append(f"{where}: {path} is not a regular file; write the key into a file")
            return None
        try:
            raw = _read_fd(fd, 8192)
        except OSError as e:
            problems.append(f"{where}: {path} cannot be read ({e.strerror})")
            return None
    finally:
        os.close(fd)
    key = raw.strip()
    if not key:
        problems.append(f"{where}: {path} is empty; write {what} into it")
        return None
    if not _KEY.fullmatch(key.decode("latin-1")):
        problems.append(f"{where}: {path} must hold one line: the key, in printable ASCII without spaces, "
                        "at most 4096 characters (it goes into an HTTP header)")
        return None
    if owner_only and (st.st_uid != os.geteuid() or st.st_mode & 0o077):
        problems.append(f"{where}: {path} must be owned by the daemon's user (uid {os.geteuid()}) with mode 0600 "
                        f"(it is uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}); "
                        f"chown {os.geteuid()} {path} && chmod 600 {path}")
        return None
    if st.st_mode & 0o044 and warnings is not None:
        warnings.append(f"{where}: {path} is readable by group or others (mode {stat.S_IMODE(st.st_mode):04o}); "
                        f"chmod 600 {path}")
    return key.decode("ascii")


# --- command-line flags ------------------------------------------------------------------

# The flags' groups in --help, each holding the flags of its tables.
_FLAG_GROUPS = {
    "fault tolerance (override the config file)": ("supervisor", "health_check", "warmup", "restart", "weights"),
    "router (override the config file's [router] table)": ("router",),
}


def _apply_overrides(overrides: dict[str, Any]):
    for dest, value in overrides.items():
        if value is not None and dest in _FLAG_KEYS:
            section, key = _FLAG_KEYS[dest]
            yield section, key, value


def add_flags(ap: argparse.ArgumentParser) -> None:
    """A flag for each setting that declares one, in its table's group (slime's names where they
    exist). Each defaults to None: only a flag given overrides the file."""
    for title, sections in _FLAG_GROUPS.items():
        group = ap.add_argument_group(title)
        for name in sections:
            for setting in SETTINGS[name]:
                if setting.knob.flag:
                    knobs.add_flag(group, setting)


def load(path: str, args: argparse.Namespace | None = None) -> Config:
    raw = load_file(path)
    overrides = {k: getattr(args, k, None) for k in _FLAG_KEYS} if args else {}
    return build(raw, overrides, base_dir=os.path.dirname(os.path.abspath(path)))


# --- docs/configuration.md ---------------------------------------------------------------

DOCS_BEGIN = "<!-- the table below is generated: python -m vime.supervisor.config --write-docs -->"
DOCS_END = "<!-- end of the generated table -->"
# The daemon's own flags (daemon.parse_args), above the settings; test_docs checks them too.
_DAEMON_ROWS = (
    "| | `-c`, `--config FILE` | `$VIME_SUPERVISOR_CONFIG`, else `/etc/vime-supervisor/config.toml` | the TOML "
    "config file |",
    "| | `--check-config` | | validate the config (and the open-file limit, the runtime directory) and exit: 0 "
    "when it would start, 2 with one line per problem |",
)


def docs_table() -> str:
    """The "Every key and flag" table of docs/configuration.md, from the declarations."""
    rows = ["| key | flag | default | meaning |", "|---|---|---|---|", *_DAEMON_ROWS]
    for name, declared in SETTINGS.items():
        table = f"[[{name}]]" if name == "engines" else f"[{name}]"
        rows += [knobs.table_row(s, f"{table} {s.key}") for s in declared]
    return "\n".join(rows)


def docs_with_table(page: str) -> str:
    """`page` with the text between DOCS_BEGIN and DOCS_END replaced by docs_table()."""
    head, begin, rest = page.partition(DOCS_BEGIN)
    _, end, tail = rest.partition(DOCS_END)
    if not begin or not end:
        raise ValueError(f"the page has no {DOCS_BEGIN!r} ... {DOCS_END!r} section")
    return f"{head}{DOCS_BEGIN}\n{docs_table()}\n{DOCS_END}{tail}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vime.supervisor.config",
                                 description="Print the settings' table of docs/configuration.md, or write it there.")
    ap.add_argument("--write-docs", metavar="PAGE", nargs="?", const="docs/configuration.md",
                    help="replace the generated table in PAGE (default docs/configuration.md)")
    args = ap.parse_args(argv)
    if args.write_docs is None:
        print(docs_table())
        return 0
    page = Path(args.write_docs)
    page.write_text(docs_with_table(page.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
