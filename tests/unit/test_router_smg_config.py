"""[router] kind = "smg": the config accepts it, a spawned SMG gets SMG's binary, `launch` and
flags, and the adapter is the one the daemon builds."""

from __future__ import annotations

import aiohttp
import pytest

from vime.harness.local_daemon import free_port, standin_model
from vime.supervisor.config import ROUTER_ARGS, ConfigError, build
from vime.supervisor.router import KINDS, SmgRouter, make_router
from vime.supervisor.router.child import router_command
from vime.supervisor.router.smg import SPAWN_ARGS


@pytest.fixture
def base(tmp_path) -> dict:
    return {"engines": [{"name": "e0", "model": str(standin_model(tmp_path / "tiny")), "port": 8001}]}


def test_smg_is_a_router_kind(base):
    assert KINDS == ("vllm-router", "smg")
    r = build({**base, "router": {"url": "http://127.0.0.1:30000", "kind": "smg"}}).router
    assert r is not None and r.kind == "smg"
    with pytest.raises(ConfigError) as ei:
        build({**base, "router": {"url": "http://127.0.0.1:30000", "kind": "sglang"}})
    assert any(p.startswith("router.kind: must be one of vllm-router, smg") for p in ei.value.problems)


def test_a_spawned_smg_runs_smg_launch_with_smgs_flags(base):
    port = free_port()
    r = build({**base, "router": {"url": f"http://127.0.0.1:{port}", "kind": "smg", "spawn": True}}).router
    assert r is not None and r.binary == "smg" and r.args == SPAWN_ARGS
    assert router_command(r, "/venv/bin/smg") == [
        "/venv/bin/smg", "launch", *SPAWN_ARGS, "--host", "127.0.0.1", "--port", str(port), "--worker-urls"]
    assert "--worker-startup-timeout-secs" in SPAWN_ARGS and "--prometheus-host" in SPAWN_ARGS
    # Given binary and args win; vllm-router's defaults are untouched.
    mine = build({**base, "router": {"url": f"http://127.0.0.1:{port}", "kind": "smg", "spawn": True,
                                     "args": ["--policy", "random"]}}).router
    assert mine is not None and mine.args == ("--policy", "random")
    assert router_command(mine, "smg")[:4] == ["smg", "launch", "--policy", "random"]
    v = build({**base, "router": {"url": f"http://127.0.0.1:{port}", "spawn": True}}).router
    assert v is not None and v.binary == "vllm-router" and v.args == ROUTER_ARGS
    assert router_command(v, "vllm-router")[1] != "launch"


@pytest.mark.parametrize("args, message", [
    (["--worker-urls", "http://x:1"], "router.args: do not pass --worker-urls"),
    # SMG's admin keys would be on a command line any local user reads.
    (["--control-plane-api-keys", "k:n:admin:s3cret"], "router.args: do not pass --control-plane-api-keys: any local"),
    (["--control-plane-api=k:n:admin:s3cret"], "router.args: do not pass --control-plane-api-keys"),
])
def test_a_spawned_smgs_args_are_checked(base, args, message):
    with pytest.raises(ConfigError) as ei:
        build({**base, "router": {"url": f"http://127.0.0.1:{free_port()}", "kind": "smg", "spawn": True,
                                  "args": args}})
    assert any(p.startswith(message) and "s3cret" not in p for p in ei.value.problems), ei.value.problems


async def test_the_daemon_builds_the_smg_adapter():
    async with aiohttp.ClientSession() as s:
        r = make_router("smg", "http://127.0.0.1:30000/", s, token="t")
        assert isinstance(r, SmgRouter) and r.kind == "smg" and r.url == "http://127.0.0.1:30000"
        assert r.headers == {"Authorization": "Bearer t"}
