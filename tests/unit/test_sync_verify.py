"""The check after a sync (EngineRunner.verify_weights): /weight_info must say the synced version
and the deep probe must answer. A read that answers another version fails the sync at once; one
that got no answer says nothing of the weights and is judged as the heartbeat judges a probe,
failure_threshold in a row. Emulated engines (PROTOCOL STAND-INS, harness/emulated_engine.py) on
the test's loop, /weight_info and the deep probe read for real."""

from __future__ import annotations

import contextlib

import aiohttp
from aiohttp import web

from vime.harness.emulated_engine import EmulatedEngine
from vime.supervisor.config import Config, EngineSpec, ProbePolicy
from vime.supervisor.daemon import Supervisor
from vime.supervisor.engine.runner import EngineRunner

from support.standin_inproc import InProcessEngines


class WeightInfoDown(EmulatedEngine):
    """PROTOCOL STAND-IN: /weight_info answers 503 (a route that cannot be read now) its first
    `down` times, then as the emulated engine does."""

    down = 0
    reads = 0

    async def h_weight_info(self, request: web.Request) -> web.Response:
        type(self).reads += 1
        if type(self).reads <= type(self).down:
            return web.json_response({"error": "unavailable (emulated)"}, status=503)
        return await super().h_weight_info(request)


@contextlib.asynccontextmanager
async def syncing(tmp_path, holds: int, down: int, failure_threshold: int = 3):
    """A runner attached to an engine that holds `holds`, SYNCING, its /weight_info down `down` times."""
    WeightInfoDown.down, WeightInfoDown.reads = down, 0
    async with InProcessEngines([holds], engine=WeightInfoDown) as engines, aiohttp.ClientSession() as session:
        spec = EngineSpec("e0", url=engines.urls[0])
        cfg = Config(engines=(spec,), state_dir=str(tmp_path), log_dir=str(tmp_path), runtime_dir=str(tmp_path),
                     min_healthy=0, probe=ProbePolicy(failure_threshold=failure_threshold))
        sup = Supervisor(cfg)
        r = EngineRunner(spec, cfg, sup.policy, sup.bus, session)
        r.fsm.begin_start("attach", restart=False)
        r.fsm.became_ready(holds, None, rule=sup.policy.rule)
        r.begin_sync("reloading")
        try:
            yield r
        finally:
            r.prober.close()


async def test_a_read_that_got_no_answer_is_tried_again_before_the_sync_fails(tmp_path):
    async with syncing(tmp_path, holds=5, down=2) as r:
        assert await r.verify_weights(5, r.fsm.incarnation) == (True, None)
        assert WeightInfoDown.reads == 3


async def test_failure_threshold_reads_with_no_answer_fail_the_sync_saying_so(tmp_path):
    async with syncing(tmp_path, holds=5, down=3) as r:
        ours, problem = await r.verify_weights(5, r.fsm.incarnation)
        assert ours and problem == "no answer could be read: /weight_info answered 503"
        assert WeightInfoDown.reads == 3


async def test_a_read_that_answers_another_version_fails_the_sync_at_once(tmp_path):
    async with syncing(tmp_path, holds=4, down=0) as r:
        assert await r.verify_weights(5, r.fsm.incarnation) == (True, "/weight_info says v4, not v5")
        assert WeightInfoDown.reads == 1


async def test_a_sync_no_longer_current_is_not_judged(tmp_path):
    async with syncing(tmp_path, holds=5, down=0) as r:
        assert await r.verify_weights(5, r.fsm.incarnation + 1) == (False, None)
