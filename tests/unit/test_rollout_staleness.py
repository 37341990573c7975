"""The staleness bound on samples (async mode): RolloutClient returns no sample with a token more
than max_staleness versions behind the current one; such a sample is regenerated from its prompt
or raised as StaleSample, and counted. PROTOCOL STAND-INS, not vLLM: emulated engines
(harness/emulated_engine.py) in this process and a stand-in for the daemon's answers
(tests/support/standin_inproc.py). Versions move while a request streams."""

from __future__ import annotations

import asyncio

import pytest

from vime.trainer.rollout import OK, STALE, Attempt, RolloutClient, Split, StaleSample

from support.polling import until
from support.standin_inproc import DaemonAnswers, InProcessEngines

PROMPT = [5, 6, 7, 8]
N = 12


def client(daemon: DaemonAnswers, **kw) -> RolloutClient:
    return RolloutClient(daemon, backoff_initial=0.001, backoff_max=0.01, refresh_interval=60.0, **kw)


async def publish_during_the_stream(rollout: RolloutClient, daemon: DaemonAnswers, engines: InProcessEngines,
                                    to: list[int]) -> None:
    """Once the request has streamed tokens, publish each version of `to` in turn, every engine
    loaded with it (so what is generated from now on is the new weights'), and wait until the
    client has read the last one."""
    await until(lambda: any(p.tokens > 0 for p in rollout.progress().values()), timeout=10)
    for v in to:
        for e in engines.emulated:
            e.set_version(str(v))
        daemon.publish(v, [engines.entry(i, v) for i in range(len(engines.emulated))])
    await until(lambda: rollout.weight_version == to[-1], timeout=10)


async def test_a_sample_past_the_bound_is_regenerated_from_its_prompt_and_counted():
    async with InProcessEngines([3], step_s=0.05) as engines:
        daemon = DaemonAnswers([engines.entry(0)], version=3, max_staleness=1)
        async with client(daemon) as rollout:
            task = asyncio.ensure_future(rollout.complete(PROMPT, max_tokens=N, logprobs=1))
            await publish_during_the_stream(rollout, daemon, engines, [4, 5])
            r = await asyncio.wait_for(task, 30)
    # Its first attempt was routed at v3, two versions behind v5 at its end: not returned.
    assert r.attempts == [Attempt("e0", STALE), Attempt("e0", OK)]
    assert r.splits == [Split("e0", 5, 0, N, OK)]
    assert r.token_ids == engines.tokens(0, PROMPT, N, 5)  # regenerated on v5 alone
    (thrown,) = r.started_over
    assert (thrown.engine, thrown.weight_version, thrown.tokens) == ("e0", 3, N)
    assert thrown.reason.startswith("stale: tokens from 3 are more than max_staleness (1) versions behind "
                                    "the current 5")
    st = rollout.stats
    assert (st.stale_samples, st.tokens_regenerated, st.tokens_before_fault, st.succeeded) == (1, N, N, 1)


async def test_a_sample_past_the_bound_is_raised_when_samples_are_dropped():
    async with InProcessEngines([3], step_s=0.05) as engines:
        daemon = DaemonAnswers([engines.entry(0)], version=3, max_staleness=1)
        async with client(daemon, stale_samples="drop") as rollout:
            task = asyncio.ensure_future(rollout.complete(PROMPT, max_tokens=N))
            await publish_during_the_stream(rollout, daemon, engines, [4, 5])
            with pytest.raises(StaleSample, match="more than max_staleness") as ei:
                await asyncio.wait_for(task, 30)
    assert [s.weight_version for s in ei.value.splits] == [3]
    assert (rollout.stats.stale_samples, rollout.stats.failed) == (1, 1)


async def test_a_sample_within_the_bound_is_returned_with_its_version():
    async with InProcessEngines([3], step_s=0.05) as engines:
        daemon = DaemonAnswers([engines.entry(0)], version=3, max_staleness=1)
        async with client(daemon) as rollout:
            task = asyncio.ensure_future(rollout.complete(PROMPT, max_tokens=N))
            await publish_during_the_stream(rollout, daemon, engines, [4])
            r = await asyncio.wait_for(task, 30)
    assert r.attempts == [Attempt("e0", OK)] and r.splits == [Split("e0", 3, 0, N, OK)]
    assert rollout.stats.stale_samples == 0 and not r.started_over


async def test_sync_mode_applies_no_bound_on_samples():
    async with InProcessEngines([3], step_s=0.05) as engines:
        daemon = DaemonAnswers([engines.entry(0)], version=3, mode="sync")
        async with client(daemon) as rollout:
            task = asyncio.ensure_future(rollout.complete(PROMPT, max_tokens=N))
            await publish_during_the_stream(rollout, daemon, engines, [4, 5])
            r = await asyncio.wait_for(task, 30)
    assert r.attempts == [Attempt("e0", OK)] and rollout.stats.stale_samples == 0


async def test_a_cut_request_never_continues_on_older_weights():
    """e0 (v4) dies after tokens; e1 is listed at v3 (within the bound of v4, so routable) but
    older than the tokens so far: the request starts over on it rather than mixing back."""
    async with InProcessEngines([4, 3], step_s=0.05) as engines:
        daemon = DaemonAnswers([engines.entry(0), engines.entry(1)], version=4, max_staleness=1)
        async with client(daemon) as rollout:
            rollout.pick = first_on(rollout, "e0")
            task = asyncio.ensure_future(rollout.complete(PROMPT, max_tokens=N))
            await until(lambda: any(p.tokens >= 2 for p in rollout.progress().values()), timeout=10)
            engines.emulated[0].add_fault("die")
            r = await asyncio.wait_for(task, 30)
    assert r.splits == [Split("e1", 3, 0, N, OK)]
    (thrown,) = r.started_over
    assert thrown.engine == "e0" and thrown.reason.startswith("no routable engine left at weight version 4 or newer")
    assert r.token_ids == engines.tokens(1, PROMPT, N, 3)


def first_on(rollout: RolloutClient, name: str):
    """The client's pick, but the first attempt goes to `name`."""
    pick, first = rollout.pick, [True]

    def chosen(exclude=(), avoid=()):
        if first[0]:
            first[0] = False
            return next(e for e in rollout.engines if e.name == name)
        return pick(exclude, avoid)
    return chosen


def test_an_unknown_stale_samples_choice_is_refused():
    with pytest.raises(ValueError, match="stale_samples must be one of regenerate, drop, got 'keep'"):
        RolloutClient(None, stale_samples="keep")
