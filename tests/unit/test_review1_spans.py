"""Defect demonstration (review1, for the lead): a continued sample goes back to older weights.
PROTOCOL STAND-INS, not vLLM: emulated engines in this process and a stand-in for the daemon's
answers (tests/support/standin_inproc.py). Strict xfail: it passes (and so fails the suite) once
the defect is fixed; then drop the marker."""

from __future__ import annotations

import asyncio

import pytest

from vime.trainer.rollout import OK, RolloutClient
from vime.trainer.rollout_types import SPAN_SENT

from support.polling import until
from support.standin_inproc import DaemonAnswers, InProcessEngines
from test_rollout_staleness import PROMPT, first_on

N = 16


@pytest.mark.xfail(strict=True, reason="rollout.py _made_on / rollout_types.piece_version: a piece cut by a death "
                                       "is `sent` at the version read before it, so its newest_version ignores an "
                                       "update that kept the request running; the continuation may go back to it")
async def test_a_piece_cut_after_a_keep_mode_update_is_not_continued_on_older_weights():
    """e0 (v3) takes the request; mid-stream e0 is updated to v4 keeping the request (pause
    keep) and v4 is published (e0 listed at v4, e1 still at v3, within max_staleness 1); then
    e0 fails mid-stream. The continuation must go to v4 or newer (docs/rollout.md: never back
    to older weights); it goes to e1 at v3, and the splits say every token is v3."""
    async with InProcessEngines([3, 3], step_s=0.05) as engines:
        daemon = DaemonAnswers([engines.entry(0), engines.entry(1)], version=3, max_staleness=1)
        async with RolloutClient(daemon, backoff_initial=0.001, backoff_max=0.01, refresh_interval=60.0) as rollout:
            rollout.pick = first_on(rollout, "e0")
            task = asyncio.ensure_future(rollout.complete(PROMPT, max_tokens=N))
            await until(lambda: any(p.tokens >= 3 for p in rollout.progress().values()), timeout=10)
            engines.emulated[0].set_version("4")  # the update that kept the request running
            daemon.publish(4, [engines.entry(0, 4), engines.entry(1, 3)])
            await until(lambda: rollout.weight_version == 4, timeout=10)
            at_v4 = max(p.tokens for p in rollout.progress().values())
            await until(lambda: any(p.tokens >= at_v4 + 3 for p in rollout.progress().values()), timeout=10)
            engines.emulated[0].add_fault("die")
            r = await asyncio.wait_for(task, 30)
    first, last = r.splits[0], r.splits[-1]
    assert first.engine == "e0" and first.span == SPAN_SENT and last.outcome == OK
    assert r.token_ids[:first.tokens] != engines.tokens(0, PROMPT, first.tokens, 3)  # e0 made some on v4
    assert last.weight_version is not None and last.weight_version >= 4, r.splits
