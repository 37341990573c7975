"""Who can reach an engine: where spawned engines listen, and their API key (config rules, the
engine's environment and command line, the header our HTTP helpers send). No engines."""

from __future__ import annotations

import http.server
import os
import threading
from pathlib import Path

import pytest

from vime.supervisor.config import ConfigError, build, load
from vime.supervisor.engine.process import engine_command, engine_env, engine_fingerprint
from vime.weight_sync.engine_http import http_json

KEY = "s3cr3t-Key_0123456789"


def model_dir(root: Path, name: str = "tiny") -> Path:
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text("{}")
    return d


def engine(name: str, model: Path, port: int, **kw) -> dict:
    return {"name": name, "model": str(model), "port": port, **kw}


def problems(raw: dict, **kw) -> list[str]:
    with pytest.raises(ConfigError) as ei:
        build(raw, **kw)
    return ei.value.problems


def key_file(tmp_path: Path, text: str = KEY + "\n", mode: int = 0o600, name: str = "engine.key") -> Path:
    f = tmp_path / name
    f.write_text(text)
    f.chmod(mode)
    return f


@pytest.fixture
def model(tmp_path) -> Path:
    return model_dir(tmp_path)


# -- where engines listen -------------------------------------------------------------------


def test_engines_listen_on_loopback_unless_told(model):
    (e,) = build({"engines": [engine("e0", model, 8001)]}).engines
    assert e.host == "127.0.0.1" and e.base_url == "http://127.0.0.1:8001"


def test_engine_defaults_host_is_every_spawned_engines_address(model):
    """One line per node: its cluster address. An engine's own host still wins; an attached
    engine's address is its url."""
    cfg = build({"engine_defaults": {"host": "127.0.0.2"},
                 "engines": [engine("a", model, 8001), engine("b", model, 8002, host="127.0.0.3"),
                             {"name": "r", "url": "http://10.0.0.5:8000"}]})
    a, b, r = cfg.engines
    assert (a.host, a.base_url) == ("127.0.0.2", "http://127.0.0.2:8001")
    assert (b.host, b.base_url) == ("127.0.0.3", "http://127.0.0.3:8002")
    assert r.base_url == "http://10.0.0.5:8000"
    assert engine_command(a, cfg)[engine_command(a, cfg).index("--host") + 1] == "127.0.0.2"


def test_ipv6_host_gets_brackets_in_its_url(model):
    (e,) = build({"engines": [engine("e0", model, 8001, host="::1")]}).engines
    assert e.base_url == "http://[::1]:8001"


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "0:0:0:0:0:0:0:0", "0", "*"])
def test_wildcard_bind_is_refused_unless_allowed(model, host):
    out = problems({"engine_defaults": {"host": host}, "engines": [engine("e0", model, 8001)]})
    assert out == [f"engine_defaults.host: {host!r} listens on every address of this machine, and vLLM's "
                   "dev-mode routes (/pause, weight transfer, /collective_rpc) take no API key: give this "
                   "node's cluster address, or set engine_defaults.allow_wildcard_bind = true if you mean "
                   "it (then firewall the engine ports)"]
    (line,) = problems({"engines": [engine("e0", model, 8001, host=host)]})
    assert line.startswith(f"engines[0] (e0).host: {host!r} listens on every address")
    if host != "*":  # vLLM cannot bind "*"; the opt-in is for real addresses
        cfg = build({"engine_defaults": {"host": host, "allow_wildcard_bind": True},
                     "engines": [engine("e0", model, 8001)]})
        assert cfg.engines[0].host == host


def test_a_wildcard_bind_takes_the_port_on_every_address(model):
    ok = build({"engines": [engine("a", model, 8001, host="127.0.0.2"), engine("b", model, 8001, host="127.0.0.3")]})
    assert len(ok.engines) == 2  # one port on two addresses: two sockets
    assert problems({"engine_defaults": {"allow_wildcard_bind": True},
                     "engines": [engine("a", model, 8001, host="0.0.0.0"), engine("b", model, 8001)]}) == [
        "engines[1] (b).port: duplicate port 8001 (also used by a)"]


@pytest.mark.parametrize("host, says", [
    ("192.0.2.1", "192.0.2.1 is not an address of this machine, so an engine cannot listen on it; "
                  "give one of its own (ip -brief address)"),
    ("[::1]", "give an IPv6 address without brackets, got '[::1]'"),
    ("", "must be an address or host name of this machine, got ''"),
    ("127.0.0.1 ", "must be an address or host name of this machine, got '127.0.0.1 '"),
])
def test_host_must_be_an_address_of_this_machine(model, host, says):
    assert problems({"engine_defaults": {"host": host}, "engines": [engine("e0", model, 8001)]}) == [
        f"engine_defaults.host: {says}"]


def test_allow_wildcard_bind_must_be_a_boolean(model):
    assert problems({"engine_defaults": {"allow_wildcard_bind": "yes"}, "engines": [engine("e0", model, 8001)]}) == [
        "engine_defaults.allow_wildcard_bind: must be true or false, got 'yes'"]


# -- the API key ----------------------------------------------------------------------------


def test_api_key_file_gives_the_key_to_engines_through_the_environment(tmp_path, model, monkeypatch):
    monkeypatch.setenv("NOTIFY_SOCKET", "/run/systemd/notify")
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    monkeypatch.setenv("VLLM_API_KEY", "the-daemons-own")
    cfg = build({"engine_defaults": {"api_key_file": str(key_file(tmp_path))},
                 "engines": [engine("e0", model, 8001), {"name": "r", "url": "http://10.0.0.5:8000"}]})
    assert cfg.api_key == KEY  # the newline stripped
    assert cfg.engine_headers == {"Authorization": f"Bearer {KEY}"}
    spec = cfg.engines[0]
    env = engine_env(spec, cfg)
    assert env["VLLM_API_KEY"] == KEY
    # The daemon's systemd handles name the daemon's socket and watchdog, not an engine's.
    assert not {"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"} & set(env)
    assert not any(KEY in a for a in engine_command(spec, cfg))  # argv is world-readable
    assert KEY not in repr(cfg) and KEY not in repr(spec)
    assert cfg.warnings == ()


def test_without_a_key_file_the_daemons_own_vllm_api_key_is_not_passed_on(model, monkeypatch):
    """The engines' key is the config's: an engine holding a key the probes do not send
    would never become ready."""
    monkeypatch.setenv("VLLM_API_KEY", "the-daemons-own")
    cfg = build({"engines": [engine("e0", model, 8001)]})
    assert cfg.api_key is None and cfg.engine_headers == {}
    assert "VLLM_API_KEY" not in engine_env(cfg.engines[0], cfg)
    cfg = build({"engines": [engine("e0", model, 8001, env={"VLLM_API_KEY": "in-the-config"})]})
    assert engine_env(cfg.engines[0], cfg)["VLLM_API_KEY"] == "in-the-config"


def test_a_new_key_is_a_new_fingerprint(tmp_path, model):
    """A restarted daemon must not adopt an engine started with another key: it would refuse
    the probes."""
    raw = {"engines": [engine("e0", model, 8001)]}
    fp = [engine_fingerprint(c.engines[0], c) for c in (
        build(raw),
        build({**raw, "engine_defaults": {"api_key_file": str(key_file(tmp_path, "one"))}}),
        build({**raw, "engine_defaults": {"api_key_file": str(key_file(tmp_path, "two"))}}))]
    assert len(set(fp)) == 3
    assert all(KEY not in f and "one" not in f for f in fp)


def test_relative_api_key_file_is_relative_to_the_config_file(tmp_path):
    etc = tmp_path / "etc"
    m = model_dir(etc)
    key_file(etc, name="engine.key")
    (etc / "config.toml").write_text(
        f'[engine_defaults]\napi_key_file = "engine.key"\n[[engines]]\nname = "e0"\nmodel = "{m}"\nport = 8001\n')
    assert load(str(etc / "config.toml")).api_key == KEY


@pytest.mark.parametrize("text, says", [
    ("", "is empty; write the engines' API key into it"),
    ("  \n\n", "is empty; write the engines' API key into it"),
    (f"{KEY} more\n", "must hold one line: the key, in printable ASCII without spaces, at most 4096 "
                      "characters (it goes into an HTTP header)"),
    (f"{KEY}\nsecond line\n", "must hold one line"),
    (f"{KEY}\r\nX-Injected: 1", "must hold one line"),
    ("clé", "must hold one line"),
])
def test_a_key_file_that_holds_no_usable_key(tmp_path, model, text, says):
    f = key_file(tmp_path, text)
    (line,) = problems({"engine_defaults": {"api_key_file": str(f)}, "engines": [engine("e0", model, 8001)]})
    assert line.startswith(f"engine_defaults.api_key_file: {f} {says}"), line
    assert KEY not in line  # what the file holds is never echoed


def test_a_key_file_that_cannot_be_read(tmp_path, model):
    def one(path) -> str:
        (line,) = problems({"engine_defaults": {"api_key_file": str(path)}, "engines": [engine("e0", model, 8001)]})
        return line

    gone = tmp_path / "gone.key"
    assert one(gone) == (f"engine_defaults.api_key_file: no such file: {gone}; write the engines' API key "
                         "into it (one line, mode 0600)")
    assert one(tmp_path) == f"engine_defaults.api_key_file: {tmp_path} is not a regular file; write the key into a file"
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # no writer: opening it must not hang
    assert one(fifo).endswith("is not a regular file; write the key into a file")


def test_a_key_file_others_can_read_is_a_warning(tmp_path, model):
    f = key_file(tmp_path, mode=0o644)
    cfg = build({"engine_defaults": {"api_key_file": str(f)}, "engines": [engine("e0", model, 8001)]})
    assert cfg.api_key == KEY
    assert cfg.warnings == (f"engine_defaults.api_key_file: {f} is readable by group or others (mode 0644); "
                            f"chmod 600 {f}",)


def test_the_key_is_given_once(tmp_path, model):
    f = str(key_file(tmp_path))
    assert problems({"engine_defaults": {"api_key_file": f, "env": {"VLLM_API_KEY": "x"}},
                     "engines": [engine("e0", model, 8001, env={"VLLM_API_KEY": "y"})]}) == [
        "engine_defaults.env: VLLM_API_KEY and engine_defaults.api_key_file both give the engines' key; "
        "keep one (the file: it stays out of the config)",
        "engines[0] (e0).env: VLLM_API_KEY and engine_defaults.api_key_file both give the engines' key; "
        "keep one (the file: it stays out of the config)",
    ]


@pytest.mark.parametrize("args", [["--api-key", KEY], [f"--api-key={KEY}"], ["--api-k", KEY]])
def test_api_key_on_the_command_line_is_refused(model, args):
    msg = ("do not pass --api-key: any local user can read a command line (/proc/PID/cmdline); put the "
           "key in a file and set engine_defaults.api_key_file")
    assert problems({"engines": [engine("e0", model, 8001, args=args)]}) == [f"engines[0] (e0).args: {msg}"]
    assert problems({"engine_defaults": {"args": args}, "engines": [engine("e0", model, 8001)]}) == [
        f"engine_defaults.args: {msg}"]


# -- the header our stdlib helper sends (weight_sync/engine_http.py) ------------------------------


class _Recorder(http.server.BaseHTTPRequestHandler):
    seen: list = []

    def do_GET(self):  # noqa: N802
        self.seen.append(self.headers.get("Authorization"))
        body = b'{"ok": true}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


def test_http_json_sends_the_key_from_the_argument_or_the_environment(monkeypatch):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    _Recorder.seen = []
    try:
        monkeypatch.delenv("VIME_ENGINE_API_KEY", raising=False)
        assert http_json(url, "GET", "/weight_info", timeout=5) == {"ok": True}
        monkeypatch.setenv("VIME_ENGINE_API_KEY", "from-env")
        http_json(url, "GET", "/weight_info", timeout=5)
        http_json(url, "GET", "/weight_info", timeout=5, api_key="given")
    finally:
        server.shutdown()
        server.server_close()
    assert _Recorder.seen == [None, "Bearer from-env", "Bearer given"]
