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
    # Each wave announced to the daemon as a push of its engines, and ended ok.
    assert [(p["version"], p["engines"], p["ended"]) for p in daemon.pushes] == [
        (4, ["e0", "e1"], {"ok": True, "failed": {}}), (4, ["e2", "e3"], {"ok": True, "failed": {}})]
    assert len(report.pushes) == 2
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


HALF = (0.5, 2, [["e0", "e1"], ["e2", "e3"]])
ALL_AT_ONCE = (0.0, 0, [["e0", "e1", "e2", "e3"]])
ONE_BY_ONE = (0.75, 3, [["e0"], ["e1"], ["e2"], ["e3"]])
FLOORS = [(m, *f) for m in ("abort", "keep", "wait") for f in (HALF, ALL_AT_ONCE)] + [("abort", *ONE_BY_ONE)]


@pytest.mark.parametrize("mode,fraction,floor,plan", FLOORS,
                         ids=[f"{m}-{f:g}" for m, f, _, _ in FLOORS])
async def test_which_engines_serve_through_an_update_never_drops_below_the_floor(mode, fraction, floor, plan):
    """Which engines serve (not paused, as the engines themselves say) is sampled every 2 ms
    through an update whose push takes 50 ms: never fewer than the floor, every engine paused
    once, all four at once when the fraction is 0. And each mode's samples: abort, every
    piece exact; keep, no request cut, the tokens after the update labelled mixed (kv_version)
    and split where the engine froze; wait, every sample made whole by one version."""
    async with InProcessEngines([3, 3, 3, 3], step_s=0.02) as engines:
        daemon = DaemonAnswers([engines.entry(i) for i in range(4)], version=3, max_staleness=1)
        seen: list[frozenset[str]] = []

        async def sample() -> None:
            while True:
                seen.append(frozenset(f"e{i}" for i, e in enumerate(engines.emulated) if e.paused is None))
                await asyncio.sleep(0.002)

        async def slow_push(engine: Engine, version: int) -> None:
            await asyncio.sleep(0.05)
            await push_version(engine, version)

        async with RolloutClient(daemon, backoff_initial=0.001, backoff_max=0.01, refresh_interval=60.0) as rollout:
            prompts = [[9 + i, 6, 7] for i in range(8)]
            batch = asyncio.ensure_future(asyncio.gather(*(rollout.complete(p, max_tokens=N, logprobs=1)
                                                           for p in prompts)))
            await until(lambda: len(rollout.progress()) == 8 and all(p.tokens >= 3 for p in rollout.progress().values()),
                        timeout=20)
            sampler = asyncio.ensure_future(sample())
            report = await InFlightUpdate([rollout], push=slow_push, serving_fraction=fraction, mode=mode).run(
                4, supervisor=daemon)
            sampler.cancel()
            results = await asyncio.wait_for(batch, 60)

    assert report.waves == plan and report.mode == mode and not report.failed and report.serving_min == floor
    assert min(len(s) for s in seen) == floor  # reached, never crossed
    assert set().union(*({f"e{i}" for i in range(4)} - s for s in seen)) == {f"e{i}" for i in range(4)}
    assert [e.label for e in engines.emulated] == ["4"] * 4
    st = rollout.stats
    assert st.tokens_regenerated == 0 and st.started_over == 0
    for p, r in zip(prompts, results):
        assert r.token_ids is not None and len(r.token_ids) == N
        assert [s.offset for s in r.splits] == [sum(s.tokens for s in r.splits[:i]) for i in range(len(r.splits))]
        for s in r.splits:  # the emulator's tokens depend on the context and the weights, not on the KV
            assert r.token_ids[s.offset:s.offset + s.tokens] == engines.tokens(
                0, p + r.token_ids[:s.offset], s.tokens, s.weight_version), (r.splits, s)
        versions = [s.weight_version for s in r.splits]
        assert versions == sorted(versions) and r.weight_version == versions[-1]
    mixed = [r for r in results if any(s.kv_version is not None for s in r.splits)]
    if mode == "abort":
        assert not mixed and st.aborted >= 4 and sum(r.continued for r in results) >= 4
    elif mode == "keep":
        # The first wave's requests were frozen mid-stream and went on over their old KV: 2
        # pieces, the second at 4 over 3's KV (a later wave's may have ended before it); none
        # cut, none continued.
        assert len(mixed) >= 2 * len(plan[0]) and st.aborted == 0 and st.continued == 0
        assert not any(r.continued for r in results)
        assert all(len(r.splits) == 1 and r.weight_version == 3 for r in results if r not in mixed)
        for r in mixed:
            assert [(s.weight_version, s.kv_version, s.outcome) for s in r.splits] == [(3, None, "kept"), (4, 3, "ok")]
            assert r.splits[0].tokens == report.kept[r.engine][r.request_id] >= 3 and r.tokens_reused == 0
    else:  # drained on the old weights: every sample one version's, nothing cut
        assert not mixed and st.continued == 0 and all(len(r.splits) == 1 for r in results)
        assert {r.weight_version for r in results} == {3}


async def test_each_wave_is_an_announced_push_and_a_failed_engine_is_reported_in_its_end():
    """Waves [e0], [e1]; e1's push fails. Each push is pushed inside its own wave's announcement
    (begun, not yet ended), and e1's wave ends not ok, naming it; e1 is resumed at v3."""
    async with InProcessEngines([3, 3]) as engines:
        daemon = DaemonAnswers([engines.entry(i) for i in range(2)], version=3, max_staleness=1)
        open_at_push: list[tuple[str, list[str]]] = []

        async def push(engine: Engine, version: int) -> None:
            (current,) = [p for p in daemon.pushes if p["ended"] is None]
            open_at_push.append((engine.name, current["engines"]))
            if engine.name == "e1":
                raise RuntimeError("collective timed out")
            await push_version(engine, version)

        async with RolloutClient(daemon, refresh_interval=60.0) as rollout:
            report = await InFlightUpdate([rollout], push=push, serving_fraction=0.5, timeout=5.0,
                                          nbytes=1234).run(4, supervisor=daemon)
    assert open_at_push == [("e0", ["e0"]), ("e1", ["e1"])]
    assert [(p["engines"], p["bytes"], p["deadline_s"], p["ended"]) for p in daemon.pushes] == [
        (["e0"], 1234, 15.0, {"ok": True, "failed": {}}),
        (["e1"], 1234, 15.0, {"ok": False, "failed": {"e1": "RuntimeError: collective timed out"}})]
    assert report.failed == {"e1": "RuntimeError: collective timed out"}
    assert [e.label for e in engines.emulated] == ["4", "3"]
