"""PROTOCOL STAND-INS, in this process: emulated engines (harness/emulated_engine.py, the
project's one stand-in; not vLLM) served on the running event loop, and a stand-in for the
daemon's routable answer and event stream (the verbs the rollout client reads), for tests
that change weights and versions while requests stream.

    async with InProcessEngines([3, 3], step_s=0.02) as engines:   # /weight_info: "3"
        engines.emulated[0].set_version("4")                        # now makes v4's tokens
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

from aiohttp import web

from vime.harness.emulated_engine import EmulatedEngine
from vime.harness.emulated_model import generate


class InProcessEngines:
    """One emulated engine per version given, each loaded with that version (its tokens are
    made with it, /weight_info says it), serving at once; a decode step takes `step_s`."""

    def __init__(self, versions: list[int], *, step_s: float = 0.0, engine: type[EmulatedEngine] = EmulatedEngine):
        self.versions = versions
        self.step_s = step_s
        self.engine = engine  # a subclass of the stand-in for a fault it has no mode for
        self.emulated: list[EmulatedEngine] = []
        self.urls: list[str] = []
        self._runners: list[web.AppRunner] = []

    async def __aenter__(self) -> "InProcessEngines":
        zero = {k: 0.0 for k in ("boot_s", "first_batch_s", "step_per_seq_s", "prefill_token_s")}
        for v in self.versions:
            e = self.engine(time_scale=1.0, exit_on_death=False, params={**zero, "step_base_s": self.step_s})
            e.set_version(str(v))
            runner = web.AppRunner(e.app(), access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            e.start()
            self.emulated.append(e)
            self._runners.append(runner)
            self.urls.append(f"http://127.0.0.1:{port}")
        return self

    async def __aexit__(self, *exc: Any) -> None:
        for e in self.emulated:
            if e.paused:
                e.resume()
        for r in self._runners:
            await r.cleanup()

    def entry(self, i: int, version: int | None = None) -> dict:
        """Engine i as the daemon's routable answer lists it (at `version`, default its own)."""
        v = self.versions[i] if version is None else version
        return {"name": f"e{i}", "url": self.urls[i], "model": "tiny", "weight_version": v, "incarnation": 1}

    def tokens(self, i: int, prompt: list[int], n: int, version: int | str) -> list[int]:
        """The n tokens engine i makes after `prompt` holding weights `version` (a pure function
        of the context and the weights: what a continuation on them must equal)."""
        return generate(prompt, n, str(version), self.emulated[i].vocab.choices)


class DaemonAnswers:
    """Stand-in for AsyncSupervisorClient's routable_engines / report_failure / events: the
    answer a daemon in `mode` would give; `publish` moves the current version and lists the
    engines as given (each at the version it now holds), then tells the event stream."""

    def __init__(self, engines: list[dict], *, version: int, mode: str = "async", max_staleness: int = 1):
        self.view: dict[str, Any] = {"epoch": 1, "weight_version": version,
                                     "weights": {"mode": mode, "max_staleness": max_staleness}, "engines": engines}
        self.reports: list[tuple[str, str]] = []
        self.pushes: list[dict[str, Any]] = []  # each announced push: begin's arguments, then end's
        self.queue: asyncio.Queue = asyncio.Queue()

    async def routable_engines(self) -> dict:
        return copy.deepcopy(self.view)

    async def report_failure(self, name: str, detail: str, incarnation: int | None = None) -> dict:
        self.reports.append((name, detail))
        return {"counted": True, "state": "SUSPECT"}

    async def events(self):
        yield {"event": "hello", **copy.deepcopy(self.view)}
        while True:
            yield await self.queue.get()

    async def push_begin(self, version: int, engines: list[str], nbytes: int, deadline_s: float) -> str:
        """Records the announcement (the daemon's excuse and re-read are tested on the real one,
        tests/daemon/test_push_announce.py)."""
        self.pushes.append({"version": version, "engines": list(engines), "bytes": nbytes, "deadline_s": deadline_s,
                            "ended": None})
        return f"p{len(self.pushes)}"

    async def push_end(self, push: str, ok: bool, failed: dict[str, str] | None = None) -> dict:
        self.pushes[int(push[1:]) - 1]["ended"] = {"ok": ok, "failed": dict(failed or {})}
        return {"push": push, "outcome": "ok" if ok else "failed"}

    async def publish_weights(self, version: int) -> dict:
        """As the daemon's verb after a push into every engine: all listed at `version`."""
        self.publish(version, [{**e, "weight_version": version} for e in self.view["engines"]])
        return {"version": version, "changed": True}

    def publish(self, version: int, engines: list[dict]) -> None:
        self.view = {**self.view, "epoch": self.view["epoch"] + 1, "weight_version": version, "engines": engines}
        self.queue.put_nowait({"event": "weights_published", "version": version, "epoch": self.view["epoch"]})
