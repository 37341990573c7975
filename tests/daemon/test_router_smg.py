"""The SMG adapter (supervisor/router/smg.py) against the real SMG binary (smg 1.13.0, the
`router` and `test` extras), and against sglang-router 0.3.2 where it can be imported (a smoke
test of the same adapter: tests/support/smg_proc.py says why it is not installed beside SMG).
The workers are PROTOCOL STAND-INS (an aiohttp app answering /health and /v1/models, not vLLM):
what is under test is the router's admin API as the adapter drives it, each call one bounded
attempt whose RouterError says whether a retry can help. The daemon over real engines behind
SMG: tests/engine/test_router_real.py (its [smg] cases).
"""

from __future__ import annotations

import signal
import time

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web

from vime.harness.local_daemon import free_port
from vime.supervisor.router import RouterError, SmgRouter, make_router

from support.smg_proc import SmgProc, available

TIMEOUT = 5.0


class Worker:
    """A PROTOCOL STAND-IN for an OpenAI-compatible engine: what SMG reads to register one."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.runner: web.AppRunner | None = None

    async def start(self) -> "Worker":
        async def health(_: web.Request) -> web.Response:
            return web.Response(status=200)

        async def models(_: web.Request) -> web.Response:
            return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model",
                                                                  "owned_by": "vllm", "max_model_len": 128}]})

        async def other(_: web.Request) -> web.Response:
            return web.json_response({})

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/v1/models", models)
        app.router.add_route("*", "/{tail:.*}", other)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


@pytest.fixture(params=["smg", "sglang-router"])
def router(request, tmp_path):
    why = available(request.param)
    if why:
        pytest.skip(why)
    r = SmgProc(tmp_path / "router.log", kind=request.param).start()
    try:
        yield r
    finally:
        r.kill()


@pytest_asyncio.fixture(loop_scope="function")  # on the test's own loop
async def session():
    async with aiohttp.ClientSession() as s:
        yield s


@pytest_asyncio.fixture(loop_scope="function")
async def workers():
    made: list[Worker] = []

    async def make() -> Worker:
        made.append(await Worker().start())
        return made[-1]

    yield make
    for w in made:
        await w.stop()


async def test_add_list_remove_each_done_when_the_router_has_acted(router, session, workers):
    smg = SmgRouter(router.url, session, kind=router.kind)
    a, b = await workers(), await workers()
    assert await smg.workers(TIMEOUT) == []
    await smg.add(a.url, TIMEOUT)
    # POST answers 202 (queued); the add returns once the router lists the worker, routable.
    assert router.routed() == [a.url]
    await smg.add(a.url, TIMEOUT)  # one it already has: not an error
    await smg.add(b.url + "/", TIMEOUT)
    assert sorted(await smg.workers(TIMEOUT)) == sorted([a.url, b.url + "/"])
    # Removed by another spelling of its URL (normalized): once remove returns, the router no
    # longer routes to it (SMG: draining, then dropped; sglang-router: dropped).
    await smg.remove(b.url.replace("http", "HTTP"), TIMEOUT)
    assert router.routed() == [a.url]
    assert await smg.workers(TIMEOUT) == [a.url]
    await smg.remove(b.url, TIMEOUT)  # not listed any more: not an error
    await smg.remove(f"http://127.0.0.1:{free_port()}", TIMEOUT)  # never listed


async def test_an_add_the_router_cannot_complete_is_a_transient_error_within_its_bound(router, session):
    smg = SmgRouter(router.url, session, kind=router.kind)
    nobody = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(RouterError) as ei:
        await smg.add(nobody, 1.0)
    # Its status polled until the bound: "not ready", or, on a loaded host, the last poll itself
    # unanswered when the bound ran out; transient either way.
    assert ei.value.transient and ("not ready within 1s" in str(ei.value)
                                   or "no answer within the call's bound" in str(ei.value)), ei.value
    assert time.monotonic() - started < 2.0
    assert nobody not in router.routed()


async def test_an_add_while_its_removal_drains_is_retried(router, session, workers):
    if router.kind != "smg":
        pytest.skip("sglang-router 0.3.2 drops a worker at once: no draining")
    smg = SmgRouter(router.url, session)
    a = await workers()
    await smg.add(a.url, TIMEOUT)
    await smg.remove(a.url, TIMEOUT)
    assert [w["status"] for w in router.listing()] == ["draining"]  # SMG's settle time (5 s)
    with pytest.raises(RouterError) as ei:
        await smg.add(a.url, 1.0)
    assert ei.value.transient and "draining" in str(ei.value)


async def test_a_router_that_is_down_or_hung_is_transient_and_bounded(router, session):
    smg = SmgRouter(router.url, session, kind=router.kind)
    router.signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        for call in (smg.workers(0.5), smg.add("http://127.0.0.1:1", 0.5), smg.remove("http://127.0.0.1:1", 0.5)):
            with pytest.raises(RouterError) as ei:
                await call
            assert ei.value.transient, ei.value
        assert time.monotonic() - started < 3 * 0.5 + 1.0
    finally:
        router.signal(signal.SIGCONT)
    router.kill()
    with pytest.raises(RouterError) as ei:
        await smg.workers(1.0)
    assert ei.value.transient and "is the router running" in str(ei.value)


async def test_not_a_router_and_a_bad_token_are_not_retried(tmp_path, session, workers):
    if available("smg"):
        pytest.skip(available("smg"))
    w = await workers()
    with pytest.raises(RouterError) as ei:
        await make_router("smg", w.url, session).workers(TIMEOUT)
    assert not ei.value.transient and "not SMG's worker list" in str(ei.value), ei.value
    r = SmgProc(tmp_path / "router.log", "--control-plane-api-keys", "vime:daemon:admin:s3cret").start(token="s3cret")
    try:
        with pytest.raises(RouterError) as ei:
            await make_router("smg", r.url, session, token="wrong").workers(TIMEOUT)
        assert not ei.value.transient and "refused our token" in str(ei.value), ei.value
        with pytest.raises(RouterError) as ei:
            await make_router("smg", r.url, session).add(w.url, TIMEOUT)
        assert not ei.value.transient
        ours = make_router("smg", r.url, session, token="s3cret")
        await ours.add(w.url, TIMEOUT)
        assert await ours.workers(TIMEOUT) == [w.url]
        await ours.remove(w.url, TIMEOUT)
        assert await ours.workers(TIMEOUT) == []
    finally:
        r.kill()



async def test_a_router_error_status_is_transient_a_refusal_is_not(session):
    """A STAND-IN for SMG's admin API answering what the real one answers only when broken: a
    5xx or 429 (worth retrying), a 400 (not)."""
    answers = {"GET": 503, "POST": 400, "DELETE": 429}

    async def any_route(request: web.Request) -> web.Response:
        status = answers[request.method]
        if request.method == "DELETE":
            return web.json_response({"error": "slow down"}, status=status)
        if request.method == "GET" and request.path == "/workers" and answers["GET"] == 200:
            return web.json_response({"workers": [{"id": "00000000-0000-0000-0000-000000000001",
                                                   "url": "http://127.0.0.1:1", "status": "ready"}]})
        return web.json_response({"error": f"answered {status}"}, status=status)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", any_route)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        smg = SmgRouter(f"http://127.0.0.1:{port}", session)
        with pytest.raises(RouterError) as ei:
            await smg.workers(TIMEOUT)
        assert ei.value.transient and "503" in str(ei.value)
        with pytest.raises(RouterError) as ei:
            await smg.add("http://127.0.0.1:1", TIMEOUT)
        assert not ei.value.transient and "400: answered 400" in str(ei.value)
        answers["GET"] = 200
        with pytest.raises(RouterError) as ei:
            await smg.remove("http://127.0.0.1:1", TIMEOUT)
        assert ei.value.transient and "429" in str(ei.value)
    finally:
        await runner.cleanup()
