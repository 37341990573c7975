"""An in-flight update, abort + continue (trainer/inflight.py): a new version pushed in waves
while requests stream; the cut requests continue from their tokens, and every sample's spans
are exact (each piece's tokens are what its version's weights make from the prefix before it).
PROTOCOL STAND-INS, not vLLM: emulated engines (harness/emulated_engine.py) in this process, a
stand-in for the daemon's answers (tests/support/standin_inproc.py); the push is the emulated
engine's /update_weight_version (its tokens are made with the version it last loaded)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from vime.trainer.inflight import InFlightUpdate, waves
from vime.trainer.rollout import RolloutClient
from vime.trainer.rollout_types import Engine

from support.polling import until
from support.standin_inproc import DaemonAnswers, InProcessEngines

N = 40


def test_waves_keep_the_serving_floor():
    names = [f"e{i}" for i in range(5)]
    assert waves(names, 0) == [names]
    assert waves(names, 0.5) == [names[:2], names[2:4], names[4:]]  # 3 of 5 serve throughout
    assert waves(names, 0.8) == [[n] for n in names]
    with pytest.raises(ValueError, match="keeps all 1 engine"):
        waves(["e0"], 0.5)
    with pytest.raises(ValueError, match=r"serving_fraction must be in \[0, 1\)"):
        waves(names, 1.0)


async def push_version(engine: Engine, version: int) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{engine.url}/update_weight_version", json={"new_version": str(version)}) as r:
            assert r.status == 200


async def test_a_publish_while_requests_stream_continues_them_with_exact_spans():
    async with InProcessEngines([3, 3, 3, 3], step_s=0.02) as engines:
        daemon = DaemonAnswers([engines.entry(i) for i in range(4)], version=3, max_staleness=1)
        serving: list[int] = []

        async def sample() -> None:  # how many engines serve (not paused), every few ms
            while True:
                serving.append(sum(e.paused is None for e in engines.emulated))
                await asyncio.sleep(0.002)

        async with RolloutClient(daemon, backoff_initial=0.001, backoff_max=0.01, refresh_interval=60.0) as rollout:
            prompts = [[5 + i, 6, 7] for i in range(8)]
            batch = asyncio.ensure_future(asyncio.gather(*(rollout.complete(p, max_tokens=N, logprobs=1)
                                                           for p in prompts)))
            await until(lambda: len(rollout.progress()) == 8 and all(p.tokens >= 3 for p in rollout.progress().values()),
                        timeout=20)
            sampler = asyncio.ensure_future(sample())
            update = InFlightUpdate([rollout], push=push_version, serving_fraction=0.5)
            report = await update.run(4, supervisor=daemon)
            results = await asyncio.wait_for(batch, 60)
            sampler.cancel()

    assert report.waves == [["e0", "e1"], ["e2", "e3"]] and not report.failed and report.serving_min == 2
    assert min(serving) >= 2  # the fleet never below its floor, as the engines themselves said
    assert [e.label for e in engines.emulated] == ["4"] * 4 and daemon.view["weight_version"] == 4
    cut = 0
    for p, r in zip(prompts, results):
        assert r.token_ids is not None and len(r.token_ids) == N and not r.started_over
        for s in r.splits:  # each piece: what its version's weights make from the prefix before it
            made = r.token_ids[s.offset:s.offset + s.tokens]
            assert made == engines.tokens(0, p + r.token_ids[:s.offset], s.tokens, s.weight_version), (r.splits, s)
        versions = [s.weight_version for s in r.splits]
        assert versions == sorted(versions)  # never back to older weights
        cut += versions[0] == 3 and versions[-1] == 4
    assert cut >= 4  # the requests on the first wave's engines were cut and continued on v4
    st = rollout.stats
    assert st.tokens_regenerated == 0 and st.stale_samples == 0 and st.aborted >= 4
