"""The check after a sync (EngineRunner.verify_weights): /weight_info must say the synced version
and the deep probe must answer. A read that answers another version fails the sync at once; one
that got no answer says nothing of the weights and is tried again as the heartbeat re-probes (one
timeout after the last try began), failure_threshold in a row. Emulated engines (PROTOCOL
STAND-INS, harness/emulated_engine.py) on the test's loop, /weight_info and the deep probe read
for real."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, AsyncIterator

import aiohttp
from aiohttp import web

from vime.harness.emulated_engine import EmulatedEngine
from vime.supervisor.config import Config, EngineSpec, ProbePolicy
from vime.supervisor.daemon import Supervisor
from vime.supervisor.engine.runner import EngineRunner

from support.standin_inproc import InProcessEngines

TIMEOUT = 0.3  # the probe timeout: the spacing of the tries


class WeightInfoDown(EmulatedEngine):
    """PROTOCOL STAND-IN: /weight_info answers 503 (a route that cannot be read now) its first
    `down` times, then as the emulated engine does; `reads` holds when each read came."""

    down = 0

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        self.reads: list[float] = []

    async def h_weight_info(self, request: web.Request) -> web.Response:
        self.reads.append(time.monotonic())
        if len(self.reads) <= self.down:
            return web.json_response({"error": "unavailable (emulated)"}, status=503)
        return await super().h_weight_info(request)


@contextlib.asynccontextmanager
async def syncing(tmp_path, holds: int, down: int) -> AsyncIterator[tuple[EngineRunner, WeightInfoDown]]:
    """A runner SYNCING an attached engine that holds `holds`, its /weight_info down `down` times."""
    engine = type("Down", (WeightInfoDown,), {"down": down})  # a class per test: nothing shared
    async with InProcessEngines([holds], engine=engine) as engines, aiohttp.ClientSession() as session:
        spec = EngineSpec("e0", url=engines.urls[0])
        cfg = Config(engines=(spec,), state_dir=str(tmp_path), log_dir=str(tmp_path), runtime_dir=str(tmp_path),
                     min_healthy=0, probe=ProbePolicy(timeout=TIMEOUT, failure_threshold=3))
        sup = Supervisor(cfg)
        r = EngineRunner(spec, cfg, sup.policy, sup.bus, session)
        r.fsm.begin_start("attach", restart=False)
        r.fsm.became_ready(holds, None, rule=sup.policy.rule)
        r.begin_sync("reloading")
        emulated = engines.emulated[0]
        assert isinstance(emulated, WeightInfoDown)
        try:
            yield r, emulated
        finally:
            r.prober.close()


async def test_a_read_that_got_no_answer_is_tried_again_one_timeout_later(tmp_path):
    async with syncing(tmp_path, holds=5, down=2) as (r, engine):
        assert await r.verify_weights(5, r.fsm.incarnation) == (True, None)
        assert len(engine.reads) == 3
        gaps = [b - a for a, b in zip(engine.reads, engine.reads[1:])]
        assert min(gaps) >= 0.9 * TIMEOUT, gaps  # a 503 comes at once: the next try waits


async def test_failure_threshold_reads_with_no_answer_fail_the_sync_saying_so(tmp_path):
    async with syncing(tmp_path, holds=5, down=3) as (r, engine):
        ours, problem = await r.verify_weights(5, r.fsm.incarnation)
        assert ours and problem == "no answer could be read: /weight_info answered 503"
        assert len(engine.reads) == 3


async def test_a_read_that_answers_another_version_fails_the_sync_at_once(tmp_path):
    async with syncing(tmp_path, holds=4, down=0) as (r, engine):
        assert await r.verify_weights(5, r.fsm.incarnation) == (True, "/weight_info says v4, not v5")
        assert len(engine.reads) == 1


async def test_an_engine_gone_between_tries_is_not_judged(tmp_path):
    async with syncing(tmp_path, holds=5, down=3) as (r, engine):
        task = asyncio.ensure_future(r.verify_weights(5, r.fsm.incarnation))
        while not engine.reads:
            await asyncio.sleep(0.01)
        r.fsm.exited("gone")  # its death seen while the check waits to try again
        assert await task == (False, None)
        assert len(engine.reads) == 1
