"""The staleness bound on samples (async mode): RolloutClient returns no sample with a token more
than max_staleness versions behind the current one; such a sample is regenerated from its prompt
or raised as StaleSample, and counted. PROTOCOL STAND-INS, not vLLM: emulated engines
(harness/emulated_engine.py) in this process and a stand-in for the daemon's answers
(tests/support/standin_inproc.py). Versions move while a request streams."""

from __future__ import annotations

import asyncio

import pytest

from vime.trainer.rollout import (OK, SERVER_ERROR, SPAN_BRACKET, SPAN_READ, STALE, Attempt, NoEngineAvailable, RolloutClient, Split,
                                  StaleSample)

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
    assert r.splits == [Split("e0", 5, 0, N, OK, span=SPAN_READ)]  # e0's /weight_info said 5 before and after
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
    # e0 changed weights mid-stream (its /weight_info said 3 before, 4 after): the piece says so,
    # at its oldest version for the bound.
    assert r.attempts == [Attempt("e0", OK)] and r.splits == [Split("e0", 3, 0, N, OK, span=SPAN_BRACKET, weight_version_end=4)]
    assert rollout.stats.stale_samples == 0 and not r.started_over


async def test_sync_mode_applies_no_bound_on_samples():
    async with InProcessEngines([3], step_s=0.05) as engines:
        daemon = DaemonAnswers([engines.entry(0)], version=3, mode="sync")
        async with client(daemon) as rollout:
            task = asyncio.ensure_future(rollout.complete(PROMPT, max_tokens=N))
            await publish_during_the_stream(rollout, daemon, engines, [4, 5])
            r = await asyncio.wait_for(task, 30)
    assert r.attempts == [Attempt("e0", OK)] and rollout.stats.stale_samples == 0


async def killed_mid_stream(rollout: RolloutClient, engines: InProcessEngines) -> asyncio.Future:
    """A request of N tokens, e0 killed once it has streamed 2 of them (the request is on e0:
    the only engine listed, or the client's pick made so). The request, running."""
    task = asyncio.ensure_future(rollout.complete(PROMPT, max_tokens=N))
    await until(lambda: any(p.tokens >= 2 for p in rollout.progress().values()), timeout=10)
    engines.emulated[0].add_fault("die")
    return task


async def test_a_cut_request_never_continues_on_older_weights():
    """e0 (v4) dies after tokens; e1 is listed at v3 (within the bound of v4, so routable, and
    admitting new requests with max_staleness 2) but older than the tokens so far: the request
    starts over on it rather than mixing back."""
    async with InProcessEngines([4, 3], step_s=0.05) as engines:
        daemon = DaemonAnswers([engines.entry(0), engines.entry(1)], version=4, max_staleness=2)
        async with client(daemon) as rollout:
            rollout.pick = first_on(rollout, "e0")
            task = await killed_mid_stream(rollout, engines)
            r = await asyncio.wait_for(task, 30)
    assert r.splits == [Split("e1", 3, 0, N, OK, span=SPAN_READ)]
    (thrown,) = r.started_over
    assert thrown.engine == "e0" and thrown.reason.startswith("no routable engine left at weight version 4 or newer")
    assert r.token_ids == engines.tokens(1, PROMPT, N, 3)


async def test_a_cut_request_whose_engine_died_waits_for_the_one_listed_in_its_place():
    """e0 (v4), the only listed engine, dies after tokens; e1 (v4, a warm spare) is listed in
    its place a moment later, as the daemon promotes a spare or restarts an engine. The cut
    request waits for it (starting over would need an engine too) and continues there:
    nothing regenerated."""
    async with InProcessEngines([4, 4], step_s=0.05) as engines:
        daemon = DaemonAnswers([engines.entry(0)], version=4, max_staleness=1)
        async with client(daemon) as rollout:
            task = await killed_mid_stream(rollout, engines)
            await until(lambda: daemon.reports, timeout=10)  # e0's failure seen: nothing else listed
            await asyncio.sleep(0.3)
            assert not task.done()
            daemon.publish(4, [engines.entry(1, 4)])  # the spare, listed in e0's place
            r = await asyncio.wait_for(task, 30)
    first, last = r.splits
    assert (first.engine, last.engine, first.tokens + last.tokens) == ("e0", "e1", N)
    assert r.token_ids == engines.tokens(0, PROMPT, N, 4)  # as if never cut
    assert r.started_over == [] and rollout.stats.tokens_regenerated == 0


async def test_a_cut_request_with_no_engine_listed_in_time_is_raised_saying_why():
    async with InProcessEngines([4], step_s=0.05) as engines:
        daemon = DaemonAnswers([engines.entry(0)], version=4, max_staleness=1)
        async with client(daemon, request_timeout=1.0) as rollout:
            task = await killed_mid_stream(rollout, engines)
            with pytest.raises(NoEngineAvailable, match=r"no other engine listed in [\d.]+s \(failed this request: "
                                                         r"e0\); not continued: no routable engine left at weight "
                                                         r"version 4 or newer"):
                await asyncio.wait_for(task, 30)
    assert rollout.stats.tokens_regenerated == 0


async def test_a_cut_request_continues_on_its_engine_restarted_under_the_same_name():
    """e0 dies after tokens and the daemon restarts it in place: the same name, a new
    incarnation (here served at e1's address). The new process has not failed the request: it
    is continued there, nothing regenerated."""
    async with InProcessEngines([4, 4], step_s=0.05) as engines:
        daemon = DaemonAnswers([engines.entry(0)], version=4, max_staleness=1)
        async with client(daemon, request_timeout=10.0) as rollout:
            task = await killed_mid_stream(rollout, engines)
            await until(lambda: daemon.reports, timeout=10)
            await asyncio.sleep(0.2)
            daemon.publish(4, [{**engines.entry(1, 4), "name": "e0", "incarnation": 2}])
            r = await asyncio.wait_for(task, 30)
    assert [s.engine for s in r.splits] == ["e0", "e0"] and r.token_ids == engines.tokens(0, PROMPT, N, 4)
    assert r.started_over == [] and rollout.stats.tokens_regenerated == 0


async def test_a_cut_request_whose_failed_engine_stays_listed_waits_only_the_grace(monkeypatch):
    """The only engine fails the request and the daemon keeps it listed (the same incarnation:
    alive, or its death not seen): the request waits ORPHAN_GRACE_S for the daemon to act, not
    the whole request_timeout."""
    from vime.trainer import rollout as rollout_module
    monkeypatch.setattr(rollout_module, "ORPHAN_GRACE_S", 0.3)
    async with InProcessEngines([4], step_s=0.05) as engines:
        daemon = DaemonAnswers([engines.entry(0)], version=4, max_staleness=1)
        async with client(daemon, request_timeout=60.0) as rollout:
            task = await killed_mid_stream(rollout, engines)
            with pytest.raises(NoEngineAvailable, match="no other engine listed in"):
                await asyncio.wait_for(task, 20)  # well inside request_timeout


LONG = 32  # 1.6 s of stream: the publish is read and e0 makes tokens on v4 before it ends, even on a loaded CI


async def cut_after_an_update_it_was_not_told_of(rollout: RolloutClient, daemon: DaemonAnswers,
                                                 engines: InProcessEngines) -> asyncio.Future:
    """e0 and e1 at v3 (max_staleness 1), the request on e0; mid-stream e0 is updated to v4
    keeping the request (a keep-mode pause this client was not told of) and v4 is published
    (e0 listed at 4, e1 at 3); e0 dies after making tokens on v4. The request, running."""
    rollout.pick = first_on(rollout, "e0")
    task = asyncio.ensure_future(rollout.complete(PROMPT, max_tokens=LONG))
    await until(lambda: any(p.tokens >= 3 for p in rollout.progress().values()), timeout=10)
    engines.emulated[0].set_version("4")
    daemon.publish(4, [engines.entry(0, 4), engines.entry(1, 3)])
    await until(lambda: rollout.weight_version == 4, timeout=10)
    at_v4 = max(p.tokens for p in rollout.progress().values())
    await until(lambda: any(p.tokens >= at_v4 + 3 for p in rollout.progress().values()), timeout=10)
    engines.emulated[0].add_fault("die")
    return task


async def test_a_piece_cut_after_an_update_it_was_not_told_of_is_continued_at_the_listed_version():
    """(An outside review's case.) The cut piece is bracketed v3..v4 by e0's listing at the cut,
    so it is not continued on e1 at v3 (its versions would go back); e1 admits no new request
    either (one version behind, max_staleness 1): the request waits, and once e1 is moved up
    to v4 it is continued there, nothing regenerated."""
    async with InProcessEngines([3, 3], step_s=0.05) as engines:
        daemon = DaemonAnswers([engines.entry(0), engines.entry(1)], version=3, max_staleness=1)
        async with client(daemon) as rollout:
            task = await cut_after_an_update_it_was_not_told_of(rollout, daemon, engines)
            await until(lambda: rollout.stats.held_at_admission == 1, timeout=10)
            assert not task.done()
            engines.emulated[1].set_version("4")
            daemon.publish(4, [engines.entry(1, 4)])  # e0 dead; e1 updated and listed at v4
            r = await asyncio.wait_for(task, 30)
    first, last = r.splits
    assert (first.engine, first.weight_version, first.span, first.weight_version_end) == ("e0", 3, SPAN_BRACKET, 4)
    assert first.outcome == SERVER_ERROR and r.token_ids[:first.tokens] != engines.tokens(0, PROMPT, first.tokens, 3)
    assert last == Split("e1", 4, first.tokens, LONG - first.tokens, OK, span=SPAN_READ)
    assert r.token_ids[first.tokens:] == engines.tokens(1, PROMPT + r.token_ids[:first.tokens], last.tokens, 4)
    assert r.started_over == [] and rollout.stats.tokens_regenerated == 0


async def test_a_cut_request_no_engine_can_continue_or_admit_in_time_is_raised_saying_why():
    async with InProcessEngines([3, 3], step_s=0.05) as engines:
        daemon = DaemonAnswers([engines.entry(0), engines.entry(1)], version=3, max_staleness=1)
        async with client(daemon) as rollout:
            task = await cut_after_an_update_it_was_not_told_of(rollout, daemon, engines)
            rollout.request_timeout = 1.0  # the wait's bound from here (the streams had the default)
            with pytest.raises(NoEngineAvailable, match=r"e1 not admitted in 1s.*; not continued: no routable engine "
                                                         r"left at weight version 4 or newer to continue on"):
                await asyncio.wait_for(task, 30)
    assert (rollout.stats.held_at_admission, rollout.stats.failed) == (1, 1)


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


# -- admission: no new request where it could not finish inside the bound ----------------------

async def test_a_new_request_waits_for_an_engine_that_can_finish_it_inside_the_bound():
    """max_staleness 1, e0 one version behind the current one (routable, but a sample started on
    it is stale once the next version is published): the request is held at admission until
    e0 holds the current version, then runs there, counted."""
    async with InProcessEngines([3], step_s=0.01) as engines:
        daemon = DaemonAnswers([engines.entry(0)], version=4, max_staleness=1)
        async with client(daemon) as rollout:
            assert rollout._late() == {"e0"}
            task = asyncio.ensure_future(rollout.complete(PROMPT, max_tokens=N))
            await until(lambda: rollout.stats.held_at_admission == 1, timeout=10)
            await asyncio.sleep(0.2)
            assert not task.done() and rollout.stats.sent == 0
            engines.emulated[0].set_version("4")
            daemon.publish(4, [engines.entry(0, 4)])
            r = await asyncio.wait_for(task, 30)
    assert r.splits == [Split("e0", 4, 0, N, OK, span=SPAN_READ)]
    assert r.token_ids == engines.tokens(0, PROMPT, N, 4)
    st = rollout.stats
    assert (st.held_at_admission, st.sent, st.stale_samples) == (1, 1, 0) and st.admission_wait_ms >= 200


async def test_admission_admits_within_the_bound_and_ahead_of_the_current_version():
    """max_staleness 2: one version behind still finishes inside the bound after one more
    publish (admitted); two behind does not; a version pushed ahead of its publish does."""
    async with InProcessEngines([5, 4, 3, 6], step_s=0.0) as engines:
        daemon = DaemonAnswers([engines.entry(i) for i in range(4)], version=5, max_staleness=2)
        async with client(daemon) as rollout:
            assert rollout._late() == {"e2"}
    async with InProcessEngines([3], step_s=0.0) as engines:
        daemon = DaemonAnswers([engines.entry(0)], version=4, mode="sync")
        async with client(daemon) as rollout:
            assert rollout._late() == set()  # sync mode: a publish cuts and restarts, no admission


async def test_a_request_no_engine_admits_in_time_is_raised_saying_why():
    async with InProcessEngines([3], step_s=0.0) as engines:
        daemon = DaemonAnswers([engines.entry(0)], version=4, max_staleness=1)
        async with client(daemon, request_timeout=0.3) as rollout:
            with pytest.raises(NoEngineAvailable, match=r"e0 not admitted in 0.3s: a sample started there would "
                                                         r"be past max_staleness after the next publish"):
                await rollout.complete(PROMPT, max_tokens=N)
    assert (rollout.stats.held_at_admission, rollout.stats.sent, rollout.stats.failed) == (1, 0, 1)


async def test_a_cut_request_whose_prefix_is_past_the_bound_is_dropped_when_samples_are_dropped():
    """The prefix to continue holds tokens two versions behind (max_staleness 1): with
    stale_samples="drop" it is raised as StaleSample (not regenerated), its tokens counted."""
    async with InProcessEngines([3, 3], step_s=0.05) as engines:
        daemon = DaemonAnswers([engines.entry(0), engines.entry(1)], version=3, max_staleness=1)
        async with client(daemon, stale_samples="drop") as rollout:
            rollout.pick = first_on(rollout, "e0")
            task = asyncio.ensure_future(rollout.complete(PROMPT, max_tokens=N))
            await publish_during_the_stream(rollout, daemon, engines, [4, 5])
            engines.emulated[0].add_fault("die")
            with pytest.raises(StaleSample, match="the tokens so far include ones from 3") as ei:
                await asyncio.wait_for(task, 30)
    (piece,) = ei.value.splits
    assert (piece.engine, piece.weight_version) == ("e0", 3) and piece.tokens > 0
    st = rollout.stats
    assert (st.stale_samples, st.stale_tokens, st.stale_dropped_tokens) == (1, piece.tokens, piece.tokens)
    assert st.ledger() == {"tokens_discarded": piece.tokens, "stale_samples": 1, "held_at_admission": 0}


# -- each piece's version: the engine's own label, read around it ------------------------------

def test_piece_version_brackets_the_piece_with_the_engines_reads():
    from vime.trainer.rollout_types import SPAN_LISTED, SPAN_SENT, UNREAD, engine_label, piece_version

    assert piece_version(7, 3, 3) == (3, SPAN_READ, None)          # exact
    assert piece_version(7, None, None) == (None, SPAN_SENT, None)  # base weights both times: no bound after
    assert piece_version(7, 3, 5) == (3, SPAN_BRACKET, 5)          # updated while it ran (keep): 3..5
    assert piece_version(7, None, 1) == (None, SPAN_BRACKET, 1)    # base weights, then version 1
    assert piece_version(7, 3, "mine") == (3, SPAN_BRACKET, "mine")
    assert piece_version(7, 5, 3) == (5, SPAN_SENT, None)          # an older one after: another process
    assert piece_version(7, 3, UNREAD) == (3, SPAN_SENT, None)     # cut (aborted, died, hung): not asked again
    assert piece_version(7, UNREAD, 3) == (7, SPAN_LISTED, None)   # /weight_info not served
    assert [engine_label(x) for x in ("default", "12", "v2", "²", 12)] == [None, 12, "v2", "²", UNREAD]


async def test_a_burst_of_requests_shares_its_version_reads():
    async with InProcessEngines([3], step_s=0.0) as engines:
        daemon = DaemonAnswers([engines.entry(0)], version=3, max_staleness=1)
        async with client(daemon) as rollout:
            reads = 0
            real = rollout._read_weight_info

            async def counted(engine):
                nonlocal reads
                reads += 1
                return await real(engine)
            rollout._read_weight_info = counted
            results = await rollout.gather([PROMPT] * 16, max_tokens=4)
    assert all(r.splits == [Split("e0", 3, 0, 4, OK, span=SPAN_READ)] for r in results)
    assert reads < 16, reads


def test_a_cut_piece_split_at_a_keep_mark_is_exact_only_before_the_mark():
    """A piece cut after a keep-mode update this client was told of (a mark at token 4, the
    update's read said 4): before the mark exact at 3; after it no read bounds it from above
    but the listing at the cut (5: another update since), so a bracket 4..5; with the engine
    listed at 4, known from the mark's read alone (sent)."""
    from vime.trainer.rollout import KEPT
    from vime.trainer.rollout_types import SPAN_SENT, Engine

    rollout = RolloutClient(None)
    cut = Split("e0", 3, 0, 10, SERVER_ERROR, span=SPAN_SENT)
    for listed, tail in ((5, (SPAN_BRACKET, 5)), (4, (SPAN_SENT, None))):
        e0 = Engine("e0", "http://e0", weight_version=listed, incarnation=1)
        rollout.engines = [e0]
        rollout._kept["r"] = [(4, 4)]
        assert rollout._listing_bound(e0, rollout._kept_pieces("r", cut)) == [
            Split("e0", 3, 0, 4, KEPT, span=SPAN_READ),
            Split("e0", 4, 4, 6, SERVER_ERROR, kv_version=3, span=tail[0], weight_version_end=tail[1])]
