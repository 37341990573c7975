"""Issue 13, bad config and bad input: each fault through the daemon's public interface.

The daemon is `python -m vime.supervisor` as a child (harness/local_daemon.Daemon); --check-config
is the real CLI. Engines are attached: either urls nobody listens on, or protocol stand-ins
served from a thread of this test (aiohttp, not vLLM) that also answer the checkpoint reload
routes (/pause, /collective_rpc reload_weights, /update_weight_version, /resume).
"""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from vime.supervisor.client import Forbidden, SupervisorClient
from vime.harness.local_daemon import Daemon, free_port, write_config

from support.daemons import start_answering, stop_removing_run_dir
from support.polling import wait_until
from support.standins import AttachedStandIns

REPO = Path(__file__).resolve().parents[2]
PREFIX = "vime-supervisor: config error: "
NOBODY = 65534


# -- helpers ----------------------------------------------------------------------------------


from test_control_socket import UnixHTTPConnection  # noqa: E402  (one raw client for the socket tests)


def call(sock: str, method: str, path: str, body=None, *, timeout: float = 10.0):
    conn = UnixHTTPConnection(sock, timeout)
    try:
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def jcall(sock: str, method: str, path: str, body=None, **kw) -> tuple[int, dict]:
    code, data = call(sock, method, path, body, **kw)
    return code, json.loads(data)


def status(sock: str) -> dict:
    code, doc = jcall(sock, "GET", "/v1/status")
    assert code == 200, doc
    return doc


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "VIME_SUPERVISOR_CONFIG"}
    return subprocess.run([sys.executable, "-m", "vime.supervisor", *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)


def cli_config(tmp_path: Path, *, supervisor: dict | None = None, health: dict | None = None,
               engines: list[dict] | None = None) -> Path:
    return write_config(
        tmp_path / "config.toml",
        supervisor={"runtime_dir": str(tmp_path / "run"), "log_dir": str(tmp_path / "logs"), **(supervisor or {})},
        health_check={"first_wait": 30.0, "interval": 1.0, "timeout": 0.5, **(health or {})},
        engines=engines or [{"name": "e0", "url": "http://127.0.0.1:8001"}],
    )


def check_refused(cfg: Path, *flags: str) -> list[str]:
    """--check-config refuses the file: exit 2, no traceback; the problem lines."""
    r = run_cli("--config", str(cfg), "--check-config", *flags)
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.splitlines()
    assert lines[-1].endswith("nothing was started"), lines
    return [line.removeprefix(PREFIX) for line in lines[:-1]]


def start_daemon(root: Path, engines: list[dict], *, supervisor: dict | None = None,
                 health: dict | None = None) -> Daemon:
    root.mkdir(parents=True, exist_ok=True)
    run = tempfile.mkdtemp(prefix="vime-in-", dir="/tmp")
    cfg = write_config(
        root / "supervisor.toml",
        supervisor={"runtime_dir": run, "log_dir": str(root / "logs"), "stop_timeout": 2.0, **(supervisor or {})},
        health_check={"first_wait": 20.0, "interval": 1.0, "timeout": 0.9, **(health or {})},
        engines=engines,
    )
    return start_answering(cfg, status)


def stop_daemon(d: Daemon) -> None:
    stop_removing_run_dir(d, 30)


def unheard_engines(n: int = 2) -> list[dict]:
    return [{"name": f"e{i}", "url": f"http://127.0.0.1:{free_port()}"} for i in range(n)]


# -- a checkpoint on disk, without torch --------------------------------------------------------


def write_safetensors(path: Path, header: object, data: bytes = b"") -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def good_checkpoint(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 4}))
    write_safetensors(d / "model.safetensors", {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
                      b"\0" * 8)
    return d


def all_running(sock: str, version=None) -> bool:
    engines = status(sock)["engines"]
    return all(e["state"] == "RUNNING" and e["weight_version"] == version for e in engines)


# -- 10. NaN timings, sync_timeout <= 0 ---------------------------------------------------------


def test_fault10_nan_and_nonpositive_timings_rejected(tmp_path):
    cfg = cli_config(tmp_path, health={"interval": float("nan")})
    (line,) = check_refused(cfg)
    assert line.startswith("health_check.interval: must be a finite number"), line
    cfg = cli_config(tmp_path, health={"timeout": float("inf"), "first_wait": float("inf")})
    lines = check_refused(cfg)
    assert any(x.startswith("health_check.timeout: must be a finite number") for x in lines), lines
    for bad in (0.0, -5.0, float("nan")):
        cfg = cli_config(tmp_path, supervisor={"sync_timeout": bad})
        lines = check_refused(cfg)
        assert any(x.startswith("supervisor.sync_timeout: must be") for x in lines), lines
    # Flags are numbers too: argparse's float() takes "nan".
    cfg = cli_config(tmp_path)
    assert run_cli("--config", str(cfg), "--check-config").returncode == 0
    lines = check_refused(cfg, "--rollout-health-check-interval", "nan")
    assert any(x.startswith("health_check.interval: must be a finite number") for x in lines), lines
    lines = check_refused(cfg, "--backoff-max", "inf")
    assert any(x.startswith("restart.backoff_max: must be a finite number") for x in lines), lines


# -- 12. a bad engine URL -----------------------------------------------------------------------


@pytest.mark.parametrize("url, says", [
    ("http://[::1", "engines[0] (e0).url: "),
    ("http://127.0.0.1:99999", "engines[0] (e0).url: port"),
    ("http://127.0.0.1:0", "engines[0] (e0).url: port"),
    ("http://:8000", "engines[0] (e0).url: "),
    ("http://127.0.0.1:80a", "engines[0] (e0).url: "),
])
def test_fault12_bad_engine_url_rejected(tmp_path, url, says):
    cfg = cli_config(tmp_path, engines=[{"name": "e0", "url": url}])
    (line,) = check_refused(cfg)
    assert line.startswith(says), line


# -- 13. start-up failures --check-config let through -------------------------------------------


def test_fault13_check_config_catches_startup_failures(tmp_path):
    long_dir = tmp_path / ("r" * 120)
    cfg = cli_config(tmp_path, supervisor={"runtime_dir": str(long_dir)})
    (line,) = check_refused(cfg)
    assert line.startswith("supervisor.runtime_dir: ") and "too long" in line, line

    cfg = cli_config(tmp_path, supervisor={"socket_group": "no-such-group-vime"})
    (line,) = check_refused(cfg)
    assert line.startswith("supervisor.socket_group: no group named 'no-such-group-vime'"), line

    # A runtime_dir that is a file, or that others may write into (they could replace the socket).
    afile = tmp_path / "afile"
    afile.write_text("")
    cfg = cli_config(tmp_path, supervisor={"runtime_dir": str(afile / "run")})
    (line,) = check_refused(cfg)
    assert line.startswith("supervisor.runtime_dir: "), line
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    cfg = cli_config(tmp_path, supervisor={"runtime_dir": str(open_dir)})
    (line,) = check_refused(cfg)
    assert line.startswith("supervisor.runtime_dir: ") and "writable" in line, line

    # What --check-config passes, start-up survives: the daemon starts, no traceback.
    cfg = cli_config(tmp_path, supervisor={"socket_group": "0", "state_dir": str(tmp_path / "state")})
    assert run_cli("--config", str(cfg), "--check-config").returncode == 0
    d = Daemon(cfg)
    try:
        sock = str(tmp_path / "run" / "supervisor.sock")
        wait_until(lambda: os.path.exists(sock), 20, "socket")
        assert status(sock)["engines"]
    finally:
        d.terminate(30)
    assert not [x for x in d.raw if x.startswith("Traceback")]
    assert not os.path.exists(sock)


# -- 14. weight versions beyond what every consumer accepts -------------------------------------


def test_fault14_huge_weight_version_rejected(tmp_path):
    d = start_daemon(tmp_path, unheard_engines())
    try:
        for v in (10 ** 400, 2 ** 63, -1):
            code, doc = jcall(d.sock, "POST", "/v1/weights", f'{{"version": {v}}}'.encode())
            assert code == 400, (v, doc)
            assert "version" in doc["error"]["message"] and "2**63" in doc["error"]["message"], doc
        assert status(d.sock)["weight_version"] is None
        code, body = call(d.sock, "GET", "/v1/metrics")
        assert code == 200, body
        biggest = 2 ** 63 - 1
        code, doc = jcall(d.sock, "POST", "/v1/weights", {"version": biggest})
        assert code == 200, doc
        code, body = call(d.sock, "GET", "/v1/metrics")
        assert code == 200, body
        # A huge version elsewhere gets 400 too, never 500.
        for path in ("/v1/engines/e0/sync/begin", "/v1/engines/e0/sync/end"):
            code, doc = jcall(d.sock, "POST", path, f'{{"version": {10 ** 400}, "ok": true}}'.encode())
            assert code == 400, (path, doc)
        journal = json.loads((tmp_path / "state" / "journal.json").read_text())
        assert journal["weight_version"] == biggest
    finally:
        stop_daemon(d)


# -- 15, 17, 18. bad checkpoints ----------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpt_daemon(tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("ckd"), unheard_engines())
    try:
        yield d
    finally:
        stop_daemon(d)


def publish_refused(d: Daemon, path: str, mentions: str | None = None, timeout: float = 10.0) -> str:
    before = status(d.sock)["weight_version"]
    code, doc = jcall(d.sock, "POST", "/v1/weights", {"version": 100, "checkpoint": path}, timeout=timeout)
    assert code == 400, doc
    assert doc["error"]["code"] == "bad_request", doc
    msg = doc["error"]["message"]
    if mentions:
        assert mentions in msg, msg
    assert status(d.sock)["weight_version"] == before
    return msg


def malformed(root: Path, kind: str) -> Path:
    d = good_checkpoint(root / kind)
    if kind == "shard_is_a_directory":
        (d / "extra.safetensors").mkdir()
    elif kind == "header_is_a_list":
        write_safetensors(d / "model.safetensors", [1, 2, 3])
    elif kind == "tensor_entry_not_a_table":
        write_safetensors(d / "model.safetensors", {"w": 5})
    elif kind == "no_data_offsets":
        write_safetensors(d / "model.safetensors", {"w": {"dtype": "F32", "shape": [2]}}, b"\0" * 8)
    elif kind == "bad_data_offsets":
        write_safetensors(d / "model.safetensors", {"w": {"dtype": "F32", "data_offsets": ["a", None]}})
    elif kind == "config_is_a_list":
        (d / "config.json").write_text("[1, 2]")
    elif kind == "config_is_a_directory":
        (d / "config.json").unlink()
        (d / "config.json").mkdir()
    elif kind == "weight_map_is_a_list":
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["model.safetensors"]}))
    elif kind == "index_is_a_list":
        (d / "model.safetensors.index.json").write_text("[]")
    elif kind == "weight_map_names_a_non_string":
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": 3}}))
    elif kind == "config_not_utf8":
        (d / "config.json").write_bytes(b"\xff\xfe{")
    return d


@pytest.mark.parametrize("kind", [
    "shard_is_a_directory", "header_is_a_list", "tensor_entry_not_a_table", "no_data_offsets",
    "bad_data_offsets", "config_is_a_list", "config_is_a_directory", "weight_map_is_a_list",
    "index_is_a_list", "weight_map_names_a_non_string", "config_not_utf8",
])
def test_fault15_malformed_checkpoint_gets_400(ckpt_daemon, tmp_path, kind):
    publish_refused(ckpt_daemon, str(malformed(tmp_path, kind)))


def test_fault15_good_handmade_checkpoint_is_accepted(tmp_path):
    # The hand-made checkpoint the malformed ones start from is itself valid.
    d = start_daemon(tmp_path / "d", unheard_engines())
    try:
        code, doc = jcall(d.sock, "POST", "/v1/weights", {"version": 1, "checkpoint": str(good_checkpoint(tmp_path / "c"))})
        assert code == 200, doc
    finally:
        stop_daemon(d)


def test_fault17_overlong_checkpoint_path_gets_400(ckpt_daemon):
    publish_refused(ckpt_daemon, "/" + "a" * 300, mentions="too long")
    publish_refused(ckpt_daemon, "/tmp/" + "/".join(["b" * 200] * 25), mentions="too long")


@pytest.mark.parametrize("which", ["model.safetensors", "config.json", "model.safetensors.index.json"])
def test_fault18_fifo_in_checkpoint_does_not_block_the_loop(ckpt_daemon, tmp_path, which):
    d = good_checkpoint(tmp_path / "ck")
    (d / which).unlink(missing_ok=True)
    os.mkfifo(d / which)
    result: dict = {}

    def publish():
        try:
            result["msg"] = publish_refused(ckpt_daemon, str(d), timeout=20)
        except BaseException as e:  # noqa: BLE001
            result["error"] = e

    t = threading.Thread(target=publish, daemon=True)
    t.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    code, _ = call(ckpt_daemon.sock, "GET", "/v1/status", timeout=5)
    assert code == 200 and time.monotonic() - t0 < 2
    t.join(20)
    if t.is_alive():  # unblock the daemon so that the module's other tests can go on
        fd = os.open(d / which, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        t.join(10)
        pytest.fail("publishing a checkpoint with a FIFO in it never answered")
    assert "error" not in result, result
    assert "regular file" in result["msg"], result["msg"]


# -- 7. reloads time out only on the engine's work ----------------------------------------------


def test_fault7_reload_timeout_starts_when_the_engine_is_asked(tmp_path):
    engines = AttachedStandIns(26, reload_s=1.2)
    d = start_daemon(tmp_path / "d", engines.engines(), supervisor={"sync_timeout": 4.0, "min_healthy": 0},
                     health={"interval": 2.0, "timeout": 1.5})
    try:
        wait_until(lambda: all_running(d.sock, None), 60, "26 stand-ins RUNNING")
        code, doc = jcall(d.sock, "POST", "/v1/weights", {"version": 1, "checkpoint": str(good_checkpoint(tmp_path / "c"))})
        assert code == 200, doc

        def settled():
            engines_ = status(d.sock)["engines"]
            return engines_ if all(e["state"] in ("RUNNING", "UNHEALTHY") for e in engines_) else None

        engines_ = wait_until(settled, 60, "every engine reloaded or condemned")
        bad = {e["name"]: e["reason"] for e in engines_ if e["state"] != "RUNNING"}
        assert not bad, bad
        assert all(e["weight_version"] == 1 for e in engines_)
        assert len(engines.reloads) == 26
        failed = [e for e in d.events if e.get("event") == "sync.poisoned"]
        assert not failed, failed
    finally:
        stop_daemon(d)
        engines.close()


def test_fault7_reload_failure_reason_is_never_empty(tmp_path):
    engines = AttachedStandIns(1, reload_s=6)  # never within sync_timeout (1 s)
    d = start_daemon(tmp_path / "d", engines.engines(), supervisor={"sync_timeout": 1.0, "min_healthy": 0})
    try:
        wait_until(lambda: all_running(d.sock, None), 30, "stand-in RUNNING")
        code, doc = jcall(d.sock, "POST", "/v1/weights", {"version": 1, "checkpoint": str(good_checkpoint(tmp_path / "c"))})
        assert code == 200, doc
        ev = d.wait_for(lambda e: e.get("event") == "sync.poisoned", 20)
        assert not ev["why"].rstrip().endswith("failed:"), ev
        assert "1s" in ev["why"], ev
    finally:
        stop_daemon(d)
        engines.close()


# -- also examine: a silent agent, event-stream readers, stale failure reports, server uid ------


def test_silent_agent_does_not_block_the_checkpoint_fallback(tmp_path):
    engines = AttachedStandIns(1)
    d = start_daemon(tmp_path / "d", engines.engines(), supervisor={"sync_timeout": 2.0, "min_healthy": 0})
    agent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        wait_until(lambda: all_running(d.sock, None), 30, "stand-in RUNNING")
        agent.connect(d.sock)  # an agent that connects, reads nothing, answers nothing
        agent.sendall(b"GET /v1/events?role=agent HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.5)
        code, doc = jcall(d.sock, "POST", "/v1/weights", {"version": 1, "checkpoint": str(good_checkpoint(tmp_path / "c"))})
        assert code == 200, doc
        wait_until(lambda: all_running(d.sock, 1), 20, "reloaded from the checkpoint after the agent stayed silent")
        assert engines.reloads
    finally:
        agent.close()
        stop_daemon(d)
        engines.close()


def test_event_stream_readers_are_capped(tmp_path):
    d = start_daemon(tmp_path, unheard_engines())
    held = []
    try:
        refused = None
        for i in range(300):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(10)
            s.connect(d.sock)
            s.sendall(b"GET /v1/events HTTP/1.1\r\nHost: x\r\n\r\n")
            head = s.recv(200)
            held.append(s)
            if not head.startswith(b"HTTP/1.1 200"):
                refused = (i, head)
                break
        assert refused is not None, "300 event-stream readers were all accepted"
        assert refused[1].startswith(b"HTTP/1.1 429"), refused
        assert refused[0] >= 16, refused
        code, _ = call(d.sock, "GET", "/v1/status")
        assert code == 200
    finally:
        for s in held:
            s.close()
        stop_daemon(d)


def test_failure_report_for_an_older_incarnation_is_ignored(tmp_path):
    engines = AttachedStandIns(1)
    d = start_daemon(tmp_path / "d", engines.engines(), supervisor={"min_healthy": 0},
                     health={"failure_threshold": 2})
    try:
        wait_until(lambda: all_running(d.sock, None), 30, "stand-in RUNNING")
        (e,) = status(d.sock)["engines"]
        inc = e["incarnation"]
        code, doc = jcall(d.sock, "POST", "/v1/engines/s0/failures", {"detail": "late", "incarnation": inc - 1})
        assert code == 200, doc
        assert doc["counted"] is False and "incarnation" in doc["message"], doc
        assert status(d.sock)["engines"][0]["consecutive_failures"] == 0
        code, doc = jcall(d.sock, "POST", "/v1/engines/s0/failures", {"detail": "now", "incarnation": inc})
        assert code == 200 and doc["counted"] is True, doc
        code, doc = jcall(d.sock, "POST", "/v1/engines/s0/failures", {"detail": "x", "incarnation": 10 ** 30})
        assert code == 400, doc
        with SupervisorClient(d.sock) as c:
            assert c.report_failure("s0", "late", incarnation=inc - 1)["counted"] is False
    finally:
        stop_daemon(d)
        engines.close()


def test_client_refuses_a_server_of_another_uid(tmp_path):
    run = tempfile.mkdtemp(prefix="vime-fake-", dir="/tmp")
    os.chmod(run, 0o777)  # the impostor needs to create its socket here
    sock = os.path.join(run, "supervisor.sock")
    server = subprocess.Popen([sys.executable, "-c", f"""
import os, socket
os.setgid({NOBODY}); os.setuid({NOBODY})
s = socket.socket(socket.AF_UNIX); s.bind({sock!r}); s.listen(8)
while True:
    c, _ = s.accept()
    c.recv(65536)
    body = b'{{"engines": [], "round": null}}'
    c.sendall(b'HTTP/1.1 200 OK\\r\\nContent-Type: application/json\\r\\nContent-Length: ' + str(len(body)).encode() + b'\\r\\n\\r\\n' + body)
    c.close()
"""])
    if os.getuid() != 0:
        pytest.skip("needs root to run a server as another uid")
    try:
        wait_until(lambda: os.path.exists(sock), 10, "impostor socket")
        with pytest.raises(Forbidden) as ei:
            SupervisorClient(sock, connect_timeout=2).status()
        assert f"uid {NOBODY}" in ei.value.message, ei.value.message
    finally:
        server.kill()
        server.wait(10)
        import shutil

        shutil.rmtree(run, ignore_errors=True)


def test_stalled_event_stream_reader_is_dropped(tmp_path):
    d = start_daemon(tmp_path, unheard_engines(1), health={"first_wait": 2.0})
    reader = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        wait_until(lambda: status(d.sock)["engines"][0]["state"] == "EXITED", 20, "e0 EXITED")
        mark = d.mark()
        reader.connect(d.sock)  # asks for the stream, then reads nothing
        reader.sendall(b"GET /v1/events HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.5)
        detail = "x" * 60000  # each report is one ~60 KB event: a few fill the socket's buffers
        for _ in range(40):
            code, doc = jcall(d.sock, "POST", "/v1/engines/e0/failures", {"detail": detail})
            assert code == 200, doc
        ev = d.wait_for(lambda e: e.get("event") == "control.stream_stalled", 30, after=mark)
        assert ev["timeout"] > 0
        code, _ = call(d.sock, "GET", "/v1/status")
        assert code == 200
        time.sleep(1.0)
        assert not [x for x in d.raw if x.startswith("Traceback") or "Error handling request" in x]
    finally:
        reader.close()
        stop_daemon(d)
