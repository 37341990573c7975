"""Configuration: a TOML file, then command-line flags over it, validated before anything starts.

Every problem is collected and reported as one line (`ConfigError.problems`), so an operator
fixes a bad file in one pass. See systemd/vime-supervisor.example.toml for every key.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from vime.weight_sync.vllm_plugin import SPIN_ENV, spin_seconds  # read by our plugin in each engine

# sockaddr_un.sun_path is 108 bytes, the terminating NUL included.
MAX_SOCKET_PATH = 107


# The per-engine policies the config builds: here, at the base, so that the config need not
# import the engine modules that read them (fsm.py, warmup.py).
@dataclass(frozen=True)
class ProbePolicy:
    """Kubernetes probe terms; slime's --rollout-health-check-* for the first three."""

    first_wait: float = 300.0  # startup budget of each incarnation
    interval: float = 10.0  # periodSeconds
    timeout: float = 5.0  # timeoutSeconds, per probe
    failure_threshold: int = 3  # consecutive failures -> UNHEALTHY
    success_threshold: int = 1  # consecutive successes to clear SUSPECT
    # A late probe is excused while the engine's processes burn CPU (a first-use compile, a
    # long prefill); busy cannot excuse it for ever: on GPU a collective that never completes
    # spins a core too. Far above a compile of a new shape (seconds here, tens of seconds on
    # GPU), well below vLLM's own VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS (300).
    max_busy: float = 120.0
    # A paused engine (a weight push holds generation) is excused up to this long: the
    # config's sync_timeout, past which the push has failed anyway.
    max_paused: float = 300.0


@dataclass(frozen=True)
class RestartPolicy:
    start_retries: int = 3  # consecutive failed starts before FATAL (supervisord's startretries)
    backoff_initial: float = 1.0  # seconds before the 2nd attempt; doubles per failure
    backoff_max: float = 60.0
    flapping_window: float = 600.0  # seconds
    flapping_max_restarts: int = 5  # restarts inside the window -> FATAL (systemd StartLimitBurst)


@dataclass(frozen=True)
class WarmupPolicy:
    """The defaults mirror a rollout batch: concurrent sampled requests with logprobs."""

    requests: int = 8  # sent at once; 0 turns the warm-up off
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    logprobs: int = 1  # completions' logprobs=N; 0 asks for none
    prompt: str = "The quick brown fox"


# More at once than any engine batches is no warm-up, only load (and memory in the daemon).
MAX_REQUESTS = 256


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


@dataclass(frozen=True)
class EngineSpec:
    name: str
    # Spawned engines: model directory and port. Attached engines: url only.
    model: str | None = None
    port: int | None = None
    host: str = "127.0.0.1"
    served_model_name: str | None = None
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    url: str | None = None

    @property
    def spawned(self) -> bool:
        return self.url is None

    @property
    def base_url(self) -> str:
        if self.url:
            return self.url.rstrip("/")
        host = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 literal
        return f"http://{host}:{self.port}"

    @property
    def model_name(self) -> str:
        """The name requests must use (vLLM defaults it to the model path)."""
        return self.served_model_name or self.model or ""


# vime's flags for vllm-router: long RL generations trip the circuit breaker on healthy engines.
ROUTER_ARGS = ("--disable-circuit-breaker", "--request-timeout-secs", "14400")
# Flags a spawned router's args may not carry: the daemon sets them, or they would put a secret
# on a command line any local user reads (/proc/PID/cmdline).
_ROUTER_OWN_FLAGS = ("--host", "--port", "--worker-urls")


@dataclass(frozen=True)
class RouterConfig:
    """[router]: the router in front of the engines, fed by the daemon (docs/router.md)."""

    url: str
    kind: str = "vllm-router"
    worker_type: str = "regular"  # vllm-router's worker_type of every engine we add
    # Report the drift, change nothing: to try the daemon beside a router that others feed.
    observe_only: bool = False
    # Remove workers no daemon of ours owns (another node's daemon owns its own: leave off there).
    prune_unknown: bool = False
    period: float = 2.0  # drift repair: the router's list is read this often besides every change
    timeout: float = 5.0  # one GET or POST /workers (POST blocks until the worker answers /health)
    remove_timeout: float = 1.0  # one DELETE: an engine leaving the routable set is out within it
    # A planned stop (operator stop/restart/retire, the daemon's shutdown): the engine leaves the
    # router, then vLLM's POST /pause?mode=wait lets its requests in flight end, at most this long.
    drain_timeout: float = 30.0
    token_file: str = ""
    token: str | None = field(default=None, repr=False)  # read from token_file; never printed
    # Run the router as a child of the daemon (routerchild.py): its own process group, restarted
    # with [restart]'s backoff, re-adopted across a daemon restart or reload, stopped last.
    spawn: bool = False
    binary: str = "vllm-router"  # on PATH, else beside the daemon's interpreter (a venv's bin)
    # Its flags besides --host/--port (from url) and --worker-urls (none: the daemon adds them).
    # Set whole: these are vime's (the breaker off, a 4-hour request timeout).
    args: tuple[str, ...] = ROUTER_ARGS
    # A spawned router that answers nothing this long, starting or after it had answered (hung,
    # SIGSTOPped), is stopped and started again: a process that runs is not one that serves.
    silent_timeout: float = 60.0


@dataclass(frozen=True)
class Config:
    engines: tuple[EngineSpec, ...]
    probe: ProbePolicy = ProbePolicy()
    restart: RestartPolicy = RestartPolicy()
    use_fault_tolerance: bool = True
    stop_timeout: float = 10.0  # SIGTERM -> SIGKILL (supervisord's stopwaitsecs)
    min_healthy: int = 1
    restart_immediately: bool = False  # boot a dead engine during the round, route it after
    # Full strength inside the round: a current spare takes a failed engine's place at once,
    # and an engine verified at the current version (a restart reloaded from the published
    # checkpoint, a held one) joins at once, instead of in the next gap. Version-safe: nothing
    # at another version is routable. Off: membership grows only in gaps (slime's rule).
    admit_mid_round: bool = False
    # Warm spares: this many engines beyond the routing target (engines - spares) are kept
    # booted and verified in STANDBY, and one takes a failed engine's place in the next gap.
    spares: int = 0
    # When a spare gets the current weights: "promotion" (synced when it takes a place: no
    # cost while nothing fails) or "publish" (synced in every gap after a publish, like a
    # serving engine: one more receiver per push, a promotion without a sync).
    spares_sync: str = "promotion"
    # How a restarted engine gets its weights: "model" (read from disk, as at its first start)
    # or "dummy" (vLLM's dummy weights when the trainer's agent is connected to push every
    # tensor: no checkpoint read; a normal restart when no push can come).
    restart_load: str = "model"
    runtime_dir: str = "/run/vime-supervisor"
    log_dir: str = "/var/log/vime-supervisor"
    state_dir: str = "/var/lib/vime-supervisor"  # the journal (systemd's StateDirectory=)
    # Retention, so that a week of restarts cannot fill log_dir (0: no limit). Each engine keeps
    # its newest log_keep logs within log_keep_bytes, oldest incarnation removed first, the live
    # one never; the incident folders, all engines together, likewise, the newest never.
    log_keep: int = 10
    log_keep_bytes: int = 1 << 30
    incidents_keep: int = 100
    incidents_keep_bytes: int = 256 << 20
    # Each engine's compiler caches, <engine_cache_dir>/<engine>/<model digest>/; "" is
    # <state_dir>/engine-cache. Engines of the same name and model on the same host may share it.
    engine_cache_dir: str = ""
    log_level: str = "info"
    python: str = ""  # interpreter for `-m vllm.entrypoints.openai.api_server`; "" = ours
    engine_env: dict[str, str] = field(default_factory=dict)  # for every spawned engine
    engine_args: tuple[str, ...] = ()  # for every spawned engine, before its own args
    allowed_uids: tuple[int, ...] = ()  # control socket peers besides our own uid
    socket_group: str = ""  # group owning the socket (mode 0660), so its members can connect
    sync_timeout: float = 300.0  # a push or reload not verified by then poisons the engine
    # Prometheus' GET /metrics over TCP: "127.0.0.1:9464"; "" for none. Loopback only, unless
    # metrics_allow_remote: the metrics name every engine and its URL.
    metrics_address: str = ""
    metrics_allow_remote: bool = False
    warmup: WarmupPolicy = WarmupPolicy()  # sent to each new incarnation before it is RUNNING
    # The engines' API key (engine_defaults.api_key_file): spawned engines get it as VLLM_API_KEY
    # in their environment, never on argv; the daemon sends it to every engine. Never printed.
    api_key: str | None = field(default=None, repr=False)
    router: RouterConfig | None = None  # [router]; None: the daemon feeds no router
    # What is accepted but probably not meant: printed by --check-config, logged at start.
    warnings: tuple[str, ...] = field(default=(), compare=False)

    @property
    def socket_path(self) -> str:
        return os.path.join(self.runtime_dir, "supervisor.sock")

    @property
    def engine_headers(self) -> dict[str, str]:
        """Headers for every request of the daemon's to an engine."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


# Table -> {key: type}. Everything else in the file is an error.
_TOP = {"supervisor", "health_check", "restart", "warmup", "engine_defaults", "engines", "router"}
_SUPERVISOR = {
    "use_fault_tolerance": bool,
    "stop_timeout": float,
    "min_healthy": int,
    "restart_immediately": bool,
    "admit_mid_round": bool,
    "spares": int,
    "spares_sync": str,
    "restart_load": str,
    "runtime_dir": str,
    "log_dir": str,
    "state_dir": str,
    "log_keep": int,
    "log_keep_bytes": int,
    "incidents_keep": int,
    "incidents_keep_bytes": int,
    "engine_cache_dir": str,
    "log_level": str,
    "python": str,
    "allowed_uids": list,
    "socket_group": str,
    "sync_timeout": float,
    "metrics_address": str,
    "metrics_allow_remote": bool,
}
_HEALTH = {
    "first_wait": float,
    "interval": float,
    "timeout": float,
    "failure_threshold": int,
    "success_threshold": int,
    "max_busy": float,
}
_WARMUP = {
    "requests": int,
    "max_tokens": int,
    "temperature": float,
    "top_p": float,
    "logprobs": int,
    "prompt": str,
}
_RESTART = {
    "start_retries": int,
    "backoff_initial": float,
    "backoff_max": float,
    "flapping_window": float,
    "flapping_max_restarts": int,
}
_DEFAULTS = {"env": dict, "args": list, "host": str, "api_key_file": str, "allow_wildcard_bind": bool}
_ENGINE = {
    "name": str,
    "model": str,
    "port": int,
    "host": str,
    "served_model_name": str,
    "args": list,
    "env": dict,
    "url": str,
}
_ROUTER = {
    "kind": str,
    "url": str,
    "token_file": str,
    "worker_type": str,
    "observe_only": bool,
    "prune_unknown": bool,
    "period": float,
    "timeout": float,
    "remove_timeout": float,
    "drain_timeout": float,
    "spawn": bool,
    "binary": str,
    "args": list,
    "silent_timeout": float,
}
_LOG_LEVELS = {"debug", "info", "warning", "error"}
SPARES_SYNC = ("promotion", "publish")
RESTART_LOAD = ("model", "dummy")
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
    for key in raw:
        if key not in _TOP:
            problems.append(f"{key}: unknown key (known: {', '.join(sorted(_TOP))})")
    sup = _check_table("supervisor", raw.get("supervisor", {}), _SUPERVISOR, problems)
    health = _check_table("health_check", raw.get("health_check", {}), _HEALTH, problems)
    restart = _check_table("restart", raw.get("restart", {}), _RESTART, problems)
    defaults = _check_table("engine_defaults", raw.get("engine_defaults", {}), _DEFAULTS, problems)
    warm = _check_table("warmup", raw.get("warmup", {}), _WARMUP, problems)
    rtr = _check_table("router", raw.get("router", {}), _ROUTER, problems)
    router_given = "router" in raw
    for section, key, value in _apply_overrides(overrides or {}):
        {"supervisor": sup, "health_check": health, "restart": restart, "warmup": warm,
         "router": rtr}[section][key] = value
        router_given |= section == "router"

    # NaN passes every `<= 0` test and inf never fires: refused first, and each rule below
    # judges only finite values, so a non-finite one is reported once.
    _check_finite({"supervisor": sup, "health_check": health, "restart": restart, "warmup": warm,
                   "router": rtr}, problems)
    warnings: list[str] = []
    # A paused engine is excused for as long as a weight push may take.
    probe = ProbePolicy(**health, max_paused=sup.get("sync_timeout", Config.sync_timeout))
    warmup = WarmupPolicy(**warm)
    # Bounded: each request is held in the daemon while it runs (vLLM's own logprobs cap is 20).
    for key, low, high in (("requests", 0, MAX_REQUESTS), ("max_tokens", 1, 4096), ("logprobs", 0, 20)):
        if not low <= getattr(warmup, key) <= high:
            problems.append(f"warmup.{key}: must be in {low}..{high}, got {getattr(warmup, key)}")
    if _finite(warmup.temperature) and warmup.temperature < 0:
        problems.append(f"warmup.temperature: must be >= 0, got {warmup.temperature:g}")
    if _finite(warmup.top_p) and not 0 < warmup.top_p <= 1:
        problems.append(f"warmup.top_p: must be in (0, 1], got {warmup.top_p:g}")
    if _finite(probe.max_busy) and probe.max_busy <= 0:
        problems.append(f"health_check.max_busy: must be a number of seconds > 0, got {probe.max_busy:g}")
    rpolicy = RestartPolicy(**restart)
    _check_probe(probe, problems, warnings)
    if rpolicy.start_retries < 1:
        problems.append(f"restart.start_retries: must be >= 1, got {rpolicy.start_retries}")
    if rpolicy.flapping_max_restarts < 1:
        problems.append(f"restart.flapping_max_restarts: must be >= 1, got {rpolicy.flapping_max_restarts}")
    for key in ("backoff_initial", "backoff_max", "flapping_window"):
        if _finite(getattr(rpolicy, key)) and getattr(rpolicy, key) < 0:
            problems.append(f"restart.{key}: must be >= 0, got {getattr(rpolicy, key):g}")
    if _finite(rpolicy.backoff_max, rpolicy.backoff_initial) and rpolicy.backoff_max < rpolicy.backoff_initial:
        problems.append("restart.backoff_max: must be >= backoff_initial")
    _check_startup(sup, problems)
    _check_metrics_address(sup, problems, warnings)
    if _finite(sup.get("stop_timeout", 1.0)) and sup.get("stop_timeout", 1.0) <= 0:
        problems.append(f"supervisor.stop_timeout: must be > 0, got {sup['stop_timeout']:g}")
    for key in ("log_keep", "log_keep_bytes", "incidents_keep", "incidents_keep_bytes"):
        if sup.get(key, 0) < 0:
            problems.append(f"supervisor.{key}: must be >= 0 (0: no limit), got {sup[key]}")
    if sup.get("log_level", "info") not in _LOG_LEVELS:
        problems.append(f"supervisor.log_level: must be one of {', '.join(sorted(_LOG_LEVELS))}, got {sup['log_level']!r}")
    uids = sup.pop("allowed_uids", [])
    if not all(isinstance(u, int) and not isinstance(u, bool) and u >= 0 for u in uids):
        problems.append("supervisor.allowed_uids: must be a list of non-negative integers")
        uids = []

    # Spawned engines inherit the daemon's own environment (a unit's Environment=) under theirs.
    _env("the daemon's environment", {k: v for k, v in os.environ.items() if k == SPIN_ENV}, problems)
    engine_env = _env("engine_defaults.env", defaults.get("env", {}), problems)
    engine_args = _strs("engine_defaults.args", defaults.get("args", []), problems)
    _forbidden_flags("engine_defaults.args", engine_args, problems)
    wildcard_ok = defaults.get("allow_wildcard_bind", False)
    hosts = _Hosts(wildcard_ok)
    default_host = defaults.get("host", EngineSpec.host)
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
    min_healthy = sup.get("min_healthy", 1)
    if min_healthy < 0:
        problems.append(f"supervisor.min_healthy: must be >= 0, got {min_healthy}")
    elif engines and min_healthy > len(engines):
        problems.append(f"supervisor.min_healthy: {min_healthy} is more than the {len(engines)} configured engines")
    spares = sup.get("spares", 0)
    if spares < 0:
        problems.append(f"supervisor.spares: must be >= 0, got {spares}")
    elif spares and spares >= len(engines):
        problems.append(f"supervisor.spares: {spares} spare(s) leave none of the {len(engines)} configured "
                        "engines to serve; configure more engines than spares")
    elif spares and engines and min_healthy > len(engines) - spares:
        problems.append(f"supervisor.min_healthy: {min_healthy} is more than the {len(engines) - spares} engines "
                        f"that serve ({len(engines)} configured, {spares} spare(s))")
    if sup.get("restart_load", "model") not in RESTART_LOAD:
        problems.append(f"supervisor.restart_load: must be one of {', '.join(RESTART_LOAD)}, "
                        f"got {sup['restart_load']!r}")
    if sup.get("spares_sync", "promotion") not in SPARES_SYNC:
        problems.append(f"supervisor.spares_sync: must be one of {', '.join(SPARES_SYNC)}, "
                        f"got {sup['spares_sync']!r}")

    router = _router(rtr, base_dir, problems, warnings) if router_given else None

    if problems:
        raise ConfigError(problems)
    return Config(
        engines=tuple(engines),
        probe=probe,
        restart=rpolicy,
        allowed_uids=tuple(uids),
        engine_env=engine_env,
        engine_args=engine_args,
        warmup=warmup,
        api_key=api_key,
        warnings=tuple(_one_line(w) for w in warnings),
        router=router,
        **sup,
    )


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
    if rtr.get("observe_only") and rtr.get("prune_unknown"):
        warnings.append("router.prune_unknown has no effect with router.observe_only = true: nothing is removed")
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
    for key in ("period", "timeout", "remove_timeout", "drain_timeout", "silent_timeout"):
        if key in rtr and _finite(rtr[key]) and rtr[key] <= 0:
            problems.append(f"router.{key}: must be a number of seconds > 0, got {rtr[key]:g}")
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
    """The heartbeat's timings. slime's own settings pass: first_wait = 0 (no grace period)
    and one failed probe that stops the engine (failure_threshold 1, interval 10, timeout 5);
    what they cost is a warning, not an error."""
    for key in ("interval", "timeout"):
        value = getattr(probe, key)
        if _finite(value) and value <= 0:
            problems.append(f"health_check.{key}: must be > 0, got {value:g}")
    if _finite(probe.first_wait) and probe.first_wait < 0:
        problems.append(f"health_check.first_wait: must be >= 0 (0: no startup deadline), got {probe.first_wait:g}")
    for key in ("failure_threshold", "success_threshold"):
        if getattr(probe, key) < 1:
            problems.append(f"health_check.{key}: must be >= 1, got {getattr(probe, key)}")
    if not _finite(probe.interval, probe.timeout, probe.first_wait) or probe.timeout <= 0 or probe.interval <= 0:
        return
    if probe.first_wait == 0:
        warnings.append("health_check.first_wait = 0: no startup deadline, as slime's 0 (no grace period): "
                        "an incarnation stays STARTING until it answers or exits, so one that hangs while "
                        "booting is never stopped. Give the longest boot you expect (seconds) to bound it")
    elif probe.timeout >= probe.first_wait:
        problems.append(f"health_check: timeout ({probe.timeout:g}s) must be less than first_wait ({probe.first_wait:g}s)")
    if probe.failure_threshold >= 1 and probe.interval >= probe.timeout * probe.failure_threshold:
        bound = probe.interval + probe.failure_threshold * (probe.timeout + 0.5)
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
    sync_timeout = sections["supervisor"].get("sync_timeout", 1.0)
    if math.isfinite(sync_timeout) and sync_timeout <= 0:
        problems.append(f"supervisor.sync_timeout: must be > 0 seconds, got {sync_timeout:g}; a push "
                        "or reload gets this long before the engine counts as poisoned")


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

# flag dest -> (section, key). slime's names where they exist.
_FLAG_KEYS = {
    "use_fault_tolerance": ("supervisor", "use_fault_tolerance"),
    "rollout_health_check_first_wait": ("health_check", "first_wait"),
    "rollout_health_check_interval": ("health_check", "interval"),
    "rollout_health_check_timeout": ("health_check", "timeout"),
    "rollout_health_check_failure_threshold": ("health_check", "failure_threshold"),
    "rollout_health_check_success_threshold": ("health_check", "success_threshold"),
    "rollout_health_check_max_busy": ("health_check", "max_busy"),
    "warmup_requests": ("warmup", "requests"),
    "stop_timeout": ("supervisor", "stop_timeout"),
    "start_retries": ("restart", "start_retries"),
    "backoff_initial": ("restart", "backoff_initial"),
    "backoff_max": ("restart", "backoff_max"),
    "flapping_window": ("restart", "flapping_window"),
    "flapping_max_restarts": ("restart", "flapping_max_restarts"),
    "min_healthy": ("supervisor", "min_healthy"),
    "restart_immediately": ("supervisor", "restart_immediately"),
    "admit_mid_round": ("supervisor", "admit_mid_round"),
    "spares": ("supervisor", "spares"),
    "spares_sync": ("supervisor", "spares_sync"),
    "restart_load": ("supervisor", "restart_load"),
    "runtime_dir": ("supervisor", "runtime_dir"),
    "log_dir": ("supervisor", "log_dir"),
    "state_dir": ("supervisor", "state_dir"),
    "log_keep": ("supervisor", "log_keep"),
    "log_keep_bytes": ("supervisor", "log_keep_bytes"),
    "incidents_keep": ("supervisor", "incidents_keep"),
    "incidents_keep_bytes": ("supervisor", "incidents_keep_bytes"),
    "engine_cache_dir": ("supervisor", "engine_cache_dir"),
    "log_level": ("supervisor", "log_level"),
    "metrics_address": ("supervisor", "metrics_address"),
    "router_url": ("router", "url"),
    "router_observe_only": ("router", "observe_only"),
    "router_prune_unknown": ("router", "prune_unknown"),
}


def _apply_overrides(overrides: dict[str, Any]):
    for dest, value in overrides.items():
        if value is not None and dest in _FLAG_KEYS:
            section, key = _FLAG_KEYS[dest]
            yield section, key, value


def add_flags(ap: argparse.ArgumentParser) -> None:
    d = ProbePolicy()
    r = RestartPolicy()
    g = ap.add_argument_group("fault tolerance (override the config file)")
    g.add_argument("--use-fault-tolerance", action=argparse.BooleanOptionalAction, default=None,
                   help="probe engines and restart dead ones (default: on)")
    g.add_argument("--rollout-health-check-first-wait", type=float, metavar="S",
                   help=f"startup budget of each engine incarnation (default {d.first_wait:g})")
    g.add_argument("--rollout-health-check-interval", type=float, metavar="S",
                   help=f"seconds between probes of one engine (default {d.interval:g})")
    g.add_argument("--rollout-health-check-timeout", type=float, metavar="S",
                   help=f"timeout of one probe (default {d.timeout:g})")
    g.add_argument("--rollout-health-check-failure-threshold", type=int, metavar="N",
                   help=f"consecutive failures that make an engine UNHEALTHY (default {d.failure_threshold})")
    g.add_argument("--rollout-health-check-success-threshold", type=int, metavar="N",
                   help=f"consecutive successes that clear SUSPECT (default {d.success_threshold})")
    g.add_argument("--rollout-health-check-max-busy", type=float, metavar="S",
                   help="longest a late probe is excused while the engine's processes burn CPU with no "
                        f"token counted (default {d.max_busy:g})")
    g.add_argument("--warmup-requests", type=int, metavar="N",
                   help=f"concurrent warm-up requests before an incarnation is RUNNING; 0: none "
                        f"(default {WarmupPolicy().requests})")
    g.add_argument("--stop-timeout", type=float, metavar="S", help="SIGTERM to SIGKILL (default 10)")
    g.add_argument("--start-retries", type=int, metavar="N",
                   help=f"consecutive failed starts before FATAL (default {r.start_retries})")
    g.add_argument("--backoff-initial", type=float, metavar="S", help=f"default {r.backoff_initial:g}")
    g.add_argument("--backoff-max", type=float, metavar="S", help=f"default {r.backoff_max:g}")
    g.add_argument("--flapping-window", type=float, metavar="S", help=f"default {r.flapping_window:g}")
    g.add_argument("--flapping-max-restarts", type=int, metavar="N",
                   help=f"restarts inside the window before FATAL (default {r.flapping_max_restarts})")
    g.add_argument("--min-healthy", type=int, metavar="N", help="routable engines below which the trainer is told")
    g.add_argument("--restart-immediately", action=argparse.BooleanOptionalAction, default=None,
                   help="boot a dead engine during the round (routed after the gap, or at once with "
                        "--admit-mid-round once verified at the current version)")
    g.add_argument("--admit-mid-round", action=argparse.BooleanOptionalAction, default=None,
                   help="fill a failed engine's place inside the round: a current spare at once, an engine "
                        "verified at the current version as soon as it is (default off: in the gap)")
    g.add_argument("--spares", type=int, metavar="K",
                   help="warm spares: K engines beyond the routing target kept in STANDBY, promoted in "
                        "the gap after a failure (default 0)")
    g.add_argument("--spares-sync", choices=SPARES_SYNC,
                   help="when spares get new weights: at promotion (default) or after every publish")
    g.add_argument("--restart-load", choices=RESTART_LOAD,
                   help="a restarted engine's weights: read the model (default), or dummy weights when the "
                        "trainer's agent is connected to push them")
    g.add_argument("--runtime-dir", help="holds the control socket (default /run/vime-supervisor)")
    g.add_argument("--log-dir", help="engine logs, one file per incarnation")
    g.add_argument("--state-dir", help="the journal that lets a restarted daemon lose nothing")
    g.add_argument("--log-keep", type=int, metavar="N",
                   help=f"each engine's newest N logs are kept, the live one always; 0: no limit "
                        f"(default {Config.log_keep})")
    g.add_argument("--log-keep-bytes", type=int, metavar="BYTES",
                   help=f"each engine's logs within BYTES, oldest removed first; 0: no limit "
                        f"(default {Config.log_keep_bytes})")
    g.add_argument("--incidents-keep", type=int, metavar="N",
                   help=f"the newest N incident folders are kept; 0: no limit (default {Config.incidents_keep})")
    g.add_argument("--incidents-keep-bytes", type=int, metavar="BYTES",
                   help=f"the incident folders within BYTES, oldest removed first; 0: no limit "
                        f"(default {Config.incidents_keep_bytes})")
    g.add_argument("--engine-cache-dir", help="the engines' compiler caches, kept across restarts "
                                              "(default <state_dir>/engine-cache)")
    g.add_argument("--log-level", help="debug, info, warning, error")
    g.add_argument("--metrics-address", metavar="HOST:PORT",
                   help="serve Prometheus' GET /metrics over TCP here, e.g. 127.0.0.1:9464 (loopback only "
                        "unless supervisor.metrics_allow_remote; default: none)")
    g = ap.add_argument_group("router (override the config file's [router] table)")
    g.add_argument("--router-url", metavar="URL",
                   help="feed the router (vllm-router) at URL with the routable engines, e.g. http://127.0.0.1:30000")
    g.add_argument("--router-observe-only", action=argparse.BooleanOptionalAction, default=None,
                   help="report how the router's list differs from the routable set; change nothing")
    g.add_argument("--router-prune-unknown", action=argparse.BooleanOptionalAction, default=None,
                   help="remove router workers that are not this daemon's engines (default: report them)")


def load(path: str, args: argparse.Namespace | None = None) -> Config:
    raw = load_file(path)
    overrides = {k: getattr(args, k, None) for k in _FLAG_KEYS} if args else {}
    return build(raw, overrides, base_dir=os.path.dirname(os.path.abspath(path)))
