"""The goodput ledger's async rule (harness/goodput_ledger.py: async_sample): a sample is judged
per piece against what the emulated weights make (harness/emulated_model.generate, the emulated
engine's tokens as a pure function), token for token, whatever its splits report, and its oldest
piece against the staleness bound; the sync rule is unchanged."""

from __future__ import annotations

from vime.harness.emulated_model import generate
from vime.harness.goodput_ledger import Piece, RunRecord, Sample, account, async_sample, piece_made_by

CHOICES = list(range(3, 98))
PROMPT = [5, 9, 17, 33, 60, 7, 8, 12]


def make(ctx, n, v):
    return generate(list(ctx), n, v, CHOICES)


def continued(*parts: tuple[str, int]) -> list[int]:
    """An output made piece by piece, each (version label, tokens) from the prompt and the tokens
    before it: what an engine at that version continues from."""
    out: list[int] = []
    for v, n in parts:
        out += make(PROMPT + out, n, v)
    return out


def test_a_sample_continued_across_an_update_is_exact_and_within_the_bound():
    out = continued(("1", 5), ("2", 7))
    pieces = [Piece(0, 5, 1), Piece(5, 7, 2)]
    s = async_sample(PROMPT, out, pieces, make, current=2, max_staleness=1)
    assert s == Sample(1, 2, 1) and not s.stale
    # the same sample returned once version 3 is current: its oldest token is 2 versions behind
    assert async_sample(PROMPT, out, pieces, make, current=3, max_staleness=1).stale
    assert not async_sample(PROMPT, out, pieces, make, current=3, max_staleness=2).stale


def test_a_piece_whose_tokens_another_version_made_is_stale_whatever_it_claims():
    out = continued(("1", 5), ("1", 7))  # the second engine said 2 but kept version 1's weights
    s = async_sample(PROMPT, out, [Piece(0, 5, 1), Piece(5, 7, 2)], make, current=2, max_staleness=1)
    assert s.version == -1 and s.stale
    # one token off in the last piece is enough
    bad = out[:-1] + [out[-1] + 1 if out[-1] < 97 else 3]
    good = continued(("1", 5), ("2", 7))
    assert piece_made_by(PROMPT, good, Piece(5, 7, 2), make) == 2
    assert piece_made_by(PROMPT, good[:-1] + [bad[-1]], Piece(5, 7, 2), make) is None


def test_pieces_that_do_not_cover_the_output_in_order_or_claim_no_version_are_stale():
    out = continued(("1", 5), ("2", 7))
    for pieces in ([Piece(0, 5, 1)],                           # tokens no piece claims
                   [Piece(0, 5, 1), Piece(6, 6, 2)],           # a gap
                   [Piece(5, 7, 2), Piece(0, 5, 1)],           # out of order
                   [],                                         # no piece at all
                   [Piece(0, 5, None), Piece(5, 7, 2)],        # base weights: no version of the run
                   [Piece(0, 5, "1"), Piece(5, 7, 2)]):        # a label, not a version
        assert async_sample(PROMPT, out, pieces, make, current=2, max_staleness=1).stale, pieces


def test_a_bracket_piece_is_the_version_in_its_range_that_made_it():
    out = continued(("3", 6))
    assert piece_made_by(PROMPT, out, Piece(0, 6, 2, 4), make) == 3
    assert piece_made_by(PROMPT, out, Piece(0, 6, 1, 2), make) is None
    assert async_sample(PROMPT, out, [Piece(0, 6, 2, 4)], make, current=4, max_staleness=1) == Sample(3, 4, 1)


def test_the_sync_rule_and_the_counts_are_unchanged_and_async_samples_count_by_their_rule():
    assert Sample(2, 3).stale and not Sample(3, 3).stale  # sync: any version but the round's
    assert not Sample(2, 3, 1).stale and Sample(1, 3, 1).stale and Sample(-1, 1, 5).stale
    rec = RunRecord(policy="defaults-async", seed=0, target=1, launched_at=0.0, end=10.0, injections=(),
                    serving=(), samples=[Sample(2, 3, 1), Sample(1, 3, 1), Sample(-1, 3, 1), Sample(3, 3)],
                    stale_regenerated=4)
    g = account(rec)
    assert g.stale_samples == 2 and g.stale_regenerated == 4
    assert account(RunRecord(policy="d", seed=0, target=1, launched_at=0.0, end=1.0, injections=(),
                             serving=())).stale_regenerated == 0


def test_the_async_run_judges_a_result_by_its_splits_against_the_publish_before_its_return(tmp_path):
    """fleet_run.AsyncFleetRun._judge: the version current at a result's return is the one
    whose publish began last before it; a bracket split's range is passed on."""
    from types import SimpleNamespace

    from vime.harness.fleet_plan import Policy, Workload
    from vime.harness.fleet_run import AsyncFleetRun
    from vime.trainer.rollout_types import SPAN_BRACKET, SPAN_READ, Split

    run = AsyncFleetRun(Workload(engines=2), Policy("defaults-async", weights_mode="async"), [], 0, tmp_path)
    run.choices = CHOICES
    run.publishes = [(100.0, 1), (200.0, 2), (300.0, 3)]
    out = continued(("1", 4), ("2", 3))
    splits = [Split("e0", 1, 0, 4, "abort", span=SPAN_READ), Split("e1", 2, 4, 3, "ok", span=SPAN_READ)]

    def result(finished: float, sp=splits) -> SimpleNamespace:
        return SimpleNamespace(token_ids=out, splits=sp, finished=finished)
    assert run._judge(result(250.0), PROMPT) == Sample(1, 2, 1)
    assert run._judge(result(300.0), PROMPT).stale  # version 3's publish had begun: 1 is 2 behind
    bracket = [splits[0], Split("e1", 1, 4, 3, "ok", span=SPAN_BRACKET, weight_version_end=2)]
    assert run._judge(result(250.0, bracket), PROMPT) == Sample(1, 2, 1)
    listed_only = [splits[0], Split("e1", 1, 4, 3, "ok", weight_version_end=2)]  # not a bracket: 1 claimed
    assert run._judge(result(250.0, listed_only), PROMPT).stale
